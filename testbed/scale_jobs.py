"""Jobs on the emulated cluster (testbed/emulated_cluster.py) and their figures, for bench/bench_scale.py and the tests.

Every job is the real pyxis-per-task.sbatch and job program, unchanged; the ranks are a stub (one file written in the
shared folder, its mtime the rank's ready time) and the image a squashfs of about 1 MB. What a job did is read from the
command log the emulated cluster keeps (its Slurm shim, the nodes' counted python3 and enroot create) and from each
node's cgroup.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from testbed import emulated_cluster as ec
from testbed.env import ROOT
from testbed.slurm_cluster import stage_dir

STUB = """#!/bin/sh
# ddpack bench_scale's rank: ready when this file exists; with --hold it then waits on the gate (no CPU).
echo "${SLURMD_NODENAME}" > "/fsx/ready/${SLURM_JOB_ID}.${SLURM_STEP_ID}.${SLURM_PROCID}"
case " $* " in *" --hold "*) read -r go < /fsx/gate ;; esac
exit 0
"""
BATCH_STEP = "-"  # the batch script has no SLURM_STEP_ID: its lines in the log are the batch host's own


def build_stub(work: Path, pad_mb: int = 0) -> Path:
    """The stub image: the host's dash as /bin/sh, libc, ld.so, passwd, group, /fsx and the stub entrypoint (about 1 MB),
    plus `pad_mb` MiB of random bytes (incompressible) for a per-byte figure."""
    root = work / "stub-root"
    for folder in ("bin", "lib/x86_64-linux-gnu", "lib64", "etc", "fsx", "usr/local/bin", "tmp", "proc", "sys", "dev", "run", "root"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    shutil.copy("/bin/dash", root / "bin/sh")
    for lib in ("/lib/x86_64-linux-gnu/libc.so.6", "/lib64/ld-linux-x86-64.so.2"):
        shutil.copy(lib, root / lib.lstrip("/"))
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc/group").write_text("root:x:0:\n")
    (root / "etc/environment").write_text("PATH=/usr/local/bin:/usr/bin:/bin\n")
    (root / "usr/local/bin/entrypoint").write_text(STUB)
    (root / "usr/local/bin/entrypoint").chmod(0o755)
    if pad_mb:
        with open(root / "pad", "wb") as pad:
            for _ in range(pad_mb):
                pad.write(os.urandom(1 << 20))
    image = work / "images" / "stub.sqsh"
    image.parent.mkdir(mode=0o755, exist_ok=True)
    subprocess.run(
        ["mksquashfs", str(root), str(image), "-noappend", "-quiet", "-comp", "gzip", "-no-progress"], check=True, stdout=subprocess.DEVNULL
    )
    image.chmod(0o644)
    return image


@dataclass
class Line:
    """One line of the command log: when, which job, step and node, the command and its words."""

    t: float
    job: str
    step: str
    node: str
    cmd: str
    words: list[str]


def read_calls(job: str) -> list[Line]:
    found = []
    for text in ec.CALLS.read_text(errors="replace").splitlines():
        parts = text.split(" ")
        if len(parts) >= 5 and parts[1] == job:
            with contextlib.suppress(ValueError):
                found.append(Line(float(parts[0]), parts[1], parts[2], parts[3], parts[4], parts[5:]))
    return found


def munged_cpu() -> float:
    """munged's CPU so far, seconds (utime + stime)."""
    out = subprocess.run(["pgrep", "-x", "munged"], capture_output=True, text=True).stdout.split()
    total = 0.0
    for pid in out:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@dataclass
