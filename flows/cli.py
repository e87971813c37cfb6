"""The `drafter` command line.

    drafter release -c configs/demo.yaml [--profile quick] [--set generate.num_prompts=64]
    drafter stage capture -c configs/demo.yaml          # one stage: the container entrypoint
    drafter plan -c configs/demo.yaml                   # stage keys and whether they are done
    drafter runs -c configs/demo.yaml [--json]          # stage table of the latest run
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from drafter.config import ReleaseConfig, load_config
from drafter.errors import DrafterError
from drafter.pipeline import format_table, open_store, plan, run_stage
from drafter.report import release_report
from drafter.store import Store

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Release pipeline for speculative-decoding drafters.")
console = Console()

ConfigOpt = typer.Option(Path("configs/demo.yaml"), "--config", "-c", help="Release config (YAML).")
ProfileOpt = typer.Option(None, "--profile", "-p", help="Named profile from the config's `profiles:` block (e.g. quick).")
SetOpt = typer.Option(None, "--set", "-s", help="Override a field: section.field=value (repeatable).")
StoreOpt = typer.Option(None, "--store", help="Store root (local path or fsspec URL); overrides store.root.")


def _load(config: Path, profile: Optional[str], sets: Optional[list[str]], store: Optional[str]) -> ReleaseConfig:
    overrides = list(sets or [])
    if store:
        overrides.append(f"store.root={store}")
    try:
        return load_config(config, profile=profile, overrides=overrides)
    except DrafterError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2)


@app.command()
def release(config: Path = ConfigOpt, profile: Optional[str] = ProfileOpt, set_: Optional[list[str]] = SetOpt,
            store: Optional[str] = StoreOpt,
            stage: Optional[list[str]] = typer.Option(None, "--stage", help="Run only these stages (and what they need)."),
            ) -> None:
    """Run the release flow (Prefect; ephemeral API unless PREFECT_API_URL is set)."""
    cfg = _load(config, profile, set_, store)
    from flows.release import release as release_flow

    try:
        summary = release_flow(config=cfg, stages=stage)
    except DrafterError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1)
    except RuntimeError as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(1)
    _print_outputs(summary)


def _print_outputs(summary: dict) -> None:
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


@app.command("stage")
def stage_cmd(name: str = typer.Argument(..., help="Stage name, e.g. capture."), config: Path = ConfigOpt,
              profile: Optional[str] = ProfileOpt, set_: Optional[list[str]] = SetOpt, store: Optional[str] = StoreOpt) -> None:
    """Run one stage without Prefect (inputs must be in the store): the container entrypoint."""
    cfg = _load(config, profile, set_, store)
    try:
        result = run_stage(cfg, name)
    except KeyError as e:
        console.print(f"[red]error:[/red] {e.args[0]}")
        raise typer.Exit(2)
    except DrafterError as e:
        console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(1)
    console.print(result.line())
    console.print_json(json.dumps(result.metrics, default=str))


@app.command("plan")
def plan_cmd(config: Path = ConfigOpt, profile: Optional[str] = ProfileOpt, set_: Optional[list[str]] = SetOpt,
             store: Optional[str] = StoreOpt) -> None:
    """Show every stage's key and whether its output is already in the store."""
    cfg = _load(config, profile, set_, store)
    st = open_store(cfg)
    t = Table(title=f"plan for {cfg.name} (store {cfg.store.root})")
    for col in ("stage", "key", "state", "output"):
        t.add_column(col)
    for p in plan(cfg):
        try:
            state = "done" if st.find(p.stage.name, p.key) else ("partial (will resume)" if st.partial_dir(p.stage.name, p.key).is_dir() else "to compute")
        except DrafterError as e:
            state = f"[red]corrupt: {e}[/red]"
        t.add_row(p.stage.name, p.key, state, st.location(p.stage.name, p.key))
    console.print(t)


@app.command()
def runs(config: Path = ConfigOpt, store: Optional[str] = StoreOpt,
         as_json: bool = typer.Option(False, "--json", help="Print the latest run's summary as JSON (for automation)."),
         all_: bool = typer.Option(False, "--all", help="List every run, not only the latest.")) -> None:
    """The stage table of the latest run (key, status, time, metrics)."""
    root = store
    cache = "~/.cache/drafter-release/store"
    if root is None:
        if config.is_file():
            cfg = _load(config, None, None, None)
            root, cache = cfg.store.root, cfg.store.cache_dir
        else:
            root = "store"
    history = Store(root, cache).runs()
    if not history:
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
