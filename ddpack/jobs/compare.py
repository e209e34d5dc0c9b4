"""`ddpack compare RUN RUN... [--json] [--html PATH]`: what differed between runs, and how each ended;
`ddpack compare SWEEP [--sort KEY]`: one row a point, its swept values and how it ended.

What ran comes from each run's record (run.json): the image, the code (commit, uncommitted diff, the files' digest),
every setting, the command, the environment the job got (secrets by name), the run file and a sweep point's values
(a sweep's folder stands for all its points). Only what differs is
shown, one row a field, one column a run. How each ended comes from `ddpack status` (state, step of the total) and
the run's metrics (the last training batch's loss, the last eval's loss, median samples/s and MFU, wall time over
its segments, restarts). The HTML page (written only where --html asks) overlays the runs' loss and throughput
curves, drawn as the report draws one run's.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpack.errors import HostError
from ddpack.jobs.cells import cell, duration
from ddpack.jobs.ledger import Ledger, added_ledgers, run_ledger
from ddpack.jobs.metrics_scan import digest_stale, read_digest
from ddpack.jobs.run_json import read_record
from ddpack.jobs.run_metrics import Digest, Run, eval_metrics, metric_of, read_run
from ddpack.private_files import write_atomically
from train.metrics import format_share

if TYPE_CHECKING:
    from ddpack.jobs.status import Asked

# Fields of the record that name this run rather than what it ran: the same run twice always differs in them.
OWN = (
    "settings.run_dir",
    "settings.runs",
    "environment.script.DDPACK_RUN_DIR",
    "environment.script.DDPACK_HOME",
    "environment.login_shell",
)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys; lists as JSON text (a command compares as a whole)."""
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, inner in value.items():
            flat.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: json.dumps(value) if isinstance(value, list) else value}


def what_ran(run_dir: Path) -> dict[str, Any]:
    """The record's facts of what ran, flattened, less what only names the run."""
    record = read_record(run_dir)
    facts = {
        "image": {key: record.image.get(key) for key in ("ref", "image_id", "variant")},
        "code": {key: record.code.get(key) for key in ("digest", "git_commit", "git_dirty", "diff_sha256", "vcs")},
        "command": record.command,
        "settings": {key: value for key, value in record.settings.items() if key != "exported"},
        "environment": record.environment,
        "run_file": (record.run_file or {}).get("sha256"),
        "sweep": (record.sweep or {}).get("values"),
    }
    return {key: value for key, value in flatten(facts).items() if not key.startswith(OWN)}


@dataclass(frozen=True, kw_only=True)
class Outcome:
    state: str
    step: int | None
    total_steps: int | None
    train_loss: float | None  # the last progress record's: one training batch's loss, not a held-out measure
    eval_loss: float | None  # the last eval record's loss, where the program evaluates
    samples_per_s: float | None  # median over the run's progress records
    mfu: float | None  # median
    wall_s: float | None  # the sum of its segments' spans: time spent training, not queued
    restarts: int
    node_hours: float | None = None  # the node-hour ledger's allocation (ddpack.jobs.ledger), None without start records
    kept_node_hours: float | None = None  # of which bought steps the run kept
    evals: dict[str, float] = field(default_factory=dict)  # each eval metric's last value (eval_metrics)


def outcome(run_dir: Path, curves: bool = True, asked: Asked | None = None) -> tuple[Outcome, Run | None]:
    """How the run ended, and its metrics (None where it wrote none; without `curves`, its digest's records alone)."""
    ended, run, _ = measured(run_dir, curves, asked)
    return ended, run


def slurm_said(run_dirs: list[Path]) -> Callable[[Path], Asked | None]:
    """What Slurm says of each run's newest job, asked once for all the runs (status.asked_for: one squeue and one
    sacct), as a sweep's status asks: each run's own status asked both, two processes a point, 0.3 s of 100 points."""
    from ddpack.jobs.status import asked_for

    jobs = {run_dir: read_record(run_dir).last_job for run_dir in run_dirs}
    asked = asked_for(list(jobs.values()))
    return lambda run_dir: asked(jobs[run_dir])


