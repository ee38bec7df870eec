"""The generated modules refuse a transformers other than the one they were generated from, saying so.

They are upstream's modeling code of that exact release: another release fails at a missing name
(5.18: `ImportError: cannot import name 'MultimodalBaseModelOutputWithPast'`) or, worse, imports and runs
with internals that moved. The generator refuses a mismatch the same way (`patchgen/source.py`).
"""

import os
import subprocess
import sys

from patchgen.pins import TRANSFORMERS_PIN


def _import_generated(path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run(
        [sys.executable, "-c", "import patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )


def test_importing_a_generated_module_under_another_transformers_names_both_versions_and_the_fix(tmp_path):
    # a transformers imported from a checkout on PYTHONPATH, which has no metadata of its own: the installed
    # distribution's metadata (the pin) says nothing of the package imported
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text('__version__ = "5.18.0"\n')
    run = _import_generated(tmp_path)
    assert run.returncode != 0
    assert f"generated from transformers {TRANSFORMERS_PIN}, imported 5.18.0" in run.stderr
    assert f"pip install transformers=={TRANSFORMERS_PIN}" in run.stderr


def test_metadata_of_another_version_found_first_does_not_refuse_the_pinned_package_imported(tmp_path):
    info = tmp_path / "transformers-5.18.0.dist-info"  # a stray distribution's metadata ahead on sys.path
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.18.0\n")
    run = _import_generated(tmp_path)
    assert run.returncode == 0, run.stderr


def test_the_pinned_transformers_imports():
    import patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu  # noqa: F401
