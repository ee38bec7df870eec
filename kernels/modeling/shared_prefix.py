"""Deciding, guarding and building the shared-prefix plan at the top of a generated model.

Called by ``ForCausalLM.forward`` and ``ForConditionalGeneration.forward``; the plan then travels
down as the ``shared_prefix`` keyword (TextModel compacts, the mixers run on the compact row).
Section 4 of shared_prefix.md is the table of guards implemented here.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

from ..config import (
    SHARED_PREFIX_CHUNK_ALIGNED,
    SHARED_PREFIX_MAX_DEPTH,
    bool_field,
    field,
    int_field,
    shared_prefix_cuda_graphs,
    shared_prefix_cuda_graphs_buckets,
    shared_prefix_cuda_graphs_scoring,
    shared_prefix_cuda_graphs_training,
    shared_prefix_level_cost,
    shared_prefix_min_length,
    shared_prefix_plan_reuse,
)
from ..selection import working
from ..shared_prefix import (
    ATTENTION_NEEDS,
    CONV_NEEDS,
    GDN_NEEDS,
    build_plan,
    check_attention_backend,
    check_conv_backend,
    check_gdn_backend,
    positions_from_cu_seqlens,
    reject_unsupported,
    takes_ordinary_path,
    warn_row_count_dependent,
)
from ..shared_prefix.plan_reuse import PLANS, build_or_reuse
from .packing import PACKED_ROW
from .user_warning import warn_at_caller

_observers: list[Callable] = []

KWARG = "shared_prefix"  # the keyword the plan travels under, from the top model to the mixers
FLAG = "shared_prefix_training"


def text_config(config):
    """The text config of a multimodal config, or the config itself."""
    return getattr(config, "text_config", None) or config


# id(text config) -> the composite config whose text config it is, registered by the top model's forward
# (`plan_for`): the text model's layer stack reads the graphs' fields through it, so that a field set on the
# composite config (`model.config.shared_prefix_cuda_graphs = True` on a vision-language class) is read as the
# plan's fields are (and the same field set differently in both places is refused, as there)
_COMPOSITES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def fields_config(text_cfg):
    """The config a text model reads patchgen's fields from: its composite config when a top model registered one."""
    composite = _COMPOSITES.get(id(text_cfg))
    return composite if composite is not None and getattr(composite, "text_config", None) is text_cfg else text_cfg


def enabled(config) -> bool:
    """``text_config.shared_prefix_training`` (default False; also read on a composite config itself)."""
    return bool_field(config, FLAG)


class SharedPrefixUnused(UserWarning):
    """``shared_prefix_training`` is on, but a training forward reached the text model in a form that cannot share."""


_WARNED = "_patchgen_nothing_shared_warned"


def warn_if_nothing_shared(text_model, *, packed: bool, decided_above: bool) -> None:
    """Warn once per text model when the flag is on and a training forward (train mode, grad on) cannot share.

    ``decided_above``: the model's own forward (ForCausalLM / ForConditionalGeneration) saw this packed
    row and built the plan or found nothing to share; only rows it never saw are warned about: a padded
    ``[B, L]`` batch, and a packed row given to the backbone by a trainer with its own LM head.
    """
    if decided_above or not (text_model.training and torch.is_grad_enabled()) or not enabled(text_model.config):
        return
    name = type(text_model).__name__
    if packed:
        reason = (
            f"a packed row reached {name} without the model's own forward (ForCausalLM / ForConditionalGeneration), "
            "which builds the plan: a trainer that calls the backbone through its own LM head (TRL's SFTTrainer and "
            "GRPOTrainer do) never shares, and a batch with images or video never does. Call model(...) itself; "
            "for GRPO use patchgen.integrations.trl.SharedPrefixGRPOTrainer"
        )
    else:
        reason = (
            f"{name} got a batch that is not one packed row (a padded [B, L] batch, as TRL's GRPOTrainer scores): "
            "prefixes are shared only between the sequences of one packed row (cu_seq_lens_q, or position_ids that "
            "restart at 0). Pack the micro-batch; for GRPO use patchgen.integrations.trl.SharedPrefixGRPOTrainer"
        )
    _warn_unused_once(text_model, _WARNED, reason)


