#!/usr/bin/env bash
# Podman as the container engine of this project's images and of Prefect's docker worker, on a machine
# without Docker (see DESIGN.md "Containers and deployments"). Idempotent.
#   1. containers.conf ($CONTAINERS_CONF, default build/podman/containers.conf): runtime runc (crun
#      fails on hybrid cgroups) and ulimits the VM allows (nofile ≤ the hard limit, nproc ≤ 32768);
#   2. the Docker-compatible API: `podman system service` on build/podman/podman.sock, so docker-py,
#      prefect-docker's worker and the docker CLI talk to podman through DOCKER_HOST.
# usage: eval "$(bash deployments/podman-setup.sh)"     # exports CONTAINERS_CONF and DOCKER_HOST
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${PODMAN_DIR:-$root/build/podman}
mkdir -p "$dir"
conf=${CONTAINERS_CONF:-$dir/containers.conf}
sock=$dir/podman.sock
command -v podman >/dev/null || { echo "podman is not installed: apt-get install podman runc" >&2; exit 2; }
hard=$(ulimit -Hn)
[ "$hard" = unlimited ] && hard=1048576
cat > "$conf.tmp" <<CONF
[containers]
default_ulimits = ["nofile=$hard:$hard", "nproc=32768:32768"]

[engine]
runtime = "runc"
CONF
mv "$conf.tmp" "$conf"
export CONTAINERS_CONF=$conf
if ! curl -fs --unix-socket "$sock" http://d/_ping >/dev/null 2>&1; then
  rm -f "$sock"
  nohup podman system service --time=0 "unix://$sock" > "$dir/service.log" 2>&1 &
  echo $! > "$dir/service.pid"
  for _ in $(seq 1 100); do
    curl -fs --unix-socket "$sock" http://d/_ping >/dev/null 2>&1 && break
    sleep 0.1
  done
  curl -fs --unix-socket "$sock" http://d/_ping >/dev/null || { echo "podman service did not start: $dir/service.log" >&2; exit 1; }
fi
echo "export CONTAINERS_CONF=$conf DOCKER_HOST=unix://$sock"
