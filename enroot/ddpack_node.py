"""ddpack_node.py — the decisions a ddpack job makes on a node's shared folders, safe when other users share them.

Run by enroot/ddpack-job.sh with the host's python3 (standard library only), as the job's user, one task per
node (`srun ... python3 -c "$code" VERB ...`) or on the batch host:

    key SQSH                 the staging key of a squashfs: its content's (make sqsh's record) or its file's version
    record RUN_DIR KIND K=V  one decision of the job (a start, the placement, the staging choice, the step's end and
                             what follows) appended to RUN_DIR/decisions.jsonl as one JSON record: what `ddpack status`
                             reads, where the job's log says the same in a sentence for people
    image-ok SQSH            refuse a squashfs other users could replace (writable by them, or in a folder they can)
    prepare                  on each node: remove containers of this user's jobs that are over, check the staging
                             folder (created private when missing), lease the job's key, drop copies no live job
                             leases beyond the newest KEEP, then answer `has NODE`, `lacks NODE` or `refuse NODE why`
    receive                  on each node: make the private folder sbcast writes into
    install                  on each node: check what sbcast wrote (ours, a plain file, the whole size) and rename it
                             into place as KEY.sqsh, then the same cleanup as prepare
    lock RUN_DIR             on the batch host: take the run folder for this job, or refuse naming the live job that
                             holds it; unlock RUN_DIR gives it back when the job leaves it for good. A job started by
                             hand with a template leaves the folder a run.json naming it (with its log), so `ddpack
                             status/logs/cancel JOB` know it as they know a run `ddpack submit` made

Why Python and not more shell: these are decisions about files another user may have planted (owner, mode, links,
odd names) and about `squeue`'s answer (a failure is not "no jobs"); os.lstat, O_NOFOLLOW and a list of names
say that exactly, where `ls | xargs rm` split names on whitespace (docs/security.md).

Trust (docs/security.md): other users of the node are not trusted; root and the Slurm admins are. The staging folder
(DDPACK_STAGE_DIR, default /tmp/ddpack-images-<uid>) is used only when this user owns it, it is not a link, group
and others cannot write it and every folder above it is root's or ours (and sticky where others can write it); it
holds only ddpack's names, on a local filesystem. Inside a folder only we can write, a name only we can have made is
trusted, and nothing is followed through a link.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# A staged copy's name: the key ddpack-job.sh derives (image id prefix and options hash, or a file-version hash).
KEY = re.compile(r"[0-9a-f]{24}-[0-9a-f]{8}|[0-9a-f]{32}")
STAGED = re.compile(rf"(?:{KEY.pattern})\.sqsh")
INCOMING = re.compile(r"\.incoming-(\d+)-[0-9a-f]{8,64}")
LEASES = ".leases"  # LEASES/<job id> holds the key that live job chose
JOB_ID = re.compile(r"[0-9]+")
# Filesystems another machine can write: a staging folder there is shared with other nodes and users.
NETWORK_FS = {
    "nfs", "nfs4", "lustre", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "gpfs", "beegfs", "9p", "afs", "panfs",
    "wekafs", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse", "fuse.mountpoint-s3", "fuse.cephfs",
}  # fmt: skip
SQUEUE_TIMEOUT_S = 30


class Refused(Exception):
    """A folder or file this user cannot trust, with the one line that says why and what to do."""


# --------------------------------------------------------------------------- Slurm's view of this user's jobs


def live_jobs(uid: int | None = None) -> set[str] | None:
    """This user's jobs that Slurm still lists (pending, running, requeued, completing), or None when squeue
    failed: a controller that timed out says nothing about which jobs are over, so a caller removes nothing."""
    who = str(os.getuid() if uid is None else uid)
    try:
        out = subprocess.run(["squeue", "-h", "-u", who, "-o", "%A"], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        warn(f"squeue did not answer ({exc}); removing nothing this time")
        return None
    if out.returncode != 0:
        warn(f"squeue failed (exit {out.returncode}: {last_line(out.stderr)}); removing nothing this time")
        return None
    return {word for word in out.stdout.split() if JOB_ID.fullmatch(word)}


# Slurm's job states (squeue's and sacct's, without sacct's "by UID" suffix) as ddpack names them: the one table of
# them, the host's too (ddpack/jobs/slurm_cli.py loads it). PREEMPTED is a job Slurm ended to make room (PreemptMode=CANCEL,
# after its grace time): it has left its nodes for good, like a cancel, and `ddpack resubmit` continues its run; a
# preemption that requeues shows as REQUEUED. States not listed (newer Slurms add some) are shown as Slurm names them
# and read as live.
JOB_STATES = {
    "PENDING": "PENDING",
    "CONFIGURING": "RUNNING",
    "RUNNING": "RUNNING",
    "COMPLETING": "RUNNING",
    "RESIZING": "RUNNING",
    "SIGNALING": "RUNNING",
    "STAGE_OUT": "RUNNING",
    "SUSPENDED": "RUNNING",
    "STOPPED": "RUNNING",
    "REQUEUED": "REQUEUED",
    "REQUEUE_FED": "REQUEUED",
    "REQUEUE_HOLD": "REQUEUED",
    "SPECIAL_EXIT": "REQUEUED",
    "COMPLETED": "COMPLETED",
    "FAILED": "FAILED",
    "NODE_FAIL": "FAILED",
    "OUT_OF_MEMORY": "FAILED",
    "BOOT_FAIL": "FAILED",
    "CANCELLED": "CANCELLED",
    "TIMEOUT": "TIMEOUT",
    "DEADLINE": "TIMEOUT",
    "PREEMPTED": "PREEMPTED",
}
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED")  # ddpack's states of a job that ended for good
# States in which squeue still lists a job (for MinJobAge) that has left its nodes for good.
OVER = {state for state, ours in JOB_STATES.items() if ours in ENDED}


def job_state(job: str) -> str | None:
    """The state squeue gives job `job` (any user's) while it lives, "" when Slurm no longer lists it or lists it
    as over, None when squeue failed."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return "" if "Invalid job id" in out.stderr else None
    state = out.stdout.strip().splitlines()[0] if out.stdout.strip() else ""
    return "" if state in OVER else state


# --------------------------------------------------------------------------- folders we may trust


def check_ancestors(path: Path) -> None:
    """Every folder above `path` is root's or ours, and sticky where group or others can write it (as /tmp is):
    otherwise another user could rename our folder away and put theirs in its place."""
    if os.path.realpath(path.parent) != str(path.parent):
        raise Refused(f"{path.parent} goes through a symbolic link ({os.path.realpath(path.parent)}); name the real folder")
    for folder in [*reversed(path.parents)]:
        info = os.lstat(folder)
        if info.st_uid not in (0, os.getuid()):
            raise Refused(f"{folder} belongs to uid {info.st_uid}, who could replace what lies under it")
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise Refused(f"{folder} is writable by other users and not sticky, so they could replace what lies under it")


def filesystem_type(path: Path, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type of the filesystem `path` lies on: the longest mount point above it in this mount namespace's
    mountinfo (the node's own view)."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    with contextlib.suppress(OSError), open(mountinfo) as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            rest = fields[fields.index("-") + 1 :]
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, fstype = point, rest[0]
    return fstype


def private_folder(path: Path, setting: str, mountinfo: str = "/proc/self/mountinfo") -> Path:
    """`path` as a folder only this user can write: made 0700 when missing; refused (one line) when it is a link,
    someone else's, writable by group or others, on a filesystem other machines share, or when a folder above it
    could be swapped by another user. An existing folder of ours that others may read is closed to them."""
    if not path.is_absolute():
        raise Refused(f"{setting}={path} is not an absolute path on the node's local disk")
    check_ancestors(path)
    fstype = filesystem_type(path, mountinfo)
    if fstype in NETWORK_FS or fstype.startswith("fuse."):
        raise Refused(f"{setting}={path} is on a {fstype} filesystem that other nodes share; name a folder on the node's local disk")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    if (problem := not_yours_alone(path, "folder")) is not None:
        raise Refused(f"{setting}={path} {problem}; it is not used")
    info = os.lstat(path)
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def check_stage_contents(folder: Path) -> None:
    """The staging folder holds ddpack's names alone: pointed at a folder of other files (a shared images folder, a
    project), its cleanup would delete what is not its own."""
    for entry in os.scandir(folder):
        if STAGED.fullmatch(entry.name) or INCOMING.fullmatch(entry.name) or entry.name == LEASES:
            continue
        raise Refused(
            f"DDPACK_STAGE_DIR={folder} holds {entry.name!r}, which is not an image ddpack staged; "
            "point DDPACK_STAGE_DIR at a folder of its own (the default is /tmp/ddpack-images-<uid>)"
        )


def trusted_copy(path: Path, size: int) -> bool:
    """`path` is a plain file of ours (not a link, one name, nobody else can write it) of exactly `size` bytes."""
    return not_yours_alone(path) is None and os.lstat(path).st_size == size


def not_yours_alone(path: Path, want: str = "file") -> str | None:
    """Why `path` is not this user's alone, or None when it is: a plain file with one name (`want="file"`) or a folder
    (`"folder"`), not a link (another user may have planted it), this user's, and nobody else can write it. The one
    "my own file" check of ddpack, the job's and the host's (ddpack/private_files.py loads it from here): anything read
    back from a shared folder (a run folder, its records, a staged image, a squashfs to reuse) passes it first."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as why:
        return f"cannot be read ({why.strerror or why})"
    if stat.S_ISLNK(info.st_mode):
        return "is a symbolic link (another user may have planted it)"
    if want == "folder" and not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if want == "file" and not stat.S_ISREG(info.st_mode):
        return "is not a plain file"
    if info.st_uid != os.geteuid():
        return f"belongs to uid {info.st_uid}, not to you (uid {os.geteuid()})"
    if info.st_mode & 0o022:
        return f"is writable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    if want == "file" and info.st_nlink != 1:
        return f"has {info.st_nlink} names (hard links): a write through another one would change it"
    return None


# --------------------------------------------------------------------------- leases and the cleanup


def lease(folder: Path, job: str, key: str) -> None:
    """Record that job `job` chose `key`: no cleanup removes that copy while the job lives."""
    leases = folder / LEASES
    with contextlib.suppress(FileExistsError):
        os.mkdir(leases, 0o700)
    if not stat.S_ISDIR(os.lstat(leases).st_mode):
        raise Refused(f"{leases} is not a folder")
    write_private(leases / job, key + "\n")


def write_private(path: Path, text: str, *, durable: bool = False) -> None:
    """Write `text` to `path` through a new temporary name beside it, then rename: never through a link, never half.
    `durable`: the data and the rename are fsync'd first, so that a host that crashes cannot bring back an empty or an
    older file (a count that caps restarts must not reset)."""
    tmp = path.with_name(f".{path.name}.{os.urandom(8).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            if durable:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
        if durable:
            folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_leases(folder: Path) -> dict[str, str]:
    """{job id: key} from the lease folder; names that are not job ids are ignored."""
    leases: dict[str, str] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder / LEASES):
            if JOB_ID.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    key = Path(entry.path).read_text().strip()
                    leases[entry.name] = key if KEY.fullmatch(key) else ""
    return leases


class LiveJobs:
    """This user's live jobs plus this one, asked of squeue once and only when a removal depends on the answer: a
    start with nothing to clean (the usual one) never asks. None when squeue failed: then nothing is removed."""

    def __init__(self, job: str) -> None:
        self.job, self._asked, self._answer = job, False, None

    def get(self) -> set[str] | None:
        if not self._asked:
            self._answer, self._asked = live_jobs(), True
        return None if self._answer is None else self._answer | {self.job}


def clean_stage(folder: Path, keep: int, live: LiveJobs) -> list[str]:
    """Remove, by name, what no live job of ours needs: copies beyond the newest `keep` that no live job leases,
    leases and half-received folders of jobs that are over. Nothing goes when squeue failed. Returns the names
    removed."""
    copies, incoming = [], []
    for entry in os.scandir(folder):
        if (found := INCOMING.fullmatch(entry.name)) and found.group(1) != live.job:
            incoming.append((found.group(1), entry.name))
        elif STAGED.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
            copies.append((entry.stat(follow_symlinks=False).st_mtime, entry.name))
    beyond = [name for _, name in sorted(copies, reverse=True)[keep:]]
    if not beyond and not incoming:
        return []
    jobs = live.get()
    if jobs is None:
        return []
    removed: list[str] = []
    leased = set()
    for holder, key in read_leases(folder).items():
        if holder in jobs:
            leased.add(key)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / LEASES / holder)
    for owner, name in incoming:
        if owner not in jobs:
            remove_incoming(folder / name)
            removed.append(name)
    for name in beyond:
        if name.removesuffix(".sqsh") in leased:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(folder / name)
        removed.append(name)
    return removed


def remove_incoming(path: Path) -> None:
    """A receiving folder of ours: its files by name (no recursion through links), then the folder."""
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(path):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        os.rmdir(path)


# --------------------------------------------------------------------------- containers of jobs that are over


CONTAINER = re.compile(r"pyxis_(?:\d+_)?ddpack-(\d+)")


def remove_stale_containers(live: LiveJobs, node: str) -> None:
    """Remove this user's ddpack containers (pyxis_ddpack-<job>, or pyxis_<job>_ddpack-<job> under container_scope
    =job) whose job Slurm no longer lists: a job scancelled or timed out leaves its container behind. An squeue that
    failed removes nothing."""
    try:
        names = subprocess.run(["enroot", "list"], capture_output=True, text=True, timeout=60).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return
    others = [(name, m.group(1)) for name in names if (m := CONTAINER.fullmatch(name)) and m.group(1) != live.job]
    jobs = live.get() if others else set()
    if jobs is None:
        return
    for name, job in others:
        if job in jobs:
            continue
        gone = subprocess.run(["enroot", "remove", "-f", name], capture_output=True, timeout=120).returncode == 0
        if gone:
            warn(f"removed container {name} on {node} (job {job} is over)")


# --------------------------------------------------------------------------- the verbs


def image_key(sqsh: Path) -> str:
    """A name for the image: its content's, from make sqsh's record beside it (the Docker image's id and the squash
    options) while the record describes the file as it is; else the file's version (size, modification time, inode
    and path: no read of the file; a copy made again is a new name and is sent again)."""
    info = os.stat(sqsh)
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        record = json.loads(Path(f"{sqsh}.ddpack.json").read_text())
        image_id = str(record["image_id"]).removeprefix("sha256:")
        if re.fullmatch(r"[0-9a-f]{64}", image_id) and record["size"] == info.st_size and record["mtime_ns"] == info.st_mtime_ns:
            options = hashlib_hex(str(record.get("squash_options", "")))[:8]
            return f"{image_id[:24]}-{options}"
    return hashlib_hex(f"file {info.st_size} {int(info.st_mtime)} {info.st_ino} {sqsh}")[:32]


def hashlib_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def gpu_devices(root: Path = Path("/")) -> list[str]:
    """This node's NVIDIA GPU device nodes (/dev/nvidia0, ...; not nvidiactl): what a container can be given."""
    return sorted(path.name for path in (root / "dev").glob("nvidia[0-9]*"))


def prepare(args: argparse.Namespace) -> int:
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    if args.gpus and len(found := gpu_devices()) < args.gpus:
        # Before anything is staged or unpacked: a GPU job on a node with no GPU ends in seconds, not after a
        # multi-gigabyte CUDA image was unpacked to train on the CPU. Fewer devices than promised is only said (MIG
        # slices of one GPU share its device node).
        driver = "an NVIDIA driver" if Path("/proc/driver/nvidia/version").exists() else "no NVIDIA driver"
        print(f"nogpu {node} {len(found)} GPU device(s) (/dev/nvidia0...), {driver}")
        if not found:
            return 0
    live = LiveJobs(args.job)
    remove_stale_containers(live, node)
    if not args.key:
        return 0
    folder = Path(args.dir)
    try:
        private_folder(folder, "DDPACK_STAGE_DIR")
        with folder_locked(folder):  # two jobs of yours on this node: one cleans while the other answers, never both
            check_stage_contents(folder)
            lease(folder, args.job, args.key)
            for name in clean_stage(folder, args.keep, live):
                warn(f"removed {folder}/{name} on {node} (no live job of yours uses it)")
            copy = folder / f"{args.key}.sqsh"
            if trusted_copy(copy, args.size):
                os.utime(copy, follow_symlinks=False)  # the newest DDPACK_STAGE_KEEP stay
                print(f"has {node}")
            else:
                print(f"lacks {node}")
    except (Refused, OSError) as why:
        print(f"refuse {node} {one_line(why)}")
    return 0


def receive(args: argparse.Namespace) -> int:
    """The folder sbcast writes into: new, ours, 0700, inside the checked staging folder (the caller then holds
    the node for sbcast)."""
    folder = Path(args.dir)
    try:
        private_folder(folder, "DDPACK_STAGE_DIR")
        os.mkdir(folder / args.incoming, 0o700)
    except (Refused, OSError) as why:
        print(f"{os.environ.get('SLURMD_NODENAME', '?')}: {one_line(why)}", file=sys.stderr)
        return 1
    return 0


def install(args: argparse.Namespace) -> int:
    """What sbcast wrote, checked (a plain file of ours, of the source's size) and renamed into place as KEY.sqsh."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    folder = Path(args.dir)
    incoming = folder / args.incoming
    part = incoming / f"{args.key}.sqsh"
    try:
        private_folder(folder, "DDPACK_STAGE_DIR")
        info = os.lstat(part) if os.path.lexists(part) else None
        if info is None or not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            print(f"{node}: sbcast left no file of yours at {part}")
            return 1
        if info.st_size != args.size:
            print(f"{node}: received {info.st_size} of {args.size} bytes")
            return 1
        os.chmod(part, 0o600, follow_symlinks=False)  # sbcast copies the source's mode (a team's 664): ours alone now
        os.replace(part, folder / f"{args.key}.sqsh")
    except (Refused, OSError) as why:
        print(f"{node}: {one_line(why)}")
        return 1
    finally:
        remove_incoming(incoming)
    with folder_locked(folder):
        for name in clean_stage(folder, args.keep, LiveJobs(args.job)):
            warn(f"removed {folder}/{name} on {node} (no live job of yours uses it)")
    return 0


@contextlib.contextmanager
def folder_locked(folder: Path):  # type: ignore[no-untyped-def]
    """An exclusive flock on a folder of ours (a local filesystem: the staging folder is refused elsewhere)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


LOCK = ".ddpack-lock"


def lock(args: argparse.Namespace) -> int:
    """Take the run folder for job `job`: its lock file names the job holding it. A requeue of the holder (same
    job id) continues; a live other job is refused in one line; a holder Slurm no longer lists left it behind
    (scancelled, timed out) and is replaced. An squeue that fails refuses: a folder in use is never shared."""
    run_dir = Path(args.run_dir)
    try:
        own_run_folder(run_dir)
    except (Refused, OSError) as why:
        die(f"DDPACK_RUN_DIR={run_dir}: {one_line(why)}")
    path = run_dir / LOCK
    me = f"{args.job} {user_name()} {socket.gethostname()} {int(time.time())}\n"
    with guard(run_dir / f"{LOCK}.guard"):
        try:
            holder_line = read_nofollow(path)
        except FileNotFoundError:
            holder_line = ""
        holder = holder_line.split()[0] if holder_line.split() else ""
        if holder and holder != args.job:
            state = job_state(holder) if JOB_ID.fullmatch(holder) else ""
            if state is None:
                die(f"the run folder {run_dir} is held by job {holder} and squeue cannot say whether it is over; try again")
            if state:
                die(
                    f"the run folder {run_dir} is in use by job {holder} ({state}, {' '.join(holder_line.split()[1:2])}); "
                    f"wait for it to end, scancel {holder}, or give this job another DDPACK_RUN_DIR"
                )
        write_private(path, me)
    try:
        record_hand_made(run_dir, args.job, dict(os.environ))
    except (OSError, Refused) as why:  # the run goes on; only ddpack's view of it is missing
        warn(f"could not write {run_dir / RUN_RECORD} for `ddpack status/logs/cancel {args.job}`: {one_line(why)}")
    return 0


RUN_RECORD = "run.json"  # ddpack/jobs/run_json.py's file and format (its RunRecord and Job fields, format 1)
RECORD_FORMAT = 1
SECRET_SETTINGS = ("DDPACK_JOB_TOKEN",)  # never written to a record


def scontrol_fields(job: str, names: tuple[str, ...]) -> dict[str, str]:
    """Fields of `scontrol show job JOB`; empty when it fails. A field alone on its line (Command=, StdOut=) is read whole,
    spaces and all; one among others (TresPerNode=, NodeList= in some versions) is read as one word."""
    try:
        out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    found = {}
    for line in out.splitlines():
        name, sep, value = line.strip().partition("=")
        if sep and name in names and name not in found:
            found[name] = value
            continue
        for word in line.split():
            name, sep, value = word.partition("=")
            if sep and name in names and name not in found:
                found[name] = value
    return found


def record_hand_made(run_dir: Path, job: str, environ: dict[str, str]) -> None:
    """A run.json for a job started by hand with a template (sbatch enroot/...): the job, its log (Slurm's StdOut)
    and script, its settings and command, so `ddpack status`, `logs` and `cancel` know it. A run `ddpack submit` made
    is left alone (it lists its jobs itself); a hand-made run a later job continues (DDPACK_RUN_DIR) gets that job
    appended. Written as ddpack writes it: under the record's flock, through a private name and a rename."""
    path = run_dir / RUN_RECORD
    with guard(run_dir / f".{RUN_RECORD}.lock"):
        try:
            data = json.loads(read_nofollow(path, limit=None))
        except FileNotFoundError:
            data = None
        except (OSError, ValueError):
            return  # a record ddpack cannot read is left as it is: `ddpack status` names the problem
        fields = scontrol_fields(job, ("Command", "StdOut"))
        now = time.time()
        entry = {"job_id": job, "attempt": 1, "submitted": now, "how": "template", "changes": {}, "log": fields.get("StdOut") or None}
        if data is not None:
            jobs = data.get("jobs") or []
            if not jobs or jobs[0].get("how") != "template" or any(j.get("job_id") == job for j in jobs):
                return
            data["jobs"] = [*jobs, {**entry, "attempt": len(jobs) + 1}]
        else:
            script = Path(fields.get("Command") or "")
            try:
                digest = hashlib.sha256(script.read_bytes()).hexdigest() if script.is_absolute() else ""
            except OSError:
                digest = ""
            settings = {k: v for k, v in environ.items() if k.startswith("DDPACK_") and k not in SECRET_SETTINGS}
            try:
                command = json.loads(environ.get("DDPACK_COMMAND") or "[]")
            except ValueError:
                command = []
            data = {
                "format": RECORD_FORMAT, "name": run_dir.name, "run_dir": str(run_dir), "created": now, "user": user_name(),
                "host": socket.gethostname(), "image": {"ref": None, "image_id": None, "note": "a job started by hand with a template"},
                "sqsh": {"path": environ.get("DDPACK_SQSH")}, "code": {}, "command": command if isinstance(command, list) else [],
                "settings": {"made_by": "template", "exported": settings}, "script": os.path.relpath(script, run_dir) if digest else "",
                "script_sha256": digest, "versions": {}, "jobs": [entry], "events": [], "environment": {}, "run_file": None, "sweep": None,
            }  # fmt: skip
        write_private(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


DECISIONS = "decisions.jsonl"  # ddpack/jobs/decisions.py reads it, for status and the ledger
DECISION_KINDS = ("start", "placement", "staging", "preflight", "step-end", "keep-out")
VERDICTS = ("completed", "end", "requeue", "restart")  # a step-end's: what follows the step
RESERVED = ("time", "kind", "job", "slurm_job", "restart")  # every record's own fields, which no caller sets


def record(args: argparse.Namespace) -> int:
    """The verb: one decision record from NAME=VALUE words (ddpack-job.sh's ddpack_record)."""
    fields: dict[str, object] = {}
    for pair in args.fields:
        name, sep, value = pair.partition("=")
        if not sep or not re.fullmatch(r"[a-z_]+", name) or name in RESERVED:
            warn(f"record {args.kind}: {pair!r} is not NAME=VALUE of a field of its own; left out")
            continue
        fields[name] = value
    write_record(Path(args.run_dir), args.kind, fields)
    return 0


def write_record(run_dir: Path, kind: str, fields: dict[str, object]) -> None:
    """Append one decision record: time, kind, the job as ddpack knows it (a sweep's point as <array>_<index>) and as
    Slurm numbers it, the requeue count, and the fields given. One write of one line, to a file of this user's only
    (O_NOFOLLOW: never through a planted link); a failure is one warning line, never the job's end."""
    if kind == "step-end" and fields.get("verdict") not in VERDICTS:
        warn(f"record step-end: verdict {fields.get('verdict')!r} is not one of {', '.join(VERDICTS)}")
    env = os.environ
    array = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    entry = {
        "time": time.time(), "kind": kind, "job": f"{array[0]}_{array[1]}" if all(array) else env.get("SLURM_JOB_ID"),
        "slurm_job": env.get("SLURM_JOB_ID"), "restart": int(env.get("SLURM_RESTART_COUNT") or 0),
        **{name: value for name, value in fields.items() if name not in RESERVED},
    }  # fmt: skip
    try:
        fd = os.open(run_dir / DECISIONS, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
        finally:
            os.close(fd)
    except OSError as why:
        warn(f"could not record the job's {kind} in {run_dir / DECISIONS}: {one_line(why)}")


def own_run_folder(run_dir: Path) -> None:
    """The run folder, made when missing (with its parents, under the job's umask), used only when it is this user's,
    not a link, and nobody else can write it or swap it (every folder above it root's or ours, sticky where others
    can write): another user's folder at a guessable runs/<name>-<job id> would get the job's snapshots and plant
    what the job reads back."""
    if not run_dir.is_absolute():
        raise Refused("is not an absolute path")
    with contextlib.suppress(FileExistsError):
        run_dir.mkdir(parents=True)
    if (problem := not_yours_alone(run_dir, "folder")) is not None:
        raise Refused(f"{problem}; give this job a run folder of your own")
    check_ancestors(run_dir)


@contextlib.contextmanager
def guard(path: Path):  # type: ignore[no-untyped-def]
    """An exclusive lock around a run lock's read and write, so two jobs starting at once cannot both take it: an
    flock, or where the filesystem has none (an NFS or Lustre mount without flock), a guard file made with O_EXCL,
    waited for up to a minute (one older than that was left by a killed job and is taken over)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        with exclusive_file(path.with_name(path.name + ".excl")):
            yield
        return
    try:
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive_file(path: Path, wait_s: float = 60.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            break
        except FileExistsError:
            if time.monotonic() > deadline:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                deadline = time.monotonic() + wait_s
            time.sleep(0.1)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def unlock(args: argparse.Namespace) -> int:
    """Give the run folder back when this job leaves it for good (not on a requeue)."""
    path = Path(args.run_dir) / LOCK
    with contextlib.suppress(OSError):
        if read_nofollow(path).split()[:1] == [args.job]:
            os.unlink(path)
    return 0


def user_name() -> str:
    """This user's name from the password database (a batch job's environment may carry no USER), else the uid."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def read_nofollow(path: Path, limit: int | None = 4096) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as handle:
        return handle.read(limit) if limit is not None else handle.read()


def image_ok(args: argparse.Namespace) -> int:
    """The squashfs the job will import is not a file other users can replace: not writable by them, in no folder
    they can write without a sticky bit. Its owner may be anyone: the user chose it (a team's images folder, an
    admin's)."""
    real = Path(os.path.realpath(args.sqsh))
    info = os.stat(real)
    if info.st_mode & 0o022:
        mode = f"{stat.S_IMODE(info.st_mode):o}"
        die(f"DDPACK_SQSH={args.sqsh} is writable by other users (mode {mode}): any of them could replace what your job runs; chmod go-w it")
    for folder in real.parents:
        mode = os.stat(folder).st_mode
        if mode & 0o022 and not mode & stat.S_ISVTX:
            die(
                f"DDPACK_SQSH={args.sqsh}: {folder} is writable by other users and not sticky, so any of them could swap the image; "
                "keep images in a folder only you (or root) can write"
            )
    return 0


def key(args: argparse.Namespace) -> int:
    print(image_key(Path(args.sqsh)))
    return 0


# --------------------------------------------------------------------------- the start: settings, run folder, banner


def setup(name: str) -> int:
    """The job's start (ddpack-job.sh's ddpack_setup, under the job's umask): every DDPACK_* value against the settings
    table, before anything is touched (one line each, exit 2); the job's log narrowed to the umask's mode; the run
    folder chosen, made and locked for this job; the start marked, said in the banner and recorded. The run folder is
    the answer (stdout); the lines for people go to stderr.

    Run folders: one run, one folder. A new submission gets runs/<job name>-<job id> in the submission folder; a requeue
    keeps its job id and so continues its own folder; to continue an earlier run in a new job, name its folder with
    DDPACK_RUN_DIR (the banner prints the line to use). Two jobs submitted from one folder never resume each other's
    snapshots."""
    env = os.environ
    found = settings_table().problems(env)
    for why in found:
        print(f"ddpack: error: {why}", file=sys.stderr)
    if found:
        return 2
    job, restart = env["SLURM_JOB_ID"], int(env.get("SLURM_RESTART_COUNT") or 0)
    private_log(job)
    if env.get("DDPACK_RUN_DIR"):
        run_dir = Path(env["DDPACK_RUN_DIR"])
        origin = f"continuing {run_dir} (DDPACK_RUN_DIR)"
        if not (run_dir / MARKER).exists():
            origin = f"new run in {run_dir} (DDPACK_RUN_DIR); a requeue continues it"
    else:
        run_dir = Path(env.get("SLURM_SUBMIT_DIR") or os.getcwd()) / "runs" / f"{name}-{job}"
        origin = "requeued: continuing its run from the last snapshot"
        if not restart:
            origin = f"new run; a requeue continues it; to continue it in another job: sbatch --export=ALL,DDPACK_RUN_DIR={run_dir} ..."
    # Made here when missing, then used only when it is this user's (not a link, nobody else can write or swap it), and
    # only by this job while it lives: another live job that names it is refused, naming the holder.
    with for_people():
        lock(argparse.Namespace(run_dir=str(run_dir), job=job))
        (run_dir / MARKER).open("w").close()  # forensics newer than this were written during this start
        # The time closes the line: `ddpack status` dates the segment this start begins, for a program that writes no records.
        nodes = env.get("SLURM_JOB_NODELIST", "")
        log_at = log_offset()
        say(f"job {job} (restart {restart}) on {nodes}, run dir {run_dir} ({origin}), at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
    write_record(run_dir, "start", {"nodes": nodes, "origin": origin, **({"log_at": log_at} if log_at is not None else {})})
    answer(str(run_dir))
    return 0


def log_offset() -> int | None:
    """Where this start begins in the job's log (stdout, when Slurm made it a file): `ddpack status` places Slurm's own
    cancel line, which no record of the job's can hold, after the start it ended by this offset, not by a clock (Slurm
    writes the cluster's local time) nor by a sentence of the log."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        info = os.fstat(sys.stdout.fileno())
        return info.st_size if stat.S_ISREG(info.st_mode) else None
    return None


def private_log(job: str) -> None:
    """The job's log, opened by Slurm before the script ran with the umask sbatch was called under, narrowed to the
    job's own umask (DDPACK_UMASK: what the job writes is its user's alone, or its group's too)."""
    mask = os.umask(0)
    os.umask(mask)
    fields = scontrol_fields(job, ("StdOut", "StdErr"))
    for log in {fields.get("StdOut"), fields.get("StdErr")} - {None, ""}:
        with contextlib.suppress(OSError):  # another user's file cannot be changed (EPERM); a link is never followed
            if stat.S_ISREG(os.lstat(log).st_mode):
                os.chmod(log, 0o666 & ~mask)


def cpus_per_task() -> int:
    """The verb: each task's share of its node's CPUs, for a one-task-per-GPU step (answered; nothing when srun's own
    choice stands). srun (Slurm 22.05 and later) does not inherit the job's --cpus-per-task, and without one each task
    may be bound to a single CPU: 8 GPU ranks and their DataLoader workers on 8 cores of a 96-core node. srun reads
    SRUN_CPUS_PER_TASK: the job's --cpus-per-task when it gave one, else the node's CPUs divided among its tasks. A
    value the job set itself stands."""
    env = os.environ
    cpus, tasks, given = env.get("SLURM_CPUS_ON_NODE", ""), env.get("SLURM_NTASKS_PER_NODE", ""), env.get("SLURM_CPUS_PER_TASK", "")
    share = 0
    if not env.get("SRUN_CPUS_PER_TASK"):
        if re.fullmatch(r"[0-9]+", given):
            share = int(given)
        elif re.fullmatch(r"[0-9]+", cpus) and re.fullmatch(r"[0-9]+", tasks) and int(tasks) > 0:
            share = int(cpus) // int(tasks)
    if share > 1:
        with for_people():
            say(f"each task gets {share} CPUs (SRUN_CPUS_PER_TASK; set it to choose)")
    answer(str(share) if share > 1 else "")
    return 0


def words(name: str) -> int:
    """The words of a command setting (DDPACK_TRAIN_ARGS, DDPACK_PREFLIGHT_ARGS, DDPACK_LAUNCH_ARGS), or with COMMAND
    what the training step runs after the entrypoint: `--` and DDPACK_COMMAND's words (your own program), else
    DDPACK_TRAIN_ARGS's (the bundled trainer's flags), else nothing (the image's own command or the bundled trainer).
    Shell-quoted for the template's array: a value that starts with [ is a JSON list of strings, each word exactly as
    given (spaces, quotes, backslashes, empty words: what `ddpack submit -- CMD` writes); any other value is split on
    whitespace, the hand-made form. A value that is neither is one line (the settings table's), exit 2."""
    env = os.environ
    prefix: list[str] = []
    if name == "COMMAND":
        if env.get("DDPACK_COMMAND") and env.get("DDPACK_TRAIN_ARGS"):
            job_error(
                Path(env["DDPACK_RUN_DIR"]) if env.get("DDPACK_RUN_DIR") else None,
                "DDPACK_COMMAND and DDPACK_TRAIN_ARGS are both set; DDPACK_TRAIN_ARGS is for the bundled trainer: "
                "put your program's arguments in DDPACK_COMMAND",
            )
        name, prefix = ("DDPACK_COMMAND", ["--"]) if env.get("DDPACK_COMMAND") else ("DDPACK_TRAIN_ARGS", [])
    value = env.get(name, "")
    setting = settings_table().SETTINGS.get(name)
    if setting is not None and (why := setting.problem(name, value)) is not None:
        die(why)
    found = json.loads(value) if value.startswith("[") else value.split()
    print(" ".join(shlex.quote(word) for word in [*prefix, *found]))
    return 0


def container_path(path: str, mounts: str) -> str | None:
    """`path` as the container sees it through `mounts` (pyxis' --container-mounts: comma-separated SRC[:DST[:FLAGS]],
    DST defaulting to SRC; the longest SRC above it wins), or None when no mount holds it. The one definition: the
    host's submit loads it (ddpack/job_side.py), so both sides agree, on a mount of `/` too (`/:/host`)."""
    best: tuple[str, str] | None = None
    for entry in filter(None, mounts.split(",")):
        src, _, rest = entry.partition(":")
        dst = rest.split(":")[0] or src
        src, dst = src.rstrip("/"), dst.rstrip("/")  # "/" becomes "": a prefix of every absolute path
        if f"{path}/".startswith(f"{src}/") and (best is None or len(src) > len(best[0])):
            best = (src, dst)
    if best is None:
        return None
    return (best[1] + path[len(best[0]) :]) or "/"


def container_path_verb(path: str) -> int:
    """The verb: the path inside the container, or one line (recorded as the job's end once it has a run folder)."""
    mounts = os.environ.get("DDPACK_MOUNTS", "")
    inside = container_path(path, mounts)
    if inside is None:
        run_dir = os.environ.get("DDPACK_RUN_DIR")
        job_error(
            Path(run_dir) if run_dir else None,
            f"{path} is not under any of DDPACK_MOUNTS={mounts} (host:container pairs), so the container cannot reach it; submit "
            "from a folder on a mounted filesystem or add its mount to DDPACK_MOUNTS",
        )
    print(inside)
    return 0


def project_dir(where: str) -> int:
    """Where the trainer imports `--task module:factory` from after its working directory: DDPACK_PROJECT_DIR as given,
    else the submission folder; with `container`, as the container sees it (nothing, and one line, when no mount holds
    it: the modules are then looked for in the run folder only)."""
    env = os.environ
    folder = env.get("DDPACK_PROJECT_DIR") or env.get("SLURM_SUBMIT_DIR", "")
    if where == "container":
        inside = container_path(folder, env.get("DDPACK_MOUNTS", ""))
        if inside is None:
            with for_people():
                say(f"{folder} is under none of DDPACK_MOUNTS={env.get('DDPACK_MOUNTS', '')}: --task modules are looked for in the run folder only")
        folder = inside or ""
    answer(folder)
    return 0


def preflight(argv: list[str]) -> int:
    """The verb: `preflight [--container NAME] STEP...`. DDPACK_PREFLIGHT=1 runs the template's own srun line with
    `entrypoint --preflight` as a step before training; a failed check ends the job with its code (the container
    leaves the nodes). DDPACK_PREFLIGHT=only: the check alone (enroot/preflight.sbatch, which the shell ends after it)."""
    container = ""
    if argv[:1] == ["--container"]:
        container, argv = argv[1], argv[2:]
    env = os.environ
    mode = env.get("DDPACK_PREFLIGHT") or "0"
    if mode == "0":
        return 0
    run_dir, job = Path(env["DDPACK_RUN_DIR"]), env["SLURM_JOB_ID"]
    report = run_dir / "preflight.json"
    say(f"preflight (DDPACK_PREFLIGHT={mode}): checking the job in its own image, plan and network first")
    code = command(argv).returncode
    rc = 128 - code if code < 0 else code
    if rc:
        if container:
            remove_container(job, container)
        say(f"preflight failed (exit {rc}); not training. The 'preflight: FAIL' lines above name each problem; the report is {report}")
        write_record(run_dir, "preflight", {"result": "failed", "exit": str(rc), "report": str(report)})
        return rc
    write_record(run_dir, "preflight", {"result": "passed", "exit": "0", "report": str(report)})
    if mode == "only":
        say(f"preflight passed; report {report}")
    return 0


# --------------------------------------------------------------------------- the image on the nodes: the choice


def settings_table():  # type: ignore[no-untyped-def]
    """ddpack_settings.py beside this file: the one table of the job's settings (on the batch host, which has the file)."""
    import importlib.util

    path = Path(__file__).with_name("ddpack_settings.py")
    spec = importlib.util.spec_from_file_location("ddpack_settings", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules.setdefault("ddpack_settings", module)
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    except OSError as why:
        die(f"cannot read {path} ({one_line(why)}): ddpack_node.py reads the settings table beside it; set DDPACK_HOME to ddpack's enroot/ folder")
    return module


def stage_by_model(nodes: int, fsx: int, bcast: int, unpack: int) -> str:
    """sbcast or off for `nodes` nodes: the model's choice (ddpack/jobs/goodput_model.py, without the tree's few blocks) at
    FSX, SBCAST and UNPACK MB/s: N unpacks from the shared filesystem at once wait size / min(unpack, fsx / N); sbcast
    then an unpack from local disk, size / sbcast + size / unpack."""
    return "sbcast" if nodes * bcast * unpack > fsx * (bcast + unpack) and nodes * unpack > fsx else "off"


def command(argv: list[str], *, timeout: float | None = None, **options: object) -> subprocess.CompletedProcess:
    """`argv` run as subprocess.run runs it; a command that is missing, cannot start (E2BIG) or outlives `timeout`
    is a failed one (status 127, or 124 for the timeout, with empty output), as the shell would have it: the job's
    decisions go on with what they know, they never end in a traceback."""
    try:
        return subprocess.run(argv, timeout=timeout, **options)  # type: ignore[call-overload]
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "" if options.get("text") else b"", "")
    except OSError as why:
        warn(f"{argv[0]}: {one_line(why)}")
        return subprocess.CompletedProcess(argv, 127, "" if options.get("text") else b"", "")


def hostnames(hostlist: str) -> list[str] | None:
    """Slurm's hostlist (ddnode[1-3],gpu1) as names, as `scontrol show hostnames` expands it; None when scontrol did
    not answer (three tries a second apart): unknown, never "no nodes"."""
    if not hostlist:
        return []
    for attempt in range(3):
        out = command(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
        if out.returncode == 0:
            return out.stdout.split()
        if attempt < 2:
            time.sleep(1)
    return None


def natural(name: str) -> list[object]:
    """`sort -V`'s order for node names: node2 before node10."""
    return [int(part) if part.isascii() and part.isdigit() else part for part in re.split(r"([0-9]+)", name)]


def job_nodelist(job: str) -> str:
    """The job's nodes as Slurm lists them now (a hostlist): a --no-kill job that lost a node no longer holds it, while
    SLURM_JOB_NODELIST still names it."""
    listed = scontrol_fields(job, ("NodeList",)).get("NodeList", "")
    return listed if listed not in ("", "(null)") else os.environ.get("SLURM_JOB_NODELIST", "")


def gpus_promised(job: str) -> int:
    """The GPUs a node this job asked Slurm for (its TresPerNode: --gpus-per-node, --gres=gpu:N; several types add up),
    0 for none. Asked of Slurm, not read from SLURM_GPUS_* variables, which a job submitted from inside a GPU allocation
    inherits."""
    total = 0
    for entry in scontrol_fields(job, ("TresPerNode",)).get("TresPerNode", "").split(","):
        if re.fullmatch(r"gres[:/]gpu(:.*)?", entry):
            count = entry.rsplit(":", 1)[-1]
            total += int(count) if re.fullmatch(r"[0-9]+", count) else 1
    return total


class Staging:
    """DDPACK_STAGE's choice for this start, made and carried out on the batch host (ddpack-job.sh's
    ddpack_prepare_nodes): the image's path each node's pyxis imports. One line says the choice and why, and it is
    recorded (decisions.jsonl); a staging that fails is never the job's end: the nodes read the shared file instead.

    - off: every node reads DDPACK_SQSH from the shared filesystem (pyxis 0.19's own way): N reads of the image.
    - sbcast: one read: Slurm's sbcast sends it down a tree (fan-out DDPACK_STAGE_FANOUT, at most 8) to the nodes' local
      disk, DDPACK_STAGE_DIR/<key>.sqsh, where <key> names the image's content; a node that already holds that key (an
      earlier job's copy) is skipped. DDPACK_STAGE_KEEP (2) keys stay per node, and any key a live job of yours has
      chosen (the leases). DDPACK_STAGE_DIR (default /tmp/ddpack-images-<your uid>) is yours alone (docs/security.md).
    - auto (the default): the nodes' copies when every node holds the image already (nothing read at all); else sbcast
      when the model (stage_by_model) says the nodes would wait less: from 5 nodes with the defaults (DDPACK_FSX_MBPS=
      1200, DDPACK_SBCAST_MBPS=1000, DDPACK_UNPACK_MBPS=400)."""

    def __init__(self, sqsh: str, run_dir: Path, job: str, helper: str) -> None:
        env = os.environ
        self.sqsh, self.run_dir, self.job, self.helper = sqsh, run_dir, job, helper
        names = ("DDPACK_STAGE", "DDPACK_STAGE_DIR", "DDPACK_STAGE_KEEP", "DDPACK_FSX_MBPS", "DDPACK_SBCAST_MBPS", "DDPACK_UNPACK_MBPS",
                 "DDPACK_STAGE_FANOUT")  # fmt: skip
        for why in settings_table().problems({name: env[name] for name in names if name in env}):
            job_error(run_dir, why)  # ddpack_setup checked them all already: this is for a script that skipped it
        self.mode = env.get("DDPACK_STAGE") or "auto"
        self.dir = env.get("DDPACK_STAGE_DIR") or f"/tmp/ddpack-images-{os.getuid()}"
        self.keep, self.fsx, self.bcast, self.unpack, self.fanout = (
            int(env.get(name) or default) for name, default in
            (("DDPACK_STAGE_KEEP", 2), ("DDPACK_FSX_MBPS", 1200), ("DDPACK_SBCAST_MBPS", 1000), ("DDPACK_UNPACK_MBPS", 400), ("DDPACK_STAGE_FANOUT", 8))
        )  # fmt: skip

    def choose(self) -> str:
        """The path --container-image names: the shared file, or each node's local copy (sent now, or held already)."""
        mode, why, key, size = self.mode, "DDPACK_STAGE=off", "", 0
        if self.sqsh.startswith("/"):
            image_ok(argparse.Namespace(sqsh=self.sqsh))  # nobody else can swap what the job runs
        else:
            mode, why = "off", "not a file: pyxis imports it on every node"
        nodes = job_nodelist(self.job)
        count = len(hostnames(nodes) or [])  # unknown: the prepare step cannot run, and the nodes read the shared file
        if mode != "off":
            try:
                key, size = image_key(Path(self.sqsh)), os.stat(self.sqsh).st_size
            except OSError:
                mode, why = "off", f"cannot read {self.sqsh}"
        # One step on every node (prepare): containers of this user's jobs that are over (scancelled, timed out, killed
        # with their script) go, and each node checks its staging folder, leases the key for this job and answers
        # whether it holds a copy it can trust (has / lacks), or why it will not stage (refuse). A GPU job checks that
        # every node has the GPUs it was promised, first.
        gpus = gpus_promised(self.job)
        answers, rc = self.on_nodes(nodes, count, "prepare", "--key", key, "--size", str(size), "--gpus", str(gpus))
        lines = answers.splitlines()
        short = sorted((line.split(" ", 1)[1] for line in lines if line.startswith("nogpu ")), key=natural)
        none = [entry for entry in short if entry.split()[1] == "0"]
        if none:
            node, has = none[0].split(" ", 1)
            job_error(
                self.run_dir,
                f"this job was promised {gpus} GPU(s) a node, but {node} has {has} here, so the image would train on the CPU "
                "or fail; submit GPU jobs to a partition whose nodes have their GPUs, or drop --gpus-per-node to train on CPUs (not requeued)",
            )
        if short:
            say(f"warning: fewer GPU devices than the {gpus} promised a node (MIG slices share one device; else a GPU is missing): {';'.join(short)}")
        refused = [line.removeprefix("refuse ") for line in lines if line.startswith("refuse ")]
        answered = [line for line in lines if line.startswith(("has ", "lacks "))]
        if mode != "off" and refused:
            mode, why = "off", f"staging refused on {refused[0]}"
        elif mode != "off" and (rc != 0 or len(answered) != count):
            mode, why = "off", f"staging failed: not every node answered whether it holds the image (exit {rc})"
        lacking = sorted((line.split()[1] for line in answered if line.startswith("lacks ")), key=natural)
        if mode == "auto" and lacking:
            mode = stage_by_model(count, self.fsx, self.bcast, self.unpack)
            why = f"DDPACK_STAGE=auto: for {count} node(s) the model has the shared filesystem ahead of sbcast"
        if mode == "off":
            return self.shared(why)
        copy = f"{self.dir}/{key}.sqsh"
        if not lacking:
            say(f"image: all {count} nodes hold {copy} already; the shared filesystem is not read")
            write_record(self.run_dir, "staging", {"choice": "held", "why": f"every node holds this image's copy (key {key})", "sqsh": self.sqsh})
            return copy
        return copy if self.send(key, size, ",".join(lacking)) else self.sqsh

    def shared(self, why: str) -> str:
        say(f"image: every node reads {self.sqsh} ({why})")
        write_record(self.run_dir, "staging", {"choice": "shared", "why": why, "sqsh": self.sqsh})
        return self.sqsh

    def on_nodes(self, nodes: str, count: int, verb: str, *args: str) -> tuple[str, int]:
        """One task of this helper on each of `nodes`: (what they printed, srun's status); their warnings pass through."""
        argv = [
            "srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", f"--nodelist={nodes}", sys.executable, "-I", "-S",
            "-c", self.helper, verb, "--dir", self.dir, "--job", self.job, "--keep", str(self.keep), *args,
        ]  # fmt: skip
        out = command(argv, stdout=subprocess.PIPE, text=True)
        return out.stdout, out.returncode

    def send(self, key: str, size: int, lacking: str) -> bool:
        """sbcast the image to the `lacking` nodes into DIR as KEY.sqsh: a step that holds those nodes (sbcast sends to a
        step's nodes) and makes on each a new private folder for it (receive: sbcast never writes through a name another
        user could have planted), the copy, then each node checks it (ours, a plain file, the whole size) and renames it
        into place (install). On a failure one line names the node and why, and this start reads the shared file."""
        count = len(lacking.split(","))  # the lacking nodes' own names
        incoming = f".incoming-{self.job}-{os.urandom(8).hex()}"
        started = time.monotonic()
        try:
            handoff = Path(tempfile.mkdtemp(prefix=f".ddpack-stage-{self.job}.", dir=self.run_dir))
        except OSError:
            return self.failed(f"staging the image failed: cannot make a folder in {self.run_dir}; this start reads {self.sqsh} on every node")
        errors_file = Path(f"{handoff}.err")
        script = (
            '"$5" -I -S -c "$1" receive --dir "$2" --job "${SLURM_JOB_ID}" --incoming "$3" || exit 1\n'
            'echo "${SLURM_STEP_ID}" >"$4/${SLURMD_NODENAME}"\nexec sleep 3600'
        )
        try:
            with open(errors_file, "w") as errors:  # srun's lines about the step's cancel; only a node's refusal is shown
                holder = subprocess.Popen(
                    ["srun", "--quiet", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", f"--nodelist={lacking}",
                     "bash", "-c", script, "_", self.helper, self.dir, incoming, str(handoff), sys.executable],
                    stdout=subprocess.DEVNULL, stderr=errors,
                )  # fmt: skip
        except OSError as why:
            shutil.rmtree(handoff, ignore_errors=True)
            errors_file.unlink(missing_ok=True)
            return self.failed(f"staging the image failed: srun: {one_line(why)}; this start reads {self.sqsh} on every node")
        try:
            deadline = time.monotonic() + 120
            while len(list(handoff.iterdir())) < count:
                if holder.poll() is not None or time.monotonic() > deadline:
                    said = [line for line in errors_file.read_text().splitlines() if line.strip() and not line.startswith("srun")]
                    return self.failed(
                        f"staging the image failed: could not make a private folder to receive it on {lacking} "
                        f"({said[0] if said else 'no message'}); this start reads {self.sqsh} on every node"
                    )
                time.sleep(0.2)
            step = next(handoff.iterdir()).read_text().strip()
            sent = command(
                ["sbcast", f"--fanout={self.fanout}", f"--jobid={self.job}.{step}", self.sqsh, f"{self.dir}/{incoming}/{key}.sqsh"],
                capture_output=True, text=True,
            )  # fmt: skip
            command(["scancel", "--quiet", f"{self.job}.{step}"], capture_output=True)
        finally:
            with contextlib.suppress(ProcessLookupError):
                holder.terminate()
            holder.wait()
            shutil.rmtree(handoff, ignore_errors=True)
            errors_file.unlink(missing_ok=True)
        install = ("--key", key, "--size", str(size), "--incoming", incoming)
        argv = [
            "srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", f"--nodelist={lacking}", sys.executable, "-I", "-S",
            "-c", self.helper, "install", "--dir", self.dir, "--job", self.job, "--keep", str(self.keep), *install,
        ]  # fmt: skip
        if sent.returncode != 0:
            failed = self.failed(
                f"staging the image failed: sbcast to {lacking}: {last_line(sent.stdout + sent.stderr)}; this start reads {self.sqsh} on every node"
            )
            command(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # what sbcast left goes with the receiving folders
            return failed
        done = command(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        said = [line for line in done.stdout.splitlines() if line.strip()]
        removed = [line for line in said if line.startswith("ddpack: removed")]
        if done.returncode != 0:
            first = next((line for line in said if line not in removed), "no message")
            return self.failed(f"staging the image failed on {first}; this start reads {self.sqsh} on every node")
        for line in removed:
            write_line(sys.stdout, line)
        seconds = f"{time.monotonic() - started:.3f}"
        say(f"image: sent {self.sqsh} ({size // 1048576} MiB) once, by sbcast, to {lacking} as {self.dir}/{key}.sqsh in {seconds} s")
        sent_record = {"choice": "sent", "why": "sbcast to the nodes lacking it", "nodes": lacking, "sqsh": self.sqsh, "seconds": seconds}
        write_record(self.run_dir, "staging", sent_record)
        return True

    def failed(self, why: str) -> bool:
        """A staging that failed: one line, and the record of this start reading the shared file instead."""
        say(why)
        write_record(self.run_dir, "staging", {"choice": "shared", "why": why})
        return False


def stage(args: argparse.Namespace) -> int:
    """The verb: answer the path each node's pyxis imports; the choice is said for people."""
    helper = Path(__file__).read_text()
    with for_people():
        image = Staging(args.sqsh, Path(os.environ["DDPACK_RUN_DIR"]), os.environ["SLURM_JOB_ID"], helper).choose()
    answer(image)
    return 0


# --------------------------------------------------------------------------- training, restarted in place

MARKER = ".ddpack-this-start"  # touched at each start: forensics newer than it were written during this start
FAILURE_RESTARTS = ".ddpack-failure-restarts"  # the run folder's count of restarts after a failure, over its jobs
# train/run_folder.py's names (a test holds them to it)
FORENSICS, METRICS, SUMMARY, UNRESPONSIVE_NODES, REPORT = "forensics", "metrics.jsonl", "summary.json", "unresponsive-nodes", "report.html"


def unhealthy_nodes(hostlist: str) -> list[str]:
    """The nodes of `hostlist` that sinfo says are down, drained, failing or not responding (a trailing *)."""
    out = command(["sinfo", "-h", "-N", "-n", hostlist, "-o", "%N %t"], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S)
    found = []
    for line in out.stdout.splitlines():
        node, _, state = line.partition(" ")
        if state.startswith(("down", "drain", "drng", "fail")) or state.endswith("*"):
            found.append(node)
    return found


def read_count(path: Path) -> int:
    """The number in `path`; 0 where there is none yet. A file that is there but cannot be read, or holds no number,
    counts as 0 too: the count that follows must then be written, and a restart that cannot be is not made."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return 0
    return int(text) if re.fullmatch(r"[0-9]{1,9}", text) else 0


# srun's line for tasks that ended badly, "srun: error: NODE: task 3: Exited with exit code 1" (or "tasks 0-1: Killed").
TASK_ENDED = re.compile(rb"srun: error: ([A-Za-z0-9._-]+): tasks? ([0-9,-]+): (.*)")
NOT_A_CRASH = (b"Terminated", b"Exited with exit code 0")  # srun's own TERM for a stop; a task that ended well
END_MARK = b"ddpack-end "  # train/outcome.py's end record: {"rank", "host", "outcome", "reason", ...}
LEFT_BY_A_PEER = "a collective failed"  # the trainer's reason for a rank whose peer died (train/__main__.py)


def task_count(tasks: bytes) -> int:
    """How many tasks srun's list names ("3", "0-1,4")."""
    count = 0
    for part in tasks.split(b","):
        low, _, high = part.partition(b"-")
        count += int(high) - int(low) + 1 if high else 1
    return count


def crashed_node(ended: list[tuple[str, int]], left: dict[str, int]) -> str:
    """The node whose task crashed, from srun's lines (`ended`: node and task count, in srun's order) and the ranks'
    end records (`left`: per host, the ranks that say a peer left them, which crashed nothing): the first node srun
    names with more tasks that ended badly than ranks a peer left; else the first srun names ("" for none). A rank
    that crashes is often not the first srun hears of: its peers may exit before its own teardown ends."""
    counts: dict[str, int] = {}
    for node, count in ended:  # srun may name one node's tasks on several lines (one killed, one exited)
        counts[node] = counts.get(node, 0) + count
    for node, count in counts.items():  # in the order srun first named them
        if count > left.get(node, 0):
            return node
    return ended[0][0] if ended else ""


def run_step(argv: list[str]) -> tuple[int, str]:
    """Run the training step (srun), its output and errors passed through line by line as they come; its status (as
    `command` gives it) and the node whose task crashed ("" for none), read from srun's lines and the end records."""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    except OSError as why:
        warn(f"{argv[0]}: {one_line(why)}")
        return 127, ""
    ended: list[tuple[str, int]] = []
    left: dict[str, int] = {}

    def copy(stream: object, fd: int) -> None:
        for line in stream:  # type: ignore[attr-defined]
            data = line
            with contextlib.suppress(OSError):
                while data:
                    data = data[os.write(fd, data) :]
            found = TASK_ENDED.match(line)
            if found and not found.group(3).startswith(NOT_A_CRASH):
                ended.append((found.group(1).decode("ascii"), task_count(found.group(2))))
            at = line.find(END_MARK)
            if at >= 0:
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    end = json.loads(line[at + len(END_MARK) :])
                    if str(end.get("reason") or "").startswith(LEFT_BY_A_PEER):
                        left[str(end["host"])] = left.get(str(end["host"]), 0) + 1

    readers = [
        threading.Thread(target=copy, args=(stream, fd), name=f"ddpack-step-{fd}", daemon=True)
        for stream, fd in ((proc.stdout, 1), (proc.stderr, 2))
    ]
    for reader in readers:
        reader.start()
    code = proc.wait()
    for reader in readers:
        reader.join(timeout=5)  # a process the step left behind may hold a pipe open: never wait on it for long
    return code, crashed_node(ended, left)


PROGRESS_RECORD = b'"kind": "progress"'  # train/metrics.py's progress records, as json.dumps spells them


def metrics_size(path: Path) -> int | None:
    """The metrics file's size now; None where there is none (a program of your own may write none)."""
    try:
        return path.stat().st_size
    except OSError:
        return None


def made_progress(path: Path, since: int | None) -> str:
    """Whether the step wrote a progress record (it finished steps) after byte `since` of the metrics file: "yes",
    "no", or "" where there is no metrics file, before or after (nothing to tell from)."""
    try:
        with path.open("rb") as handle:
            handle.seek(since or 0)
            while chunk := handle.read(1 << 20):
                if PROGRESS_RECORD in chunk:
                    return "yes"
    except OSError:
        return "" if since is None else "no"
    return "no"


RECOVERY_FALLBACK = "in-process recovery impossible: "  # train/__main__.py's end-record reason when --recovery falls back


def recovery_fallback(path: Path, since: int | None) -> str:
    """Why in-process recovery (the trainer's --recovery, train/recovery.py) fell back to this restart, from rank 0's end
    record written after byte `since` of the metrics file; "" when it did not (or there is no such record)."""
    try:
        with path.open("rb") as handle:
            handle.seek(since or 0)
            lines = handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("kind") == "end" and str(record.get("reason", "")).startswith(RECOVERY_FALLBACK):
                return str(record["reason"])[len(RECOVERY_FALLBACK) :]
    return ""


def newer(path: Path, than: Path) -> bool:
    """`test PATH -nt THAN`: PATH exists and was changed after THAN (or THAN is missing)."""
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return False
    try:
        return mtime > than.stat().st_mtime_ns
    except OSError:
        return True


def remove_container(job: str, name: str) -> None:
    """Remove the job's container from every node it holds now (pyxis keeps named containers after the job unless its
    plugstack.conf sets container_scope=job, when pyxis calls it pyxis_<job>_<name> and removes it itself, so a missing
    pyxis_<name> is not an error). One task per node, with the node's own enroot (the one pyxis runs)."""
    nodes = job_nodelist(job)
    count = str(len(hostnames(nodes) or []))
    command(
        ["srun", "--ntasks-per-node=1", f"--nodes={count}", f"--ntasks={count}", f"--nodelist={nodes}",
         "bash", "-c", 'enroot remove -f "pyxis_$1" >/dev/null 2>&1 || true', "_", name],
    )  # fmt: skip


class Training:
    """The training step, restarted in this allocation while it can, then the job's end or its requeue (ddpack-job.sh's
    ddpack_train). The step's exit status decides, whatever ran (the bundled trainer, your DDPACK_COMMAND, the image's
    own):

    - 0 done; 2 bad input (never retried: the error line says what to fix);
    - 128+10 / 128+15 (138, 143) stopped on SIGUSR1/SIGTERM: preempted (or the time limit's warning): back to the queue,
      requeued up to DDPACK_MAX_RESTARTS (10);
    - anything else (124 a hang the watchdog ended, 137 a SIGKILL such as the OOM killer's or srun's for a rank still
      frozen DDPACK_STEP_WAIT seconds after the others ended, 1 a crash or a lost peer or node): a failure, retried up to
      DDPACK_MAX_FAILURE_RESTARTS times (1) per run folder. A retry restarts the step in this allocation when enough
      healthy nodes remain (a spare swapped in for a bad node; DDPACK_RESTART_IN_PLACE=0 turns that off), else requeues
      the job, keeping out the nodes a hang's forensics named unresponsive where the partition has others to spare. A
      hang is told by its exit 124 or by forensics written during this start (the frozen rank's 137 is the step's
      status then). A step Slurm ended because the job lost a node (143) is a failure of the node, not a preemption.

    DDPACK_SPARE_NODES=K: the job's last K nodes are spares; training runs on the others, and a restart swaps a spare
    in for a node that failed. Each decision is one line for people and a record for `ddpack status`."""

    def __init__(self, step: list[str], command: list[str], container: str = "") -> None:
        env = os.environ
        self.step, self.command, self.container = step, command, container
        self.job, self.run_dir = env["SLURM_JOB_ID"], Path(env["DDPACK_RUN_DIR"])
        names = ("DDPACK_SPARE_NODES", "DDPACK_RESTART_IN_PLACE", "DDPACK_MAX_RESTARTS", "DDPACK_MAX_FAILURE_RESTARTS")
        for why in settings_table().problems({name: env[name] for name in names if name in env}):
            job_error(self.run_dir, why)  # ddpack_setup checked them all already: this is for a script that skipped it
        self.spares = int(env.get("DDPACK_SPARE_NODES") or 0)
        self.in_place = (env.get("DDPACK_RESTART_IN_PLACE") or "1") == "1"
        self.max_restarts = int(env.get("DDPACK_MAX_RESTARTS") or 10)
        self.max_failed = int(env.get("DDPACK_MAX_FAILURE_RESTARTS") or 1)
        self.restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
        self.failed = 0  # failure restarts counted during this start: the cap holds if the run folder's count is lost
        self.bad_nodes: list[str] = []  # nodes a hang's forensics named, over the whole job
        self.last_nodes: list[str] = []  # the nodes the last training step ran on
        self.placement: list[str] = []  # srun's options that put the step on them (none: the whole allocation)
        self.short = ""  # why no placement was found
        self.keep_out: list[str] = []
        self.crashed = ""  # the node srun named first for a task that crashed in the last step
        self.progress = ""  # whether the last step wrote progress records: yes, no, "" (no metrics file)
        self.fallback = ""  # why the trainer's in-process recovery fell back to this restart ("": it did not)
        self.crashes: dict[str, int] = {}  # crashes by node during this start: a second one puts the node out for the job
        self.avoid: list[str] = []  # nodes the next placement uses only where no other healthy node is left

    def run(self) -> int:
        """Train until the job ends here or goes back to the queue; the last step's status."""
        if self.spares > 0:
            if not self.place():
                if self.short.startswith("Slurm did not"):  # not bad input: the job fails, and says why
                    say(f"cannot place the training step: {self.short}")
                    write_record(self.run_dir, "step-end", {"verdict": "end", "reason": "no-placement", "exit": "1", "text": self.short})
                    self.leave("end")
                    return 1
                job_error(self.run_dir, f"DDPACK_SPARE_NODES={self.spares}: {self.short}")
            say(f"training on {','.join(self.last_nodes)}; spare: {self.spares_now()}")
            write_record(self.run_dir, "placement", {"nodes": ",".join(self.last_nodes), "spares": self.spares_now()})
        while True:
            sys.stdout.flush()
            before = metrics_size(self.run_dir / METRICS)
            code, self.crashed = run_step([*self.step, *self.placement, *self.command])
            self.progress = made_progress(self.run_dir / METRICS, before)
            self.fallback = recovery_fallback(self.run_dir / METRICS, before)
            rc = 128 - code if code < 0 else code  # a step killed by a signal: its status as the shell gives it
            after = self.after_step(rc)
            if after != "restart":
                break
            with contextlib.suppress(OSError):
                (self.run_dir / MARKER).open("w").close()  # forensics newer than this belong to the restart
        self.leave(after)
        return rc

    def place(self) -> bool:
        """Set the srun options that put a training step on the job's healthy nodes, the ones the last step used first,
        spares after; False (self.short says why) when fewer are healthy than training needs. Healthy: still in the job
        (Slurm drops a node it lost from a --no-kill job), not down, drained or failing in sinfo, not named unresponsive
        by a hang's forensics during this job."""
        env = os.environ
        total = int(env.get("SLURM_JOB_NUM_NODES") or 1)
        need = total - self.spares
        if need < 1:
            job_error(
                self.run_dir,
                f"DDPACK_SPARE_NODES={self.spares} leaves no node to train on: the job has {total}; ask sbatch for --nodes=<training nodes + spares>",
            )
        per_node = (env.get("SLURM_NTASKS_PER_NODE") or "").split("(")[0]
        if not re.fullmatch(r"[0-9]+", per_node):
            job_error(
                self.run_dir,
                f"a restart in this allocation needs --ntasks-per-node (SLURM_NTASKS_PER_NODE={env.get('SLURM_NTASKS_PER_NODE', '')}); the templates set it",
            )
        listed = job_nodelist(self.job)
        bad = {*self.bad_nodes, *unhealthy_nodes(listed)}
        listed_names = hostnames(listed)
        if listed_names is None:
            self.short = "Slurm did not list the job's nodes (scontrol show hostnames failed)"
            return False
        names = [node for node in listed_names if node not in bad]
        healthy = [node for node in names if node in self.last_nodes] + [node for node in names if node not in self.last_nodes]
        healthy = [node for node in healthy if node not in self.avoid] + [node for node in healthy if node in self.avoid]
        if len(healthy) < need:
            self.short = f"{len(healthy)} healthy node(s) left in the allocation and training needs {need}"
            return False
        self.last_nodes = healthy[:need]
        self.placement = [f"--nodes={need}", f"--ntasks={need * int(per_node)}", f"--nodelist={','.join(self.last_nodes)}"]
        return True

    def spares_now(self) -> str:
        """The allocation's nodes that are not the ones training uses now."""
        spare = [node for node in hostnames(job_nodelist(self.job)) or [] if node not in self.last_nodes]
        return ",".join(spare) or "none"

    def after_step(self, rc: int) -> str:
        """end, restart or requeue, from the step's exit status; one line says which and why."""
        self.report_hint()
        if rc == 0:
            return self.decide("end", "completed", "done", rc, "the step completed (exit 0)")
        if rc == 2:
            said = "the step ended on bad input (exit 2); not requeueing: fix what its error line names and resubmit"
            return self.decide("end", "end", "bad-input", rc, said)
        kind = "preempted" if rc in (138, 143) else "failed"
        what, reason = f"failed (exit {rc})", kind
        lost = self.lost_nodes()
        if lost:
            kind, what, reason = "failed", f"ended (exit {rc}) when the job lost {','.join(lost)}", "lost-node"
        if kind == "preempted":
            if self.restarts >= self.max_restarts:
                return self.decide(
                    "end", "end", "preempted", rc,
                    f"preempted (exit {rc}) after {self.restarts} restarts, the cap DDPACK_MAX_RESTARTS={self.max_restarts}; "
                    f"not requeueing ({self.continue_hint()} to continue)",
                )  # fmt: skip
            if self.progress == "no" and self.restarts >= 1 and self.earlier_start_progress() == "no":
                return self.decide(
                    "end", "end", "no-progress", rc,
                    f"preempted (exit {rc}) with no new step in {self.run_dir / METRICS}, as in the start before it: not requeueing "
                    f"a program that stops before its first step at every start (its lines above say where); {self.continue_hint()} to try again",
                )  # fmt: skip
            return self.decide(
                "requeue", "requeue", "preempted", rc,
                f"preempted (exit {rc}); requeueing job {self.job} (restart {self.restarts + 1} of at most {self.max_restarts})",
            )  # fmt: skip
        counted = self.run_dir / FAILURE_RESTARTS
        failed = max(self.failed, read_count(counted))  # the file may have been lost or reset: memory counts too
        forensics = self.run_dir / FORENSICS
        crashed = ""
        if not lost and (rc == 124 or newer(forensics / SUMMARY, self.run_dir / MARKER)):
            what, reason = f"ended as hung (exit {rc}; evidence in {forensics})", "hung"
        elif not lost and self.crashed in self.our_nodes():  # srun's line shares the pipe with the tasks': ours only
            crashed, reason = self.crashed, "crashed"
            what = f"failed (exit {rc}) when its task on {crashed} crashed"
        if failed >= self.max_failed or self.restarts >= self.max_restarts:
            return self.decide(
                "end", "end", reason, rc,
                f"the step {what} after {failed} failure restarts, the cap DDPACK_MAX_FAILURE_RESTARTS={self.max_failed}; "
                f"not requeueing ({self.continue_hint()} to continue from its last snapshot)",
            )  # fmt: skip
        try:
            write_private(counted, f"{failed + 1}\n", durable=True)
        except OSError as why:  # full, over quota, read-only: a restart that cannot be counted could loop for ever
            return self.decide(
                "end", "end", "uncounted", rc,
                f"the step {what}; not restarting it: the restart cannot be counted in {counted} ({one_line(why)}); "
                f"make room there or fix its permissions, then {self.continue_hint()} to continue from its last snapshot",
            )  # fmt: skip
        self.failed = failed + 1
        count = f"failure restart {failed + 1} of at most {self.max_failed}"
        named = self.named_this_start()
        without = f", without {','.join(named)} (named unresponsive)" if named else ""
        self.bad_nodes += [node for node in named if node not in self.bad_nodes]
        self.avoid = []
        if crashed:
            self.crashes[crashed] = self.crashes.get(crashed, 0) + 1
            if self.crashes[crashed] >= 2:  # twice: the node's fault, not the program's; out for the rest of the job
                named = [*named, crashed]
                without += f", without {crashed} (its tasks crashed twice)"
                if crashed not in self.bad_nodes:
                    self.bad_nodes.append(crashed)
            else:
                self.avoid = [crashed]
        if not self.in_place:
            self.short = "DDPACK_RESTART_IN_PLACE=0"
        elif self.place():
            if crashed in self.avoid:
                without += f", without {crashed} (its task crashed)" if crashed not in self.last_nodes else f", on {crashed} again (no other node)"
            left_out = ",".join(node for node in [*named, *self.avoid] if node not in self.last_nodes)
            placed = {"nodes": ",".join(self.last_nodes), "spares": self.spares_now(), "without": left_out}
            write_record(self.run_dir, "placement", placed)
            return self.decide(
                "restart", "restart", reason, rc,
                f"the step {what}; restarting it in this allocation on {','.join(self.last_nodes)}{without} from its last snapshot ({count})",
            )  # fmt: skip
        after = self.decide(
            "requeue", "requeue", reason, rc,
            f"the step {what}; {self.short}: requeueing job {self.job} to resume from its last snapshot ({count})",
        )  # fmt: skip
        self.nodes_to_keep_out()
        return after

    def decide(self, after: str, verdict: str, reason: str, rc: int | str, sentence: str) -> str:
        """The step's end decided: said, recorded (the run's end, for `ddpack status` once Slurm has forgotten the job)."""
        if self.fallback and verdict != "completed":
            say(f"in-process recovery fell back to this decision: {self.fallback}")
        say(sentence)
        fields = {"verdict": verdict, "reason": reason, "exit": str(rc), "text": sentence, "progress": self.progress}
        if self.fallback:
            fields["recovery_fallback"] = self.fallback
        write_record(self.run_dir, "step-end", fields)
        return after

    def earlier_start_progress(self) -> str:
        """The progress of the last step of the start before this one (SLURM_RESTART_COUNT one less), as its step-end
        record has it: "yes", "no" or "" (unknown)."""
        try:
            lines = read_nofollow(self.run_dir / DECISIONS, limit=None).splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("kind") == "step-end" and entry.get("restart") == self.restarts - 1:
                return str(entry.get("progress") or "")
        return ""

    def lost_nodes(self) -> list[str]:
        """The nodes the last step ran on that the job lost (Slurm dropped them from this --no-kill job) or that sinfo
        says are down, drained or failing."""
        ran = self.last_nodes or hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) or []
        if not ran:
            return []
        listed = hostnames(job_nodelist(self.job))
        now = set(ran if listed is None else listed)  # unknown: only sinfo's word counts, never "all were lost"
        bad = set(unhealthy_nodes(",".join(ran)))
        return [node for node in ran if node not in now or node in bad]

    def our_nodes(self) -> set[str]:
        """The job's nodes, as it started and as Slurm lists them now: the only names a decision may act on."""
        return {*(hostnames(os.environ.get("SLURM_JOB_NODELIST", "")) or []), *(hostnames(job_nodelist(self.job)) or [])}

    def named_this_start(self) -> list[str]:
        """The nodes a hang's forensics named unresponsive during this start. Only names of this job's nodes count: the
        file is written from what ranks said through the rendezvous store, and a name that is not one of ours must never
        reach ExcNodeList."""
        named = self.run_dir / FORENSICS / UNRESPONSIVE_NODES
        if not (named.is_file() and named.stat().st_size and newer(named, self.run_dir / MARKER)):
            return []
        ours = self.our_nodes()
        found: list[str] = []
        for line in named.read_text(errors="replace").splitlines():
            if line in ours and line not in found:
                found.append(line)
        return found

    def nodes_to_keep_out(self) -> None:
        """Keep the nodes a hang's forensics named out of the requeued job when the partition has enough others for it
        (else it would never start again, and a line says so)."""
        if not self.bad_nodes:
            return
        env = os.environ
        partition, needs = env.get("SLURM_JOB_PARTITION", ""), int(env.get("SLURM_JOB_NUM_NODES") or 1)
        out = command(["sinfo", "-h", "-p", partition, "-o", "%D"], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S).stdout.split()
        total = int(out[0]) if out and re.fullmatch(r"[0-9]+", out[0]) else 0
        nodes = ",".join(self.bad_nodes)
        if total - len(self.bad_nodes) < needs:
            why = f"partition {partition or '?'} has {total} nodes and the job needs {needs}"
            say(f"not keeping out {nodes} ({self.why_out(self.bad_nodes, short=True)}): {why}")
            write_record(self.run_dir, "keep-out", {"nodes": nodes, "kept": "no", "why": why})
            return
        self.keep_out = list(self.bad_nodes)

    def why_out(self, nodes: list[str], *, short: bool = False) -> str:
        """Why `nodes` are kept out: a hang's forensics named them, or their tasks crashed twice."""
        crashed = [node for node in nodes if self.crashes.get(node, 0) >= 2]
        reasons = ["named unresponsive" + ("" if short else " by the hang's forensics")] if len(crashed) < len(nodes) else []
        if crashed:
            reasons.append(f"{'its' if len(crashed) == 1 else 'their'} tasks crashed twice")
        return "; ".join(reasons)

    def leave(self, after: str) -> None:
        """After the last step of this start: the job's container leaves the nodes, then the requeue decided, or the run
        folder is free for another job."""
        if self.container:
            remove_container(self.job, self.container)
        if after == "requeue":
            self.requeue()
        else:
            unlock(argparse.Namespace(run_dir=str(self.run_dir), job=self.job))

    def requeue(self) -> None:
        """Requeue this job, then keep the named nodes out of its next start. Slurm refuses ExcNodeList for a running
        job, and a requeue SIGTERMs this script and kills it KillWait seconds later (30 by default): TERM is ignored from
        here (by this program and the commands it runs, which inherit that), which keeps it alive for the one update and
        its record that follow."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.stdout.flush()
        if command(["scontrol", "requeue", self.job]).returncode != 0:
            self.decide(
                "end", "end", "requeue-refused", "",
                f"scontrol requeue {self.job} was refused (its line above says why); the job ends here: {self.continue_hint()} to continue",
            )  # fmt: skip
            return
        if not self.keep_out:
            return
        nodes = ",".join(self.keep_out)
        if command(["scontrol", "update", f"JobId={self.job}", f"ExcNodeList={nodes}"]).returncode == 0:
            say(f"keeping {nodes} ({self.why_out(self.keep_out)}) out of the restart")
            write_record(self.run_dir, "keep-out", {"nodes": nodes, "kept": "yes"})
        else:
            say(f"could not keep {nodes} out of the restart (scontrol update refused); it may land there again")
            write_record(self.run_dir, "keep-out", {"nodes": nodes, "kept": "no", "why": "scontrol update refused"})

    def continue_hint(self) -> str:
        """How to continue this run in a new job: `ddpack resubmit` for a run `ddpack submit` made, else the setting (a
        job started by hand leaves a run.json too, which says a template made it: ddpack cannot resubmit that one)."""
        try:
            made_by = json.loads(read_nofollow(self.run_dir / RUN_RECORD, limit=None)).get("settings", {}).get("made_by")
        except (OSError, ValueError, AttributeError):
            return f"resubmit with DDPACK_RUN_DIR={self.run_dir}"
        return f"resubmit with DDPACK_RUN_DIR={self.run_dir}" if made_by == "template" else f"ddpack resubmit {self.run_dir}"

    def report_hint(self) -> None:
        """Where the run's charts come from, once a step has left metrics (a program of your own may write none)."""
        metrics = self.run_dir / METRICS
        if metrics.is_file() and metrics.stat().st_size:
            say(f"metrics in {metrics}; for the run report ({self.run_dir / REPORT}) run, in the ddpack checkout: make report RUN={self.run_dir}")


def train(argv: list[str]) -> int:
    """The verb: `train [--container NAME] N STEP(N words)... COMMAND...`; the step's srun and its options come first,
    the placement goes between them and the command. Ends with the last step's status."""
    container = ""
    if argv[:1] == ["--container"]:
        container, argv = argv[1], argv[2:]
    if not argv or not re.fullmatch(r"[0-9]+", argv[0]):
        die("train: expected [--container NAME] N STEP... COMMAND..., N the step's words")
    count = int(argv[0])
    return Training(argv[1 : 1 + count], argv[1 + count :], container).run()


# --------------------------------------------------------------------------- plumbing


def write_line(stream: object, text: str) -> None:
    """One line to `stream`'s file descriptor in one write, nothing left in Python's buffer (which would fail again at
    exit and turn the status into 120 when the log's disk is full): a line that cannot be written is lost alone."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        stream.flush()  # type: ignore[attr-defined]
        os.write(stream.fileno(), os.fsencode(text) + b"\n")  # type: ignore[attr-defined]


def warn(text: str) -> None:
    write_line(sys.stderr, f"ddpack: {text}")


ANSWER_FD = os.environ.pop("ddpack_answer_fd", None)  # ddpack-job.sh's ddpack_ask: the fd a verb's answer goes to


def answer(text: str) -> None:
    """A verb's answer, which the shell captures: on the fd ddpack_ask opened for it (the verb's lines for people stay on
    stdout, in the job's log with the rest), else on stdout (its lines for people then go to stderr: for_people)."""
    if ANSWER_FD:
        os.write(int(ANSWER_FD), os.fsencode(text) + b"\n")
    else:
        print(text, flush=True)


def for_people() -> contextlib.AbstractContextManager:
    """Where a verb with an answer says its lines for people: stdout when the answer has its own fd, else stderr."""
    return contextlib.nullcontext() if ANSWER_FD else contextlib.redirect_stdout(sys.stderr)


def restore_locale() -> None:
    """Python coerces a C locale to C.UTF-8 and exports LC_CTYPE (PEP 538; -I cannot turn that off): the steps this
    program starts get LC_CTYPE as the job's shell had it (ddpack-job.sh passes it as ddpack_lc_ctype)."""
    was = os.environ.pop("ddpack_lc_ctype", None)
    if was == "(unset)":
        os.environ.pop("LC_CTYPE", None)
    elif was is not None:
        os.environ["LC_CTYPE"] = was


def say(text: str) -> None:
    """A line of the job's log for people (stdout, as the shell's echo); a log that cannot be written (a full disk) costs
    the line, never the decision it tells of."""
    write_line(sys.stdout, f"ddpack: {text}")


def job_error(run_dir: Path | None, text: str) -> None:
    """Bad input found by the job: one line, recorded as the job's end once it has a run folder (ddpack-job.sh's
    ddpack_die), exit 2."""
    if run_dir is not None and run_dir.is_dir():
        write_record(run_dir, "step-end", {"verdict": "end", "reason": "bad-input", "exit": "2", "text": f"error: {text}"})
    die(text)


def die(text: str) -> None:
    print(f"ddpack: error: {text}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"


def one_line(why: BaseException) -> str:
    if isinstance(why, OSError) and why.errno in (errno.EACCES, errno.EPERM):
        return f"{why.filename}: permission denied (another user's folder?)"
    return " ".join(str(why).split())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    restore_locale()
    if argv[:1] == ["train"]:
        return train(argv[1:])
    if argv[:1] == ["setup"] and len(argv) == 2:
        return setup(argv[1])
    if argv[:1] == ["cpus-per-task"]:
        return cpus_per_task()
    if argv[:1] == ["words"] and len(argv) == 2:
        return words(argv[1])
    if argv[:1] == ["container-path"] and len(argv) == 2:
        return container_path_verb(argv[1])
    if argv[:1] == ["project-dir"] and len(argv) <= 2:
        return project_dir((argv[1:] or [""])[0])
    if argv[:1] == ["preflight"]:
        return preflight(argv[1:])
    if argv[:1] == ["remove-container"] and len(argv) == 2:
        remove_container(os.environ["SLURM_JOB_ID"], argv[1])
        return 0
    if argv[:1] == ["leave"]:  # leave [--container NAME]: remove the job's container, give the run folder back
        job = os.environ["SLURM_JOB_ID"]
        if argv[1:2] == ["--container"] and argv[2:3] != [""]:
            remove_container(job, argv[2])
        return unlock(argparse.Namespace(run_dir=os.environ["DDPACK_RUN_DIR"], job=job))
    parser = argparse.ArgumentParser(prog="ddpack_node.py", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    folder_args = argparse.ArgumentParser(add_help=False)
    folder_args.add_argument("--dir", required=True)
    folder_args.add_argument("--job", required=True)
    folder_args.add_argument("--key", default="")
    folder_args.add_argument("--size", type=int, default=0)
    folder_args.add_argument("--keep", type=int, default=2)
    verbs.add_parser("prepare", parents=[folder_args]).set_defaults(run=prepare)
    verbs.choices["prepare"].add_argument("--gpus", type=int, default=0, help="the GPUs Slurm promised the job on each node")
    for name, run in (("receive", receive), ("install", install)):
        sub = verbs.add_parser(name, parents=[folder_args])
        sub.add_argument("--incoming", required=True, type=incoming_name)
        sub.set_defaults(run=run)
    for name, run in (("lock", lock), ("unlock", unlock)):
        sub = verbs.add_parser(name)
        sub.add_argument("run_dir")
        sub.add_argument("--job", required=True)
        sub.set_defaults(run=run)
    sub = verbs.add_parser("record")
    sub.add_argument("run_dir")
    sub.add_argument("kind", choices=DECISION_KINDS)
    sub.add_argument("fields", nargs="*")
    sub.set_defaults(run=record)
    verbs.add_parser("key").add_argument("sqsh")
    verbs.choices["key"].set_defaults(run=key)
    verbs.add_parser("stage", help="on the batch host: choose and carry out DDPACK_STAGE; print the image's path").add_argument("sqsh")
    verbs.choices["stage"].set_defaults(run=stage)
    verbs.add_parser("image-ok").add_argument("sqsh")
    verbs.choices["image-ok"].set_defaults(run=image_ok)
    args = parser.parse_args(argv)
    if getattr(args, "key", "") and args.verb != "key" and not KEY.fullmatch(args.key):
        die(f"--key {args.key!r} is not a staging key")
    return args.run(args)


def incoming_name(text: str) -> str:
    if not INCOMING.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a receiving folder's name (.incoming-<job>-<hex>)")
    return text


if __name__ == "__main__":
    sys.exit(main())
