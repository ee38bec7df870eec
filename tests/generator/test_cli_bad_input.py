"""Bad input to the CLI: refused flag combinations (exit 2), input and environment errors (exit 3,
naming the file and the fix, never "internal error"), Ctrl-C (exit 130, saying what was written),
stray temp files, file modes, and the drift gate's own blind spots."""

import os
import stat
import zipfile
from pathlib import Path

import pytest

from patchgen import cli, write
from patchgen.source import load_upstream

MODULE = "transformers.models.qwen3_5.modeling_qwen3_5"


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def no_internal_error(err: str) -> bool:
    return "internal error" not in err and "Traceback" not in err


# -- flag combinations (item 8) ------------------------------------------------------------------


def test_check_fix_dry_run_is_refused_and_writes_nothing(out_copy, capsys):
    py = out_copy / "qwen3_5" / "patched_modeling_qwen3_5_npu.py"
    py.write_text(py.read_text() + "\n# drift\n")
    before = snapshot(out_copy)
    assert cli.main(["--check", "--fix", "--dry-run"]) == 2
    assert "--dry-run has no meaning with --check" in capsys.readouterr().err
    assert snapshot(out_copy) == before


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--check", "--dry-run"], "--dry-run has no meaning with --check"),
        (["--check", "--no-diff"], "--diff/--no-diff only go with generating"),
        (["--check", "--diff"], "--diff/--no-diff only go with generating"),
        (["--check", "qwen3_5/gpu", "--model", "qwen3_5", "--device", "npu"], "both name a target"),
        (["--list", "--dry-run"], "--dry-run has no meaning with it"),
        (["--list", "--source", "x.whl"], "--source has no meaning with it"),
    ],
)
def test_flags_the_mode_does_not_use_are_refused(argv, message, capsys):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


# -- op_defaults validated at generation (item 9) ------------------------------------------------


@pytest.mark.parametrize(
    "defaults, message",
    [
        ({"gated_delta_rule": "flaa"}, "op_defaults gated_delta_rule='flaa' names no backend (did you mean 'fla'?)"),
        ({"gated_delta_rul": "fla"}, "unknown op slot 'gated_delta_rul' (did you mean 'gated_delta_rule'?)"),
    ],
)
def test_typo_in_op_defaults_exits_3_naming_config_and_close_match(defaults, message, out_copy, monkeypatch, capsys):
    from patchgen.configs.qwen3_5 import gpu

    monkeypatch.setattr(gpu.config, "op_defaults", {**gpu.config.op_defaults, **defaults})
    before = snapshot(out_copy)
    assert cli.main(["--model", "qwen3_5", "--device", "gpu"]) == 3
    err = capsys.readouterr().err
    assert "config patchgen/configs/qwen3_5/gpu.py: " in err and message in err
    assert snapshot(out_copy) == before


def test_every_checked_in_config_has_valid_op_defaults():
    from patchgen.targets import all_targets

    for target in all_targets():
        target.load_config()  # raises ConfigError on a bad slot or backend


# -- input and environment errors (item 10) ------------------------------------------------------


def wheel(path: Path, text: bytes | None = None) -> Path:
    """A minimal transformers wheel holding the qwen3_5 modeling module."""
    data = text if text is not None else load_upstream(MODULE).text.encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("transformers-5.24.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: transformers\nVersion: 5.24.0\n")
        zf.writestr(MODULE.replace(".", "/") + ".py", data)
    return path


def test_truncated_wheel_exits_3_naming_it(tmp_path, capsys):
    good = wheel(tmp_path / "transformers-5.24.0-py3-none-any.whl")
    bad = tmp_path / "cut.whl"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert cli.main(["--model", "qwen3_5", "--device", "gpu", "--dry-run", "--source", str(bad)]) == 3
    err = capsys.readouterr().err
    assert f"--source {bad} is not a readable wheel" in err and "download it again" in err
    assert no_internal_error(err)


def test_wheel_with_a_corrupt_member_exits_3_naming_the_member(tmp_path, capsys):
    good = wheel(tmp_path / "transformers-5.24.0-py3-none-any.whl")
    data = bytearray(good.read_bytes())
    start = data.index(b"modeling_qwen3_5.py") + 200  # inside the module's compressed bytes
    data[start : start + 64] = bytes(64)
    good.write_bytes(bytes(data))
    assert cli.main(["--model", "qwen3_5", "--device", "gpu", "--dry-run", "--source", str(good)]) == 3
    err = capsys.readouterr().err
    assert "modeling_qwen3_5.py cannot be read from the wheel" in err and no_internal_error(err)


