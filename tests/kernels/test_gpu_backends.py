"""Every GPU backend against the torch reference, bf16 inputs, on CUDA (skipped elsewhere).

Error is relative in the Frobenius norm, ``|a - b| / |b|``, against the reference run in fp32 on
the same bf16 inputs. Bounds: forward 1e-2 and gradients 2e-2 (bf16 has an 8-bit mantissa,
2^-8 = 3.9e-3 per rounding; the kernels round intermediates to bf16 a few times).
"""

import pytest
import torch
import torch.nn.functional as F
from patchgen.kernels import registry
from patchgen.kernels.reference import attention as attention_ref
from patchgen.kernels.reference import causal_conv1d as conv_ref
from patchgen.kernels.reference import cross_entropy as ce_ref
from patchgen.kernels.reference import gated_delta_rule as gdn_ref
from patchgen.kernels.reference import moe_experts as moe_ref
from patchgen.kernels.reference import norms, rotary, swiglu_mlp

pytestmark = pytest.mark.gpu
FORWARD_BOUND, GRAD_BOUND = 1e-2, 2e-2
# Qwen3.5-4B/9B's GDN widths, as in tests/triton/test_gpu.py: head counts and dims are compile-time
# constants of the Triton kernels, so one shape across the GPU suite means one set of cold compiles.
GDN_WIDTHS = (16, 32, 128, 128)


def backend(slot, name):
    handle = registry.handle(slot, name)
    if not handle.available:
        pytest.skip(f"{slot}/{name} unavailable: {handle.reason}")
    return handle.load()


