"""TRL's ``GRPOTrainer`` with every scoring pass on one packed row per micro-batch.

Stock TRL scores padded ``[B, L]`` rows through the backbone and its own fused LM head, so a
patchgen model's shared-prefix plan never runs there. ``SharedPrefixGRPOTrainer`` packs the real
tokens of each micro-batch into one row, calls the model with ``return_log_probs`` /
``return_entropy`` and TRL's temperature, and puts the per-token values back in TRL's layout. With
``shared_prefix_training`` on, each prompt of a group of rollouts runs once; the loss, rewards and
gradients are those of stock ``GRPOTrainer``. The policy, old-policy and reference passes all go
through it, and a prompt's rollouts stay in one micro-batch when TRL splits a generation batch.
"""

from __future__ import annotations

import copy
import gc
import logging
import warnings

import torch
from trl import GRPOTrainer
from trl.trainer.utils import (
    add_fused_lm_head,
    split_pixel_values_by_grid,
    split_tensor_dict,
    unsplit_pixel_values_by_grid,
)

from patchgen.kernels import ops
from patchgen.kernels.config import shared_prefix_min_length
from patchgen.kernels.modeling.shared_prefix import enabled as shared_prefix_enabled
from patchgen.kernels.modeling.shared_prefix import observe_plans
from patchgen.kernels.modeling.verify import sharing_allowed

from .packed_rows import pack_rows

logger = logging.getLogger(__name__)

MEDIA_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
    "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)


class GroupedMicroBatches(UserWarning):
    """A loss term TRL normalises per micro-batch sees other rows than in stock TRL (a prompt's rollouts kept together)."""


class PrefixesNotShared(UserWarning):
    """A setting or a batch under which SharedPrefixGRPOTrainer computes prompts more often than it could.

    The results are those of stock ``GRPOTrainer`` all the same; only the time saved is lost.
    """


def is_patchgen_model(model) -> bool:
    """True for a model built from a patchgen generated module (its op table is bound)."""
    return getattr(model, ops.ATTRIBUTE, None) is not None and hasattr(model, "lm_head")


class SharedPrefixGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` that scores each micro-batch as one packed row of a patchgen model.

    Use it as ``GRPOTrainer``, with a patchgen model instance (``shared_prefix_training=True`` on its
    text config to share prompts). Batches it cannot pack (media, a mask with holes, a non-patchgen
    or PEFT-wrapped model, ``cast_lm_head_to_fp32``) are scored by TRL's own path, with one warning.
    ``packed_tokens`` counts the tokens of every packed row scored, per pass (``policy``, ``old``, ``ref``, and
    ``eval`` for the policy model's passes while evaluating);
    ``shared_prefix_tokens`` the packed (T) and compact (C) tokens of the rows that shared a prefix,
    also logged as ``shared_prefix/packed_over_compact``.
    """

    def __init__(self, model, *args, **kwargs):
        if isinstance(model, str):
            raise TypeError(
                "SharedPrefixGRPOTrainer needs a patchgen model instance, got the path "
                f"{model!r}: load it with a generated class, e.g. "
                "patchgen.generated.qwen3_5.patched_modeling_qwen3_5_gpu.Qwen3_5ForCausalLM.from_pretrained(path)"
            )
        super().__init__(model, *args, **kwargs)
        self.packed_tokens = {"policy": 0, "old": 0, "ref": 0, "eval": 0}
        self.shared_prefix_tokens = {"packed": 0, "compact": 0}
        self._fallback_warned = False
        self._unshared_warned = False
        self._share_reference_model()
        self._warn_grouped_micro_batches()
        self._warn_less_sharing()

    # ---- scoring -------------------------------------------------------------------------------
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **media,
    ):
        reason = self._cannot_pack(model, media)
        if reason is not None:
            self._warn_fallback(reason)
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **media,
            )
        batch_size = batch_size or input_ids.size(0)
        chunks = []
        # one copy to the host for every micro-batch: each is packed there and handed to the model on the host, so
        # the loop queues micro-batch k + 1 while the device still runs k (no copy back waits for it)
        ids_host, mask_host = input_ids.detach().cpu(), attention_mask.detach().cpu()
        for start in range(0, input_ids.size(0), batch_size):
            end = min(start + batch_size, input_ids.size(0))
            packed = pack_rows(ids_host[start:end], mask_host[start:end], logits_to_keep, device=input_ids.device)
            if packed is None or packed.tokens == 0:
                self._warn_fallback("a row whose attention_mask is not one contiguous run of tokens")
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                    compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **media,
                )
            extra = {"output_router_logits": True} if compute_aux_loss else {}
            plans = []
            with self.accelerator.autocast(), observe_plans(lambda plan, tokens, found=plans: found.append(plan)):
                out = model(
                    **packed.model_kwargs(), return_log_probs=True, return_entropy=compute_entropy,
                    return_logits=False, temperature=self.temperature, use_cache=False,
                    labelled_positions_only=True, **extra,
                )
            for plan in plans:
                self._count_plan(plan, packed.tokens)
            self.packed_tokens[self._pass_name(model)] += packed.tokens
            if self._pass_name(model) == "policy" and not any(plan is not None for plan in plans):
                self._warn_nothing_shared(model, attention_mask[start:end], logits_to_keep, packed)
            entropy = packed.scatter(out.entropy) if compute_entropy else None
            chunks.append((packed.scatter(out.log_probs), entropy, out.get("aux_loss") if compute_aux_loss else None))
        logps = torch.cat([c[0] for c in chunks])
        entropies = torch.cat([c[1] for c in chunks]) if compute_entropy else None
        aux_loss = torch.stack([c[2] for c in chunks]).mean() if compute_aux_loss else None
        return logps, entropies, aux_loss

    def _count_plan(self, plan, tokens: int) -> None:
        # the layout's C: a plan padded to a CUDA-graph bucket computes padding rows, which share nothing
        compact = tokens if plan is None else plan.layout.compact_length
        self.shared_prefix_tokens["packed"] += tokens
        self.shared_prefix_tokens["compact"] += compact
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["shared_prefix/packed_over_compact"].append(tokens / max(compact, 1))

    def _pass_name(self, model) -> str:
        if self.ref_model is not None and model is self.ref_model:
            return "ref"
        if not self.model.training:
            return "eval"  # evaluation scores the policy without gradients too: it is no old-policy pass
        return "policy" if torch.is_grad_enabled() else "old"

    def _cannot_pack(self, model, media) -> str | None:
        if any(value is not None for value in media.values()):
            return "images or other media in the batch"
        if self.args.cast_lm_head_to_fp32:
            return "cast_lm_head_to_fp32=True"
        if not is_patchgen_model(self.accelerator.unwrap_model(model)):
            return f"a model that is not a patchgen model ({type(self.accelerator.unwrap_model(model)).__name__})"
        return None

    def _warn_fallback(self, reason: str) -> None:
        if not self._fallback_warned:
            warnings.warn(
                f"SharedPrefixGRPOTrainer: scoring with TRL's padded path (no packed row, no shared prefix) because of "
                f"{reason}", stacklevel=3,
            )
            self._fallback_warned = True

    def _warn_nothing_shared(self, model, attention_mask, logits_to_keep, packed) -> None:
        """Once: a training micro-batch shared no prompt although the flag is on (T/C = 1 for it)."""
        unwrapped = self.accelerator.unwrap_model(model)
        if self._unshared_warned or not shared_prefix_enabled(unwrapped.config) or not sharing_allowed(unwrapped):
            return  # flag off: warned at construction; verification turned sharing off: it warned
        self._unshared_warned = True
        prompts = attention_mask[:, :-logits_to_keep].sum(1) if logits_to_keep else attention_mask.sum(1)
        warnings.warn(
            f"SharedPrefixGRPOTrainer: shared_prefix_training is on, but a training micro-batch "
            f"({attention_mask.shape[0]} rollouts, {packed.tokens} packed tokens) shared no prompt: its longest prompt "
            f"has {int(prompts.max())} tokens and shared_prefix_min_length is {shared_prefix_min_length(unwrapped.config)}, "
            "or no two rollouts of one prompt are in it. Set model.config.shared_prefix_min_length below your prompt "
            "length, and per_device_train_batch_size to a multiple of num_generations",
            PrefixesNotShared, stacklevel=3,
        )

    def _warn_less_sharing(self) -> None:
        """At construction: the flag is off, or micro-batches cut through a prompt's rollouts."""
        policy = self.accelerator.unwrap_model(self.model)
        if is_patchgen_model(policy) and not shared_prefix_enabled(policy.config):
            warnings.warn(
                "SharedPrefixGRPOTrainer: the model's shared_prefix_training is off, so each micro-batch is scored as "
                "one packed row but every rollout computes its prompt again (T/C = 1). Set "
                "model.config.shared_prefix_training = True to compute each prompt once",
                PrefixesNotShared, stacklevel=3,
            )
        size, group = self.args.per_device_train_batch_size, self.num_generations
        if size % group and group % size:
            warnings.warn(
                f"SharedPrefixGRPOTrainer: per_device_train_batch_size={size} is neither a multiple nor a divisor of "
                f"num_generations={group}, so some prompts' rollouts are split over two micro-batches and those prompts "
                f"are computed once in each. Use a multiple of {group} (or a divisor) to compute each prompt once per "
                "micro-batch",
                PrefixesNotShared, stacklevel=3,
            )

    # ---- a prompt's rollouts in one micro-batch ------------------------------------------------
    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            batch = split_pixel_values_by_grid(batch)
            batch = shuffle_keeping_groups(batch)
            batches = split_tensor_dict(batch, self.args.steps_per_generation)
            self._buffered_inputs = [unsplit_pixel_values_by_grid(b) for b in batches]
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def micro_batch_terms(self) -> list[str]:
        """TRL's loss terms computed per micro-batch, whose value depends on which rows share one."""
        terms = []
        if self.loss_type == "bnpo":
            terms.append('loss_type="bnpo" (a token mean per micro-batch)')
        if getattr(self, "_entropy_bonus_enabled", False):
            terms.append("the entropy bonus (a token mean per micro-batch)")
        quantile = getattr(self, "top_entropy_quantile", 1.0)
        if quantile < 1.0:
            terms.append(f"the entropy mask of top_entropy_quantile={quantile} (a quantile per micro-batch)")
        if getattr(self, "aux_loss_enabled", False):
            terms.append("the MoE load-balancing loss (routing statistics per micro-batch)")
        return terms

    def _warn_grouped_micro_batches(self) -> None:
        # With one micro-batch per generation batch the rows are the same as stock TRL's, whatever their order.
        accumulation, splits = self.args.gradient_accumulation_steps, self.args.steps_per_generation
        if splits > 1 and accumulation % splits:
            warnings.warn(
                f"SharedPrefixGRPOTrainer keeps each prompt's rollouts in one micro-batch, and gradient_accumulation_steps="
                f"{accumulation} is not a multiple of steps_per_generation={splits}: an optimizer step then sees part of a "
                "generation batch, whole groups here where stock GRPOTrainer takes a random subset of rows, so the "
                "updates differ from a stock run. For stock TRL's updates, make gradient_accumulation_steps a multiple "
                "of steps_per_generation",
                GroupedMicroBatches, stacklevel=3,
            )
        terms = self.micro_batch_terms()
        if self.args.steps_per_generation > 1 and terms:
            warnings.warn(
                f"SharedPrefixGRPOTrainer keeps each prompt's rollouts in one micro-batch, where stock GRPOTrainer splits "
                f"a shuffled generation batch (steps_per_generation={self.args.steps_per_generation}); "
                f"{'; '.join(terms)} is then computed over other rows and differs from a stock run. For stock TRL's "
                "values, let one micro-batch hold the generation batch (per_device_train_batch_size = generation batch, "
                "steps_per_generation=1), or use a loss normalised over the generation batch (loss_type dapo, dr_grpo, grpo)",
                GroupedMicroBatches, stacklevel=3,
            )

    # ---- reference model -----------------------------------------------------------------------
    def _share_reference_model(self) -> None:
        """Score the reference pass with a patchgen model holding TRL's reference weights, not TRL's upstream-class load.

        TRL loads the reference from the policy's path (``config._name_or_path``) with the class its
        ``architectures`` names in transformers, transformers' own Qwen3.5, so its pass would neither pack
        nor share. A copy of the policy (its generated class, op table and fields) takes that load's
        weights and replaces it: the reference is the checkpoint at the path, as in stock TRL, also when
        the policy's weights moved after loading (an SFT stage in the same process).
        """
        if self.ref_model is None or is_patchgen_model(self.accelerator.unwrap_model(self.ref_model)):
            return
        policy = self.accelerator.unwrap_model(self.model)
        if not is_patchgen_model(policy) or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return  # TRL's reference stays; its pass takes TRL's padded path (warned on first use)
        if self.args.cast_lm_head_to_fp32:
            return  # every pass takes TRL's path (`_cannot_pack`), whose reference casts its head as TRL's policy does
        reference = copy.deepcopy(policy)
        reference.__dict__.pop("forward", None)  # the copied fused head would call the policy's forward
        reference.requires_grad_(False).eval()
        take_weights(reference, self.accelerator.unwrap_model(self.ref_model))
        add_fused_lm_head(reference, temperature=self.temperature)
        # TRL's load is prepared already: accelerate holds it (until Trainer frees its models when training starts), so
        # the device would hold the policy and two references through construction and any evaluation before train()
        loaded = self.ref_model
        self.accelerator._models[:] = [m for m in self.accelerator._models if m is not loaded]  # accelerate 1.x
        self.ref_model = self.accelerator.prepare_model(reference, evaluation_mode=True)
        for callback in self.callback_handler.callbacks:  # TRL's sync_ref_model callback holds the load too
            if hasattr(callback, "ref_model"):
                callback.ref_model = self.ref_model
        del loaded
        gc.collect()  # a bound forward kept on the instance (a fused head, accelerate's autocast) is a cycle
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.info("SharedPrefixGRPOTrainer: reference model is a patchgen copy of the policy with TRL's reference weights")


def take_weights(reference, loaded) -> None:
    """Copy the weights of TRL's reference load into ``reference`` (a copy of the policy), strictly.

    The load has the policy's names, except for a text-only policy loaded from a vision-language checkpoint
    (the published layout), where TRL builds the vision-language class: its text model and LM head are taken.
    """
    def unfit(detail: str) -> ValueError:
        return ValueError(
            f"SharedPrefixGRPOTrainer: TRL's reference model, {type(loaded).__name__} loaded from the policy's path "
            f"{reference.config._name_or_path!r}, does not fit the policy ({type(reference).__name__}): {detail}. The "
            "reference is the checkpoint at that path, as in stock GRPOTrainer: save the policy there (or set "
            "config._name_or_path to its checkpoint) after changing its shapes"
        )

    weights = loaded.state_dict()
    try:
        if weights.keys() == reference.state_dict().keys():
            reference.load_state_dict(weights)
        elif getattr(loaded.config, "text_config", None) is not None and getattr(reference.config, "text_config", None) is None:
            reference.get_decoder().load_state_dict(loaded.get_decoder().state_dict())
            reference.get_output_embeddings().load_state_dict(loaded.get_output_embeddings().state_dict())
        else:
            raise unfit("their weights have other names")
    except RuntimeError as error:  # load_state_dict: a size mismatch, a missing or unexpected weight
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise unfit(lines[1] if len(lines) > 1 else lines[0]) from error  # the first weight that does not fit


def shuffle_keeping_groups(batch: dict) -> dict:
    """TRL's shuffle of a generation batch, keeping the rollouts of one prompt next to each other.

    Draws the same ``torch.randperm`` as TRL (so the random stream, and every later sample, is
    unchanged) and orders whole groups by where their first member lands in it. A prompt's rollouts
    then share a micro-batch whenever the micro-batch size is a multiple of the group size.
    """
    size = len(next(v for v in batch.values() if v is not None))
    permutation = torch.randperm(size).tolist()
    keys = _group_keys(batch, size)
    members: dict = {}
    for index in permutation:
        members.setdefault(keys[index], []).append(index)
    order = [index for group in members.values() for index in group]
    index_tensor = torch.tensor(order)

    def permute(value):
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            return value
        if isinstance(value, torch.Tensor):
            return value[index_tensor.to(value.device)]
        return [value[i] for i in order]

    return {key: permute(value) for key, value in batch.items()}


def _group_keys(batch: dict, size: int) -> list:
    """One hashable key per row: its prompt's real tokens (rows of one prompt share it)."""
    prompt_ids, prompt_mask = batch.get("prompt_ids"), batch.get("prompt_mask")
    if prompt_ids is None:
        return list(range(size))
    ids, mask = prompt_ids.detach().cpu(), None if prompt_mask is None else prompt_mask.detach().cpu().bool()
    return [tuple(ids[i][mask[i]].tolist() if mask is not None else ids[i].tolist()) for i in range(size)]
