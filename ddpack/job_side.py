"""The job's own definitions, read by the host from enroot/.

The job helpers run on the nodes with the system's Python (`python3 -I -S`), so they cannot import ddpack; ddpack
imports them instead, so that each rule has one definition, not a copy on each side: the settings table
(enroot/ddpack_settings.py), the staging key, the folder rules and the "yours alone" check (enroot/ddpack_node.py).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any


def enroot_folder(package: Path) -> Path:
    """enroot/ for ddpack's `package` folder: at the top of a checkout (the design's place for it, an editable install's
    too), else where `pip install .` put it as ddpack's data (ddpack/enroot/, pyproject.toml's package-dir)."""
    checkout = package.parent / "enroot"
    return checkout if (checkout / "ddpack_node.py").is_file() else package / "enroot"


ENROOT = enroot_folder(Path(__file__).resolve().parent)  # the job templates and the job's program, which submit renders and copies into a run folder


@functools.cache
def module(name: str) -> Any:
    """enroot/NAME.py as a module, loaded once a process."""
    spec = importlib.util.spec_from_file_location(name, ENROOT / f"{name}.py")
    loaded = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules.setdefault(name, loaded)  # dataclasses look their module up there
    spec.loader.exec_module(loaded)  # type: ignore[union-attr]
    return loaded


def settings_table() -> Any:
    """enroot/ddpack_settings.py: the one table of the job's settings, which the job checks too."""
    return module("ddpack_settings")


def node_helper() -> Any:
    """enroot/ddpack_node.py: the job helper's own definitions (the staging key, the folder rules, the own-file check)."""
    return module("ddpack_node")
