"""The rename codemod: module-level identifiers and module paths only, each renamed once."""

import libcst as cst

from patchgen.codemods.rename import rename_tree
from patchgen.spec import Renames

RENAMES = Renames(
    {"Qwen3_5": "Qwen3_5Moe"},
    {"qwen3_5": "qwen3_5_moe", "modeling_qwen3_5": "modeling_qwen3_5_moe"},
    {"BaseModelOutputWithPast": "MoeModelOutputWithPast"},
)


def test_identifiers_and_import_paths_are_renamed_attributes_keywords_strings_comments_are_not():
    source = (
        "import transformers.models.qwen3_5.modeling_qwen3_5 as up\n"
        "from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention\n"
        "def f(self, Qwen3_5Config=None):\n"
        "    x = self.BaseModelOutputWithPast\n"
        "    y = make(Qwen3_5Config=1)\n"
        '    return BaseModelOutputWithPast(Qwen3_5Attention(Qwen3_5Config), "Qwen3_5Attention")  # Qwen3_5Attention\n'
    )
    assert rename_tree(cst.parse_module(source), RENAMES).code == (
        "import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as up\n"
        "from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeAttention\n"
        "def f(self, Qwen3_5MoeConfig=None):\n"
        "    x = self.BaseModelOutputWithPast\n"
        "    y = make(Qwen3_5Config=1)\n"
        '    return MoeModelOutputWithPast(Qwen3_5MoeAttention(Qwen3_5MoeConfig), "Qwen3_5Attention")  # Qwen3_5Attention\n'
    )


def test_already_renamed_identifiers_stay():
    source = "Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig)\n"
    assert rename_tree(cst.parse_module(source), RENAMES).code == source


def test_statements_without_a_renamed_name_are_kept_as_the_same_objects():
    module = cst.parse_module("def f(x):\n    y = torch.relu(x)\n    return Qwen3_5Norm(y)\n")
    renamed = rename_tree(module, RENAMES)
    before, after = module.body[0].body.body, renamed.body[0].body.body
    assert after[0] is before[0]  # nothing renamed there: not rebuilt
    assert cst.Module(body=[after[1]]).code == "return Qwen3_5MoeNorm(y)\n"


def test_a_tree_with_nothing_to_rename_is_returned_as_it_is():
    module = cst.parse_module("def f(x):\n    return x + 1\n")
    assert rename_tree(module, RENAMES) is module
