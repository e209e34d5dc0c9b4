"""The README's and docs/' worked examples, taken from the pages themselves, so that the tests run what users read."""

from __future__ import annotations

import re
from pathlib import Path

from testbed.env import ROOT

README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))


def pages_text() -> str:
    """The README and every docs/ page, one after the other: where a worked example may live."""
    return "\n".join(page.read_text() for page in PAGES)


def python_block(first_line_prefix: str) -> str:
    """The ```python block (README or docs/) whose first line starts with `first_line_prefix`."""
    for block in re.findall(r"```python\n(.*?)```", pages_text(), re.S):
        if block.startswith(first_line_prefix):
            return block
    raise AssertionError(f"neither README.md nor docs/ has a python block starting {first_line_prefix!r}")


def write_mytask(folder: Path) -> Path:
    """The README's `mytask.py` (a CNN with BatchNorm and an eval metric) in `folder`, a user's project."""
    path = folder / "mytask.py"
    path.write_text(python_block("# mytask.py"))
    path.chmod(0o644)
    return path


def readme_line(prefix: str) -> str:
    """The README's command line (in a ```sh block) that starts with `prefix`: the front page's commands."""
    for block in re.findall(r"```sh\n(.*?)```", README.read_text(), re.S):
        for line in block.splitlines():
            if line.startswith(prefix):
                return line
    raise AssertionError(f"README.md has no command line starting {prefix!r}")


def write_cpu_ddp(folder: Path) -> Path:
    """The README's worked project, `cpu-ddp`: its `ddp.py` and one-line `requirements.txt`, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ddp.py").write_text(python_block("# ddp.py"))
    (folder / "requirements.txt").write_text("tqdm\n")
    return folder
