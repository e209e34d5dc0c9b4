"""`ddpack submit / status / logs / cancel / resubmit` against fake Slurm commands and recorded run folders.

Slurm's commands are stand-ins on PATH that answer as a real controller does, including the answers that break
status tools elsewhere: an squeue that times out, an squeue that no longer lists the job, no accounting at all.
The run folders hold the records a real job writes (a requeue, a cancel, 100,000 progress records). The test
cluster's tier (tests/test_lifecycle_cluster.py) runs the same commands on real jobs.
"""

from __future__ import annotations

import io
import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
from job_records import decision, started, step_end, write_decisions

from ddpack import cli
from ddpack.errors import HostError
from ddpack.jobs import listing, status
from ddpack.jobs.find_runs import list_runs, resolve_run
from ddpack.jobs.job_script import render_script
from ddpack.jobs.logs import follow, print_logs
from ddpack.jobs.run_actions import resubmit
from ddpack.jobs.run_json import Job, RunRecord, read_record, write_record
from ddpack.jobs.submit import image_key, submit
from ddpack.jobs.submit_checks import SubmitSettings, setting_problems
from train import run_folder


@pytest.fixture
def slurm(tmp_path, monkeypatch) -> Path:
    return fake_slurm(tmp_path, monkeypatch)


def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of fake Slurm commands first on PATH; each one logs its arguments to calls.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    fake(bin_dir, "sacct", "echo 'sacct: error: Slurm accounting storage is disabled' >&2; exit 1")
    fake(bin_dir, "squeue", "exit 0")
    fake(bin_dir, "srun", "echo '      --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH'")
    partitions = 'echo "debug*|2|idle|(null)"; echo "big|3|idle|(null)"; echo "gpu|3|idle|gpu:2"'
    fake(bin_dir, "sinfo", f'case "$*" in *--version*) echo "slurm-wlm 22.05.8" ;; *) {partitions} ;; esac')
    fake(bin_dir, "sbatch", "echo 101")
    fake(bin_dir, "scancel", "exit 0")
    fake(bin_dir, "enroot", "echo 3.4.1")
    return bin_dir


def fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f'#!/bin/bash\necho "{name} $*" >>"{bin_dir}/calls.log"\n{body}\n')
    path.chmod(0o755)


def squeue_says(bin_dir: Path, state: str, nodes: str = "ddnode[1-2]", job: str = "41") -> None:
    """An squeue that lists job `job` in `state`, in whichever form it is asked: one job (%T|%r|%N, status) or many
    (%i|%T, ls's one call for every run)."""
    fake(bin_dir, "squeue", f'case "$*" in *%i*) echo "{job}|{state}" ;; *) echo "{state}|None|{nodes}" ;; esac')


def calls(bin_dir: Path, name: str) -> list[str]:
    log = bin_dir / "calls.log"
    return [line for line in (log.read_text().splitlines() if log.exists() else []) if line.startswith(name + " ")]


def queued(bin_dir: Path) -> list[str]:
    """The sbatch calls that queue a job (not --test-only's)."""
    return [call for call in calls(bin_dir, "sbatch") if "--test-only" not in call]


def make_run(
    root: Path, *, jobs: tuple[str, ...] = ("41",), records: list[dict] | None = None, logs: dict[str, str] | None = None,
    decisions: list[dict] | None = None,
) -> Path:
    """A run folder as `ddpack submit` and a job leave it: run.json, the metrics `records`, the jobs' `logs` and the
    job's `decisions` (decisions.jsonl; tests/job_records.py writes them as the job's program does)."""
    run_dir = root / "runs" / "cpu-ddp-20261125-120000-abcd"
    (run_dir / run_folder.LOGS).mkdir(parents=True)
    (run_dir / run_folder.JOB).mkdir()
    (run_dir / run_folder.JOB / run_folder.JOB_SCRIPT).write_text("#!/bin/bash\n")
    sqsh = root / "images" / "cpu-ddp-0da569a1216820a3.sqsh"
    sqsh.parent.mkdir(exist_ok=True)
    sqsh.write_bytes(b"hsqs" + b"\0" * 1000)
    record = RunRecord(
        name=run_dir.name, run_dir=str(run_dir), created=time.time(), user="alice", host="login1",
        image={"ref": "cpu-ddp:7b3b-8f80", "image_id": "sha256:0da5"}, sqsh={"path": str(sqsh), "key": image_key(sqsh), "size": 1004},
        code={}, command=[], settings={}, script=f"{run_folder.JOB}/{run_folder.JOB_SCRIPT}",
        script_sha256="e3a6a1b0a2b8b2d1e5a1a0f3b5d1c7e9f2a4c6b8d0e2f4a6c8e0b2d4f6a8c0e2", versions={},
        jobs=[Job(job_id=job, attempt=i + 1, submitted=time.time(), how="submit" if i == 0 else "resubmit") for i, job in enumerate(jobs)],
    )  # fmt: skip
    import hashlib

    record = RunRecord(**{**asdict(record), "jobs": record.jobs, "script_sha256": hashlib.sha256(b"#!/bin/bash\n").hexdigest()})
    write_record(record)
    if records is not None:
        (run_dir / run_folder.METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))
    for job, text in (logs or {}).items():
        (run_dir / run_folder.LOGS / run_folder.job_log(job)).write_text(text)
    if decisions is not None:
        write_decisions(run_dir, decisions)
    return run_dir


def start(t: float, step: int, restart: int = 0, total: int = 232) -> dict:
    return {"time": t, "kind": "start", "world_size": 4, "hosts": ["ddnode1", "ddnode1", "ddnode2", "ddnode2"], "global_step": step,
            "total_steps": total, "slurm_restart_count": restart}  # fmt: skip


def progress(t: float, step: int, eta: float | None = None) -> dict:
    record = {"time": t, "kind": "progress", "global_step": step, "loss": 1.0 / (step + 1), "samples_per_s": 2000.0,
              "rank_step_s": [0.010, 0.012, 0.031, 0.011], "rank_sync_s": [0.004, 0.003, 0.0, 0.004],
              "rank_data_s": [0.001, 0.001, 0.001, 0.001]}  # fmt: skip
    if eta is not None:
        record["eta_s"] = eta
    return record


def end(t: float, step: int, outcome: str, code: int) -> dict:
    return {"time": t, "kind": "end", "outcome": outcome, "exit_code": code, "global_step": step}


BANNER = "ddpack: job 41 (restart {r}) on ddnode[1-2], run dir /fsx/runs/x (continuing)\n"
PREEMPTED = "ddpack: preempted (exit 138); requeueing job 41 (restart 1 of at most 10)\n"
REQUEUED_RUN = [
    start(100, 0),
    progress(101, 10),
    progress(102, 20),
    end(103, 22, "stopped", 138),
    start(130, 22, 1),
    progress(131, 30),
    progress(133, 50),
]
REQUEUED_LOG = BANNER.format(r=0) + "[rank 0/4] step 10\n[rank 3/4] step 10\n" + PREEMPTED + BANNER.format(r=1) + "[rank 0/4] step 30\n"
# What the job recorded of the same two starts: each start (where it began in the log), the preemption's decision.
REQUEUED_DECISIONS = [
    started(99, log_at=0),
    step_end(104, "requeue", PREEMPTED.removeprefix("ddpack: ").strip(), reason="preempted", code=138),
    started(129, restart=1, log_at=REQUEUED_LOG.index(BANNER.format(r=1))),
]


