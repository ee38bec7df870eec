"""First-use self-verification of shared-prefix training (``text_config.shared_prefix_verify``, off by default).

On the first packed forward with the flag on, and whenever a packed row is longer than the longest
one verified so far, the step runs twice: shared and packed. Loss and per-token log-probs must agree
within a bound set by the dtype; a match is logged and the shared result returned, a mismatch is
warned about and the packed result returned, and the model stays on the packed path from then on.
The check costs one extra forward (no backward) per new largest shape, so a run pays it a few times.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass

import torch

from ..config import SHARED_PREFIX_VERIFY, bool_field
from ..shared_prefix import has_media
from .boundaries import resolve_packed
from .shared_prefix import embeddings_noised, enabled

logger = logging.getLogger(__name__)

FIELD = SHARED_PREFIX_VERIFY
ATTRIBUTE = "_patchgen_shared_prefix_verify"

# Largest |shared - packed| accepted, per unit of the compared values' scale. float64 runs the same
# math in another order (1e-12 in practice); the low-precision bounds cover kernels that accumulate
# in a different order over the compact row, far below the error a wrong plan gives (order 1).
BOUNDS = {torch.float64: 1e-8, torch.float32: 1e-3, torch.bfloat16: 1.25e-1, torch.float16: 3e-2}


class SharedPrefixMismatch(UserWarning):
    """The shared-prefix step did not match the packed step; training continues on the packed path."""


@dataclass
class VerifyState:
    largest_verified: int = 0  # tokens of the longest packed row verified
    disabled: bool = False  # a mismatch was seen: plans are no longer built
    inside: bool = False  # a verification is running (its inner forwards run plainly)
    packed_only: bool = False  # the reference forward of a verification
    checks: int = 0


def state(model) -> VerifyState:
    current = getattr(model, ATTRIBUTE, None)
    if current is None:
        current = VerifyState()
        object.__setattr__(model, ATTRIBUTE, current)
    return current


def sharing_allowed(model) -> bool:
    """False after a mismatch, during a verification's packed reference forward, and while NEFTune noises the
    input embeddings (`shared_prefix.embeddings_noised`)."""
    current = getattr(model, ATTRIBUTE, None)
    if current is not None and (current.disabled or current.packed_only):
        return False
    return not embeddings_noised(model)


def due(
    model, input_ids, position_ids, cache, use_cache, kwargs, pixel_values=None, pixel_values_videos=None,
    mm_encoder_outputs=None, *, attention_mask=None,
) -> bool:
    """True when this forward must be verified: a packed training row longer than any verified one.

    A batch with images or videos runs the ordinary path (nothing is shared), so it is never verified.
    """
    config = model.config
    if not (enabled(config) and bool_field(config, FIELD)):
        return False
    if has_media(pixel_values, pixel_values_videos, mm_encoder_outputs):
        return False
    current = state(model)
    if current.inside or current.disabled or input_ids is None or cache is not None or use_cache:
        return False
    if input_ids.shape[-1] <= current.largest_verified:
        return False
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("seq_idx") is not None:
        return True
    return position_ids is not None and _packed_by_positions(kwargs, position_ids, input_ids, attention_mask)


def _packed_by_positions(kwargs, position_ids, input_ids, attention_mask) -> bool:
    """Whether ``position_ids`` alone make the row a packed one, read as the forward reads them (`resolve_packed`).

    Positions come with rows that are not packed too: every step of ``generate(use_cache=False)``, a padded batch
    scored with its positions. Verifying those compared the packed path with itself (at twice the cost) and marked
    their length verified, so a shorter packed row that did share went unchecked.
    """
    resolved = resolve_packed(kwargs, position_ids, input_ids, attention_mask=attention_mask)
    return resolved.get("cu_seq_lens_q") is not None


def bound(dtype: torch.dtype, scale: float) -> float:
    return BOUNDS.get(dtype, BOUNDS[torch.float32]) * max(1.0, scale)


def compute_dtype(model, device: torch.device) -> torch.dtype:
    """The dtype the model computes in, which sets the bound: autocast's where it is on, else the least precise of its
    weights'. Not the log-probs': the head upcasts them to float32 whatever the model runs in."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    weights = {p.dtype for p in model.parameters() if p.dtype in BOUNDS}
    return max(weights, key=BOUNDS.__getitem__, default=torch.float32)


def run(model, call: dict):
    """Run ``call`` shared and packed, compare, and return the shared output or, on a mismatch, the packed one."""
    current = state(model)
    call = {**call, "return_log_probs": True}
    with _flag(current, "inside"):
        shared = model(**call)
        with _flag(current, "packed_only"), torch.no_grad():
            packed = model(**call)
    tokens = call["input_ids"].shape[-1]
    dtype = compute_dtype(model, call["input_ids"].device)
    diffs = {"log_probs": (shared.log_probs.detach() - packed.log_probs).abs().max().item()}
    scale = packed.log_probs.abs().max().item()
    if shared.loss is not None and packed.loss is not None:
        diffs["loss"] = (shared.loss.detach() - packed.loss).abs().item()
        scale = max(scale, packed.loss.abs().item())
    limit = bound(dtype, scale)
    current.checks += 1
    report = ", ".join(f"max |{name} diff| {value:.3e}" for name, value in diffs.items())
    if all(value <= limit for value in diffs.values()):
        current.largest_verified = max(current.largest_verified, tokens)
        logger.info("shared_prefix_verify: %d-token packed row matches the packed path (%s, bound %.1e, %s)",
                    tokens, report, limit, dtype)
        return shared
    current.disabled = True
    warnings.warn(
        f"shared_prefix_verify: the shared-prefix step on a {tokens}-token packed row does not match the packed "
        f"path ({report}, bound {limit:.1e} for {dtype}); this model continues on the packed path. Please report "
        "it with the batch's lengths and the ops table (ops.of(model).describe())",
        SharedPrefixMismatch,
        stacklevel=3,
    )
    with _flag(current, "inside"), _flag(current, "packed_only"):
        return model(**call)  # recomputed with gradients: the step trains on the packed result


@contextlib.contextmanager
def _flag(current: VerifyState, name: str):
    previous = getattr(current, name)
    setattr(current, name, True)
    try:
        yield
    finally:
        setattr(current, name, previous)