class Result:
    """One job's figures."""

    case: str
    nodes: int
    w: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)
    node_cpu: dict[str, float] = field(default_factory=dict)
    ctld_cpu: float = 0.0
    munged_cpu: float = 0.0
    waited: float = 0.0  # the seconds of the window some task waited for a CPU (PSI's "some")
    calls: dict[str, int] = field(default_factory=dict)  # the batch host's Slurm commands, by command
    steps: int = 0
    python_batch: int = 0
    python_per_node: float = 0.0
    node_side_calls: int = 0
    shared_readers: int = 0
    job: str = ""
    batch_host: str = ""  # the node the batch script ran on (its lines in the command log)
    ranks_on: tuple[list[str], list[str]] = ([], [])  # a swap's: the nodes of the step before the DOWN, and after
    share: float = 1.0  # of the queued node CPU, the part on the critical path (bench_scale's calibration; 1: all of it)

    @property
    def queued(self) -> float:
        """The nodes' CPU this host queued that a cluster runs side by side: all but the busiest node's, over the CPUs."""
        cpus = sorted(self.node_cpu.values())
        return (sum(cpus) - (cpus[-1] if cpus else 0)) / (os.cpu_count() or 1)

    @property
    def delta(self) -> float:
        """What the correction takes out: the queued CPU's critical-path share, never more than the seconds some task
        waited for a CPU (a queue costs the critical path no more than that)."""
        return min(self.share * self.queued, self.waited)

    @property
    def r(self) -> float:
        return self.w - self.delta


