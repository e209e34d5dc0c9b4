"""The start-time model: a job's start and its recovery from a failure against node count, today's path (every
node reads the squashfs from the shared filesystem and unpacks it; a failure requeues the job, which starts
again through the queue and unpacks again) against ddpack's (a failure restarts the step in the allocation, in the
container the first step unpacked). ddpack's start is the path DDPACK_STAGE=auto takes, named in the table: the
shared file where few nodes read it at once, one read sent by sbcast down a tree to every node's local disk where
many would; beside it sbcast forced (DDPACK_STAGE=sbcast) and the image already on every node.

`python -m ddpack.jobs.goodput_model` prints the table for your site's figures (`--help`); `make bench-goodput`
feeds it the per-node ones it measures on the test cluster. Assumptions, each a parameter:
- the shared filesystem serves `fsx_mbps` in all (FSx for Lustre: throughput per TiB times the TiB; 1,200 MB/s is
  a 1.2 TiB PERSISTENT-1000 file system), shared by every node reading at once, each node at most `node_mbps`
  (its network: 100 Gb/s ~ 12,500 MB/s);
- sbcast reads the file once and sends it down a tree, stop and wait per 8 MiB block (each block goes down the
  whole tree and every reply comes back before the next is read: Slurm's src/bcast/file_bcast.c). The tree: in Slurm
  before 23.11 the fan-out (at most 8) sets the first hop and slurm.conf's TreeWidth (`tree_width`, 50) every
  later one; from 23.11 the fan-out (up to 64) sets every hop (give `tree_width` the fan-out). A block costs the
  read of it, then at each level `sbcast_hop_ms` (a slurmd's receive, write and reply: 5 ms assumed;
  bench/bench_scale.py fits it on emulated nodes) plus the block sent to each child over one sender's link
  (`node_mbps`): T = blocks x sum over levels (hop + children x block / link). Never less than the pipelined bound,
  size / `sbcast_mbps` plus a block per level;
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

from ddpack.job_side import setting_value
from ddpack.jobs.cells import duration

SBCAST_BLOCK_MB = 8.0  # sbcast's default block: the pipeline's latency per level of the tree


@dataclass(frozen=True, kw_only=True)
class Site:
    # The staging model's rates and sbcast's fan-out default to the job's (the settings table's, written there once).
    fsx_mbps: float = float(setting_value("DDPACK_FSX_MBPS"))
    node_mbps: float = 12500.0
    sbcast_mbps: float = float(setting_value("DDPACK_SBCAST_MBPS"))
    fanout: int = int(setting_value("DDPACK_STAGE_FANOUT"))
    tree_width: int = 50  # slurm.conf's TreeWidth: every hop of sbcast's tree after the first before Slurm 23.11
    # One level of the tree, one block: a slurmd's receive, write and reply (assumed; bench_scale's fit on this 2-CPU host
    # is an upper bound, its nodes' CPU queued: docs/scale.md).
    sbcast_hop_ms: float = 5.0
    unpack_mbps: float = float(setting_value("DDPACK_UNPACK_MBPS"))
    step_s: float = 2.0
    trainer_s: float = 10.0
    requeue_s: float = 30.0
    detect_s: float = 2.0


@dataclass(frozen=True, kw_only=True)
class Times:
    start_s: float
    recovery_s: float
    path: str  # how the nodes got the image: "shared" (each reads the shared file), "sbcast", or "held" (already there)


def tree_depth(nodes: int, fanout: int) -> int:
    """Levels of sbcast's tree below the sending node."""
    return max(1, math.ceil(math.log(max(nodes, 2), fanout))) if nodes > 1 else 0


def sbcast_levels(nodes: int, fanout: int, tree_width: int) -> list[int]:
    """The children of the busiest sender at each level of sbcast's tree to `nodes` nodes: the first hop `fanout`
    wide, each later one `tree_width` wide (Slurm before 23.11; from 23.11 both are the fan-out). The first hop
    splits the nodes into `fanout` groups; a group's head forwards to the rest of its group."""
    levels, width, left = [], fanout, nodes
    while left > 0:
        heads = min(width, left)
        levels.append(heads)
        left, width = math.ceil(left / heads) - 1, tree_width
    return levels


def read_and_unpack_shared(size_mb: float, nodes: int, site: Site) -> float:
    """Every node unpacks from the shared filesystem at once: each at the slower of its unpack rate and its share."""
    share = min(site.node_mbps, site.fsx_mbps / nodes)
    return size_mb / min(site.unpack_mbps, share)


