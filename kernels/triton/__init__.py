"""Our portable Triton kernels: the `triton` backend of the op slots (the npu target's default).

Plain Triton only (no inline assembly, no TMA-only paths, no vendor intrinsics), block sizes as
parameters; on CPU the same source runs under TRITON_INTERPRET=1.
"""

from ..capabilities import FINAL_STATE_GRAD, GQA, INITIAL_STATE, INITIAL_STATE_GRAD, ROW_INVARIANT, VARLEN
from .causal_conv1d import causal_conv1d
from .causal_conv1d_state import LookBack
from .gated_delta_rule import gated_delta_rule
from .rms_norm_gated import rms_norm_gated

__all__ = ["CAPABILITIES", "causal_conv1d", "gated_delta_rule", "rms_norm_gated"]

# What each op of this backend can serve, for its kernel handle (shared-prefix training needs
# varlen + initial-state gradient from the GDN backend, varlen from the conv; a conv with the
# initial-state gradient also takes the look-back as an initial state).
CAPABILITIES = {
    "gated_delta_rule": frozenset({VARLEN, GQA, INITIAL_STATE, INITIAL_STATE_GRAD, FINAL_STATE_GRAD}),
    "causal_conv1d": frozenset({VARLEN, INITIAL_STATE, INITIAL_STATE_GRAD}),
    "rms_norm_gated": frozenset({ROW_INVARIANT}),
}

causal_conv1d.look_back = LookBack()  # state kernels for the shared-prefix conv (shared_prefix/conv.py)
