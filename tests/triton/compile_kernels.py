"""Compile every specialisation of our Triton kernels that the launchers make, for a GPU target, on CPU.

    python tests/triton/compile_kernels.py                      # TTIR and TTGIR for sm_90, a summary
    python tests/triton/compile_kernels.py --stage cubin --json out.json   # through ptxas, as JSON

Runs in its own process (TRITON_INTERPRET=0 must hold before triton is imported); tests/triton/
test_kernel_compile.py runs it and checks the report. Exit status 1 when any specialisation failed.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # kernels must be JITFunctions here, whatever the caller's setting
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said out loud (no warning)

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from kernel_compile import (
    PACKAGE,
    STAGES,
    LaunchRecorder,
    called_jit_functions,
    compile_launch,
    jit_functions,
    parse_target,
)
from kernel_launch_cases import POLICIES, cases, device_policy

_WORK: list = []  # the launches, inherited by the forked workers

# Kernels whose TTGIR takes many seconds of CPU: with --budget their GPU configurations stop at --stage
# too (measured on 2 CPU cores, Triton 3.9: the state backward's W x (W-1) x W unrolled taps, 10-30 s).
SLOW_TO_LOWER = {
    f"{PACKAGE}.causal_conv1d_state.causal_conv1d_state_bwd_kernel": "TTGIR alone takes 10-30 s of CPU",
}


def record(target, policies=POLICIES, only: str | None = None) -> list:
    """The launches of every case (those whose label holds `only`), once per specialisation."""
    recorder = LaunchRecorder(target)
    with recorder.active():
        for policy in policies:
            with device_policy(policy):
                for label, call, deep in cases():
                    if only and only not in label:
                        continue
                    with recorder.labelled(f"{policy}: {label}", deep and policy == "cuda"):
                        call()
    return list(recorder.launches.values())


def record_self_check(target) -> list:
    """The launch of compile_fixtures.two_shapes_across_an_if, which the compiler must refuse."""
    import compile_fixtures

    recorder = LaunchRecorder(target)
    with recorder.active(), recorder.labelled("self-check"):
        x = torch.empty(64)
        compile_fixtures.launch(x, torch.empty_like(x), 1)
    return list(recorder.launches.values())


def _compile_one(args):
    index, target, stage = args
    return index, compile_launch(_WORK[index], target, stage)


def compile_all(launches, target, stage: str, deep_stage: str, jobs: int, budget: bool = False) -> list:
    """compile_launch of every launch, over `jobs` forked processes: the GPU's own configurations
    (`deep`) through `deep_stage`, the others through `stage`, once per frontend input when that is
    TTIR (launches that differ only in warps, stages or registers share one TTIR); with `budget`, the
    kernels of SLOW_TO_LOWER stop at `stage` whatever they are."""
    _WORK[:] = launches
    deep_stage = max(stage, deep_stage, key=STAGES.index)
    frontend_only = stage == "ttir"
    first: dict[tuple, int] = {}
    work = []
    for i, launch in enumerate(launches):
        if launch.deep and not (budget and launch.name in SLOW_TO_LOWER):
            work.append((i, target, deep_stage))
        elif not frontend_only or first.setdefault(launch.frontend_key(), i) == i:
            work.append((i, target, stage))
    work.sort(key=lambda w: STAGES.index(w[2]), reverse=True)  # the long ones first
    if jobs <= 1:
        results = dict(map(_compile_one, work))
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            results = dict(pool.imap_unordered(_compile_one, work, chunksize=1))
    for i, launch in enumerate(launches):
        if i not in results:
            results[i] = results[first[launch.frontend_key()]]
    return [results[i] for i in range(len(launches))]


def report(launches, results, target, stage: str, seconds: float) -> dict:
    """The JSON report: what was compiled, how far, and what the package holds."""
    entry = sorted({launch.name for launch in launches})
    reached = set(entry)
    for launch in launches:
        reached |= {name for name in called_jit_functions(launch.kernel) if name.startswith(PACKAGE + ".")}
    return {
        "target": f"{target.backend}:{target.arch}",
        "stage": stage,
        "seconds": round(seconds, 2),
        "jit_functions": sorted(jit_functions()),
        "entry_kernels": entry,
        "reached": sorted(reached),
        "launches": [_entry(launch, result) for launch, result in zip(launches, results)],
    }


def _entry(launch, result) -> dict:
    return {"kernel": launch.name, **launch.describe(), "cases": launch.cases, "deep": launch.deep,
            "stages": [[name, round(t, 3)] for name, t in result.stages], "error": result.error,
            "failed_stage": result.failed_stage, "shared_bytes": result.shared_bytes}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="cuda:90", help="GPU target, 'cuda:<sm>' (default cuda:90, the H200)")
    parser.add_argument("--stage", default="ttir", choices=STAGES,
                        help="last compiler stage for every specialisation (default ttir: the frontend)")
    parser.add_argument("--deep-stage", default="ttgir", choices=STAGES,
                        help="last stage for the configurations the H200 runs in bf16 (default ttgir)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="compiling processes")
    parser.add_argument("--only", help="only the cases whose label contains this (e.g. 'conv state')")
    parser.add_argument("--budget", action="store_true",
                        help="the CI's: kernels slow to lower (SLOW_TO_LOWER) stop at --stage")
    parser.add_argument("--self-check", action="store_true",
                        help="also compile compile_fixtures.py's kernel, which must fail (reported apart)")
    parser.add_argument("--json", type=Path, help="write the full report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    target = parse_target(args.target)
    start = time.perf_counter()
    launches = record(target, only=args.only)
    recorded = time.perf_counter() - start
    results = compile_all(launches, target, args.stage, args.deep_stage, args.jobs, args.budget)
    out = report(launches, results, target, args.stage, time.perf_counter() - start)
    out["record_seconds"] = round(recorded, 2)
    out["slow_to_lower"] = SLOW_TO_LOWER if args.budget else {}
    if args.self_check:
        checks = record_self_check(target)
        out["self_check"] = [_entry(launch, compile_launch(launch, target, args.stage)) for launch in checks]
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    failed = [launch for launch in out["launches"] if launch["error"]]
    deep = sum(launch["deep"] for launch in out["launches"])
    print(f"{len(out['launches'])} specialisations of {len(out['entry_kernels'])} kernels for {out['target']}, "
          f"through {args.stage} ({deep} the H200 runs in bf16: through {args.deep_stage}): {len(failed)} failed, "
          f"{out['seconds']} s ({out['record_seconds']} s of it recording)")
    for launch in failed:
        print(f"\nFAILED at {launch['failed_stage']}: {launch['kernel']} {launch['constexprs']}\n"
              f"  cases: {', '.join(launch['cases'][:3])}\n  {launch['error']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