def stage_by_sbcast(size_mb: float, nodes: int, site: Site) -> float:
    """One read of the shared file sent down the tree, stop and wait per block: the last node holds it after this
    long (the fitted law; never less than the pipelined bound at `sbcast_mbps`)."""
    rate = min(site.sbcast_mbps, site.fsx_mbps, site.node_mbps)
    pipelined = size_mb / rate + tree_depth(nodes, site.fanout) * SBCAST_BLOCK_MB / rate
    levels = sbcast_levels(nodes, site.fanout, site.tree_width)
    per_block = SBCAST_BLOCK_MB / site.fsx_mbps + sum(
        site.sbcast_hop_ms / 1000 + children * SBCAST_BLOCK_MB / site.node_mbps for children in levels
    )
    return max(pipelined, math.ceil(size_mb / SBCAST_BLOCK_MB) * per_block)


def auto_stages(nodes: int, site: Site) -> bool:
    """DDPACK_STAGE=auto's choice for nodes that lack the image, as enroot/ddpack_staging.py's stage_by_model
    makes it (in whole MB/s, the tree's few blocks aside): sbcast then an unpack from local disk, size / sbcast +
    size / unpack, against every node unpacking from the shared filesystem at once, size / min(unpack, fsx / N).
    The size cancels: N x sbcast x unpack > fsx x (sbcast + unpack), and N x unpack > fsx (below that each node's
    share outruns its unpack, and one more copy cannot win)."""
    fsx, bcast, unpack = int(site.fsx_mbps), int(site.sbcast_mbps), int(site.unpack_mbps)
    return nodes * bcast * unpack > fsx * (bcast + unpack) and nodes * unpack > fsx


def today(size_mb: float, nodes: int, site: Site) -> Times:
    """pyxis without ddpack: every node reads and unpacks the shared file; a failure requeues the job."""
    start = site.step_s + read_and_unpack_shared(size_mb, nodes, site) + site.trainer_s
    return Times(start_s=start, recovery_s=site.detect_s + site.requeue_s + start, path="shared")


def ddpack(size_mb: float, nodes: int, site: Site, *, stage: str = "auto", held: bool = False) -> Times:
    """The templates: `stage` is DDPACK_STAGE (auto, sbcast, off); `held`, every node holds this image from an
    earlier job, so neither auto nor sbcast reads or sends anything. A failure restarts the step in place."""
    if stage not in ("auto", "sbcast", "off"):
        raise ValueError(f"stage={stage!r} is not auto, sbcast or off (DDPACK_STAGE's values)")
    recovery = site.detect_s + site.step_s + site.trainer_s
    if stage != "off" and held:
        return Times(start_s=site.step_s + size_mb / site.unpack_mbps + site.trainer_s, recovery_s=recovery, path="held")
    if stage == "sbcast" or (stage == "auto" and auto_stages(nodes, site)):
        start = site.step_s + stage_by_sbcast(size_mb, nodes, site) + size_mb / site.unpack_mbps + site.trainer_s
        return Times(start_s=start, recovery_s=recovery, path="sbcast")
    return Times(start_s=today(size_mb, nodes, site).start_s, recovery_s=recovery, path="shared")


def table(site: Site, sizes_gb: tuple[float, ...] = (0.9, 5.4), node_counts: tuple[int, ...] = (2, 16, 128, 1024)) -> str:
    """Start and recovery per image size and node count: today's path, what ddpack does (DDPACK_STAGE=auto, its
    path named), sbcast forced (DDPACK_STAGE=sbcast) and the image already on every node."""
    lines = [
        f"{'image':>6} {'nodes':>6} | {'start: today':>13} {'ddpack (auto: path)':>20} {'sbcast':>9} {'held':>8} | "
        f"{'recovery: today':>16} {'ddpack':>8}",
    ]
    for size_gb in sizes_gb:
        size_mb = size_gb * 1000
        for nodes in node_counts:
            old, new = today(size_mb, nodes, site), ddpack(size_mb, nodes, site)
            forced, held = ddpack(size_mb, nodes, site, stage="sbcast"), ddpack(size_mb, nodes, site, held=True)
            chosen = f"{duration(new.start_s)} ({new.path})"
            lines.append(
                f"{size_gb:>4.1f}GB {nodes:>6} | {duration(old.start_s):>13} {chosen:>20} {duration(forced.start_s):>9} "
                f"{duration(held.start_s):>8} | {duration(old.recovery_s):>16} {duration(new.recovery_s):>8}"
            )
    lines += [
        "start: sbatch -> first step. ddpack (auto): DDPACK_STAGE=auto's path where the nodes lack the image (shared: each reads",
        "the shared file, as today; sbcast: one read sent to every node); sbcast: DDPACK_STAGE=sbcast forced; held: every node holds",
        "the image already (auto uses it). recovery: a killed rank -> training again (today: a requeue; ddpack: a restart in place).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpack.jobs.goodput_model", description=__doc__.splitlines()[0])
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
