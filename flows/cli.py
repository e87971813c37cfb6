"""The `drafter` command line.

    drafter release -c configs/demo.yaml [--profile quick] [--set generate.num_prompts=64]
    drafter stage capture -c configs/demo.yaml          # one stage: the container entrypoint
    drafter plan -c configs/demo.yaml                   # stage keys and whether they are done
    drafter runs -c configs/demo.yaml [--json]          # stage table of the latest run
    drafter clean -c configs/demo.yaml [--dry-run]      # remove partial directories no process works on
    drafter heldout-sample -c configs/demo.yaml -t 1 -o heldout-t1.jsonl   # the held-out split re-sampled at T=1

Errors are one line, `error: …`, naming the file:line, key or value and what to do, and exit with
2 for bad input (config, prompt files, an unknown stage, permission or decode errors), 1 for any
other failure (a stage that failed, an inconsistent store); inside the release flow the stage's own error
decides, and the terminal shows no traceback: the error line names the log file that holds it. `release`, `stage` and `plan` run the
preflight checks (:mod:`drafter.data.preflight`) before any stage starts.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.table import Table

from drafter.core.config import ReleaseConfig, load_config
from drafter.core.errors import BadInputError, ConfigError, DrafterError
from drafter.core.pipeline import format_table, open_store, plan, run_stage
from drafter.evaluation.report import release_report
from drafter.core.store import Store
from flows.api_server import DEFAULT_STARTUP_TIMEOUT_S, TIMEOUT_ENV, exit_on_signals, prefect_api

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Release pipeline for speculative-decoding drafters.")
console = Console()

ConfigOpt = typer.Option(Path("configs/demo.yaml"), "--config", "-c", help="Release config (YAML).")
ProfileOpt = typer.Option(None, "--profile", "-p", help="Named profile from the config's `profiles:` block (e.g. quick).")
SetOpt = typer.Option(None, "--set", "-s", help="Override a field: section.field=value (repeatable).")
StoreOpt = typer.Option(None, "--store", help="Store root (local path or fsspec URL); overrides store.root.")


def _one_line(message: object) -> str:
    """A message as one line: a multi-line one (several invalid fields) joined with '; '."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    out = lines[0] if lines else ""
    for ln in lines[1:]:
        out += (" " if out.endswith(":") else "; ") + ln
    return out


def _fail(message: object, code: int) -> None:
    """Print `error: <one line>` to stderr and exit with ``code`` (no traceback)."""
    typer.echo(f"error: {_one_line(message)}", err=True)
    raise typer.Exit(code)


_BAD_INPUT = (ConfigError, BadInputError, PermissionError, UnicodeError)


def _exit_code(e: BaseException) -> int:
    """2 for bad input (config, prompt files, permission or decode errors), 1 for other failures.

    The original error decides: a wrapper that is neither one of the pipeline's errors nor bad input
    (the release flow's :class:`flows.release.ReleaseFailed`, a RuntimeError around the stage's error) is
    looked through along its explicit causes (``raise … from e``), as
    :func:`drafter.core.errors.is_permanent` walks them; the first pipeline error or bad input found decides.
    """
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, _BAD_INPUT):
            return 2
        if isinstance(cur, DrafterError):
            return 1
        cur = cur.__cause__
    return 1


