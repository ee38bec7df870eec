"""next_token_labels on short rows and one-token sequences (a mutation gap of issue 14)."""

import pytest
import torch
from patchgen.kernels.modeling.packing import next_token_labels

I = -100


@pytest.mark.parametrize(
    "row, expected",
    [([7], [I]), ([7, 8], [8, I]), ([7, 8, 9], [8, 9, I])],
)
def test_unpacked_short_rows(row, expected):
    assert next_token_labels(torch.tensor([row]), None).tolist() == [expected]


def test_every_row_of_a_batch_ends_with_ignore():
    ids = torch.tensor([[1, 2], [3, 4]])
    assert next_token_labels(ids, None).tolist() == [[2, I], [4, I]]


def test_one_token_sequences_are_all_ignore():
    cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    assert next_token_labels(torch.tensor([[5, 6, 7]]), cu).tolist() == [[I, I, I]]


def test_one_token_sequence_between_longer_ones():
    cu = torch.tensor([0, 2, 3, 5], dtype=torch.int32)
    assert next_token_labels(torch.tensor([[1, 2, 3, 4, 5]]), cu).tolist() == [[2, I, I, 5, I]]


def test_single_sequence_cu_seqlens_equals_no_cu_seqlens():
    ids = torch.tensor([[4, 5, 6]])
    cu = torch.tensor([0, 3], dtype=torch.int32)
    assert next_token_labels(ids, cu).tolist() == next_token_labels(ids, None).tolist() == [[5, 6, I]]


def test_custom_ignore_index():
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    assert next_token_labels(torch.tensor([[1, 2, 3]]), cu, ignore_index=-1).tolist() == [[-1, 3, -1]]
