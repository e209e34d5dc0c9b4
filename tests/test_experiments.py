"""Experiments (issue 49): a run file beside the code, an explicit environment, secrets in no file, a resubmit that
may change the time, nodes or partition, and shell completion written from the parser. Against the fake Slurm
commands of tests/test_lifecycle.py; the cluster tier submits a run file, a secret and a leaking shell for real
(tests/test_lifecycle_cluster.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_lifecycle import calls, fake, fake_slurm, make_run, queued, settings

from ddpack import cli
from ddpack.run_record import read_record
from ddpack.submit import LOGIN_ENV


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

    from ddpack.run_record import write_record

    fake(slurm, "squeue", "exit 0")  # neither job is listed: the run folders say how they ended
    done = [start(100, 0), progress(101, 10), progress(102, 20), end(103, 20, "done", 0)]
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
    assert (ends["41"]["state"], ends["41"]["step"], ends["41"]["restarts"], ends["41"]["final_loss"]) == ("COMPLETED", 20, 0, 1 / 21)
    assert (ends["52"]["state"], ends["52"]["step"], ends["52"]["restarts"]) == ("COMPLETED", 60, 1)
    assert ends["52"]["samples_per_s"] == 2000.0 and ends["41"]["wall_s"] == 3
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 1 and "settings.nodes" in text and "--lr" in text
    assert cli.main(["compare", str(first), str(second), "--html", str(page)]) == 0
    out = capfd.readouterr().out
    assert "2 field(s) differ" in out and "settings.nodes" in out and "restarts" in out and f"compare: wrote {page}" in out
    assert cli.main(["compare", str(first)]) == 2
    assert "compare needs two runs or more" in capfd.readouterr().err
