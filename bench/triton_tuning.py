"""Launch shapes, profiles and pipelining checks of our Triton kernels on a CUDA GPU (not tests).

Same cases as bench/triton_kernels.py (T = 16384 in 4 sequences, bf16, Qwen3.5-4B/9B widths).

    python bench/triton_tuning.py --sweep [--only conv,norm] [--presets a,b] [--csv s.csv] [--tuning t.json]
        # every launch preset of the conv and gated norm (bench/triton_presets.py: checked against float64,
        # then GPU ms, CUDA-graph ms, host us per call and x floor per pass), the GDN-state launch shapes;
        # the fastest forward + backward of each go to t.json for triton_kernels.py --tuning
        # (t.json also names the preset to make each kernel's default on this GPU model; then, anywhere:)
    python bench/triton_tuning.py --write-table t.json        # kernels/triton/tuning_table.json takes it
    python bench/triton_tuning.py --sweep --compile-only      # compile every preset (Triton's disk cache), time nothing
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
    conv_inputs,
    gdn_arms,
    gdn_inputs,
    machine_rates,
    make_step,
    norm_inputs,
    timed,
)


def sweep(args, bandwidth):
    """Every launch preset of the conv and norm, and the GDN-state shapes; the best to args.tuning."""
    import json
    from dataclasses import asdict

    import triton
    import triton_presets

    conv, norm, chunk_state = tuning_modules()
    only = args.only.split(",")
    rows = []
    best = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "presets": {}}

    def save():  # after each kernel, so that what ran is kept if a time limit stops the run later
        if args.csv:
            triton_presets.write_csv(rows, args.csv)
        if args.tuning:
            with open(args.tuning, "w") as fh:
                json.dump(best, fh)

    triton_presets.precompile(args)
    if args.compile_only:
        return
    # the norm first: it compiles in seconds, and a time limit then cuts the conv's last presets only
    for kernel, mod, run in (("norm", norm, triton_presets.sweep_norm), ("conv", conv, triton_presets.sweep_conv)):
        if kernel in only:
            name = run(args, bandwidth, rows)
            if name:
                best[kernel] = asdict(mod.PRESETS[name])
                best["presets"][TABLE_NAMES[kernel]] = name
            save()
    if "host" in only or "conv" in only:
        triton_presets.launch_costs(rows)
        save()
    if "gdn" in only:
        torch.cuda.empty_cache()
        from dataclasses import replace

        best["state"] = asdict(_sweep_gdn(args, replace, chunk_state))
        save()
    if "transposes" in only:
        torch.cuda.empty_cache()
        name = _sweep_transposes(args)
        best["transposes"] = name
        best["presets"][TABLE_NAMES["transposes"]] = name
        save()
    print("best:", best)


TABLE_NAMES = {"conv": "causal_conv1d", "norm": "rms_norm_gated",  # sweep name -> table key
               "transposes": "gated_delta_rule_transposes"}
TABLE_MODULES = {"causal_conv1d": "patchgen.kernels.triton.causal_conv1d",
                 "rms_norm_gated": "patchgen.kernels.triton.rms_norm_gated",
                 "gated_delta_rule_transposes": "patchgen.kernels.triton.gated_delta_rule.transposes"}


def write_table(result_path: str, table_path: str | None = None) -> dict:
    """Put the presets a sweep picked (its --tuning JSON) into the tuning table under the sweep's GPU
    model; other models' entries stay. Returns the table written."""
    import datetime
    import json

    from patchgen.kernels.triton import launch_config

    with open(result_path) as fh:
        result = json.load(fh)
    if not result.get("presets") or "device" not in result:
        raise SystemExit(f"{result_path}: no 'presets' and 'device' in it; write it with "
                         f"bench/triton_tuning.py --sweep --tuning {result_path}")
    for key, name in result["presets"].items():
        module = tuning_module(key)
        if name not in module.PRESETS:
            raise SystemExit(f"{result_path}: {key} preset {name!r} is not one of {', '.join(module.PRESETS)}")
    table_path = table_path or launch_config.TABLE_PATH
    try:
        with open(table_path) as fh:
            table = json.load(fh)
    except FileNotFoundError:
        table = {}
    entry = dict(table.get(result["device"], {}))
    entry.update(result["presets"])
    entry["measured"] = (f"{datetime.date.today().isoformat()}, Triton {result.get('triton', '?')}, "
                         f"bench/triton_tuning.py --sweep")
    table[result["device"]] = entry
    with open(table_path, "w") as fh:
        json.dump(table, fh, indent=2)
        fh.write("\n")
    print(f"{table_path}: {result['device']}: {entry}")
    return table


def tuning_module(table_key: str):
    import importlib

    if table_key not in TABLE_MODULES:
        raise SystemExit(f"unknown kernel {table_key!r} in the tuning table; known: {', '.join(TABLE_MODULES)}")
    return importlib.import_module(TABLE_MODULES[table_key])


def tuning_modules():
    """The kernel modules that hold a TUNING (the package re-exports functions of the same names)."""
    import importlib

    return [importlib.import_module(f"patchgen.kernels.triton.{name}") for name in
            ("causal_conv1d", "rms_norm_gated", "gated_delta_rule.chunk_state")]


