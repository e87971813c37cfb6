#!/usr/bin/env bash
# EXL3 on a lent GPU machine: the one prepared script of a visit (see DESIGN.md, "When a GPU machine is lent").
#
# The GPU image has CUDA (nvcc), PyTorch, Triton and transformers but no exllamav3 and no network, so
# everything the run needs is prepared here on the CPU machine and carried:
#
#   1. here:        bash bench/exl3_gpu.sh prepare
#                   → out/exl3-carry/{wheels/, prepare_target/, train/}  (ignored path, ~45 MB)
#   2. on the GPU:  run(command="bash bench/exl3_gpu.sh run", carry=["out/exl3-carry"], timeout_s=540)
#                   → $OUT/exl3-gpu/{env.txt, pip.log, compile.log, stage.log, result.json,
#                                     exl3-error.json, convert.log}
#
# `run` installs the carried exllamav3 wheel (and whichever of its small dependencies the image lacks),
# times the one-off compilation of exllamav3's CUDA extension, then runs the real `quantize_exl3` stage
# (drafter.stages.quantize_exl3.run) on a tiny GLM-4-MoE target with one MTP layer: bits 5, head 6,
# o_proj overridden to 6 (applied through an exllamav3 recipe) and eh_proj to 6 (reported as not
# applied: no slot in the one-layer model), a small calibration (16 rows × 256 tokens). It prints the
# stage's metrics (achieved bits, per-tensor relative error from exllamav3's own dequantization, size,
# converter seconds) and writes them under $OUT. Every step's failure is recorded, not hidden.
set -uo pipefail
mode=${1:-run}
C=out/exl3-carry
PY=${PY:-python3}

prepare() {
    set -e
    rm -rf "$C" && mkdir -p "$C/wheels"
    # exllamav3 is pure Python; its compiled dependencies are fetched for the Pythons the image may have.
    # Our own stage needs pydantic/pyyaml/rich (transformers brings safetensors, numpy, tokenizers, pyyaml).
    local pkgs="exllamav3==1.6.5 marisa-trie llguidance ninja rich markdown-it-py mdurl pygments pydantic
                pydantic-core annotated-types typing-inspection typing-extensions pyyaml pillow"
    for v in 3.10 3.11 3.12; do
        .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "$v" \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$C/wheels" $pkgs
    done
    .venv/bin/python - "$C" <<'EOF'
import sys
from pathlib import Path

import torch

from drafter.models import TRAINED_NAME, layout_for, load_drafter, save_drafter
from drafter.models.target import write_target_json
from tests.helpers.targets import make_tiny_target

carry = Path(sys.argv[1])
pt = carry / "prepare_target"
model = make_tiny_target(pt / "model", hidden_size=64, intermediate_size=128, num_heads=1, num_kv_heads=1,
                         head_dim=64, dtype="bfloat16")
write_target_json(pt, "model", source="path", name="tiny-glm4-moe-mtp", revision=None)
layout = layout_for(model)
drafter = load_drafter(model, layout)
g = torch.Generator().manual_seed(1)
with torch.no_grad():  # a "fine-tuned" drafter: the released one plus a small perturbation
    for p in drafter.parameters():
        if p.requires_grad and p.dim() == 2:
            p.add_(torch.randn(p.shape, generator=g) * 0.01 * p.std())
(carry / "train").mkdir(parents=True, exist_ok=True)
save_drafter(drafter, carry / "train" / TRAINED_NAME, layout, torch.bfloat16)
print("prepared", carry)
EOF
    du -sh "$C" "$C"/*
}

run() {
    local R="${OUT:-/tmp/exl3-out}/exl3-gpu"
    mkdir -p "$R"
    export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
    export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}   # H200 (sm_90); compile only what is used
    { date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; which nvcc && nvcc --version | tail -1
      $PY -c "import sys, torch, transformers; print(sys.version); print('torch', torch.__version__, torch.version.cuda, torch.cuda.is_available()); print('transformers', transformers.__version__)"
    } > "$R/env.txt" 2>&1
    cat "$R/env.txt"

    local t0=$SECONDS
    if ! $PY -m pip install --no-index --find-links "$C/wheels" exllamav3==1.6.5 pydantic pyyaml rich > "$R/pip.log" 2>&1; then
        echo "pip with dependencies failed (see pip.log); retrying exllamav3 --no-deps + the missing modules" | tee -a "$R/pip.log"
        $PY -m pip install --no-index --find-links "$C/wheels" --no-deps exllamav3==1.6.5 >> "$R/pip.log" 2>&1
        for m in marisa_trie:marisa-trie llguidance:llguidance ninja:ninja rich:rich pydantic:pydantic yaml:pyyaml PIL:pillow; do
            $PY -c "import ${m%%:*}" 2>/dev/null || $PY -m pip install --no-index --find-links "$C/wheels" "${m##*:}" >> "$R/pip.log" 2>&1
        done
    fi
    echo "pip: $((SECONDS - t0)) s"; tail -2 "$R/pip.log"

    t0=$SECONDS
    $PY -c "import exllamav3.ext; print('exllamav3 extension ready')" > "$R/compile.log" 2>&1
    echo "compile exllamav3 extension: rc=$? $((SECONDS - t0)) s" | tee -a "$R/compile.log"; tail -3 "$R/compile.log"

    t0=$SECONDS
    PYTHONPATH=$PWD timeout 420 $PY - "$C" "$R" > "$R/stage.log" 2>&1 <<'EOF'
import json, shutil, sys, time, traceback
from pathlib import Path

from drafter.core.config import ReleaseConfig
from drafter.core.errors import StageSkipped
from drafter.core.stage import Artifact
from drafter.stages import quantize_exl3

carry, res = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
cfg = ReleaseConfig(quantize_exl3={"bits": 5, "head_bits": 6, "overrides": {"o_proj": 6, "eh_proj": 6},
                                   "cal_rows": 16, "cal_cols": 256, "timeout_s": 380})
inputs = {"prepare_target": Artifact("prepare_target", "tiny", carry / "prepare_target"),
          "train": Artifact("train", "tiny", carry / "train")}
out = res / "quantize_exl3"
shutil.rmtree(out, ignore_errors=True)
out.mkdir(parents=True)
t0 = time.monotonic()
result = {"status": "done"}
try:
    result["metrics"] = quantize_exl3.run(cfg, inputs, out)
except StageSkipped as e:
    result = {"status": "skipped", "reason": str(e)}
except Exception as e:
    result = {"status": "failed", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
result["seconds"] = round(time.monotonic() - t0, 1)
(res / "result.json").write_text(json.dumps(result, indent=2))
for f in ("exl3-error.json", "convert.log"):
    if (out / "exl3" / f).is_file():
        shutil.copy(out / "exl3" / f, res / f)
print(json.dumps(result, indent=2))
EOF
    echo "stage: rc=$? $((SECONDS - t0)) s"
    tail -40 "$R/stage.log"
    rm -rf "$R/quantize_exl3/exl3/model"   # the EXL3 model itself stays on the device (size); its report comes back
}

case "$mode" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: $0 prepare|run" >&2; exit 2 ;;
esac