def _warn_unused_once(model, attribute: str, reason: str) -> None:
    """`SharedPrefixUnused` with `reason`, once per model and reason (`attribute` marks the model as told)."""
    if getattr(model, attribute, False):
        return
    object.__setattr__(model, attribute, True)
    warn_at_caller(f"shared_prefix_training is on, but this training forward shares nothing: {reason}", SharedPrefixUnused)


_NOISE_WARNED = "_patchgen_noised_embeddings_warned"


def embeddings_noised(model) -> bool:
    """Whether NEFTune noises the input embeddings (transformers' `neftune_post_forward_hook`, which `Trainer` adds
    for `neftune_noise_alpha` and which reads `neftune_noise_alpha` off the embedding module): its noise scales with
    1 / sqrt(rows x width) of the tensor it sees, so on the compact row it would be sqrt(T / C) times larger and the
    same for every sequence of a prefix. Such a forward takes the packed path; warned once per model when the flag
    is on."""
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if get is not None else None
    if embeddings is None or not embeddings.training or getattr(embeddings, "neftune_noise_alpha", None) is None:
        return False
    if enabled(model.config):
        _warn_unused_once(
            model, _NOISE_WARNED,
            "NEFTune noises the input embeddings (neftune_noise_alpha), scaled by the row's length, and on the compact "
            "row it would be larger and shared by every sequence of a prefix. These forwards run packed; drop "
            "neftune_noise_alpha to share prefixes",
        )
    return True


def packed_positions(position_ids, input_ids, inputs_embeds, cache, kwargs):
    """Per-sequence positions for a packed row passed without ``position_ids`` (else unchanged)."""
    cu = kwargs.get("cu_seq_lens_q")
    if position_ids is not None or cu is None or cache is not None:
        return position_ids
    length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
    return positions_from_cu_seqlens(cu, length)


def plan_for(
    config, table, *, input_ids, position_ids, cache, use_cache, kwargs, pixel_values=None, pixel_values_videos=None,
    mm_encoder_outputs=None, uploaded=None,
):
    """The shared-prefix plan of this micro-batch, or None for the ordinary path.

    The flag means "share prefixes on packed training rows": generation, cached forwards
    (a cache or ``use_cache=True``) and unpacked rows (no ``cu_seq_lens_q``, no restarting
    ``position_ids``) take the ordinary path, so one model trains and generates. On a packed row it
    raises ``NotImplementedError`` for MTP and sequence parallelism, and ``BackendUnavailable`` when a
    bound backend lacks what the compact row needs. Builds nothing when the flag is off or media are present (pixels or
    precomputed ``mm_encoder_outputs``).

    The plan reads the row on the host: the host copy a row came in (``uploaded``, `host_rows.upload`), and the
    boundaries `resolve_packed` already copied; only what came on the device alone is copied back (one sync).
    """
    cfg = text_config(config)
    if cfg is not config:
        _COMPOSITES[id(cfg)] = config
    if takes_ordinary_path(enabled(config), input_ids, pixel_values, pixel_values_videos, mm_encoder_outputs):
        return None
    if cache is not None or use_cache or kwargs.get("cu_seq_lens_q") is None:
        return None
    sequence_parallel = bool(kwargs.get("sequence_parallel")) or field(config, "sequence_parallel_size", 1) > 1
    mtp = bool(kwargs.get("use_mtp")) or bool(field(config, "mtp_training", False))
    reject_unsupported(mtp=mtp, sequence_parallel=sequence_parallel)
    check_gdn_backend(table.handle("gated_delta_rule"), _working("gated_delta_rule", GDN_NEEDS))
    check_conv_backend(table.handle("causal_conv1d"), _working("causal_conv1d", CONV_NEEDS))
    check_attention_backend(table.handle("attention"), _working("attention", ATTENTION_NEEDS))
    warn_row_count_dependent("rms_norm_gated", table.handle("rms_norm_gated"))
    row = kwargs.get(PACKED_ROW)
    plan = build_or_reuse(
        PLANS if shared_prefix_plan_reuse(config) else None,
        input_ids if uploaded is None else uploaded.input_ids,
        kwargs["cu_seq_lens_q"] if row is None else row.cu_seqlens_cpu,
        position_ids if uploaded is None else uploaded.positions(position_ids),
        device=input_ids.device,
        conv_kernel_size=getattr(cfg, "linear_conv_kernel_dim", 4),
        min_prefix=shared_prefix_min_length(config),
        max_depth=int_field(config, SHARED_PREFIX_MAX_DEPTH),
        level_cost=shared_prefix_level_cost(config),
        chunk_aligned=bool_field(config, SHARED_PREFIX_CHUNK_ALIGNED),
        pad_to_bucket=pads_to_bucket(config) and graphs_way(config) != "eager",
        held_buckets=held_buckets(config),
        bucket_gate=bucket_gate(config),
        build=build_plan,  # looked up here per call: tests spy on it
    )
    for observer in _observers:
        observer(plan, input_ids.shape[-1])
    return plan


