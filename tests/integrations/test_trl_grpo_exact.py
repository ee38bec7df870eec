"""SharedPrefixGRPOTrainer against stock trl.GRPOTrainer over several optimizer steps, to float64 rounding, for the
TRL options whose loss reads the scored values in its own way (loss types, truncated completions, entropy terms,
off-policy masks, a synced reference, the composite class).

Stock TRL rounds to float32 in two places that are not the scoring under test: its fused LM head keeps its
log-sum-exp in float32 whatever the model's dtype, and it loads the reference with transformers' own class (norms in
float32). Here the head computes the same values in the model's dtype and the reference is loaded with the
policy's generated class (flag off, padded rows), so the two runs must agree to float64 rounding, step after step,
where test_trl_grpo.py can only ask for float32's.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from tests.integrations import tiny_trl
from tests.models import tiny

trl = pytest.importorskip("trl")

STEPS = 3


class _LogProbsInModelDtype:
    """TRL's ``_ChunkedLogProbFunction`` computed at once in the dtype of its inputs (the same values, unrounded)."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk_size, softcapping, logit_scale, outputs):
        assert softcapping is None
        log_probs = (F.linear(hidden, weight, bias) * logit_scale / temperature).log_softmax(-1)
        picked = log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1) if "entropy" in outputs else None
        return picked, entropy, None, None, None


@pytest.fixture
def exact_stock(monkeypatch):
    import trl.trainer.grpo_trainer as grpo
    from trl.trainer import utils

    monkeypatch.setattr(utils, "_ChunkedLogProbFunction", _LogProbsInModelDtype)
    loaded = {}

    def load_like_the_policy(model_id, **kwargs):
        return loaded["class"].from_pretrained(model_id, dtype=kwargs["dtype"])

    monkeypatch.setattr(grpo, "create_model_from_path", load_like_the_policy)
    return loaded


def _eos_prone(net):
    """Make EOS likely after most hidden states, so some completions end and others are cut at the length limit."""
    with torch.no_grad():
        ids = torch.randint(2, tiny.VOCAB, (4, 20), generator=torch.Generator().manual_seed(5))
        hidden = net.get_decoder()(input_ids=ids).last_hidden_state.reshape(-1, net.config.get_text_config().hidden_size)
        mean = hidden.mean(0)
        net.lm_head.weight[tiny_trl.EOS] = 2.0 * mean / mean.norm() ** 2


def _conditional(flag):
    net = tiny.build_conditional("qwen3_5", "gpu", shared_prefix_training=flag, shared_prefix_min_length=4)
    for config in (net.config, net.config.text_config, net.generation_config):
        config.eos_token_id, config.pad_token_id = tiny_trl.EOS, tiny_trl.PAD
    return net


def _run(trainer_class, flag, tmp_path, exact_stock, eos_prone=False, conditional=False, family="qwen3_5", **extra):
    from datasets import Dataset
    from trl import GRPOConfig

    net = _conditional(flag) if conditional else tiny_trl.model(flag, family=family)
    if eos_prone:
        _eos_prone(net)
    exact_stock["class"] = type(net)
    if extra.get("beta"):
        net.save_pretrained(tmp_path / "policy")
        net.config._name_or_path = str(tmp_path / "policy")
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
        max_completion_length=8, max_steps=STEPS, learning_rate=0.1, optim="sgd", logging_steps=1, report_to="none",
        use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True, bf16=False, dataloader_num_workers=0,
    )
    settings.update(extra)
    # Prompts of one length: stock TRL gives a left-padded row no position_ids, so its rotary positions are shifted by
    # the padding, which changes nothing but its float32 cos / sin rounding (2e-9 on the logits here). The packed
    # scoring of left-padded rows is checked per token in test_trl_grpo.py.
    gen = torch.Generator().manual_seed(0)
    prompts = [" ".join(f"w{int(t)}" for t in torch.randint(2, tiny.VOCAB, (12,), generator=gen)) for _ in range(12)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PrefixesNotShared / GroupedMicroBatches are tested elsewhere
        trainer = trainer_class(
            model=net, reward_funcs=tiny_trl.even_word_reward, args=GRPOConfig(**settings),
            train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tiny_trl.tokenizer(),
        )
    return tiny_trl.train_observing_plans(trainer)


def _assert_equal_to_stock(stock, ours):
    (trainer_a, logs_a, _), (trainer_b, logs_b, plans) = stock, ours
    assert plans and all(p.compact_length < p.packed_length for p in plans)
    assert len(logs_a) == len(logs_b) == STEPS
    for a, b in zip(logs_a, logs_b):
        for key in ("reward", "completions/mean_length", "completions/clipped_ratio"):
            assert a.get(key) == b.get(key), key
        assert a["loss"] == pytest.approx(b["loss"], abs=4 * torch.finfo(torch.float32).eps)  # logged through float32
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-10)
        # logged as means per micro-batch: other rows in ours when TRL splits a shuffled generation batch
        for key in ("kl", "entropy") if trainer_b.args.steps_per_generation == 1 else ():
            if key in a:
                assert a[key] == pytest.approx(b[key], rel=1e-9, abs=1e-15), key
    weights = dict(trainer_a.model.named_parameters())
    for name, p in trainer_b.model.named_parameters():
        diff = (p - weights[name]).abs().max().item()
        assert diff <= 1e-10, f"{name}: {diff:.2e}"


