"""The store's commands: ``drafter plan`` (keys, states, the memory plan), ``drafter clean``, ``drafter runs``."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from drafter.cli.common import ConfigOpt, ProfileOpt, SetOpt, StoreOpt, app, cli_errors, console, fail, load, one_line
from drafter.cli.render import print_memory_plan
from drafter.core.config import ReleaseConfig
from drafter.core.errors import ConfigError, DrafterError
from drafter.core.pipeline import format_table, open_store, plan
from drafter.core.store import Store


@app.command("plan")
@cli_errors
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
        fail(f"--gpu-memory: {e}", 2)
    cfg = load(config, profile, set_, store)
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
            unreachable = one_line(e)
        except Exception as e:  # noqa: BLE001 - anything else fsspec raises: its type and first line
            unreachable = f"{type(e).__name__}: {one_line(e)[:200]}"
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
    print_memory_plan(cfg, target_art, target_config, gpu_bytes)


@app.command()
@cli_errors
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
        cfg = load(config, profile, set_, store)
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
@cli_errors
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
            cfg = load(config, None, None, None)
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