# --------------------------------------------------------------------------- status


def test_status_says_which_recovery_the_run_has_from_the_jobs_record_else_from_submits_plan(tmp_path, slurm) -> None:
    """Before the job says (pending), status shows what submit planned (run.json); once the job's program has resolved
    it on its nodes (its `recovery` record), that; a run with neither (an older ddpack) shows no recovery line."""
    run_dir = make_run(tmp_path, records=[], decisions=[started(99, log_at=0)])
    assert status.run_status(run_dir).recovery is None and "recovery" not in status.render(status.run_status(run_dir))
    planned = {"mode": "in-process", "standbys": 1, "why": "the default where the nodes have no GPUs"}
    write_record(replace(read_record(run_dir), settings={"recovery": planned}))
    said = status.run_status(run_dir)
    assert said.recovery == {**planned, "from": "submit"}
    assert (
        "recovery in-process, 1 standby(s) (the default where the nodes have no GPUs; as submitted: the job has not said yet)"
        in status.render(said)
    )
    resolved = {"mode": "restart", "standbys": 0, "why": "this step could not start its standbys (SLURM_NTASKS_PER_NODE=)"}
    write_decisions(run_dir, [decision(100, "recovery", **resolved)], append=True)
    said = status.run_status(run_dir)
    assert said.recovery == {**resolved, "from": "job"} and json.loads(said.to_json())["recovery"]["mode"] == "restart"
    assert "recovery a restart of the step from its last snapshot (this step could not start its standbys" in status.render(said)
    on_spares = {"mode": "in-process", "standbys": 2, "why": "2 on each spare node", "on_spares": True}
    write_decisions(run_dir, [decision(101, "recovery", **on_spares)], append=True)
    assert "recovery in-process, 2 standby(s) on the spare nodes (2 on each spare node)" in status.render(status.run_status(run_dir))


def test_a_running_requeued_job_shows_both_segments_the_step_of_the_total_an_eta_and_the_slowest_rank(tmp_path, slurm) -> None:
    fake(slurm, "squeue", "echo 'RUNNING|None|ddnode[1-2]'")
    run_dir = make_run(tmp_path, records=REQUEUED_RUN, logs={"41": REQUEUED_LOG}, decisions=REQUEUED_DECISIONS)
    got = status.run_status(run_dir)
    assert (got.state, got.state_from, got.step, got.total_steps) == ("RUNNING", "squeue", 50, 232)
    assert got.eta_s == pytest.approx((232 - 50) * (133 - 131) / (50 - 30))  # no eta_s in the records: the segment's rate
    assert (got.slowest_rank, got.slowest_step_s) == (2, 0.031)
    assert [(s["number"], s["why"], s["from_step"], s["outcome"]) for s in got.segments] == [
        (1, "submitted", 0, "stopped"),
        (2, "preempted (exit 138); requeueing job 41 (restart 1 of at most 10)", 22, None),
    ]
    payload = json.loads(got.to_json())
    assert {"state", "step", "total_steps", "eta_s", "segments"} <= payload.keys() and len(payload["segments"]) == 2
    assert "segment  2 " in status.render(got) and "slowest rank 2 (31.0 ms/step)" in status.render(got)


@pytest.mark.parametrize(
    ("squeue", "expected"),
    [
        ("echo 'PENDING|BeginTime|'", ("REQUEUED", "squeue")),  # requeued: Slurm holds it back a moment
        ("echo 'REQUEUE_HOLD|JobHeldUser|'", ("REQUEUED", "squeue")),
        ("echo 'COMPLETED|None|ddnode[1-2]'", ("COMPLETED", "squeue")),
        ("echo 'CANCELLED|None|ddnode[1-2]'", ("CANCELLED", "squeue")),
        ("echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", ("COMPLETED", "end record")),  # Slurm forgot it
        ("echo 'squeue: error: Socket timed out on send/recv operation' >&2; exit 1", ("COMPLETED", "end record")),
    ],
)
def test_the_state_comes_from_squeue_then_the_run_folder(tmp_path, slurm, squeue: str, expected: tuple[str, str]) -> None:
    fake(slurm, "squeue", squeue)
    run_dir = make_run(tmp_path, records=[*REQUEUED_RUN, end(140, 232, "done", 0)], logs={"41": REQUEUED_LOG}, decisions=REQUEUED_DECISIONS)
    got = status.run_status(run_dir)
    assert (got.state, got.state_from) == expected
    assert got.eta_s is None and got.step == 232
    if "timed out" in squeue:
        assert got.note == "squeue failed (exit 1: squeue: error: Socket timed out on send/recv operation); state from the run folder"


def test_an_squeue_that_fails_never_loses_a_run_and_a_run_with_no_end_record_is_unknown(tmp_path, slurm) -> None:
    """SkyPilot #10457: one empty squeue deleted a run's record. Here a failed squeue leaves the run listed and says
    UNKNOWN (not FAILED) while nothing in the folder settles it; an squeue that answers, but no longer lists the job,
    with no end record, is FAILED."""
    fake(slurm, "squeue", "echo 'squeue: error: Unable to contact slurm controller (connect failure)' >&2; exit 1")
    run_dir = make_run(tmp_path, records=REQUEUED_RUN, logs={"41": REQUEUED_LOG}, decisions=REQUEUED_DECISIONS)
    got = status.run_status(run_dir)
    assert (got.state, got.state_from) == ("UNKNOWN", "run folder") and got.step == 50
    assert [line.split()[0] for line in listing.render_list(listing.list_rows(tmp_path / "runs"))] == [run_dir.name]
    assert (run_dir / run_folder.RUN_RECORD).exists()
    fake(slurm, "squeue", "exit 0")
    assert status.run_status(run_dir).state == "FAILED"


@pytest.mark.parametrize(
    ("line", "state"),
    [("CANCELLED AT 2026-11-25T12:00:00", "CANCELLED"), ("CANCELLED AT 2026-11-25T12:00:00 DUE TO TIME LIMIT", "TIMEOUT")],
)
def test_slurms_own_cancel_line_in_the_log_says_cancelled_or_timeout_without_accounting(tmp_path, slurm, line: str, state: str) -> None:
    log = REQUEUED_LOG + f"slurmstepd: error: *** JOB 41 ON ddnode1 {line} ***\n"
    run_dir = make_run(tmp_path, records=REQUEUED_RUN, logs={"41": log}, decisions=REQUEUED_DECISIONS)
    assert (status.run_status(run_dir).state, status.run_status(run_dir).state_from) == (state, "job log")


def test_a_requeue_is_not_a_cancel_and_a_cancel_before_a_restart_is_not_the_end(tmp_path, slurm) -> None:
    """Slurm writes `CANCELLED AT … DUE TO JOB REQUEUE` when it requeues a job: the run went on. A start Slurm cancelled
    (a preemption) that the job came back from (a start recorded further on in the log) is not the job's end either."""
    requeue = "slurmstepd: error: *** JOB 41 ON ddnode1 CANCELLED AT 2026-11-25T12:00:00 DUE TO JOB REQUEUE ***\n"
    cancel = "slurmstepd: error: *** JOB 41 ON ddnode1 CANCELLED AT 2026-11-25T12:00:00 ***\n"
    for log in (BANNER.format(r=0) + PREEMPTED + requeue + BANNER.format(r=1), BANNER.format(r=0) + cancel + BANNER.format(r=1)):
        again = started(129, restart=1, log_at=log.index(BANNER.format(r=1)))  # long before Slurm's time: the log's place decides
        run_dir = make_run(tmp_path / str(len(log)), records=[*REQUEUED_RUN, end(140, 232, "done", 0)], logs={"41": log},
                           decisions=[started(99, log_at=0), again])  # fmt: skip
        assert (status.run_status(run_dir).state, status.run_status(run_dir).state_from) == ("COMPLETED", "end record")