def apply_tuning(path):
    import json

    with open(path) as fh:
        best = json.load(fh)
    for mod, name in zip(tuning_modules(), ("conv", "norm", "state")):
        if name not in best:
            continue
        mod.TUNING = type(mod.DEFAULT if mod.TUNING is None else mod.TUNING)(**best[name])
        print(f"tuning {name}: {mod.TUNING}")
    if "transposes" in best:
        import importlib

        transposes = importlib.import_module("patchgen.kernels.triton.gated_delta_rule.transposes")
        transposes.TUNING = transposes.PRESETS[best["transposes"]]
        print(f"tuning transposes: {best['transposes']} {transposes.TUNING}")


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


def _sweep_transposes(args) -> str:
    """Our GDN forward + backward (without and with initial states) with each transposes preset (the
    backward kernels' `tl.trans` designs); gradients compared with the first's; returns the preset to make
    the default (`triton_presets.pick`: the fastest without h0, unless today's is within the margin)."""
    import importlib

    from triton_kernels import host_ms
    from triton_presets import pick, rel_err

    transposes = importlib.import_module("patchgen.kernels.triton.gated_delta_rule.transposes")
    override = transposes.TUNING
    current = transposes.transpose_tuning(torch.device("cuda"))
    current = next(n for n, t in transposes.PRESETS.items() if t == current)
    times, grads = {}, {}
    try:
        for name, tuning in transposes.PRESETS.items():
            transposes.TUNING = tuning
            for with_state in (False, True):
                step = make_step(gdn_arms(with_state, ("ours",))["ours"],
                                 lambda b, s=with_state: gdn_inputs(b, with_state=s), True)
                ms = timed(step, args.repeats)
                if not with_state:
                    times[name] = ms
                host = host_ms(step)
                print(f"gdn ours fwd+bwd{' with h0' if with_state else ''}, transposes {name}: gpu {ms:.3f} ms, "
                      f"host {host:.3f} ms", flush=True)
                if with_state:
                    grads[name] = [g.clone() for g in step()]
                torch.cuda.empty_cache()
    finally:
        transposes.TUNING = override
    first = next(iter(grads))
    for name in list(grads)[1:]:
        print(f"transposes {name} vs {first}, gradients (max |diff| / max |ref|): "
              + ", ".join(f"{n} {rel_err(a, b):.1e}" for n, a, b in
                          zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads[name], grads[first])), flush=True)
    best = pick(times, current)
    print(f"transposes: the default becomes {best} (today {current}; fwd+bwd ms "
          + ", ".join(f"{n} {ms:.3f}" for n, ms in times.items()) + ")", flush=True)
    return best


def triton_presets_precompile(args):
    import triton_presets

    if args.jobs < 2:
        raise SystemExit("--compile-only needs --jobs of 2 or more (it compiles in that many processes)")
    triton_presets.precompile(args)


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
        t = replace(conv.default_tuning(x.device), bwd_stages=stages)
        same = all(torch.equal(a, b) for a, b in zip(conv.conv_bwd(x, w, None, dy, cu, True, t)[:2], want[:2]))
        ms = timed(lambda t=t: conv.conv_bwd(x, w, None, dy, cu, True, t), args.repeats)
        print(f"conv bwd stages={stages}: {ms:.3f} ms, outputs identical to the default's: {same}")
    (x, gate, w), _ = norm_inputs(False)
    dy = torch.randn_like(x)
    _, rstd = norm.norm_fwd(x, gate, w, 1e-6)
    want = norm.norm_bwd(x, gate, w, rstd, dy)
    for stages in (None, 1, 2, 3):
        t = replace(norm.default_tuning(x.device), bwd_stages=stages)
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--sweep", action="store_true", help="time launch configurations")
    mode.add_argument("--profile", action="store_true", help="per-kernel GDN times")
    mode.add_argument("--stages", action="store_true", help="pipelining depths of the persistent backwards")
    mode.add_argument("--ncu", action="store_true", help="run each conv and norm kernel twice, for ncu")
    mode.add_argument("--write-table", metavar="JSON",
                      help="put the presets of a --sweep --tuning JSON into the tuning table (no GPU needed)")
    parser.add_argument("--table", help="--write-table: the table to update (default: the package's tuning_table.json)")
    parser.add_argument("--compile-only", action="store_true", help="--sweep: compile every preset, time nothing")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tuning", help="where --sweep writes the best launch configurations (JSON)")
    parser.add_argument("--only", default="conv,norm,gdn", help="--sweep: which of conv, norm, gdn (the state kernels' "
                        "launch shapes), transposes (the GDN backward's tl.trans designs), host")
    parser.add_argument("--presets", help="--sweep: only these preset names (comma-separated)")
    parser.add_argument("--csv", help="--sweep: where to write the preset rows (CSV)")
    parser.add_argument("--jobs", type=int, default=8, help="--sweep: processes compiling the presets first (1: none)")
    args = parser.parse_args(argv)
    if args.write_table:
        write_table(args.write_table, args.table)
        return
    if not torch.cuda.is_available():
        sys.exit("bench/triton_tuning.py needs a CUDA device")
    if args.ncu:
        return ncu_targets()
    if args.compile_only:
        return triton_presets_precompile(args)
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
