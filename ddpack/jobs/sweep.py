"""Sweeps: `ddpack submit P --sweep lr=1e-3,3e-4 --sweep seed=0,1 -- python train.py --lr {lr} --seed {seed}`.

The values' cross product is the sweep's points, in the order given (the last name varies fastest). Each point's
command is the command with `{NAME}` replaced by its value in every word (braces of any other name are left alone),
and a sweep name that no word uses is an error: it would run the same thing twice.

The sweep is one Slurm job array (`--array=0-N%LIMIT`) of one job script, on one image built and converted once. Its
folder holds `sweep.json` (the names, values and points, and the array's job id), the job script and its helpers
(`job/`), and one run folder a point (`0/`, `1/`, ...), each with its own `run.json` (its command, and the point's
values under `sweep`) and logs: `status`, `logs`, `cancel`, `resubmit` and `compare` take a point as any run, and
`status`, `logs`, `cancel` and `ls` take the sweep as a whole (its folder, or the array's job id).
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


def parse_flag(text: str) -> tuple[str, list[str]]:
    """NAME=V1,V2,... (one --sweep flag)."""
    name, sep, values = text.partition("=")
    if not sep or not NAME.fullmatch(name) or not values:
        raise HostError(f"--sweep {text}: expected NAME=V1,V2,... (a name of letters, digits and _, then its values)", code=2)
    return name, values.split(",")


def sweep_values(flags: list[str], table: dict[str, list[str]]) -> dict[str, list[str]]:
    """The run file's [sweep] table, then the flags (a flag's name replaces the file's)."""
    values = dict(table)
    for text in flags:
        name, given = parse_flag(text)
        values[name] = given
    return values


def sweep_problems(command: tuple[str, ...], values: dict[str, list[str]]) -> list[str]:
    """Each reason the sweep cannot run, one line each."""
    found = []
    for name, given in values.items():
        if not NAME.fullmatch(name):
            found.append(f"--sweep {name!r}: a sweep's name is letters, digits and _ (it stands for {{NAME}} in the command)")
            continue
        if any(CONTROL.search(value) for value in given):
            found.append(f"--sweep {name}: a value holds a newline or another control character; write each value on one line")
        if not all(given):
            found.append(f"--sweep {name}: an empty value (two commas, or one at an end)")
        elif len(set(given)) != len(given):
            found.append(f"--sweep {name}: a value given twice ({', '.join(sorted({v for v in given if given.count(v) > 1}))})")
        if not any(f"{{{name}}}" in word for word in command):
            where = "the command after --" if command else "the command (none given: -- COMMAND, or command in the run file)"
            found.append(f"--sweep {name}: {where} never uses {{{name}}}, so every point would run the same thing")
    count = math.prod(len(given) for given in values.values())  # counted before any point is made
    if count > MAX_POINTS:
        found.append(f"the sweep has {count} points; one job array holds at most {MAX_POINTS} (Slurm's MaxArraySize): sweep fewer values")
    return found


def sweep_points(values: dict[str, list[str]]) -> list[dict[str, str]]:
    names = list(values)
    return [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(values[name] for name in names))]


def sweep_command(command: tuple[str, ...], point: dict[str, str]) -> list[str]:
    """The command with each `{NAME}` of the point replaced by its value, in every word."""
    words = []
    for word in command:
        for name, value in point.items():
            word = word.replace(f"{{{name}}}", value)
        words.append(word)
    return words


def is_sweep(folder: Path) -> bool:
    return (folder / SWEEP_RECORD).is_file()


def read_sweep(folder: Path) -> dict[str, Any]:
    """sweep.json, read only from a folder of this user's alone (as a run's record is)."""
    from ddpack.jobs.run_record import not_a_run_of_yours

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


def sweep_status(folder: Path) -> dict[str, Any]:
    """The sweep as a whole (status --json's names: run_dir, name, job_id, state) and each point's status."""
    from dataclasses import asdict

    from ddpack.jobs.run_record import read_record
    from ddpack.jobs.status import asked_for, run_status

    data = read_sweep(folder)
    folders = point_dirs(folder)
    asked = asked_for([read_record(point_dir).last_job for point_dir in folders])
    points = []
    for index, point_dir in enumerate(folders):
        now = asdict(run_status(point_dir, asked(read_record(point_dir).last_job)))
        points.append({"index": index, "values": data["points"][index], **now})
    states = [point["state"] for point in points]
    counts = {state: states.count(state) for state in dict.fromkeys(states)}
    return {"run_dir": str(folder), "name": data["name"], "job_id": data.get("job_id"), "state": sweep_state(states),
            "points": points, "counts": counts, "values": data["values"]}  # fmt: skip


def render_sweep(status: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {state}" for state, n in status["counts"].items())
    lines = [f"sweep {status['name']}: job array {status['job_id']}, {len(status['points'])} points: {counts}", f"  folder {status['run_dir']}"]
    width = max(len(point_label(p["values"])) for p in status["points"])
    lines.append(f"  {'point':>5}  {'values':<{width}}  {'job':>10}  {'state':<10} {'step':>11}  loss")
    for point in status["points"]:
        step = f"{point['step']}/{point['total_steps'] or '?'}" if point["step"] is not None else "-"
        loss = f"{point['loss']:.4g}" if point["loss"] is not None else "-"
        lines.append(f"  {point['index']:>5}  {point_label(point['values']):<{width}}  {point['job_id'] or '-':>10}  {point['state']:<10} {step:>11}  {loss}")
    lines.append(f"  a point on its own: ddpack status {status['run_dir']}/INDEX (or its job id, {status['job_id']}_INDEX)")
    return "\n".join(lines)


def cancel_sweep(folder: Path) -> list[str]:
    """scancel every point still waiting or running, by its newest job (the array's element, or a resubmit's own),
    in one call; each point's record says so once Slurm took it."""
    from ddpack.jobs import slurm_cli
    from ddpack.jobs.run_record import append_event

    status = sweep_status(folder)
    live = [point for point in status["points"] if point["state"] not in slurm_cli.ENDED and point["job_id"]]
    if not live:
        raise HostError(f"every point of the sweep {folder} has ended; nothing to cancel", code=2)
    jobs = [str(point["job_id"]) for point in live]
    answer = slurm_cli.ask(["scancel", *jobs])
    if answer.failed:
        raise HostError(f"scancel {' '.join(jobs)}: {answer.failed}", code=1)
    for point in live:
        append_event(Path(point["run_dir"]), {"kind": "cancel", "job_id": point["job_id"]})
    return jobs
