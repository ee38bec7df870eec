"""SharedPrefixGRPOTrainer against stock trl.GRPOTrainer: same losses, rewards, gradient norms, weights."""

import pytest
import torch

from tests.integrations import tiny_trl

trl = pytest.importorskip("trl")


def _config(tmp_path, **extra):
    from trl import GRPOConfig

    base = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2,
        max_completion_length=8, max_steps=2, learning_rate=0.1, optim="sgd", logging_steps=1, report_to="none", use_cpu=True,
        seed=0, save_strategy="no", disable_tqdm=True, bf16=False, dataloader_num_workers=0,
    )
    base.update(extra)
    return GRPOConfig(**base)


def _train(trainer_class, flag, tmp_path, family="qwen3_5", **extra):
    net = tiny_trl.model(flag, family=family)
    if extra.get("beta"):
        # Stock TRL loads its reference model from the policy's path (transformers' own class).
        net.save_pretrained(tmp_path / "policy")
        net.config._name_or_path = str(tmp_path / "policy")
    trainer = trainer_class(
        model=net, reward_funcs=tiny_trl.even_word_reward, args=_config(tmp_path, **extra),
        train_dataset=tiny_trl.prompts(8, 12), processing_class=tiny_trl.tokenizer(),
    )
    from patchgen.kernels.modeling.shared_prefix import observe_plans

    plans = []
    with observe_plans(lambda plan, tokens: plans.append(plan)):
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, logs, [p for p in plans if p is not None]


def _assert_same_run(stock, ours):
    (_, logs_a, _), (trainer_b, logs_b, _) = stock, ours
    assert len(logs_a) == len(logs_b) == 2
    for a, b in zip(logs_a, logs_b):
        for key in ("reward", "completions/mean_length"):
            assert a.get(key) == b.get(key), key
        # Stock TRL's fused LM head keeps its log-sum-exp in float32 even for a float64 model, and
        # Trainer sums micro-batch losses in a float32 tensor; ours is float64 throughout. So the two
        # runs agree to float32 rounding (the float64 scoring itself is checked exactly below).
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6), "grad_norm"
        assert a["loss"] == pytest.approx(b["loss"], abs=4 * torch.finfo(torch.float32).eps), "loss"
    # Plain SGD: Adam's first step is sign(grad), which turns rounding-level gradients into whole steps.
    weights_a = dict(stock[0].model.named_parameters())
    for name, p in trainer_b.model.named_parameters():
        assert torch.allclose(p, weights_a[name], atol=1e-8, rtol=0), (name, (p - weights_a[name]).abs().max().item())


def test_losses_rewards_grad_norms_and_weights_equal_stock_grpo(tmp_path):
    """Sampling temperature 0.7 (TRL scores logits / temperature; checked exactly per token below)."""
    from trl import GRPOTrainer

    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    stock = _train(GRPOTrainer, False, tmp_path / "stock", temperature=0.7)
    ours = _train(SharedPrefixGRPOTrainer, True, tmp_path / "ours", temperature=0.7)
    _assert_same_run(stock, ours)
    assert not stock[2]  # stock TRL never reaches the model's plan
    assert ours[2] and all(p.compact_length < p.packed_length for p in ours[2])
    assert ours[0].packed_tokens["policy"] > 0


def test_old_log_prob_pass_is_packed_and_shared(tmp_path):
    """num_iterations=2: TRL scores the old policy once per generation batch and reuses the batch."""
    from patchgen.kernels.shared_prefix.plan_reuse import PLANS
    from trl import GRPOTrainer

    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    extra = dict(num_iterations=2)
    stock = _train(GRPOTrainer, False, tmp_path / "stock", **extra)
    hits = PLANS.hits
    ours = _train(SharedPrefixGRPOTrainer, True, tmp_path / "ours", **extra)
    _assert_same_run(stock, ours)
    assert ours[0].packed_tokens["old"] > 0
    # the second iteration trains on the buffered micro-batches again: their plans are handed out again
    assert PLANS.hits - hits >= 2


