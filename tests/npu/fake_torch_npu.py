"""A stand-in for ``torch_npu`` on machines without an Ascend NPU, written by us in plain torch.

Each operator follows torch_npu's documentation (docs/npu.md lists the pages): the same argument
names, layouts and return tuples, and a ``FakeNpuRejected`` wherever the documented constraints say
the real operator would refuse the call. Only the modes patchgen uses are computed; any other
mode raises ``NotImplementedError`` rather than guessing. Not a correctness oracle for the
hardware: it checks that our adapters call the operators as documented and that the documented
semantics give the reference results.
"""

from __future__ import annotations

import importlib.machinery
import itertools
import types

import torch
import torch.nn.functional as F

VERSION = "2.14.0"
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
COMPRESSED = 2048  # side of the compressed causal mask of sparse modes 2, 3, 4
MAX_VARLEN_SEGMENTS = 1024
MAX_GROUPS = 1024


class FakeNpuRejected(ValueError):
    """The real operator's documented constraints reject this call."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise FakeNpuRejected(message)


def _float_dtypes(*tensors) -> None:
    dtypes = {t.dtype for t in tensors}
    _require(len(dtypes) == 1, f"inputs must share one dtype, got {sorted(map(str, dtypes))}")
    _require(tensors[0].dtype in FLOATS, f"dtype must be float16, bfloat16 or float32, got {tensors[0].dtype}")


def _int_list(name: str, value) -> list[int]:
    _require(
        isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value),
        f"{name} must be a list of Python ints (int[]), got {type(value).__name__}",
    )
    return list(value)


def _cumulative_ends(name: str, ends: list[int], total: int) -> list[int]:
    """Segment lengths from cumulative ends without the leading 0; trailing zeros mark skipped segments."""
    _require(1 <= len(ends) <= MAX_VARLEN_SEGMENTS, f"{name} holds 1..{MAX_VARLEN_SEGMENTS} entries, got {len(ends)}")
    used = len(ends)
    while used > 1 and ends[used - 1] == 0:
        used -= 1
    live = ends[:used]
    _require(all(b >= 0 for b in live), f"{name} must not be negative: {ends}")
    _require(all(a <= b for a, b in itertools.pairwise(live)), f"{name} must not decrease: {ends}")
    _require(live[-1] == total, f"{name} must end at the row length {total}, got {live[-1]}")
    starts = [0, *live[:-1]]
    return [end - start for start, end in zip(starts, live)] + [0] * (len(ends) - used)


def _is_compressed_causal(mask) -> bool:
    if mask is None or mask.dtype not in (torch.bool, torch.uint8) or tuple(mask.shape) != (COMPRESSED, COMPRESSED):
        return False
    expected = torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=mask.device).triu(1)
    return bool(torch.equal(mask.bool(), expected))


def npu_fusion_attention(
    query,
    key,
    value,
    head_num,
    input_layout,
    *,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    scale=1.0,
    keep_prob=1.0,
    pre_tockens=2147483647,
    next_tockens=2147483647,
    inner_precise=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
    softmax_layout="",
):
    """``softmax(mask(scale * q k^T)) v``; returns (out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)."""
    _require(input_layout in LAYOUTS, f"input_layout must be one of {LAYOUTS}, got {input_layout!r}")
    if input_layout != "TND":
        raise NotImplementedError(f"the fake computes only the TND (varlen) layout, not {input_layout!r}")
    _float_dtypes(query, key, value)
    _require(padding_mask is None, "padding_mask is not supported yet")
    _require(query.dim() == 3 and key.dim() == 3 and value.dim() == 3, "TND inputs are [T, N, D]")
    _require(key.shape == value.shape, f"key and value must have one shape, got {tuple(key.shape)}, {tuple(value.shape)}")
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[2]
    _require(isinstance(head_num, int) and head_num == heads, f"head_num {head_num} must equal query's N {heads}")
    _require(1 <= heads <= 256, f"query heads must lie in 1..256, got {heads}")
    _require(kv_heads > 0 and heads % kv_heads == 0, f"query heads {heads} must be a multiple of key heads {kv_heads}")
    _require(key.shape[2] == dim and dim >= value.shape[2], "head dims must satisfy Dq == Dk >= Dv")
    _require(1 <= dim <= 768, f"head dim must lie in 1..768, got {dim}")
    _require(isinstance(scale, float), f"scale is a float, got {type(scale).__name__}")
    _require(isinstance(keep_prob, float) and 0.0 < keep_prob <= 1.0, f"keep_prob lies in (0, 1], got {keep_prob}")
    if keep_prob != 1.0 or pse is not None or prefix is not None:
        raise NotImplementedError("the fake computes no dropout, pse or prefix")
    _require(actual_seq_qlen is not None and actual_seq_kvlen is not None, "TND needs actual_seq_qlen and actual_seq_kvlen")
    ends_q = _int_list("actual_seq_qlen", actual_seq_qlen)
    ends_k = _int_list("actual_seq_kvlen", actual_seq_kvlen)
    _require(len(ends_q) == len(ends_k), "actual_seq_qlen and actual_seq_kvlen must have one length")
    lengths_q = _cumulative_ends("actual_seq_qlen", ends_q, query.shape[0])
    lengths_k = _cumulative_ends("actual_seq_kvlen", ends_k, key.shape[0])
    _require(sparse_mode in range(9), f"sparse_mode lies in 0..8, got {sparse_mode}")
    _require(sparse_mode != 5, "varlen does not support sparse_mode 5 (uncompressed prefix)")
    if sparse_mode in (2, 3, 4, 6, 7, 8):
        _require(_is_compressed_causal(atten_mask), f"sparse_mode {sparse_mode} needs the 2048x2048 upper-triangular bool atten_mask")
    if sparse_mode not in (0, 2, 3) or (sparse_mode == 0 and atten_mask is not None):
        raise NotImplementedError(f"the fake computes sparse_mode 0 without a mask, 2 and 3, not {sparse_mode}")

    group = heads // kv_heads
    outputs, maxima, sums = [], [], []
    q_start = k_start = 0
    for lq, lk in zip(lengths_q, lengths_k):
        q = query[q_start : q_start + lq].transpose(0, 1).float()
        k = key[k_start : k_start + lk].repeat_interleave(group, dim=1).transpose(0, 1).float()
        v = value[k_start : k_start + lk].repeat_interleave(group, dim=1).transpose(0, 1).float()
        scores = (q @ k.transpose(-1, -2)) * scale
        if sparse_mode in (2, 3):
            rows = torch.arange(lq, device=query.device).unsqueeze(-1)
            cols = torch.arange(lk, device=query.device)
            shift = lk - lq if sparse_mode == 3 else 0  # 3: rightDownCausal, 2: leftUpCausal
            masked = cols > rows + shift
            _require(lq == 0 or not bool(masked.all(-1).any()), "varlen masks must not mask a whole row")
            scores = scores.masked_fill(masked, float("-inf"))
        top = scores.amax(-1, keepdim=True) if lk else scores.new_zeros(heads, lq, 1)
        weights = (scores - top).exp()
        total = weights.sum(-1, keepdim=True)
        outputs.append(((weights / total) @ v).transpose(0, 1).to(query.dtype))
        maxima.append(top.expand(heads, lq, 8))
        sums.append(total.expand(heads, lq, 8))
        q_start, k_start = q_start + lq, k_start + lk
    out = torch.cat(outputs, dim=0) if outputs else query.new_zeros(0, heads, value.shape[2])
    # Default softmax layout for TND is NTD, with the statistic repeated over 8 lanes.
    softmax_max = torch.cat(maxima, dim=1).detach()
    softmax_sum = torch.cat(sums, dim=1).detach()
    return out, softmax_max, softmax_sum, query.new_empty(0), 0, 0, 0


def npu_rms_norm(input, gamma, epsilon=1e-6):
    """``(input * rstd * gamma, rstd)`` with rstd over gamma's trailing dims, in fp32."""
    _float_dtypes(input, gamma)
    _require(1 <= input.dim() <= 8, f"input has 1..8 dims, got {input.dim()}")
    _require(
        gamma.dim() <= input.dim() and tuple(gamma.shape) == tuple(input.shape[input.dim() - gamma.dim() :]),
        f"gamma's shape {tuple(gamma.shape)} must equal input's trailing dims {tuple(input.shape)}",
    )
    dims = tuple(range(input.dim() - gamma.dim(), input.dim()))
    x = input.float()
    rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + epsilon)
    return (x * rstd * gamma.float()).to(input.dtype), rstd


