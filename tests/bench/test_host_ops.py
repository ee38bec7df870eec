"""The CPU host-work bench (`bench/shared_prefix_host_ops.py`): it counts what it says it counts."""

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import host_ops
import shared_prefix_host_ops


def _counts(fn, *args):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(*args)
    return host_ops.count_events(prof.events())


def test_a_gather_a_cat_and_a_scatter_are_launches_views_are_not():
    x = torch.randn(6, 4, requires_grad=True)
    index = torch.tensor([0, 2, 2, 5])

    def step(x):
        y = torch.cat([x.index_select(0, index), x[1:3]]).t().reshape(-1)  # gather, slice, cat, views
        y.sum().backward()

    counts = _counts(step, x)
    assert counts.by_op["forward"]["aten::index_select"] == 1
    assert counts.by_op["forward"]["aten::cat"] == 1
    assert not any(op in counts.by_op["forward"] for op in ("aten::t", "aten::slice", "aten::view"))
    assert counts.by_op["backward"]["aten::index_select_backward"] == 2  # zeros + index_add_
    assert counts.slot_calls == {"forward": 0, "backward": 0}


def test_a_slot_is_one_call_each_way_and_its_inside_is_not_glue():
    slot = host_ops._Slot("rms_norm", lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w)
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)

    def step():
        out = slot(x, w)
        out.sum().backward()

    counts = _counts(step)
    assert counts.slot_calls == {"forward": 1, "backward": 1}
    assert counts.total() <= 2  # the loss's sum and its backward fill; nothing of the slot's own math
    expected = torch.autograd.grad((x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w).sum(), (x, w))
    assert torch.allclose(x.grad, expected[0]) and torch.allclose(w.grad, expected[1])


def test_host_reads_are_found_with_their_call_site_and_host_copies_are_free():
    reads = host_ops.HostReads()
    t = torch.arange(4)
    with reads:
        host = t.cpu()
        int(host[0]), host.tolist()  # reads of a host copy cost nothing
        t.sum().item()
    sites = {name for name, _ in reads.sites}
    assert sites == {"cpu", "item"}
    assert all("test_host_ops.py" in site for _, site in reads.sites)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("host_ops") / "report.txt"
    results = shared_prefix_host_ops.main(["--shape", "2x70x4", "--repeats", "1", "--out", str(out)])
    return results, out.read_text()


def test_the_aligned_plan_cuts_the_gdn_layers_gathers_and_scatters(report):
    results, text = report
    gdn = {arm: sum(shared_prefix_host_ops.per_layer(results, "gdn", arm, ph) for ph in ("forward", "backward"))
           for arm in shared_prefix_host_ops.ARMS}
    assert gdn["packed"] < gdn["aligned"] < gdn["shared"]
    ops = shared_prefix_host_ops.layer_ops(results, "gdn", "aligned")
    assert ops["for aten::index_select"] < shared_prefix_host_ops.layer_ops(results, "gdn", "shared")["for aten::index_select"]
    assert "per GDN layer, forward" in text and "host reads in one shared step" in text


def test_every_arm_calls_the_same_slots_in_an_attention_layer(report):
    results, _ = report
    calls = {arm: results["attn"][arm]["counts"].total("slot_calls") - results["base"][arm]["counts"].total("slot_calls")
             for arm in shared_prefix_host_ops.ARMS}
    assert len(set(calls.values())) == 1 and calls["packed"] > 0
