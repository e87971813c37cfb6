"""Planning and running stages against the store (no Prefect here; :mod:`drafter_prefect` wraps this).

Every stage key is computable from the config alone (key = hash(stage, version, its config
sections, the keys of its inputs)), so the whole plan is known before anything runs.

Example::

    cfg = load_config("configs/demo.yaml")
    for p in plan(cfg):
        result = run_stage(cfg, p.stage.name)
        print(result.line())
"""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from drafter.core import registry
from drafter.core.config import ReleaseConfig
from drafter.core.errors import ConfigError, StoreError
from drafter.core.urls import redact_url
from drafter.core.stage import Artifact, Metrics, Stage, key_config, stage_key
from drafter.core.store import Store


@dataclass(frozen=True)
class PlannedStage:
    stage: Stage
    key: str
    input_keys: dict[str, str]


@dataclass
class StageResult:
    stage: str
    key: str
    status: str  # computed | reused | skipped | failed
    path: str
    metrics: Metrics = field(default_factory=dict)
    seconds: float = 0.0  # wall time of this call
    compute_seconds: float = 0.0  # time the output originally took to compute
    reason: str | None = None

    def line(self) -> str:
        what = {
            "computed": f"computed in {self.seconds:.1f} s",
            "reused": f"reused (nothing recomputed; computed earlier in {self.compute_seconds:.1f} s)",
            "skipped": f"skipped: {self.reason}",
            "failed": f"FAILED: {self.reason}",
        }[self.status]
        return f"{self.stage:<15} {self.key}  {what}  → {self.path}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def open_store(cfg: ReleaseConfig) -> Store:
    return Store(cfg.store.root, cfg.store.cache_dir)


def with_inputs(wanted: list[str] | None, cfg: ReleaseConfig | None = None) -> list[str]:
    """``wanted`` and every stage they need, in pipeline order (all stages when ``wanted`` is empty);
    an unknown name raises KeyError. With ``cfg``, a stage it does not enable (:meth:`Stage.is_enabled`) is left out."""
    all_stages = {s.name: s for s in registry.all_stages()}
    on = {n: cfg is None or s.is_enabled(cfg) for n, s in all_stages.items()}
    if not wanted:
        return [n for n in registry.ORDER if on[n]]
    unknown = [w for w in wanted if w not in all_stages]
    if unknown:
        raise KeyError(f"unknown stage(s) {unknown}; stages are: {', '.join(registry.ORDER)}")
    needed: set[str] = set()
    todo = list(wanted)
    while todo:
        n = todo.pop()
        if n not in needed:
            needed.add(n)
            todo.extend(all_stages[n].inputs)
    return [n for n in registry.ORDER if n in needed and on[n]]


def plan(cfg: ReleaseConfig, only: list[str] | None = None) -> list[PlannedStage]:
    """Stages to run, in pipeline order, with their keys. ``only`` (or ``cfg.stages``) selects
    stages; everything they need is included."""
    wanted = only if only is not None else cfg.stages
    all_stages = {s.name: s for s in registry.all_stages()}
    needed = set(with_inputs(wanted, cfg))
    keys: dict[str, str] = {}
    out = []
    for name in registry.ORDER:
        st = all_stages[name]
        ik = {i: keys[i] for i in st.inputs if i in keys}
        if not st.is_enabled(cfg):
            continue  # not planned; the stages reading it go without it
        keys[name] = stage_key(st, cfg, ik)
        if name in needed:
            out.append(PlannedStage(st, keys[name], ik))
    return out


def planned_stage(cfg: ReleaseConfig, name: str) -> PlannedStage:
    for p in plan(cfg, only=[name]):
        if p.stage.name == name:
            return p
    if name in registry.ORDER:  # a stage this config does not enable (Stage.enabled)
        raise ConfigError(f"stage {name!r} has nothing to do with this config, so it is not planned: "
                          f"{registry.get(name).description}")
    raise KeyError(name)


def load_inputs(store: Store, p: PlannedStage) -> dict[str, Artifact]:
    inputs = {}
    for name, key in p.input_keys.items():
        art = store.find(name, key)
        if art is None:
            raise StoreError(
                f"stage {p.stage.name} needs the output of {name} (key {key}), which is not in the store "
                f"{store.root_url}; run `drafter stage {name}` (or the whole release) first"
            )
        inputs[name] = art
    return inputs


