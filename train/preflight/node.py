"""Node checks that take milliseconds: what makes one node of a job die in its first minutes or train slowly for
hours, read on each node (its first local rank) before any rank trains.

- `/dev/shm`: its size and free space against what the run's DataLoader workers and NCCL put there (a full or 64 MiB
  one kills DataLoader workers with a bus error);
- the locked-memory limit where RDMA devices (EFA, InfiniBand) are used (their memory registrations pin pages);
- the RDMA devices the job expects and their ports' state;
- on GPU nodes, from `nvidia-smi` (the NVIDIA hook's `utility` capability puts it in the container; the image has no
  NVML binding): the GPU count against what the job asked, persistence and compute modes, uncorrected ECC errors
  since the driver loaded, clock throttle reasons, pending or failed row remaps, NVLink links down, and the Xids in
  the kernel log when the container may read it (`dmesg`: most hosts restrict it; the row then says so).

Everything that reads the node is injected (`runner` for commands, `statvfs`, `root`, `memlock`), so that tests give
recorded `nvidia-smi` outputs of healthy and failing GPUs and a small /dev/shm. Each check is one `NodeCheck` row
with its threshold and what to do; the rules are pure functions of what was read.
"""

from __future__ import annotations

import csv
import os
import re
import resource
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from train.preflight.verdict import NodeCheck

# (exit status, text): stdout when the command ran, else the one line that says why not.
Runner = Callable[[Sequence[str], float], tuple[int, str]]
COMMAND_TIMEOUT_S = 10.0  # nvidia-smi without persistence mode initialises every GPU: seconds, not minutes

SHM = "/dev/shm"
# /dev/shm floors. NCCL passes data between the ranks of a node through /dev/shm, and its documentation's Docker
# advice is --shm-size=1g; a CPU job's floor is four times Docker's 64 MiB default, the size DataLoader workers are
# known to exhaust.
SHM_FLOOR_NCCL = 1 << 30
SHM_FLOOR_CPU = 256 << 20
# A DataLoader worker holds up to prefetch_factor batches in /dev/shm (train/data.py LoaderBatches: 4). A sample's
# size is not known before the task is built, which this check does not do: it assumes an ImageNet crop in float32
# (3 x 224 x 224 x 4 bytes), a common vision sample, for tasks of your own.
PREFETCH_FACTOR = 4
ASSUMED_SAMPLE_BYTES = 3 * 224 * 224 * 4
BUILT_IN_TASKS = ("regression", "classification")  # in-memory TensorDatasets: no DataLoader workers (train/data.py)

# Clock throttle (since driver 535: "clocks event") reason bits, NVML's nvmlClocksEventReasons.
HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x8, 0x20, 0x40, 0x80
THROTTLE_FAIL = {HW_SLOWDOWN: "hardware slowdown", HW_THERMAL: "hardware thermal slowdown", HW_POWER_BRAKE: "power brake"}
THROTTLE_RENAMED_AT = (535, 54, 3)  # the driver that renamed clocks_throttle_reasons.* to clocks_event_reasons.*
# The Xids that mean the GPU or its links are bad, not the program (azurehpc-health-checks' azure_gpu_xid.nhc list):
# double-bit ECC (48), row remap events (63, 64), NVLink (74), fallen off the bus (79), GSP (119, 120), ...
BAD_XIDS = frozenset({48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 119, 120})

DRAIN = "drain the node (scontrol update nodename=NODE state=drain reason=...) and have it repaired"


@dataclass(frozen=True, kw_only=True)
class NodeFacts:
    """What the checks compare with, from the job's own settings."""

    node: str
    gpus: bool  # the job uses this node's GPUs (backend nccl)
    gpus_asked: int  # GPUs the job asked on this node: Slurm's SLURM_GPUS_ON_NODE, else one per local rank
    shm_need: int  # bytes of /dev/shm the run needs free
    shm_why: str  # how shm_need was reached, for the threshold column
    efa_expected: bool  # the job asked for EFA (FI_PROVIDER=efa)
    driver: str | None = None  # the NVIDIA driver's version, to pick nvidia-smi's field names


