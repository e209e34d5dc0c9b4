"""enroot/ddpack-job.sh, the helper every Slurm template sources, run by bash without a cluster."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from ddpack.jobs import submit_checks
from testbed.env import ROOT
from train.preflight.verdict import NodeCheck

HELPER = ROOT / "enroot" / "ddpack-job.sh"


def container_path(path: str, mounts: str) -> subprocess.CompletedProcess[str]:
    script = f'. "{HELPER}"; DDPACK_MOUNTS="$2" ddpack_container_path inside "$1"; echo "${{inside}}"'
    return subprocess.run(["bash", "-uc", script, "helper", path, mounts], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("path", "mounts", "inside"),
    [
        ("/fsx/team/runs/a-1", "/fsx:/fsx", "/fsx/team/runs/a-1"),
        ("/shared/team/runs/a-1", "/shared/team:/fsx", "/fsx/runs/a-1"),
        ("/shared/team/runs/a-1", "/data:/data,/shared:/mnt/shared:ro,/shared/team:/fsx", "/fsx/runs/a-1"),
        ("/shared/team", "/shared/team/:/fsx/", "/fsx"),
        ("/fsx/x", "/fsx", "/fsx/x"),
        ("/fsx/runs/a", "/:/host", "/host/fsx/runs/a"),  # the whole host under one folder
        ("/fsx/runs/a", "/:/host,/fsx:/data", "/data/runs/a"),
        ("/fsx", "/fsx:/", "/"),
    ],
)
def test_run_dirs_are_mapped_through_the_mounts(path: str, mounts: str, inside: str) -> None:
    out = container_path(path, mounts)
    assert out.returncode == 0 and out.stdout == inside + "\n", out.stderr
    assert submit_checks.container_path(Path(path), mounts) == inside  # submit's check asks the same rule


def test_a_run_dir_outside_every_mount_is_one_line() -> None:
    out = container_path("/home/me/runs/a-1", "/fsx:/fsx,/fsxdata:/data")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "ddpack: error: /home/me/runs/a-1 is not under any of DDPACK_MOUNTS=/fsx:/fsx,/fsxdata:/data (host:container pairs), "
        "so the container cannot reach it; submit from a folder on a mounted filesystem or add its mount to DDPACK_MOUNTS\n"
    )


@pytest.mark.parametrize(("help_text", "code"), [("  --container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH", 0), ("  --cpu-bind=...", 2)])
def test_pyxis_is_required_before_anything_runs(tmp_path, help_text: str, code: int) -> None:
    fake = tmp_path / "srun"
    fake.write_text(f"#!/bin/sh\necho 'Usage: srun [OPTIONS(0)...]'\necho '{help_text}'\n")
    fake.chmod(0o755)
    script = f'PATH="{tmp_path}:$PATH"; . "{HELPER}"; ddpack_require_pyxis; echo still-here'
    out = subprocess.run(["bash", "-uc", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == code, out.stderr
    assert (out.stdout == "still-here\n") == (code == 0)
    assert ("pyxis is not loaded" in out.stderr) == (code == 2)


def step_command(**settings: str) -> subprocess.CompletedProcess[str]:
    script = f'. "{HELPER}"; ddpack_command /fsx/runs/a-1; printf "<%s>" "${{ddpack_cmd[@]}}"; echo; '
    script += 'echo "$DDPACK_SNAPSHOT_DIR $DDPACK_METRICS_FILE $DDPACK_FORENSICS_DIR"'
    env = {"PATH": "/usr/bin:/bin", **settings}
    return subprocess.run(["bash", "-uc", script], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({}, "<>"),  # the image's own command (APP_CMD), else the bundled trainer
        ({"DDPACK_TRAIN_ARGS": "--task mytask:make --epochs 50"}, "<--task><mytask:make><--epochs><50>"),
        ({"DDPACK_COMMAND": "python ddp.py 50 5"}, "<--><python><ddp.py><50><5>"),
        # A JSON list, as ddpack submit writes it: every word exactly, spaces, quotes, backslashes and empty words too.
        (
            {"DDPACK_COMMAND": json.dumps(["python", "train.py", "--name", "two words", "--note", "it's", "--path", "a\\b", "--empty", ""])},
            "<--><python><train.py><--name><two words><--note><it's><--path><a\\b><--empty><>",
        ),
        ({"DDPACK_TRAIN_ARGS": '["--task", "my task:make", "--note", "$HOME `x`"]'}, "<--task><my task:make><--note><$HOME `x`>"),
    ],
)
def test_the_training_step_runs_your_command_the_trainers_flags_or_the_images_own(settings: dict[str, str], words: str) -> None:
    out = step_command(**settings)
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"{words}\n/fsx/runs/a-1/snapshots /fsx/runs/a-1/metrics.jsonl /fsx/runs/a-1/forensics\n"


def test_the_step_wait_reaches_srun_and_a_bad_one_is_one_line(tmp_path: Path) -> None:
    """DDPACK_STEP_WAIT becomes SLURM_WAIT (srun --wait: how long a frozen rank may outlive the others); a value the
    settings table refuses ends the start before its run folder is made."""
    script = f'. "{HELPER}"; ddpack_command /fsx/runs/a-1; echo "$SLURM_WAIT"'
    waits = [
        subprocess.run(["bash", "-uc", script], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=30)
        for env in ({}, {"DDPACK_STEP_WAIT": "30"})
    ]
    assert [w.stdout.splitlines()[-1] for w in waits] == ["120", "30"]
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "5", "SLURM_SUBMIT_DIR": str(tmp_path), "DDPACK_STEP_WAIT": "2m"}
    bad = subprocess.run(["bash", "-c", f'. "{HELPER}"; ddpack_setup x'], env=env, capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and bad.stderr == "ddpack: error: DDPACK_STEP_WAIT=2m: expected \\d+\n" and not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("value", "why"),
    [("[python, train.py]", "starts with [ but is not a JSON list"), ('["python", 3]', "is JSON but not a list of strings")],
)
def test_a_command_that_starts_as_json_but_is_not_a_list_of_strings_is_one_line(value: str, why: str) -> None:
    out = step_command(DDPACK_COMMAND=value)
    assert out.returncode == 2 and out.stdout == "" and out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"ddpack: error: DDPACK_COMMAND {why}"), out.stderr


def test_a_command_and_trainer_flags_together_are_one_line() -> None:
    out = step_command(DDPACK_COMMAND="python ddp.py", DDPACK_TRAIN_ARGS="--epochs 3")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("ddpack: error: DDPACK_COMMAND and DDPACK_TRAIN_ARGS are both set;") and out.stderr.count("\n") == 1


def after_step(
    tmp_path: Path,
    rc: int,
    *,
    failures: int | None = None,
    unresponsive: str = "",
    hang_summary: bool = False,
    forensics_before_this_start: bool = False,
    partition_nodes: int = 3,
    job_nodes: str = "ddnode1,ddnode2",
    down: str = "",
    then: int = 0,
    step_also: str = "",
    preflight: dict | None = None,
    tres: str = "",
    before_train: str = "",
    step: str = "step",
    **settings: str,
):
    """`ddpack_train x` (ddpack_job.py train) with a step that exits RC, then `then` when it is started again, and
    scontrol and sinfo stubbed (their calls recorded in calls.txt), after a start that ddpack_setup marked; forensics
    written during it, or before it (an earlier start's). `job_nodes`: the job's nodes as Slurm lists them now; `down`:
    those sinfo reports down; `step_also`: shell the step runs before it exits (it may print srun's lines, or change the
    run folder); `preflight`: `ddpack_preflight` first (DDPACK_PREFLIGHT=1), its step writing this preflight.json and
    exiting 1 (None: the report is left as an earlier start wrote it); `tres`: the job's TresPerNode (its GPUs);
    `before_train`: the template's lines before ddpack_train; `step`: the template's step words. Returns what it printed, the
    calls, the run folder and each step's options."""
    run_dir = tmp_path / "run"
    (run_dir / "forensics").mkdir(parents=True)
    if failures is not None:
        (run_dir / ".ddpack-failure-restarts").write_text(f"{failures}\n")
    forensics = {"unresponsive-nodes": unresponsive, "summary.json": "{}" if hang_summary else ""}
    for name, text in forensics.items():
        if text:
            (run_dir / "forensics" / name).write_text(text)
    marker = run_dir / ".ddpack-this-start"
    marker.touch()
    start, earlier = time.time(), time.time() - 3600
    os.utime(marker, (start, start))
    for name, text in forensics.items():
        if text:
            when = earlier if forensics_before_this_start else start + 5
            os.utime(run_dir / "forensics" / name, (when, when))
    calls = tmp_path / "calls.txt"
    steps = tmp_path / "steps.txt"
    # Before the first step Slurm lists the job's nodes as it started (SLURM_JOB_NODELIST, else `job_nodes`), all of them
    # up; once it ran, `job_nodes`, with `down` down: what happened to them during the step.
    first = settings.get("SLURM_JOB_NODELIST", job_nodes)
    scontrol = f"""case "$1 $2" in
"show job") if [ -f "{steps}" ]; then echo "   NodeList={job_nodes}"; else echo "   NodeList={first}"; fi; echo "   TresPerNode={tres}" ;;
"show hostnames") echo "$3" | tr , '\\n' ;;
esac"""
    states = " ".join(f"{n}:{'down*' if n in down.split(',') else 'alloc'}" for n in job_nodes.split(","))
    sinfo = f"""case "$*" in
*" -p "*) echo {partition_nodes} ;;
*" -N "*) if [ -f "{steps}" ]; then for s in {states}; do echo "${{s%%:*}} ${{s#*:}}"; done; fi ;;
esac"""
    for tool, out in (("scontrol", scontrol), ("sinfo", sinfo)):
        (tmp_path / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "{calls}"\n{out}\n')
        (tmp_path / tool).chmod(0o755)
    (tmp_path / "step").write_text(f'#!/bin/sh\necho "$*" >> "{steps}"\n{step_also}\n[ "$(wc -l < "{steps}")" -eq 1 ] && exit {rc}\nexit {then}\n')
    (tmp_path / "step").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "DDPACK_RUN_DIR": str(run_dir), "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2"}
    # No standby unless a test asks (the default on CPU nodes is one): each decision here is about the step alone.
    env |= {"SLURM_JOB_PARTITION": "debug", "SLURM_NTASKS_PER_NODE": "2", "DDPACK_STANDBYS": "0", **settings}
    before = f"{before_train}; " if before_train else ""
    script = f'. "{HELPER}"; {before}ddpack_step=({step}); ddpack_train x'
    if "DDPACK_PREFLIGHT" in settings:
        write = f"cat > {run_dir}/preflight.json <<'EOF'\n{json.dumps(preflight)}\nEOF\n" if preflight is not None else ""
        (tmp_path / "preflight-step").write_text(f"#!/bin/sh\n{write}exit 1\n")
        (tmp_path / "preflight-step").chmod(0o755)
        script = f'. "{HELPER}"; {before}ddpack_step=({step}); ddpack_preflight preflight-step; ddpack_train x'
    out = subprocess.run(["bash", "-uc", script], env=env, capture_output=True, text=True, timeout=30)
    return out, calls.read_text() if calls.exists() else "", run_dir, steps.read_text().splitlines() if steps.exists() else []


IN_PLACE = "restarting it in this allocation on ddnode1,ddnode2 from its last snapshot (failure restart 1 of at most 1)"
DONE = "ddpack: the step completed (exit 0)\n"  # the restarted step's end


@pytest.mark.parametrize(
    ("rc", "settings", "line", "next_"),
    [
        (0, {}, "ddpack: the step completed (exit 0)", "end"),
        (2, {}, "ddpack: the step ended on bad input (exit 2); not requeueing", "end"),
        (138, {}, "ddpack: preempted (exit 138); requeueing job 77 (restart 1 of at most 10)", "requeue"),
        (143, {"SLURM_RESTART_COUNT": "10"}, "ddpack: preempted (exit 143) after 10 restarts, the cap DDPACK_MAX_RESTARTS=10; not requeueing", "end"),
        (137, {}, f"ddpack: the step failed (exit 137); {IN_PLACE}", "restart"),
        (
            137,
            {"DDPACK_RESTART_IN_PLACE": "0"},
            "ddpack: the step failed (exit 137); DDPACK_RESTART_IN_PLACE=0: requeueing job 77 to resume from its last snapshot "
            "(failure restart 1 of at most 1)",
            "requeue",
        ),
        (1, {"DDPACK_MAX_FAILURE_RESTARTS": "0"}, "ddpack: the step failed (exit 1) after 0 failure restarts, the cap DDPACK_MAX_FAILURE_RESTARTS=0;", "end"),
    ],
)
def test_the_exit_status_alone_decides_the_next_start_for_any_command(tmp_path: Path, rc: int, settings: dict[str, str], line: str, next_: str) -> None:
    """A user's own script that exits 138 after SIGUSR1 is requeued like the trainer; a crash restarts in this
    allocation, once; bad input never restarts."""
    out, calls, run_dir, steps = after_step(tmp_path, rc, **settings)
    assert out.returncode == (0 if next_ == "restart" else rc) and out.stderr == "", out.stderr
    assert out.stdout.startswith(line) and out.stdout.count("\n") == (2 if next_ == "restart" else 1), out.stdout
    assert ("scontrol requeue 77" in calls) == (next_ == "requeue")
    assert (run_dir / ".ddpack-failure-restarts").exists() == (next_ != "end" and rc not in (138, 143))
    assert len(steps) == (2 if next_ == "restart" else 1) and steps[0] == "x"
    if next_ == "restart":  # the same nodes, as Slurm lists them now
        assert steps[1] == "--nodes=2 --ntasks=4 --nodelist=ddnode1,ddnode2 x" and out.stdout.endswith(DONE)


def test_a_failure_restart_that_cannot_be_counted_is_not_made(tmp_path: Path) -> None:
    """The run folder's count cannot be written (a full, over-quota or read-only folder; here its path is a folder): a
    step that fails every time runs once and the job ends, naming the file, instead of restarting in place uncounted
    for ever (an in-place restart does not advance SLURM_RESTART_COUNT)."""
    run_dir = tmp_path / "run"
    out, calls, _, steps = after_step(tmp_path, 1, then=1, step_also=f'mkdir -p "{run_dir}/.ddpack-failure-restarts"', DDPACK_MAX_FAILURE_RESTARTS="3")
    assert out.returncode == 1 and len(steps) == 1 and "requeue" not in calls, out.stdout
    assert out.stdout.startswith(
        f"ddpack: the step failed (exit 1); not restarting it: the restart cannot be counted in {run_dir}/.ddpack-failure-restarts ("
    ), out.stdout
    assert json.loads((run_dir / "decisions.jsonl").read_text().splitlines()[-1])["reason"] == "uncounted"


def test_the_failure_cap_holds_when_the_run_folders_count_is_lost(tmp_path: Path) -> None:
    """Each failed step takes the count back to nothing (a host that crashed before the write reached the disk): the
    count kept in memory still caps the restarts in this allocation."""
    out, _, _, steps = after_step(
        tmp_path, 1, then=1, step_also=f'rm -f "{tmp_path}/run/.ddpack-failure-restarts"', DDPACK_MAX_FAILURE_RESTARTS="2"
    )
    assert len(steps) == 3 and out.returncode == 1, out.stdout
    assert out.stdout.splitlines()[-1].startswith("ddpack: the step failed (exit 1) after 2 failure restarts, the cap DDPACK_MAX_FAILURE_RESTARTS=2;")


CRASH_ON_2 = 'echo "srun: error: ddnode2: task 2: Exited with exit code 1" >&2; echo "srun: error: ddnode1: tasks 0-1: Killed" >&2'


def test_a_node_whose_task_crashed_gives_its_place_to_a_spare(tmp_path: Path) -> None:
    """srun names the node whose task crashed first (its peers, which lost it, after it): the restart in this
    allocation takes the spare instead of that node; srun's lines still reach the log."""
    out, calls, run_dir, steps = after_step(
        tmp_path, 1, step_also=CRASH_ON_2, job_nodes="ddnode1,ddnode2,ddnode3", SLURM_JOB_NUM_NODES="3", DDPACK_SPARE_NODES="1"
    )
    assert out.stdout.splitlines()[1] == (
        "ddpack: the step failed (exit 1) when its task on ddnode2 crashed; restarting it in this allocation on ddnode1,ddnode3, "
        "without ddnode2 (its task crashed) from its last snapshot (failure restart 1 of at most 1)"
    ), out.stdout
    assert steps == ["--nodes=2 --ntasks=4 --nodelist=ddnode1,ddnode2 x", "--nodes=2 --ntasks=4 --nodelist=ddnode1,ddnode3 x"]
    assert out.stderr.count("srun: error: ddnode2: task 2: Exited with exit code 1\n") == 2 and "requeue" not in calls
    placement = json.loads((run_dir / "decisions.jsonl").read_text().splitlines()[-3])
    assert placement["kind"] == "placement" and placement["without"] == "ddnode2"


def test_a_node_whose_tasks_crash_twice_is_out_for_the_rest_of_the_job(tmp_path: Path) -> None:
    """No spare: the first crash restarts on the same nodes (a crash may be the program's, and a requeue costs a wait in
    the queue); the second on that node requeues the job without it (ExcNodeList stays with the job)."""
    out, calls, _, steps = after_step(tmp_path, 1, then=1, step_also=CRASH_ON_2, DDPACK_MAX_FAILURE_RESTARTS="3")
    lines = out.stdout.splitlines()
    assert lines[0].endswith(
        "restarting it in this allocation on ddnode1,ddnode2, on ddnode2 again (no other node) from its last snapshot (failure restart 1 of at most 3)"
    ), out.stdout
    assert lines[1:] == [
        "ddpack: the step failed (exit 1) when its task on ddnode2 crashed; 1 healthy node(s) left in the allocation and training needs 2: "
        "requeueing job 77 to resume from its last snapshot (failure restart 2 of at most 3)",
        "ddpack: keeping ddnode2 (its tasks crashed twice) out of the restart",
    ], out.stdout
    assert len(steps) == 2 and calls.splitlines()[-2:] == ["scontrol requeue 77", "scontrol update JobId=77 ExcNodeList=ddnode2"]


def test_the_node_whose_rank_crashed_is_told_from_its_peers_by_their_end_records(tmp_path: Path) -> None:
    """The crashed rank's teardown may outlast its peer's reaction: srun names the peer's node first. The peer's end
    record says a collective failed (a peer left it), so the node kept out is the other one."""
    peer = '{"rank":1,"world_size":2,"host":"ddnode2","outcome":"failed","exit_code":1,"reason":"a collective failed (RuntimeError: x)"}'
    lines = f"echo '[rank 1/2] ddpack-end {peer}'; " + 'echo "srun: error: ddnode2: task 1: Exited with exit code 1" >&2; '
    lines += 'echo "srun: error: ddnode1: task 0: Exited with exit code 1" >&2'
    out, _, _, steps = after_step(
        tmp_path, 1, step_also=lines, job_nodes="ddnode1,ddnode2,ddnode3", SLURM_JOB_NUM_NODES="3", DDPACK_SPARE_NODES="1"
    )
    assert "the step failed (exit 1) when its task on ddnode1 crashed; restarting it in this allocation on ddnode2,ddnode3" in out.stdout
    assert steps[1] == "--nodes=2 --ntasks=4 --nodelist=ddnode2,ddnode3 x" and f"ddpack-end {peer}" in out.stdout


def test_a_node_with_one_crashed_rank_among_several_is_told_by_its_count(tmp_path: Path) -> None:
    """Two ranks a node: rank 3 is killed on ddnode2, rank 2 beside it and ranks 0-1 on ddnode1 say a collective failed.
    srun names ddnode1 first and ddnode2 on two lines; ddnode2 ended more tasks badly than it has ranks a peer left."""
    def end(rank: int, host: str) -> str:
        return f'{{"rank":{rank},"world_size":4,"host":"{host}","outcome":"failed","exit_code":1,"reason":"a collective failed (x)"}}'

    lines = "; ".join(f"echo '[rank {r}/4] ddpack-end {end(r, h)}'" for r, h in ((0, "ddnode1"), (1, "ddnode1"), (2, "ddnode2")))
    lines += '; echo "srun: error: ddnode1: tasks 0-1: Exited with exit code 1" >&2; echo "srun: error: ddnode2: task 2: Exited with exit code 1" >&2'
    lines += '; echo "srun: error: ddnode2: task 3: Killed" >&2'
    out, _, _, _ = after_step(tmp_path, 1, step_also=lines)
    assert "the step failed (exit 1) when its task on ddnode2 crashed;" in out.stdout, out.stdout


def test_a_crash_line_naming_a_node_not_the_jobs_moves_nothing(tmp_path: Path) -> None:
    """srun's lines share the pipe with the tasks' own stderr: a task that prints one naming another node is ignored."""
    forged = 'echo "srun: error: login-node: task 0: Exited with exit code 1" >&2'
    out, _, _, steps = after_step(tmp_path, 1, step_also=forged)
    assert out.stdout == f"ddpack: the step failed (exit 1); {IN_PLACE}\n{DONE}" and len(steps) == 2, out.stdout


@pytest.mark.parametrize(
    ("before", "writes", "ends"),
    [("no", "", True), ("yes", "", False), ("no", '{"time": 2, "kind": "progress", "global_step": 41}', False), ("", "", False)],
)
def test_a_program_that_stops_before_its_first_step_at_every_start_is_not_requeued_again(
    tmp_path: Path, before: str, writes: str, ends: bool
) -> None:
    """Preempted (or stopped at the time limit's warning) with no progress record written during this start, after a
    start before it that wrote none either: the job ends instead of going back to the queue up to 10 times."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"time": 1, "kind": "progress", "global_step": 40}\n')
    earlier = {"kind": "step-end", "verdict": "requeue", "restart": 1, "progress": before}
    (run_dir / "decisions.jsonl").write_text(json.dumps({**earlier, "restart": 0, "progress": "yes"}) + "\n" + json.dumps(earlier) + "\n")
    out, calls, _, steps = after_step(tmp_path, 138, step_also=f"echo '{writes}' >> {run_dir}/metrics.jsonl" if writes else "", SLURM_RESTART_COUNT="2")
    assert len(steps) == 1 and ("scontrol requeue 77" in calls) == (not ends), out.stdout
    if ends:
        assert out.stdout.splitlines()[-1].startswith(
            f"ddpack: preempted (exit 138) with no new step in {run_dir}/metrics.jsonl, as in the start before it: not requeueing"
        )
    last = json.loads((run_dir / "decisions.jsonl").read_text().splitlines()[-1])
    assert last["progress"] == ("yes" if writes else "no") and last["reason"] == ("no-progress" if ends else "preempted")


def test_a_hang_that_names_a_node_the_job_cannot_spare_requeues_without_it_then_not_again(tmp_path: Path) -> None:
    out, calls, run_dir, _ = after_step(tmp_path, 124, unresponsive="ddnode2\n")
    assert out.stdout.splitlines() == [
        f"ddpack: the step ended as hung (exit 124; evidence in {run_dir}/forensics); 1 healthy node(s) left in the allocation and training "
        "needs 2: requeueing job 77 to resume from its last snapshot (failure restart 1 of at most 1)",
        "ddpack: keeping ddnode2 (named unresponsive by the hang's forensics) out of the restart",
    ]
    assert calls.splitlines()[-3:] == ["sinfo -h -p debug -o %D", "scontrol requeue 77", "scontrol update JobId=77 ExcNodeList=ddnode2"]
    again, calls, _, _ = after_step(tmp_path / "again", 124, failures=1)
    assert "after 1 failure restarts, the cap DDPACK_MAX_FAILURE_RESTARTS=1; not requeueing" in again.stdout and "requeue" not in calls


def test_only_the_jobs_own_nodes_named_by_forensics_reach_excnodelist(tmp_path: Path) -> None:
    """unresponsive-nodes is written from what ranks said through the rendezvous store: a name that is not one of the
    job's nodes (another user's injection, a glob) never reaches Slurm's ExcNodeList, and `*` is not expanded."""
    (tmp_path / "train.py").write_text("mine")
    _, calls, _, _ = after_step(tmp_path, 124, unresponsive="ddnode2\n*\nlogin-node\nddnode2,login-node\n")
    assert "scontrol update JobId=77 ExcNodeList=ddnode2" in calls.splitlines(), calls
    assert "login-node" not in calls and "train.py" not in calls


