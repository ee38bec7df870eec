"""The launcher calls whose launches compile_kernels.py compiles: every preset and design of every op,
in the dtypes the launchers take, at the model's widths where the launch constexprs depend on them.

Each case is (label, call, deep); a call runs our real launchers while `kernel_compile.LaunchRecorder` stands
in for the launches, so tensors are only allocated, never computed. New presets are picked up from the
modules' `PRESETS` tables; a new kernel needs a case here (the coverage test says which).
"""

from __future__ import annotations

import contextlib
import importlib
import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

conv = importlib.import_module("patchgen.kernels.triton.causal_conv1d")
conv_state = importlib.import_module("patchgen.kernels.triton.causal_conv1d_state")
norm = importlib.import_module("patchgen.kernels.triton.rms_norm_gated")
log_probs = importlib.import_module("patchgen.kernels.triton.log_probs")
common = importlib.import_module("patchgen.kernels.triton._common")
varlen = importlib.import_module("patchgen.kernels.triton.gated_delta_rule.varlen")
transposes = importlib.import_module("patchgen.kernels.triton.gated_delta_rule.transposes")
gdn_api = importlib.import_module("patchgen.kernels.triton.gated_delta_rule")

# Every preset in these; the other dtypes the launchers take, with one configuration per design.
PRESET_DTYPES = (torch.float32, torch.bfloat16)
OTHER_DTYPES = (torch.float16, torch.float64)

# Qwen3.5 widths where the specialisation depends on them (block sizes are capped by the width);
# T is long enough that the window designs get their full chunk (L), as in training.
T, CONV_D, CONV_W = 1024, 1024, 4
CU = (0, 100, 300, 301, 700, 1024)  # five sequences: the binary search loops (n_iter > 1)
HEAD = 128  # GDN key / value head dim, and the gated norm's row
VOCAB = 151936  # the LM head's rows (scoring head); the tests' 37 too
H, HV = 2, 4  # grouped value heads (the models' layout)

Case = tuple[str, Callable[[], None], bool]

# The configurations the H200 runs (the tuning table's entry, else the code's default), in bf16 with the
# model's options: compile_kernels.py takes these through more of the compiler's stages ("deep").
GPU = "NVIDIA H200"
TABLE = Path(conv.__file__).with_name("tuning_table.json")

# What the compiled device decides in our launchers: "cuda" (Hopper: tf32 products, the scratch conv
# backward), "portable" (any other backend, the npu target among them: ieee products).
POLICIES = ("cuda", "portable")


