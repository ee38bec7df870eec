"""Replacement bodies for Qwen3.5, as subclasses of the upstream classes.

Importable at run time (and so unit-testable: instantiate a class here and compare with upstream);
the generator reads each method's source from this file and splices it into the upstream class.
Names from the upstream module are imported from it; the generated module defines them itself.

Packed rows (`cu_seq_lens_q/k`, `max_length_q/k` in the kwargs) run the mixers varlen through the
op slots; a shared-prefix plan (the `shared_prefix` keyword, built by the top model when
`text_config.shared_prefix_training` is on) runs them on the compact row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_5 import modeling_qwen3_5 as upstream
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    ALL_ATTENTION_FUNCTIONS,
    AutoModel,
    BaseModelOutputWithPast,
    BaseModelOutputWithPooling,
    Cache,
    CausalLMOutputWithPast,
    DynamicCache,
    FlashAttentionKwargs,
    MultimodalCausalLMOutputWithPast,
    Qwen3_5Config,
    TransformersKwargs,
    Unpack,
    apply_mask_to_padding_states,
    causal_conv1d_fn,
    causal_conv1d_update,
    create_causal_mask,
    create_recurrent_attention_mask,
    eager_attention_forward,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from patchgen.kernels import ops
from patchgen.kernels.modeling import (
    fields,
    host_rows,
    layer_graphs,
    loaded_weights,
    scoring_layers,
    shared_prefix,
    verify,
)
from patchgen.kernels.modeling.boundaries import resolve_packed
from patchgen.kernels.modeling.generation import (
    settle_use_cache,
    slot_rows,
    starts_from_zero_state,
    use_cache_for,
)
from patchgen.kernels.modeling.lm_head import HeadRequest, causal_lm_head
from patchgen.kernels.modeling.packing import (
    PACKED_ROW,
    packed_max_lengths,
    packed_row,
    varlen_attention,
    warn_dropout_unapplied,
    without_packed,
)
from patchgen.kernels.modeling.plain_modules import conv_weight, plain_linears
from patchgen.kernels.shared_prefix import (
    has_media,
    shared_prefix_attention,
    shared_prefix_causal_conv1d,
    shared_prefix_gated_delta_rule,
)

# Stand-ins for the constants the generator writes into each generated module (its device target's
# op-slot defaults); here, where the bodies run unpatched in tests, nothing is preferred.
PATCHGEN_OP_DEFAULTS: dict[str, str] = {}


class Qwen3_5PreTrainedModel(upstream.Qwen3_5PreTrainedModel):
    def post_init(self):
        super().post_init()
        # Resolve the op slots once per model build; every submodule reads them with ops.of(self).
        ops.bind(self, self.config, defaults=PATCHGEN_OP_DEFAULTS)
        # A text class saves the published layout's keys when it was loaded from them (as upstream's does):
        # its load_state_dict takes them back (Trainer's resume), however the model was built.
        loaded_weights.accept_published_layout(self)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        # patchgen's config fields set on the text config the model reads: given as keywords
        # (shared_prefix_training=True), which transformers would pass to __init__, or on a composite config
        # (config= or the checkpoint's config.json), of which a text class would keep only the text section.
        return fields.from_pretrained(cls, super().from_pretrained, args, kwargs, defaults=PATCHGEN_OP_DEFAULTS)

    @classmethod
    def _from_config(cls, config, **kwargs):
        # A composite config given to a text class builds from its text_config, with the patchgen fields set
        # on the composite moved there (transformers' auto classes would drop them).
        return super()._from_config(fields.text_config_for(cls, config), **kwargs)

    @classmethod
    def is_custom_code(cls) -> bool:
        # transformers counts a class defined outside `transformers.` as custom code, and then skips the
        # checkpoint conversions (the published `model.language_model.` layout, per-expert MoE keys) and
        # part of weight init. This module's own classes keep upstream's weights, names and init, so
        # those apply; subclasses defined elsewhere are judged by upstream's rule (docs/loading.md).
        return cls.__module__ != __name__ and super().is_custom_code()


class Qwen3_5RMSNorm(upstream.Qwen3_5RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.of(self).rms_norm(x, self.weight, self.eps)


class Qwen3_5RMSNormGated(upstream.Qwen3_5RMSNormGated):
    def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return ops.of(self).rms_norm_gated(hidden_states, gate, self.weight, self.variance_epsilon)


class Qwen3_5MLP(upstream.Qwen3_5MLP):
    def forward(self, x):
        # a LoRA-wrapped or quantised projection is called: the fused op reads weights and would skip it
        if self.config.hidden_act != "silu" or not plain_linears(self.gate_proj, self.up_proj, self.down_proj):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return ops.of(self).swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


class Qwen3_5GatedDeltaNet(upstream.Qwen3_5GatedDeltaNet):
    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ):
        hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
        batch_size, seq_len, _ = hidden_states.shape
        table = ops.of(self)
        plan = kwargs.get("shared_prefix")

        mixed_qkv = self.in_proj_qkv(hidden_states)
        z = self.in_proj_z(hidden_states)
        z = z.reshape(batch_size, seq_len, -1, self.head_v_dim)
        b = self.in_proj_b(hidden_states)
        a = self.in_proj_a(hidden_states)
        beta = b.sigmoid()
        # If the model is loaded in fp16, without the .float() here, A might be -inf
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

        prefill = cache is not None and starts_from_zero_state(cache, self.layer_idx)
        if cache is not None and not prefill:
            core_attn_out = self._cached_mix(mixed_qkv, g, beta, cache, **kwargs)
        else:
            # Training, scoring and prefill: one packed row [1, B*T, .] through the op slots. Every
            # sequence starts from zeros, so packed sequences never leak into each other.
            if prefill:
                # Decoding continues from the last conv inputs, stored as upstream's prefill stores them.
                cache.update_conv_state(mixed_qkv.transpose(1, 2), self.layer_idx, conv_kernel_size=self.conv_kernel_size)
            weight = conv_weight(self.conv1d)
            mixed_qkv = mixed_qkv.reshape(1, batch_size * seq_len, -1)
            g = g.reshape(1, batch_size * seq_len, -1)
            beta = beta.reshape(1, batch_size * seq_len, -1)
            if plan is not None:
                mixed_qkv = shared_prefix_causal_conv1d(
                    plan, table.causal_conv1d, mixed_qkv, weight, self.conv1d.bias, activation=self.activation
                )
            else:
                row = packed_row(kwargs, batch_size, seq_len, hidden_states.device)
                # the host boundaries and chunk table spare both slots a host sync per layer
                varlen = {} if row is None else dict(
                    cu_seqlens=row.cu_seqlens, cu_seqlens_cpu=row.cu_seqlens_cpu, chunk_indices=row.chunk_indices
                )
                mixed_qkv = table.causal_conv1d(
                    mixed_qkv, weight, self.conv1d.bias, activation=self.activation, **varlen
                )
            query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
            query = query.reshape(1, batch_size * seq_len, -1, self.head_k_dim)
            key = key.reshape(1, batch_size * seq_len, -1, self.head_k_dim)
            value = value.reshape(1, batch_size * seq_len, -1, self.head_v_dim)
            if plan is not None:
                core_attn_out = shared_prefix_gated_delta_rule(
                    plan, table.gated_delta_rule, query, key, value, g, beta, use_qk_l2norm_in_kernel=True
                )
            else:
                core_attn_out, final_state = table.gated_delta_rule(
                    query, key, value, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=prefill, **varlen
                )
                if prefill:
                    cache.update_recurrent_state(final_state, self.layer_idx)

        # reshape input data into 2D tensor
        core_attn_out = core_attn_out.reshape(-1, self.head_v_dim)
        z = z.reshape(-1, self.head_v_dim)
        core_attn_out = self.norm(core_attn_out, z)
        core_attn_out = core_attn_out.reshape(batch_size, seq_len, -1)

        output = self.out_proj(core_attn_out)
        return output

    def _cached_mix(self, mixed_qkv, g, beta, cache, **kwargs):
        """Upstream's conv and delta rule with a cache (generation): conv and recurrent state kept per layer."""
        batch_size, seq_len, _ = mixed_qkv.shape
        conv_state = cache.get_conv_state(self.layer_idx, state_idx=0)
        recurrent_state = cache.get_recurrent_state(self.layer_idx, state_idx=0)
        mixed_qkv = mixed_qkv.transpose(1, 2)
        if conv_state is not None and seq_len == 1 and not cache.is_recording_past(self.layer_idx):
            mixed_qkv = causal_conv1d_update(
                mixed_qkv, conv_state, conv_weight(self.conv1d), self.conv1d.bias, self.activation
            )
        else:
            mixed_qkv = cache.update_conv_state(mixed_qkv, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
            mixed_qkv = causal_conv1d_fn(
                mixed_qkv, conv_weight(self.conv1d), self.conv1d.bias, activation=self.activation
            )
            mixed_qkv = mixed_qkv[:, :, -seq_len:]
        mixed_qkv = mixed_qkv.transpose(1, 2)
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(batch_size, seq_len, -1, self.head_k_dim)
        key = key.reshape(batch_size, seq_len, -1, self.head_k_dim)
        value = value.reshape(batch_size, seq_len, -1, self.head_v_dim)
        rule = torch_recurrent_gated_delta_rule if recurrent_state is not None and seq_len == 1 else torch_chunk_gated_delta_rule
        core_attn_out, last_recurrent_state = rule(
            query,
            key,
            value,
            g=g,
            beta=beta,
            initial_state=recurrent_state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        cache.update_recurrent_state(last_recurrent_state, self.layer_idx)
        return core_attn_out


class Qwen3_5Attention(upstream.Qwen3_5Attention):
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs: Unpack[FlashAttentionKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        table = ops.of(self)

        query_states, gate = torch.chunk(
            self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1
        )
        gate = gate.reshape(*input_shape, -1)

        query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = table.rotary(query_states, key_states, cos, sin)

        plan = kwargs.get("shared_prefix")
        varlen = varlen_attention(kwargs) if plan is None else None
        # No padding mask (generation's prefill, a plain training forward): every batch row is one sequence
        # for the attention slot.
        rows = None if plan is not None or varlen is not None else slot_rows(
            cache, self.layer_idx, attention_mask, *input_shape, hidden_states.device,
            dropout=self.attention_dropout if self.training else 0.0,
        )
        if rows is not None:
            if cache is not None:
                cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)
            cache, varlen = None, rows
        if cache is None and (plan is not None or varlen is not None):
            if self.training and self.attention_dropout:
                warn_dropout_unapplied(self.attention_dropout)  # the slot has no dropout (unpacked rows keep it)
            # One packed row: [1, H, T, D] -> [1, T, H, D]; causal per segment, aligned bottom-right.
            query_states, key_states, value_states = (x.transpose(1, 2) for x in (query_states, key_states, value_states))
            if plan is not None:
                attn_output = shared_prefix_attention(
                    plan, table.attention, query_states, key_states, value_states, scale=self.scaling
                )
            else:
                attn_output = table.attention(
                    query_states.reshape(-1, *query_states.shape[2:]),
                    key_states.reshape(-1, *key_states.shape[2:]),
                    value_states.reshape(-1, *value_states.shape[2:]),
                    cu_seqlens_q=varlen.cu_seqlens_q,
                    cu_seqlens_k=varlen.cu_seqlens_k,
                    max_seqlen_q=varlen.max_seqlen_q,
                    max_seqlen_k=varlen.max_seqlen_k,
                    scale=self.scaling,
                    causal=True,
                )
            attn_weights = None
        else:
            if cache is not None:
                key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )

            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                **kwargs,
            )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = attn_output * torch.sigmoid(gate)

        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class Qwen3_5DecoderLayer(upstream.Qwen3_5DecoderLayer):
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        # upstream annotates this Unpack[TransformersKwargs] here, Unpack[FlashAttentionKwargs] in
        # Qwen3.5-MoE: left bare, the generator writes each module's own (patchgen/signatures.py)
        **kwargs,
    ) -> torch.Tensor:
        # The packed metadata or the shared-prefix plan travels in kwargs to both mixers; on the
        # compact row every token-wise step below (norms, MLP or MoE, residuals) runs on C rows.
        residual = hidden_states

        hidden_states = self.input_layernorm(hidden_states)

        # Token Mixer
        if self.block_type == "linear_attention":
            hidden_states = self.linear_attn(
                hidden_states=hidden_states,
                cache=cache,
                attention_mask=attention_mask,
                **kwargs,
            )
        else:
            hidden_states, _ = self.self_attn(
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )

        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        # A mixture-of-experts block returns (hidden_states, router_logits)
        if isinstance(hidden_states, tuple):
            hidden_states, _ = hidden_states
        hidden_states = residual + hidden_states

        return hidden_states


