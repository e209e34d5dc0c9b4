"""`ddpack try` (issue 64, point 5): a sweep's point (or the plain command) run here before it waits in the queue, in
the job's image with the job's command, environment and mounts, in a one-task world. The docker command is checked as
built (--dry-run --json), the run's exit, lines and time limit against a stand-in `docker` command; the Docker tier runs
one point for real in the CPU image the other Docker tests build (never an image of its own)."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

import pytest

from ddpack import cli
from ddpack.images.sqsh import write_record
from ddpack.jobs import try_point

IMAGE_ID = "sha256:" + "ab" * 32


@pytest.fixture(autouse=True)
def scratch_in_tmp_path(tmp_path, monkeypatch) -> None:
    """try's scratch run folders (made in the temporary folder, kept for the user to read) go with the test's."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def squashfs(folder: Path, image: str = "cpu-ddp:abc", image_id: str = IMAGE_ID) -> Path:
    """A squashfs with make sqsh's record beside it naming the Docker image it was made from (its contents unread)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "cpu-ddp.sqsh"
    path.write_bytes(b"hsqs" + bytes(60))
    write_record(path, image, image_id, "-noI -noD -noF -noX -no-duplicates")
    return path


def planned(tmp_path: Path, capfd, *args: str) -> dict:
    """try --dry-run --json's object for `args` (submit's options and try's own)."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    base = ["try", str(tmp_path), "--nodes", "2", "--sqsh", str(squashfs(tmp_path / "images")), "--mounts", f"{data}:/data"]
    assert cli.main([*base, "--dry-run", "--json", *args]) == 0, capfd.readouterr().err
    return json.loads(capfd.readouterr().out)


