"""The key of a layer-stack call: everything a captured graph baked in, so that no batch replays a graph
captured for another.

A graph replays the captured kernels with their grids, host ints (`max_seqlen`, sequence and chunk
counts, round flags) and device addresses. Two calls may share a graph only when all of these agree:

- every tensor argument's shape, dtype, device and whether it asks for a gradient;
- every host value the kernels read (ints, flags, CPU tensors such as `cu_seqlens_cpu`, by value);
- the plan's segment layout (host arrays, by value): the GDN rounds, conv and attention indices are
  functions of it, so equal layouts give equal index contents, and so do whatever a kernel library
  derived from those indices and cached (fla keeps chunk tables it computed per `cu_seqlens` tensor);
  for a plan padded to a bucket, its bucket counts instead: every index content is then copied per step,
  and the backends must read every chunk table from the plan (the mixers refuse those that would not);
- the storage and requires-grad flag of every parameter and buffer of the layers (a graph reads the
  weights where they were at capture: a moved or resharded model must capture again);
- every layer module's training flag (dropout runs or not), op table (`ops.bind` again: other backends)
  and host flags (bool and str attributes; a PEFT tuner layer's adapter switches);
- the autocast state.

A tensor argument other than the hidden states that requires grad is refused (the stack returns no
gradient for it), and so is a value the key cannot describe (a cache object, an unknown class): never
ignored.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass

import numpy as np
import torch

from ..errors import CudaGraphsUnavailable
from ..ops import ATTRIBUTE as OP_TABLE
from ..shared_prefix.conv import ConvIndex

# fields that hold caches derived from the other fields (built lazily by the first call), not inputs
DERIVED = {(ConvIndex, "state_index")}
# the segment arrays of a plan's layout that the mixers' indices are built from
LAYOUT_FIELDS = ("start", "length", "offset", "parent", "level", "node", "ancestry")


def is_host(tensor: torch.Tensor, device: torch.device) -> bool:
    """A tensor the kernels read on the host (keyed by value, shared), not one they read on `device` (keyed by
    shape, held in a static buffer and copied): a CPU tensor of a call on another device. On the CPU every
    tensor counts as the device's, so that the CPU tests run the static buffers and copies a GPU batch runs."""
    return tensor.device.type == "cpu" and device.type != "cpu" and not tensor.requires_grad


CUDA = torch.device("cuda")
HIDDEN = "hidden_states"  # the one tensor argument whose gradient the graphed stack returns


def describe(value, where: str = "argument", device: torch.device = CUDA):
    """A hashable description of `value` for the key of a call on `device` (see the module docstring)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, torch.Tensor):
        if value.requires_grad and where != HIDDEN:
            raise CudaGraphsUnavailable(
                f"shared_prefix_cuda_graphs: the decoder layers were called with {where}, a tensor that requires "
                "grad; a graphed stack returns gradients for the hidden states and the layers' parameters only, so "
                "this tensor's gradient would be lost. Detach it, or set shared_prefix_cuda_graphs=False for this "
                "call pattern"
            )
        if is_host(value, device):
            return ("cpu", tuple(value.shape), value.dtype, tuple(value.reshape(-1).tolist()))
        return ("tensor", tuple(value.shape), value.dtype, value.device, value.requires_grad)
    if isinstance(value, np.ndarray):
        return ("array", value.shape, value.dtype.str, value.tobytes())
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(describe(v, f"{where}[{i}]", device) for i, v in enumerate(value)))
    if isinstance(value, dict):
        return ("dict", tuple((k, describe(v, f"{where}[{k!r}]", device)) for k, v in sorted(value.items(), key=_by_key)))
    if is_dataclass(value) and not isinstance(value, type):
        kind = type(value)
        return (
            kind.__module__,
            kind.__qualname__,
            tuple(
                (f.name, describe(getattr(value, f.name), f"{where}.{f.name}", device))
                for f in fields(value)
                if (kind, f.name) not in DERIVED
            ),
        )
    raise CudaGraphsUnavailable(
        f"shared_prefix_cuda_graphs: the decoder layers were called with {where} of type {type(value).__name__}, "
        "which a captured graph cannot key on (a graph would replay it as it was at capture); the graphs run only "
        "the shared-prefix training step, whose layer arguments are tensors, host values and the plan. "
        "Set shared_prefix_cuda_graphs=False for this call pattern"
    )


def _by_key(item):
    return str(item[0])


def plan_signature(plan, device: torch.device) -> tuple:
    """The plan's part of the key: its lengths, its segment layout (by value) and its mixers' indices; for a
    plan padded to a bucket (`shared_prefix/bucket.py`) its bucket counts instead of the layout and lengths,
    so every layout of the bucket replays one graph (the index tensors' contents are copied in per step)."""
    if getattr(plan, "bucket", None) is not None:
        return (
            "bucket",
            plan.bucket,
            describe(plan.gdn, "plan.gdn", device),
            describe(plan.conv, "plan.conv", device),
            describe(plan.attention, "plan.attention", device),
            describe(plan.position_ids, "plan.position_ids", device),
        )
    layout = plan.layout
    return (
        "plan",
        plan.packed_length,
        plan.compact_length,
        tuple(describe(getattr(layout, name)) for name in LAYOUT_FIELDS),
        describe(plan.gdn, "plan.gdn", device),
        describe(plan.conv, "plan.conv", device),
        describe(plan.attention, "plan.attention", device),
        describe(plan.position_ids, "plan.position_ids", device),
    )


# PEFT's tuner layers keep their adapter state in these (`disable_adapter()`, `set_adapter`, `merge_adapter()`)
ADAPTER_STATE = ("_active_adapter", "merged_adapters", "scaling")


def host_flags(module) -> tuple:
    """The host values a module's forward may branch on: its bool and str attributes (PEFT's
    `_disable_adapters` among them) and a PEFT tuner layer's active adapters, merged adapters and scales.
    A graph replays the branch it captured, so a switch must capture anew (TRL's reference log-probs run
    the policy under `disable_adapter()`: a replay of the adapter graph would score with the adapters on).

    Which attributes to read is found once per module (the walk of every `__dict__` would cost a few ms
    per call at 32 layers); their values are read every call."""
    values = module.__dict__
    names = values.get(FLAG_NAMES)
    if names is None:
        names = tuple(k for k, v in values.items() if isinstance(v, (bool, str)) and k not in NOT_READ)
        if "_disable_adapters" in values:
            names += tuple(k for k in ADAPTER_STATE if k not in names)
        object.__setattr__(module, FLAG_NAMES, names)
    return tuple([_frozen(values.get(k)) for k in names]) if names else ()


# bool attributes no forward branches on: the training flag is keyed on its own, and transformers' weight-init
# mark is set on every module (reading it would cost the 32-layer key about half a ms a call)
NOT_READ = frozenset({"training", "_is_hf_initialized"})
FLAG_NAMES = "_patchgen_host_flags"  # the attribute names `host_flags` reads, found on its first call


def _frozen(value):
    if value is None or isinstance(value, (bool, str, int, float)):
        return value
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple, set)):
        return tuple(_frozen(v) for v in value)
    return repr(value)


