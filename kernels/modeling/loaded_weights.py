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


# The published (vision-language) checkpoints hold the text weights here; transformers renames them to `model.`
# for a text class while loading, and back when that model is saved.
PUBLISHED_PREFIX = "model.language_model."


def accept_published_layout(model) -> None:
    """Let ``model.load_state_dict`` read the published layout's keys: a text class's, registered when it is
    built (``post_init``), so a model built from its config takes such a checkpoint too.

    One loaded from that layout saves ``model.language_model.*`` (transformers reverts its load-time rename
    on save, for upstream's class too), and Trainer's resume loads that file with
    ``load_state_dict(sd, strict=False)``, which converts nothing: every backbone key missed, the trained LM
    head alone was loaded, and the run went on from the initial backbone with a logged warning. Composite
    classes hold those keys themselves.
    """
    backbone = getattr(model, "model", None)
    if backbone is None or hasattr(backbone, "language_model"):
        return
    model.register_load_state_dict_pre_hook(take_published_layout)


def take_published_layout(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """``load_state_dict`` pre-hook: ``model.language_model.X`` becomes ``model.X`` (before the experts' own hook
    fuses per-expert keys, which runs on the submodule, later); a key present under both names is left alone."""
    old = prefix + PUBLISHED_PREFIX
    for key in [k for k in state_dict if k.startswith(old)]:
        new = prefix + "model." + key[len(old):]
        if new not in state_dict:
            state_dict[new] = state_dict.pop(key)
