"""Tiny random Qwen3.5 / Qwen3.5-MoE models and float64 references for the model tests."""

from __future__ import annotations

import importlib

import torch
from patchgen.kernels.reference import attention as ref_attention
from patchgen.kernels.reference import gated_delta_rule as ref_gdn
from patchgen.kernels.reference import norms as ref_norms

MODULES = {
    ("qwen3_5", "gpu"): "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu",
    ("qwen3_5", "npu"): "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_npu",
    ("qwen3_5_moe", "gpu"): "patchgen.generated.qwen3_5_moe.patched_modeling_qwen3_5_moe_gpu",
    ("qwen3_5_moe", "npu"): "patchgen.generated.qwen3_5_moe.patched_modeling_qwen3_5_moe_npu",
}
UPSTREAM = {
    "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_5_moe": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
}
PREFIX = {"qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}
VOCAB = 160
REF_ATTN = "patchgen_f64_varlen"


def text_config(model: str, **extra):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0]},
        tie_word_embeddings=False,
        use_cache=False,
    )
    if model == "qwen3_5":
        config = Qwen3_5TextConfig(intermediate_size=48, **common)
    else:
        config = Qwen3_5MoeTextConfig(
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=6,
            num_experts_per_tok=2,
            output_router_logits=True,
            router_aux_loss_coef=0.01,
            **common,
        )
    for key, value in extra.items():
        setattr(config, key, value)
    config._attn_implementation = "sdpa"
    return config


def module(model: str, device: str):
    return importlib.import_module(MODULES[(model, device)])


def build(model: str, device: str, seed: int = 0, **extra):
    """A float64 ForCausalLM of the generated module, with random (not zero) norm weights."""
    mod = module(model, device)
    torch.manual_seed(seed)
    net = getattr(mod, PREFIX[model] + "ForCausalLM")(text_config(model, **extra)).double()
    randomize(net, seed)
    return net


def build_conditional(model: str, device: str, seed: int = 0, **extra):
    """A float64 ForConditionalGeneration (the published layout) of the generated module; ``extra`` goes to its text config."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5Config
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeConfig

    text = text_config(model, **extra).to_dict()
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"])
    config = (Qwen3_5Config if model == "qwen3_5" else Qwen3_5MoeConfig)(text_config=text, vision_config=vision)
    torch.manual_seed(seed)
    net = getattr(module(model, device), PREFIX[model] + "ForConditionalGeneration")(config).double()
    return randomize(net, seed)


def randomize(net, seed: int = 0):
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if name.endswith("norm.weight") or "A_log" in name or "dt_bias" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif "router" in name or name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype))
            elif "experts" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return net


def upstream_f64(model: str, monkeypatch):
    """The upstream module with its float32-casting pieces replaced by float64 references.

    Upstream casts norms and the chunked delta rule to fp32, so float64 comparisons would only hold
    to ~1e-7; the references compute the same math in float64. Attention goes through a float64
    varlen reference registered with transformers' AttentionInterface.
    """
    from transformers import AttentionInterface

    mod = importlib.import_module(UPSTREAM[model])
    prefix = PREFIX[model]

    def rms(self, x):
        return ref_norms.rms_norm(x, self.weight, self.eps)

    def rms_gated(self, x, gate):
        return ref_norms.rms_norm_gated(x, gate, self.weight, self.variance_epsilon)

    def chunk_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        return ref_gdn.gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                        output_final_state=output_final_state,
                                        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)

    monkeypatch.setattr(getattr(mod, prefix + "RMSNorm"), "forward", rms)
    monkeypatch.setattr(getattr(mod, prefix + "RMSNormGated"), "forward", rms_gated)
    monkeypatch.setattr(mod, "torch_chunk_gated_delta_rule", chunk_rule)
    AttentionInterface.register(REF_ATTN, varlen_reference_attention)
    return mod


def varlen_reference_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers attention-interface signature over the float64 varlen reference (causal, per sequence)."""
    batch, _, length, _ = query.shape
    cu = kwargs.get("cu_seq_lens_q")
    outs = []
    for b in range(batch):
        q, k, v = (x[b].transpose(0, 1) for x in (query, key, value))
        bounds = cu if cu is not None else torch.tensor([0, length], dtype=torch.int32)
        outs.append(ref_attention.eager(q, k, v, cu_seqlens_q=bounds, cu_seqlens_k=bounds, max_seqlen_q=length,
                                        max_seqlen_k=length, scale=scaling))
    return torch.stack(outs), None


