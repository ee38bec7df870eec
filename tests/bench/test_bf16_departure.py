"""`bench/bf16_departure.py` on the CPU at tiny widths: it compares what it says and finds a planted departure."""

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import bf16_departure
import row_invariance
from shared_prefix_arms import TINY, our_model
from shared_prefix_shapes import TINY_SHAPES, shape_batch, tree_settings


def tiny_plan(name="system-tree"):
    from patchgen.kernels.shared_prefix import build_plan

    ids, cu, _, _ = shape_batch(TINY_SHAPES[name], TINY["vocab_size"], "cpu")
    return build_plan(ids, cu, **tree_settings(TINY_SHAPES[name]))


def test_expand_like_maps_every_packed_position_to_its_nodes_compact_row():
    plan = tiny_plan()
    compact = torch.randn(1, plan.compact_length, 3)
    packed = plan.expand(compact, 1)
    assert torch.equal(row_invariance.compact_like(plan, packed), compact)
    assert torch.equal(row_invariance.expand_like(plan, compact, packed.shape), packed)
    # rows flattened with heads ([C * H, D], as the gated norm sees them) and `[1, C, ...]` against `[T, ...]`
    flat = compact.reshape(plan.compact_length * 3, 1)
    assert torch.equal(
        row_invariance.expand_like(plan, flat, (plan.packed_length * 3, 1)), packed.reshape(-1, 1)
    )
    assert torch.equal(row_invariance.expand_like(plan, compact, packed.shape[1:]), packed[0])
    assert row_invariance.expand_like(plan, compact, (plan.packed_length + 1, 3)) is None


def test_token_rows_tells_a_row_invariant_op_from_one_that_depends_on_the_row_count():
    plan = tiny_plan()
    x = plan.expand(torch.randn(1, plan.compact_length, 4), 1)
    assert row_invariance.token_rows("silu", torch.nn.functional.silu, (x,), plan).equal
    # a reduction over the rows in the call: each row's result depends on what else is in it
    check = row_invariance.token_rows("centre", lambda t: t - t.mean(1, keepdim=True), (x,), plan)
    assert not check.equal and check.max_abs > 0


def test_token_rows_gives_an_op_that_writes_its_inputs_fresh_copies_for_each_call():
    """Liger's rotary rotates q and k in place: the M=C call must not see rows the M=T call rotated."""
    plan = tiny_plan()
    x = plan.expand(torch.randn(1, plan.compact_length, 4), 1)
    kept = x.clone()
    assert row_invariance.token_rows("double in place", lambda t: t.mul_(2), (x,), plan).equal
    assert torch.equal(x, kept)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_probe_checks_every_gemm_width_and_each_mixer_op(dtype, capsys):
    (summary,) = bf16_departure.main(["--tiny", "--probe", "--dtype", dtype, "--shapes", "system-tree"])
    out = capsys.readouterr().out
    for gemm in ("in_proj_qkv", "out_proj", "q_proj", "o_proj", "down_proj", "lm_head"):
        assert f"F.linear {gemm} " in out
    for op in ("causal_conv1d", "gated_delta_rule", "attention"):
        assert f"{op} one sequence alone" in out
        assert f"{op} shared-prefix" in out
    assert "gated_delta_rule split at rows [64, 128]" in out
    assert "attention rows [0, 64) alone" in out and "attention rows [128, 132) alone (q=4, k=132)" in out
    assert summary.startswith(f"SUMMARY row_invariance [cpu {'float32' if dtype == 'fp32' else 'bfloat16'}]")


def test_model_run_compares_every_sub_module_of_every_layer(capsys):
    (summary,) = bf16_departure.main(
        ["--tiny", "--dtype", "fp32", "--layers", "4", "--shapes", "system-tree"]
    )
    out = capsys.readouterr().out
    for name in (
        "model.embed_tokens",
        "model.layers.0.input_layernorm",
        "model.layers.0.linear_attn.in_proj_qkv",
        "model.layers.0.linear_attn.<causal_conv1d>",
        "model.layers.0.linear_attn.<gated_delta_rule>",
        "model.layers.0.linear_attn.norm",
        "model.layers.0.post_attention_layernorm",
        "model.layers.0.mlp",
        "model.layers.3.self_attn.<rotary>[0]",
        "model.layers.3.self_attn.<attention>",
        "model.layers.3.self_attn.o_proj",
        "model.layers.3 ",
        "model.norm",
        "lm_head",
    ):
        assert f"\n{name}" in out, name
    assert "has no packed twin" not in out and "not called on the shared path" not in out
    # every op of the first GDN layer and the first attention layer replayed on its recorded inputs
    assert "replays of every op of layers [0, 3] and the LM head" in out
    for replayed in (
        "F.linear model.layers.0.linear_attn.out_proj",
        "gated_delta_rule shared-prefix rounds",
        "attention rows [64, 128) alone",
        "model.layers.3.self_attn.<rotary> M=C",
        "F.linear lm_head",
    ):
        assert replayed in out, replayed
    assert "row-variant on recorded inputs: " in summary
    assert summary.startswith("SUMMARY bf16_departure [cpu float32 4L] tiny system tree: loss ")


def test_a_planted_departure_is_named_first_with_equal_inputs_and_replayed(monkeypatch):
    # The shared path's MLP of layer 1 nudges its output: the tool must name it, say its inputs were
    # still equal, and find the MLP not row-invariant when replayed (it is planted on C-row calls).
    built = our_model(TINY, 4, torch.device("cpu"), torch.float32)
    mlp = built.model.layers[1].mlp
    plan = tiny_plan()

    def nudge(module, args, output):
        return output + 1e-3 if output.shape[1] == plan.compact_length else output

    mlp.register_forward_hook(nudge)
    monkeypatch.setattr(bf16_departure, "our_model", lambda *a, **k: built)
    (summary,) = bf16_departure.main(
        ["--tiny", "--dtype", "fp32", "--layers", "4", "--shapes", "system-tree", "--replays", "first"]
    )
    assert "first departure model.layers.1.mlp (Qwen3_5MLP" in summary
    assert "inputs equal" in summary
    assert "NOT: model.layers.1.mlp (Qwen3_5MLP) M=C vs M=T rows" in summary


def test_a_departure_in_the_loss_alone_is_replayed_on_identical_hidden_rows(monkeypatch):
    # Every module equal, the cross-entropy slot nudged on the shared head's (fewer) rows: the tool must
    # find no module departing and the LM head replay must show the loss differing.
    from patchgen.kernels import ops

    built = our_model(TINY, 4, torch.device("cpu"), torch.float32)
    table = ops.of(built)
    original = table.cross_entropy
    plan = tiny_plan()
    fewer = (plan.packed_length + plan.compact_length) // 2  # the packed head scores ~T rows, the shared ~C

    def nudged(rows, *args, **kwargs):
        nll, entropy = original(rows, *args, **kwargs)
        return (nll + 1e-3 if rows.shape[0] < fewer else nll), entropy

    object.__setattr__(table, "cross_entropy", nudged)
    try:
        monkeypatch.setattr(bf16_departure, "our_model", lambda *a, **k: built)
        (summary,) = bf16_departure.main(
            ["--tiny", "--dtype", "fp32", "--layers", "4", "--shapes", "system-tree", "--replays", "first"]
        )
    finally:
        object.__setattr__(table, "cross_entropy", original)
    assert "loss" in summary and "bit-equal False" in summary
    assert "no module or op departs; LM head replay: 0/2 bit-equal" in summary