@pytest.mark.parametrize("sync", [False, True], ids=["fixed reference", "sync_ref_model"])
def test_reference_pass_is_a_patchgen_copy_and_shared(tmp_path, monkeypatch, sync):
    import weakref

    import trl.trainer.grpo_trainer as grpo

    from patchgen.integrations.trl import SharedPrefixGRPOTrainer, is_patchgen_model

    loads, load = [], grpo.create_model_from_path

    def watched_load(*args, **kwargs):
        model = load(*args, **kwargs)
        loads.append(weakref.ref(model))
        return model

    monkeypatch.setattr(grpo, "create_model_from_path", watched_load)
    net = tiny_trl.model(True)
    path = tmp_path / "ckpt"
    net.save_pretrained(path)
    net.config._name_or_path = str(path)
    trainer = SharedPrefixGRPOTrainer(
        model=net, reward_funcs=tiny_trl.even_word_reward, args=_config(tmp_path / "out", beta=0.1, max_steps=1, sync_ref_model=sync),
        train_dataset=tiny_trl.prompts(8, 12), processing_class=tiny_trl.tokenizer(),
    )
    assert is_patchgen_model(trainer.ref_model) and trainer.ref_model is not net
    # TRL's own load of the reference is freed at once, not held beside the copy until train() frees models
    assert all(is_patchgen_model(trainer.accelerator.unwrap_model(m)) for m in trainer.accelerator._models)
    assert len(loads) == 1 and loads[0]() is None
    trainer.train()
    assert trainer.packed_tokens["ref"] > 0
    kl = [entry["kl"] for entry in trainer.state.log_history if "kl" in entry]
    assert kl and kl[0] == pytest.approx(0.0, abs=1e-12)  # first step: policy == reference


def test_with_an_fp32_head_the_reference_stays_trls_as_every_pass_takes_trls_path(tmp_path):
    from patchgen.integrations.trl import SharedPrefixGRPOTrainer, is_patchgen_model

    net = tiny_trl.model(True)
    net.save_pretrained(tmp_path / "ckpt")
    net.config._name_or_path = str(tmp_path / "ckpt")
    trainer = SharedPrefixGRPOTrainer(
        model=net, reward_funcs=tiny_trl.even_word_reward,
        args=_config(tmp_path / "out", beta=0.1, max_steps=1, cast_lm_head_to_fp32=True),
        train_dataset=tiny_trl.prompts(8, 12), processing_class=tiny_trl.tokenizer(),
    )
    # a copy made here would miss the policy's fp32 head: its log-probs would differ from the policy's before any update
    assert not is_patchgen_model(trainer.accelerator.unwrap_model(trainer.ref_model))


def test_rollouts_of_a_prompt_stay_in_one_micro_batch_when_trl_shuffles():
    from patchgen.integrations.trl import shuffle_keeping_groups

    prompts = torch.tensor([[5, 6], [5, 6], [7, 8], [7, 8], [0, 9], [0, 9]])
    batch = {"prompt_ids": prompts, "prompt_mask": torch.tensor([[1, 1]] * 4 + [[0, 1]] * 2),
             "advantages": torch.arange(6.0), "num_items_in_batch": torch.tensor(12), "names": list("abcdef")}
    torch.manual_seed(3)
    expected_permutation = torch.randperm(6)
    after_trl = torch.rand(3)
    torch.manual_seed(3)
    out = shuffle_keeping_groups(batch)
    assert torch.equal(torch.rand(3), after_trl)  # the random stream advanced exactly as TRL's shuffle does
    rows = out["prompt_ids"].tolist()
    assert all(rows[i] == rows[i + 1] for i in (0, 2, 4))
    assert out["names"] == [chr(ord("a") + int(i)) for i in out["advantages"]]
    assert out["num_items_in_batch"] == 12
    first = int(expected_permutation[0])
    assert out["advantages"][0] == first  # the group of TRL's first pick leads


