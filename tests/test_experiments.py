"""Experiments (issue 49): a run file beside the code, an explicit environment, secrets in no file, a resubmit that
may change the time, nodes or partition, and shell completion written from the parser. Against the fake Slurm
commands of tests/test_lifecycle.py; the cluster tier submits a run file, a secret and a leaking shell for real
(tests/test_lifecycle_cluster.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_records import started, step_end, write_decisions
from test_lifecycle import calls, fake, fake_slurm, make_run, queued, settings

from ddpack import cli
from ddpack.jobs.run_json import read_record
from ddpack.jobs.submit_checks import LOGIN_ENV


@pytest.fixture
def slurm(tmp_path, monkeypatch) -> Path:
    return fake_slurm(tmp_path, monkeypatch)


SECRET = "s3cr3t-value-\u00e9-'quoted' $HOME"


def run_file(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "project" / "run.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


def good_file(tmp_path: Path) -> Path:
    good = settings(tmp_path)
    return run_file(
        tmp_path,
        f"""# the run, kept beside the code
nodes = 2
tasks-per-node = 2
runs = "{good.runs}"
sqsh = "{good.sqsh}"
mounts = "{good.mounts}"
time = "1:00:00"
command = ["python", "train.py", "--name", "two words"]
pass_env = ["NCCL_DEBUG"]
secrets = ["WANDB_API_KEY"]

