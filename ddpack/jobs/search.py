r"""Search beyond a grid: a sweep's points listed, drawn at random, and losing points paused by successive halving.

- `--point lr=0.1,bs=32` (repeatable) and `--points FILE` (JSON lines, or one JSON list, of objects NAME -> value):
  exactly these points, in this order, each a point of the job array (`\,` is a comma inside a --point value).
- `--sample N [--sample-seed S]`: N points drawn from the `--sweep` names, each `NAME=V1,V2,...` a choice among its
  values and `NAME=loguniform(A,B)`, `uniform(A,B)` or `randint(A,B)` (both ends included) a distribution. The seed
  (one is chosen and printed when none is given) and the drawn points are kept in sweep.json, so a resubmit of a
  point runs that point again, and the same seed draws the same points.
- `ddpack halve SWEEP --rungs 20,40,80 --by eval_loss [--max]`: successive halving. When every live point has reached
  a rung (a record at that step or past it), the worse half by the metric's value at the rung (its last record at
  or before it) is paused: its job is cancelled, which the trainer meets with its stop snapshot (SIGTERM), so
  `ddpack resubmit SWEEP/I` later continues it from where it stopped, no step trained twice. The better half trains
  on untouched. `decide_rung` is the decision alone, a function of the points' values.

Each sweep's record (sweep.json) keeps how its points were made (`search`) and the halving's rungs and decisions
(`halving`), so `halve` can be stopped and started again and decides each rung once.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from ddpack.jobs.sweep_points import MAX_POINTS, NAME, parse_flag, split_values

# --------------------------------------------------------------------------- listed points


def parse_point(text: str) -> dict[str, str]:
    """One --point: NAME=VALUE,NAME=VALUE (`\\,` a comma inside a value)."""
    point: dict[str, str] = {}
    for pair in split_values(text):
        name, sep, value = pair.partition("=")
        if not sep or not NAME.fullmatch(name) or not value:
            raise HostError(
                f"--point {text}: expected NAME=VALUE,NAME=VALUE,... (each name of letters, digits and _, then its value)", code=2
            )
        if name in point:
            raise HostError(f"--point {text}: {name} is given twice; give each name once", code=2)
        point[name] = value
    return point


def read_points_file(path: Path) -> list[dict[str, str]]:
    """--points FILE: JSON lines of objects, or one JSON list of them; a value may be a string or a number."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise HostError(f"--points {path}: cannot read it ({exc.strerror}); give a file of JSON objects, one a line", code=2) from None
    try:
        loaded = json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as exc:
        raise HostError(
            f'--points {path}: not JSON lines nor a JSON list ({exc}); write one object a line: {{"lr": 0.1}}', code=2
        ) from None
    points = []
    for number, point in enumerate(loaded, 1):
        if not isinstance(point, dict) or not point or not all(type(v) in (str, int, float) for v in point.values()):
            raise HostError(f"--points {path}: point {number} is not an object of names to strings or numbers", code=2)
        points.append({str(name): str(value) for name, value in point.items()})
    return points


def listed_problems(points: list[dict[str, str]]) -> list[str]:
    """Listed points that cannot run as meant: none, different names, one given twice, more than an array holds."""
    if not points:
        return ["--points: the file holds no point"]
    found = []
    names = list(points[0])
    for index, point in enumerate(points):
        if sorted(point) != sorted(names):
            found.append(
                f"point {index} names {', '.join(sorted(point))}; point 0 names {', '.join(sorted(names))}: every point gives the same names"
            )
        elif point in points[:index]:
            found.append(f"point {index} is point {points.index(point)} again; list each point once")
    if len(points) > MAX_POINTS:
        found.append(f"{len(points)} points; one job array holds at most {MAX_POINTS} (Slurm's MaxArraySize)")
    return found


# --------------------------------------------------------------------------- random search

DISTRIBUTION = re.compile(r"(loguniform|uniform|randint)\(\s*([^,()\s]+)\s*,\s*([^,()\s]+)\s*\)")


@dataclass(frozen=True)
class Dimension:
    """One name of a random search: a choice among `values`, or a distribution `kind`(low, high)."""

    name: str
    kind: str  # "choice", "loguniform", "uniform", "randint"
    values: tuple[str, ...] = ()
    low: float = 0.0
    high: float = 0.0

    def draw(self, rng: random.Random) -> str:
        if self.kind == "choice":
            return rng.choice(self.values)
        if self.kind == "randint":
            return str(rng.randint(int(self.low), int(self.high)))
        value = (
            math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
            if self.kind == "loguniform"
            else rng.uniform(self.low, self.high)
        )
        return f"{value:.6g}"  # what the command gets, and what sweep.json keeps: six significant digits

    def to_json(self) -> Any:
        return list(self.values) if self.kind == "choice" else f"{self.kind}({self.low:g},{self.high:g})"