@pytest.mark.parametrize(
    ("job_nodes", "down", "unresponsive", "chosen"),
    [
        ("ddnode1,ddnode2,ddnode3", "ddnode2", "", "ddnode1,ddnode3"),  # set DOWN: still in the job, not healthy
        ("ddnode1,ddnode3", "", "", "ddnode1,ddnode3"),  # lost: Slurm dropped it from the --no-kill job
        ("ddnode1,ddnode2,ddnode3", "", "ddnode1\n", "ddnode2,ddnode3"),  # named by a hang's forensics
    ],
)
def test_a_spare_node_takes_the_place_of_a_bad_one_in_the_same_allocation(
    tmp_path: Path, job_nodes: str, down: str, unresponsive: str, chosen: str
) -> None:
    out, calls, _, steps = after_step(
        tmp_path, 1, job_nodes=job_nodes, down=down, unresponsive=unresponsive, SLURM_JOB_NUM_NODES="3", DDPACK_SPARE_NODES="1"
    )
    lines = out.stdout.splitlines()
    assert lines[0].startswith("ddpack: training on ") and f"restarting it in this allocation on {chosen}" in lines[1], out.stdout
    assert out.stdout.endswith(DONE) and len(lines) == 3
    assert steps[1] == f"--nodes=2 --ntasks=4 --nodelist={chosen} x" and "requeue" not in calls


