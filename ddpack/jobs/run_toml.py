"""A run file: `ddpack submit --file run.toml`, the flags kept beside the code (read with the standard library's tomllib; tomli on Python 3.10).

    app_dir = "."                    # relative to this file (default: this file's folder)
    nodes = 2
    tasks_per_node = 2               # gpus_per_node, spares, standbys, efa, partition, time, template, mounts, runs,
    partition = "big"                # images, sqsh, name: as the flags of the same name (dashes or underscores)
    time = "4:00:00"
    command = ["python", "train.py", "--lr", "3e-4"]
    pass_env = ["NCCL_DEBUG"]        # variables the job takes from this shell, value recorded (as --env NAME)
    secrets = ["WANDB_API_KEY"]      # from this shell, handed to the job by Slurm, written to no file (as --secret)
    sweep_parallel = 4               # at most 4 points at once (as --sweep-parallel)
    account = "research"             # qos, constraint, reservation: Slurm's own (as the flags)
    sbatch = ["--mem=0", "--comment=baseline"]   # any other sbatch option (as --sbatch-arg)

    [env]                            # settings for the job (as --env NAME=VALUE)
    OMP_NUM_THREADS = "4"

    [sweep]                          # one job array of the cross product, {lr} in the command's words (as --sweep)
    lr = ["1e-3", "3e-4"]

A flag given on the command line wins over the file's value. A path may begin with `~` (your home) and hold `$NAME`
or `${NAME}` (this shell's variable; one not set is refused). A bad key or value is one line naming the file, the
line and the key, exit 2. The file's text is kept in the run's record (run.json) with the rest of what ran.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpack.errors import HostError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10 (Ubuntu 22.04's login nodes): the same reader, from PyPI (the host extras)
    import tomli as tomllib  # type: ignore[no-redef]

# Each key, the Python type its value must have, and what to write instead when it is wrong.
SCALARS: dict[str, tuple[type, str]] = {
    "app_dir": (str, "a folder, relative to the run file"),
    "nodes": (int, "a whole number"),
    "tasks_per_node": (int, "a whole number"),
    "spares": (int, "a whole number"),
    "standbys": (int, "a whole number"),
    "gpus_per_node": (int, "a whole number"),
    "efa": (bool, "true or false"),
    "partition": (str, "a partition's name"),
    "time": (str, 'a Slurm time such as "4:00:00"'),
    "template": (str, '"per-task" or "torchrun"'),
    "mounts": (str, 'SRC[:DST[:FLAGS]],... such as "/fsx:/fsx"'),
    "runs": (str, "a folder, relative to the run file"),
    "images": (str, "a folder, relative to the run file"),
    "sqsh": (str, "a squashfs file, relative to the run file"),
    "name": (str, "a name"),
    "sweep_parallel": (int, "a whole number"),
    "account": (str, "a Slurm account's name"),
    "qos": (str, "a Slurm QOS's name"),
    "constraint": (str, 'node features, such as "a100&ib"'),
    "reservation": (str, "a Slurm reservation's name"),
    "note": (str, "a note for the run"),
}
LISTS = ("command", "pass_env", "secrets", "sbatch")  # lists of strings
TABLES = ("env", "sweep", "tags")  # env, tags: NAME = "value"; sweep: NAME = [values]
PATHS = ("app_dir", "runs", "images", "sqsh")
VARIABLE = re.compile(
    r"\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)"
)  # $NAME or ${NAME} in a path, as os.path.expandvars reads it


@dataclass(frozen=True)
class RunFile:
    """A run file's values (paths made absolute against its folder), with where it came from."""

    path: Path
    text: str
    values: dict[str, Any] = field(default_factory=dict)
    written: tuple[str, ...] = ()  # the keys as the file writes them (tasks-per-node or tasks_per_node)

    def passed_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """pass_env's names with their values from `environ` (this shell), as --env NAME takes them: recorded."""
        missing = [name for name in self.values.get("pass_env", []) if name not in environ]
        if missing:
            where = f"{self.path}:{line_of(self.text, 'pass_env')}: pass_env"
            raise HostError(f"{where}: {', '.join(missing)} is not set in this shell; export it, or leave it out of pass_env", code=2)
        return {name: environ[name] for name in self.values.get("pass_env", [])}

    def where(self, problem: str, flags_given: set[str]) -> str:
        """A check's line about `--flag VALUE`, where the value came from this file rather than the command line:
        the file and the line that set it, first."""
        flag = problem.split()[0] if problem.startswith("--") else ""
        if not flag or flag in flags_given:
            return problem
        keys = {"--time": "time", "--env": "env", "--secret": "secrets", "--sweep": "sweep", "--sbatch-arg": "sbatch", "--tag": "tags"}
        key = keys.get(flag, flag[2:].replace("-", "_"))
        written = next((k for k in self.written if k.replace("-", "_") == key), None)
        if written is None:
            return problem
        if key in TABLES:  # --env NAME=VALUE, --sweep NAME: the entry's own line in its table
            name = re.split(r"[=:\s]", problem.split()[1], maxsplit=1)[0]
            return f"{self.path}:{line_of(self.text, name, key)}: {problem}"
        return f"{self.path}:{line_of(self.text, written)}: {problem}"

    def record(self) -> dict[str, Any]:
        """What run.json keeps of it: where it was, its digest and its whole text (names of secrets, never values)."""
        return {"path": str(self.path), "sha256": hashlib.sha256(self.text.encode()).hexdigest(), "text": self.text}


