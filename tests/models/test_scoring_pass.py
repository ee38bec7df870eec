"""The scoring pass of RL (per-token log-probs under no_grad, logits skipped, as the old-policy and reference
passes run): shared equals packed (float64), and the shared head gathers its hidden rows once."""

import pytest
import torch
from patchgen.kernels.modeling.packing import next_token_labels
from patchgen.kernels.shared_prefix import build_plan
from torch.utils._python_dispatch import TorchDispatchMode

from tests.models import tiny

GROUPS = [(80, [10, 20, 15]), (70, [5, 1])]
SINGLES = [30]


class HiddenGathers(TorchDispatchMode):
    """Counts the floating gathers of `[..., hidden]` rows (the LM head's; the mixers gather other widths)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden, self.rows = hidden, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.index_select:
            source = args[0]
            if source.is_floating_point() and source.dim() >= 2 and source.shape[-1] == self.hidden:
                self.rows.append(out.shape[-2])
        return out


def score(flag: bool, ids, cu, labels=None, count: bool = False):
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag)
    gathers = HiddenGathers(net.config.hidden_size)
    with torch.no_grad(), (gathers if count else torch.enable_grad()):
        out = net(input_ids=ids, labels=labels, return_log_probs=True, return_logits=False, **tiny.packed_kwargs(cu))
    return out, gathers.rows


@pytest.mark.parametrize("prompt_labels", [True, False], ids=["ids as labels", "prompts masked"])
def test_shared_scoring_pass_equals_packed(prompt_labels):
    ids, cu, prompt = tiny.grpo_batch(GROUPS, SINGLES, seed=7)
    labels = None if prompt_labels else ids.masked_fill(prompt, -100)
    packed, _ = score(False, ids, cu, labels)
    shared, _ = score(True, ids, cu, labels)
    assert shared.log_probs.dtype == torch.float64
    torch.testing.assert_close(shared.log_probs, packed.log_probs, rtol=0, atol=1e-10)


@pytest.mark.parametrize("prompt_labels", [True, False], ids=["ids as labels", "prompts masked"])
def test_shared_head_gathers_the_scored_rows_once(prompt_labels):
    ids, cu, prompt = tiny.grpo_batch(GROUPS, SINGLES, seed=7)
    labels = None if prompt_labels else ids.masked_fill(prompt, -100)
    _, rows = score(True, ids, cu, labels, count=True)
    plan = build_plan(ids, cu)
    entries = plan.lm_rows(next_token_labels(ids if labels is None else labels, cu, -100))
    scored = int((entries.labels != -100).sum())
    assert scored < entries.length  # some deduplicated rows are owed nothing (each sequence's last token)
    if prompt_labels:
        # targets read off the ids ignore only each sequence's last token: every row in one gather, no count
        assert rows == [entries.length]
    else:
        # one gather of exactly the rows scored: not every deduplicated row, then the labelled ones again
        assert rows == [scored]


class Counts(TorchDispatchMode):
    """Counts `nonzero` (a host sync: its output's size is read back)."""

    def __init__(self):
        super().__init__()
        self.nonzero = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.nonzero += func.overloadpacket is torch.ops.aten.nonzero
        return func(*args, **(kwargs or {}))


def _nonzero_calls(net, ids, cu, labels, never_skip=False):
    """`nonzero` calls of one log-prob pass; `never_skip`: with the head's row count turned off (what the rest
    of the forward, its plan and its boundaries, counts on its own)."""
    from patchgen.kernels.modeling import lm_head

    counts, real = Counts(), lm_head._score_rows
    if never_skip:
        lm_head._score_rows = lambda *args, **kwargs: real(*args[:-1], False)
    try:
        with torch.no_grad(), counts:
            net(input_ids=ids, labels=labels, return_log_probs=True, return_logits=False, **tiny.packed_kwargs(cu))
    finally:
        lm_head._score_rows = real
    return counts.nonzero


@pytest.mark.parametrize("flag", [False, True], ids=["packed", "shared"])
def test_a_log_prob_pass_without_labels_does_not_count_its_rows_on_the_host(flag):
    """After the layers, a count of the labelled rows waits for the device, which then idles while the head is
    launched: worth it when labels mask the prompts (most rows skipped), not for the few sequence ends of ids."""
    ids, cu, prompt = tiny.grpo_batch(GROUPS, SINGLES, seed=7)
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag)
    for labels, head_counts in ((None, 0), (ids.masked_fill(prompt, -100), 1)):
        own = _nonzero_calls(net, ids, cu, labels) - _nonzero_calls(net, ids, cu, labels, never_skip=True)
        assert own == head_counts, "labels" if labels is not None else "ids"


