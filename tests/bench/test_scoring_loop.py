"""`bench/scoring_loop.py` at tiny widths on the CPU: every arm runs, host rows score as device rows."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import scoring_loop


def test_the_loop_times_every_arm_and_host_rows_score_as_device_rows():
    (row,) = scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "4x128x32", "--batches", "2", "--repeats", "1"])
    assert (row["T"], row["C"]) == (4 * 160, 128 + 4 * 32)
    for arm in ("packed", "shared"):
        assert row[f"{arm} host rows bit-equal"] is True
        assert row[f"{arm} device rows ms"] > 0 and row[f"{arm} host rows ms"] > 0
    assert 0 < row["shared host rows host ms"] <= row["shared host rows ms"] * 1.001
    assert row["efficiency host rows"] == row["packed host rows ms"] / row["shared host rows ms"] / (640 / 256)


def test_response_labels_score_the_last_tokens_of_each_sequence_only():
    import torch

    ids = torch.arange(10, 20).unsqueeze(0)
    cu = torch.tensor([0, 6, 10])
    labels = scoring_loop.response_labels(ids, cu, 2)
    # sequence [10..15]: positions 3 and 4 predict 14 and 15; sequence [16..19]: positions 7 and 8 predict 18, 19
    assert labels.tolist() == [[-100, -100, -100, 14, 15, -100, -100, 18, 19, -100]]


def test_the_labelled_loop_scores_as_the_trainer_does():
    (row,) = scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "4x128x32", "--batches", "2", "--repeats", "1",
                                "--labels"])
    assert row["packed host rows bit-equal"] is True and row["shared host rows bit-equal"] is True


def test_the_eager_arm_scores_as_the_shared_one_off_cuda():
    (row,) = scoring_loop.main(["--tiny", "--layers", "4", "--shapes", "4x128x32", "--batches", "2", "--repeats", "1",
                                "--eager"])
    assert row["shared eager host rows ms"] > 0 and "shared eager device rows ms" not in row
    assert row["shared eager bit-equal to shared"] is True  # off CUDA neither arm graphs nor pads
    assert row["efficiency eager host rows"] == row["packed host rows ms"] / row["shared eager host rows ms"] / (640 / 256)