def _rotary_shapes(shape) -> set[tuple[int, ...]]:
    """r1/r2 shapes the documented layouts allow for an input of ``shape`` (BNSD, BSND or SBND)."""
    a, b, c, d = shape
    return {
        (1, 1, c, d), (a, 1, c, d), (a, b, c, d),  # BNSD: 11SD, B1SD, BNSD
        (1, b, 1, d), (a, b, 1, d),  # BSND: 1S1D, BS1D (BSND equals the full shape)
        (a, 1, 1, d),  # SBND: S11D (SB1D and SBND are covered above)
    }


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    """``r1 * input + r2 * rotate(input)``; half mode rotates ``cat(-x2, x1)`` of the two halves."""
    _require(rotary_mode in ("half", "interleave"), f"rotary_mode is 'half' or 'interleave', got {rotary_mode!r}")
    _float_dtypes(input, r1, r2)
    _require(input.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "input, r1 and r2 are 4-D")
    _require(r1.shape == r2.shape, "r1 and r2 must have one shape")
    dim = input.shape[-1]
    _require(dim % 2 == 0 and dim < 896, f"D must be even and below 896, got {dim}")
    _require(tuple(r1.shape) in _rotary_shapes(tuple(input.shape)), f"r1 shape {tuple(r1.shape)} fits no documented layout of {tuple(input.shape)}")
    if rotary_mode == "half":
        first, second = input.chunk(2, dim=-1)
        turned = torch.cat((-second, first), dim=-1)
    else:
        pairs = torch.stack((-input[..., 1::2], input[..., ::2]), dim=-1)
        turned = pairs.flatten(-2)
    return r1 * input + r2 * turned