def test_too_few_healthy_nodes_go_back_to_the_queue(tmp_path: Path) -> None:
    out, calls, _, steps = after_step(
        tmp_path, 1, job_nodes="ddnode1,ddnode2,ddnode3", down="ddnode1,ddnode2", SLURM_JOB_NUM_NODES="3", DDPACK_SPARE_NODES="1"
    )
    assert out.stdout.startswith("ddpack: training on ddnode1,ddnode2; spare: ddnode3\n"), out.stdout
    assert "1 healthy node(s) left in the allocation and training needs 2: requeueing job 77" in out.stdout
    assert len(steps) == 1 and "scontrol requeue 77" in calls


def preflight_report(*failing: str, others: int = 0) -> dict:
    """A preflight.json of three nodes whose `failing` ones have a full 1 MiB /dev/shm, and `others` failures that are
    no node check's (sums, identity, storage), as train/preflight writes it."""
    rows = [
        NodeCheck(node=node, check="shm-free", value="1.0 MiB free of 1.0 MiB" if node in failing else "24.0 GiB free of 24.0 GiB",
                  threshold=">= 256.0 MiB free (the CPU floor)", status="fail" if node in failing else "ok", action="free it")
        for node in ("ddnode1", "ddnode2", "ddnode3")
    ]  # fmt: skip
    failures = [row.line() for row in rows if row.status == "fail"] + ["all-reduce: 3 wrong elements at 4096 B"] * others
    return {"ok": not failures, "failures": failures, "warnings": [], "seconds": 3.0, "node_checks": [dataclasses.asdict(r) for r in rows]}


