"""The trainer on an older torch: each API newer than torch 2.8 (train/torch_compat.py) hidden in turn, two ranks
train over gloo to agreeing checksums through the fallback. The quick tier, so that a new call that only the newest
torch has fails here first, not on a user's image."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from ddp_jobs import start_standalone

from train.torch_compat import NEWER_APIS

HIDE = """\
import importlib, sys
module = importlib.import_module({module!r})
delattr(module, {name!r})
print(f"hidden: {module!r}.{name!r} (pid", __import__("os").getpid(), ")", file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize(("module", "name"), NEWER_APIS, ids=[f"{m}.{n}" for m, n in NEWER_APIS])
def test_two_ranks_train_with_a_newer_api_hidden(tmp_path: Path, module: str, name: str) -> None:
    assert hasattr(importlib.import_module(module), name), f"{module}.{name} is no newer API of this torch: drop it from NEWER_APIS"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE.format(module=module, name=name))
    job = start_standalone(
        tmp_path, 2, ["--epochs", "2", "--dataset-size", "512", "--snapshot-dir", str(tmp_path / "snapshots")],
        env={"PYTHONPATH": f"{site}:{Path(__file__).resolve().parents[1]}"},
    )  # fmt: skip
    assert job.wait() == [0], job.output()
    out = job.output()
    assert out.count(f"hidden: '{module}'.'{name}'") >= 3, out  # the launcher and both ranks ran without it
    assert len(set(job.checksums())) == 1 and "checksums agree across 2 ranks" in out, out
