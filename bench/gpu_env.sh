#!/usr/bin/env bash
# Source this on the lent GPU machine (offline image: Python 3.12, torch 2.11, Triton 3.6.0):
#   . bench/gpu_env.sh
# installs our pinned transformers, fla-core and liger from the carried .whl/ into /tmp/site (or, when
# .whl-site/site-py312.tar.xz was carried instead, unpacks it into /tmp/site-xz: the same pins plus
# TRL, bench/slim_trl.sh makes it), stages
# the package as plain folders under /tmp/pg-<md5 of its sources> ($PG_DIR; the image's setuptools editable install does not map
# patchgen.kernels) and, when .whl-triton/triton371-slim.tar.xz was carried (bench/slim_triton.sh
# makes it), unpacks Triton 3.7.1 into /tmp/t371 without putting it on the path:
#   PYTHONPATH=$T371:$PYTHONPATH python ...   # this process under Triton 3.7.1
# Safe to source again, from several shells at once: each step runs once per machine, the staging of the
# package once per content of its sources.
set -e
if [ -f .whl-site/site-py312.tar.xz ] && [ ! -d /tmp/site-xz ]; then
  rm -rf /tmp/site-xz.new && mkdir -p /tmp/site-xz.new && tar -C /tmp/site-xz.new -xJf .whl-site/site-py312.tar.xz \
    && mv /tmp/site-xz.new /tmp/site-xz
fi
if [ ! -d /tmp/site-xz ] && [ ! -f /tmp/site/.patchgen-installed ]; then
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && touch /tmp/site/.patchgen-installed
fi
# staged per content: /tmp/pg-<md5 of the sources>, so a warm machine (which keeps /tmp between calls) runs the
# checkout's code and not the call before's, and shells sourcing this at once never share a half-built folder
PG_STAMP=$(find patchgen kernels generated templates -type f -not -path '*/__pycache__/*' -print0 | sort -z \
  | xargs -0 md5sum | md5sum | cut -d' ' -f1)
export PG_DIR=/tmp/pg-$PG_STAMP
if [ ! -d "$PG_DIR/patchgen" ]; then
  PG_NEW=$(mktemp -d /tmp/pg.XXXXXX)
  # explicit checks, not set -e: callers source this inside `||`, where bash ignores set -e
  if mkdir -p "$PG_NEW/patchgen" && cp -r patchgen/. "$PG_NEW/patchgen/" && cp -r kernels "$PG_NEW/patchgen/kernels" \
    && cp -r generated "$PG_NEW/patchgen/generated" && cp -r templates "$PG_NEW/patchgen/templates"; then
    mv -T "$PG_NEW" "$PG_DIR" 2>/dev/null || rm -rf "$PG_NEW"  # another shell staged the same sources first
  else
    rm -rf "$PG_NEW"
    echo "gpu_env.sh: staging the package into $PG_DIR failed (disk full? run from the repository root)" >&2
    return 1 2>/dev/null || exit 1
  fi
fi
export T371=/tmp/t371
if [ -f .whl-triton/triton371-slim.tar.xz ] && [ ! -d $T371/triton ]; then
  rm -rf $T371.new && mkdir -p $T371.new && tar -C $T371.new -xJf .whl-triton/triton371-slim.tar.xz && mv $T371.new $T371
fi
# the slim build has no AMD backend: drop its entry point, or backend discovery fails on import
[ -d $T371/triton ] && sed -i '/triton.backends.amd/d' $T371/triton-*.dist-info/entry_points.txt
export PYTHONPATH=$PG_DIR:/tmp/site-xz:/tmp/site
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(), 'x', torch.cuda.device_count())"
[ -d $T371/triton ] && PYTHONPATH=$T371:$PYTHONPATH python -c "import triton; print('on request: triton', triton.__version__, 'from', triton.__file__)"
# fla's tuned configurations from earlier runs on this GPU model (bench/fla_configs.py), read in
# strict mode: a tuning key seen before skips fla's autotuning (minutes on a cold machine)
FLA_GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | sed 's/[^0-9A-Za-z]\{1,\}/_/g; s/^_//; s/_$//')
export FLA_GPU
if [ -z "${FLA_CACHE_MODE:-}" ] && [ -n "$FLA_GPU" ] && [ -d "$PWD/bench/fla_configs/$FLA_GPU" ]; then
  export FLA_CONFIG_DIR=$PWD/bench/fla_configs/$FLA_GPU FLA_CACHE_MODE=strict
  echo "fla: tuned configurations from bench/fla_configs/$FLA_GPU ($(ls "$FLA_CONFIG_DIR" | wc -l) kernels, strict)"
fi
set +e
