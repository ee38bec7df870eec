"""The pipeline on a toy upstream module: each verb applied, validated, and the rest preserved."""

import libcst as cst
import pytest

from patchgen.errors import ConfigError, PatchApplyError, PatchTargetMissing
from patchgen.spec import Renames


def body_of(result):
    """The generated module without patchgen's header."""
    return result.python.split("# Copyright 2026 The Toy Authors", 1)[1]


def test_override_method_replaces_body_keeps_signature_position_and_marks_reason(toy_config, toy_generate):
    toy_config.override_method("ToyNorm.forward", reason="norm through ops")
    out = toy_generate(toy_config).python
    assert "# patchgen[override_method]: norm through ops\n    def forward(self, x):\n        # body comment survives;" in out
    assert "return ops.norm(helper_a(x), self.eps)" in out
    assert "# upstream comment in a patched method" not in out
    assert "self.eps = eps  # keep this comment" in out  # untouched code keeps its comments


def test_override_method_keeps_upstream_decorators_unless_told(toy_config, toy_generate):
    toy_config.override_method("ToyAttention.forward", reason="r")
    assert "@staticmethod" not in toy_generate(toy_config).python
    toy_config.patches.clear()
    toy_config.override_method("ToyAttention.forward", reason="r", decorators="body")
    # the bare body parameter takes upstream's annotation (patchgen/signatures.py)
    assert "    @staticmethod\n    def forward(x, cache: Optional[int] = None):" in toy_generate(toy_config).python


def test_override_method_of_missing_method_names_target_config_line_and_version(toy_config, toy_generate):
    toy_config.override_method("ToyNorm.backward", reason="r")
    with pytest.raises(PatchTargetMissing, match=r"ToyNorm has no method 'backward'.*test_pipeline.py:\d+.*9\.9\.9.*add_method"):
        toy_generate(toy_config)


def test_misspelt_method_suggests_the_close_method_names(toy_config, toy_generate):
    # docs/patchgen.md: a missing target lists the closest upstream names; a typo of a method got only
    # "use add_method", which would add a second, never-called method
    toy_config.override_method("ToyNorm.forwrd", reason="r")
    with pytest.raises(PatchTargetMissing, match=r"no method 'forwrd'.*closest methods of ToyNorm upstream: forward"):
        toy_generate(toy_config)


def test_missing_class_suggests_close_names(toy_config, toy_generate):
    toy_config.override_method("ToyNrom.forward", reason="r")
    with pytest.raises(PatchTargetMissing, match="closest upstream names: ToyNorm"):
        toy_generate(toy_config)


def test_add_method_appends_and_refuses_existing(toy_config, toy_generate):
    toy_config.add_method("ToyNorm.reset", reason="new api")
    out = toy_generate(toy_config).python
    assert "# patchgen[add_method]: new api\n    def reset(self):\n        return collections.OrderedDict()" in out
    assert "\nimport collections\n" in out  # carried in from the bodies module
    toy_config.patches.clear()
    toy_config.add_method("ToyNorm.forward", reason="r")
    with pytest.raises(PatchTargetMissing, match="already has 'forward' upstream.*use override_method"):
        toy_generate(toy_config)


def test_replace_function_and_its_kind_check(toy_config, toy_generate):
    toy_config.replace_function("toy_function", reason="fast add")
    out = toy_generate(toy_config).python
    assert "# patchgen[replace_function]: fast add\ndef toy_function(x):\n    return ops.add_one(x)" in out
    assert "from toy_runtime import ops" in out
    toy_config.patches.clear()
    toy_config.replace_function("ToyNorm", reason="r")
    with pytest.raises(PatchTargetMissing, match="'ToyNorm' is a class, not a function"):
        toy_generate(toy_config)


def test_replace_class_and_its_kind_check(toy_config, toy_generate):
    toy_config.replace_class("ToyLegacy", reason="rewritten")
    out = toy_generate(toy_config).python
    assert '# patchgen[replace_class]: rewritten\nclass ToyLegacy:\n    """Replaced wholesale."""\n\n    value = 2' in out
    toy_config.patches.clear()
    toy_config.replace_class("toy_function", reason="r")
    with pytest.raises(PatchTargetMissing, match="is a function, not a class"):
        toy_generate(toy_config)


