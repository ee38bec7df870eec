"""Counting what a training step asks of the host, on the CPU, in units that carry over to the GPU.

Every op slot of the model's table becomes one opaque call (`OpaqueSlot`: one autograd node whose
forward and backward run inside a `slot::<name>` profiler scope), as a GPU backend's autograd
Function is; the GDN slot also offers the round stages (`RoundKernels` of the reference), so the
shared path takes the same one-node-per-layer route (`gdn_rounds.py`) as on fla or our Triton
backend. What a step then runs outside every slot scope is the modelling code's own glue (gathers,
scatters, casts, residuals, projections) and is the same list of aten ops on either device: each
op that launches a kernel on CUDA counts as one launch (`launches`), views and allocations as none.
What runs inside slot scopes is backend work, reported as slot calls (on the GPU each is a fixed
number of kernels of its backend).

Possible host syncs on a device are found by a `TorchFunctionMode` that records every call which
reads a tensor's value on the host (`.item()`, `.tolist()`, `.cpu()`, `bool(t)`, ...) with its call
site; on the CPU none of them waits, so the list says where a GPU run would wait, not how long.
"""

from __future__ import annotations

import collections
import time
import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

SLOT_PREFIX = "slot::"
BACKWARD_PREFIX = "autograd::engine::evaluate_function"

# aten ops that launch no kernel on CUDA (metadata, views, allocation without fill)
NO_KERNEL = frozenset(
    "aten::" + name
    for name in [
        "empty",
        "empty_strided",
        "empty_like",
        "new_empty",
        "new_empty_strided",
        "view",
        "reshape",
        "_reshape_alias",
        "_unsafe_view",
        "as_strided",
        "transpose",
        "t",
        "permute",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "detach",
        "alias",
        "split",
        "split_with_sizes",
        "chunk",
        "narrow",
        "unbind",
        "lift_fresh",
        "resize_",
        "set_",
        "result_type",
        "size",
        "stride",
        "is_nonzero",
        "view_as",
        "unflatten",
        "flatten",
        "contiguous",
        "numpy_T",
        "_local_scalar_dense",
        "item",
        "is_same_size",
        "movedim",
        "unfold",
        "diagonal",
        "real",
        "imag",
        "_to_copy",
        "to",
        "_has_compatible_shallow_copy_type",
        "type_as",
        "clone",
        "resolve_conj",
        "resolve_neg",
    ]
)
# ops that are one kernel on CUDA whatever their CPU implementation calls underneath (CPU index_add_
# loops over rows with select/add_, CPU cat and copies may split work)
ONE_KERNEL = frozenset(
    "aten::" + name
    for name in [
        "index_select",
        "index_add_",
        "index_add",
        "index_copy_",
        "index_copy",
        "index_fill_",
        "index_fill",
        "scatter_reduce",
        "scatter_reduce_",
        "scatter_add_",
        "scatter_add",
        "gather",
        "masked_fill_",
        "masked_fill",
        "cat",
        "copy_",
        "fill_",
        "zero_",
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "where",
        "sum",
        "mean",
        "add",
        "add_",
        "mul",
        "mul_",
        "sub",
        "sub_",
        "div",
        "div_",
        "neg",
        "exp",
        "sigmoid",
        "softplus",
        "sigmoid_backward",
        "softplus_backward",
        "rsqrt",
        "pow",
        "embedding_dense_backward",
        "index_put_",
        "_index_put_impl_",
    ]
)
# a contiguous call on a contiguous tensor, clone and _to_copy run copy_ underneath: counted there
HOST_READS = frozenset(
    {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"}
)


class OpaqueSlot(torch.autograd.Function):
    """One backend call as one autograd node: forward under its scope, backward recomputes under its scope."""

    @staticmethod
    def forward(ctx, name, fn, args_spec, kwargs, *tensors):
        args = _fill(args_spec, tensors)
        ctx.name, ctx.fn, ctx.spec, ctx.kwargs = name, fn, args_spec, kwargs
        ctx.save_for_backward(*tensors)
        with torch.profiler.record_function(SLOT_PREFIX + name), Timer.slot():
            out = fn(*args, **kwargs)
        flat, ctx.out_spec = _flatten(out)
        ctx.mark_non_differentiable(*(t for t in flat if not t.is_floating_point()))
        return tuple(flat)

    @staticmethod
    def backward(ctx, *grads):
        tensors = ctx.saved_tensors
        with torch.profiler.record_function(SLOT_PREFIX + ctx.name), Timer.slot(), torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.is_floating_point() and t.requires_grad) for t in tensors]
            out, _ = _flatten(ctx.fn(*_fill(ctx.spec, leaves), **ctx.kwargs))
            pairs = [(o, g) for o, g in zip(out, grads) if g is not None and o.requires_grad]
            wanted = [x for x in leaves if x.requires_grad]
            found = iter(
                torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                if pairs and wanted
                else []
            )
        return (None, None, None, None, *(next(found) if x.requires_grad else None for x in leaves))


