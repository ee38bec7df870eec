#!/usr/bin/env bash
# Every Python package the GPU benches need beyond the image, in one file small enough to travel with
# Triton 3.7.1 in one call (64 MiB limit): the pure-Python wheels of our pins (transformers, fla-core,
# liger-kernel, einops) and of TRL's GRPO path (trl, datasets, dill, multiprocess), unpacked into one
# site folder and packed as tar.xz (16.6 MB of wheels, about 5.5 MB packed). TRL's other needs
# (pyarrow, pandas, accelerate, huggingface-hub, xxhash, fsspec, psutil, pyyaml) are in the image
# already, so none of them travels. Writes .whl-site/site-py312.tar.xz (and PINS); bench/gpu_env.sh
# unpacks it into /tmp/site-xz in place of installing .whl/. Recipe: docs/bench/README.md.
set -euo pipefail
PINS=(transformers==5.24.0 fla-core==0.6.0 liger-kernel==0.8.5 einops==0.8.2
      trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19)
top=$(git rev-parse --show-toplevel); out="$top/.whl-site"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# The image's Python: 3.12, x86-64 (each wheel here is pure Python; multiprocess ships one per Python).
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$work/wheels" "${PINS[@]}"
mkdir "$work/site"
for wheel in "$work"/wheels/*.whl; do
  grep -qx 'Root-Is-Purelib: true' <(unzip -p "$wheel" '*.dist-info/WHEEL') || { echo "not pure Python: $wheel" >&2; exit 1; }
  unzip -q -o "$wheel" -d "$work/site"  # a pure-Python wheel installs by unpacking (PEP 427)
done
rm -rf "$work"/site/*.data  # console scripts only (dill's); nothing imports them
mkdir -p "$out"
tar -C "$work/site" --sort=name --owner=0 --group=0 --mtime=@0 -cf - . | xz -T2 -9 > "$out/site-py312.tar.xz"
printf '%s\n' "${PINS[@]}" > "$out/PINS"
ls -la "$out/site-py312.tar.xz"
