"""The trainer on an older torch: each API newer than torch 2.8 (train/torch_compat.py) hidden in turn, two ranks
train over gloo to agreeing checksums through the fallback. The quick tier, so that a new call that only the newest
torch has fails here first, not on a user's image. An API the installed torch lacks is skipped (its fallback is what
runs anyway); the torch floor is one number, and each version-dependent spelling is chosen by version."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from ddp_jobs import start_standalone

from train.torch_compat import NEWER_APIS, TORCH_FLOOR, flight_recorder_size_var, torch_version

ROOT = Path(__file__).resolve().parents[1]

HIDE = """\
import importlib, sys
module = importlib.import_module({module!r})
delattr(module, {name!r})
print(f"hidden: {module!r}.{name!r} (pid", __import__("os").getpid(), ")", file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize(("module", "name"), NEWER_APIS, ids=[f"{m}.{n}" for m, n in NEWER_APIS])
def test_two_ranks_train_with_a_newer_api_hidden(tmp_path: Path, module: str, name: str) -> None:
    if not hasattr(importlib.import_module(module), name):
        pytest.skip(f"this torch has no {module}.{name}: its fallback is what runs here")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE.format(module=module, name=name))
    job = start_standalone(
        tmp_path, 2, ["--epochs", "2", "--dataset-size", "512", "--snapshot-dir", str(tmp_path / "snapshots")],
        env={"PYTHONPATH": f"{site}:{ROOT}"},
    )  # fmt: skip
    assert job.wait() == [0], job.output()
    out = job.output()
    assert out.count(f"hidden: '{module}'.'{name}'") >= 3, out  # the launcher and both ranks ran without it
    assert len(set(job.checksums())) == 1 and "checksums agree across 2 ranks" in out, out


def test_the_torch_floor_is_one_number() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=(\d+)\.(\d+)"', pyproject)
    assert floor and (int(floor.group(1)), int(floor.group(2))) == TORCH_FLOOR, floor
    assert torch_version() >= TORCH_FLOOR
    assert f"torch {TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}" in (ROOT / "docs" / "trainer.md").read_text()


@pytest.mark.parametrize(("version", "variable"), [("2.8.0+cu128", "TORCH_NCCL_TRACE_BUFFER_SIZE"), ("2.9.1", "TORCH_FR_BUFFER_SIZE"),
                                                   ("2.11.0+cu130", "TORCH_FR_BUFFER_SIZE"), ("2.13.0a0+git1234", "TORCH_FR_BUFFER_SIZE")])  # fmt: skip
def test_the_flight_recorder_is_turned_on_by_the_name_each_torch_reads(version: str, variable: str) -> None:
    assert flight_recorder_size_var(version) == variable
    assert torch_version(version) >= TORCH_FLOOR
