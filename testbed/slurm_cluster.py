"""A real Slurm of three nodes on this one machine, for the tests (Debian's slurm-wlm + munge).

Three slurmd daemons (`-N ddnode1` ... `-N ddnode3`) on different ports stand in for three nodes; their names
resolve to 127.0.0.1 through /etc/hosts, as cluster node names resolve on a real cluster. Partition `debug`
(the default) holds two of them, as the templates' two-node jobs need; `big` holds all three, for a job with a
spare node. Each slurmd runs in a mount namespace of its own where NODE_TMP is that node's own folder (sticky and
world-writable, as a node's /tmp is): jobs submitted through testbed.slurm_jobs stage images in a folder of their
user's there (DDPACK_STAGE_DIR=NODE_TMP/ddpack-images-<uid>, as the templates' default is /tmp/ddpack-images-<uid>),
so an image staged to "every node's local disk" lands once per node here too, and a test can plant files on one
node as another user would in that node's /tmp.
Partition `gpu` holds all three too, and every node announces two GPUs (GRES gpu:2, whose device files are stand-ins:
Slurm 22.05 drops a gpu GRES without files): these nodes have no GPU, as a GPU partition's nodes whose GPUs a job
cannot use, so a GPU job's request, script and record are real here, and so is its refusal on nodes without the
GPUs it was promised.
Partition `cores` holds ddnode1 and ddnode2 with Slurm's default OverSubscribe=NO (the others force oversubscription,
which would let --exclusive jobs share a node): there a job's CPUs are its own, so jobs that each ask less than a node
share nodes only as far as their CPUs fit, as on a real cluster.
Idempotent: a running cluster is reused, and restarted when its configuration changed. Needs root; writes
/etc/slurm/slurm.conf and gres.conf only when they are absent or ours.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

CONF = Path("/etc/slurm/slurm.conf")
GRES_CONF = Path("/etc/slurm/gres.conf")
MARKER = "# ddpack test cluster"
GPUS_PER_NODE = 2
NODES = ("ddnode1", "ddnode2", "ddnode3")
NODE_TMP = Path("/tmp/ddnode-tmp")  # each node's own /tmp, for the staging folders
NODE_DISKS = Path("/var/lib/ddpack-test-nodes")  # NODE_DISKS/<node> is NODE_TMP as that node sees it


def stage_dir(uid: int) -> Path:
    """DDPACK_STAGE_DIR for jobs of user `uid` on the test cluster (the templates' /tmp/ddpack-images-<uid>)."""
    return NODE_TMP / f"ddpack-images-{uid}"


def node_stage_dir(node: str, uid: int) -> Path:
    """That staging folder as the host sees node `node`'s copy of it."""
    return NODE_DISKS / node / stage_dir(uid).name


# What the test cluster and the emulated one (testbed/emulated_cluster.py) share, written once: no cgroups, the
# scheduler's pace, core selection, no accounting. A requeued job waits out the credential lifetime (cred_expire) before
# it may start again; once that wait is over, no event wakes the scheduler for it: the backfill pass (every bf_interval
# seconds, 30 by default) or the main loop (every sched_interval, 60 by default) starts it. With bf_interval=1 alone the
# main loop still started most of them, on its minute: a requeue cost 12 to 68 s (28 on average over 25 in this host's
# slurmctld log, 49 s for one Lightning preemption) where cred_expire's 10 s is the floor.
COMMON_SETTINGS = """SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=5
MinJobAge=30
"""

SLURM_CONF = f"""{MARKER}
ClusterName=ddpack
SlurmctldHost=localhost
AuthType=auth/munge
CredType=cred/munge
# A requeued job waits out the credential lifetime before it may start again (default 120 s).
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
StateSaveLocation=/var/spool/slurmctld
# The slurmd ports lie outside [15000, 30000), where the launcher derives a step's MASTER_PORT from its job and
# step id (entrypoint/plan.py): a rank of job 125 would otherwise find ddnode2's port taken.
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
{COMMON_SETTINGS}GresTypes=gpu
NodeName=ddnode1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=6831 CPUs=2 RealMemory=4000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN
NodeName=ddnode2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=6832 CPUs=2 RealMemory=4000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN
NodeName=ddnode3 NodeHostname=localhost NodeAddr=127.0.0.1 Port=6833 CPUs=2 RealMemory=4000 Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN
PartitionName=debug Nodes=ddnode[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
PartitionName=big Nodes=ddnode[1-3] MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
PartitionName=gpu Nodes=ddnode[1-3] MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
PartitionName=cores Nodes=ddnode[1-2] MaxTime=INFINITE State=UP
"""
# Slurm 22.05 drops a gpu GRES with no device file ("Removing file-less GPU"), so each node's GPUs are stand-in
# character devices (copies of /dev/null) that no NVIDIA driver or torch takes for a GPU: /dev/nvidia* stays empty.
FAKE_GPUS = [Path(f"/dev/ddpack-test-gpu{index}") for index in range(GPUS_PER_NODE)]
GRES = f"""{MARKER}
Name=gpu File=/dev/ddpack-test-gpu[0-{GPUS_PER_NODE - 1}]
"""


# A task's `enroot` is its node's (the per-node wrapper below, as plain `enroot` is on a real node), so a job's
# own enroot calls (removing its container) reach the data folder pyxis used on that node: a dispatcher early on
# root's PATH (/usr/local/sbin) picks the wrapper of the node a task runs on, and plain enroot elsewhere. (A
# TaskProlog cannot do it: under pyxis it runs inside the container.)
NODE_ENROOT = Path("/usr/local/sbin/enroot")
NODE_ENROOT_TEXT = """#!/bin/sh
# ddpack test cluster: the enroot of the simulated node this task runs on (testbed/slurm_cluster.py).
wrapper=/usr/local/lib/enroot-nodes/${SLURMD_NODENAME:-none}/enroot
[ -x "$wrapper" ] && exec "$wrapper" "$@"
exec /usr/bin/enroot "$@"
"""


def clear_staged_images() -> None:
    """Remove every user's staging folder from every node's disk (a start that must stage again, cold)."""
    for node in NODES:  # what is in it only: each node's folder is mounted as its NODE_TMP
        for old in (NODE_DISKS / node).glob("ddpack-images-*"):
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


class ClusterUnavailable(RuntimeError):
    """Why a Slurm cluster cannot be had here."""


PARTITIONS = ("debug", "big", "gpu", "cores")


def restore_cluster(timeout_s: float = 60) -> str:
    """Cancel every job still queued or running and wait until Slurm has let them go, then set any partition or node
    that is down (or drained) up again; what was found, in words ("" when the cluster was as it starts)."""
    found = []
    jobs = _queued_jobs()
    if jobs:
        found.append(f"jobs {','.join(jobs)} cancelled")
        subprocess.run(["scancel", *jobs], capture_output=True, timeout=20)
        deadline = time.monotonic() + timeout_s
        while _queued_jobs():
            if time.monotonic() > deadline:
                raise ClusterUnavailable(f"jobs {','.join(jobs)} did not leave the queue within {timeout_s:.0f} s of scancel")
            time.sleep(0.2)
    partitions = subprocess.run(["sinfo", "-h", "-o", "%R %a"], capture_output=True, text=True, timeout=20).stdout.splitlines()
    for name, avail in sorted({tuple(line.split()) for line in partitions if line.strip()}):
        if name in PARTITIONS and avail != "up":
            found.append(f"partition {name} up")
            subprocess.run(["scontrol", "update", f"partitionname={name}", "state=up"], capture_output=True, timeout=20)
    states = _node_states()
    down = [node for node in NODES if states.get(node, "").startswith(("down", "drain"))]
    if down:
        found.append(f"nodes {','.join(down)} resumed")
        subprocess.run(["scontrol", "update", f"nodename={','.join(down)}", "state=resume"], capture_output=True, timeout=20)
    return "; ".join(found)


def _node_states() -> dict[str, str]:
    """Each node's state as sinfo gives it ({} when sinfo fails)."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=20)
    return dict(line.split()[:2] for line in out.stdout.splitlines() if len(line.split()) >= 2) if out.returncode == 0 else {}


def _idle_nodes() -> int:
    return sum(1 for state in _node_states().values() if state in ("idle", "mixed", "allocated"))


def _queued_jobs() -> list[str]:
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=20).stdout.split()


# The nodes' enroot data disk: a journaled ext4 (a loop file, plain mkfs.ext4) as a node's local disk is. This VM's
# root is an ext4 without a journal, where the kernel will not reuse an inode freed in the last 60 s and looks at
# every recently freed one to find a free one: an `enroot create` soon after an `enroot remove` (every job's) costs
# ~10x what it does on a node's disk (11 s against 1.7 s for the CPU image, measured here; 20-30 s with two nodes
# unpacking at once). bench_start.py mounts a fresh one for its run (--journaled-data).


def mount_device(folder: Path) -> str | None:
    """The device (major:minor) of the filesystem mounted exactly at `folder` in this process's mount namespace (the
    last one, where several are stacked), or None."""
    found = [fields[2] for fields in map(str.split, Path("/proc/self/mountinfo").read_text().splitlines()) if fields[4] == str(folder)]
    return found[-1] if found else None


def mount_journaled_ext4(folder: Path, image: Path, size_gib: int) -> None:
    """Make `image` a fresh sparse ext4 of `size_gib` (with its journal) and mount it over `folder`, whose first two
    levels of folders (a node's, a user's: not the containers in them) are laid down again on it with their owners and
    modes, as enroot and its users expect them. Needs root. The image's blocks are taken as they are written and given
    back to the host's disk as they are freed (`discard`: every job removes its container, and without it the file
    grew to 27 GiB of freed blocks over one CI dry run and a few test runs here, and CI's own run filled its disk)."""
    levels = [*folder.glob("*"), *(user for node in folder.glob("*") if not node.name.startswith("user-") for user in node.glob("user-*"))]
    skeleton = [(path.relative_to(folder), path.stat()) for path in sorted(levels) if path.is_dir() and not path.is_symlink()]
    top = folder.stat()
    image.unlink(missing_ok=True)
    with open(image, "wb") as handle:
        handle.truncate(size_gib << 30)
    image.chmod(0o600)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
    subprocess.run(["mount", "-o", "loop,discard", str(image), str(folder)], check=True)
    for path, info in [(folder, top), *((folder / rel, st) for rel, st in skeleton)]:
        path.mkdir(exist_ok=True)
        os.chown(path, info.st_uid, info.st_gid)
        path.chmod(info.st_mode & 0o7777)