def test_a_path_instead_of_a_model_names_the_fix():
    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    with pytest.raises(TypeError, match="patchgen model instance"):
        SharedPrefixGRPOTrainer(model="Qwen/Qwen3.5-0.8B", reward_funcs=tiny_trl.even_word_reward)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_scoring_equals_each_padded_row_scored_alone_in_float64(tmp_path, temperature):
    """Log-probs and entropies put back in TRL's [B, K] layout, against a float64 reference per row."""
    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    net = tiny_trl.model(True)
    trainer = SharedPrefixGRPOTrainer(
        model=net, reward_funcs=tiny_trl.even_word_reward, args=_config(tmp_path, temperature=temperature),
        train_dataset=tiny_trl.prompts(8, 12), processing_class=tiny_trl.tokenizer(),
    )
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 100, (10,), generator=gen)
    rows, masks = [], []
    for pad_left, length in [(0, 6), (0, 3), (2, 6), (0, 1)]:  # left-padded prompts, right-padded completions
        completion = torch.randint(2, 100, (6,), generator=gen)
        ids = torch.cat([torch.zeros(pad_left, dtype=torch.long), prompt[pad_left:], completion])
        mask = torch.cat([torch.zeros(pad_left), torch.ones(10 - pad_left), torch.ones(length), torch.zeros(6 - length)])
        rows.append(ids)
        masks.append(mask.long())
    input_ids, attention_mask = torch.stack(rows), torch.stack(masks)
    logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, 6, compute_entropy=True
    )
    for b in range(4):
        real = attention_mask[b].bool()
        first = int(real.nonzero()[0])
        logits = net(input_ids=input_ids[b : b + 1, real]).logits[0] / temperature
        logp_all = logits.log_softmax(-1)
        for k in range(6):
            col = 10 + k
            if not attention_mask[b, col]:
                assert logps[b, k] == 0 and entropies[b, k] == 0
                continue
            pos = col - 1 - first  # the position that predicts column `col`
            assert torch.allclose(logps[b, k], logp_all[pos, input_ids[b, col]], atol=1e-12, rtol=0)
            assert torch.allclose(entropies[b, k], -(logp_all[pos].exp() * logp_all[pos]).sum(), atol=1e-12, rtol=0)


def test_moe_load_balancing_loss_equals_stock_when_one_micro_batch_holds_the_generation_batch(tmp_path):
    """The MoE auxiliary loss is a statistic of the micro-batch: with one micro-batch, stock and ours see the same rows."""
    from trl import GRPOTrainer

    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    extra = dict(per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=1)
    (_, stock, _) = _train(GRPOTrainer, False, tmp_path / "stock", family="qwen3_5_moe", **extra)
    (trainer, ours, plans) = _train(SharedPrefixGRPOTrainer, True, tmp_path / "ours", family="qwen3_5_moe", **extra)
    assert plans and trainer.router_aux_loss_coef > 0
    assert stock[0]["aux_loss"] == pytest.approx(ours[0]["aux_loss"], rel=1e-6)
    assert stock[0]["loss"] == pytest.approx(ours[0]["loss"], abs=4 * torch.finfo(torch.float32).eps)


@pytest.mark.parametrize(
    "extra,term",
    [(dict(loss_type="bnpo"), "bnpo"), (dict(entropy_coef=0.01), "entropy bonus"), (dict(family="qwen3_5_moe"), "load-balancing"),
     (dict(top_entropy_quantile=0.5), "entropy mask of top_entropy_quantile=0.5")],
)
def test_micro_batch_normalised_terms_warn_when_groups_change_the_micro_batches(tmp_path, extra, term):
    """steps_per_generation > 1: TRL splits a shuffled generation batch; ours keeps each prompt's rollouts together."""
    from patchgen.integrations.trl import GroupedMicroBatches, SharedPrefixGRPOTrainer

    family = extra.pop("family", "qwen3_5")
    with pytest.warns(GroupedMicroBatches, match=term):
        SharedPrefixGRPOTrainer(
            model=tiny_trl.model(True, family=family), reward_funcs=tiny_trl.even_word_reward,
            args=_config(tmp_path, **extra), train_dataset=tiny_trl.prompts(8, 12), processing_class=tiny_trl.tokenizer(),
        )