def test_accounting_answers_when_the_cluster_has_it(tmp_path, slurm) -> None:
    fake(slurm, "sacct", "echo 'TIMEOUT|0:0'")
    run_dir = make_run(tmp_path, records=REQUEUED_RUN)
    assert (status.run_status(run_dir).state, status.run_status(run_dir).state_from) == ("TIMEOUT", "sacct")


def test_a_program_that_writes_no_metrics_still_has_a_state_and_its_segments_from_the_jobs_records(tmp_path, slurm) -> None:
    fake(slurm, "squeue", "echo 'RUNNING|None|ddnode[1-2]'")
    restarted = "the step failed (exit 1); restarting it in this allocation on ddnode1,ddnode2 from its last snapshot (failure restart 1 of at most 1)"
    decisions = [
        started(100, log_at=0),
        step_end(110, "restart", restarted, reason="failed", code=1),
        step_end(120, "requeue", PREEMPTED.removeprefix("ddpack: ").strip(), reason="preempted", code=138),
        started(150, restart=1, log_at=60),
    ]
    run_dir = make_run(tmp_path, logs={"41": "epoch 1\n" * 20}, decisions=decisions)
    got = status.run_status(run_dir)
    assert got.state == "RUNNING" and got.step is None and got.eta_s is None and got.unrecorded == []
    assert [(s["began"], s["why"].split(";")[0]) for s in got.segments] == [
        (100, "submitted"), (110, "the step failed (exit 1)"), (150, "preempted (exit 138)")
    ]  # fmt: skip
    write_decisions(run_dir, [step_end(160, "completed", "the step completed (exit 0)", restart=1, reason="done")], append=True)
    fake(slurm, "squeue", "exit 0")  # MinJobAge later, Slurm has forgotten it: the job's last record still says
    assert (status.run_status(run_dir).state, status.run_status(run_dir).state_from) == ("COMPLETED", "job records")


def test_no_sentence_of_the_log_is_read_and_a_job_without_records_is_said_to_be_one_in_one_line(tmp_path, slurm) -> None:
    """A job of a ddpack older than its records: its log's sentences (the banner, the decisions) say nothing to
    status; its state is Slurm's and the metrics', and status says in one line that its decisions are unknown."""
    fake(slurm, "squeue", "exit 0")
    run_dir = make_run(tmp_path, records=[*REQUEUED_RUN, end(140, 232, "done", 0)], logs={"41": REQUEUED_LOG + "ddpack: the step completed (exit 0)\n"})
    got = status.run_status(run_dir)
    assert (got.state, got.state_from, got.unrecorded) == ("COMPLETED", "end record", ["41"])
    assert [s["why"] for s in got.segments] == ["submitted", "started again (a resubmit)"]  # no sentence told it why
    said = [line for line in status.render(got).splitlines() if "decision records" in line]
    assert said == [f"records  {status.UNRECORDED.format(jobs='41')}"] and "job 41 wrote no decision records (decisions.jsonl)" in said[0]
    (run_dir / run_folder.METRICS).unlink()
    assert (status.run_status(run_dir).state, status.run_status(run_dir).segments) == ("FAILED", [])  # the log's sentences: not read


def test_status_reads_a_run_of_100000_progress_records_without_parsing_them_all(tmp_path, slurm) -> None:
    """Counted, not parsed: the newest records alone are JSON-decoded (bench/bench_lifecycle.py times it)."""
    fake(slurm, "squeue", "echo 'RUNNING|None|ddnode[1-2]'")
    run_dir = make_run(tmp_path)
    with (run_dir / run_folder.METRICS).open("w") as handle:
        handle.write(json.dumps(start(0, 0, total=200_000)) + "\n")
        for step in range(1, 100_001):
            handle.write(json.dumps(progress(step * 0.01, step, eta=(200_000 - step) * 0.01)) + "\n")
    got = status.run_status(run_dir)
    assert (got.step, got.total_steps, got.progress_records) == (100_000, 200_000, 100_000)
    assert got.eta_s == pytest.approx(1000.0)


# --------------------------------------------------------------------------- logs, cancel, resubmit


def test_logs_show_every_job_in_order_and_one_ranks_lines(tmp_path, slurm) -> None:
    run_dir = make_run(tmp_path, jobs=("41", "57"), logs={"41": REQUEUED_LOG, "57": "[rank 3/4] resumed\n[rank 0/4] resumed\npartial"})
    out = io.StringIO()
    print_logs(run_dir, None, out)
    text = out.getvalue()
    assert text.index("==> job 41 (attempt 1, submit) <==") < text.index(PREEMPTED) < text.index("==> job 57 (attempt 2, resubmit) <==")
    assert "partial" not in text  # a line still being written is shown once it is whole
    out = io.StringIO()
    print_logs(run_dir, 3, out)
    assert [line for line in out.getvalue().splitlines() if not line.startswith("==>")] == ["[rank 3/4] step 10", "[rank 3/4] resumed"]


def test_logs_follow_a_job_across_its_requeue_and_exit_with_its_state(tmp_path, slurm, monkeypatch) -> None:
    """The log grows through a requeue (squeue: RUNNING, then PENDING, then RUNNING again, then COMPLETED); follow
    prints what is appended and exits 0 only once COMPLETED has held (a requeue passes through an ended state)."""
    import ddpack.jobs.logs

    answers = slurm / "answers"
    answers.write_text("RUNNING\nCANCELLED\nPENDING\nRUNNING\nCOMPLETED\n")
    fake(slurm, "squeue", f'state=$(head -n1 "{answers}"); [ "$(wc -l <"{answers}")" -gt 1 ] && sed -i 1d "{answers}"; echo "$state||"')
    run_dir = make_run(tmp_path, records=REQUEUED_RUN, logs={"41": BANNER.format(r=0)})
    log = run_dir / run_folder.LOGS / run_folder.job_log("41")
    import threading

    def grow() -> None:
        for text in ("[rank 0/4] step 10\n", PREEMPTED, BANNER.format(r=1), "[rank 0/4] done\n"):
            time.sleep(0.3)
            with log.open("a") as handle:
                handle.write(text)
        with (run_dir / run_folder.METRICS).open("a") as handle:
            handle.write(json.dumps(end(150, 232, "done", 0)) + "\n")

    thread = threading.Thread(target=grow)
    thread.start()
    out = io.StringIO()
    monkeypatch.setattr(ddpack.jobs.logs, "POLL_STATE_S", 0.2)
    code = follow(run_dir, None, out, poll_s=0.05, settle_s=0.5)
    thread.join()
    assert code == 0, out.getvalue()
    text = out.getvalue()
    assert text.index(PREEMPTED) < text.index("[rank 0/4] done") < text.index("ddpack logs: job 41 COMPLETED")


