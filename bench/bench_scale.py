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
correction takes out what a cluster runs side by side and this host queues: delta = share x (sum of node CPU - the
largest) / CPUs, bounded by the time some task waited for a CPU (the kernel's pressure count, PSI); R = W - delta.
The share is the part of that queued CPU on the critical path, calibrated after the jobs against runs pinned to one
CPU (a warm start and a swap at the largest size, or --calibrate-at N; each case's own: `calibrate`); 1 with
--no-calibrate, which over-corrects where the host is not saturated all along. slurmctld's CPU is its cgroup's,
munged's from /proc (the host's one munged: the test cluster's use in the window is in it too). Each row names its
busiest node, whose CPU the correction leaves in R.

    python bench/bench_scale.py [--sizes 2,16,64] [--swap-sizes 3,16,64] [--rounds 1] [--pad-mb 0] [--busy-ok]
                                [--sbcast-law | --sbcast-only] [--no-calibrate] [--calibrate-at N]

--sbcast-law: sbcast timed at TreeWidth 50 and 4, fan-out 2 and 8, 8 and 32 MiB, and its stop-and-wait law fitted
beside the pipelined one (docs/scale.md); --no-calibrate: no runs pinned to one CPU, every queued CPU second taken out.

Needs root, the test cluster's munged, pyxis and enroot; hold /tmp/ddpack-cluster.lock around it (make bench-scale does).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpack.jobs.goodput_model import SBCAST_BLOCK_MB, Site, sbcast_levels, stage_by_sbcast
from testbed import emulated_cluster as ec
from testbed.scale_jobs import Result, ScaleJobs, build_stub
from testbed.slurm_cluster import NODE_TMP

PRESSURE = Path("/proc/pressure/cpu")  # the kernel's CPU pressure (PSI): "some ... total=µs some task waited for a CPU"


class Host:
    """The kernel's count of the time some task waited for a CPU (PSI's "some", /proc/pressure/cpu), sampled at 10 Hz:
    the bound of the correction. A task on the critical path that waited for a CPU did so while some task waited, so
    the queue cannot have cost a start more than that time in its window; where the host idles (two nodes), it is
    near 0 and nothing is taken out. (It replaced the seconds when every CPU was at least 95 % busy in a sample,
    which missed the stretches a CPU idled a moment while tasks still queued behind the other: at 64 nodes that bound
    took out 15 s of the 17.9 s the calibration measured, share 1.00.)"""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = [(time.time(), self.waited_s())]  # (time, seconds waited since boot)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    @staticmethod
    def available() -> bool:
        return PRESSURE.is_file()

    @staticmethod
    def ticks() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields) - idle, sum(fields)

    @staticmethod
    def waited_s() -> float:
        some = PRESSURE.read_text().splitlines()[0]  # some avg10=0.00 avg60=0.00 avg300=0.00 total=123
        return int(some.rsplit("total=", 1)[1]) / 1e6

    def run(self) -> None:
        while not self.stop.wait(0.1):
            self.samples.append((time.time(), self.waited_s()))

    def at(self, moment: float) -> float:
        """The seconds waited since boot at `moment`, between the two samples around it (linear)."""
        before = max((s for s in self.samples if s[0] <= moment), default=self.samples[0])
        after = min((s for s in self.samples if s[0] >= moment), default=self.samples[-1])
        if after[0] <= before[0]:
            return before[1]
        return before[1] + (after[1] - before[1]) * (moment - before[0]) / (after[0] - before[0])

    def waited(self, start: float, end: float) -> float:
        """The seconds of [start, end] in which some task waited for a CPU."""
        return max(self.at(end) - self.at(start), 0.0)


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
        f"; busiest {busiest(result)}"
    )


def busiest(result: Result) -> str:
    """The node whose CPU is the max column (the part of R the correction leaves in), and whether it is the batch host."""
    if not result.node_cpu:
        return "-"
    name = max(result.node_cpu, key=result.node_cpu.__getitem__)
    return f"{name} (the batch host)" if name == result.batch_host else name


