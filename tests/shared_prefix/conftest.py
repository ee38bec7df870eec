import importlib.util
import pathlib

import pytest
import torch

_spec = importlib.util.spec_from_file_location(
    "shared_prefix_references", pathlib.Path(__file__).with_name("references.py")
)
references = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(references)


@pytest.fixture(scope="session")
def ref():
    """Float64 references and batch helpers (tests/shared_prefix/references.py)."""
    return references


@pytest.fixture(autouse=True)
def _float64_seed():
    torch.manual_seed(0)
