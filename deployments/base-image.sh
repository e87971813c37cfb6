#!/usr/bin/env bash
# The local base image drafter-base:bookworm for machines without a registry: a debootstrap'd
# Debian bookworm (Python 3.11, venv) with this machine's CA certificates (pip inside the builds
# needs them to reach the package registry), imported into podman. Skipped when it exists.
# On a machine with a registry, build FROM python:3.11-slim instead (the Dockerfiles' default).
# usage: bash deployments/base-image.sh [IMAGE]
set -euo pipefail
image=${1:-drafter-base:bookworm}
if podman image exists "$image"; then echo "$image exists"; exit 0; fi
command -v debootstrap >/dev/null || { echo "debootstrap is not installed: apt-get install debootstrap" >&2; exit 2; }
rootfs=$(mktemp -d /tmp/drafter-base.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT
t0=$(date +%s)
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libgomp1,libnuma1,curl \
  bookworm "$rootfs" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" > "$rootfs.log" 2>&1 \
  || { tail -20 "$rootfs.log" >&2; exit 1; }
cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
rm -rf "$rootfs/var/cache/apt/archives/"*.deb "$rootfs/var/lib/apt/lists/"*
tar -C "$rootfs" -c . | podman import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$image" >/dev/null
rm -f "$rootfs.log"
echo "$image built in $(( $(date +%s) - t0 )) s ($(podman image inspect "$image" --format '{{.Size}}') bytes)"
