"""The A/B plan: which turns are replayed, which draft sampling methods run at which temperature on this
engine, the servers of one round and the settings they share (see :mod:`drafter.evaluation.ab_live`)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from drafter.core.errors import StageError
from drafter.data.replay import REPLAY_DOMAIN, ReplayTurn, replay_turns  # noqa: F401 - part of the plan

if TYPE_CHECKING:
    from drafter.core.config import AbLiveConfig, ServingConfig

DRAFTERS = ("none", "baseline", "candidate")

# --------------------------------------------------------------------------- engine facts


def speculative_config(c: "AbLiveConfig", draft_sample_method: str | None, *, engine_has_field: bool = True) -> dict | None:
    """vLLM's ``--speculative-config`` for a drafter: None for no speculation.

    ``draft_sample_method`` is left out for an engine without that setting (it drafts greedily and
    would reject the unknown key).
    """
    if draft_sample_method is None:
        return None
    spec = {"method": c.method, "num_speculative_tokens": c.num_speculative_tokens}
    return spec | {"draft_sample_method": draft_sample_method} if engine_has_field else spec


_PROBE = r"""
import ast, importlib.util, json, os, sys
out = {"methods": None, "why": None}
spec = importlib.util.find_spec("vllm")
if spec is None or not spec.submodule_search_locations:
    out["why"] = "vllm is not installed in this environment"
