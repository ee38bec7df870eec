"""M5-M7: LM-head rows scored once per (compact row, label) and the exact loss (float64)."""

import pytest
import torch
import torch.nn.functional as F
from patchgen.kernels.shared_prefix import build_plan, shared_prefix_loss

F64 = {"dtype": torch.float64}
VOCAB = 2000


def tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1000, VOCAB, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def batch(ref):
    pa, pb = tokens(70, 1), tokens(90, 2)
    seqs = [
        pa + tokens(6, 3),
        tokens(15, 4),
        pa + [5],
        [],
        pb + tokens(4, 6),
        pa + tokens(9, 7),
        pb + tokens(2, 8),
    ]
    plan = build_plan(*ref.pack(seqs))
    assert [(g.members, g.prefix_length) for g in plan.groups] == [((0, 2, 5), 70), ((4, 6), 90)]
    return plan, seqs


def nll_and_entropy(hidden, weight, labels):
    logits = hidden @ weight.T
    logp = logits.log_softmax(-1)
    nll = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
    return nll, -(logp.exp() * logp).sum(-1)


def run_both(plan, shift_labels, d=5):
    hidden = torch.randn(1, plan.compact_length, d, **F64, requires_grad=True)
    weight = torch.randn(VOCAB, d, **F64, requires_grad=True)
    rows = plan.lm_rows(shift_labels)
    nll_l, ent_l = nll_and_entropy(rows.select(hidden)[0], weight, rows.labels)
    compact = rows.expand(nll_l), rows.expand(ent_l)
    packed = nll_and_entropy(plan.expand(hidden)[0], weight, shift_labels[0])
    return hidden, weight, rows, nll_l, compact, tuple(x.unsqueeze(0) for x in packed)


def expected_rows(plan):
    return plan.packed_length - sum((len(g.members) - 1) * (g.prefix_length - 1) for g in plan.groups)


def test_m5_log_probs_entropy_and_row_count(batch, ref):
    plan, seqs = batch
    shift = ref.shifted_labels(seqs)
    hidden, weight, rows, _, (nll_c, ent_c), (nll_p, ent_p) = run_both(plan, shift)
    assert rows.length == expected_rows(plan) == rows.rows.numel() == rows.labels.numel()
    assert nll_c.shape == (1, plan.packed_length)
    torch.testing.assert_close(nll_c, nll_p, rtol=0, atol=1e-10)
    torch.testing.assert_close(ent_c, ent_p, rtol=0, atol=1e-10)
    w = torch.randn_like(nll_p)
    grads_c = torch.autograd.grad(((nll_c + ent_c) * w).sum(), [hidden, weight])
    grads_p = torch.autograd.grad(((nll_p + ent_p) * w).sum(), [hidden, weight])
    for a, b in zip(grads_c, grads_p):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    rows.check_labels()


@pytest.mark.parametrize("num_items", [None, 37])
def test_m6_loss_with_masked_prompt(batch, ref, num_items):
    plan, seqs = batch
    prompt = [70, 15, 70, 0, 90, 70, 90]
    shift = ref.shifted_labels(seqs, prompt_lengths=prompt)
    hidden, weight, _, _, (nll_c, _), (nll_p, _) = run_both(plan, shift)
    valid = shift != -100
    packed = nll_p[valid].sum() / (valid.sum() if num_items is None else num_items)
    loss = shared_prefix_loss(nll_c, shift, num_items_in_batch=num_items)
    torch.testing.assert_close(loss, packed, rtol=0, atol=1e-10)
    for a, b in zip(
        torch.autograd.grad(loss, [hidden, weight]), torch.autograd.grad(packed, [hidden, weight])
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_m7_loss_with_valid_prompt_labels(batch, ref):
    plan, seqs = batch
    shift = ref.shifted_labels(seqs)  # the prompt is trained on too (SFT, multi-turn)
    hidden, weight, rows, nll_l, (nll_c, _), (_nll_p, _) = run_both(plan, shift)
    packed = F.cross_entropy((plan.expand(hidden)[0] @ weight.T), shift[0], ignore_index=-100)
    naive_valid = rows.labels != -100
    naive = nll_l[naive_valid].sum() / naive_valid.sum()
    assert (
        abs(float(naive.detach() - packed.detach())) > 1e-3
    )  # each shared prompt token counted once instead of n times
    loss = shared_prefix_loss(nll_c, shift)
    torch.testing.assert_close(loss, packed, rtol=0, atol=1e-10)
    for a, b in zip(
        torch.autograd.grad(loss, [hidden, weight]), torch.autograd.grad(packed, [hidden, weight])
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_valid_labels_differing_inside_a_shared_prefix_are_detected(batch, ref):
    plan, seqs = batch
    shift = ref.shifted_labels(seqs)
    at = plan.layout.cu[2] + 3
    shift[0, at] = -100  # member 2 masks one prompt label, member 1 does not: allowed
    plan.lm_rows(shift).check_labels()
    shift[0, at] = int(shift[0, plan.layout.cu[0] + 3]) + 1  # two members, two different valid labels
    with pytest.raises(ValueError, match="differ"):
        plan.lm_rows(shift).check_labels()


def test_an_entry_scores_the_label_of_any_member_that_has_one(batch, ref):
    plan, seqs = batch
    shift = ref.shifted_labels(seqs)
    first, second = plan.layout.cu[0], plan.layout.cu[2]  # sequences 0 and 2 share prompt pa
    shift[0, first + 3] = -100  # the first member masks the row, the second keeps it
    rows = plan.lm_rows(shift)
    entry = rows.inverse[first + 3]
    assert rows.inverse[second + 3] == entry and rows.labels[entry] == shift[0, second + 3]


def test_labels_of_the_wrong_length_are_refused(batch):
    plan, _ = batch
    with pytest.raises(ValueError, match="positions"):
        plan.lm_rows(torch.zeros(1, plan.packed_length - 1, dtype=torch.long))
