r"""Sweeps: `ddpack submit P --sweep lr=1e-3,3e-4 --sweep seed=0,1 -- python train.py --lr {lr} --seed {seed}`.

The values' cross product is the sweep's points, in the order given (the last name varies fastest). Each point's
command and `--env` values are the submitted ones with `{NAME}` replaced by its value and `{index}` by the point's
number, in one pass (a value that holds `{other}` is never replaced again); `{{NAME}}` is the text `{NAME}`, and the
shell's `${NAME}` is left as written. A
`{NAME}` that no `--sweep` gives, a name given twice and a sweep name nothing uses are errors: each would run
something other than what was meant. A value holds a comma as `\,` (or any text at all in a run file's `[sweep]`
list).

The sweep is one Slurm job array (`--array=0-N%LIMIT`) of one job script, on one image built and converted once. Its
folder holds `sweep.json` (the names, values and points, and the array's job id), the job script and its helpers
(`job/`), and one run folder a point (`0/`, `1/`, ...), each with its own `run.json` (its command, and the point's
values under `sweep`) and logs: `status`, `logs`, `cancel`, `resubmit` and `compare` take a point as any run, and
`status` (`--watch` too), `logs` (`-f` too, `--point I` for one), `cancel`, `resubmit --failed` and `ls` take the
sweep as a whole (its folder, or the array's job id).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path
from typing import Any

from ddpack.errors import HostError

SWEEP_RECORD = "sweep.json"
MAX_POINTS = 1000  # Slurm's default MaxArraySize is 1001 (indices 0-1000)
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")  # a newline or other control character: no command word needs one


INDEX = "index"  # {index}: the point's number, given by no --sweep
# {NAME} (a value), or {{NAME}} (the text {NAME}): matched in one pass, so a value is never read again. ${NAME} is the
# shell's (bash -c '... ${SLURM_JOB_ID}'), never a placeholder: left as written.
PLACEHOLDER = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}|(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")


def split_values(text: str) -> list[str]:
    """V1,V2,... where `\\,` is a comma inside a value and `\\\\` a backslash; any other backslash stays as it is."""
    values, current, chars = [], [], iter(text)
    for char in chars:
        if char == "\\":
            following = next(chars, "")
            current.append(following if following in (",", "\\") else char + following)
        elif char == ",":
            values.append("".join(current))
            current = []
        else:
            current.append(char)
    values.append("".join(current))
    return values


def parse_flag(text: str) -> tuple[str, list[str]]:
    """NAME=V1,V2,... (one --sweep flag; `\\,` is a comma inside a value)."""
    name, sep, values = text.partition("=")
    if not sep or not NAME.fullmatch(name) or not values:
        raise HostError(f"--sweep {text}: expected NAME=V1,V2,... (a name of letters, digits and _, then its values)", code=2)
    return name, split_values(values)


def sweep_values(flags: list[str], table: dict[str, list[str]]) -> dict[str, list[str]]:
    """The run file's [sweep] table, then the flags (a flag's name replaces the file's; a name two flags give is an
    error: only one of them could count)."""
    values = dict(table)
    given: set[str] = set()
    for text in flags:
        name, found = parse_flag(text)
        if name in given:
            raise HostError(f"--sweep {name} is given twice; give its values once: --sweep {name}=V1,V2,...", code=2)
        given.add(name)
        values[name] = found
    return values


def placeholders(words: list[str]) -> set[str]:
    """The names `{NAME}` stands for in `words` (not those written `{{NAME}}`, which are text)."""
    return {found.group(2) for word in words for found in PLACEHOLDER.finditer(word) if found.group(2)}


def sweep_problems(command: tuple[str, ...], values: dict[str, list[str]], env: dict[str, str] | None = None) -> list[str]:
    """Each reason the sweep cannot run, one line each."""
    found = []
    env_values = list((env or {}).values())
    used = placeholders([*command, *env_values])
    for name, given in values.items():
        if not NAME.fullmatch(name):
            found.append(f"--sweep {name!r}: a sweep's name is letters, digits and _ (it stands for {{NAME}} in the command)")
            continue
        if name == INDEX:
            found.append(f"--sweep {INDEX}: {{{INDEX}}} is the point's number already; give the sweep another name")
            continue
        if any(CONTROL.search(value) for value in given):
            found.append(f"--sweep {name}: a value holds a newline or another control character; write each value on one line")
        if not all(given):
            found.append(f"--sweep {name}: an empty value (two commas, or one at an end)")
        elif len(set(given)) != len(given):
            found.append(f"--sweep {name}: a value given twice ({', '.join(sorted({v for v in given if given.count(v) > 1}))})")
        if name not in used:
            where = "the command after --" if command else "the command (none given: -- COMMAND, or command in the run file)"
            found.append(
                f"--sweep {name}: {where} never uses {{{name}}} (nor does an --env value), so every point would run the same thing"
            )
    for name in sorted(used - set(values) - {INDEX}):
        where = "the command" if name in placeholders(list(command)) else "an --env value"
        found.append(
            f"{where} uses {{{name}}}, which no --sweep gives: add --sweep {name}=V1,V2,..., or write {{{{{name}}}}} for the text {{{name}}}"
        )
    count = math.prod(len(given) for given in values.values())  # counted before any point is made
    if count > MAX_POINTS:
        found.append(f"the sweep has {count} points; one job array holds at most {MAX_POINTS} (Slurm's MaxArraySize): sweep fewer values")
    return found


def sweep_points(values: dict[str, list[str]]) -> list[dict[str, str]]:
    names = list(values)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(values[name] for name in names))]


def substitute(word: str, point: dict[str, str], index: int) -> str:
    """`word` with each `{NAME}` of the point replaced by its value and `{index}` by `index`, in one pass; `{{NAME}}`
    is the text `{NAME}`, and a name the point does not give stays as written (sweep_problems refuses it first)."""

    def one(found: re.Match[str]) -> str:
        if found.group(1):
            return "{" + found.group(1) + "}"
        name = found.group(2)
        return str(index) if name == INDEX else point.get(name, found.group(0))

    return PLACEHOLDER.sub(one, word)


def sweep_command(command: tuple[str, ...], point: dict[str, str], index: int) -> list[str]:
    """The command with each `{NAME}` of the point replaced by its value, in every word (one pass: substitute)."""
    return [substitute(word, point, index) for word in command]


def sweep_env(env: dict[str, str], point: dict[str, str], index: int) -> dict[str, str]:
    """The --env values as this point's job gets them (substitute)."""
    return {name: substitute(value, point, index) for name, value in env.items()}


