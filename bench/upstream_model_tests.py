"""Run transformers' own qwen3_5 / qwen3_5_moe model tests against upstream and against ours.

Each model's test file runs twice in a fresh pytest process: once as it is (upstream's modules),
once with ``patchgen.integrations.upstream_tests`` swapping in the generated module of
``--device``. Prints pass/fail/skip counts per run and every test whose outcome differs; the
tests that pass upstream and fail with ours are the ones to look at (exit status 1 if any).

    .venv/bin/python bench/upstream_model_tests.py --tests /path/to/transformers/tests --device gpu

``--tests`` is the ``tests`` folder of a transformers checkout at the pinned version (the PyPI sdist
does not carry it). docs/loading.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

MODELS = ("qwen3_5", "qwen3_5_moe")
PLUGIN = "patchgen.integrations.upstream_tests"


def test_file(tests: Path, model: str) -> Path:
    path = tests / "models" / model / f"test_modeling_{model}.py"
    if not path.is_file():
        raise SystemExit(
            f"--tests {tests}: no {path.relative_to(tests)} there; pass the tests/ folder of a transformers checkout"
        )
    return path


def outcomes(junit_xml: Path) -> dict[str, str]:
    """``{test id: passed|failed|skipped}`` from a pytest junit report (errors count as failed)."""
    result = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            result[test_id] = "failed"
        elif "skipped" in kinds:
            result[test_id] = "skipped"
        else:
            result[test_id] = "passed"
    return result


def failure_messages(junit_xml: Path) -> dict[str, str]:
    messages = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error"):
                messages[f"{case.get('classname')}::{case.get('name')}"] = (child.get("message") or "")[:300]
    return messages


def run_pytest(
    path: Path,
    swap_device: str | None,
    extra: list[str],
    workdir: Path,
    ours_env: dict[str, str] | None = None,
) -> tuple[dict, dict, int]:
    label = swap_device or "upstream"
    report = workdir / f"{path.stem}-{label}.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        str(path),
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={report}",
        "-o",
        "junit_family=xunit1",
    ]
    env = dict(os.environ)
    env.pop("PATCHGEN_SWAP_DEVICE", None)
    if swap_device:
        command += ["-p", PLUGIN]
        env["PATCHGEN_SWAP_DEVICE"] = swap_device
        env.update(ours_env or {})
    # The checkout's root holds `tests/` as a package: run from there so its relative imports resolve.
    proc = subprocess.run(
        command + extra, check=False, cwd=path.parents[3], env=env, capture_output=True, text=True
    )
    log = workdir / f"{path.stem}-{label}.log"
    log.write_text(proc.stdout + proc.stderr)
    if not report.exists():
        raise SystemExit(
            f"pytest wrote no report for {path} ({label}), exit {proc.returncode}; see {log}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    return outcomes(report), failure_messages(report), proc.returncode


def counts(result: dict[str, str]) -> dict[str, int]:
    return {kind: sum(v == kind for v in result.values()) for kind in ("passed", "failed", "skipped")}


def compare(model: str, device: str, upstream: dict, ours: dict, messages: dict) -> list[dict]:
    differing = []
    for test_id in sorted(set(upstream) | set(ours)):
        before, after = upstream.get(test_id, "absent"), ours.get(test_id, "absent")
        if before != after:
            differing.append(
                {
                    "model": model,
                    "device": device,
                    "test": test_id,
                    "upstream": before,
                    "ours": after,
                    "message": messages.get(test_id, ""),
                }
            )
    return differing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tests", type=Path, required=True, help="the tests/ folder of a transformers checkout"
    )
    parser.add_argument(
        "--device",
        choices=("gpu", "npu"),
        action="append",
        help="generated target(s) to swap in (default: both)",
    )
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--json", type=Path, help="write counts and differing tests here")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set for the runs with ours only, e.g. PATCHGEN_OPS_GATED_DELTA_RULE=triton (with TRITON_INTERPRET=1 on CPU)",
    )
    parser.add_argument("--workdir", type=Path, help="keep junit reports and logs here (default: a temp dir)")
    parser.add_argument(
        "pytest_args", nargs="*", help="passed to pytest after `--`, e.g. -- -k TextModelTest"
    )
    args = parser.parse_args(argv)
    devices = args.device or ["gpu", "npu"]
    bad = [item for item in args.env if "=" not in item]
    if bad:
        parser.error(f"--env takes KEY=VALUE, got {bad}")
    ours_env = dict(item.split("=", 1) for item in args.env)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="upstream-tests-"))
    workdir.mkdir(parents=True, exist_ok=True)

    summary = {"runs": [], "differing": []}
    for model in args.models:
        path = test_file(args.tests.resolve(), model)
        upstream, _, _ = run_pytest(path, None, args.pytest_args, workdir)
        summary["runs"].append({"model": model, "modules": "upstream", **counts(upstream)})
        print(f"{model:12s} upstream     {counts(upstream)}")
        for device in devices:
            ours, messages, _ = run_pytest(path, device, args.pytest_args, workdir, ours_env)
            summary["runs"].append({"model": model, "modules": f"ours-{device}", **counts(ours)})
            print(f"{model:12s} ours-{device:7s} {counts(ours)}")
            summary["differing"].extend(compare(model, device, upstream, ours, messages))

    regressions = [d for d in summary["differing"] if d["upstream"] == "passed" and d["ours"] != "passed"]
    for d in summary["differing"]:
        mark = "REGRESSION" if d in regressions else "differs"
        print(
            f"{mark}: [{d['device']}] {d['test']}: upstream {d['upstream']}, ours {d['ours']}  {d['message']}"
        )
    print(f"reports and logs: {workdir}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 1 if regressions else 0


if __name__ == "__main__":
    raise SystemExit(main())