def parse_dimension(name: str, text: str) -> Dimension:
    """NAME=V1,V2,... (a choice) or NAME=loguniform(A,B) / uniform(A,B) / randint(A,B)."""
    found = DISTRIBUTION.fullmatch(text.strip())
    if found is None:
        if "(" in text and text.split("(")[0] in ("loguniform", "uniform", "randint", "log_uniform", "normal", "choice"):
            raise HostError(f"--sweep {name}={text}: expected loguniform(A,B), uniform(A,B) or randint(A,B), or values V1,V2,...", code=2)
        return Dimension(name, "choice", tuple(split_values(text)))
    kind, low_text, high_text = found.groups()
    try:
        low, high = float(low_text), float(high_text)
    except ValueError:
        raise HostError(f"--sweep {name}={text}: {kind}'s ends are numbers", code=2) from None
    if not (low < high) or (kind == "loguniform" and low <= 0) or (kind == "randint" and not (low.is_integer() and high.is_integer())):
        need = {"loguniform": "0 < A < B", "uniform": "A < B", "randint": "whole numbers A < B"}[kind]
        raise HostError(f"--sweep {name}={text}: {kind}(A,B) needs {need}", code=2)
    return Dimension(name, kind, low=low, high=high)


def dimensions(flags: list[str], table: dict[str, list[str]]) -> list[Dimension]:
    """The run file's [sweep] lists (choices), then the flags (a flag's name replaces the file's)."""
    found = {name: Dimension(name, "choice", tuple(values)) for name, values in table.items()}
    for text in flags:
        name, _ = parse_flag(text)
        found[name] = parse_dimension(name, text.partition("=")[2])
    return list(found.values())


def draw_points(space: list[Dimension], count: int, seed: int) -> list[dict[str, str]]:
    """`count` points from `space`, the same for the same seed (Python's Mersenne Twister, one stream for all)."""
    rng = random.Random(seed)
    return [{dim.name: dim.draw(rng) for dim in space} for _ in range(count)]


def new_seed() -> int:
    return int.from_bytes(os.urandom(4), "big")


# --------------------------------------------------------------------------- what submit gets


@dataclass(frozen=True, kw_only=True)
class Space:
    """A sweep's points as submit takes them: `values` (each name's distinct values, in order: what the checks and
    sweep.json's `values` read), the points themselves (`listed`; empty for a grid: the product of `values`), and
    how they were made (`search`, kept in sweep.json)."""

    values: dict[str, list[str]]
    listed: tuple[dict[str, str], ...] = ()
    search: dict[str, Any] | None = None


def values_of(points: list[dict[str, str]]) -> dict[str, list[str]]:
    names = list(dict.fromkeys(name for point in points for name in point))
    return {name: list(dict.fromkeys(point[name] for point in points if name in point)) for name in names}


def sweep_space(
    flags: list[str], table: dict[str, list[str]], *, point_flags: list[str], points_file: Path | None, sample: int | None,
    seed: int | None, say: Callable[[str], None] = print,
) -> Space:  # fmt: skip
    """The grid (--sweep alone), the listed points (--point, --points) or the random draw (--sample N) submit runs."""
    from ddpack.jobs.sweep_points import sweep_values

    listed = [parse_point(text) for text in point_flags] + (read_points_file(points_file) if points_file else [])
    if seed is not None and sample is None:
        raise HostError("--sample-seed goes with --sample N: the seed of its random draw", code=2)
    if listed and (sample is not None or flags or table):
        raise HostError("--point and --points list the points themselves; give them without --sweep, [sweep] or --sample", code=2)
    if listed:
        if problems := listed_problems(listed):
            raise HostError("; ".join(problems), code=2)
        return Space(values=values_of(listed), listed=tuple(listed), search={"kind": "list"})
    if sample is None:
        return Space(values=sweep_values(flags, table))
    if sample < 1 or sample > MAX_POINTS:
        raise HostError(f"--sample {sample}: draw 1 to {MAX_POINTS} points (one job array's most)", code=2)
    space = dimensions(flags, table)
    if not space:
        raise HostError("--sample N draws from the --sweep names: give --sweep NAME=loguniform(A,B) or NAME=V1,V2,...", code=2)
    if seed is None:
        seed = new_seed()
        say(f"submit: --sample {sample} drawn with --sample-seed {seed} (kept in sweep.json; give it again to draw the same points)")
    drawn = draw_points(space, sample, seed)
    search = {"kind": "random", "sample": sample, "seed": seed, "space": {dim.name: dim.to_json() for dim in space}}
    return Space(values=values_of(drawn), listed=tuple(drawn), search=search)


# --------------------------------------------------------------------------- successive halving: the decision


