"""The one table of the job's settings (enroot/ddpack_settings.py): every name the job side reads is in it, the docs
name the same ones, and `ddpack submit` and the templates accept or refuse each value alike, before anything runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
        ("DDPACK_STAGE_FANOUT", "64", False),  # Slurm 23.11+ takes it (the job caps it at 8 on older ones)
        ("DDPACK_STAGE_FANOUT", "65", True),
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


def written_defaults(paths: list[Path]) -> list[str]:
    """Each place in `paths` that writes a table setting's default again: a shell fallback `${NAME:-literal}` (any
    literal: the table's `ddpack_value` reads the default), a Python `.get("NAME", "literal")` or `.get("NAME") or
    "literal"` for a setting that has a default (`or "[]"` parses an empty one), or a line of prose that names the
    setting beside its default value (`NAME (10)`, or with the word "default" on that line or the one before)."""
    found = []
    for path in paths:
        lines = path.read_text(errors="replace").splitlines()
        for number, line in enumerate(lines, 1):
            for name, setting in TABLE.items():
                if not re.search(rf"\b{name}\b", line):
                    continue
                fallback = re.search(rf"\$\{{{name}:?-(?![}}$])", line)
                get = setting.default and re.search(rf"""\.get\(\s*["']{name}["']\s*(,\s*|\)\s*or\s*)["'][^"']""", line)
                said = False
                if setting.default:
                    literal = re.escape(setting.default.split("<uid>")[0])
                    token = rf"(?<![\w.-]){literal}" + ("" if "<uid>" in setting.default else r"(?![\w])")
                    near = f"{lines[number - 2] if number > 1 else ''} {line}"
                    said = bool(re.search(rf"\b{name}\b[^()\n]{{0,24}}\({token}[):;]", line)) or (
                        "default" in near and bool(re.search(token, line))
                    )
                if fallback or get or said:
                    found.append(f"{path.relative_to(ROOT)}:{number}: {name}: {line.strip()}")
    return found


def test_a_settings_default_is_written_in_the_table_alone() -> None:
    enroot = [path for path in (ROOT / "enroot").iterdir() if path.is_file() and path.suffix in (".py", ".sh", ".sbatch")]
    host = sorted((ROOT / "ddpack").rglob("*.py"))
    paths = [path for path in enroot + host if path.name != "ddpack_settings.py"]
    assert len(paths) > 40
    assert written_defaults(paths) == [], "read it from enroot/ddpack_settings.py: ddpack_value (shell), value or job_side.setting_value"


# The image's own copies (train/, entrypoint/: the image holds no enroot/, so it cannot read the table; a program run
# outside a template needs them): these alone, each still the table's value.
IMAGE_COPIES = {
    ("train/config.py", "DDPACK_CPU_BIND"),
    ("train/config.py", "DDPACK_STANDBYS"),
    ("train/config.py", "DDPACK_STORE_TASK"),
    ("entrypoint/cli.py", "DDPACK_STOP_GRACE"),
    ("entrypoint/supervise.py", "DDPACK_STOP_GRACE"),
}


def test_the_image_repeats_only_the_defaults_it_must_and_each_as_the_table_has_it() -> None:
    paths = [path for folder in ("train", "entrypoint", "ddpack_run") for path in sorted((ROOT / folder).rglob("*.py"))]
    found = written_defaults(paths)
    copies = {(line.split(":")[0], line.split(": ")[1]) for line in found}
    assert copies == IMAGE_COPIES, "the image writes these defaults (IMAGE_COPIES alone, each as the table has it)"
    for line in found:
        name, text = line.split(": ", 2)[1:]
        assert re.search(rf"(?<![\w.-]){re.escape(TABLE[name].default)}(?!\w)", text), f"{line}: the table's default is {TABLE[name].default}"


def test_the_check_for_a_second_default_finds_each_way_one_is_written(tmp_path: Path) -> None:
    tried = {
        "sh": "mask=${DDPACK_UMASK:-077}\nwait=${DDPACK_STEP_WAIT-5}\nok=${DDPACK_NPROC:-}\nhome=${DDPACK_HOME:-$(pwd)}\n",
        "py": 'a = env.get("DDPACK_STANDBYS", "0")\nb = env.get("DDPACK_MOUNTS") or "/fsx:/fsx"\nc = env.get("DDPACK_RUN_DIR", "")\n',
        "txt": "up to DDPACK_MAX_RESTARTS (10).\nthe folder (default\nDDPACK_STAGE_DIR /tmp/ddpack-images-1).\nDDPACK_STAGE=auto: said\n",
    }
    paths = []
    for suffix, text in tried.items():
        (path := tmp_path / f"x.{suffix}").write_text(text)
        paths.append(path)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules[__name__], "ROOT", tmp_path)
        found = [line.split(": ", 1)[0] for line in written_defaults(paths)]
    assert found == ["x.sh:1", "x.sh:2", "x.py:1", "x.py:2", "x.txt:1", "x.txt:3"]


def test_the_templates_read_a_default_from_the_table(tmp_path: Path) -> None:
    """ddpack_value: the setting's own value, else the table's default (<uid>: this user's), else nothing."""
    script = (
        f'. "{HELPER}"; for name in DDPACK_STEP_WAIT DDPACK_UMASK DDPACK_STAGE_DIR DDPACK_NPROC; do '
        'ddpack_value v "${name}"; echo "${name}=${v}"; done'
    )
    env = {"PATH": "/usr/bin:/bin", "DDPACK_UMASK": "027", "DDPACK_STEP_WAIT": ""}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30, check=True).stdout.split()
    uid = os.getuid()
    assert out == [
        f"DDPACK_STEP_WAIT={TABLE['DDPACK_STEP_WAIT'].default}",
        "DDPACK_UMASK=027",
        f"DDPACK_STAGE_DIR={TABLE['DDPACK_STAGE_DIR'].default.replace('<uid>', str(uid))}",
        "DDPACK_NPROC=",
    ]
