"""enroot/ddpack_node.py on one node's shared /tmp, as two users: the victim's job stages, the attacker plants.

Each test runs the real helper as the unprivileged victim (root would pass every ownership check), with fake
`squeue` and `enroot` on its PATH standing in for Slurm's answer (a list of jobs, or a controller that failed)
and for the node's containers. The node's /tmp is a fresh sticky, world-writable folder, as /tmp is."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from testbed.env import ROOT
from testbed.users import User

NODE_PY = ROOT / "enroot" / "ddpack_node.py"
JOB_PY = ROOT / "enroot" / "ddpack_job.py"  # the batch host's verbs (lock, unlock, image-ok)
PYTHON = "/usr/bin/python3"  # the node's own python3, as the job helper runs it (not a venv of root's)
KEY = "0123456789abcdef01234567-89abcdef"
OTHER_KEYS = ("1" * 24 + "-" + "1" * 8, "2" * 24 + "-" + "2" * 8, "3" * 32)



@pytest.fixture
def node_tmp(node_tmp: Path) -> Path:
    """The shared node /tmp fixture, with a folder for the fake squeue and enroot beside it."""
    (node_tmp / "bin").mkdir()
    (node_tmp / "bin").chmod(0o755)  # whatever this process's umask
    return node_tmp


def fake_tools(node_tmp: Path, *, squeue: str, enroot_list: str = "") -> None:
    """squeue prints `squeue` (job ids) or, given "FAIL", fails as a controller that timed out does; enroot lists
    `enroot_list` and logs each removal."""
    bin_dir = node_tmp / "bin"
    if squeue == "FAIL":
        body = "echo 'squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation' >&2; exit 1"
    else:
        body = f"printf '%s\\n' {squeue}"
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n{body}\n")
    (bin_dir / "enroot").write_text(
        f'#!/bin/sh\ncase "$1" in list) printf "%s\\n" {enroot_list} ;; remove) echo "$3" >>"{bin_dir}/removed" ;; esac\n'
    )
    for tool in ("squeue", "enroot"):
        (bin_dir / tool).chmod(0o755)
    (bin_dir / "removed").touch()
    (bin_dir / "removed").chmod(0o666)


def run_as(user: User, node_tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    runs = user.runs()
    env = dict(runs.pop("env"))  # type: ignore[arg-type]
    env.update(PATH=f"{node_tmp / 'bin'}:/usr/bin:/bin", SLURMD_NODENAME="ddnode1")
    program = NODE_PY if args[0] in ("prepare", "receive", "install") else JOB_PY
    return subprocess.run([PYTHON, str(program), *args], env=env, capture_output=True, text=True, timeout=60, **runs)  # type: ignore[arg-type]


def prepare(
    user: User, node_tmp: Path, folder: Path, *more: str, job: str = "500", size: int = 4, keep: int = 2
) -> subprocess.CompletedProcess[str]:
    return run_as(
        user, node_tmp, "prepare", "--dir", str(folder), "--job", job, "--key", KEY, "--size", str(size), "--keep", str(keep), *more
    )


def plant(path: Path, owner: User, text: str = "evil", mode: int = 0o666) -> Path:
    path.write_text(text)
    os.chown(path, owner.uid, owner.gid)
    path.chmod(mode)
    return path


def own_folder(path: Path, user: User) -> Path:
    path.mkdir(mode=0o700)
    os.chown(path, user.uid, user.gid)
    return path


def test_a_staging_folder_another_user_made_first_is_refused_and_its_image_never_used(users, node_tmp) -> None:
    """The attacker makes the victim's staging folder first (mode 777) and plants an image under the job's key:
    the victim's node answers `refuse` in one line, so that start reads the shared file; nothing of the planted
    folder is used or changed."""
    alice, mallory = users
    fake_tools(node_tmp, squeue="500")
    folder = node_tmp / f"ddpack-images-{alice.uid}"
    folder.mkdir()
    os.chown(folder, mallory.uid, mallory.gid)
    folder.chmod(0o777)
    planted = plant(folder / f"{KEY}.sqsh", mallory, "evil")
    out = prepare(alice, node_tmp, folder)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refuse ddnode1 ") and out.stdout.count("\n") == 1, out.stdout
    assert f"belongs to uid {mallory.uid}, not to you" in out.stdout
    assert planted.read_text() == "evil" and sorted(p.name for p in folder.iterdir()) == [planted.name]


def test_a_staging_folder_planted_as_a_symlink_is_refused(users, node_tmp) -> None:
    alice, mallory = users
    fake_tools(node_tmp, squeue="500")
    theirs = own_folder(node_tmp / "mallory-images", mallory)
    folder = node_tmp / f"ddpack-images-{alice.uid}"
    subprocess.run(["ln", "-s", str(theirs), str(folder)], check=True, **mallory.runs())  # type: ignore[arg-type]
    out = prepare(alice, node_tmp, folder)
    assert out.stdout.startswith("refuse ddnode1 ") and "is a symbolic link" in out.stdout, out.stdout
    assert list(theirs.iterdir()) == []


def test_a_staging_folder_under_a_folder_another_user_owns_is_refused(users, node_tmp) -> None:
    """Whoever owns a folder above ours can rename ours away and put theirs in its place."""
    alice, mallory = users
    fake_tools(node_tmp, squeue="500")
    theirs = own_folder(node_tmp / "shared-scratch", mallory)
    theirs.chmod(0o777)
    out = prepare(alice, node_tmp, theirs / "stage")
    assert out.stdout.startswith("refuse ddnode1 ") and f"belongs to uid {mallory.uid}" in out.stdout, out.stdout


def test_a_new_staging_folder_is_made_private_and_only_the_users_own_whole_copy_is_trusted(users, node_tmp) -> None:
    alice, _ = users
    fake_tools(node_tmp, squeue="500")
    folder = node_tmp / f"ddpack-images-{alice.uid}"
    out = prepare(alice, node_tmp, folder)
    assert out.stdout == "lacks ddnode1\n", out.stderr
    info = folder.stat()
    assert (info.st_uid, info.st_mode & 0o777) == (alice.uid, 0o700)
    copy = plant(folder / f"{KEY}.sqsh", alice, "abcd", 0o644)
    assert prepare(alice, node_tmp, folder).stdout == "has ddnode1\n"
    assert prepare(alice, node_tmp, folder, size=5).stdout == "lacks ddnode1\n"  # not the image's size: half a copy
    copy.chmod(0o666)
    assert prepare(alice, node_tmp, folder).stdout == "lacks ddnode1\n"  # others could have written it
    copy.chmod(0o644)
    os.link(copy, node_tmp / "second-name")
    assert prepare(alice, node_tmp, folder).stdout == "lacks ddnode1\n"  # a second name elsewhere: not ours alone


def test_a_staging_folder_holding_other_files_is_refused_and_nothing_in_it_is_deleted(users, node_tmp) -> None:
    """DDPACK_STAGE_DIR pointed at a folder of images (/fsx/images: a teammate's, the job's own DDPACK_SQSH) or at
    a project, even one holding a name made to split into other names (`z train.py config.yaml q.sqsh`): refused,
    and its keep-N cleanup deletes nothing."""
    alice, _ = users
    fake_tools(node_tmp, squeue="500")
    images = own_folder(node_tmp / "images", alice)
    names = ["team.sqsh", "ddpack+abc.sqsh", "z train.py config.yaml q.sqsh", "train.py", "config.yaml", *(f"{k}.sqsh" for k in OTHER_KEYS)]
    for name in names:
        plant(images / name, alice, "x", 0o644)
    out = prepare(alice, node_tmp, images, keep=1)
    assert out.stdout.startswith("refuse ddnode1 DDPACK_STAGE_DIR=") and "which is not an image ddpack staged" in out.stdout, out.stdout
    assert sorted(p.name for p in images.iterdir()) == sorted(names)


def test_the_cleanup_keeps_what_a_live_job_leased_and_removes_nothing_when_squeue_fails(users, node_tmp) -> None:
    """Job 101 chose the oldest copy and is still running; jobs 102 and 103 staged newer ones. Keep-1 by job 103
    removes 102's copy but not 101's. When squeue fails, nothing at all is removed; once 101 is over, its copy
    goes too, with its lease and the half-received folder a failed sbcast of job 99 left."""
    alice, _ = users
    folder = node_tmp / f"ddpack-images-{alice.uid}"
    fake_tools(node_tmp, squeue="101")
    old, middle, new = OTHER_KEYS
    for job, key in (("101", old), ("102", middle)):  # each job leases the copy it chose
        assert run_as(alice, node_tmp, "prepare", "--dir", str(folder), "--job", job, "--key", key, "--size", "1", "--keep", "2").returncode == 0
    for age, key in enumerate((new, middle, old)):
        copy = plant(folder / f"{key}.sqsh", alice, "x", 0o600)
        os.utime(copy, (1_000_000 - age * 1000, 1_000_000 - age * 1000))
    leftover = own_folder(folder / ".incoming-99-0123456789abcdef", alice)
    plant(leftover / f"{KEY}.sqsh", alice, "half", 0o600)

    fake_tools(node_tmp, squeue="FAIL")
    out = run_as(alice, node_tmp, "prepare", "--dir", str(folder), "--job", "103", "--key", new, "--size", "1", "--keep", "1")
    assert out.stdout == "has ddnode1\n", out.stdout + out.stderr
    assert (
        "squeue failed (exit 1: squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation); removing nothing"
        in out.stderr
    )
    assert {p.name for p in folder.glob("*.sqsh")} == {f"{k}.sqsh" for k in OTHER_KEYS} and leftover.exists()

    fake_tools(node_tmp, squeue="101 103")
    out = run_as(alice, node_tmp, "prepare", "--dir", str(folder), "--job", "103", "--key", new, "--size", "1", "--keep", "1")
    assert {p.name for p in folder.glob("*.sqsh")} == {f"{old}.sqsh", f"{new}.sqsh"}, out.stderr
    assert leftover.exists() is False and "(no live job of yours uses it)" in out.stderr

    fake_tools(node_tmp, squeue="103")
    run_as(alice, node_tmp, "prepare", "--dir", str(folder), "--job", "103", "--key", new, "--size", "1", "--keep", "1")
    assert {p.name for p in folder.glob("*.sqsh")} == {f"{new}.sqsh"}
    assert sorted(p.name for p in (folder / ".leases").iterdir()) == ["103"]


def test_containers_of_jobs_that_are_over_go_and_a_failed_squeue_removes_none(users, node_tmp) -> None:
    """A controller timeout must not read as "every other job is over": that would remove the user's running
    jobs' containers."""
    alice, _ = users
    containers = "pyxis_ddpack-5 pyxis_ddpack-6 pyxis_7_ddpack-7 pyxis_ddpack-500 pyxis_mine other"
    fake_tools(node_tmp, squeue="FAIL", enroot_list=containers)
    assert run_as(alice, node_tmp, "prepare", "--dir", str(node_tmp / "s"), "--job", "500", "--keep", "2").returncode == 0
    assert (node_tmp / "bin" / "removed").read_text() == ""
    fake_tools(node_tmp, squeue="6 500", enroot_list=containers)
    out = run_as(alice, node_tmp, "prepare", "--dir", str(node_tmp / "s"), "--job", "500", "--keep", "2")
    assert (node_tmp / "bin" / "removed").read_text().split() == ["pyxis_ddpack-5", "pyxis_7_ddpack-7"], out.stderr
    assert "removed container pyxis_ddpack-5 on ddnode1 (job 5 is over)" in out.stderr


