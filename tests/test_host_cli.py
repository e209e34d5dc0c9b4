"""Host verbs from the command line: bad input and a missing engine are one line, non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys

from testbed.env import ROOT, clean_env


def host(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], env=clean_env(**env), cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_no_engine_is_one_line_naming_the_socket_and_the_fix() -> None:
    out = host("ddpack.images.engine", DOCKER_HOST="unix:///tmp/ddpack-no-such.sock")
    assert out.returncode == 1
    assert out.stderr.count("\n") == 1
    assert out.stderr.startswith("ddpack engine: error: no Docker engine reachable at unix:///tmp/ddpack-no-such.sock")
    assert "make engine" in out.stderr


def test_a_reader_that_closed_the_pipe_ends_a_verb_quietly_as_sigpipe_would() -> None:
    """`ddpack ls | head`: the reader gone before the verb writes is exit 141 and nothing on stderr, not a traceback
    (nor the interpreter's "Exception ignored" at its last flush). Without the handler: exit 1 and a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([sys.executable, "-m", "ddpack.cli", "completion", "bash"], stdout=write_end, stderr=subprocess.PIPE,
                             env=clean_env(), cwd=ROOT, text=True, timeout=60)  # fmt: skip
    finally:
        os.close(write_end)
    assert (out.returncode, out.stderr) == (141, "")


def test_unknown_variant_is_rejected() -> None:
    out = host("ddpack.images.images", "--tag", "x:y", "--variant", "tpu")
    assert out.returncode == 2 and "invalid choice: 'tpu'" in out.stderr


def test_an_installed_ddpack_renders_and_ships_the_job_from_its_own_copy_of_enroot(tmp_path) -> None:
    """`pip install .` (not editable) on a login node: enroot/ is installed as ddpack's data (ddpack/enroot/, no Python
    package named enroot), and submit renders the template and loads the job's program from there."""
    import shutil

    source = tmp_path / "source"
    source.mkdir()
    for item in ("pyproject.toml", "entrypoint", "train", "ddpack_run", "ddpack", "enroot"):
        copy = shutil.copytree if (ROOT / item).is_dir() else shutil.copy2
        copy(ROOT / item, source / item, **({"ignore": shutil.ignore_patterns("__pycache__")} if copy is shutil.copytree else {}))
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-compile", "--target", str(target), "."]
    installed = subprocess.run(pip, cwd=source, capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stderr
    assert not (target / "enroot").exists() and (target / "ddpack" / "enroot" / "ddpack_node.py").is_file()
    check = (
        "import sys; from pathlib import Path; from ddpack import job_side; from ddpack.jobs import job_script, submit_checks\n"
        "assert job_side.ENROOT == Path(sys.argv[1]) / 'ddpack' / 'enroot', job_side.ENROOT\n"
        "assert job_side.module('ddpack_records').DECISIONS == 'decisions.jsonl'\n"
        "assert '#SBATCH' in (job_side.ENROOT / submit_checks.TEMPLATES['per-task']).read_text()\n"
        "assert all((job_side.ENROOT / helper).is_file() for helper in job_script.HELPERS)\n"
    )
    ran = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, sys.argv[1])\n{check}", str(target)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert ran.returncode == 0, ran.stderr


def test_every_verb_the_parser_knows_is_run_by_one_entry_of_the_verb_table_and_the_table_holds_no_other() -> None:
    import argparse

    from ddpack import cli

    parsed = next(action for action in cli.parser()._actions if isinstance(action, argparse._SubParsersAction))
    assert sorted(parsed.choices) == sorted(cli.VERBS)