def test_a_job_whose_own_last_decision_ended_it_is_not_waited_on_for_a_requeue(tmp_path, slurm, monkeypatch) -> None:
    """`logs -f` and `status --watch` wait `settle_s` on an ended state only where a requeue may follow it: a job whose
    last record after its last start is a decision nothing follows (completed, end) has ended for good, and they end
    at once (settle_s here is an hour: a wait for it would never end); the requeue's decision still waits."""
    import threading

    import ddpack.jobs.logs

    fake(slurm, "squeue", "echo 'COMPLETED||'")
    monkeypatch.setattr(ddpack.jobs.logs, "POLL_STATE_S", 0.05)
    done = [*REQUEUED_DECISIONS, step_end(140, "completed", "training completed", restart=1)]
    run_dir = make_run(tmp_path, records=[*REQUEUED_RUN, end(140, 232, "done", 0)], logs={"41": REQUEUED_LOG}, decisions=done)
    assert status.run_status(run_dir).ended_for_good
    results: list[object] = []
    out = io.StringIO()
    watched = threading.Thread(target=lambda: results.append(status.watch(run_dir, interval_s=0.05, tty=False, out=io.StringIO(), settle_s=3600)))
    followed = threading.Thread(target=lambda: results.append(follow(run_dir, None, out, poll_s=0.05, settle_s=3600)), daemon=True)
    watched.daemon = True
    for thread in (watched, followed):
        thread.start()
        thread.join(timeout=60)
        assert not thread.is_alive(), "waited out the settle of a job that had ended for good"
    assert results[0].state == "COMPLETED" and results[1] == 0 and out.getvalue().endswith("ddpack logs: job 41 COMPLETED\n")
    requeued = make_run(tmp_path / "other", records=REQUEUED_RUN, logs={"41": REQUEUED_LOG}, decisions=REQUEUED_DECISIONS[:2])
    assert status.run_status(requeued).ended and not status.run_status(requeued).ended_for_good  # a requeue may follow


def test_resubmit_continues_the_run_and_is_refused_when_its_image_changed_or_is_gone(tmp_path, slurm) -> None:
    fake(slurm, "squeue", "echo 'COMPLETED||'")
    run_dir = make_run(tmp_path, records=REQUEUED_RUN)
    fake(slurm, "sbatch", "echo 57")
    assert resubmit(run_dir) == "57"
    assert [(j.job_id, j.attempt, j.how) for j in read_record(run_dir).jobs] == [("41", 1, "submit"), ("57", 2, "resubmit")]
    assert calls(slurm, "sbatch") == [f"sbatch --parsable {run_dir}/job/ddpack.sbatch"]
    sqsh = Path(read_record(run_dir).sqsh["path"])
    os.utime(sqsh, (1, 1))  # copied over, rebuilt, touched: not the file this run ran
    with pytest.raises(HostError, match="changed since this run was submitted"):
        resubmit(run_dir)
    sqsh.unlink()
    with pytest.raises(HostError, match="is gone; submit again"):
        resubmit(run_dir)
    assert len(calls(slurm, "sbatch")) == 1


def test_a_run_is_named_by_its_folder_a_job_id_or_nothing(tmp_path, slurm) -> None:
    run_dir = make_run(tmp_path, jobs=("41", "57"))
    runs = tmp_path / "runs"
    assert resolve_run(None, runs) == resolve_run("57", runs) == resolve_run(str(run_dir), runs) == run_dir.resolve()
    with pytest.raises(HostError, match="job 99 belongs to no run under"):
        resolve_run("99", runs)


def test_cancel_scancels_the_newest_job_and_status_then_says_cancelled(tmp_path, slurm, capsys) -> None:
    run_dir = make_run(tmp_path, jobs=("41", "57"), records=REQUEUED_RUN)
    fake(slurm, "squeue", "echo 'RUNNING|None|ddnode[1-2]'")
    assert cli.main(["cancel", str(run_dir)]) == 0
    assert calls(slurm, "scancel") == ["scancel 57"]
    fake(slurm, "squeue", "exit 0")  # Slurm has forgotten it: run.json still knows
    assert (status.run_status(run_dir).state, status.run_status(run_dir).state_from) == ("CANCELLED", "run.json")


@pytest.mark.parametrize("squeue", ["echo 'COMPLETED|None|'", "exit 0", "echo 'squeue: error: Socket timed out' >&2; exit 1"])
def test_cancel_of_a_job_that_has_ended_or_cannot_be_asked_about_is_one_line_and_records_nothing(tmp_path, slurm, capsys, squeue: str) -> None:
    """scancel says nothing for an ended or unknown job: cancel asks first, so a finished run never reads CANCELLED."""
    fake(slurm, "squeue", squeue)
    run_dir = make_run(tmp_path, records=[*REQUEUED_RUN, end(140, 232, "done", 0)])
    assert cli.main(["cancel", str(run_dir)]) == 2
    assert calls(slurm, "scancel") == [] and read_record(run_dir).events == []
    assert capsys.readouterr().err.count("\n") == 1


def test_a_run_folder_or_record_that_is_not_the_users_own_is_never_listed_or_acted_on(tmp_path, slurm, capsys) -> None:
    """Another user can make a folder in a shared runs folder and plant a run.json naming this user's job ids and a
    script of theirs: ls, status, cancel and resubmit must not take it for a run of this user's."""
    from testbed.users import UsersUnavailable, attacker

    try:
        mallory = attacker()
    except UsersUnavailable as why:
        pytest.skip(str(why))
    fake(slurm, "squeue", "echo 'RUNNING|None|ddnode[1-2]'")
    run_dir = make_run(tmp_path, records=REQUEUED_RUN)
    for path in (run_dir, run_dir / "run.json", run_dir / "job", run_dir / "job" / "ddpack.sbatch"):
        os.chown(path, mallory.uid, mallory.gid)
    assert list_runs(tmp_path / "runs") == []
    for verb in ("cancel", "resubmit", "status"):
        assert cli.main([verb, str(run_dir)]) == 2
        assert "it is not a run of yours" in capsys.readouterr().err
    assert calls(slurm, "scancel") == [] and queued(slurm) == []


# --------------------------------------------------------------------------- submit and its dry run


def settings(tmp_path: Path, **changes) -> SubmitSettings:
    sqsh = tmp_path / "fsx" / "images" / "x.sqsh"
    sqsh.parent.mkdir(parents=True, exist_ok=True)
    if not sqsh.exists():  # kept as it is: make sqsh's record beside it names its size and time
        sqsh.write_bytes(b"hsqs")
    base = {"app_dir": tmp_path, "nodes": 2, "tasks_per_node": 2, "runs": tmp_path / "fsx" / "runs", "images": sqsh.parent,
            "sqsh": sqsh, "mounts": f"{tmp_path / 'fsx'}:/fsx", "name": "cpu-ddp"}  # fmt: skip
    return SubmitSettings(**{**base, **changes})


def made_by_sqsh(sqsh: Path, app_cmd: str) -> None:
    """make sqsh's record beside `sqsh` (ddpack/images/sqsh.py write_record), naming the image's own command."""
    info = sqsh.stat()
    record = {"image": "x:1", "app_cmd": app_cmd, "image_id": "sha256:" + "a" * 64, "squash_options": "-comp lz4", "size": info.st_size,
              "mtime_ns": info.st_mtime_ns}  # fmt: skip
    Path(f"{sqsh}.ddpack.json").write_text(json.dumps(record))


def dry_run_says(tmp_path: Path, capsys, *args: str) -> tuple[list[str], str]:
    """A good setup's dry run with `args` added: (its `submit: ` lines after the script, the script)."""
    good = settings(tmp_path)
    assert cli.main(["submit", "--nodes", "2", "--dry-run", "--runs", str(good.runs), "--sqsh", str(good.sqsh), "--mounts", good.mounts,
                     str(tmp_path), *args]) == 0  # fmt: skip
    out = capsys.readouterr().out
    return [line for line in out.splitlines() if line.startswith(("submit: recovery", "submit: spares"))], out


