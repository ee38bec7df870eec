"""The patch DSL validates what a config declares, before any source is read."""

import pytest

from patchgen.errors import ConfigError
from patchgen.spec import PatchConfig, Renames


def make():
    return PatchConfig("toy", "gpu", bodies="fixture_bodies.toy")


@pytest.mark.parametrize(
    "verb, target",
    [("override_method", "ToyNorm"), ("add_method", "ToyNorm"), ("replace_class", "A.b"),
     ("replace_function", "a.b"), ("exclude", "A.b"), ("override_method", "A.b.c"), ("replace_class", "1bad")],
)
def test_verb_rejects_target_of_wrong_shape(verb, target):
    with pytest.raises(ConfigError, match="target must look like"):
        getattr(make(), verb)(target, reason="r")


@pytest.mark.parametrize("reason", ["", "   ", "two\nlines", None])
def test_reason_must_be_one_nonempty_line(reason):
    with pytest.raises(ConfigError, match="reason must be one non-empty line"):
        make().override_method("ToyNorm.forward", reason=reason)


def test_body_defaults_to_same_qualname_in_bodies_module():
    patch = make().override_method("ToyNorm.forward", reason="r")
    assert (patch.body_module, patch.body_name) == ("fixture_bodies.toy", "ToyNorm.forward")


def test_explicit_body_reference():
    patch = make().replace_function("toy_function", reason="r", body="other.mod:impl")
    assert (patch.body_module, patch.body_name) == ("other.mod", "impl")


def test_malformed_body_reference_is_rejected():
    with pytest.raises(ConfigError, match="body must be 'package.module:Qual.name'"):
        make().replace_function("toy_function", reason="r", body="no_colon")


def test_no_bodies_module_and_no_body_is_an_error():
    config = PatchConfig("toy", "gpu")
    with pytest.raises(ConfigError, match="no body= given"):
        config.override_method("ToyNorm.forward", reason="r")


def test_same_target_twice_is_an_error_naming_the_first_declaration():
    config = make()
    config.override_method("ToyNorm.forward", reason="r")
    with pytest.raises(ConfigError, match=r"already patched by override_method at .*test_spec.py:\d+"):
        config.override_method("ToyNorm.forward", reason="again")


def test_add_import_needs_one_import_line():
    with pytest.raises(ConfigError, match="expected one 'import"):
        make().add_import("x = 1", reason="r")
    assert make().add_import("from a import b", reason="r").statement == "from a import b"


def test_decorators_option_is_validated():
    with pytest.raises(ConfigError, match="decorators must be"):
        make().override_method("ToyNorm.forward", reason="r", decorators="both")


def test_patch_records_where_it_was_declared():
    patch = make().exclude("ToyLegacy", reason="r")
    assert patch.declared_at.endswith("test_spec.py:" + str(patch.declared_at.rsplit(":", 1)[1]))
    assert "test_spec.py" in patch.declared_at


def test_rename_prefix_is_applied_once_never_twice():
    renames = Renames({"Qwen3_5": "Qwen3_5Moe"})
    assert renames.identifier("Qwen3_5Attention") == "Qwen3_5MoeAttention"
    assert renames.identifier("Qwen3_5MoeSparseMoeBlock") == "Qwen3_5MoeSparseMoeBlock"
    assert renames.identifier("apply_rotary_pos_emb") == "apply_rotary_pos_emb"
    assert renames.qualname("Qwen3_5Attention.forward") == "Qwen3_5MoeAttention.forward"


def test_exact_name_renames_win_over_prefixes():
    renames = Renames({"Qwen3_5": "Qwen3_5Moe"}, names={"BaseModelOutputWithPast": "MoeModelOutputWithPast"})
    assert renames.identifier("BaseModelOutputWithPast") == "MoeModelOutputWithPast"
    assert renames.identifier("BaseModelOutputWithPooling") == "BaseModelOutputWithPooling"
    assert renames.identifier("Qwen3_5TextModel") == "Qwen3_5MoeTextModel"


def test_module_renames_apply_to_whole_path_components():
    renames = Renames(modules={"qwen3_5": "qwen3_5_moe", "modeling_qwen3_5": "modeling_qwen3_5_moe"})
    assert renames.module("transformers.models.qwen3_5.modeling_qwen3_5") == (
        "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
    )
    assert renames.module("transformers.models.qwen3_5x.y") == "transformers.models.qwen3_5x.y"


def test_derive_carries_patches_and_merges_op_defaults():
    base = PatchConfig("toy", "gpu", bodies="fixture_bodies.toy", op_defaults={"a": "x", "b": "y"})
    base.override_method("ToyNorm.forward", reason="r")
    child = base.derive(device="npu", op_defaults={"b": "z"})
    assert (child.device, child.op_defaults, len(child.patches)) == ("npu", {"a": "x", "b": "z"}, 1)
    sibling = base.derive(model="toy_moe", renames=Renames({"Toy": "ToyMoe"}))
    assert sibling.upstream_module == "transformers.models.toy_moe.modeling_toy_moe"
    assert sibling.resolved_target(sibling.patches[0]) == "ToyMoeNorm.forward"


def test_derived_config_supersedes_an_inherited_patch_in_place():
    base = PatchConfig("toy", "gpu", bodies="fixture_bodies.toy")
    base.override_method("ToyNorm.forward", reason="dense")
    base.exclude("ToyLegacy", reason="gone")
    moe = base.derive(model="toy_moe", renames=Renames({"Toy": "ToyMoe"}))
    own = moe.override_method("ToyMoeNorm.forward", reason="moe body", body="other:impl")
    assert moe.patches == [own, base.patches[1]]
    assert len(base.patches) == 2 and base.patches[0].reason == "dense"
    with pytest.raises(ConfigError, match="already patched"):
        moe.override_method("ToyMoeNorm.forward", reason="twice", body="other:impl")
