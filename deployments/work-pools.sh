#!/usr/bin/env bash
# The work pools of deployments/prefect.yaml, on the server of $PREFECT_API_URL (idempotent:
# an existing pool keeps its settings unless OVERWRITE=1).
#   process     runs flows as subprocesses of `prefect worker start --pool process` (no container)
#   docker      runs each flow run in a container (images: deployments/Dockerfile.*; needs prefect-docker
#               where its worker runs)
#   kubernetes  one Job per flow run; deployments/k8s-gpu-job-template.json puts the `gpus` job
#               variable into the container's nvidia.com/gpu limit
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefect=${PREFECT:-prefect}
flags=()
[ "${OVERWRITE:-0}" = 1 ] && flags+=(--overwrite)
create() {  # NAME TYPE [ARGS…]: one CLI call (each starts Prefect: seconds of CPU), "exists" read from its answer
  local out
  if out=$("$prefect" work-pool create "$1" --type "$2" "${@:3}" "${flags[@]}" 2>&1); then echo "$out"; return; fi
  if [ "${OVERWRITE:-0}" != 1 ] && grep -q "already exists" <<<"$out"; then echo "work pool $1 exists"; return; fi
  echo "$out" >&2
  return 1
}
create process process
create docker docker
create kubernetes kubernetes --base-job-template "$here/k8s-gpu-job-template.json"