def test_no_grouping_warning_for_losses_normalised_over_the_generation_batch(tmp_path, recwarn):
    from patchgen.integrations.trl import GroupedMicroBatches, SharedPrefixGRPOTrainer

    SharedPrefixGRPOTrainer(
        model=tiny_trl.model(True), reward_funcs=tiny_trl.even_word_reward, args=_config(tmp_path),
        train_dataset=tiny_trl.prompts(8, 12), processing_class=tiny_trl.tokenizer(),
    )
    assert not [w for w in recwarn if issubclass(w.category, GroupedMicroBatches)]


def test_equal_to_stock_with_reference_model_temperature_and_accumulation_over_shuffled_generations(tmp_path):
    """beta > 0 (reference pass), temperature 0.8, gradient accumulation over steps_per_generation=2 (TRL shuffles)."""
    from trl import GRPOTrainer

    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    extra = dict(beta=0.04, temperature=0.8, steps_per_generation=2, gradient_accumulation_steps=2)
    stock = _train(GRPOTrainer, False, tmp_path / "stock", **extra)
    ours = _train(SharedPrefixGRPOTrainer, True, tmp_path / "ours", **extra)
    _assert_same_run(stock, ours)
    assert ours[2] and ours[0].packed_tokens["ref"] > 0
    kls = [(a["kl"], b["kl"]) for a, b in zip(stock[1], ours[1])]
    assert kls[0] == (0.0, 0.0) and kls[1][0] > 0  # the second step's policy has moved away from the reference
    # KL is a difference of log-probs that stock TRL rounds to float32: equal to that rounding, not to float64's.
    assert kls[1][1] == pytest.approx(kls[1][0], rel=1e-3)


def _trainer(tmp_path, flag=True, min_prefix=4, **extra):
    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    return SharedPrefixGRPOTrainer(
        model=tiny_trl.model(flag, min_prefix=min_prefix), reward_funcs=tiny_trl.even_word_reward,
        args=_config(tmp_path, **extra), train_dataset=tiny_trl.prompts(8, 12), processing_class=tiny_trl.tokenizer(),
    )


def test_the_flag_off_is_warned_at_construction(tmp_path):
    from patchgen.integrations.trl import PrefixesNotShared

    with pytest.warns(PrefixesNotShared, match="shared_prefix_training is off"):
        _trainer(tmp_path, flag=False)


def test_micro_batches_that_cut_through_a_group_are_warned_at_construction(tmp_path):
    from patchgen.integrations.trl import PrefixesNotShared

    with pytest.warns(PrefixesNotShared, match="per_device_train_batch_size=6 is neither a multiple nor a divisor of num_generations=4"):
        _trainer(tmp_path, per_device_train_batch_size=6)


def test_no_sharing_warning_for_whole_groups_per_micro_batch(tmp_path, recwarn):
    from patchgen.integrations.trl import PrefixesNotShared

    _trainer(tmp_path, per_device_train_batch_size=8)
    _trainer(tmp_path, per_device_train_batch_size=2)
    assert not [w for w in recwarn if issubclass(w.category, PrefixesNotShared)]


def _score_policy(trainer, prompt_length=12):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 100, (prompt_length,), generator=gen)
    input_ids = torch.stack([torch.cat([prompt, torch.randint(2, 100, (4,), generator=gen)]) for _ in range(4)])
    trainer.model.train()
    return trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, torch.ones_like(input_ids), 4)