# Written by ../shared/tools/install-enroot-pyxis.sh: a per-node enroot wrapper (several slurmd share
# this host, and pyxis runs enroot from slurmstepd's PATH) and pyxis' plugstack entry.
ENROOT_NODE_WRAPPERS = Path("/usr/local/lib/enroot-nodes")
ENROOT_DATA = Path("/tmp/enroot/data")  # every node's ENROOT_DATA_PATH (and the host's) lies under it
ENROOT_DATA_GIB = 40  # sparse: the disk takes what its containers hold at most (1.3 GiB each for the CPU image)
PYXIS_PLUGSTACK = Path("/etc/slurm/plugstack.conf.d/pyxis.conf")


def _slurmd_pid(node: str) -> int | None:
    out = subprocess.run(["pgrep", "-f", f"slurmd -N {node}$"], capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.split() else None


@contextlib.contextmanager
def full_shm(node: str, size: str = "1m") -> Iterator[None]:
    """`node`'s /dev/shm a full tmpfs of `size` while the block runs: a bad node, made in its slurmd's own mount namespace
    alone (_start_slurmd), where every step and pyxis container of that node is started, and enroot binds /dev/shm
    into each container (its mounts.d/10-system.fstab) as it does on a real node. The other nodes keep the host's.
    Needs root; the tmpfs is unmounted afterwards whatever happened, which gives the node its /dev/shm back."""
    pid = _slurmd_pid(node)
    if pid is None:
        raise ClusterUnavailable(f"no slurmd runs for {node}")
    inside = ["nsenter", f"--target={pid}", "--mount"]
    subprocess.run([*inside, "mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "ddpack-full-shm", "/dev/shm"], check=True)
    try:
        subprocess.run([*inside, "sh", "-c", "cat /dev/zero > /dev/shm/ddpack-filler 2>/dev/null; true"], check=True)  # ENOSPC: full
        yield
    finally:
        subprocess.run([*inside, "umount", "/dev/shm"], check=True)


def _own_disk(pid: int) -> bool:
    """The slurmd sees NODE_TMP as its node's own folder (it was started by _start_slurmd), and that folder
    still exists (removing it leaves the mount on a deleted directory, where nothing can be written); and it sees
    the nodes' enroot data disk when this host has it mounted (a slurmd started before it was would unpack beside it)."""
    try:
        mounts = [line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
    except OSError:
        return False
    own = any(m[4] == str(NODE_TMP) and not m[3].endswith("//deleted") for m in mounts)
    data = mount_device(ENROOT_DATA)  # the same filesystem (device), not an older one mounted there
    return own and (data is None or any(m[4] == str(ENROOT_DATA) and m[2] == data for m in mounts))


def _enroot_data_on_a_node_disk() -> None:
    """Every node's enroot data folder (ENROOT_DATA) on a journaled ext4, as a node keeps ENROOT_DATA_PATH on its
    local disk, not on this VM's journal-less root, where each unpack after a removal cost 20-30 s (see above)."""
    if ENROOT_DATA.is_dir() and mount_device(ENROOT_DATA) is None:
        NODE_DISKS.mkdir(parents=True, exist_ok=True)
        mount_journaled_ext4(ENROOT_DATA, NODE_DISKS / "enroot-data.ext4", ENROOT_DATA_GIB)
    elif mount_device(ENROOT_DATA) is not None and "discard" not in mount_options(ENROOT_DATA):
        # mounted by an older testbed, without discard: give back what it holds freed, and from now on as it frees
        subprocess.run(["mount", "-o", "remount,discard", str(ENROOT_DATA)], check=True)
        subprocess.run(["fstrim", str(ENROOT_DATA)], check=True)


def mount_options(folder: Path) -> list[str]:
    """The options of the filesystem mounted at `folder` (the last one stacked there), as /proc/mounts lists them."""
    found = [fields[3].split(",") for fields in map(str.split, Path("/proc/mounts").read_text().splitlines()) if fields[1] == str(folder)]
    return found[-1] if found else []


def _start_slurmd(node: str) -> None:
    """Start this node's slurmd with its enroot wrapper first on PATH (when installed), in a mount namespace
    where NODE_TMP is the node's own folder; restart one that predates pyxis' plugstack entry, lacks the
    wrapper or that folder, since slurmd reads all three only when it starts (its steps inherit them)."""
    wrapper = ENROOT_NODE_WRAPPERS / node
    env = dict(os.environ)
    if wrapper.is_dir():
        env["PATH"] = f"{wrapper}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
    pid = _slurmd_pid(node)
    if pid is not None:
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        stale = wrapper.is_dir() and str(wrapper) not in environ
        stale = stale or (PYXIS_PLUGSTACK.exists() and PYXIS_PLUGSTACK.lstat().st_mtime > Path(f"/proc/{pid}").stat().st_mtime)
        stale = stale or not _own_disk(pid)
        if not stale:
            return
        subprocess.run(["kill", str(pid)], check=True)
        deadline = time.monotonic() + 20
        while _slurmd_pid(node) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
    disk = NODE_DISKS / node
    disk.mkdir(parents=True, exist_ok=True)
    disk.chmod(0o1777)  # as a node's /tmp: every user may make a folder there, and only remove their own
    NODE_TMP.mkdir(parents=True, exist_ok=True)
    own_disk = f'mount --bind "{disk}" "{NODE_TMP}" && exec slurmd -N {node}'
    subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", own_disk], check=True, env=env)


def _stop_daemons(timeout_s: float = 30) -> None:
    """Stop slurmctld and the nodes' slurmd, if running, and wait for them to go (a configuration change)."""
    patterns = [["-x", "slurmctld"], *(["-f", f"slurmd -N {node}$"] for node in NODES)]
    for pattern in patterns:
        subprocess.run(["pkill", *pattern], capture_output=True)
    deadline = time.monotonic() + timeout_s
    while any(subprocess.run(["pgrep", *p], capture_output=True).returncode == 0 for p in patterns):
        if time.monotonic() > deadline:
            raise ClusterUnavailable("slurmctld or a slurmd did not stop for the new configuration; see /var/log/slurm/")
        time.sleep(0.2)


def ensure_cluster(timeout_s: float = 60) -> None:
    """Start munged, slurmctld and every node's slurmd unless a cluster already answers with all of them."""
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        raise ClusterUnavailable("slurm-wlm and munge are not installed (apt-get install -y slurm-wlm munge)")
    if _idle_nodes() >= len(NODES) and os.geteuid() != 0:
        return
    if os.geteuid() != 0:
        raise ClusterUnavailable("starting a test Slurm cluster needs root")
    for conf in (CONF, GRES_CONF):
        if conf.exists() and MARKER not in conf.read_text():
            raise ClusterUnavailable(f"{conf} belongs to another Slurm set-up; not touching it")
    CONF.parent.mkdir(parents=True, exist_ok=True)
    changed = [conf for conf, text in ((CONF, SLURM_CONF), (GRES_CONF, GRES)) if not conf.exists() or conf.read_text() != text]
    for conf, text in ((CONF, SLURM_CONF), (GRES_CONF, GRES)):
        conf.write_text(text)
    for device in FAKE_GPUS:
        if not device.exists():
            os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    if changed:
        _stop_daemons()  # slurmctld and each slurmd read their configuration only when they start
    NODE_ENROOT.write_text(NODE_ENROOT_TEXT)
    NODE_ENROOT.chmod(0o755)
    hosts = Path("/etc/hosts")
    if not all(node in hosts.read_text().split() for node in NODES):
        with hosts.open("a") as handle:
            handle.write(f"127.0.0.1 {' '.join(NODES)}\n")
    for folder in ("/var/spool/slurmctld", "/var/log/slurm", *(f"/var/spool/slurmd/{n}" for n in NODES)):
        Path(folder).mkdir(parents=True, exist_ok=True)
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
        subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True)
    if subprocess.run(["pgrep", "-x", "slurmctld"], capture_output=True).returncode != 0:
        subprocess.run(["slurmctld"], check=True)
    _enroot_data_on_a_node_disk()
    for node in NODES:
        _start_slurmd(node)
    if changed:  # nodes an earlier configuration drained (slurmctld keeps their state) come back under this one
        subprocess.run(["scontrol", "update", f"nodename={','.join(NODES)}", "state=resume"], capture_output=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _idle_nodes() >= len(NODES):
            return
        time.sleep(1)
    raise ClusterUnavailable(f"Slurm nodes did not become idle in {timeout_s:.0f}s; see /var/log/slurm/")


if __name__ == "__main__":
    ensure_cluster()
    print(subprocess.run(["sinfo"], capture_output=True, text=True).stdout)
