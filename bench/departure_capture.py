"""Recording one forward of `bench/bf16_departure.py`: every module's output and every mixer op's call.

Forward hooks on every module of the model (decoder layers, their norms, mixers, projections, MLP,
the LM head) keep each call's inputs and outputs by module name, in the order the calls finish.
The mixer ops are not modules, so their calls are recorded by wrapping them for one forward: on
the packed path the op table's slots (`causal_conv1d`, `gated_delta_rule`, `attention`), on the
shared path the generated module's `shared_prefix_*` functions that call those slots; `rotary` on
both. Either way an op's record is named `<module>.<slot>` after the module that called it, so the
two paths' records pair up by name. Tensors are kept by reference (nothing is copied).
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field

import torch

OP_SLOTS = ("causal_conv1d", "gated_delta_rule", "attention")  # mixer ops: not modules
SHARED_FUNCTIONS = {  # the generated module's shared-prefix callers of those slots
    "causal_conv1d": "shared_prefix_causal_conv1d",
    "gated_delta_rule": "shared_prefix_gated_delta_rule",
    "attention": "shared_prefix_attention",
}


@dataclass
class Record:
    name: str  # module name, or `<module>.<slot>` for an op
    module: torch.nn.Module | None  # None for an op
    args: tuple
    kwargs: dict
    outputs: tuple[torch.Tensor, ...]  # the tensors of the output, in order


def tensors_of(output) -> tuple[torch.Tensor, ...]:
    """The tensors of a module's or op's output (a tensor, a tuple of them, or a ModelOutput)."""
    if isinstance(output, torch.Tensor):
        return (output.detach(),)
    if isinstance(output, dict):  # ModelOutput
        return tuple(v.detach() for v in output.values() if isinstance(v, torch.Tensor))
    if isinstance(output, (tuple, list)):
        return tuple(t.detach() for t in output if isinstance(t, torch.Tensor))
    return ()


@dataclass
class Capture:
    """Records of one forward, in the order the calls finished (children before their parents)."""

    records: dict[str, Record] = field(default_factory=dict)
    stack: list[str] = field(default_factory=list)
    active: bool = True

    def add(self, name, module, args, kwargs, output):
        if not self.active:
            return
        key, n = name, 2
        while key in self.records:  # a module called twice in one forward
            key, n = f"{name}#{n}", n + 1
        self.records[key] = Record(key, module, tuple(args), dict(kwargs), tensors_of(output))

    def op_name(self, slot: str) -> str:
        return f"{self.stack[-1] if self.stack else '<top>'}.<{slot}>"

    @contextlib.contextmanager
    def paused(self):
        """Calls inside the block (replays) are not recorded."""
        before, self.active = self.active, False
        try:
            yield
        finally:
            self.active = before


@contextlib.contextmanager
def recording(model, capture: Capture, *, shared: bool, module_name: str):
    """Hooks on every module of `model` and wrappers on the mixer ops for the block.

    `shared`: wrap the generated module's `shared_prefix_*` functions (the shared path's calls)
    instead of the op table's slots (the packed path's calls); the slots themselves stay untouched
    then, since the shared path reads attributes of them (a GDN backend's round kernels).
    """
    from patchgen.kernels import ops

    table = ops.of(model)
    generated = importlib.import_module(module_name)
    handles, restore = [], []

    def pre(name):
        def hook(module, args):
            capture.stack.append(name)

        return hook

    def post(name):
        def hook(module, args, kwargs, output):
            if capture.stack and capture.stack[-1] == name:
                capture.stack.pop()
            capture.add(name, module, args, kwargs, output)

        return hook

    def wrapped(slot, fn):
        def call(*args, **kwargs):
            name = capture.op_name(slot)
            # a rotary kernel may rotate q and k in place (liger's does): keep the inputs it was given
            kept = (
                tuple(a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args)
                if slot == "rotary"
                else args
            )
            out = fn(*args, **kwargs)
            capture.add(name, None, kept, kwargs, out)
            return out

        return call

    for name, module in model.named_modules():
        if not name or isinstance(module, torch.nn.ModuleList):
            continue
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post(name), with_kwargs=True))
    slots = ("rotary",) if shared else ("rotary", *OP_SLOTS)
    for slot in slots:
        original = getattr(table, slot)
        object.__setattr__(
            table, slot, wrapped(slot, original)
        )  # an OpTable refuses setattr: for this block only
        restore.append(lambda s=slot, f=original: object.__setattr__(table, s, f))
    if shared:
        for slot, fn_name in SHARED_FUNCTIONS.items():
            original = getattr(generated, fn_name)
            setattr(generated, fn_name, wrapped(slot, original))
            restore.append(lambda n=fn_name, f=original: setattr(generated, n, f))
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()
        for undo in restore:
            undo()
        capture.stack.clear()