[env]
OMP_NUM_THREADS = "4"
""",
    )


def submitted(capfd) -> dict:
    """submit --json's object (in-process, what the build would say to stderr shares pytest's captured stdout)."""
    lines = capfd.readouterr().out.splitlines()
    return json.loads("\n".join(lines[lines.index("{") :]))


def test_a_run_file_holds_the_flags_the_flags_win_and_the_file_is_kept_in_the_record(tmp_path, slurm, monkeypatch, capfd) -> None:
    path = good_file(tmp_path)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    assert cli.main(["submit", "--file", str(path), "--time", "2:00:00", "--json"]) == 0
    result = submitted(capfd)
    record = read_record(Path(result["run_dir"]))
    assert record.settings["app_dir"] == str(path.parent)  # the run file's folder is the project
    assert (record.settings["nodes"], record.settings["tasks_per_node"], record.settings["time_limit"]) == (2, 2, "2:00:00")
    assert record.command == ["python", "train.py", "--name", "two words"]
    assert record.run_file is not None and record.run_file["text"] == path.read_text() and record.run_file["path"] == str(path)
    script = (Path(result["run_dir"]) / record.script).read_text()
    assert "#SBATCH --time=2:00:00" in script and "export OMP_NUM_THREADS=4" in script and "export NCCL_DEBUG=INFO" in script


@pytest.mark.parametrize(
    ("body", "line"),
    [
        ("nodes = 2\nnodse = 3\n", "run.toml:2: nodse: not a run file key (a typo?)"),
        ('nodes = "two"\n', "run.toml:1: nodes = 'two': expected a whole number"),
        ("nodes = true\n", "run.toml:1: nodes = True: expected a whole number"),
        ('nodes = 2\ncommand = "python train.py"\n', "run.toml:2: command: expected a list of strings"),
        ("nodes = 2\n\n[env]\nA = 1\n", "run.toml:4: env.A = 1: expected a string"),
        ("nodes = 2\ncommand = [\n", "run.toml: not TOML:"),
        ('nodes = 2\npass_env = ["DDPACK_TEST_UNSET_VAR"]\n', "run.toml:2: pass_env: DDPACK_TEST_UNSET_VAR is not set in this shell"),
        ("tasks_per_node = 2\n", "how many nodes? --nodes N (or nodes = N in a run file"),
        ('nodes = 2\ntime = "soon"\n', "run.toml:2: --time soon: not a Slurm time"),
        ('nodes = 2\ntemplate = "mpi"\n', "run.toml:2: --template mpi: expected one of per-task, torchrun"),
        ('nodes = 2\n[env]\nA = "1"\nDDPACK_STAGE = "sbcats"\n', "run.toml:4: --env DDPACK_STAGE=sbcats: expected auto, sbcast, off"),
        ('nodes = 2\ncommand = ["x"]\n[sweep]\nlr = ["1", "2"]\n', "run.toml:4: --sweep lr: the command after -- never uses {lr}"),
    ],
)
def test_a_bad_run_file_is_one_line_with_the_key_and_its_line_exit_2_and_nothing_queued(tmp_path, slurm, capfd, body: str, line: str) -> None:
    path = run_file(tmp_path, body)
    assert cli.main(["submit", "--file", str(path), "--dry-run"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
    assert calls(slurm, "sbatch") == []


def test_the_job_gets_the_login_basics_what_is_named_and_secrets_only_through_slurm(tmp_path, slurm, monkeypatch, capfd) -> None:
    """A login shell's NCCL_*, FI_* and CUDA_* stay out unless named; --env NAME passes one with its value recorded;
    a secret's value reaches sbatch's environment alone (--export by name) and no file of the run folder."""
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; env > "$(dirname "${@: -1}")/../../sbatch-env"; echo 73')
    for name, value in (("NCCL_SOCKET_IFNAME", "eth9"), ("FI_PROVIDER", "efa"), ("CUDA_VISIBLE_DEVICES", "3"), ("NCCL_DEBUG", "WARN")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    good = settings(tmp_path)
    args = ["submit", str(tmp_path), "--nodes", "2", "--runs", str(good.runs), "--sqsh", str(good.sqsh), "--mounts", good.mounts]
    assert cli.main([*args, "--env", "NCCL_DEBUG", "--secret", "HF_TOKEN", "--json", "--", "python", "-c", "pass"]) == 0
    run_dir = Path(submitted(capfd)["run_dir"])
    (sbatch,) = queued(slurm)
    assert f"--export={','.join([*LOGIN_ENV, 'HF_TOKEN'])} " in sbatch
    record = read_record(run_dir)
    assert record.environment["secrets"] == ["HF_TOKEN"] and record.environment["script"]["NCCL_DEBUG"] == "WARN"
    assert record.environment["login_shell"]["PATH"] == os.environ["PATH"]
    script = (run_dir / record.script).read_text()
    assert "NCCL_SOCKET_IFNAME" not in script and "FI_PROVIDER" not in script and "unset SLURM_EXPORT_ENV" in script
    assert "export NCCL_DEBUG=WARN" in script
    seen = run_dir.parent / "sbatch-env"  # what sbatch itself had (the fake's copy, outside the run folder): the secret
    assert f"HF_TOKEN={SECRET}" in seen.read_text()
    seen.unlink()
    leaks = [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaks == [] and SECRET not in json.dumps(json.loads((run_dir / "run.json").read_text()))


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--secret", "DDPACK_TEST_NOT_SET"], "--secret DDPACK_TEST_NOT_SET: not a variable name of your own"),
        (["--secret", "NOT_SET_HERE_XYZ"], "--secret NOT_SET_HERE_XYZ: NOT_SET_HERE_XYZ is not set in this environment"),
        (["--secret", "HF_TOKEN", "--env", "HF_TOKEN=x"], "--secret HF_TOKEN is also an --env setting"),
        (["--secret", "PATH"], "--secret PATH: not a variable name of your own"),
        (["--secret", "all"], "--secret all: not a variable name of your own"),  # sbatch --export=...,ALL: the whole shell
    ],
)
def test_a_secret_that_cannot_be_kept_secret_is_refused_in_one_line(tmp_path, slurm, monkeypatch, capfd, args, line) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    good = settings(tmp_path)
    assert cli.main(["submit", str(tmp_path), "--nodes", "2", "--runs", str(good.runs), "--sqsh", str(good.sqsh), "--mounts", good.mounts, *args]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
    assert queued(slurm) == []


def test_resubmit_may_change_time_nodes_and_partition_and_keeps_the_change_in_the_history(tmp_path, slurm, monkeypatch, capfd) -> None:
    fake(slurm, "squeue", "echo 'TIMEOUT||'")
    run_dir = make_run(tmp_path)
    fake(slurm, "sbatch", "echo 57")
    assert cli.main(["resubmit", str(run_dir), "--time", "8:00:00", "--nodes", "3", "--partition", "big"]) == 0
    assert "resubmit: job 57 continues" in capfd.readouterr().out
    assert calls(slurm, "sbatch") == [f"sbatch --parsable --time=8:00:00 --nodes=3 --partition=big {run_dir}/job/ddpack.sbatch"]
    last = read_record(run_dir).jobs[-1]
    assert (last.job_id, last.how, last.changes) == ("57", "resubmit", {"time_limit": "8:00:00", "nodes": 3, "partition": "big"})
    assert cli.main(["resubmit", str(run_dir), "--time", "soon"]) == 2
    assert "--time soon: not a Slurm time" in capfd.readouterr().err
    assert len(calls(slurm, "sbatch")) == 1


def test_resubmit_hands_the_secrets_again_and_refuses_without_them(tmp_path, slurm, monkeypatch, capfd) -> None:
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 73')
    monkeypatch.setenv("HF_TOKEN", SECRET)
    good = settings(tmp_path)
    assert cli.main(["submit", str(tmp_path), "--nodes", "2", "--runs", str(good.runs), "--sqsh", str(good.sqsh), "--mounts", good.mounts,
                     "--secret", "HF_TOKEN", "--json"]) == 0  # fmt: skip
    run_dir = submitted(capfd)["run_dir"]
    fake(slurm, "squeue", "echo 'COMPLETED||'")
    monkeypatch.delenv("HF_TOKEN")
    assert cli.main(["resubmit", run_dir]) == 2
    assert "this run's secret HF_TOKEN is not set in this shell" in capfd.readouterr().err
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert cli.main(["resubmit", run_dir]) == 0
    assert f"--export={','.join([*LOGIN_ENV, 'HF_TOKEN'])} " in queued(slurm)[-1]


# --------------------------------------------------------------------------- completion


def complete(tmp_path: Path, words: list[str], env: dict[str, str] | None = None) -> list[str]:
    """What bash's completion offers after `words` (the last one being typed), with the script `ddpack completion
    bash` prints sourced."""
    script = tmp_path / "ddpack.bash"
    script.write_text(subprocess.run([shutil.which("ddpack") or ".venv/bin/ddpack", "completion", "bash"], capture_output=True, text=True,
                                     check=True).stdout)  # fmt: skip
    quoted = " ".join(f"'{w}'" for w in words)
    probe = f'source {script}; COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _ddpack; printf "%s\\n" "${{COMPREPLY[@]}}"'
    path = f"{Path(shutil.which('ddpack') or '.venv/bin/ddpack').resolve().parent}:{os.environ['PATH']}"
    out = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, env={**os.environ, "PATH": path, **(env or {})}, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    return [line for line in out.stdout.splitlines() if line]


def test_bash_completes_verbs_flags_choices_and_runs_from_the_parser(tmp_path) -> None:
    assert complete(tmp_path, ["ddpack", "su"]) == ["submit"]
    assert complete(tmp_path, ["ddpack", "submit", "--sec"]) == ["--secret"]
    assert complete(tmp_path, ["ddpack", "submit", "--template", ""]) == ["per-task", "torchrun"]
    assert complete(tmp_path, ["ddpack", "resubmit", "--ti"]) == ["--time"]
    assert complete(tmp_path, ["ddpack", "completion", ""]) == ["bash", "zsh"]
    assert complete(tmp_path, ["ddpack", "submit", "--nodes", ""]) == []  # a number: nothing to offer
    (tmp_path / "proj").mkdir()
    assert complete(tmp_path, ["ddpack", "submit", "pr"]) == ["proj"]
    assert "python3" in complete(tmp_path, ["ddpack", "submit", "proj", "--", "python3"])
    run_dir = make_run(tmp_path)
    assert complete(tmp_path, ["ddpack", "status", ""], env={"DDPACK_RUNS": str(run_dir.parent)}) == [str(run_dir), "41"]


def test_zsh_reads_the_completion_script_and_registers_it() -> None:
    if shutil.which("zsh") is None:
        if os.environ.get("CI"):
            pytest.fail("zsh is not installed (.ci/run installs it)")
        pytest.skip("zsh is not installed")
    ddpack = shutil.which("ddpack") or str(Path(".venv/bin/ddpack").resolve())
    probe = f"autoload -U compinit; compinit -u; source <({ddpack} completion zsh); print -r -- ${{_comps[ddpack]}}"
    out = subprocess.run(["zsh", "-f", "-c", probe], capture_output=True, text=True)
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, "_ddpack", "")


# --------------------------------------------------------------------------- compare


def test_compare_shows_only_what_differed_and_how_each_run_ended_with_a_page_of_both_curves(tmp_path, slurm, capfd) -> None:
    from dataclasses import replace

    from test_lifecycle import REQUEUED_RUN, end, progress, start

    from ddpack.jobs.run_json import write_record

    fake(slurm, "squeue", "exit 0")  # neither job is listed: the run folders say how they ended
    done = [start(100, 0), {**progress(101, 10), "mfu": 2.3e-6}, {**progress(102, 20), "mfu": 2.3e-6}, end(103, 20, "done", 0)]
    first, second = make_run(tmp_path / "a", records=done), make_run(tmp_path / "b", jobs=("52",), records=[*REQUEUED_RUN, end(140, 60, "done", 0)])
    for run_dir, lr, nodes in ((first, "1e-3", 2), (second, "3e-4", 4)):
        record = read_record(run_dir)
        settings_now = {"nodes": nodes, "tasks_per_node": 2, "partition": "big", "run_dir": str(run_dir)}
        write_record(replace(record, command=["python", "train.py", "--lr", lr], settings=settings_now,
                             environment={"script": {"DDPACK_RUN_DIR": str(run_dir)}, "secrets": ["HF_TOKEN"]}))  # fmt: skip
    page = tmp_path / "cmp.html"
    assert cli.main(["compare", str(first), str(second), "--json", "--html", str(page)]) == 0
    result = json.loads(capfd.readouterr().out)
    assert sorted(result["differ"]) == ["command", "settings.nodes"]  # the run's own folder is not a difference
    assert result["differ"]["settings.nodes"] == [2, 4] and result["same"] > 3
    ends = {run["name"]: run for run in result["runs"]}
    assert (ends["41"]["state"], ends["41"]["step"], ends["41"]["restarts"], ends["41"]["train_loss"]) == ("COMPLETED", 20, 0, 1 / 21)
    assert (ends["52"]["state"], ends["52"]["step"], ends["52"]["restarts"]) == ("COMPLETED", 60, 1)
    assert ends["52"]["samples_per_s"] == 2000.0 and ends["41"]["wall_s"] == 3
    text = page.read_text()
    assert os.stat(page).st_mode & 0o077 == 0  # settings and --env values: the user's alone
    assert text.count("data:image/png;base64,") == 1 and "settings.nodes" in text and "--lr" in text
    assert cli.main(["compare", str(first), str(second), "--html", str(page)]) == 0
    out = capfd.readouterr().out
    assert "2 field(s) differ" in out and "settings.nodes" in out and "restarts" in out and f"compare: wrote {page}" in out
    assert cli.main(["compare", str(first)]) == 2
    assert "compare needs two runs or more" in capfd.readouterr().err
    page.unlink()
    assert cli.main(["compare", str(first), str(second)]) == 0 and "last train loss" in (out := capfd.readouterr().out)
    assert "0.00023%" in out and "0.0 %" not in out  # a small model's MFU on a CPU, as the trainer writes it (format_share)
    assert not page.exists() and not Path("compare.html").exists()  # a page only where --html asks


# --------------------------------------------------------------------------- sweeps


def sweep_args(tmp_path: Path) -> list[str]:
    good = settings(tmp_path)
    return ["submit", str(tmp_path), "--nodes", "1", "--runs", str(good.runs), "--sqsh", str(good.sqsh), "--mounts", good.mounts]


def test_a_sweep_is_one_job_array_with_a_run_folder_a_point(tmp_path, slurm, capfd) -> None:
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1e-3,3e-4", "--sweep", "seed=0,1", "--sweep-parallel", "2", "--json",
                     "--", "python", "train.py", "--lr", "{lr}", "--seed={seed}", "--note", "{{other}} stays"]) == 0  # fmt: skip
    sweep_dir = Path(submitted(capfd)["run_dir"])
    (sbatch,) = queued(slurm)
    assert sbatch.endswith(f"{sweep_dir}/job/ddpack.sbatch") and len(calls(slurm, "sbatch")) == 2  # --test-only, then the one array
    data = json.loads((sweep_dir / "sweep.json").read_text())
    assert data["job_id"] == "90" and data["values"] == {"lr": ["1e-3", "3e-4"], "seed": ["0", "1"]}
    assert data["points"] == [{"lr": "1e-3", "seed": "0"}, {"lr": "1e-3", "seed": "1"}, {"lr": "3e-4", "seed": "0"}, {"lr": "3e-4", "seed": "1"}]
    for index, point in enumerate(data["points"]):
        record = read_record(sweep_dir / str(index))
        assert record.command == ["python", "train.py", "--lr", point["lr"], f"--seed={point['seed']}", "--note", "{other} stays"]
        assert record.sweep == {"dir": str(sweep_dir), "index": index, "values": point, "points": 4}
        assert [job.job_id for job in record.jobs] == [f"90_{index}"] and (sweep_dir / str(index) / "logs").is_dir()
        assert (sweep_dir / str(index) / record.script).resolve() == sweep_dir / "job" / "ddpack.sbatch"
    script = (sweep_dir / "job" / "ddpack.sbatch").read_text()
    assert "#SBATCH --array=0-3%2" in script and f"#SBATCH --output={sweep_dir}/%a/logs/slurm-%A_%a.out" in script
    # The script's own settings block, run by bash as array task 2: that point's folder and command.
    block = script[script.index("# ddpack submit: this run's settings") : script.index('export DDPACK_COMMAND="${ddpack_commands[ddpack_point]}"')]
    probe = block + 'export DDPACK_COMMAND="${ddpack_commands[ddpack_point]}"\nprintf "%s\\n%s\\n" "$DDPACK_RUN_DIR" "$DDPACK_COMMAND"\n'
    out = subprocess.run(["bash", "-c", probe], env={**os.environ, "SLURM_ARRAY_TASK_ID": "2"}, capture_output=True, text=True, check=True)
    run_dir, command = out.stdout.splitlines()
    assert (run_dir, json.loads(command)) == (str(sweep_dir / "2"), read_record(sweep_dir / "2").command)
    alone = subprocess.run(["bash", "-c", probe], env={k: v for k, v in os.environ.items() if k != "SLURM_ARRAY_TASK_ID"}, capture_output=True, text=True)
    assert alone.returncode != 0 and "this script is a sweep of 4 points: sbatch --array=0-3 it" in alone.stderr


def test_a_sweep_of_the_bundled_trainer_sets_no_command_beside_its_points_train_args(tmp_path, slurm, capfd) -> None:
    """No command, the points told apart by DDPACK_TRAIN_ARGS: the script sets each point's arguments and no
    DDPACK_COMMAND (the job refuses the two together, and an empty command list is one: every point failed)."""
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=0.1,0.3", "--env=DDPACK_TRAIN_ARGS=--lr {lr}", "--json"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    script = (sweep_dir / "job" / "ddpack.sbatch").read_text()
    start = script.index("# ddpack submit: this run's settings")
    block = script[start : script.index("\n\n", start)]  # the whole settings block, to the blank line after it
    probe = block + '\nprintf "%s|%s\\n" "$DDPACK_TRAIN_ARGS" "${DDPACK_COMMAND-unset}"\n'
    out = subprocess.run(["bash", "-c", probe], env={**os.environ, "SLURM_ARRAY_TASK_ID": "1"}, capture_output=True, text=True, check=True)
    assert out.stdout == "--lr 0.3|unset\n", out.stdout


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (["--sweep", "lr=1e-3,3e-4", "--", "python", "train.py"], "--sweep lr: the command after -- never uses {lr}"),
        (["--sweep", "lr=1e-3,,3e-4", "--", "python", "{lr}"], "--sweep lr: an empty value"),
        (["--sweep", "lr=1,2,1", "--", "python", "{lr}"], "--sweep lr: a value given twice (1)"),
        (["--sweep", "lr", "--", "python", "{lr}"], "--sweep lr: expected NAME=V1,V2,..."),
        (["--sweep-parallel", "2", "--", "python", "x"], "--sweep-parallel limits a sweep's points at once: it needs --sweep"),
        (["--sweep", "a=" + ",".join(map(str, range(40))), "--sweep", "b=" + ",".join(map(str, range(40))), "--", "p", "{a}{b}"],
         "the sweep has 1600 points; one job array holds at most 1000"),
        ([*(f"--sweep=n{i}={','.join(map(str, range(10)))}" for i in range(9)), "--", "p", *(f"{{n{i}}}" for i in range(9))],
         "the sweep has 1000000000 points"),  # counted, never made
        (["--sweep", "tag=a\n$(touch /tmp/ddpack-pwned)", "--", "p", "{tag}"], "--sweep tag: a value holds a newline"),
        (["--sweep", "lr=1", "--sweep", "lr=2", "--", "p", "{lr}"], "--sweep lr is given twice"),  # never only the last
        (["--sweep", "lr=1,2", "--", "p", "{lr}", "--seed={seed}"], "the command uses {seed}, which no --sweep gives"),
        (["--sweep", "lr=1,2", "--env", "TAG={sed}", "--", "p", "{lr}"], "an --env value uses {sed}, which no --sweep gives"),
        (["--sweep", "index=1,2", "--", "p", "{index}"], "--sweep index: {index} is the point's number already"),
        (["--sweep", "st=sbcast,sbcats", "--env", "DDPACK_STAGE={st}", "--", "p"], "--env DDPACK_STAGE=sbcats: expected auto"),
    ],
)
def test_a_sweep_that_cannot_run_as_meant_is_one_line_and_exit_2(tmp_path, slurm, capfd, extra: list[str], line: str) -> None:
    assert cli.main([*sweep_args(tmp_path), "--dry-run", *extra]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
    assert queued(slurm) == []


def test_a_sweeps_values_are_put_in_once_may_hold_commas_and_reach_env_values_and_the_points_index(tmp_path, slurm, capfd) -> None:
    """One pass: a value that reads {b} is not replaced again; \\, is a comma in a value; {{a}} is the text {a};
    --env values take the point's values too, each point's job exporting its own (the script's array), recorded."""
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "a=x\\,y,{b}", "--sweep", "b=1,2", "--env", "RUN_TAG=r{index}-{b}", "--env", "PLAIN=p",
                     "--json", "--", "p", "{a}", "{{a}}", "--index={index}"]) == 0  # fmt: skip
    sweep_dir = Path(submitted(capfd)["run_dir"])
    assert json.loads((sweep_dir / "sweep.json").read_text())["values"] == {"a": ["x,y", "{b}"], "b": ["1", "2"]}
    first, third = read_record(sweep_dir / "0"), read_record(sweep_dir / "2")
    assert first.command == ["p", "x,y", "{a}", "--index=0"] and third.command == ["p", "{b}", "{a}", "--index=2"]
    assert (first.settings["env"], third.settings["env"]) == ({"RUN_TAG": "r0-1", "PLAIN": "p"}, {"RUN_TAG": "r2-1", "PLAIN": "p"})
    assert third.environment["script"]["RUN_TAG"] == "r2-1"
    script = (sweep_dir / "job" / "ddpack.sbatch").read_text()
    block = script[script.index("# ddpack submit: this run's settings") : script.index('export DDPACK_COMMAND="${ddpack_commands[ddpack_point]}"')]
    probe = block + 'export DDPACK_COMMAND="${ddpack_commands[ddpack_point]}"\nprintf "%s|%s|%s\\n" "$RUN_TAG" "$PLAIN" "$DDPACK_COMMAND"\n'
    out = subprocess.run(["bash", "-c", probe], env={**os.environ, "SLURM_ARRAY_TASK_ID": "3"}, capture_output=True, text=True, check=True)
    tag, plain, command = out.stdout.strip().split("|")
    assert (tag, plain, json.loads(command)) == ("r3-2", "p", ["p", "{b}", "{a}", "--index=3"])


def test_a_run_files_path_expands_the_home_folder_or_is_refused(tmp_path, slurm, monkeypatch, capfd) -> None:
    from ddpack.jobs.run_toml import read_run_file

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = run_file(tmp_path, 'nodes = 1\nruns = "~/runs"\n')
    assert read_run_file(path).values["runs"] == tmp_path / "home" / "runs"
    bad = run_file(tmp_path, 'nodes = 1\nruns = "~nosuchuser-ddpack/runs"\n')
    assert cli.main(["submit", "--file", str(bad), "--dry-run"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run.toml:2: runs = '~nosuchuser-ddpack/runs': ~nosuchuser-ddpack is no user's home here" in err[0], err
    assert not list(tmp_path.rglob("~*"))


def test_a_run_files_sweep_table_is_a_sweep_and_a_flag_replaces_its_values(tmp_path, slurm, capfd) -> None:
    good = settings(tmp_path)
    path = run_file(tmp_path, f'nodes = 1\nruns = "{good.runs}"\nsqsh = "{good.sqsh}"\nmounts = "{good.mounts}"\n'
                              'command = ["python", "t.py", "--lr", "{lr}", "--seed", "{seed}"]\n\n[sweep]\nlr = ["1e-3", 3e-4]\nseed = [0, 1]\n')  # fmt: skip
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 91')
    assert cli.main(["submit", "--file", str(path), "--sweep", "seed=7", "--json"]) == 0
    data = json.loads((Path(submitted(capfd)["run_dir"]) / "sweep.json").read_text())
    assert data["points"] == [{"lr": "1e-3", "seed": "7"}, {"lr": "0.0003", "seed": "7"}]
    named = run_file(tmp_path, 'nodes = 1\ncommand = ["{lr}"]\n[sweep]\n"x\\n$(id)" = ["1"]\n')
    assert cli.main(["submit", "--file", str(named), "--dry-run"]) == 2
    assert "a sweep's name is letters, digits and _" in capfd.readouterr().err
    bad = run_file(tmp_path, 'nodes = 1\ncommand = ["{lr}"]\n[sweep]\nlr = "1e-3"\n')
    assert cli.main(["submit", "--file", str(bad), "--dry-run"]) == 2
    assert "run.toml:4: sweep.lr = '1e-3': expected a list of values" in capfd.readouterr().err


def test_status_ls_logs_and_cancel_take_a_sweep_as_a_whole_and_each_point_alone(tmp_path, slurm, capfd) -> None:
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1e-3,3e-4,1e-4", "--json", "--", "python", "t.py", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    runs = str(sweep_dir.parent)
    states = {"90_0": "COMPLETED", "90_1": "RUNNING", "90_2": "PENDING"}
    one = " ".join(f'*"-j {job} "*) echo "{state}||ddnode1" ;;' for job, state in states.items())  # squeue -j ID -o %T|%r|%N
    every = "; ".join(f'echo "{job}|{state}"' for job, state in states.items())  # squeue -j ID,ID... -o %i|%T
    fake(slurm, "squeue", f'case "$*" in *%i*) {every} ;; {one} esac')
    (sweep_dir / "1" / "logs" / "slurm-90_1.out").write_text("0: hello from point 1\n")
    assert cli.main(["status", "90", "--runs", runs, "--json"]) == 0
    whole = json.loads(capfd.readouterr().out)
    assert (whole["run_dir"], whole["job_id"], whole["state"]) == (str(sweep_dir), "90", "RUNNING")
    assert [(p["index"], p["values"], p["job_id"]) for p in whole["points"]] == [(0, {"lr": "1e-3"}, "90_0"), (1, {"lr": "3e-4"}, "90_1"),
                                                                                 (2, {"lr": "1e-4"}, "90_2")]  # fmt: skip
    assert cli.main(["status", str(sweep_dir)]) == 0
    text = capfd.readouterr().out
    assert f"sweep {sweep_dir.name}: job array 90, 3 points" in text and "lr=3e-4" in text
    assert cli.main(["status", "90_1", "--runs", runs, "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["run_dir"] == str(sweep_dir / "1")
    assert cli.main(["ls", "--runs", runs, "--json"]) == 0
    rows = json.loads(capfd.readouterr().out)
    assert [(Path(r["run_dir"]).name, r["job_id"], r.get("points"), r.get("values")) for r in rows] == [
        (sweep_dir.name, "90", 3, None), ("0", "90_0", None, {"lr": "1e-3"}), ("1", "90_1", None, {"lr": "3e-4"}), ("2", "90_2", None, {"lr": "1e-4"})]
    assert cli.main(["logs", str(sweep_dir)]) == 0
    assert "== point 1 (lr=3e-4)" in (out := capfd.readouterr().out) and "0: hello from point 1" in out
    assert cli.main(["cancel", str(sweep_dir)]) == 0
    assert calls(slurm, "scancel") == ["scancel 90_1 90_2"]  # the points still waiting or running, by their newest jobs
    assert [e["job_id"] for e in read_record(sweep_dir / "1").events] == ["90_1"]  # the ended point's record says nothing
    assert read_record(sweep_dir / "0").events == []


def test_every_command_submit_suggests_for_a_sweep_follows_it_to_its_end(tmp_path, slurm, monkeypatch, capfd) -> None:
    """The `next:` lines run: `status SWEEP --watch` and `logs SWEEP -f` wait while a point runs (the fake squeue lists
    it on its first call only), end by themselves once every point has ended, exit 0 only when all COMPLETED (else by
    the worst point's state, not the first's) and name the points that did not; `--point I` is that point alone."""
    from ddpack.jobs import logs as job_logs
    from ddpack.jobs import slurm_cli
    from ddpack.jobs import sweep as sweeps

    monkeypatch.setattr(slurm_cli, "SETTLE_S", 0.0)
    monkeypatch.setattr(job_logs, "POLL_STATE_S", 0.0)
    monkeypatch.setattr(sweeps, "FOLLOW_POLL_S", 0.0)
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2,3", "--", "python", "t.py", "{lr}"]) == 0
    out = capfd.readouterr().out
    suggested = [line.split()[1:] for line in out[out.index("next:") :].splitlines()[1:]]
    sweep_dir = Path(suggested[0][1])
    assert [words[0] for words in suggested] == ["status", "logs", "cancel"] and suggested[0][2:] == ["--watch"] and suggested[1][2:] == ["-f"]
    logs = [sweep_dir / str(i) / "logs" / f"slurm-90_{i}.out" for i in range(3)]
    logs[0].write_text("ddpack: the step completed (exit 0)\n")
    write_decisions(sweep_dir / "0", [started(100, "90_0", slurm_job="124", log_at=0), step_end(110, "completed", "the step completed (exit 0)", "90_0")])
    logs[1].write_text("slurmstepd: error: *** JOB 125 ON n1 CANCELLED AT 2026-11-26T10:05:00 DUE TO TIME LIMIT ***\n")
    write_decisions(sweep_dir / "1", [started(100, "90_1", slurm_job="125", log_at=0)])
    logs[2].write_text("0: starting\n")
    write_decisions(sweep_dir / "2", [started(100, "90_2", slurm_job="126", log_at=0)])
    ended = "ddpack: the step failed (exit 1); not requeueing: a setting's error\n"
    failed = tmp_path / "point-2-ends.jsonl"  # its decision, appended when it ends
    failed.write_text(json.dumps(step_end(120, "end", ended.removeprefix("ddpack: ").strip(), "90_2", slurm_job="126", reason="failed", code=1)) + "\n")
    counter = tmp_path / "squeue-calls"
    # Point 2 runs until squeue's first answer has been read; then it writes its last lines and its decision, and Slurm forgets it.
    fake(slurm, "squeue", f'echo x >>{counter}; [ "$(wc -l <{counter})" -le 1 ] && {{ echo "90_2|RUNNING"; exit 0; }}; '
                          f'grep -q step {logs[2]} || {{ printf "0: step 1\\n%s\\n" {json.dumps(ended.strip())} >>{logs[2]}; '
                          f"cat {failed} >>{sweep_dir / '2' / 'decisions.jsonl'}; }}")  # fmt: skip
    assert cli.main([*suggested[0], "--interval", "0"]) == 6  # FAILED, point 2's: the worst, though point 1 (TIMEOUT) came first
    out = capfd.readouterr().out
    assert "1 RUNNING" in out.splitlines()[0] and len(counter.read_text().splitlines()) >= 2
    assert "2 of 3 points did not complete: 1 (lr=2) TIMEOUT, 2 (lr=3) FAILED" in out and "0 (lr=1)" not in out.splitlines()[-1]
    assert f"ddpack resubmit {sweep_dir} --failed" in out
    counter.unlink()
    logs[2].write_text("0: starting\n")  # the sweep as it was before the watch: point 2 running, nothing settled
    for summary in sweep_dir.glob("*/summary.json"):
        summary.unlink()
    assert cli.main(suggested[1]) == 6
    out = capfd.readouterr().out
    Path("/tmp/o57").write_text(out)
    assert "== point 2 (lr=3)" in out and "0: starting" in out and "[2] 0: step 1\n" in out and f"[2] {ended}" in out
    assert out.rstrip().endswith(f"ddpack resubmit {sweep_dir} --failed queues them again")
    assert cli.main(["logs", str(sweep_dir), "-f", "--point", "0"]) == 0 and "the step completed" in capfd.readouterr().out
    assert cli.main(["status", "90", "--runs", str(sweep_dir.parent), "--point", "1", "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["run_dir"] == str(sweep_dir / "1")
    assert cli.main(["status", str(sweep_dir), "--point", "3"]) == 2 and "has points 0 to 2" in capfd.readouterr().err
    assert cli.main(suggested[2]) == 2 and "every point of the sweep" in capfd.readouterr().err  # all ended: nothing to cancel


def test_resubmit_failed_queues_exactly_the_failed_points_again_as_one_array(tmp_path, slurm, capfd) -> None:
    """FAILED (Slurm's NODE_FAIL too) and TIMEOUT points, one sbatch --array=I,J (the sweep's %limit kept), each point's
    own folder continuing; the COMPLETED and CANCELLED points untouched; --state picks other states."""
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2,3,4", "--sweep-parallel", "2", "--json", "--", "python", "t.py", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    write_decisions(sweep_dir / "0", [started(100, "90_0", slurm_job="124", log_at=0), step_end(110, "completed", "the step completed (exit 0)", "90_0")])
    (sweep_dir / "1" / "logs" / "slurm-90_1.out").write_text("slurmstepd: error: *** JOB 125 ON n1 CANCELLED AT 2026-11-26T10:05:00 DUE TO TIME LIMIT ***\n")
    write_decisions(sweep_dir / "1", [started(100, "90_1", slurm_job="125", log_at=0)])
    fake(slurm, "squeue", 'case "$*" in *%i*) echo "90_2|NODE_FAIL"; echo "90_3|CANCELLED" ;; *"-j 90_2 "*) echo "NODE_FAIL||n1" ;; '
                          '*"-j 90_3 "*) echo "CANCELLED||n1" ;; esac')  # fmt: skip
    assert cli.main(["resubmit", str(sweep_dir)]) == 2 and "resubmit --failed (or --state S,...)" in capfd.readouterr().err
    fake(slurm, "sbatch", "echo 95")
    assert cli.main(["resubmit", str(sweep_dir), "--failed", "--time", "30"]) == 0
    assert "resubmit: job array 95 queues points 1, 2 of the sweep" in capfd.readouterr().out
    assert queued(slurm)[1:] == [f"sbatch --parsable --export={','.join(LOGIN_ENV)} --array=1,2%2 --time=30 {sweep_dir}/job/ddpack.sbatch"]
    assert [[job.job_id for job in read_record(sweep_dir / str(i)).jobs] for i in range(4)] == [["90_0"], ["90_1", "95_1"], ["90_2", "95_2"], ["90_3"]]
    assert json.loads((sweep_dir / "sweep.json").read_text())["resubmits"] == [{"job_id": "95", "points": [1, 2], "changes": {"time_limit": "30"}}]
    fake(slurm, "sbatch", "echo 96")
    fake(slurm, "squeue", 'case "$*" in *%i*) echo "90_3|CANCELLED" ;; *"-j 90_3 "*) echo "CANCELLED||n1" ;; esac')
    assert cli.main(["resubmit", str(sweep_dir), "--state", "cancelled", "--json"]) == 0
    assert json.loads(capfd.readouterr().out) == {"run_dir": str(sweep_dir), "job_id": "96", "points": [3]}
    assert cli.main(["resubmit", str(sweep_dir), "--state", "RUNNING"]) == 2 and "--state RUNNING: expected states a point ends in" in capfd.readouterr().err
    fake(slurm, "squeue", 'case "$*" in *%i*) echo "95_1|RUNNING"; echo "95_2|RUNNING"; echo "96_3|PENDING" ;; esac')
    assert cli.main(["resubmit", str(sweep_dir), "--failed"]) == 2 and "no point of the sweep" in capfd.readouterr().err
    assert cli.main(["resubmit", str(sweep_dir / "0"), "--failed"]) == 2 and "--failed and --state pick a sweep's points" in capfd.readouterr().err
    assert len(queued(slurm)) == 3  # the sweep, --failed's array, --state's


def test_resubmit_of_a_point_is_its_element_of_the_sweeps_array(tmp_path, slurm, capfd) -> None:
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2", "--json", "--", "python", "t.py", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    fake(slurm, "squeue", "exit 0")
    fake(slurm, "sbatch", "echo 95")
    assert cli.main(["resubmit", str(sweep_dir / "1"), "--time", "30", "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["job_id"] == "95_1"
    assert calls(slurm, "sbatch")[-1].startswith("sbatch --parsable --export=") and " --array=1 --time=30 " in calls(slurm, "sbatch")[-1]
    assert [job.job_id for job in read_record(sweep_dir / "1").jobs] == ["90_1", "95_1"]


def test_the_experiments_bench_runs_and_prints_its_figures(tmp_path) -> None:
    """bench/bench_experiments.py, small (one round, 20 runs): it runs, and prints the figures it is for."""
    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_experiments.py"
    small = ["--rounds", "1", "--runs", "20", "--big-runs", "3", "--points", "2", "--point-mb", "0.05", "--live", "3", "--compare-rounds", "1"]
    out = subprocess.run([sys.executable, str(bench), *small], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "the sweep's own work beyond one submit:" in out.stdout and "ls, squeue lists none" in out.stdout, out.stdout
    assert "ls, cold (summaries written)" in out.stdout and "ls, warm" in out.stdout, out.stdout
    assert "ls, 3 live of 20" in out.stdout and "export SWEEP --summary" in out.stdout, out.stdout
    assert "compare SWEEP, first" in out.stdout and "compare SWEEP, again" in out.stdout, out.stdout
    assert "export SWEEP --summary, first" in out.stdout and "the first compare's CPU" in out.stdout, out.stdout


def test_compare_of_a_sweep_is_one_row_a_point_with_its_values_sortable(tmp_path, slurm, capfd) -> None:
    from test_lifecycle import end, progress, start

    from train import run_folder

    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1e-3,3e-4", "--sweep", "bs=8,16", "--json", "--", "python", "t.py", "{lr}", "{bs}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    fake(slurm, "squeue", "exit 0")
    for index, loss in enumerate((0.5, 0.2, 0.9, 0.1)):
        records = [start(100, 0), {**progress(101, 10), "loss": loss, "samples_per_s": 100.0 * (index + 1)},
                   {"time": 101.5, "kind": "eval", "global_step": 10, "eval_loss": loss + 1}, end(102, 10, "done", 0)]  # fmt: skip
        (sweep_dir / str(index) / run_folder.METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.main(["compare", str(sweep_dir), "--json", "--sort", "eval_loss"]) == 0
    result = json.loads(capfd.readouterr().out)
    assert result["names"] == ["lr", "bs"] and result["html"] is None
    assert [(r["index"], r["lr"], r["bs"], r["state"], r["train_loss"], r["eval_loss"]) for r in result["points"]] == [
        (3, "3e-4", "16", "COMPLETED", 0.1, 1.1), (1, "1e-3", "16", "COMPLETED", 0.2, 1.2), (0, "1e-3", "8", "COMPLETED", 0.5, 1.5),
        (2, "3e-4", "8", "COMPLETED", 0.9, 1.9)]  # fmt: skip
    page = tmp_path / "sweep.html"
    assert cli.main(["compare", "90", "--runs", str(sweep_dir.parent), "--sort", "samples_per_s", "--reverse", "--html", str(page)]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["point", "lr", "bs", "state"] and [line.split()[0] for line in lines[1:5]] == ["3", "2", "1", "0"]
    assert f"compare: wrote {page}" in lines and page.read_text().count("data:image/png;base64,") == 1
    assert lines[-1].startswith("  not allocated:")  # the sweep's node-hour ledger closes the table
    assert cli.main(["compare", str(sweep_dir), "--sort", "speed"]) == 2 and "--sort speed: expected one of index, lr, bs" in capfd.readouterr().err
    assert cli.main(["compare", str(sweep_dir), str(sweep_dir / "3"), "--json"]) == 0  # with another run: what differed
    assert json.loads(capfd.readouterr().out)["differ"]["sweep.lr"] == ["1e-3", "1e-3", "3e-4", "3e-4", "3e-4"]


def test_a_points_own_records_settle_its_state_once_slurm_has_forgotten_it(tmp_path, slurm, capfd) -> None:
    """A point's records name it as ddpack knows it (90_1) and as Slurm numbers it (125); its log holds Slurm's cancel."""
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2", "--json", "--", "python", "t.py", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    fake(slurm, "squeue", "exit 0")  # MinJobAge later: Slurm lists neither point
    write_decisions(sweep_dir / "0", [started(100, "90_0", slurm_job="124", log_at=0), step_end(110, "completed", "the step completed (exit 0)", "90_0")])
    write_decisions(sweep_dir / "1", [started(100, "90_1", slurm_job="125", log_at=0)])
    cancel = "slurmstepd: error: *** JOB 125 ON ddnode1 CANCELLED AT 2026-11-26T10:05:00 DUE TO TIME LIMIT ***\n"
    (sweep_dir / "1" / "logs" / "slurm-90_1.out").write_text("0: step 1\n" + cancel)
    assert cli.main(["status", str(sweep_dir), "--json"]) == 0
    points = json.loads(capfd.readouterr().out)["points"]
    assert [(p["state"], p["segments"][0]["began"] is not None) for p in points] == [("COMPLETED", True), ("TIMEOUT", True)]


# --------------------------------------------------------------------------- jobs started by hand with a template


def test_a_job_started_by_hand_with_a_template_is_known_to_status_logs_and_cancel(tmp_path, slurm, monkeypatch, capfd) -> None:
    """The template's lock step (enroot/ddpack_records.py, as the job runs it) leaves runs/<name>-<job>/run.json naming the
    job, its log (Slurm's StdOut, in the submission folder's logs/) and script; `ddpack status/logs/cancel JOB` typed in
    the submission folder find it. A later job continuing it is appended; a run `ddpack submit` made is left alone."""
    from ddpack.job_side import module

    def hand_made(run_dir: Path, job: str) -> None:  # as the job's setup does it: Slurm read once, before the lock
        facts = module("ddpack_slurm").JobFacts(job)
        module("ddpack_records").record_hand_made(run_dir, job, environ, log=facts.field("StdOut"), script=facts.field("Command"))

    submitted_from = tmp_path / "project"
    (submitted_from / "logs").mkdir(parents=True)
    script = submitted_from / "pyxis-per-task.sbatch"
    script.write_text("#!/bin/bash\n")
    log = submitted_from / "logs" / "ddpack-77.out"
    log.write_text("ddpack: job 77 (restart 0) on ddnode[1-2], run dir x (new run), at 2026-11-26T10:00:00+0000\n0: hello\n")
    fake(slurm, "scontrol", f'echo "   Command={script}"; echo "   StdOut={log}"')
    run_dir = submitted_from / "runs" / "ddpack-77"
    run_dir.mkdir(parents=True, mode=0o700)
    environ = {"DDPACK_SQSH": "/fsx/images/x.sqsh", "DDPACK_COMMAND": '["python", "ddp.py"]', "DDPACK_JOB_TOKEN": "s3cr3t"}
    hand_made(run_dir, "77")
    record = read_record(run_dir)
    assert [(j.job_id, j.how, j.log) for j in record.jobs] == [("77", "template", str(log))] and record.command == ["python", "ddp.py"]
    assert "s3cr3t" not in (run_dir / "run.json").read_text() and record.settings["exported"]["DDPACK_SQSH"] == "/fsx/images/x.sqsh"
    monkeypatch.chdir(submitted_from)
    squeue_running = 'case "$*" in *%i*) echo "77|RUNNING" ;; *) echo "RUNNING|None|ddnode[1-2]" ;; esac'
    fake(slurm, "squeue", squeue_running)
    assert cli.main(["status", "77", "--json"]) == 0
    assert (now := json.loads(capfd.readouterr().out))["run_dir"] == str(run_dir) and now["state"] == "RUNNING"
    assert cli.main(["logs", "77"]) == 0 and "0: hello" in capfd.readouterr().out
    assert cli.main(["resubmit", "77"]) == 2 and "started by hand with a template" in capfd.readouterr().err
    assert cli.main(["cancel", "77"]) == 0 and calls(slurm, "scancel") == ["scancel 77"]
    hand_made(run_dir, "78")  # sbatch --export=ALL,DDPACK_RUN_DIR=... continues it
    hand_made(run_dir, "78")  # its requeue: the same job, not again
    assert [(j.job_id, j.attempt) for j in read_record(run_dir).jobs] == [("77", 1), ("78", 2)]
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    made = settings(tmp_path)
    assert cli.main(["submit", str(tmp_path), "--nodes", "1", "--runs", str(made.runs), "--sqsh", str(made.sqsh), "--mounts", made.mounts, "--json"]) == 0
    ours = Path(submitted(capfd)["run_dir"])
    before = (ours / "run.json").read_text()
    hand_made(ours, "91")  # the job of a submit: its record is submit's
    assert (ours / "run.json").read_text() == before


# --------------------------------------------------------------------------- the job's decisions as records (issue 48)


def test_the_job_records_each_decision_beside_its_sentence(tmp_path) -> None:
    """The job's program says each decision in a sentence for people and appends the record ddpack status reads (one
    JSON line, enroot/ddpack_records.py); a sweep's point is recorded as ddpack knows it, <array>_<index>."""
    from train import run_folder

    helper = Path(__file__).resolve().parents[1] / "enroot" / "ddpack-job.sh"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\n")  # a requeue Slurm accepts; no nodes listed
    (bin_dir / "scontrol").chmod(0o755)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = (f'. "{helper}"; ddpack_record start nodes=x; ddpack_recording=1; '  # recorded once the run folder is the job's (its lock)
              'ddpack_record start nodes="ddnode[1-2]" origin="new run" kind=forged time=0; '
              'ddpack_step=(sh -c "exit 138" _); ddpack_train x')  # fmt: skip
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "DDPACK_RUN_DIR": str(run_dir), "SLURM_JOB_ID": "125"}
    env |= {"SLURM_ARRAY_JOB_ID": "90", "SLURM_ARRAY_TASK_ID": "1", "DDPACK_STANDBYS": "0"}
    out = subprocess.run(["bash", "-uc", script], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 138 and out.stdout == "ddpack: preempted (exit 138); requeueing job 125 (restart 1 of at most 10)\n", out.stderr
    start, recovery, decision = (json.loads(line) for line in (run_dir / run_folder.DECISIONS).read_text().splitlines())
    assert (recovery["kind"], recovery["mode"], recovery["standbys"]) == ("recovery", "restart", 0)  # which recovery, for status
    assert (start["kind"], start["job"], start["slurm_job"], start["nodes"]) == ("start", "90_1", "125", "ddnode[1-2]")
    assert start["time"] > 1e9 and "is not NAME=VALUE of a field of its own" in out.stderr  # kind=, time=: the record's own
    assert (decision["kind"], decision["verdict"], decision["reason"], decision["exit"]) == ("step-end", "requeue", "preempted", "138")
    assert os.stat(run_dir / run_folder.DECISIONS).st_mode & 0o077 == 0
    from ddpack.job_side import module

    assert module("ddpack_records").DECISIONS == run_folder.DECISIONS and module("ddpack_records").RUN_RECORD == run_folder.RUN_RECORD
    # tests/job_records.py, which the status tests' run folders are written with, spells the records as the job does
    assert set(start) == set(started(0, "90_1")) and set(decision) == set(step_end(0, "requeue", "x"))


def test_a_start_records_where_it_began_in_the_jobs_log(tmp_path) -> None:
    """The job's start record says how long its log was when it began (`log_at`): `ddpack status` places Slurm's own
    cancel line, which no record holds, after the start it ended by that, not by a clock or a sentence."""
    from train import run_folder

    helper = Path(__file__).resolve().parents[1] / "enroot" / "ddpack-job.sh"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("scontrol", "squeue"):  # Slurm knows no other job, and no log to narrow
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "slurm-7.out"
    log.write_text("the lines of the start before\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_RESTART_COUNT": "1"}
    with log.open("a") as out:
        done = subprocess.run(["bash", "-c", f'. "{helper}"; ddpack_setup x'], stdout=out, stderr=subprocess.PIPE, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    first = json.loads((tmp_path / "runs" / "x-7" / run_folder.DECISIONS).read_text().splitlines()[0])
    assert first["log_at"] == len("the lines of the start before\n") and set(first) == set(started(0, "7", log_at=0))


def test_one_job_state_table_for_the_jobs_cleanup_and_every_verb() -> None:
    """The job helper's table is the host's: the states its cleanup takes as over are the ones the verbs take as ended,
    and each ended state has its exit status."""
    from ddpack.job_side import module
    from ddpack.jobs import slurm_cli

    assert slurm_cli.JOB_STATES is module("ddpack_slurm").JOB_STATES
    assert slurm_cli.OVER == module("ddpack_slurm").OVER and set(slurm_cli.EXIT_FOR_STATE) == set(slurm_cli.ENDED)
    assert slurm_cli.ddpack_state("NODE_FAIL") == "FAILED" and slurm_cli.ddpack_state("CANCELLED by 1001") == "CANCELLED"
    assert not set(slurm_cli.LIVE) & set(slurm_cli.ENDED) and set(slurm_cli.LIVE) <= set(slurm_cli.JOB_STATES.values())


def test_status_reads_the_jobs_records_not_its_sentences(tmp_path, slurm) -> None:
    """A log whose sentences say nothing ddpack knows (reworded, translated): the records alone give the segments, why
    each began, and the end once Slurm has forgotten the job."""
    from test_lifecycle import end, progress, start

    from ddpack.jobs.status import run_status
    from train import run_folder

    run_dir = make_run(tmp_path, records=[start(100, 0), progress(101, 10), end(102, 10, "stopped", 138), start(130, 10, 1), progress(131, 20)],
                       logs={"41": "ddpack: job 41 hat begonnen\n[rank 0/4] step 10\nddpack: unterbrochen\nddpack: job 41 wieder da\n"})  # fmt: skip
    records = [
        {"time": 99.0, "kind": "start", "job": "41", "slurm_job": "41", "restart": 0},
        {"time": 103.0, "kind": "step-end", "job": "41", "slurm_job": "41", "restart": 0, "verdict": "requeue", "reason": "preempted",
         "exit": "138", "text": "preempted (exit 138); requeueing job 41 (restart 1 of at most 10)"},
        {"time": 129.0, "kind": "start", "job": "41", "slurm_job": "41", "restart": 1},
    ]
    (run_dir / run_folder.DECISIONS).write_text("".join(json.dumps(r) + "\n" for r in records))
    fake(slurm, "squeue", "exit 0")  # Slurm has forgotten the job
    now = run_status(run_dir)
    assert [(s["number"], s["why"]) for s in now.segments] == [(1, "submitted"), (2, "preempted (exit 138); requeueing job 41 (restart 1 of at most 10)")]
    assert now.state == "FAILED"  # no end record, no verdict that ends it: Slurm forgot a job still to finish
    with (run_dir / run_folder.DECISIONS).open("a") as handle:
        handle.write(json.dumps({"time": 140.0, "kind": "step-end", "job": "41", "restart": 1, "verdict": "completed", "reason": "done",
                                 "exit": "0", "text": "reworded: all done"}) + "\n")  # fmt: skip
    assert (run_status(run_dir).state, run_status(run_dir).state_from) == ("COMPLETED", "job records")


def test_a_job_without_records_is_named_and_slurms_cancel_stays_where_the_log_has_it(tmp_path, slurm, monkeypatch) -> None:
    """A run an older ddpack started (its job's log only, no records) continued by a job that records its decisions:
    both jobs' metrics segments count, the older job's sentences are not read (it is named, in one line, as a job
    without records). Slurm's cancel line (the cluster's local time) is placed by where it is in the log against the
    start record's `log_at`, not by a clock: read in any time zone, the second job's time limit ends the run as TIMEOUT."""
    from test_lifecycle import progress, start

    from ddpack.jobs.status import run_status

    run_dir = make_run(tmp_path, jobs=("41", "57"), records=[start(100, 0), progress(101, 10), start(200, 10, 0), progress(201, 20)],
                       logs={"41": "ddpack: job 41 (restart 0) on n1, run dir x (new run), at 1970-01-01T00:01:40+0000\n"
                                    "ddpack: the step failed (exit 1); restarting it in this allocation on n1 from its last snapshot (1)\n",
                             "57": "ddpack: job 57 (restart 0) on n1, run dir x (continuing), at 1970-01-01T00:03:20+0000\n"
                                    "slurmstepd: error: *** JOB 57 ON n1 CANCELLED AT 1970-01-01T05:10:00 DUE TO TIME LIMIT ***\n"})  # fmt: skip
    write_decisions(run_dir, [started(199.0, "57", log_at=0)])
    fake(slurm, "squeue", "exit 0")
    for zone in ("UTC", "Asia/Tokyo", "America/New_York"):
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        now = run_status(run_dir)
        assert (now.state, now.unrecorded) == ("TIMEOUT", ["41"]), (zone, now)
        assert [s["why"] for s in now.segments] == ["submitted", "started again (a resubmit)"], now.segments
    monkeypatch.delenv("TZ")
    time.tzset()


# --------------------------------------------------------------------------- Slurm's own options (issue 57)


def test_slurms_own_options_reach_the_script_the_record_and_sbatch_test_only(tmp_path, slurm, capfd) -> None:
    """--account, --qos, --constraint, --reservation, --sbatch-arg (the run file's sbatch list too) and --after RUN[:kind]:
    #SBATCH lines of the script sbatch --test-only checks and sbatch queues, kept in run.json."""
    tested = tmp_path / "tested.sbatch"
    fake(slurm, "sbatch", f'[ "$1" = --test-only ] && {{ cp "$2" "{tested}"; exit 0; }}; echo 73')
    good = settings(tmp_path)
    path = run_file(tmp_path, f'nodes = 1\nruns = "{good.runs}"\nsqsh = "{good.sqsh}"\nmounts = "{good.mounts}"\n'
                              'account = "lab"\nsbatch = ["--mem=0"]\n')  # fmt: skip
    assert cli.main(["submit", "--file", str(path), "--qos", "high", "--constraint", "a100&ib", "--reservation", "maint",
                     "--sbatch-arg", "--comment=first run", "--json"]) == 0  # fmt: skip
    first = Path(submitted(capfd)["run_dir"])
    wanted = ["#SBATCH --account=lab", "#SBATCH --qos=high", "#SBATCH --constraint=a100&ib", "#SBATCH --reservation=maint",
              "#SBATCH --mem=0", '#SBATCH --comment="first run"']  # fmt: skip: a value with a space is quoted, as sbatch needs
    script = (first / "job" / "ddpack.sbatch").read_text()
    assert all(line in script.splitlines() for line in wanted), script
    assert all(line in tested.read_text().splitlines() for line in wanted)
    record = read_record(first).settings
    assert (record["account"], record["qos"], record["constraint"], record["reservation"]) == ("lab", "high", "a100&ib", "maint")
    assert record["sbatch_args"] == ["--mem=0", "--comment=first run"]
    fake(slurm, "sbatch", f'[ "$1" = --test-only ] && {{ cp "$2" "{tested}"; exit 0; }}; echo 74')
    assert cli.main(["submit", "--file", str(path), "--after", f"{first}:any", "--json"]) == 0
    second = Path(submitted(capfd)["run_dir"])
    assert "#SBATCH --dependency=afterany:73" in tested.read_text().splitlines()
    assert (read_record(second).settings["after"], read_record(second).settings["dependency"]) == (f"{first}:any", "afterany:73")
    fake(slurm, "squeue", "exit 0")
    assert cli.main(["resubmit", str(second)]) == 0  # continues now: the dependency (on a job maybe long gone) is dropped
    assert queued(slurm)[-1].endswith(f" --dependency= {second}/job/ddpack.sbatch")
    assert cli.main(["submit", "--file", str(path), "--after", "74", "--dry-run"]) == 0
    assert "#SBATCH --dependency=afterok:74" in capfd.readouterr().out.splitlines()
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2", "--json", "--", "p", "{lr}"]) == 0
    sweep_dir = submitted(capfd)["run_dir"]
    assert cli.main(["submit", "--file", str(path), "--after", f"{sweep_dir}:notok", "--dry-run"]) == 0
    assert "#SBATCH --dependency=afternotok:90" in capfd.readouterr().out.splitlines()  # the array: every point


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (["--sbatch-arg", "--array=0-3"], "--sbatch-arg --array=0-3: ddpack sets --array itself; use a sweep's points (--sweep)"),
        (["--sbatch-arg=-N3"], "--sbatch-arg -N3: ddpack sets -N itself; use --nodes, --spares and --tasks-per-node"),
        (["--sbatch-arg", "--export=ALL"], "--sbatch-arg --export=ALL: ddpack sets --export itself; use --env and --secret"),
        (["--sbatch-arg", "--dependency=afterok:1"], "ddpack sets --dependency itself; use --after RUN[:ok|any|notok]"),
        (["--sbatch-arg", "--account=x"], "ddpack sets --account itself; use --account"),
        (["--sbatch-arg", "mem=0"], "--sbatch-arg 'mem=0': an sbatch option"),
        (["--sbatch-arg", '--comment=say "hi"'], "without a double quote"),
        (["--account", "a b"], "--account 'a b': not a Slurm name"),
        (["--after", "9999:ok"], "--after 9999:ok: job 9999 belongs to no run"),
        (["--after", "9999:soon"], "--after 9999:soon: 9999:soon is neither a run folder nor a job id"),
    ],
)
def test_a_slurm_option_ddpack_owns_or_cannot_be_is_refused_in_one_line(tmp_path, slurm, capfd, extra: list[str], line: str) -> None:
    assert cli.main([*sweep_args(tmp_path), "--dry-run", *extra, "--", "p"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
    assert queued(slurm) == []


# --------------------------------------------------------------------------- care with what cannot be undone (issue 57)


def test_cancel_without_a_run_names_the_newest_and_cancels_nothing_and_rm_refuses_a_live_job(tmp_path, slurm, capfd) -> None:
    run_dir = make_run(tmp_path)
    runs = str(run_dir.parent)
    fake(slurm, "squeue", 'case "$*" in *%i*) echo "41|RUNNING" ;; *) echo "RUNNING||n1" ;; esac')
    assert cli.main(["cancel", "--runs", runs]) == 2
    assert f"cancel names its run: the newest is {run_dir} (job 41); ddpack cancel {run_dir} cancels it" in capfd.readouterr().err
    assert cli.main(["rm", str(run_dir)]) == 2 and "has jobs that may still live: 41 (RUNNING)" in capfd.readouterr().err
    assert calls(slurm, "scancel") == [] and run_dir.is_dir()
    fake(slurm, "squeue", "echo 'sqeue: error: timed out' >&2; exit 1")  # Slurm did not answer: the job may live
    assert cli.main(["rm", "41", "--runs", runs]) == 2 and run_dir.is_dir()
    capfd.readouterr()
    fake(slurm, "squeue", 'case "$*" in *%i*) echo "41|COMPLETED" ;; *) echo "COMPLETED||n1" ;; esac')
    assert cli.main(["rm", "41", "--runs", runs]) == 0 and f"rm: removed {run_dir} (jobs 41)" in capfd.readouterr().out
    assert not run_dir.exists()


def test_a_sweeps_array_is_recorded_first_so_cancel_reaches_points_whose_records_failed(tmp_path, slurm, monkeypatch, capfd) -> None:
    from ddpack.jobs import submit as submitting

    def broken(run_dir, job_id, how, changes=None):  # the points' records cannot be written (a full disk, a quota)
        raise HostError(f"job {job_id} is queued, but recording it failed", code=1)

    from ddpack.errors import HostError

    monkeypatch.setattr(submitting, "record_job", broken)
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2", "--", "p", "{lr}"]) == 1
    (sweep_dir,) = [p.parent for p in (tmp_path / "fsx" / "runs").glob("*/sweep.json")]
    assert json.loads((sweep_dir / "sweep.json").read_text())["job_id"] == "90"
    fake(slurm, "squeue", "exit 0")
    assert cli.main(["cancel", "90", "--runs", str(sweep_dir.parent)]) == 0
    assert calls(slurm, "scancel") == ["scancel 90_0 90_1"]


def test_a_reused_job_id_names_the_newest_run_or_sweep_that_has_it(tmp_path, slurm, capfd) -> None:
    from dataclasses import replace

    from ddpack.jobs.find_runs import resolve_run
    from ddpack.jobs.run_json import write_record

    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 41')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2", "--json", "--", "p", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    runs = sweep_dir.parent
    old = make_run(tmp_path / "fsx")  # a run of an earlier cluster whose job was 41 too, made before the sweep
    assert old.parent == runs
    write_record(replace(read_record(old), created=1.0))
    assert resolve_run("41", runs) == sweep_dir
    write_record(replace(read_record(old), created=4e9))  # now the run is the newer
    assert resolve_run("41", runs) == old


def test_gc_images_removes_only_your_squashfs_files_that_no_run_names(tmp_path, slurm, capfd) -> None:
    run_dir = make_run(tmp_path)
    images = tmp_path / "images"
    kept = Path(read_record(run_dir).sqsh["path"])
    stale = images / "old-0123456789abcdef.sqsh"
    stale.write_bytes(b"hsqs" + b"\0" * 4096)
    (images / "old-0123456789abcdef.sqsh.ddpack.json").write_text("{}")
    shared = images / "theirs.sqsh"
    shared.write_bytes(b"hsqs")
    shared.chmod(0o666)  # others may write it: not a file of yours alone, never touched
    (images / "notes.txt").write_text("x")
    args = ["gc", "--images", str(images), "--runs", str(run_dir.parent)]
    assert cli.main([*args, "--dry-run", "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["would_remove"] == [str(stale)] and stale.exists()
    assert cli.main(args) == 0 and f"gc: removed {stale}" in capfd.readouterr().out
    assert sorted(p.name for p in images.iterdir()) == sorted([kept.name, "theirs.sqsh", "notes.txt"])


# --------------------------------------------------------------------------- finding runs at scale (issue 57)


def test_an_ended_runs_summary_answers_ls_so_its_metrics_and_logs_are_not_read_again(tmp_path, slurm, capfd) -> None:
    from test_lifecycle import end, progress, start

    from ddpack.jobs.run_json import append_job
    from ddpack.jobs.status import SUMMARY
    from train import run_folder

    run_dir = make_run(tmp_path, records=[start(100, 0), progress(101, 10), end(102, 10, "done", 0)])
    runs = str(run_dir.parent)
    fake(slurm, "squeue", 'case "$*" in *%i*) echo "41|COMPLETED" ;; *) echo "COMPLETED||n1" ;; esac')
    assert cli.main(["ls", "--runs", runs, "--json"]) == 0 and json.loads(capfd.readouterr().out)[0]["state"] == "COMPLETED"
    assert not (run_dir / SUMMARY).exists()  # Slurm still lists the job: not yet settled for good
    fake(slurm, "squeue", "exit 0")
    assert cli.main(["ls", "--runs", runs, "--json"]) == 0
    assert (json.loads(capfd.readouterr().out)[0]["state"], json.loads((run_dir / SUMMARY).read_text())["job_id"]) == ("COMPLETED", "41")
    (run_dir / run_folder.METRICS).write_text("")  # were they read again, the run would read FAILED (no end record)
    before = len(calls(slurm, "squeue"))
    assert cli.main(["ls", "--runs", runs]) == 0 and "COMPLETED  step 10/" in capfd.readouterr().out
    assert len(calls(slurm, "squeue")) == before  # no Slurm call for a settled run
    append_job(run_dir, "57", "resubmit")  # a new job: the summary speaks of the old one
    assert cli.main(["ls", "--runs", runs, "--json"]) == 0 and json.loads(capfd.readouterr().out)[0]["job_id"] == "57"
    assert "-j 57 " in calls(slurm, "squeue")[-1]
    # Slurm does not list job 57 and nothing in the folder says how it ended: a guess (FAILED), never kept as settled.
    assert json.loads((run_dir / SUMMARY).read_text())["job_id"] == "41"


def test_ls_filters_and_sorts_and_tags_are_set_at_submit_and_afterwards(tmp_path, slurm, capfd) -> None:
    counter = tmp_path / "jobs"
    fake(slurm, "sbatch", f'[ "$1" = --test-only ] && exit 0; echo x >>{counter}; echo $((72 + $(wc -l <{counter})))')
    made = {}
    for name, tags in (("alpha", ["--tag", "lr=1", "--tag", "team=nlp"]), ("beta", ["--tag", "lr=2"]), ("gamma", [])):
        assert cli.main([*sweep_args(tmp_path), "--name", name, *tags, "--note", f"{name} try", "--json", "--", "p"]) == 0
        made[name] = submitted(capfd)["run_dir"]
    runs = str(Path(made["alpha"]).parent)
    assert read_record(Path(made["alpha"])).tags == {"lr": "1", "team": "nlp"} and read_record(Path(made["alpha"])).note == "alpha try"
    assert "tags" not in read_record(Path(made["alpha"])).settings
    fake(slurm, "squeue", 'case "$*" in *%i*) echo "73|RUNNING"; echo "74|PENDING"; echo "75|RUNNING" ;; esac')

    def names(*args: str) -> list[str]:
        assert cli.main(["ls", "--runs", runs, "--json", *args]) == 0
        return [Path(row["run_dir"]).name.split("-")[0] for row in json.loads(capfd.readouterr().out)]

    assert names() == ["alpha", "beta", "gamma"]
    assert names("--state", "RUNNING") == ["alpha", "gamma"]
    assert names("--tag", "lr=2") == ["beta"] and names("--tag", "lr=1", "--tag", "team=nlp") == ["alpha"]
    assert names("--name", "b*") == ["beta"] and names("--sort", "name", "--reverse") == ["gamma", "beta", "alpha"]
    assert names("--since", "1h") == ["alpha", "beta", "gamma"] and names("--since", "2099-01-01") == []
    assert cli.main(["ls", "--runs", runs, "--since", "yesterday"]) == 2 and "--since yesterday: expected 30m" in capfd.readouterr().err
    assert cli.main(["tag", made["gamma"], "lr=2", "--note", "rerun of beta"]) == 0 and "tags lr=2" in capfd.readouterr().out
    assert cli.main(["tag", made["alpha"], "--rm", "team"]) == 0
    capfd.readouterr()
    assert names("--tag", "lr=2") == ["beta", "gamma"] and read_record(Path(made["gamma"])).note == "rerun of beta"
    assert read_record(Path(made["alpha"])).tags == {"lr": "1"}
    assert cli.main(["ls", "--runs", runs, "--tag", "lr=1"]) == 0 and "#lr=1" in capfd.readouterr().out
    assert cli.main(["tag", made["beta"], "bad key=x"]) == 2 and "expected KEY=VALUE" in capfd.readouterr().err
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=5,6", "--tag", "group=s", "--json", "--", "p", "{lr}"]) == 0
    sweep_dir = submitted(capfd)["run_dir"]
    assert cli.main(["ls", "--runs", runs, "--tag", "group=s", "--json"]) == 0
    assert [row["run_dir"] for row in json.loads(capfd.readouterr().out)] == [sweep_dir, f"{sweep_dir}/0", f"{sweep_dir}/1"]
    assert cli.main(["tag", sweep_dir, "best=yes"]) == 0
    assert json.loads((Path(sweep_dir) / "sweep.json").read_text())["tags"] == {"group": "s", "best": "yes"}
    assert read_record(Path(sweep_dir) / "1").tags == {"group": "s", "best": "yes"}


def test_completion_lists_runs_without_asking_slurm(tmp_path, slurm) -> None:
    run_dir = make_run(tmp_path)
    assert complete(tmp_path, ["ddpack", "status", ""], env={"DDPACK_RUNS": str(run_dir.parent)}) == [str(run_dir), "41"]
    assert calls(slurm, "squeue") == [] and calls(slurm, "sacct") == []


# --------------------------------------------------------------------------- export (issue 57)


def test_export_writes_a_row_a_record_a_row_a_run_and_a_tensorboard_folder_a_run(tmp_path, slurm, capfd) -> None:
    import csv

    from test_lifecycle import end, progress, start

    from train import run_folder

    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1e-3,3e-4", "--tag", "team=nlp", "--json", "--", "p", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    fake(slurm, "squeue", "exit 0")
    for index in (0, 1):
        records = [start(100, 0), {**progress(101, 10), "lr": 0.5, "rank_step_s": [0.1, 0.2]}, progress(102, 20),
                   {"time": 103.0, "kind": "eval", "epoch": 1, "global_step": 20, "eval_loss": 0.3 + index}, end(104, 20, "done", 0)]  # fmt: skip
        (sweep_dir / str(index) / run_folder.METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))
    rows_csv, runs_csv, board = tmp_path / "out" / "records.csv", tmp_path / "out" / "runs.csv", tmp_path / "tb"
    (tmp_path / "out").mkdir()
    assert cli.main(["export", "90", "--runs", str(sweep_dir.parent), "--csv", str(rows_csv), "--summary", str(runs_csv),
                     "--tensorboard", str(board)]) == 0  # fmt: skip
    assert f"export: wrote {rows_csv} (10 rows, a record each)" in capfd.readouterr().out
    rows = list(csv.DictReader(rows_csv.open()))
    assert [(r["point"], r["value.lr"], r["tag.team"], r["kind"], r["global_step"]) for r in rows[:5]] == [
        ("0", "1e-3", "nlp", kind, step) for kind, step in (("start", "0"), ("progress", "10"), ("progress", "20"), ("eval", "20"), ("end", "20"))]
    assert rows[1]["lr"] == "0.5" and "rank_step_s" not in rows[0] and rows[8]["eval_loss"] == "1.3" and rows[8]["value.lr"] == "3e-4"
    summary = list(csv.DictReader(runs_csv.open()))
    assert [(r["value.lr"], r["state"], r["step"], r["eval_loss"]) for r in summary] == [("1e-3", "COMPLETED", "20", "0.3"), ("3e-4", "COMPLETED", "20", "1.3")]
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert sorted(p.name for p in board.iterdir()) == ["lr=1e-3", "lr=3e-4"]
    events = EventAccumulator(str(board / "lr=3e-4"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, pytest.approx(1 / 11)), (20, pytest.approx(1 / 21))]
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("eval/eval_loss")] == [(20, 1.3)] and events.Scalars("train/lr")[0].value == 0.5
    assert cli.main(["export", str(sweep_dir)]) == 2 and "export writes --csv FILE, --summary FILE or --tensorboard DIR" in capfd.readouterr().err


# --------------------------------------------------------------------------- the node-hour ledger (issue 57)


def ledger_run(tmp_path: Path) -> Path:
    """A 2-node run: allocation 1 (0-62 s) fails at step 20 (exit 1), restarts in place from its snapshot at 10, is
    preempted at step 30 and requeued; allocation 2 (100-127 s) resumes from 20 and completes at 40."""
    from test_lifecycle import end, progress, start

    from train import run_folder

    run_dir = make_run(tmp_path, records=[
        start(10, 0), progress(20, 10), {"time": 21.0, "kind": "snapshot", "global_step": 10}, progress(30, 20),
        start(40, 10), progress(50, 20), {"time": 51.0, "kind": "snapshot", "global_step": 20}, progress(60, 30),
        start(105, 20, 1), progress(115, 30), progress(125, 40), end(126, 40, "done", 0)])  # fmt: skip
    decisions = [
        {"time": 0.0, "kind": "start", "job": "41", "nodes": "ddnode[1-2]", "restart": 0},
        {"time": 9.0, "kind": "preflight", "job": "41", "result": "passed"},
        {"time": 35.0, "kind": "step-end", "job": "41", "verdict": "restart", "reason": "failed", "exit": "1"},
        {"time": 62.0, "kind": "step-end", "job": "41", "verdict": "requeue", "reason": "preempted", "exit": "138"},
        {"time": 100.0, "kind": "start", "job": "41", "nodes": "ddnode[1-2]", "restart": 1},
        {"time": 127.0, "kind": "step-end", "job": "41", "verdict": "completed", "reason": "done", "exit": "0"},
    ]
    (run_dir / run_folder.DECISIONS).write_text("".join(json.dumps(d) + "\n" for d in decisions))
    (run_dir / run_folder.PREFLIGHT).write_text(json.dumps({"ok": True, "seconds": 4.0, "failures": [], "warnings": []}))
    return run_dir


def test_the_ledgers_parts_add_up_to_the_allocation_through_a_restart_and_a_preemption(tmp_path, slurm) -> None:
    from dataclasses import replace

    from ddpack.jobs.ledger import run_ledger
    from ddpack.jobs.run_json import write_record

    run_dir = ledger_run(tmp_path)
    write_record(replace(read_record(run_dir), jobs=[replace(read_record(run_dir).jobs[0], submitted=-30.0)]))
    ledger = run_ledger(run_dir, "COMPLETED")
    # Allocation 1, 0-62 s on 2 nodes: startup 0-10, of it the preflight's 4 s (preflight.json; its record at 9), kept
    # 10-21 and 40-51, redone 21-30 and 51-60 (the next segment resumed from the snapshot), the failure
    # 30-35, the restart in place 35-40, the preemption 60-62. Allocation 2, 100-127 s: startup 100-105, kept 105-126,
    # shutdown 126-127.
    assert {part: seconds for part, seconds in ledger.node_s.items() if seconds} == {
        "startup": 2 * (6 + 5), "preflight": 2 * 4, "kept": 2 * (11 + 11 + 21), "redone": 2 * (9 + 9), "failures": 2 * 5, "restarts": 2 * 5,
        "preemptions": 2 * 2, "shutdown": 2 * 1}  # fmt: skip
    assert ledger.allocated_node_s == 2 * (62 + 27) == sum(ledger.node_s.values())
    assert [(a["nodes"], a["began"], a["ended"]) for a in ledger.allocations] == [(2, 0.0, 62.0), (2, 100.0, 127.0)]
    assert (ledger.steps_kept, ledger.steps_redone, ledger.preemptions, ledger.restarts, ledger.requeues) == (40, 20, 1, 1, 1)
    assert (ledger.queue_wait_s, ledger.requeue_wait_s) == (30.0, 38.0)  # beside the allocation, not in it


def test_report_and_compare_show_the_ledger_for_a_run_and_for_a_sweep(tmp_path, slurm, capfd) -> None:
    pytest.importorskip("matplotlib")
    fake(slurm, "squeue", "exit 0")
    run_dir = ledger_run(tmp_path / "a")
    assert cli.main(["report", str(run_dir), "--json"]) == 0
    ledger = json.loads(capfd.readouterr().out)["ledger"]
    assert ledger["allocated_node_hours"] == pytest.approx(178 / 3600) and ledger["node_hours"]["kept"] == pytest.approx(86 / 3600)
    assert cli.main(["report", str(run_dir)]) == 0
    out = capfd.readouterr().out
    assert "node-hours of the run" in out and "0.049 allocated over 2 allocation(s)" in out and "steps redone after a restart" in out
    page = (run_dir / "report.html").read_text()
    assert "<h2 id='ledger'>Node-hours</h2>" in page and "<td>steps kept</td><td>0.02389</td><td>48.3 %</td>" in page
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2", "--json", "--", "p", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    for index in (0, 1):  # point 0 completes as the run above; point 1 the same records, but it ended FAILED
        shutil.rmtree(sweep_dir / str(index) / "logs")
        for name in ("metrics.jsonl", "decisions.jsonl", "preflight.json"):
            shutil.copy(run_dir / name, sweep_dir / str(index) / name)
    failed = (run_dir / "decisions.jsonl").read_text().replace('"completed", "reason": "done"', '"end", "reason": "failed"')
    (sweep_dir / "1" / "decisions.jsonl").write_text(failed)
    (sweep_dir / "1" / "metrics.jsonl").write_text("".join(line for line in (run_dir / "metrics.jsonl").read_text().splitlines(True) if '"end"' not in line))
    assert cli.main(["report", str(sweep_dir), "--json"]) == 0
    total = json.loads(capfd.readouterr().out)["ledger"]
    assert total["allocated_node_hours"] == pytest.approx(2 * 178 / 3600) and total["failed_points"] == 1
    assert total["failed_point_node_hours"] == pytest.approx(178 / 3600) and total["steps_kept"] == 40
    assert cli.main(["compare", str(sweep_dir), "--json"]) == 0
    points = json.loads(capfd.readouterr().out)["points"]
    assert [(p["state"], round(p["node_hours"] * 3600), round(p["kept_node_hours"] * 3600)) for p in points] == [("COMPLETED", 178, 86), ("FAILED", 178, 44)]


def test_a_sweeps_status_reads_a_settled_points_summary_not_its_log(tmp_path, slurm, capfd) -> None:
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2", "--json", "--", "p", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    fake(slurm, "squeue", 'case "$*" in *%i*) echo "90_1|RUNNING" ;; esac')
    write_decisions(sweep_dir / "0", [started(100, "90_0", slurm_job="124", log_at=0), step_end(110, "completed", "the step completed (exit 0)", "90_0")])
    assert cli.main(["status", str(sweep_dir), "--json"]) == 0
    assert [p["state"] for p in json.loads(capfd.readouterr().out)["points"]] == ["COMPLETED", "RUNNING"]
    assert (sweep_dir / "0" / "summary.json").is_file() and not (sweep_dir / "1" / "summary.json").exists()
    (sweep_dir / "0" / "decisions.jsonl").write_text("")  # were it read again, point 0 would not read COMPLETED
    assert cli.main(["status", str(sweep_dir), "--json"]) == 0
    assert [p["state"] for p in json.loads(capfd.readouterr().out)["points"]] == ["COMPLETED", "RUNNING"]
    assert calls(slurm, "squeue")[-1] == "squeue -h -r -t all -j 90_1 -o %i|%T"  # the settled point is not asked about


# --------------------------------------------------------------------------- the seams mended (issue 64)


def mended_sweep(tmp_path: Path, slurm: Path, capfd) -> Path:
    """A 4-point sweep (array 90) whose points 1 (FAILED) and 2 (TIMEOUT) were resubmitted as array 95; point 1's own
    job number (SLURM_JOB_ID) in its records is 125."""
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2,3,4", "--json", "--", "python", "t.py", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    write_decisions(sweep_dir / "1", [started(100, "90_1", slurm_job="125", log_at=0)])
    fake(slurm, "squeue", 'case "$*" in *%i*) echo "90_0|COMPLETED"; echo "90_1|FAILED"; echo "90_2|TIMEOUT"; echo "90_3|RUNNING" ;; '
                          '*"-j 90_1 "*) echo "FAILED||n1" ;; *"-j 90_2 "*) echo "TIMEOUT||n1" ;; esac')  # fmt: skip
    fake(slurm, "sbatch", "echo 95")
    assert cli.main(["resubmit", str(sweep_dir), "--failed"]) == 0
    assert "resubmit: job array 95 queues points 1, 2" in capfd.readouterr().out
    return sweep_dir


def test_after_a_mended_sweep_waits_for_each_points_newest_job_not_the_failed_array(tmp_path, slurm, capfd) -> None:
    """afterok on array 90 could never start (its point 1 FAILED): after the mend it waits for 90_0, 95_1, 95_2, 90_3."""
    sweep_dir = mended_sweep(tmp_path, slurm, capfd)
    assert cli.main([*sweep_args(tmp_path), "--after", str(sweep_dir), "--dry-run", "--", "p"]) == 0
    assert "#SBATCH --dependency=afterok:90_0:95_1:95_2:90_3" in capfd.readouterr().out.splitlines()


def test_a_mends_array_id_and_a_points_own_job_number_name_a_run(tmp_path, slurm, capfd) -> None:
    from ddpack.jobs.find_runs import resolve_run

    sweep_dir = mended_sweep(tmp_path, slurm, capfd)
    runs = sweep_dir.parent
    assert resolve_run("95", runs) == sweep_dir  # what resubmit printed
    assert resolve_run("125", runs) == sweep_dir / "1"  # what Slurm's mail says of 90_1
    assert cli.main(["status", "95", "--runs", str(runs), "--json"]) == 0 and json.loads(capfd.readouterr().out)["run_dir"] == str(sweep_dir)
    assert cli.main(["logs", "125", "--runs", str(runs), "--json"]) == 0 and json.loads(capfd.readouterr().out)["run_dir"] == str(sweep_dir / "1")
    assert cli.main(["status", "126", "--runs", str(runs)]) == 2 and "job 126 belongs to no run" in capfd.readouterr().err


def test_a_sweeps_point_is_not_removed_alone_so_cancel_sweep_still_reaches_every_point(tmp_path, slurm, capfd) -> None:
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2", "--json", "--", "python", "t.py", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    fake(slurm, "squeue", 'case "$*" in *%i*) echo "90_0|COMPLETED"; echo "90_1|RUNNING" ;; *"-j 90_0 "*) echo "COMPLETED||n1" ;; esac')
    for named in (str(sweep_dir / "0"), "90_0"):
        assert cli.main(["rm", named, "--runs", str(sweep_dir.parent)]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"is point 0 of the sweep {sweep_dir}" in err[0] and f"ddpack rm {sweep_dir} removes the whole sweep" in err[0]
    assert (sweep_dir / "0" / "run.json").is_file()
    assert cli.main(["cancel", str(sweep_dir)]) == 0 and calls(slurm, "scancel") == ["scancel 90_1"]


def test_gc_refuses_a_runs_folder_that_is_missing_or_holds_no_run_and_removes_nothing(tmp_path, slurm, capfd) -> None:
    run_dir = make_run(tmp_path)
    images = Path(read_record(run_dir).sqsh["path"]).parent
    (tmp_path / "empty").mkdir()
    for runs, why in ((tmp_path / "rnus", "is not a folder"), (tmp_path / "empty", "holds no run of yours")):
        assert cli.main(["gc", "--images", str(images), "--runs", str(runs)]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--runs {runs} {why}" in err[0] and "would remove every image of yours" in err[0], err
    assert [p.name for p in images.glob("*.sqsh")] == [Path(read_record(run_dir).sqsh["path"]).name]


def test_gc_keeps_every_image_a_live_job_of_yours_names_wherever_its_run_folder_is(tmp_path, slurm, capfd) -> None:
    """A job of a run under another runs folder (its run.json), and one started by hand (its script's text): both live,
    both images kept; the one no run and no live job names goes. squeue failing removes nothing."""
    elsewhere = make_run(tmp_path / "other")  # a run gc's --runs does not hold
    images = tmp_path / "images"
    images.mkdir()
    kept_by_run = images / "run-0123.sqsh"
    shutil.move(read_record(elsewhere).sqsh["path"], kept_by_run)
    record = json.loads((elsewhere / "run.json").read_text())
    (elsewhere / "run.json").write_text(json.dumps({**record, "sqsh": {**record["sqsh"], "path": str(kept_by_run)}}))
    kept_by_script, stale = images / "by-hand.sqsh", images / "stale.sqsh"
    for path in (kept_by_script, stale):
        path.write_bytes(b"hsqs")
    script = tmp_path / "by-hand.sbatch"
    script.write_text(f"#!/bin/bash\nexport DDPACK_SQSH={kept_by_script}\n")
    runs = make_run(tmp_path / "mine").parent  # gc's own runs folder, holding one run of an image elsewhere
    fake(slurm, "squeue", f'case "$*" in *"-u "*) echo "77|{elsewhere}|{elsewhere}/job/ddpack.sbatch"; echo "78|{tmp_path}|{script}" ;; esac')
    assert cli.main(["gc", "--images", str(images), "--runs", str(runs), "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["removed"] == [str(stale)]
    assert sorted(p.name for p in images.iterdir()) == ["by-hand.sqsh", "run-0123.sqsh"]
    stale.write_bytes(b"hsqs")
    fake(slurm, "squeue", "echo 'squeue: error: timed out' >&2; exit 1")
    assert cli.main(["gc", "--images", str(images), "--runs", str(runs)]) == 1
    assert "cannot tell which of your jobs live" in capfd.readouterr().err and stale.exists()


def test_a_waiting_run_is_not_called_a_job_of_an_older_ddpack(tmp_path, slurm) -> None:
    """A PENDING job has no log and no records yet: no warning; once Slurm started it (its log exists) and it wrote no
    records, it is named."""
    from test_lifecycle import squeue_says

    from ddpack.jobs.status import render, run_status

    run_dir = make_run(tmp_path)
    squeue_says(slurm, "PENDING")
    now = run_status(run_dir)
    assert (now.state, now.unrecorded) == ("PENDING", []) and "wrote no decision records" not in render(now)
    (run_dir / "logs" / "slurm-41.out").write_text("0: hello\n")
    squeue_says(slurm, "RUNNING")
    assert run_status(run_dir).unrecorded == ["41"]


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["submit", "--after", "41", "--after=42", "--nodes", "1"], "--after is given twice (41, then 42); give it once"),
        (["status", "--runs", "/a", "--runs", "/b"], "--runs is given twice (/a, then /b); give it once"),
        (["resubmit", "41", "--time", "1:00:00", "--time", "2:00:00"], "--time is given twice (1:00:00, then 2:00:00)"),
    ],
)
def test_a_single_valued_option_given_twice_is_refused_in_one_line(tmp_path, slurm, capfd, args: list[str], line: str) -> None:
    assert cli.main(args) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
    assert queued(slurm) == []


def test_a_placeholder_needs_a_sweep_and_a_shell_variable_is_never_one(tmp_path, slurm, capfd) -> None:
    assert cli.main([*sweep_args(tmp_path), "--dry-run", "--", "p", "--lr", "{lr}"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the command uses {lr}, but there is no sweep: add --sweep lr=V1,V2,..., or write {{lr}}" in err[0], err
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 73')
    assert cli.main([*sweep_args(tmp_path), "--json", "--", "p", "--name={{lr}}"]) == 0  # the text {lr}, as in a sweep
    assert read_record(Path(submitted(capfd)["run_dir"])).command == ["p", "--name={lr}"]
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2", "--json", "--", "bash", "-c", "p --lr {lr} --out o-${SLURM_JOB_ID}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    assert read_record(sweep_dir / "1").command == ["bash", "-c", "p --lr 2 --out o-${SLURM_JOB_ID}"]


def test_a_run_files_path_expands_this_shells_variables_or_is_refused(tmp_path, slurm, monkeypatch, capfd) -> None:
    from ddpack.jobs.run_toml import read_run_file

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SCRATCH", str(tmp_path / "scratch"))
    path = run_file(tmp_path, 'nodes = 1\nruns = "$HOME/runs"\nimages = "${SCRATCH}/images"\n')
    assert (read_run_file(path).values["runs"], read_run_file(path).values["images"]) == (tmp_path / "home" / "runs", tmp_path / "scratch" / "images")
    monkeypatch.delenv("NO_SUCH_DDPACK_VAR", raising=False)
    bad = run_file(tmp_path, 'nodes = 1\n\nruns = "$NO_SUCH_DDPACK_VAR/runs"\n')
    assert cli.main(["submit", "--file", str(bad), "--dry-run"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "run.toml:3: runs = '$NO_SUCH_DDPACK_VAR/runs': $NO_SUCH_DDPACK_VAR is not set in this shell" in err[0], err
    assert not list(tmp_path.rglob("$*"))


def killed_run(tmp_path: Path, log: str = "", time_limit: str | None = None) -> Path:
    """A 2-node run whose job started at 100 s, wrote records until 130 s and was killed by Slurm (no decision after)."""
    from dataclasses import replace

    from test_lifecycle import progress, start

    from ddpack.jobs.run_json import write_record

    run_dir = make_run(tmp_path, records=[start(110, 0), progress(120, 10), progress(130, 20)], logs={"41": log} if log else None,
                       decisions=[started(100, slurm_job="41", log_at=0)])  # fmt: skip
    if time_limit:
        write_record(replace(read_record(run_dir), settings={"time_limit": time_limit}))
    return run_dir


def test_a_job_slurm_killed_at_its_time_limit_is_charged_until_slurm_ended_it(tmp_path, slurm) -> None:
    """Slurm's cancel line says when (its local time, this host's); without one, a TIMEOUT ran its whole limit."""
    from ddpack.jobs.ledger import run_ledger

    at = 1_800_000_000  # Slurm's line is to the second, in local time
    line = f"slurmstepd: error: *** JOB 41 ON n1 CANCELLED AT {time.strftime('%Y-%m-%dT%H:%M:%S', time.localtime(at))} DUE TO TIME LIMIT ***\n"
    run_dir = killed_run(tmp_path / "a", log="0: step 20\n" + line)
    decisions = (run_dir / "decisions.jsonl").read_text().replace('"time": 100', f'"time": {at - 600}')
    (run_dir / "decisions.jsonl").write_text(decisions)
    ledger = run_ledger(run_dir, "TIMEOUT")
    assert [(a["began"], a["ended"]) for a in ledger.allocations] == [(at - 600, at)] and ledger.allocated_node_s == 2 * 600
    alone = run_ledger(killed_run(tmp_path / "b", time_limit="10"), "TIMEOUT")  # no line: the start plus its 10 minutes
    assert [(a["began"], a["ended"]) for a in alone.allocations] == [(100.0, 700.0)] and alone.allocated_node_s == 2 * 600
    assert run_ledger(killed_run(tmp_path / "c", time_limit="10"), "CANCELLED").allocations[0]["ended"] == 130.0  # its last record


def test_a_sweeps_ledger_counts_only_ended_points_as_failed(tmp_path, slurm, capfd) -> None:
    from ddpack.jobs.ledger import sweep_ledger

    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2,3", "--json", "--", "p", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    for index in range(3):
        write_decisions(sweep_dir / str(index), [started(100, f"90_{index}", slurm_job=str(124 + index), log_at=0)])
    write_decisions(sweep_dir / "0", [step_end(160, "end", "the step failed (exit 1)", "90_0", reason="failed", code=1)], append=True)
    fake(slurm, "squeue", 'case "$*" in *%i*) echo "90_1|RUNNING"; echo "90_2|PENDING" ;; esac')
    total = sweep_ledger(sweep_dir)
    assert (total.failed_points, total.failed_point_node_s) == (1, 2 * 60.0)


def test_report_without_matplotlib_still_shows_the_ledger(tmp_path, slurm, monkeypatch, capfd) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the host's light install: import matplotlib fails
    run_dir = ledger_run(tmp_path)
    assert cli.main(["report", str(run_dir)]) == 0
    out, err = capfd.readouterr()
    assert "node-hours of the run" in out and "0.049 allocated over 2 allocation(s)" in out
    assert len(err.strip().splitlines()) == 1 and "no page written: report.html needs matplotlib" in err
    assert cli.main(["report", str(run_dir), "--json"]) == 0
    said = json.loads(capfd.readouterr().out)
    assert said["files"] == [] and said["ledger"]["allocated_node_hours"] == pytest.approx(178 / 3600)
    assert not (run_dir / "report.html").exists()


# --------------------------------------------------------------------------- results from any program (issue 64 point 3)


def test_a_sweep_is_ranked_by_any_eval_metric_in_compare_ls_export_and_its_best_point(tmp_path, slurm, capfd) -> None:
    """Points whose programs recorded their own metrics (Lightning's val_loss and val_acc, as its adapter writes
    them): compare sorts and shows them, --best names the winner (highest with --max), ls orders the points under
    their sweep, export --summary carries each as a column; a metric no point has is one line and exit 2."""
    import csv

    from test_lifecycle import end, progress, start

    from train import run_folder

    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2,3", "--json", "--", "python", "t.py", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    fake(slurm, "squeue", "exit 0")
    for index, acc in enumerate((0.5, 0.9, 0.7)):
        evals = [{"time": 101.0, "kind": "eval", "global_step": 5, "epoch": 0, "val_loss": 2.0, "val_acc": 0.1},
                 {"time": 101.5, "kind": "eval", "global_step": 10, "epoch": 1, "val_loss": 1 - acc, "val_acc": acc}]  # fmt: skip
        records = [start(100, 0), progress(101, 10), *evals, end(102, 10, "done", 0)]
        (sweep_dir / str(index) / run_folder.METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.main(["compare", str(sweep_dir), "--json", "--sort", "val_acc", "--reverse"]) == 0
    points = json.loads(capfd.readouterr().out)["points"]
    assert [(p["index"], p["evals"]["val_acc"], p["eval_loss"]) for p in points] == [(1, 0.9, 1 - 0.9), (2, 0.7, 1 - 0.7), (0, 0.5, 0.5)]
    assert cli.main(["compare", str(sweep_dir)]) == 0
    table = capfd.readouterr().out.splitlines()
    assert table[0].split()[:6] == ["point", "lr", "state", "step", "train", "loss"] and "val_acc" in table[0] and "0.9" in table[2].split()
    assert cli.main(["compare", str(sweep_dir), "--best", "val_acc", "--max"]) == 0
    assert capfd.readouterr().out.startswith(
        f"best by val_acc (highest of 3 point(s)): point 1 (lr=2) val_acc 0.9, COMPLETED at step 10; {sweep_dir}/1"
    )
    assert cli.main(["compare", str(sweep_dir), "--best", "eval.val_loss", "--json"]) == 0
    assert json.loads(capfd.readouterr().out)["best"]["index"] == 1
    assert cli.main(["ls", "--runs", str(sweep_dir.parent), "--sort", "val_acc", "--json"]) == 0
    assert [Path(r["run_dir"]).name for r in json.loads(capfd.readouterr().out)] == [sweep_dir.name, "0", "2", "1"]
    assert cli.main(["ls", "--runs", str(sweep_dir.parent), "--sort", "val_acc", "--reverse", "--json"]) == 0
    assert [Path(r["run_dir"]).name for r in json.loads(capfd.readouterr().out)][1:] == ["1", "2", "0"]
    summary = tmp_path / "runs.csv"
    assert cli.main(["export", str(sweep_dir), "--summary", str(summary)]) == 0
    capfd.readouterr()
    assert [(r["point"], r["eval.val_acc"], r["eval.val_loss"]) for r in csv.DictReader(summary.open())] == [
        ("0", "0.5", "0.5"), ("1", "0.9", str(1 - 0.9)), ("2", "0.7", str(1 - 0.7))]  # fmt: skip
    assert cli.main(["compare", str(sweep_dir), "--best", "val_acu"]) == 2
    assert "--best val_acu: expected one of index, lr, state" in capfd.readouterr().err
    assert cli.main(["ls", "--runs", str(sweep_dir.parent), "--sort", "val_acu"]) == 2
    assert (
        "--sort val_acu: expected one of created, name, state, step, loss, or an eval metric a run recorded (val_acc, val_loss)"
        in capfd.readouterr().err
    )
    assert cli.main(["compare", str(sweep_dir), "--max"]) == 2 and "--max goes with --best" in capfd.readouterr().err
    assert cli.main(["compare", str(sweep_dir / "0"), str(sweep_dir / "1")]) == 0  # two runs: a row a metric
    assert [line.split()[2:] for line in capfd.readouterr().out.splitlines() if line.startswith("eval val_acc")] == [["0.5", "0.9"]]


# --------------------------------------------------------------------------- search beyond a grid (issue 64 point 4)


def test_listed_points_are_the_sweep_in_their_order_from_flags_or_a_file(tmp_path, slurm, capfd) -> None:
    """--point twice: those two points, no product; --points FILE (JSON lines): its points, numbers as text."""
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--point", "lr=0.1,bs=32", "--point", "lr=0.01,bs=8", "--json", "--", "p", "{lr}", "{bs}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    data = json.loads((sweep_dir / "sweep.json").read_text())
    assert data["points"] == [{"lr": "0.1", "bs": "32"}, {"lr": "0.01", "bs": "8"}] and data["search"] == {"kind": "list"}
    assert [read_record(sweep_dir / str(i)).command for i in (0, 1)] == [["p", "0.1", "32"], ["p", "0.01", "8"]]
    assert "#SBATCH --array=0-1" in (sweep_dir / "job" / "ddpack.sbatch").read_text()
    listed = tmp_path / "points.jsonl"
    listed.write_text('{"lr": 0.3, "arch": "small"}\n\n{"lr": 3e-4, "arch": "big"}\n{"lr": 1, "arch": "big"}\n')
    assert cli.main([*sweep_args(tmp_path), "--points", str(listed), "--json", "--", "p", "{lr}", "{arch}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    assert json.loads((sweep_dir / "sweep.json").read_text())["points"] == [
        {"lr": "0.3", "arch": "small"}, {"lr": "0.0003", "arch": "big"}, {"lr": "1", "arch": "big"}]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (["--point", "lr=1", "--point", "bs=2", "--", "p", "{lr}"], "point 1 names bs; point 0 names lr: every point gives the same names"),
        (["--point", "lr=1", "--point", "lr=1", "--", "p", "{lr}"], "point 1 is point 0 again"),
        (["--point", "lr=1", "--sweep", "bs=1,2", "--", "p", "{lr}{bs}"], "--point and --points list the points themselves"),
        (["--point", "lr", "--", "p", "{lr}"], "--point lr: expected NAME=VALUE,NAME=VALUE"),
        (["--point", "lr=1", "--", "p", "{lr}", "{bs}"], "the command uses {bs}, which no --sweep gives"),
        (["--sample", "4", "--sweep", "lr=loguniform(1,0.1)", "--", "p", "{lr}"], "loguniform(A,B) needs 0 < A < B"),
        (["--sample", "4", "--sweep", "lr=normal(0,1)", "--", "p", "{lr}"], "expected loguniform(A,B), uniform(A,B) or randint(A,B)"),
        (["--sample", "4", "--", "p"], "--sample N draws from the --sweep names"),
        (["--sample-seed", "4", "--sweep", "lr=1,2", "--", "p", "{lr}"], "--sample-seed goes with --sample N"),
        (["--sample", "1001", "--sweep", "lr=1,2", "--", "p", "{lr}"], "--sample 1001: draw 1 to 1000 points"),
    ],
)
def test_a_point_list_or_random_draw_that_cannot_run_as_meant_is_one_line_and_exit_2(tmp_path, slurm, capfd, extra, line) -> None:
    assert cli.main([*sweep_args(tmp_path), "--dry-run", *extra]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and line in err[0], err
    assert queued(slurm) == []


def test_a_random_search_draws_n_points_from_its_distributions_seeded_and_kept_in_the_sweeps_record(tmp_path, slurm, capfd) -> None:
    """--sample 5: five points, lr from loguniform(1e-4,1e-1), bs a choice, layers randint(2,4) (ends included); the
    seed and the space are in sweep.json; the same seed draws the same points; without one a seed is chosen and said."""
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    args = [*sweep_args(tmp_path), "--sample", "5", "--sweep", "lr=loguniform(1e-4,1e-1)", "--sweep", "bs=16,32", "--sweep", "layers=randint(2,4)"]
    command = ["--", "p", "{lr}", "{bs}", "{layers}"]
    assert cli.main([*args, "--sample-seed", "7", "--json", *command]) == 0
    first = json.loads((Path(submitted(capfd)["run_dir"]) / "sweep.json").read_text())
    assert first["search"] == {"kind": "random", "sample": 5, "seed": 7,
                               "space": {"lr": "loguniform(0.0001,0.1)", "bs": ["16", "32"], "layers": "randint(2,4)"}}  # fmt: skip
    points = first["points"]
    assert len(points) == 5 and all(1e-4 <= float(p["lr"]) <= 1e-1 and p["bs"] in ("16", "32") and p["layers"] in ("2", "3", "4") for p in points)
    assert len({p["lr"] for p in points}) == 5  # drawn, not a grid
    assert cli.main([*args, "--sample-seed", "7", "--json", *command]) == 0
    assert json.loads((Path(submitted(capfd)["run_dir"]) / "sweep.json").read_text())["points"] == points
    assert cli.main([*args, *command]) == 0
    said = capfd.readouterr().out
    seed = int(said.split("drawn with --sample-seed ")[1].split()[0])
    sweep_dir = Path(said.split("sweep folder ")[1].split()[0])
    assert json.loads((sweep_dir / "sweep.json").read_text())["search"]["seed"] == seed


def test_halve_pauses_the_worse_half_at_a_rung_once_every_point_reached_it_and_keeps_its_decisions(tmp_path, slurm, capfd) -> None:
    """Four running points (stand-in squeue); point 3 short of the rung: nothing decided. All at it: the two worse by
    eval_loss are cancelled (the trainer's stop snapshot) and the decision is kept in sweep.json; a second look
    decides nothing again; the paused point continues with resubmit, its own element of the array; another plan is
    refused."""
    from test_lifecycle import start

    from train import run_folder

    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2,3,4", "--json", "--", "python", "t.py", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    fake(slurm, "squeue", 'case "$*" in *%i*) for i in 0 1 2 3; do echo "90_$i|RUNNING"; done ;; *) echo "RUNNING|None|ddnode1" ;; esac')

    def write(index: int, step: int, loss: float) -> None:
        records = [start(100, 0), *({"time": 100.0 + s, "kind": "progress", "global_step": s, "loss": loss} for s in range(5, step + 1, 5)),
                   {"time": 100.0 + step, "kind": "eval", "global_step": step, "eval_loss": loss}]  # fmt: skip
        (sweep_dir / str(index) / run_folder.METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))

    for index, loss in enumerate((0.4, 0.1, 0.3, 0.2)):
        write(index, 20 if index != 3 else 15, loss)
    halve = ["halve", str(sweep_dir), "--rungs", "20,40", "--by", "loss", "--once"]
    assert cli.main(halve) == 0 and capfd.readouterr().out == "" and calls(slurm, "scancel") == []
    write(3, 25, 0.2)
    assert cli.main(halve) == 0
    assert capfd.readouterr().out.startswith("halve: rung 20 by loss (1: 0.1, 3: 0.2, 0: 0.4, 2: 0.3): points 1, 3 go on, 0, 2 paused")
    assert calls(slurm, "scancel") == ["scancel 90_0", "scancel 90_2"]
    (decision,) = json.loads((sweep_dir / "sweep.json").read_text())["halving"]["decided"]
    assert (decision["rung"], decision["kept"], decision["paused"]) == (20, [1, 3], [0, 2])
    assert cli.main([*halve, "--json"]) == 0 and capfd.readouterr().out == "" and len(calls(slurm, "scancel")) == 2  # decided once
    assert cli.main(["halve", str(sweep_dir), "--rungs", "20,40", "--by", "eval_loss", "--once"]) == 2
    assert "this sweep is halved at rungs 20,40 by loss already" in capfd.readouterr().err
    assert cli.main(["halve", str(sweep_dir), "--rungs", "40,20", "--by", "loss"]) == 2
    assert "--rungs 40,20: expected steps in rising order" in capfd.readouterr().err
    fake(slurm, "squeue", "exit 0")
    fake(slurm, "sbatch", "echo 95")
    assert cli.main(["resubmit", str(sweep_dir / "2"), "--json"]) == 0  # a paused point continues: its own folder, its snapshot
    assert json.loads(capfd.readouterr().out)["job_id"] == "95_2" and " --array=2 " in calls(slurm, "sbatch")[-1]


def test_a_point_held_at_a_rung_while_another_waits_for_a_node_is_continued_when_it_wins_and_left_paused_when_it_loses(
    tmp_path, slurm, capfd
) -> None:
    """Three points, one node free: 0 and 1 reach rung 20 while 2 waits in the queue; both are held (paused), the rung
    waits for 2; once 2 reached it, the decision keeps 0 and 2 (lowest loss): held 0 goes on (resume), held 1 stays
    paused, 2 is never touched."""
    from test_lifecycle import start

    from ddpack.jobs import search
    from train import run_folder

    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1,2,3", "--json", "--", "python", "t.py", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])

    def write(index: int, step: int, loss: float) -> None:
        records = [start(100, 0), *({"time": 100.0 + s, "kind": "progress", "global_step": s, "loss": loss} for s in range(5, step + 1, 5))]
        (sweep_dir / str(index) / run_folder.METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))

    states = {"0": "RUNNING", "1": "RUNNING", "2": "PENDING"}
    acted: list[tuple[str, str]] = []
    ready = True

    def look() -> search.HalvePass:
        return search.halve_pass(sweep_dir, search.Halving(rungs=(20, 40), by="loss"), state_of=lambda d: states[d.name],
                                 pause=lambda d: acted.append(("pause", d.name)), resume=lambda d: acted.append(("resume", d.name)) or ready,
                                 now=lambda: 1.0)  # fmt: skip

    write(0, 20, 0.1)
    write(1, 25, 0.5)
    done = look()
    assert (done.held, done.decisions, done.over, acted) == ([0, 1], [], False, [("pause", "0"), ("pause", "1")])
    assert json.loads((sweep_dir / "sweep.json").read_text())["halving"]["held"] == [0, 1]
    states.update({"0": "CANCELLED", "1": "CANCELLED", "2": "RUNNING"})
    write(2, 20, 0.3)
    ready = False  # 0's cancelled job still ending: its resubmit is refused, and tried again at the next look
    done = look()
    assert ([(d["kept"], d["paused"]) for d in done.decisions], done.resumed, done.over) == ([([0, 2], [1])], [], False)
    assert json.loads((sweep_dir / "sweep.json").read_text())["halving"]["waking"] == [0]
    ready = True
    done = look()
    assert (done.decisions, done.resumed) == ([], [0]) and acted[2:] == [("resume", "0"), ("resume", "0")]  # 1 stays paused, 2 untouched
    assert tuple(json.loads((sweep_dir / "sweep.json").read_text())["halving"][key] for key in ("held", "waking")) == ([], [])


# --------------------------------------------------------------- points that share nodes (issue 64 point 2)

SIZED_PARTITIONS = 'echo "debug*|2|idle|gpu:8|64"; echo "small|2|idle|(null)|2"'  # sinfo's %P|%D|%T|%G|%c


@pytest.mark.parametrize(
    ("extra", "shares", "said"),
    [
        ([], (1, 0), "each point asks 1 CPU(s) and 0 GPU(s) of a node with 64 CPUs and 8 GPUs: the points share nodes"),
        (["--sbatch-arg=--gpus-per-task=1", "--tasks-per-node", "2"], (2, 2), "charged 0.25 of a node's hours"),
        (["--sbatch-arg=--cpus-per-task=16", "--tasks-per-node", "4"], None, "asks 64 CPU(s) and 0 GPU(s) of a node with 64 CPUs"),
        (["--gpus-per-node", "8"], None, "asks 8 CPU(s) and 8 GPU(s) of a node with 64 CPUs and 8 GPUs: whole nodes (--exclusive)"),
        (["--partition", "small", "--tasks-per-node", "2"], None, "of a node with 2 CPUs and 0 GPUs: whole nodes (--exclusive)"),
        (["--template", "torchrun"], None, "torchrun starts a node's ranks in one Slurm task"),
    ],
)
def test_a_sweep_point_that_asks_less_than_a_node_shares_nodes_and_a_whole_node_point_stays_exclusive(
    tmp_path, slurm, capfd, extra: list[str], shares: tuple[int, int] | None, said: str
) -> None:
    fake(slurm, "sinfo", f'case "$*" in *--version*) echo "slurm-wlm 22.05.8" ;; *) {SIZED_PARTITIONS} ;; esac')
    assert cli.main([*sweep_args(tmp_path), "--dry-run", *extra, "--sweep", "lr=1,2", "--", "p", "{lr}"]) == 0
    dry = capfd.readouterr().out
    assert said in dry and ("#SBATCH --exclusive" in dry) == (shares is None), dry
    assert cli.main([*sweep_args(tmp_path), *extra, "--sweep", "lr=1,2", "--json", "--", "p", "{lr}"]) == 0
    share = read_record(Path(submitted(capfd)["run_dir"]) / "0").settings["share"]
    assert (share and (share["cpus"], share["gpus"])) == shares or (share is None and shares is None)


def test_a_plain_run_and_a_partition_sinfo_does_not_size_take_whole_nodes(tmp_path, slurm, capfd) -> None:
    assert cli.main([*sweep_args(tmp_path), "--dry-run", "--sweep", "lr=1,2", "--", "p", "{lr}"]) == 0  # sinfo without %c
    assert "sinfo gave no node size for the partition: whole nodes (--exclusive)" in (dry := capfd.readouterr().out)
    assert "#SBATCH --exclusive" in dry
    fake(slurm, "sinfo", f'case "$*" in *--version*) echo "slurm-wlm 22.05.8" ;; *) {SIZED_PARTITIONS} ;; esac')
    assert cli.main([*sweep_args(tmp_path), "--dry-run", "--", "p"]) == 0
    assert "#SBATCH --exclusive" in capfd.readouterr().out


def test_the_ledger_charges_a_point_that_shared_its_nodes_its_share(tmp_path, slurm) -> None:
    from dataclasses import replace

    from ddpack.jobs.ledger import run_ledger
    from ddpack.jobs.run_json import write_record

    run_dir = ledger_run(tmp_path)
    whole = run_ledger(run_dir, "COMPLETED")
    record = read_record(run_dir)
    write_record(replace(record, settings={**record.settings, "share": {"cpus": 1, "gpus": 2, "node_cpus": 64, "node_gpus": 8}}))
    shared = run_ledger(run_dir, "COMPLETED")
    assert shared.allocated_node_s == whole.allocated_node_s / 4 == 2 * (62 + 27) / 4  # its 2 GPUs of each node's 8
    assert shared.node_s == {part: seconds / 4 for part, seconds in whole.node_s.items()}
    assert [a["share"] for a in shared.allocations] == [0.25, 0.25]
    write_record(replace(record, settings={**record.settings, "share": {"cpus": 1, "gpus": 0, "node_cpus": 2, "node_gpus": 2}}))
    assert run_ledger(run_dir, "COMPLETED").allocated_node_s == whole.allocated_node_s / 2  # no GPUs: its CPU of the node's 2


# --------------------------------------------------------------- big runs stay fast (issue 64 point 6)


def test_compare_and_export_summary_read_each_points_metrics_file_once(tmp_path, slurm, capfd, monkeypatch) -> None:
    """Once for status and the ledger together; then never again while the file is unchanged (its digest answers the
    same); a file that grew is read again. Two cores, so that the first reads are made in digest_stale's processes
    (the opens are counted in a file, which they share)."""
    import os
    import pathlib
    from collections import Counter

    from test_lifecycle import end, progress, start

    from train import run_folder

    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1e-3,3e-4", "--json", "--", "p", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    for index in (0, 1):
        records = [start(100, 0), progress(101, 10), {"time": 101.5, "kind": "eval", "global_step": 10, "eval_loss": 1.0}, end(102, 10, "done", 0)]
        (sweep_dir / str(index) / run_folder.METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))
    log = tmp_path / "opened.log"
    real_open = pathlib.Path.open

    class Opened:
        def __eq__(self, other: object) -> bool:
            return Counter(log.read_text().split() if log.exists() else []) == other

        def clear(self) -> None:
            log.unlink(missing_ok=True)

    def counting_open(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.name == run_folder.METRICS:
            with real_open(log, "a") as out:
                out.write(self.parent.name + "\n")
        return real_open(self, *args, **kwargs)

    opened = Opened()
    monkeypatch.setattr(pathlib.Path, "open", counting_open)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    assert cli.main(["compare", str(sweep_dir), "--json"]) == 0
    first = json.loads(capfd.readouterr().out)
    assert [row["eval_loss"] for row in first["points"]] == [1.0, 1.0]
    assert opened == {"0": 1, "1": 1}  # status and the ledger from one read
    opened.clear()
    assert cli.main(["compare", str(sweep_dir), "--json"]) == 0 and json.loads(capfd.readouterr().out) == first
    assert cli.main(["export", str(sweep_dir), "--summary", str(tmp_path / "runs.csv")]) == 0
    assert opened == {} and "(2 rows, a run each)" in capfd.readouterr().out  # unchanged since: each point's digest answers
    with (sweep_dir / "1" / run_folder.METRICS).open("a") as metrics:
        metrics.write(json.dumps(start(200, 10, 1)) + "\n")
    opened.clear()
    assert cli.main(["compare", str(sweep_dir), "--json"]) == 0
    assert opened == {"1": 1} and json.loads(capfd.readouterr().out)["points"][1]["restarts"] == 1  # the file that grew
    opened.clear()
    assert cli.main(["compare", str(sweep_dir), "--json", "--html", str(tmp_path / "page.html")]) == 0
    assert opened == {"0": 1, "1": 1}  # --html's curves are drawn from every record: each file read, once


def test_compare_and_export_summary_ask_slurm_once_for_all_their_runs(tmp_path, slurm, capfd) -> None:
    """One squeue and one sacct for every point of a sweep or every run named (status.asked_for, as a sweep's status
    asks), where each run's status asked both: two processes a point, a third of a second of 100 points. The states
    are Slurm's still: the point squeue lists is RUNNING."""
    from test_lifecycle import squeue_says

    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')
    assert cli.main([*sweep_args(tmp_path), "--sweep", "lr=1e-3,3e-4,1e-4", "--json", "--", "p", "{lr}"]) == 0
    sweep_dir = Path(submitted(capfd)["run_dir"])
    squeue_says(slurm, "RUNNING", job="90_1")
    for argv in (["compare", str(sweep_dir), "--json"], ["compare", str(sweep_dir / "0"), str(sweep_dir / "1"), "--json"],
                 ["export", str(sweep_dir), "--summary", str(tmp_path / "runs.csv")]):  # fmt: skip
        (slurm / "calls.log").unlink(missing_ok=True)
        assert cli.main(argv) == 0
        assert len(calls(slurm, "squeue")) == 1 and len(calls(slurm, "sacct")) == 1, argv
    out = capfd.readouterr().out
    states = [point["state"] for point in json.loads(out[: out.index("\n}\n") + 2])["points"]]
    assert states[1] == "RUNNING" and states.count("RUNNING") == 1, states


def test_the_csv_says_each_records_segment_and_which_steps_a_later_segment_trained_again(tmp_path, slurm, capfd) -> None:
    import csv

    from test_lifecycle import end, progress, start

    run_dir = make_run(tmp_path, records=[start(10, 0), progress(20, 10), progress(30, 20), progress(35, 30),
                                          start(40, 20, 1), progress(50, 30), end(60, 40, "done", 0)])  # fmt: skip
    out = tmp_path / "records.csv"
    assert cli.main(["export", str(run_dir), "--csv", str(out)]) == 0
    rows = [(r["kind"], r["global_step"], r["segment"], r["redone"]) for r in csv.DictReader(out.open())]
    assert rows == [("start", "0", "1", "False"), ("progress", "10", "1", "False"), ("progress", "20", "1", "False"),
                    ("progress", "30", "1", "True"), ("start", "20", "2", "False"), ("progress", "30", "2", "False"),
                    ("end", "40", "2", "False")]  # fmt: skip


def test_ls_of_a_live_run_reads_its_metrics_head_and_tail_not_the_whole_file_nor_its_log(tmp_path, slurm, capfd, monkeypatch) -> None:
    import pathlib

    from test_lifecycle import progress, squeue_says, start

    run_dir = make_run(tmp_path, records=[start(10, 0, total=5000), *(progress(10 + step, step) for step in range(1, 4001))],
                       logs={"41": "x" * 300_000 + "\n"}, decisions=[started(5.0)])  # fmt: skip
    assert (run_dir / "metrics.jsonl").stat().st_size > 4 * 64 * 1024  # past a glance of its head and tail
    squeue_says(slurm, "RUNNING")
    whole: list[str] = []
    real_read_bytes, real_read_text = pathlib.Path.read_bytes, pathlib.Path.read_text
    monkeypatch.setattr(pathlib.Path, "read_bytes", lambda self: whole.append(self.name) or real_read_bytes(self))
    monkeypatch.setattr(pathlib.Path, "read_text", lambda self, *a, **k: whole.append(self.name) or real_read_text(self, *a, **k))
    assert cli.main(["ls", "--runs", str(run_dir.parent), "--json"]) == 0
    (row,) = json.loads(capfd.readouterr().out)
    assert (row["state"], row["step"], row["total_steps"], row["loss"]) == ("RUNNING", 4000, 5000, 1.0 / 4001)  # tail, and head's start
    assert "metrics.jsonl" not in whole and "slurm-41.out" not in whole, whole


# --------------------------------------------------------------- the README's sweep, as written (issue 64 point 7)


def test_the_readmes_sweep_runs_as_written_from_submit_through_status_watch_to_compare(tmp_path, slurm, monkeypatch, capfd) -> None:
    """The README's sweep block, each line as written (the shared folder /fsx is the test's own; Slurm's commands
    stand-ins, the array's id the README's): submit, then `status --watch` follows the newest sweep to its end once
    each point has its records, and `compare 90` sets the points side by side."""
    import re
    import shlex

    from test_lifecycle import end, progress, start

    from ddpack.jobs import slurm_cli
    from testbed.readme_examples import README, readme_line
    from train import run_folder

    fsx = tmp_path / "fsx"
    (fsx / "images").mkdir(parents=True)
    shutil.copyfile(settings(tmp_path).sqsh, fsx / "images" / "cpu-ddp.sqsh")
    monkeypatch.setenv("DDPACK_RUNS", str(fsx / "runs"))
    monkeypatch.setenv("DDPACK_MOUNTS", f"{fsx}:/fsx")
    monkeypatch.setattr(slurm_cli, "SETTLE_S", 0.0)
    monkeypatch.chdir(tmp_path)
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; echo 90')

    def words(prefix: str) -> list[str]:
        return [word.replace("/fsx", str(fsx)) for word in shlex.split(readme_line(prefix))[1:]]

    assert cli.main(words("ddpack submit --sqsh ")) == 0
    said = capfd.readouterr()
    assert "submit: job array 90 queued: 4 points" in said.out, said.out + said.err
    (sweep_dir,) = (fsx / "runs").iterdir()
    data = json.loads((sweep_dir / "sweep.json").read_text())
    assert data["job_id"] == "90" and data["points"] == [{"lr": lr, "bs": bs} for lr in ("1e-3", "3e-3") for bs in ("16", "32")]
    assert read_record(sweep_dir / "3").command == ["python", "-m", "train", "--task", "classification", "--lr", "3e-3", "--batch-size", "32",
                                                    "--epochs", "2"]  # fmt: skip
    for index in range(4):
        steps = 4 * (index + 1)
        accuracy = {"time": 105.0, "kind": "eval", "epoch": 1, "global_step": steps, "eval_loss": 1.0 / (index + 1), "eval_accuracy": 0.25 * index}
        records = [start(100, 0, total=steps), {**progress(101 + index, steps), "loss": 0.5 / (index + 1)}, accuracy, end(110, steps, "done", 0)]
        (sweep_dir / str(index) / run_folder.METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))
        done = step_end(111, "completed", "the step completed (exit 0)", f"90_{index}")
        write_decisions(sweep_dir / str(index), [started(99, f"90_{index}", log_at=0), done])
    assert cli.main([*words("ddpack status --watch"), "--interval", "0"]) == 0
    watched = capfd.readouterr().out
    assert "sweep" in watched and "all 4 points COMPLETED" in watched, watched
    assert cli.main(words("ddpack compare 90")) == 0
    compared = capfd.readouterr().out
    readme_head = re.findall(r"```\n(point .*?)\n", README.read_text())[0]
    assert compared.splitlines()[0].split() == readme_head.split() and "node-hours of the sweep" in compared  # the README's columns
    assert [line.split()[:4] for line in compared.splitlines()[1:5]] == [[str(i), lr, bs, "COMPLETED"] for i, (lr, bs) in enumerate(
        (lr, bs) for lr in ("1e-3", "3e-3") for bs in ("16", "32"))]  # fmt: skip