def measured(run_dir: Path, curves: bool = True, asked: Asked | None = None) -> tuple[Outcome, Run | None, Ledger]:
    """How the run ended, its metrics and its ledger, the metrics file read at most once: status and the ledger take
    them from here. Without `curves` (no page to draw) the run's digest answers (metrics_scan.read_digest: a file
    unchanged since an earlier compare is not read again) and the Run holds the digest's records alone. `asked`: what
    Slurm already said of its job (slurm_said), else its status asks."""
    from ddpack.jobs.status import MetricsTail, run_status, tail_of

    try:
        digest: Digest | None = read_digest(run_dir) if not curves else Digest.of(read_run(run_dir))
    except HostError:  # no metrics yet (queued), or a program that writes none
        digest = None
    run = digest.run if digest else None
    now = run_status(run_dir, asked, records=tail_of(run.segments, digest.progress_count) if digest and run else MetricsTail())
    spans = [s.ended - s.began for s in run.segments if s.began is not None and s.ended is not None] if run else []
    ledger = run_ledger(run_dir, now.state, run.segments if run else [])
    allocated = ledger.allocated_node_s / 3600 if ledger.allocations else None
    return (
        Outcome(
            state=now.state,
            step=now.step,
            total_steps=now.total_steps,
            train_loss=digest.train_loss if digest else None,
            eval_loss=eval_loss(run.evals if run else []),
            samples_per_s=digest.samples_per_s if digest else None,
            mfu=digest.mfu if digest else None,
            wall_s=sum(spans) if spans else None,
            restarts=max(0, len(now.segments) - 1),
            node_hours=allocated,
            kept_node_hours=ledger.node_s["kept"] / 3600 if allocated is not None else None,
            evals=eval_metrics(run.evals if run else []),
        ),
        run,
        ledger,
    )


EVAL_LOSSES = (
    "eval_loss",
    "val_loss",
    "loss",
)  # the eval loss as the bundled trainer and HF (eval_loss), Lightning (val_loss), eval_done name it


def eval_loss(evals: list[dict[str, Any]]) -> float | None:
    """The last eval record's loss (eval_loss, val_loss, or loss), None where the run wrote no eval."""
    for record in reversed(evals):
        for key in EVAL_LOSSES:
            if isinstance(record.get(key), int | float):
                return float(record[key])
    return None


@dataclass(frozen=True, kw_only=True)
class Comparison:
    runs: list[str]  # run folders
    names: list[str]  # each run's column heading: its job id, else its folder's name
    differ: dict[str, list[Any]]  # field -> each run's value, only where they differ
    same: int  # how many fields are the same in every run
    outcomes: list[Outcome]

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"runs": [{"run_dir": run, "name": name, **asdict(out)} for run, name, out in zip(self.runs, self.names, self.outcomes, strict=True)],
                "differ": self.differ, "same": self.same}  # fmt: skip


def compare(run_dirs: list[Path], curves: bool = True) -> tuple[Comparison, list[Run | None]]:
    """What differed between the runs and how each ended; without `curves` (no page) each run's digest answers."""
    if len(run_dirs) < 2:
        raise HostError("compare needs two runs or more (run folders or job ids), or a sweep (its points)", code=2)
    facts = [what_ran(run_dir) for run_dir in run_dirs]
    keys = sorted({key for fact in facts for key in fact})
    differ = {key: [fact.get(key) for fact in facts] for key in keys if len({json.dumps(f.get(key), sort_keys=True) for f in facts}) > 1}
    if not curves:
        digest_stale(run_dirs)  # the first read of big files, on every core
    said = slurm_said(run_dirs)
    ended = [outcome(run_dir, curves, said(run_dir)) for run_dir in run_dirs]
    names = []
    for run_dir in run_dirs:
        job = read_record(run_dir).last_job
        names.append(job.job_id if job else run_dir.name)
    comparison = Comparison(
        runs=[str(run_dir) for run_dir in run_dirs],
        names=names,
        differ=differ,
        same=len(keys) - len(differ),
        outcomes=[o for o, _ in ended],
    )
    return comparison, [run for _, run in ended]


def outcome_rows(comparison: Comparison) -> list[tuple[str, list[str]]]:
    out = comparison.outcomes
    return [
        ("state", [o.state for o in out]),
        ("step", [f"{cell(o.step)} of {cell(o.total_steps)}" for o in out]),
        ("last train loss", [cell(o.train_loss) for o in out]),
        ("last eval loss", [cell(o.eval_loss) for o in out]),
        *((f"eval {name}", [cell(o.evals.get(name)) for o in out]) for name in metric_columns([{"evals": o.evals} for o in out])),
        ("samples/s (median)", [f"{o.samples_per_s:,.0f}" if o.samples_per_s is not None else "-" for o in out]),
        ("MFU (median)", [format_share(o.mfu) if o.mfu is not None else "-" for o in out]),
        ("wall time", [duration(o.wall_s) for o in out]),
        ("restarts", [str(o.restarts) for o in out]),
        ("node-hours (kept)", [f"{o.node_hours:.3f} ({o.kept_node_hours:.3f})" if o.node_hours is not None else "-" for o in out]),
    ]


