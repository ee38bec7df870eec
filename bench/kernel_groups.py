"""GPU kernels of a profile sorted into the op groups of `bench/scoring_work.py`, and the packed vs shared table.

`profile_shared_prefix.py --groups` prints, per group, the kernel time of the packed and the shared pass
and what the shared pass spends beyond `C / T` of the packed one: the measured side of the accounting
`scoring_work.py` does on the CPU (FLOPs and bytes), so the two tables read line by line.
"""

from __future__ import annotations

# First match wins: the specific names (fla's and our GDN stages, liger's CE) before the generic ones.
PATTERNS = (
    ("GDN (delta rule)", ("chunk_gated_delta", "chunk_fwd_kernel_o", "recompute_w_u", "solve_tril", "l2norm",
                          "chunk_local_cumsum", "merge_16x16", "wy_fwd", "chunk_state_fwd", "chunk_output_fwd",
                          "chunk_cumsum", "chunk_offsets", "prepare_wy", "kkt")),
    ("conv", ("causal_conv1d",)),
    ("attention", ("flash", "fmha", "attn")),
    ("LM head + log-softmax", ("liger_cross_entropy", "cross_entropy", "element_mul")),
    ("norms", ("rms_norm", "layer_norm", "rmsnorm", "_norm_")),
    ("rotary", ("rope", "rotary")),
    ("GEMMs (projections)", ("nvjet", "gemm", "cutlass", "cublas", "xmma", "sm90_", "sm80_")),
    ("gathers / scatters", ("index", "gather", "scatter")),
    ("memcpy / memset", ("memcpy", "memset")),  # the runtime's copies and fills (host to device: a plan, a static load)
    ("copies / casts", ("copy", "cat", "fill")),
    ("elementwise", ("elementwise", "reduce", "silu", "swiglu", "softplus", "sigmoid", "mul", "add")),
)
ORDER = [group for group, _ in PATTERNS] + ["other"]
GEMMS = "every GEMM kernel (cublas)"  # one line of `heaviest_excess`; matches the GEMM group's patterns


def group_of(kernel: str) -> str:
    """The op group of a GPU kernel's name (`other` when nothing matches)."""
    name = kernel.lower()
    for group, needles in PATTERNS:
        if any(needle in name for needle in needles):
            return group
    return "other"


def grouped(kernels: dict[str, float]) -> dict[str, float]:
    """{kernel name: us} -> {group: us}."""
    out: dict[str, float] = {}
    for name, us in kernels.items():
        group = group_of(name)
        out[group] = out.get(group, 0.0) + us
    return out


def table(packed: dict[str, float], shared: dict[str, float], compact_over_packed: float) -> str:
    """Per group: packed and shared kernel ms, shared / packed, and shared beyond `C / T` of packed (ms)."""
    p, s = grouped(packed), grouped(shared)
    lines = [f"{'group':24} {'packed ms':>10} {'shared ms':>10} {'ratio':>6} {'excess ms':>10}   (C/T = {compact_over_packed:.3f})"]
    for group in ORDER:
        if group not in p and group not in s:
            continue
        a, b = p.get(group, 0.0) / 1e3, s.get(group, 0.0) / 1e3
        ratio = f"{b / a:6.3f}" if a else "   nan"
        lines.append(f"{group:24} {a:10.2f} {b:10.2f} {ratio} {b - compact_over_packed * a:10.2f}")
    a, b = sum(p.values()) / 1e3, sum(s.values()) / 1e3
    lines.append(f"{'total':24} {a:10.2f} {b:10.2f} {b / a if a else float('nan'):6.3f} "
                 f"{b - compact_over_packed * a:10.2f}")
    return "\n".join(lines)


def heaviest_excess(packed: dict[str, float], shared: dict[str, float], compact_over_packed: float, top: int = 10) -> str:
    """The kernels that spend most beyond `C / T` of packed, one per line (a kernel the packed pass never runs,
    a gather of the plan's, is all excess): what the group table's excess column is made of. GEMMs count as
    one line: cuBLAS picks its kernel (tile shape) by row count, so the two passes' GEMMs have other names."""

    def merged(kernels: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, us in kernels.items():
            key = GEMMS if group_of(name) == "GEMMs (projections)" else name
            out[key] = out.get(key, 0.0) + us
        return out

    packed, shared = merged(packed), merged(shared)
    excess = {name: shared.get(name, 0.0) - compact_over_packed * packed.get(name, 0.0) for name in {*packed, *shared}}
    lines = [f"{'excess ms':>10} {'packed ms':>10} {'shared ms':>10}  group / kernel"]
    for name in sorted(excess, key=lambda n: (-excess[n], n))[:top]:  # ties by name: the same order every run
        lines.append(f"{excess[name] / 1e3:10.2f} {packed.get(name, 0.0) / 1e3:10.2f} {shared.get(name, 0.0) / 1e3:10.2f}"
                     f"  {group_of(name)} / {name[:110]}")
    return "\n".join(lines)
