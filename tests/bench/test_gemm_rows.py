"""`bench/gemm_rows.py` on the CPU at tiny widths: it finds every projection of a 4-layer group and runs each row count."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import gemm_rows


def test_every_projection_of_the_group_runs_at_every_row_count():
    found, shapes = gemm_rows.main(["--tiny", "--rows", "64,65"])
    assert list(found) == [64, 65]
    assert len(shapes) == 31  # per GDN layer 5 (qkv, z, b, a, out), the attention layer 4, every MLP 3


def test_the_projections_are_the_layers_own_shapes():
    widths = dict(gemm_rows.TINY, hidden_size=96, intermediate_size=160, linear_num_value_heads=4,
                  linear_value_head_dim=20)
    shapes = gemm_rows.projections(widths)
    assert shapes.count((96, 160)) == 8 and shapes.count((160, 96)) == 4  # gate and up, down: four MLPs
    assert shapes.count((4 * 20, 96)) == 3  # the three GDN layers' output projections
