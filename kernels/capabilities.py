"""Capability flags a kernel handle declares; features (such as shared-prefix training) require them."""

VARLEN = "varlen"  # takes cu_seqlens over one packed row
INITIAL_STATE = "initial_state"  # accepts an initial recurrent state
INITIAL_STATE_GRAD = "initial_state_grad"  # returns the gradient of the initial state (dh0)
FINAL_STATE_GRAD = "final_state_grad"  # accepts a gradient for the final state (dht)
BOTTOM_RIGHT_CAUSAL = "bottom_right_causal"  # causal mask aligned bottom-right when q_len < k_len
GQA = "gqa"  # grouped query / value heads without materialised repeats
NEEDS_GPU = "needs_gpu"
ENTROPY = "entropy"  # cross_entropy: also returns the per-token entropy (return_entropy=True)
# cross_entropy: reads nothing back to the host, so a loop of scoring calls queues the next call while the device
# runs this one (liger's fused head counts its valid targets on the host first)
SYNC_FREE = "sync_free"
# a row's result has the same bits whatever the call's row count (one launch shape for every size): shared
# (C rows) equals packed (T rows) bit for bit only through ops that have it; declared where it was checked
ROW_INVARIANT = "row_invariant"
FLOAT64 = "float64"  # computes in float64 when given float64 (the references; used by the tests)

# The floating dtypes a backend computes in, by torch name. A handle serves these unless it declares
# fewer (flash attention: half precision only); FLOAT64 adds float64. The dtype an op is called with
# is read at call time (a model can be cast after it is built), see selection.OpTable.
HALF_AND_FLOAT32 = frozenset({"float16", "bfloat16", "float32"})
HALF = frozenset({"float16", "bfloat16"})

ALL = frozenset(
    {
        VARLEN,
        INITIAL_STATE,
        INITIAL_STATE_GRAD,
        FINAL_STATE_GRAD,
        BOTTOM_RIGHT_CAUSAL,
        GQA,
        NEEDS_GPU,
        ENTROPY,
        SYNC_FREE,
        ROW_INVARIANT,
        FLOAT64,
    }
)
