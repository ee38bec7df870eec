"""The decoder-layer stack of a shared-prefix training step under CUDA graphs (``shared_prefix_cuda_graphs``).

The generated ``TextModel.forward`` hands its layer loop to `run_layers`. With the flag off, or for any
call without a shared-prefix plan (generation, unpacked batches), the loop runs as it is. A training
step (a plan, gradients wanted) runs the stack as one forward and one backward graph replay; a scoring
forward (a plan, no gradient: an RL step's old-policy or reference log-probs, evaluation) as one
forward replay. Under ``"auto"`` (the default of ``shared_prefix_cuda_graphs_training`` and ``_scoring``) a call
whose plan the gate left unpadded runs eagerly instead, timed (`graphs/choice.py`); under ``"eager"`` every call of
that kind does. Both are keyed by everything the graphs baked in (`patchgen.kernels.graphs.signature`)
and by the mode; a batch whose key was never seen captures first (a few eager steps' time), and at
most ``shared_prefix_cuda_graphs_cache`` captured stacks are kept. Loss, logits and gradients are the
eager step's: the same kernels on the same rows.

Refused with `CudaGraphsUnavailable` (flag on, a forward with a plan): a device other than CUDA,
activation checkpointing in a training step (the graphs hold the whole stack's activations, a recompute
would save nothing), per-layer outputs asked for (hidden states, attentions, router logits: hooks do not run in
a replay), hooks on the stack's modules (FSDP, ZeRO-3, accelerate offloading, probes), and layer
arguments a key cannot describe or that want a gradient the stack does not return.
"""

from __future__ import annotations

import torch

from ..config import (
    SHARED_PREFIX_CUDA_GRAPHS_CACHE,
    int_field,
    shared_prefix_cuda_graphs,
    shared_prefix_cuda_graphs_scoring,
    shared_prefix_cuda_graphs_training,
)
from ..errors import CudaGraphsUnavailable
from ..graphs import CudaGraphReplay, EagerReplay, GraphCache, StackReplay, StaticCall, call_signature
from ..graphs.cache import Entry
from ..graphs.choice import EAGER, REPLAY, ReplayOrEager, mark_backward_end, time_backward
from ..graphs.replay import CudaGraphScoring, EagerScoring, replay_scoring
from ..shared_prefix.bucket import cost
from . import shared_prefix
from .shared_prefix import KWARG

ATTRIBUTE = "_patchgen_layer_graphs"
# what a text model's graphs capture with; tests off CUDA set `EagerReplay` (the same buffers and node, run eagerly)
DEFAULT_REPLAY = CudaGraphReplay
# keyword arguments the decoder layers pass along but never read under a plan; left out of a graphed stack's call
LOSS_ONLY = ("num_items_in_batch",)
RECORDED_OUTPUTS = ("output_hidden_states", "output_attentions", "output_router_logits")
# the forward-only replay that goes with each training replay
SCORING = {CudaGraphReplay: CudaGraphScoring, EagerReplay: EagerScoring}


class LayerGraphs:
    """The graph cache of one text model and the replays it captures with: `CudaGraphReplay` for training steps
    and `CudaGraphScoring` for scoring forwards (`EagerReplay` / `EagerScoring` in tests)."""

    def __init__(self, max_entries: int = 2, replay=CudaGraphReplay, scoring=None):
        self.cache = GraphCache(max_entries)
        self.choice = ReplayOrEager()  # per call, under "auto": replay or eager (`graphs/choice.py`)
        self.replay = replay
        self.scoring = scoring or SCORING[replay]

    @property
    def stats(self):
        return self.cache.stats

    def held_buckets(self, training: bool = True) -> tuple:
        """Buckets of the held stacks this kind of call can replay (training steps, scoring forwards under no_grad,
        or under inference mode), most recently used first: a plan pads to one when it fits."""
        return self.cache.held_buckets(_entry_mode(training))

    def __call__(
        self, text_model, layers_fn, hidden, position_embeddings, masks, kwargs: dict, training: bool = True,
        timed: bool = False,
    ) -> torch.Tensor:
        layers = list(text_model.layers[: text_model.config.num_hidden_layers])
        mode = _entry_mode(training)
        candidates = []
        key = (mode, call_signature(hidden, position_embeddings, masks, kwargs, layers, KWARG, candidates))
        _refuse_hooks(layers, candidates)
        entry = self.cache.get(key)
        timing = None
        if entry is not None and timed and entry.bucket is not None:  # a replay (a capture is not measured)
            timing = self.choice.timing("train" if training else "score", REPLAY, cost(entry.bucket), hidden.device)
        if entry is None:
            self.cache.make_room()
            static = StaticCall.of(hidden, position_embeddings, masks, kwargs)
            bucket = kwargs[KWARG].bucket
            if training:
                params = list(dict.fromkeys(p for layer in layers for p in layer.parameters() if p.requires_grad))
                entry = Entry(static, self.replay(layers_fn, static, params), params, bucket=bucket, mode="train")
            else:
                entry = Entry(static, self.scoring(layers_fn, static), [], bucket=bucket, mode=mode)
            self.cache.put(key, entry)
        if not training:
            return _timed(timing, False, lambda t: self._score(entry, hidden, position_embeddings, masks, kwargs))
        return _timed(
            timing, True, lambda t: self._train(entry, mark_backward_end(hidden, t), position_embeddings, masks, kwargs)
        )

    @staticmethod
    def _score(entry, hidden, position_embeddings, masks, kwargs) -> torch.Tensor:
        entry.static.load(position_embeddings, masks, kwargs)
        return replay_scoring(entry, hidden)

    @staticmethod
    def _train(entry, hidden, position_embeddings, masks, kwargs) -> torch.Tensor:
        entry.static.load(position_embeddings, masks, kwargs)
        return StackReplay.apply(entry, hidden, *entry.params)


