"""The README's worked examples, taken from the README itself, so that the tests run what users read."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

README = ROOT / "README.md"


def python_block(first_line_prefix: str) -> str:
    """The README's ```python block whose first line starts with `first_line_prefix`."""
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S):
        if block.startswith(first_line_prefix):
            return block
    raise AssertionError(f"README.md has no python block starting {first_line_prefix!r}")


def write_mytask(folder: Path) -> Path:
    """The README's `mytask.py` (a CNN with BatchNorm and an eval metric) in `folder`, a user's project."""
    path = folder / "mytask.py"
    path.write_text(python_block("# mytask.py"))
    path.chmod(0o644)
    return path


def readme_line(prefix: str) -> str:
    """The README's command line (in a ```sh block) that starts with `prefix`."""
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
