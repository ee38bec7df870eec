"""`patchgen upgrade-report` and `--source`: what a new upstream release does to each patch."""

import json
import zipfile
from pathlib import Path

import pytest

from patchgen import cli
from patchgen.source import TransformersSource, UpstreamSource
from patchgen.upgrade import report_target

FIXTURES = Path(__file__).parent / "fixtures"
TOY_MODULE = "toy_pkg.models.toy.modeling_toy"


def toy(version: str, name: str = "upstream_toy.py") -> UpstreamSource:
    path = FIXTURES / name
    return UpstreamSource(TOY_MODULE, path, path.read_text(), version)


@pytest.fixture
def v1_v2(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    return toy("1.0"), toy("2.0", "upstream_toy_v2.py")


def lines(config, old, new):
    return [r.line() for r in report_target("toy/gpu", config, old, new)]


def test_each_kind_of_upstream_change_gets_its_line(toy_config, v1_v2):
    toy_config.override_method("ToyNorm.forward", reason="r")
    toy_config.override_method("ToyAttention.forward", reason="r")
    toy_config.replace_function("toy_function", reason="r")
    toy_config.exclude("ToyLegacy", reason="r")
    toy_config.add_method("ToyNorm.reset", reason="r")
    assert lines(toy_config, *v1_v2) == [
        "[toy/gpu] override_method ToyNorm.forward: unchanged upstream",
        (
            "[toy/gpu] override_method ToyAttention.forward: signature changed upstream (parameters: +scale, "
            'renamed cache -> past; decorators: +@deprecate_kwarg("cache", "9.0", new_name="past")); '
            "the override does not accept: self, past, scale, x (position 2 upstream, 1 here)"
        ),
        "[toy/gpu] replace_function toy_function: changed upstream",
        "[toy/gpu] exclude ToyLegacy: missing upstream (closest: ToyLegacyModel)",
        "[toy/gpu] add_method ToyNorm.reset: conflict (upstream now defines ToyNorm.reset: use override_method)",
    ]


def test_override_taking_kwargs_accepts_a_changed_signature(toy_config, v1_v2):
    toy_config.override_method("ToyAttention.forward", reason="r", body="fixture_bodies.toy:attention_forward_any")
    [report] = report_target("toy/gpu", toy_config, *v1_v2)
    assert report.accepts_upstream_arguments is True
    assert report.line().endswith("; the override accepts every upstream argument")


def test_changed_node_carries_a_unified_diff_between_versions(toy_config, v1_v2):
    toy_config.replace_function("toy_function", reason="r")
    [report] = report_target("toy/gpu", toy_config, *v1_v2)
    assert report.diff.splitlines()[:2] == ["--- toy_function (transformers 1.0)", "+++ toy_function (transformers 2.0)"]
    assert "-    return x + 1" in report.diff and "+    return x + 2" in report.diff


def test_missing_method_lists_close_methods(toy_config, v1_v2):
    old, new = v1_v2
    renamed = UpstreamSource(TOY_MODULE, new.path, new.text.replace("def extra(", "def extras("), "2.0")
    toy_config.override_method("ToyAttention.extra", reason="r", body="fixture_bodies.toy:attention_forward_any")
    assert lines(toy_config, old, renamed) == [
        "[toy/gpu] override_method ToyAttention.extra: missing upstream (closest: ToyAttention.extras)"
    ]


def test_identical_releases_need_no_review(toy_config, v1_v2):
    toy_config.override_method("ToyAttention.forward", reason="r")
    old, _ = v1_v2
    assert not any(r.needs_review for r in report_target("toy/gpu", toy_config, old, toy("1.1")))


def build_wheel(path: Path, version: str, modeling: str) -> Path:
    wheel = path / f"transformers-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("toy_pkg/models/toy/modeling_toy.py", modeling)
        archive.writestr(f"transformers-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: transformers\nVersion: {version}\n")
    return wheel


def test_source_reads_version_and_modules_from_a_wheel_and_a_directory(tmp_path):
    wheel = build_wheel(tmp_path, "9.9.10", "x = 1\n")
    source = TransformersSource(wheel)
    assert source.version == "9.9.10"
    assert source.load(TOY_MODULE).text == "x = 1\n"
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    assert TransformersSource(unpacked).load(TOY_MODULE).version == "9.9.10"


def test_a_release_without_the_model_names_the_fix(tmp_path):
    # `upgrade-report --source transformers-4.57.6...whl` (before Qwen3.5) said only "not found"
    from patchgen.errors import SourceNotFound

    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers-4.57.6.dist-info").mkdir()
    (tmp_path / "transformers-4.57.6.dist-info" / "METADATA").write_text("Name: transformers\nVersion: 4.57.6\n")
    with pytest.raises(SourceNotFound, match=r"not found in .*transformers 4\.57\.6.*: that release has no such model"):
        TransformersSource(tmp_path).load(TOY_MODULE)


def test_source_without_metadata_is_a_clear_error(tmp_path):
    from patchgen.errors import SourceNotFound

    with pytest.raises(SourceNotFound, match="no transformers version metadata found"):
        TransformersSource(tmp_path)
    with pytest.raises(SourceNotFound, match="expected a transformers wheel"):
        TransformersSource(tmp_path / "nothing.tar.gz")


@pytest.fixture
def toy_targets(tmp_path, monkeypatch):
    """A config package with one toy target, and the CLI pointed at it."""
    package = tmp_path / "toy_configs"
    (package / "toy").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "toy" / "__init__.py").write_text("")
    (package / "toy" / "gpu.py").write_text(
        "from patchgen.spec import PatchConfig\n"
        f"config = PatchConfig('toy', 'gpu', bodies='fixture_bodies.toy', upstream_module='{TOY_MODULE}')\n"
        "config.override_method('ToyNorm.forward', reason='norm through ops')\n"
        "config.replace_function('toy_function', reason='fast add')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(FIXTURES))
    from patchgen import targets

    monkeypatch.setattr(targets, "CONFIG_PACKAGE", "toy_configs")
    out = tmp_path / "out"
    monkeypatch.setenv("PATCHGEN_OUTPUT_DIR", str(out))
    return out


def test_cli_report_text_json_and_exit_codes(tmp_path, toy_targets, capsys):
    v1 = build_wheel(tmp_path, "1.0", (FIXTURES / "upstream_toy.py").read_text())
    (tmp_path / "v2").mkdir()
    v2 = build_wheel(tmp_path / "v2", "2.0", (FIXTURES / "upstream_toy_v2.py").read_text())
    assert cli.main(["upgrade-report", "--base", str(v1), "--source", str(v1)]) == 0
    assert "2 patch(es), 0 to review" in capsys.readouterr().out
    assert cli.main(["upgrade-report", "--base", str(v1), "--source", str(v2), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["status"], r["needs_review"]) for r in rows] == [
        ("ToyNorm.forward", "unchanged", False), ("toy_function", "changed", True)
    ]
    assert cli.main(["upgrade-report", "--base", str(tmp_path / "missing.whl"), "--source", str(v2)]) == 3


def test_generate_from_a_wheel_records_its_version(tmp_path, toy_targets):
    wheel = build_wheel(tmp_path, "2.0", (FIXTURES / "upstream_toy_v2.py").read_text())
    assert cli.main(["--model", "toy", "--device", "gpu", "--source", str(wheel)]) == 0
    generated = (toy_targets / "toy" / "patched_modeling_toy_gpu.py").read_text()
    assert generated.startswith("# Generated by patchgen 0.1.0 from transformers 2.0.")
    assert "return x + 2" not in generated and "return ops.add_one(x)" in generated


def _function(source: str):
    import libcst as cst

    return cst.parse_module(source).body[0]


def test_signature_delta_reports_kinds_defaults_and_never_pairs_kwargs_with_a_name():
    from patchgen.upgrade import _signature_delta

    assert _signature_delta(_function("def f(a, b=1): pass"), _function("def f(a, *, b): pass")) == (
        "parameters: b: positional -> keyword-only, b: default removed"
    )
    assert _signature_delta(_function("def f(x, **kwargs): pass"), _function("def f(x, cache): pass")) == (
        "parameters: +cache, -**kwargs"
    )


def test_not_accepted_catches_required_additions_order_and_keyword_only():
    from patchgen.upgrade import not_accepted

    upstream = _function("def f(self, x, y=None): pass")
    assert not_accepted(_function("def f(self, x, y=None, **kw): pass"), upstream) == []
    assert not_accepted(_function("def f(self, y=None, x=None): pass"), upstream) == [
        "x (position 2 upstream, 3 here)", "y (position 3 upstream, 2 here)"
    ]
    assert not_accepted(_function("def f(self, x, *, y=None): pass"), upstream) == [
        "y (positional upstream, keyword-only here)"
    ]
    assert not_accepted(_function("def f(self, x, y=None, *, z): pass"), upstream) == ["requires z"]


def test_a_class_that_became_a_function_is_reported_not_crashed(toy_config, v1_v2):
    old, new = v1_v2
    changed = UpstreamSource(TOY_MODULE, new.path, new.text.replace("class ToyLegacyModel:\n    pass", "def ToyLegacy():\n    pass"), "2.0")
    toy_config.exclude("ToyLegacy", reason="r")
    assert lines(toy_config, old, changed) == [
        "[toy/gpu] exclude ToyLegacy: changed upstream (was a class, now a function)"
    ]
