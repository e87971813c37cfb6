"""A first release of a target's own drafter, published to a Hub as a champion for a retrain to challenge:
the MTP layer the target ships (its released drafter, what a first release with no fine-tuning holds),
written by the library (``save_drafter``), with a ``release.json`` listing its sha256, sent as one commit by
:func:`drafter.release.hub.publish_folder` — what the nightly retrain then reads with
:func:`drafter.release.champion.champion_from_hub`. Cheaper than a whole first release through the
pipeline (the nightly retrain test needs a champion, not the stages that made it)."""
from __future__ import annotations

from pathlib import Path

from drafter.core.config import ReleaseConfig


def publish_released_drafter_as_champion(target: Path, cfg: ReleaseConfig, token: str, folder: Path) -> str:
    """Publish ``target``'s released drafter to ``cfg.publish`` (repo, endpoint) as the champion release; returns
    its release id (the drafter file's sha256, first 16 hex digits)."""
    import torch

    from drafter.core.store import sha256_file
    from drafter.models import TRAINED_NAME, layout_for, load_drafter, save_drafter
    from drafter.release.folder import write_release_record
    from drafter.release.hub import publish_folder

    folder.mkdir(parents=True)
    layout = layout_for(target)
    save_drafter(load_drafter(target, layout), folder / TRAINED_NAME, layout, torch.float32)
    (folder / "README.md").write_text(f"# {cfg.name}: the released drafter\n")
    files = [{"path": p.name, "size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(folder.iterdir())]
    release_id = next(f["sha256"] for f in files if f["path"] == TRAINED_NAME)[:16]
    write_release_record(folder, {"release_id": release_id, "name": cfg.name, "kind": "mtp", "files": files})
    publish_folder(folder, cfg.publish, token=token, message=f"Release {cfg.name} (the released drafter)", tag=None,
                   release_id=release_id, log=lambda *_: None)
    return release_id
