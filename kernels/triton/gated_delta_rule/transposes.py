"""How the GDN backward kernels get their transposed tiles (a launch choice, timed by
`bench/triton_tuning.py --sweep --only transposes`).

"loaded": the first design: a transposed tile is loaded again with transposed offsets, or computed as
a product of its own (dA and dA^T, the inverse's gradient and its transpose, dP and dP^T).
"trans": `tl.trans` of the one tile (fewer loads and products). "trans-wy": only the WY backward so.
"trans-half": "trans", and dq, dk per value head stored in the input dtype (bf16) instead of fp32 when
the l2norm backward is their only reader (it sums the value heads in fp32): 2 x 268 MB fewer bytes a
backward at Qwen3.5-4B widths, for one more rounding of each per-head gradient (as fla stores them).
The tuning table (key `gated_delta_rule_transposes`) picks one per GPU model; the code's default stays
"loaded" until a GPU run shows another faster.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..launch_config import table_config


@dataclass(frozen=True)
class TransposeTuning:
    wy_bwd: bool = False
    output_bwd: bool = False
    half_dqk: bool = False  # dq, dk per value head in the input dtype when only the l2norm backward reads them


PRESETS = {
    "loaded": TransposeTuning(),
    "trans-wy": TransposeTuning(wy_bwd=True),
    "trans": TransposeTuning(wy_bwd=True, output_bwd=True),
    "trans-half": TransposeTuning(wy_bwd=True, output_bwd=True, half_dqk=True),
}
DEFAULT = PRESETS["loaded"]
TUNING: TransposeTuning | None = None  # a process-wide choice (tests, the bench); None: the table's, else DEFAULT


def transpose_tuning(device) -> TransposeTuning:
    """The design a backward on `device` uses."""
    return TUNING or table_config("gated_delta_rule_transposes", PRESETS, DEFAULT, device, "GDN transposes")
