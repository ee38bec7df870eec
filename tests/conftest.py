import os

import pytest

# The CPU test environment runs our Triton kernels through the interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Property tests are reproducible: the same examples on every run and machine, no example database
# carried between runs. `HYPOTHESIS_PROFILE=explore` draws fresh random examples (for bug hunting).
from hypothesis import settings as _hypothesis_settings

_hypothesis_settings.register_profile("patchgen", derandomize=True, database=None, print_blob=True)
_hypothesis_settings.register_profile("explore", derandomize=False)
_hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "patchgen"))