def _cli_errors(fn):
    """Every command: the pipeline's errors, an unknown stage, OS, permission and decode errors
    become one `error: …` line and a non-zero exit instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DrafterError as e:
            _fail(e, _exit_code(e))
        except KeyError as e:  # drafter.stages / pipeline.plan: an unknown stage name
            msg = str(e.args[0]) if e.args else ""
            if not msg.startswith("unknown stage"):
                raise
            _fail(msg, 2)
        except UnicodeDecodeError as e:
            _fail(f"a file is not UTF-8 text ({e.reason} at byte {e.start}); save it as UTF-8", 2)
        except OSError as e:
            what = f"{e.filename}: " if e.filename else ""
            _fail(f"{what}{e.strerror or e}; check the path and its permissions", _exit_code(e))

    return wrapper


def _load(config: Path, profile: Optional[str], sets: Optional[list[str]], store: Optional[str], *,
          check: bool = False, stages: Optional[list[str]] = None, **preflight_kw) -> ReleaseConfig:
    """Load the config; with ``check``, run the preflight checks for ``stages`` (every error: one line)."""
    overrides = list(sets or [])
    if store:
        overrides.append(f"store.root={store}")
    try:
        cfg = load_config(config, profile=profile, overrides=overrides)
    except DrafterError as e:
        msg = _one_line(e)
        if msg.startswith("invalid config"):
            msg += f"; fix the field in {config} or with --set section.field=value"
        _fail(msg, 2)
    if check:
        from drafter.data.preflight import preflight

        preflight(cfg, stages or None, **preflight_kw)
    return cfg


class _NoTraceback(logging.Formatter):
    """The terminal's formatter during ``drafter release``: a record's message without its traceback
    (the record itself keeps it, for the log file and Prefect's database)."""

    def __init__(self, inner: logging.Formatter | None):
        super().__init__()
        self.inner = inner or logging.Formatter()

    def format(self, record: logging.LogRecord) -> str:
        if not (record.exc_info or record.exc_text or record.stack_info):
            return self.inner.format(record)
        bare = logging.makeLogRecord(record.__dict__)
        bare.exc_info = bare.exc_text = bare.stack_info = None
        return self.inner.format(bare)


def _release_log_path() -> Path | None:
    """``$PREFECT_HOME/drafter-logs/release-<UTC time>-<pid>.log`` (None where it cannot be created)."""
    from datetime import datetime, timezone

    from prefect.settings import PREFECT_HOME

    d = Path(PREFECT_HOME.value()).expanduser() / "drafter-logs"
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return d / f"release-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{os.getpid()}.log"


@contextlib.contextmanager
def _flow_log() -> Iterator[Path | None]:
    """While the release flow runs: every log record (Prefect's and the pipeline's, tracebacks included) also
    goes to a log file (:func:`_release_log_path`), and the terminal shows the records without their
    tracebacks, so that a failure ends in one `error: …` line. Yields the file's path (None if it could not be
    created); the file is removed when the block ends without an error (Prefect's database keeps the logs)."""
    root = logging.getLogger()
    from prefect.logging.handlers import PrefectConsoleHandler

    std = (sys.stderr, sys.stdout, sys.__stderr__, sys.__stdout__)
    consoles = [h for h in root.handlers if isinstance(h, PrefectConsoleHandler)
                or (type(h) is logging.StreamHandler and h.stream in std)]
    saved = [(h, h.formatter) for h in consoles]
    path = _release_log_path()
    fh = None
    if path is not None:
        try:
            fh = logging.FileHandler(path, encoding="utf-8", delay=True)
        except OSError:
            path = None
    if fh is not None:
        fh.setLevel(logging.INFO)
        fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s - %(message)s"))
        root.addHandler(fh)
    for h, fmt in saved:
        h.setFormatter(_NoTraceback(fmt))
    ok = False
    try:
        yield path
        ok = True
    finally:
        for h, fmt in saved:
            h.setFormatter(fmt)
        if fh is not None:
            root.removeHandler(fh)
            fh.close()
            if ok and path is not None:
                with contextlib.suppress(OSError):
                    path.unlink()


def _run_release(cfg: ReleaseConfig, stage: Optional[list[str]], prefect_startup_timeout: Optional[float]) -> dict:
    """Run the release flow; a failure inside it is one `error: …` line (the original error's message and exit
    code: 2 for bad input, also when a stage raised it) naming the log file that holds the traceback."""
    exit_on_signals()
    from flows.release import ReleaseFailed
    from flows.release import release as release_flow

    with _flow_log() as log_path:
        try:
            with prefect_api(prefect_startup_timeout):
                return release_flow(config=cfg, stages=stage)
        except typer.Exit:
            raise
        except Exception as e:  # noqa: BLE001 - every failure of the flow: one line, the traceback in the log
            message = _one_line(e) if isinstance(e, (DrafterError, ReleaseFailed)) else f"{type(e).__name__}: {_one_line(e)}"
            if log_path is not None and log_path.is_file() and log_path.stat().st_size:
                message += f" (the traceback: {log_path})"
            _fail(message, _exit_code(e))


StartupOpt = typer.Option(
    None, "--prefect-startup-timeout", metavar="SECONDS",
    help=f"Start-up limit of the local Prefect API server started when PREFECT_API_URL is not set "
         f"(default ${TIMEOUT_ENV}, else {DEFAULT_STARTUP_TIMEOUT_S:.0f}).")


@app.command()
@_cli_errors
def release(config: Path = ConfigOpt, profile: Optional[str] = ProfileOpt, set_: Optional[list[str]] = SetOpt,
            store: Optional[str] = StoreOpt,
            stage: Optional[list[str]] = typer.Option(None, "--stage", help="Run only these stages (and what they need)."),
            prefect_startup_timeout: Optional[float] = StartupOpt,
            ) -> None:
    """Run the release flow (Prefect: a local API server unless PREFECT_API_URL is set)."""
    cfg = _load(config, profile, set_, store, check=True, stages=stage)
    # the same config, profile, overrides and store, so that only `publish` is computed again
    send = shlex.join(["drafter", "publish", "-c", str(config), *(["--profile", profile] if profile else []),
                       *[a for s in set_ or [] for a in ("--set", s)], *(["--store", store] if store else []),
                       "--repo-id", cfg.publish.repo_id or "ORG/NAME"])
    _print_outputs(_run_release(cfg, stage, prefect_startup_timeout), send)


@app.command()
@_cli_errors
def publish(config: Path = ConfigOpt, profile: Optional[str] = ProfileOpt, set_: Optional[list[str]] = SetOpt,
            store: Optional[str] = StoreOpt,
            repo_id: Optional[str] = typer.Option(None, "--repo-id", metavar="ORG/NAME", help="Hub repo (default: publish.repo_id)."),
            mode: Optional[str] = typer.Option(None, "--mode", help="commit | pr (default: publish.mode)."),
            dry_run: bool = typer.Option(False, "--dry-run", help="Only build the release folder and the plan."),
            prefect_startup_timeout: Optional[float] = StartupOpt,
            ) -> None:
    """Publish the release to the Hub: the release flow up to `publish` (finished stages are reused), sending
    the release folder unless --dry-run. The token is read from $HF_TOKEN (publish.token_env)."""
    sets = list(set_ or []) + [f"publish.dry_run={'true' if dry_run else 'false'}"]
    if repo_id:
        sets.append(f"publish.repo_id={repo_id}")
    if mode:
        sets.append(f"publish.mode={mode}")
    cfg = _load(config, profile, sets, store, check=True, stages=["publish"])
    _print_outputs(_run_release(cfg, ["publish"], prefect_startup_timeout))


def _print_outputs(summary: dict, send_cmd: str | None = None) -> None:
    console.print()
    t = Table(title=f"release {summary['release']} — run {summary['run_id']}")
    t.add_column("stage")
    t.add_column("status")
    t.add_column("output", overflow="fold")  # full paths, folded rather than cut
    for s in summary["stages"]:
        t.add_row(s["stage"], s["status"], s["path"])
    console.print(t)
    if summary["computed"]:
        console.print(f"computed: {', '.join(summary['computed'])}")
    else:
        console.print("[green]nothing recomputed[/green]: every stage output was already in the store")
    console.print(f"run summary: {summary.get('summary_path')}")
    for s in summary["stages"]:
        table = Path(s["path"]) / "table.md"
        if s["status"] in ("computed", "reused") and table.is_file():
            console.print(f"\n[bold]{s['stage']}[/bold]: held-out acceptance (τ = mean accepted tokens per step, incl. the bonus token)")
            console.print(table.read_text(), markup=False, highlight=False)
    report = release_report(summary)
    if report:
        console.print("\n[bold]release report[/bold]")
        console.print(report, markup=False, highlight=False)
    _print_publish(summary, send_cmd)


def _print_publish(summary: dict, send_cmd: str | None = None) -> None:
    """The card's path and the publish plan (or what was published)."""
    s = next((s for s in summary["stages"] if s["stage"] == "publish" and s["status"] in ("computed", "reused")), None)
    if s is None:
        return
    out = Path(s["path"])
    try:
        plan = json.loads((out / "publish-plan.json").read_text())
        result = json.loads((out / "publish.json").read_text())
    except (OSError, ValueError):
        return
    console.print(f"\n[bold]model card[/bold]: {out / 'release' / 'README.md'}", highlight=False)
    console.print(f"[bold]publish plan[/bold]: {out / 'publish-plan.json'}", highlight=False)
    tag = f", tag {plan['tag']}{' at merge' if plan.get('tag_at') == 'merge' else ''}" if plan.get("tag") else ""
    t = Table(title=f"release {plan['release_id']} → {plan['repo_id']} ({plan['mode']} on {plan['branch']}{tag}): "
                    f"{len(plan['files'])} files, {plan['total_bytes']:,} bytes")
    t.add_column("file", overflow="fold")
    t.add_column("bytes", justify="right")
    t.add_column("sha256 (full in the plan)")
    for f in plan["files"]:
        t.add_row(f["path"], f"{f['size']:,}", f["sha256"][:16] + "…")
    console.print(t)
    if result.get("status") == "dry_run":
        console.print(f"dry run: nothing sent. Send it with: {send_cmd or result.get('send')} (a write token in $HF_TOKEN)",
                      markup=False, highlight=False)
        if plan.get("tag_note"):  # PR mode: the tag waits for the merge (and the command that creates it then)
            console.print(plan["tag_note"], markup=False, highlight=False, soft_wrap=True)
    else:
        where = result.get("pr_url") or result.get("commit_url") or result.get("commit_sha")
        console.print(f"{result['status']}: {where}" + (f" (tag {result['tag']})" if result.get("tag") else ""),
                      markup=False, highlight=False)
        if result.get("tag_pending"):  # PR mode, not merged yet: no tag on refs/pr/N
            console.print(result.get("tag_note") or f"tag {result['tag_pending']} waits for the merge: "
                          f"{result.get('tag_command')}", markup=False, highlight=False, soft_wrap=True)


@app.command("stage")
@_cli_errors
def stage_cmd(name: str = typer.Argument(..., help="Stage name, e.g. capture."), config: Path = ConfigOpt,
              profile: Optional[str] = ProfileOpt, set_: Optional[list[str]] = SetOpt, store: Optional[str] = StoreOpt) -> None:
    """Run one stage without Prefect (inputs must be in the store): the container entrypoint."""
    cfg = _load(config, profile, set_, store, check=True, stages=[name], single=True, stages_source="the stage name")
    exit_on_signals()
    try:
        result = run_stage(cfg, name)
    except KeyError as e:
        _fail(e.args[0], 2)
    except DrafterError as e:
        _fail(e, _exit_code(e))
    console.print(result.line())
    console.print_json(json.dumps(result.metrics, default=str))


@app.command("heldout-sample")
@_cli_errors
def heldout_sample_cmd(out: Path = typer.Option(..., "--out", "-o", help="The held-out file to write (JSONL)."),
                       temperature: float = typer.Option(1.0, "--temperature", "-t", help="Sampling temperature."),
                       config: Path = ConfigOpt, profile: Optional[str] = ProfileOpt,
                       set_: Optional[list[str]] = SetOpt, store: Optional[str] = StoreOpt) -> None:
    """Regenerate the built-in held-out conversations at a temperature with the served target into a
    held-out file: `--set heldout.files='["FILE"]'` then measures offline T>0 acceptance on text the
    target sampled at that temperature, as a live replay does (no Prefect; prepare_target from the store
    or computed)."""
    import shutil

    from drafter.data.heldout import resample_heldout
    from drafter.models.target import target_dir

    cfg = _load(config, profile, set_, store)
    if out.suffix != ".jsonl":
        _fail(f"--out {out}: the held-out file is written as JSONL; give it a .jsonl name", 2)
    exit_on_signals()
    work = out.with_name(out.name + ".parts")  # the generation's shards: a retry resumes from them
    try:
        pt = run_stage(cfg, "prepare_target")
        res = resample_heldout(cfg, target_dir(Path(pt.path)), out,
                               temperature=temperature, work_dir=work, log=console.print)
    except DrafterError as e:
        _fail(e, _exit_code(e))
    shutil.rmtree(work, ignore_errors=True)
    console.print(f"{res['conversations']} conversations, {res['requests']} turns, {res['tokens_generated']} tokens "
                  f"at T={temperature:g} ({res['tok_per_s']} tok/s) → {out}")
    console.print(f"measure on it: drafter stage eval_offline -c {config} --set 'heldout.files=[\"{out}\"]'")


@app.command("plan")
@_cli_errors
def plan_cmd(config: Path = ConfigOpt, profile: Optional[str] = ProfileOpt, set_: Optional[list[str]] = SetOpt,
             store: Optional[str] = StoreOpt,
             gpu_memory: str = typer.Option("80GiB", "--gpu-memory", help="Memory of one GPU for the memory plan "
                                            "(e.g. 80GiB for an A100/H100, 141GiB for an H200)."),
             target_config: Optional[Path] = typer.Option(None, "--target-config", help="The target's config.json "
                                                          "for the memory plan (default: the store's prepare_target "
                                                          "output, else configs/targets/)."),
             ) -> None:
    """Show every stage's key and whether its output is already in the store; list leftover
    partial directories that belong to no planned key (`drafter clean` removes them). Then the GPU
    memory one training step needs (drafter/training/memory.py), computed without weights."""
    from drafter.core.errors import StoreError
    from drafter.data.preflight import preflight
    from drafter.training import memory

    try:
        gpu_bytes = memory.parse_size(gpu_memory)
    except ValueError as e:
        _fail(f"--gpu-memory: {e}", 2)
    cfg = _load(config, profile, set_, store)
    try:
        st = open_store(cfg)
    except StoreError as e:  # a store root that cannot be a store: bad input, as preflight says it
        raise ConfigError(str(e)) from None
    if st.local:  # the checks first: a bad config is one line before any table
        preflight(cfg, None, check_outputs=False, check_lengths=False)
    planned = plan(cfg)
    unreachable = None
    if not st.local:  # a remote store without credentials or network: the stage plan without states, and why
        try:
            st.check_access()  # one bounded request; StoreAccessError says what is wrong in one line
        except DrafterError as e:
            unreachable = _one_line(e)
        except Exception as e:  # noqa: BLE001 - anything else fsspec raises: its type and first line
            unreachable = f"{type(e).__name__}: {_one_line(e)[:200]}"
        if unreachable is None:
            preflight(cfg, None, check_outputs=False, check_lengths=False)
    t = Table(title=f"plan for {cfg.name} (store {cfg.store.root})")
    for col in ("stage", "key", "state", "output"):
        t.add_column(col)
    target_art = None
    for p in planned:
        if unreachable is not None:
            state = "unknown (store unreachable)"
        else:
            try:
                art = st.find(p.stage.name, p.key)
                state = "done" if art else ("partial (will resume)" if st.partial_dir(p.stage.name, p.key).is_dir() else "to compute")
                if art is not None and p.stage.name == "prepare_target":
                    target_art = art
            except DrafterError as e:
                state = f"[red]corrupt: {e}[/red]"
        t.add_row(p.stage.name, p.key, state, st.location(p.stage.name, p.key))
    console.print(t)
    if unreachable is not None:
        typer.echo(f"store {cfg.store.root} unreachable ({unreachable}): stage states and the preflight checks "
                   "skipped; give the store's credentials, or --store DIR for a local store")
    else:
        keys = {(p.stage.name, p.key) for p in planned}
        leftover = [d for d in st.partials() if st.partial_owner(d) not in keys]
        if leftover:
            typer.echo(f"{len(leftover)} leftover partial director{'y' if len(leftover) == 1 else 'ies'} of no planned "
                       "key (an interrupted run with another config); `drafter clean` removes them:")
            for d in leftover:
                busy = " (in use by a running process)" if st.partial_in_use(*st.partial_owner(d)) else ""
                typer.echo(f"  {d}{busy}")
    _print_memory_plan(cfg, target_art, target_config, gpu_bytes)


def _print_memory_plan(cfg: ReleaseConfig, target_art, target_config: Optional[Path], gpu_bytes: int) -> None:
    """The memory plan of ``drafter plan``: one column with the frozen weights in float32 (today), one in bfloat16."""
    from drafter.training import memory

    GiB = memory.GiB
    if target_config is not None:
        tc = memory.read_target_config(target_config)
    elif target_art is not None:
        from drafter.models.target import target_dir

        tc = memory.read_target_config(target_dir(target_art) / "config.json",
                                       f"the store's prepare_target output ({target_dir(target_art) / 'config.json'})")
    else:
        tc = memory.shipped_target_config(cfg.prepare_target.hub_id)
    if tc is None:
        typer.echo("memory plan: no config.json of the target (prepare_target is not in the store and configs/targets/ "
                   "has no facts for it): run `drafter stage prepare_target` first, or pass --target-config FILE")
        return
    try:
        plans = [memory.plan_for_config(cfg, tc, frozen_dtype=d, gpu_memory=gpu_bytes) for d in ("float32", "bfloat16")]
    except ValueError as e:
        typer.echo(f"memory plan: {e}")
        return
    p32, p16 = plans
    d, pc = p32.drafter, p32.drafter.params
    typer.echo(f"\nmemory plan: {d.name}; dims from {p32.dims_source}")
    shared = f", {pc.shared_with_target / 1e9:.2f} B shared with the target" if pc.shared_with_target else ""
    typer.echo(f"parameters: {pc.total:,} ({pc.total / 1e9:.2f} B) total, {pc.routed_experts:,} "
               f"({pc.routed_experts / 1e9:.2f} B) routed experts{shared}; trainable under train.freeze: "
               f"{pc.trainable:,} ({pc.trainable / 1e6:.0f} M), frozen {pc.frozen:,}")
    step = (f"{cfg.dspark.anchors} anchors × block {cfg.dspark.block_size} per window {p32.window}"
            if d.kind == "dspark_v41" else f"window {p32.window}, K = {p32.k_steps} unrolled steps")
    typer.echo(f"GPU memory of one training step per rank ({cfg.train.loss}, {step}, compute {p32.compute_dtype}, "
               f"loss over {p32.loss_vocab:,} tokens), GiB:")
    w = max(len(ln.what) for ln in p32.lines)
    typer.echo(f"  {'':{w}}  {'frozen f32':>10}  {'frozen bf16':>11}  formula (frozen float32 = today)")
    by16 = {ln.what.replace("(bfloat16)", "(float32)"): ln for ln in p16.lines}
    for ln in p32.lines:
        other = by16.get(ln.what)
        typer.echo(f"  {ln.what:{w}}  {ln.bytes / GiB:10.2f}  {(f'{other.bytes / GiB:.2f}' if other else '—'):>11}  {ln.formula}")
    typer.echo(f"  {'total':{w}}  {p32.total / GiB:10.2f}  {p16.total / GiB:11.2f}")
    for name, pl in (("frozen float32 (today)", p32), ("frozen bfloat16", p16)):
        gpu = f"{gpu_bytes / GiB:g} GiB GPU ({pl.usable / GiB:.1f} GiB usable)"
        if pl.fits_one_gpu:
            verdict = (f"fits one {gpu}; train.nproc_per_node {cfg.train.nproc_per_node} = "
                       f"{cfg.train.nproc_per_node} such GPUs, each a full replica")
        else:
            n = pl.gpus_sharded
            shard = (f"{n} GPUs with weights, gradients and AdamW state sharded (FSDP / expert parallel; the train "
                     "stage does not shard today)" if n else "not even sharded: activations and logits alone exceed it")
            verdict = f"does NOT fit one {gpu}; {shard}"
        typer.echo(f"{name}: {pl.total / GiB:.1f} GiB per rank — {verdict}")
    typer.echo("assumptions: " + "; ".join(p32.assumptions))


@app.command()
@_cli_errors
def clean(config: Path = ConfigOpt, profile: Optional[str] = ProfileOpt, set_: Optional[list[str]] = SetOpt,
          store: Optional[str] = StoreOpt,
          orphans: bool = typer.Option(False, "--orphans", help="Keep the partial directories of this config's planned "
                                       "keys (a rerun resumes from them); remove only the others."),
          dry_run: bool = typer.Option(False, "--dry-run", help="Only list what would be removed.")) -> None:
    """Remove `.partial` directories that no process is working on (their lock is free).

    A partial directory holds a failed or interrupted stage's checkpoints; a rerun of the same key
    resumes from it, so remove it only when that run is abandoned (--orphans keeps this config's).
    """
    if store is not None or config.is_file():
        cfg = _load(config, profile, set_, store)
    else:
        cfg = ReleaseConfig()
    st = open_store(cfg)
    keep = {(p.stage.name, p.key) for p in plan(cfg)} if orphans else set()
    removed, busy = st.remove_partials(keep=keep, dry_run=dry_run)
    for d in removed:
        typer.echo(f"{'would remove' if dry_run else 'removed'} {d}")
    for d in busy:
        typer.echo(f"kept {d}: a running process holds its lock")
    if not removed and not busy:
        typer.echo(f"no partial directories to remove in store {st.root_url}")


@app.command()
@_cli_errors
def runs(config: Path = ConfigOpt, store: Optional[str] = StoreOpt,
         as_json: bool = typer.Option(False, "--json", help="Print the latest run's summary as JSON (for automation)."),
         all_: bool = typer.Option(False, "--all", help="List every run, not only the latest.")) -> None:
    """The stage table of the latest run (key, status, time, metrics).

    A run summary that cannot be read or has the wrong shape is skipped with one `warning:` line on
    stderr (its path and what is wrong); the good ones are listed. Exit 1 when no summary is left
    (none recorded, or every one skipped: then stderr says how many were skipped)."""
    root = store
    cache = "~/.cache/drafter-release/store"
    if root is None:
        if config.is_file():
            cfg = _load(config, None, None, None)
            root, cache = cfg.store.root, cfg.store.cache_dir
        else:
            root = "store"
    skipped: list[str] = []

    def warn(msg: str) -> None:
        skipped.append(msg)
        typer.echo(f"warning: {msg}", err=True)

    history = Store(root, cache).runs(warn=warn)
    if not history:
        if skipped:
            typer.echo(f"no runs recorded in store {root} that can be read: {len(skipped)} run "
                       f"{'summary' if len(skipped) == 1 else 'summaries'} skipped (the warnings above say why)",
                       err=True)
        else:
            console.print(f"no runs recorded in store {root}")
        raise typer.Exit(1)
    latest = history[-1]
    if as_json:
        sys.stdout.write(json.dumps(latest, indent=2, default=str) + "\n")
        return
    if all_:
        t = Table(title=f"runs in {root}")
        for col in ("run", "status", "started", "computed", "reused"):
            t.add_column(col)
        for r in history:
            t.add_row(r["run_id"], r["status"], r["started_at"], ", ".join(r["computed"]), ", ".join(r["reused"]))
        console.print(t)
    console.print(f"latest run {latest['run_id']} ({latest['status']}):")
    console.print(format_table(latest), highlight=False, markup=False)


def stage_main() -> None:
    """`python -m tasks <stage> --config C --store S`: same as `drafter stage`."""
    argv = sys.argv[1:]
    sys.argv = [sys.argv[0], "stage", *argv]
    app()


def main() -> None:  # pragma: no cover - console script
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    app()
