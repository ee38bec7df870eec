"""Launch shapes, profiles and pipelining checks of our Triton kernels on a CUDA GPU (not tests).

Same cases as bench/triton_kernels.py (T = 16384 in 4 sequences, bf16, Qwen3.5-4B/9B widths).

    python bench/triton_tuning.py --sweep [--tuning t.json]   # conv, norm and GDN-state launch shapes;
                                                              # the best go to t.json for triton_kernels.py
    python bench/triton_tuning.py --profile                   # GDN forward + backward kernel times, ours vs fla
    python bench/triton_tuning.py --stages                    # pipelining depth of the persistent backwards
    ncu --clock-control none --section SpeedOfLight --section LaunchStats --section Occupancy \\
        -k regex:"causal_conv1d|rms_norm_gated" python bench/triton_tuning.py --ncu
"""

from __future__ import annotations

import argparse
import sys

import torch
from triton_kernels import (
    BYTES,
    conv_inputs,
    gdn_arms,
    gdn_inputs,
    machine_rates,
    make_step,
    norm_inputs,
    timed,
)


def sweep(args, bandwidth):
    """GPU time of each kernel pass alone over launch configurations."""
    import json
    from dataclasses import asdict, replace

    conv, norm, chunk_state = tuning_modules()
    best = {}
    best["conv"] = _sweep_conv(args, bandwidth, replace, conv)
    torch.cuda.empty_cache()
    best["norm"] = _sweep_norm(args, bandwidth, replace, norm)
    torch.cuda.empty_cache()
    best["state"] = _sweep_gdn(args, replace, chunk_state)
    best = {name: asdict(t) for name, t in best.items()}
    print("best:", best)
    if args.tuning:
        with open(args.tuning, "w") as fh:
            json.dump(best, fh)


def tuning_modules():
    """The kernel modules that hold a TUNING (the package re-exports functions of the same names)."""
    import importlib

    return [importlib.import_module(f"patchgen.kernels.triton.{name}") for name in
            ("causal_conv1d", "rms_norm_gated", "gated_delta_rule.chunk_state")]


def apply_tuning(path):
    import json
    from dataclasses import replace

    with open(path) as fh:
        best = json.load(fh)
    for mod, name in zip(tuning_modules(), ("conv", "norm", "state")):
        mod.TUNING = replace(mod.TUNING, **best[name])
        print(f"tuning {name}: {mod.TUNING}")


def _sweep_conv(args, bandwidth, replace, conv):
    (x, w), (cu,) = conv_inputs(False)
    x = x[0]
    dy = torch.randn_like(x)
    floor = {"fwd": 2 * x.numel() * BYTES / bandwidth * 1e3, "bwd": 3 * x.numel() * BYTES / bandwidth * 1e3}
    print(f"\nconv floors: fwd {floor['fwd']:.3f} ms, bwd {floor['bwd']:.3f} ms")
    best, best_ms = conv.TUNING, float("inf")
    for bt, bd, nw in [(64, 64, 4), (32, 128, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8), (32, 256, 4),
                       (64, 256, 8), (16, 256, 4), (128, 128, 8)]:
        t = replace(best, fwd_bt=bt, fwd_bd=bd, fwd_warps=nw)
        ms = timed(lambda t=t: conv.conv_fwd(x, w, None, cu, True, t), args.repeats)
        print(f"conv fwd BT={bt:<4} BD={bd:<4} warps={nw}: {ms:.3f} ms = {ms / floor['fwd']:.2f}x floor")
        if ms < best_ms:
            best_ms, fwd = ms, t
    best, best_ms = fwd, float("inf")
    for bt, bd, nw, per_sm in [(32, 64, 4, 4), (64, 64, 4, 4), (64, 64, 8, 4), (32, 128, 4, 4), (64, 128, 8, 2),
                               (64, 128, 8, 4), (128, 64, 8, 2), (32, 256, 8, 2), (64, 64, 4, 8), (32, 64, 4, 8)]:
        t = replace(fwd, bwd_bt=bt, bwd_bd=bd, bwd_warps=nw, bwd_programs_per_sm=per_sm)
        try:
            ms = timed(lambda t=t: conv.conv_bwd(x, w, None, dy, cu, True, t), args.repeats)
            print(f"conv bwd BT={bt:<4} BD={bd:<4} warps={nw} per_sm={per_sm}: {ms:.3f} ms = "
                  f"{ms / floor['bwd']:.2f}x floor")
        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory or registers
            print(f"conv bwd BT={bt} BD={bd} warps={nw} per_sm={per_sm}: failed {exc!r}")
            continue
        if ms < best_ms:
            best_ms, best = ms, t
    return best


def _sweep_norm(args, bandwidth, replace, norm):
    (x, gate, w), _ = norm_inputs(False)
    dy = torch.randn_like(x)
    floor = {"fwd": 3 * x.numel() * BYTES / bandwidth * 1e3, "bwd": 5 * x.numel() * BYTES / bandwidth * 1e3}
    print(f"\nnorm floors: fwd {floor['fwd']:.3f} ms, bwd {floor['bwd']:.3f} ms")
    best_ms = float("inf")
    for el, nw in [(2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16)]:
        t = replace(norm.TUNING, fwd_elements=el, fwd_warps=nw)
        ms = timed(lambda t=t: norm.norm_fwd(x, gate, w, 1e-6, t), args.repeats)
        print(f"norm fwd elements={el:<5} warps={nw}: {ms:.3f} ms = {ms / floor['fwd']:.2f}x floor")
        if ms < best_ms:
            best_ms, fwd = ms, t
    best, best_ms = fwd, float("inf")
    _, rstd = norm.norm_fwd(x, gate, w, 1e-6)
    for el, nw, per_sm in [(2048, 4, 8), (4096, 4, 4), (4096, 8, 4), (8192, 8, 2), (2048, 4, 16), (4096, 8, 8),
                           (1024, 2, 16)]:
        t = replace(fwd, bwd_elements=el, bwd_warps=nw, bwd_programs_per_sm=per_sm)
        ms = timed(lambda t=t: norm.norm_bwd(x, gate, w, rstd, dy, t), args.repeats)
        print(f"norm bwd elements={el:<5} warps={nw} per_sm={per_sm:<3}: {ms:.3f} ms = {ms / floor['bwd']:.2f}x floor")
        if ms < best_ms:
            best_ms, best = ms, t
    return best


