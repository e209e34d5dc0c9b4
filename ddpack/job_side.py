"""The job's own definitions, read by the host from enroot/.

The job's program runs on the batch host and the nodes with the system's Python (`python3 -I -S`), so it cannot import
ddpack; ddpack imports it instead, so that each rule has one definition, not a copy on each side: the settings table
(enroot/ddpack_settings.py, with the container's view of a path), the folder rules and the "yours alone" check
(enroot/ddpack_node.py), the job states (ddpack_slurm.py), the run folder's names (ddpack_records.py), the staging key
and model (ddpack_staging.py).
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def enroot_folder(package: Path) -> Path:
    """enroot/ for ddpack's `package` folder: at the top of a checkout (the design's place for it, an editable install's
    too), else where `pip install .` put it as ddpack's data (ddpack/enroot/, pyproject.toml's package-dir)."""
    checkout = package.parent / "enroot"
    return checkout if (checkout / "ddpack_node.py").is_file() else package / "enroot"


ENROOT = enroot_folder(
    Path(__file__).resolve().parent
)  # the job templates and the job's program, which submit renders and copies into a run folder


@functools.cache
def module(name: str) -> Any:
    """enroot/NAME.py as a module, imported once a process, with enroot/ last on sys.path: its files import each other
    by name, as the job imports them (ddpack_job.py puts its own folder on sys.path)."""
    if str(ENROOT) not in sys.path:
        sys.path.append(str(ENROOT))
    return importlib.import_module(name)


def settings_table() -> Any:
    """enroot/ddpack_settings.py: the one table of the job's settings, which the job checks too."""
    return module("ddpack_settings")


def setting_value(name: str, environ: Mapping[str, str] | None = None) -> str:
    """Job setting NAME as a job sees it given `environ` (None: unset, so its default): the table's value, where each
    default is written once; the host never writes one again."""
    return settings_table().value(name, environ or {})


def node_helper() -> Any:
    """enroot/ddpack_node.py, what a node runs: the folder rules and the own-file check, which the host holds too."""
    return module("ddpack_node")