@pytest.mark.parametrize(
    ("args", "app_cmd", "said", "exported"),
    [
        ((), "", "in-process recovery with 1 standby process(es) (the default where the nodes have no GPUs: one standby", "1"),
        (
            ("--standbys", "2"),
            "",
            "in-process recovery with 2 standby process(es) (asked for: DDPACK_STANDBYS=2 (ddpack submit --standbys 2))",
            "2",
        ),
        (("--standbys", "0"), "", "a restart of the step from its last snapshot (none asked for: DDPACK_STANDBYS=0", "0"),
        (
            ("--gpus-per-node", "2", "--partition", "gpu"),
            "",
            "a restart of the step from its last snapshot (a CUDA job: a standby would hold a GPU",
            "0",
        ),
        (
            ("--", "python", "ddp.py"),
            "",
            "a restart of the step from its last snapshot (your own program runs (a command after --, `python -m train` too), and standbys",
            "0",
        ),
        (("--template", "torchrun"), "", "a restart of the step from its last snapshot (torchrun starts a node's ranks itself", "0"),
        ((), "python train.py", "a restart of the step from its last snapshot (the image runs its own command (its APP_CMD)", "0"),
        ((), None, "a restart of the step from its last snapshot (no make sqsh record says the image runs the bundled trainer", "0"),
        (("--env", "DDPACK_TRAIN_ARGS=--epochs 2"), None, "in-process recovery with 1 standby process(es) (the default where", "1"),
    ],
    ids=["cpu-default", "asked", "none-asked", "cuda", "own-command", "torchrun", "image-command", "image-unknown", "trainer-flags"],
)
def test_a_dry_run_says_which_recovery_the_run_has_and_why_and_the_script_holds_its_count(
    tmp_path, slurm, capsys, args: tuple[str, ...], app_cmd: str | None, said: str, exported: str
) -> None:
    """One standby is the default where the job asks for no GPUs and its tasks run the bundled trainer (the settings
    table's rule, which the job applies too); anything else has the restart, and the dry run says why in one line."""
    if app_cmd is not None:
        made_by_sqsh(settings(tmp_path).sqsh, app_cmd=app_cmd)
    lines, out = dry_run_says(tmp_path, capsys, *args)
    assert lines[0].startswith(f"submit: recovery: {said}"), out
    assert f"export DDPACK_STANDBYS={exported}\n" in out


def test_a_dry_run_says_the_spare_nodes_host_the_standbys_and_an_nccl_standby_is_not_yet_proven(tmp_path, slurm, capsys) -> None:
    """With --spares the standbys live on the spare nodes, as many on each as a node's ranks (a GPU job too: no GPU of a
    node that trains idles for them); --standbys 0 keeps the spares for restarts alone, and the dry run says so."""
    made_by_sqsh(settings(tmp_path).sqsh, app_cmd="")
    gpu = ("--spares", "1", "--gpus-per-node", "2", "--partition", "gpu", "--tasks-per-node", "2")
    lines, out = dry_run_says(tmp_path, capsys, *gpu, "--standbys", "1")
    assert lines == [
        "submit: recovery: in-process recovery with 2 standby process(es) on the spare nodes (2 on each spare node, as many as a "
        "node's ranks, so that a lost node's ranks are replaced in process; asked for: DDPACK_STANDBYS=1 (ddpack submit --standbys 1))",
        "submit: recovery: in-process recovery on NCCL has not yet run across two GPUs (docs/recovery.md): a restart is the proven path",
        "submit: spares: 1 node(s) held back; they host the standbys (2 a spare), which take a lost node's ranks in process; where "
        "recovery cannot, a restart in place swaps a spare in",
    ], out
    lines, out = dry_run_says(tmp_path, capsys, *gpu, "--standbys", "0")
    assert lines[-1] == (
        "submit: spares: 1 node(s) held back for a restart in place after a node fails; they host no standbys "
        "(none asked for: DDPACK_STANDBYS=0 (ddpack submit --standbys 0))"
    ), out


def test_a_run_files_standbys_is_the_flags_and_the_flag_wins(tmp_path, slurm, capsys) -> None:
    good = settings(tmp_path)
    made_by_sqsh(good.sqsh, app_cmd="")
    (tmp_path / "run.toml").write_text(f'nodes = 2\nstandbys = 3\nsqsh = "{good.sqsh}"\nmounts = "{good.mounts}"\nruns = "{good.runs}"\n')
    assert cli.main(["submit", "--file", str(tmp_path / "run.toml"), "--dry-run"]) == 0
    assert "export DDPACK_STANDBYS=3\n" in capsys.readouterr().out
    assert cli.main(["submit", "--file", str(tmp_path / "run.toml"), "--standbys", "0", "--dry-run"]) == 0
    assert "export DDPACK_STANDBYS=0\n" in capsys.readouterr().out


def test_submit_writes_the_record_before_sbatch_and_appends_the_job(tmp_path, slurm) -> None:
    record_first = 'test -f "$(dirname "$(dirname "${@: -1}")")/run.json" && echo 73 || { echo "no run.json yet" >&2; exit 1; }'
    fake(slurm, "sbatch", f'[ "$1" = --test-only ] && exit 0; {record_first}')
    result = submit(settings(tmp_path, command=("python", "ddp.py", "4", "2"), env={"DDPACK_STAGE": "sbcast"}), say=lambda _: None)
    record = read_record(Path(result.run_dir))
    assert result.job_id == "73" and [j.job_id for j in record.jobs] == ["73"]
    script = (Path(result.run_dir) / record.script).read_text()
    assert """export DDPACK_COMMAND='["python", "ddp.py", "4", "2"]'""" in script and "export DDPACK_STAGE=sbcast" in script
    assert f"#SBATCH --output={result.run_dir}/logs/slurm-%j.out" in script and "#SBATCH --nodes=2" in script
    assert record.versions == {"slurm": "slurm-wlm 22.05.8", "pyxis": record.versions["pyxis"], "enroot": "3.4.1"}
    assert sorted(p.name for p in (Path(result.run_dir) / "job").iterdir()) == [
        "ddpack-job.sh", "ddpack.sbatch", "ddpack_job.py", "ddpack_node.py", "ddpack_records.py", "ddpack_settings.py", "ddpack_slurm.py",
        "ddpack_staging.py", "ddpack_step.py", "ddpack_step_records.py", "ddpack_training.py",
    ]  # fmt: skip
    assert os.stat(result.run_dir).st_mode & 0o077 == 0  # the run folder is the user's alone (DDPACK_UMASK 077)
    assert os.umask(0o022) == 0o022  # and the caller's own umask is back (a library call must not change it for good)