def npu_swiglu(input, dim=-1):
    """``silu(A) * B`` where A is the first and B the second half of ``input`` along ``dim``."""
    _require(input.dtype in FLOATS, f"dtype must be float16, bfloat16 or float32, got {input.dtype}")
    _require(input.is_contiguous(), "input must be contiguous")
    _require(input.numel() > 0, "input must not be empty")
    _require(-input.dim() <= dim < input.dim() and input.shape[dim] % 2 == 0, f"input's dim {dim} must split in two halves")
    first, second = input.chunk(2, dim=dim)
    return F.silu(first) * second


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
    tuning_config=None,
):
    """``y_i = x_i @ weight_i``; the fake computes the single-tensor case grouped along M (group_type 0)."""
    _require(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), "x and weight are lists of tensors")
    quantized = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input)
    if any(a is not None for a in quantized) or act_type != 0 or output_dtype not in (None, x[0].dtype):
        raise NotImplementedError("the fake computes no bias, quantization or activation")
    if not (len(x) == 1 and len(weight) == 1 and isinstance(group_list, torch.Tensor)):
        raise NotImplementedError("the fake computes only single x, single weight, group_list as a Tensor")
    a, w = x[0], weight[0]
    _float_dtypes(a, w)
    _require(group_type == 0, f"single-tensor weight needs group_type 0 (M axis), got {group_type}")
    _require(split_item in (2, 3), f"a single output needs split_item 2 or 3, got {split_item}")
    _require(a.dim() == 2 and w.dim() == 3, f"x is 2-D and weight 3-D, got {a.dim()}-D and {w.dim()}-D")
    _require(a.is_contiguous(), "x must not be transposed")
    transposed = w.transpose(-2, -1).is_contiguous()
    _require(w.is_contiguous() or transposed, "weight must be contiguous or the transpose of a contiguous tensor")
    _require(a.shape[1] == w.shape[1], f"x's K {a.shape[1]} must equal weight's K {w.shape[1]}")
    _require(max(a.shape[1], w.shape[2]) < 65536, "inner dims must be below 65536")
    _require(group_list.dtype == torch.int64 and group_list.dim() == 1, "group_list is a 1-D int64 tensor")
    _require(group_list.shape[0] == w.shape[0], f"group_list has one entry per weight group ({w.shape[0]})")
    _require(group_list.shape[0] <= MAX_GROUPS, f"at most {MAX_GROUPS} groups")
    values = [int(v) for v in group_list.tolist()]
    _require(all(v >= 0 for v in values), "group_list must not be negative")
    if group_list_type == 0:
        _require(all(p <= n for p, n in itertools.pairwise(values)), "cumulative group_list must not decrease")
        _require(values[-1] == a.shape[0], f"group_list's last value {values[-1]} must equal x's rows {a.shape[0]}")
        ends = values
    elif group_list_type == 1:
        _require(sum(values) == a.shape[0], f"group sizes sum to {sum(values)}, x has {a.shape[0]} rows")
        ends = torch.tensor(values).cumsum(0).tolist()
    else:
        raise NotImplementedError(f"the fake computes group_list_type 0 and 1, not {group_list_type}")
    pieces, start = [], 0
    for group, end in enumerate(ends):
        pieces.append(a[start:end] @ w[group])
        start = end
    return [torch.cat(pieces, dim=0)]


OPERATORS = ("npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_grouped_matmul")


def module() -> types.ModuleType:
    """A fresh ``torch_npu`` module object holding the fake operators."""
    fake = types.ModuleType("torch_npu")
    fake.__version__ = VERSION
    fake.__file__ = __file__
    # transformers probes for torch_npu with importlib.util.find_spec, which reads __spec__.
    fake.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    for name in OPERATORS:
        setattr(fake, name, globals()[name])
    return fake


def device_module() -> types.ModuleType:
    """A fresh ``torch.npu`` that reports one available device."""
    npu = types.ModuleType("torch.npu")
    npu.is_available = lambda: True
    npu.device_count = lambda: 1
    return npu
