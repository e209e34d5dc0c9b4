"""Start real multi-process DDP jobs the way a cluster would: one process per Slurm task, fed the
variables srun sets, through the entrypoint; or torchrun via the entrypoint's standalone mode."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from testbed.env import ROOT, clean_env
from train.outcome import RunEnd, checksums, read_ends

ENTRYPOINT = [sys.executable, "-m", "entrypoint"]


@dataclass
class Job:
    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]
    started: float = field(default_factory=time.monotonic)

    def wait(self, timeout: float = 180) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                raise AssertionError(f"job did not finish in {timeout}s:\n{self.output()}") from None
        return codes

    def send(self, sig: int, ranks: Sequence[int]) -> None:
        for rank in ranks:
            self.procs[rank].send_signal(sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(sig)
        for proc in self.procs:
            proc.wait(timeout=30)

    def output(self, index: int | None = None) -> str:
        paths = self.logs if index is None else [self.logs[index]]
        return "\n".join(p.read_text(errors="replace") for p in paths)

    def checksums(self) -> list[str]:
        return checksums(self.output())

    def ends(self, index: int | None = None) -> list[RunEnd]:
        return read_ends(self.output(index))


def run_train(*args: str, cwd: Path = ROOT, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m train ARGS` in one process from `cwd`, with the tests' own modules (plugins.*) importable."""
    return subprocess.run(
        [sys.executable, "-m", "train", *args],
        env=clean_env(PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}", **env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _spawn(argv: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    handle = open(log, "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(argv, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=cwd)


def start_slurm_step(
    tmp: Path,
    tasks_per_node: Sequence[int],
    args: Sequence[str],
    nproc_per_node: int | None = None,
    job_id: int | None = None,
    cwd: Path | None = None,
    rank_env: Mapping[int, Mapping[str, str]] | None = None,
) -> Job:
    """One process per task with the variables `srun` gives a step's tasks; nodes are 127.0.0.N.
    `cwd`: the job's working directory (where a user's `--task module:factory` lives); `rank_env`:
    variables that differ for some ranks (one node with another image, say)."""
    job_id = job_id if job_id is not None else random.randint(1000, 900000)
    nodes = len(tasks_per_node)
    tpn = ",".join(str(c) for c in tasks_per_node)
    procs, logs, procid = [], [], 0
    for node, count in enumerate(tasks_per_node):
        for local in range(count):
            env = clean_env(
                SLURM_JOB_ID=str(job_id),
                SLURM_STEP_ID="0",
                SLURM_STEP_NUM_TASKS=str(sum(tasks_per_node)),
                SLURM_PROCID=str(procid),
                SLURM_LOCALID=str(local),
                SLURM_NODEID=str(node),
                SLURM_STEP_TASKS_PER_NODE=tpn,
                SLURM_STEP_NUM_NODES=str(nodes),
                SLURM_STEP_NODELIST=f"127.0.0.[1-{nodes}]" if nodes > 1 else "127.0.0.1",
                SLURM_JOB_NAME="interactive",
            )
            env.update((rank_env or {}).get(procid, {}))
            opts = [f"--nproc-per-node={nproc_per_node}"] if nproc_per_node else []
            logs.append(tmp / f"task{procid}.log")
            procs.append(_spawn([*ENTRYPOINT, *opts, *args], env, logs[-1], cwd))
            procid += 1
    return Job(procs, logs)


def start_standalone(tmp: Path, nproc: int, args: Sequence[str], cwd: Path | None = None, env: Mapping[str, str] | None = None) -> Job:
    """`entrypoint --nproc-per-node N` with nothing set but `env`: torchrun --standalone."""
    log = tmp / "standalone.log"
    return Job([_spawn([*ENTRYPOINT, f"--nproc-per-node={nproc}", *args], clean_env(**(env or {})), log, cwd)], [log])


def start_env_mode(tmp: Path, world: int, args: Sequence[str], env: Mapping[str, str] | None = None) -> Job:
    """`docker run -e RANK=r -e WORLD_SIZE=w -e MASTER_ADDR -e MASTER_PORT IMAGE ...` once per rank, on this host."""
    from train.distributed import free_port  # torch: imported by the tests that start jobs, not by every importer

    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        logs.append(tmp / f"rank{rank}.log")
        ranks = {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(_spawn([*ENTRYPOINT, *args], clean_env(**ranks, **(env or {})), logs[-1], tmp))
    return Job(procs, logs)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def metrics_step(path: Path) -> int:
    """The newest global step in a JSON-lines metrics file (0 before the first line)."""
    if not path.exists():
        return 0
    steps = [json.loads(line).get("global_step", 0) for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return max(steps, default=0)


def subdir(tmp: Path, name: str) -> Path:
    path = tmp / name
    path.mkdir()
    return path


def reference_checksum(
    tmp: Path, args: Sequence[str], ranks: int = 2, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> str:
    """An uninterrupted run's final checksum, the target every resumed run must hit exactly; the
    ranks must agree on it."""
    ref = subdir(tmp, "reference")
    job = start_slurm_step(ref, [ranks], [*args, "--snapshot-dir", str(ref / "snap")], cwd=cwd, rank_env=dict.fromkeys(range(ranks), env or {}))
    assert job.wait() == [0] * ranks, job.output()
    sums = job.checksums()
    assert len(sums) == ranks and len(set(sums)) == 1, job.output()
    return sums[0]


def stopped_mid_epoch_then_resumed(
    tmp: Path, args: Sequence[str], *, after_step: int, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> tuple[Job, Job]:
    """Two ranks of `args` (which name no --snapshot-dir), SIGTERM to rank 1 alone once rank 0 is past
    `after_step`; the stop must land mid-epoch with a snapshot. Returns the stopped job and the rerun of
    the same command, which resumed from it and finished."""
    snap, metrics = tmp / "snap", tmp / "stopped.jsonl"
    full = [*args, "--snapshot-dir", str(snap), "--snapshot-every", "1000", "--log-every", "1"]
    rank_env = dict.fromkeys(range(2), env or {})
    job = start_slurm_step(subdir(tmp, "stopped"), [2], [*full, "--metrics-file", str(metrics)], cwd=cwd, rank_env=rank_env)
    wait_for(lambda: metrics_step(metrics) >= after_step, 120, f"step {after_step}")
    job.send(signal.SIGTERM, [1])  # one node preempted: both ranks must stop at the same step
    assert job.wait() == [143, 143], job.output()
    stopped = job.ends(0)[-1]
    assert stopped.outcome == "stopped" and stopped.signal == "SIGTERM", job.output()
    assert 0 < stopped.step_in_epoch < stopped.steps_per_epoch, f"the stop must land mid-epoch:\n{job.output()}"
    assert [p.name for p in snap.glob("snapshot-*.pt")] == [f"snapshot-{stopped.global_step:010d}.pt"]
    assert stopped.snapshot is not None and Path(stopped.snapshot).name == f"snapshot-{stopped.global_step:010d}.pt"
    resumed = start_slurm_step(subdir(tmp, "resumed"), [2], full, cwd=cwd, rank_env=rank_env)
    assert resumed.wait() == [0, 0], resumed.output()
    position = f"step {stopped.step_in_epoch}/{stopped.steps_per_epoch} (global {stopped.global_step}/"
    assert any("resumed after epoch" in line and position in line for line in resumed.output(0).splitlines()), resumed.output()
    return job, resumed


def grad_sync_pair_reports(device: str) -> list[dict]:
    """Both ranks' reports of tests/plugins/grad_sync_pair.py: a two-rank gloo job on `device` (cpu, or
    cuda: both ranks on GPU 0) checking the gradient-sync hook against DDP's own all-reduce."""
    from train.distributed import free_port

    port = str(free_port())
    script = ROOT / "tests" / "plugins" / "grad_sync_pair.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=clean_env(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DDPACK_TEST_DEVICE=device),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in outputs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
