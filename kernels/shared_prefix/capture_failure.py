"""What a CUDA graph capture that raised leaves behind on its device, put right.

A capture can fail after torch has changed state that only a capture that ends well changes back:

- the device's random generator: torch before 2.13 puts it into capture mode early in `capture_begin` (before its
  checks of the stream and the memory pool, and before CUDA's capture begins) and back only at the end of a
  `capture_end` that succeeds. A capture that fails in between (a pool already recording, a capture CUDA invalidated,
  whose `capture_end` then raises) leaves it in capture mode, and every later random op on that device fails with
  "Offset increment outside graph capture": sampling in generation, dropout in training;
- the caching allocator, still recording to the failed capture's pool (a `capture_end` that raises does so before
  it stops that), and holding the failed graph's filter, which every allocation during a later capture calls, and
  which reads the graph object after it is gone. torch 2.11's pinned-host allocator keeps recording to that pool too,
  and nothing in Python ends that: a capture into the same pool is refused ("already recording"), so after a failure
  our graphs capture into a new pool or not at all;
- `torch.cuda.graph`'s stream: where `capture_begin` raises inside its `__enter__`, its capture stream stays current.

`restore_after_failed_capture` mends all three, where our captures fail (`CallGraphs`, the layer-stack graphs).
Mending the generator keeps its seed and offset: a failed capture never advanced the offset the eager ops read, so
the next random op draws what it would have drawn had the capture never been tried.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

IN_CAPTURE_MODE = "Offset increment outside graph capture"


def restore_after_failed_capture(device: torch.device, *, pool=None, stream: torch.cuda.Stream | None = None,
                                 off: str = "turn those CUDA graphs off") -> None:
    """Put `device` back as it was before a capture that raised: `stream` current again where it is not (pass the
    stream that was current before the capture), the allocator no longer recording to `pool` (pass it only where no
    other capture can be recording to it now), the random generator out of capture mode. Call it from the thread
    whose capture failed, outside any capture. A generator that stays in capture mode, or that cannot be checked,
    gets a RuntimeWarning that says so, with `off`: how to keep the failing capture from being tried; the caller's
    own error is never replaced by one of the generator's."""
    device = torch.device(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    device = torch.device("cuda", index)
    if stream is not None and torch.cuda.current_stream(device) != stream:
        torch.cuda.set_stream(stream)
    if pool is not None:
        # "not currently recording": the capture failed before it began recording, or stopped recording itself
        with contextlib.suppress(RuntimeError):
            torch._C._cuda_endAllocateToPool(index, pool)
    with torch.cuda.device(device):  # the failed capture's device, which need not be the current one
        capturing = torch.cuda.is_current_stream_capturing()
    if capturing:  # another capture of this thread's, not ours to end
        return
    try:
        if _mend_generator(torch.cuda.default_generators[index], device):
            return
        state = "in capture mode, and it could not be taken out of it"
    except Exception as error:  # noqa: BLE001 - the caller's own error (or its eager fallback) goes first
        # the probe's draw can fail too: no memory left after the capture, a CUDA error of its own
        state = f"in a state that could not be checked ({type(error).__name__}: {(str(error).splitlines() or [''])[0]})"
    warnings.warn(
        f"a failed CUDA graph capture left {device}'s random generator {state}: random ops on that device may fail. "
        f"Restart the process, and {off}",
        RuntimeWarning,
        stacklevel=2,
    )


def _mend_generator(generator: torch.Generator, device: torch.device) -> bool:
    """Take `generator` out of capture mode where it is in it; whether it is out of it now."""
    if not in_capture_mode(generator, device):
        return True
    with torch.cuda.device(device):
        with contextlib.suppress(Exception):
            _end_capture_mode(device)
        if in_capture_mode(generator, device):
            # a fresh state of the same seed and offset: eager ops work again, but graphs captured before the
            # failure hold the old state and fail at their next replay (they are released with the failed ones)
            generator.graphsafe_set_state(generator.clone_state())
    return not in_capture_mode(generator, device)


def in_capture_mode(generator: torch.Generator, device: torch.device) -> bool:
    """Whether `generator` refuses eager draws because it takes itself to be in a capture (its state is left as it
    was: one draw is made and undone)."""
    state = generator.get_state()
    try:
        torch.empty(1, device=device).uniform_(generator=generator)
    except RuntimeError as error:
        if IN_CAPTURE_MODE in str(error):
            return True
        raise
    finally:
        generator.set_state(state)
    return False


def _end_capture_mode(device: torch.device) -> None:
    """One small capture that ends well: torch takes the generators it armed out of capture mode at its end, the
    default one included, in place, so graphs captured before the failure share a working generator again."""
    probe = torch.zeros(1, device=device)
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            probe.add_(1)  # one kernel: torch warns of an empty capture
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(side)
    graph.reset()
