#!/usr/bin/env bash
# Source this on the lent GPU machine (offline image: Python 3.12, torch 2.11, Triton 3.6.0):
#   . bench/gpu_env.sh            # our pinned transformers, fla-core, liger from the carried .whl/
#   . bench/gpu_env.sh triton371  # also Triton 3.7.1, joined beforehand into /tmp/t.whl (see docs/bench/README.md)
# The package is staged as plain folders (patchgen/, with kernels/, generated/, templates/ inside):
# the image's setuptools editable install does not map patchgen.kernels.
set -e
pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
rm -rf /tmp/pg && mkdir -p /tmp/pg/patchgen
cp -r patchgen/. /tmp/pg/patchgen/
cp -r kernels /tmp/pg/patchgen/kernels
cp -r generated /tmp/pg/patchgen/generated
cp -r templates /tmp/pg/patchgen/templates
export PYTHONPATH=/tmp/pg:/tmp/site
if [ "${1:-}" = "triton371" ]; then
  pip install -q --no-index --no-deps --target /tmp/t371 /tmp/t.whl
  export PYTHONPATH=/tmp/t371:$PYTHONPATH
fi
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
set +e
