"""The preflight's all-reduce figures next to a direct torch.distributed measurement of the same sizes.

Side by side in one run (A B, B A, ... so that neither always goes first; medians of each size's time,
ratios): A is `python -m
train.preflight` as `entrypoint --preflight` runs it on every rank, read from its JSON report; B is a
plain loop here (`--direct`): init_process_group, 5 warm-up all-reduces, then 100 blocking
dist.all_reduce calls each timed with time.perf_counter; the median call, averaged over ranks (the
preflight's statistic, train/preflight/comm.py says why). Target: the two
agree within 10 % at every size.

2 gloo ranks on this machine, OMP_NUM_THREADS=1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_train import RANKS, run_job

SIZES = tuple(8 * 4**i for i in range(12))  # the preflight's sweep: 8 B .. 32 MiB
DIRECT_ITERS = 100


def direct() -> None:
    """One rank of the direct measurement; rank 0 prints {size: seconds per all-reduce}."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    times = {}
    for size in SIZES:
        tensor = torch.zeros(max(1, size // 4))
        for _ in range(5):
            dist.all_reduce(tensor)
        laps = []
        for _ in range(DIRECT_ITERS):
            started = time.perf_counter()
            dist.all_reduce(tensor)
            laps.append(time.perf_counter() - started)
        each = torch.tensor([statistics.median(laps)], dtype=torch.float64)
        dist.all_reduce(each)
        times[size] = each.item() / world
    if dist.get_rank() == 0:
        print(json.dumps(times))
    dist.destroy_process_group()


def preflight_run(seconds: float) -> dict[int, float]:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "preflight.json"
        argv = [sys.executable, "-P", "-m", "train.preflight", "--preflight-seconds", str(seconds), "--preflight-json", str(report)]
        run_job([*argv, "--snapshot-dir", ""])
        return {row["size"]: row["time_us"] / 1e6 for row in json.loads(report.read_text())["all_reduce"]}


def direct_run() -> dict[int, float]:
    out = run_job([sys.executable, str(Path(__file__).resolve()), "--direct"])
    return {int(size): seconds for size, seconds in json.loads(out.strip().splitlines()[-1]).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=8, help="interleaved rounds")
    parser.add_argument("--seconds", type=float, default=30, help="the preflight's --preflight-seconds")
    parser.add_argument("--direct", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.direct:
        direct()
        return
    seen: dict[str, list[dict[int, float]]] = {"preflight": [], "direct": []}
    runs = {"preflight": lambda: preflight_run(opts.seconds), "direct": direct_run}
    for round_no in range(opts.repeats):
        order = ("preflight", "direct") if round_no % 2 == 0 else ("direct", "preflight")  # A B, B A, ...
        for name in order:
            seen[name].append(runs[name]())
    med = {name: {size: statistics.median(run[size] for run in runs) for size in SIZES} for name, runs in seen.items()}
    print(f"preflight all-reduce vs direct torch.distributed: {RANKS} gloo ranks, medians of {opts.repeats} interleaved rounds")
    print(f"  {'size (B)':>10}  {'preflight (us)':>14}  {'direct (us)':>11}  {'ratio':>6}  {'busbw (GB/s)':>12}")
    ratios = []
    for size in SIZES:
        a, b = med["preflight"][size], med["direct"][size]
        ratios.append(a / b)
        print(f"  {size:>10}  {a * 1e6:>14.1f}  {b * 1e6:>11.1f}  {a / b:>6.2f}  {size / a / 1e9 * 2 * (RANKS - 1) / RANKS:>12.3f}")
    worst = max(ratios, key=lambda r: abs(r - 1))
    within = sum(abs(r - 1) <= 0.10 for r in ratios)
    print(
        f"preflight / direct: median {statistics.median(ratios):.3f}, furthest {worst:.3f}, "
        f"{within}/{len(ratios)} sizes within 10% (target: all)"
    )


if __name__ == "__main__":
    main()
