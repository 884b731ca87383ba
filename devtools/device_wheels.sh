#!/usr/bin/env bash
# Wheels for the device check (devtools/device_check.sh) that the accelerator machine lacks, for
# its Python (3.12, x86-64 manylinux), downloaded here into .whl/ (ignored by git; the device tool
# carries it: name `.whl` in its carry list). The machine has JAX, flax, optax, numpy, scipy,
# ml_dtypes, safetensors and fsspec, and no package registry; what the island, merge and bench
# path imports at module level beyond those is pydantic (the config) with its dependencies and
# google-crc32c (training/store/tensors.py). The Google Cloud clients (gcs.py: only for gs://
# URLs) and matplotlib (plots: the check draws none) are imported lazily and not needed.
#
#   devtools/device_wheels.sh [DIR]       # default .whl; versions: requirements.lock's
#
# Environment: PYTHON (python3, with pip), DEVICE_PYTHON_VERSION (3.12).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$repo/.whl}
PY=${PYTHON:-python3}
pyver=${DEVICE_PYTHON_VERSION:-3.12}
names=(pydantic pydantic_core annotated-types typing-inspection typing_extensions google-crc32c)

pins=()
for name in "${names[@]}"; do
    # requirements.lock spells a name with '-' or '_'; pip treats them alike
    pattern="^$(echo "$name" | sed 's/[-_]/[-_]/g')=="
    pin=$(grep -iE "$pattern" "$repo/requirements.lock" | head -n1 || true)
    if [ -z "$pin" ]; then
        echo "error: $name is not pinned in requirements.lock" >&2
        exit 2
    fi
    pins+=("$pin")
done

mkdir -p "$dest"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version "$pyver" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dest" "${pins[@]}"
echo "wheels in $dest ($(du -sh "$dest" | cut -f1)): ${pins[*]}"
