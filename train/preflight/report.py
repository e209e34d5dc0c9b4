"""Rank 0's report: the tables users read in the job log, and the JSON file for scripts."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from entrypoint.atomic_file import write_atomically
from train.preflight.comm import P2P_BYTES, AllReduceRow, Link
from train.preflight.compute import Rate
from train.preflight.identity import Identity
from train.preflight.storage import StorageResult
from train.preflight.verdict import NodeCheck, verdict_line


@dataclass
class Report:
    world_size: int
    backend: str
    budget_s: float
    identity: list[Identity] = field(default_factory=list)
    all_reduce: list[AllReduceRow] = field(default_factory=list)
    p2p: list[Link] = field(default_factory=list)
    compute: list[Rate] = field(default_factory=list)
    storage: StorageResult | None = None
    node_checks: list[NodeCheck] = field(default_factory=list)  # every node's rows, the strict throughput rows after them
    node_check_s: float = 0.0  # the slowest node's time for its node checks
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> str:
        data = asdict(self)
        data["ok"] = self.ok
        return json.dumps(data, indent=2)


IDENTITY_COLUMNS = (
    "rank",
    "host",
    "local",
    "device",
    "bundle",
    "code",
    "app",
    "image",
    "python",
    "torch",
    "cuda",
    "nccl",
    "driver",
    "network",
    "efa",
)


def identity_table(records: Sequence[Identity]) -> list[str]:
    """One row per rank, columns as wide as their widest value (host names run long)."""
    rows = [IDENTITY_COLUMNS] + [
        (
            str(r.rank),
            r.host,
            f"{r.local_rank}/{r.local_world_size}",
            r.device,
            r.bundle,
            r.code,
            r.app,
            "yes" if r.in_image else "no",
            r.python,
            r.torch,
            r.cuda,
            r.nccl,
            r.driver,
            r.transport,
            str(r.efa),
        )
        for r in records
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(IDENTITY_COLUMNS))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


NODE_COLUMNS = ("node", "check", "status", "value", "threshold")


def node_check_table(rows: Sequence[NodeCheck]) -> list[str]:
    """One row per node and check; a GPU or NIC a value is about is named in it."""
    cells = [NODE_COLUMNS] + [(r.node, r.check, r.status.upper() if r.status != "ok" else "ok", r.value, r.threshold) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(NODE_COLUMNS) - 1)]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, [*widths, 0], strict=True)).rstrip() for row in cells]


def all_reduce_table(rows: Sequence[AllReduceRow], dtype: str = "float") -> list[str]:
    """nccl-tests' all_reduce_perf layout (one in-place column set)."""
    lines = [
        f"#  {'size':>10}  {'count':>12}  {'type':>6}  {'redop':>5}  {'root':>4}  {'time':>9}  {'algbw':>7}  {'busbw':>7}  {'#wrong':>6}",
        f"#  {'(B)':>10}  {'(elements)':>12}  {'':>6}  {'':>5}  {'':>4}  {'(us)':>9}  {'(GB/s)':>7}  {'(GB/s)':>7}  {'':>6}",
    ]
    for row in rows:
        lines.append(
            f"   {row.size:>10}  {row.count:>12}  {dtype:>6}  {'sum':>5}  {-1:>4}  {row.time_us:>9.1f}  "
            f"{row.algbw:>7.2f}  {row.busbw:>7.2f}  {row.wrong:>6}"
        )
    if rows:
        lines.append(f"# Avg bus bandwidth    : {sum(r.busbw for r in rows) / len(rows):.4g}")
    return lines


def render(report: Report) -> list[str]:
    """The whole report as lines, in the order the checks ran."""
    hosts = list(dict.fromkeys(r.host for r in report.identity))
    on = f"{len(hosts)} host{'s' if len(hosts) != 1 else ''} ({', '.join(hosts)})"
    lines = [f"preflight: {report.world_size} ranks on {on}, backend {report.backend}", "identity:"]
    lines += identity_table(report.identity)
    if report.node_checks:
        lines.append(f"node checks (each node's first rank; the slowest node took {report.node_check_s * 1000:.1f} ms):")
        lines += node_check_table(report.node_checks)
    if report.all_reduce:
        lines.append(f"all-reduce ({report.backend}, in place; time: the median iteration, averaged over ranks):")
        lines += all_reduce_table(report.all_reduce)
    if report.p2p:
        lines.append(f"point-to-point (every rank sends and receives {P2P_BYTES >> 20} MiB at once):")
        lines += [
            f"  rank {link.src:>4} ({link.src_host}) -> rank {link.dst:>4} ({link.dst_host}): {link.gbps:8.3f} GB/s" for link in report.p2p
        ]
    if report.compute:
        lines.append("compute (matrix multiply, best of 5 chunks):")
        lines += [f"  rank {rate.rank:>4} ({rate.host}): {rate.gflops:10.1f} GFLOP/s" for rate in report.compute]
    storage = report.storage
    if storage is not None and storage.error is None:
        lines.append(
            f"storage (rank 0, {storage.folder}): wrote {storage.nbytes >> 20} MiB + fsync at {storage.write_mbps:,.0f} MB/s, "
            f"read back at {storage.read_mbps:,.0f} MB/s, {storage.free_bytes / 2**30:,.1f} GiB free"
        )
    elif storage is None:
        lines.append("storage: skipped (--snapshot-dir '' disables snapshots)")
    lines += [f"preflight: WARN {warning}" for warning in report.warnings]
    lines += [f"preflight: FAIL {failure}" for failure in report.failures]
    lines.append(verdict_line(report.failures, report.warnings, report.seconds))
    return lines


def write_json_atomically(path: str, text: str) -> None:
    """Write next to the target, then rename: a reader never sees half a report (this user's alone, 0600)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(target, text + "\n", 0o600)
