"""Overrides keep upstream's parameters and annotations; the generator refuses those that do not."""

import pytest

from patchgen.errors import EXIT_ERROR, SignatureMismatch

BODY = "fixture_bodies.toy:"


def _override(config, body):
    config.override_method("ToyAttention.forward", reason="r", body=BODY + body)


def test_a_bare_parameter_takes_upstreams_annotation(toy_config, toy_generate):
    toy_config.override_method("ToyAttention.forward", reason="r", decorators="body")
    assert "def forward(x, cache: Optional[int] = None):" in toy_generate(toy_config).python


def test_an_added_parameter_is_allowed_and_upstreams_annotations_stay(toy_config, toy_generate):
    _override(toy_config, "attention_forward_adds_a_parameter")
    assert "def forward(self, x, cache: Optional[int] = None, extra: int = 0):" in toy_generate(toy_config).python


@pytest.mark.parametrize(
    "body,message",
    [
        ("attention_forward_drops_cache", "drops upstream's parameter `cache: Optional[int]` (positional)"),
        ("attention_forward_other_annotation", "parameter `cache` is annotated `Optional[int]` upstream, the body has `str | None`"),
        ("attention_forward_keyword_only_x", "upstream's parameter `x` is positional, the body makes it keyword-only"),
        ("attention_forward_swapped", "positional parameters (cache, x) do not start with upstream's (x, cache) in order"),
        ("attention_forward_any", "drops upstream's parameter `cache: Optional[int]`"),
    ],
)
def test_an_override_that_drops_or_changes_upstreams_signature_is_refused(toy_config, toy_generate, body, message):
    _override(toy_config, body)
    with pytest.raises(SignatureMismatch) as raised:
        toy_generate(toy_config)
    text = str(raised.value)
    assert message in text
    assert text.startswith("override_method ToyAttention.forward (body fixture_bodies.toy:" + body)
    assert "transformers 9.9.9" in text and "declared at" in text


def test_signature_mismatch_is_a_generation_error_with_exit_code_3():
    assert SignatureMismatch("x").exit_code == EXIT_ERROR == 3


def test_a_replaced_class_keeps_upstreams_signatures_of_the_methods_it_shares(toy_config, toy_generate):
    toy_config.replace_class("ToyNorm", reason="r", body=BODY + "ToyNormWithoutInput")
    with pytest.raises(SignatureMismatch, match=r"method forward: drops upstream's parameter `x` \(positional\)"):
        toy_generate(toy_config)
