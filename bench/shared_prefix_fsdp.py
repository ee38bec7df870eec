"""Shared-prefix training under FSDP2 data parallel: equal to one device, and per-device throughput.

    torchrun --nproc_per_node=2 bench/shared_prefix_fsdp.py --out DIR            # GPUs (NCCL)
    torchrun --nproc_per_node=2 bench/shared_prefix_fsdp.py --tiny               # CPU smoke test (gloo)

Each rank takes one micro-batch of whole GRPO groups (so no group is split across ranks); the model
is sharded with `fully_shard` per decoder layer and at the root. Rank 0 also runs the unsharded
model over every rank's micro-batch (gradients averaged, as FSDP's reduce-scatter does) and reports
the distance of loss and every gradient, next to the bf16 noise floor: the same unsharded model's
shared-prefix vs packed distance, two computations equal in exact arithmetic. Then, per group size
in `--groups`, both set-ups are timed: tokens per second per device, FSDP step vs one device's
step on one micro-batch.
"""

from __future__ import annotations

import argparse
import copy
import csv
import functools
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from shared_prefix_arms import MODULE, TINY, WIDTHS, boundary_labels, checkpointed, config_for, packed_kwargs
from shared_prefix_shapes import batch


def step(model, ids, cu, max_len, n_items=None):
    out = model(
        input_ids=ids,
        labels=boundary_labels(ids, cu),
        return_logits=False,
        num_items_in_batch=n_items,
        **packed_kwargs(cu, max_len),
    )
    out.loss.backward()
    return out.loss.detach()


def fresh_step(model, ids, cu, max_len):
    model.zero_grad(set_to_none=True)
    step(model, ids, cu, max_len)


def timed(fn, device, repeats):
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gradients(model, world=1):
    return {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).float() / world
        for name, p in model.named_parameters()
        if p.grad is not None
    }


def grad_rel(a, b):
    num = sum((a[k] - b[k]).pow(2).sum() for k in b).sqrt()
    return (num / sum(g.pow(2).sum() for g in b.values()).sqrt()).item()


def reference_pass(model, micro, flag):
    """Unsharded: losses of every micro-batch and their averaged gradients, flag on or off."""
    model.config.shared_prefix_training = flag
    model.zero_grad(set_to_none=True)
    losses = [step(model, ids, cu, max_len) for ids, cu, max_len, _ in micro]
    grads = gradients(model, len(micro))
    model.zero_grad(set_to_none=True)
    model.config.shared_prefix_training = True
    return losses, grads


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--groups",
        default="8x2048x256,8x4096x512",
        help="n x P x R of the group each rank trains on; the first is also checked for equality",
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)

    import importlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cuda = torch.cuda.is_available() and not args.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    widths = WIDTHS if not args.tiny else TINY
    groups = [tuple(int(v) for v in g.split("x")) for g in args.groups.split(",")]
    if args.tiny:
        groups = [(4, 160, 24), (2, 96, 16)]

    module = importlib.import_module(MODULE)
    torch.manual_seed(0)
    with torch.device(device):
        reference = module.Qwen3_5ForCausalLM(config_for(widths, args.layers)).to(dtype)
    reference.config.shared_prefix_training = True
    checkpointed(reference)
    model = copy.deepcopy(reference)
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    rows = []
    for index, group in enumerate(groups):
        # Rank k's micro-batch: seed k. Every rank builds all of them, for the reference on rank 0.
        micro = [batch([group], [], widths["vocab_size"], device, seed=k) for k in range(world)]
        ids, cu, max_len, _ = micro[rank]
        if index == 0:
            model.zero_grad(set_to_none=True)
            loss = step(model, ids, cu, max_len)
            losses = [torch.zeros_like(loss) for _ in range(world)]
            dist.all_gather(losses, loss)
            grads = gradients(model)
            model.zero_grad(set_to_none=True)
            if rank == 0:
                ref_losses, ref_grads = reference_pass(reference, micro, True)
                packed_losses, packed_grads = reference_pass(reference, micro, False)
                loss_diff = max(abs(a.item() - b.item()) for a, b in zip(losses, ref_losses))
                floor_loss = max(abs(a.item() - b.item()) for a, b in zip(packed_losses, ref_losses))
                rel, floor_rel = grad_rel(grads, ref_grads), grad_rel(packed_grads, ref_grads)
                print(
                    f"FSDP2 x{world} vs one device, group {group}: max |loss diff| {loss_diff:.3e}, gradient rel "
                    f"{rel:.3e} ({len(ref_grads)} tensors); bf16 floor (one device, shared vs packed): loss "
                    f"{floor_loss:.3e}, gradient rel {floor_rel:.3e}",
                    flush=True,
                )
                rows.append(
                    {
                        "what": "equality",
                        "group": "x".join(map(str, group)),
                        "loss_max_abs": loss_diff,
                        "grad_rel": rel,
                        "floor_loss_max_abs": floor_loss,
                        "floor_grad_rel": floor_rel,
                    }
                )

        fsdp_step = functools.partial(fresh_step, model, ids, cu, max_len)
        fsdp_step()  # warm-up: Triton autotune, NCCL communicators
        fsdp_s = timed(fsdp_step, device, args.repeats)
        dist.barrier()
        if rank == 0:
            single_step = functools.partial(fresh_step, reference, ids, cu, max_len)
            single_step()
            single_s = timed(single_step, device, args.repeats)
            reference.zero_grad(set_to_none=True)
            tokens = ids.shape[1]
            ratio = single_s / fsdp_s
            print(
                f"group {group}, {tokens} packed tokens per device per step: one device {tokens / single_s:.0f} "
                f"tok/s, FSDP2 x{world} {tokens / fsdp_s:.0f} tok/s per device ({ratio:.2f} of one device)",
                flush=True,
            )
            rows.append(
                {
                    "what": "throughput",
                    "group": "x".join(map(str, group)),
                    "tokens": tokens,
                    "single_s": single_s,
                    "fsdp_s": fsdp_s,
                    "per_device_ratio": ratio,
                }
            )
        dist.barrier()
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with (out / f"fsdp_x{world}_{'cpu-tiny' if args.tiny else 'gpu'}.csv").open(
            "w", newline=""
        ) as handle:
            writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
            writer.writeheader()
            writer.writerows(rows)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
