"""A real Slurm (two slurmd on this machine): srun of the entrypoint in both launch shapes, the sbatch
templates as a user submits them, and preemption with --signal semantics through requeue to resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.readme_examples import write_mytask
from testbed.slurm_cluster import ClusterUnavailable, ensure_cluster
from testbed.slurm_jobs import (
    FINAL_STATES,
    VENV,
    all_agree,
    brief,
    cluster_now,
    env,
    hold_training,
    job_state,
    sbatch,
    signal_tasks,
    stuck,
    submit,
    submit_and_preempt,
    wait_for_restarts,
)
from train.outcome import read_ends

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    try:
        ensure_cluster()
    except ClusterUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must provide the test Slurm cluster: {exc}")
        pytest.skip(str(exc))


def srun(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["srun", "--export=ALL", *args], env=env(), cwd=cwd, capture_output=True, text=True, timeout=300)


def test_srun_two_nodes_four_tasks_one_ddp_job(tmp_path: Path) -> None:
    out = srun(["-N2", "-n4", "-l", str(VENV / "bin" / "entrypoint"), "--epochs", "2", "--snapshot-dir", ""], tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in range(4):
        assert f"[rank {rank}/4] start: rank {rank} world 4 local_rank {rank % 2}/2" in out.stdout
    assert all_agree(out.stdout, 4), out.stdout
    assert "checksums agree across 4 ranks" in out.stdout


def test_srun_one_task_per_node_runs_torchrun_with_c10d(tmp_path: Path) -> None:
    args = [
        "-N2",
        "--ntasks-per-node=1",
        "-l",
        str(VENV / "bin" / "entrypoint"),
        "--nproc-per-node",
        "2",
        "--epochs",
        "2",
        "--snapshot-dir",
        "",
    ]
    out = srun(args, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert all_agree(out.stdout, 4), out.stdout


def test_baremetal_template_runs_the_preflight_first_then_the_readme_task(tmp_path: Path) -> None:
    """The README's own task, in the submission folder, trained from the job's run folder, after the preflight
    (DDPACK_PREFLIGHT=1) has checked the job's two nodes; the trainer's MFU is against the preflight's measurement.
    (One job for both: the preflight before training changes nothing the task's run checks, and the jobs without it
    are every other test's.)"""
    write_mytask(tmp_path)
    code, job = sbatch("baremetal.sbatch", tmp_path, DDPACK_PREFLIGHT="1", DDPACK_TRAIN_ARGS="--task mytask:make --epochs 2 --log-every 100")
    log = (tmp_path / "logs" / f"ddpack-{job}.out").read_text()
    assert code == 0, log
    assert log.index("ddpack: preflight (DDPACK_PREFLIGHT=1)") < log.index("preflight: PASS") < log.index("checksums agree across 4 ranks")
    report = json.loads((tmp_path / "runs" / f"ddpack-{job}" / "preflight.json").read_text())
    assert report["ok"] and [r["host"] for r in report["identity"]] == ["ddnode1", "ddnode1", "ddnode2", "ddnode2"]
    assert {(link["src_host"], link["dst_host"]) for link in report["p2p"]} == {("ddnode1", "ddnode2"), ("ddnode2", "ddnode1")}
    run_dir = tmp_path / "runs" / f"ddpack-{job}"
    assert f"ddpack: job {job} (restart 0) on ddnode[1-2], run dir {run_dir} (new run;" in log
    assert "task my-cnn" in log and "epoch 2 done: eval_accuracy" in log
    assert "checksums agree across 4 ranks" in log
    assert list((run_dir / "snapshots").glob("snapshot-*.pt"))
    # The step's end names the report's command; the report draws every rank by its node.
    hint = f"ddpack: metrics in {run_dir}/metrics.jsonl; for the run report ({run_dir}/report.html) run, in the ddpack checkout: make report RUN={run_dir}"
    assert hint in log
    start = next(json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"start"' in line)
    assert start["hosts"] == ["ddnode1", "ddnode1", "ddnode2", "ddnode2"] and start["flops_per_sample"] > 0
    assert start["peak_source"].startswith("preflight: median measured fp32 matmul"), start  # MFU against the job's own measurement
    made = subprocess.run([sys.executable, "-m", "ddpack.jobs.report", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    assert "<td>4 on ddnode1, ddnode2</td>" in (run_dir / "report.html").read_text()


def test_two_submissions_from_one_folder_are_two_runs_unless_one_names_the_other(tmp_path: Path) -> None:
    args = "--epochs 1 --log-every 100"
    first_code, first = sbatch("baremetal.sbatch", tmp_path, DDPACK_TRAIN_ARGS=args)
    second_code, second = sbatch("baremetal.sbatch", tmp_path, DDPACK_TRAIN_ARGS=f"{args} --batch-size 16")
    assert (first_code, second_code) == (0, 0)
    second_log = (tmp_path / "logs" / f"ddpack-{second}.out").read_text()
    assert "resuming from" not in second_log and "checksums agree across 4 ranks" in second_log
    first_dir = tmp_path / "runs" / f"ddpack-{first}"
    first_log = (tmp_path / "logs" / f"ddpack-{first}.out").read_text()
    assert f"sbatch --export=ALL,DDPACK_RUN_DIR={first_dir} ..." in first_log  # how to continue it
    code, third = sbatch("baremetal.sbatch", tmp_path, DDPACK_TRAIN_ARGS=args, DDPACK_RUN_DIR=str(first_dir))
    third_log = (tmp_path / "logs" / f"ddpack-{third}.out").read_text()
    assert code == 0, third_log
    assert f"run dir {first_dir} (continuing {first_dir} (DDPACK_RUN_DIR))" in third_log
    assert "training already complete" in third_log


def test_a_pyxis_template_without_pyxis_fails_at_once_with_one_line(tmp_path: Path) -> None:
    """On a cluster whose srun has no pyxis (here: an srun first on the job's PATH whose help lacks
    --container-image, as Slurm's own does), the job would otherwise run on the host."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text("#!/bin/sh\necho 'Usage: srun [OPTIONS(0)...] [ : [OPTIONS(N)...]] executable(0) [args(0)...]'\n")
    (fake / "srun").chmod(0o755)
    path = f"{fake}:{os.environ.get('PATH', '/usr/bin:/bin')}"
    for template, layout in (("pyxis-per-task.sbatch", ("--ntasks-per-node=2",)), ("pyxis-torchrun.sbatch", ())):
        code, job = sbatch(template, tmp_path, layout, DDPACK_SQSH=str(tmp_path / "x.sqsh"), PATH=path)
        log = (tmp_path / "logs" / f"ddpack-{job}.out").read_text()
        assert code == 2, log
        assert log.strip().splitlines() == [
            "ddpack: error: this cluster's srun has no --container-image (pyxis is not loaded: no plugstack.conf entry on this node), "
            "so the job would run on the host; use enroot/baremetal.sbatch or ask for pyxis"
        ]


def test_docker_hostnet_template(tmp_path: Path, cpu_image: str) -> None:
    write_mytask(tmp_path)  # the user's task in the submission folder, which the template mounts read-only
    code, job = sbatch(
        "docker-hostnet.sbatch",
        tmp_path,
        DDPACK_IMAGE=cpu_image,
        DDPACK_TRAIN_ARGS="--task mytask:make --epochs 2 --log-every 100",
        DDPACK_DOCKER_ARGS="-e OMP_NUM_THREADS=1",
        DDPACK_PREFLIGHT="1",
    )
    log = (tmp_path / "logs" / f"ddpack-docker-{job}.out").read_text()
    assert code == 0, log
    assert log.index("preflight: PASS") < log.index("checksums agree across 2 ranks") and "[rank 1/2] start: rank 1 world 2" in log
    assert "task my-cnn" in log
    report = json.loads((tmp_path / "runs" / f"ddpack-docker-{job}" / "preflight.json").read_text())
    assert [r["in_image"] for r in report["identity"]] == [True, True]  # the check ran in the containers


def test_a_lost_node_killed_tasks_and_a_frozen_rank_each_come_back_and_resume_from_the_last_snapshot(tmp_path: Path) -> None:
    """One job through baremetal.sbatch on the two debug nodes (no spare), three disorderly endings. ddnode2 set
    DOWN mid-training (a node failure, a health agent's verdict): Slurm ends the step and drops the node from the
    --no-kill job; one node cannot carry a two-node job, so the template requeues it, and it resumes from the last
    snapshot once the node is back. Then ddnode2's tasks are SIGKILLed with no warning (a kernel panic, the OOM
    killer): the surviving ranks' collective fails and the template restarts the step in the same allocation,
    from the last periodic snapshot, with no requeue. Then rank 3 is frozen (SIGSTOP): the others' watchdogs end
    them with 124 and name ddnode2, srun kills the frozen rank DDPACK_STEP_WAIT seconds later; without ddnode2
    the allocation is too small, so the template requeues (saying why ddnode2 is not kept out: the partition has
    no node to spare); the run finishes with agreeing checksums."""
    # Each of the three starts is held at its step 31 while the test takes its node, kills its tasks or freezes its rank.
    gate = hold_training(tmp_path, 30, train_args="--dataset-size 8192 --epochs 3 --log-every 1 --snapshot-every 20 --hang-timeout 10")
    job, _, log = submit(
        tmp_path, "lost", DDPACK_TRAIN_ARGS=gate.train_args, DDPACK_MAX_FAILURE_RESTARTS="3", DDPACK_STEP_WAIT="5", **gate.settings
    )
    first_start = gate.held(log, 4)
    try:
        subprocess.run(["scontrol", "update", "nodename=ddnode2", "state=down", "reason=ddpack-lost-node-test"], check=True)
        gate.open(first_start)
        deadline = time.monotonic() + 300
        while "requeueing job" not in log.read_text():  # the template's verdict on the loss; then the node may come back
            assert time.monotonic() < deadline, f"lost node: the job was not requeued\n{stuck(log)}"
            time.sleep(0.5)
    finally:
        subprocess.run(["scontrol", "update", "nodename=ddnode2", "state=resume"], capture_output=True)  # if Slurm has not
    requeued = gate.held(log, 4, seen=(first_start,))
    assert signal_tasks(job, "ddnode2"), "no task of the job on ddnode2"
    gate.open(requeued)
    gate.held(log, 4, seen=(first_start, requeued))  # the restart in place
    assert signal_tasks(job, "ddnode2", signal.SIGSTOP, rank=3), "no rank 3 on ddnode2"
    gate.open()  # this start goes on without rank 3, and the next (the requeue) is not held
    text = wait_for_restarts(job, 2, log)
    first, second, third = re.split(r"\(restart [12]\)", text)

    def check(ok: object, what: str) -> None:
        assert ok, f"{what}; the job's log without its progress lines:\n{brief(text)}"

    check(
        re.search(r"ddpack: the step ended \(exit \d+\) when the job lost ddnode2; 1 healthy node\(s\) left in the allocation and training "
                  r"needs 2: requeueing job \d+ to resume from its last snapshot \(failure restart 1 of at most 3\)", first),
        "lost node: the template did not requeue the job that lost ddnode2",
    )  # fmt: skip
    before_loss = re.findall(r"snapshot saved: (\S+snapshot-\d+\.pt)", first)[-1]
    check("requeued: continuing its run from the last snapshot" in second.splitlines()[0], "lost node: the job was not requeued")
    check(f"resuming from {before_loss}" in second, f"lost node: the requeued job did not resume from {before_loss}")
    killed, _, after_kill = second.partition("restarting it in this allocation")
    check(
        re.search(r"ddpack: the step failed \(exit \d+\) when its task on ddnode2 crashed; restarting it in this allocation on ddnode1,ddnode2, "
                  r"on ddnode2 again \(no other node\) from its last snapshot \(failure restart 2 of at most 3\)", second),
        "killed tasks: the template did not restart the failed step in place",
    )  # fmt: skip
    last_periodic = re.findall(r"snapshot saved: (\S+snapshot-(\d+)\.pt)", killed)[-1]
    check(int(last_periodic[1]) % 20 == 0, f"killed tasks: the last snapshot before the kill, {last_periodic[0]}, is not a periodic one")
    check(f"resuming from {last_periodic[0]}" in after_kill, f"killed tasks: the restart did not resume from {last_periodic[0]}")
    hung = [end for end in read_ends(after_kill) if end.outcome == "hung"]
    check(
        sorted(end.rank for end in hung) == [0, 1, 2],
        f"frozen rank: ranks {sorted(end.rank for end in hung)} ended as hung, not 0, 1 and 2",
    )
    check(all("rank 3 on ddnode2" in end.reason for end in hung), "frozen rank: a hung rank's reason does not name rank 3 on ddnode2")
    check(
        "ddpack: the step ended as hung (exit 137;" in after_kill and "(failure restart 3 of at most 3)" in after_kill,
        "frozen rank: the template did not retry the hung step",
    )
    check(
        "ddpack: not keeping out ddnode2 (named unresponsive): partition debug has 2 nodes and the job needs 2" in after_kill,
        "frozen rank: the template did not say why ddnode2 is not kept out",
    )
    check(all_agree(third, 4), "the last start did not finish with 4 agreeing checksums")


def test_the_restart_cap_stops_requeueing_and_says_how_to_continue(tmp_path: Path) -> None:
    job, log = submit_and_preempt(tmp_path, "capped", DDPACK_MAX_RESTARTS="0")
    deadline = time.monotonic() + 120
    while (state := job_state(job))[0] not in FINAL_STATES:
        assert time.monotonic() < deadline, f"job {job} did not end: {state}\n{cluster_now()}"
        time.sleep(0.5)
    assert state[2] == 0, f"job {job} was requeued: {state}"
    text = log.read_text()
    run_dir = tmp_path / "runs" / f"capped-{job}"
    assert (
        f"ddpack: preempted (exit 138) after 0 restarts, the cap DDPACK_MAX_RESTARTS=0; not requeueing "
        f"(resubmit with DDPACK_RUN_DIR={run_dir} to continue)"
    ) in text


def test_a_failed_preflight_ends_the_job_before_training(tmp_path: Path) -> None:
    # The job's own flags come last, so this snapshot folder (under a file) is the one checked.
    (tmp_path / "file").write_text("")
    args = f"--epochs 1 --snapshot-dir {tmp_path}/file/snapshots"
    code, job = sbatch("baremetal.sbatch", tmp_path, DDPACK_PREFLIGHT="1", DDPACK_TRAIN_ARGS=args)
    log = (tmp_path / "logs" / f"ddpack-{job}.out").read_text()
    assert code == 1, log
    assert f"preflight: FAIL storage: cannot write to the snapshot folder {tmp_path}/file/snapshots" in log
    assert "ddpack: preflight failed (exit 1); not training." in log
    assert "start: rank" not in log and not (tmp_path / "runs" / f"ddpack-{job}" / "metrics.jsonl").exists()


def test_the_preflight_template_checks_a_training_template_shape_without_training(tmp_path: Path) -> None:
    layout = ("--ntasks-per-node=1", "--cpus-per-task=2")
    code, job = sbatch("preflight.sbatch", tmp_path, layout, DDPACK_TEMPLATE="baremetal.sbatch", DDPACK_LAUNCH_ARGS="--nproc-per-node 2")
    log = (tmp_path / "logs" / f"ddpack-preflight-{job}.out").read_text()
    assert code == 0, log
    run_dir = tmp_path / "runs" / f"ddpack-preflight-{job}"
    # torchrun's rendezvous numbers the nodes in the order they arrive: either may hold rank 0.
    assert re.search(r"preflight: 4 ranks on 2 hosts \((ddnode1, ddnode2|ddnode2, ddnode1)\), backend gloo", log), log
    assert f"ddpack: preflight passed; report {run_dir}/preflight.json" in log
    assert "start: rank" not in log and not (run_dir / "metrics.jsonl").exists()
    report = json.loads((run_dir / "preflight.json").read_text())
    assert report["world_size"] == 4 and sorted(r["host"] for r in report["identity"]) == ["ddnode1", "ddnode1", "ddnode2", "ddnode2"]


def test_the_preflight_template_refuses_an_unknown_template(tmp_path: Path) -> None:
    code, job = sbatch("preflight.sbatch", tmp_path, ("--ntasks-per-node=1",), DDPACK_TEMPLATE="nope.sbatch")
    log = (tmp_path / "logs" / f"ddpack-preflight-{job}.out").read_text()
    assert code == 2
    assert log.strip().splitlines()[-1].startswith("ddpack: error: DDPACK_TEMPLATE=nope.sbatch is not a file in ")
