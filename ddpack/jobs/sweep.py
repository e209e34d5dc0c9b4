"""A sweep as a whole, for the verbs that take one: `status` (`--watch` too), `logs` (`-f` too, `--point I` for one),
`cancel`, `resubmit --failed` and `tag`. The sweep's record and points themselves (`sweep.json`, the values' cross
product, the placeholders) are ddpack/jobs/sweep_points.py, which submit, status and finding runs read without this."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ddpack.errors import HostError
from ddpack.jobs.sweep_points import SWEEP_RECORD, point_dirs, point_label, read_sweep, sweep_state


def sweep_status(folder: Path) -> dict[str, Any]:
    """The sweep as a whole (status --json's names: run_dir, name, job_id, state) and each point's status."""
    from dataclasses import asdict

    from ddpack.jobs.run_json import read_record
    from ddpack.jobs.status import asked_for, keep_summary, read_summary, run_status, summarized

    data = read_sweep(folder)
    folders = point_dirs(folder)
    records = [read_record(point_dir) for point_dir in folders]
    summaries = [read_summary(point_dir, record) for point_dir, record in zip(folders, records, strict=True)]
    # One squeue (and sacct) for the points still to settle; a settled point's summary answers for it, unread.
    asked = asked_for([record.last_job for record, known in zip(records, summaries, strict=True) if known is None])
    points = []
    for index, (point_dir, record, known) in enumerate(zip(folders, records, summaries, strict=True)):
        if known is not None:
            now = summarized(point_dir, record, known)
        else:
            status = run_status(point_dir, asked(record.last_job))
            keep_summary(point_dir, status)
            now = asdict(status)
        points.append({"index": index, "values": data["points"][index], **now})
    states = [point["state"] for point in points]
    counts = {state: states.count(state) for state in dict.fromkeys(states)}
    return {"run_dir": str(folder), "name": data["name"], "job_id": data.get("job_id"), "state": sweep_state(states),
            "points": points, "counts": counts, "values": data["values"]}  # fmt: skip


def render_sweep(status: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {state}" for state, n in status["counts"].items())
    lines = [
        f"sweep {status['name']}: job array {status['job_id']}, {len(status['points'])} points: {counts}",
        f"  folder {status['run_dir']}",
    ]
    width = max(len(point_label(p["values"])) for p in status["points"])
    lines.append(f"  {'point':>5}  {'values':<{width}}  {'job':>10}  {'state':<10} {'step':>11}  loss")
    for point in status["points"]:
        step = f"{point['step']}/{point['total_steps'] or '?'}" if point["step"] is not None else "-"
        loss = f"{point['loss']:.4g}" if point["loss"] is not None else "-"
        lines.append(
            f"  {point['index']:>5}  {point_label(point['values']):<{width}}  {point['job_id'] or '-':>10}  {point['state']:<10} {step:>11}  {loss}"
        )
    lines.append(f"  a point on its own: ddpack status {status['run_dir']}/INDEX (or its job id, {status['job_id']}_INDEX)")
    return "\n".join(lines)


def cancel_sweep(folder: Path) -> list[str]:
    """scancel every point still waiting or running, by its newest job (the array's element, or a resubmit's own),
    in one call; each point's record says so once Slurm took it."""
    from ddpack.jobs import slurm_cli
    from ddpack.jobs.run_json import append_event

    status = sweep_status(folder)
    live = [point for point in status["points"] if point["state"] not in slurm_cli.ENDED and point["job_id"]]
    # A point whose record names no job (a submit stopped between the array and the points' records): its element.
    unrecorded = [f"{status['job_id']}_{point['index']}" for point in status["points"] if not point["job_id"] and status["job_id"]]
    if not live and not unrecorded:
        raise HostError(f"every point of the sweep {folder} has ended; nothing to cancel", code=2)
    jobs = [*(str(point["job_id"]) for point in live), *unrecorded]
    answer = slurm_cli.ask(["scancel", *jobs])
    if answer.failed:
        raise HostError(f"scancel {' '.join(jobs)}: {answer.failed}", code=1)
    for point in live:
        append_event(Path(point["run_dir"]), {"kind": "cancel", "job_id": point["job_id"]})
    return jobs


def not_completed(status: dict[str, Any]) -> list[dict[str, Any]]:
    return [point for point in status["points"] if point["state"] != "COMPLETED"]


def ended_line(status: dict[str, Any]) -> str:
    """The last word on a sweep that has ended: all completed, or the points that did not, and how to run them again."""
    missed = not_completed(status)
    if not missed:
        return f"sweep {status['name']}: all {len(status['points'])} points COMPLETED"
    named = ", ".join(f"{p['index']} ({point_label(p['values'])}) {p['state']}" for p in missed)
    return (f"sweep {status['name']}: {len(missed)} of {len(status['points'])} points did not complete: {named}; "
            f"ddpack resubmit {status['run_dir']} --failed queues them again")  # fmt: skip


def sweep_exit(status: dict[str, Any]) -> int:
    """0 when every point COMPLETED, else the exit status of the worst point's state (slurm_cli.worst_exit): one FAILED
    point among TIMEOUTs is a failed sweep, whichever point came first."""
    from ddpack.jobs.slurm_cli import worst_exit

    return worst_exit([point["state"] for point in status["points"]])


def one_line(status: dict[str, Any]) -> str:
    import time

    counts = ", ".join(f"{n} {state}" for state, n in status["counts"].items())
    return f"{time.strftime('%H:%M:%S')} sweep {status['name']} job array {status['job_id']} {status['state']}: {counts}"


def watch_sweep(
    folder: Path, *, interval_s: float, tty: bool, out: Any, as_json: bool = False, settle_s: float | None = None
) -> dict[str, Any]:
    """`status SWEEP --watch`: redraw (a terminal), one line a refresh (elsewhere; one JSON object with as_json) until
    every point has ended, held for `settle_s` (a requeue passes through an ended state) unless each point's own last
    decision ended it, as a run's watch does."""
    from ddpack.jobs import slurm_cli
    from ddpack.jobs.status import watch_until_ended

    return watch_until_ended(
        lambda: sweep_status(folder), ended=lambda status: all(point["state"] in slurm_cli.ENDED for point in status["points"]),
        full=render_sweep, line=one_line, as_dict=lambda status: status, interval_s=interval_s, tty=tty, out=out, as_json=as_json,
        settle_s=settle_s, for_good=lambda status: all(point["final"] for point in status["points"]),
    )  # fmt: skip


FOLLOW_POLL_S = 0.5  # how often `logs SWEEP -f` reads the points' logs


def follow_sweep(folder: Path, rank: int | None, out: Any, settle_s: float | None = None) -> dict[str, Any]:
    """`logs SWEEP -f`: every point's log so far under its values, then each new whole line as `[I] line` (I the point),
    following a point's newest job (a resubmit's too), until every point has ended (held `settle_s`, unless each point's
    own last decision ended it); the last status."""
    import time

    from ddpack.jobs import logs as job_logs
    from ddpack.jobs import slurm_cli
    from ddpack.jobs.run_json import read_record

    settle_s = slurm_cli.SETTLE_S if settle_s is None else settle_s
    data = read_sweep(folder)
    folders = point_dirs(folder)
    offsets: dict[str, int] = {}
    for index, point in enumerate(folders):
        out.write(f"== point {index} ({point_label(data['points'][index])}): {point}\n")
        offsets.update(job_logs.print_logs(point, rank, out))
    ended_since, next_check, status, last_pass = None, 0.0, None, False
    while True:
        for index, point in enumerate(folders):
            job = read_record(point).last_job
            if job is None:
                continue
            log = job.log_path(point)
            offset = offsets.get(str(log), 0)
            if log.exists() and log.stat().st_size > offset:
                with log.open("rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
                complete = chunk[: chunk.rfind(b"\n") + 1]
                offsets[str(log)] = offset + len(complete)
                out.writelines(f"[{index}] {line}" for line in complete.decode(errors="replace").splitlines(keepends=True)
                               if job_logs.rank_filter(line, rank))  # fmt: skip
                out.flush()
        now = time.monotonic()
        if now >= next_check:
            status = sweep_status(folder)
            next_check = now + job_logs.POLL_STATE_S
            over = all(point["state"] in slurm_cli.ENDED for point in status["points"])
            ended_since = (ended_since or now) if over else None
        if last_pass and status is not None:
            return status
        for_good = status is not None and all(point["final"] for point in status["points"])
        last_pass = ended_since is not None and (now - ended_since >= settle_s or for_good)  # one more read: the lines of the very end
        time.sleep(0 if last_pass else FOLLOW_POLL_S)


MEND_STATES = ("FAILED", "TIMEOUT")  # FAILED holds Slurm's NODE_FAIL, OUT_OF_MEMORY and BOOT_FAIL (slurm_cli.ddpack_state)


def mend_states(given: str | None) -> tuple[str, ...]:
    """--state S,S,... as ddpack names states (Slurm's NODE_FAIL is FAILED), each a state a point ends in; default
    MEND_STATES."""
    from ddpack.jobs import slurm_cli

    if given is None:
        return MEND_STATES
    states = tuple(dict.fromkeys(slurm_cli.ddpack_state(word.strip().upper()) for word in given.split(",") if word.strip()))
    wrong = [state for state in states if state not in slurm_cli.ENDED]
    if not states or wrong:
        raise HostError(f"--state {given}: expected states a point ends in, from {', '.join(slurm_cli.ENDED)} (comma-separated)", code=2)
    return states


def resubmit_points(folder: Path, states: tuple[str, ...], changes: dict[str, Any]) -> tuple[str, list[int]]:
    """The points of the sweep whose state is one of `states`, queued again as one job array of the sweep's own
    script (`sbatch --array=I,J,...`), each continuing in its own run folder; the others untouched. The array is in
    sweep.json before any point's record is written; (its job id, the points)."""
    from ddpack.jobs import slurm_cli
    from ddpack.jobs.run_actions import resubmit_options, resubmit_ready, undepend
    from ddpack.jobs.run_json import read_record, write_json_atomic
    from ddpack.jobs.submit import record_job

    status = sweep_status(folder)
    picked = [point["index"] for point in status["points"] if point["state"] in states]
    if not picked:
        now = ", ".join(f"{n} {state}" for state, n in status["counts"].items())
        raise HostError(f"no point of the sweep {folder} is {' or '.join(states)} (its points: {now}); nothing to resubmit", code=2)
    changes = {key: value for key, value in changes.items() if value is not None}
    records = {index: read_record(folder / str(index)) for index in picked}
    ready = {index: resubmit_ready(folder / str(index), record) for index, record in records.items()}
    script, export = ready[picked[0]]
    limit = f"%{data['parallel']}" if (data := read_sweep(folder)).get("parallel") else ""
    spares = int(records[picked[0]].settings.get("spares") or 0)
    options = (f"--array={','.join(map(str, picked))}{limit}", *resubmit_options(changes, spares), *undepend(records[picked[0]]))
    job_id = slurm_cli.sbatch(Path(os.path.normpath(script)), folder, export=export, options=options)
    data = read_sweep(folder)  # again: as it is now
    mended = [*data.get("resubmits", []), {"job_id": job_id, "points": picked, "changes": changes}]
    write_json_atomic(folder / SWEEP_RECORD, {**data, "resubmits": mended})
    for index in picked:
        record_job(folder / str(index), f"{job_id}_{index}", "resubmit", changes)
    return job_id, picked


def tag_sweep(folder: Path, tags: dict[str, str], removed: tuple[str, ...], note: str | None) -> dict[str, str]:
    """sweep.json's tags and note (its points' are the points' own records: ddpack tag sets both)."""
    from ddpack.jobs.run_json import write_json_atomic

    data = read_sweep(folder)
    data["tags"] = {key: value for key, value in {**data.get("tags", {}), **tags}.items() if key not in removed}
    if note is not None:
        data["note"] = note or None
    write_json_atomic(folder / SWEEP_RECORD, data)
    return data["tags"]
