"""patchgen's config fields as ``from_pretrained`` keywords, as transformers takes any config field.

transformers hands a keyword its config class does not know to the model's ``__init__``, which
refuses ``shared_prefix_training=True`` with a bare ``TypeError``; a vision-language config would
also hold it on the composite config rather than on the text config the model reads. The generated
``from_pretrained`` takes these keywords out, loads, then sets them on the text config and
re-resolves the op slots (which also checks the values).
"""

from __future__ import annotations

from ..config import FIELDS


def pop_fields(kwargs: dict) -> dict:
    """Remove and return the patchgen config fields among ``from_pretrained``'s keywords."""
    return {name: kwargs.pop(name) for name in FIELDS if name in kwargs}


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