HEADER = (
    "scale  nodes case      W | " + " ".join(f"{p:>6s}" for p in PHASES) + " | nodeCPU   max  delta      R | ctld munged | "
    "batch host's Slurm calls, steps, python starts (batch+per node), node-side calls, nodes reading the shared file; the busiest node"
)


def median(results: list[Result], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in results)


SBCAST_DEST = "sbcast-law"  # the file each node receives, in its NODE_TMP


def sbcast_points(work: Path, node_counts: list[int], fanouts: list[int], sizes_mb: list[int], rounds: int, tree_width: int) -> list[dict]:
    """sbcast timed on the emulated cluster (up at TreeWidth `tree_width`): for each node count a job holds the nodes
    with a step of `sleep` tasks, and each image size is sent at each fan-out to its nodes' tmpfs, removed after."""
    points = []
    env = ec.client_env()
    for nodes in node_counts:
        out = subprocess.run(
            ["sbatch", "--parsable", f"--nodes={nodes}", "--ntasks-per-node=1", "--output=/dev/null", "--wrap", "srun sleep 900"],
            env=env, capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        job = out.stdout.strip().split(";")[0]
        try:
            deadline = time.monotonic() + 120
            while subprocess.run(["scontrol", "show", "step", f"{job}.0"], env=env, capture_output=True, timeout=30).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sbcast law: the holder job {job} of {nodes} nodes did not start its step")
                time.sleep(0.2)
            time.sleep(0.5)  # every node's sleep task is up
            for size_mb in sizes_mb:
                source = work / f"sbcast-{size_mb}.bin"
                if not source.exists():
                    with open(source, "wb") as out_file:
                        for _ in range(size_mb):
                            out_file.write(os.urandom(1 << 20))
                for fanout in fanouts:
                    for _ in range(rounds):
                        cpu0, t0 = ec.cgroup_usage(), time.monotonic()
                        sent = subprocess.run(
                            ["sbcast", "-f", f"--fanout={fanout}", f"--jobid={job}.0", str(source), f"{NODE_TMP}/{SBCAST_DEST}"],
                            env=env, capture_output=True, text=True, timeout=600,
                        )  # fmt: skip
                        seconds, cpu1 = time.monotonic() - t0, ec.cgroup_usage()
                        used = sorted((cpu1[n] - cpu0.get(n, 0)) / 1e9 for n in ec.node_names(nodes) if n in cpu1)
                        queued = (sum(used) - (used[-1] if used else 0)) / (os.cpu_count() or 1)  # what a cluster's nodes do side by side
                        if sent.returncode != 0:
                            raise RuntimeError(f"sbcast to {nodes} nodes failed: {sent.stderr.strip()}")
                        for node in ec.node_names(nodes):
                            (ec.DISKS / node / SBCAST_DEST).unlink(missing_ok=True)
                        points.append(
                            {
                                "nodes": nodes,
                                "fanout": fanout,
                                "tree_width": tree_width,
                                "size_mb": size_mb,
                                "raw": seconds,
                                "s": max(seconds - queued, 0.01),
                            }
                        )
        finally:
            subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 60
            while subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True, timeout=30).stdout.strip():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.3)
    return points


