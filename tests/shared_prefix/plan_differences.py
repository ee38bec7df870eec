"""Comparing two shared-prefix plans field by field (the padding reference and plan reuse tests)."""

import dataclasses

import numpy as np
import torch
from patchgen.kernels.graphs.signature import DERIVED


def differences(a, b, where="plan") -> list[str]:
    """Where two plans differ: every dataclass field, tensor (dtype, shape, values), array, tuple and int; not the caches
    derived from the other fields (`signature.DERIVED`: the conv's state index, which plans build with themselves)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        return [] if same else [where]
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        same = np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b)
        return [] if same else [where]
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        if type(a) is not type(b):
            return [where]
        return [d for f in dataclasses.fields(a) if (type(a), f.name) not in DERIVED
                for d in differences(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [where]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [where]
        return [d for k in a for d in differences(a[k], b[k], f"{where}[{k!r}]")]
    return [] if (type(a) is type(b) and a == b) else [where]
