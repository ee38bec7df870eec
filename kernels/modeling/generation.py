"""When the generated forwards use a cache, and when a cached forward still runs through the op slots.

Published Qwen3.5 configs set ``use_cache=True``. Read as a default in a training step, it would make
every plain training forward build a cache (memory for nothing) and take upstream's cached mixers.
Outside a training step the default holds as upstream's does: a decode loop written for upstream,
``out = model(ids); model(next_ids, past_key_values=out.past_key_values)``, needs the cache that
``model(ids)`` returns, and without it would silently score ``next_ids`` as a new sequence. A layer
whose cache holds no state yet (a prefill) runs the op slots and stores its final states.
"""

from __future__ import annotations

import torch

from .packing import Varlen


def use_cache_for(use_cache, cache, config, module) -> bool:
    """``use_cache`` for the text model: a cache passed in or ``use_cache`` given decides; otherwise
    ``config.use_cache`` (the text config's), as upstream, except in a training step (``module`` in
    training mode with gradients on), which builds no cache unless asked."""
    if cache is not None:
        return True
    if use_cache is not None:
        return bool(use_cache)
    if module.training and torch.is_grad_enabled():
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text, "use_cache", False))


def settle_use_cache(kwargs: dict, cache, config, module) -> bool | None:
    """Sets ``kwargs["use_cache"]`` to what the text model reads (``use_cache_for``) and returns the caller's own
    ``use_cache`` (None when not given), for the shared-prefix plan: the config's default is no request to keep
    a packed row's cache, so a row scored in eval mode or under ``no_grad`` is still shared."""
    asked_for_cache = kwargs.get("use_cache")
    kwargs["use_cache"] = use_cache_for(asked_for_cache, cache, config, module)
    return asked_for_cache


def starts_from_zero_state(cache, layer_idx: int) -> bool:
    """True when this linear-attention layer of ``cache`` holds no state yet (a prefill), so the op slots can run it.

    Speculative decoding's recording caches keep the full conv history for a rollback: those take
    upstream's cached path.
    """
    try:
        if cache.get_conv_state(layer_idx) is not None or cache.get_recurrent_state(layer_idx) is not None:
            return False
    except (AttributeError, IndexError, ValueError):
        return False  # not a linear-attention cache layer we know how to fill
    recording = getattr(cache, "is_recording_past", None)
    return not (recording is not None and recording(layer_idx))


def prefill_rows(cache, layer_idx: int, attention_mask, batch: int, length: int, device) -> Varlen | None:
    """Varlen metadata treating each batch row as one sequence, for an attention prefill through the op slot.

    Only when this layer's cache is still empty and no mask came down (no padding: the causal mask
    was skipped); any other cached forward takes upstream's attention with the cache.
    """
    if cache is None or attention_mask is not None or length < 1:
        return None
    try:
        if cache.get_seq_length(layer_idx) != 0:
            return None
    except (AttributeError, IndexError, TypeError):
        return None
    cu = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=device)
    return Varlen(cu, cu, length, length)


def slot_rows(cache, layer_idx: int, attention_mask, batch: int, length: int, device, dropout: float = 0.0) -> Varlen | None:
    """Varlen metadata for attention through the op slot, each batch row one sequence, or None.

    Generation's prefill (``prefill_rows``), and every forward without a cache and without a mask (no
    padding: the causal mask was skipped), a plain training forward among them: the slot's backend runs
    there as it does on packed rows. ``dropout`` (the attention dropout of a module in training mode) keeps
    transformers' attention, which applies it; the slot has none. A cached prefill too: a decode loop run in
    training mode then drops in every step, as upstream's does.
    """
    if dropout:
        return None
    if cache is not None:
        return prefill_rows(cache, layer_idx, attention_mask, batch, length, device)
    if attention_mask is not None or length < 1:
        return None
    cu = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=device)
    return Varlen(cu, cu, length, length)


def routed_tokens_mask(attention_mask, router_logits):
    """The columns of a 2-D ``attention_mask`` that this forward's router logits cover: its last ones.

    A cached forward (a decode step) routes only its new tokens while the mask covers the cached ones
    too; the MoE load-balancing loss weighs each routed token by its own mask entry (upstream passes the
    whole mask and fails on the shapes).
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2 or not router_logits:
        return attention_mask
    routed = router_logits[0].shape[0] // attention_mask.shape[0]
    return attention_mask[:, -routed:] if 0 < routed < attention_mask.shape[1] else attention_mask
