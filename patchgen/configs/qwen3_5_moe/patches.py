"""Qwen3.5-MoE = Qwen3.5's patch list through the rename map, plus the MoE-only patches."""

from __future__ import annotations

from patchgen.configs.qwen3_5.patches import TASK_HEADS
from patchgen.spec import PatchConfig, Renames

BODIES = "patchgen.configs.qwen3_5_moe.bodies"
RENAMES = Renames(
    prefixes={"Qwen3_5": "Qwen3_5Moe"},
    modules={"qwen3_5": "qwen3_5_moe", "modeling_qwen3_5": "modeling_qwen3_5_moe"},
    # The MoE text model returns the MoE output class (same fields as far as the body fills them).
    names={"BaseModelOutputWithPast": "MoeModelOutputWithPast"},
)


def moe_config(dense: PatchConfig, op_defaults: dict[str, str]) -> PatchConfig:
    config = dense.derive(model="qwen3_5_moe", renames=RENAMES, op_defaults=op_defaults)
    # upstream's MoE module has no task heads
    config.patches = [p for p in config.patches if p.target.split(".")[0] not in TASK_HEADS]
    # ForCausalLM and ForConditionalGeneration carry the auxiliary loss: the MoE bodies below
    # supersede the inherited Qwen3.5 patches of the same targets.

    def own(target: str, reason: str) -> None:
        config.override_method(target, reason=reason, body=f"{BODIES}:{target}")

    config.replace_class(
        "Qwen3_5MoeExperts",
        reason=(
            "experts through ops.moe_experts, without upstream's experts-implementation dispatch; "
            "load_state_dict fuses a checkpoint's per-expert tensors (Trainer's resume)"
        ),
        body=f"{BODIES}:Qwen3_5MoeExperts",
    )
    config.add_method(
        "Qwen3_5MoePreTrainedModel._can_set_experts_implementation",
        reason="experts_implementation is always settable: it maps onto the moe_experts op slot",
        body=f"{BODIES}:Qwen3_5MoePreTrainedModel._can_set_experts_implementation",
    )
    config.add_method(
        "Qwen3_5MoePreTrainedModel._check_and_adjust_experts_implementation",
        reason="an unset experts_implementation stays unset: the moe_experts op slot decides",
        body=f"{BODIES}:Qwen3_5MoePreTrainedModel._check_and_adjust_experts_implementation",
    )
    config.add_method(
        "Qwen3_5MoePreTrainedModel.set_experts_implementation",
        reason="a new experts_implementation re-resolves the op slots (moe_experts follows it)",
        body=f"{BODIES}:Qwen3_5MoePreTrainedModel.set_experts_implementation",
    )
    own(
        "Qwen3_5MoeForCausalLM.forward",
        "shared-prefix plan and guards; LM head through ops.cross_entropy; aux loss over packed tokens",
    )
    own(
        "Qwen3_5MoeForConditionalGeneration.forward",
        "shared-prefix plan (text only); LM head through ops.cross_entropy; aux loss over packed tokens",
    )
    return config