def run_command(argv: Sequence[str], timeout_s: float) -> tuple[int, str]:
    """Run `argv`; (exit status, stdout) when it ran, else (127/124/126, the one line that says why not)."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return 127, f"{argv[0]} is not in this container"
    except subprocess.TimeoutExpired:
        return 124, f"{argv[0]} did not answer within {timeout_s:g} s"
    except OSError as exc:
        return 126, f"{argv[0]}: {exc.strerror or exc}"
    if done.returncode:
        first = next((line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()), "no output")
        return done.returncode, f"{argv[0]} exited {done.returncode}: {first}"
    return 0, done.stdout


def size_text(nbytes: float) -> str:
    """1.0 MiB, 24.5 GiB: the unit a /dev/shm is sized in."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(nbytes) >= 1 << shift:
            return f"{nbytes / (1 << shift):.1f} {unit}"
    return f"{int(nbytes)} B"


# --------------------------------------------------------------------------- /dev/shm and the locked-memory limit


def shm_need(*, nccl: bool, local_ranks: int, workers: int, batch_size: int, task: str) -> tuple[int, str]:
    """(bytes, how): the larger of the floor and what the node's DataLoader workers can hold at once (every local rank's
    workers x prefetched batches x the batch's bytes; none for the built-in in-memory tasks)."""
    floor = SHM_FLOOR_NCCL if nccl else SHM_FLOOR_CPU
    why = f"the {'NCCL' if nccl else 'CPU'} floor"
    if task in BUILT_IN_TASKS or workers == 0:
        return floor, why
    loader = local_ranks * workers * PREFETCH_FACTOR * batch_size * ASSUMED_SAMPLE_BYTES
    if loader <= floor:
        return floor, why
    return (
        loader,
        f"{local_ranks} ranks x {workers} workers x {PREFETCH_FACTOR} batches of {batch_size} x {size_text(ASSUMED_SAMPLE_BYTES)}",
    )


def shm_checks(
    node: str, need: int, why: str, path: str = SHM, statvfs: Callable[[str], os.statvfs_result] = os.statvfs
) -> list[NodeCheck]:
    """Two rows: the size of `path` (too small: its mount is) and its free space (too little: other processes' files)."""
    try:
        stats = statvfs(path)
    except OSError as exc:
        return [
            NodeCheck(node=node, check="shm", value=f"cannot read {path} ({exc.strerror or exc})", threshold=f">= {size_text(need)} free",
                      status="fail", action=f"give the container a {path} (docker --shm-size or --ipc=host; enroot binds the host's)")
        ]  # fmt: skip
    size, free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
    threshold = f">= {size_text(need)} ({why})"
    return [
        NodeCheck(
            node=node, check="shm-size", value=f"{path} {size_text(size)}", threshold=threshold, status="ok" if size >= need else "fail",
            action=f"{path} is too small for the run's DataLoader workers and NCCL: mount it larger (docker --shm-size or --ipc=host; "
            "under enroot and pyxis it is the host's, sized by the host's tmpfs: remount it there) or drain the node",
        ),
        NodeCheck(
            node=node, check="shm-free", value=f"{size_text(free)} free of {size_text(size)}", threshold=threshold,
            status="ok" if free >= need else "fail",
            action=f"{path} is filled by other processes' files (often a previous job's: ls -la {path} on the node); remove what no "
            "running job holds, or drain the node",
        ),
    ]  # fmt: skip


def memlock_limit() -> int:
    """This process's soft RLIMIT_MEMLOCK in bytes (resource.RLIM_INFINITY: unlimited)."""
    return resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]