def _fill(spec, tensors):
    it = iter(tensors)
    return [next(it) if s is _TENSOR else s for s in spec]


_TENSOR = object()


def _flatten(out):
    if torch.is_tensor(out):
        return [out], ("one",)
    items = list(out)
    present = [i for i, x in enumerate(items) if x is not None]
    return [items[i] for i in present], ("tuple", len(items), present)


def _unflatten(flat, spec):
    if spec[0] == "one":
        return flat[0]
    items = [None] * spec[1]
    for i, x in zip(spec[2], flat):
        items[i] = x
    return tuple(items)


class _Slot:
    """A slot function made opaque; keyword tensors are passed through as constants (boundaries, indices)."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn
        rounds = _rounds_of(fn)
        if rounds is not None:
            self.rounds = _ScopedRounds(rounds)
        look_back = _rounds_of(fn, "look_back")
        if look_back is not None:  # the conv's state kernels (shared_prefix/conv.py)
            self.look_back = _ScopedRounds(look_back, "causal_conv1d.")

    def __call__(self, *args, **kwargs):
        spec = [_TENSOR if torch.is_tensor(a) else a for a in args]
        tensors = [a for a in args if torch.is_tensor(a)]
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
            with torch.profiler.record_function(SLOT_PREFIX + self.name), Timer.slot():
                return self.fn(*args, **kwargs)
        probe = {}

        def run(*a, **k):
            out = self.fn(*a, **k)
            probe["spec"] = _flatten(out)[1]
            return out

        flat = OpaqueSlot.apply(self.name, run, spec, kwargs, *tensors)
        return _unflatten(list(flat), probe["spec"])


def _rounds_of(fn, name="rounds"):
    by_dtype = getattr(fn, "by_dtype", None)
    if by_dtype is not None:
        fn = next(iter(by_dtype.values()))
    return getattr(fn, name, None)


class _ScopedRounds:
    """A backend's stages (GDN rounds, conv state kernels), each call inside the slot scope (they run
    inside the shared path's own autograd node)."""

    def __init__(self, rounds, prefix="gated_delta_rule."):
        self.inner, self.prefix = rounds, prefix

    def __getattr__(self, stage):
        inner = getattr(self.inner, stage)
        if not callable(inner):  # data, such as the conv kernels' state layout
            return inner

        def scoped(*args, **kwargs):
            with torch.profiler.record_function(SLOT_PREFIX + self.prefix + stage), Timer.slot():
                return inner(*args, **kwargs)

        return scoped


class ScopedTable:
    """An op table whose every slot is opaque and scoped; everything else is the wrapped table's."""

    def __init__(self, table, slots):
        self._table = table
        for slot in slots:
            setattr(self, slot, _Slot(slot, getattr(table, slot)))

    def __getattr__(self, name):
        return getattr(self._table, name)


