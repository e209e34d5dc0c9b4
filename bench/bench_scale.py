"""ddpack's control plane at 2, 16 and 64 nodes, on emulated nodes (testbed/emulated_cluster.py): where a start's time goes.

Every job is the real pyxis-per-task.sbatch and job program, unchanged, on a second Slurm instance of N emulated nodes
(real slurmctld, slurmd, srun, sbcast, pyxis and enroot); the ranks are a stub (one file written in the shared folder,
its mtime the rank's ready time) and the image a squashfs of about 1 MB (--pad-mb to grow it). Cases, at each size:

  cold   DDPACK_STAGE=sbcast with every node's staging folder and enroot data emptied: prepare, the holder step,
         sbcast, install, the training step (each node unpacks from its copy)
  warm   the same image again (DDPACK_STAGE=auto: every node holds it): prepare, then the training step
  bad    cold, with one node's staging folder a plain file (it refuses at prepare): K, the nodes that read the shared file
  swap   N+1 nodes with DDPACK_SPARE_NODES=1 (baseline 3): the ranks hold; a training node other than the batch host is
         set DOWN; the time until every rank of the restarted step is ready

Times: W from sbatch to every rank ready (one clock: this host's). Phases from the command log (the shim on PATH and
the nodes' counted python3 and enroot): queue (sbatch to the batch script's first command), setup (to the prepare
step), prepare, holder (the receive step), sbcast, install, launch (the training step's srun to its first rank ready,
with the unpacks: first create to last end), spread (first to last rank ready). Each node's CPU is its cgroup's; the
correction takes out what a cluster runs side by side and this host queues: delta = (sum of node CPU - the largest) /
CPUs, bounded by the time both CPUs were saturated; R = W - delta. slurmctld's CPU is its cgroup's, munged's from /proc
(the host's one munged: the test cluster's use in the window is in it too).

    python bench/bench_scale.py [--sizes 2,16,64] [--rounds 1] [--pad-mb 0] [--busy-ok]

Needs root, the test cluster's munged, pyxis and enroot; hold /tmp/ddpack-cluster.lock around it (make bench-scale does).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed import emulated_cluster as ec
from testbed.scale_jobs import Result, ScaleJobs, build_stub


class Host:
    """/proc/stat sampled at 10 Hz: the seconds in a window when every CPU was at least 95 % busy (saturated)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (time, busy share over the last interval)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    @staticmethod
    def ticks() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields) - idle, sum(fields)

    def run(self) -> None:
        busy, total = self.ticks()
        while not self.stop.wait(0.1):
            b, t = self.ticks()
            if t > total:
                self.samples.append((time.time(), (b - busy) / (t - total)))
            busy, total = b, t

    def saturated(self, start: float, end: float) -> float:
        return sum(0.1 for t, share in self.samples if start <= t <= end and share >= 0.95)


def fmt(value: float) -> str:
    return f"{value:6.2f}"


PHASES = ("queue", "setup", "prepare", "holder", "sbcast", "install", "launch", "unpack", "spread")


def row(result: Result) -> str:
    cpus = result.node_cpu.values()
    phases = " ".join(f"{result.phases[p]:6.2f}" if p in result.phases else "     -" for p in PHASES)
    calls = ",".join(f"{k}:{v}" for k, v in sorted(result.calls.items()))
    return (
        f"scale  {result.nodes:5d} {result.case:5s} {fmt(result.w)} | {phases} | {sum(cpus):6.2f} {max(cpus, default=0):5.2f} "
        f"{result.delta:6.2f} {fmt(result.r)} | {result.ctld_cpu:5.2f} {result.munged_cpu:5.2f} | {calls} steps {result.steps} "
        f"py {result.python_batch}+{result.python_per_node:.0f}/node node-side {result.node_side_calls} shared {result.shared_readers}"
    )


HEADER = (
    "scale  nodes case      W | " + " ".join(f"{p:>6s}" for p in PHASES) + " | nodeCPU   max  delta      R | ctld munged | "
    "batch host's Slurm calls, steps, python starts (batch+per node), node-side calls, nodes reading the shared file"
)