else:
    src = os.path.join(list(spec.submodule_search_locations)[0], "config", "speculative.py")
    try:
        tree = ast.parse(open(src).read())
    except OSError as e:
        tree, out["why"] = None, f"cannot read {src}: {e}"
    if tree is not None:
        aliases = {}
        for n in tree.body:
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                aliases[n.targets[0].id] = n.value
        ann = None
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef) and n.name == "SpeculativeConfig":
                for b in n.body:
                    if isinstance(b, ast.AnnAssign) and getattr(b.target, "id", None) == "draft_sample_method":
                        ann = b.annotation
        if ann is None:
            out["why"] = f"SpeculativeConfig in {src} has no draft_sample_method field"
        else:
            if isinstance(ann, ast.Name):
                ann = aliases.get(ann.id, ann)
            vals = [c.value for c in ast.walk(ann) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
            out["methods"] = vals or None
            if not vals:
                out["why"] = f"cannot read the values of draft_sample_method in {src}"
print(json.dumps(out))
"""


def engine_draft_sample_methods(python: str | Path, timeout: float = 60.0) -> tuple[list[str] | None, str | None]:
    """``(methods, why)``: the ``draft_sample_method`` values the serving env's vLLM accepts.

    Read from ``vllm/config/speculative.py`` (the ``SpeculativeConfig`` field and its ``Literal``)
    with ``ast``, without importing vLLM (that takes ~10 s). ``methods`` is None when the field is
    absent (such an engine drafts greedily only); ``why`` then says what was found.
    """
    r = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        return None, f"probing vLLM with {python} failed: {(r.stderr or r.stdout).strip()[-300:]}"
    d = json.loads(r.stdout.strip().splitlines()[-1])
    return d["methods"], d["why"]


def plan_draft_methods(wanted: list[str], engine_methods: list[str] | None, why: str | None,
                       temperature: float, engine_version: str) -> tuple[list[str], dict[str, str]]:
    """``(run, unsupported)``: the configured draft sampling methods to measure, and why the others are not.

    An engine without the ``draft_sample_method`` field drafts greedily: ``greedy`` runs, anything
    else is unsupported. At temperature 0 vLLM drafts greedily whatever the method (its proposer
    samples only when some request is not greedy), so ``probabilistic`` would repeat ``greedy``.
    """
    run: list[str] = []
    unsupported: dict[str, str] = {}
    for m in dict.fromkeys(wanted):
        if engine_methods is None:
            if m == "greedy":
                run.append(m)
            else:
                unsupported[m] = f"vLLM {engine_version} has no draft_sample_method setting ({why}); it drafts greedily"
        elif m not in engine_methods:
            unsupported[m] = (f"vLLM {engine_version} accepts draft_sample_method in {engine_methods}, not {m!r}")
        elif m != "greedy" and temperature == 0:
            unsupported[m] = (f"at temperature 0 vLLM {engine_version} drafts greedily with any draft_sample_method "
                              f"(the proposer samples only for non-greedy requests), so {m!r} equals 'greedy'; "
                              f"add a temperature > 0 to ab_live.temperature to measure it")
        else:
            run.append(m)
    if not run:
        raise StageError(f"ab_live.draft_sample_methods={wanted}: none can run on vLLM {engine_version} at temperature "
                         f"{temperature:g}: {unsupported}")
    return run, unsupported


def plan_matrix(wanted: list[str], engine_methods: list[str] | None, why: str | None, temperatures: list[float],
                engine_version: str) -> tuple[dict[float, list[str]], dict[str, str]]:
    """``(plan, unsupported)``: per temperature the draft sampling methods to measure there
    (:func:`plan_draft_methods` at each), and why the others are not — keyed by the method where it runs at
    no temperature, by ``<method> at T=<t>`` where it runs at some temperatures only.

    Example: temperatures [0, 1], methods [greedy, probabilistic] on vLLM 0.32 →
    ``({0.0: ["greedy"], 1.0: ["greedy", "probabilistic"]}, {"probabilistic at T=0": "at temperature 0 …"})``.
    """
    plan: dict[float, list[str]] = {}
    why_not: dict[str, dict[float, str]] = {}
    for t in sorted(temperatures):
        plan[t], unsupported = plan_draft_methods(wanted, engine_methods, why, t, engine_version)
        for m, reason in unsupported.items():
            why_not.setdefault(m, {})[t] = reason
    out: dict[str, str] = {}
    for m, by_t in why_not.items():
        if len(by_t) == len(plan):  # measured at no temperature
            out[m] = "; ".join(dict.fromkeys(by_t.values()))
        else:
            out |= {f"{m} at T={t:g}": reason for t, reason in by_t.items()}
    return plan, out


def ab_servers(plan: dict[float, list[str]], drafts_first: bool = False, baseline_at: str = "all",
               sweep: list[str] = ()) -> list[tuple[str, str | None, list[float]]]:
    """One round: ``(drafter, draft sample method, temperatures)`` per server, in the fixed A B order.

    No speculation is one server, measured at every temperature; each drafter has one server per draft
    sampling method (a server setting), measured at the temperatures (a request parameter) where ``plan``
    runs that method. ``baseline_at="gate"`` (``ab_live.baseline_at``) keeps the baseline to the gate's
    measurement only (:func:`primary_of` the plan).
    ``drafts_first`` (DSpark) starts with the speculative servers, so an engine that refuses the method
    says so at once. ``sweep``: the fine-tuned drafter's servers at the sweep's other Ks
    (:func:`~drafter.evaluation.ab_live.sweep.sweep_name`), measured at the gate's measurement only, after it.
    """
    if baseline_at not in ("all", "gate"):
        raise ValueError(f"baseline_at={baseline_at!r}: expected 'all' or 'gate'")
    temps = sorted(plan)
    methods = list(dict.fromkeys(m for t in temps for m in plan[t]))
    spec = [(d, m, [t for t in temps if m in plan[t]]) for d in ("baseline", "candidate") for m in methods]
    if baseline_at == "gate" and temps:
        t0, m0 = primary_of(plan)
        spec = [(d, m, [t0] if d == "baseline" else ts) for d, m, ts in spec if d != "baseline" or m == m0]
    if sweep and temps:
        t0, m0 = primary_of(plan)
        spec += [(name, m0, [t0]) for name in sweep]
    none = [("none", None, temps)]
    return spec + none if drafts_first else none + spec


def ab_serving(serving: "ServingConfig", server_args: list[str], compiled: bool | None = None) -> "ServingConfig":
    """The settings every server of an A/B runs with: ``serving`` plus ``server_args`` (``ab_live.server_args``),
    compiled or eager as ``compiled`` says (``ab_live.compiled``; None keeps ``serving.enforce_eager``). A vLLM CPU
    subprocess also gets :func:`drafter.serving.server.cpu_server_env` from ``serve`` itself, as every server does."""
    eager = serving.enforce_eager if compiled is None else not compiled
    return serving.model_copy(update={"extra_args": [*serving.extra_args, *server_args], "enforce_eager": eager})


def compile_mode(compiled: bool | None) -> str:
    """How the A/B's servers ran, in words (ab_live.json's ``compiled``; None: an output that did not record it)."""
    if compiled is None:
        return "eager or compiled: not recorded"
    return "compiled (CUDA graphs / torch.compile)" if compiled else "eager (--enforce-eager: no graph capture)"



def primary_of(plan: dict[float, list[str]]) -> tuple[float, str]:
    """``(temperature, method)`` of the primary measurement of a temperature → draft sampling methods plan: the
    lowest temperature, greedy drafts when planned there (else its first method)."""
    t = min(plan)
    methods = plan[t] or ["greedy"]
    return t, "greedy" if "greedy" in methods else methods[0]

