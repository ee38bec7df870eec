"""Run transformers' own qwen3_5 / qwen3_5_moe model tests against upstream and against ours.

The model test files run once as they are (upstream's modules) and once per ``--device`` with
``patchgen.integrations.upstream_tests`` swapping in the generated module of that device, each in a
fresh pytest process of a separate test virtualenv (the runs go side by side unless ``--serial``).
Prints passed/failed/skipped per test class and run, and every test whose outcome differs; a test
that passes upstream and fails with ours is a regression (exit status 1 if any).

    .venv/bin/python bench/upstream_model_tests.py                 # cache, venv and both targets
    .venv/bin/python bench/upstream_model_tests.py --device npu -- -k TextModelTest

transformers' sdist and wheel do not ship its ``tests/`` folder. The runner keeps one in a cache
(``$PATCHGEN_UPSTREAM_TESTS`` or ``~/.cache/patchgen/transformers-tests/<version>/tests``) and fills
it with a sparse git checkout of the pinned tag when it is missing; ``--tests`` points at any other
checkout. Test-only packages (parameterized, pytest-timeout) go into the test virtualenv, which sees
the project's environment through a ``.pth`` file, never into the project's dependencies.
docs/loading.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

MODELS = ("qwen3_5", "qwen3_5_moe")
PLUGIN = "patchgen.integrations.upstream_tests"
UPSTREAM_REPO = "https://github.com/huggingface/transformers"
TEST_ONLY_PACKAGES = ("parameterized", "pytest-timeout")
OUTCOMES = ("passed", "failed", "skipped")
# On a machine without an accelerator, upstream's fp16/bf16 parameterizations (eager vs sdpa, experts
# implementations) and the fullgraph torch.compile generate test run for many minutes each on CPU;
# they are deselected unless --cpu-slow-tests is given.
CPU_DESELECT = "not fp16 and not bf16 and not compile_model_forward"


@dataclass(frozen=True)
class CompatEdit:
    """A text edit that lets a test tree older or newer than the installed transformers import at all."""

    file: str
    find: str
    replace: str
    why: str


# Each applies only where `find` is present (and `replace` not yet), and is printed when applied.
COMPAT_EDITS = (
    CompatEdit(
        file="test_modeling_common.py",
        find="    from transformers.integrations.tensor_parallel import _get_parameter_tp_plan\n",
        replace=(
            "    try:\n"
            "        from transformers.integrations.tensor_parallel import _get_parameter_tp_plan\n"
            "    except ImportError:  # patchgen compat edit: moved to transformers.distributed\n"
            "        _get_parameter_tp_plan = None\n"
        ),
        why=(
            "transformers.integrations.tensor_parallel no longer has _get_parameter_tp_plan "
            "(only test_tp_plan_matches_params uses it; it then fails alike upstream and ours)"
        ),
    ),
)


class UpstreamTestsUnavailable(RuntimeError):
    """The transformers test tree is neither in the cache nor fetchable."""


def installed_transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def default_tests_dir() -> Path:
    root = os.environ.get("PATCHGEN_UPSTREAM_TESTS")
    if root:
        return Path(root).expanduser() / "tests"
    return (
        Path.home()
        / ".cache"
        / "patchgen"
        / "transformers-tests"
        / installed_transformers_version()
        / "tests"
    )


def fill_cache(tests: Path, version: str) -> None:
    """Sparse-checkout ``tests/`` of transformers ``v{version}`` into ``tests``."""
    with tempfile.TemporaryDirectory(prefix="transformers-tests-") as tmp:
        clone = Path(tmp) / "transformers"
        steps = [
            [
                "git",
                "clone",
                "--depth",
                "1",
                "--branch",
                f"v{version}",
                "--filter=blob:none",
                "--sparse",
                UPSTREAM_REPO,
                str(clone),
            ],
            ["git", "-C", str(clone), "sparse-checkout", "set", "tests"],
        ]
        for step in steps:
            proc = subprocess.run(step, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise UpstreamTestsUnavailable(
                    f"no transformers test tree at {tests}, and fetching v{version} failed: "
                    f"`{' '.join(step)}` exited {proc.returncode}: {proc.stderr.strip()[-500:]}. "
                    f"Put the tests/ folder of a transformers v{version} checkout there "
                    f"(or set PATCHGEN_UPSTREAM_TESTS, or pass --tests)"
                )
        tests.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(clone / "tests", tests)


def sdist_test_files(sdist: Path, version: str) -> dict[str, bytes]:
    """``{name: text}`` of the top-level ``tests/*.py`` in transformers' sdist of ``version``."""
    prefix = f"transformers-{version}/tests/"
    files = {}
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            name = member.name[len(prefix):] if member.name.startswith(prefix) else ""
            if member.isfile() and name.endswith(".py") and "/" not in name:
                files[name] = archive.extractfile(member).read()
    return files


def overlay_sdist_tests(tests: Path, version: str) -> list[str]:
    """Write the release's own top-level test files (the sdist ships them: test_modeling_common.py,
    test_configuration_common.py, test_pipeline_mixin.py, ...) over ``tests``; returns their names.

    The sdist holds no tests/models, tests/generation or tests/utils, so those stay as they are."""
    with tempfile.TemporaryDirectory(prefix="transformers-sdist-") as tmp:
        step = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-build-isolation",
                "--no-binary", ":all:", "-d", tmp, f"transformers=={version}"]
        proc = subprocess.run(step, capture_output=True, text=True, check=False)
        sdists = list(Path(tmp).glob(f"transformers-{version}.tar.gz"))
        if proc.returncode != 0 or not sdists:
            raise UpstreamTestsUnavailable(
                f"--sdist-overlay: `{' '.join(step)}` exited {proc.returncode}: {proc.stderr.strip()[-500:]}. "
                "Run without --sdist-overlay, or where PyPI is reachable"
            )
        files = sdist_test_files(sdists[0], version)
    if "test_modeling_common.py" not in files:
        raise UpstreamTestsUnavailable(f"the transformers {version} sdist holds no tests/test_modeling_common.py")
    if not (tests / "utils" / "tiny_model_summary.json").is_file():
        # Upstream's pipeline mixin reads that file (and src/transformers of a checkout) at import; a tree
        # without them keeps its stand-in mixin, so the pipeline tests are not collected (docs/loading.md).
        files.pop("test_pipeline_mixin.py", None)
    for name, text in files.items():
        (tests / name).write_bytes(text)
    return sorted(files)


def apply_compat_edits(tests: Path) -> list[str]:
    applied = []
    for edit in COMPAT_EDITS:
        path = tests / edit.file
        if not path.is_file():
            continue
        text = path.read_text()
        if edit.find in text and edit.replace not in text:
            path.write_text(text.replace(edit.find, edit.replace))
            applied.append(f"{edit.file}: {edit.why}")
    return applied


def test_files(tests: Path, models: list[str]) -> list[Path]:
    paths = []
    for model in models:
        path = tests / "models" / model / f"test_modeling_{model}.py"
        if not path.is_file():
            raise UpstreamTestsUnavailable(
                f"{tests}: no {path.relative_to(tests)} there; pass the tests/ folder of a transformers checkout"
            )
        paths.append(path)
    return paths


def ensure_test_venv(venv: Path) -> Path:
    """A virtualenv that sees the project's packages and holds the test-only ones; returns its python."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    site_packages = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # addsitedir (not a bare path line) so the project's own .pth files (the editable install) apply too.
    (site_packages / "patchgen-project.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n"
    )
    missing = [pkg for pkg in TEST_ONLY_PACKAGES if not _venv_has(python, pkg)]
    if missing:
        proc = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", *missing], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise UpstreamTestsUnavailable(
                f"pip could not install the test-only packages {missing} into {venv} "
                f"(exit {proc.returncode}): {proc.stderr.strip()[-800:]}"
            )
    return python


def _venv_has(python: Path, package: str) -> bool:
    module = package.replace("-", "_")
    return (
        subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, check=False).returncode
        == 0
    )


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


class PytestRun:
    """One pytest process over the model test files, upstream (``swap_device=None``) or ours."""

    def __init__(self, paths, swap_device, extra, workdir, ours_env=None, python=sys.executable):
        self.label = swap_device or "upstream"
        self.report = workdir / f"{self.label}.xml"
        self.log = workdir / f"{self.label}.log"
        command = [
            str(python),
            "-m",
            "pytest",
            *map(str, paths),
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={self.report}",
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
        self._log_file = self.log.open("w")
        self.proc = subprocess.Popen(
            command + list(extra),
            cwd=Path(paths[0]).parents[3],
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
        )

    def wait(self) -> tuple[dict, dict, int]:
        returncode = self.proc.wait()
        self._log_file.close()
        # 2: interrupted (a test module failed to import), 3: internal error, 4: usage error.
        if not self.report.exists() or returncode in (2, 3, 4):
            tail = self.log.read_text()[-3000:]
            raise SystemExit(
                f"pytest did not run the tests ({self.label}), exit {returncode}; see {self.log}:\n{tail}"
            )
        return outcomes(self.report), failure_messages(self.report), returncode


def run_pytest(path, swap_device, extra, workdir, ours_env=None, python=sys.executable):
    """Run one test file to completion; returns (outcomes, failure messages, exit status)."""
    return PytestRun([Path(path)], swap_device, extra, Path(workdir), ours_env, python).wait()


def counts(result: dict[str, str]) -> dict[str, int]:
    return {kind: sum(v == kind for v in result.values()) for kind in OUTCOMES}


def counts_by_class(result: dict[str, str]) -> dict[str, dict[str, int]]:
    table: dict[str, Counter] = {}
    for test_id, outcome in result.items():
        test_class = test_id.split("::")[0].rsplit(".", 1)[-1]
        table.setdefault(test_class, Counter())[outcome] += 1
    return {cls: {kind: table[cls][kind] for kind in OUTCOMES} for cls in sorted(table)}


def compare(device: str, upstream: dict, ours: dict, messages: dict) -> list[dict]:
    differing = []
    for test_id in sorted(set(upstream) | set(ours)):
        before, after = upstream.get(test_id, "absent"), ours.get(test_id, "absent")
        if before != after:
            differing.append(
                {
                    "device": device,
                    "test": test_id,
                    "upstream": before,
                    "ours": after,
                    "message": messages.get(test_id, ""),
                }
            )
    return differing


def accelerator_present() -> bool:
    import torch

    return torch.cuda.is_available() or (hasattr(torch, "npu") and torch.npu.is_available())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tests", type=Path, help="tests/ folder of a transformers checkout (default: the cache)"
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
        help="set for the runs with ours only, e.g. PATCHGEN_OPS_GATED_DELTA_RULE=triton "
        "(with TRITON_INTERPRET=1 on CPU)",
    )
    parser.add_argument(
        "--venv",
        type=Path,
        default=Path.home() / ".cache" / "patchgen" / "upstream-tests-venv",
        help="the test virtualenv (made on first use)",
    )
    parser.add_argument("--timeout", type=int, default=900, help="per-test limit in seconds (pytest-timeout)")
    parser.add_argument(
        "--cpu-slow-tests",
        action="store_true",
        help="also run the fp16/bf16 parameterizations and the fullgraph-compile test without an accelerator",
    )
    parser.add_argument("--serial", action="store_true", help="one pytest process at a time")
    parser.add_argument(
        "--sdist-overlay",
        action="store_true",
        help="first write the top-level tests/*.py of the installed version's PyPI sdist (the release's exact "
        "files) over the test tree",
    )
    parser.add_argument("--workdir", type=Path, help="keep junit reports and logs here (default: a temp dir)")
    parser.add_argument(
        "--from-reports",
        type=Path,
        nargs="+",
        metavar="WORKDIR",
        help="run nothing: summarize the junit reports (upstream.xml, gpu.xml, npu.xml) of earlier, "
        "possibly interrupted, runs in these workdirs",
    )
    parser.add_argument(
        "pytest_args", nargs="*", help="passed to pytest after `--`, e.g. -- -k TextModelTest"
    )
    args = parser.parse_args(argv)
    devices = args.device or ["gpu", "npu"]
    bad = [item for item in args.env if "=" not in item]
    if bad:
        parser.error(f"--env takes KEY=VALUE, got {bad}")
    ours_env = dict(item.split("=", 1) for item in args.env)
    if args.from_reports:
        results, devices = results_from_reports(args.from_reports)
        meta = {"from_reports": [str(p) for p in args.from_reports]}
        return report(results, devices, meta, args.from_reports[0], args.json)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="upstream-tests-"))
    workdir.mkdir(parents=True, exist_ok=True)

    try:
        tests = (args.tests or default_tests_dir()).expanduser().resolve()
        if args.tests is None and not tests.is_dir():
            fill_cache(tests, installed_transformers_version())
        if args.sdist_overlay:
            names = overlay_sdist_tests(tests, installed_transformers_version())
            print(f"sdist overlay: {len(names)} files of the {installed_transformers_version()} sdist: {' '.join(names)}")
        for line in apply_compat_edits(tests):
            print(f"compat edit: {line}")
        paths = test_files(tests, args.models)
        python = ensure_test_venv(args.venv.expanduser())
    except UpstreamTestsUnavailable as error:
        raise SystemExit(str(error)) from None

    extra = [f"--timeout={args.timeout}", *args.pytest_args]
    if not args.cpu_slow_tests and not accelerator_present() and "-k" not in args.pytest_args:
        extra += ["-k", CPU_DESELECT]
        print(f"no accelerator: deselecting `{CPU_DESELECT}` (pass --cpu-slow-tests to run them)")
    labels = [None, *devices]
    runs = {}
    for label in labels:
        runs[label or "upstream"] = PytestRun(
            paths, label, extra, workdir, ours_env if label else None, python
        )
        if args.serial:
            runs[label or "upstream"].result = runs[label or "upstream"].wait()
    try:
        results = {name: (run.result if args.serial else run.wait()) for name, run in runs.items()}
    finally:
        for run in runs.values():
            if run.proc.poll() is None:
                run.proc.terminate()

    return report(results, devices, {"tests": str(tests), "pytest_args": extra}, workdir, args.json)


def report(results: dict, devices: list[str], meta: dict, workdir: Path, json_path: Path | None) -> int:
    """Print counts per test class and run, and every differing test; 1 if any is a regression."""
    upstream = results["upstream"][0]
    summary = {**meta, "runs": [], "differing": []}
    for name, (result, _, _) in results.items():
        modules = "upstream" if name == "upstream" else f"ours-{name}"
        for test_class, row in counts_by_class(result).items():
            summary["runs"].append({"class": test_class, "modules": modules, **row})
            print(f"{test_class:34s} {modules:10s} {row}")
        print(f"{'all':34s} {modules:10s} {counts(result)}")
    for device in devices:
        ours, messages, _ = results[device]
        summary["differing"].extend(compare(device, upstream, ours, messages))

    regressions = [d for d in summary["differing"] if d["upstream"] == "passed" and d["ours"] != "passed"]
    for d in summary["differing"]:
        mark = "REGRESSION" if d in regressions else "differs"
        print(
            f"{mark}: [{d['device']}] {d['test']}: upstream {d['upstream']}, ours {d['ours']}  {d['message']}"
        )
    print(f"reports and logs: {workdir}")
    if json_path:
        json_path.write_text(json.dumps(summary, indent=2))
    return 1 if regressions else 0


def results_from_reports(workdirs: list[Path]) -> tuple[dict, list[str]]:
    """Merge the junit reports of earlier runs; keep only tests that finished in every run found.

    An interrupted pytest (Ctrl-C) still writes its report, so an hour-long run can be stopped early
    and summarized here; the tests that did not finish in all runs are left out of every count.
    """
    merged: dict[str, tuple[dict, dict]] = {}
    for workdir in workdirs:
        for name in ("upstream", "gpu", "npu"):
            junit = workdir / f"{name}.xml"
            if junit.exists():
                result, messages = merged.get(name, ({}, {}))
                result.update(outcomes(junit))
                messages.update(failure_messages(junit))
                merged[name] = (result, messages)
    if "upstream" not in merged or len(merged) < 2:
        raise SystemExit(f"no upstream report and no report of ours in {', '.join(map(str, workdirs))}")
    finished = set.intersection(*(set(result) for result, _ in merged.values()))
    results = {
        name: ({t: o for t, o in result.items() if t in finished}, messages, 0)
        for name, (result, messages) in merged.items()
    }
    print(f"{len(finished)} tests finished in every run ({', '.join(results)})")
    return results, [name for name in results if name != "upstream"]


if __name__ == "__main__":
    raise SystemExit(main())