class ScaleJobs:
    """Jobs on the emulated cluster: its work folder (the shared filesystem, /fsx in the container), the stub image,
    and the figures of each start or swap. `waited(start, end)`: the seconds of that window some task waited for one of
    this host's CPUs (bench_scale samples the kernel's count; 0 where nobody does, and then nothing is taken out)."""

    def __init__(self, work: Path, image: Path, waited: Callable[[float, float], float] = lambda start, end: 0.0) -> None:
        self.work, self.image, self.waited = work, image, waited
        self.env = ec.client_env(PATH=f"{ec.SHIM}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}")
        self.stage = stage_dir(0)

    def slurm(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return ec.slurm(*argv, check=check)

    def empty_nodes(self, nodes: list[str], staged_too: bool) -> None:
        """Every node's enroot data (containers) gone, and with `staged_too` its staging folder: a cold node."""
        for node in nodes:
            shutil.rmtree(ec.DISKS / "enroot" / node, ignore_errors=True)
            if staged_too:
                shutil.rmtree(ec.DISKS / node / self.stage.name, ignore_errors=True)

    def idle(self, timeout: float = 120) -> None:
        """Wait until no job of ours is left and every node is idle."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = self.slurm("squeue", "-h", "-o", "%i").stdout.split()
            states = self.slurm("sinfo", "-h", "-N", "-o", "%T").stdout.split()
            if not jobs and all(state == "idle" for state in states):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the emulated cluster did not come back idle: {self.slurm('squeue', check=False).stdout}")

    def submit(self, nodes: int, **settings: str) -> tuple[str, float]:
        given = {"DDPACK_SQSH": str(self.image), "DDPACK_MOUNTS": f"{self.work}:/fsx", "DDPACK_STAGE_DIR": str(self.stage), **settings}
        exports = ",".join(["ALL", *(f"{k}={v}" for k, v in given.items())])
        template = str(ROOT / "enroot" / "pyxis-per-task.sbatch")
        argv = ["sbatch", "--parsable", "--job-name=scale", f"--nodes={nodes}", "--ntasks-per-node=1", f"--export={exports}", template]
        for attempt in range(10):  # a node resumed just before (the last swap's victim) may not be schedulable yet
            t0 = time.time()
            out = subprocess.run(argv, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=60)
            if out.returncode == 0:
                return out.stdout.strip().split(";")[0], t0
            time.sleep(1 + attempt)
        raise RuntimeError(
            f"sbatch of {nodes} emulated nodes failed (exit {out.returncode}): {out.stderr.strip()}; {self.slurm('sinfo', check=False).stdout}"
        )

    def ready(self, job: str) -> dict[str, dict[int, float]]:
        """{step: {rank: ready time}} of job `job`, from the stub's files."""
        found: dict[str, dict[int, float]] = {}
        for entry in (self.work / "ready").glob(f"{job}.*"):
            _, step, rank = entry.name.split(".")
            with contextlib.suppress(OSError):
                found.setdefault(step, {})[int(rank)] = entry.stat().st_mtime
        return found

    def ready_nodes(self, job: str, step: str) -> list[str]:
        """The nodes the ranks of `step` ran on (each rank's file names its node)."""
        return sorted((entry.read_text().strip() for entry in (self.work / "ready").glob(f"{job}.{step}.*")), key=lambda n: int(n[2:]))

    def log(self, job: str) -> str:
        path = self.work / "logs" / f"scale-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait(self, what: str, job: str, until, timeout: float = 300):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while True:
            found = until()
            if found:
                return found
            state = self.slurm("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip()
            if time.monotonic() > deadline or (not state and not until()):
                raise RuntimeError(f"job {job}: {what} did not happen (state {state or 'gone'}):\n{self.log(job)[-3000:]}")
            time.sleep(0.05)

    def start(self, case: str, nodes: int, bad: str = "") -> Result:
        """One start (cold, warm or bad) of `nodes` nodes: W, phases, CPU, counts."""
        names = ec.node_names(nodes)
        self.idle()
        self.empty_nodes(names, staged_too=case != "warm")
        blocker = ec.DISKS / bad / self.stage.name if bad else None
        if blocker is not None:
            blocker.write_text("not a folder")
        cpu0, ctld0, munge0 = ec.cgroup_usage(), ec.cgroup_usage().get("ctld", 0), munged_cpu()
        job, t0 = self.submit(nodes, DDPACK_STAGE="auto" if case == "warm" else "sbcast")
        steps = self.wait(f"{nodes} ranks ready", job, lambda: [s for s, ranks in self.ready(job).items() if len(ranks) >= nodes])
        cpu1, munge1 = ec.cgroup_usage(), munged_cpu()
        ranks = self.ready(job)[steps[0]]
        result = self.figures(case, nodes, job, t0, ranks, cpu0, cpu1, ctld0, munge1 - munge0)
        self.wait("its end", job, lambda: not self.slurm("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip())
        if blocker is not None:
            blocker.unlink()
        return result

    def figures(
        self, case: str, nodes: int, job: str, t0: float, ranks: dict[int, float], cpu0: dict, cpu1: dict, ctld0: int, munge: float
    ) -> Result:
        first, last = min(ranks.values()), max(ranks.values())
        calls = [line for line in read_calls(job) if t0 <= line.t <= last]  # a swap's window starts at the DOWN
        batch = [line for line in calls if line.step == BATCH_STEP]
        result = Result(case, nodes, w=last - t0, job=job)
        result.node_cpu = {n: (cpu1.get(n, 0) - cpu0.get(n, 0)) / 1e9 for n in cpu1 if n != "ctld"}
        result.ctld_cpu = (cpu1.get("ctld", 0) - ctld0) / 1e9
        result.munged_cpu = munge
        result.waited = self.waited(t0, last)
        for line in batch:
            if line.cmd in ec.SLURM_COMMANDS:
                result.calls[line.cmd] = result.calls.get(line.cmd, 0) + 1
        result.steps = result.calls.get("srun", 0)
        result.batch_host = batch[0].node if batch else ""
        result.python_batch = sum(1 for line in batch if line.cmd == "python3")
        result.python_per_node = sum(1 for line in calls if line.cmd == "python3" and line.step != BATCH_STEP) / nodes
        result.node_side_calls = sum(1 for line in calls if line.cmd in ec.SLURM_COMMANDS and line.step != BATCH_STEP)
        creates = [line for line in calls if line.cmd == "enroot-create"]
        result.shared_readers = len({line.node for line in creates if line.words[1:2] == [str(self.image)]})
        srun = [line for line in batch if line.cmd == "srun"]

        def at(word: str) -> float | None:
            return next((line.t for line in srun if word in line.words), None)

        train = [line.t for line in srun if any(w.startswith("--container-image") for w in line.words) and "entrypoint" in line.words]
        start_batch = batch[0].t if batch else t0
        marks = {
            "batch": start_batch,
            "prepare": at("prepare"),
            "holder": at("receive"),
            "install": at("install"),
            "train": train[-1] if train else None,
        }
        sbcast = next((line.t for line in batch if line.cmd == "sbcast"), None)
        p = result.phases
        p["queue"] = start_batch - t0
        p["setup"] = (marks["prepare"] or start_batch) - start_batch
        after_prepare = marks["holder"] or marks["train"] or last
        p["prepare"] = after_prepare - (marks["prepare"] or after_prepare)
        if marks["holder"]:
            p["holder"] = (sbcast or marks["install"] or after_prepare) - marks["holder"]
            p["sbcast"] = (marks["install"] or after_prepare) - (sbcast or after_prepare)
            p["install"] = (marks["train"] or last) - (marks["install"] or last)
        p["launch"] = first - (marks["train"] or first)
        if creates:
            p["unpack"] = max(float(line.words[0]) for line in creates) - min(line.t for line in creates)
        p["spread"] = last - first
        return result

    def swap(self, nodes: int) -> Result:
        """`nodes` nodes, one a spare: the ranks hold, a training node that is not the batch host goes DOWN; the time until
        every rank of the restarted step is ready.

        Without standbys (DDPACK_STANDBYS=0), as a GPU job's swap runs (the rule's auto gives a CUDA job none; this stub
        job asks for no GPUs, so auto would give it one). With a standby the training step is 3 tasks on 2 nodes
        (--distribution=arbitrary, --overcommit), and Slurm 22.05's controller, on this node's DOWN, found the job's
        nodes' run_job_cnt already 0 (make_node_idle and make_node_comp: run_job_cnt underflow) and dumped core in
        select_nodes (bit_copy) at the next sbatch: two swaps of two with a standby, none of 23 without (docs/scale.md,
        "The swap's crash, found")."""
        names = ec.node_names(nodes)
        self.idle()
        self.empty_nodes(names, staged_too=False)
        gate = self.work / "gate"
        gate.unlink(missing_ok=True)
        os.mkfifo(gate, 0o666)
        job, _ = self.submit(nodes, DDPACK_SPARE_NODES="1", DDPACK_STAGE="auto", DDPACK_TRAIN_ARGS="--hold", DDPACK_STANDBYS="0")
        train = nodes - 1
        steps = self.wait(f"{train} ranks held", job, lambda: [s for s, ranks in self.ready(job).items() if len(ranks) >= train])
        victim = names[train - 1]
        cpu0, ctld0, munge0 = ec.cgroup_usage(), ec.cgroup_usage().get("ctld", 0), munged_cpu()
        t0 = time.time()
        try:
            self.slurm("scontrol", "update", f"nodename={victim}", "state=down", "reason=bench-scale")
            again = self.wait(
                f"{train} ranks of the restarted step",
                job,
                lambda: [s for s, ranks in self.ready(job).items() if s not in steps and len(ranks) >= train],
            )
            cpu1, munge1 = ec.cgroup_usage(), munged_cpu()
            result = self.figures("swap", nodes, job, t0, self.ready(job)[again[0]], cpu0, cpu1, ctld0, munge1 - munge0)
            result.ranks_on = (self.ready_nodes(job, steps[0]), self.ready_nodes(job, again[0]))
        finally:
            deadline = time.monotonic() + 60
            while self.slurm("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip() and time.monotonic() < deadline:
                with contextlib.suppress(OSError):
                    fd = os.open(gate, os.O_RDWR | os.O_NONBLOCK)
                    time.sleep(0.3)
                    os.close(fd)
                time.sleep(0.2)
            self.slurm("scancel", job, check=False)
            self.slurm("scontrol", "update", f"nodename={victim}", "state=resume", check=False)
            gate.unlink(missing_ok=True)
        return result
