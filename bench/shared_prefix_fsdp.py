"""Shared-prefix training under FSDP2 data parallel: equal to one device, and per-device throughput.

    torchrun --nproc_per_node=2 bench/shared_prefix_fsdp.py --out DIR            # GPUs (NCCL)
    torchrun --nproc_per_node=2 bench/shared_prefix_fsdp.py --tiny               # CPU smoke test (gloo)

Each rank takes one micro-batch of whole GRPO groups (so no group is split across ranks); the model
is sharded with `fully_shard` per decoder layer and at the root. Rank 0 also runs the unsharded
model over both micro-batches (gradients averaged, as FSDP's reduce-scatter does) and reports the
distance of loss and every gradient. Then both set-ups are timed: tokens per second per device,
FSDP step vs one device's step on one micro-batch.
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from shared_prefix_gpu import MODULE, TINY, WIDTHS, batch, boundary_labels, config_for, packed_kwargs


def step(model, ids, cu, max_len, n_items=None):
    out = model(input_ids=ids, labels=boundary_labels(ids, cu), return_logits=False,
                num_items_in_batch=n_items, **packed_kwargs(cu, max_len))
    out.loss.backward()
    return out.loss.detach()


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", default="8x2048x256", help="n x P x R of the group each rank trains on")
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
    n, p, r = (int(v) for v in args.group.split("x"))
    if args.tiny:
        n, p, r = 4, 160, 24

    module = importlib.import_module(MODULE)
    torch.manual_seed(0)
    with torch.device(device):
        reference = module.Qwen3_5ForCausalLM(config_for(widths, args.layers)).to(dtype)
    reference.config.shared_prefix_training = True
    model = copy.deepcopy(reference)
    for layer in model.model.layers:
        fully_shard(layer, mesh=init_device_mesh(device.type, (world,)))
    fully_shard(model, mesh=init_device_mesh(device.type, (world,)))

    # Rank k's micro-batch: seed k. Every rank builds all of them, for the reference on rank 0.
    micro = [batch([(n, p, r)], [], widths["vocab_size"], device, seed=k) for k in range(world)]
    ids, cu, max_len, _ = micro[rank]
    loss = step(model, ids, cu, max_len)
    losses = [torch.zeros_like(loss) for _ in range(world)]
    dist.all_gather(losses, loss)
    grads = {name: p.grad.full_tensor().float() for name, p in model.named_parameters() if p.grad is not None}

    rows = []
    if rank == 0:
        ref_losses = []
        for k, (ids_k, cu_k, max_k, _) in enumerate(micro):
            ref_losses.append(step(reference, ids_k, cu_k, max_k))
        ref_grads = {name: p.grad.float() / world for name, p in reference.named_parameters() if p.grad is not None}
        loss_diff = max(abs(a.item() - b.item()) for a, b in zip(losses, ref_losses))
        num = sum((grads[k] - ref_grads[k]).pow(2).sum() for k in ref_grads).sqrt()
        den = sum(g.pow(2).sum() for g in ref_grads.values()).sqrt()
        grad_rel = (num / den).item()
        print(f"FSDP2 x{world} vs one device: max |loss diff| {loss_diff:.3e}, gradient rel {grad_rel:.3e} "
              f"({len(ref_grads)} tensors)", flush=True)
        rows.append({"what": "equality", "loss_max_abs": loss_diff, "grad_rel": grad_rel})

    def fsdp_step():
        model.zero_grad(set_to_none=True)
        step(model, ids, cu, max_len)

    fsdp_s = timed(fsdp_step, device, args.repeats)
    dist.barrier()
    single_s = None
    if rank == 0:
        def single_step():
            reference.zero_grad(set_to_none=True)
            step(reference, ids, cu, max_len)

        single_s = timed(single_step, device, args.repeats)
        tokens = ids.shape[1]
        ratio = single_s / fsdp_s
        print(f"tokens per device per step {tokens}: one device {tokens / single_s:.0f} tok/s, FSDP2 x{world} "
              f"{tokens / fsdp_s:.0f} tok/s per device ({ratio:.2f} of one device)", flush=True)
        rows.append({"what": "throughput", "single_s": single_s, "fsdp_s": fsdp_s, "per_device_ratio": ratio})
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with (out / f"fsdp_x{world}_{'cpu-tiny' if args.tiny else 'gpu'}.csv").open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=sorted({k for row in rows for k in row}))
            writer.writeheader()
            writer.writerows(rows)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
