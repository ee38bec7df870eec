"""Input builders shared by the Triton kernel tests (tiny shapes: the interpreter is slow)."""

from __future__ import annotations

import torch


def gdn_inputs(lengths, *, H=2, HV=4, K=16, V=32, dtype=torch.float64, device="cpu", with_state=True):
    """Leaf tensors for one packed row of sequences with the given lengths."""
    T = sum(lengths)
    N = len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)

    def leaf(x):
        return x.to(device=device, dtype=dtype).requires_grad_()

    q = leaf(torch.randn(1, T, H, K))
    k = leaf(torch.randn(1, T, H, K))
    v = leaf(torch.randn(1, T, HV, V))
    g = leaf(torch.nn.functional.logsigmoid(torch.randn(1, T, HV)) * 0.5)  # log-decay in (-inf, 0)
    beta = leaf(torch.rand(1, T, HV))
    h0 = torch.randn(N, HV, K, V).to(device=device, dtype=dtype).requires_grad_() if with_state else None
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "h0": h0, "cu": cu}


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def grads(outputs, inputs, cotangents):
    """Gradients of sum(<output, cotangent>) with respect to inputs (None kept for None inputs)."""
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if o is not None]
    loss = sum((o * c).sum() for o, c in pairs)
    wanted = [x for x in inputs if x is not None]
    got = iter(torch.autograd.grad(loss, wanted))
    return [None if x is None else next(got) for x in inputs]
