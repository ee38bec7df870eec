"""The flag on and a training forward that cannot share: warned once, never silently a no-op.

A trainer that calls the backbone through its own LM head (TRL's SFTTrainer, stock GRPOTrainer) or
feeds padded ``[B, L]`` batches gets nothing from ``shared_prefix_training``; the model says so.
"""

import pytest
import torch
from patchgen.kernels.modeling.shared_prefix import SharedPrefixUnused

from tests.models import tiny


def _net(flag=True):
    return tiny.build("qwen3_5", "gpu", shared_prefix_training=flag, shared_prefix_min_length=8).train()


def _packed():
    ids, cu, _ = tiny.grpo_batch([(12, [3, 4])], seed=1)
    return ids, tiny.packed_kwargs(cu)


def _unused(record):
    return [w for w in record if issubclass(w.category, SharedPrefixUnused)]


def test_a_packed_row_given_to_the_backbone_directly_is_warned_once(recwarn):
    net = _net()
    ids, packed = _packed()
    net.model(input_ids=ids, **packed)
    net.model(input_ids=ids, **packed)
    warned = _unused(recwarn)
    assert len(warned) == 1 and "without the model's own forward" in str(warned[0].message)


def test_a_padded_training_batch_is_warned():
    net = _net()
    ids = torch.randint(0, tiny.VOCAB, (2, 16))
    with pytest.warns(SharedPrefixUnused, match=r"not one packed row \(a padded \[B, L\] batch"):
        net(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)


def test_a_packed_row_through_the_model_forward_is_not_warned(recwarn):
    net = _net()
    ids, packed = _packed()
    net(input_ids=ids, labels=ids, **packed)
    single = torch.randint(0, tiny.VOCAB, (1, 20))  # one sequence: nothing to share, decided by the model
    net(input_ids=single, labels=single, cu_seq_lens_q=torch.tensor([0, 20], dtype=torch.int32))
    assert not _unused(recwarn)


def test_no_warning_without_the_flag_in_eval_or_without_grad(recwarn):
    ids = torch.randint(0, tiny.VOCAB, (2, 16))
    _net(flag=False)(input_ids=ids)
    _net().eval()(input_ids=ids)
    with torch.no_grad():
        _net()(input_ids=ids)
    assert not _unused(recwarn)


def test_neftune_noise_runs_packed_with_the_packed_noise_and_is_warned_once(recwarn):
    """Trainer's `neftune_noise_alpha` hooks the embeddings with noise scaled by 1 / sqrt(rows x width): on the
    compact row it would be larger and shared by a prefix's sequences, so those forwards run packed."""
    from patchgen.kernels.modeling.shared_prefix import observe_plans
    from transformers.integrations.neftune import neftune_post_forward_hook

    ids, packed = _packed()
    losses, plans = {}, []
    for flag in (False, True):
        net = _net(flag)
        embeddings = net.get_input_embeddings()
        embeddings.neftune_noise_alpha = 5.0
        handle = embeddings.register_forward_hook(neftune_post_forward_hook)
        torch.manual_seed(7)  # the same noise draw for both runs: same shape, same generator state
        with observe_plans(lambda plan, _tokens: plans.append(plan)):
            losses[flag] = net(input_ids=ids, labels=ids, **packed).loss
            net(input_ids=ids, labels=ids, **packed)  # warned once per model
        handle.remove()
        del embeddings.neftune_noise_alpha  # as Trainer leaves it after training: sharing resumes
        with observe_plans(lambda plan, _tokens: plans.append(plan)):
            net(input_ids=ids, labels=ids, **packed)
    assert torch.equal(losses[True], losses[False])
    # no plan is decided while the noise is on (nor with the flag off): one plan, once the hook is gone
    assert [p is not None for p in plans] == [True]
    (warning,) = _unused(recwarn)
    assert "NEFTune" in str(warning.message) and warning.filename == __file__
