"""Guards of the shared-prefix path: what it refuses, with errors that say what to do instead.

The model code calls these before building a plan (section 4 of shared_prefix.md). Backends are
checked through any object with `.name` and `.capabilities` (a kernel handle).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

from .. import capabilities as caps
from ..errors import BackendUnavailable

GDN_NEEDS = (caps.VARLEN, caps.INITIAL_STATE, caps.INITIAL_STATE_GRAD, caps.FINAL_STATE_GRAD)
ATTENTION_NEEDS = (caps.VARLEN, caps.BOTTOM_RIGHT_CAUSAL)
CONV_NEEDS = (caps.VARLEN,)


_WARNED: set[tuple[str, str]] = set()


class BitIdentityNotGuaranteed(UserWarning):
    """A backend of the shared-prefix path may round a row differently from packed: equal to bf16 rounding only."""


class PackedMetadataMissing(ValueError):
    """Shared-prefix training was asked for without the packed row's sequence boundaries."""


def _check(slot: str, handle, needs: tuple[str, ...], working: Iterable) -> None:
    missing = [c for c in needs if c not in handle.capabilities]
    if not missing:
        return
    names = []
    for w in working:  # names as given, or handles filtered to those that qualify
        if isinstance(w, str):
            names.append(w)
        elif all(c in w.capabilities for c in needs):
            names.append(w.name)
    raise BackendUnavailable(
        slot,
        handle.name,
        f"shared-prefix training needs {', '.join(needs)}; this backend lacks {', '.join(missing)}",
        names,
    )


def check_gdn_backend(handle, working: Iterable = ()) -> None:
    """A GDN backend must take cu_seqlens, an initial state, `dht`, and return `dh0` (the prefix's gradient)."""
    _check("gated_delta_rule", handle, GDN_NEEDS, working)


def check_attention_backend(handle, working: Iterable = ()) -> None:
    """An attention backend must be varlen with the causal mask aligned bottom-right (suffix queries see the prefix)."""
    _check("attention", handle, ATTENTION_NEEDS, working)


def check_conv_backend(handle, working: Iterable = ()) -> None:
    """A conv backend must respect sequence boundaries (varlen), or look-back rows leak across segments."""
    _check("causal_conv1d", handle, CONV_NEEDS, working)


def warn_row_count_dependent(slot: str, handle) -> None:
    """Once per process and backend, for a backend without `row_invariant` (fla's gated norm, tuned per bucket
    of row count: some of its configurations round rows apart): shared training still runs, equal to packed
    within bf16 rounding, bit for bit only when the two calls' tunings agree."""
    if caps.ROW_INVARIANT in handle.capabilities or (slot, handle.name) in _WARNED:
        return
    _WARNED.add((slot, handle.name))
    warnings.warn(
        f"shared-prefix training with {slot}={handle.name!r}: this backend may round a row differently in a call "
        f"of another row count (shared runs C rows where packed runs T), so the two agree to bf16 rounding, not "
        f"bit for bit; set ops_implementation {slot}='triton' (one launch shape for every row count) for "
        "bit-identical results",
        BitIdentityNotGuaranteed,
        stacklevel=4,
    )


def require_packed_metadata(cu_seq_lens_q) -> None:
    """Shared-prefix training plans over one packed row; its boundaries must be given."""
    if cu_seq_lens_q is None:
        raise PackedMetadataMissing(
            "shared_prefix_training needs packed metadata: pass cu_seq_lens_q (int32 sequence boundaries "
            "of the packed row), e.g. from a padding-free data collator"
        )


def reject_unsupported(
    *, cache=None, use_cache: bool = False, mtp: bool = False, sequence_parallel: bool = False
) -> None:
    """Features the shared-prefix path does not implement; raised before any plan is built."""
    if sequence_parallel:
        raise NotImplementedError(
            "shared_prefix_training does not support sequence parallelism; turn one of them off"
        )
    if cache is not None or use_cache:
        raise NotImplementedError("shared_prefix_training is for training: pass no cache and use_cache=False")
    if mtp:
        raise NotImplementedError("shared_prefix_training does not support multi-token prediction (MTP) yet")


def has_media(pixel_values=None, pixel_values_videos=None, mm_encoder_outputs=None) -> bool:
    """Whether a forward carries images or videos: as pixels, or as the vision tower's outputs computed beforehand
    (upstream's ``mm_encoder_outputs``, which it scatters into the row just as it does the pixels' features)."""
    encoded = any(value is not None for value in (mm_encoder_outputs or {}).values())
    return pixel_values is not None or pixel_values_videos is not None or encoded


def takes_ordinary_path(
    enabled: bool, input_ids=None, pixel_values=None, pixel_values_videos=None, mm_encoder_outputs=None
) -> bool:
    """True when the ordinary packed path runs instead: flag off, no token ids, or media present.

    With media, placeholder ids repeat across different images, so equal ids do not mean equal rows.
    """
    return not enabled or input_ids is None or has_media(pixel_values, pixel_values_videos, mm_encoder_outputs)
