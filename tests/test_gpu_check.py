"""bench/gpu_check.py (issue 32) up to its boundary: on a machine without CUDA it stops at once with the reason
and exit code 3; its dry run (the CPU standing in for the GPU, small sizes) runs every check and passes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.torch_threads import same_threads_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device: the check runs for real")
def test_stops_at_the_boundary_without_cuda(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 3, p.stderr
    assert "gpu_check: stopping at the boundary: no CUDA device" in p.stderr
    assert f"torch {torch.__version__}" in p.stderr and "--dry-run" in p.stderr
    assert not (tmp_path / "gpu_check.json").exists()  # nothing measured, nothing written


def test_unknown_check_is_refused():
    """Every name of --only is checked before any check runs: the known 'mtp' before the typo does not run."""
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", "mtp,warp"], capture_output=True,
                       text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and "unknown check 'warp'" in p.stderr
    assert p.stdout == "", p.stdout  # no header, no row: nothing measured


@pytest.mark.slow
def test_dry_run_runs_every_check(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--steps", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT,
                       env=os.environ | same_threads_env())  # this worker's share of the cores (tests/helpers/torch_threads.py)
    failed_lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "FAIL" in ln or "Error" in ln]
    assert p.returncode == 0, "\n".join(failed_lines) + "\n" + p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    names = [r["check"] for r in res["rows"]]
    for prefix in ("mtp window_loss K=1", "mtp window_loss K=3 draft vocab", "mtp step bf16",
                   "mtp step bf16 compiled (train.compile)", "train()",
                   "dspark block_loss", "dspark block_acceptance", "fp8 float32", "fp8 ue8m0", "v3-size MTP step",
                   "torchrun 2 processes"):
        assert any(n.startswith(prefix) for n in names), (prefix, names)
    failed = [r for r in res["rows"] if r["result"] == "FAIL"]
    assert not failed, failed
    # the CPU against itself: identical numbers where the check compares them
    fp8 = [r for r in res["rows"] if r["check"].startswith("fp8")]
    assert all(r["compare"].startswith("0 scales, 0 bytes differ") for r in fp8), fp8
    assert "| check | CPU | GPU | comparison | result |" in (tmp_path / "gpu_check.md").read_text()
    step = next(r for r in res["rows"] if r["check"].startswith("mtp step bf16"))
    assert "micro batch 4 × window 64" in step["check"] and "one window at a time" in step["gpu"]
    assert "bar" not in step["compare"] and step["result"] == "—"  # issue 36's bars are a GPU's, not a dry run's
    comp = next(r for r in res["rows"] if r["check"].startswith("mtp step bf16 compiled"))
    assert "compiled" in comp["gpu"] and "× eager" in comp["compare"] and "bar" not in comp["compare"], comp
    assert "Torch-Compiled Region" in (tmp_path / "profile-demo-step-compiled.txt").read_text()
    for name in ("profile-demo-step-micro-batch-4.txt", "profile-demo-step-compiled.txt",
                 "profile-v3-step-window-128.txt"):
        text = (tmp_path / name).read_text()
        assert text.startswith(name[8:-4] + ": one step, 0 GPU kernels") and "aten::mm" in text, text[:500]
