#!/usr/bin/env bash
# The whole GPU test suite in one device call: every test file with a `gpu` mark, compiled (the
# conftest turns the Triton interpreter on only where there is no CUDA device), under Triton 3.7.1
# when it was carried (fla's GDN backward needs it on Hopper), in parallel workers that share the
# Triton cache. On the H200 it took 171 s of pytest time with 8 workers, cold (docs/bench/README.md).
#   . bench/gpu_env.sh && bash bench/gpu_tests.sh [pytest args]
# PYTHONSAFEPATH, not `python -P`: the workers inherit it, so the checkout's patchgen/ (which has no
# kernels/) does not shadow the package gpu_env.sh staged.
set -uo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests | sort)
export PYTHONSAFEPATH=1 TRITON_CACHE_AUTOTUNING=1
[ -d "${T371:-/nonexistent}/triton" ] && export PYTHONPATH="$T371:$PYTHONPATH"
exec python -m pytest -rs -p no:cacheprovider -n "${WORKERS:-8}" --timeout "${TEST_TIMEOUT:-300}" --durations=15 \
  -m gpu "${files[@]}" "$@"
