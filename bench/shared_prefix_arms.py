"""The arms of `bench/shared_prefix_gpu.py`: our model (packed, shared prefix) and what a user would pick instead.

`packed` and `shared` are the generated GPU module's `Qwen3_5ForCausalLM` with the flag off and on.
The baselines are transformers' own `Qwen3_5ForCausalLM` with the same weights, packed through
`position_ids` and `cu_seq_lens_*` (it runs fla's GDN kernels when fla is importable):
`upstream` as transformers ships it, `upstream_liger` after liger-kernel's own
`apply_liger_kernel_to_qwen3_5(model=...)` (its defaults: RMSNorm, SwiGLU and the fused linear
cross-entropy; liger has no rotary kernel for Qwen3.5).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch
from patchgen.kernels.shared_prefix.positions import positions_from_cu_seqlens

MODULE = "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu"
WIDTHS = dict(
    hidden_size=2560,
    intermediate_size=9216,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    vocab_size=151936,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    vocab_size=512,
)
BASELINES = ("upstream", "upstream_liger")


class BaselineUnavailable(RuntimeError):
    """A baseline arm was asked for whose library is missing or did not patch the model."""


def config_for(widths: dict, layers: int):
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    if layers < 4 or layers % 4:
        raise SystemExit(
            f"--layers: {layers} is not a multiple of 4 (the pattern is 3 linear + 1 full); give 4, 8, 32, ..."
        )
    config = Qwen3_5TextConfig(
        num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        tie_word_embeddings=False,
        use_cache=False,
        **widths,
    )
    config.shared_prefix_training = False
    # every timed call builds its plan (the benches time one call after another on one batch, which plan reuse
    # would answer from its kept plan); `shared_prefix_graphs.py` times the reuse case as its own figure
    config.shared_prefix_plan_reuse = False
    # the graphed arms always replay (the figures since the first graphs runs); the arms of "auto", the models'
    # default, set it themselves (`shared_prefix_vary.py`'s auto arm, `scoring_loop.py --scoring auto`)
    config.shared_prefix_cuda_graphs_training = config.shared_prefix_cuda_graphs_scoring = "graphs"
    return config


def checkpointed(model):
    """Activation checkpointing on every decoder layer (transformers 5.24 renamed the method)."""
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    return model


def our_model(widths: dict, layers: int, device, dtype):
    """The generated GPU module's `Qwen3_5ForCausalLM`, random weights (seed 0), checkpointed, in training mode."""
    module = importlib.import_module(MODULE)
    torch.manual_seed(0)
    with torch.device(device):
        model = module.Qwen3_5ForCausalLM(config_for(widths, layers)).to(dtype)
    checkpointed(model)
    return model.train()


def packed_kwargs(cu, max_len):
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)


def boundary_labels(ids, cu):
    """Labels = input ids, -100 at each sequence start: no token predicts across a packed boundary."""
    labels = ids.clone()
    labels[0, cu[:-1].long()] = -100
    return labels


def train_step(model, ids, cu, max_len):
    """Forward with labels and backward; returns the loss (detached, still on the device: no sync)."""
    model.zero_grad(set_to_none=True)
    out = model(
        input_ids=ids, labels=boundary_labels(ids, cu), return_logits=False, **packed_kwargs(cu, max_len)
    )
    out.loss.backward()
    return out.loss.detach()


def logprob_pass(model, ids, cu, max_len):
    """Per-token log-probs under `no_grad` (the old-policy / reference pass of RL)."""
    with torch.no_grad():
        return model(
            input_ids=ids, return_log_probs=True, return_logits=False, **packed_kwargs(cu, max_len)
        ).log_probs


def upstream_train_step(model, ids, cu, max_len):
    model.zero_grad(set_to_none=True)
    out = model(
        input_ids=ids,
        position_ids=positions_from_cu_seqlens(cu, ids.shape[1]),  # how upstream detects a packed row
        labels=boundary_labels(ids, cu),
        **packed_kwargs(cu, max_len),
    )
    out.loss.backward()
    return out.loss.detach()


def upstream_logprob_pass(model, ids, cu, max_len):
    """Upstream has no log-prob output: logits, then log-softmax gathered at the next token, as RL code does."""
    with torch.no_grad():
        positions = positions_from_cu_seqlens(cu, ids.shape[1])
        logits = model(input_ids=ids, position_ids=positions, **packed_kwargs(cu, max_len)).logits
        return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])