def _sweep_gdn(args, replace, chunk_state):
    arms = gdn_arms(False)
    default = best = chunk_state.TUNING
    best_ms = float("inf")
    for fbv, fw, bbv, bw in [(None, 4, None, 8), (32, 4, 32, 4), (32, 4, 32, 8), (64, 8, 64, 4), (32, 2, 32, 4),
                             (64, 4, 32, 4)]:
        chunk_state.TUNING = replace(default, fwd_block_v=fbv, fwd_warps=fw, bwd_block_v=bbv, bwd_warps=bw)
        fwd = timed(make_step(arms["ours"], gdn_inputs, False), args.repeats)
        both = timed(make_step(arms["ours"], gdn_inputs, True), args.repeats)
        print(f"gdn ours state fwd BV={fbv} warps={fw}, bwd BV={bbv} warps={bw}: fwd {fwd:.3f} ms, fwd+bwd {both:.3f} ms")
        if both < best_ms:
            best_ms, best = both, chunk_state.TUNING
    chunk_state.TUNING = default
    return best


def stages_check(args):
    """The persistent backward kernels with their loop pipelined at several depths: time, and outputs
    identical to the default's (the same arithmetic in the same order)."""
    from dataclasses import replace

    conv, norm, _ = tuning_modules()
    (x, w), (cu,) = conv_inputs(False)
    x = x[0]
    dy = torch.randn_like(x)
    want = conv.conv_bwd(x, w, None, dy, cu, True)
    for stages in (None, 1, 2, 3):
        t = replace(conv.TUNING, bwd_stages=stages)
        same = all(torch.equal(a, b) for a, b in zip(conv.conv_bwd(x, w, None, dy, cu, True, t)[:2], want[:2]))
        ms = timed(lambda t=t: conv.conv_bwd(x, w, None, dy, cu, True, t), args.repeats)
        print(f"conv bwd stages={stages}: {ms:.3f} ms, outputs identical to the default's: {same}")
    (x, gate, w), _ = norm_inputs(False)
    dy = torch.randn_like(x)
    _, rstd = norm.norm_fwd(x, gate, w, 1e-6)
    want = norm.norm_bwd(x, gate, w, rstd, dy)
    for stages in (None, 1, 2, 3):
        t = replace(norm.TUNING, bwd_stages=stages)
        same = all(torch.equal(a, b) for a, b in zip(norm.norm_bwd(x, gate, w, rstd, dy, t)[:2], want[:2]))
        ms = timed(lambda t=t: norm.norm_bwd(x, gate, w, rstd, dy, t), args.repeats)
        print(f"norm bwd stages={stages}: {ms:.3f} ms, outputs identical to the default's: {same}")


def ncu_targets():
    """Each conv and gated-norm pass of ours once, after a compiling call (for ncu -k)."""
    conv, norm, _ = tuning_modules()
    (x, w), (cu,) = conv_inputs(False)
    x = x[0]
    dy = torch.randn_like(x)
    for _ in range(2):
        conv.conv_fwd(x, w, None, cu, True)
        conv.conv_bwd(x, w, None, dy, cu, True)
    torch.cuda.synchronize()
    (x, gate, w), _ = norm_inputs(False)
    for _ in range(2):
        _, rstd = norm.norm_fwd(x, gate, w, 1e-6)
        norm.norm_bwd(x, gate, w, rstd, torch.ones_like(x))
    torch.cuda.synchronize()


def profile(args):
    """Per-kernel GPU time of one GDN forward + backward (after warm-up), ours and fla."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for arm in ("ours", "fla"):
        for with_state in (False, True):
            arms = gdn_arms(with_state)
            if arm not in arms:
                continue
            step = make_step(arms[arm], lambda b, s=with_state: gdn_inputs(b, with_state=s), True)
            for _ in range(3):
                step()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            totals = {}
            for evt in prof.events():
                if evt.device_type == torch.autograd.DeviceType.CUDA:
                    totals[evt.name] = totals.get(evt.name, 0.0) + evt.device_time / 5 / 1e3
            total = sum(totals.values())
            print(f"\nGDN fwd+bwd {arm} {'with h0' if with_state else ''}: kernel time {total:.3f} ms per step")
            for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:14]:
                print(f"  {ms:8.3f} ms  {100 * ms / total:5.1f}%  {name[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sweep", action="store_true", help="time launch configurations")
    mode.add_argument("--profile", action="store_true", help="per-kernel GDN times")
    mode.add_argument("--stages", action="store_true", help="pipelining depths of the persistent backwards")
    mode.add_argument("--ncu", action="store_true", help="run each conv and norm kernel twice, for ncu")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tuning", help="where --sweep writes the best launch configurations (JSON)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/triton_tuning.py needs a CUDA device")
    if args.ncu:
        return ncu_targets()
    bandwidth, matmul = machine_rates(args.repeats)
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e12:.2f} TB/s, bf16 matmul {matmul / 1e12:.0f} TFLOP/s")
    if args.stages:
        stages_check(args)
    elif args.sweep:
        sweep(args, bandwidth)
    else:
        profile(args)


if __name__ == "__main__":
    main()
