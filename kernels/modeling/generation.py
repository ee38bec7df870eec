"""When the generated forwards use a cache, and when a cached forward still runs through the op slots.

Published Qwen3.5 configs set ``use_cache=True``; read as a default, it would make every plain
training forward build a cache and take upstream's cached mixers, so the selected kernels would
never run. A cache is therefore made only when the caller asks for one, and a layer whose cache
holds no state yet (generation's prefill) runs the op slots and stores its final states.
"""

from __future__ import annotations

import torch

from .packing import Varlen


def cache_only_when_asked(use_cache, cache) -> bool:
    """``use_cache`` for the text model: True with a cache passed in or ``use_cache=True`` given, never from the config."""
    return cache is not None or bool(use_cache)


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
