#!/usr/bin/env bash
# The GPU check (issue 32) in one call: bench/gpu_check.py on an offline GPU machine whose image has CUDA torch but
# maybe not the project's other dependencies (the check machine: torch 2.11+cu130, transformers 5.17, no pydantic).
#   bash bench/gpu_check.sh              # on the GPU machine
#   bash bench/gpu_check.sh --dry-run    # the same on a CPU machine (the CPU stands in for the GPU, small sizes)
# When the image's python lacks transformers >= 5.24, pydantic, pyyaml, rich or safetensors, the wheels of
# bench/gpu_wheels (`make gpu-check-wheels`, ~45 MiB, git-ignored: carry it) go into build/gpu-check-site, which
# comes first on PYTHONPATH (the image's torch stays). Extra arguments go to bench/gpu_check.py; results go to
# $OUT/gpu_check.{md,json} when OUT is set (the device tool's output folder).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=bench/gpu_wheels
SITE=${GPU_CHECK_SITE:-build/gpu-check-site}
[ -f "$SITE/.installed" ] && export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" - <<'PY'
import importlib.metadata as md, sys
def v(name):
    try:
        return tuple(int(x) for x in md.version(name).split(".")[:2])
    except Exception:
        return None
want = {"transformers": (5, 24), "pydantic": (2, 7), "pyyaml": (6, 0), "rich": (13, 0), "safetensors": (0, 6)}
bad = [f"{n} (has {md.version(n) if v(n) else 'none'}, needs >= {'.'.join(map(str, f))})"
       for n, f in want.items() if v(n) is None or v(n) < f]
print("gpu_check: " + ("; ".join(bad) if bad else "dependencies present"), file=sys.stderr)
sys.exit(1 if bad else 0)
PY
then
  if [ ! -f "$WHEELS/requirements.txt" ]; then
    echo "gpu_check: no $WHEELS/requirements.txt: run 'make gpu-check-wheels' where the package index is reachable" >&2
    exit 2
  fi
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --find-links "$WHEELS" --target "$SITE" -r "$WHEELS/requirements.txt"
  touch "$SITE/.installed"
  export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: installed $(wc -l < "$WHEELS/requirements.txt") packages from $WHEELS into $SITE" >&2
fi
exec "$PY" bench/gpu_check.py "$@"