class Qwen3_5TextModel(upstream.Qwen3_5TextModel):
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        plan = kwargs.get("shared_prefix")
        decided_above = plan is not None or kwargs.get(PACKED_ROW) is not None  # the top model saw this packed row
        if plan is None:
            # Checked boundaries, or boundaries from restarting position_ids (a no-op below the top model).
            kwargs = resolve_packed(
                kwargs, position_ids, input_ids if input_ids is not None else inputs_embeds, cache, attention_mask=attention_mask
            )
        packed = plan is not None or kwargs.get("cu_seq_lens_q") is not None
        shared_prefix.warn_if_nothing_shared(self, packed=packed, decided_above=decided_above)
        if packed and isinstance(attention_mask, torch.Tensor) and not bool(attention_mask.all()):
            raise ValueError(
                "attention_mask with padding on a packed row (given by cu_seq_lens_q, or by position_ids that restart "
                "at 0 per sequence): packed rows carry no padding, their boundaries mark the sequences; pass "
                "attention_mask=None"
            )
        if plan is not None:
            # The compact row: one copy of every shared prefix; the plan replaces the packed metadata
            # and the mask (the mixers read their boundaries from the plan).
            input_ids = plan.compact(input_ids, dim=1) if input_ids is not None else None
            inputs_embeds = plan.compact(inputs_embeds, dim=1) if inputs_embeds is not None else None
            position_ids = plan.position_ids
            attention_mask = None
            use_cache = False
            kwargs = without_packed(kwargs)

        if packed and cache is None:
            # Training or scoring a packed row: a new cache would send the mixers down the unpacked
            # decode path, which ignores the sequence boundaries.
            use_cache = False

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)

        # the hard coded `4` is for text, temporal, height and width.
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.view(1, 1, -1).expand(4, inputs_embeds.shape[0], -1)
        elif position_ids.ndim == 2:
            position_ids = position_ids[None, ...].expand(4, position_ids.shape[0], -1)

        if position_ids.ndim == 3 and position_ids.shape[0] == 4:
            text_position_ids = position_ids[0]
            position_ids = position_ids[1:]
        else:
            text_position_ids = None

        if plan is not None or (cache is None and kwargs.get("cu_seq_lens_q") is not None):
            # Varlen mixers read boundaries, not masks: no [T, T] mask is built.
            causal_mask_mapping = {"full_attention": None, "linear_attention": None}
            if plan is None:
                # Boundaries on the host, chunk indices and max lengths once per micro-batch, not per layer.
                row = packed_row(kwargs, *inputs_embeds.shape[:2], inputs_embeds.device)
                kwargs = {**kwargs, PACKED_ROW: row, **packed_max_lengths(kwargs, row)}
        elif not isinstance(causal_mask_mapping := attention_mask, dict):
            mask_kwargs = {
                "config": self.config,
                "inputs_embeds": inputs_embeds,
                "attention_mask": attention_mask,
                "cache": cache,
                "position_ids": text_position_ids,
            }
            causal_mask_mapping = {
                "full_attention": create_causal_mask(**mask_kwargs),
                "linear_attention": create_recurrent_attention_mask(**mask_kwargs),
            }

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)

        def decoder_layers(hidden_states, position_embeddings, masks, **layer_kwargs):
            # each layer as it is, or in a shared-prefix scoring forward replayed from a graph of its kind's
            call_layer = scoring_layers.layer_call(layer_kwargs)
            for i, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
                hidden_states = call_layer(
                    decoder_layer,
                    hidden_states,
                    position_embeddings=position_embeddings,
                    attention_mask=masks[self.config.layer_types[i]],
                    **layer_kwargs,
                )
            return hidden_states

        # The loop as it is, or (shared_prefix_cuda_graphs, shared-prefix training step) replayed as CUDA graphs.
        hidden_states = layer_graphs.run_layers(
            self, decoder_layers, hidden_states, position_embeddings, causal_mask_mapping,
            position_ids=text_position_ids, cache=cache, use_cache=use_cache, **kwargs,
        )

        hidden_states = self.norm(hidden_states)

        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            cache=cache,
        )