@pytest.mark.parametrize(
    ("broken", "line"),
    [
        ("no pyxis", "this cluster's srun has no --container-image (pyxis is not loaded)"),
        ("squashfs not there", "is not a readable file here; the nodes would not find it either"),
        ("too many nodes", "partition debug has 2 nodes that can run a job and the job asks for 3 (--nodes 2 + --spares 1)"),
        ("unwritable log folder", "cannot be written:"),
        ("bad setting", "--env DDPACK_STAGE=sbcats: expected auto, sbcast, off"),
        ("a typo in a setting's name", "--env DDPACK_STAEG: not a ddpack setting (a typo?)"),
        ("standbys for your own program", "--standbys 1: standbys are tasks of the bundled trainer's per-task step (docs/recovery.md); -- COMMAND"),
        ("standbys for the image's own command", "--standbys 1: the image in"),
        ("standbys through --env", "--env DDPACK_STANDBYS: set by submit's own flag --standbys; give that instead"),
        ("trainer flags for your own program", "--env DDPACK_TRAIN_ARGS is for the bundled trainer, and -- COMMAND runs your own program"),
        ("run folder outside the mounts", "is under none of --mounts"),
        ("runs folder another user owns", "who could replace what lies under it; use a folder of your own"),
    ],
)
def test_a_dry_run_names_each_broken_setup_in_one_line_exits_2_and_queues_nothing(tmp_path, slurm, capsys, broken: str, line: str) -> None:
    args = ["submit", "--nodes", "2", "--tasks-per-node", "2", "--dry-run", "--runs", str(tmp_path / "fsx" / "runs"),
            "--sqsh", str(settings(tmp_path).sqsh), "--mounts", f"{tmp_path / 'fsx'}:/fsx", str(tmp_path)]  # fmt: skip
    if broken == "no pyxis":
        fake(slurm, "srun", "echo '      --cpu-bind=...'")
    elif broken == "squashfs not there":
        args[args.index("--sqsh") + 1] = str(tmp_path / "fsx" / "images" / "gone.sqsh")
    elif broken == "too many nodes":
        args += ["--spares", "1"]
    elif broken == "unwritable log folder":
        (tmp_path / "fsx" / "runs").write_text("a file where the runs folder should be")
    elif broken == "bad setting":
        args += ["--env", "DDPACK_STAGE=sbcats"]
    elif broken == "a typo in a setting's name":
        args += ["--env", "DDPACK_STAEG=sbcast"]
    elif broken == "standbys for your own program":
        args += ["--standbys", "1", "--", "python", "ddp.py"]
    elif broken == "standbys for the image's own command":
        made_by_sqsh(settings(tmp_path).sqsh, app_cmd="python train.py")
        args += ["--standbys", "1"]
    elif broken == "standbys through --env":
        args += ["--env", "DDPACK_STANDBYS=1"]
    elif broken == "trainer flags for your own program":  # the job would refuse the pair at its start
        args += ["--env", "DDPACK_TRAIN_ARGS=--epochs 1", "--", "python", "ddp.py"]
    elif broken == "runs folder another user owns":
        from testbed.users import UsersUnavailable, attacker

        try:
            mallory = attacker()
        except UsersUnavailable as why:
            pytest.skip(str(why))
        (tmp_path / "fsx" / "runs").mkdir(mode=0o777)
        os.chown(tmp_path / "fsx" / "runs", mallory.uid, mallory.gid)
    else:
        args[args.index("--mounts") + 1] = "/data:/data"
    assert cli.main(args) == 2
    out, err = capsys.readouterr()
    errors = [text for text in (out + err).splitlines() if text.startswith("ddpack submit: error:")]
    assert len(errors) == 1 and line in errors[0], out + err
    assert queued(slurm) == []


def test_a_dry_run_of_a_good_setup_prints_the_exact_job_script(tmp_path, slurm, capsys) -> None:
    good = settings(tmp_path)
    assert cli.main(["submit", "--nodes", "2", "--tasks-per-node", "2", "--dry-run", "--runs", str(good.runs), "--sqsh", str(good.sqsh),
                     "--mounts", good.mounts, "--name", "cpu-ddp", str(tmp_path)]) == 0  # fmt: skip
    out = capsys.readouterr().out
    expected = render_script(good, (good.runs / "cpu-ddp-<time>").resolve(), good.sqsh.resolve())
    assert out.startswith(expected) and "dry run: every check passed (sbatch --test-only too); nothing was queued" in out
    assert queued(slurm) == [] and not good.runs.exists()
    assert [call.split()[:2] for call in calls(slurm, "sbatch")] == [["sbatch", "--test-only"]]  # the controller was asked


@pytest.mark.parametrize(
    ("spares", "line"),
    [
        ("0", "submit: the preflight checks all 2 nodes before training; a node that fails it ends the job there, named in its log and "
              "record (no spare: --spares 0)"),
        ("1", "submit: the preflight checks all 3 nodes before training; up to 1 node(s) that fail only its node checks are swapped for "
              "the spares and the job trains on the others; more, or any other failure, end the job there, naming them"),
    ],
)  # fmt: skip
def test_a_dry_run_with_the_preflight_says_what_a_failing_node_does_with_and_without_a_spare(
    tmp_path, slurm, capsys, spares: str, line: str
) -> None:
    good = settings(tmp_path)
    args = ["submit", "--nodes", "2", "--tasks-per-node", "2", "--spares", spares, "--dry-run", "--runs", str(good.runs),
            "--sqsh", str(good.sqsh), "--mounts", good.mounts, "--partition", "big", str(tmp_path)]  # fmt: skip
    assert cli.main([*args, "--env", "DDPACK_PREFLIGHT=1"]) == 0
    out, err = capsys.readouterr()
    assert line in (out + err).splitlines(), out + err
    assert cli.main(args) == 0
    out, err = capsys.readouterr()
    assert "submit: the preflight" not in out + err


def test_settings_are_checked_before_anything_runs(tmp_path) -> None:
    problems = setting_problems(
        settings(tmp_path, nodes=0, time_limit="soon", template="mpi", command=("python", "a b.py"), env={"DDPACK_SQSH": "/x"})
    )
    assert len(problems) == 4, problems  # "a b.py" is no problem: the command travels as a list


def test_the_readmes_submit_line_runs_as_written(tmp_path, slurm, monkeypatch, capsys) -> None:
    """The front page's `ddpack submit` line, its ../cpu-ddp swapped for the project and /fsx for a folder here, as a
    dry run with a squashfs made already (the cluster tier submits the same project for real)."""
    import shlex

    from testbed.readme_examples import readme_line, write_cpu_ddp

    fsx = tmp_path / "fsx"
    project = write_cpu_ddp(tmp_path / "cpu-ddp")
    good = settings(tmp_path)
    monkeypatch.setenv("DDPACK_RUNS", str(fsx / "runs"))
    monkeypatch.setenv("DDPACK_IMAGES", str(fsx / "images"))
    monkeypatch.setenv("DDPACK_MOUNTS", f"{fsx}:/fsx")
    words = shlex.split(readme_line(".venv/bin/ddpack submit "))[1:]
    words = [str(project) if word == "../cpu-ddp" else word for word in words]
    cut = words.index("--")
    assert cli.main([*words[:cut], "--dry-run", "--sqsh", str(good.sqsh), *words[cut:]]) == 0
    out = capsys.readouterr().out
    assert """export DDPACK_COMMAND='["python", "ddp.py", "4", "2"]'""" in out and "#SBATCH --ntasks-per-node=2" in out


# --------------------------------------------------------------------------- every verb as a script reads it (issue 50)


