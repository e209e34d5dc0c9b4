"""The one table of the job's settings (enroot/ddpack_settings.py): every name the job side reads is in it, the docs
name the same ones, and `ddpack submit` and the templates accept or refuse each value alike, before anything runs."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

from ddpack.job_side import settings_table
from ddpack.jobs.submit_checks import SubmitSettings, setting_problems
from testbed.env import ROOT

TABLE = settings_table().SETTINGS
HELPER = ROOT / "enroot" / "ddpack-job.sh"


def read_by_the_job_side() -> set[str]:
    """Every DDPACK_* name in the templates, their helpers, the launcher, the trainer and the adapters."""
    names: set[str] = set()
    for folder, pattern in (("enroot", "*"), ("entrypoint", "*.py"), ("train", "**/*.py"), ("ddpack_run", "*.py")):
        for path in (ROOT / folder).glob(pattern):
            if path.is_file() and path.name != "ddpack_settings.py":
                names.update(re.findall(r"\bDDPACK_[A-Z0-9_]+\b", path.read_text(errors="replace")))
    return names


def test_every_setting_the_job_side_reads_is_in_the_table_and_the_docs_name_the_same_ones() -> None:
    assert read_by_the_job_side() - TABLE.keys() == set(), "add these to enroot/ddpack_settings.py"
    docs = (ROOT / "docs" / "cluster.md").read_text()
    assert settings_table().markdown() in docs, "docs/cluster.md's table is not the table's: python3 enroot/ddpack_settings.py markdown"
    assert set(re.findall(r"\bDDPACK_[A-Z0-9_]+\b", docs)) - TABLE.keys() == set(), "docs/cluster.md names settings the table does not have"


def job_side_refuses(name: str, value: str) -> str:
    """What the templates' first check (ddpack_setup) says of one setting: its one line, or "" when it passes (and the
    start goes on: its run folder made, in a folder of its own)."""
    with tempfile.TemporaryDirectory() as submitted:
        env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "5", "SLURM_SUBMIT_DIR": submitted, name: value}
        out = subprocess.run(["bash", "-c", f'. "{HELPER}"; ddpack_setup x'], env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode in (0, 2), out.stderr
        assert (out.returncode == 0) == (Path(submitted) / "runs" / "x-5").is_dir()
    return out.stderr.strip() if out.returncode else ""


@pytest.mark.parametrize(
    ("name", "value", "refused"),
    [
        ("DDPACK_STAGE_FANOUT", "8", False),
        ("DDPACK_STAGE_FANOUT", "9", True),  # passed submit's old table, then killed the job
        ("DDPACK_STAGE", "sbcats", True),
        ("DDPACK_UMASK", "027", False),
        ("DDPACK_STOP_GRACE", "0", True),
        ("DDPACK_STOP_GRACE", "3600", False),
        ("DDPACK_STOP_GRACE", "3601", True),
        ("DDPACK_HANG_TIMEOUT", "15", False),
        ("DDPACK_STAGE_DIR", "relative/dir", True),
        ("DDPACK_TRAIN_ARGS", '["--epochs", "2"]', False),
        ("DDPACK_TRAIN_ARGS", "[--epochs 2]", True),
        ("DDPACK_TEMPLATE", "preflight.sbatch", True),
        ("DDPACK_BACKEND", "nccl", False),
    ],
)
def test_submit_and_the_templates_accept_or_refuse_a_value_alike(tmp_path: Path, name: str, value: str, refused: bool) -> None:
    at_submit = setting_problems(SubmitSettings(app_dir=tmp_path, nodes=1, runs=tmp_path, images=tmp_path, env={name: value}))
    on_the_job = job_side_refuses(name, value)
    assert bool(at_submit) == bool(on_the_job) == refused, (at_submit, on_the_job)
    if refused:
        assert at_submit[0] == f"--env {on_the_job.removeprefix('ddpack: error: ')}" and on_the_job.count("\n") == 0


def test_a_setting_ddpack_sets_itself_is_not_yours_to_set(tmp_path: Path) -> None:
    problems = setting_problems(SubmitSettings(app_dir=tmp_path, nodes=1, runs=tmp_path, images=tmp_path, env={"DDPACK_JOB_TOKEN": "x"}))
    assert problems == ["--env DDPACK_JOB_TOKEN: set by ddpack itself (this start's secret for the watchdog's store (made by the template)), not by you"]