def memlock_check(node: str, rdma: Sequence[str], limit: int) -> NodeCheck:
    """Unlimited where RDMA devices (EFA, InfiniBand) are: libfabric and verbs pin every buffer they register, and a
    64 KiB limit (a login shell's default, which Slurm passes on to the job) fails NCCL's first registration."""
    value = "unlimited" if limit == resource.RLIM_INFINITY else size_text(limit)
    if not rdma:
        return NodeCheck(node=node, check="memlock", value=value, threshold="unlimited where RDMA devices are (none here)", status="ok")
    return NodeCheck(
        node=node, check="memlock", value=value, threshold="unlimited (RDMA devices: " + ", ".join(rdma[:4]) + ("..." if len(rdma) > 4 else "") + ")",
        status="ok" if limit == resource.RLIM_INFINITY else "fail",
        action="raise the locked-memory limit: LimitMEMLOCK=infinity in slurmd's systemd unit and PropagateResourceLimitsExcept=MEMLOCK "
        "in slurm.conf (else the submitting shell's ulimit -l is passed on); docker: --ulimit memlock=-1",
    )  # fmt: skip


# --------------------------------------------------------------------------- RDMA devices (EFA, InfiniBand)


def rdma_devices(root: Path) -> dict[str, str]:
    """{device: its kernel driver} under /sys/class/infiniband (efa, mlx5_core, ...)."""
    found = {}
    for device in sorted((root / "sys/class/infiniband").glob("*")):
        driver = device / "device" / "driver"
        found[device.name] = Path(os.readlink(driver)).name if driver.is_symlink() else ("efa" if device.name.startswith("rdmap") else "?")
    return found


def port_states(root: Path, device: str) -> dict[str, str]:
    """{port: state} of one RDMA device ("4: ACTIVE" read as ACTIVE)."""
    states = {}
    for port in sorted((root / "sys/class/infiniband" / device / "ports").glob("*")):
        try:
            text = (port / "state").read_text().strip()
        except OSError:
            continue
        states[port.name] = text.split(":", 1)[-1].strip()
    return states


def rdma_checks(node: str, root: Path, efa_expected: bool, used: bool = True) -> list[NodeCheck]:
    """The EFA devices the job expects, and the RDMA ports up (a device with no port ACTIVE is a link down: NCCL falls
    back or hangs at its first collective). `used`: the job uses RDMA (NCCL or EFA); a gloo job on a node with an
    InfiniBand card, or a second port with no cable, is no reason to fail a node, only to say so (warn)."""
    devices = rdma_devices(root)
    efa = [name for name, driver in devices.items() if driver == "efa"]
    rows = [
        NodeCheck(
            node=node, check="efa", value=f"{len(efa)} EFA devices", threshold=">= 1 (FI_PROVIDER=efa)" if efa_expected else "none required",
            status="fail" if efa_expected and not efa else "ok",
            action="FI_PROVIDER=efa asks for EFA but the container sees no EFA device: pass /dev/infiniband into the container "
            "(pyxis does; docker --device /dev/infiniband) and check the instance has EFA enabled, or drain the node",
        )
    ]  # fmt: skip
    states = {name: port_states(root, name) for name in devices}
    down = [f"{name} port {port} {state}" for name, ports in states.items() for port, state in ports.items() if state != "ACTIVE"]
    dead = [name for name, ports in states.items() if ports and "ACTIVE" not in ports.values()]  # not one port up
    if devices:
        status = "fail" if used and dead else "warn" if down else "ok"
        rows.append(
            NodeCheck(
                node=node, check="rdma-ports", value="; ".join(down) if down else f"all ACTIVE on {len(devices)} devices",
                threshold="a port ACTIVE on every device the job uses" if used else "not used by this job (gloo, no EFA)",
                status=status, device=", ".join(d.split(" port")[0] for d in down),
                action="a NIC link is down (cable, switch port or the NIC): " + DRAIN,
            )
        )  # fmt: skip
    return rows


# --------------------------------------------------------------------------- GPUs, from nvidia-smi


@dataclass(frozen=True)
class Gpu:
    index: str
    bus: str
    name: str
    persistence: str  # Enabled / Disabled
    compute_mode: str  # Default / Exclusive_Process / Prohibited
    ecc_uncorrected: str  # a count since the driver loaded, or [N/A] with ECC off
    throttle: str  # the active reasons' bit mask, 0x...


def version_tuple(text: str | None) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text or ""))