def run_stage(cfg: ReleaseConfig, name: str, store: Store | None = None) -> StageResult:
    """Reuse the finished output of stage ``name`` or compute it (inputs must be in the store). A stage the config
    does not enable (:attr:`Stage.enabled`) raises :class:`ConfigError`."""
    store = store or open_store(cfg)
    p = planned_stage(cfg, name)
    t0 = time.monotonic()
    found = store.find(name, p.key)
    if found is not None:
        return StageResult(name, p.key, "reused", str(found.path), found.metrics, time.monotonic() - t0,
                           found.manifest.get("seconds", 0.0), found.manifest.get("reason"))
    inputs = load_inputs(store, p)
    meta = {
        "version": p.stage.version,
        "config": key_config(p.stage, cfg),  # operational fields and secrets left out, as in the key
        "inputs": p.input_keys,
    }
    art, computed = store.produce(name, p.key, lambda out: p.stage.run(cfg, inputs, out), meta)
    status = "skipped" if art.status == "skipped" else ("computed" if computed else "reused")
    return StageResult(name, p.key, status, str(art.path), art.metrics, time.monotonic() - t0,
                       art.manifest.get("seconds", 0.0), art.manifest.get("reason"))


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]


def summarize(cfg: ReleaseConfig, run_id: str, started_at: str, results: list[StageResult],
              status: str, error: str | None = None) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "release": cfg.name,
        "store": redact_url(cfg.store.root),  # an fsspec URL may carry credentials
        "status": status,
        "error": error,
        "started_at": started_at,
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "stages": [r.to_dict() for r in results],
        "computed": [r.stage for r in results if r.status == "computed"],
        "reused": [r.stage for r in results if r.status == "reused"],
    }


Runner = Callable[[PlannedStage], StageResult]


@dataclass
class RunOutcome:
    """A run of a plan: its summary (written to the store's ``runs/``) and, when a stage failed, which and why."""

    summary: dict[str, Any]
    failed: tuple[str, BaseException] | None = None


def run_plan(cfg: ReleaseConfig, planned: list[PlannedStage], store: Store, runner: Runner,
             echo: Callable[[str], Any] = lambda _line: None) -> RunOutcome:
    """The pipeline's one sequence: each planned stage through ``runner`` (in this process, a Prefect task, a
    container), in order; the first failure ends the run. The summary is written to the store either way
    (``summary["summary_path"]``); the failure is returned, not raised: the caller decides what it becomes."""
    run_id, started = new_run_id(), datetime.now(timezone.utc).isoformat()
    results: list[StageResult] = []
    failed: tuple[str, BaseException] | None = None
    for p in planned:
        try:
            r = runner(p)
        except Exception as e:  # noqa: BLE001 — recorded in the summary; the caller re-raises
            results.append(StageResult(p.stage.name, p.key, "failed", store.location(p.stage.name, p.key), reason=str(e)))
            failed = (p.stage.name, e)
            break
        echo(r.line())
        results.append(r)
    error = f"{failed[0]}: {type(failed[1]).__name__}: {failed[1]}" if failed else None
    summary = summarize(cfg, run_id, started, results, "failed" if failed else "completed", error)
    summary["summary_path"] = store.write_run(run_id, summary)
    return RunOutcome(summary, failed)


def run_all(cfg: ReleaseConfig, only: list[str] | None = None, echo=print) -> dict[str, Any]:
    """Run the plan in this process without Prefect (the release flow, :mod:`drafter_prefect.release`, runs the
    same sequence with its tasks as the runner); raises the failed stage's error."""
    store = open_store(cfg)
    outcome = run_plan(cfg, plan(cfg, only), store, lambda p: run_stage(cfg, p.stage.name, store), echo)
    if outcome.failed:
        raise outcome.failed[1]
    return outcome.summary


def format_table(summary: dict[str, Any]) -> str:
    """A plain-text table of a run summary (stage, key, status, time, metrics)."""
    rows = [("stage", "key", "status", "time", "metrics")]
    for s in summary["stages"]:
        t = s["compute_seconds"] if s["status"] == "reused" else s["seconds"]
        m = ", ".join(f"{k}={_fmt(v)}" for k, v in list(s["metrics"].items())[:8])
        rows.append((s["stage"], s["key"], s["status"], f"{t:.1f}s", m))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v)[:40]
    return str(v)


def stage_output(cfg: ReleaseConfig, name: str) -> Path:
    """Where stage ``name``'s output for this config lives (or will live)."""
    store = open_store(cfg)
    return Path(store.location(name, planned_stage(cfg, name).key))