class Qwen3_5Model(upstream.Qwen3_5Model):
    def __init__(self, config: Qwen3_5Config):
        super().__init__(config)
        self.visual = AutoModel.from_config(config.vision_config)
        # This module's (patched) text model; AutoModel would build upstream's.
        self.language_model = Qwen3_5TextModel._from_config(config.text_config)
        self.rope_deltas = None  # cache rope_deltas here

        # Initialize weights and apply final processing
        self.post_init()


class Qwen3_5ForTokenClassification(upstream.Qwen3_5ForTokenClassification):
    def __init__(self, config):
        # transformers' generic head builds its backbone with AutoModel, which is upstream's model: the same head
        # (names, sizes, dropout, init) on this module's backbone
        Qwen3_5PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = (Qwen3_5Model if isinstance(config, Qwen3_5Config) else Qwen3_5TextModel)._from_config(config)
        rates = (getattr(config, "classifier_dropout", None), getattr(config, "hidden_dropout", None))
        self.dropout = nn.Dropout(next((rate for rate in rates if rate is not None), 0.1))
        self.score = nn.Linear(config.get_text_config().hidden_size, self.num_labels)

        # Initialize weights and apply final processing
        self.post_init()


class Qwen3_5TextForSequenceClassification(upstream.Qwen3_5TextForSequenceClassification):
    def __init__(self, config):
        # transformers' generic head builds its backbone with AutoModel, which is upstream's model: the same head
        # (names, sizes, init) on this module's backbone
        Qwen3_5PreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = (Qwen3_5Model if isinstance(config, Qwen3_5Config) else Qwen3_5TextModel)._from_config(config)
        self.score = nn.Linear(config.get_text_config().hidden_size, self.num_labels, bias=False)

        # Initialize weights and apply final processing
        self.post_init()


