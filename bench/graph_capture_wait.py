"""Does capturing, replaying or dropping a CUDA graph make the host wait for work already queued (GPU)?

    python bench/graph_capture_wait.py

The layer graphs capture twice per scoring forward (`kernels/modeling/scoring_layers.py`); in a scoring loop the host
must stay ahead of the device, so a capture that waited for the queue to drain would leave the device idle while the
host does the next forward's first layers. Per case, the host ms of each step of one tiny capture (as the layer graphs
capture: a side stream, one shared memory pool, thread-local capture mode) with the device idle and with about 50 ms
of matmuls queued on the current stream: a step that takes about as long as the queue when busy waits for it.
"""

from __future__ import annotations

import time

import torch

QUEUED_MATMULS = 40  # 8192^3 bf16 matmuls: about 1.3 ms each on an H200


def _ms(since: float) -> float:
    return (time.perf_counter() - since) * 1e3


def one_capture(busy: bool, pool, side, a: torch.Tensor, x: torch.Tensor, held: list) -> dict[str, float]:
    """One capture, replay and drop; `held` keeps the previous capture's graph until this one is captured, as
    `CallGraphs` keeps a replaced graph (a capture into a pool whose last graph is gone fails torch 2.11's host
    allocator's assertion)."""
    torch.cuda.synchronize()
    if busy:
        for _ in range(QUEUED_MATMULS):
            torch.mm(a, a)
    steps = {}
    t = time.perf_counter()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        graph.capture_begin(pool=pool.id, capture_error_mode="thread_local")
        steps["capture_begin"] = _ms(t)
        t = time.perf_counter()
        y = x * 2 + 1
        graph.capture_end()
        steps["capture_end (instantiate)"] = _ms(t)
    t = time.perf_counter()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    steps["replay"] = _ms(t)
    t = time.perf_counter()
    held.append(graph)
    del held[0], graph, y  # the previous capture's graph
    steps["drop"] = _ms(t)
    t = time.perf_counter()
    torch.cuda.synchronize()
    steps["queue left"] = _ms(t)
    return steps


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("graph_capture_wait.py measures CUDA graph captures: it needs a CUDA device")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1 << 20, device="cuda")
    pool, side = torch.cuda.MemPool(), torch.cuda.Stream()
    held = [None]
    one_capture(False, pool, side, a, x, held)  # warm: the kernels, the pool, cuBLAS
    print(f"{torch.cuda.get_device_name()}: host ms per step of one capture, {QUEUED_MATMULS} matmuls queued or none")
    for busy in (False, True, False, True):
        steps = one_capture(busy, pool, side, a, x, held)
        print(f"  {'queued' if busy else 'idle  '}: " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()), flush=True)


if __name__ == "__main__":
    main()