def keep_count(live: int, keep: float = 0.5) -> int:
    """How many of `live` points go on past a rung: the better `keep` share, rounded up, at least one (6 -> 3 -> 2 -> 1)."""
    return max(1, math.ceil(live * keep)) if live else 0


def decide_rung(values: dict[int, float | None], *, highest: bool = False, keep: float = 0.5) -> list[int]:
    """Which points to pause at a rung: of the live points (index -> their metric at the rung), all but the better
    keep_count, by value (the lowest unless `highest`), ties to the lower index. A point with no value (it recorded
    no such metric by the rung) ranks last. Sorted indices."""

    def rank(index: int) -> tuple[int, float, int]:
        value = values[index]
        if value is None or not math.isfinite(value):
            return (1, 0.0, index)
        return (0, -value if highest else value, index)

    ranked = sorted(values, key=rank)
    return sorted(ranked[keep_count(len(ranked), keep) :])


def metric_at(records: list[dict[str, Any]], key: str, rung: int) -> float | None:
    """The metric's value at a rung: the last record (progress or eval) at or before that step that holds it."""
    found = None
    for record in records:
        step = record.get("global_step")
        value = record.get(key) if key not in ("train_loss",) else record.get("loss") if record.get("kind") == "progress" else None
        if isinstance(step, int) and step <= rung and isinstance(value, int | float) and not isinstance(value, bool):
            found = float(value)
    return found


def reached(records: list[dict[str, Any]], rung: int) -> bool:
    """Whether a point has trained to the rung: a record at that step or past it."""
    return any(isinstance(r.get("global_step"), int) and r["global_step"] >= rung for r in records)


@dataclass(frozen=True, kw_only=True)
class Halving:
    """`ddpack halve`'s plan, kept in sweep.json's `halving` with its decisions: the rungs (steps), the metric, which
    end of it is better, and the share kept at each rung."""

    rungs: tuple[int, ...]
    by: str
    highest: bool = False
    keep: float = 0.5

    def to_json(self) -> dict[str, Any]:
        return {"rungs": list(self.rungs), "by": self.by, "highest": self.highest, "keep": self.keep}


@dataclass(frozen=True, kw_only=True)
class PointNow:
    """A sweep's point as a halving pass sees it: its state (ddpack's: RUNNING, COMPLETED, ...) and its records."""

    index: int
    state: str
    records: list[dict[str, Any]]


def halving_step(
    plan: Halving, decided: list[dict[str, Any]], points: list[PointNow], waiting: set[int] | frozenset[int] = frozenset()
) -> list[dict[str, Any]]:
    """The rungs that can be decided now, in order, each as {rung, values, paused, kept}: a rung is decided once every
    point still in the race has reached it (a point paused at an earlier rung, or ended before this one, is out;
    one the halving itself paused to go on later, `waiting`: held, or kept and not yet continued, is in, though its
    job ended); the next rung waits for its turn. Nothing is decided twice: `decided` are the rungs done before."""
    from ddpack.jobs.slurm_cli import ENDED

    out = {index for decision in decided for index in decision["paused"]}
    new: list[dict[str, Any]] = []
    for rung in plan.rungs[len(decided) :]:
        racing = [p for p in points if p.index not in out and (p.state not in ENDED or p.index in waiting or reached(p.records, rung))]
        if not racing or any(not reached(p.records, rung) for p in racing):
            break
        values = {p.index: metric_at(p.records, plan.by, rung) for p in racing}
        paused = decide_rung(values, highest=plan.highest, keep=plan.keep)
        new.append({"rung": rung, "values": {str(i): v for i, v in values.items()}, "paused": paused,
                    "kept": sorted(set(values) - set(paused))})  # fmt: skip
        out |= set(paused)
    return new


def parse_rungs(text: str) -> tuple[int, ...]:
    try:
        rungs = tuple(int(word) for word in text.split(","))
    except ValueError:
        rungs = ()
    if not rungs or any(r < 1 for r in rungs) or list(rungs) != sorted(set(rungs)):
        raise HostError(f"--rungs {text}: expected steps in rising order, such as 20,40,80", code=2)
    return rungs


def halving_plan(data: dict[str, Any], asked: Halving) -> tuple[Halving, list[dict[str, Any]]]:
    """The sweep's halving: the one asked for, or the one it runs already (asked the same way: a halving changed
    half-way would decide its next rungs by another rule than its first)."""
    kept = data.get("halving")
    if not kept:
        return asked, []
    plan = Halving(rungs=tuple(kept["rungs"]), by=kept["by"], highest=bool(kept.get("highest")), keep=float(kept.get("keep", 0.5)))
    if plan != asked:
        raise HostError(
            f"this sweep is halved at rungs {','.join(map(str, plan.rungs))} by {plan.by}{' --max' if plan.highest else ''} already; "
            "halve it the same way (or submit the sweep again for another halving)",
            code=2,
        )
    return plan, list(kept.get("decided", []))


