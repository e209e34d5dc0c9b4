"""Private temporary names and ddpack's own registry setting, as another user of a shared machine would attack them.

A shared HyperPod-style node has one /tmp for every user, and /fsx/images may be writable by many (docs/security.md).
Each test plants what an attacker could at every name the code used to use, then runs the real code (as the
unprivileged victim where ownership matters: root would pass every check) and shows the attack harmless:
- train/forensics.py: a rank's DataLoader workers' stacks folder (was /tmp/ddpack-stacks-<rank pid>, used
  whoever made it: a planted link truncated a checkpoint, a planted name had SIGUSR2 sent to any pid, a foreign
  folder crashed the hang's evidence and a successful run's end);
- ddpack/images/sqsh.py: `make sqsh`, run as root, wrote `.X.sqsh.tmp-<pid>` and the record's temp under predictable
  names and resolved a link at the output itself;
- ddpack/images/ecr.py: the common variable REGISTRY silently redirected the ECR token; now only DDPACK_REGISTRY does,
  and a non-ECR host is named on stderr before the token is sent or written.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpack.errors import HostError
from ddpack.images import credentials, push, sqsh
from ddpack.images.ecr import REGISTRY_SETTING, RegistryCredential, registry_override_from
from entrypoint.atomic_file import write_atomically
from testbed.env import ROOT
from testbed.users import User
from train import forensics

PYTHON = "/usr/bin/python3"  # a node's own python3, which any user can run (root's venv may live under /root)
ATTACK_PIDS = 400  # names planted for the next pids: the workers', on a machine where other processes start too

# A rank as the victim runs it: the real watchdog (a one-rank job on a store in memory), and two workers that
# start the way DataLoader workers do (forked or spawned, ddpack's worker_init_fn first). "hang": the workers stall
# in their dataset, the watchdog ends the rank with its evidence; "ok": they finish and the run ends normally.
VICTIM_RANK = f"""
import multiprocessing, os, sys, time
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from train.forensics import register_worker_stack_dump
from train.watchdog import Progress, Watchdog


class Store:  # the calls the watchdog makes of its GuardedStore
    gone = False
    deadline_s = 2.0

    def __init__(self):
        self.data = {{}}

    def close(self):
        self.gone = True

    def set(self, key, value):
        self.data[key] = value

    def get(self, key):
        return self.data.get(key)


def worker(worker_id, ready, hang):
    register_worker_stack_dump(worker_id)  # a DataLoader worker's worker_init_fn
    ready.set()
    if hang:
        time.sleep(3600)  # stuck in the dataset


if __name__ == "__main__":
    mode, start_method, forensics_dir = sys.argv[1:4]
    print(os.getpid(), flush=True)
    sys.stdin.readline()  # the attacker plants now: it knows this rank's pid and the next ones
    progress = Progress()
    timeout = 1.0 if mode == "hang" else 120.0
    dog = Watchdog(progress, rank=0, world_size=1, host="victim", timeout_s=timeout, forensics_dir=Path(forensics_dir), log=print, store=Store())
    dog.start()
    ctx = multiprocessing.get_context(start_method)
    readies = [ctx.Event() for _ in range(2)]
    workers = [ctx.Process(target=worker, args=(i, readies[i], mode == "hang"), daemon=True) for i in range(2)]
    for w in workers:
        w.start()
    for ready in readies:
        assert ready.wait(60), "a worker did not start"
    progress.step_done(1)
    progress.enter("data")
    for w in workers:
        w.join()  # a hang: the watchdog ends this process with 124 from its own thread
    dog.stop()
    print("done", flush=True)