def test_body_of_wrong_kind_is_a_config_error(toy_config, toy_generate):
    toy_config.replace_function("toy_function", reason="r", body="fixture_bodies.toy:ToyLegacy")
    with pytest.raises(ConfigError, match="is a class, but the patch needs a function"):
        toy_generate(toy_config)


def test_explicit_body_takes_the_target_name(toy_config, toy_generate):
    toy_config.replace_function("toy_function", reason="r", body="fixture_bodies.toy:toy_function_named_otherwise")
    out = toy_generate(toy_config).python
    assert "def toy_function(x):\n    return x * 2" in out and "toy_function_named_otherwise" not in out


def test_body_missing_from_bodies_module(toy_config, toy_generate):
    toy_config.replace_function("toy_function", reason="r", body="fixture_bodies.toy:nowhere")
    with pytest.raises(ConfigError, match="body fixture_bodies.toy:nowhere not found"):
        toy_generate(toy_config)


def test_body_reading_an_undefined_name_is_refused(toy_config, toy_generate):
    toy_config.replace_function("toy_function", reason="r", body="fixture_bodies.toy:uses_unknown")
    with pytest.raises(PatchApplyError, match="reads 'not_imported_anywhere'.*import it in the bodies module"):
        toy_generate(toy_config)


def test_body_importing_a_name_upstream_lacks_is_refused(toy_config, toy_generate):
    toy_config.replace_function("toy_function", reason="r", body="fixture_bodies.toy:uses_gone_upstream_name")
    with pytest.raises(PatchApplyError, match="imports 'ToyGone' from the upstream model package .* which this upstream"):
        toy_generate(toy_config)


def test_exclude_drops_definition_and_all_entry(toy_config, toy_generate):
    toy_config.exclude("ToyLegacy", reason="not supported")
    out = toy_generate(toy_config).python
    assert "class ToyLegacy" not in out
    assert '__all__ = ["ToyNorm", "ToyAttention"]' in out
    toy_config.patches.clear()
    toy_config.exclude("ToyMissing", reason="r")
    with pytest.raises(PatchTargetMissing, match="'ToyMissing' is not defined upstream"):
        toy_generate(toy_config)


def test_add_import_is_inserted_after_upstream_imports(toy_config, toy_generate):
    toy_config.add_import("import operator", reason="side effects")
    out = body_of(toy_generate(toy_config))
    assert out.index("from toy_pkg.models.toy.configuration_toy import ToyConfig") < out.index("import operator")
    assert out.index("import operator") < out.index("try:")


def test_preserves_license_docstring_guarded_imports_and_annotated_assignment(toy_config, toy_generate):
    toy_config.override_method("ToyNorm.forward", reason="r")
    out = toy_generate(toy_config).python
    for kept in (
        "# Copyright 2026 The Toy Authors. All rights reserved.\n#\n# Licensed under the Apache License, Version 2.0.\n",
        '"""Toy upstream modeling module for the generator\'s tests."""',
        "try:\n    import fancy_kernels\nexcept ImportError:\n    fancy_kernels = None",
        "if is_fancy_available():\n    from fancy import fast_norm\nelse:\n    fast_norm = None",
        "DEFAULT_EPS: float = 1e-6",
        "# ToyNorm is used by ToyAttention; this comment names the class and must survive renames.",
    ):
        assert kept in out


def test_relative_imports_become_absolute(toy_config, toy_generate):
    out = toy_generate(toy_config).python
    assert "from toy_pkg.utils import is_fancy_available, helper_a, helper_b" in out
    assert "from toy_pkg.models.toy.configuration_toy import ToyConfig" in out
    assert "from ." not in out


