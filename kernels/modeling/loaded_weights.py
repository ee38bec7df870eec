"""What a checkpoint leaves out when a generated class loads it: an LM head that the checkpoint's
composite config ties to the embedding, and weights that transformers would leave random.

A vision-language checkpoint whose composite ``config.json`` says ``tie_word_embeddings: true`` was
saved by a model that tied its LM head to the embedding, so it holds no ``lm_head.weight``; its
``text_config`` section carries the text config's own default (false). A text class (``ForCausalLM``)
loads only that section, and transformers then leaves the LM head random, reported as MISSING in a
table. Here the text class ties as the composite did, and any other backbone or LM-head weight
absent from the checkpoint is an error unless ``allow_missing_weights=True``.
"""

from __future__ import annotations

from typing import Any

from ..errors import MissingWeights

ALLOW_KEYWORD = "allow_missing_weights"
TIE = "tie_word_embeddings"
# heads that a task class adds on top of a backbone checkpoint: new by design, trained by the user
NEW_HEADS = ("score.", "classifier.", "qa_outputs.")


def composite_ties(saved: dict | None, section: str) -> bool:
    """Whether a composite ``config.json`` (as a dict) ties the embeddings while its text section does not say so."""
    if not saved or not isinstance(saved.get(section), dict):
        return False
    return saved.get(TIE) is True and saved[section].get(TIE) is not True


def tie_like_composite(config: Any) -> None:
    """A composite config object's tie, on its text config (the one a text class builds from)."""
    text = getattr(config, "text_config", None)
    if text is not None and getattr(config, TIE, False) is True and getattr(text, TIE, False) is not True:
        setattr(text, TIE, True)


def check_missing(cls, source: Any, info: dict, allowed: bool) -> None:
    """Raise `MissingWeights` for backbone or LM-head weights the checkpoint lacked (``info`` is transformers' report)."""
    missing = sorted(str(key) for key in info.get("missing_keys", ()) if not str(key).startswith(NEW_HEADS))
    if missing and not allowed:
        raise MissingWeights(cls.__name__, repr(str(source)), missing)