ARMS = {  # arm -> (flag, or None for a baseline, training step, log-prob pass)
    "packed": (False, train_step, logprob_pass),
    "shared": (True, train_step, logprob_pass),
    "upstream": (None, upstream_train_step, upstream_logprob_pass),
    "upstream_liger": (None, upstream_train_step, upstream_logprob_pass),
}


def _upstream_module():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def baseline_model(arm: str, state: dict, widths: dict, layers: int, device, dtype):
    """transformers' own `Qwen3_5ForCausalLM` with `state` (our weights: the parameter names are the same).

    `upstream_liger` then goes through `apply_liger_kernel_to_qwen3_5(model=twin)`; liger also swaps
    classes in transformers' module, which is put back at once, so a later `upstream` twin in the same
    process is transformers' own (checked: a plain twin built from patched classes is refused).
    """
    upstream = _upstream_module()
    originals = {name: getattr(upstream, name) for name in ("Qwen3_5RMSNorm", "Qwen3_5MLP")}
    foreign = [
        f"{n} from {c.__module__}"
        for n, c in originals.items()
        if not c.__module__.startswith("transformers.")
    ]
    if foreign:
        raise BaselineUnavailable(
            f"transformers' Qwen3.5 module holds patched classes ({', '.join(foreign)}): the {arm} arm would not be "
            "upstream; run the baselines in a fresh process"
        )
    if arm == "upstream_liger":
        apply = liger_apply()  # before the twin is built: a missing liger fails fast
    with torch.device(device):
        twin = upstream.Qwen3_5ForCausalLM(config_for(widths, layers)).to(dtype)
    twin.load_state_dict(state, strict=True)
    checkpointed(twin)
    twin.train()
    if arm == "upstream_liger":
        saved_forward = upstream.Qwen3_5ForCausalLM.forward
        try:
            apply(model=twin)
        finally:
            for name, cls in originals.items():
                setattr(upstream, name, cls)
            upstream.Qwen3_5ForCausalLM.forward = saved_forward
        check_liger_patched(twin)
    print(f"{arm}: {describe_baseline(twin)}", flush=True)
    return twin


def liger_apply():
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_5
    except ImportError as error:
        raise BaselineUnavailable(
            f"the upstream_liger arm needs liger-kernel 0.8.5 (import failed: {error}); install it "
            "(`pip install liger-kernel==0.8.5`) or leave the arm out (`--baselines upstream` or `--baselines ''`)"
        ) from error
    return apply_liger_kernel_to_qwen3_5


def liger_modules(twin) -> dict[str, tuple[int, int]]:
    """(patched, total) per kind of module liger replaces: RMSNorms, MLPs, and the LM head's forward."""
    norms = [
        m
        for name, m in twin.named_modules()
        if name.endswith(("layernorm", "q_norm", "k_norm", "model.norm"))
    ]
    mlps = [layer.mlp for layer in twin.model.layers]
    forward = getattr(twin.forward, "__func__", twin.forward)
    return {
        "rms_norm": (sum(m._get_name().startswith("Liger") for m in norms), len(norms)),
        "swiglu": (sum(m._get_name().startswith("Liger") for m in mlps), len(mlps)),
        "fused_linear_cross_entropy": (int(forward.__module__.startswith("liger_kernel.")), 1),
    }


def check_liger_patched(twin):
    """Refuse an upstream_liger twin that liger left (partly) unpatched: it would be timed as liger while it is not."""
    missing = {
        kind: f"{done}/{total}" for kind, (done, total) in liger_modules(twin).items() if done != total
    }
    if missing:
        raise BaselineUnavailable(
            f"apply_liger_kernel_to_qwen3_5 left modules unpatched ({missing}): check the liger-kernel version (0.8.5 expected)"
        )


def describe_baseline(twin) -> str:
    fla = importlib.util.find_spec("fla") is not None
    conv = "causal-conv1d" if importlib.util.find_spec("causal_conv1d") else "transformers' PyTorch fallback"
    text = (
        f"attention {twin.config._attn_implementation}, GDN {'fla' if fla else 'torch (no fla)'}, conv {conv}"
    )
    forward = getattr(twin.forward, "__func__", twin.forward)
    if forward.__module__.startswith("liger_kernel."):
        text += ", liger " + ", ".join(
            f"{kind} {done}/{total}" for kind, (done, total) in liger_modules(twin).items()
        )
    return text
