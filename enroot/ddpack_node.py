"""ddpack_node.py — what a ddpack job runs on each node: the image's staging folder, safe when other users share it.

The batch host's job program (enroot/ddpack_job.py) sends this file, and only this file, to the nodes as `python3 -I -S -c
TEXT VERB ...` (one task per node), so it imports nothing but the standard library and nothing beside it. Its verbs:

    prepare --dir D --job J --keep K [--key KEY --size BYTES] [--gpus N] [--need BYTES]
                  remove containers of this user's jobs that are over, check the node's GPUs (a GPU job), check the
                  staging folder D (created private when missing), lease KEY for job J, drop copies no live job leases
                  beyond the newest K, then answer `has NODE`, `lacks NODE` or `refuse NODE why` (and `nogpu NODE ...`);
                  a node that lacks the copy and has less than BYTES free in D (the copy and its unpacked size) refuses
    receive --dir D --job J --keep K --incoming NAME
                  make the private folder sbcast writes into
    install --dir D --job J --keep K --key KEY --size BYTES --incoming NAME
                  check what sbcast wrote (ours, a plain file, the whole size) and rename it into place as KEY.sqsh,
                  then the same cleanup as prepare; answers `installed NODE` or `failed NODE why`

The batch host imports it too, for the one "yours alone" check and the folder rules (the run folder's, the records').

Why Python and not more shell: these are decisions about files another user may have planted (owner, mode, links,
odd names) and about `squeue`'s answer (a failure is not "no jobs"); os.lstat, O_NOFOLLOW and a list of names
say that exactly, where `ls | xargs rm` split names on whitespace (docs/security.md).

Trust (docs/security.md): other users of the node are not trusted; root and the Slurm admins are. The staging folder
(DDPACK_STAGE_DIR; the settings table's default is under /tmp) is used only when this user owns it, it is not a link, group
and others cannot write it and every folder above it is root's or ours (and sticky where others can write it); it
holds only ddpack's names, on a local filesystem. Inside a folder only we can write, a name only we can have made is
trusted, and nothing is followed through a link.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

# A staged copy's name: the key ddpack_staging.image_key derives (image id prefix and options hash, or a file-version hash).
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


# --------------------------------------------------------------------------- this user's live jobs


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
            "point DDPACK_STAGE_DIR at a folder of its own (or unset it: its default is a folder of your own in /tmp)"
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
            elif (short := too_little_space(folder, args.need)) is not None:
                print(f"refuse {node} {short}")
            else:
                print(f"lacks {node}")
    except (Refused, OSError) as why:
        print(f"refuse {node} {one_line(why)}")
    return 0


def too_little_space(folder: Path, need: int) -> str | None:
    """Why `folder`'s filesystem cannot take `need` bytes (the copy, then what enroot unpacks from it), or None: checked
    before anything is copied, so that a node whose disk would fill mid-copy or mid-unpack reads the shared file
    instead, named, rather than failing the step (or every node's staging) later."""
    info = os.statvfs(folder)
    free = info.f_bavail * info.f_frsize
    if free >= need:
        return None
    return (
        f"has too little free space in {folder}: {free // 1048576} MiB free, {need // 1048576} MiB needed (the image and its unpacked size)"
    )


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
    """What sbcast wrote, checked (a plain file of ours, of the source's size) and renamed into place as KEY.sqsh; the
    answer, `installed NODE` or `failed NODE why`, is this node's alone (the batch host keeps each node's)."""
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    folder = Path(args.dir)
    incoming = folder / args.incoming
    part = incoming / f"{args.key}.sqsh"
    try:
        private_folder(folder, "DDPACK_STAGE_DIR")
        info = os.lstat(part) if os.path.lexists(part) else None
        if info is None or not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            print(f"failed {node} sbcast left no file of yours at {part}")
            return 1
        if info.st_size != args.size:
            print(f"failed {node} received {info.st_size} of {args.size} bytes")
            return 1
        os.chmod(part, 0o600, follow_symlinks=False)  # sbcast copies the source's mode (a team's 664): ours alone now
        os.replace(part, folder / f"{args.key}.sqsh")
    except (Refused, OSError) as why:
        print(f"failed {node} {one_line(why)}")
        return 1
    finally:
        remove_incoming(incoming)
    with folder_locked(folder):
        for name in clean_stage(folder, args.keep, LiveJobs(args.job)):
            warn(f"removed {folder}/{name} on {node} (no live job of yours uses it)")
    print(f"installed {node}")
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


# --------------------------------------------------------------------------- plumbing


def write_line(stream: object, text: str) -> None:
    """One line to `stream`'s file descriptor in one write, nothing left in Python's buffer (which would fail again at
    exit and turn the status into 120 when the log's disk is full): a line that cannot be written is lost alone."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        stream.flush()  # type: ignore[attr-defined]
        os.write(stream.fileno(), os.fsencode(text) + b"\n")  # type: ignore[attr-defined]


def warn(text: str) -> None:
    write_line(sys.stderr, f"ddpack: {text}")


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"


def one_line(why: BaseException) -> str:
    if isinstance(why, OSError) and why.errno in (errno.EACCES, errno.EPERM):
        return f"{why.filename}: permission denied (another user's folder?)"
    return " ".join(str(why).split())


def incoming_name(text: str) -> str:
    if not INCOMING.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a receiving folder's name (.incoming-<job>-<hex>)")
    return text


def main(argv: list[str] | None = None) -> int:
    """The node's verb table: one parse of each option (the batch host's Staging writes every one of them)."""
    parser = argparse.ArgumentParser(prog="ddpack_node.py", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    folder_args = argparse.ArgumentParser(add_help=False)
    folder_args.add_argument("--dir", required=True, help="the staging folder (DDPACK_STAGE_DIR)")
    folder_args.add_argument("--job", required=True)
    folder_args.add_argument("--keep", type=int, required=True, help="DDPACK_STAGE_KEEP")
    folder_args.add_argument("--key", default="", type=staging_key)
    folder_args.add_argument("--size", type=int, default=0)
    verbs.add_parser("prepare", parents=[folder_args]).set_defaults(run=prepare)
    verbs.choices["prepare"].add_argument("--gpus", type=int, default=0, help="the GPUs Slurm promised the job on each node")
    verbs.choices["prepare"].add_argument("--need", type=int, default=0, help="bytes a node that lacks the copy needs free in --dir")
    for name, run in (("receive", receive), ("install", install)):
        sub = verbs.add_parser(name, parents=[folder_args])
        sub.add_argument("--incoming", required=True, type=incoming_name)
        sub.set_defaults(run=run)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return args.run(args)


def staging_key(text: str) -> str:
    if text and not KEY.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a staging key")
    return text


if __name__ == "__main__":  # on a node: `python3 -I -S -c TEXT VERB ...` runs as __main__ too
    sys.exit(main())
