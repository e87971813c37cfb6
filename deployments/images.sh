#!/usr/bin/env bash
# `make images`: this project's CPU images, built here from the repository.
#   drafter-release:project  deployments/Dockerfile.project  orchestration, data stages, CPU training
#   drafter-release:serving  deployments/Dockerfile.serving  the same + vLLM (CPU): the stages that serve
# The CUDA images (Dockerfile.train: CUDA training; Dockerfile.exl3: EXL3) need a CUDA base image from a
# registry: they are checked (deployments/check_dockerfile.py), not built, and this says so.
#
# Engine: docker where a Docker engine answers, else podman (deployments/podman-setup.sh: containers.conf
# and the Docker-compatible socket). Base: $BASE_IMAGE, default python:3.11-slim with docker; with podman
# and no registry, the local drafter-base:bookworm (deployments/base-image.sh) unless BASE_IMAGE is set.
# Build times and sizes go to build/images/images.json and are printed as a table.
# usage: bash deployments/images.sh [project|serving ...]     (default: both)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
wanted=("${@:-project serving}")
wanted=(${wanted[*]})
if [ -z "${ENGINE:-}" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then ENGINE=docker
  elif command -v podman >/dev/null; then ENGINE=podman
  else echo "images.sh: no container engine: install podman (apt-get install podman runc) or run a Docker engine" >&2; exit 2
  fi
fi
if [ "$ENGINE" = podman ]; then
  eval "$(bash deployments/podman-setup.sh)"
  BASE_IMAGE=${BASE_IMAGE:-drafter-base:bookworm}
  [ "$BASE_IMAGE" = drafter-base:bookworm ] && bash deployments/base-image.sh "$BASE_IMAGE"
fi
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
PROJECT_IMAGE=${PROJECT_IMAGE:-drafter-release:project}
SERVING_IMAGE=${SERVING_IMAGE:-drafter-release:serving}
mkdir -p build/images
report=build/images/images.json
[ -f "$report" ] || echo '{}' > "$report"

record() {  # IMAGE SECONDS
  local size
  size=$("$ENGINE" image inspect "$1" --format '{{.Size}}')
  "$root/.venv/bin/python" - "$report" "$1" "$2" "$size" "$ENGINE" "$BASE_IMAGE" <<'PY'
import json, sys, datetime
path, image, seconds, size, engine, base = sys.argv[1:7]
doc = json.load(open(path))
doc[image] = {"build_seconds": int(seconds), "size_bytes": int(size), "engine": engine, "base_image": base,
              "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
json.dump(doc, open(path, "w"), indent=2)
PY
}

build() {  # KIND DOCKERFILE TAG [BUILD-ARGS…]
  local kind=$1 file=$2 tag=$3 t0
  shift 3
  bash deployments/wheelhouse.sh "$kind"
  t0=$(date +%s)
  echo "building $tag ($file, $ENGINE)…"
  "$ENGINE" build -q -f "$file" --build-arg DRAFTER_IMAGE="$tag" "$@" -t "$tag" . > build/images/"$kind".log 2>&1 \
    || { tail -40 build/images/"$kind".log >&2; echo "images.sh: building $tag failed (log build/images/$kind.log)" >&2; exit 1; }
  record "$tag" $(( $(date +%s) - t0 ))
}

for kind in "${wanted[@]}"; do
  case "$kind" in
    project) build project deployments/Dockerfile.project "$PROJECT_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" ;;
    serving)
      bash deployments/wheelhouse.sh project  # its second environment
      build serving deployments/Dockerfile.serving "$SERVING_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" ;;
    *) echo "images.sh: unknown image '$kind' (project or serving)" >&2; exit 2 ;;
  esac
done
"$root/.venv/bin/python" deployments/check_dockerfile.py --cuda deployments/Dockerfile.train deployments/Dockerfile.exl3
"$root/.venv/bin/python" - "$report" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
print(f"{'image':<28} {'size':>9} {'build':>7}  base")
for image, r in doc.items():
    print(f"{image:<28} {r['size_bytes'] / 1e9:>7.2f} GB {r['build_seconds']:>5} s  {r['base_image']} ({r['engine']})")
PY