def _entry_mode(training: bool) -> str:
    # a scoring graph captured in inference mode holds inference tensors, which plain no_grad cannot write: the two
    # are held apart, and a plan pads only to a bucket its own kind of call holds
    if training:
        return "train"
    return "infer" if torch.is_inference_mode_enabled() else "score"


def graphs_of(model) -> LayerGraphs | None:
    """The layer graphs of a model (its text model's), for their counters (`.stats`); None before the first graphed call."""
    for module in model.modules():
        found = getattr(module, ATTRIBUTE, None)
        if found is not None:
            return found
    return None


def use_graphs(text_model, graphs: LayerGraphs | None) -> None:
    """Give a text model its layer graphs (tests give `LayerGraphs(replay=EagerReplay)` to run the static path off CUDA)."""
    object.__setattr__(text_model, ATTRIBUTE, graphs)
    if graphs is not None:  # the top model's plan reads their buckets through its config
        graphs.config = text_model.config
        shared_prefix.GRAPHS_BY_CONFIG[id(text_model.config)] = graphs


def _graphs(text_model) -> LayerGraphs | None:
    """The text model's layer graphs when the flag is on (made on first use); None, and any held graphs dropped, when off."""
    current = getattr(text_model, ATTRIBUTE, None)
    config = shared_prefix.fields_config(text_model.config)
    if not shared_prefix_cuda_graphs(config):
        if current is not None:
            use_graphs(text_model, None)  # turned off: the graphs and their pools go
        return None
    size = int_field(config, SHARED_PREFIX_CUDA_GRAPHS_CACHE)
    if current is None:
        current = LayerGraphs(size, replay=DEFAULT_REPLAY)
        use_graphs(text_model, current)
    current.cache.max_entries = size  # a bound changed since (to free memory) holds from the next capture on
    return current


def _training_step(text_model, hidden, kwargs) -> bool:
    """A shared-prefix step that will run a backward: a plan, and gradients wanted from the stack."""
    if kwargs.get(KWARG) is None or not torch.is_grad_enabled():
        return False
    return hidden.requires_grad or any(p.requires_grad for p in text_model.layers.parameters())


def _asked_outputs(text_model, kwargs) -> list[str]:
    return [name for name in RECORDED_OUTPUTS if kwargs.get(name, getattr(text_model.config, name, False))]


FIX = "set shared_prefix_cuda_graphs=False (or PATCHGEN_SHARED_PREFIX_CUDA_GRAPHS=0)"


def _refuse(text_model, graphs: LayerGraphs, hidden, kwargs, training: bool) -> None:
    if graphs.replay is CudaGraphReplay and hidden.device.type != "cuda":
        raise CudaGraphsUnavailable(
            f"shared_prefix_cuda_graphs is on, but the model runs on {hidden.device} ({hidden.device.type}): CUDA "
            f"graphs need a CUDA device; {FIX} on this device"
        )
    checkpointed = [i for i, layer in enumerate(text_model.layers) if getattr(layer, "gradient_checkpointing", False)]
    if training and text_model.training and (checkpointed or getattr(text_model, "gradient_checkpointing", False)):
        raise CudaGraphsUnavailable(
            "shared_prefix_cuda_graphs is on together with activation checkpointing (layers "
            f"{checkpointed[:4]}{'...' if len(checkpointed) > 4 else ''}): the graphs keep the whole stack's "
            "activations in their memory pool, so a recompute would save no memory and cost time. Turn one off: "
            f"model.activation_checkpointing_disable() (or TrainingArguments(gradient_checkpointing=False)), or {FIX}"
        )
    asked = _asked_outputs(text_model, kwargs)
    if asked:
        raise CudaGraphsUnavailable(
            f"shared_prefix_cuda_graphs is on and this forward asks for {', '.join(asked)}: per-layer outputs are "
            "recorded by hooks, which do not run when a graph replays (an MoE model's router logits for the "
            f"load-balancing loss among them). Do not ask for them in training steps, or {FIX}"
        )


