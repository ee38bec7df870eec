"""`bench/shared_prefix_buckets.py` (host only): the padding it reports per mixer is the plan's own."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import shared_prefix_buckets
from patchgen.kernels.shared_prefix import bucket, build_plan


class _Spread:
    vary_prompt, vary_response, draw, seed = 0.1, 0.5, "buckets", 0


@pytest.mark.parametrize("shape", ["4x256x64", "agentic"])
def test_the_padded_counts_are_the_plans_and_lm_rows_are_never_padded(shape):
    rows, settings = shared_prefix_buckets._shape_rows(shape, 2, _Spread, random.Random(0))
    ids, cu = rows[0]
    plain = build_plan(ids, cu, conv_kernel_size=4, **settings)
    padded = build_plan(ids, cu, conv_kernel_size=4, pad_to_bucket=True, **settings)
    ratios = shared_prefix_buckets.ratios(plain, padded)
    assert ratios["C"] == padded.compact_length / plain.compact_length > 1
    assert ratios["lm_rows"] == 1.0
    rounds = [r for r in padded.gdn.rounds]
    assert ratios["gdn1_chunks"] == rounds[1].chunk_indices.shape[0] / plain.gdn.rounds[1].chunk_indices.shape[0]
    # a weighted mean of the mixers' ratios: above 1 (the compact row is padded), at most the largest of them
    assert 1 < ratios["work"] <= max(v for k, v in ratios.items() if k != "work")


def test_drawn_lengths_vary_and_a_tree_keeps_its_shape():
    rows, settings = shared_prefix_buckets._shape_rows("agentic", 3, _Spread, random.Random(0))
    assert len({r[0].shape[1] for r in rows}) == 3  # lengths drawn anew every step
    plans = [build_plan(ids, cu, conv_kernel_size=4, **settings) for ids, cu in rows]
    assert all(p.depth == plans[0].depth > 1 for p in plans)  # the turns stay shared: a tree every step
    assert len({len(p.gdn.rounds) for p in plans}) == 1


def test_the_bench_weighs_gdn_chunks_and_conv_rows_as_the_bucket_choice_does():
    assert shared_prefix_buckets.COST["gdn_chunk"] == bucket.GDN_CHUNK_COST
    assert shared_prefix_buckets.COST["conv_row"] == bucket.CONV_ROW_COST


# `--compact-ladder` is the A/B of `bucket.COMPACT_RATIO`, `--reuse` of `bucket.REUSE` (how much more than its own
# bucket a layout may pad to, to replay a held graph rather than capture), under RL-like variation: the same
# drawn batches, each setting's buckets; the finer ladder and the lower bound pad fewer compact rows
@pytest.mark.parametrize(
    "option, coarse, fine, knob, printed, bad, refusal",
    [
        ("--compact-ladder", "17/16", "65/64", ("COMPACT_RATIO", (65, 64)), "ladder for this run", "16/17", "--compact-ladder"),
        ("--reuse", "1.4", "1.02", ("REUSE", 1.02), "reuse bound of held buckets for this run", "0.9", "--reuse: 0.9 is below 1"),
    ],
)
def test_a_finer_bucket_setting_pads_the_same_draw_with_fewer_compact_rows(
    monkeypatch, capsys, option, coarse, fine, knob, printed, bad, refusal
):
    monkeypatch.setattr(bucket, knob[0], getattr(bucket, knob[0]))  # restored after the test
    compact = {}
    for value in (coarse, fine):
        shared_prefix_buckets.main(["--steps", "12", "--cache", "2", "--shapes", "4x512x128", option, value])
        out = capsys.readouterr().out
        assert f"{printed}: {value}" in out
        compact[value] = float(out.split(" C x")[1].split()[0])
    assert getattr(bucket, knob[0]) == knob[1]
    assert 1 <= compact[fine] < compact[coarse]
    with pytest.raises(SystemExit, match=refusal):
        shared_prefix_buckets.main([option, bad])


def test_the_loops_own_draw_scored_again_replays_what_the_first_cycle_captured(capsys):
    """`--draw loop --cycles N`: the micro-batches `scoring_loop.py --vary` scores, again and again as its warm and
    timed loops do; with a cache holding every bucket the later cycles capture nothing (three steps: too few for rent
    or buy to buy, so `--policy regret` is checked to run and to agree here)."""
    for policy in ("bound", "regret"):
        shared_prefix_buckets.main(["--draw", "loop", "--steps", "3", "--cycles", "2", "--cache", "8",
                                    "--shapes", "4x512x128", "--policy", policy])
        out = capsys.readouterr().out
        assert "3 steps of" in out and "capture share 0.00" in out


def test_the_bucket_bench_refuses_no_cycles_and_a_loop_draw_of_an_rl_shape():
    with pytest.raises(SystemExit, match="--cycles: 0 is below 1"):
        shared_prefix_buckets.main(["--cycles", "0"])
    with pytest.raises(SystemExit, match="--draw loop draws around GPU-bench shapes"):
        shared_prefix_buckets.main(["--draw", "loop", "--shapes", next(iter(shared_prefix_buckets.RL_SHAPES))])
