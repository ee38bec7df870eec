"""HF ``Trainer`` with ``DataCollatorWithFlattening`` on multi-turn rows that share a system prompt and
their turns (a prefix tree; one micro-batch, two steps), with the edge rows a real data set has: two identical rows, a row that is
a prefix of another, a response right after the system prompt, responses of one token. Flag on vs off,
float64: losses, gradient norms and weights to float64 rounding, with prompts masked or labelled and
under gradient checkpointing (re-entrant or not)."""

import contextlib
import io

import pytest
import torch

from tests.integrations import tiny_trl
from tests.models import tiny


def _rows(seed=0):
    """Features of ``DataCollatorWithFlattening``: ``input_ids`` and ``labels`` (-100 on the prompt turns)."""
    gen = torch.Generator().manual_seed(seed)
    toks = lambda n: torch.randint(2, tiny.VOCAB, (n,), generator=gen).tolist()
    system = toks(66)
    rows = []
    for _ in range(2):  # two conversations under the system prompt
        prompt = system + toks(65)
        for length in (1, 2):  # each branches at its second turn; responses of one and two tokens
            turn = prompt + toks(64)
            rows.append((turn + toks(length), len(turn)))
    rows.append((system + toks(3), len(system)))  # a response right after the system prompt
    rows.append(rows[0])  # a row seen twice
    rows.append((rows[0][0][:131], 130))  # a row that is a prefix of another
    return rows


def _run(flag, tmp_path, masked=True, max_depth=4, **extra):
    from datasets import Dataset
    from patchgen.kernels.modeling.shared_prefix import observe_plans
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    net = tiny_trl.model(flag)
    net.config.shared_prefix_max_depth = max_depth
    net.config.shared_prefix_level_cost = 0
    rows = _rows()
    labels = [[-100] * prompt + ids[prompt:] if masked else ids for ids, prompt in rows]
    data = Dataset.from_dict({"input_ids": [ids for ids, _ in rows], "labels": labels})
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=len(rows), max_steps=2,
        learning_rate=0.1, optim="sgd", logging_steps=1, report_to="none", use_cpu=True, seed=0, save_strategy="no",
        disable_tqdm=True, remove_unused_columns=False, **extra,
    )
    trainer = Trainer(model=net, args=args, train_dataset=data, data_collator=DataCollatorWithFlattening(return_tensors="pt"))
    plans = []
    with observe_plans(lambda plan, tokens: plans.append(plan)), contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return net, [e for e in trainer.state.log_history if "loss" in e], plans


CASES = {
    "prompts_masked": dict(),
    "prompts_labelled": dict(masked=False),
    "reentrant_checkpointing": dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}),
    "one_level": dict(max_depth=1),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_flattened_multi_turn_rows_share_a_tree_and_equal_the_flag_off(tmp_path, case):
    net_off, logs_off, plans_off = _run(False, tmp_path / "off", **case)
    net_on, logs_on, plans_on = _run(True, tmp_path / "on", **case)
    assert not plans_off  # the flag off plans nothing
    assert len(plans_on) == 2 and all(p is not None and p.compact_length < p.packed_length for p in plans_on)
    # the tree: the system prompt (all 7 rows), each conversation, and the twice-seen row up to its last token;
    # one level: the two conversations
    assert {len(p.nodes) for p in plans_on} == ({2} if case.get("max_depth") == 1 else {4})
    for a, b in zip(logs_off, logs_on):
        assert a["loss"] == pytest.approx(b["loss"], rel=4 * torch.finfo(torch.float32).eps)  # logged in float32
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-10)
    weights = dict(net_off.named_parameters())
    for name, p in net_on.named_parameters():
        diff = (p - weights[name]).abs().max().item()
        assert diff <= 1e-10, f"{name}: {diff:.2e}"
