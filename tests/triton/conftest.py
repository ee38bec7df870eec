"""Our Triton kernels' tests.

Without CUDA every kernel runs through Triton's CPU interpreter, which must be switched on
before triton is imported. On a CUDA machine the kernels are compiled instead (the interpreter
tests then run on the GPU and the `gpu` tests run too); PATCHGEN_TRITON_INTERPRET=1 forces the
interpreter there as well.
"""

import os

import pytest
import torch

_COMPILED = torch.cuda.is_available() and os.environ.get("PATCHGEN_TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "0" if _COMPILED else "1"


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
