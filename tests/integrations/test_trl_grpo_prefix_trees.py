"""SharedPrefixGRPOTrainer on a system-prompt batch (a prefix tree: one system prompt, two prompts, four
rollouts each), flag on vs off, in float64: TRL's GRPO loss variants give the same losses, gradient norms
and weights to float64 rounding, and ``shared_prefix_max_depth=1`` (the one-level plan) does too."""

import os
import tempfile
import warnings

import pytest
import torch

from tests.integrations import tiny_trl
from tests.models import tiny

trl = pytest.importorskip("trl")

SYSTEM, OWN = 70, 66  # tokens: both above one GDN chunk, so the tree keeps the system prompt as its own node


def _prompts(count=2, seed=0):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(seed)
    words = lambda n: [f"w{int(t)}" for t in torch.randint(2, tiny.VOCAB, (n,), generator=gen)]
    system = words(SYSTEM)
    return Dataset.from_dict({"prompt": [" ".join(system + words(OWN)) for _ in range(count)]})


def _run(flag, family="qwen3_5", max_depth=4, steps=2, **extra):
    from trl import GRPOConfig

    from patchgen.integrations.trl import SharedPrefixGRPOTrainer

    net = tiny_trl.model(flag, family=family)
    net.config.shared_prefix_max_depth = max_depth
    net.config.shared_prefix_level_cost = 0  # a level pays whatever it saves: the tree is used on this tiny batch
    settings = dict(
        # nothing is saved; a relative path would leave a folder in the checkout
        output_dir=os.path.join(tempfile.gettempdir(), "patchgen-grpo-tree"),
        per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=1,
        max_completion_length=6, max_steps=steps, learning_rate=0.1, optim="sgd", logging_steps=1, report_to="none",
        use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True, bf16=False, dataloader_num_workers=0,
    )
    settings.update(extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PrefixesNotShared for the flag off
        trainer = SharedPrefixGRPOTrainer(
            model=net, reward_funcs=tiny_trl.even_word_reward, args=GRPOConfig(**settings), train_dataset=_prompts(),
            processing_class=tiny_trl.tokenizer(),
        )
    return tiny_trl.train_observing_plans(trainer)


def _assert_equal_runs(off, on):
    (trainer_off, logs_off, _), (trainer_on, logs_on, _) = off, on
    assert len(logs_off) == len(logs_on) == trainer_off.args.max_steps
    for a, b in zip(logs_off, logs_on):
        assert a.get("reward") == b.get("reward") and a.get("completions/mean_length") == b.get("completions/mean_length")
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-12)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-10)
    weights = dict(trainer_off.model.named_parameters())
    for name, p in trainer_on.model.named_parameters():
        diff = (p - weights[name]).abs().max().item()
        assert diff <= 1e-10, f"{name}: {diff:.2e}"


def _nodes(plans):
    return {len(plan.nodes) for plan in plans}


LOSSES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    # the old-policy pass, and accumulation over a generation batch split in two (whole groups each)
    "dapo_iterations_accumulation": dict(
        loss_type="dapo", num_iterations=2, per_device_train_batch_size=4, steps_per_generation=2,
        gradient_accumulation_steps=2,
    ),
}


@pytest.mark.parametrize("variant", LOSSES.values(), ids=LOSSES.keys())
def test_grpo_loss_variants_on_a_prefix_tree_equal_the_flag_off(variant):
    """One optimizer step (two to reuse the generation batch); the default dapo, over two steps, is the test below."""
    steps = 2 if variant.get("num_iterations", 1) > 1 else 1
    off, on = _run(False, steps=steps, **variant), _run(True, steps=steps, **variant)
    assert on[2] and not off[2]
    one_group = variant.get("per_device_train_batch_size") == 4  # a micro-batch holds one prompt's rollouts
    assert _nodes(on[2]) == ({1} if one_group else {3})  # the system prompt and each prompt: one node each
    _assert_equal_runs(off, on)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_max_depth_one_runs_the_one_level_plan_and_equals_the_tree_and_the_flag_off(float64_router, family):
    off, tree, flat = _run(False, family), _run(True, family), _run(True, family, max_depth=1)
    assert _nodes(tree[2]) == {3} and _nodes(flat[2]) == {2}
    assert min(p.compact_length for p in tree[2]) < min(p.compact_length for p in flat[2])
    _assert_equal_runs(off, tree)
    _assert_equal_runs(off, flat)
