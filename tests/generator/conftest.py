import shutil
from pathlib import Path

import pytest

from patchgen.source import UpstreamSource
from patchgen.spec import PatchConfig
from patchgen.targets import Target, generated_dir

FIXTURES = Path(__file__).parent / "fixtures"
TOY_MODULE = "toy_pkg.models.toy.modeling_toy"


@pytest.fixture
def toy_upstream(monkeypatch) -> UpstreamSource:
    # The bodies modules are found on sys.path by name, like real ones, without being imported.
    monkeypatch.syspath_prepend(str(FIXTURES))
    text = (FIXTURES / "upstream_toy.py").read_text()
    return UpstreamSource(TOY_MODULE, FIXTURES / "upstream_toy.py", text, "9.9.9")


@pytest.fixture
def toy_config() -> PatchConfig:
    return PatchConfig("toy", "gpu", bodies="fixture_bodies.toy", upstream_module=TOY_MODULE)


@pytest.fixture
def toy_generate(toy_upstream):
    from patchgen.pipeline import generate

    def run(config: PatchConfig):
        return generate(Target(config.model, config.device), config=config, upstream=toy_upstream)

    return run


@pytest.fixture
def out_copy(tmp_path, monkeypatch):
    """A copy of generated/ that the CLI reads and writes instead of the checked-in one."""
    copy = tmp_path / "generated"
    shutil.copytree(generated_dir(), copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("PATCHGEN_OUTPUT_DIR", str(copy))
    return copy
