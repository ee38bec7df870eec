"""A training forward on a packed row with `attention_dropout > 0` is warned once: the varlen attention slot has no
dropout (flag on or off). Unpacked rows keep transformers' attention, which applies it, and are not warned."""

import warnings

import pytest
import torch
from patchgen.kernels.modeling import packing

from tests.models import tiny


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(packing, "_dropout_warned", False)


def _packed(net):
    ids, cu, _ = tiny.grpo_batch([(70, [5, 9, 3])], seed=1)
    return net(input_ids=ids, labels=ids, **tiny.packed_kwargs(cu))


@pytest.mark.parametrize("model", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("flag", [False, True])
def test_a_packed_training_row_with_attention_dropout_is_warned_once_at_the_callers_line(model, flag):
    net = tiny.build(model, "gpu", shared_prefix_training=flag, attention_dropout=0.1).train()
    with pytest.warns(packing.AttentionDropoutUnapplied, match="attention_dropout=0.1 is not applied on packed rows") as caught:
        _packed(net)
    assert [w.filename for w in caught if w.category is packing.AttentionDropoutUnapplied] == [__file__]
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        _packed(net)
    assert not [w for w in again if w.category is packing.AttentionDropoutUnapplied]  # once per process


@pytest.mark.parametrize("case", ["eval", "no dropout", "unpacked"])
def test_no_warning_where_nothing_is_dropped_or_transformers_applies_it(case, recwarn):
    net = tiny.build("qwen3_5", "gpu", attention_dropout=0.0 if case == "no dropout" else 0.1)
    net.train(case != "eval")
    if case == "unpacked":
        ids = tiny.packed_batch([20])[0]
        net(input_ids=ids, labels=ids)
    else:
        with torch.no_grad():
            _packed(net)
    assert not [w for w in recwarn if w.category is packing.AttentionDropoutUnapplied]
