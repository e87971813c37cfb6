"""What the commands print: the release's outputs, the publish plan, the memory plan."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from drafter.cli.common import console
from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageError
from drafter.evaluation.report import release_report
from drafter.release.hub import PublishPlan, load_publish


def print_outputs(summary: dict, send_cmd: str | None = None) -> None:
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
    print_publish(summary, send_cmd)


def print_publish(summary: dict, send_cmd: str | None = None) -> None:
    """The card's path and the publish plan (or what was published)."""
    s = next((s for s in summary["stages"] if s["stage"] == "publish" and s["status"] in ("computed", "reused")), None)
    if s is None:
        return
    out = Path(s["path"])
    try:
        plan, result = load_publish(out)
    except StageError:
        return
    console.print(f"\n[bold]model card[/bold]: {out / 'release' / 'README.md'}", highlight=False)
    console.print(f"[bold]publish plan[/bold]: {PublishPlan.path(out)}", highlight=False)
    tag = f", tag {plan.tag}{' at merge' if plan.tag_at == 'merge' else ''}" if plan.tag else ""
    t = Table(title=f"release {plan.release_id} → {plan.repo_id} ({plan.mode} on {plan.branch}{tag}): "
                    f"{len(plan.files)} files, {plan.total_bytes:,} bytes")
    t.add_column("file", overflow="fold")
    t.add_column("bytes", justify="right")
    t.add_column("sha256 (full in the plan)")
    for f in plan.files:
        t.add_row(f.path, f"{f.size:,}", f.sha256[:16] + "…")
    console.print(t)
    if result.status == "dry_run":
        console.print(f"dry run: nothing sent. Send it with: {send_cmd or result.send} (a write token in $HF_TOKEN)",
                      markup=False, highlight=False)
        if plan.tag_note:  # PR mode: the tag waits for the merge (and the command that creates it then)
            console.print(plan.tag_note, markup=False, highlight=False, soft_wrap=True)
    else:
        where = result.pr_url or result.commit_url or result.commit_sha
        console.print(f"{result.status}: {where}" + (f" (tag {result.tag})" if result.tag else ""),
                      markup=False, highlight=False)
        if result.tag_pending:  # PR mode, not merged yet: no tag on refs/pr/N
            console.print(result.tag_note or f"tag {result.tag_pending} waits for the merge: {result.tag_command}",
                          markup=False, highlight=False, soft_wrap=True)


def print_memory_plan(cfg: ReleaseConfig, target_art, target_config: Optional[Path], gpu_bytes: int) -> None:
    """The memory plan of ``drafter plan``: one column with the frozen weights in float32, one in bfloat16 (the one train.frozen_dtype holds marked)."""
    from drafter.training import memory
    from drafter.training.frozen import frozen_dtype_of

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
    used = frozen_dtype_of(cfg.train)
    typer.echo(f"  {'':{w}}  {'frozen f32':>10}  {'frozen bf16':>11}  formula (training holds frozen weights in "
               f"{used}: train.frozen_dtype)")
    by16 = {ln.what.replace("(bfloat16)", "(float32)"): ln for ln in p16.lines}
    for ln in p32.lines:
        other = by16.get(ln.what)
        typer.echo(f"  {ln.what:{w}}  {ln.bytes / GiB:10.2f}  {(f'{other.bytes / GiB:.2f}' if other else '—'):>11}  {ln.formula}")
    typer.echo(f"  {'total':{w}}  {p32.total / GiB:10.2f}  {p16.total / GiB:11.2f}")
    for name, pl in ((f"frozen float32{' (training)' if used == 'float32' else ''}", p32),
                     (f"frozen bfloat16{' (training)' if used == 'bfloat16' else ''}", p16)):
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
