"""bench/upstream_model_tests.py and its swap plugin: a run "with ours" really runs the generated classes.

A test tree shaped like transformers' (``tests/models/qwen3_5/test_modeling_qwen3_5.py``) whose one test
passes only when the names it imports from transformers are the generated classes.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import upstream_model_tests

PROBE = """
from transformers import AutoModelForCausalLM, Qwen3_5ForCausalLM, Qwen3_5TextConfig


def test_names_resolve_to_the_generated_module():
    assert Qwen3_5ForCausalLM.__module__ == "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_npu"
    config = Qwen3_5TextConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=16, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=8, vocab_size=32, linear_num_key_heads=2,
                               linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                               layer_types=["full_attention"])
    assert type(AutoModelForCausalLM.from_config(config)) is Qwen3_5ForCausalLM
"""


@pytest.fixture
def probe_tree(tmp_path):
    folder = tmp_path / "tests" / "models" / "qwen3_5"
    folder.mkdir(parents=True)
    for package in (tmp_path / "tests", tmp_path / "tests" / "models", folder):
        (package / "__init__.py").write_text("")
    (folder / "test_modeling_qwen3_5.py").write_text(PROBE)
    return folder / "test_modeling_qwen3_5.py"


def test_the_swapped_run_sees_generated_classes_and_the_upstream_run_does_not(probe_tree, tmp_path):
    ours, _, _ = upstream_model_tests.run_pytest(probe_tree, "npu", [], tmp_path)
    upstream, _, _ = upstream_model_tests.run_pytest(probe_tree, None, [], tmp_path)
    test_id = "tests.models.qwen3_5.test_modeling_qwen3_5::test_names_resolve_to_the_generated_module"
    assert ours == {test_id: "passed"}
    assert upstream == {test_id: "failed"}


def test_a_pass_upstream_that_fails_with_ours_is_listed():
    differing = upstream_model_tests.compare(
        "gpu", {"t::a": "passed", "t::b": "skipped"}, {"t::a": "failed", "t::b": "skipped"}, {}
    )
    assert [(d["test"], d["upstream"], d["ours"]) for d in differing] == [("t::a", "passed", "failed")]


def test_a_compat_edit_applies_once_and_leaves_the_file_importable(tmp_path):
    edit = upstream_model_tests.COMPAT_EDITS[0]
    source = tmp_path / edit.file
    source.write_text(f"if True:\n{edit.find}")
    first = upstream_model_tests.apply_compat_edits(tmp_path)
    second = upstream_model_tests.apply_compat_edits(tmp_path)
    assert (len(first), second) == (1, [])
    compile(source.read_text(), str(source), "exec")


def test_counts_are_kept_per_test_class():
    result = {
        "tests.models.qwen3_5.test_modeling_qwen3_5.Qwen3_5TextModelTest::test_a": "passed",
        "tests.models.qwen3_5.test_modeling_qwen3_5.Qwen3_5TextModelTest::test_b": "skipped",
        "tests.models.qwen3_5.test_modeling_qwen3_5.Qwen3_5ModelTest::test_a": "failed",
    }
    assert upstream_model_tests.counts_by_class(result) == {
        "Qwen3_5ModelTest": {"passed": 0, "failed": 1, "skipped": 0},
        "Qwen3_5TextModelTest": {"passed": 1, "failed": 0, "skipped": 1},
    }


def test_the_sdist_overlay_takes_only_the_top_level_test_files(tmp_path):
    import io
    import tarfile

    sdist = tmp_path / "transformers-9.9.9.tar.gz"
    with tarfile.open(sdist, "w:gz") as archive:
        for name in ("tests/test_modeling_common.py", "tests/models/x/test_x.py", "tests/data.json", "src/a.py"):
            data = name.encode()
            info = tarfile.TarInfo(f"transformers-9.9.9/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    assert upstream_model_tests.sdist_test_files(sdist, "9.9.9") == {
        "test_modeling_common.py": b"tests/test_modeling_common.py"
    }
