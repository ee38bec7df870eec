"""Every op slot and its backends, as kernel handles. Declaring a handle imports nothing."""

from __future__ import annotations

import os
from importlib import metadata

from . import capabilities as caps
from .handles import KernelHandle, Requirement

SLOTS = (
    "gated_delta_rule",
    "causal_conv1d",
    "rms_norm_gated",
    "rms_norm",
    "rotary",
    "swiglu_mlp",
    "attention",
    "cross_entropy",
    "moe_experts",
)

_REF = "patchgen.kernels.reference"
_ADAPT = "patchgen.kernels.backends"
FLA = Requirement("fla-core", ">=0.6,<0.7")
LIGER = Requirement("liger-kernel", ">=0.8,<0.9")
TRITON = Requirement("triton", ">=3.4")
# On Ascend, Triton comes as the triton-ascend distribution (it installs the `triton` package).
TRITON_ASCEND = Requirement("triton-ascend", ">=3.2")
# The oldest torch-npu whose documentation lists every argument the npu_* adapters pass, and the
# newest release: a later one is refused (auto falls back) until it is checked.
TORCH_NPU = Requirement("torch-npu", ">=2.6,<2.15")

GDN_STATE = {caps.VARLEN, caps.INITIAL_STATE, caps.INITIAL_STATE_GRAD, caps.FINAL_STATE_GRAD, caps.GQA}
# A conv that takes a per-sequence initial state (its last W-1 input rows) and returns its gradient:
# the shared-prefix look-back then needs no gathered rows (shared_prefix/conv.py).
CONV_STATE = {caps.VARLEN, caps.INITIAL_STATE, caps.INITIAL_STATE_GRAD}
ATTENTION = {caps.VARLEN, caps.BOTTOM_RIGHT_CAUSAL, caps.GQA}


def triton_device() -> str | None:
    """Why our Triton kernels cannot run here: they need a CUDA or NPU device, or TRITON_INTERPRET=1."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    import torch

    if torch.cuda.is_available() or npu_available():
        return None
    return "needs a CUDA or NPU device for Triton, or TRITON_INTERPRET=1 to run it on the CPU"


def triton_ready() -> str | None:
    """Why our Triton kernels cannot run here: they need triton>=3.4 (or triton-ascend>=3.2) and a device."""
    problem = TRITON.problem()
    if problem and TRITON_ASCEND.problem() is not None:
        return f"{problem}; on an Ascend NPU, needs {TRITON_ASCEND} instead"
    return triton_device()


def fla_gdn_backward_works() -> str | None:
    """fla refuses the GDN backward on Hopper with Triton >=3.4,<3.7.1 (a Triton code-generation bug)."""
    from packaging.version import Version

    try:
        found = metadata.version("triton")
    except metadata.PackageNotFoundError:
        return "needs triton, not installed"
    if not Version("3.4") <= Version(found) < Version("3.7.1"):
        return None
    import torch

    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        return f"fla's GDN backward fails on Hopper with triton {found} (>=3.4,<3.7.1); install triton>=3.7.1"
    return None


def npu_available() -> bool:
    """Whether ``torch.npu.is_available()``; imports torch_npu (which registers ``torch.npu``) when installed.

    Users need not import torch_npu before building a model: an installed torch-npu is imported here.
    """
    import torch

    if getattr(torch, "npu", None) is None:
        try:
            metadata.version("torch-npu")
        except metadata.PackageNotFoundError:
            return False
        try:
            import torch_npu  # noqa: F401 - registers torch.npu
        except Exception:  # noqa: BLE001 - a broken install means no NPU, as for a missing one
            return False
    npu = getattr(torch, "npu", None)
    return npu is not None and bool(npu.is_available())


def npu_device() -> str | None:
    """Why torch_npu's operators cannot run here: they need ``torch.npu.is_available()``. Creates no tensor."""
    import torch_npu  # noqa: F401 - the adapters need it; an import error becomes the handle's reason

    return None if npu_available() else "needs an Ascend NPU (torch.npu.is_available() is False)"


def grouped_mm_present() -> str | None:
    """Why torch.nn.functional.grouped_mm cannot be used, or None."""
    import torch

    return (
        None
        if hasattr(torch.nn.functional, "grouped_mm")
        else f"needs torch.nn.functional.grouped_mm, torch {torch.__version__} has none"
    )


