"""`publish` stage: the model card, the release folder and (unless a dry run) the Hub upload.

Inputs: every stage of the run (the card's numbers come from their output files) — the gate must
have passed or been forced. Computes: the release folder (:func:`drafter.release.folder.build_release_folder`:
``README.md`` card, the trained drafter under the release's names with its index, ``fp8/``,
``exl3/`` when produced, ``assets/``, ``release.json``; an EAGLE-3 head's ``config.json`` + ``model.safetensors`` at
the root, the repo vLLM loads as ``"model"``) and the publish plan (repo, branch, mode,
every file with size and sha256, commit message, release id). Dry run (the default): nothing is
sent. Otherwise one commit (or one pull request) with every file, made by
:func:`drafter.release.hub.publish_folder` — retry-safe: an identical remote tree or an earlier
commit of the same release id means no new commit. The token comes from the environment variable
``publish.token_env`` and is never written anywhere.

Writes: ``release/`` (the exact tree sent), ``publish-plan.json``, ``publish.json`` (what happened:
repo, commit sha, PR URL, tag — or ``dry_run``). Reports: ``status``, ``release_id``, ``files``,
``bytes``, and when sent ``commit``, ``tag``, ``pr_url``.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from drafter import __version__
from drafter.core.config import ReleaseConfig
from drafter.core.errors import BadInputError, StageError
from drafter.core.stage import Artifact, Metrics, Stage
from drafter.evaluation.gate import GateResult, load_gate

# answer_heldout: only when it is planned (its key is recorded with the other stages' in the card and release.json)
INPUTS = ("prepare_target", "generate", "scrub", "answer_heldout", "capture", "bootstrap_drafter", "train",
          "eval_offline", "quantize_fp8", "verify_fp8", "quantize_exl3", "ab_live", "gate")
REPO_ROOT = Path(__file__).resolve().parents[2]


class ReleaseRefused(BadInputError):
    """The release cannot be published as it stands (gate refused, a required result missing): a retry
    would fail the same way."""


def fill(pattern: str, cfg: ReleaseConfig, key: str) -> str:
    """``publish.tag`` / ``publish.commit_message`` with ``{name}``, ``{version}``, ``{key}`` filled in."""
    return pattern.format(name=cfg.name, version=__version__, key=key)


def check_gate(gate: Artifact | None) -> dict:
    """The gate's document (``gate.json``, checked by :class:`GateResult`); refuses unless it passed or was forced."""
    if gate is None or gate.status != "done":
        why = gate.manifest.get("reason") if gate is not None else "the gate stage did not run"
        raise ReleaseRefused(f"publish: no gate verdict ({why}); a release is published only after the gate")
    path = GateResult.path(gate.path)
    try:
        res = load_gate(gate.path)
    except StageError as e:
        raise ReleaseRefused(f"publish: cannot read the gate's verdict {path}: {e}") from e
    if res.verdict not in ("pass", "forced"):
        raise ReleaseRefused(f"publish: the gate refused this release ({path}: verdict {res.verdict!r}, failed "
                             f"checks {res.failed}); fix the drafter or set gate.force: true to release anyway")
    return res.raw


def run(cfg: ReleaseConfig, inputs: dict[str, Artifact], out: Path) -> Metrics:
    from drafter.release.card import required_missing
    from drafter.release.folder import build_release_folder, git_commit_of
    from drafter.release.hub import PublishPlan, PublishResult, make_plan, publish_folder, read_token

    pc = cfg.publish
    check_gate(inputs.get("gate"))
    missing = required_missing(inputs)
    if missing:
        raise ReleaseRefused(f"publish: the card needs results that are missing: {', '.join(missing)}")
    token = None if pc.dry_run else read_token(pc)  # before any work: a missing token fails in seconds
    key = out.name.removeprefix(".").split(".")[0]  # the stage key (the in-progress directory is .<key>.partial)

    folder = out / "release"
    if folder.exists():  # a retry: rebuild from the stage outputs (deterministic), never reuse half a folder
        shutil.rmtree(folder)
    built = build_release_folder(cfg, inputs, folder, version=__version__, git_commit=git_commit_of(REPO_ROOT), repo_id=pc.repo_id)
    release_id = built["release_id"]
    message = fill(pc.commit_message, cfg, key)
    tag = fill(pc.tag, cfg, key) if pc.tag else None
    plan = make_plan(folder, pc, message=message, tag=tag, release_id=release_id)
    PublishPlan.write(out, plan)
    metrics: Metrics = {"release_id": release_id, "files": len(plan["files"]), "bytes": plan["total_bytes"],
                        "card": "release/README.md"}
    if pc.dry_run:
        result = {"status": "dry_run", "release_id": release_id, "repo_id": pc.repo_id,
                  "send": "drafter publish --repo-id ORG/NAME" if pc.repo_id is None else "drafter publish"}
        print(f"publish: dry run — release {release_id}: {len(plan['files'])} files, {plan['total_bytes']:,} bytes "
              f"in {folder}; nothing sent ({result['send']} sends it)")
    else:
        result = publish_folder(folder, pc, token=token, message=message, tag=tag, release_id=release_id)
        metrics |= {"repo": result["repo_id"], "commit": result["commit_sha"], "tag": result.get("tag"),
                    "pr_url": result.get("pr_url")}
    PublishResult.write(out, result)
    return {"status": result["status"], **{k: v for k, v in metrics.items() if v is not None}}


STAGE = Stage(
    name="publish",
    version="1",
    inputs=INPUTS,
    sections=("publish",),
    run=run,
    description="Model card, release folder and the Hugging Face Hub upload (dry run by default)",
    # the release name and the library version appear in the card, the commit message and the tag
    fingerprint=lambda cfg: {"name": cfg.name, "version": __version__},
)
