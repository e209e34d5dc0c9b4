"""Which training-step shape makes the emulated Slurm 22.05 controller lose its node counts (docs/scale.md, "The swap's
crash, found"): each try a fresh 3-node emulated cluster, a `--no-kill --exclusive` job of 3 nodes running one raw
`srun ... sleep` step of the shape on ds1,ds2 (no container: only Slurm's side is tried), ds2 set DOWN (unless the
shape's name ends in -nodown), the job cancelled, one more sbatch; then whether the controller logged
`run_job_cnt underflow` and is still alive. Needs root and the cluster lock:
`flock /tmp/ddpack-cluster.lock python -m testbed.step_shape_tries arbitrary-2 plain arbitrary-2-nodown`."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from testbed import emulated_cluster as ec

STEP = ["--nodes=2", "--kill-on-bad-exit=0"]
# name: (srun's options, SLURM_HOSTFILE's lines or none); every shape's step has SRUN_CPUS_PER_TASK=2
SHAPES: dict[str, tuple[list[str], list[str]]] = {
    "today": ([*STEP, "--ntasks=4", "--distribution=arbitrary", "--overcommit"], ["ds1", "ds2", "ds1", "ds1"]),
    "no-overcommit": ([*STEP, "--ntasks=4", "--distribution=arbitrary"], ["ds1", "ds2", "ds1", "ds1"]),
    "block": ([*STEP, "--ntasks=4", "--overcommit", "--nodelist=ds1,ds2"], []),
    "standby-other": ([*STEP, "--ntasks=4", "--distribution=arbitrary", "--overcommit"], ["ds1", "ds2", "ds2", "ds1"]),
    "plain-overcommit": (["--nodes=2", "--ntasks=2", "--nodelist=ds1,ds2", "--overcommit"], []),
    "arbitrary-2": ([*STEP, "--ntasks=2", "--distribution=arbitrary"], ["ds1", "ds2"]),
    "plain": (["--nodes=2", "--ntasks=2", "--nodelist=ds1,ds2"], []),
}


def job_script(work: Path, name: str) -> Path:
    """The job's script: the step of shape `name` as the job program runs it (SLURM_NTASKS_PER_NODE and SLURM_WAIT
    out of its environment, as `standby_step` takes them out)."""
    options, hosts = SHAPES[name]
    lines = ["#!/bin/bash", "unset SLURM_NTASKS_PER_NODE SLURM_WAIT", "export SRUN_CPUS_PER_TASK=2"]
    if hosts:
        (work / f"hosts-{name}").write_text("\n".join(hosts) + "\n")
        lines.append(f"export SLURM_HOSTFILE={work}/hosts-{name}")
    lines += [f"srun {' '.join(options)} sleep 120", "echo step-exit $?"]
    script = work / f"job-{name}.sh"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    return script


def attempt(name: str, work: Path) -> dict[str, object]:
    """One try on a fresh controller; what it showed."""
    shape, down = (name[: -len("-nodown")], False) if name.endswith("-nodown") else (name, True)
    ec.up(3, need_cpu=False)
    log = ec.LOGS / "slurmctld.log"
    start = log.stat().st_size if log.exists() else 0
    try:
        out = ec.slurm(
            "sbatch",
            "--parsable",
            "--nodes=3",
            "--ntasks-per-node=1",
            "--exclusive",
            "--no-kill",
            f"--output={work}/out-%j",
            str(job_script(work, shape)),
        )
        job = out.stdout.strip()
        deadline = time.monotonic() + 60
        while f"{job}.0" not in ec.slurm("squeue", "-h", "-s", "-j", job, "-o", "%i").stdout and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)
        running = ec.slurm("sinfo", "-h", "-N", "-o", "%N %T").stdout.split("\n")
        if down:
            ec.slurm("scontrol", "update", "nodename=ds2", "state=down", "reason=step-shape-tries")
        time.sleep(4)
        ec.slurm("scancel", job)
        time.sleep(8)
        if down:
            ec.slurm("scontrol", "update", "nodename=ds2", "state=resume")
        after = ec.slurm("sbatch", "--parsable", "--nodes=1", "--wrap=true", f"--output={work}/next-%j")
        time.sleep(5)
        alive = "UP" in ec.slurm("scontrol", "ping").stdout
        text = log.read_text(errors="replace")[start:] if log.exists() else ""
        underflow = [line for line in text.splitlines() if "underflow" in line]
        return {
            "try": name,
            "nodes while the step ran": running,
            "underflow": underflow,
            "next sbatch": after.returncode,
            "controller alive": alive,
        }
    finally:
        ec.down()


def main(names: list[str]) -> int:
    unknown = [name for name in names if name.removesuffix("-nodown") not in SHAPES]
    if not names or unknown:
        print(f"step_shape_tries: name shapes of {', '.join(SHAPES)} (a -nodown suffix: no node set DOWN); not {unknown}", file=sys.stderr)
        return 2
    # Made new (a fixed name in /tmp, chmod 0777, would let another user swap in the scripts root's jobs run), kept
    # after: the jobs' outputs are its out-* and next-* files.
    work = Path(tempfile.mkdtemp(prefix="ddpack-step-shape-tries-", dir="/tmp"))
    work.chmod(0o755)
    print(f"step_shape_tries: job scripts and outputs in {work}", file=sys.stderr)
    for name in names:
        print(json.dumps(attempt(name, work)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
