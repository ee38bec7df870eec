"""How liger's fused linear cross-entropy is called: chunks sized by rows, arguments by name."""

import pytest
from patchgen.kernels.backends.flce import LOGIT_ROWS_PER_CHUNK, chunk_mem_const, positional_arguments

QWEN35_VOCAB, QWEN35_4B_HIDDEN = 151936, 2560


def next_pow2(n):
    return 1 << (n - 1).bit_length()


def liger_chunks(rows, hidden, vocab, c):
    """liger-kernel 0.8.5's chunking of fused_linear_cross_entropy_forward: (chunk rows, chunk count)."""
    inc_factor = -(-vocab // (c * hidden))
    chunk = min(next_pow2(-(-rows // inc_factor)), rows)
    return chunk, -(-rows // chunk)


@pytest.mark.parametrize("rows", [1, 300, 2048, 2049, 6144, 12288, 34816, 69632, 200_000])
def test_chunk_count_follows_rows_and_logits_stay_bounded(rows):
    chunk, count = liger_chunks(rows, QWEN35_4B_HIDDEN, QWEN35_VOCAB,
                                chunk_mem_const(rows, QWEN35_4B_HIDDEN, QWEN35_VOCAB))
    wanted = -(-rows // LOGIT_ROWS_PER_CHUNK)
    default_chunk, default_count = liger_chunks(rows, QWEN35_4B_HIDDEN, QWEN35_VOCAB, 1)
    assert count <= max(wanted + 1, 1) and count <= default_count
    # never more logits at once than twice the budget, or than liger's own default where that is more
    assert chunk <= max(2 * LOGIT_ROWS_PER_CHUNK, default_chunk)


def test_liger_default_would_split_a_shared_prefix_step_into_dozens_of_chunks():
    # why the budget exists: liger's own default (c = 1) cuts 6144 rows into 48 chunks
    assert liger_chunks(6144, QWEN35_4B_HIDDEN, QWEN35_VOCAB, 1)[1] == 48
    assert liger_chunks(6144, QWEN35_4B_HIDDEN, QWEN35_VOCAB, chunk_mem_const(6144, QWEN35_4B_HIDDEN, QWEN35_VOCAB))[1] == 6


def forward_085(ctx, _input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
                use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False, ce_impl=None,
                ce_mode=None, chunk_mem_const=1):
    """liger-kernel 0.8.5's LigerFusedLinearCrossEntropyFunction.forward signature."""


def forward_without_budget(ctx, _input, weight, target, bias=None, ce_weight=None, ignore_index=-100,
                           lse_square_scale=0.0, label_smoothing=0.0, reduction="mean"):
    """An older release: no chunk_mem_const."""


def test_arguments_land_in_their_positions_with_defaults_between():
    args = positional_arguments(forward_085, _input="h", weight="w", target="y", ignore_index=-1, reduction="none",
                                chunk_mem_const=20)
    assert args[:9] == ["h", "w", "y", None, None, -1, 0.0, 0.0, "none"]
    assert len(args) == 18 and args[-1] == 20


def test_a_release_without_the_budget_gets_the_old_call():
    args = positional_arguments(forward_without_budget, _input="h", weight="w", target="y", ignore_index=-1,
                                reduction="none", chunk_mem_const=20)
    assert args == ["h", "w", "y", None, None, -1, 0.0, 0.0, "none"]


def test_a_missing_required_argument_is_named():
    with pytest.raises(TypeError, match="target"):
        positional_arguments(forward_085, _input="h", weight="w")