class Qwen3_5ForCausalLM(upstream.Qwen3_5ForCausalLM):
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        r"""
        Packed rows: pass `cu_seq_lens_q/k` and `max_length_q/k`. With `text_config.shared_prefix_training`
        each prompt shared by several packed sequences runs once. `return_log_probs=True` and
        `return_entropy=True` add per-token `log_probs` and `entropy` (`[1, T]`) to the output;
        `return_logits=False` skips the logits.
        """
        # a packed row handed over on the host is uploaded here; the plan reads the host copy (no sync)
        input_ids, position_ids, attention_mask, labels, kwargs, uploaded = host_rows.upload(
            self, input_ids, position_ids, attention_mask, labels, kwargs
        )
        if verify.due(self, input_ids, position_ids, cache, use_cache, kwargs, attention_mask=attention_mask):
            # First use (or a longer row than verified): run shared and packed, compare, keep the checked result.
            return verify.run(self, dict(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs,
            ))
        request = HeadRequest.pop(kwargs, uploaded)
        kwargs = resolve_packed(
            kwargs, position_ids, input_ids if input_ids is not None else inputs_embeds, cache, attention_mask=attention_mask, uploaded=uploaded
        )
        position_ids = shared_prefix.packed_positions(position_ids, input_ids, inputs_embeds, cache, kwargs)
        plan = None if not verify.sharing_allowed(self) else shared_prefix.plan_for(
            self.config, ops.of(self), input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=use_cache, kwargs=kwargs, uploaded=uploaded
        )
        model_kwargs = kwargs if plan is None else {**kwargs, "shared_prefix": plan}
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache_for(use_cache, cache, self.config, self) if plan is None else False,
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

        output = CausalLMOutputWithPast(
            loss=head.loss,
            logits=head.logits,
            cache=outputs.cache,
            hidden_states=shared_prefix.expand_hidden_states(plan, outputs.hidden_states),
            attentions=outputs.attentions,
        )
        return head.attach(output)


class Qwen3_5ForConditionalGeneration(upstream.Qwen3_5ForConditionalGeneration):
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
        logits_to_keep: int | torch.Tensor = 0,
        mm_encoder_outputs: dict[str, BaseModelOutputWithPooling] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple | MultimodalCausalLMOutputWithPast:
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
                mm_token_type_ids=mm_token_type_ids, logits_to_keep=logits_to_keep,
                mm_encoder_outputs=mm_encoder_outputs, **kwargs,
            ))
        request = HeadRequest.pop(kwargs, uploaded)
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

        output = MultimodalCausalLMOutputWithPast(
            loss=head.loss,
            logits=head.logits,
            cache=outputs.cache,
            hidden_states=shared_prefix.expand_hidden_states(plan, outputs.hidden_states),
            attentions=outputs.attentions,
            image_outputs=outputs.image_outputs,
            video_outputs=outputs.video_outputs,
        )
        return head.attach(output)
