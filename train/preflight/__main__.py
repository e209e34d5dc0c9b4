"""`python -m train.preflight [--preflight-json PATH] [--preflight-seconds S] [--preflight-strict] [trainer flags]`,
run by
`entrypoint --preflight` on every rank of the job in place of the trainer (`--preflight-strict`: see --help).

The trainer's own flags are parsed as the trainer parses them (so a bad flag fails here too), and give
the snapshot folder, backend and collective timeout. Exit codes: 0 every check passed; 1 a check
failed (one `preflight: FAIL` line each, on rank 0) or a peer died; 2 bad input. Every rank exits with
rank 0's verdict, so `srun`'s exit code is the check's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from train.config import Config, parse_config
from train.data import default_num_workers
from train.distributed import (
    DeviceError,
    DistContext,
    exit_now,
    first_line,
    gather_objects,
    init_distributed,
    run_program,
    select_device,
    shutdown,
)
from train.gpu import capture_nccl_log, driver_version, gpus_promised, nccl_warnings
from train.preflight.comm import all_reduce_sweep, p2p_ring, slow_links
from train.preflight.compute import measure_rates, stragglers
from train.preflight.identity import Identity, collect_identity, disagreements
from train.preflight.node import NodeFacts, node_checks, shm_need
from train.preflight.report import Report, render, write_json_atomically
from train.preflight.storage import check_storage
from train.preflight.throughput import judge, measure
from train.preflight.transport import transport_findings
from train.preflight.verdict import NodeCheck

DEFAULT_SECONDS = 30.0
# Shares of the budget; the rest is start-up, identity and slack.
SHARES = {"all_reduce": 0.5, "p2p": 0.15, "compute": 0.15, "storage": 0.1}


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, 3600]")
    return value


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(
        prog="python -m train.preflight",
        description=__doc__.split("\n\n")[1],
        usage="%(prog)s [--preflight-json PATH] [--preflight-seconds S] [--preflight-strict] [trainer flags, see python -m train --help]",
        allow_abbrev=False,
    )
    parser.add_argument("--preflight-json", metavar="PATH", help="also write the report as JSON to PATH (rank 0; atomic)")
    parser.add_argument(
        "--preflight-seconds",
        type=_seconds,
        default=DEFAULT_SECONDS,
        metavar="S",
        help=f"time budget of the measurements (default {DEFAULT_SECONDS:g}); a hung peer ends the check after at most S",
    )
    parser.add_argument(
        "--preflight-strict",
        action="store_true",
        help="fail on stragglers and slow links too (default: warn; they are relative timings, which a shared or small node "
        "can upset, while a wrong sum, an unwritable folder, a failing node check or ranks that disagree are failures always); "
        "on GPUs, also measure host-to-GPU and GPU-to-GPU copies and each node's all-reduce against the GPU model's floors",
    )
    own, rest = parser.parse_known_args(argv)
    return own, parse_config(rest)


def node_facts(ctx: DistContext, config: Config) -> NodeFacts:
    """What this node's checks compare with, from the run's own settings and what Slurm allocated."""
    gpus = ctx.device.type == "cuda"
    ranks_sharing = 1 if ctx.cpus_bound else ctx.local_world_size
    workers = config.num_workers if config.num_workers is not None else default_num_workers(ranks_sharing)
    need, why = shm_need(
        nccl=ctx.backend == "nccl", local_ranks=ctx.local_world_size, workers=workers, batch_size=config.batch_size, task=config.task
    )
    return NodeFacts(
        node=ctx.host,
        gpus=gpus,
        gpus_asked=(gpus_promised(os.environ) or ctx.local_world_size) if gpus else 0,
        shm_need=need,
        shm_why=why,
        efa_expected=os.environ.get("FI_PROVIDER", "").strip().lower() == "efa",
        driver=driver_version() if gpus else None,
    )


def gathered_node_checks(ctx: DistContext, group: dist.ProcessGroup, config: Config) -> tuple[list[NodeCheck], float]:
    """Every node's rows (its first local rank reads the node), and the slowest node's seconds."""
    own = node_checks(node_facts(ctx, config)) if ctx.local_rank == 0 else None
    found = [result for result in gather_objects(own, ctx, group, allowed=[NodeCheck]) if result is not None]
    return [row for rows, _ in found for row in rows], max((seconds for _, seconds in found), default=0.0)


def run_checks(
    ctx: DistContext, group: dist.ProcessGroup, config: Config, seconds: float, started: float, strict: bool, nccl_log: Path | None = None
) -> Report:
    """Every check, on every rank, over `group`; rank 0's Report holds the verdict. `nccl_log`: where NCCL
    says which network it chose, once a first collective has set up its communicator."""
    report = Report(ctx.world_size, ctx.backend, seconds)
    if ctx.backend == "nccl":
        dist.all_reduce(torch.zeros(1, device=ctx.device), group=group)
    report.identity = gather_objects(collect_identity(ctx, nccl_log), ctx, group, allowed=[Identity])
    transport_failures, transport_warnings = transport_findings(report.identity, ctx.backend)
    hosts = [record.host for record in report.identity]
    report.node_checks, report.node_check_s = gathered_node_checks(ctx, group, config)
    report.all_reduce = all_reduce_sweep(ctx, group, seconds * SHARES["all_reduce"])
    report.p2p = p2p_ring(ctx, group, hosts, seconds * SHARES["p2p"])
    local_ranks = max(record.local_world_size for record in report.identity)
    report.compute = measure_rates(ctx, group, local_ranks, seconds * SHARES["compute"])
    if strict and ctx.device.type == "cuda":  # copy rates and each node's all-reduce against the GPU model's floors
        report.node_checks += judge(measure(ctx, group, hosts))
    if ctx.is_main and config.snapshot_dir:
        report.storage = check_storage(config.snapshot_dir, seconds * SHARES["storage"])
    outliers = [*slow_links(report.p2p), *stragglers(report.compute)]
    report.failures = [
        *disagreements(report.identity),
        *(row.line() for row in report.node_checks if row.status == "fail"),
        *transport_failures,
        *(
            f"all-reduce: {row.wrong} wrong elements at {row.size} B: the sums are not what every rank sent"
            for row in report.all_reduce
            if row.wrong
        ),
        *([report.storage.error] if report.storage and report.storage.error else []),
        *(outliers if strict else []),
    ]
    report.warnings = [
        *(row.line() for row in report.node_checks if row.status == "warn"),
        *transport_warnings,
        *([] if strict else outliers),
    ]
    report.seconds = time.monotonic() - started
    return report


def _watchdog(limit: float) -> None:
    """Ends this rank if the check overruns (a peer hung in a way no collective timeout catches)."""

    def expire() -> None:
        print(f"preflight: error: did not finish within {limit:.0f} s; a peer hung or the job is far slower than expected", file=sys.stderr)
        exit_now(1)

    timer = threading.Timer(limit, expire)
    timer.daemon = True
    timer.start()


def main(argv: Sequence[str] | None = None) -> int:
    own, config = parse_args(argv)
    seconds = own.preflight_seconds
    started = time.monotonic()
    try:
        # Joining waits up to --collective-timeout: ranks can start minutes apart (pyxis unpacks the
        # image on each node). The checks' own group waits at most the budget for a peer.
        backend, device = select_device(config.backend)
        nccl_log = capture_nccl_log() if backend == "nccl" else None  # before NCCL first reads its settings
        ctx = init_distributed(backend, device, config.collective_timeout)
        group = dist.new_group(timeout=timedelta(seconds=seconds))
    except DeviceError as exc:  # this node's GPUs, not the group: what to do about them (train.gpu)
        print(f"preflight: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError) as exc:
        first = first_line(exc)
        print(f"preflight: error: cannot join the process group: {first}", file=sys.stderr)
        return 1
    _watchdog(2 * seconds + 30)  # from here on the job is bounded by the budget, not by start-up
    if ctx.is_main:
        checks = "identity, node, all-reduce, point-to-point, compute, storage"
        if own.preflight_strict and ctx.device.type == "cuda":
            checks += ", GPU copy and all-reduce floors"
        print(f"preflight: {ctx.world_size} ranks, backend {ctx.backend}, budget {seconds:g} s: {checks}", flush=True)
    try:
        report = run_checks(ctx, group, config, seconds, started, own.preflight_strict, nccl_log)
        code = 0 if report.ok else 1
        if ctx.is_main:
            print("\n".join(render(report)), flush=True)
            if own.preflight_json:
                try:
                    write_json_atomically(own.preflight_json, report.to_json())
                except OSError as exc:
                    print(f"preflight: error: cannot write --preflight-json {own.preflight_json} ({exc.strerror or exc})", file=sys.stderr)
                    code = 2
        verdict = torch.tensor([code], device=ctx.device)
        dist.broadcast(verdict, src=0, group=group)
        code = int(verdict.item())
    except RuntimeError as exc:  # gloo/nccl: a dead or silent peer
        first = first_line(exc)
        print(
            f"preflight: error: rank {ctx.rank} on {ctx.host}: a collective failed ({type(exc).__name__}: {first}); "
            f"a peer died or did not answer within {seconds:g} s",
            file=sys.stderr,
        )
        exit_now(1)
    shutdown()
    if nccl_log is not None:
        for line in nccl_warnings(nccl_log):  # NCCL_DEBUG=WARN would have shown them: they still reach stderr
            print(line, file=sys.stderr)
        shutil.rmtree(nccl_log.parent, ignore_errors=True)
    return code


if __name__ == "__main__":
    run_program(main)