INCOMING = ".incoming-500-00112233445566778899aabb"


def receiving(alice: User, node_tmp: Path) -> tuple[Path, tuple[str, ...]]:
    """Job 500's staging folder with a fresh receiving folder INCOMING made by `receive`; (folder, staging args)."""
    fake_tools(node_tmp, squeue="500")
    folder = node_tmp / f"ddpack-images-{alice.uid}"
    stage = ("--dir", str(folder), "--job", "500", "--keep", "2", "--key", KEY, "--size", "4")
    assert run_as(alice, node_tmp, "receive", *stage, "--incoming", INCOMING).returncode == 0
    return folder, stage


def test_what_sbcast_wrote_is_installed_only_when_it_is_the_users_whole_file(users, node_tmp) -> None:
    """receive makes a fresh private folder for sbcast (a name that exists already is refused, never reused);
    install renames the copy into place only when it is a plain file of the user's of the source's size."""
    alice, _ = users
    folder, stage = receiving(alice, node_tmp)
    assert (folder / INCOMING).stat().st_mode & 0o777 == 0o700
    assert run_as(alice, node_tmp, "receive", *stage, "--incoming", INCOMING).returncode == 1  # never reused
    target = plant(node_tmp / "victims-checkpoint.pt", alice, "weights", 0o600)
    os.symlink(target, folder / INCOMING / f"{KEY}.sqsh")  # were a link there, install must not follow it
    out = run_as(alice, node_tmp, "install", *stage, "--incoming", INCOMING)
    assert out.returncode == 1 and not (folder / f"{KEY}.sqsh").exists() and target.read_text() == "weights", out.stdout
    assert out.stdout == f"failed ddnode1 sbcast left no file of yours at {folder / INCOMING / KEY}.sqsh\n"  # the node named
    assert not (folder / INCOMING).exists()
    assert run_as(alice, node_tmp, "receive", *stage, "--incoming", INCOMING).returncode == 0
    plant(folder / INCOMING / f"{KEY}.sqsh", alice, "abcd", 0o600)
    out = run_as(alice, node_tmp, "install", *stage, "--incoming", INCOMING)
    assert out.returncode == 0 and (folder / f"{KEY}.sqsh").read_text() == "abcd", out.stdout + out.stderr
    assert out.stdout == "installed ddnode1\n"


