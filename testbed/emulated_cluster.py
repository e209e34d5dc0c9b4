"""An emulated cluster of N nodes beside the 3-node test cluster: a second Slurm instance (`ddscale`) on this one host.

Real slurmctld, one `slurmd -N dsI` per emulated node (each in its own mount namespace, where NODE_TMP is that node's
own folder on a tmpfs, and in a cpuacct cgroup of its own: its CPU, and everything it forks, counted), srun, sbcast,
pyxis and enroot; the job program is run unchanged. Its own slurm.conf (/etc/slurm-ddscale), ports (controller 6917,
nodes 7001...), state, spool, pid and log files; munged is the host's (one key: the design's choice). Clients reach it
through SLURM_CONF (`client_env`); inside a job nothing is needed, since Slurm 22.05 puts its slurmd's SLURM_CONF into
every job's environment. The test cluster's configuration, daemons and jobs are never touched: its tools find
daemons by name (`pgrep -x slurmctld`, `slurmd -N ddnodeI$`), and ours run under other names (links named
ddscale-slurmctld and ddscale-slurmd), so neither instance's start or stop can reach the other's.

Every command the job runs is counted: a shim folder first on the job's PATH logs each Slurm command (time, job, step,
node, words) and execs the real one; in each node's mount namespace /usr/bin/python3.11 is a wrapper that logs a
Python start the same way (the job program runs /usr/bin/python3 by its path, which no PATH shim sees); each node's
enroot wrapper logs `create` with its start and end, and the squashfs it read.

Sized by DDPACK_TEST_NODES (16 by default). Needs root. `python -m testbed.emulated_cluster [--nodes N] [--down]`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from testbed.env import clean_env
from testbed.slurm_cluster import COMMON_SETTINGS, NODE_TMP, ClusterUnavailable
from testbed.slurm_cluster import CONF as TEST_CONF

NAME = "ddscale"
CONF_DIR = Path("/etc/slurm-ddscale")
CONF = CONF_DIR / "slurm.conf"
MARKER = "# ddpack emulated cluster (testbed/emulated_cluster.py)"
CTLD_PORT = 6917
NODE_PORT_BASE = 7000  # node I listens on 7000+I: below 15000, outside the launcher's MASTER_PORT range [15000, 30000)
STATE = Path("/var/spool/slurmctld-ddscale")
SPOOL = Path("/var/spool/slurmd-ddscale")
LOGS = Path("/var/log/slurm/ddscale")
CTLD_PID = Path("/run/slurmctld-ddscale.pid")
DISKS = Path("/var/lib/ddpack-scale-nodes")  # a tmpfs: DISKS/dsI is node I's NODE_TMP; bin/, shim/, enroot/ and calls.log
DISK_SIZE = "3g"
CGROUP = Path("/sys/fs/cgroup/cpuacct") / NAME  # cgroup v1 cpuacct: CGROUP/dsI, CGROUP/ctld
CPUSET = Path("/sys/fs/cgroup/cpuset") / NAME  # every node's slurmd (and what it forks): narrowed for the 1-CPU calibration
WRAPPERS = Path("/usr/local/lib/enroot-nodes")  # WRAPPERS/dsI/enroot: the dispatcher /usr/local/sbin/enroot picks it
CALLS = DISKS / "calls.log"
SHIM = DISKS / "shim"
SLURM_COMMANDS = ("sbatch", "scontrol", "sinfo", "squeue", "srun", "sbcast", "scancel")
PYTHON = Path(os.path.realpath("/usr/bin/python3"))  # the job program's interpreter (/usr/bin/python3), the file it links to
DEFAULT_NODES = 16
MEMORY_PER_NODE = 64 << 20  # an idle slurmd takes 2-38 MB (the design's measurement); a node's share of a job's steps
MEMORY_FLOOR = 4 << 30


def node_names(count: int) -> list[str]:
    return [f"ds{index}" for index in range(1, count + 1)]


def nodes_wanted() -> int:
    """DDPACK_TEST_NODES, 16 when unset; a value that is not a whole number from 2 is one line, exit 2."""
    text = os.environ.get("DDPACK_TEST_NODES", "") or str(DEFAULT_NODES)
    if not text.isdigit() or int(text) < 2:
        print(
            f"emulated cluster: DDPACK_TEST_NODES={text} is not a node count of 2 or more; set e.g. DDPACK_TEST_NODES=16", file=sys.stderr
        )
        raise SystemExit(2)
    return int(text)


def scale_conf(count: int, tree_width: int = 50) -> str:
    """The second instance's slurm.conf: the test cluster's settings (so 2-node figures compare with bench_restart's),
    its own name, ports, state, spool, pid and log files, pyxis through the host's plugstack, no GRES."""
    nodes = "\n".join(
        f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={NODE_PORT_BASE + index} CPUs=2 RealMemory=4000 State=UNKNOWN"
        for index, name in enumerate(node_names(count), start=1)
    )
    return f"""{MARKER}
ClusterName={NAME}
SlurmctldHost=localhost
SlurmctldPort={CTLD_PORT}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
SlurmUser=root
SlurmdUser=root
StateSaveLocation={STATE}
SlurmdSpoolDir={SPOOL}/%n
SlurmctldPidFile={CTLD_PID}
SlurmdPidFile=/run/slurmd-ddscale-%n.pid
SlurmctldLogFile={LOGS}/slurmctld.log
SlurmdLogFile={LOGS}/slurmd-%n.log
PlugStackConfig=/etc/slurm/plugstack.conf
{COMMON_SETTINGS}TreeWidth={tree_width}
{nodes}
PartitionName=scale Nodes=ds[1-{count}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def client_env(**extra: str) -> dict[str, str]:
    """A client's environment for the emulated cluster (clean_env drops every SLURM_* variable, SLURM_CONF too:
    without it here, a command would reach the test cluster)."""
    return clean_env(SLURM_CONF=str(CONF), **extra)


def slurm(*argv: str, check: bool = False) -> subprocess.CompletedProcess:
    """A Slurm command against the emulated cluster (`client_env`), its output captured as text, within 60 s."""
    return subprocess.run(list(argv), env=client_env(), capture_output=True, text=True, check=check, timeout=60)


def refusal(count: int, busy_ok: bool = False) -> str | None:
    """Why `count` nodes should not be brought up on this host now (one line), or None. Memory: MemAvailable under
    count x 64 MiB + 4 GiB. Load (unless `busy_ok`): a 1-minute load above this host's CPUs, where every node's work
    would queue behind other work and the figures would measure that."""
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    available = int(meminfo["MemAvailable"].split()[0]) << 10
    need = count * MEMORY_PER_NODE + MEMORY_FLOOR
    if available < need:
        return (
            f"refusing {count} emulated nodes: {available >> 20} MiB available, {need >> 20} MiB needed ({count} x 64 MiB + 4 GiB); "
            "free memory or use fewer nodes"
        )
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if not busy_ok and load > cpus:
        return (
            f"refusing {count} emulated nodes: load {load:.2f} on {cpus} CPUs, so their work would queue behind other work and the figures "
            "would measure that; wait, or pass --busy-ok (figures labelled 'busy host')"
        )
    return None


# The per-node enroot: its own data and runtime folders on the tmpfs, and `create` logged with its end and its squashfs
# (unpacks, and which file each node read). `start` is exec'd: pyxis waits for its own child to stop itself.
ENROOT_WRAPPER = """#!/bin/bash
# enroot for emulated node '{node}' (testbed/emulated_cluster.py): its own folders; create is logged.
ENROOT_DATA_PATH="{disks}/enroot/{node}/data/user-$(id -u)"
ENROOT_RUNTIME_PATH="{disks}/enroot/{node}/run/user-$(id -u)"
ENROOT_CACHE_PATH="{disks}/enroot/{node}/cache/user-$(id -u)"
export ENROOT_DATA_PATH ENROOT_RUNTIME_PATH ENROOT_CACHE_PATH
if [ "$1" = create ]; then
    t0=$EPOCHREALTIME
    /usr/bin/enroot "$@"; rc=$?
    printf '%s %s %s %s enroot-create %s %s rc=%s\\n' "$t0" "${{SLURM_JOB_ID:--}}" "${{SLURM_STEP_ID:--}}" {node} "$EPOCHREALTIME" "${{!#}}" "$rc" >>{calls}
    exit $rc