CASES = {
    # the old-policy pass, and rows whose completions were cut at the length limit masked out of the loss
    "cispo_truncated_masked": dict(loss_type="cispo", num_iterations=2, mask_truncated_completions=True, eos_prone=True),
    "sapo_off_policy_mask": dict(loss_type="sapo", num_iterations=2, off_policy_mask_threshold=0.0),
    # the reference pass, mixed into the policy's weights after every step
    "luspo_sequence_synced_reference": dict(
        loss_type="luspo", importance_sampling_level="sequence", beta=0.04, sync_ref_model=True, ref_model_sync_steps=1,
        ref_model_mixup_alpha=0.5,
    ),
    "vespo": dict(loss_type="vespo", num_iterations=2),
    "gspo_two_sided_clip": dict(loss_type="grpo", importance_sampling_level="sequence", num_iterations=2, delta=1.05),
    # terms TRL computes per micro-batch: equal to stock when one micro-batch holds the generation batch
    "entropy_mask_and_bonus": dict(
        top_entropy_quantile=0.5, entropy_coef=0.05, temperature=0.7, per_device_train_batch_size=8,
        gradient_accumulation_steps=1,
    ),
    # a target above the tiny model's entropy (about 5 nats): the bonus applies from the second step, its coefficient
    # moved by the window's entropy
    "adaptive_entropy_one_generation_per_micro_batch": dict(
        use_adaptive_entropy=True, entropy_coef=0.05, entropy_target=10.0, steps_per_generation=1,
    ),
    "conditional_generation_class": dict(conditional=True, beta=0.04, num_iterations=2),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_several_steps_equal_stock_grpo_to_float64_rounding(tmp_path, exact_stock, case):
    from trl import GRPOTrainer

    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    stock = _run(GRPOTrainer, False, tmp_path / "stock", exact_stock, **case)
    ours = _run(SharedPrefixGRPOTrainer, True, tmp_path / "ours", exact_stock, **case)
    _assert_equal_to_stock(stock, ours)
    if case.get("mask_truncated_completions"):
        clipped = [e["completions/clipped_ratio"] for e in ours[1] if "completions/clipped_ratio" in e]
        assert any(0 < c < 1 for c in clipped)  # some completions ended, some were cut and masked
    if case.get("beta"):
        assert ours[0].packed_tokens["ref"] > 0 and any(e["kl"] > 0 for e in ours[1])


def test_the_exact_head_is_trls_head_to_float32_rounding(exact_stock, monkeypatch):
    """The stand-in computes what TRL's fused head computes (the fixture only removes its float32 rounding)."""
    from trl.trainer import utils

    net = tiny_trl.model(False)
    ids = torch.randint(2, tiny.VOCAB, (3, 10), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :4] = -100
    utils.add_fused_lm_head(net, temperature=0.7, outputs=("log_probs", "entropy"))
    exact = net(input_ids=ids, labels=labels, fused_lm_head=True)
    monkeypatch.undo()
    trls = net(input_ids=ids, labels=labels, fused_lm_head=True)
    assert not torch.equal(exact.log_probs, trls.log_probs)  # TRL's own head rounds to float32
    assert torch.allclose(exact.log_probs, trls.log_probs.double(), atol=1e-5, rtol=0)
    assert torch.allclose(exact.entropy, trls.entropy.double(), atol=1e-5, rtol=0)
