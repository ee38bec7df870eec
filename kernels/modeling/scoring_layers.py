"""A shared-prefix scoring forward's decoder layers replayed from one CUDA graph per kind of layer.

An eager scoring forward (old-policy or reference log-probs under ``no_grad`` / ``inference_mode``) is host-bound
at RL's sizes: at 32 layers, n=4 P=2048 on the H200 the host spends about 79 ms issuing what the GPU runs in about
52, even with the plan ops' call graphs (`shared_prefix/call_graphs.py`); what is left is every layer's linears,
norms, activations and gates, launched one by one. Yet every layer of a kind (GDN or full attention) runs the
same code on inputs of the same shapes and on the same plan: only its weights and its input differ. So per kind,
the first layer of the process's first forward runs eagerly (compiles, autotuning, the plan's lazily built tables; a
later forward's first layer is captured, watched by `shared_prefix/capture_guard.py`), the second is
captured with its small weights (norms, conv taps) and inputs swapped for static copies (`torch.func.functional_call`)
and its bias-free linears of `MIN_LIVE_BYTES` or more left out of the graphs (`shared_prefix/graph_tape.py`: a replay
runs each as one `mm` on the replayed layer's own weight, so the big weights are never copied), and every later one
copies its small weights and inputs into those statics and replays: a few graph launches and one `mm` per linear
instead of its launches. A capture costs the host about two eager layers: where too few layers of a kind are left
for the replays to repay it, the second runs eagerly too (`call_graphs.CallGraphs._pays`).

What it costs: memory holds the statics and one layer's linear outputs per kind and the graphs' working memory
until a forward on another plan replaces them, a training forward starts (it releases them, so its backward has that
memory), or `release_call_graphs()` drops them. A layer with more than `MAX_LAYER_BYTES` of copied weights (an MoE
layer's experts, which are not linears) runs as it is: its copy would cost the GPU more than the launches it saves.

A replay runs the captured kernels with the captured launch parameters on copies of the same values, so its
output is the eager layer's bit for bit. Layers run as they are where a graph could be wrong or is not wanted:
outside a shared-prefix plan (generation, packed rows), when autograd needs the layer's node, off CUDA, inside
another capture (the layer-stack graphs of ``shared_prefix_cuda_graphs``) or its warm-ups, with hooks on the
layer or per-layer outputs being recorded (a hook's Python does not run in a replay), and with arguments a key
cannot describe. A graph replays the host branches it was captured in, so its key holds, besides the plan and the
shapes, what a layer branches on: every module's training flag, op table's backends and host flags (a PEFT adapter
switched off for reference log-probs on the plan the policy's kept) and the autocast state; and a layer that reads
tensors beside its parameters and buffers (a quantised weight's scales) runs as it is.
``PATCHGEN_LAYER_GRAPHS=1`` turns them on, ``=0`` off.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from transformers.utils import output_capturing

from ..graphs.signature import host_flags
from ..ops import ATTRIBUTE as OP_TABLE
from ..shared_prefix import call_graphs
from .layer_graphs import HOOK_TABLES, _global_hooks
from .layer_graphs import _recording as _recording_hook
from .shared_prefix import KWARG

# above this, copying a layer's weights (all but its linears') costs the GPU more than its launches cost the host (a
# Qwen3.5-MoE layer's experts are several GB)
MAX_LAYER_BYTES = 1 << 30
# a linear's weight below this stays in the graph, copied with the small weights: its copy costs the GPU less than
# its segment of the tape costs the host (a capture's graph to end and begin, a replay's `mm` launch). A GDN layer's
# in_proj_b and in_proj_a (hidden x heads, 160 KB at 4B widths) stay in; every other linear of Qwen3.5 is tens of MB
MIN_LIVE_BYTES = 1 << 20
SCALARS = (int, float, bool, str, type(None))


def layer_call(layer_kwargs: dict) -> Callable:
    """How the decoder-layer loop calls each layer in this forward: ``call(layer, hidden, **kwargs)``."""
    if torch.is_grad_enabled() and (call_graphs.LAYER_GRAPHS.entries or call_graphs.CALL_GRAPHS.entries):
        # a training step, on a plan or on a micro-batch that shares nothing: the last scoring forward's graphs
        # (weight copies, working memory) would hold their memory through its backward, and the next scoring forward
        # brings a plan of its own anyway
        call_graphs.release_call_graphs()
    if layer_kwargs.get(KWARG) is None:
        return _as_it_is
    if not call_graphs.LAYER_GRAPHS.enabled or _recording():
        return _as_it_is
    return _replayed


def _recording() -> bool:
    """Whether transformers is collecting per-layer outputs (hidden states, attentions, router logits) through its
    module hooks, which run when a layer is called, not when a graph of it replays."""
    collector = getattr(output_capturing, "_active_collector", None)
    return bool(collector is not None and collector.get())


def _as_it_is(layer, hidden, **kwargs):
    return layer(hidden, **kwargs)


def _replayed(layer, hidden: torch.Tensor, **kwargs):
    graphs = call_graphs.LAYER_GRAPHS
    if (
        graphs._held
        or not graphs.enabled
        or not graphs.on_device(hidden)
        or (hidden.is_cuda and torch.cuda.is_current_stream_capturing())
        # a training forward, told early: the checks below cost host time that an eager training step lacks
        or (torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in layer.parameters())))
    ):
        return layer(hidden, **kwargs)
    split = _split_kwargs(kwargs)
    walked = None if split is None else _walk(layer)
    if walked is None:
        return layer(hidden, **kwargs)
    settings, tensors, rebuild = split
    names, weights, modules, linear = walked
    # any other one that wants a gradient (a tensor argument): the layer's node is needed
    if torch.is_grad_enabled() and any(x.requires_grad for x in tensors):
        return layer(hidden, **kwargs)
    # the linears' weights stay where they are, read by the replay's eager linears (`graph_tape.py`); the rest is
    # copied into the graph's statics
    copied = [w for w, is_linear in zip(weights, linear) if not is_linear]
    live = [w for w, is_linear in zip(weights, linear) if is_linear]
    order = [name for name, is_linear in zip(names, linear) if not is_linear] + [
        name for name, is_linear in zip(names, linear) if is_linear]
    inputs = [hidden, *tensors, *copied]

    def body(*statics):
        kw_tensors, layer_weights = statics[1 : 1 + len(tensors)], statics[1 + len(tensors) :]
        return torch.func.functional_call(layer, dict(zip(order, layer_weights)), (statics[0],), rebuild(kw_tensors))

    # the class itself: two modules' layers may share a name (the generated gpu and npu modules)
    kind = (type(layer), names, linear)
    host = (modules, torch.is_autocast_enabled(hidden.device.type), torch.get_autocast_dtype(hidden.device.type))
    out = graphs.run(kind, kwargs[KWARG], (settings, host), body, inputs, live)
    return layer(hidden, **kwargs) if out is None else out


# a module's own tables of its state, which the replay copies (parameters, buffers) or walks (children)
MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})
PLAIN = (torch.nn.Parameter, torch.Tensor)
LINEAR_FORWARD = torch.nn.Linear.forward
HELD_TENSORS = "_patchgen_holds_tensors"  # (attribute count, whether one is a tensor), `_holds_tensors`


def _walk(layer):
    """One walk of the layer's modules through their own tables (`Module.named_parameters()` and the like walk it
    once each, about half a ms a layer in all): the names and tensors of its parameters and buffers, what each
    module's forward branches on besides its arguments (its training flag, its op table's backends and its host
    flags, `signature.host_flags`: a PEFT adapter switched off for TRL's reference log-probs on the plan the policy's
    kept, a layer's own adapter scale), all a graph replays as it was at capture. None when the layer must run as it
    is: a hook a replay would skip (as `layer_graphs.hooked_modules` finds them), more than `MAX_LAYER_BYTES` of
    weights, or tensors a replay would not copy in and so would read as the captured layer's: a weight of a tensor
    subclass (bitsandbytes' Params4bit and Int8Params carry their scales as attributes, torchao's quantised tensors
    hold theirs inside), a tensor held as a plain module attribute or in a dict, list or tuple of one (HQQ's `meta`
    scales) or a module with weights held so (a linear in a plain list), or a wrapper of torch.distributed (FSDP's,
    which gathers its shards in its own forward, not through hooks)."""
    if _global_hooks() or type(layer).__module__.startswith("torch.distributed"):
        return None
    # a lean loop: it runs for every replayed layer of every scoring forward (about 100 us a layer written with
    # generators and `named_*` walks, 3 ms of a 32-layer forward's host time)
    names, weights, modules, linear, seen, size = [], [], [], [], set(), 0
    stack = [("", layer)]
    while stack:
        prefix, module = stack.pop()
        values = module.__dict__
        if values.get("_hf_hook") is not None:
            return None
        for table in HOOK_TABLES:
            hooks = values.get(table)
            if hooks:
                for hook in hooks.values():
                    if not _recording_hook(hook):
                        return None
        if _holds_tensors(values):
            return None
        parameters = values["_parameters"]
        # a plain bias-free linear: the replay runs it eagerly on its weight (`graph_tape.py`), unless it is small
        plain_linear = type(module).forward is LINEAR_FORWARD and parameters.get("bias") is None
        for table in (parameters, values["_buffers"]):
            for name, tensor in table.items():
                if tensor is None or id(tensor) in seen:
                    continue
                if type(tensor) not in PLAIN or tensor._backward_hooks:
                    return None
                seen.add(id(tensor))
                names.append(prefix + name)
                weights.append(tensor)
                bytes_ = tensor.numel() * tensor.element_size()
                is_linear = plain_linear and name == "weight" and table is parameters and bytes_ >= MIN_LIVE_BYTES
                linear.append(is_linear)
                if not is_linear:
                    size += bytes_
        table = values.get(OP_TABLE)
        modules.append((module.training, None if table is None else table.backends_key, host_flags(module)))
        children = values["_modules"]
        if children:
            for name, child in reversed(children.items()):
                if child is not None:
                    stack.append((prefix + name + ".", child))
    if size > MAX_LAYER_BYTES:
        return None
    return tuple(names), weights, tuple(modules), tuple(linear)


def _holds_tensors(values: dict) -> bool:
    """Whether a module holds a tensor beside its tables, directly or in a dict, list or tuple, or a module with
    parameters or buffers there (a linear kept in a plain list, out of `_modules`): the walk would not see its weights,
    and a capture would bake the captured layer's in. Found once per module and again when its attributes grow (a
    quantiser attaching scales): the scan costs a few us a module, every call."""
    found = values.get(HELD_TENSORS)
    if found is not None and found[0] == len(values):
        return found[1]
    held = False
    for name, value in values.items():
        if name in MODULE_TABLES or name == HELD_TENSORS:
            continue
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        if any(isinstance(item, torch.Tensor) or _has_state(item) for item in items):
            held = True
            break
    values[HELD_TENSORS] = (len(values) + (HELD_TENSORS not in values), held)
    return held


def _has_state(item) -> bool:
    return isinstance(item, torch.nn.Module) and any(True for _ in itertools.chain(item.parameters(), item.buffers()))


def _split_kwargs(kwargs: dict):
    """(what the key holds by value, the tensors a replay copies in, how to rebuild the keyword arguments from copies
    of those tensors), or None for an argument that is neither (a cache object: the layer runs as it is). The plan is
    keyed by identity (`CallGraphs.run`'s index), the tables it holds are read in place."""
    scalars, tensors, slots = {}, [], []
    for name in sorted(kwargs):
        value = kwargs[name]
        if name == KWARG:
            continue
        if isinstance(value, torch.Tensor):
            slots.append((name, len(tensors), 1, None))
            tensors.append(value)
        elif isinstance(value, (tuple, list)) and value and all(isinstance(x, torch.Tensor) for x in value):
            slots.append((name, len(tensors), len(value), type(value)))
            tensors.extend(value)
        elif isinstance(value, SCALARS):
            scalars[name] = value
        else:
            return None
    plan = kwargs[KWARG]

    def rebuild(copies):
        rebuilt = dict(scalars)
        for name, at, count, container in slots:
            rebuilt[name] = copies[at] if container is None else container(copies[at : at + count])
        rebuilt[KWARG] = plan
        return rebuilt

    settings = (tuple(scalars.items()), tuple((name, count, container) for name, _, count, container in slots))
    return settings, tensors, rebuild
