"""``drafter stage`` (one stage without Prefect: the container entrypoint, also ``python -m drafter stage``)
and ``drafter heldout-sample``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from drafter.cli.common import ConfigOpt, ProfileOpt, SetOpt, StoreOpt, app, cli_errors, console, exit_code, fail, load
from drafter.core.errors import DrafterError
from drafter.core.pipeline import run_stage
from drafter_prefect.api_server import exit_on_signals


@app.command("stage")
@cli_errors
def stage_cmd(name: str = typer.Argument(..., help="Stage name, e.g. capture."), config: Path = ConfigOpt,
              profile: Optional[str] = ProfileOpt, set_: Optional[list[str]] = SetOpt, store: Optional[str] = StoreOpt) -> None:
    """Run one stage without Prefect (inputs must be in the store): the container entrypoint."""
    cfg = load(config, profile, set_, store, check=True, stages=[name], single=True, stages_source="the stage name")
    exit_on_signals()
    try:
        result = run_stage(cfg, name)
    except KeyError as e:
        fail(e.args[0], 2)
    except DrafterError as e:
        fail(e, exit_code(e))
    console.print(result.line())
    console.print_json(json.dumps(result.metrics, default=str))


@app.command("heldout-sample")
@cli_errors
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

    cfg = load(config, profile, set_, store)
    if out.suffix != ".jsonl":
        fail(f"--out {out}: the held-out file is written as JSONL; give it a .jsonl name", 2)
    exit_on_signals()
    work = out.with_name(out.name + ".parts")  # the generation's shards: a retry resumes from them
    try:
        pt = run_stage(cfg, "prepare_target")
        res = resample_heldout(cfg, target_dir(Path(pt.path)), out,
                               temperature=temperature, work_dir=work, log=console.print)
    except DrafterError as e:
        fail(e, exit_code(e))
    shutil.rmtree(work, ignore_errors=True)
    console.print(f"{res['conversations']} conversations, {res['requests']} turns, {res['tokens_generated']} tokens "
                  f"at T={temperature:g} ({res['tok_per_s']} tok/s) → {out}")
    console.print(f"measure on it: drafter stage eval_offline -c {config} --set 'heldout.files=[\"{out}\"]'")
