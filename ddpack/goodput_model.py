"""The start-time model: a job's start and its recovery from a failure against node count, today's path (every
node reads the squashfs from the shared filesystem and unpacks it; a failure requeues the job, which starts
again through the queue and unpacks again) against ddpack's (one read, sbcast down a tree to every node's local
disk; a failure restarts the step in the allocation, in the container the first step unpacked).

`python -m ddpack.goodput_model` prints the table for your site's figures (`--help`); `make bench-goodput`
feeds it the per-node ones it measures on the test cluster. Assumptions, each a parameter:
- the shared filesystem serves `fsx_mbps` in all (FSx for Lustre: throughput per TiB times the TiB; 1,200 MB/s is
  a 1.2 TiB PERSISTENT-1000 file system), shared by every node reading at once, each node at most `node_mbps`
  (its network: 100 Gb/s ~ 12,500 MB/s);
- sbcast reads the file once and pipelines it down a tree of `fanout` (at most 8 in Slurm 22.05) at
  `sbcast_mbps` per hop: the last node has it after size / rate plus one block per level of the tree;
- a node unpacks (`enroot create`) at `unpack_mbps` of squashfs from its local disk, and in parallel with the
  others when they each read their own copy; reading from the shared filesystem it can go no faster than its
  share of `fsx_mbps`;
- a step starts (srun, pyxis, the launcher) in `step_s`; the trainer needs `trainer_s` to its first step;
- a requeued job waits `requeue_s` before it starts again (an idle cluster's; a busy one's is its queue).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, fields

SBCAST_BLOCK_MB = 8.0  # sbcast's default block: the pipeline's latency per level of the tree


@dataclass(frozen=True, kw_only=True)
class Site:
    fsx_mbps: float = 1200.0
    node_mbps: float = 12500.0
    sbcast_mbps: float = 1000.0
    fanout: int = 8
    unpack_mbps: float = 400.0
    step_s: float = 2.0
    trainer_s: float = 10.0
    requeue_s: float = 30.0
    detect_s: float = 2.0


@dataclass(frozen=True, kw_only=True)
class Times:
    start_s: float
    recovery_s: float


def tree_depth(nodes: int, fanout: int) -> int:
    """Levels of sbcast's tree below the sending node."""
    return max(1, math.ceil(math.log(max(nodes, 2), fanout))) if nodes > 1 else 0


def read_and_unpack_shared(size_mb: float, nodes: int, site: Site) -> float:
    """Every node unpacks from the shared filesystem at once: each at the slower of its unpack rate and its share."""
    share = min(site.node_mbps, site.fsx_mbps / nodes)
    return size_mb / min(site.unpack_mbps, share)


def stage_by_sbcast(size_mb: float, nodes: int, site: Site) -> float:
    """One read of the shared file, piped down the tree: the last node holds it after this long."""
    rate = min(site.sbcast_mbps, site.fsx_mbps, site.node_mbps)
    return size_mb / rate + tree_depth(nodes, site.fanout) * SBCAST_BLOCK_MB / rate


def today(size_mb: float, nodes: int, site: Site) -> Times:
    start = site.step_s + read_and_unpack_shared(size_mb, nodes, site) + site.trainer_s
    return Times(start_s=start, recovery_s=site.detect_s + site.requeue_s + start)


def ddpack(size_mb: float, nodes: int, site: Site, staged: bool = False) -> Times:
    """`staged`: the nodes hold this image from an earlier job (nothing is read or sent)."""
    stage = 0.0 if staged else stage_by_sbcast(size_mb, nodes, site)
    start = site.step_s + stage + size_mb / site.unpack_mbps + site.trainer_s
    return Times(start_s=start, recovery_s=site.detect_s + site.step_s + site.trainer_s)


def table(site: Site, sizes_gb: tuple[float, ...] = (0.9, 5.4), node_counts: tuple[int, ...] = (2, 16, 128, 1024)) -> str:
    lines = [
        f"{'image':>6} {'nodes':>6} | {'start: today':>13} {'ddpack':>8} {'(staged)':>9} | {'recovery: today':>16} {'ddpack':>8}",
    ]
    for size_gb in sizes_gb:
        size_mb = size_gb * 1000
        for nodes in node_counts:
            old, new, warm = today(size_mb, nodes, site), ddpack(size_mb, nodes, site), ddpack(size_mb, nodes, site, staged=True)
            lines.append(
                f"{size_gb:>4.1f}GB {nodes:>6} | {_duration(old.start_s):>13} {_duration(new.start_s):>8} {_duration(warm.start_s):>9} | "
                f"{_duration(old.recovery_s):>16} {_duration(new.recovery_s):>8}"
            )
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpack.goodput_model", description=__doc__.splitlines()[0])
    defaults = Site()
    for f in fields(Site):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name))
    parser.add_argument("--image-gb", type=float, action="append", help="squashfs sizes in GB (default 0.9 and 5.4)")
    parser.add_argument("--nodes", type=int, action="append", help="node counts (default 2, 16, 128, 1024)")
    opts = parser.parse_args(argv)
    bad = [f.name for f in fields(Site) if not getattr(opts, f.name) > 0 and f.name not in ("requeue_s", "detect_s")]
    if bad or any(n < 1 for n in opts.nodes or []) or any(g <= 0 for g in opts.image_gb or []):
        what = ", ".join(f"--{b.replace('_', '-')}" for b in bad) or "--nodes/--image-gb"
        print(f"goodput_model: {what} must be above 0; give rates in MB/s, times in seconds, at least one node", file=sys.stderr)
        return 2
    site = Site(**{f.name: getattr(opts, f.name) for f in fields(Site)})
    print(table(site, tuple(opts.image_gb or (0.9, 5.4)), tuple(opts.nodes or (2, 16, 128, 1024))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
