"""Faults on the submitting side (issue 54), against the fake Slurm commands of tests/test_lifecycle.py: an sbatch
that does not answer, a secret given with its value, a cluster that keeps every job's environment in its accounting.
docs/faults.md lists every fault, what ddpack does, and the test that shows it."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_lifecycle import fake, fake_slurm, queued, settings

from ddpack import cli
from ddpack.errors import HostError
from ddpack.jobs import slurm_cli
from ddpack.jobs.run_json import read_record
from ddpack.jobs.submit import submit

SECRET = "tok-3f9a-not-for-logs"


@pytest.fixture
def slurm(tmp_path, monkeypatch) -> Path:
    return fake_slurm(tmp_path, monkeypatch)


def silent_sbatch(slurm: Path, monkeypatch, squeue: str, runs: Path) -> None:
    """An sbatch that never answers (killed at the timeout, 1 s here); `squeue` is what squeue then prints, with
    {where} for the run folder submit made under `runs` (the only one there)."""
    monkeypatch.setattr(slurm_cli, "SBATCH_TIMEOUT_S", 1)
    fake(slurm, "sbatch", '[ "$1" = --test-only ] && exit 0; exec sleep 60')
    listing = squeue.replace("{where}", f'$(cd "{runs}"/*/ && pwd)')
    fake(slurm, "squeue", f'case "$*" in *%Z*) {listing} ;; esac')


def test_an_sbatch_that_does_not_answer_is_found_in_squeue_by_its_run_folder_and_recorded(tmp_path, slurm, monkeypatch, capfd) -> None:
    good = settings(tmp_path)
    silent_sbatch(slurm, monkeypatch, 'echo "12|/fsx/someone/else"; echo "73|{where}"', good.runs)
    result = submit(good, say=lambda _: None)
    assert result.job_id == "73" and [job.job_id for job in read_record(Path(result.run_dir)).jobs] == ["73"]
    assert capfd.readouterr().err == f"sbatch did not answer in 1 s, but squeue lists job 73 working in {result.run_dir}: it was queued\n"


@pytest.mark.parametrize(
    ("squeue", "line"),
    [
        ('echo "12|/fsx/someone/else"', "sbatch did not answer in 1 s and squeue lists no job working in "),
        ("echo 'squeue: error: Socket timed out' >&2; exit 1", "sbatch did not answer in 1 s and squeue could not say whether it queued the job"),
    ],
)
def test_an_sbatch_that_does_not_answer_and_is_not_found_says_what_to_look_for(tmp_path, slurm, monkeypatch, squeue: str, line: str) -> None:
    good = settings(tmp_path)
    silent_sbatch(slurm, monkeypatch, squeue, good.runs)
    with pytest.raises(HostError, match="^" + line) as raised:
        submit(good, say=lambda _: None)
    assert raised.value.code == 1 and "squeue -u " in str(raised.value) and "refused" not in str(raised.value)


@pytest.mark.parametrize("given", [f"HF_TOKEN={SECRET}", SECRET, f"{SECRET} "])
def test_a_secret_given_with_its_value_is_refused_without_printing_it(tmp_path, slurm, monkeypatch, capfd, given: str) -> None:
    monkeypatch.setenv("HF_TOKEN", SECRET)
    good = settings(tmp_path)
    argv = ["submit", str(tmp_path), "--nodes", "2", "--runs", str(good.runs), "--sqsh", str(good.sqsh), "--mounts", good.mounts]
    assert cli.main([*argv, "--secret", "OTHER_NAME_XYZ", "--secret", given]) == 2
    out, err = capfd.readouterr()
    assert SECRET not in out + err and queued(slurm) == []
    assert "--secret (the 2nd): not a variable name, and not shown here as it may hold the value" in err, err


@pytest.mark.parametrize(("flags", "warned"), [("job_comment,job_env,job_script", True), ("job_comment,job_script", False)])
def test_submit_warns_where_the_accounting_keeps_the_jobs_environment(tmp_path, slurm, monkeypatch, flags: str, warned: bool) -> None:
    """A --secret's value lies in the controller's state, and in the accounting database where it stores job_env."""
    fake(slurm, "scontrol", f'[ "$*" = "show config" ] && echo "AccountingStoreFlags    = {flags}"')
    monkeypatch.setenv("HF_TOKEN", SECRET)
    said: list[str] = []
    submit(settings(tmp_path, secrets=("HF_TOKEN",)), say=said.append)
    warning = [line for line in said if "AccountingStoreFlags=job_env" in line]
    assert len(warning) == int(warned) and all("HF_TOKEN" in line and SECRET not in line for line in warning), said


def test_garbage_from_sinfo_is_one_line_not_a_traceback(tmp_path, slurm) -> None:
    fake(slurm, "sinfo", 'case "$*" in *--version*) echo "slurm-wlm 22.05.8" ;; *) echo "debug*|lots|idle|(null)" ;; esac')
    with pytest.raises(HostError) as raised:
        submit(settings(tmp_path), say=lambda _: None)
    assert "sinfo answered 'debug*|lots|idle|(null)', not PARTITION|NODES|STATE|GRES" in str(raised.value) and queued(slurm) == []


def test_a_default_job_name_slurm_would_expand_is_refused(tmp_path, slurm) -> None:
    """The job's name comes from the project folder (or the squashfs) unless --name gives it; `%u` in it would be
    expanded by Slurm in the log path the name is part of."""
    project = tmp_path / "my proj%u"
    project.mkdir()
    with pytest.raises(HostError, match=r"the job's name 'my proj%u' \(from the project folder's name\) is not only letters") as raised:
        submit(settings(tmp_path, app_dir=project, sqsh=None, name=None), say=lambda _: None)
    assert raised.value.code == 2 and queued(slurm) == []


def test_submit_on_a_full_filesystem_is_one_line_and_leaves_no_run_folder_without_its_record(tmp_path, slurm, monkeypatch) -> None:
    import ddpack.jobs.job_script as job_script

    def full(*_: object, **__: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(job_script.shutil, "copy2", full)  # the job's helpers are the first files written into it
    good = settings(tmp_path)
    with pytest.raises(HostError, match=f"^cannot write the run folder under {good.runs} \\(No space left on device\\); make room"):
        submit(good, say=lambda _: None)
    assert list(good.runs.iterdir()) == [] and queued(slurm) == []


def test_a_resubmit_gives_the_new_job_its_failure_restarts_anew(tmp_path, slurm) -> None:
    """The count caps one job's restart loop; a person who resubmits chose to go on."""
    from test_lifecycle import make_run

    from ddpack.jobs.run_actions import resubmit

    fake(slurm, "squeue", "echo 'FAILED||'")
    run_dir = make_run(tmp_path)
    (run_dir / ".ddpack-failure-restarts").write_text("1\n")
    assert resubmit(run_dir) == "101"
    assert not (run_dir / ".ddpack-failure-restarts").exists()


def test_every_row_of_the_fault_table_names_tests_that_exist() -> None:
    """docs/faults.md: each fault has a test, and each test it names is there (a file::name, or ::name in the file
    the row named last)."""
    import re

    from testbed.env import ROOT

    rows = [line for line in (ROOT / "docs" / "faults.md").read_text().splitlines() if line.startswith("| ") and not line.startswith("| fault")]
    assert len(rows) >= 15
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        named = re.findall(r"`((?:tests/)?test_\w+\.py)?::(\w+)", cells[-1]) + [(f, "") for f in re.findall(r"`((?:tests/)?test_\w+\.py)`", cells[-1])]
        assert named, row
        current = ""
        for file, name in named:
            current = file or current
            text = (ROOT / "tests" / Path(current).name).read_text()
            assert not name or re.search(rf"^def {name}\(", text, re.MULTILINE), (current, name)