def test_a_node_without_room_for_the_copy_and_its_unpack_refuses_before_anything_is_copied(users, node_tmp) -> None:
    """prepare --need BYTES: a node that lacks the copy and has less free space in its staging folder (the copy, then
    what enroot unpacks) refuses, naming the figures, so it reads the shared file alone; one that holds its copy
    already needs no room for another."""
    alice, _ = users
    fake_tools(node_tmp, squeue="500")
    folder = node_tmp / f"ddpack-images-{alice.uid}"
    free = shutil.disk_usage(node_tmp).free
    assert prepare(alice, node_tmp, folder, "--need", str(free // 2)).stdout == "lacks ddnode1\n"
    short = prepare(alice, node_tmp, folder, "--need", str(free * 4))
    assert short.returncode == 0 and short.stdout.startswith(f"refuse ddnode1 has too little free space in {folder}: "), short.stdout
    assert short.stdout.endswith(f" MiB free, {free * 4 // 1048576} MiB needed (the image and its unpacked size)\n")
    plant(folder / f"{KEY}.sqsh", alice, "abcd", 0o600)
    assert prepare(alice, node_tmp, folder, "--need", str(free * 4)).stdout == "has ddnode1\n"


def test_a_run_folder_in_use_by_a_live_job_is_refused_naming_the_holder(users, node_tmp) -> None:
    alice, _ = users
    run_dir = own_folder(node_tmp / "run", alice)
    fake_tools(node_tmp, squeue="")
    assert run_as(alice, node_tmp, "lock", str(run_dir), "--job", "10").returncode == 0
    assert run_as(alice, node_tmp, "lock", str(run_dir), "--job", "10").returncode == 0  # its requeue continues it
    (node_tmp / "bin" / "squeue").write_text("#!/bin/sh\necho RUNNING\n")
    out = run_as(alice, node_tmp, "lock", str(run_dir), "--job", "11")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"ddpack: error: the run folder {run_dir} is in use by job 10 (RUNNING, {alice.name}); ")
    fake_tools(node_tmp, squeue="FAIL")
    out = run_as(alice, node_tmp, "lock", str(run_dir), "--job", "11")
    assert out.returncode == 2 and "squeue cannot say whether it is over" in out.stderr
    assert run_as(alice, node_tmp, "unlock", str(run_dir), "--job", "11").returncode == 0  # not its lock: stays
    (node_tmp / "bin" / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1\n")
    assert run_as(alice, node_tmp, "lock", str(run_dir), "--job", "11").returncode == 0  # job 10 is over
    assert (run_dir / ".ddpack-lock").read_text().split()[0] == "11"
    assert run_as(alice, node_tmp, "unlock", str(run_dir), "--job", "11").returncode == 0
    assert not (run_dir / ".ddpack-lock").exists()


@pytest.mark.parametrize(("fstype", "refused"), [("lustre", True), ("nfs4", True), ("fuse.s3fs", True), ("ext4", False), ("xfs", False)])
def test_a_staging_folder_on_a_shared_filesystem_is_refused(tmp_path, fstype: str, refused: bool) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddpack_node", NODE_PY)
    node = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(node)  # type: ignore[union-attr]
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"22 1 0:21 / / rw - ext4 /dev/vda rw\n40 22 0:40 / {tmp_path} rw - {fstype} fs@tcp:/x rw\n")
    assert node.filesystem_type(tmp_path / "stage", str(mountinfo)) == fstype
    if refused:
        with pytest.raises(node.Refused, match=f"on a {fstype} filesystem that other nodes share"):
            node.private_folder(tmp_path / "stage", "DDPACK_STAGE_DIR", str(mountinfo))
    else:
        assert node.private_folder(tmp_path / "stage", "DDPACK_STAGE_DIR", str(mountinfo)).is_dir()


def test_a_run_folder_another_user_made_first_is_refused_and_nothing_in_it_is_written(users, node_tmp) -> None:
    """runs/<name>-<job id> is guessable: the attacker makes it first (open to all, the start marker a link to the
    victim's file). The victim's job refuses it in one line before writing anything there."""
    alice, mallory = users
    fake_tools(node_tmp, squeue="")
    victims = plant(node_tmp / "victims-notes.txt", alice, "mine", 0o600)
    theirs = node_tmp / "stage-86"
    theirs.mkdir()
    os.chown(theirs, mallory.uid, mallory.gid)
    theirs.chmod(0o777)
    (theirs / ".ddpack-this-start").symlink_to(victims)
    out = run_as(alice, node_tmp, "lock", str(theirs), "--job", "86")
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"DDPACK_RUN_DIR={theirs}: belongs to uid {mallory.uid}, not to you" in out.stderr
    assert victims.read_text() == "mine" and not (theirs / ".ddpack-lock").exists()
    mine = own_folder(node_tmp / "mine", alice)
    mine.chmod(0o775)  # a group could swap files in it
    assert "is writable by other users (mode 775)" in run_as(alice, node_tmp, "lock", str(mine), "--job", "86").stderr


def test_an_image_other_users_could_replace_is_refused_before_the_job_imports_it(users, node_tmp) -> None:
    alice, mallory = users
    fake_tools(node_tmp, squeue="")
    images = own_folder(node_tmp / "images", alice)
    images.chmod(0o755)
    image = plant(images / "x.sqsh", alice, "hsqs", 0o644)
    assert run_as(alice, node_tmp, "image-ok", str(image)).returncode == 0
    image.chmod(0o664)
    out = run_as(alice, node_tmp, "image-ok", str(image))
    assert out.returncode == 2 and "is writable by other users (mode 664)" in out.stderr, out.stderr
    image.chmod(0o644)
    images.chmod(0o777)  # anyone may rename the image away and put theirs in its place
    out = run_as(alice, node_tmp, "image-ok", str(image))
    assert out.returncode == 2 and "is writable by other users and not sticky" in out.stderr, out.stderr
    teams = node_tmp / "team-images"  # another user's folder that only they can write: the user chose to trust them
    teams.mkdir()
    teams.chmod(0o755)
    os.chown(teams, mallory.uid, mallory.gid)
    assert run_as(alice, node_tmp, "image-ok", str(plant(teams / "y.sqsh", mallory, "hsqs", 0o644))).returncode == 0


def test_a_copy_of_a_team_writable_image_is_made_private_and_staged(users, node_tmp) -> None:
    """sbcast copies the source's mode: an image made under umask 002 arrives group-writable, in the job's own 0700
    folder. It is made 0600 and staged, not refused on every start."""
    alice, _ = users
    folder, stage = receiving(alice, node_tmp)
    plant(folder / INCOMING / f"{KEY}.sqsh", alice, "abcd", 0o664)
    out = run_as(alice, node_tmp, "install", *stage, "--incoming", INCOMING)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (folder / f"{KEY}.sqsh").stat().st_mode & 0o777 == 0o600
    assert prepare(alice, node_tmp, folder).stdout == "has ddnode1\n"


def test_the_unpacked_size_comes_from_make_sqshs_record_without_opening_the_shared_file(tmp_path: Path) -> None:
    """A start whose nodes all hold a copy must not open the shared file at all (tests/test_pyxis.py counts its readers):
    the free-space need is told by make sqsh's record while it describes the file, and without one it is the bound for
    a compressed image; the file itself is never read."""
    import json

    from ddpack.job_side import module

    staging = module("ddpack_staging")
    sqsh = tmp_path / "x.sqsh"
    sqsh.write_bytes(b"hsqs" + bytes(28) + bytes(1000))
    assert staging.unpacked_bytes(str(sqsh), 1032) == 1032 * staging.UNPACK_FACTOR  # no record: the compressed bound
    info = sqsh.stat()
    record = {"image_id": "sha256:" + "a" * 64, "squash_options": "-comp lzo -noI -noD -noF -noX", "size": info.st_size, "mtime_ns": info.st_mtime_ns}
    (tmp_path / "x.sqsh.ddpack.json").write_text(json.dumps(record))
    assert staging.unpacked_bytes(str(sqsh), 1032) == 1032
    sqsh.write_bytes(b"hsqs" + bytes(30))  # changed since the record: the record no longer describes it
    assert staging.unpacked_bytes(str(sqsh), 34) == 34 * staging.UNPACK_FACTOR


@pytest.mark.parametrize(
    ("wanted", "version", "given", "said"),
    [
        (8, "", 8, ""),  # up to 8: every Slurm takes it, and sbcast is not asked
        (16, "slurm 23.11.4", 16, ""),
        (64, "slurm 24.05.1", 64, ""),
        (16, "slurm-wlm 22.05.8", 8, "DDPACK_STAGE_FANOUT=16: Slurm 22.05 takes a fan-out of 8 at most, for sbcast's first hop only"),
        (16, "", 8, "DDPACK_STAGE_FANOUT=16: this sbcast (no version given) takes a fan-out of 8 at most"),
    ],
)
def test_the_fan_out_above_8_is_sbcasts_on_slurm_23_11_and_later_and_capped_at_8_with_one_line_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wanted: int, version: str, given: int, said: str
) -> None:
    """Slurm 22.05's sbcast takes --fanout 8 at most and only for its first hop; 23.11 and later take up to 64 on every
    hop: the job asks sbcast's version only for a fan-out above 8, and caps it at 8 below 23.11, saying so."""
    from ddpack.job_side import module

    staging = module("ddpack_staging")
    sbcast = tmp_path / "sbcast"
    sbcast.write_text(f'#!/bin/sh\necho "$*" >> "{tmp_path}/asked"\n' + (f'echo "{version}"\n' if version else ""))
    sbcast.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    fanout, line = staging.sbcast_fanout(wanted)
    assert fanout == given and line.startswith(said) and bool(line) == bool(said)
    assert (tmp_path / "asked").exists() == (wanted > 8)
