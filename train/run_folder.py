"""The run folder: what one run's ranks write and the job templates and host tools read, by one set of names.

    runs/<job name>-<job id>/      (the templates' DDPACK_RUN_DIR; a smoke's build/smoke/<variant>-<id>/)
      snapshots/                   the trainer's snapshots (DDPACK_SNAPSHOT_DIR)
      metrics.jsonl                start, progress, snapshot, eval and end records (DDPACK_METRICS_FILE)
      preflight.json               the preflight's report (entrypoint --preflight-json)
      forensics/                   a hang's evidence (DDPACK_FORENSICS_DIR):
        rank-R.txt                   every thread's stack of rank R (the watchdog's, or the supervisor's abort)
        summary.json                 who fell behind, written once
        unresponsive-nodes           nodes whose ranks stopped answering, one a line (kept out of a retry)
      report.html                  make report's page
      run.json                     `ddpack submit`'s record: image, code, command, settings, versions, each job
                                   (a job started by hand with a template writes one naming itself and its log)
      decisions.jsonl              the job's decisions, a record each: start, placement, staging, preflight, the
                                   step's end and what follows (enroot/ddpack_job.py record), which ddpack status reads
      job/                         the job script as submitted and the helpers it sources (ddpack submit)
      logs/slurm-<job id>.out      each job's log, requeues appended (ddpack submit's --output)

Standard library only: the launcher (entrypoint/supervise.py), the trainer, ddpack_run and the host tools
import these names; enroot/ddpack-job.sh spells them in shell, and tests/test_job_helper.py checks that it
spells the same.
"""

from __future__ import annotations

SNAPSHOTS = "snapshots"
METRICS = "metrics.jsonl"
PREFLIGHT = "preflight.json"
FORENSICS = "forensics"
SUMMARY = "summary.json"
UNRESPONSIVE_NODES = "unresponsive-nodes"
LOST_NODES = ".ddpack-lost-nodes"  # the nodes Slurm dropped from the job during the step (the job program's), fenced
REPORT = "report.html"
REPORT_IMAGE = "report.png"
RUN_RECORD = "run.json"
DECISIONS = "decisions.jsonl"
JOB = "job"
JOB_SCRIPT = "ddpack.sbatch"
LOGS = "logs"


def rank_stacks(rank: int | str) -> str:
    """The file in FORENSICS that holds rank `rank`'s stacks."""
    return f"rank-{rank}.txt"


def job_log(job_id: int | str) -> str:
    """The file in LOGS that holds job `job_id`'s output (Slurm's --output=LOGS/slurm-%j.out)."""
    return f"slurm-{job_id}.out"