def render(comparison: Comparison, page: Path | None) -> str:
    """The two tables as text: what differed (or that nothing did), then how each run ended."""
    rows = [("", comparison.names)]
    if comparison.differ:
        rows += [(key, [cell(v) for v in values]) for key, values in comparison.differ.items()]
    rows += [("---", ["" for _ in comparison.names]), *outcome_rows(comparison)]
    width = max(len(key) for key, _ in rows)
    columns = [max(len(row[1][i]) for row in rows) for i in range(len(comparison.names))]
    lines = [f"{key:<{width}}  " + "  ".join(f"{v:<{columns[i]}}" for i, v in enumerate(values)) for key, values in rows]
    lines = [line.rstrip() if not line.startswith("---") else "-" * len(lines[0]) for line in lines]
    said = (
        f"{len(comparison.differ)} field(s) differ, {comparison.same} the same"
        if comparison.differ
        else f"what ran is the same ({comparison.same} fields)"
    )
    return "\n".join([*lines, said, *([f"compare: wrote {page}"] if page else [])])


def write_page(comparison: Comparison, runs: list[Run | None], path: Path) -> Path:
    """One self-contained HTML page: the tables, then the runs' loss and throughput overlaid (one colour a run)."""
    from ddpack.jobs.report import STYLE, html_table, png, pyplot

    plt = pyplot()
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan"]
    fig, (loss_ax, rate_ax) = plt.subplots(2, 1, figsize=(10, 8))
    for index, (name, run) in enumerate(zip(comparison.names, runs, strict=True)):
        if run is None:
            continue
        colour = colours[index % len(colours)]
        losses = [(r["global_step"], r["loss"]) for r in run.progress if r.get("loss") is not None]
        if losses:
            loss_ax.plot(*zip(*losses, strict=True), color=colour, label=name)
        for number, segment in enumerate(run.segments):  # no line across a requeue's gap
            rated = [r for r in segment.progress if r.get("samples_per_s") is not None]
            rate_ax.plot([r["time"] - run.t0 for r in rated], [r["samples_per_s"] for r in rated], color=colour, marker=".",
                         label=name if number == 0 else None)  # fmt: skip
    loss_ax.set(xlabel="global step", ylabel="loss", title="Loss")
    rate_ax.set(xlabel="seconds since each run's first start", ylabel="samples/s (all ranks)", title="Throughput")
    rate_ax.set_ylim(bottom=0)
    for ax in (loss_ax, rate_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    image = base64.b64encode(png(plt, fig)).decode()
    differ = [[key, *[cell(v) for v in values]] for key, values in comparison.differ.items()]
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>ddpack compare</title><style>{STYLE}</style></head><body>"
        f"<h1>ddpack compare: {html.escape(', '.join(comparison.names))}</h1>"
        + html_table(["run", "folder"], zip(comparison.names, comparison.runs, strict=True))
        + "<h2>What differed</h2>"
        + (html_table(["field", *comparison.names], differ) if differ else "<p>Nothing: the same image, code, settings and command.</p>")
        + "<h2>How each ended</h2>"
        + html_table(["", *comparison.names], [[key, *values] for key, values in outcome_rows(comparison)])
        + f'<img alt="loss and throughput" src="data:image/png;base64,{image}"></body></html>'
    )
    write_atomically(path, page, mode=0o600)  # it shows settings and --env values: the user's alone, as run.json is
    return path


# --------------------------------------------------------------------------- a sweep: one row a point

POINT_COLUMNS = (
    "state",
    "step",
    "train_loss",
    "eval_loss",
    "samples_per_s",
    "mfu",
    "wall_s",
    "restarts",
    "node_hours",
    "kept_node_hours",
    "evals",
)


def sweep_table(folder: Path, curves: bool = True) -> tuple[list[str], list[dict[str, Any]], list[Run | None], Ledger]:
    """(the swept names, one row a point: index, job_id, run_dir, each swept value, then POINT_COLUMNS, each point's
    metrics, the sweep's ledger) for `compare SWEEP`: each point's metrics file read once."""
    from dataclasses import asdict

    from ddpack.jobs.sweep_points import point_dirs, read_sweep, sweep_state

    data = read_sweep(folder)
    names = data.get("names") or list(data["values"])  # the order given (the file's keys are sorted)
    rows, runs, ledgers = [], [], []
    points = point_dirs(folder)
    if not curves:
        digest_stale(points)  # the first read of big files, on every core
    said = slurm_said(points)
    for index, point_dir in enumerate(points):
        ended, run, ledger = measured(point_dir, curves, said(point_dir))
        ledgers.append((index, ended.state, ledger))
        job = read_record(point_dir).last_job
        values = asdict(ended)
        rows.append({"index": index, "job_id": job.job_id if job else None, "run_dir": str(point_dir), **data["points"][index],
                     **{key: values[key] for key in POINT_COLUMNS}})  # fmt: skip
        runs.append(run)
    return names, rows, runs, added_ledgers(folder, sweep_state([state for _, state, _ in ledgers]), ledgers)