def line_of(text: str, key: str, table: str | None = None) -> int:
    """The line (from 1) where `key` is set, in `table` when given; 1 when it cannot be told (a dotted or inline key)."""
    in_table: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        header = re.match(r"\s*\[\s*([A-Za-z0-9_.-]+)\s*\]", line)
        if header:
            in_table = header.group(1)
            if table is None and in_table == key:
                return number
            continue
        if in_table == table and re.match(rf"\s*[\"']?{re.escape(key)}[\"']?\s*=", line):
            return number
    return 1


def table_values(path: Path, text: str, key: str, table: dict[str, Any]) -> dict[str, Any]:
    """[env]'s strings, or [sweep]'s lists of values (a TOML number becomes Python's text of it, 3e-4 -> 0.0003: quote
    a value to keep it as written)."""
    for name, value in table.items():
        where = f"{path}:{line_of(text, name, key)}: {key}.{name} = {value!r}"
        if key in ("env", "tags") and not isinstance(value, str):
            raise HostError(f'{where}: expected a string ("{value}")', code=2)
        if key == "sweep" and (not isinstance(value, list) or not value or not all(type(v) in (str, int, float) for v in value)):
            raise HostError(f'{where}: expected a list of values, such as ["1e-3", "3e-4"]', code=2)
    if key == "sweep":
        return {name: [v if isinstance(v, str) else repr(v) for v in value] for name, value in table.items()}
    return dict(table)


def run_file_path(path: Path, text: str, written: str, value: str, folder: Path) -> Path:
    """A path key's value: `~`, `~user`, `$NAME` and `${NAME}` expanded as a shell would (from this shell's
    variables), then relative to the run file's folder; one that cannot be expanded (a user this host does not know, a
    variable not set) is an error, never a folder named `~` or `$HOME`."""
    where = f"{path}:{line_of(text, written)}: {written} = {value!r}"
    unset = [name for name in VARIABLE.findall(value) if name.strip("{}") not in os.environ]
    if unset:
        raise HostError(f"{where}: ${unset[0].strip('{}')} is not set in this shell; export it, or write the folder's whole path", code=2)
    expanded = os.path.expanduser(os.path.expandvars(value))
    if expanded.startswith("~"):
        raise HostError(f"{where}: {value.split('/')[0]} is no user's home here; write the folder's whole path", code=2)
    return (folder / expanded).resolve()


def read_run_file(path: Path) -> RunFile:
    """The run file at `path`, checked key by key: one HostError (exit 2) naming the file, line and key when wrong."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise HostError(f"--file {path}: cannot read it ({exc.strerror}); give the path of a run file (TOML)", code=2) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise HostError(f"{path}: not TOML: {exc}", code=2) from None
    folder = path.resolve().parent
    values: dict[str, Any] = {}
    for written, value in data.items():
        key, where = written.replace("-", "_"), f"{path}:{line_of(text, written)}: {written}"
        if key in SCALARS:
            kind, expected = SCALARS[key]
            if type(value) is not kind:  # exactly: TOML's true is no whole number of nodes
                raise HostError(f"{where} = {value!r}: expected {expected}", code=2)
            values[key] = run_file_path(path, text, written, value, folder) if key in PATHS else value
        elif key in LISTS:
            if not isinstance(value, list) or not all(isinstance(word, str) for word in value):
                raise HostError(f'{where}: expected a list of strings, such as ["python", "train.py"]', code=2)
            values[key] = list(value)
        elif key in TABLES:
            if not isinstance(value, dict):
                raise HostError(f'{where}: expected a table of NAME = "value" ([{key}] with one line each)', code=2)
            values[key] = table_values(path, text, key, value)
        else:
            known = ", ".join([*SCALARS, *LISTS, *TABLES])
            raise HostError(f"{where}: not a run file key (a typo?); the keys are {known}", code=2)
    values.setdefault("app_dir", folder)
    return RunFile(path=path.resolve(), text=text, values=values, written=tuple(data))