@contextlib.contextmanager
def device_policy(policy: str) -> Iterator[None]:
    """Our launchers' choices as on a compiled `policy` device, with CPU tensors: not the interpreter's
    (no fp32 widening of half products, half head tiles padded to 64), and the chunk offsets by their
    kernel, as on a device."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    saved = common._on_cuda, varlen.interpreting
    common._on_cuda = lambda: policy == "cuda"
    varlen.interpreting = lambda: True  # make_chunking launches chunk_offsets_kernel as on a device
    _clear_launch_caches()
    try:
        yield
    finally:
        common._on_cuda, varlen.interpreting = saved
        _clear_launch_caches()


def _clear_launch_caches() -> None:
    """The launchers cache their constexprs per shape and dtype: a policy change must not reuse them."""
    from kernel_compile import package_modules

    for module in package_modules():
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)) and getattr(value, "__module__", None) == module.__name__:
                value.cache_clear()


def _cu() -> torch.Tensor:
    return torch.tensor(CU, dtype=torch.int32)


def _conv_calls(dtype, tuning, *, bias: bool, silu: bool, width: int = CONV_W, d: int = CONV_D) -> None:
    x = torch.empty(T, d, dtype=dtype)
    w = torch.empty(d, width, dtype=dtype)
    b = torch.empty(d, dtype=dtype) if bias else None
    conv.conv_fwd(x, w, b, _cu(), silu, tuning=tuning)
    conv.conv_bwd(x, w, b, torch.empty_like(x), _cu(), silu, tuning=tuning)


def _conv_state_calls(dtype, *, bias: bool, silu: bool, from_x: bool, width: int = CONV_W, d: int = CONV_D) -> None:
    x = torch.empty(T, d, dtype=dtype)
    w = torch.empty(d, width, dtype=dtype)
    b = torch.empty(d, dtype=dtype) if bias else None
    n = len(CU) - 1
    # from_x: the shared-prefix look-back, [N, W] rows of x (shared_prefix.conv.LookBackConv, layout "x")
    state = torch.zeros(n, width, dtype=torch.int64) if from_x else torch.empty(n, width - 1, d, dtype=dtype)
    conv_state.conv_state_fwd(x, state, w, b, _cu(), silu, from_x)
    conv_state.conv_state_bwd(x, state, w, b, torch.empty_like(x), _cu(), silu, from_x)


def _norm_calls(dtype, tuning, d: int = HEAD) -> None:
    x = torch.empty(T * HV, d, dtype=dtype)
    gate, weight = torch.empty_like(x), torch.empty(d, dtype=dtype)
    _, rstd = norm.norm_fwd(x, gate, weight, 1e-6, tuning=tuning)
    norm.norm_bwd(x, gate, weight, rstd, torch.empty_like(x), tuning=tuning)


def _log_probs_calls(dtype, entropy: bool, vocab: int = VOCAB) -> None:
    log_probs.row_log_probs(torch.empty(8, vocab, dtype=dtype), torch.zeros(8, dtype=torch.long), return_entropy=entropy)


def _gdn_calls(dtype, design: str, *, l2norm: bool, h0: bool, heads=(H, HV), dims=(HEAD, HEAD)) -> None:
    """One forward and backward through the autograd Function, as the model calls it."""
    def leaf(*shape):
        return torch.zeros(*shape, dtype=dtype, requires_grad=True)

    (h, hv), (dk, dv) = heads, dims
    q, k = leaf(1, T, h, dk), leaf(1, T, h, dk)
    v, g, beta = leaf(1, T, hv, dv), leaf(1, T, hv), leaf(1, T, hv)
    state = torch.zeros(len(CU) - 1, hv, dk, dv, dtype=torch.float32, requires_grad=True) if h0 else None
    saved, transposes.TUNING = transposes.TUNING, transposes.PRESETS[design]
    try:
        o, final = gdn_api.gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=h0,
                                            use_qk_l2norm_in_kernel=l2norm, cu_seqlens=_cu())
        loss = o.float().sum() + (final.sum() if h0 else 0)  # h0: the final state's gradient too (dht)
        loss.backward()
    finally:
        transposes.TUNING = saved


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def gpu_presets(gpu: str = GPU) -> dict[str, set[str]]:
    """{table key: preset names} a call on `gpu` can get without asking: its tuning-table entry and the
    code's default."""
    table = json.loads(TABLE.read_text()).get(gpu, {})
    modules = {"causal_conv1d": conv, "rms_norm_gated": norm, "gated_delta_rule_transposes": transposes}
    out = {}
    for key, module in modules.items():
        default = next(name for name, preset in module.PRESETS.items() if preset == module.DEFAULT)
        out[key] = {default} | ({table[key].split(",")[0]} if key in table else set())
    return out