def upstream_model(model: str, monkeypatch, state_dict, seed: int = 0, **extra):
    mod = upstream_f64(model, monkeypatch)
    config = text_config(model, **extra)
    torch.manual_seed(seed)
    net = getattr(mod, PREFIX[model] + "ForCausalLM")(config).double()
    net.config._attn_implementation = REF_ATTN
    if model == "qwen3_5_moe":
        net.config._experts_implementation = "eager"
    net.load_state_dict(state_dict)
    return net


def packed_batch(lengths, seed: int = 0, shared: int = 0, vocab: int = VOCAB):
    """input_ids [1, T] and cu_seq_lens; the first `shared` tokens are common to all sequences."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=gen)
    seqs = [torch.cat([prefix, torch.randint(0, vocab, (n - shared,), generator=gen)]) for n in lengths]
    ids = torch.cat(seqs).unsqueeze(0)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return ids, cu


def packed_kwargs(cu):
    max_len = int((cu[1:] - cu[:-1]).max())
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)


def grads(net):
    return {n: p.grad.detach().clone() for n, p in net.named_parameters() if p.grad is not None}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a) if a else 0.0


def grpo_batch(groups, singles=(), seed: int = 0, vocab: int = VOCAB):
    """One packed row: per group `(P, [R_1, ..])` the rollouts `prompt + response_i`, then singletons.

    Returns `input_ids [1, T]`, `cu [N + 1]` int32 and `prompt_mask [1, T]` (True on prompt tokens).
    """
    gen = torch.Generator().manual_seed(seed)
    seqs, prompt = [], []
    for p, suffixes in groups:
        head = torch.randint(0, vocab, (p,), generator=gen)
        for r in suffixes:
            seqs.append(torch.cat([head, torch.randint(0, vocab, (r,), generator=gen)]))
            prompt.append(torch.arange(p + r) < p)
    for n in singles:
        seqs.append(torch.randint(0, vocab, (n,), generator=gen))
        prompt.append(torch.zeros(n, dtype=torch.bool))
    lengths = [len(s) for s in seqs]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return torch.cat(seqs).unsqueeze(0), cu, torch.cat(prompt).unsqueeze(0)


# Upstream's decay `-A_log.float().exp() * softplus(a.float() + dt_bias)` rounds A_log and the
# in_proj_a output to float32 even in a float64 model (kept as is: flag off must equal upstream),
# so their gradients carry float32 rounding; everything else holds to float64 rounding.
FP32_ROUNDED = ("linear_attn.A_log", "linear_attn.in_proj_a.weight")


def assert_grads_close(a: dict, b: dict, atol: float = 1e-10):
    assert a.keys() == b.keys()
    for name in a:  # noqa: PLC0206 (both dicts are indexed by name)
        if name.endswith(FP32_ROUNDED):
            ok = torch.allclose(a[name], b[name], rtol=1e-5, atol=1e-7)
        else:
            ok = torch.allclose(a[name], b[name], atol=atol, rtol=0)
        assert ok, f"{name}: max diff {(a[name] - b[name]).abs().max().item():.3e}"


def left_padded_batch(lengths=(5, 24, 9), pad: int = 0, seed: int = 3, vocab: int = VOCAB):
    """Prompts of `lengths` left-padded with `pad` to one width, as generation takes them: (ids, attention mask)."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(2, vocab, (n,), generator=gen) for n in lengths]
    width = max(len(r) for r in rows)
    ids = torch.stack([torch.cat([torch.full((width - len(r),), pad), r]) for r in rows])
    mask = torch.stack([torch.arange(width) >= width - len(r) for r in rows]).long()
    return ids, mask
