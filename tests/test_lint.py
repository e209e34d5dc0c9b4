"""`make lint` checks every product file: no folder of the product has a name (build/, dist/, ...) that ruff skips."""

from __future__ import annotations

import subprocess
import sys

from testbed.env import ROOT

PRODUCT = ("ddpack/", "train/", "entrypoint/", "enroot/", "ddpack_run/")


def test_ruff_sees_every_tracked_python_file_of_the_product() -> None:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    product = {path for path in tracked if path.startswith(PRODUCT)}
    shown = subprocess.run([sys.executable, "-m", "ruff", "check", "--show-files", "."], cwd=ROOT, capture_output=True, text=True, check=True)
    seen = {line.strip().removeprefix(f"{ROOT}/") for line in shown.stdout.splitlines()}
    assert len(product) > 60 and product <= seen, sorted(product - seen)