fi
exec /usr/bin/enroot "$@"
"""

# A Slurm command's shim: one line (time, job, step, node, command, its words with any long one elided), then the real one.
SHIM_TEXT = """#!/bin/bash
words=()
for word in "$@"; do [ ${{#word}} -gt 120 ] && word='<text>'; words+=("${{word// /_}}"); done
printf '%s %s %s %s %s %s\\n' "$EPOCHREALTIME" "${{SLURM_JOB_ID:--}}" "${{SLURM_STEP_ID:--}}" "${{SLURMD_NODENAME:--}}" {name} "${{words[*]}}" >>{calls}
exec /usr/bin/{name} "$@"
"""

# /usr/bin/python3.11 in each node's namespace: a Python start logged, then the real interpreter, named as it was called
# (argv[0]: Python finds its library, and sys.executable, from it).
PYTHON_WRAPPER = """#!/bin/bash
words=()
for word in "$@"; do [ ${{#word}} -gt 120 ] && word='<text>'; words+=("${{word// /_}}"); done
printf '%s %s %s %s python3 %s\\n' "$EPOCHREALTIME" "${{SLURM_JOB_ID:--}}" "${{SLURM_STEP_ID:--}}" "${{SLURMD_NODENAME:--}}" "${{words[*]}}" >>{calls}
exec -a "$0" {real} "$@"
"""


@dataclass(frozen=True)
class Emulated:
    """A running emulated cluster: its nodes and where a client finds it."""

    nodes: list[str]
    started_s: float  # seconds from the first daemon's start to every node idle

    @property
    def env(self) -> dict[str, str]:
        return client_env()


def _run(argv: list[str], **options: object) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, **options)  # type: ignore[call-overload]


def _write(path: Path, text: str, mode: int = 0o755) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    temp.write_text(text)
    temp.chmod(mode)
    temp.replace(path)


def _pid(path: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        pid = int(path.read_text().split()[0])
        os.kill(pid, 0)
        return pid
    return None


def node_pid_file(node: str) -> Path:
    return Path(f"/run/slurmd-ddscale-{node}.pid")


def ctld_pid() -> int | None:
    return _pid(CTLD_PID)


def cgroup_usage() -> dict[str, int]:
    """CPU used so far (ns) by each node's cgroup (and `ctld`, the controller's), from cpuacct.usage."""
    found = {}
    for group in CGROUP.glob("*/cpuacct.usage") if CGROUP.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            found[group.parent.name] = int(group.read_text())
    return found


def _mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines())


def up(count: int, busy_ok: bool = True, tree_width: int = 50, timeout_s: float = 180, need_cpu: bool = True) -> Emulated:
    """Bring up `count` emulated nodes (after `down` of any left from before); raises ClusterUnavailable with one line
    where this host cannot have them (not root, no Slurm, too little memory, too busy unless `busy_ok`, no cgroup v1
    cpuacct to count each node's CPU unless not `need_cpu`: the counts need none, and without it the daemons are
    found by their pid files alone)."""
    if os.geteuid() != 0:
        raise ClusterUnavailable("the emulated cluster needs root (its daemons, mounts and cgroups)")
    if shutil.which("slurmctld") is None or shutil.which("slurmd") is None:
        raise ClusterUnavailable("slurm-wlm is not installed (apt-get install -y slurm-wlm munge)")
    if _run(["pgrep", "-x", "munged"]).returncode != 0:
        raise ClusterUnavailable("munged is not running: start the test cluster first (python testbed/slurm_cluster.py)")
    if need_cpu and not CGROUP.parent.is_dir():
        raise ClusterUnavailable("no cgroup v1 cpuacct hierarchy at /sys/fs/cgroup/cpuacct: each node's CPU cannot be accounted here")
    if (why := refusal(count, busy_ok)) is not None:
        raise ClusterUnavailable(why)
    if CONF.exists() and MARKER not in CONF.read_text():
        raise ClusterUnavailable(f"{CONF} belongs to another Slurm set-up; not touching it")
    down()
    nodes = node_names(count)
    CONF_DIR.mkdir(parents=True, exist_ok=True)
    _write(CONF, scale_conf(count, tree_width), 0o644)
    for folder in (STATE, LOGS, *(SPOOL / node for node in nodes)):
        folder.mkdir(parents=True, exist_ok=True)
    DISKS.mkdir(parents=True, exist_ok=True)
    _run(["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE},mode=755", "ddscale-nodes", str(DISKS)], check=True)
    for folder in ("bin", "shim", "enroot"):
        (DISKS / folder).mkdir()
    CALLS.touch()
    CALLS.chmod(0o666)
    for name in SLURM_COMMANDS:
        _write(SHIM / name, SHIM_TEXT.format(name=name, calls=CALLS))
    real = DISKS / "bin" / "python3.11.real"
    real.touch()
    _write(DISKS / "bin" / "python3-counted", PYTHON_WRAPPER.format(calls=CALLS, real=real))
    for daemon in ("slurmctld", "slurmd"):
        (DISKS / "bin" / f"{NAME}-{daemon}").symlink_to(shutil.which(daemon) or daemon)
    if CGROUP.parent.is_dir():
        CGROUP.mkdir(exist_ok=True)
        (CGROUP / "ctld").mkdir(exist_ok=True)
    if CPUSET.parent.is_dir():
        CPUSET.mkdir(exist_ok=True)
        for name in ("cpuset.mems", "cpuset.cpus"):
            (CPUSET / name).write_text((CPUSET.parent / name).read_text())
    started = time.monotonic()
    ctld = f"{{ [ ! -d {CGROUP} ] || echo $$ > {CGROUP}/ctld/cgroup.procs; }} && exec {DISKS}/bin/{NAME}-slurmctld -c -f {CONF}"
    _run(["sh", "-c", ctld], check=True, env=clean_env())
    for node in nodes:
        _start_node(node)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = _run(["sinfo", "-h", "-N", "-o", "%N %T"], env=client_env(), timeout=30)
        idle = sum(1 for line in out.stdout.splitlines() if line.split()[1:2] == ["idle"])
        if idle >= count:
            return Emulated(nodes, time.monotonic() - started)
        time.sleep(1)
    down()
    raise ClusterUnavailable(f"{count} emulated nodes were not idle within {timeout_s:.0f} s; see {LOGS}")


def _start_node(node: str) -> None:
    """Node `node`'s slurmd in a mount namespace of its own: NODE_TMP is its folder on the tmpfs, /usr/bin/python3.11
    the counting wrapper; in its cpuacct cgroup before it execs, so its steps and tasks are counted there too."""
    disk = DISKS / node
    disk.mkdir()
    disk.chmod(0o1777)
    wrapper = WRAPPERS / node
    wrapper.mkdir(parents=True, exist_ok=True)
    _write(wrapper / "enroot", ENROOT_WRAPPER.format(node=node, disks=DISKS, calls=CALLS))
    if CGROUP.is_dir():
        (CGROUP / node).mkdir(exist_ok=True)
    NODE_TMP.mkdir(parents=True, exist_ok=True)
    real = DISKS / "bin" / "python3.11.real"
    script = (
        f"{{ [ ! -d {CGROUP} ] || echo $$ > {CGROUP}/{node}/cgroup.procs; }} && {{ [ ! -d {CPUSET} ] || echo $$ > {CPUSET}/cgroup.procs; }} && "
        f"mount --bind {disk} {NODE_TMP} && mount --bind {PYTHON} {real} && "
        f"mount --bind {DISKS}/bin/python3-counted {PYTHON} && exec {DISKS}/bin/{NAME}-slurmd -f {CONF} -N {node}"
    )
    env = clean_env(MALLOC_ARENA_MAX="2")
    env["PATH"] = f"{wrapper}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
    env.pop("PYTHONPATH", None)
    _run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], check=True, env=env)


def pin_cpus(cpus: str = "") -> str:
    """Narrow every emulated node (and all it runs) to `cpus` (a cpuset list, "0"), or give them back the host's
    ("" ); the CPUs they have now. The calibration runs the same job on one CPU and on two."""
    (CPUSET / "cpuset.cpus").write_text(cpus or (CPUSET.parent / "cpuset.cpus").read_text())
    return (CPUSET / "cpuset.cpus").read_text().strip()


def _ours() -> list[int]:
    """Every process in the emulated cluster's cgroups: its daemons and whatever they forked (steps, tasks)."""
    pids = []
    for procs in CGROUP.glob("*/cgroup.procs") if CGROUP.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            pids += [int(pid) for pid in procs.read_text().split()]
    return pids


def down(timeout_s: float = 30) -> list[str]:
    """Stop every daemon of the emulated cluster and whatever they started (by their pid files and cgroups: nothing
    of the test cluster), unmount the node disks, remove the cgroups, wrappers and configuration; what it removed."""
    done = []
    pids = [pid for pid in (ctld_pid(), *(_pid(path) for path in Path("/run").glob("slurmd-ddscale-*.pid"))) if pid]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in {*pids, *_ours()}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (timeout_s if sig == signal.SIGTERM else 10)
        while _ours() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _ours():
            break
    if pids:
        done.append(f"{len(pids)} daemons stopped")
    for path in Path("/run").glob("slurmd-ddscale-*.pid"):
        path.unlink(missing_ok=True)
    CTLD_PID.unlink(missing_ok=True)
    if _mounted(DISKS):
        if _run(["umount", str(DISKS)]).returncode != 0:
            _run(["umount", "-l", str(DISKS)])
        done.append(f"{DISKS} unmounted")
    for group in sorted(CGROUP.glob("*/"), reverse=True) if CGROUP.is_dir() else []:
        with contextlib.suppress(OSError):
            group.rmdir()
    with contextlib.suppress(OSError):
        CGROUP.rmdir()
        done.append("cgroups removed")
    with contextlib.suppress(OSError):
        CPUSET.rmdir()
    for wrapper in WRAPPERS.glob("ds[0-9]*"):
        shutil.rmtree(wrapper, ignore_errors=True)
    shutil.rmtree(SPOOL, ignore_errors=True)
    shutil.rmtree(STATE, ignore_errors=True)
    if CONF.exists() and MARKER in CONF.read_text():
        shutil.rmtree(CONF_DIR, ignore_errors=True)
    return done


def _alive(pid: str) -> bool:
    """Not a zombie: a daemon's parent that forked it and exited stays a zombie until it is reaped, which may happen
    during a run (the test cluster just started), and would read as a daemon gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_cluster_now() -> dict[str, str]:
    """The 3-node test cluster's daemons (their pids) and its slurm.conf's text: equal before and after, it was untouched."""
    patterns = (("slurmctld", ["-x", "slurmctld"]), ("slurmd", ["-f", "^slurmd -N ddnode[0-9]+$"]), ("munged", ["-x", "munged"]))
    found = {name: ",".join(sorted(filter(_alive, _run(["pgrep", *pattern]).stdout.split()))) for name, pattern in patterns}
    found["slurm.conf"] = TEST_CONF.read_text() if TEST_CONF.exists() else ""
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=None, help="emulated nodes (default: DDPACK_TEST_NODES, else 16)")
    parser.add_argument("--down", action="store_true", help="stop the emulated cluster and remove what it made")
    parser.add_argument("--busy-ok", action="store_true", help="bring it up on a loaded host too")
    opts = parser.parse_args(argv)
    if opts.down:
        print("; ".join(down()) or "nothing to stop")
        return 0
    count = opts.nodes or nodes_wanted()
    try:
        cluster = up(count, busy_ok=opts.busy_ok)
    except ClusterUnavailable as why:
        print(f"emulated cluster: {why}", file=sys.stderr)
        return 1
    print(f"emulated cluster: {len(cluster.nodes)} nodes idle in {cluster.started_s:.1f} s; SLURM_CONF={CONF}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
