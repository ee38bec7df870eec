"""The suite compiles Triton kernels where there is a GPU and interprets them only where there is none
(issue 14 item 12: the interpreter on the H200 failed fla and bent our bf16 bounds)."""

import pytest

from tests.conftest import triton_interpret_setting


def test_triton_kernels_are_compiled_where_there_is_a_gpu():
    assert triton_interpret_setting({}, has_cuda=True) == "0"


def test_triton_kernels_are_interpreted_where_there_is_no_gpu():
    assert triton_interpret_setting({}, has_cuda=False) == "1"


def test_an_explicit_triton_interpret_wins_either_way():
    assert triton_interpret_setting({"TRITON_INTERPRET": "1"}, has_cuda=True) == "1"
    assert triton_interpret_setting({"TRITON_INTERPRET": "0"}, has_cuda=False) == "0"


def test_patchgen_triton_interpret_forces_the_interpreter():
    assert triton_interpret_setting({"PATCHGEN_TRITON_INTERPRET": "1", "TRITON_INTERPRET": "0"}, has_cuda=True) == "1"


@pytest.mark.parametrize("target", ["gpu"])
def test_a_parameter_id_gpu_is_not_the_gpu_marker(request, target):
    """A CPU test parametrized over the gpu target runs; before, the id matched the keyword and skipped it."""
    from tests.conftest import marked_gpu

    assert not marked_gpu(request.node)


@pytest.mark.gpu
def test_the_gpu_marker_is_seen(request):
    from tests.conftest import marked_gpu

    assert marked_gpu(request.node)  # runs where CUDA is; skipped here by that very marker