def _refuse_hooks(layers, candidates: list) -> None:
    """Refuse a stack with hooks a replay would skip. `candidates` are the modules the key's walk found holding
    any hook (`signature.module_state`): the stack is walked again, for the names, only when there are some."""
    if not candidates and not _global_hooks():
        return
    hooked = hooked_modules(layers)
    if hooked:
        raise CudaGraphsUnavailable(
            f"shared_prefix_cuda_graphs is on and modules of the decoder-layer stack have hooks ({', '.join(hooked[:4])}"
            f"{'...' if len(hooked) > 4 else ''}): a hook's Python runs when a graph is captured, never when it "
            "replays (FSDP's and DeepSpeed ZeRO-3's parameter gathering, accelerate's offloading, a probe or "
            f"steering hook among them). Remove the hooks, or {FIX}"
        )


# transformers' output-recording hook: inactive unless per-layer outputs are asked for, which `_refuse` refuses
RECORDING_HOOK = ("transformers.utils.output_capturing", "output_capturing_hook")
HOOK_TABLES = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
GLOBAL_HOOK_TABLES = ("_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks")


def _recording(hook) -> bool:
    return (getattr(hook, "__module__", None), getattr(hook, "__name__", None)) == RECORDING_HOOK


def _global_hooks() -> bool:
    return any(getattr(torch.nn.modules.module, table, None) for table in GLOBAL_HOOK_TABLES)


def hooked_modules(layers) -> list[str]:
    """The modules of the stack whose hooks a replay would skip (any module hook but transformers' inactive
    output recorder, or an accelerate hook that wraps the forward), the parameters with tensor hooks, and
    "every module" for global module hooks."""
    found = []
    if _global_hooks():
        found.append("every module (torch.nn.modules.module.register_module_*_hook)")
    stack = [(f"layers.{i}", layer) for i, layer in enumerate(layers)][::-1]
    while stack:
        name, module = stack.pop()
        hooks = [h for table in HOOK_TABLES for h in getattr(module, table, {}).values()]
        if getattr(module, "_hf_hook", None) is not None or any(not _recording(h) for h in hooks):
            found.append(name)
        # a parameter's tensor hook (`register_hook`) fires inside the warm-ups' and capture's own backward (with
        # their gradients), and one that changes the gradient would be applied in the graph and again on replay;
        # post-accumulate hooks (DDP, optimizer-in-backward) run once per replay, as in eager
        found += [f"{name}.{p_name} (register_hook)" for p_name, p in module._parameters.items() if p is not None and p._backward_hooks]
        stack.extend((f"{name}.{child}", m) for child, m in reversed(module._modules.items()) if m is not None)
    return found


def run_layers(text_model, layers_fn, hidden_states, position_embeddings, masks, **kwargs) -> torch.Tensor:
    """``layers_fn(hidden_states, position_embeddings, masks, **kwargs)``: the decoder layers, graphed when asked for and possible."""
    graphs = _graphs(text_model)
    if graphs is None or kwargs.get(KWARG) is None:
        return layers_fn(hidden_states, position_embeddings, masks, **kwargs)
    training = _training_step(text_model, hidden_states, kwargs)
    if not training and _asked_outputs(text_model, kwargs):
        # a scoring pass that wants per-layer outputs gets them eagerly: nothing to lose but the replay's speed
        return layers_fn(hidden_states, position_embeddings, masks, **kwargs)
    config = shared_prefix.fields_config(text_model.config)
    way = shared_prefix_cuda_graphs_training(config) if training else shared_prefix_cuda_graphs_scoring(config)
    mode = "train" if training else "score"
    if way == "eager":  # never graphed: nothing a graph could not do is refused (checkpointing, router logits)
        graphs.stats.eager += 1
        return layers_fn(hidden_states, position_embeddings, masks, **kwargs)
    _refuse(text_model, graphs, hidden_states, kwargs, training)
    if kwargs[KWARG].eager:
        # "auto"'s gate chose eager for this plan (left unpadded); under another way a kept plan built under "auto"
        # (`plan_reuse`) runs as built: the same rows either way
        graphs.stats.eager += 1
        timing = graphs.choice.timing(mode, EAGER, kwargs[KWARG].work, hidden_states.device) if way == "auto" else None
        return _timed(timing, training, lambda t: layers_fn(mark_backward_end(hidden_states, t), position_embeddings, masks,
                                                               **kwargs))
    # read by the loss only (HF Trainer's token count, new every step): in the key, every step would capture
    kwargs = {k: v for k, v in kwargs.items() if k not in LOSS_ONLY}
    # the layers read the plan's mixer indices only; the rest follows the packed row (its length, the LM rows)
    kwargs[KWARG] = kwargs[KWARG].for_layers()
    return graphs(text_model, layers_fn, hidden_states, position_embeddings, masks, kwargs, training, way == "auto")


def _timed(timing, training: bool, run):
    """`run(timing or None)` (the stack, given the timing to mark its input with), its forward measured into `timing`
    (and a training step's backward, from its output's backward to its input's), when given."""
    if timing is None:
        return run(None)
    timing.begin()
    out = run(timing if training else None)
    timing.end()
    return time_backward(out, timing) if training else out
