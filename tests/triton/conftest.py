"""Our Triton kernels' tests.

tests/conftest.py decides, before triton is imported, whether kernels run through Triton's CPU
interpreter (no CUDA device, or PATCHGEN_TRITON_INTERPRET=1 / TRITON_INTERPRET=1 asked for) or
compiled on the GPU; the small-shape tests follow that choice.
"""

import os

import pytest
import torch

_COMPILED = os.environ.get("TRITON_INTERPRET") != "1"


@pytest.fixture
def device() -> str:
    """Where the small-shape tests put their tensors: the interpreter takes CPU tensors."""
    return "cuda" if _COMPILED else "cpu"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# triton_helpers.py sits beside this file; pytest's importlib mode does not put it on sys.path.
import sys

sys.path.insert(0, os.path.dirname(__file__))