SWAP = {"SLURM_JOB_NUM_NODES": "3", "job_nodes": "ddnode1,ddnode2,ddnode3", "DDPACK_PREFLIGHT": "1", "DDPACK_SPARE_NODES": "1"}


@pytest.mark.parametrize(("bad", "training"), [("ddnode2", "ddnode1,ddnode3"), ("ddnode3", "ddnode1,ddnode2")])
def test_a_node_that_fails_the_preflights_node_checks_is_swapped_for_a_spare_and_the_same_job_trains_on_the_others(
    tmp_path: Path, bad: str, training: str
) -> None:
    """A training node (ddnode2) or the spare itself (ddnode3) with a full /dev/shm: one line and one record name the
    node, the check and the value; training starts on the others, in this job (no requeue, the container kept)."""
    out, calls, run_dir, steps = after_step(tmp_path, 0, preflight=preflight_report(bad), **SWAP)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines[1] == (
        f"ddpack: preflight failed on node {bad} (shm-free): shm-free: 1.0 MiB free of 1.0 MiB (threshold >= 256.0 MiB free "
        f"(the CPU floor)); swapped for a spare: training on {training} in this job, without {bad} here and in its restarts "
        "(DDPACK_SPARE_NODES=1)"
    ), out.stdout
    assert lines[2] == f"ddpack: training on {training}; spare: none; without {bad} (failed the preflight's node checks)"
    assert steps == [f"--nodes=2 --ntasks=4 --nodelist={training} x"] and out.stdout.endswith(DONE)
    assert "requeue" not in calls and "srun" not in calls
    records = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    swapped = next(r for r in records if r["kind"] == "preflight")
    assert (swapped["result"], swapped["nodes"], swapped["training"]) == ("swapped", [bad], training)
    assert swapped["failed_checks"] == [
        {
            "node": bad,
            "check": "shm-free",
            "value": "1.0 MiB free of 1.0 MiB",
            "threshold": ">= 256.0 MiB free (the CPU floor)",
            "device": "",
        }
    ]
    placed = next(r for r in records if r["kind"] == "placement")
    assert (placed["nodes"], placed["spares"], placed["without"]) == (training, "none", bad)