def gpu_query(driver: str | None) -> list[str]:
    """The nvidia-smi line of the per-GPU fields (the throttle field has its new name from driver 535.54.03 on)."""
    reasons = "clocks_event_reasons" if version_tuple(driver) >= THROTTLE_RENAMED_AT else "clocks_throttle_reasons"
    fields = f"index,pci.bus_id,name,persistence_mode,compute_mode,ecc.errors.uncorrected.volatile.total,{reasons}.active"
    return ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"]


ROW_REMAP = ["nvidia-smi", "-q", "-d", "ROW_REMAPPER"]
NVLINK = ["nvidia-smi", "nvlink", "-s"]
KERNEL_LOG = ["dmesg"]


def parse_gpus(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=... --format=csv,noheader`: one GPU a line."""
    rows = [row for row in csv.reader(text.splitlines(), skipinitialspace=True) if len(row) == 7]
    return [Gpu(*(cell.strip() for cell in row)) for row in rows]


def gpu_label(gpu: Gpu) -> str:
    return f"GPU {gpu.index} ({gpu.bus})"


def gpu_checks(node: str, gpus: Sequence[Gpu], asked: int) -> list[NodeCheck]:
    """GPU count, persistence mode, compute mode, uncorrected ECC errors, throttle reasons: one row each for the node,
    naming the GPUs that fail."""
    model = gpus[0].name if gpus else "no GPU"
    rows = [
        NodeCheck(
            node=node, check="gpu-count", value=f"{len(gpus)} ({model})", threshold=f">= {asked} (what the job asked on this node)",
            status="ok" if len(gpus) >= asked else "fail",
            action="a GPU is missing (fallen off the bus, or not passed to the container): check nvidia-smi on the node; " + DRAIN,
        )
    ]  # fmt: skip

    def per_gpu(check: str, threshold: str, bad: Callable[[Gpu], str | None], status: str, action: str, ok_value: str) -> None:
        found = [(gpu, why) for gpu in gpus if (why := bad(gpu)) is not None]
        value = "; ".join(f"GPU {gpu.index}: {why}" for gpu, why in found) if found else ok_value
        rows.append(NodeCheck(node=node, check=check, value=value, threshold=threshold, status=status if found else "ok",
                              device=", ".join(gpu_label(gpu) for gpu, _ in found), action=action))  # fmt: skip

    per_gpu("persistence", "Enabled", lambda g: None if g.persistence == "Enabled" else g.persistence, "warn",
            "without persistence mode every process that opens the GPUs waits for the driver to set them up: "
            "nvidia-smi -pm 1 on the node (or the nvidia-persistenced service)", f"Enabled on {len(gpus)}")  # fmt: skip
    per_gpu("compute-mode", "Default or Exclusive_Process", lambda g: g.compute_mode if g.compute_mode == "Prohibited" else None, "fail",
            "a Prohibited GPU runs no CUDA context: nvidia-smi -c DEFAULT on the node", "no GPU Prohibited")  # fmt: skip

    def ecc(gpu: Gpu) -> str | None:
        return f"{gpu.ecc_uncorrected} uncorrected" if gpu.ecc_uncorrected.isdigit() and int(gpu.ecc_uncorrected) > 0 else None

    per_gpu("ecc", "0 uncorrected ECC errors since the driver loaded", ecc, "fail",
            "uncorrected memory errors: the GPU's results can be wrong; " + DRAIN + " (a GPU reset clears the count, not the cause)",
            f"0 on {len(gpus)}")  # fmt: skip

    def throttled(gpu: Gpu) -> str | None:
        try:
            mask = int(gpu.throttle, 16)
        except ValueError:
            return None
        names = [name for bit, name in THROTTLE_FAIL.items() if mask & bit]
        return ", ".join(names) if names else None

    per_gpu("throttle", "no hardware slowdown, hardware thermal slowdown or power brake", throttled, "fail",
            "the GPU's clocks are held down by its hardware (heat, power supply or an external brake): it sets the pace of every "
            "step; check cooling and power on the node, or " + DRAIN, "none active")  # fmt: skip
    per_gpu("thermal", "no software thermal slowdown", lambda g: "software thermal slowdown" if _bits(g.throttle) & SW_THERMAL else None,
            "warn", "the GPU is hot enough for the driver to slow it: check the node's cooling", "none active")  # fmt: skip
    return rows


def _bits(text: str) -> int:
    try:
        return int(text, 16)
    except ValueError:
        return 0


def parse_row_remaps(text: str) -> dict[str, dict[str, str]]:
    """`nvidia-smi -q -d ROW_REMAPPER`: {bus id: {Pending, Remapping Failure Occurred, Uncorrectable Error, ...}}."""
    found: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for line in text.splitlines():
        if match := re.match(r"^GPU\s+([0-9A-Fa-f:.]+)\s*$", line):
            current = found.setdefault(match.group(1), {})
        elif current is not None and ":" in line:
            name, _, value = line.partition(":")
            current[name.strip()] = value.strip()
    return found


def row_remap_check(node: str, remaps: Mapping[str, Mapping[str, str]]) -> NodeCheck:
    """Fail on any pending or failed row remap (Azure's and AWS's GPU health checks do): a pending remap needs a GPU
    reset before the row is replaced; a failed one means the GPU has run out of spare rows."""
    bad = []
    for bus, fields in remaps.items():
        why = [
            what for what, key in (("pending", "Pending"), ("failed", "Remapping Failure Occurred")) if fields.get(key, "").lower() == "yes"
        ]
        if why:
            bad.append((bus, " and ".join(why)))
    return NodeCheck(
        node=node, check="row-remap", value="; ".join(f"{bus}: {why}" for bus, why in bad) or f"none pending or failed on {len(remaps)}",
        threshold="no pending or failed row remap", status="fail" if bad else "ok", device=", ".join(bus for bus, _ in bad),
        action="a pending remap is applied by a GPU reset (nvidia-smi -r with no process on it) or a reboot; a failed one "
        "needs the GPU replaced: " + DRAIN,
    )  # fmt: skip


def parse_nvlink(text: str) -> dict[str, tuple[int, int]]:
    """`nvidia-smi nvlink -s`: {GPU index: (links up, links down)}."""
    found: dict[str, tuple[int, int]] = {}
    gpu = None
    for line in text.splitlines():
        if match := re.match(r"^GPU (\d+):", line):
            gpu = match.group(1)
            found[gpu] = (0, 0)
        elif gpu is not None and (match := re.match(r"^\s*Link \d+:\s*(.*)$", line)):
            up, down = found[gpu]
            found[gpu] = (up, down + 1) if "inactive" in match.group(1).lower() else (up + 1, down)
        elif gpu is not None and "inactive" in line.lower():  # "all links are inActive"
            found[gpu] = (found[gpu][0], max(found[gpu][1], 1))
    return found


def nvlink_check(node: str, links: Mapping[str, tuple[int, int]]) -> NodeCheck:
    """On a node whose GPUs have NVLink (some link up), every GPU's links up; a node with no link up anywhere has none
    (PCIe GPUs), which passes."""
    if not any(up for up, _ in links.values()):
        return NodeCheck(
            node=node, check="nvlink", value="no NVLink link up (PCIe GPUs)", threshold="every link up where NVLink is", status="ok"
        )
    bad = {gpu: down for gpu, (up, down) in links.items() if down}
    return NodeCheck(
        node=node, check="nvlink", value="; ".join(f"GPU {gpu}: {down} links down" for gpu, down in bad.items())
        or f"{sum(up for up, _ in links.values())} links up on {len(links)} GPUs",
        threshold="every link up where NVLink is", status="fail" if bad else "ok", device=", ".join(f"GPU {gpu}" for gpu in bad),
        action="an NVLink link is down: traffic between these GPUs crawls or NCCL hangs; " + DRAIN,
    )  # fmt: skip


def xid_check(node: str, code: int, text: str) -> NodeCheck:
    """The GPU Xids in the kernel log since boot (`NVRM: Xid (PCI:0000:53:00): 79, ...`); most hosts keep the kernel log
    from unprivileged users (kernel.dmesg_restrict=1), and the row then says it could not be read here."""
    threshold = "no Xid " + ", ".join(str(x) for x in sorted(BAD_XIDS)) + " since boot"
    if code:
        return NodeCheck(node=node, check="xid", value=f"not readable here ({text})", threshold=threshold, status="skip",
                         action="read the node's kernel log on the host (dmesg | grep Xid) or in its health check")  # fmt: skip
    seen: dict[int, set[str]] = {}
    for bus, xid in re.findall(r"NVRM: Xid \(PCI:([0-9A-Fa-f:.]+)\): (\d+),", text):
        seen.setdefault(int(xid), set()).add(bus)
    bad = {xid: buses for xid, buses in seen.items() if xid in BAD_XIDS}
    other = sorted(set(seen) - set(bad))
    value = "; ".join(f"Xid {xid} on {', '.join(sorted(buses))}" for xid, buses in sorted(bad.items())) or "none of these"
    if other:
        value += f" (also Xid {', '.join(map(str, other))}: a program's errors, not the GPU's)"
    return NodeCheck(
        node=node, check="xid", value=value, threshold=threshold, status="fail" if bad else "ok",
        device=", ".join(sorted({bus for buses in bad.values() for bus in buses})),
        action="the GPU reported a hardware, memory or link fault since boot (NVIDIA's Xid catalog says which): " + DRAIN,
    )  # fmt: skip


def skipped(node: str, checks: Sequence[str], why: str) -> list[NodeCheck]:
    return [NodeCheck(node=node, check=check, value=f"not checked ({why})", threshold="-", status="skip",
                      action="run with the NVIDIA hook's utility capability (NVIDIA_DRIVER_CAPABILITIES=compute,utility, as the GPU image sets)")
            for check in checks]  # fmt: skip


GPU_CHECKS = ("gpu-count", "persistence", "compute-mode", "ecc", "throttle", "thermal")


def gpu_node_checks(facts: NodeFacts, runner: Runner) -> list[NodeCheck]:
    """The nvidia-smi and kernel-log reads at once (nvidia-smi takes a second or more on a node without persistence mode),
    then their rows."""
    commands = [gpu_query(facts.driver), ROW_REMAP, NVLINK, KERNEL_LOG]
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        (code, text), (remap_code, remap), (link_code, link), (log_code, log) = pool.map(
            lambda argv: runner(argv, COMMAND_TIMEOUT_S), commands
        )
    node = facts.node
    rows = gpu_checks(node, parse_gpus(text), facts.gpus_asked) if code == 0 else skipped(node, GPU_CHECKS, text)
    rows.append(row_remap_check(node, parse_row_remaps(remap)) if remap_code == 0 else skipped(node, ["row-remap"], remap)[0])
    rows.append(nvlink_check(node, parse_nvlink(link)) if link_code == 0 else skipped(node, ["nvlink"], link)[0])
    rows.append(xid_check(node, log_code, log))
    return rows


def node_checks(
    facts: NodeFacts,
    *,
    runner: Runner = run_command,
    statvfs: Callable[[str], os.statvfs_result] = os.statvfs,
    shm: str = SHM,
    root: Path = Path("/"),
    memlock: int | None = None,
) -> tuple[list[NodeCheck], float]:
    """Every check of this node, and the seconds they took."""
    started = time.perf_counter()
    rows = shm_checks(facts.node, facts.shm_need, facts.shm_why, shm, statvfs)
    rdma_used = facts.gpus or facts.efa_expected  # NCCL or EFA: a gloo job registers no memory with a NIC
    rows.append(memlock_check(facts.node, list(rdma_devices(root)) if rdma_used else [], memlock_limit() if memlock is None else memlock))
    rows += rdma_checks(facts.node, root, facts.efa_expected, used=rdma_used)
    if facts.gpus:
        rows += gpu_node_checks(facts, runner)
    return rows, time.perf_counter() - started