def _handles() -> dict[str, tuple[KernelHandle, ...]]:
    def h(slot, name, entry, requires=(), capabilities=(), check=None, summary="", dtypes=caps.HALF_AND_FLOAT32):
        return KernelHandle(
            slot,
            name,
            entry,
            requires=requires,
            capabilities=frozenset(capabilities),
            check=check,
            summary=summary,
            dtypes=dtypes,
        )

    gpu, f64 = {caps.NEEDS_GPU}, {caps.FLOAT64}
    ours = "patchgen.kernels.triton"
    return {
        "gated_delta_rule": (
            h(
                "gated_delta_rule",
                "fla",
                f"{_ADAPT}.fla:gated_delta_rule",
                (FLA,),
                GDN_STATE | gpu,
                fla_gdn_backward_works,
                "fla chunk_gated_delta_rule",
            ),
            h(
                "gated_delta_rule",
                "triton",
                f"{ours}:gated_delta_rule",
                (),
                GDN_STATE,
                triton_ready,
                "our portable Triton kernels",
            ),
            h(
                "gated_delta_rule",
                "torch",
                f"{_REF}.gated_delta_rule:gated_delta_rule",
                (),
                GDN_STATE | f64,
                summary="chunked PyTorch reference",
            ),
        ),
        "causal_conv1d": (
            h(
                "causal_conv1d",
                "fla",
                f"{_ADAPT}.fla:causal_conv1d",
                (FLA,),
                CONV_STATE | gpu,
                summary="fla causal_conv1d (Triton)",
            ),
            h(
                "causal_conv1d",
                "triton",
                f"{ours}:causal_conv1d",
                (),
                CONV_STATE,
                triton_ready,
                "our portable Triton kernels",
            ),
            h(
                "causal_conv1d",
                "torch",
                f"{_REF}.causal_conv1d:causal_conv1d",
                (),
                CONV_STATE | f64,
                summary="masked taps, boundary-respecting",
            ),
        ),
        "rms_norm_gated": (
            h(
                "rms_norm_gated",
                "fla",
                f"{_ADAPT}.fla:rms_norm_gated",
                (FLA,),
                gpu,
                summary="fla fused norm-gate",
            ),
            h(
                "rms_norm_gated",
                "triton",
                f"{ours}:rms_norm_gated",
                (),
                {caps.ROW_INVARIANT},
                triton_ready,
                "our portable Triton kernels",
            ),
            h(
                "rms_norm_gated",
                "torch",
                f"{_REF}.norms:rms_norm_gated",
                (),
                f64 | {caps.ROW_INVARIANT},
                summary="upstream RMSNormGated math",
            ),
        ),
        "rms_norm": (
            h(
                "rms_norm",
                "liger",
                f"{_ADAPT}.liger:rms_norm",
                (LIGER,),
                gpu,
                summary="LigerRMSNorm, offset 1",
            ),
            h(
                "rms_norm",
                "npu_rms_norm",
                f"{_ADAPT}.npu_rms_norm:rms_norm",
                (TORCH_NPU,),
                (),
                npu_device,
                "torch_npu.npu_rms_norm, gamma 1 + weight",
            ),
            h("rms_norm", "torch", f"{_REF}.norms:rms_norm", (), f64, summary="upstream RMSNorm math"),
        ),
        "rotary": (
            h("rotary", "liger", f"{_ADAPT}.liger:rotary", (LIGER,), gpu, summary="liger_rotary_pos_emb"),
            h(
                "rotary",
                "npu_rotary_mul",
                f"{_ADAPT}.npu_rotary_mul:rotary",
                (TORCH_NPU,),
                (),
                npu_device,
                "torch_npu.npu_rotary_mul, partial rotary sliced",
            ),
            h("rotary", "torch", f"{_REF}.rotary:rotary", (), f64, summary="upstream apply_rotary_pos_emb"),
        ),
        "swiglu_mlp": (
            h(
                "swiglu_mlp",
                "liger",
                f"{_ADAPT}.liger:swiglu_mlp",
                (LIGER,),
                gpu,
                summary="fused SiLU-multiply",
            ),
            h(
                "swiglu_mlp",
                "npu_swiglu",
                f"{_ADAPT}.npu_swiglu:swiglu_mlp",
                (TORCH_NPU,),
                (),
                npu_device,
                "torch_npu.npu_swiglu, gate half first",
            ),
            h("swiglu_mlp", "torch", f"{_REF}.swiglu_mlp:swiglu_mlp", (), f64, summary="upstream MLP math"),
        ),
        "attention": (
            h(
                "attention",
                "flash_attention_3",
                f"{_ADAPT}.flash_attention_3:attention",
                (Requirement("flash-attn-3"),),
                ATTENTION | gpu,
                summary="FA3 varlen",
                dtypes=caps.HALF,
            ),
            h(
                "attention",
                "flash_attention_2",
                f"{_ADAPT}.flash_attention_2:attention",
                (Requirement("flash-attn", ">=2.6,<3"),),
                ATTENTION | gpu,
                summary="FA2 varlen",
                dtypes=caps.HALF,
            ),
            h(
                "attention",
                "flash_attention_4",
                f"{_ADAPT}.flash_attention_4:attention",
                (Requirement("flash-attn-4"),),
                ATTENTION | gpu,
                summary="FA4 (CuTeDSL) varlen",
                dtypes=caps.HALF,
            ),
            h(
                "attention",
                "torch_varlen",
                f"{_ADAPT}.torch_varlen:attention",
                (Requirement("torch", ">=2.11"),),
                ATTENTION | gpu,
                summary="torch.nn.attention.varlen.varlen_attn",
                dtypes=caps.HALF,
            ),
            h(
                "attention",
                "npu_fusion_attention",
                f"{_ADAPT}.npu_fusion_attention:attention",
                (TORCH_NPU,),
                # sparse_mode=3 (rightDownCausal) aligns each TND segment's mask bottom-right.
                ATTENTION,
                npu_device,
                "torch_npu.npu_fusion_attention, TND varlen",
            ),
            h(
                "attention",
                "sdpa",
                f"{_REF}.attention:sdpa",
                (),
                ATTENTION | f64,
                summary="scaled_dot_product_attention per segment",
            ),
            h(
                "attention",
                "eager",
                f"{_REF}.attention:eager",
                (),
                ATTENTION | f64,
                summary="explicit softmax per segment",
            ),
        ),
        "cross_entropy": (
            h(
                "cross_entropy",
                "liger",
                f"{_ADAPT}.liger:cross_entropy",
                (LIGER,),
                gpu,
                summary="fused linear cross-entropy",
            ),
            h(
                "cross_entropy",
                "triton",
                f"{ours}.log_probs:cross_entropy",
                (),
                {caps.ENTROPY, caps.SYNC_FREE},
                triton_ready,
                "GEMM per row chunk, one Triton pass per row; scoring passes (with gradients: chunked)",
            ),
            h(
                "cross_entropy",
                "chunked",
                f"{_REF}.cross_entropy:chunked",
                (),
                {caps.ENTROPY, caps.SYNC_FREE} | f64,
                summary="row chunks, recomputed in backward",
            ),
            h(
                "cross_entropy",
                "eager",
                f"{_REF}.cross_entropy:eager",
                (),
                {caps.ENTROPY, caps.SYNC_FREE} | f64,
                summary="full logits",
            ),
        ),
        "moe_experts": (
            h(
                "moe_experts",
                "liger",
                f"{_ADAPT}.liger_moe:moe_experts",
                (LIGER,),
                gpu,
                summary="fused MoE, SiLU only",
            ),
            h(
                "moe_experts",
                "grouped_mm",
                f"{_REF}.moe_experts:grouped_mm",
                (),
                (),
                grouped_mm_present,
                "torch grouped_mm",
            ),
            h("moe_experts", "batched_mm", f"{_REF}.moe_experts:batched_mm", (), f64, summary="gathered weights, bmm"),
            h(
                "moe_experts",
                "npu_grouped_matmul",
                f"{_ADAPT}.npu_grouped_matmul:moe_experts",
                (TORCH_NPU,),
                (),
                npu_device,
                "torch_npu.npu_grouped_matmul, grouped along M",
            ),
            h("moe_experts", "eager", f"{_REF}.moe_experts:eager", (), f64, summary="loop over experts hit"),
        ),
    }


BACKENDS: dict[str, tuple[KernelHandle, ...]] = _handles()


def handle(slot: str, backend: str) -> KernelHandle | None:
    """The handle named ``backend`` of ``slot``, or None."""
    return next((h for h in BACKENDS.get(slot, ()) if h.name == backend), None)


def reset_all() -> None:
    """Forget every handle's cached availability (after installing a library, or in tests)."""
    for handles in BACKENDS.values():
        for h in handles:
            h.reset()
