"""One process on GPU 0: form an NCCL group on a store as --recovery does, abort and destroy it (train.recovery.tear_down),
form the next generation's on the same store, all-reduce on each; prints one JSON report (tests/test_gpu.py)."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from train.distributed import free_port
from train.recovery import NCCL_ERROR_HANDLING, join_group, tear_down


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), None, True, wait_for_workers=False)
    sums, seconds = [], []
    for generation in range(2):
        if generation:
            started = time.monotonic()
            tear_down("nccl")
            seconds.append(time.monotonic() - started)
        join_group(dist.PrefixStore(f"gen{generation}/", store), generation=generation, rank=0, world_size=1, backend="nccl", device=device, timeout_s=5)
        tensor = torch.full((4,), float(generation + 1), device=device)
        dist.all_reduce(tensor)
        sums.append(tensor.sum().item())
    tear_down("nccl")
    print(json.dumps({"sums": sums, "abort_s": seconds[0], "error_handling": os.environ.get(NCCL_ERROR_HANDLING)}), flush=True)


if __name__ == "__main__":
    main()