def test_imports_made_unused_by_patches_are_dropped_others_kept(toy_config, toy_generate):
    # helper_b is only read by ToyAttention.forward upstream; math only by ToyNorm.forward.
    toy_config.override_method("ToyAttention.forward", reason="r")
    toy_config.override_method("ToyNorm.forward", reason="r")
    out = toy_generate(toy_config).python
    assert "from toy_pkg.utils import is_fancy_available, helper_a\n" in out
    assert "import math\n" not in out
    assert "from typing import Optional\n" in out  # the override keeps upstream's annotation `Optional[int]`
    assert "\nimport os\n" in out  # unused upstream already: not ours to drop


def test_imported_upstream_names_are_not_reimported(toy_config, toy_generate):
    toy_config.override_method("ToyNorm.forward", reason="r")
    out = toy_generate(toy_config).python
    assert "modeling_toy import" not in out  # helper_a comes from upstream's own import


def test_generated_code_compiles_and_header_lists_patches_with_hashes(toy_config, toy_generate):
    toy_config.override_method("ToyNorm.forward", reason="norm through ops")
    toy_config.exclude("ToyLegacy", reason="gone")
    result = toy_generate(toy_config)
    compile(result.python, "x.py", "exec")
    header = result.python.split("# Copyright", 1)[0]
    assert "from transformers 9.9.9" in header
    assert f"# sha256:     {result.upstream.sha256}" in header
    assert "#   override_method ToyNorm.forward [upstream " in header and ": norm through ops" in header
    assert "#   exclude ToyLegacy [upstream " in header
    assert set(result.upstream_hashes) == {"ToyNorm.forward", "ToyLegacy"}


def test_upstream_hash_changes_with_the_node_only(toy_config, toy_upstream, toy_generate):
    from patchgen.pipeline import generate
    from patchgen.targets import Target

    toy_config.override_method("ToyNorm.forward", reason="r")
    before = toy_generate(toy_config).upstream_hashes["ToyNorm.forward"]
    elsewhere = toy_upstream.__class__(toy_upstream.module, toy_upstream.path,
                                       toy_upstream.text.replace("return x + 1", "return x + 2"), "9.9.9")
    inside = toy_upstream.__class__(toy_upstream.module, toy_upstream.path,
                                    toy_upstream.text.replace("math.sqrt(self.eps)", "math.sqrt(self.eps + 0)"), "9.9.9")
    target = Target("toy", "gpu")
    assert generate(target, toy_config, elsewhere).upstream_hashes["ToyNorm.forward"] == before
    assert generate(target, toy_config, inside).upstream_hashes["ToyNorm.forward"] != before


def test_renames_touch_identifiers_only(toy_upstream, toy_generate):
    from patchgen.spec import PatchConfig

    moe_text = toy_upstream.text.replace("Toy", "ToyMoe").replace("toy", "toy_moe")
    upstream = toy_upstream.__class__("toy_pkg.models.toy_moe.modeling_toy_moe", toy_upstream.path, moe_text, "9.9.9")
    base = PatchConfig("toy", "gpu", bodies="fixture_bodies.toy", upstream_module="toy_pkg.models.toy.modeling_toy")
    base.override_method("ToyNorm.forward", reason="r")
    base.override_method("ToyAttention.forward", reason="r")
    moe = base.derive(
        model="toy_moe", renames=Renames({"Toy": "ToyMoe"}, {"toy": "toy_moe", "modeling_toy": "modeling_toy_moe"}),
        upstream_module="toy_pkg.models.toy_moe.modeling_toy_moe",
    )
    from patchgen.pipeline import generate
    from patchgen.targets import Target

    out = generate(Target("toy_moe", "gpu"), moe, upstream).python
    assert "ToyMoeMoe" not in out
    assert "#   override_method ToyMoeNorm.forward" in out
    assert '# body comment survives; "ToyNorm" in a comment is never renamed' in out
    assert "class ToyMoeNorm:" in out
    cst.parse_module(out)


def test_output_with_syntax_error_is_refused(toy_config, toy_upstream):
    from patchgen.pipeline import generate
    from patchgen.targets import Target

    broken = toy_upstream.__class__(toy_upstream.module, toy_upstream.path, "def broken(:\n", "9.9.9")
    with pytest.raises(PatchApplyError, match="does not parse"):
        generate(Target("toy", "gpu"), toy_config, broken)
