"""Shared-prefix training: compute each prompt shared by several packed sequences once.

`build_plan` arranges the sequences of one packed micro-batch in a prefix tree and lays out the
compact row; the mixers run Gated DeltaNet, the causal conv and attention on it through op-slot
backends with a number of calls per layer that grows with the tree's depth only; `Plan.lm_rows` and `shared_prefix_loss` keep the LM head and
the loss exact. The algorithm is written down in `shared/shared_prefix.md`.
"""

from .attention import AttentionIndex, attention_kv, shared_prefix_attention
from .call_graphs import CallGraphUnavailable, release_call_graphs
from .conv import ConvIndex, shared_prefix_causal_conv1d
from .gdn import GDNIndex, GDNRound, shared_prefix_gated_delta_rule
from .grouping import Group
from .guards import (
    ATTENTION_NEEDS,
    CONV_NEEDS,
    GDN_NEEDS,
    BitIdentityNotGuaranteed,
    PackedMetadataMissing,
    check_attention_backend,
    check_conv_backend,
    check_gdn_backend,
    has_media,
    reject_unsupported,
    require_packed_metadata,
    takes_ordinary_path,
    warn_row_count_dependent,
)
from .level_cost import ENV_LEVEL_COST, LEVEL_COST_TOKENS, LevelCost, resolve_level_cost
from .lm_rows import LMIndex, LMRows, shared_prefix_loss
from .plan import DEFAULT_MAX_DEPTH, Plan, build_plan
from .positions import positions_from_cu_seqlens
from .tree import Node

__all__ = [
    "ATTENTION_NEEDS",
    "CONV_NEEDS",
    "DEFAULT_MAX_DEPTH",
    "ENV_LEVEL_COST",
    "GDN_NEEDS",
    "LEVEL_COST_TOKENS",
    "AttentionIndex",
    "BitIdentityNotGuaranteed",
    "CallGraphUnavailable",
    "ConvIndex",
    "GDNIndex",
    "GDNRound",
    "Group",
    "LMIndex",
    "LMRows",
    "LevelCost",
    "Node",
    "PackedMetadataMissing",
    "Plan",
    "attention_kv",
    "build_plan",
    "check_attention_backend",
    "check_conv_backend",
    "check_gdn_backend",
    "has_media",
    "positions_from_cu_seqlens",
    "reject_unsupported",
    "release_call_graphs",
    "require_packed_metadata",
    "resolve_level_cost",
    "shared_prefix_attention",
    "shared_prefix_causal_conv1d",
    "shared_prefix_gated_delta_rule",
    "shared_prefix_loss",
    "takes_ordinary_path",
    "warn_row_count_dependent",
]
