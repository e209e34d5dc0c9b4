"""One rank of a two-rank gloo job that checks train.grad_sync.GradientSync against DDP's own
all-reduce: the same gradients bit for bit, on a model whose buckets take both of the hook's paths
(a small bucket exchanged by all-gather, a large one all-reduced), with the stop-flag parameter in
either kind of bucket (it goes with the last layer); the stop agreed on by both ranks when only
rank 1 got the signal; and the largest copy each step makes (no bucket is copied for the flags).

Run by tests/test_trainer_collectives.py with RANK/WORLD_SIZE/MASTER_* set; prints one JSON line.
"""

from __future__ import annotations

import copy
import json
import math
import signal
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile

from train.grad_sync import EXCHANGE_MAX_BYTES, GradientSync
from train.signals import PreemptionWatcher

# A bucket closes once it holds this much (8 KiB), so each layer below, 16 KiB or more, gets its own;
# DDP orders buckets from the last layer.
BUCKET_CAP_MB = 8 * 1024 / 2**20


def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {
        # first bucket: the flags and 512x8 weights (16 KiB, exchanged); then 512x512 (1 MiB, all-reduced)
        "small-last": nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8)),
        # first bucket: the flags and 512x512 (all-reduced); then 512x8 (exchanged)
        "large-last": nn.Sequential(nn.Linear(8, 512), nn.ReLU(), nn.Linear(512, 512)),
    }


def layer_bytes(model: nn.Module) -> list[int]:
    """Each layer's gradient bytes, last layer first (DDP's bucket order)."""
    return [sum(p.numel() * p.element_size() for p in m.parameters()) for m in model if isinstance(m, nn.Linear)][::-1]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    watcher = PreemptionWatcher()
    report: dict[str, object] = {"rank": rank}
    try:
        for name, base in models().items():
            sync = GradientSync(watcher, world, torch.device("cpu"))
            hooked = DistributedDataParallel(sync.wrap(copy.deepcopy(base)), bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=True)
            plain = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB)
            sync.attach(hooked)
            refused = []
            for other in (
                plain,  # results go into the buckets: a DDP whose gradients are not views of them is refused
                DistributedDataParallel(copy.deepcopy(base), gradient_as_bucket_view=True),  # and one without the flags
            ):
                try:
                    GradientSync(watcher, world, torch.device("cpu")).attach(other)
                    refused.append(False)
                except ValueError:
                    refused.append(True)
            gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
            same, polls, calls, largest_copy = [], [], [], []
            for step in range(4):
                watcher.received = signal.SIGTERM if rank == 1 and step == 2 else None
                inputs = torch.randn(16, base[0].in_features, generator=gen)
                for model in (hooked, plain):
                    model.module.zero_grad(set_to_none=model is plain)  # the trainer zeroes its bucket views in place
                    if model is hooked:
                        outputs, flags = model(inputs)
                        loss = outputs.square().mean()
                        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                            sync.carry_flags(loss, flags).backward()
                            sync.finish()
                        calls.append(Counter(e.name for e in prof.events() if e.name.startswith("gloo:")))
                        copies = [math.prod(e.input_shapes[0]) for e in prof.events() if e.name == "aten::copy_"]
                        largest_copy.append(max(copies, default=0))
                    else:
                        model(inputs).square().mean().backward()
                # The user's module inside the wrapper against the plain DDP's
                same.append(all(torch.equal(a.grad, b.grad) for a, b in zip(hooked.module.module.parameters(), plain.parameters(), strict=True)))
                agreed = sync.poll()
                polls.append(agreed.name if agreed is not None else None)
            report[name] = {
                "same_grads": same,
                "polls": polls,
                "refuses_copied_gradients": refused,
                "calls": calls,
                "largest_copy_elements": largest_copy,
                "layer_bytes": layer_bytes(base),
                "exchange_max": EXCHANGE_MAX_BYTES,
            }
    finally:
        watcher.restore()
    print(json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