def test_a_training_micro_batch_that_shares_nothing_with_the_flag_on_is_warned_once(tmp_path, recwarn):
    from patchgen.integrations.trl import PrefixesNotShared

    trainer = _trainer(tmp_path, min_prefix=64)  # longer than the 12-token prompt
    _score_policy(trainer)
    _score_policy(trainer)
    warned = [w for w in recwarn if issubclass(w.category, PrefixesNotShared)]
    assert len(warned) == 1
    assert "longest prompt has 12 tokens and shared_prefix_min_length is 64" in str(warned[0].message)


def test_a_micro_batch_that_shares_its_prompt_is_not_warned(tmp_path, recwarn):
    from patchgen.integrations.trl import PrefixesNotShared

    trainer = _trainer(tmp_path, min_prefix=8)
    _score_policy(trainer)
    assert trainer.shared_prefix_tokens["compact"] < trainer.shared_prefix_tokens["packed"]
    assert not [w for w in recwarn if issubclass(w.category, PrefixesNotShared)]


def test_optimizer_steps_over_part_of_a_generation_batch_are_warned(tmp_path):
    """gradient_accumulation_steps=1 with steps_per_generation=2: each step sees whole groups, not TRL's random rows."""
    from patchgen.integrations.trl import GroupedMicroBatches

    with pytest.warns(GroupedMicroBatches, match="gradient_accumulation_steps=1 is not a multiple of steps_per_generation=2"):
        _trainer(tmp_path, gradient_accumulation_steps=1, steps_per_generation=2)


def test_tokens_counted_as_computed_leave_out_a_graph_buckets_padding_rows(tmp_path):
    """With `shared_prefix_cuda_graphs` a plan is padded to its bucket: the padding rows share nothing, so the
    trainer's compact count (and `shared_prefix/packed_over_compact`) is the layout's C, not the padded one."""
    from patchgen.kernels.shared_prefix import build_plan

    trainer = _trainer(tmp_path, min_prefix=8)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1000, 2000, (70,), generator=g)
    seqs = [torch.cat([prompt, torch.randint(1000, 2000, (n,), generator=g)]) for n in (5, 9, 3)]
    ids = torch.cat(seqs).reshape(1, -1)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).to(torch.int32)
    padded = build_plan(ids, cu, pad_to_bucket=True)
    assert padded.compact_length > padded.layout.compact_length == 70 + 5 + 9 + 3
    before = dict(trainer.shared_prefix_tokens)
    trainer._count_plan(padded, ids.shape[1])
    assert trainer.shared_prefix_tokens["compact"] - before.get("compact", 0) == 87
    assert trainer.shared_prefix_tokens["packed"] - before.get("packed", 0) == ids.shape[1]


def test_evaluation_passes_are_counted_as_eval_not_as_an_old_policy_pass(tmp_path):
    """Evaluation scores the policy without gradients; with num_iterations=1 and accumulation covering the generation
    batch there is no old-policy pass, so nothing may be counted under "old"."""
    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    trainer = SharedPrefixGRPOTrainer(
        model=tiny_trl.model(True), reward_funcs=tiny_trl.even_word_reward,
        args=_config(tmp_path, per_device_eval_batch_size=4, num_generations_eval=4),
        train_dataset=tiny_trl.prompts(8, 12), eval_dataset=tiny_trl.prompts(4, 12, seed=1),
        processing_class=tiny_trl.tokenizer(),
    )
    trainer.evaluate()
    assert trainer.packed_tokens["old"] == 0 and trainer.packed_tokens["policy"] == 0
    assert trainer.packed_tokens["eval"] > 0