def test_non_utf8_upstream_exits_3_naming_the_file(tmp_path, capsys):
    source = wheel(tmp_path / "transformers-5.24.0-py3-none-any.whl", b"# caf\xe9\nx = 1\n")
    assert cli.main(["--model", "qwen3_5", "--device", "gpu", "--dry-run", "--source", str(source)]) == 3
    err = capsys.readouterr().err
    assert "modeling_qwen3_5.py is not UTF-8 text (byte 0xe9 at offset 5)" in err and no_internal_error(err)


def test_non_utf8_file_in_an_unpacked_source_exits_3(tmp_path, capsys):
    root = tmp_path / "unpacked"
    module = root / (MODULE.replace(".", "/") + ".py")
    module.parent.mkdir(parents=True)
    module.write_bytes(b"\xff\xfe")
    (root / "PKG-INFO").write_text("Version: 5.24.0\n")
    assert cli.main(["--model", "qwen3_5", "--device", "gpu", "--dry-run", "--source", str(root)]) == 3
    err = capsys.readouterr().err
    assert f"{module} is not UTF-8 text" in err and no_internal_error(err)


def test_output_folder_that_is_a_file_is_an_error_not_drift(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "out"
    blocker.write_text("not a folder")
    monkeypatch.setenv("PATCHGEN_OUTPUT_DIR", str(blocker))
    assert cli.main(["--check"]) == 3
    captured = capsys.readouterr()
    assert f"output folder {blocker} is a file, not a folder" in captured.err
    assert "stale" not in captured.out and no_internal_error(captured.err)


def test_generating_into_a_path_under_a_file_exits_3(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "out"
    blocker.write_text("not a folder")
    monkeypatch.setenv("PATCHGEN_OUTPUT_DIR", str(blocker))
    assert cli.main(["--model", "qwen3_5", "--device", "gpu"]) == 3
    err = capsys.readouterr().err
    assert "is a file, not a folder" in err and no_internal_error(err)


def test_unwritable_output_folder_exits_3_naming_it(out_copy, monkeypatch, capsys):
    # The real call fails the same way on a read-only folder; faked so that it also fails as root.
    def refuse(*args, dir=None, **kwargs):
        raise PermissionError(13, "Permission denied", str(dir))

    monkeypatch.setattr(write.tempfile, "mkstemp", refuse)
    py = out_copy / "qwen3_5" / "patched_modeling_qwen3_5_gpu.py"
    py.write_text("stale")
    assert cli.main(["--model", "qwen3_5", "--device", "gpu"]) == 3
    err = capsys.readouterr().err
    assert f"cannot write {py}: permission denied on {py.parent}" in err and "make the folder writable" in err
    assert no_internal_error(err)


def test_read_only_folder_for_real_when_not_root(out_copy, capsys):
    if os.geteuid() == 0:
        pytest.skip("root ignores folder permissions; test_unwritable_output_folder_exits_3_naming_it covers it")
    folder = out_copy / "qwen3_5"
    (folder / "patched_modeling_qwen3_5_gpu.py").write_text("stale")
    folder.chmod(0o555)
    try:
        assert cli.main(["--model", "qwen3_5", "--device", "gpu"]) == 3
    finally:
        folder.chmod(0o755)
    assert "permission denied" in capsys.readouterr().err


# -- Ctrl-C, stray temp files, modes (item 11) ---------------------------------------------------


def test_ctrl_c_while_generating_exits_130_saying_nothing_was_written(out_copy, monkeypatch, capsys):
    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_generate_one", interrupt)
    before = snapshot(out_copy)
    assert cli.main(["--all"]) == 130
    assert "patchgen: interrupted: nothing was written" in capsys.readouterr().err
    assert snapshot(out_copy) == before


def test_ctrl_c_while_writing_all_says_which_targets_were_written(out_copy, monkeypatch, capsys):
    for path in out_copy.rglob("patched_modeling_*"):
        path.write_text("old")
    real, calls = write.write_if_changed, []

    def stop_at_fourth(path, text):  # gpu .py and .diff, npu .py written; stopped at npu .diff
        calls.append(path)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real(path, text)

    monkeypatch.setattr(write, "write_if_changed", stop_at_fourth)
    assert cli.main(["--all"]) == 130
    err = capsys.readouterr().err
    assert "up to date: qwen3_5/gpu" in err
    assert "qwen3_5/npu partly written (not written: " in err and "patched_modeling_qwen3_5_npu.diff)" in err
    assert "not written (old files kept): qwen3_5_moe/gpu, qwen3_5_moe/npu" in err
    assert (out_copy / "qwen3_5_moe" / "patched_modeling_qwen3_5_moe_gpu.py").read_text() == "old"
    assert not list(out_copy.rglob("*.tmp"))


def test_a_folder_in_place_of_a_later_file_is_refused_before_anything_is_written(out_copy, capsys):
    # the writes of --all went target by target: qwen3_5's files were rewritten before the error on
    # the last target's .diff, leaving a set of generated files from two runs
    for path in out_copy.rglob("patched_modeling_*"):
        path.write_text("old")
    blocked = out_copy / "qwen3_5_moe" / "patched_modeling_qwen3_5_moe_npu.diff"
    blocked.unlink()
    blocked.mkdir()
    before = snapshot(out_copy)
    assert cli.main(["--all"]) == 3
    err = capsys.readouterr().err
    assert f"cannot write {blocked}: a folder is in its place" in err and no_internal_error(err)
    assert snapshot(out_copy) == before


def test_a_write_failing_midway_says_which_targets_were_written(out_copy, monkeypatch, capsys):
    from patchgen.errors import OutputError

    for path in out_copy.rglob("patched_modeling_*"):
        path.write_text("old")
    real, calls = write.write_if_changed, []

    def fail_at_fourth(path, text):  # the disk fills up at qwen3_5/npu's .diff
        calls.append(path)
        if len(calls) == 4:
            raise OutputError(f"cannot write {path}: No space left on device: check the disk and the folder")
        return real(path, text)

    monkeypatch.setattr(write, "write_if_changed", fail_at_fourth)
    assert cli.main(["--all"]) == 3
    err = capsys.readouterr().err
    assert "No space left on device" in err
    assert "up to date: qwen3_5/gpu" in err
    assert "qwen3_5/npu partly written (not written: " in err
    assert "not written (old files kept): qwen3_5_moe/gpu, qwen3_5_moe/npu" in err


@pytest.mark.parametrize("value", ["   ", "{out} "])
def test_an_output_dir_with_stray_whitespace_is_refused_naming_the_variable(out_copy, monkeypatch, capsys, tmp_path, value):
    # "   " was a folder named three spaces under the current one; "/x/generated " a sibling of the real one
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATCHGEN_OUTPUT_DIR", value.format(out=out_copy))
    before = snapshot(tmp_path)
    assert cli.main(["--all"]) == 3
    err = capsys.readouterr().err
    assert "PATCHGEN_OUTPUT_DIR=" in err and "whitespace" in err and no_internal_error(err)
    assert snapshot(tmp_path) == before


def test_a_reader_that_went_away_is_no_error_about_paths(monkeypatch, capsys):
    # `patchgen --check | head` said "error: cannot use: Broken pipe: check the path and its permissions"
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert cli.main(["--list"]) == 141  # 128 + SIGPIPE, as a shell reports a process the signal ended
    assert capsys.readouterr().err == ""


def test_check_reports_a_temp_file_left_by_a_killed_write(out_copy, capsys):
    stray = out_copy / "qwen3_5" / ".patched_modeling_qwen3_5_gpu.py.k3j9x.tmp"
    stray.write_text("half")
    assert cli.main(["--check"]) == 3
    err = capsys.readouterr().err
    assert f"temporary file(s) left by an interrupted write: {stray}: delete them" in err


def test_rewrite_keeps_the_file_mode(tmp_path):
    path = tmp_path / "module.py"
    path.write_text("old")
    path.chmod(0o640)
    assert write.write_if_changed(path, "new")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and path.read_text() == "new"


def test_new_file_gets_the_umask_default(tmp_path):
    old = os.umask(0o027)
    try:
        assert write.write_if_changed(tmp_path / "fresh.py", "text")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "fresh.py").stat().st_mode) == 0o640


# -- blind spots of the drift gate (mutation gaps) -----------------------------------------------


def test_check_reports_a_missing_generated_file_as_drift(out_copy, capsys):
    missing = out_copy / "qwen3_5_moe" / "patched_modeling_qwen3_5_moe_npu.py"
    missing.unlink()
    assert cli.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert f"stale: {missing}" in out and "(on disk: missing)" in out


def test_orphaned_diff_file_is_a_configuration_error(out_copy, capsys):
    stray = out_copy / "qwen3_5" / "patched_modeling_qwen3_5_tpu.diff"
    stray.write_text("")
    assert cli.main(["--check"]) == 3
    assert f"orphaned generated file(s) with no config: {stray}" in capsys.readouterr().err
