import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when a kernel is defined, so this must be decided before anything
# imports triton (torch.cuda.is_available() does not). Where there is no CUDA device our kernels and
# fla's run through Triton's CPU interpreter; on a CUDA machine they are compiled, as in training.
# An explicit TRITON_INTERPRET (or PATCHGEN_TRITON_INTERPRET=1) wins; tests marked `gpu` then skip,
# since the interpreter is not what they check.
_HAS_CUDA = torch.cuda.is_available()


def triton_interpret_setting(environ, has_cuda: bool) -> str:
    """TRITON_INTERPRET for this run: "1" (the CPU interpreter) only where there is no CUDA device or
    where it was asked for."""
    if environ.get("PATCHGEN_TRITON_INTERPRET") == "1":
        return "1"
    return environ.get("TRITON_INTERPRET", "0" if has_cuda else "1")


os.environ["TRITON_INTERPRET"] = triton_interpret_setting(os.environ, _HAS_CUDA)
INTERPRETING = os.environ["TRITON_INTERPRET"] == "1"


def pytest_report_header(config):
    mode = "interpreter (CPU)" if INTERPRETING else "compiled"
    return f"patchgen: CUDA {'available' if _HAS_CUDA else 'not available'}; Triton kernels {mode}"


def marked_gpu(item) -> bool:
    """Whether a test carries the ``gpu`` marker (not merely a keyword ``gpu``: a parameter id "gpu",
    such as the gpu target of a model test, is a keyword too and must not skip it)."""
    return item.get_closest_marker("gpu") is not None


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA and not INTERPRETING:
        return
    reason = ("needs a CUDA device" if not _HAS_CUDA else
              "TRITON_INTERPRET=1 was asked for: the gpu tests check compiled kernels; unset it to run them")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if marked_gpu(item):
            item.add_marker(skip)


# Property tests are reproducible: the same examples on every run and machine, no example database
# carried between runs. `HYPOTHESIS_PROFILE=explore` draws fresh random examples (for bug hunting).
from hypothesis import settings as _hypothesis_settings

_hypothesis_settings.register_profile("patchgen", derandomize=True, database=None, print_blob=True)
_hypothesis_settings.register_profile("explore", derandomize=False)
_hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "patchgen"))


@pytest.fixture(autouse=True)
def _fresh_plan_reuse():
    """Each test starts without the process's kept plans (`shared_prefix/plan_reuse.py`): a test that patches a
    bucket ladder or a level-cost table must not get a plan another test built for the same batch."""
    from patchgen.kernels.shared_prefix.plan_reuse import PLANS

    PLANS.clear()
    yield
    PLANS.clear()