def scope_slots(model, slots, gdn_rounds=None):
    """Replace the op table bound to `model` (and its submodules) by a `ScopedTable`.

    `gdn_rounds`: round stages to give the GDN slot when its backend has none (the CPU reference),
    so that the shared path takes the one-node-per-layer route of the GPU backends.
    """
    from patchgen.kernels import ops

    table = ops.of(model)
    scoped = ScopedTable(table, slots)
    if gdn_rounds is not None and not hasattr(scoped.gated_delta_rule, "rounds"):
        scoped.gated_delta_rule.rounds = _ScopedRounds(gdn_rounds)
    for module in model.modules():
        object.__setattr__(module, ops.ATTRIBUTE, scoped)
    return scoped


class Timer:
    """CPU seconds of this thread inside slot calls (outermost only): glue time = step time - slot time.

    Thread time, not wall time: other processes on a shared host do not count (the CPU runs backward
    on the calling thread)."""

    depth = 0
    spent = 0.0

    @classmethod
    def slot(cls):
        return _SlotTimer(cls)

    @classmethod
    def reset(cls):
        cls.spent = 0.0


class _SlotTimer:
    def __init__(self, owner):
        self.owner = owner

    def __enter__(self):
        self.owner.depth += 1
        if self.owner.depth == 1:
            self.t0 = time.thread_time()

    def __exit__(self, *exc):
        if self.owner.depth == 1:
            self.owner.spent += time.thread_time() - self.t0
        self.owner.depth -= 1


@dataclass
class Counts:
    """Launch-equivalent counts of one profiled step, split forward / backward and glue / slot."""

    launches: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    slot_calls: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    by_op: dict = field(
        default_factory=lambda: {"forward": collections.Counter(), "backward": collections.Counter()}
    )
    by_slot: dict = field(
        default_factory=lambda: {"forward": collections.Counter(), "backward": collections.Counter()}
    )

    def total(self, what="launches"):
        return sum(getattr(self, what).values())


def count_events(events) -> Counts:
    """Classify a profile's function events (a tree): glue launches by op, slot calls by slot."""
    counts = Counts()
    roots = [e for e in events if e.cpu_parent is None]
    for root in roots:
        _walk(root, "forward", counts)
    return counts


def _walk(event, phase, counts):
    name = event.name
    if name.startswith(BACKWARD_PREFIX):
        phase = "backward"
    if name.startswith(SLOT_PREFIX):
        counts.slot_calls[phase] += 1
        counts.by_slot[phase][name[len(SLOT_PREFIX) :]] += 1
        return
    if name.startswith("aten::"):
        n = _launches(event)
        if n:
            counts.launches[phase] += n
            counts.by_op[phase][name] += n
        return
    for child in event.cpu_children:
        _walk(child, phase, counts)


def _launches(event) -> int:
    """Kernels this aten op would launch on CUDA: one for single-kernel ops, else its children's, views none."""
    name = event.name
    if name in ONE_KERNEL:
        return 1
    children = [c for c in event.cpu_children if c.name.startswith("aten::")]
    if children:
        return sum(_launches(c) for c in children)
    return 0 if name in NO_KERNEL else 1


class HostReads(TorchFunctionMode):
    """Records every call that reads a tensor's value on the host, with the first call site outside torch."""

    def __init__(self):
        super().__init__()
        self.sites = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        read = name in HOST_READS and args and torch.is_tensor(args[0]) and not getattr(args[0], _HOST, False)
        if read and Timer.depth == 0:  # a backend's own reads are the backend's business
            self.sites[(name, _caller())] += 1
        out = func(*args, **(kwargs or {}))
        if name == "cpu" and out is args[0]:
            out = out.view_as(out)  # on the CPU `.cpu()` is the tensor itself: mark a stand-in for the copy
        # a host copy, and whatever is computed from one, can be read later at no cost
        if torch.is_tensor(out) and (
            name == "cpu" or any(getattr(a, _HOST, False) for a in args if torch.is_tensor(a))
        ):
            setattr(out, _HOST, True)
        return out


_HOST = "_host_copy"


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        if "/torch/" in path or path == __file__:
            continue
        return f"{path.split('/wt/')[-1].split('site-packages/')[-1]}:{frame.lineno} {frame.name}"
    return "?"