def sort_rows(rows: list[dict[str, Any]], key: str, names: list[str], reverse: bool = False, flag: str = "--sort") -> list[dict[str, Any]]:
    """Rows by `key` (a swept name, a column or an eval metric; a value that reads as a number sorts as one), rows
    without it last."""
    known = ["index", *names, *(c for c in POINT_COLUMNS if c != "evals")]
    metrics = list(dict.fromkeys(name for row in rows for name in row.get("evals") or {}))
    if key not in known and metric_of({"evals": dict.fromkeys(metrics, 0)}, key) is None:
        raise HostError(
            f"{flag} {key}: expected one of {', '.join(known)}, or an eval metric a point recorded ({', '.join(metrics) or 'none yet'})",
            code=2,
        )

    def number(value: Any) -> tuple[int, Any]:
        try:
            return (0, float(value))
        except (TypeError, ValueError):
            return (1, str(value))

    present = sorted((row for row in rows if metric_of(row, key) is not None), key=lambda row: number(metric_of(row, key)), reverse=reverse)
    return present + [row for row in rows if metric_of(row, key) is None]


def metric_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The eval metrics a sweep's table shows beside its fixed columns: every one a point recorded but the eval loss
    (its own column)."""
    return [name for name in dict.fromkeys(name for row in rows for name in row.get("evals") or {}) if name not in EVAL_LOSSES]


def best_row(rows: list[dict[str, Any]], key: str, names: list[str], highest: bool) -> tuple[dict[str, Any], str]:
    """`compare SWEEP --best KEY`: the point with the lowest KEY (highest with --max) and its one-line verdict."""
    ranked = sort_rows(rows, key, names, reverse=highest, flag="--best")
    top = ranked[0] if ranked else None
    if top is None or metric_of(top, key) is None:
        raise HostError(f"--best {key}: no point has recorded it yet; compare SWEEP shows what each has", code=2)
    values = " ".join(f"{name}={top[name]}" for name in names)
    of = sum(1 for row in rows if metric_of(row, key) is not None)
    return top, (f"best by {key} ({'highest' if highest else 'lowest'} of {of} point(s)): point {top['index']} ({values}) {key} "
                 f"{cell(metric_of(top, key))}, {top['state']} at step {cell(top['step'])}; {top['run_dir']}")  # fmt: skip


def render_sweep_table(names: list[str], rows: list[dict[str, Any]], page: Path | None) -> str:
    extra = metric_columns(rows)
    heads = ["point", *names, "state", "step", "train loss", "eval loss", *extra, "samples/s", "MFU", "wall", "restarts", "node-h (kept)"]
    body = [[str(row["index"]), *(str(row[name]) for name in names), row["state"], cell(row["step"]), cell(row["train_loss"]),
             cell(row["eval_loss"]), *(cell((row.get("evals") or {}).get(name)) for name in extra),
             f"{row['samples_per_s']:,.0f}" if row["samples_per_s"] is not None else "-",
             format_share(row["mfu"]) if row["mfu"] is not None else "-", duration(row["wall_s"]), str(row["restarts"]),
             f"{row['node_hours']:.3f} ({row['kept_node_hours']:.3f})" if row["node_hours"] is not None else "-"]
            for row in rows]  # fmt: skip
    widths = [max(len(line[i]) for line in [heads, *body]) for i in range(len(heads))]
    lines = ["  ".join(f"{cell:<{widths[i]}}" for i, cell in enumerate(line)).rstrip() for line in [heads, *body]]
    return "\n".join([*lines, *([f"compare: wrote {page}"] if page else [])])


def write_sweep_page(folder: Path, names: list[str], rows: list[dict[str, Any]], runs: list[Run | None], path: Path) -> Path:
    """The points' table and their curves overlaid, one colour a point (write_page's drawing)."""
    columns = [f"{row['index']} " + " ".join(f"{n}={row[n]}" for n in names) for row in rows]
    outcomes = [Outcome(**{key: row[key] for key in POINT_COLUMNS}, total_steps=None) for row in rows]
    comparison = Comparison(runs=[row["run_dir"] for row in rows], names=columns, differ={}, same=0, outcomes=outcomes)
    return write_page(comparison, runs, path)