def relative_error(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def compare(fn, ref, tensors, kwargs=None, constants=0, forward_bound=FORWARD_BOUND, grad_bound=GRAD_BOUND):
    """Run ``fn`` on bf16 ``tensors`` and ``ref`` on their fp32 copies; check outputs and the gradients
    of every tensor but the last ``constants`` (such as rotary's cos and sin)."""
    kwargs = kwargs or {}
    runs = []
    for impl, dtype in ((fn, None), (ref, torch.float32)):
        leaves = [
            t.detach().to(dtype or t.dtype).requires_grad_(i < len(tensors) - constants)
            for i, t in enumerate(tensors)
        ]
        out = impl(*leaves, **kwargs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
        runs.append((leaves, outs))
    (leaves, outs), (ref_leaves, ref_outs) = runs
    for i, (a, b) in enumerate(zip(outs, ref_outs)):
        assert relative_error(a, b) < forward_bound, f"output {i}: {relative_error(a, b):.2e}"
    weights = [torch.randn_like(b) for b in ref_outs]
    trainable = [i for i, t in enumerate(leaves) if t.requires_grad]
    got = torch.autograd.grad(
        sum((a.float() * w).sum() for a, w in zip(outs, weights)), [leaves[i] for i in trainable]
    )
    want = torch.autograd.grad(
        sum((b * w).sum() for b, w in zip(ref_outs, weights)), [ref_leaves[i] for i in trainable]
    )
    for i, a, b in zip(trainable, got, want):
        assert relative_error(a, b) < grad_bound, f"gradient of input {i}: {relative_error(a, b):.2e}"


def cuda(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


@pytest.mark.parametrize("name", ["fla", "triton"])
def test_gated_delta_rule_with_cu_seqlens_and_initial_state(name):
    fn = backend("gated_delta_rule", name)
    torch.manual_seed(0)
    T, H, HV, K, V = 300, *GDN_WIDTHS
    cu = torch.tensor([0, 100, 233, 300], dtype=torch.int32, device="cuda")
    q, k, v = cuda(1, T, H, K), cuda(1, T, H, K), cuda(1, T, HV, V)
    g = F.logsigmoid(cuda(1, T, HV, dtype=torch.float32) + 3)
    beta = torch.rand(1, T, HV, device="cuda").to(torch.bfloat16)
    h0 = cuda(3, HV, K, V, dtype=torch.float32, scale=0.1)
    kwargs = {
        "initial_state": None,
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": True,
        "cu_seqlens": cu,
    }

    def with_state(impl):
        return lambda q, k, v, g, beta, h0, **kw: impl(
            q, k, v, g, beta, **{**kw, "initial_state": h0.float()}
        )

    compare(with_state(fn), with_state(gdn_ref.gated_delta_rule), [q, k, v, g, beta, h0], kwargs)


@pytest.mark.parametrize("name", ["fla", "triton"])
def test_causal_conv1d(name):
    fn = backend("causal_conv1d", name)
    cu = torch.tensor([0, 3, 130, 257], dtype=torch.int32, device="cuda")
    compare(fn, conv_ref.causal_conv1d, [cuda(1, 257, 256), cuda(256, 4), cuda(256)], {"cu_seqlens": cu})


@pytest.mark.parametrize("name", ["fla", "triton"])
def test_causal_conv1d_with_the_packed_rows_chunk_table_equals_it_without(name):
    """The packed path hands the conv the PackedRow's host boundaries and chunk table (fla's own layout, 64-row
    chunks); output and gradients are those of the call that derives them, bit for bit."""
    from patchgen.kernels.modeling.packing import packed_row

    fn = backend("causal_conv1d", name)
    cu = torch.tensor([0, 40, 49, 119, 119, 184], dtype=torch.int32, device="cuda")  # an empty sequence too
    row = packed_row({"cu_seq_lens_q": cu}, 1, 184, cu.device)
    x, weight, bias = cuda(1, 184, 256), cuda(256, 4), cuda(256)
    grad = cuda(1, 184, 256)
    results = []
    for extras in ({}, {"cu_seqlens_cpu": row.cu_seqlens_cpu, "chunk_indices": row.chunk_indices}):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
        y = fn(*leaves, cu_seqlens=cu.clone(), **extras)  # a tensor fla has not seen: it derives its own table
        y.backward(grad)
        results.append([y.detach(), *(t.grad for t in leaves)])
    for plain, given in zip(*results):
        assert torch.equal(plain, given)


@pytest.mark.parametrize("name", ["fla", "triton"])
def test_rms_norm_gated(name):
    fn = backend("rms_norm_gated", name)
    compare(
        lambda x, z, w: fn(x, z, w, 1e-6),
        lambda x, z, w: norms.rms_norm_gated(x, z, w, 1e-6),
        [cuda(64, 128), cuda(64, 128), cuda(128)],
    )


def test_liger_rms_norm():
    fn = backend("rms_norm", "liger")
    compare(
        lambda x, w: fn(x, w, 1e-6),
        lambda x, w: norms.rms_norm(x, w, 1e-6),
        [cuda(64, 256), cuda(256, scale=0.1)],
    )


@pytest.mark.parametrize(
    "slot, name, width",
    [
        ("rms_norm", "liger", 256),
        ("rms_norm", "liger", 2560),
        ("rms_norm_gated", "triton", 128),
    ],
)
def test_a_row_of_a_token_wise_norm_has_the_same_bits_whatever_the_row_count(slot, name, width):
    """Shared-prefix training is bit-identical to packed in bf16 only if a token's output does not
    depend on how many rows its call holds (C compact rows against T packed ones); 140000 rows cross
    liger's 32768-row switch to its block kernel and fla's tuning buckets of 65536 rows, 1000 do not.
    fla's gated norm is not listed: it is tuned per bucket, and the result would hang on which
    configurations the two buckets' tunings picked (bench/norm_config_bits.py)."""
    fn = backend(slot, name)
    many = cuda(140000, width)
    weight = cuda(width, scale=0.1)
    if slot == "rms_norm":
        whole, part = fn(many, weight, 1e-6), fn(many[:1000].clone(), weight, 1e-6)
    else:
        gate = cuda(140000, width)
        whole, part = fn(many, gate, weight, 1e-6), fn(many[:1000].clone(), gate[:1000].clone(), weight, 1e-6)
    assert torch.equal(whole[:1000], part)


def test_liger_partial_rotary():
    fn = backend("rotary", "liger")
    angles = torch.rand(2, 33, 32, device="cuda") * 6
    angles = torch.cat((angles[..., :16], angles[..., :16]), -1)
    compare(
        fn, rotary.rotary, [cuda(2, 8, 33, 128), cuda(2, 2, 33, 128), angles.cos(), angles.sin()], constants=2
    )


def test_liger_swiglu_mlp():
    fn = backend("swiglu_mlp", "liger")
    compare(
        fn,
        swiglu_mlp.swiglu_mlp,
        [cuda(64, 256), cuda(512, 256, scale=0.05), cuda(512, 256, scale=0.05), cuda(256, 512, scale=0.05)],
    )


@pytest.mark.parametrize(
    "name", ["flash_attention_2", "flash_attention_3", "flash_attention_4", "torch_varlen", "sdpa"]
)
def test_attention_gqa_and_shorter_queries(name):
    fn = backend("attention", name)
    cu_q = torch.tensor([0, 50, 51, 180], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 90, 150, 279], dtype=torch.int32, device="cuda")
    kwargs = {
        "cu_seqlens_q": cu_q,
        "cu_seqlens_k": cu_k,
        "max_seqlen_q": 129,
        "max_seqlen_k": 129,
        "scale": 128**-0.5,
        "causal": True,
    }
    compare(fn, attention_ref.eager, [cuda(180, 8, 128), cuda(279, 2, 128), cuda(279, 2, 128)], kwargs)


def test_liger_cross_entropy():
    fn = backend("cross_entropy", "liger")
    labels = torch.randint(0, 4096, (256,), device="cuda")
    labels[::7] = -100

    def nll_only(impl):
        return lambda h, w: impl(h, w, labels)[0]

    compare(nll_only(fn), nll_only(ce_ref.chunked), [cuda(256, 512), cuda(4096, 512, scale=0.05)])


def test_entropy_calls_reach_a_backend_with_entropy_when_liger_is_bound():
    """TRL asks for the entropy on its policy pass; liger's fused head has none."""
    from patchgen.kernels import capabilities as caps
    from patchgen.kernels.modeling.lm_head import HeadRequest, causal_lm_head
    from patchgen.kernels.selection import resolve

    backend("cross_entropy", "liger")
    table = resolve(None, "gpu")
    assert table.backend("cross_entropy") == "liger"
    head = torch.nn.Linear(512, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden, labels = cuda(1, 256, 512), torch.randint(0, 4096, (1, 256), device="cuda")
    out = causal_lm_head(
        head, table, hidden, labels=labels, request=HeadRequest(log_probs=True, entropy=True)
    )
    logits = head(hidden)[0, :-1].float()
    expected = torch.special.entr(logits.softmax(-1)).sum(-1)
    assert relative_error(out.entropy[0, :-1], expected) < FORWARD_BOUND
    assert table.serving("cross_entropy", caps.ENTROPY) is not table.cross_entropy


@pytest.mark.parametrize("name", ["liger", "grouped_mm"])
def test_moe_experts(name):
    fn = backend("moe_experts", name)
    E, N, d, inter, top_k = 8, 128, 256, 128, 2
    index = torch.stack([torch.randperm(E, device="cuda")[:top_k] for _ in range(N)])
    weights = torch.rand(N, top_k, device="cuda").to(torch.bfloat16)

    def bound(impl):
        return lambda h, w, gu, dp: impl(h, index, w, gu, dp, F.silu)

    compare(
        bound(fn),
        bound(moe_ref.eager),
        [cuda(N, d), weights, cuda(E, 2 * inter, d, scale=0.05), cuda(E, d, inter, scale=0.05)],
    )


def test_fla_gated_delta_rule_forward_even_where_its_backward_is_refused():
    fla = pytest.importorskip("patchgen.kernels.backends.fla", exc_type=ImportError)
    T, H, HV, K, V = 300, *GDN_WIDTHS
    cu = torch.tensor([0, 100, 233, 300], dtype=torch.int32, device="cuda")
    q, k, v = cuda(1, T, H, K), cuda(1, T, H, K), cuda(1, T, HV, V)
    g = F.logsigmoid(cuda(1, T, HV, dtype=torch.float32) + 3)
    beta = torch.rand(1, T, HV, device="cuda").to(torch.bfloat16)
    h0 = cuda(3, HV, K, V, dtype=torch.float32, scale=0.1)
    kwargs = {
        "initial_state": h0,
        "output_final_state": True,
        "use_qk_l2norm_in_kernel": True,
        "cu_seqlens": cu,
    }
    with torch.no_grad():
        o, final = fla.gated_delta_rule(q, k, v, g, beta, **kwargs)
        o_ref, final_ref = gdn_ref.gated_delta_rule(*(x.float() for x in (q, k, v, g, beta)), **kwargs)
    assert relative_error(o, o_ref) < FORWARD_BOUND
    assert relative_error(final, final_ref) < FORWARD_BOUND
