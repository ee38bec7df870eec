"""What a capture at a pass's first call must not meet (`capture_guard.py`): a Triton kernel to load, which Triton's
hook turns into `NotWarm` in the capturing thread only, and a plan's table to build, which every plan now builds with
itself once the process has asked for it."""

import threading

import pytest
import torch
from patchgen.kernels.shared_prefix import build_plan, capture_guard
from patchgen.kernels.shared_prefix import conv as conv_module

from tests.models.prefix_trees import pack
from tests.shared_prefix.test_tree import tokens

triton = pytest.importorskip("triton")


def _load_hooks():
    from triton import knobs

    return knobs.runtime.kernel_load_start_hook


def test_the_hook_is_added_to_tritons_chain_once_beside_the_others():
    chain = _load_hooks()
    assert capture_guard.available() and capture_guard.available()
    assert chain.calls.count(capture_guard._on_kernel_load) == 1


def test_a_kernel_load_raises_only_in_the_watched_thread_and_only_while_watched():
    assert capture_guard.available()
    chain = _load_hooks()
    chain(None, None, "k", {}, "hash")  # not watched: nothing happens
    elsewhere = []
    with capture_guard.no_new_kernels():
        with pytest.raises(capture_guard.NotWarm, match="Triton kernel k would be compiled or loaded"):
            chain(None, None, "k", {}, "hash")
        # another thread (an eager scoring forward beside the capture) loads its kernels as ever
        thread = threading.Thread(target=lambda: elsewhere.append(chain(None, None, "k", {}, "hash")))
        thread.start()
        thread.join()
        with capture_guard.no_new_kernels():
            pass
        assert capture_guard.guarded()  # a nested guard leaves the outer one on
    assert elsewhere == [None]
    assert not capture_guard.guarded()
    chain(None, None, "k", {}, "hash")


def _plan(rollouts):
    ids, cu = pack([tokens(100, 0) + tokens(9 + i, 1 + i) for i in range(rollouts)])
    return build_plan(ids, cu, max_depth=4, level_cost=0)


def test_a_table_is_never_built_under_a_watched_capture_and_later_plans_build_it_with_themselves(monkeypatch):
    monkeypatch.setattr(conv_module, "_WANTED", {})
    first = _plan(3)
    with capture_guard.no_new_kernels(), pytest.raises(capture_guard.NotWarm, match=r"index \(4, 6, 'fla'\)"):
        first.conv.state_gather(4, 6, "fla")
    assert not first.conv.state_index
    built = first.conv.state_gather(4, 6, "fla")  # an eager call builds it
    later = _plan(4)
    assert set(later.conv.state_index) == {(4, 6, "fla")}  # built with the plan
    with capture_guard.no_new_kernels():
        found = later.conv.state_gather(4, 6, "fla")
    expected = later.conv._state_gather(4, 6, "fla")
    assert all(torch.equal(a, b) for a, b in zip(found, expected))
    assert not all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(found, built))  # its own plan's


def test_a_wider_conv_of_another_model_is_not_built_for_a_narrower_plan(monkeypatch):
    monkeypatch.setattr(conv_module, "_WANTED", {(64, 6, "fla"): None})
    plan = _plan(3)
    assert plan.conv.kernel_size < 64 and not plan.conv.state_index


def test_a_table_that_fails_to_build_fails_its_own_call_only(monkeypatch):
    monkeypatch.setattr(conv_module, "_WANTED", {})
    with pytest.raises(ValueError, match="state layout"):
        _plan(3).conv.state_gather(4, 6, "not_a_layout")
    later = _plan(4)  # the failed key is not built with later plans, which would fail their build
    assert not later.conv.state_index