def cases() -> list[Case]:
    """Every launcher call to record, labelled with what it covers, and whether the H200 runs it."""
    runs = gpu_presets()
    out: list[Case] = []
    for dtype in PRESET_DTYPES + OTHER_DTYPES:
        every_preset = dtype in PRESET_DTYPES
        gpu_dtype = dtype == torch.bfloat16
        d = _dtype_name(dtype)
        # conv: every preset (the model's conv: no bias, SiLU); one per design with bias and without SiLU
        conv_tunings = dict(conv.PRESETS) if every_preset else {
            "tile-scratch": conv.PRESETS["tile-scratch"], "window": conv.PRESETS["window"],
            "segment": conv.PRESETS["segment"]}
        conv_tunings["recompute"] = conv.ConvTuning(bwd_kernel="recompute")  # the non-CUDA default backward
        for name, tuning in conv_tunings.items():
            out.append((f"conv {name} {d}", lambda dtype=dtype, tuning=tuning:
                        _conv_calls(dtype, tuning, bias=False, silu=True),
                        gpu_dtype and name in runs["causal_conv1d"]))
        for name in ("tile-scratch", "window", "segment", "recompute"):
            out.append((f"conv {name} bias no-silu {d}", lambda dtype=dtype, tuning=conv_tunings[name]:
                        _conv_calls(dtype, tuning, bias=True, silu=False), False))
        for from_x in (False, True):
            for bias, silu in ((False, True), (True, False)):
                label = f"conv state {'look-back' if from_x else 'initial-state'}{' bias' if bias else ''}" \
                        f"{'' if silu else ' no-silu'} {d}"
                out.append((label, lambda dtype=dtype, bias=bias, silu=silu, from_x=from_x:
                            _conv_state_calls(dtype, bias=bias, silu=silu, from_x=from_x),
                            gpu_dtype and silu and not bias))
        norm_tunings = norm.PRESETS if every_preset else {"default": norm.PRESETS["default"]}
        for name, tuning in norm_tunings.items():
            out.append((f"norm {name} {d}", lambda dtype=dtype, tuning=tuning: _norm_calls(dtype, tuning),
                        gpu_dtype and name in runs["rms_norm_gated"]))
        designs = transposes.PRESETS if every_preset else {"loaded": None}
        for design in designs:
            for l2norm in (True, False):
                for h0 in (False, True):
                    label = f"gdn {design}{' l2norm' if l2norm else ''}{' h0' if h0 else ''} {d}"
                    out.append((label, lambda dtype=dtype, design=design, l2norm=l2norm, h0=h0:
                                _gdn_calls(dtype, design, l2norm=l2norm, h0=h0),
                                gpu_dtype and l2norm and design in runs["gated_delta_rule_transposes"]))
        for entropy in (False, True):
            out.append((f"log-probs{' entropy' if entropy else ''} {d}",
                        lambda dtype=dtype, entropy=entropy: _log_probs_calls(dtype, entropy), gpu_dtype))
            out.append((f"log-probs{' entropy' if entropy else ''} vocab 37 {d}",
                        lambda dtype=dtype, entropy=entropy: _log_probs_calls(dtype, entropy, 37), False))
        if every_preset:
            out += _test_width_cases(dtype)
    return out


def _test_width_cases(dtype) -> list[Case]:
    """The other widths the CPU tests launch (conv widths 2 and 3, one row a window step, head dims 16
    and 32 with and without grouped heads), one configuration per design: a block shape the model's
    widths never give must compile too."""
    d = _dtype_name(dtype)
    one_row = {"fwd_rows": 1, "bwd_rows": 1}
    designs = {"tile-scratch": conv.PRESETS["tile-scratch"], "window-r1": replace(conv.PRESETS["window"], **one_row),
               "segment-r1": replace(conv.PRESETS["segment"], **one_row),
               "recompute": conv.ConvTuning(bwd_kernel="recompute")}
    out: list[Case] = []
    for width in (2, 3):
        for name, tuning in designs.items():
            out.append((f"conv {name} width {width} {d}", lambda tuning=tuning, width=width:
                        _conv_calls(dtype, tuning, bias=True, silu=True, width=width, d=40), False))
        out.append((f"conv state width {width} {d}", lambda width=width:
                    _conv_state_calls(dtype, bias=True, silu=True, from_x=width == 3, width=width, d=40), False))
    out.append((f"norm default width 40 {d}", lambda: _norm_calls(dtype, norm.PRESETS["default"], d=40), False))
    for heads, dims in (((2, 2), (32, 16)), ((3, 6), (16, 32))):
        out.append((f"gdn loaded heads {heads} dims {dims} {d}", lambda heads=heads, dims=dims:
                    _gdn_calls(dtype, "loaded", l2norm=True, h0=True, heads=heads, dims=dims), False))
    return out
