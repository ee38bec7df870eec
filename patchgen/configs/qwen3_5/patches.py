"""The Qwen3.5 patch list, shared by every device target (devices differ in op-slot defaults only)."""

from __future__ import annotations

from patchgen.spec import PatchConfig

BODIES = "patchgen.configs.qwen3_5.bodies"
# transformers' generic task heads, which build their backbone with AutoModel (upstream's model)
TASK_HEADS = ("Qwen3_5ForTokenClassification", "Qwen3_5TextForSequenceClassification", "Qwen3_5ForSequenceClassification")


def dense_config(device: str, op_defaults: dict[str, str]) -> PatchConfig:
    config = PatchConfig("qwen3_5", device, bodies=BODIES, op_defaults=op_defaults)
    config.add_method("Qwen3_5PreTrainedModel.post_init", reason="resolve the op slots once per model build (ops.bind)")
    config.add_method(
        "Qwen3_5PreTrainedModel.from_pretrained",
        reason="patchgen's config fields as from_pretrained keywords or on a composite config, set on the text config the model reads",
    )
    config.add_method(
        "Qwen3_5PreTrainedModel._from_config",
        reason="a composite config given to a text class: its patchgen fields moved to the text config it builds from",
    )
    config.add_method(
        "Qwen3_5PreTrainedModel.is_custom_code",
        reason="upstream's weights and names: transformers' checkpoint conversions and weight init apply",
    )
    config.override_method("Qwen3_5RMSNorm.forward", reason="zero-centred RMSNorm through ops.rms_norm")
    config.override_method("Qwen3_5RMSNormGated.forward", reason="gated RMSNorm through ops.rms_norm_gated")
    config.override_method("Qwen3_5MLP.forward", reason="SwiGLU MLP through ops.swiglu_mlp")
    config.override_method(
        "Qwen3_5GatedDeltaNet.forward",
        reason="varlen conv and delta rule through ops (no leak across packed sequences, prefill too); shared-prefix rounds",
    )
    config.add_method("Qwen3_5GatedDeltaNet._cached_mix", reason="upstream's cached conv and delta rule, for decode steps")
    config.override_method(
        "Qwen3_5Attention.forward", reason="rotary through ops.rotary; varlen ops.attention when packed or shared-prefix"
    )
    config.override_method("Qwen3_5DecoderLayer.forward", reason="thread packed metadata / shared-prefix plan to both mixers")
    config.override_method(
        "Qwen3_5TextModel.forward",
        reason="compact row under a shared-prefix plan; packed rows checked or read from position_ids; no [T, T] mask; "
        "the layer stack through layer_graphs (opt-in CUDA graphs)",
    )
    config.override_method(
        "Qwen3_5Model.__init__", reason="build this module's patched text model (AutoModel would build upstream's)"
    )
    for task in TASK_HEADS:
        # the two sequence heads are built alike: one body
        body = "Qwen3_5TextForSequenceClassification" if task.endswith("ForSequenceClassification") else task
        config.add_method(
            f"{task}.__init__",
            reason="the task head on this module's backbone (transformers' generic head builds upstream's with AutoModel)",
            body=f"{BODIES}:{body}.__init__",
        )
    config.override_method(
        "Qwen3_5ForCausalLM.forward", reason="shared-prefix plan and guards; LM head through ops.cross_entropy with row dedup"
    )
    config.override_method(
        "Qwen3_5ForConditionalGeneration.forward",
        reason="shared-prefix plan (text only) and guards; LM head through ops.cross_entropy with row dedup",
    )
    return config