def _working(slot: str, needs) -> Iterator[str]:
    """The backends that would serve `slot` here, looked up only when an error names them (every plan checks)."""
    yield from working(slot, frozenset(needs))


def pads_to_bucket(config) -> bool:
    """A plan is padded to its bucket (`shared_prefix/bucket.py`) for the forwards the CUDA graphs run (training
    steps and scoring forwards): the graphs on and their buckets on."""
    return shared_prefix_cuda_graphs(config) and shared_prefix_cuda_graphs_buckets(config)


def graphs_way(config) -> str:
    """With the graphs on, how this forward's layer stack runs: ``"graphs"``, ``"eager"`` or ``"auto"``
    (``shared_prefix_cuda_graphs_training`` when gradients are on, else ``shared_prefix_cuda_graphs_scoring``)."""
    if torch.is_grad_enabled():
        return shared_prefix_cuda_graphs_training(config)
    return shared_prefix_cuda_graphs_scoring(config)


def bucket_gate(config):
    """Under ``"auto"``, what decides per layout whether its plan pads to a bucket (a replay) or stays unpadded (an
    eager call): the text model's `graphs.choice.ReplayOrEager` for this kind of forward (None before its first
    graphed call, which then captures, and for the other ways)."""
    if not pads_to_bucket(config) or graphs_way(config) != "auto":
        return None
    graphs = _graphs_of(config)
    return None if graphs is None else graphs.choice.gate("train" if torch.is_grad_enabled() else "score")


# id(text config) -> the layer graphs of its text model (`layer_graphs.use_graphs` registers them), so that the
# top model's plan can pad to a bucket whose graph is held
GRAPHS_BY_CONFIG: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def held_buckets(config) -> tuple:
    """The buckets of the graphs the text model of `config` holds for this kind of forward (a training step
    when gradients are on, else a scoring forward), most recently used first (none when off)."""
    graphs = _graphs_of(config)
    return () if graphs is None else graphs.held_buckets(training=torch.is_grad_enabled())


def _graphs_of(config):
    cfg = text_config(config)
    graphs = GRAPHS_BY_CONFIG.get(id(cfg))
    return graphs if graphs is not None and getattr(graphs, "config", None) is cfg else None


@contextlib.contextmanager
def observe_plans(callback: Callable):
    """Call ``callback(plan_or_None, packed_tokens)`` for every plan decision on a packed row inside the block.

    For trainers and benchmarks that report ``T / C``; the models themselves never read it.
    """
    _observers.append(callback)
    try:
        yield
    finally:
        _observers.remove(callback)


def expand_hidden_states(plan, hidden_states):
    """Captured compact hidden states ``[1, C, d]`` back to ``[1, T, d]`` (a tuple, or None)."""
    if plan is None or hidden_states is None:
        return hidden_states
    return tuple(plan.expand(h, dim=1) for h in hidden_states)


def expand_router_logits(plan, router_logits):
    """Router logits of the compact rows ``[C, E]`` repeated per packed token ``[T, E]``.

    The load-balancing loss then counts every packed token with its multiplicity and equals the
    packed value exactly (the expansion is an index_select; routing itself ran on ``C`` rows).
    """
    if plan is None or router_logits is None:
        return router_logits
    return tuple(plan.expand(r, dim=0) for r in router_logits)


def compact_positions(plan, position_ids: torch.Tensor | None) -> torch.Tensor:
    """The compact row's positions (the plan computed them from the packed ones)."""
    return plan.position_ids