def module_state(modules, hooked: list | None = None) -> tuple:
    """Storage, shape, dtype and requires-grad of every parameter and buffer the graph reads, and every
    module's training flag (a dropout, LoRA's among them, runs in a graph captured in training mode only),
    bound op table (a graph replays the backends it captured) and host flags (`host_flags`).

    Walked every call (a submodule swapped in, an adapter added, a weight moved all change the key),
    through the modules' own tables rather than `Module.parameters()`, whose generators cost about
    10 ms per call at 32 layers. `hooked`, when given, receives every module that holds a module hook, an
    accelerate hook or a parameter with a tensor hook: the replay's hook refusal reads the same modules, and
    a second walk would cost about a ms a call at 32 layers (it names them only when one is found)."""
    out = []
    append = out.append  # the loop runs for every module of the stack each call: bound once
    stack = list(modules)[::-1]
    check = hooked is not None
    while stack:
        module = stack.pop()
        if module is None:
            continue
        values = module.__dict__
        names = values.get(FLAG_NAMES)
        # the op table is held, so its identity stays unique; most modules have no host flags: no call
        append((module.training, values.get(OP_TABLE), host_flags(module) if names is None or names else ()))
        for tensor in values["_parameters"].values():
            if tensor is not None:
                append((tensor.data_ptr(), tensor.shape, tensor.dtype, tensor.requires_grad))
                if check and tensor._backward_hooks:
                    hooked.append(module)
        for tensor in values["_buffers"].values():
            if tensor is not None:
                append((tensor.data_ptr(), tensor.shape, tensor.dtype, tensor.requires_grad))
        if check and (
            values.get("_forward_hooks")
            or values.get("_forward_pre_hooks")
            or values.get("_backward_hooks")
            or values.get("_backward_pre_hooks")
            or "_hf_hook" in values
        ):
            hooked.append(module)
        children = values["_modules"]
        if children:
            stack.extend(reversed(children.values()))
    return tuple(out)


def call_signature(hidden, position_embeddings, masks, kwargs: dict, layers, plan_key: str, hooked: list | None = None) -> tuple:
    """The key of one call of the layer stack (see the module docstring); `hooked` as for `module_state`."""
    rest = {k: v for k, v in kwargs.items() if k != plan_key}
    device = hidden.device
    autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))
    return (
        describe(hidden, HIDDEN, device),
        describe(position_embeddings, "position_embeddings", device),
        describe(masks, "attention masks", device),
        describe(rest, "layer keyword", device),
        plan_signature(kwargs[plan_key], device),
        module_state(layers, hooked),
        autocast,
        torch.is_grad_enabled(),
    )