@pytest.mark.parametrize(
    ("settings", "report", "named", "why"),
    [
        ({"DDPACK_SPARE_NODES": "0"}, preflight_report("ddnode2"), " on node ddnode2 (shm-free)",
         " (DDPACK_SPARE_NODES=0: no spare node to take its place)"),
        ({}, preflight_report("ddnode2", "ddnode3"), " on node ddnode2 (shm-free) on node ddnode3 (shm-free)",
         " (DDPACK_SPARE_NODES=1: 1 healthy node(s) left in the allocation and training needs 2)"),
        ({}, preflight_report("ddnode2", others=1), " on node ddnode2 (shm-free)", ""),  # a wrong sum is no node's alone
        ({}, None, "", ""),  # no report of this start (the preflight died before writing it): an earlier start's says nothing
    ],
    ids=["no-spare", "too-few-spares", "not-only-node-checks", "no-report-of-this-start"],
)  # fmt: skip
def test_a_preflight_failure_no_spare_can_cover_ends_the_job_naming_the_node(
    tmp_path: Path, settings: dict, report: dict | None, named: str, why: str
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old = run_dir / "preflight.json"
    old.write_text(json.dumps(preflight_report("ddnode2")))  # an earlier start's, older than this start's marker
    os.utime(old, (time.time() - 3600,) * 2)
    out, _, run_dir, steps = after_step(tmp_path, 0, preflight=report, **{**SWAP, **settings})
    assert out.returncode == 1 and steps == [], out.stdout
    assert f"ddpack: preflight failed (exit 1){named}; not training{why}. The 'preflight: FAIL' lines" in out.stdout, out.stdout
    record = json.loads((run_dir / "decisions.jsonl").read_text().splitlines()[-1])
    assert record["kind"] == "preflight" and record["result"] == "failed" and record.get("swap", "") == why[2:-1]


def test_a_node_the_preflight_failed_stays_out_of_a_restart_in_place_and_out_of_a_requeue(tmp_path: Path) -> None:
    out, calls, _, steps = after_step(tmp_path, 1, preflight=preflight_report("ddnode2"), **SWAP)
    assert steps == ["--nodes=2 --ntasks=4 --nodelist=ddnode1,ddnode3 x"] * 2, out.stdout
    assert "restarting it in this allocation on ddnode1,ddnode3 from its last snapshot" in out.stdout
    out, calls, _, _ = after_step(
        tmp_path / "requeued", 124, preflight=preflight_report("ddnode2"), partition_nodes=8, DDPACK_RESTART_IN_PLACE="0", **SWAP
    )
    assert "scontrol update JobId=77 ExcNodeList=ddnode2" in calls.splitlines(), calls
    assert "ddpack: keeping ddnode2 (failed the preflight's node checks) out of the restart" in out.stdout


def test_a_node_the_job_cannot_do_without_is_not_kept_out(tmp_path: Path) -> None:
    out, calls, _, _ = after_step(tmp_path, 124, unresponsive="ddnode2\n", partition_nodes=2)
    assert out.stdout.splitlines()[1] == "ddpack: not keeping out ddnode2 (named unresponsive): partition debug has 2 nodes and the job needs 2"
    assert "ExcNodeList" not in calls and "scontrol requeue 77" in calls


def test_a_frozen_rank_killed_by_srun_is_told_as_a_hang_by_this_starts_forensics(tmp_path: Path) -> None:
    """The others' watchdogs exit 124, srun kills the frozen rank DDPACK_STEP_WAIT later, and the step's
    status is that rank's 137: the forensics written during this start say it was a hang."""
    out, calls, run_dir, _ = after_step(tmp_path, 137, hang_summary=True, unresponsive="ddnode2\n")
    assert out.stdout.startswith(f"ddpack: the step ended as hung (exit 137; evidence in {run_dir}/forensics); 1 healthy"), out.stdout
    assert "ExcNodeList=ddnode2" in calls
    stale, calls, _, _ = after_step(tmp_path / "stale", 137, hang_summary=True, unresponsive="ddnode2\n", forensics_before_this_start=True)
    assert stale.stdout == f"ddpack: the step failed (exit 137); {IN_PLACE}\n{DONE}" and "ExcNodeList" not in calls, stale.stdout


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        ({"DDPACK_SPARE_NODES": "one"}, "ddpack: error: DDPACK_SPARE_NODES=one: expected \\d+"),
        ({"DDPACK_SPARE_NODES": "2"}, "ddpack: error: DDPACK_SPARE_NODES=2 leaves no node to train on: the job has 2; ask sbatch for "),
        ({"DDPACK_RESTART_IN_PLACE": "yes"}, "ddpack: error: DDPACK_RESTART_IN_PLACE=yes: expected 0, 1"),
    ],
)
def test_bad_restart_settings_are_one_line_before_training_starts(tmp_path: Path, settings: dict[str, str], line: str) -> None:
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "2", **settings}
    env["DDPACK_RUN_DIR"] = str(tmp_path)
    script = f'. "{HELPER}"; ddpack_step=(echo STEP-RAN); ddpack_train x'
    out = subprocess.run(["bash", "-uc", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "STEP-RAN" not in out.stdout and out.stderr.startswith(line) and out.stderr.count("\n") == 1, out.stderr


SHARE_NOTE = "CPUs (SRUN_CPUS_PER_TASK; set it to choose)"


@pytest.mark.parametrize(
    ("env", "share", "line"),
    [
        ({"SLURM_CPUS_ON_NODE": "96", "SLURM_NTASKS_PER_NODE": "8"}, "12", f"ddpack: each task gets 12 {SHARE_NOTE}\n"),
        ({"SLURM_CPUS_ON_NODE": "96", "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "6"}, "6", f"ddpack: each task gets 6 {SHARE_NOTE}\n"),
        ({"SLURM_CPUS_ON_NODE": "96", "SLURM_NTASKS_PER_NODE": "8", "SRUN_CPUS_PER_TASK": "4"}, "4", ""),  # the job's own
        ({"SLURM_CPUS_ON_NODE": "2", "SLURM_NTASKS_PER_NODE": "2"}, "", ""),  # one each: srun's default
        ({"SLURM_CPUS_ON_NODE": "96"}, "", ""),  # no tasks per node given: srun decides
    ],
)
def test_each_task_of_a_per_gpu_step_gets_its_share_of_the_nodes_cpus(env: dict[str, str], share: str, line: str) -> None:
    """srun does not inherit the job's --cpus-per-task: the helper hands the steps a share of the node."""
    script = f'. "{HELPER}"; ddpack_cpus_per_task; echo "share=${{SRUN_CPUS_PER_TASK:-}}"'
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))}
    out = subprocess.run(["bash", "-uc", script], capture_output=True, text=True, timeout=30, env={**clean, **env})
    assert out.returncode == 0 and out.stdout == f"{line}share={share}\n", out.stderr


def test_the_helper_spells_the_run_folders_names_as_train_run_folder_defines_them() -> None:
    """The run folder's layout is defined once (train/run_folder.py); the job's shell and its Python, which cannot
    import it, must name every file and folder they read or export the same way. Their own dot-files are their business."""
    from ddpack.job_side import module
    from train import run_folder

    text = HELPER.read_text()
    spelled = set(re.findall(r"(?:\$\{DDPACK_RUN_DIR\}|\$\{forensics\}|\$1)/([A-Za-z0-9._-]+)(?:/([A-Za-z0-9._-]+))?", text))
    names = {part for pair in spelled for part in pair if part and not part.startswith((".", "$"))}
    assert names == {run_folder.SNAPSHOTS, run_folder.METRICS, run_folder.PREFLIGHT, run_folder.FORENSICS}, names
    node = module("ddpack_records")
    assert node.LOST_NODES == run_folder.LOST_NODES
    python = (node.FORENSICS, node.METRICS, node.SUMMARY, node.UNRESPONSIVE_NODES, node.REPORT, node.RUN_RECORD, node.DECISIONS)
    assert python == (run_folder.FORENSICS, run_folder.METRICS, run_folder.SUMMARY, run_folder.UNRESPONSIVE_NODES, run_folder.REPORT,
                      run_folder.RUN_RECORD, run_folder.DECISIONS)  # fmt: skip
    out = step_command()
    assert out.stdout.splitlines()[-1] == f"/fsx/runs/a-1/{run_folder.SNAPSHOTS} /fsx/runs/a-1/{run_folder.METRICS} /fsx/runs/a-1/{run_folder.FORENSICS}"


def image_key(sqsh: Path) -> str:
    out = subprocess.run(["python3", "-I", "-S", str(ROOT / "enroot" / "ddpack_job.py"), "key", str(sqsh)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_staged_image_is_named_by_its_content(tmp_path: Path) -> None:
    """make sqsh's record (the image id and the squash options) names the file while it describes it; a file the
    record no longer describes, or one without a record, is named by its size, time and inode, without reading
    it. The helper reads the record that ddpack.images.sqsh writes, by the same name."""
    from ddpack.images.sqsh import record_path, write_record

    sqsh = tmp_path / "x.sqsh"
    sqsh.write_bytes(b"squashfs bytes")
    write_record(sqsh, "ddpack:abc", "sha256:" + "ab" * 32, "-comp lzo -noI")
    named = image_key(sqsh)
    assert re.fullmatch(r"(ab){12}-[0-9a-f]{8}", named) and record_path(sqsh).exists()
    write_record(sqsh, "ddpack:abc", "sha256:" + "ab" * 32, "-comp zstd")
    assert image_key(sqsh) != named and image_key(sqsh).startswith("ab" * 12)  # other options, other content
    sqsh.write_bytes(b"another image")  # the record describes the file as it was: its version names it
    versioned = image_key(sqsh)
    assert re.fullmatch(r"[0-9a-f]{32}", versioned) and image_key(sqsh) == versioned
    copy = tmp_path / "copy.sqsh"
    copy.write_bytes(sqsh.read_bytes())
    assert image_key(copy) != versioned  # another file (a cp), another name: sent again, never mistaken


def test_a_step_slurm_ended_because_its_job_lost_a_node_is_a_failure_not_a_preemption(tmp_path: Path) -> None:
    """Slurm SIGTERMs the tasks of a step whose node went down (143): with a spare the step restarts in place;
    without one the job goes back to the queue as a failure (never counted against DDPACK_MAX_RESTARTS alone)."""
    lost = {"SLURM_JOB_NODELIST": "ddnode1,ddnode2,ddnode3", "SLURM_JOB_NUM_NODES": "3", "DDPACK_SPARE_NODES": "1"}
    out, calls, _, steps = after_step(tmp_path, 143, job_nodes="ddnode1,ddnode3", **lost)
    assert out.stdout == (
        "ddpack: training on ddnode1,ddnode2; spare: ddnode3\n"
        "ddpack: the step ended (exit 143) when the job lost ddnode2; restarting it in this allocation on ddnode1,ddnode3 "
        f"from its last snapshot (failure restart 1 of at most 1)\n{DONE}"
    ), out.stdout
    assert steps == ["--nodes=2 --ntasks=4 --nodelist=ddnode1,ddnode2 x", "--nodes=2 --ntasks=4 --nodelist=ddnode1,ddnode3 x"]
    alone, calls, _, _ = after_step(tmp_path / "alone", 143, job_nodes="ddnode1", SLURM_JOB_NODELIST="ddnode1,ddnode2")
    assert alone.stdout.startswith("ddpack: the step ended (exit 143) when the job lost ddnode2; 1 healthy node(s) left") and "requeue 77" in calls


def staging(tmp_path: Path, answers: str, *, tres: str = "", settings: dict[str, str] | None = None, container: str = ""):
    """`ddpack_prepare_nodes SQSH` (ddpack_job.py stage) with scontrol and srun stubbed: the nodes answer `answers`
    (prepare's lines) for a job on ddnode1 and ddnode2, whose template named its container `container`. Returns the
    run, what it printed, and its decision records."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, mode=0o700)
    images = tmp_path / "images"
    images.mkdir(mode=0o755)
    sqsh = images / "x.sqsh"
    sqsh.write_bytes(b"squashfs bytes")
    sqsh.chmod(0o644)
    stubs = {
        "scontrol": f'case "$1 $2" in\n"show job") echo "   NodeList=ddnode[1-2]"; echo "   {tres}" ;;\n'
        '"show hostnames") case "$3" in "ddnode[1-2]") echo ddnode1; echo ddnode2 ;; *) echo "$3" | tr , "\\n" ;; esac ;;\nesac',
        "srun": f'echo "srun $*" >> "{tmp_path}/calls.txt"\nprintf "%s" "{answers}"',
    }
    for tool, body in stubs.items():
        (tmp_path / tool).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / tool).chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "DDPACK_RUN_DIR": str(run_dir), "SLURM_JOB_ID": "77", **(settings or {})}
    script = f'. "{HELPER}"; ddpack_recording=1; ddpack_container_name={container}; ddpack_prepare_nodes "$1"; echo "image=$ddpack_image"'
    out = subprocess.run(["bash", "-uc", script, "_", str(sqsh)], env=env, capture_output=True, text=True, timeout=60)
    decisions = run_dir / "decisions.jsonl"
    records = [json.loads(line) for line in decisions.read_text().splitlines()] if decisions.exists() else []
    return sqsh, out, records


def test_the_staging_choice_is_the_jobs_one_program_and_its_record(tmp_path: Path) -> None:
    """DDPACK_STAGE=auto for two nodes that lack the image: the model keeps the shared file (sbcast wins from five nodes
    with the table's rates); both holding it: their copies; a node that refuses or does not answer, in a job with no
    named container to give it its own: the shared file, with why. The path is the one answer; the choice is said once
    and recorded."""
    uid = os.getuid()
    cases = [
        ("lacks ddnode2\nlacks ddnode1\n", "shared", "DDPACK_STAGE=auto: for 2 node(s) the model has the shared filesystem ahead of sbcast"),
        ("has ddnode1\nhas ddnode2\n", "held", ""),
        (
            "has ddnode1\nrefuse ddnode2 DDPACK_STAGE_DIR=/tmp/x is a link\n",
            "shared",
            "staging failed on ddnode2 (DDPACK_STAGE_DIR=/tmp/x is a link) and the job names no container to give it its own",
        ),
        (
            "has ddnode1\n",
            "shared",
            "staging failed on ddnode2 (did not answer the prepare step (srun exit 0)) and the job names no container to give it its own",
        ),
        ("refuse ddnode1 too full\nrefuse ddnode2 a link\n", "shared", "staging failed on every node; ddnode1: too full"),
    ]
    for i, (answers, choice, why) in enumerate(cases):
        sqsh, out, records = staging(tmp_path / str(i), answers)
        assert out.returncode == 0, out.stderr
        key = image_key(sqsh)
        image = f"/tmp/ddpack-images-{uid}/{key}.sqsh" if choice == "held" else str(sqsh)
        held = f"ddpack: image: all 2 nodes hold {image} already; the shared filesystem is not read"
        said = held if choice == "held" else f"ddpack: image: every node reads {sqsh} ({why})"
        assert out.stdout == f"{said}\nimage={image}\n" and out.stderr == ""  # the line in the job's log, the path in ddpack_image
        assert [(r["kind"], r["choice"]) for r in records] == [("staging", choice)] and records[0]["job"] == "77"
        calls = (tmp_path / str(i) / "calls.txt").read_text()
        assert calls.startswith("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=ddnode[1-2] ")
        assert f" prepare --dir /tmp/ddpack-images-{uid} --job 77 " in calls
        assert f"--key {key} --size 14 --gpus 0 --need {14 * 5}" in calls  # the copy and its unpack (not a squashfs: x4)


def test_a_node_that_cannot_stage_gets_the_jobs_container_from_the_shared_file_and_the_others_their_copies(tmp_path: Path) -> None:
    """The template's named container reaches the staging: ddnode2 refuses, so the container is made there from the
    shared file (pyxis reuses it in every later step and never opens the local path), and ddpack_image is the copy
    ddnode1 holds."""
    sqsh, out, records = staging(tmp_path, "has ddnode1\nrefuse ddnode2 DDPACK_STAGE_DIR=/tmp/x is a link\n", container="ddpack-77")
    copy = f"/tmp/ddpack-images-{os.getuid()}/{image_key(sqsh)}.sqsh"
    assert out.returncode == 0 and out.stdout == (
        f"ddpack: image: 1 of 2 nodes hold {copy} already\n"
        f"ddpack: image: ddnode2 reads {sqsh} from the shared file alone (DDPACK_STAGE_DIR=/tmp/x is a link); the other nodes keep their copies\n"
        f"image={copy}\n"
    ), out.stdout + out.stderr
    assert [(r["choice"], r.get("node")) for r in records] == [("held", None), ("shared", "ddnode2")]
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls[-1] == f"srun --container-image={sqsh} --container-name=ddpack-77 --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=ddnode2 true"


def test_a_gpu_job_on_a_node_without_its_gpus_ends_in_one_line_before_staging(tmp_path: Path) -> None:
    answers = "nogpu ddnode2 0 GPU device(s) (/dev/nvidia0...), no NVIDIA driver\nlacks ddnode1\n"
    _, out, records = staging(tmp_path, answers, tres="TresPerNode=gres:gpu:2")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "ddpack: error: this job was promised 2 GPU(s) a node, but ddnode2 has 0 GPU device(s) (/dev/nvidia0...), no NVIDIA driver "
        "here, so the image would train on the CPU or fail; submit GPU jobs to a partition whose nodes have their GPUs, or drop "
        "--gpus-per-node to train on CPUs (not requeued)\n"
    )
    assert [(r["kind"], r["verdict"], r["reason"], r["exit"]) for r in records] == [("step-end", "end", "bad-input", "2")]
    assert " --gpus 2" in (tmp_path / "calls.txt").read_text()


@pytest.mark.parametrize(
    ("settings", "line"),
    [
        ({"DDPACK_STAGE": "always"}, "DDPACK_STAGE=always: expected auto, sbcast, off"),
        ({"DDPACK_STAGE_FANOUT": "65"}, "DDPACK_STAGE_FANOUT=65: expected [1-9], [1-5][0-9], 6[0-4]"),
        ({"DDPACK_STAGE_KEEP": "0"}, "DDPACK_STAGE_KEEP=0: expected [1-9]\\d*"),
        ({"DDPACK_STAGE_DIR": "images"}, "DDPACK_STAGE_DIR=images: expected /.*"),
    ],
)
def test_a_bad_staging_setting_is_one_line_before_any_node_is_asked(tmp_path: Path, settings: dict[str, str], line: str) -> None:
    _, out, records = staging(tmp_path, "has ddnode1\nhas ddnode2\n", settings=settings)
    assert out.returncode == 2 and out.stderr == f"ddpack: error: {line}\n" and not (tmp_path / "calls.txt").exists()
    assert [r["reason"] for r in records] == ["bad-input"]


@pytest.mark.parametrize("lc_ctype", [None, "en_US.UTF-8"])
def test_the_steps_get_the_jobs_locale_not_pythons_coerced_one(tmp_path: Path, lc_ctype: str | None) -> None:
    """Python exports LC_CTYPE=C.UTF-8 when it starts under the C locale (PEP 538, even with -I): the job's program hands
    its steps LC_CTYPE as the job's shell had it, unset included (pyxis carries it into the container)."""
    (tmp_path / "scontrol").write_text("#!/bin/sh\n")
    (tmp_path / "scontrol").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "DDPACK_RUN_DIR": str(tmp_path), "SLURM_JOB_ID": "77", "DDPACK_STANDBYS": "0"}
    if lc_ctype:
        env["LC_CTYPE"] = lc_ctype
    script = f'. "{HELPER}"; ddpack_step=(sh -c \'echo "lc=${{LC_CTYPE-unset}} $(env | grep -c ^ddpack_)"\' _); ddpack_train'
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.splitlines()[0] == f"lc={lc_ctype or 'unset'} 0", out.stdout + out.stderr


def test_a_missing_slurm_command_is_a_failed_one_not_a_traceback(tmp_path: Path) -> None:
    """No srun on the PATH: the step fails as the shell would say it (127), the decision is made and said, and no
    Python traceback reaches the job's log."""
    env = {
        "PATH": "/usr/bin:/bin",
        "DDPACK_RUN_DIR": str(tmp_path),
        "SLURM_JOB_ID": "77",
        "DDPACK_MAX_FAILURE_RESTARTS": "0",
        "DDPACK_STANDBYS": "0",
    }
    script = f'. "{HELPER}"; ddpack_step=(srun-that-is-not-here); ddpack_train x'
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 127 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.startswith("ddpack: the step failed (exit 127) after 0 failure restarts"), out.stdout


def test_a_node_is_sent_its_own_program_alone_and_no_job_file_is_over_900_lines() -> None:
    """Each node runs ddpack_node.py as `python3 -c TEXT` (it needs no checkout): that file alone, which imports nothing
    beside it, well under the 128 KiB Linux allows one argument (MAX_ARG_STRLEN). The job's program is split by concern,
    no file of it over 900 lines."""
    node = (ROOT / "enroot" / "ddpack_node.py").read_text()
    assert len(node.encode()) < 64 * 1024 and not re.search(r"^\s*(from|import) ddpack_", node, re.MULTILINE)
    for path in (ROOT / "enroot").glob("*.py"):
        assert len(path.read_text().splitlines()) <= 900, path.name


PYXIS_SPARE = {"SLURM_JOB_NODELIST": "ddnode1,ddnode2,ddnode3", "SLURM_JOB_NUM_NODES": "3", "DDPACK_SPARE_NODES": "1"}
PYXIS_STEP = {"before_train": "ddpack_container_name=ddpack-77", "step": "step --container-image=/images/x.sqsh"}


@pytest.mark.parametrize("made", [0, 1], ids=["made", "failed"])
def test_a_spares_container_is_made_beside_training_and_a_swap_onto_it_waits_for_that(tmp_path: Path, made: int) -> None:
    """A pyxis job with a spare makes its container on the spare while the first step trains (one srun there, `true` in
    the job's container), so that the swap after a lost node does not unpack the image on its critical path; the swap's
    step starts on the spare only once that making ended (the stand-in takes 1 s and the first step waits for it to
    begin: a step that did not wait would find it still running). A making that failed is one line, and the step goes on."""
    running, log = tmp_path / "warm-running", tmp_path / "warm.txt"
    making = f'touch "{running}"; echo "$*" >> "{log}"; sleep 1; rm "{running}"; exit {made}'
    (tmp_path / "srun").write_text(f'#!/bin/sh\ncase "$*" in *" true") {making} ;; esac\n')  # the container's removal: nothing
    (tmp_path / "srun").chmod(0o755)
    began = f'while [ ! -s "{log}" ]; do sleep 0.05; done; [ -e "{running}" ] && echo "warm still running" >> "{log}"'
    out, _, _, steps = after_step(tmp_path, 143, job_nodes="ddnode1,ddnode3", step_also=began, **PYXIS_SPARE, **PYXIS_STEP)
    assert steps[1].endswith("--nodelist=ddnode1,ddnode3 x"), steps
    assert log.read_text().splitlines() == [
        "--container-image=/images/x.sqsh --container-name=ddpack-77 --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist=ddnode3 true",
        "warm still running",  # the first step, on ddnode1,ddnode2, did not wait: it need not
    ], log.read_text()
    failed = "ddpack: warning: making the job's container on ddnode3 beside training failed (srun exit 1); this step makes it there\n"
    assert (failed in out.stdout) == bool(made), out.stdout


def test_a_job_that_ends_while_its_spares_container_is_being_made_stops_that_making_first(tmp_path: Path) -> None:
    """The job's container leaves every node at its end: a making still under way on the spare is stopped first (srun
    SIGTERMed, which cancels its step), never left racing the removal, and the job does not wait for it."""
    log = tmp_path / "warm.txt"
    # Its sleep goes with it, as a real srun's step does when srun is ended: an orphan would hold the output pipe 20 s.
    srun = f'#!/bin/sh\ncase "$*" in *" true") trap \'echo stopped >> "{log}"; kill $!; exit 143\' TERM; echo making >> "{log}"; sleep 20 & wait ;; esac\n'
    (tmp_path / "srun").write_text(srun)
    (tmp_path / "srun").chmod(0o755)
    began = f'while [ ! -s "{log}" ]; do sleep 0.05; done'
    out, _, _, steps = after_step(tmp_path, 0, job_nodes="ddnode1,ddnode2,ddnode3", step_also=began, **PYXIS_SPARE, **PYXIS_STEP)
    assert out.returncode == 0 and len(steps) == 1, out
    assert log.read_text().splitlines() == ["making", "stopped"], log.read_text()


def test_a_restart_decision_asks_slurm_once_for_each_fact(tmp_path: Path) -> None:
    """One decision, one read of each: the job's nodes (scontrol show job), their names (show hostnames) and their health
    (sinfo) are asked once and passed on to every part of it (the lost nodes, the placement, the spares); the start's
    placement too."""
    spare = {"SLURM_JOB_NODELIST": "ddnode1,ddnode2,ddnode3", "SLURM_JOB_NUM_NODES": "3", "DDPACK_SPARE_NODES": "1"}
    mark = f'echo step >> "{tmp_path / "calls.txt"}"'
    out, calls, _, steps = after_step(tmp_path, 137, job_nodes="ddnode1,ddnode2,ddnode3", step_also=mark, **spare)
    assert len(steps) == 2 and "restarting it in this allocation" in out.stdout, out.stdout
    start, decision, _ = calls.split("step\n")
    for asked in (start, decision):
        assert sorted(" ".join(line.split()[:3]) for line in asked.splitlines()) == ["scontrol show hostnames", "scontrol show job", "sinfo -h -N"]


def test_a_slurm_that_does_not_answer_is_never_read_as_lost_nodes(tmp_path: Path) -> None:
    """scontrol show hostnames fails once the step has run (slurmctld busy): a preempted step is still a preemption,
    requeued, not a failure of "every node lost" that would spend the run's failure restarts."""
    steps = tmp_path / "steps.txt"
    (tmp_path / "scontrol").write_text(
        '#!/bin/sh\ncase "$1 $2" in\n"show job") echo "   NodeList=ddnode[1-3]" ;;\n'
        f'"show hostnames") [ -f "{steps}" ] && exit 1; echo ddnode1; echo ddnode2; echo ddnode3 ;;\nesac\n'
    )
    (tmp_path / "sinfo").write_text("#!/bin/sh\n")
    (tmp_path / "step").write_text(f'#!/bin/sh\necho "$*" >> "{steps}"\nexit 138\n')
    for tool in ("scontrol", "sinfo", "step"):
        (tmp_path / tool).chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "DDPACK_RUN_DIR": str(tmp_path), "SLURM_JOB_ID": "77", "SLURM_JOB_NUM_NODES": "3"}
    env |= {"SLURM_NTASKS_PER_NODE": "2", "DDPACK_SPARE_NODES": "1", "DDPACK_STANDBYS": "0"}
    out = subprocess.run(["bash", "-c", f'. "{HELPER}"; ddpack_step=(step); ddpack_train x'], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 138 and "Traceback" not in out.stderr, out.stderr
    assert out.stdout.splitlines()[-1] == "ddpack: preempted (exit 138); requeueing job 77 (restart 1 of at most 10)", out.stdout


def test_a_full_log_costs_its_lines_not_the_steps_status(tmp_path: Path) -> None:
    """The job's log on a full disk (stdout is /dev/full): the program's lines are lost, and the job still ends with the
    step's own status, decided and recorded (Python's exit flush would otherwise make it 120)."""
    (tmp_path / "scontrol").write_text("#!/bin/sh\n")
    (tmp_path / "scontrol").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "DDPACK_RUN_DIR": str(tmp_path), "SLURM_JOB_ID": "77", "DDPACK_STANDBYS": "0"}
    script = f'. "{HELPER}"; ddpack_step=(sh -c "exit 143" _); ddpack_train >/dev/full'
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 143, out.stderr
    assert json.loads((tmp_path / "decisions.jsonl").read_text().splitlines()[-1])["verdict"] == "requeue"


# ---------------------------------------------------------------- standbys (DDPACK_STANDBYS): the template half of in-process recovery


def end_line(rank: int, code: int, world: int = 4) -> str:
    """A rank's end record as the trainer prints it (train/outcome.py)."""
    record = {"rank": rank, "world_size": world, "host": "ddnode1", "outcome": {0: "done", 1: "failed"}.get(code, "stopped"), "exit_code": code}
    return f"echo '[rank {rank}/{world}] ddpack-end {json.dumps(record, separators=(',', ':'))}'"


def test_standbys_are_extra_tasks_of_the_training_step_placed_task_by_task_without_srun_wait(tmp_path: Path) -> None:
    """DDPACK_STANDBYS=1 on 2 nodes x 2 ranks: one step of 6 tasks, the 5th (the standby) on the first node, the 6th the
    store task (DDPACK_STORE_TASK=1) on the first node, the store's address; srun's --wait and the job's
    --ntasks-per-node do not reach the step, a dead rank does not end it. Rank 3 SIGKILLed and replaced in process:
    srun says 137, every rank's end record says 0, and the step completed, with the recovery recorded."""
    record = f"{tmp_path}/step-env.txt"
    seen = "wait=${SLURM_WAIT-unset} per-node=${SLURM_NTASKS_PER_NODE-unset} store-task=${DDPACK_STORE_TASK-unset}"
    shows = f'cat "$SLURM_HOSTFILE" > "{record}"; echo "{seen}" >> "{record}"; '
    recovered = f"""echo '{{"kind": "recovery", "global_step": 11}}' >> "{tmp_path}/run/metrics.jsonl"; """
    lines = "; ".join([*(end_line(rank, 0) for rank in range(4)), 'echo "srun: error: ddnode2: task 3: Killed" >&2'])
    out, _, run_dir, steps = after_step(
        tmp_path, 137, step_also=shows + recovered + lines, DDPACK_STANDBYS="1", SLURM_WAIT="120", SLURM_JOB_NODELIST="ddnode1,ddnode2"
    )
    assert steps == ["--nodes=2 --ntasks=6 --distribution=arbitrary --overcommit --kill-on-bad-exit=0 x"], steps
    assert Path(record).read_text() == "ddnode1\nddnode1\nddnode2\nddnode2\nddnode1\nddnode1\nwait=unset per-node=unset store-task=1\n"
    assert out.returncode == 0, out.stdout + out.stderr
    said = [line for line in out.stdout.splitlines() if line.startswith("ddpack: ")]
    assert said == [
        "ddpack: 1 standby process(es) start with each training step (DDPACK_STANDBYS): a rank that dies is replaced in process",
        "ddpack: the step's tasks that ended badly were ranks replaced in process (1 recovery); every rank ended 0",
        f"ddpack: metrics in {run_dir}/metrics.jsonl; for the run report ({run_dir}/report.html) run, in the ddpack checkout: make report RUN={run_dir}",
        "ddpack: the step completed (exit 0)",
    ], out.stdout
    end = json.loads((run_dir / "decisions.jsonl").read_text().splitlines()[-1])
    assert (end["verdict"], end["recovered"]) == ("completed", "1")


def test_with_standbys_a_step_whose_ranks_disagree_is_decided_by_sruns_status_and_restarts_in_place(tmp_path: Path) -> None:
    """Recovery fell back (the survivors exit 1, the dead rank said nothing): srun's status decides, as without standbys,
    and the restarted step starts its standbys again."""
    lines = "; ".join([end_line(0, 1), end_line(1, 1), end_line(2, 1)])
    out, _, _, steps = after_step(tmp_path, 137, step_also=lines, DDPACK_STANDBYS="1", SLURM_JOB_NODELIST="ddnode1,ddnode2")
    assert "ddpack: the step failed (exit 137); restarting it in this allocation on ddnode1,ddnode2" in out.stdout, out.stdout
    assert len(steps) == 2 and steps[1] == steps[0] == "--nodes=2 --ntasks=6 --distribution=arbitrary --overcommit --kill-on-bad-exit=0 x"


def test_with_standbys_a_task_still_alive_after_rank_0_ended_is_ended_after_the_step_wait(tmp_path: Path) -> None:
    """srun's --wait is off with standbys (its clock starts at the first task's end: a dead rank's); the job program
    holds the same guard from rank 0's end. Here the step prints rank 0's end and then never ends (a frozen task):
    DDPACK_STEP_WAIT=1 later it is ended, and counted a failure (137), not a preemption."""
    frozen = f'{end_line(0, 1)}; [ "$(wc -l < "{tmp_path}/steps.txt")" -eq 1 ] && exec sleep 60'
    out, _, _, steps = after_step(
        tmp_path, 1, step_also=frozen, DDPACK_STANDBYS="1", DDPACK_STEP_WAIT="1", DDPACK_MAX_FAILURE_RESTARTS="0", SLURM_JOB_NODELIST="ddnode1,ddnode2"
    )
    assert len(steps) == 1 and out.returncode == 137, out.stdout + out.stderr
    assert "ddpack: the run ended 1 s ago and the step has not (a task frozen, or a standby that cannot leave): ending it (DDPACK_STEP_WAIT)" in out.stdout
    assert "ddpack: the step failed (exit 137) after 0 failure restarts" in out.stdout, out.stdout


def test_with_standbys_rank_0_killed_and_replaced_does_not_end_the_step(tmp_path: Path) -> None:
    """The store task serves the store, so rank 0 is replaced as any rank: srun's line that task 0 was killed is no end
    of the run (the step wait does not start from it); the run ends with the ranks' end records, rank 0's the standby's.
    The ranks had formed their group (their start lines): a death before that ends the step (test_recovery_job.py)."""
    started = 'echo "[rank 0/4] start: rank 0 world 4 local_rank 0/2 backend gloo device cpu host ddnode1"'
    replaced = "; ".join([started, 'echo "srun: error: ddnode1: task 0: Killed" >&2', "sleep 2", *(end_line(rank, 0) for rank in range(4))])
    out, _, _, steps = after_step(tmp_path, 137, step_also=replaced, DDPACK_STANDBYS="1", DDPACK_STEP_WAIT="1", SLURM_JOB_NODELIST="ddnode1,ddnode2")
    assert len(steps) == 1 and out.returncode == 0, out.stdout + out.stderr
    assert "ending it (DDPACK_STEP_WAIT)" not in out.stdout and "ddpack: the step completed (exit 0)" in out.stdout, out.stdout


def test_a_node_whose_ranks_the_spares_standbys_took_in_process_is_said_recorded_and_left_out_of_the_restarts_placement(
    tmp_path: Path,
) -> None:
    """DDPACK_SPARE_NODES=1 on 3 nodes x 2 ranks: the step's standbys live on the spare (2, a node's ranks), with srun's
    --no-kill so that a node set DOWN does not end the step. ddnode2's ranks replaced in process by ddnode3's standbys
    (the recovery record names the ranks' hosts): one line and a `placement` record say ddnode3 trains now; the step's
    later failure restarts it where the ranks were (ddnode1, ddnode3), with ddnode2 the spare that hosts the standbys.
    srun's line that ddnode2 failed puts it in the run folder's lost-nodes file, which the step's store task fences;
    the next step starts without it."""
    hosts_seen = tmp_path / "hosts.txt"
    recovery = {"time": 1.0, "kind": "recovery", "global_step": 11, "hosts": ["ddnode1", "ddnode1", "ddnode3", "ddnode3"]}
    (tmp_path / "recovery.json").write_text(json.dumps(recovery) + "\n")
    lost = f"{tmp_path}/run/.ddpack-lost-nodes"  # what the step's store task reads (train/run_folder.py LOST_NODES)
    recovered = (
        f'if [ "$(wc -l < "{tmp_path}/steps.txt")" -eq 1 ]; then echo "srun: error: Node failure on ddnode2" >&2; '
        f'for _ in $(seq 100); do [ -s "{lost}" ] && break; sleep 0.1; done; cp "{lost}" "{tmp_path}/lost-seen"; '
        f'cat "{tmp_path}/recovery.json" >> "{tmp_path}/run/metrics.jsonl"; '
        "echo '[rank 0/4] recovery: trained global step 11 in generation 1, 0.400s after the failed collective'; "
        f'else [ -e "{lost}" ] && echo "a lost node of the step before is fenced again" >&2; fi; '
    )
    out, _, run_dir, steps = after_step(
        tmp_path, 1, step_also=f'{recovered}cat "$SLURM_HOSTFILE" >> "{hosts_seen}"', job_nodes="ddnode1,ddnode2,ddnode3",
        SLURM_JOB_NUM_NODES="3", DDPACK_SPARE_NODES="1", DDPACK_STANDBYS="1",
    )  # fmt: skip
    assert out.returncode == 0 and out.stderr == "srun: error: Node failure on ddnode2\n", out.stdout + out.stderr
    assert steps == [
        "--nodes=3 --ntasks=7 --distribution=arbitrary --overcommit --kill-on-bad-exit=0 --no-kill x",
        "--nodes=3 --ntasks=7 --distribution=arbitrary --overcommit --kill-on-bad-exit=0 --no-kill x",
    ], steps
    first, second = (hosts_seen.read_text().split("\n")[index * 7 : index * 7 + 7] for index in (0, 1))
    assert first == ["ddnode1", "ddnode1", "ddnode2", "ddnode2", "ddnode3", "ddnode3", "ddnode1"]
    assert second == ["ddnode1", "ddnode1", "ddnode3", "ddnode3", "ddnode2", "ddnode2", "ddnode1"]  # ranks where they were
    said = [line for line in out.stdout.splitlines() if line.startswith("ddpack: ")]
    assert (tmp_path / "lost-seen").read_text() == "ddnode2\n"  # srun's line: the node is fenced for the store task
    assert said[:4] == [
        "ddpack: training on ddnode1,ddnode2; spare: ddnode3",
        "ddpack: 2 standby process(es) start with each training step on the spare nodes (2 a spare, DDPACK_SPARE_NODES=1): a rank "
        "that dies, or every rank of a node lost, is replaced in process",
        "ddpack: ddnode2 left the job (srun: node failure): fenced, so that its ranks are counted dead at once and never rejoin",
        "ddpack: ddnode2 left the training: its ranks were replaced in process by the standbys on the spare ddnode3 (ranks 2,3 on "
        "ddnode3); the step goes on, and a restart places the ranks there (training on ddnode1,ddnode3)",
    ], out.stdout
    assert "restarting it in this allocation on ddnode1,ddnode3 from its last snapshot" in out.stdout, out.stdout
    records = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    moved = [record for record in records if record["kind"] == "placement" and record.get("how") == "in-process"]
    assert [(r["lost"], r["spare"], r["nodes"]) for r in moved] == [("ddnode2", "ddnode3", "ddnode1,ddnode3")], records
    assert next(r for r in records if r["kind"] == "recovery")["on_spares"] is True


@pytest.mark.parametrize(
    ("settings", "tres", "before_train", "options", "seen", "why"),
    [
        ({"DDPACK_TRAIN_ARGS": "--epochs 1"}, "", "", "--nodes=2 --ntasks=6 --distribution=arbitrary --overcommit --kill-on-bad-exit=0 x",
         "1", "the default where the nodes have no GPUs"),
        ({"DDPACK_TRAIN_ARGS": "--epochs 1"}, "gres/gpu:2", "", "x", "auto", "a CUDA job: a standby would hold a GPU of its own"),
        ({"DDPACK_COMMAND": "python ddp.py"}, "", "", "x", "auto", "your own program runs"),
        ({"DDPACK_TRAIN_ARGS": "--epochs 1"}, "", 'ddpack_no_standbys "torchrun starts them"', "x", "auto", "torchrun starts a node's ranks"),
        ({"DDPACK_TRAIN_ARGS": "--epochs 1", "DDPACK_STANDBYS": "1", "SLURM_NTASKS_PER_NODE": ""}, "", "", "x", "0",
         "this step could not start its standbys"),
    ],
    ids=["cpu", "gpu", "own-command", "tasks-not-ranks", "asked-but-cannot"],
)  # fmt: skip
def test_by_default_a_cpu_job_of_the_bundled_trainer_has_one_standby_and_any_other_none_and_the_tasks_see_the_count(
    tmp_path: Path, settings: dict[str, str], tres: str, before_train: str, options: str, seen: str, why: str
) -> None:
    """DDPACK_STANDBYS unset is auto (the settings table's rule): one standby task where the job asks for no GPUs and
    runs the bundled trainer, none otherwise; the tasks get the count the step started (auto reaches them only where it
    started none, and a count asked for that the step cannot start reaches them as 0); the job records which recovery
    it has and why, for `ddpack status`."""
    shows = f'echo "standbys=${{DDPACK_STANDBYS-unset}}" >> "{tmp_path}/seen.txt"'
    out, _, run_dir, steps = after_step(
        tmp_path, 0, step_also=shows, tres=tres, before_train=before_train, SLURM_JOB_NODELIST="ddnode1,ddnode2",
        **{"DDPACK_STANDBYS": "auto", **settings},
    )  # fmt: skip
    assert out.returncode == 0 and steps == [options], out.stdout + out.stderr
    assert (tmp_path / "seen.txt").read_text() == f"standbys={seen}\n"
    recorded = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    recovery = [entry for entry in recorded if entry["kind"] == "recovery"][-1]
    assert recovery["mode"] == ("in-process" if seen == "1" else "restart") and recovery["why"].startswith(why), recovery


@pytest.mark.parametrize(
    ("template_line", "settings", "line"),
    [
        (
            'ddpack_command /fsx/runs/a-1',
            {"DDPACK_COMMAND": "python ddp.py", "DDPACK_STANDBYS": "1"},
            "ddpack: error: DDPACK_STANDBYS=1 starts standbys of the bundled trainer, which DDPACK_COMMAND does not run: ",
        ),
        (
            'ddpack_no_standbys "torchrun\'s agent starts a node\'s ranks"',
            {"DDPACK_STANDBYS": "2"},
            "ddpack: error: DDPACK_STANDBYS=2 needs one Slurm task per rank, and torchrun's agent starts a node's ranks; use pyxis-per-task.sbatch",
        ),
    ],
)
def test_standbys_where_they_cannot_run_are_one_line(template_line: str, settings: dict[str, str], line: str) -> None:
    script = f'. "{HELPER}"; {template_line}; echo still-here'
    out = subprocess.run(["bash", "-uc", script], env={"PATH": "/usr/bin:/bin", **settings}, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "still-here" not in out.stdout and out.stderr.startswith(line) and out.stderr.count("\n") == 1, out.stderr
    none = subprocess.run(["bash", "-uc", f'. "{HELPER}"; ddpack_no_standbys x; echo still-here'], env={"PATH": "/usr/bin:/bin", "DDPACK_STANDBYS": "0"},
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert none.stdout == "still-here\n"
