#!/usr/bin/env bash
# Triton 3.7.1 small enough to travel to the GPU machine in one call (64 MiB limit, .whl/ included):
# the wheel (from `bash ../shared/gpu/wheels.sh --triton`, split in .whl-triton/part*) unpacked,
# without what training never loads (CUPTI and the proton profiler, the AMD backend, the Blackwell
# ptxas, nvdisasm, instrumentation), libtriton.so stripped of its symbol table, packed as tar.xz:
# about 47 MB. Writes .whl-triton/triton371-slim.tar.xz; bench/gpu_env.sh unpacks it there.
set -euo pipefail
top=$(git rev-parse --show-toplevel); cd "$top/.whl-triton"
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
cat part* > "$work/triton.whl"
[ "$(sha256sum "$work/triton.whl" | cut -d' ' -f1)" = "$(cat SHA256)" ] || { echo "checksum mismatch: re-run wheels.sh" >&2; exit 1; }
mkdir "$work/x" && unzip -q "$work/triton.whl" -d "$work/x"
cd "$work/x/triton"
rm -rf backends/nvidia/lib/cupti backends/nvidia/bin/ptxas-blackwell backends/nvidia/bin/nvdisasm \
  _C/libproton.so instrumentation backends/amd
strip --strip-unneeded _C/libtriton.so
sed -i "/triton.backends.amd/d" "$work"/x/triton-*.dist-info/entry_points.txt  # no AMD backend left to discover
tar -C "$work/x" -cf - . | xz -T0 -6 > "$top/.whl-triton/triton371-slim.tar.xz"
ls -la "$top/.whl-triton/triton371-slim.tar.xz"
