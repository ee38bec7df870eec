"""Per-expert checkpoint tensors into the fused experts of the generated MoE classes, in ``load_state_dict``.

A Qwen3.5-MoE checkpoint holds one tensor per expert (``experts.<e>.gate_proj.weight``, ``up_proj``,
``down_proj``): ``save_pretrained`` splits the fused parameters, and only ``from_pretrained`` merges them
back (transformers' ``qwen2_moe`` conversion: the experts stacked in index order, then gate and up
concatenated on dim 1). ``torch.nn.Module.load_state_dict`` converts nothing, and it is what Trainer's
``resume_from_checkpoint``, ``load_sharded_checkpoint`` and ``load_best_model_at_end`` call: without this
hook every expert silently kept its weights from before the resume.
"""

from __future__ import annotations

import re

import torch

from ..errors import ExpertWeightsUnloadable

PER_EXPERT = re.compile(r"(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# fused parameter -> its per-expert sources, in transformers' concatenation order
FUSED_FROM = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def fuse_per_expert_weights(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
    """``load_state_dict`` pre-hook of the experts module: a checkpoint's per-expert keys become its fused tensors.

    All experts of a fused parameter present: the fused tensor goes into ``state_dict``, so torch copies
    (or assigns) it and reports nothing. Only some (a shard of ``load_sharded_checkpoint``): they are
    written into their slices of the parameter now, and the fused key stays reported missing for this
    call, as the shard does not hold all of it.
    """
    found = per_expert_tensors(state_dict, prefix)
    if not found:
        return
    for fused, sources in FUSED_FROM.items():
        pieces = {(index, source): tensor for (index, source), tensor in found.items() if source in sources}
        if not pieces:
            continue
        if prefix + fused in state_dict:
            raise ExpertWeightsUnloadable(prefix + fused, "the state dict holds it both fused and per expert")
        _check_indices(module, prefix + fused, pieces)
        if len(pieces) == module.num_experts * len(sources):
            state_dict[prefix + fused] = _fused(pieces, module.num_experts, sources)
        else:
            _write_slices(module, prefix, fused, pieces, sources)
    for index, source in found:
        del state_dict[f"{prefix}{index}.{source}.weight"]


def per_expert_tensors(state_dict, prefix: str) -> dict[tuple[int, str], torch.Tensor]:
    """The state dict's per-expert tensors under ``prefix``, by (expert index, projection)."""
    found = {}
    for key, tensor in state_dict.items():
        match = PER_EXPERT.fullmatch(key[len(prefix):]) if key.startswith(prefix) else None
        if match:
            found[int(match.group(1)), match.group(2)] = tensor
    return found


def _fused(pieces, num_experts: int, sources) -> torch.Tensor:
    # transformers' MergeModulelist(dim=0) per source, then Concatenate(dim=1) across sources
    stacked = [torch.stack([pieces[index, source] for index in range(num_experts)]) for source in sources]
    return stacked[0] if len(stacked) == 1 else torch.cat(stacked, dim=1)


def _check_indices(module, fused_key: str, pieces) -> None:
    beyond = sorted({index for index, _ in pieces if index >= module.num_experts})
    if beyond:
        raise ExpertWeightsUnloadable(fused_key, f"expert indices {beyond} beyond the model's {module.num_experts} experts")


def _write_slices(module, prefix: str, fused: str, pieces, sources) -> None:
    parameter, fused_key = getattr(module, fused), prefix + fused
    if parameter.is_meta:
        raise ExpertWeightsUnloadable(fused_key, "only some experts are in this state dict and the parameter is on the meta device")
    rows = parameter.shape[1] // len(sources)
    with torch.no_grad():
        for (index, source), tensor in pieces.items():
            start = sources.index(source) * rows
            target = parameter[index, start:start + rows]
            if target.shape != tensor.shape:
                raise ExpertWeightsUnloadable(
                    fused_key, f"expert {index}'s {source} has shape {tuple(tensor.shape)}, the model's {tuple(target.shape)}"
                )
            target.copy_(tensor)