def test_the_wandb_and_mlflow_recipes_log_each_step_once_with_the_value_the_run_kept(tmp_path, slurm, monkeypatch) -> None:
    """docs/commands.md's recipes, run as written against stand-ins of wandb and mlflow on a run that restarted from
    step 20 after reaching 30: each step logged once, in rising order (W&B drops a step below its current one), step
    30's loss the second segment's, and each step's segment beside it."""
    import types

    from test_lifecycle import end, progress, start

    from testbed.readme_examples import python_block

    run_dir = make_run(tmp_path, records=[start(10, 0), progress(20, 10), progress(30, 20), {**progress(35, 30), "loss": 9.0},
                                          start(40, 20, 1), {**progress(50, 30), "loss": 0.5}, end(60, 30, "done", 0)])  # fmt: skip
    records = tmp_path / "records.csv"
    assert cli.main(["export", str(run_dir), "--csv", str(records)]) == 0
    logged: list[tuple[int, dict]] = []
    wandb = types.ModuleType("wandb")
    run = types.SimpleNamespace(finish=lambda: None)
    wandb.init = lambda **kwargs: run  # type: ignore[attr-defined]
    wandb.log = lambda metrics, step: logged.append((step, metrics))  # type: ignore[attr-defined]
    mlflow = types.ModuleType("mlflow")
    metric_steps: list[tuple[str, int, float]] = []

    class Started:
        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            return None

    mlflow.start_run = lambda **kwargs: Started()  # type: ignore[attr-defined]
    mlflow.log_params = mlflow.set_tags = lambda values: None  # type: ignore[attr-defined]
    mlflow.log_metric = lambda key, value, step: metric_steps.append((key, step, value))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "mlflow", mlflow)
    monkeypatch.setattr(sys, "argv", ["recipe", str(records)])
    exec(compile(python_block("# wandb_import.py"), "wandb_import.py", "exec"), {})
    assert [(step, m["loss"], m["segment"]) for step, m in logged] == [(10, 1 / 11, 1), (20, 1 / 21, 1), (30, 0.5, 2)]
    exec(compile(python_block("# mlflow_import.py"), "mlflow_import.py", "exec"), {})
    losses = [(step, value) for key, step, value in metric_steps if key == "loss"]
    assert losses == [(10, 1 / 11), (20, 1 / 21), (30, 0.5)]
    assert [(step, value) for key, step, value in metric_steps if key == "segment"] == [(10, 1.0), (20, 1.0), (30, 2.0)]


