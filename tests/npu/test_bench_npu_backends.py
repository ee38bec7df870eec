"""bench/npu_backends.py at tiny widths on the fake: every torch_npu backend gets a timed, checked row."""

import csv
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_every_slot_gets_a_row_per_backend_with_small_errors(npu, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import npu_backends

    out = tmp_path / "npu.csv"
    device = "npu" if npu.real else "cpu"
    code = npu_backends.main(["--tiny", "--tokens", "40", "--device", device, "--repeats", "1", "--warmup", "0",
                              "--csv", str(out)])
    assert code == 0
    rows = list(csv.DictReader(out.open()))
    assert [(r["slot"], r["backend"]) for r in rows] == [
        (slot, name) for slot, pair in npu_backends.PAIRS.items() for name in pair[:2]
    ]
    for row in rows:
        assert row["note"] == "" and float(row["ms_fwd_bwd"]) > 0, row
        bound = 1e-2 if npu.real else 1e-5  # bf16 on the NPU, float32 on the fake
        assert float(row["out_rel_err"]) < bound and float(row["max_grad_rel_err"]) < bound, row
    sys.modules.pop("npu_backends", None)