"""



def owned(path: Path, user: User, mode: int) -> Path:
    os.lchown(path, user.uid, user.gid)
    if not path.is_symlink():
        path.chmod(mode)
    return path


def next_pids(count: int) -> list[int]:
    """The pids the kernel hands out next (it counts up from the last one, wrapping at pid_max to 300)."""
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return [300 + (pid - 300) % (pid_max - 300) for pid in range(last + 1, last + 1 + count)]


def plant_stacks_folder(node_tmp: Path, rank_pid: int, mallory: User, shape: str, checkpoint: Path, bystander: int) -> Path:
    """What the old code read and wrote at /tmp/ddpack-stacks-<rank pid>: a folder of the attacker's (or the
    attacker's link to one), holding links from every worker name the next pids give to the victim's checkpoint,
    and a worker name for a pid that is not a worker (the watchdog sent it SIGUSR2, which ends a process; the
    name sorts first, before the names of the rank's own threads' ids, whose SIGUSR2 ended the rank itself)."""
    theirs = node_tmp / "mallory-stacks"
    theirs.mkdir()
    for pid in next_pids(ATTACK_PIDS):
        for worker_id in (0, 1):
            link = theirs / f"worker-{worker_id}-pid{pid}.txt"
            link.symlink_to(checkpoint)
            owned(link, mallory, 0)
    named = theirs / f"worker--pid{bystander}.txt"
    named.write_text("")
    owned(named, mallory, 0o644)
    owned(theirs, mallory, 0o755)
    name = node_tmp / f"{forensics.STACKS_PREFIX}{rank_pid}"
    if shape == "folder":
        theirs.rename(name)
        return name
    name.symlink_to(theirs)
    owned(name, mallory, 0)
    return theirs


def run_victim_rank(alice: User, node_tmp: Path, mode: str, start_method: str, plant) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The victim's rank, its TMPDIR the node's /tmp; `plant(rank_pid)` runs once its pid is known, before its
    watchdog starts or any worker exists."""
    script = node_tmp / "victim_rank.py"
    script.write_text(VICTIM_RANK)
    script.chmod(0o644)
    run_dir = node_tmp / "alice-run"
    run_dir.mkdir()
    owned(run_dir, alice, 0o700)
    runs = alice.runs()
    env = {k: v for k, v in runs.pop("env").items() if not k.startswith("DDPACK_")}  # type: ignore[attr-defined]
    env.update(TMPDIR=str(node_tmp), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [PYTHON, str(script), mode, start_method, str(run_dir / "forensics")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=str(node_tmp),
        env=env,
        start_new_session=True,  # its workers too can be ended at once, should it hang
        **runs,  # type: ignore[arg-type]
    )
    assert proc.stdout is not None and proc.stdin is not None
    plant(int(proc.stdout.readline()))
    try:
        out, err = proc.communicate("go\n", timeout=60)
    except subprocess.TimeoutExpired:  # the old code: the watchdog's thread died on the foreign folder
        os.killpg(proc.pid, signal.SIGKILL)  # the workers hold its pipes open
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), run_dir / "forensics"


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
@pytest.mark.parametrize("shape", ["folder", "link"])
@pytest.mark.parametrize("mode", ["hang", "ok"])
def test_a_planted_stacks_folder_never_touches_the_victims_files_or_processes_nor_ends_its_run(
    users, node_tmp: Path, mode: str, shape: str, start_method: str
) -> None:
    """The attacker owns /tmp/ddpack-stacks-<the victim rank's pid> (a folder, or a link to one) full of links to
    the victim's checkpoint and a name for another of the victim's processes. The victim's hung rank still ends
    with 124 and its workers' stacks; its successful run still ends 0; the checkpoint keeps its bytes, the other
    process lives, and the rank leaves no folder of its own behind."""
    alice, mallory = users
    home = node_tmp / "alice-home"
    home.mkdir()
    owned(home, alice, 0o755)
    checkpoint = home / "snapshot-0000000100.pt"
    checkpoint.write_bytes(b"weights" * 100)
    owned(checkpoint, alice, 0o644)
    bystander = subprocess.Popen(["sleep", "300"], **alice.runs())  # type: ignore[arg-type]  # not a worker of the rank
    try:
        planted: list[Path] = []
        out, forensics_dir = run_victim_rank(
            alice,
            node_tmp,
            mode,
            start_method,
            lambda pid: planted.append(plant_stacks_folder(node_tmp, pid, mallory, shape, checkpoint, bystander.pid)),
        )
        assert checkpoint.read_bytes() == b"weights" * 100, "a planted link was written through"
        assert bystander.poll() is None, f"the watchdog signalled a pid that is not its worker (it ended {bystander.returncode})"
        # (a spawned rank ended by os._exit leaves multiprocessing's note on its semaphores: not ddpack's)
        assert "Traceback" not in out.stderr and [line for line in out.stderr.splitlines() if "ddpack" in line] == [], out.stderr
        if mode == "hang":
            assert out.returncode == 124, out.stdout + out.stderr
            stacks = (forensics_dir / "rank-0.txt").read_text()
            assert stacks.count("--- DataLoader worker-") == 2 and "in worker" in stacks, stacks
            assert (forensics_dir / "summary.json").exists()
        else:
            assert (out.returncode, out.stdout.splitlines()[-1:]) == (0, ["done"]), out.stdout + out.stderr
        leftovers = [p.name for p in node_tmp.iterdir() if p.name.startswith(forensics.STACKS_PREFIX) and p.lstat().st_uid == alice.uid]
        assert leftovers == []
        assert len(list(planted[0].iterdir())) == 2 * ATTACK_PIDS + 1  # nothing of the attacker's was used or changed
    finally:
        bystander.kill()
        bystander.wait()


