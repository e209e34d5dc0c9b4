"""`make report RUN=DIR`: one self-contained HTML page (and with --png one summary image) of a run.

It draws what the trainer leaves in the run folder (the templates' runs/<job>-<id>), as ddpack.jobs.run_metrics
reads it: `metrics.jsonl` (one segment per start) and `preflight.json` when the job ran a preflight. It
draws loss and eval curves; throughput and MFU over time; every rank's step time as a heatmap, where a
straggler is a bright row; the segments on a timeline with their snapshots and how each ended; the
preflight's all-reduce bus-bandwidth curve and its point-to-point and compute tables; the run's settings.
Images are inline PNGs and the page links to nothing, so it opens in any browser, offline, as one file.

Bad input is one line and exit 2: no folder, no metrics file, or one with no records. A torn line (a start
killed mid-write, at the end or before a later start's records) is skipped with a warning.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import sys
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from statistics import median
from typing import Any

from ddpack.errors import HostError, run_verb
from ddpack.jobs.cells import cell
from ddpack.jobs.run_metrics import Run, read_run
from ddpack.private_files import write_atomically
from train import run_folder
from train.metrics import format_share

OUTCOME_COLOURS = {"done": "tab:green", "stopped": "tab:orange", "failed": "tab:red", "hung": "tab:purple", "bad-input": "tab:gray"}


# ---------------------------------------------------------------- charts


class NoCharts(HostError):
    """matplotlib is not installed (the host's light install): no page, but what needs no chart (the ledger) still."""


def pyplot() -> Any:
    """matplotlib's pyplot drawing to files (Agg: no display on a login node), or NoCharts where it is not installed;
    every page of the host's (report, compare) draws through it."""
    try:
        import matplotlib
    except ImportError:
        raise NoCharts("report.html needs matplotlib: run it with the host venv (make venv), or pip install matplotlib", 2) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mark_segments(ax: Any, run: Run, x_of: Any) -> None:
    """Dashed lines where a segment began (resumed or restarted) and where one ended other than done."""
    for index, segment in enumerate(run.segments):
        if index and segment.start is not None:
            ax.axvline(x_of(segment.start), color="tab:green", linestyle="--", linewidth=1)
        if segment.end is not None and segment.end.get("outcome") != "done":
            ax.axvline(x_of(segment.end), color=OUTCOME_COLOURS.get(segment.end["outcome"], "black"), linestyle=":", linewidth=1.5)


def chart_loss(ax: Any, run: Run) -> None:
    losses = [(r["global_step"], r["loss"]) for r in run.progress if r.get("loss") is not None]  # a loop of one's own may give none
    ax.plot([step for step, _ in losses], [loss for _, loss in losses], color="tab:blue", label="train loss")
    ax.set_xlabel("global step")
    ax.set_ylabel("loss")
    names = sorted({k for r in run.evals for k in r if k not in ("time", "kind", "epoch", "global_step")})
    if names:
        other = ax.twinx()
        colours = ["tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink"]
        for index, name in enumerate(names):
            points = [(r["global_step"], r[name]) for r in run.evals if isinstance(r.get(name), (int, float))]
            other.plot(*zip(*points, strict=True), marker="o", linestyle="--", color=colours[index % len(colours)], label=f"eval {name}")
        other.set_ylabel("eval")
        other.legend(loc="upper right", fontsize=8)
    _mark_segments(ax, run, lambda r: r.get("global_step", 0))
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Loss and eval (dashed: a resume or restart; dotted: a stop or failure)")


def time_axis(run: Run) -> tuple[float, str]:
    """Seconds or minutes since the first start, whichever reads better for the run's length."""
    span = max((s.ended or 0) for s in run.segments) - run.t0
    return (60.0, "minutes") if span > 180 else (1.0, "seconds")


def chart_throughput(ax: Any, run: Run) -> None:
    """One line a segment (no line drawn across the gap of a requeue); MFU, proportional to samples/s by
    definition, dashed on its own axis."""
    t0, (unit, unit_name) = run.t0, time_axis(run)
    other = ax.twinx() if any(r.get("mfu") is not None for r in run.progress) else None
    for index, segment in enumerate(run.segments):
        rated = [r for r in segment.progress if r.get("samples_per_s") is not None]
        when = [(r["time"] - t0) / unit for r in rated]
        ax.plot(when, [r["samples_per_s"] for r in rated], color="tab:blue", marker=".", label="samples/s" if index == 0 else None)
        mfu = [(w, r["mfu"] * 100) for w, r in zip(when, rated, strict=True) if r.get("mfu") is not None]
        if other is not None and mfu:
            other.plot(*zip(*mfu, strict=True), color="tab:red", linestyle="--", label="MFU %" if index == 0 else None)
    ax.set_xlabel(f"{unit_name} since the first start")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_ylim(bottom=0)
    if other is not None:
        other.set_ylabel("MFU % (dashed)")
        other.set_ylim(bottom=0)
        other.legend(loc="upper right", fontsize=8)
    _mark_segments(ax, run, lambda r: (r["time"] - t0) / unit)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("Throughput and MFU over time")


def rank_matrix(run: Run, column: str) -> tuple[list[list[float]], int]:
    """Ranks x progress records of a per-rank column in ms a step (busy: the step less its all-reduce wait)."""
    rows = [r for r in run.progress if r.get("rank_step_s")]
    world = max((len(r["rank_step_s"]) for r in rows), default=0)
    matrix = [[float("nan")] * len(rows) for _ in range(world)]
    for col, record in enumerate(rows):
        for rank in range(len(record["rank_step_s"])):
            busy = record["rank_step_s"][rank] - record["rank_sync_s"][rank]
            matrix[rank][col] = (busy if column == "busy" else record[column][rank]) * 1e3
    return matrix, len(rows)


def rank_labels(run: Run, world: int) -> list[str]:
    hosts = (run.last_start or {}).get("hosts") or []
    return [f"rank {r} ({hosts[r]})" if r < len(hosts) else f"rank {r}" for r in range(world)]


def chart_heatmap(fig: Any, ax: Any, run: Run, column: str, title: str) -> None:
    matrix, count = rank_matrix(run, column)
    if not count:
        ax.text(0.5, 0.5, "no per-rank step times in this file", ha="center", va="center")
        ax.set_axis_off()
        return
    # From zero: a rank a few percent off the others is noise, not a bright row.
    image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0)
    rows = [r for r in run.progress if r.get("rank_step_s")]
    ticks = sorted({0, count - 1, *range(0, count, max(1, count // 8))})
    ax.set_xticks(ticks, [str(rows[i]["global_step"]) for i in ticks])
    ax.set_xlabel("global step (at each progress line)")
    ax.set_yticks(range(len(matrix)), rank_labels(run, len(matrix)))
    fig.colorbar(image, ax=ax, label="ms a step")
    ax.set_title(title)


def chart_timeline(ax: Any, run: Run) -> None:
    t0, (unit, unit_name) = run.t0, time_axis(run)
    for index, segment in enumerate(run.segments):
        began, ended = segment.began, segment.ended
        if began is None or ended is None:
            continue
        colour = OUTCOME_COLOURS.get(segment.end["outcome"], "black") if segment.end else "lightgray"
        ax.barh(index, max((ended - began) / unit, 1e-3), left=(began - t0) / unit, color=colour, alpha=0.6)
        first = segment.start["global_step"] if segment.start else (segment.progress[0]["global_step"] if segment.progress else 0)
        last = segment.end.get("global_step") if segment.end else (segment.progress[-1]["global_step"] if segment.progress else first)
        ax.text((began - t0) / unit, index, f" steps {first}->{last}: {segment.outcome}", va="center", fontsize=8)
        for snap in segment.snapshots:
            ax.plot((snap["time"] - t0) / unit, index + 0.3, marker="v", color="black", markersize=4)
    ax.set_yticks(range(len(run.segments)), [f"segment {i + 1}" for i in range(len(run.segments))])
    ax.invert_yaxis()
    ax.set_xlabel(f"{unit_name} since the first start (triangles: snapshots)")
    ax.set_title("Segments: starts, snapshots and how each ended")


def chart_bus_bandwidth(ax: Any, preflight: dict[str, Any]) -> None:
    rows = preflight.get("all_reduce") or []
    ax.plot([r["size"] for r in rows], [r["busbw"] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(f"Preflight all-reduce ({preflight.get('backend')}, {preflight.get('world_size')} ranks)")


def png(plt: Any, fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def figure(plt: Any, draw: Any, size: tuple[float, float] = (10, 4)) -> bytes:
    fig, ax = plt.subplots(figsize=size)
    draw(fig, ax)
    return png(plt, fig)


# ---------------------------------------------------------------- the page


def html_table(header: list[str] | None, rows: Iterable[Iterable[Any]]) -> str:
    """An HTML table of `rows` (escaped; an empty value a blank cell), under `header` where one is given: every
    page's tables (report, compare)."""
    head = "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>" if header else ""
    body = "".join("<tr>" + "".join(f"<td>{html.escape(cell(c, empty=''))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{head}{body}</table>"


def _when(seconds: float | None) -> str:
    return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S") if seconds is not None else ""


def summary(run: Run) -> list[tuple[str, Any]]:
    start, progress = run.last_start or {}, run.progress
    last = run.segments[-1]
    rates = [r["samples_per_s"] for r in progress if r.get("samples_per_s") is not None]
    mfus = [r["mfu"] for r in progress if r.get("mfu") is not None]
    return [
        ("run folder", str(run.folder)),
        ("segments", len(run.segments)),
        ("last outcome", last.outcome + (f" (exit {last.end['exit_code']})" if last.end else "")),
        ("global step", f"{(last.end or (progress[-1] if progress else {})).get('global_step', '?')} of {start.get('total_steps', '?')}"),
        ("ranks", f"{start.get('world_size', '?')} on {', '.join(sorted(set(start.get('hosts') or []))) or '?'}"),
        ("device", f"{start.get('device', '?')} ({start.get('backend', '?')})"),
        ("median samples/s", f"{median(rates):,.0f}" if rates else "n/a"),
        ("median MFU", format_share(median(mfus)) if mfus else "n/a (no FLOP count or peak)"),
        ("FLOPs per sample", f"{start['flops_per_sample']:.4g}" if start.get("flops_per_sample") else "n/a"),
        (
            "peak per device",
            f"{start['peak_flops_per_s'] / 1e12:.4g} TFLOP/s, {start['peak_source']}" if start.get("peak_flops_per_s") else "n/a",
        ),
    ]


STYLE = (
    "body{font-family:sans-serif;margin:2em;max-width:1100px}table{border-collapse:collapse;margin:0.5em 0 1.5em}"
    "td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:13px}th{background:#eee}img{max-width:100%}"
)


def ledger_section(folder: Path) -> str:
    """The node-hour ledger (ddpack.jobs.ledger) of a run ddpack submit made or a template recorded; "" for a run folder
    with no run.json (a metrics file alone) or no start records."""
    from ddpack.jobs.ledger import NAMES, PARTS, run_ledger

    if not (folder / run_folder.RUN_RECORD).is_file():
        return ""
    try:
        ledger = run_ledger(folder)
    except HostError:  # not this user's run folder: no ledger, the report all the same
        return ""
    total = ledger.allocated_node_s
    if not total:
        return ""
    rows = [
        [NAMES[part], ledger.node_s[part] / 3600, f"{100 * ledger.node_s[part] / total:.1f} %"] for part in PARTS if ledger.node_s[part]
    ]
    said = (f"{total / 3600:.4g} node-hours over {len(ledger.allocations)} allocation(s); steps kept {ledger.steps_kept}, redone "
            f"{ledger.steps_redone}; {ledger.preemptions} preemption(s), {ledger.restarts} restart(s) in place, {ledger.requeues} requeue(s); "
            f"not allocated: {ledger.queue_wait_s:.0f} s queued, {ledger.requeue_wait_s:.0f} s waiting after requeues")  # fmt: skip
    return f"<h2 id='ledger'>Node-hours</h2><p>{html.escape(said)}</p>" + html_table(["part", "node-hours", "share"], rows)


def render_html(run: Run, plt: Any) -> str:
    def image(data: bytes, alt: str) -> str:
        return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'

    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>ddpack run report: {html.escape(run.folder.name)}</title>"]
    parts.append(f"<style>{STYLE}</style></head><body><h1>ddpack run report: {html.escape(run.folder.name)}</h1>")
    for warning in run.warnings:
        parts.append(f"<p><b>warning:</b> {html.escape(warning)}</p>")
    parts.append(html_table(None, summary(run)))
    parts.append("<h2 id='loss'>Loss and eval</h2>" + image(figure(plt, lambda f, a: chart_loss(a, run)), "loss and eval curves"))
    parts.append(
        "<h2 id='throughput'>Throughput and MFU</h2>" + image(figure(plt, lambda f, a: chart_throughput(a, run)), "throughput and MFU")
    )
    parts.append(
        "<h2 id='ranks'>Per-rank step time</h2><p>Busy: the step less its wait for the gradients' all-reduce. Every rank's step "
        "takes as long as the slowest's, so the straggler is the rank that waits least: its row is the brightest.</p>"
    )
    world = len(rank_matrix(run, "busy")[0])
    height = max(2.5, 0.35 * world + 1.5)
    parts.append(
        image(figure(plt, lambda f, a: chart_heatmap(f, a, run, "busy", "busy ms a step, per rank"), (10, height)), "per-rank heatmap")
    )
    parts.append(
        image(figure(plt, lambda f, a: chart_heatmap(f, a, run, "rank_data_s", "ms a step waiting for data"), (10, height)), "data wait")
    )
    parts.append(
        "<h2 id='timeline'>Timeline</h2>"
        + image(figure(plt, lambda f, a: chart_timeline(a, run), (10, max(2.0, 0.5 * len(run.segments) + 1.5))), "segments")
    )
    rows = []
    for index, segment in enumerate(run.segments, 1):
        start, end = segment.start or {}, segment.end or {}
        why = end.get("reason") or end.get("signal") or ""
        where = (
            "slurm job " + str(start["slurm_job_id"]) + f" (restart {start.get('slurm_restart_count', 0)})"
            if start.get("slurm_job_id")
            else ""
        )
        rows.append([index, _when(segment.began), start.get("global_step"), _when(segment.ended), end.get("global_step"), segment.outcome,
                     end.get("exit_code"), why, len(segment.snapshots), where])  # fmt: skip
    parts.append(html_table(["segment", "began", "from step", "ended", "at step", "outcome", "exit", "why", "snapshots", "where"], rows))
    parts.append(ledger_section(run.folder))
    if run.preflight is not None:
        parts.append(preflight_section(run.preflight, lambda data, alt: image(data, alt), plt))
    config = (run.last_start or {}).get("config") or {}
    if config:
        parts.append("<h2 id='settings'>Settings (the last segment's)</h2>" + html_table(["setting", "value"], sorted(config.items())))
    parts.append("</body></html>\n")
    return "".join(parts)


def preflight_section(preflight: dict[str, Any], image: Any, plt: Any) -> str:
    verdict = "passed" if preflight.get("ok") else "FAILED: " + "; ".join(preflight.get("failures") or [])
    parts = [f"<h2 id='preflight'>Preflight ({html.escape(verdict)})</h2>"]
    if preflight.get("all_reduce"):
        parts.append(image(figure(plt, lambda f, a: chart_bus_bandwidth(a, preflight)), "all-reduce bus bandwidth"))
        parts.append(html_table(["size (B)", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "wrong"],
                            [[r["size"], r["time_us"], r["algbw"], r["busbw"], r["wrong"]] for r in preflight["all_reduce"]]))  # fmt: skip
    if preflight.get("p2p"):
        parts.append("<h3>Point to point</h3>")
        parts.append(
            html_table(
                ["from", "to", "GB/s"],
                [[f"{r['src']} ({r['src_host']})", f"{r['dst']} ({r['dst_host']})", r["gbps"]] for r in preflight["p2p"]],
            )
        )
    if preflight.get("compute"):
        parts.append("<h3>Compute (matmul)</h3>")
        parts.append(html_table(["rank", "host", "GFLOP/s"], [[r["rank"], r["host"], r["gflops"]] for r in preflight["compute"]]))
    for warning in preflight.get("warnings") or []:
        parts.append(f"<p>{html.escape(warning)}</p>")
    return "".join(parts)


def render_png(run: Run, plt: Any) -> bytes:
    """One image to paste into a chat: loss, throughput and MFU, the per-rank heatmap, the timeline."""
    fig, axes = plt.subplots(2, 2, figsize=(16, 9))
    chart_loss(axes[0][0], run)
    chart_throughput(axes[0][1], run)
    chart_heatmap(fig, axes[1][0], run, "busy", "busy ms a step, per rank")
    chart_timeline(axes[1][1], run)
    fig.suptitle(f"ddpack run {run.folder.name}: " + ", ".join(f"{k} {v}" for k, v in summary(run)[2:8]), fontsize=10)
    fig.tight_layout()
    return png(plt, fig)


def write_report(run_dir: Path, with_png: bool = False) -> list[Path]:
    run = read_run(run_dir)
    plt = pyplot()
    for warning in run.warnings:
        print(f"report: warning: {warning}", file=sys.stderr)
    written = [run.folder / run_folder.REPORT]
    write_atomically(written[0], render_html(run, plt), mode=0o644)
    if with_png:
        written.append(run.folder / run_folder.REPORT_IMAGE)
        write_atomically(written[1], render_png(run, plt), mode=0o644)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpack.jobs.report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", type=Path, metavar="RUN", help="the run folder (holding metrics.jsonl), or the metrics file itself")
    parser.add_argument("--png", action="store_true", help="also write RUN/report.png, one summary image")
    opts = parser.parse_args(argv)

    def body() -> int:
        for path in write_report(opts.run, opts.png):
            print(f"report: wrote {path}")
        return 0

    return run_verb("report", body)


if __name__ == "__main__":
    raise SystemExit(main())
