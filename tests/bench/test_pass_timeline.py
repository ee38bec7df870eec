"""The pass timeline (`bench/pass_timeline.py`): idle gaps are found where the device waits, and blamed on the host
phase that was running."""

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import pass_timeline
from shared_prefix_timing import Event, events_of

MS = 1_000_000  # ns


def _phase(label, start_ms, length_ms):
    return Event(f"phase: {label}", True, int(start_ms * MS), int(length_ms * MS), "user_annotation")


def _kernel(start_ms, length_ms):
    return Event("kernel", False, int(start_ms * MS), int(length_ms * MS), "kernel")


def test_the_gap_before_the_first_kernel_is_blamed_on_the_phase_that_builds_its_inputs():
    events = [
        _phase("model", 0, 10),
        _phase("plan", 0.5, 2.0),
        Event("cudaStreamSynchronize", True, int(0.6 * MS), int(0.1 * MS), "cuda_runtime"),
        _phase("scoring replay", 3, 0.2),
        _kernel(3.1, 4.0),
        _kernel(7.1, 1.0),  # a 0.0 ms gap: not reported
        _kernel(9.0, 0.5),  # a 0.9 ms gap after the replay
    ]
    t = pass_timeline.timeline(events)
    assert t.first_kernel_ms == pytest.approx(3.1)
    assert t.busy_ms == pytest.approx(5.5)
    assert t.wall_ms == pytest.approx(10.0)
    first, after, tail = t.gaps
    assert (first.start_ms, first.length_ms, first.phase) == (pytest.approx(0.0), pytest.approx(3.1), "model")
    assert (after.start_ms, after.length_ms, after.phase) == (pytest.approx(8.1), pytest.approx(0.9), "model")
    assert tail.length_ms == pytest.approx(0.5)  # the host's own end after the last kernel
    assert [p[0] for p in t.phases] == ["model", "plan", "scoring replay"]


def test_a_gap_inside_a_synchronize_names_the_call():
    events = [_phase("model", 0, 5), _phase("LM head", 1, 3), _kernel(0.0, 1.0),
              Event("cudaStreamSynchronize", True, int(0.5 * MS), int(0.7 * MS), "cuda_runtime"), _kernel(3.0, 2.0)]
    (gap,) = pass_timeline.timeline(events).gaps
    assert gap.phase == "LM head" and gap.call == "cudaStreamSynchronize" and gap.length_ms == pytest.approx(2.0)


def test_a_profile_without_the_phases_is_refused():
    with pytest.raises(ValueError, match="no phase ranges"):
        pass_timeline.timeline([_kernel(0, 1)])


def test_phases_label_a_real_forward_and_put_the_functions_back():
    from tests.models import tiny

    module = tiny.module("qwen3_5", "gpu")
    model = tiny.build("qwen3_5", "gpu")
    before = module.Qwen3_5ForCausalLM.__dict__["forward"], module.causal_lm_head
    ids = torch.randint(0, model.config.vocab_size, (1, 12))
    with pass_timeline.phases(module), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(input_ids=ids)
    labels = {e.name for e in events_of(prof) if e.name.startswith("phase: ")}
    assert {"phase: model", "phase: text model", "phase: LM head", "phase: layer stack", "phase: host rows",
            "phase: verify due", "phase: packed row", "phase: op table"} <= labels
    assert (module.Qwen3_5ForCausalLM.__dict__["forward"], module.causal_lm_head) == before