def is_sweep(folder: Path) -> bool:
    return (folder / SWEEP_RECORD).is_file()


def read_sweep(folder: Path) -> dict[str, Any]:
    """sweep.json, read only from a folder of this user's alone (as a run's record is)."""
    from ddpack.jobs.run_json import not_a_run_of_yours

    path = folder / SWEEP_RECORD
    if (problem := not_a_run_of_yours(folder, path)) is not None:
        raise HostError(f"{problem}; it is not a sweep of yours", code=2)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise HostError(f"cannot read {path}: {exc}", code=2) from None
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise HostError(f"{path} is not a ddpack sweep record", code=2)
    return data


def point_dirs(folder: Path) -> list[Path]:
    return [folder / str(index) for index in range(len(read_sweep(folder)["points"]))]


def point_label(point: dict[str, str]) -> str:
    return " ".join(f"{name}={value}" for name, value in point.items())


def list_sweeps(runs: Path) -> list[tuple[Path, dict[str, Any]]]:
    """The sweep folders under `runs`, oldest first; one not the user's own is left out, never acted on."""
    found = []
    for path in runs.glob(f"*/{SWEEP_RECORD}") if runs.is_dir() else []:
        try:
            found.append((path.parent, read_sweep(path.parent)))
        except HostError:
            continue
    return sorted(found, key=lambda item: item[1].get("created", 0))


def sweep_state(states: list[str]) -> str:
    """The sweep's state from its points': RUNNING while any runs, PENDING while any waits (and none runs),
    COMPLETED when all did, else the first other end (FAILED, TIMEOUT, CANCELLED, ...)."""
    from ddpack.jobs.slurm_cli import ENDED, LIVE

    for live in LIVE:
        if live in states:
            return live
    unsettled = [state for state in states if state not in ENDED]
    if unsettled:
        return unsettled[0]
    return next((state for state in states if state != "COMPLETED"), "COMPLETED")


# --------------------------------------------------------------------------- following a sweep to its end


# --------------------------------------------------------------------------- mending a sweep
