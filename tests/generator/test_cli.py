"""The CLI on the real targets: drift gate, exit codes, determinism, atomic and minimal writes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from patchgen import cli
from patchgen.targets import all_targets

REPO = Path(__file__).resolve().parents[2]
PATCHGEN = [sys.executable, "-m", "patchgen.cli"]


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def test_checked_in_files_are_clean(capsys):
    assert cli.main(["--check"]) == 0
    assert "4 target(s) clean" in capsys.readouterr().out


def test_one_character_edit_in_py_and_diff_is_caught_fixed_and_check_never_writes(out_copy, capsys):
    py = out_copy / "qwen3_5" / "patched_modeling_qwen3_5_npu.py"
    diff = out_copy / "qwen3_5_moe" / "patched_modeling_qwen3_5_moe_gpu.diff"
    py.write_text(py.read_text().replace("class Qwen3_5MLP", "class Qwen3_5MLQ", 1))
    diff.write_text(diff.read_text().replace("+# device:", "+# devise:", 1))
    before = snapshot(out_copy)

    assert cli.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert f"stale: {py}" in out and f"stale: {diff}" in out
    assert "-class Qwen3_5MLQ" in out and "+class Qwen3_5MLP" in out
    assert snapshot(out_copy) == before  # --check alone writes nothing

    assert cli.main(["--check", "--fix"]) == 0
    capsys.readouterr()
    assert cli.main(["--check"]) == 0


def test_check_of_one_target(out_copy, capsys):
    py = out_copy / "qwen3_5" / "patched_modeling_qwen3_5_npu.py"
    py.write_text(py.read_text() + "\n")
    assert cli.main(["--check", "qwen3_5/gpu"]) == 0
    assert cli.main(["--check", "qwen3_5:npu"]) == 1


def test_generate_writes_only_changed_files(out_copy, capsys):
    py = out_copy / "qwen3_5" / "patched_modeling_qwen3_5_gpu.py"
    py.unlink()
    before = snapshot(out_copy)
    assert cli.main(["--all"]) == 0
    after = snapshot(out_copy)
    assert f"wrote {py}" in capsys.readouterr().out
    changed = {name for name in after if before.get(name) != after[name]}
    assert changed == {"qwen3_5/patched_modeling_qwen3_5_gpu.py"}
    assert not list(out_copy.rglob("*.tmp"))


def test_dry_run_writes_nothing(out_copy, capsys):
    (out_copy / "qwen3_5" / "patched_modeling_qwen3_5_gpu.diff").unlink()
    before = snapshot(out_copy)
    assert cli.main(["--model", "qwen3_5", "--device", "gpu", "--dry-run"]) == 0
    assert "would write" in capsys.readouterr().out
    assert snapshot(out_copy) == before


def test_no_diff_skips_the_diff_file(out_copy):
    target = out_copy / "qwen3_5" / "patched_modeling_qwen3_5_gpu.diff"
    target.unlink()
    assert cli.main(["--model", "qwen3_5", "--device", "gpu", "--no-diff"]) == 0
    assert not target.exists()


def test_orphaned_generated_file_is_a_configuration_error(out_copy, capsys):
    stray = out_copy / "qwen3_5" / "patched_modeling_qwen3_5_tpu.py"
    stray.write_text("")
    assert cli.main(["--check"]) == 3
    assert f"orphaned generated file(s) with no config: {stray}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [(["--model", "llama", "--device", "gpu"], "unknown model 'llama': known models are qwen3_5, qwen3_5_moe"),
     (["--model", "qwen3_5", "--device", "tpu"], "unknown device 'tpu' for model 'qwen3_5': known devices are gpu, npu"),
     (["--check", "qwen3_5"], "target 'qwen3_5' must be MODEL/DEVICE")],
)
def test_unknown_target_exits_3_naming_it(argv, message, capsys):
    assert cli.main(argv) == 3
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv", [[], ["--model", "qwen3_5"], ["--fix"], ["--all", "--list"], ["--check", "--all"], ["--bogus"]]
)
def test_usage_errors_exit_2(argv, capsys):
    assert cli.main(argv) == 2


def test_version_other_than_pin_exits_3_before_any_diff(out_copy, monkeypatch, capsys):
    from patchgen import source

    (out_copy / "qwen3_5" / "patched_modeling_qwen3_5_gpu.py").write_text("drifted")
    monkeypatch.setattr(source.importlib.metadata, "version", lambda name: "5.17.0")
    assert cli.main(["--check"]) == 3
    captured = capsys.readouterr()
    assert "pinned transformers 5.24.0, installed 5.17.0" in captured.err
    assert captured.out == ""


def test_config_that_fails_to_import_exits_3_naming_the_file(tmp_path, monkeypatch, capsys):
    package = tmp_path / "broken_configs"
    (package / "toy").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "toy" / "__init__.py").write_text("")
    (package / "toy" / "gpu.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from patchgen import targets

    monkeypatch.setattr(targets, "CONFIG_PACKAGE", "broken_configs")
    assert cli.main(["--model", "toy", "--device", "gpu"]) == 3
    err = capsys.readouterr().err
    assert "config patchgen/configs/toy/gpu.py failed to import: RuntimeError: boom" in err


def test_no_targets_is_a_configuration_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "empty_configs").mkdir()
    (tmp_path / "empty_configs" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    from patchgen import targets

    monkeypatch.setattr(targets, "CONFIG_PACKAGE", "empty_configs")
    assert cli.main(["--all"]) == 3
    assert "no targets" in capsys.readouterr().err


def test_list_prints_every_target(capsys):
    assert cli.main(["--list"]) == 0
    listed = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == ["qwen3_5/gpu", "qwen3_5/npu", "qwen3_5_moe/gpu", "qwen3_5_moe/npu"]


def test_list_names_the_outputs_where_patchgen_output_dir_puts_them(capsys, monkeypatch, tmp_path):
    # --list printed generated/... whatever PATCHGEN_OUTPUT_DIR said, not where the run would write
    monkeypatch.setenv("PATCHGEN_OUTPUT_DIR", str(tmp_path))
    assert cli.main(["--list"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith(f" -> {tmp_path / 'qwen3_5' / 'patched_modeling_qwen3_5_gpu.py'}")


def test_list_without_patchgen_output_dir_prints_the_repository_path(capsys, monkeypatch):
    monkeypatch.delenv("PATCHGEN_OUTPUT_DIR", raising=False)
    assert cli.main(["--list"]) == 0
    assert capsys.readouterr().out.splitlines()[0].endswith(" -> generated/qwen3_5/patched_modeling_qwen3_5_gpu.py")


def test_generation_is_deterministic_across_processes(tmp_path):
    """Two fresh processes, other hash seeds, cwd and TMPDIR: identical bytes for every target."""
    outputs = []
    for seed in ("1", "12345"):
        out = tmp_path / f"out{seed}"
        scratch = tmp_path / f"tmp{seed}"
        scratch.mkdir()
        env = {**os.environ, "PYTHONHASHSEED": seed, "TMPDIR": str(scratch), "PATCHGEN_OUTPUT_DIR": str(out)}
        subprocess.run([*PATCHGEN, "--all"], cwd=scratch, env=env, check=True, capture_output=True)
        outputs.append({str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()})
    assert len(outputs[0]) == 8
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("target", all_targets(), ids=lambda t: t.name)
def test_stored_diff_applied_to_upstream_yields_generated_file(target, tmp_path):
    from patchgen.source import load_upstream

    config = target.load_config()
    upstream = load_upstream(config.upstream_module)
    work = tmp_path / "file.py"
    work.write_text(upstream.text)
    subprocess.run(["patch", "-s", str(work), str(target.diff_path())], check=True)
    assert work.read_text() == target.output_path().read_text()


def test_cycle_collector_is_paused_while_generating_and_restored_after(monkeypatch, capsys):
    import gc

    seen = []
    real = cli._generate_one

    def spy(target, source):
        seen.append(gc.isenabled())
        return real(target, source)

    monkeypatch.setattr(cli, "_generate_one", spy)
    assert gc.isenabled()
    assert cli.main(["--check", "qwen3_5/gpu"]) == 0
    assert seen == [False] and gc.isenabled()
    assert cli.main(["--check", "nosuch/gpu"]) == 3  # an error path restores it too
    assert gc.isenabled()
    gc.disable()
    try:
        cli.main(["--list"])
        assert not gc.isenabled()  # a caller's own setting is left as it was
    finally:
        gc.enable()