def test_a_sweeps_point_runs_with_its_command_its_env_the_one_task_rendezvous_and_the_jobs_mounts(tmp_path, capfd, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "s3cr3t-value")
    said = planned(tmp_path, capfd, "--sweep", "lr=1e-3,3e-4", "--env", "TAG=run-{lr}", "--index", "1", "--secret", "HF_TOKEN", "--",
                   "python", "t.py", "--lr", "{lr}")  # fmt: skip
    argv, env = said["argv"], said["env"]
    assert argv[argv.index("HF_TOKEN") - 1] == "-e" and "s3cr3t-value" not in json.dumps(said)  # by name: printed nowhere
    assert (said["index"], said["points"], said["image"]) == (1, 2, IMAGE_ID)  # the image the squashfs was made from
    assert argv[argv.index("--entrypoint") :] == ["--entrypoint", "entrypoint", IMAGE_ID, "--", "python", "t.py", "--lr", "3e-4"]
    assert env["TAG"] == "run-3e-4" and json.loads(env["DDPACK_COMMAND"]) == ["python", "t.py", "--lr", "3e-4"]
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "DDPACK_STANDBYS")} == {
        "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "DDPACK_STANDBYS": "0"}  # fmt: skip
    run_dir = env["DDPACK_RUN_DIR"]
    assert env["DDPACK_METRICS_FILE"] == f"{run_dir}/metrics.jsonl" and argv[argv.index("--workdir") + 1] == run_dir
    assert f"type=bind,source={tmp_path / 'data'},target=/data" in argv
    assert argv[argv.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}" and argv[argv.index("--network") + 1] == "host"
    # Each variable by name: its value reaches docker run's environment, never its argv (which `ps` shows everyone).
    assert [argv[i + 1] for i, word in enumerate(argv) if word == "-e"] == [*env, "HF_TOKEN"] and not any(
        "run-3e-4" in word for word in argv
    )
    assert said["command"].startswith("env ") and "TAG=run-3e-4" in said["command"]


def test_the_plain_command_and_the_bundled_trainers_flags_run_as_the_job_runs_them(tmp_path, capfd) -> None:
    plain = planned(tmp_path, capfd, "--", "python", "t.py", "--fmt", "{{lr}}")
    assert plain["index"] is None and plain["argv"][-4:] == ["--", "python", "t.py", "--fmt", "{lr}"][-4:]
    trainer = planned(tmp_path, capfd, "--env", "DDPACK_TRAIN_ARGS=--epochs 1 --task classification")
    assert trainer["argv"][trainer["argv"].index(IMAGE_ID) + 1 :] == ["--epochs", "1", "--task", "classification"]


def test_a_mount_this_host_lacks_is_left_out_with_a_warning(tmp_path, capfd) -> None:
    sqsh = squashfs(tmp_path / "images")
    assert cli.main(["try", "--nodes", "1", "--sqsh", str(sqsh), "--mounts", f"/no/such/fsx:/fsx,{tmp_path}", "--dry-run", "--json"]) == 0
    said = capfd.readouterr()
    assert (
        said.err.strip()
        == "ddpack try: warning: /no/such/fsx (--mounts) does not exist here: not mounted; a program that reads it fails here"
    )
    argv = json.loads(said.out)["argv"]
    assert not any("/no/such/fsx" in word for word in argv) and f"type=bind,source={tmp_path},target={tmp_path}" in argv


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--sweep", "lr=1,2", "--index", "2", "--", "t", "{lr}"], "--index 2: the sweep has points 0 to 1"),
        (["--index", "1", "--", "t"], "--index 1 picks a point of a sweep, and there is no sweep"),
        (["--sqsh", "/no/such.sqsh", "--", "t"], "--sqsh /no/such.sqsh is not a file"),
        (["--", "t", "{lr}"], "the command uses {lr}, but there is no sweep"),  # submit's own checks
        (["--timeout", "0", "--", "t"], "--timeout 0: expected seconds > 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capfd, args: list[str], line: str) -> None:
    given = {"--sqsh": str(squashfs(tmp_path / "images")), "--mounts": f"{tmp_path}:/x"}
    base = [word for flag, value in given.items() if flag not in args for word in (flag, value)]
    assert cli.main(["try", str(tmp_path), "--nodes", "1", *base, "--dry-run", *args]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0] and err[0].startswith("ddpack try: error:"), err


def test_a_squashfs_without_its_record_is_refused_it_cannot_say_which_image_it_holds(tmp_path, capfd) -> None:
    sqsh = squashfs(tmp_path / "images")
    (sqsh.parent / f"{sqsh.name}.ddpack.json").unlink()
    assert cli.main(["try", "--nodes", "1", "--sqsh", str(sqsh), "--mounts", f"{tmp_path}:/x", "--dry-run", "--", "t"]) == 2
    assert "has no readable record of its image" in capfd.readouterr().err


def stand_in_docker(folder: Path) -> Path:
    """A `docker` that runs its last word as a shell command (printing what it prints, ending as it ends) and whose
    `stop` ends that run with SIGTERM, as the engine stops a container; each call is written to calls."""
    folder.mkdir()
    script = folder / "docker"
    script.write_text(f"""#!/bin/bash
echo "$*" >> {folder}/calls
if [ "$1" = stop ]; then kill -TERM "$(cat {folder}/pid)"; exit 0; fi
echo $$ > {folder}/pid
bash -c "${{@: -1}}" &
child=$!
trap 'kill $child; exit 143' TERM
wait $child
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


@pytest.mark.parametrize(
    ("program", "timeout", "code", "said"),
    [
        ("for i in $(seq 30); do echo line $i; done", "60", 0, "exit 0 after"),
        ("echo line 1; echo Traceback; exit 3", "60", 6, "exit 3 after"),  # the command failed: as a FAILED job
        ("echo line 1; exec sleep 60", "1", 4, "still running after 1 s (--timeout): stopped (docker stop), exit 4"),
    ],
)
def test_the_run_prints_its_first_lines_and_exits_as_a_job_would(tmp_path, capfd, monkeypatch, program, timeout, code, said) -> None:
    fake = stand_in_docker(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    monkeypatch.setattr(try_point, "choose_image", lambda settings, dry_run: ("img", "image img"))
    args = ["try", str(tmp_path), "--nodes", "1", "--mounts", f"{tmp_path}:{tmp_path}", "--timeout", timeout, "--lines", "1"]
    assert cli.main([*args, "--", "bash", "-c", program]) == code
    out = capfd.readouterr().out.splitlines()
    assert said in out[-1], out
    assert out[1] == "  line 1" or code == 4, out  # the first lines as they come (--lines 1); a stop may come first
    if code == 0:
        assert "  line 2" not in out and "all 30 lines in" in out[-1]  # the whole output kept
        assert Path(out[-1].split("all 30 lines in ")[1]).read_text().splitlines()[-1] == "line 30"
    if code == 6:
        assert out[-3:-1] == ["try: its last 1 lines:", "  Traceback"]  # a failure's last lines too: where its error is
    calls = (fake / "calls").read_text().splitlines()
    assert any(call.startswith("stop --time 10 ddpack-try-") for call in calls) == (code == 4)


@pytest.mark.docker
def test_a_point_runs_for_real_in_the_cpu_image(tmp_path, capfd, cpu_image) -> None:
    import docker

    image_id = docker.from_env().images.get(cpu_image).id
    sqsh = squashfs(tmp_path / "images", cpu_image, image_id)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shard-0").write_text("x")
    probe = "import os, json; print(json.dumps({k: os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'TAG')} | {'cwd': os.getcwd(), 'data': os.listdir('/data')}))"
    args = ["try", str(tmp_path), "--nodes", "1", "--sqsh", str(sqsh), "--mounts", f"{tmp_path / 'data'}:/data", "--sweep", "lr=1,2"]
    assert cli.main([*args, "--index", "1", "--env", "TAG=lr-{lr}", "--timeout", "60", "--", "python", "-c", probe]) == 0
    out = capfd.readouterr().out.splitlines()
    seen = json.loads(next(line for line in out if line.startswith("  {")))
    assert {k: seen[k] for k in ("RANK", "WORLD_SIZE", "TAG", "data")} == {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "TAG": "lr-2",
        "data": ["shard-0"],
    }
    assert Path(seen["cwd"]).name.startswith("ddpack-try-")  # the scratch run folder, the job's working directory
    assert "exit 0 after" in out[-1]


def test_the_readmes_try_line_plans_the_sweeps_last_point(tmp_path, capfd) -> None:
    """The README's `ddpack try` line, its squashfs one with make sqsh's record: point 3 of 4, its command in place."""
    import shlex

    from testbed.readme_examples import readme_line

    line = readme_line(".venv/bin/ddpack try ")
    made = "build/cpu-ddp+$(git describe --always --dirty).sqsh"  # make sqsh's output, its record beside it
    assert made in line
    words = shlex.split(line.replace(made, str(squashfs(tmp_path / "build"))))[1:]
    assert cli.main([*words[: words.index("--")], "--dry-run", "--json", *words[words.index("--") :]]) == 0
    said = json.loads(capfd.readouterr().out)
    assert (said["index"], said["points"]) == (3, 4)
    assert said["argv"][said["argv"].index(IMAGE_ID) + 1 :] == ["--", "python", "-m", "train", "--task", "classification", "--lr", "3e-3",
                                                                 "--batch-size", "32", "--epochs", "2"]  # fmt: skip


def test_no_docker_command_and_no_engine_are_one_line_each(tmp_path, capfd, monkeypatch) -> None:
    sqsh = squashfs(tmp_path / "images")
    args = ["try", "--nodes", "1", "--sqsh", str(sqsh), "--mounts", f"{tmp_path}:/x", "--", "t"]
    monkeypatch.setenv("PATH", str(tmp_path / "images"))  # no docker on it
    assert cli.main(args) == 2
    assert capfd.readouterr().err.strip().startswith("ddpack try: error: no docker command here")
    monkeypatch.setenv("PATH", f"{stand_in_docker(tmp_path / 'bin')}:{os.environ['PATH']}")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    assert cli.main(args) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no Docker engine reachable at unix://" in err[0], err