def fit_sbcast(points: list[dict], key: str = "s") -> dict[str, float]:
    """The stop-and-wait law, T = blocks x sum over levels (a + c x children) + d, and the pipelined law,
    T = S / r + depth x B / r + d, fitted by least squares to each point's `key` (s: corrected, the nodes' queued CPU
    taken out; raw: as timed); each law's RMS relative residual."""
    import numpy as np

    blocks = [math.ceil(p["size_mb"] * 1.048576 / SBCAST_BLOCK_MB) for p in points]
    levels = [sbcast_levels(p["nodes"], p["fanout"], p["tree_width"]) for p in points]
    seconds = np.array([p[key] for p in points])
    stop = np.array([[b * len(lv), b * sum(lv), 1.0] for b, lv in zip(blocks, levels, strict=True)])
    piped = np.array([[p["size_mb"], len(lv), 1.0] for p, lv in zip(points, levels, strict=True)])
    (a, c, d), *_ = np.linalg.lstsq(stop, seconds, rcond=None)
    (x, y, e), *_ = np.linalg.lstsq(piped, seconds, rcond=None)

    def rms(predicted: np.ndarray) -> float:
        return float(np.sqrt(np.mean(((predicted - seconds) / seconds) ** 2)))

    return {
        "a_ms": a * 1000,
        "c_ms": c * 1000,
        "d_s": d,
        "stop_rms": rms(stop @ [a, c, d]),
        "piped_rms": rms(piped @ [x, y, e]),
        "mbps": 1 / x if x > 0 else 0.0,
    }


def sbcast_law(work: Path, node_counts: list[int], rounds: int) -> None:
    """sbcast's law on the emulated nodes: TreeWidth 50 (22.05's default) and 4 (a deeper tree), fan-out 2 and 8 (the
    first hop on 22.05), 8 and 32 MiB; the fit, and the model's prediction beside each measurement at 16 and 64 nodes."""
    points = []
    for tree_width in (50, 4):
        ec.up(max(node_counts), busy_ok=True, tree_width=tree_width)
        try:
            points += sbcast_points(work, node_counts, [2, 8], [8, 32], rounds, tree_width)
        finally:
            ec.down()
    fit, raw = fit_sbcast(points), fit_sbcast(points, "raw")
    timed_law = f"hop {raw['a_ms']:.1f} ms, {raw['c_ms']:.2f} ms a child, residual {raw['stop_rms']:.0%}"
    print(f"scale: sbcast law as timed (the nodes' CPU queued on this host's CPUs): {timed_law}")
    print(
        f"scale: sbcast law, corrected (loopback, {len(points)} sends): T = blocks x sum over levels ({fit['a_ms']:.1f} ms + {fit['c_ms']:.2f} ms x children) "
        f"+ {fit['d_s']:.2f} s, residual {fit['stop_rms']:.0%}; pipelined law (S / {fit['mbps']:.0f} MB/s + depth x B) residual {fit['piped_rms']:.0%}"
    )
    site = Site(sbcast_hop_ms=fit["a_ms"], fanout=8, tree_width=50)
    for nodes in [n for n in node_counts if n >= 16]:
        for size_mb in (8, 32):
            same = [p for p in points if (p["nodes"], p["fanout"], p["tree_width"], p["size_mb"]) == (nodes, 8, 50, size_mb)]
            measured, timed = statistics.median(p["s"] for p in same), statistics.median(p["raw"] for p in same)
            lv = sbcast_levels(nodes, 8, 50)
            law = (
                math.ceil(size_mb * 1.048576 / SBCAST_BLOCK_MB) * sum(fit["a_ms"] / 1000 + fit["c_ms"] / 1000 * k for k in lv) + fit["d_s"]
            )
            model = stage_by_sbcast(size_mb * 1.048576, nodes, site)
            print(
                f"scale: sbcast {size_mb} MiB to {nodes} nodes (fan-out 8, TreeWidth 50, levels {lv}): measured {measured:.2f} s corrected "
                f"({timed:.2f} s raw), fitted law {law:.2f} s, goodput_model {model:.2f} s (its link {site.node_mbps:.0f} MB/s, not loopback's)"
            )
    for version, width in (("22.05", 50), ("23.11", 16)):
        at = {
            n: stage_by_sbcast(5400, n, Site(sbcast_hop_ms=fit["a_ms"], tree_width=width, fanout=8 if version == "22.05" else 16))
            for n in (64, 1000)
        }
        print(
            f"scale: model, 5.4 GB image on Slurm {version}: sbcast {at[64]:.0f} s at 64 nodes, {at[1000]:.0f} s at 1,000 (hop {fit['a_ms']:.1f} ms)"
        )


