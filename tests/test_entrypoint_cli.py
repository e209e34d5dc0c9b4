"""The entrypoint as a user runs it: a real process, its exit code, stdout and stderr."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from testbed.env import clean_env

ENTRYPOINT = [sys.executable, "-m", "entrypoint"]
SLURM_RANK3 = {
    "SLURM_JOB_ID": "31337",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_NODELIST": "ip-10-4-[33-34]",
    "SLURM_CPUS_PER_TASK": "3",
}


def run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    environ = clean_env(**env)
    environ.pop("OMP_NUM_THREADS")
    return subprocess.run([*ENTRYPOINT, *args], env=environ, capture_output=True, text=True, timeout=60)


def test_print_plan_is_json_and_never_imports_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "entrypoint", "--print-plan"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["mode"] == "single" and plan["world_size"] == 1
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "json" in imported
    assert not [name for name in imported if name.split(".")[0] in ("torch", "numpy")]


def test_exec_sets_the_ddp_environment_for_any_command() -> None:
    names = "RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE NODE_RANK MASTER_ADDR MASTER_PORT DDPACK_BACKEND OMP_NUM_THREADS"
    probe = f"import json,os; print(json.dumps({{k: os.environ.get(k) for k in {names.split()!r}}}))"
    out = run([sys.executable, "-c", probe], **SLURM_RANK3)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "ip-10-4-33",
        "MASTER_PORT": str(15000 + 31337 * 16 % 15000),
        "DDPACK_BACKEND": "gloo",
        "OMP_NUM_THREADS": "3",
    }


def test_exit_code_of_the_command_is_the_entrypoints() -> None:
    assert run([sys.executable, "-c", "raise SystemExit(7)"]).returncode == 7


def test_leading_flags_go_to_the_trainer_and_double_dash_ends_options() -> None:
    plan = json.loads(run(["--print-plan", "--epochs", "3"]).stdout)
    assert plan["argv"] == [sys.executable, "-P", "-m", "train", "--epochs", "3"]
    plan = json.loads(run(["--print-plan", "--", "--weird-script"]).stdout)
    assert plan["argv"][-1] == "--weird-script"
    plan = json.loads(run(["--print-plan", "--nproc-per-node=2", "python", "my.py", "--print-plan"]).stdout)
    assert plan["launcher"] == "torchrun" and plan["argv"][-3:] == ["python", "my.py", "--print-plan"]


def test_bad_environment_is_one_line_exit_2_no_traceback() -> None:
    out = run(["--print-plan"], RANK="5", WORLD_SIZE="4", MASTER_ADDR="h")
    assert out.returncode == 2
    assert out.stderr.strip() == "entrypoint: error: RANK=5 is not below WORLD_SIZE=4; expected 0..3"
    assert out.stdout == ""


def test_bad_option_is_one_line_exit_2() -> None:
    out = run(["--nproc-per-node", "two"])
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--nproc-per-node='two'" in out.stderr
    out = run(["--backend"])
    assert out.returncode == 2 and "--backend needs a value" in out.stderr


def test_missing_command_is_one_line_exit_127() -> None:
    out = run(["no-such-command-xyz"])
    assert out.returncode == 127
    assert out.stderr.strip() == "entrypoint: error: command not found: 'no-such-command-xyz'; check the image's PATH"


def test_help() -> None:
    out = run(["--help"])
    assert out.returncode == 0 and "--print-plan" in out.stdout and "--nproc-per-node" in out.stdout


@pytest.mark.parametrize("name", ["entrypoint", "/usr/local/bin/entrypoint"])
def test_the_launcher_named_as_the_command_runs_once(name: str) -> None:
    """`enroot start NAME entrypoint --print-plan`: enroot's /etc/rc execs the image's ENTRYPOINT with
    the arguments, so the launcher is its own command; it must resolve the plan once, as itself."""
    direct = json.loads(run(["--print-plan", "--epochs", "3"]).stdout)
    for args in ([name, "--print-plan", "--epochs", "3"], ["--print-plan", name, "--epochs", "3"], ["--", name, "--print-plan", "--epochs", "3"]):
        plan = json.loads(run(args).stdout)
        assert plan["mode"] == "single" and plan["argv"] == direct["argv"], args


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (["--", "python", "my_train.py"], SLURM_RANK3, "starts standbys of the bundled trainer, which this command is not (python); unset it"),
        (["--nproc-per-node", "2", "--epochs", "1"], {}, "needs one process a rank, and torchrun (--nproc-per-node) starts a node's ranks itself; unset it"),
    ],
)
def test_standbys_for_a_program_that_is_not_the_bundled_trainer_are_one_line(args: list[str], env: dict[str, str], line: str) -> None:
    """DDPACK_STANDBYS makes the launcher's last tasks standbys of the bundled trainer: an image's own command or a node's
    torchrun would take them for ranks. The trainer and its preflight pass."""
    out = run(["--print-plan", *args], DDPACK_STANDBYS="1", **env)
    assert out.returncode == 2 and out.stderr == f"entrypoint: error: DDPACK_STANDBYS=1 {line}\n", out.stderr
    for ok in (["--epochs", "1"], ["--preflight"]):
        assert run(["--print-plan", *ok], DDPACK_STANDBYS="1", **SLURM_RANK3).returncode == 0
    # auto, the settings' default, asks nothing of a task: the job's program hands a step the count it started.
    assert run(["--print-plan", *args], DDPACK_STANDBYS="auto", **env).returncode == 0