def _head(flag: bool, host, labels, shift_labels, counts):
    """One head call over a tiny model's last hidden states, under no_grad, with `host` as the request's host row."""
    from patchgen.kernels import ops
    from patchgen.kernels.modeling.lm_head import HeadRequest, causal_lm_head

    ids, cu, _ = tiny.grpo_batch(GROUPS, SINGLES, seed=7)
    net = tiny.build("qwen3_5", "gpu", shared_prefix_training=flag)
    plan = build_plan(ids, cu) if flag else None
    hidden = torch.randn(1, plan.compact_length if flag else ids.shape[1], net.config.hidden_size, dtype=torch.float64)
    kwargs = {**tiny.packed_kwargs(cu)} if shift_labels is None else {**tiny.packed_kwargs(cu), "shift_labels": shift_labels}
    with torch.no_grad(), counts:
        return causal_lm_head(
            net.lm_head, ops.of(net), hidden, plan=plan, labels=labels, input_ids=ids, kwargs=kwargs,
            request=HeadRequest(log_probs=True, logits=False, labelled_only=True, host=host),
        )


@pytest.mark.parametrize("flag", [False, True], ids=["packed", "shared"])
@pytest.mark.parametrize("given", ["labels", "shift_labels"])
def test_the_head_counts_the_rows_of_a_host_row_on_the_host(flag, given):
    """A row that came on the host (`host_rows`) has its labels there too: the head counts the rows it owes a
    log-prob there (no `nonzero` after the layers), and scores the same rows."""
    from patchgen.kernels.modeling.host_rows import HostRow

    ids, cu, prompt = tiny.grpo_batch(GROUPS, SINGLES, seed=7)
    labels = ids.masked_fill(prompt, -100)
    shift = next_token_labels(labels, cu)
    args = (labels, None) if given == "labels" else (None, shift)
    host = HostRow(ids, None, cu, *args)
    counted = {}
    for name, given_host in (("device", None), ("host", host)):
        torch.manual_seed(0)  # the same hidden states
        counted[name] = (counts := Counts(), _head(flag, given_host, *args, counts))
    assert counted["host"][0].nonzero == 0 and counted["device"][0].nonzero == 1
    assert torch.equal(counted["host"][1].log_probs, counted["device"][1].log_probs)


def test_a_padded_batch_of_host_rows_counts_its_rows_on_the_host():
    """Rows `[B > 1, T]` (no plan): the host count reads the batch's own shape."""
    from patchgen.kernels import ops
    from patchgen.kernels.modeling.host_rows import HostRow
    from patchgen.kernels.modeling.lm_head import HeadRequest, causal_lm_head

    net = tiny.build("qwen3_5", "gpu")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, net.config.vocab_size, (2, 9), generator=gen)
    shift = ids.roll(-1, 1).masked_fill(torch.arange(9) < 4, -100)
    hidden = torch.randn(2, 9, net.config.hidden_size, dtype=torch.float64, generator=gen)
    outs = []
    for host in (None, HostRow(ids, None, None, shift_labels=shift)):
        with torch.no_grad(), (counts := Counts()):
            out = causal_lm_head(net.lm_head, ops.of(net), hidden, input_ids=ids, kwargs={"shift_labels": shift},
                                 request=HeadRequest(log_probs=True, logits=False, host=host))
        outs.append((counts.nonzero, out.log_probs))
    assert [n for n, _ in outs] == [1, 0] and torch.equal(outs[0][1], outs[1][1])