OTHER_WORK_MAX = 0.15  # of the CPUs: beyond it, other work shared the calibration's one-CPU and two-CPU runs unevenly


class OtherWork:
    """The share of the host's CPUs that work other than the emulated nodes' and controller's own (their cgroups) took
    since this was made: the host's busy CPU less theirs. The load average cannot tell: the nodes' own tasks, queued
    on one CPU, are most of it."""

    def __init__(self) -> None:
        self.host0, self.ours0, self.wall0 = Host.ticks()[0], sum(ec.cgroup_usage().values()), time.monotonic()

    def share(self) -> float:
        cpus = os.cpu_count() or 1
        ours = (sum(ec.cgroup_usage().values()) - self.ours0) / 1e9
        busy = (Host.ticks()[0] - self.host0) / os.sysconf("SC_CLK_TCK")
        return max(busy - ours, 0.0) / (max(time.monotonic() - self.wall0, 1e-9) * cpus)


def calibrate(bench: ScaleJobs, nodes: int, rounds: int) -> tuple[list[str], dict[str, float]]:
    """The correction checked and sized against runs pinned to one CPU: the same warm start of `nodes` nodes, and the
    same swap, with every node on one CPU and on both, interleaved. With W = B + f x queued, where queued is the nodes'
    CPU beyond the busiest node's over the CPUs, taking one of two CPUs away adds f x (node CPU - the busiest's) / 2; so
    f, the share of the queued CPU that is on the critical path (the rest overlaps with waits: replies, the
    scheduler's pass), is 2 (W1 - W2) / (node CPU - the busiest's), clamped to [0, 1]. Each case's share scales its
    delta: the start's for the starts, the swap's for the swaps. Taking all of it out (share 1) over-corrected by about
    a third at 16 nodes (docs/scale.md). The share depends on how busy the host's CPUs are (a run that keeps both
    saturated has little slack for the queue to overlap with), so it is measured at the size whose ratio it corrects:
    the largest by default. It is labelled not trusted when other work (the host's busy CPU beyond the nodes' and the
    controller's cgroups) took more than OTHER_WORK_MAX of the CPUs during it. Only the nodes are pinned: slurmctld
    (about 0.05 s a swap) and the host's munged keep both CPUs."""
    cases = {"start": ("warm start", lambda: bench.start("warm", nodes)), "swap": ("swap", lambda: bench.swap(nodes))}
    lines, shares = [], {}
    for case, (label, run) in cases.items():
        others = OtherWork()
        one: list[Result] = []
        two: list[Result] = []
        try:
            for _ in range(rounds):
                for cpus, into in (("0", one), ("", two)):
                    ec.pin_cpus(cpus)
                    into.append(run())
        finally:
            ec.pin_cpus("")
        gap = statistics.median(r.w for r in one) - statistics.median(r.w for r in two)
        beyond = statistics.median(sum(r.node_cpu.values()) - max(r.node_cpu.values(), default=0) for r in two)
        share = min(max(2 * gap / beyond, 0.0), 1.0) if beyond > 0 else 1.0
        shares[case] = share
        other = others.share()
        busy = (
            f" (busy host: other work took {other:.0%} of the {os.cpu_count()} CPUs during it: not trusted)"
            if other > OTHER_WORK_MAX
            else ""
        )
        lines.append(
            f"scale: calibration, {nodes} nodes {label} ({rounds} rounds): W(1 CPU) - W(2 CPUs) = {gap:.2f} s against the queued node CPU "
            f"(beyond the busiest node's) / 2 = {beyond / 2:.2f} s: share on the critical path {share:.2f}{busy}"
        )
    return lines, shares


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,16,64", help="node counts of the starts (the first is the baseline)")
    parser.add_argument("--swap-sizes", default="3,16,64", help="allocations of the spare swap, spare included (the first is the baseline)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--pad-mb", type=int, default=0, help="random bytes added to the stub image (MiB)")
    parser.add_argument("--busy-ok", action="store_true", help="run on a loaded host too (figures labelled 'busy host')")
    parser.add_argument("--sbcast-law", action="store_true", help="after the starts, time sbcast at TreeWidth 50 and 4 and fit its law")
    parser.add_argument("--sbcast-only", action="store_true", help="the sbcast law alone (at --sizes)")
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip the correction's calibration (on 1 CPU and on 2): delta takes out all queued CPU",
    )
    parser.add_argument("--calibrate-at", type=int, default=0, help="the calibration's node count (default: the largest size)")
    calibration: list[str] = []
    shares: dict[str, float] = {}
    opts = parser.parse_args()
    sizes = [int(n) for n in opts.sizes.split(",")]
    swaps = [int(n) for n in opts.swap_sizes.split(",")]
    largest = max(sizes + swaps)
    if opts.calibrate_at and not 3 <= opts.calibrate_at <= largest:
        print(
            f"bench-scale: --calibrate-at {opts.calibrate_at} is not a node count from 3 (a swap's) to {largest} (the largest size); pick one"
        )
        return 2
    if not Host.available():
        print(f"bench-scale: this kernel gives no {PRESSURE} (PSI), which bounds the correction; boot it with psi=1")
        return 1
    if (why := ec.refusal(largest, busy_ok=opts.busy_ok)) is not None:
        print(f"bench-scale: {why}")
        return 1
    busy = " (busy host at the start)" if ec.refusal(largest) is not None else ""
    before = ec.test_cluster_now()
    if opts.sbcast_only:
        with tempfile.TemporaryDirectory(prefix="ddpack-scale-", dir="/tmp") as tmp:
            sbcast_law(Path(tmp), sizes, opts.rounds)
        print(f"scale  test cluster {'untouched' if ec.test_cluster_now() == before else 'CHANGED'}")
        return 0
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
        others = OtherWork()
        try:
            cluster = ec.up(largest, busy_ok=True)
            size = image.stat().st_size >> 10
            print(
                f"scale  {ec.NAME}: {largest} slurmd up in {cluster.started_s:.1f} s, {os.cpu_count()} CPUs, load {load0:.2f}{busy}, image {size} KiB"
            )
            print(HEADER)
            bench = ScaleJobs(work, image, host.waited)
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
            if not opts.no_calibrate:
                calibration, shares = calibrate(
                    bench, opts.calibrate_at or largest, max(opts.rounds, 2)
                )  # printed again before the summary
        finally:
            other = others.share()  # before the teardown, while the cgroups are there to count
            left = ec.down()
            host.stop.set()
        if other > OTHER_WORK_MAX:
            busy = f" (busy host: other work took {other:.0%} of the CPUs)"
        if opts.sbcast_law:
            sbcast_law(work, sizes, opts.rounds)
    for line in calibration:
        print(line)
    if shares:
        for result in results:
            result.share = shares["swap" if result.case == "swap" else "start"]
        print("scale: every job again, delta scaled by its case's share on the critical path")
        print(HEADER)
        for result in results:
            print(row(result))
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
    share = f", share {hi_swap[0].share:.2f}" if hi_swap[0].share != 1 else ", share 1: all queued CPU taken out"
    print(
        f"scale: spare swap {swaps[-1]}/{swaps[0]}: corrected {swap_r:.2f} (R {median(hi_swap, 'r'):.2f} s / {median(lo_swap, 'r'):.2f} s{share}), "
        f"raw {swap_raw:.2f} (W {median(hi_swap, 'w'):.2f} s / {median(lo_swap, 'w'):.2f} s)"
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
    try:
        sys.exit(main())
    except ec.ClusterUnavailable as why:  # what the host lacks (munged, root, cgroups): one line, as a refusal is
        sys.exit(f"bench-scale: {why}")
