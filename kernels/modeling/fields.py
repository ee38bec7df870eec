"""patchgen's config fields on the text config the model reads, however the user handed them over.

Three ways transformers would lose or refuse them:

- keywords: transformers hands ``from_pretrained(path, shared_prefix_training=True)``'s unknown
  keyword to the model's ``__init__``, which refuses it with a bare ``TypeError``;
- a composite (vision-language) config given to a text class (``ForCausalLM``): transformers' auto
  classes, and the text class itself, build from its ``text_config`` only, so fields set on the
  composite config were dropped;
- a checkpoint whose ``config.json`` holds the fields at the composite level (saved from a
  ``ForConditionalGeneration`` with ``model.config.shared_prefix_training = True``): a text class
  loads only the ``text_config`` section of it.

The generated ``from_pretrained`` and ``_from_config`` route all three onto the text config (a field
set to different values in two places is a ``SettingError``) and bind the op slots from there.
"""

from __future__ import annotations

import difflib
from types import SimpleNamespace
from typing import Any

from ..config import FIELDS, field
from ..errors import SettingError
from . import loaded_weights

# from_pretrained keywords that say where a checkpoint's config.json is read from (not force_download:
# the load just read it).
HUB_KEYWORDS = ("cache_dir", "proxies", "token", "local_files_only", "revision", "subfolder", "gguf_file")


def pop_fields(kwargs: dict) -> dict:
    """Remove and return the patchgen config fields among ``from_pretrained``'s keywords; a keyword one typo away
    from one (``shared_prefix_trainig=True``) is refused by name, where transformers would raise a bare TypeError."""
    # only our prefix: transformers' own keywords come close to ours (experts_implementation, ops_implementation)
    for key in (k for k in kwargs if k.startswith("shared_prefix") and k not in FIELDS):
        if close := difflib.get_close_matches(key, FIELDS, n=1, cutoff=0.85):
            raise SettingError(f"from_pretrained keyword {key!r} is not one patchgen reads; did you mean {close[0]!r}?")
    return {name: kwargs.pop(name) for name in FIELDS if name in kwargs}


def composite_fields(config: Any) -> dict:
    """The patchgen fields set on a composite config itself (not on its ``text_config``), read with ``field``.

    ``field`` raises when the composite and its text config hold different values of one field.
    """
    if getattr(config, "text_config", None) is None:
        return {}
    return {name: field(config, name) for name in FIELDS if name in vars(config)}


def builds_from_text_config(cls, config: Any) -> bool:
    """Whether ``cls`` (a text class: ``ForCausalLM``, ``TextModel``) is given a composite config around its own."""
    wanted = getattr(cls, "config_class", None)
    text = getattr(config, "text_config", None)
    return wanted is not None and text is not None and not isinstance(config, wanted) and isinstance(text, wanted)


def text_config_for(cls, config: Any) -> Any:
    """The config ``cls`` builds from: ``config`` itself, or, for a composite config given to a text class, its
    ``text_config`` holding the patchgen fields (and the quantization config) set on the composite.

    transformers' auto classes make the same swap but keep only the quantization config; upstream's text
    classes given a composite config fail on a missing attribute.
    """
    if not builds_from_text_config(cls, config):
        return config
    text = config.text_config
    for name, value in composite_fields(config).items():
        setattr(text, name, value)
    quantization = getattr(config, "quantization_config", None)
    if quantization is not None:
        text.quantization_config = quantization
    return text


def from_pretrained(cls, load, args: tuple, kwargs: dict, defaults):
    """``load(*args, **kwargs)`` (transformers' ``from_pretrained``) with patchgen's fields routed to the text config.

    Keyword fields are taken out before loading and set afterwards; a composite ``config=`` given to a text
    class is swapped for its text config (``text_config_for``); fields a composite ``config.json`` holds
    outside the text section a text class loads are set too (keywords win over the file).
    """
    fields = pop_fields(kwargs)
    allow_missing = kwargs.pop(loaded_weights.ALLOW_KEYWORD, False)
    wants_info = kwargs.pop("output_loading_info", False)
    config = kwargs.get("config")
    if config is not None and not _is_path(config):
        if builds_from_text_config(cls, config):
            loaded_weights.tie_like_composite(config)
        kwargs["config"] = text_config_for(cls, config)
    section = _text_section(cls)
    composite = saved_composite(cls, args, kwargs)
    if loaded_weights.TIE not in kwargs and loaded_weights.composite_ties(composite, section):
        kwargs[loaded_weights.TIE] = True
    model, info = load(*args, output_loading_info=True, **kwargs)
    source = kwargs.get("pretrained_model_name_or_path", args[0] if args else None)
    loaded_weights.check_missing(cls, source, info, allow_missing)
    saved = composite_fields_of(composite, section)
    return apply_fields((model, info) if wants_info else model, {**saved, **fields}, defaults)


def _text_section(cls) -> str:
    return getattr(getattr(cls, "config_class", None), "base_config_key", "")


def saved_composite_fields(cls, args: tuple, kwargs: dict) -> dict:
    """The patchgen fields at the composite level of the ``config.json`` a text class ``cls`` was loaded from.

    ``args`` and ``kwargs`` are ``from_pretrained``'s. Empty when a config object was given (then
    ``text_config_for`` has moved its fields) or the file is not a composite config.
    """
    return composite_fields_of(saved_composite(cls, args, kwargs), _text_section(cls))


def saved_composite(cls, args: tuple, kwargs: dict) -> dict | None:
    """The composite ``config.json`` (as a dict) a text class ``cls`` loads from; None when a config object
    was given, or there is no file, or the class is not a text class of a composite config."""
    section = _text_section(cls)
    config = kwargs.get("config")
    path = config if config is not None else (args[0] if args else kwargs.get("pretrained_model_name_or_path"))
    if not section or path is None or not _is_path(path):
        return None
    from transformers import PreTrainedConfig

    hub = {name: kwargs[name] for name in HUB_KEYWORDS if kwargs.get(name) is not None}
    try:
        saved, _ = PreTrainedConfig.get_config_dict(path, **hub)
    except OSError:
        # No config file at `path` although the load succeeded: its config came from elsewhere (a PEFT
        # adapter folder points transformers at its base model), so there is no composite file to read here.
        return None
    return saved if isinstance(saved.get(section), dict) else None


def composite_fields_of(saved: dict | None, section: str) -> dict:
    """The patchgen fields at the composite level of ``saved`` (``saved_composite``'s dict)."""
    if saved is None:
        return {}
    inner = saved[section]
    # Read as field() reads a live composite config, so a conflict with the text section is the same error.
    text = SimpleNamespace(**{name: inner[name] for name in FIELDS if name in inner})
    return composite_fields(SimpleNamespace(text_config=text, **{name: saved[name] for name in FIELDS if name in saved}))


def _is_path(value: Any) -> bool:
    return isinstance(value, (str, bytes)) or hasattr(value, "__fspath__")


def apply_fields(loaded, fields: dict, defaults):
    """Set ``fields`` on the loaded model's text config and bind its op slots again; returns ``loaded`` as given.

    ``loaded`` is the model or, with ``output_loading_info=True``, ``(model, info)``.
    """
    if not fields:
        return loaded
    from .. import ops

    model = loaded[0] if isinstance(loaded, tuple) else loaded
    holder = getattr(model.config, "text_config", None) or model.config
    for name, value in fields.items():
        setattr(holder, name, value)
    ops.bind(model, model.config, defaults=defaults)
    return loaded