def test_a_runs_digest_answers_as_its_whole_metrics_do_through_restarts(tmp_path, slurm) -> None:
    """A digest keeps a segment's first and last records and the one the next segment resumed at, not every progress
    record: the outcome, the status and the ledger from it are those of the whole file (three segments of 300 steps,
    resumed from steps below where each stopped, by a program that records no snapshots: the progress record at the
    step resumed from dates it)."""
    from test_lifecycle import end, progress, start

    from ddpack.jobs.compare import measured
    from ddpack.jobs.run_metrics import DIGEST

    records, decisions = [], []
    for number, (first, last) in enumerate(((0, 300), (250, 550), (500, 800))):
        began = 1000.0 * number
        decisions += [{"time": began, "kind": "start", "job": "41", "nodes": "ddnode[1-2]", "restart": number}]
        records += [start(began + 5, first, number, total=800)]
        records += [{**progress(began + 5 + step - first, step), "samples_per_s": float(step % 17), "mfu": step / 1e4} for step in range(first + 1, last + 1)]
        verdict = "completed" if number == 2 else "restart"
        decisions += [{"time": began + 10 + last - first, "kind": "step-end", "job": "41", "verdict": verdict, "reason": "done" if number == 2 else "failed"}]
    records.append(end(2306, 800, "done", 0))
    run_dir = make_run(tmp_path, records=records, decisions=decisions)
    whole = measured(run_dir, curves=True)
    digested = measured(run_dir, curves=False)
    assert (run_dir / DIGEST).is_file() and len(json.loads((run_dir / DIGEST).read_text())["records"]) < len(records) / 3
    again = measured(run_dir, curves=False)  # from the digest file now
    assert whole[0] == digested[0] == again[0] and whole[0].restarts == 2 and whole[0].step == 800
    assert whole[2].node_s == again[2].node_s and whole[2].steps_redone == again[2].steps_redone == 100


def test_compares_status_of_a_point_from_its_one_read_has_its_eval_metrics(tmp_path, slurm) -> None:
    """The status compare builds from its one read (status.tail_of) carries the eval metrics, as one read from the
    file does."""
    from test_lifecycle import end, progress, start

    from ddpack.jobs.run_metrics import read_run
    from ddpack.jobs.status import run_status, tail_of

    evals = {"time": 21.0, "kind": "eval", "global_step": 10, "val_acc": 0.75}
    run_dir = make_run(tmp_path, records=[start(10, 0), progress(20, 10), evals, end(30, 10, "done", 0)])
    assert run_status(run_dir, records=tail_of(read_run(run_dir).segments)).evals == run_status(run_dir).evals == {"val_acc": 0.75}