def point_records(point_dir: Path) -> list[dict[str, Any]]:
    """A point's metrics records, none while it has written none."""
    from ddpack.jobs.run_metrics import read_metrics
    from train import run_folder

    path = point_dir / run_folder.METRICS
    if not path.is_file():
        return []
    try:
        return read_metrics(path)[0]
    except HostError:  # an empty file: the point is starting
        return []


def hold_now(plan: Halving, decided: list[dict[str, Any]], points: list[PointNow], held: set[int]) -> list[int]:
    """The points to hold at the next rung before it is decided: those still running that reached it while a point
    in the race waits in the queue (PENDING) for a node. Held (paused at their snapshot), they free their nodes for
    it; the decision then continues the held winners. Without a queued point nobody is held: the race runs on."""
    from ddpack.jobs.slurm_cli import ENDED

    if len(decided) >= len(plan.rungs):
        return []
    out = {index for decision in decided for index in decision["paused"]}
    rung = plan.rungs[len(decided)]
    racing = [p for p in points if p.index not in out and (p.state not in ENDED or reached(p.records, rung))]
    if not any(p.state == "PENDING" for p in racing):
        return []
    return [p.index for p in racing if p.state not in ENDED and p.index not in held and reached(p.records, rung)]


@dataclass(frozen=True, kw_only=True)
class HalvePass:
    """What one look at a sweep did: the rungs decided, the points held at a rung and those continued."""

    decisions: list[dict[str, Any]]
    held: list[int]
    resumed: list[int]
    over: bool


def halve_pass(
    folder: Path, asked: Halving, *, state_of: Callable[[Path], str], pause: Callable[[Path], Any], resume: Callable[[Path], bool],
    now: Callable[[], float],
) -> HalvePass:  # fmt: skip
    """One look at the sweep: decide what can be decided; pause each loser that still lives (its job cancelled: the
    trainer stops with its snapshot on SIGTERM) and continue each held winner (`resume`: a resubmit from its
    snapshot; False when it cannot be yet, tried again at the next look); hold the points at an undecided rung while
    a point of the race waits for a node (hold_now); keep it all in sweep.json. Over once every rung is decided and
    every held winner continued, or no point is left in the race."""
    from ddpack.jobs.run_json import write_json_atomic
    from ddpack.jobs.slurm_cli import ENDED
    from ddpack.jobs.sweep_points import SWEEP_RECORD, point_dirs, read_sweep

    data = read_sweep(folder)
    plan, decided = halving_plan(data, asked)
    held = set((data.get("halving") or {}).get("held", []))
    waking = set((data.get("halving") or {}).get("waking", []))  # held winners not yet continued (a resubmit refused: again)
    dirs = point_dirs(folder)
    points = [PointNow(index=i, state=state_of(d), records=point_records(d)) for i, d in enumerate(dirs)]
    new = halving_step(plan, decided, points, waiting=held | waking)
    resumed: list[int] = []
    for decision in new:
        decision["time"] = now()
        for index in decision["paused"]:
            if points[index].state not in ENDED and index not in held:
                pause(dirs[index])
            held.discard(index)  # a held loser stays where it is: paused
        waking |= held & set(decision["kept"])
        held -= set(decision["kept"])
    for index in sorted(waking):
        if resume(dirs[index]):  # False: not now (its cancelled job still ending): the next look tries again
            waking.discard(index)
            resumed.append(index)
    decided = decided + new
    holding = [] if new else hold_now(plan, decided, points, held)  # after a decision the states are stale: next look
    for index in holding:
        pause(dirs[index])
        held.add(index)
    halving = {**plan.to_json(), "decided": decided, "held": sorted(held), "waking": sorted(waking)}
    write_json_atomic(folder / SWEEP_RECORD, {**read_sweep(folder), "halving": halving})
    out = {index for decision in decided for index in decision["paused"]}
    over = not waking and (
        len(decided) == len(plan.rungs) or (not new and not held and all(p.state in ENDED for p in points if p.index not in out))
    )
    return HalvePass(decisions=new, held=holding, resumed=resumed, over=over)


def decision_line(decision: dict[str, Any], by: str) -> str:
    values = decision["values"]
    shown = ", ".join(
        f"{i}: {values[str(i)]:.4g}" if values[str(i)] is not None else f"{i}: -" for i in decision["kept"] + decision["paused"]
    )
    return (f"halve: rung {decision['rung']} by {by} ({shown}): points {', '.join(map(str, decision['kept']))} go on, "
            f"{', '.join(map(str, decision['paused'])) or 'none'} paused at their snapshot (continue one: ddpack resubmit SWEEP/I)")  # fmt: skip
