"""Replacement bodies that only Qwen3.5-MoE has (the rest are Qwen3.5's, renamed).

The text model, the causal LM and the conditional-generation forwards differ from Qwen3.5's in
their output types and the load-balancing auxiliary loss, which under a shared-prefix plan counts
every packed token with its multiplicity (router logits expanded to the packed row).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as upstream
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    ACT2FN,
    BaseModelOutputWithPooling,
    Cache,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
    Qwen3_5MoeCausalLMOutputWithPast,
    TransformersKwargs,
    Unpack,
    load_balancing_loss_func,
)

from patchgen.kernels import ops
from patchgen.kernels.modeling import expert_weights, host_rows, shared_prefix, verify
from patchgen.kernels.modeling.boundaries import resolve_packed
from patchgen.kernels.modeling.generation import routed_tokens_mask, settle_use_cache, use_cache_for
from patchgen.kernels.modeling.lm_head import HeadRequest, causal_lm_head
from patchgen.kernels.shared_prefix import has_media

# Stand-in for the constant the generator writes into each generated module (as in Qwen3.5's bodies).
PATCHGEN_OP_DEFAULTS: dict[str, str] = {}


class Qwen3_5MoeExperts(nn.Module):
    """Collection of expert weights stored as 3D tensors, computed through the `moe_experts` op slot.

    Replaces upstream's class to drop transformers' experts dispatch: the op slot is the one place
    that picks the experts kernel, and `experts_implementation` maps onto it (weights, names and
    init are upstream's). `load_state_dict` also takes a checkpoint's per-expert tensors, as
    `from_pretrained` does (Trainer's resume loads checkpoints through it).
    """

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]
        self.register_load_state_dict_pre_hook(expert_weights.fuse_per_expert_weights)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        return ops.of(self).moe_experts(
            hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, self.act_fn
        )


class Qwen3_5MoePreTrainedModel(upstream.Qwen3_5MoePreTrainedModel):
    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        # transformers guesses this from the module source; here requests map onto the moe_experts op slot,
        # which refuses the names it has no backend for (docs/kernel_selection.md).
        return True

    def _check_and_adjust_experts_implementation(self, experts_implementation: str | None) -> str | None:
        # Not asked stays None instead of transformers' "grouped_mm": the moe_experts op slot then picks
        # the kernel, and an explicit request maps onto that slot (docs/kernel_selection.md).
        if experts_implementation is None:
            return None
        return super()._check_and_adjust_experts_implementation(experts_implementation)

    def set_experts_implementation(self, experts_implementation: str | dict):
        super().set_experts_implementation(experts_implementation)
        # The op table is resolved once per build; a new experts request resolves it again.
        ops.bind(self, self.config, defaults=PATCHGEN_OP_DEFAULTS)


class Qwen3_5MoeForCausalLM(upstream.Qwen3_5MoeForCausalLM):
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        r"""
        Packed rows: pass `cu_seq_lens_q/k` and `max_length_q/k`. With `text_config.shared_prefix_training`
        each prompt shared by several packed sequences runs once (routing on the compact row, the
        auxiliary loss over the packed tokens). `return_log_probs=True` and `return_entropy=True` add
        per-token `log_probs` and `entropy` (`[1, T]`); `return_logits=False` skips the logits.
        """
        # a packed row handed over on the host is uploaded here; the plan reads the host copy (no sync)
        input_ids, position_ids, attention_mask, labels, kwargs, uploaded = host_rows.upload(
            self, input_ids, position_ids, attention_mask, labels, kwargs
        )
        if verify.due(self, input_ids, position_ids, cache, use_cache, kwargs, attention_mask=attention_mask):
            # First use (or a longer row than verified): run shared and packed, compare, keep the checked result.
            return verify.run(self, dict(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, output_router_logits=output_router_logits, logits_to_keep=logits_to_keep, **kwargs,
            ))
        request = HeadRequest.pop(kwargs, uploaded)
        output_router_logits = (
            output_router_logits if output_router_logits is not None else self.config.output_router_logits
        )
        kwargs = resolve_packed(
            kwargs, position_ids, input_ids if input_ids is not None else inputs_embeds, cache, attention_mask=attention_mask, uploaded=uploaded
        )
        position_ids = shared_prefix.packed_positions(position_ids, input_ids, inputs_embeds, cache, kwargs)
        plan = None if not verify.sharing_allowed(self) else shared_prefix.plan_for(
            self.config, ops.of(self), input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=use_cache, kwargs=kwargs, uploaded=uploaded
        )
        model_kwargs = kwargs if plan is None else {**kwargs, "shared_prefix": plan}
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache_for(use_cache, cache, self.config, self) if plan is None else False,
            output_router_logits=output_router_logits,
            **model_kwargs,
        )

        head = causal_lm_head(
            self.lm_head,
            ops.of(self),
            outputs.last_hidden_state,
            plan=plan,
            labels=labels,
            input_ids=input_ids,
            logits_to_keep=logits_to_keep,
            request=request,
            kwargs=kwargs,
        )
        loss = head.loss

        aux_loss = None
        router_logits = shared_prefix.expand_router_logits(plan, outputs.router_logits)
        if output_router_logits:
            aux_loss = load_balancing_loss_func(
                router_logits,
                self.num_experts,
                self.num_experts_per_tok,
                routed_tokens_mask(attention_mask, router_logits),
            )
            if loss is not None:  # a loss from labels or from pre-shifted shift_labels
                loss += self.router_aux_loss_coef * aux_loss.to(loss.device)  # make sure to reside in the same device

        output = MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=head.logits,
            cache=outputs.cache,
            hidden_states=shared_prefix.expand_hidden_states(plan, outputs.hidden_states),
            attentions=outputs.attentions,
            router_logits=router_logits,
        )
        return head.attach(output)


class Qwen3_5MoeForConditionalGeneration(upstream.Qwen3_5MoeForConditionalGeneration):
    def forward(
        self,
        input_ids: torch.LongTensor = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        pixel_values: torch.Tensor | None = None,
        pixel_values_videos: torch.Tensor | None = None,
        image_grid_thw: torch.LongTensor | None = None,
        video_grid_thw: torch.LongTensor | None = None,
        mm_token_type_ids: torch.IntTensor | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple | Qwen3_5MoeCausalLMOutputWithPast:
        r"""
        As upstream, plus packed rows and shared-prefix training (text only: with media the ordinary
        path runs); `return_log_probs`, `return_entropy` and `return_logits` as in ForCausalLM.
        """
        # a packed row handed over on the host is uploaded here; the plan reads the host copy (no sync)
        input_ids, position_ids, attention_mask, labels, kwargs, uploaded = host_rows.upload(
            self, input_ids, position_ids, attention_mask, labels, kwargs
        )
        media = (pixel_values, pixel_values_videos, mm_encoder_outputs)
        if verify.due(
            self, input_ids, position_ids, cache, kwargs.get("use_cache"), kwargs, *media, attention_mask=attention_mask
        ):
            # First use (or a longer row than verified): run shared and packed, compare, keep the checked result.
            return verify.run(self, dict(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                inputs_embeds=inputs_embeds, labels=labels, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                mm_token_type_ids=mm_token_type_ids, output_router_logits=output_router_logits, logits_to_keep=logits_to_keep,
                mm_encoder_outputs=mm_encoder_outputs, **kwargs,
            ))
        request = HeadRequest.pop(kwargs, uploaded)
        output_router_logits = (
            output_router_logits if output_router_logits is not None else self.config.text_config.output_router_logits
        )
        asked_for_cache = settle_use_cache(kwargs, cache, self.config, self)
        if not has_media(*media):
            kwargs = resolve_packed(
                kwargs, position_ids, input_ids if input_ids is not None else inputs_embeds, cache, attention_mask=attention_mask, uploaded=uploaded
            )
            position_ids = shared_prefix.packed_positions(position_ids, input_ids, inputs_embeds, cache, kwargs)
        plan = None if not verify.sharing_allowed(self) else shared_prefix.plan_for(
            self.config,
            ops.of(self),
            input_ids=input_ids,
            position_ids=position_ids,
            cache=cache,
            use_cache=asked_for_cache,
            kwargs=kwargs,
            pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos,
            mm_encoder_outputs=mm_encoder_outputs,
            uploaded=uploaded,
        )
        model_kwargs = kwargs if plan is None else {**kwargs, "shared_prefix": plan, "use_cache": False}

        outputs = self.model(
            input_ids=input_ids,
            pixel_values=pixel_values,
            pixel_values_videos=pixel_values_videos,
            image_grid_thw=image_grid_thw,
            video_grid_thw=video_grid_thw,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            inputs_embeds=inputs_embeds,
            mm_token_type_ids=mm_token_type_ids,
            output_router_logits=output_router_logits,
            mm_encoder_outputs=mm_encoder_outputs,
            **model_kwargs,
        )

        head = causal_lm_head(
            self.lm_head,
            ops.of(self),
            outputs[0],
            plan=plan,
            labels=labels,
            input_ids=input_ids,
            logits_to_keep=logits_to_keep,
            request=request,
            kwargs=kwargs,
        )
        loss = head.loss

        aux_loss = None
        router_logits = shared_prefix.expand_router_logits(plan, outputs.router_logits)
        if output_router_logits:
            aux_loss = load_balancing_loss_func(
                router_logits,
                self.config.text_config.num_experts,
                self.config.text_config.num_experts_per_tok,
                routed_tokens_mask(attention_mask, router_logits),
            )
            if loss is not None:  # a loss from labels or from pre-shifted shift_labels
                loss += self.config.text_config.router_aux_loss_coef * aux_loss.to(loss.device)

        output = Qwen3_5MoeCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=head.logits,
            cache=outputs.cache,
            hidden_states=shared_prefix.expand_hidden_states(plan, outputs.hidden_states),
            attentions=outputs.attentions,
            router_logits=router_logits,
            image_outputs=outputs.image_outputs,
            video_outputs=outputs.video_outputs,
        )
        return head.attach(output)
