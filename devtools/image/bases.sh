#!/usr/bin/env bash
# Local stand-ins for the Dockerfile's base images, for machines that reach no image registry
# (this one): Debian bookworm from Debian's archive (mmdebstrap), a Python 3.11 image on it and
# an Airflow 3.3.2 image on that (user airflow, uid 50000, AIRFLOW_HOME=/opt/airflow, as the
# official image). Users build FROM the official images; `make image` builds FROM these.
# Idempotent: an image that exists is kept. Needs root (apt-get, podman's storage).
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=devtools/image
CA=/etc/ssl/certs/ca-certificates.crt   # pip inside a build uses the host's CA bundle (read-only)
PY_IMAGE=localhost/diloco-base-python:3.11
AF_IMAGE=localhost/diloco-base-airflow:3.3.2-python3.11

missing=()
for tool in podman runc mmdebstrap; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
# said before it is done (docs/AIRFLOW.md, "Building the image here"): what this changes on the
# machine beyond podman's own image storage
echo "make image: this machine-wide setup comes first (as root):"
if ((${#missing[@]})); then
  echo "  - apt-get install ${missing[*]} (Debian's packages)"
fi
if [ ! -e /etc/containers/containers.conf ]; then
  echo "  - write /etc/containers/containers.conf (default ulimits, runtime runc; there is none yet)"
fi
((${#missing[@]})) || [ ! -e /etc/containers/containers.conf ] || echo "  - nothing: all in place"
if ((${#missing[@]})); then
  echo "installing ${missing[*]} (apt-get)"
  apt-get install -y -q --no-install-recommends podman runc mmdebstrap >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends podman runc mmdebstrap >/dev/null; }
fi
# This VM lacks CAP_SYS_RESOURCE (podman's default ulimits: "Operation not permitted") and a
# unified cgroup layout (crun refuses hybrid mode): default ulimits it may set, runc.
if [ ! -e /etc/containers/containers.conf ]; then
  mkdir -p /etc/containers
  cat > /etc/containers/containers.conf <<'CONF'
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
CONF
fi

exists() { podman image exists "$1"; }
if ! exists localhost/bookworm-rootfs:latest; then
  echo "building localhost/bookworm-rootfs from Debian's archive (mmdebstrap)"
  mmdebstrap --quiet --variant=minbase --aptopt='Acquire::Check-Valid-Until "false"' \
    --include=ca-certificates,python3,python3-venv bookworm - /etc/apt/sources.list.d/debian.sources \
    | podman import --change 'CMD ["/bin/bash"]' - localhost/bookworm-rootfs:latest >/dev/null
fi
if ! exists "$PY_IMAGE"; then
  echo "building $PY_IMAGE"
  podman build -q --network host --pull=never -t "$PY_IMAGE" -f "$HERE/python.Containerfile" .
fi
if ! exists "$AF_IMAGE"; then
  echo "building $AF_IMAGE (apache-airflow 3.3.2 from the lock)"
  podman build -q --network host --pull=never -v "$CA:$CA:ro" -t "$AF_IMAGE" \
    --build-arg "PY_IMAGE=$PY_IMAGE" -f "$HERE/airflow.Containerfile" .
fi
echo "bases: $AF_IMAGE $PY_IMAGE"