def _changed_in_memory(net, seed=7):
    """A policy whose weights moved after it was saved (an SFT stage in the same script, say)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def test_reference_is_the_checkpoint_at_the_policys_path_as_in_stock_trl(tmp_path):
    """Stock TRL's reference is the checkpoint at the policy's path, not the weights the policy holds when handed over:
    the patchgen reference takes that checkpoint's weights too, so the KL (and the loss) are stock TRL's."""
    from trl import GRPOTrainer

    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    def run(trainer_class, flag, out):
        net = tiny_trl.model(flag)
        net.save_pretrained(out / "policy")
        net.config._name_or_path = str(out / "policy")
        _changed_in_memory(net)
        trainer = trainer_class(
            # one micro-batch per generation batch: the logged KL, a mean per micro-batch, is then stock TRL's too
            model=net, reward_funcs=tiny_trl.even_word_reward,
            args=_config(out, beta=0.1, max_steps=1, per_device_train_batch_size=8, gradient_accumulation_steps=1),
            train_dataset=tiny_trl.prompts(8, 12), processing_class=tiny_trl.tokenizer(),
        )
        trainer.train()
        return trainer, [e for e in trainer.state.log_history if "loss" in e]

    (_, stock), (trainer, ours) = run(GRPOTrainer, False, tmp_path / "stock"), run(SharedPrefixGRPOTrainer, True, tmp_path / "ours")
    assert trainer.packed_tokens["ref"] > 0
    assert stock[0]["kl"] > 1e-3  # the policy starts away from its reference
    # KL is a difference of log-probs that stock TRL rounds to float32
    assert ours[0]["kl"] == pytest.approx(stock[0]["kl"], rel=1e-6)
    assert ours[0]["loss"] == pytest.approx(stock[0]["loss"], rel=1e-6)


def test_a_text_policy_from_a_composite_checkpoint_gets_the_checkpoints_text_weights_as_reference(tmp_path):
    """The published layout: ForCausalLM loaded from a ForConditionalGeneration checkpoint, for which TRL loads the
    vision-language class as the reference; the patchgen reference is the text model with that load's weights."""
    from patchgen.integrations.trl import SharedPrefixGRPOTrainer, is_patchgen_model
    from tests.models import tiny

    composite = tiny.build_conditional("qwen3_5", "gpu")
    composite.save_pretrained(tmp_path / "ckpt")
    net = type(tiny_trl.model(True)).from_pretrained(tmp_path / "ckpt", dtype=torch.float64)
    net.config.shared_prefix_training, net.config.shared_prefix_min_length = True, 4
    net.config.eos_token_id, net.config.pad_token_id = tiny_trl.EOS, tiny_trl.PAD
    saved = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    _changed_in_memory(net)
    trainer = SharedPrefixGRPOTrainer(
        model=net, reward_funcs=tiny_trl.even_word_reward, args=_config(tmp_path / "out", beta=0.1, max_steps=1),
        train_dataset=tiny_trl.prompts(8, 12), processing_class=tiny_trl.tokenizer(),
    )
    reference = trainer.accelerator.unwrap_model(trainer.ref_model)
    assert is_patchgen_model(reference) and type(reference) is type(net)
    differing = [name for name, tensor in reference.state_dict().items() if not torch.equal(tensor, saved[name])]
    assert not differing, differing[:3]


def test_a_reference_checkpoint_that_does_not_fit_the_policy_is_refused_naming_the_path(tmp_path):
    """Stock TRL would score with the checkpoint at the path; a policy resized since cannot take its weights."""
    from patchgen.integrations.trl import SharedPrefixGRPOTrainer
    from tests.models import tiny

    net = tiny_trl.model(True)
    net.save_pretrained(tmp_path / "policy")
    net.config._name_or_path = str(tmp_path / "policy")
    net.resize_token_embeddings(tiny.VOCAB + 8)
    with pytest.raises(ValueError, match=r"does not fit the policy .*size mismatch.*save the policy there"):
        SharedPrefixGRPOTrainer(
            model=net, reward_funcs=tiny_trl.even_word_reward, args=_config(tmp_path / "out", beta=0.1, max_steps=1),
            train_dataset=tiny_trl.prompts(8, 12), processing_class=tiny_trl.tokenizer(),
        )
