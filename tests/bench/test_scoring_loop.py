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
