"""Which network NCCL chose between nodes, read from NCCL's own log, and whether it is the fabric the nodes
have. A multi-node GPU job on p4d/p5 whose image lacks the EFA plugin still runs: NCCL falls back to TCP
sockets at a fraction of the bandwidth and says so only at NCCL_DEBUG=INFO, and the preflight's slow-link
check compares links with their median, so links that are all slow pass it. Hence this check.
"""

from __future__ import annotations

from collections.abc import Sequence

from train.gpu import SOCKETS
from train.preflight.identity import Identity, where


def transport_findings(records: Sequence[Identity], backend: str) -> tuple[list[str], list[str]]:
    """(failures, warnings) about the inter-node transport of a multi-node nccl job: sockets where EFA
    devices exist fail the job; sockets on nodes without EFA or InfiniBand are a warning."""
    hosts = {r.rank: r.host for r in records}
    if backend != "nccl" or len(set(hosts.values())) < 2:
        return [], []
    sockets = [r.rank for r in records if r.transport == SOCKETS]
    on_efa = [r.rank for r in records if r.transport == SOCKETS and r.efa]
    if on_efa:
        return [
            f"transport: NCCL runs over TCP sockets between nodes on {where(on_efa, hosts)}, which have EFA devices: the image "
            "has no working EFA plugin (make image-gpu BUILD_ARGS='--build-arg INSTALL_EFA=1'), or NCCL_NET/FI_PROVIDER keep it off"
        ], []
    if sockets:
        return [], [
            f"transport: NCCL runs over TCP sockets between nodes on {where(sockets, hosts)} (no EFA device there): "
            "expect a fraction of a fabric's bandwidth"
        ]
    return [], []