def test_every_verb_takes_json_with_status_names_and_a_job_id(tmp_path, slurm, capsys) -> None:
    """cancel, resubmit, logs, report and ls answer in JSON with status --json's names; each takes a job id."""
    squeue_says(slurm, "RUNNING")
    run_dir = make_run(tmp_path, records=REQUEUED_RUN, logs={"41": REQUEUED_LOG}, decisions=REQUEUED_DECISIONS)
    runs = str(tmp_path / "runs")

    def answer(*argv: str) -> dict | list:
        assert cli.main([*argv, "--runs", runs, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    assert answer("status", "41") | {"run_dir": str(run_dir), "job_id": "41", "state": "RUNNING"} == answer("status", "41")
    logs = answer("logs", "41")
    assert (logs["run_dir"], logs["job_id"], logs["state"]) == (str(run_dir), "41", "RUNNING")
    assert logs["jobs"][0]["lines"] == REQUEUED_LOG.splitlines()
    (listed,) = answer("ls")
    assert {key: listed[key] for key in ("run_dir", "name", "job_id", "state", "step", "total_steps")} == {
        "run_dir": str(run_dir), "name": run_dir.name, "job_id": "41", "state": "RUNNING", "step": 50, "total_steps": 232}  # fmt: skip
    assert (listed["tags"], listed["note"], listed["created"] > 0) == ({}, None, True)
    report = answer("report", "41")
    assert report["job_id"] == "41" and report["files"] == [str(run_dir / run_folder.REPORT)]
    cancelled = answer("cancel", "41")
    assert (cancelled["run_dir"], cancelled["job_id"]) == (str(run_dir), "41") and calls(slurm, "scancel") == ["scancel 41"]
    fake(slurm, "squeue", "echo 'CANCELLED|None|'")
    fake(slurm, "sbatch", "echo 57")
    again = answer("resubmit", "41")
    assert (again["job_id"], again["attempt"], again["run_dir"]) == ("57", 2, str(run_dir))
    assert cli.main(["logs", "41", "--runs", runs, "--json", "-f"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.parametrize(("squeue", "code"), [("COMPLETED", 0), ("CANCELLED", 3), ("TIMEOUT", 4), ("PREEMPTED", 5), ("FAILED", 6)])
def test_status_watch_exits_as_logs_follow_does(tmp_path, slurm, monkeypatch, capsys, squeue: str, code: int) -> None:
    import ddpack.jobs.slurm_cli

    monkeypatch.setattr(ddpack.jobs.slurm_cli, "SETTLE_S", 0.0)
    fake(slurm, "squeue", f"echo '{squeue}|None|'")
    run_dir = make_run(tmp_path, records=REQUEUED_RUN, logs={"41": REQUEUED_LOG}, decisions=REQUEUED_DECISIONS)
    assert cli.main(["status", str(run_dir), "--watch", "--interval", "0.01"]) == code
    assert squeue in capsys.readouterr().out


def test_a_job_that_ended_badly_never_exits_as_ddpack_failing_or_refusing(tmp_path, slurm, monkeypatch, capsys) -> None:
    """Exit 1 is ddpack's own failure (a HostError, a traceback) and 2 bad input: no job state shares either, so a
    script that waits with `status --watch` tells "the job failed" from "ddpack could not tell"."""
    import ddpack.jobs.slurm_cli

    assert not {1, 2} & set(ddpack.jobs.slurm_cli.EXIT_FOR_STATE.values())
    monkeypatch.setattr(ddpack.jobs.slurm_cli, "SETTLE_S", 0.0)
    fake(slurm, "squeue", "echo 'FAILED|None|'")
    run_dir = make_run(tmp_path, records=REQUEUED_RUN, logs={"41": REQUEUED_LOG}, decisions=REQUEUED_DECISIONS)
    failed_job = cli.main(["status", str(run_dir), "--watch", "--interval", "0.01"])
    assert failed_job != 1 and cli.main(["status", str(run_dir / "no-such-run"), "--watch"]) == 2 and failed_job != 2


def test_preempted_is_an_end_in_every_verb(tmp_path, slurm, capsys) -> None:
    """A job Slurm preempted and did not requeue (PreemptMode=CANCEL) has ended: status, ls, cancel and resubmit agree."""
    squeue_says(slurm, "PREEMPTED")
    run_dir = make_run(tmp_path, records=REQUEUED_RUN, logs={"41": REQUEUED_LOG}, decisions=REQUEUED_DECISIONS)
    got = status.run_status(run_dir)
    assert (got.state, got.ended, got.eta_s) == ("PREEMPTED", True, None)
    assert listing.list_rows(tmp_path / "runs")[0]["state"] == "PREEMPTED"
    assert cli.main(["cancel", str(run_dir)]) == 2 and "has ended (PREEMPTED)" in capsys.readouterr().err
    fake(slurm, "sbatch", "echo 57")
    assert resubmit(run_dir) == "57"


def test_each_segment_shows_its_start_and_end_after_a_cancel_and_a_resubmit(tmp_path, slurm) -> None:
    """A program that writes no metrics, cancelled while it ran, then resubmitted: both segments have times, from the
    job's start records and from Slurm's cancel line."""
    began = time.mktime((2026, 11, 25, 12, 0, 0, 0, 0, -1))
    cancel = "slurmstepd: error: *** JOB 41 ON ddnode1 CANCELLED AT 2026-11-25T12:05:00 ***\n"
    run_dir = make_run(
        tmp_path, jobs=("41", "57"), logs={"41": "0: epoch 1\n" + cancel, "57": "0: epoch 1\n"},
        decisions=[started(began, log_at=0), started(began + 600, "57", log_at=0)],
    )  # fmt: skip
    fake(slurm, "squeue", "echo 'RUNNING|None|ddnode[1-2]'")
    got = status.run_status(run_dir)
    assert [(s["began"], s["ended"]) for s in got.segments] == [(began, began + 300), (began + 600, None)]
    assert "segment  1 12:00:00-12:05:00" in status.render(got).replace(time.strftime("%H:%M:%S", time.localtime(began)), "12:00:00")


def test_logs_rank_picks_a_users_programs_lines_by_sruns_label(tmp_path, slurm) -> None:
    log = BANNER.format(r=0) + "0: epoch 1 loss 0.5\n1: epoch 1 loss 0.5\n 1: epoch 2\n10: another rank\n[rank 1/4] the trainer's own\n"
    run_dir = make_run(tmp_path, logs={"41": log})
    out = io.StringIO()
    print_logs(run_dir, 1, out)
    assert out.getvalue().splitlines() == ["1: epoch 1 loss 0.5", " 1: epoch 2", "[rank 1/4] the trainer's own"]


def test_the_partition_check_counts_only_nodes_that_can_run_the_job(tmp_path, slurm, capsys) -> None:
    nodes = "debug*|1|idle|gpu:8\\ndebug*|1|drained|gpu:8\\ndebug*|1|idle*|gpu:8\\ndebug*|2|idle|gpu:4(S:0)\\n"
    fake(slurm, "sinfo", f'case "$*" in *--version*) echo "slurm-wlm 22.05.8" ;; *) printf "{nodes}" ;; esac')
    good = settings(tmp_path)
    argv = ["submit", "--nodes", "2", "--dry-run", "--runs", str(good.runs), "--sqsh", str(good.sqsh), "--mounts", good.mounts, str(tmp_path)]
    assert cli.main(argv) == 0  # three nodes can run it: two with 4 GPUs, one with 8
    assert cli.main([*argv[:-1], "--gpus-per-node", "8", argv[-1]]) == 2
    err = capsys.readouterr().err
    assert "partition debug has 1 nodes with 8 GPUs that can run a job (and 4 down, drained, not responding or with fewer GPUs)" in err


def test_the_runs_folder_is_the_users_own_on_the_shared_filesystem_and_named_when_empty(tmp_path, slurm, monkeypatch, capsys) -> None:
    import pwd

    from ddpack.jobs.find_runs import default_runs

    monkeypatch.delenv("DDPACK_RUNS", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_runs() == Path(f"/fsx/{pwd.getpwuid(os.geteuid()).pw_name}/ddpack-runs")
    monkeypatch.setenv("DDPACK_RUNS", str(tmp_path / "elsewhere"))
    assert cli.main(["ls"]) == 0 and capsys.readouterr().out == f"no runs under {tmp_path / 'elsewhere'}\n"
    assert cli.main(["status"]) == 2 and f"no runs under {tmp_path / 'elsewhere'}" in capsys.readouterr().err


def test_a_project_not_under_git_is_recorded_so_with_its_files_digest(tmp_path) -> None:
    import subprocess

    from ddpack.images.app import read_app
    from ddpack.jobs.submit import code_record
    from testbed.readme_examples import write_cpu_ddp

    project = write_cpu_ddp(tmp_path / "cpu-ddp")
    plain = code_record(project, None)
    assert (plain["vcs"], plain["git_commit"], plain["git_dirty"]) == ("not under git", None, None)
    assert plain["digest"] == read_app(project).digest
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    tracked = code_record(project, None)
    assert (tracked["vcs"], tracked["git_dirty"]) == ("git", False) and len(tracked["git_commit"]) == 40


def test_a_missing_host_package_is_one_line_saying_what_to_install(tmp_path) -> None:
    import subprocess
    import sys

    from testbed.env import clean_env

    code = "import sys; sys.modules['docker'] = None; from ddpack.cli import main; raise SystemExit(main(sys.argv[1:]))"
    out = subprocess.run(
        [sys.executable, "-c", code, "submit", "--nodes", "1", "--dry-run", "--runs", str(tmp_path / "runs"), str(tmp_path)],
        env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "needs the Python package 'docker'" in out.stderr and "pip install 'ddpack[host]'" in out.stderr


def test_a_dry_run_of_a_project_whose_squashfs_is_not_made_yet_says_what_it_would_do_and_passes(tmp_path, slurm, monkeypatch, capsys) -> None:
    """The image is built (or not), its squashfs not yet converted: the dry run says so and runs every other check."""
    import ddpack.jobs.submit
    from ddpack.jobs.submit import ImageChoice

    good = settings(tmp_path)
    argv = ["submit", "--nodes", "2", "--dry-run", "--runs", str(good.runs), "--images", str(good.images), "--mounts", good.mounts,
            "--name", "cpu-ddp", str(tmp_path)]  # fmt: skip
    built = ImageChoice(ref="cpu-ddp:7b3b-8f80", image_id="sha256:" + "ab" * 32, bundle="ddpack:src-1", built=False)
    monkeypatch.setattr(ddpack.jobs.submit, "ensure_image", lambda app_dir, **how: built)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"squashfs {good.images}/cpu-ddp-abababababababab.sqsh (would convert the image to it)" in out
    assert "dry run: every check passed" in out and "export DDPACK_SQSH=" in out
    monkeypatch.setattr(ddpack.jobs.submit, "ensure_image", lambda app_dir, **how: None)
    assert cli.main(argv) == 0
    assert "would build" in capsys.readouterr().out


def test_slurms_own_refusal_of_the_script_comes_before_any_build(tmp_path, slurm, monkeypatch, capsys) -> None:
    """sbatch --test-only with the exact script, before the image: a partition's limits, a GRES it lacks, a time
    limit over its maximum cost seconds, not a build."""
    import ddpack.jobs.submit

    refusal = "sbatch: error: Batch job submission failed: Requested node configuration is not available"
    fake(slurm, "sbatch", f'[ "$1" = --test-only ] && {{ echo "{refusal}" >&2; exit 1; }}; echo 9')
    monkeypatch.setattr(ddpack.jobs.submit, "ensure_image", lambda *a, **k: pytest.fail("built before the checks"))
    good = settings(tmp_path)
    argv = ["submit", "--nodes", "2", "--time", "30-00:00:00", "--runs", str(good.runs), "--images", str(good.images), "--mounts", good.mounts,
            str(tmp_path)]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sbatch --test-only refused this job: sbatch: error: Batch job submission failed: Requested node" in err
    assert queued(slurm) == [] and not good.runs.exists()


def test_a_gpu_job_asks_for_the_cuda_image_and_one_rank_per_gpu(tmp_path, slurm, monkeypatch, capsys) -> None:
    """--gpus-per-node N: the project on the CUDA image (with EFA's installer when asked), N ranks a node unless told
    otherwise (then one warning line), Slurm's --gpus-per-node, and a partition whose nodes have the GPUs."""
    import ddpack.jobs.submit

    asked = []
    monkeypatch.setattr(ddpack.jobs.submit, "ensure_image", lambda app_dir, **how: asked.append(how))
    good = settings(tmp_path)
    base = ["submit", "--nodes", "2", "--dry-run", "--runs", str(good.runs), "--images", str(good.images), "--mounts", good.mounts]
    assert cli.main([*base, "--partition", "gpu", "--gpus-per-node", "2", "--efa", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert asked == [{"build": False, "variant": "gpu", "efa": True}] and err == ""
    assert "#SBATCH --gpus-per-node=2" in out and "#SBATCH --ntasks-per-node=2" in out and "bundle's gpu image" in out
    assert cli.main([*base, "--partition", "gpu", "--gpus-per-node", "2", "--template", "torchrun", str(tmp_path)]) == 0
    assert "export DDPACK_NPROC=2" in capsys.readouterr().out
    assert cli.main([*base, "--partition", "gpu", "--gpus-per-node", "2", "--tasks-per-node", "1", str(tmp_path)]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [
        "ddpack submit: warning: --tasks-per-node 1 with --gpus-per-node 2: 1 ranks a node share 2 GPUs, "
        "where one rank per GPU is the rule (leave --tasks-per-node out for it)"
    ]
    assert cli.main([*base, "--efa", str(tmp_path)]) == 2
    assert "--efa adds AWS's EFA installer to the CUDA image: it needs --gpus-per-node" in capsys.readouterr().err
    assert cli.main([*base, "--gpus-per-node", "2", str(tmp_path)]) == 2  # debug's nodes have no GPUs
    assert "partition debug has 0 nodes with 2 GPUs that can run a job (and 2 down, drained, not responding or with fewer GPUs)" in (
        capsys.readouterr().err
    )
    assert [how["variant"] for how in asked] == ["gpu"] * 4  # a dry run goes on to say what it would build


def test_run_json_has_one_lock_the_jobs_own_with_its_fallback_where_the_filesystem_has_no_flock(tmp_path, slurm, monkeypatch) -> None:
    """submit, cancel, resubmit and tag write run.json under the lock the job takes to record a run started by hand
    (enroot/ddpack_records.py `guard`): on a filesystem without flock both fall back to the same O_EXCL guard file."""
    from ddpack.job_side import module
    from ddpack.jobs import run_json

    run_dir = make_run(tmp_path)
    node = module("ddpack_records")

    def no_flock(*_: object) -> None:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(node.fcntl, "flock", no_flock)
    guard_file = run_dir / f".{run_folder.RUN_RECORD}.lock.excl"
    with run_json._locked(run_dir):
        assert guard_file.exists()  # a job's record_hand_made waits here until the host's write is done
    assert not guard_file.exists()
    run_json.update_tags(run_dir, {"k": "v"})
    assert read_record(run_dir).tags == {"k": "v"}
