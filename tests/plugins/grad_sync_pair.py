"""One rank of a two-rank gloo job that checks train.grad_sync.GradientSync against DDP's own
all-reduce: the same gradients bit for bit, on a model whose buckets take both of the hook's paths
(a small bucket exchanged by all-gather, a large one all-reduced), with the stop-flag parameter in
either kind of bucket (it goes with the last layer); the stop agreed on by both ranks when only
rank 1 got the signal; and the largest copy each step makes (no bucket is copied for the flags). With
--bf16-grads (compress=True) the buckets travel as bfloat16: gradients close to DDP's, not equal, the
same on both ranks (a digest each step), and the stop still agreed.

Run by tests/test_trainer_collectives.py with RANK/WORLD_SIZE/MASTER_* set; prints one JSON line. With
DDPACK_TEST_DEVICE=cuda (tests/test_gpu.py) both ranks share GPU 0 over gloo with CUDA tensors: the hook's
CUDA branch (the collective's future, the flags read a step late through pinned memory).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
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
    device = torch.device(os.environ.get("DDPACK_TEST_DEVICE", "cpu"))
    on_gpu = {"device_ids": [device]} if device.type == "cuda" else {}
    watcher = PreemptionWatcher()
    report: dict[str, object] = {"rank": rank}
    try:
        for name, base in models().items():
            base = base.to(device)
            sync = GradientSync(watcher, world, device)
            hooked = DistributedDataParallel(sync.wrap(copy.deepcopy(base)), bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=True, **on_gpu)
            plain = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=BUCKET_CAP_MB, **on_gpu)
            sync.attach(hooked)
            packing = GradientSync(watcher, world, device, compress=True)
            packed = DistributedDataParallel(packing.wrap(copy.deepcopy(base)), bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=True, **on_gpu)
            packing.attach(packed)
            refused = []
            for other in (
                plain,  # results go into the buckets: a DDP whose gradients are not views of them is refused
                DistributedDataParallel(copy.deepcopy(base), gradient_as_bucket_view=True, **on_gpu),  # and one without the flags
            ):
                try:
                    GradientSync(watcher, world, device).attach(other)
                    refused.append(False)
                except ValueError:
                    refused.append(True)
            gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
            same, polls, calls, largest_copy = [], [], [], []
            packed_close, packed_exact, packed_digests, packed_polls = [], [], [], []
            for step in range(4):
                watcher.received = signal.SIGTERM if rank == 1 and step == 2 else None
                inputs = torch.randn(16, base[0].in_features, generator=gen).to(device)
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
                packed.module.zero_grad(set_to_none=False)
                outputs, flags = packed(inputs)
                packing.carry_flags(outputs.square().mean(), flags).backward()
                packing.finish()
                pairs = list(zip(packed.module.module.parameters(), plain.parameters(), strict=True))
                # bfloat16 keeps 8 bits: each rank's share is rounded by up to 2^-9, so the error is small against the gradient's norm
                packed_close.append(all(torch.linalg.vector_norm(a.grad - b.grad) <= 1e-2 * torch.linalg.vector_norm(b.grad) for a, b in pairs))
                packed_exact.append(all(torch.equal(a.grad, b.grad) for a, b in pairs))
                packed_digests.append(hashlib.sha256(b"".join(a.grad.cpu().numpy().tobytes() for a, _ in pairs)).hexdigest()[:16])
                stop = packing.poll()
                packed_polls.append(stop.name if stop is not None else None)
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
                "packed": {"close": packed_close, "exact": packed_exact, "digests": packed_digests, "polls": packed_polls},
            }
    finally:
        watcher.restore()
    print(json.dumps(report), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