def median(results: list[Result], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,16,64", help="node counts of the starts (the first is the baseline)")
    parser.add_argument("--swap-sizes", default="3,16,64", help="allocations of the spare swap, spare included (the first is the baseline)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pad-mb", type=int, default=0, help="random bytes added to the stub image (MiB)")
    parser.add_argument("--busy-ok", action="store_true", help="run on a loaded host too (figures labelled 'busy host')")
    opts = parser.parse_args()
    sizes = [int(n) for n in opts.sizes.split(",")]
    swaps = [int(n) for n in opts.swap_sizes.split(",")]
    largest = max(sizes + swaps)
    busy = ""
    if (why := ec.refusal(largest, busy_ok=opts.busy_ok)) is not None:
        print(f"bench-scale: {why}")
        return 1
    if ec.refusal(largest) is not None:
        busy = " (busy host)"
    before = ec.test_cluster_now()
    host = Host()
    load0 = os.getloadavg()[0]
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="ddpack-scale-", dir="/tmp") as tmp:
        work = Path(tmp)
        work.chmod(0o755)
        (work / "logs").mkdir()
        (work / "ready").mkdir(mode=0o777)
        (work / "ready").chmod(0o777)
        image = build_stub(work, opts.pad_mb)
        try:
            cluster = ec.up(largest, busy_ok=True)
            size = image.stat().st_size >> 10
            print(
                f"scale  {ec.NAME}: {largest} slurmd up in {cluster.started_s:.1f} s, {os.cpu_count()} CPUs, load {load0:.2f}{busy}, image {size} KiB"
            )
            print(HEADER)
            bench = ScaleJobs(work, image, host.saturated)
            for _ in range(opts.rounds):
                for nodes in sizes:
                    for case in ("cold", "warm"):
                        results.append(bench.start(case, nodes))
                        print(row(results[-1]), flush=True)
            bad = bench.start("bad", largest if largest in sizes else sizes[-1], bad=f"ds{max(2, (sizes[-1]) // 2)}")
            results.append(bad)
            print(row(bad), flush=True)
            for _ in range(opts.rounds):
                for nodes in swaps:
                    results.append(bench.swap(nodes))
                    print(row(results[-1]), flush=True)
        finally:
            left = ec.down()
            host.stop.set()
    after = ec.test_cluster_now()
    untouched = "untouched" if after == before else f"CHANGED: {', '.join(k for k in before if before[k] != after[k])}"
    print(f"scale  torn down ({'; '.join(left)}); test cluster {untouched}; load {os.getloadavg()[0]:.2f} after")
    return summary(results, sizes, swaps, busy)


def summary(results: list[Result], sizes: list[int], swaps: list[int], busy: str) -> int:
    def of(case: str, nodes: int) -> list[Result]:
        return [r for r in results if r.case == case and r.nodes == nodes]

    small, big = sizes[0], sizes[-1]
    ratios = {}
    for case in ("cold", "warm"):
        lo, hi = of(case, small), of(case, big)
        ratios[case] = (median(hi, "r") / median(lo, "r"), median(hi, "w") / median(lo, "w"))
        corrected = f"corrected {ratios[case][0]:.2f} (R {median(hi, 'r'):.2f} s / {median(lo, 'r'):.2f} s)"
        print(
            f"scale: {case} start {big}/{small}: {corrected}, raw {ratios[case][1]:.2f} (W {median(hi, 'w'):.2f} s / {median(lo, 'w'):.2f} s)"
        )
        ctld = f"slurmctld CPU {median(lo, 'ctld_cpu'):.2f} s at {small}, {median(hi, 'ctld_cpu'):.2f} s at {big}"
        print(f"scale: {case} {ctld}; munged {median(lo, 'munged_cpu'):.2f} s, {median(hi, 'munged_cpu'):.2f} s")
    lo_swap, hi_swap = of("swap", swaps[0]), of("swap", swaps[-1])
    swap_r = median(hi_swap, "r") / median(lo_swap, "r")
    swap_raw = median(hi_swap, "w") / median(lo_swap, "w")
    print(
        f"scale: spare swap {swaps[-1]}/{swaps[0]}: corrected {swap_r:.2f} (R {median(hi_swap, 'r'):.2f} s / {median(lo_swap, 'r'):.2f} s), raw {swap_raw:.2f}"
    )
    calls = {n: sum(of("warm", n)[0].calls.values()) for n in (small, big)}
    cold_calls = {n: sum(of("cold", n)[0].calls.values()) for n in (small, big)}
    print(
        f"scale: Slurm calls per start (batch host) at {small} / {big} nodes: warm {calls[small]} / {calls[big]}, cold {cold_calls[small]} / {cold_calls[big]}"
    )
    bad = next(r for r in results if r.case == "bad")
    worst, worst_raw = max(ratios.values())
    print(
        f"bench-scale: start {big}/{small} corrected {worst:.2f} (raw {worst_raw:.2f}); slurm calls per start {small} nodes {cold_calls[small]}, "
        f"{big} nodes {cold_calls[big]}; one bad node of {bad.nodes}: {bad.shared_readers} nodes read the shared file; "
        f"spare swap {swaps[-1]}/{swaps[0]} corrected {swap_r:.2f}{busy}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
