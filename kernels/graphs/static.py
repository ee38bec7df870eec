"""The static arguments a captured layer stack reads, and the copies that load a batch into them.

`StaticCall.of` clones every device tensor of a call (hidden states, rotary cos/sin, masks, keyword
tensors, the plan's index tensors) into buffers the cache entry owns; the graph is captured on those.
`load` copies a later batch's tensors into them, pairing the two argument trees field by field (the
key guarantees the trees have the same shape). Host values (ints, flags, CPU tensors, numpy arrays)
are part of the key and are shared, not copied.

A plan's derived caches (the conv's state-gather indices, built on first use) are cleared in the clone
(its own are built from its own tensors during the warm-up) and, on load, rebuilt from the batch's plan
and copied too, so no index a kernel reads is left from another batch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields, is_dataclass

import torch

from ..shared_prefix.conv import ConvIndex
from .signature import DERIVED, is_host


def clone_static(value, device: torch.device):
    """`value` with every tensor of `device` cloned into a fresh buffer (host values shared); derived caches emptied."""
    if isinstance(value, torch.Tensor):
        return value if is_host(value, device) else value.detach().clone()
    if isinstance(value, tuple):
        return tuple(clone_static(v, device) for v in value)
    if isinstance(value, list):
        return [clone_static(v, device) for v in value]
    if isinstance(value, dict):
        return {k: clone_static(v, device) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        if not _holds_device_tensor(value, device):
            return value
        out = copy.copy(value)
        for f in fields(value):
            if (type(value), f.name) in DERIVED:
                object.__setattr__(out, f.name, type(getattr(value, f.name))())
            else:
                object.__setattr__(out, f.name, clone_static(getattr(value, f.name), device))
        return out
    return value


def _holds_device_tensor(value, device: torch.device, seen=None) -> bool:
    seen = set() if seen is None else seen
    if id(value) in seen:
        return False
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        return not is_host(value, device)
    if isinstance(value, (tuple, list)):
        return any(_holds_device_tensor(v, device, seen) for v in value)
    if isinstance(value, dict):
        return any(_holds_device_tensor(v, device, seen) for v in value.values())
    if is_dataclass(value) and not isinstance(value, type):
        return any(_holds_device_tensor(getattr(value, f.name), device, seen) for f in fields(value))
    return False


def device_paths(value, device: torch.device, path: tuple = ()) -> list[tuple]:
    """Where every tensor of `device` in an argument tree sits (steps of attribute names and item keys);
    `ConvIndex` objects are listed too (step None), for their derived caches."""
    out = []
    if isinstance(value, torch.Tensor):
        if not is_host(value, device):
            out.append(path)
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            out += device_paths(v, device, (*path, ("item", i)))
    elif isinstance(value, dict):
        for key, v in value.items():
            out += device_paths(v, device, (*path, ("item", key)))
    elif is_dataclass(value) and not isinstance(value, type) and _holds_device_tensor(value, device):
        for f in fields(value):
            if (type(value), f.name) not in DERIVED:
                out += device_paths(getattr(value, f.name), device, (*path, ("attr", f.name)))
        if isinstance(value, ConvIndex):
            out.append((*path, None))
    return out


def _at(tree, path):
    for step in path:
        if step is None:
            return tree
        kind, key = step
        tree = getattr(tree, key) if kind == "attr" else tree[key]
    return tree


def device_pairs(static, batch, paths: list[tuple]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(static buffer, batch tensor) for every device tensor at `paths` of two trees of the same shape;
    a `ConvIndex`'s derived state-gather indices are rebuilt from the batch's and paired too."""
    out = []
    for path in paths:
        s, b = _at(static, path), _at(batch, path)
        if path and path[-1] is None:
            for key, tensors in s.state_index.items():
                out += zip(tensors, b.state_gather(*key), strict=True)
        elif s is not b:
            out.append((s, b))
    return out


@dataclass
class StaticCall:
    """One call's arguments in buffers the cache entry owns: `layers_fn(hidden, position_embeddings, masks, **kwargs)`."""

    hidden: torch.Tensor
    position_embeddings: tuple
    masks: dict
    kwargs: dict
    paths: list = field(default_factory=list)  # where the device tensors of (position_embeddings, masks, kwargs) sit

    @classmethod
    def of(cls, hidden, position_embeddings, masks, kwargs) -> StaticCall:
        device = hidden.device
        static_hidden = hidden.detach().clone().requires_grad_(hidden.requires_grad)
        call = cls(
            static_hidden, clone_static(position_embeddings, device), clone_static(masks, device),
            clone_static(kwargs, device),
        )
        call.paths = device_paths((call.position_embeddings, call.masks, call.kwargs), device)
        return call

    def load(self, position_embeddings, masks, kwargs) -> None:
        """Copy a batch's arguments (all but the hidden states, which the autograd node copies) into the buffers."""
        pairs = device_pairs((self.position_embeddings, self.masks, self.kwargs), (position_embeddings, masks, kwargs), self.paths)
        if pairs:
            with torch.no_grad():
                # one multi-tensor copy, not one dispatch per buffer: the host's time before the replay is the
                # device's idle time (a plan has about thirty index tensors)
                torch._foreach_copy_([dst for dst, _ in pairs], [src for _, src in pairs])