def test_a_worker_dumps_only_into_a_private_folder_of_its_own_user(users, tmp_path: Path, monkeypatch) -> None:
    """STACKS_ENV is inherited: a name it gives that is not a private folder of this user is never written in."""
    _, mallory = users
    tmp_path.chmod(0o755)  # the victim's own test folder; the attacker's folder inside it is theirs alone
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    owned(theirs, mallory, 0o700)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(ours)
    for folder in (theirs, shared, link, tmp_path / "missing"):
        monkeypatch.setenv(forensics.STACKS_ENV, str(folder))
        forensics.register_worker_stack_dump(0)
    assert [list(f.iterdir()) for f in (theirs, shared, ours)] == [[], [], []]


def test_only_this_ranks_own_children_named_in_its_folder_are_signalled_or_killed(tmp_path: Path, monkeypatch) -> None:
    """A name in the rank's folder is not enough to signal a pid: the real worker (a child) answers with its stack
    and is killed; a process that is not a child (here one the rank's own user started) is left alone."""
    monkeypatch.delenv(forensics.STACKS_ENV, raising=False)
    folder = forensics.prepare_worker_stacks()
    assert folder is not None and not folder.exists()  # its first worker makes it
    code = "import sys, time; from train.forensics import register_worker_stack_dump; register_worker_stack_dump(3); print(1, flush=True); time.sleep(300)"
    worker = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    stranger = subprocess.run(["sh", "-c", "sleep 300 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True)
    stranger_pid = int(stranger.stdout)
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "1\n"
        assert (folder.stat().st_mode & 0o777, folder.stat().st_uid) == (0o700, os.geteuid())
        (folder / f"worker-9-pid{stranger_pid}.txt").write_text("")
        text, pids = forensics._worker_stacks(wait_s=1.0)
        assert pids == [worker.pid]
        assert f"--- DataLoader worker-3-pid{worker.pid} ---" in text and "line" in text.split(f"worker-3-pid{worker.pid}")[1]
        forensics.kill_workers([worker.pid, stranger_pid])
        assert worker.wait(timeout=10) == -signal.SIGKILL
        os.kill(stranger_pid, 0)  # still there
        assert not folder.exists()
    finally:
        worker.kill()
        os.kill(stranger_pid, signal.SIGKILL)
        forensics.remove_stacks_dir()


def test_a_cleanup_that_fails_is_one_warning_line_never_an_exception(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(forensics, "_warned", False)
    monkeypatch.delenv(forensics.STACKS_ENV, raising=False)
    folder = forensics.prepare_worker_stacks()
    assert folder is not None and os.environ[forensics.STACKS_ENV] == str(folder)
    folder.mkdir(mode=0o700)  # as its first worker does
    (folder / "odd").mkdir()  # not ours to expect: unlink fails on it
    forensics.remove_stacks_dir()
    forensics.remove_stacks_dir()  # nothing left to do: silent
    again = forensics.prepare_worker_stacks()
    assert again is not None and again != folder
    again.mkdir(mode=0o700)
    (again / "odd").mkdir()
    forensics.remove_stacks_dir()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ddpack: warning: could not remove {folder} "), err
    assert forensics.STACKS_ENV not in os.environ
    for leftover in (folder, again):
        (leftover / "odd").rmdir()
        leftover.rmdir()


def test_a_folder_of_another_user_even_at_the_ranks_own_name_is_neither_read_nor_removed(users, monkeypatch, capsys) -> None:
    """The rank's name is random and secret; were another user to make a folder there anyway, the rank's workers
    would not write in it (test above), and the rank neither reads, signals nor removes anything in it."""
    _, mallory = users
    monkeypatch.setattr(forensics, "_warned", False)
    monkeypatch.delenv(forensics.STACKS_ENV, raising=False)
    folder = forensics.prepare_worker_stacks()
    assert folder is not None
    folder.mkdir(mode=0o700)
    planted = folder / f"worker-0-pid{os.getpid()}.txt"
    planted.write_text("theirs")
    owned(planted, mallory, 0o644)
    owned(folder, mallory, 0o700)
    try:
        assert forensics._worker_stacks(wait_s=0) == ("", [])
        assert planted.read_text() == "theirs"
        forensics.remove_stacks_dir()
        assert planted.read_text() == "theirs"
        err = capsys.readouterr().err
        assert err == f"ddpack: warning: could not remove {folder} (owned by uid {mallory.uid}, left as it is); training is unaffected\n"
    finally:
        planted.unlink()
        folder.rmdir()


def test_evidence_files_never_go_through_a_planted_temp_name(users, tmp_path: Path) -> None:
    """The evidence writer (rank-R.txt, summary.json, the NCCL trace: entrypoint/atomic_file.py) used `.NAME.tmp-<pid>` in the run folder."""
    _, mallory = users
    target = tmp_path / "victims-file"
    target.write_text("precious")
    folder = tmp_path / "forensics"
    folder.mkdir()
    pids = range(os.getpid() - 5, os.getpid() + 5)  # this process's, and its neighbours'
    for pid in pids:
        for name in ("rank-0.txt", "summary.json"):
            link = folder / f".{name}.tmp-{pid}"
            link.symlink_to(target)
            owned(link, mallory, 0)
    assert write_atomically(folder / "rank-0.txt", "stacks\n")
    assert write_atomically(folder / "summary.json", "{}\n", exclusive=True)
    assert not write_atomically(folder / "summary.json", "{}\n", exclusive=True)
    assert target.read_text() == "precious"
    assert (folder / "rank-0.txt").read_text() == "stacks\n" and not (folder / "rank-0.txt").is_symlink()
    assert len(list(folder.iterdir())) == 2 + 2 * len(pids)  # ours, and the planted links, untouched


# ---------------------------------------------------------------- make sqsh, as root, into a shared folder


class FakeImages:
    def get(self, image: str) -> object:
        return type("Image", (), {"attrs": {"Id": "sha256:" + "ab" * 32, "Config": {}, "GraphDriver": {"Name": "vfs"}}})()


@pytest.fixture
def fake_engine(monkeypatch) -> list[Path]:
    """The engine and the converter stood in for: what the converter writes goes to the temp name convert
    gives it, opened the way mksquashfs opens its output (following a link there)."""
    written: list[Path] = []
    monkeypatch.setattr(sqsh, "docker_client", lambda: type("Client", (), {"images": FakeImages()})())
    monkeypatch.setattr(sqsh, "validate_squashfs", lambda path: ["usr/local/bin/entrypoint"])

    def converter(client, image, config, options, tmp_out: Path, workspace: Path) -> None:
        written.append(tmp_out)
        with open(tmp_out, "wb") as handle:
            handle.write(b"hsqs" + b"\0" * 60)
        if image.startswith("fail"):
            raise HostError("mksquashfs failed (exit 1); its output above says why")

    monkeypatch.setitem(sqsh.RUNNERS, "mksquashfs", converter)
    return written


@pytest.mark.parametrize("at", ["temp-names", "output-too"])
@pytest.mark.parametrize("image", ["ddpack:1", "fail:1"])
def test_make_sqsh_as_root_never_writes_through_a_link_planted_in_a_shared_output_folder(
    users, node_tmp: Path, fake_engine: list[Path], at: str, image: str
) -> None:
    """The attacker plants links to a root-owned file at the old temp names (`.x.sqsh.tmp-<pid>`,
    `.x.sqsh.ddpack.json.tmp-<pid>` for pids around the converter's) and, with `output-too`, at the output and its
    record: root's file keeps its bytes; the output and record are new regular files (a failed conversion leaves
    nothing of ours behind)."""
    _, mallory = users
    precious = node_tmp / "root-only"
    precious.mkdir(mode=0o700)
    target = precious / "shadow"
    target.write_text("root:precious\n")
    images = node_tmp / "images"
    images.mkdir()
    images.chmod(0o1777)
    names = [f".x.sqsh.tmp-{pid}" for pid in range(os.getpid() - 50, os.getpid() + 50)]
    names += [f".x.sqsh.ddpack.json.tmp-{pid}" for pid in range(os.getpid() - 50, os.getpid() + 50)]
    if at == "output-too":
        names += ["x.sqsh", "x.sqsh.ddpack.json"]
    for name in names:
        (images / name).symlink_to(target)
        owned(images / name, mallory, 0)
    if image.startswith("fail"):
        with pytest.raises(HostError, match="mksquashfs failed"):
            sqsh.convert(image, images / "x.sqsh", "mksquashfs")
    else:
        assert sqsh.convert(image, images / "x.sqsh", "mksquashfs") == images / "x.sqsh"
    assert target.read_text() == "root:precious\n"
    assert fake_engine and fake_engine[0].parent.parent == images and fake_engine[0].parent.name.startswith(".x.sqsh.")
    ours = sorted(p.name for p in images.iterdir() if p.lstat().st_uid == os.geteuid())
    if image.startswith("fail"):
        assert ours == []
    else:
        assert ours == ["x.sqsh", "x.sqsh.ddpack.json"]
        assert (images / "x.sqsh").read_bytes().startswith(b"hsqs") and not (images / "x.sqsh").is_symlink()
        assert json.loads((images / "x.sqsh.ddpack.json").read_text())["image"] == "ddpack:1"
        assert (images / "x.sqsh.ddpack.json").stat().st_mode & 0o777 == 0o644  # users' jobs read it
        assert not (images / "x.sqsh").stat().st_mode & 0o022  # whatever the converter's umask: the job refuses one others can write


def test_a_planted_squashfs_and_matching_record_are_not_taken_for_this_users(users, node_tmp: Path, fake_engine: list[Path]) -> None:
    """An attacker who can write the output folder plants their squashfs and a record that matches it: `make sqsh`
    converts (and replaces both) instead of saying the output already holds the image."""
    _, mallory = users
    images = node_tmp / "images"
    images.mkdir()
    images.chmod(0o1777)
    output = images / "x.sqsh"
    output.write_bytes(b"evil image")
    options, _ = sqsh.squash_options(sqsh.DEFAULT_SQUASH_OPTIONS)
    image_id = FakeImages().get("ddpack:1").attrs["Id"]  # type: ignore[attr-defined]
    sqsh.write_record(output, "ddpack:1", image_id, options)
    assert sqsh.holds(output, image_id, options)  # as root's own files, they would be trusted
    for path in (output, sqsh.record_path(output)):
        owned(path, mallory, 0o644)
    assert not sqsh.holds(output, image_id, options)
    sqsh.convert("ddpack:1", output, "mksquashfs")
    assert output.read_bytes().startswith(b"hsqs") and output.stat().st_uid == os.geteuid()


def test_one_yours_alone_check_for_host_and_job(users, node_tmp: Path) -> None:
    """ddpack's one "my own file" check (enroot/ddpack_node.py, which the host loads): each way a file or folder in a
    shared folder can be another user's to change is one reason, and the host's door to it is that same function."""
    from ddpack.job_side import node_helper
    from ddpack.private_files import not_yours_alone

    _, mallory = users
    check = node_helper().not_yours_alone
    mine = node_tmp / "mine"
    mine.write_text("x")
    mine.chmod(0o644)
    folder = node_tmp / "folder"
    folder.mkdir(mode=0o755)
    (node_tmp / "link").symlink_to(mine)
    os.link(mine, node_tmp / "second-name")
    (node_tmp / "theirs").write_text("x")
    theirs = owned(node_tmp / "theirs", mallory, 0o644)
    group = node_tmp / "group"
    group.write_text("x")
    group.chmod(0o664)
    assert check(folder, "folder") is None
    assert check(mine) == "has 2 names (hard links): a write through another one would change it"
    (node_tmp / "second-name").unlink()
    assert check(mine) is None and not_yours_alone(mine) is None
    assert check(node_tmp / "link") == "is a symbolic link (another user may have planted it)"
    assert check(theirs) == f"belongs to uid {mallory.uid}, not to you (uid {os.geteuid()})"
    assert check(group) == "is writable by other users (mode 664)"
    assert check(folder) == "is not a plain file" and check(mine, "folder") == "is not a folder"
    assert check(node_tmp / "missing") == "does not exist"
    assert not_yours_alone(theirs) == check(theirs)


# ---------------------------------------------------------------- the registry the ECR token goes to

ACCOUNT = "123456789012"  # moto's
EVIL = "evil.example:5000"


@pytest.fixture
def aws(monkeypatch, tmp_path: Path) -> Iterator[None]:
    """boto3 against moto in this process; no AWS configuration of the machine's."""
    moto = pytest.importorskip("moto")
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "ENROOT_CONFIG_PATH": str(tmp_path / "enroot"),
    }.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_ECR", "AWS_ENDPOINT_URL_STS", REGISTRY_SETTING):
        monkeypatch.delenv(key, raising=False)
    with moto.mock_aws():
        yield


class Events:
    """stderr's lines and what was sent or written, in the order they happened."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    def write(self, text: str) -> int:
        if text.strip():
            self.log.append(("stderr", text.strip()))
        return len(text)

    def flush(self) -> None:
        pass


def warning_for(host: str) -> str:
    return f"ddpack: warning: sending the ECR token for account {ACCOUNT} to {host}, which is not an ECR registry (DDPACK_REGISTRY)"


def test_REGISTRY_is_not_ddpacks_setting() -> None:
    assert registry_override_from({"REGISTRY": EVIL}) is None
    assert registry_override_from({"REGISTRY": EVIL, REGISTRY_SETTING: "localhost:5000"}) == "localhost:5000"
    assert registry_override_from({REGISTRY_SETTING: ""}) is None


def test_with_REGISTRY_set_the_token_goes_only_to_the_ECR_registry(aws, monkeypatch, tmp_path: Path, capsys) -> None:
    """REGISTRY=evil in the environment of `make enroot-credentials` and `make push`: neither names evil."""
    monkeypatch.setenv("REGISTRY", EVIL)
    assert credentials.main(["--literal"]) == 0
    line = (tmp_path / "enroot" / ".credentials").read_text().splitlines()[-1]
    assert line.startswith(f"machine {ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com login AWS password ") and "evil" not in line
    asked: list[str | None] = []

    def push_image(*args, registry_override=None, **kwargs) -> push.PushResult:
        asked.append(registry_override)
        return push.PushResult(f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com/r:t", "sha256:" + "0" * 64, changed=True)

    monkeypatch.setattr(push, "push_image", push_image)
    assert push.main(["--image", "ddpack:1", "--repository", "r", "--tag", "t"]) == 0
    assert asked == [None]
    assert "evil" not in capsys.readouterr().err


def test_a_non_ECR_DDPACK_REGISTRY_is_named_before_enroots_credentials_are_written(aws, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(REGISTRY_SETTING, EVIL)
    events = Events()
    monkeypatch.setattr(sys, "stderr", events)
    real = credentials.write_atomically

    def write_atomically(path: Path, content: str | bytes, *args, **kwargs) -> None:
        events.log.append(("write", str(content)))
        real(path, content, *args, **kwargs)

    monkeypatch.setattr(credentials, "write_atomically", write_atomically)
    assert credentials.main(["--literal"]) == 0
    assert [kind for kind, _ in events.log] == ["stderr", "write"], events.log
    assert events.log[0][1] == warning_for(EVIL)
    assert f"machine {EVIL} login AWS password " in events.log[1][1]


def test_a_non_ECR_DDPACK_REGISTRY_is_named_before_the_push_sends_the_token(aws, monkeypatch) -> None:
    """The push's first use of the credential (the tag lookup) and the push itself come after the warning; an ECR
    host given the same way gets no warning."""
    events = Events()
    monkeypatch.setattr(sys, "stderr", events)
    local = type("Image", (), {"attrs": {"RepoDigests": []}, "tag": lambda self, *a: True, "reload": lambda self: None})()
    monkeypatch.setattr(push, "docker_client", lambda: type("Client", (), {"images": type("I", (), {"get": lambda self, name: local})()})())

    def remote_digest(cred: RegistryCredential, repository: str, tag: str) -> None:
        events.log.append(("send", f"{cred.host} {cred.password}"))

    def push_once(client, target: str, tag: str, cred: RegistryCredential) -> str:
        events.log.append(("send", f"{cred.host} {cred.password}"))
        return "sha256:" + "1" * 64

    monkeypatch.setattr(push, "remote_digest", remote_digest)
    monkeypatch.setattr(push, "push_once", push_once)
    password = base64.b64decode(base64.b64encode(f"{ACCOUNT}-auth-token".encode())).decode()
    monkeypatch.setenv(REGISTRY_SETTING, EVIL)
    assert push.main(["--image", "ddpack:1", "--repository", "ddpack/r", "--tag", "t"]) == 0, events.log
    kinds = [kind for kind, _ in events.log]
    assert kinds == ["stderr", "send", "send"], events.log
    assert events.log[0][1] == warning_for(EVIL) and events.log[1][1] == f"{EVIL} {password}"
    events.log.clear()
    ecr = f"{ACCOUNT}.dkr.ecr.us-east-1.amazonaws.com"
    push.push_image("ddpack:1", "ddpack/r", "t2", registry_override=ecr)
    assert [kind for kind, _ in events.log] == ["send", "send"], events.log
