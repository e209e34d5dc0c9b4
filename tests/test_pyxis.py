"""The real cluster stack: Slurm + pyxis 0.19.0 + enroot 3.4.1 (HyperPod's versions, built from source
by ../shared/tools/install-enroot-pyxis.sh, which .ci/run runs), two slurmd on this machine.

The image is the one users ship: the README's project (cpu-ddp) on the bundle, converted by `make sqsh`
as the README's own line runs it (the `readme_project` fixture) and copied to the shared folder as the README
shows. `srun --container-image` in both launch shapes, as root and as a non-root user with a login shell;
both pyxis templates through sbatch running the bundled trainer with the shared folder mounted at the same
path and at another, and the README's submission running the project's own command; a preemption round trip
through each. Each container start unpacks the image on each node (enroot create, ~20 s here), so this tier
takes minutes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from ddp_jobs import reference_checksum

from ddpack.jobs.logs import rank_filter
from testbed.env import ROOT
from testbed.file_opens import OpenCounter
from testbed.readme_examples import write_mytask
from testbed.slurm_cluster import (
    ENROOT_DATA,
    NODES,
    clear_staged_images,
    full_shm,
    mount_device,
    mount_journaled_ext4,
    mount_options,
    node_stage_dir,
    stage_dir,
)
from testbed.slurm_jobs import (
    Gate,
    all_agree,
    brief,
    env,
    hold_training,
    preempt_and_resume,
    sbatch,
    signal_tasks,
    stuck,
    submit,
    wait_for_end,
    wait_for_restarts,
)
from train import outcome

pytestmark = [pytest.mark.pyxis, pytest.mark.usefixtures("pyxis_stack")]
JOB_USER = "ddpackjob"  # a real login shell: enroot copies the user's shell, and nologin cannot run containers


@pytest.fixture(scope="module")
def job_user() -> str:
    if subprocess.run(["id", JOB_USER], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", JOB_USER], check=True)
    return JOB_USER


def container_srun(args: list[str], cwd: Path, user: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = ["srun", "--export=ALL", *args]
    if user is not None:
        argv = ["runuser", "-u", user, "--", *argv]
    job_env = env(OMP_NUM_THREADS="1")
    job_env["PATH"] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # no host venv: entrypoint must come from the image
    return subprocess.run(argv, env=job_env, cwd=cwd, capture_output=True, text=True, timeout=900)


# Each shape once: torchrun (a container a node) as root, per-task (each task its own container) as a user, the case
# with more to go wrong (enroot copies the user's shell, the snapshots are the user's). Per-task as root proved nothing
# these two do not (14 s of CI).
@pytest.mark.parametrize(("shape", "as_user"), [("torchrun", False), ("per-task", True)], ids=["torchrun-root", "per-task-user"])
def test_srun_container_image_runs_one_ddp_job(sqsh: Path, shared: Path, job_user: str, shape: str, as_user: bool) -> None:
    work = Path(tempfile.mkdtemp(prefix=f"srun-{shape}-", dir=shared))
    work.chmod(0o1777)
    layout = ["-N2", "-n4"] if shape == "per-task" else ["-N2", "--ntasks-per-node=1"]
    launch = [] if shape == "per-task" else ["--nproc-per-node", "2"]
    container = [f"--container-image={sqsh}", f"--container-mounts={shared}:{shared}", f"--container-workdir={work}"]
    trainer = ["--epochs", "1", "--log-every", "100", "--snapshot-dir", "snaps"]
    out = container_srun([*layout, *container, "entrypoint", *launch, *trainer], work, job_user if as_user else None)
    assert out.returncode == 0, out.stdout + out.stderr
    assert all_agree(out.stdout, 4), out.stdout
    assert "[rank 3/4] start: rank 3 world 4" in out.stdout
    snapshots = list((work / "snaps").glob("snapshot-*.pt"))
    assert snapshots
    owner = snapshots[0].stat().st_uid
    assert owner == (int(subprocess.run(["id", "-u", job_user], capture_output=True, text=True).stdout) if as_user else 0)


def submission_folder(shared: Path, name: str) -> Path:
    folder = shared / "team" / name
    folder.mkdir(parents=True)
    return folder


TEMPLATE_ARGS = {
    "pyxis-per-task.sbatch": {"sbatch": ("--ntasks-per-node=2",), "settings": {}},
    "pyxis-torchrun.sbatch": {"sbatch": (), "settings": {"DDPACK_NPROC": "2"}},
}


@pytest.fixture(scope="module")
def node_enroot(shared: Path) -> str:
    """PATH for a job whose tasks must reach their node's enroot (the per-node wrappers pyxis runs here);
    on a real cluster that is plain `enroot` on every node."""
    folder = shared / "node-enroot"
    folder.mkdir()
    script = folder / "enroot"
    script.write_text('#!/bin/sh\nexec "/usr/local/lib/enroot-nodes/${SLURMD_NODENAME}/enroot" "$@"\n')
    script.chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


def slurmd_log_lines(text: str) -> list[str]:
    """Lines of the test nodes' slurmd logs (where pyxis reports) that contain `text`."""
    logs = [Path(f"/var/log/slurm/slurmd-{node}.log").read_text() for node in NODES]
    return [line for log in logs for line in log.splitlines() if text in line]


def unpacks(job: str) -> int:
    """How many times pyxis unpacked the job's named container (once per node per job start when it is reused)."""
    return sum(line.endswith(f"creating container filesystem: pyxis_ddpack-{job}") for line in slurmd_log_lines("creating container"))


def reuses(job: str) -> int:
    """How many steps of the job started in a container an earlier step of it unpacked, summed over the nodes."""
    return sum(f"[{job}." in line for line in slurmd_log_lines("pyxis: reusing existing container filesystem"))


# One template, the shared folder mounted at another path (the translation the shared helper makes for both templates):
# pyxis-torchrun's training, requeue and resume through its own srun line, at another path too, are the preemption
# round trip's below, and its preflight step is the same ddpack_preflight (enroot/ddpack-job.sh) over that line (a job of
# its own here cost 45 s of CI). preflight.sbatch alone is a template with DDPACK_PREFLIGHT=only (its preflight step,
# then exit): its in-image step is run here, its exit after the check by tests/test_slurm.py's (27 s more here).
SHAPES = {"pyxis-per-task.sbatch": "other-path"}


@pytest.mark.parametrize(("template", "mount"), sorted(SHAPES.items()))
def test_pyxis_templates_run_the_preflight_in_the_image_then_the_users_task_in_the_same_container(
    sqsh: Path, shared: Path, node_enroot: str, template: str, mount: str
) -> None:
    """The preflight, then the README's own task from the submission folder (DDPACK_PROJECT_DIR: the container finds
    it at the folder's path inside, whichever path the shared folder is mounted at), in one container per node."""
    folder = submission_folder(shared, f"{template.split('.')[0]}-{mount}")
    write_mytask(folder)
    inside = str(shared) if mount == "same-path" else "/fsx"
    spec = TEMPLATE_ARGS[template]
    code, job = sbatch(
        template,
        folder,
        sbatch_args=spec["sbatch"],
        DDPACK_SQSH=str(sqsh),
        DDPACK_MOUNTS=f"{shared}:{inside}",
        DDPACK_PREFLIGHT="1",
        DDPACK_TRAIN_ARGS="--task mytask:make --epochs 1 --log-every 100",
        PATH=node_enroot,
        **spec["settings"],
    )
    log = (folder / "logs" / f"ddpack-{job}.out").read_text()
    assert code == 0, log
    assert log.index("preflight: PASS") < log.index("checksums agree across 4 ranks") and "task my-cnn" in log
    run_dir = folder / "runs" / f"ddpack-{job}"
    assert f"run dir {run_dir} (new run;" in log
    assert list((run_dir / "snapshots").glob("snapshot-*.pt")) and (run_dir / "metrics.jsonl").exists()
    report = json.loads((run_dir / "preflight.json").read_text())
    assert {r["in_image"] for r in report["identity"]} == {True}  # inside the bundle's image on every rank
    assert len({r["app"] for r in report["identity"]}) == 1 and report["identity"][0]["app"].startswith("cpu-ddp@")
    assert sorted(r["host"] for r in report["identity"]) == ["ddnode1", "ddnode1", "ddnode2", "ddnode2"]
    assert report["storage"]["folder"].startswith(f"{inside}/")  # the snapshot folder as the container sees it
    # Unpacked once per node by the preflight step, reused by training, removed afterwards.
    assert unpacks(job) == 2 and reuses(job) == 2
    assert not list(Path("/tmp/enroot/data").glob(f"*/*/pyxis_ddpack-{job}"))
    # Started by hand, and still known to ddpack from the folder it was submitted in (the run.json the job left).
    ddpack = str(Path(sys.executable).parent / "ddpack")
    status = subprocess.run([ddpack, "status", job, "--json"], cwd=folder, capture_output=True, text=True, env=env())
    assert status.returncode == 0, status.stderr
    assert (json.loads(status.stdout)["run_dir"], json.loads(status.stdout)["state"]) == (str(run_dir), "COMPLETED")
    logs = subprocess.run([ddpack, "logs", job], cwd=folder, capture_output=True, text=True, env=env())
    assert logs.returncode == 0 and "checksums agree across 4 ranks" in logs.stdout, logs.stderr


def test_the_readme_submission_runs_the_projects_own_command(sqsh: Path, shared: Path) -> None:
    """`sbatch --export=ALL,DDPACK_SQSH=/fsx/images/cpu-ddp.sqsh .../pyxis-per-task.sbatch` from a run folder:
    no DDPACK_TRAIN_ARGS, so every task runs the image's `python ddp.py 4 2`, writing snapshot.pt in the run folder."""
    folder = submission_folder(shared, "cpu-ddp")
    code, job = sbatch("pyxis-per-task.sbatch", folder, ("--ntasks-per-node=2",), DDPACK_SQSH=str(sqsh), DDPACK_MOUNTS=f"{shared}:/fsx")
    log = (folder / "logs" / f"ddpack-{job}.out").read_text()
    assert code == 0, log
    assert all(f"[rank {rank}] trained to epoch 4" in log for rank in range(4)), log
    snapshot = folder / "runs" / f"ddpack-{job}" / "snapshot.pt"
    assert snapshot.is_file() and "snapshot saved at snapshot.pt" in log


def test_preemption_round_trip_of_the_bundled_trainer_through_pyxis_torchrun(sqsh: Path, shared: Path) -> None:
    folder = submission_folder(shared, "pre-torchrun")
    spec = TEMPLATE_ARGS["pyxis-torchrun.sbatch"]
    log = preempt_and_resume(
        folder, "pre-torchrun", spec["sbatch"], "pyxis-torchrun.sbatch", DDPACK_SQSH=str(sqsh), DDPACK_MOUNTS=f"{shared}:/fsx", **spec["settings"]
    )
    first, second = log.split("(restart 1)", 1)
    assert first.count("stopped on SIGUSR1") == 4, first
    assert "ddpack: preempted (exit 138); requeueing job" in first and "(restart 1 of at most 10)" in first
    assert "requeued: continuing its run from the last snapshot" in second.splitlines()[0]
    assert "[rank 0/4] resuming from" in second and all_agree(second, 4)


def test_enroot_start_runs_the_launcher_once_whether_or_not_it_is_named(sqsh: Path) -> None:
    """enroot's /etc/rc execs the image's ENTRYPOINT with the arguments, so `enroot start NAME entrypoint
    --print-plan` hands the launcher its own name; it must resolve the plan as `enroot start NAME --print-plan` does."""
    name = f"ddpack-start-{os.getpid()}"
    subprocess.run(["enroot", "create", "--force", "--name", name, str(sqsh)], env=env(), check=True, capture_output=True, timeout=300)
    try:
        plans = [
            json.loads(subprocess.run(["enroot", "start", name, *args], env=env(), capture_output=True, text=True, check=True, timeout=120).stdout)
            for args in (["entrypoint", "--print-plan"], ["--print-plan"])
        ]
    finally:
        subprocess.run(["enroot", "remove", "--force", name], env=env(), capture_output=True, timeout=120)
    assert plans[0]["mode"] == plans[1]["mode"] == "single"
    assert plans[0]["argv"] == plans[1]["argv"] == ["python", "ddp.py", "4", "2"]  # the image's APP_CMD, in its WORKDIR /opt/app


def test_the_nodes_enroot_disk_gives_freed_blocks_back_to_the_host(tmp_path: Path) -> None:
    """Every job removes its containers from the nodes' enroot data disk (a sparse file: testbed/slurm_cluster.py);
    their blocks must go back to the host's disk as they are freed. Without that the file kept every block a CI run
    ever unpacked into (27 GiB of 40 held while 2.5 GiB was in use) and filled CI's disk. The nodes' disk is mounted
    so; the behaviour is shown on a disk of its own made the same way (the nodes' one also grows as the kernel zeroes
    its inode tables in the background after mkfs, and with whatever a job's cleanup still writes)."""
    if mount_device(ENROOT_DATA) is None:
        if os.environ.get("CI"):
            pytest.fail(f"the testbed did not mount the nodes' enroot data disk at {ENROOT_DATA}")
        pytest.skip(f"no enroot data disk mounted at {ENROOT_DATA} (testbed/slurm_cluster.py mounts one)")
    assert "discard" in mount_options(ENROOT_DATA), f"the nodes' enroot data disk is mounted without discard: {mount_options(ENROOT_DATA)}"
    folder, disk_file = tmp_path / "disk", tmp_path / "disk.ext4"
    folder.mkdir()
    mount_journaled_ext4(folder, disk_file, 1)
    try:
        held = lambda: disk_file.stat().st_blocks * 512  # noqa: E731
        probe = folder / "probe"
        with open(probe, "wb") as handle:
            handle.write(os.urandom(1 << 20) * 128)
            os.fsync(handle.fileno())
        grown = held()
        probe.unlink()
        os.sync()  # the journal's commit is when ext4 hands the freed blocks to the loop device, which punches them out
        assert grown - held() >= 96 << 20, f"removing 128 MiB gave back only {(grown - held()) >> 20} MiB of the disk's file"
    finally:
        subprocess.run(["umount", str(folder)], check=True)


# ---------------------------------------------------------------- a user's framework, through the template


@pytest.fixture(scope="module")
def frameworks_sqsh(sqsh: Path, shared: Path) -> Path:
    """tests/frameworks built as a user's project is, by `make image sqsh APP=...` (Lightning, transformers and
    accelerate from the package index onto the bundle's image, its torch held), its squashfs in the shared folder."""
    output = shared / "images" / "frameworks.sqsh"
    command = ["make", "image", "sqsh", f"APP={ROOT / 'tests' / 'frameworks'}", f"SQSH={output}", f"VENV={sys.prefix}"]
    out = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=3600)
    assert out.returncode == 0, f"{' '.join(command)} failed (exit {out.returncode}):\n{out.stdout[-6000:]}\n{out.stderr[-3000:]}"
    output.chmod(0o644)
    return output


# A framework's ranks: one a node, two nodes. Two ranks a node proved nothing more (the launcher's shapes are the
# dist tier's), and four ranks importing Lightning or transformers on this host's two cores cost most of each start.
FRAMEWORK_RANKS = 2


def framework_job(shared: Path, frameworks_sqsh: Path, project: str, **settings: str) -> tuple[str, Path, Path, Gate]:
    """`DDPACK_COMMAND="python /opt/app/PROJECT/train.py"` through pyxis-per-task.sbatch on both nodes, one task each,
    held at training step 3 of its first start until the test opens the gate."""
    folder = submission_folder(shared, project)
    gate = hold_training(folder, 3, f"{shared}:/fsx")
    job, metrics, log = submit(
        folder, project, ("--ntasks-per-node=1",), "pyxis-per-task.sbatch",
        DDPACK_SQSH=str(frameworks_sqsh), DDPACK_MOUNTS=f"{shared}:/fsx", DDPACK_COMMAND=f"python /opt/app/{project}/train.py",
        NODES="2", DEVICES="1", **gate.settings, **settings,
    )  # fmt: skip
    return job, metrics, log, gate


def preempt_held(job: str, log: Path, gate: Gate) -> None:
    """SIGUSR1 to every task of the held job (as --signal=USR1@90 sends it), and the gate opened once every rank has it."""
    start = gate.held(log, FRAMEWORK_RANKS)
    subprocess.run(["scancel", "--signal=USR1", job], check=True)
    gate.signalled(log, start, FRAMEWORK_RANKS)
    gate.open()


def stopped_then_finished(text: str, starts: int) -> list[str]:
    """The job log split at its requeues (`starts` job starts); checks that the first start stopped every rank at
    one step on SIGUSR1 (exit 138, requeued) and the last finished with agreeing checksums."""
    parts = re.split(r"\(restart \d+\)", text)[1:]  # each start's banner says (restart N)
    assert len(parts) == starts, text
    stops = [end for end in outcome.read_ends(parts[0]) if end.outcome == "stopped"]
    stepped = {end.global_step for end in stops}
    assert len(stops) == FRAMEWORK_RANKS and len(stepped) == 1 and {end.signal for end in stops} == {"SIGUSR1"}, parts[0]
    assert "ddpack: preempted (exit 138); requeueing job" in parts[0], parts[0]
    assert "requeued: continuing its run from the last snapshot" in parts[1].splitlines()[0]
    assert all_agree(parts[-1], FRAMEWORK_RANKS), parts[-1]
    return parts


def reported(metrics: Path, segments: int) -> str:
    """`make report RUN=...` on the job's run folder: the page's segment count."""
    run = metrics.parent
    out = subprocess.run(["make", "report", f"RUN={run}", f"VENV={sys.prefix}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    page = (run / "report.html").read_text()
    assert f"<tr><td>segments</td><td>{segments}</td></tr>" in page, page[:3000]
    return page


def test_a_lightning_project_is_preempted_requeued_resumed_then_hangs_is_named_and_finishes(frameworks_sqsh: Path, shared: Path) -> None:
    """Lightning 2.6 from the package index with ddpack's one-line callback, under the per-task template: SIGUSR1
    to every task mid-training (as --signal=USR1@90 does) stops both ranks at one step after Lightning's own
    checkpoint, and the template requeues; the next start resumes from it, and rank 1 blocks in training_step:
    the watchdog ends the step 124 with forensics naming rank 1, and the template restarts the step in the same
    allocation (no node was named unresponsive), in the container it already unpacked; that step resumes from the
    checkpoint again and finishes with agreeing checksums. make report draws three segments."""
    job, metrics, log, gate = framework_job(
        shared, frameworks_sqsh, "lightning_project", FREEZE_AT="1:5", FREEZE_ON_RESTART="1", DDPACK_HANG_TIMEOUT="15"
    )
    preempt_held(job, log, gate)
    text = wait_for_restarts(job, 1, log)
    parts = stopped_then_finished(text, 2)
    stopped_at = outcome.read_ends(parts[0])[0].global_step
    hung = [end for end in outcome.read_ends(parts[1]) if end.outcome == "hung"]
    assert hung and all("behind: rank 1 on " in str(end.reason) for end in hung), parts[1]
    assert "ddpack: the step ended as hung (exit 124; evidence in" in parts[1] and "restarting it in this allocation on ddnode1,ddnode2" in parts[1]
    assert unpacks(job) == 4 and reuses(job) == 2  # once per node per job start; the restart in place reused them
    run = metrics.parent
    summary = json.loads((run / "forensics" / "summary.json").read_text())
    assert summary["behind_ranks"] == [1] and "in training_step" in (run / "forensics" / "rank-1.txt").read_text()
    assert "in forward after step" in summary["behind"][0], summary  # the adapter's phase, as the bundled trainer's
    starts = [json.loads(line) for line in metrics.read_text().splitlines() if '"kind": "start"' in line]
    assert [s["global_step"] for s in starts] == [0, stopped_at, stopped_at] and starts[0]["framework"] == "lightning", starts
    assert "scontrol: not found" not in text and "Handling auto-requeue signal" not in text
    reported(metrics, 3)


def test_a_hugging_face_trainer_project_is_preempted_requeued_and_resumes_from_its_checkpoint(frameworks_sqsh: Path, shared: Path) -> None:
    """transformers' Trainer with ddpack's callback, same template and signal: the Trainer saves checkpoint-N at
    the agreed step on every rank, the step ends 138 and is requeued; the next start resumes from checkpoint-N
    and finishes with agreeing checksums; make report draws both segments."""
    job, metrics, log, gate = framework_job(shared, frameworks_sqsh, "hf_project", OUTPUT_DIR="hf-output", EPOCHS="1")  # 64 steps: the gate acts at 3
    preempt_held(job, log, gate)
    parts = stopped_then_finished(wait_for_restarts(job, 1, log), 2)
    # Its lines are labelled with their rank by srun (the per-task template, for a program of your own): logs --rank.
    rank_1 = [line for line in log.read_text().splitlines() if rank_filter(line, 1)]
    assert any("held_task: rank 1 held" in line for line in rank_1) and not any("held_task: rank 2 " in line for line in rank_1)
    checkpoint = outcome.read_ends(parts[0])[0].snapshot
    assert checkpoint and checkpoint.endswith(f"/hf-output/checkpoint-{outcome.read_ends(parts[0])[0].global_step}")
    assert (metrics.parent / "hf-output" / Path(checkpoint).name / "trainer_state.json").is_file()
    reported(metrics, 2)


# ---------------------------------------------------------------- goodput: the image once per job, restarts in place

RESTART_ARGS = "--dataset-size 8192 --epochs 3 --log-every 1 --snapshot-every 20"


def starts_of(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines() if '"kind": "start"' in line]


def test_a_node_set_down_mid_training_is_replaced_in_process_by_the_spares_standbys_and_the_image_is_read_once(
    sqsh: Path, shared: Path
) -> None:
    """Three nodes, one of them a spare (sbatch --nodes=3, DDPACK_SPARE_NODES=1): the squashfs is read from the
    shared folder once, by sbcast, which sends it to every node's own disk; training runs on two nodes x 2 ranks, and
    the spare hosts the step's two standbys (a node's ranks), the store task on ddnode1. ddnode2 set DOWN mid-training
    (a health agent's verdict) and its tasks SIGKILLed (a node that fails): the spare's standbys take ranks 2 and 3 in
    process, in the same step, with the survivors' state; the job program fences ddnode2 (srun's node-failure line, passed
    to the standbys by the store task), says ddnode3 trains now and records it. The
    run finishes in that step with the checksum of an uninterrupted run, every global step logged once. Each node
    unpacked the image once. The seconds from the node's loss to the next logged step are printed."""
    clear_staged_images()  # no copy from an earlier run: this job stages the image
    folder = submission_folder(shared, "spare")
    gate = hold_training(folder, 30, f"{shared}:/fsx", STANDBY_ARGS)
    with OpenCounter(sqsh) as readers:
        job, metrics, log = submit(
            folder, "spare", ("--partition=big", "--nodes=3", "--ntasks-per-node=2"), "pyxis-per-task.sbatch",
            DDPACK_SQSH=str(sqsh), DDPACK_MOUNTS=f"{shared}:/fsx", DDPACK_SPARE_NODES="1", DDPACK_TRAIN_ARGS=gate.train_args,
            DDPACK_STAGE="sbcast",  # auto would too from 5 nodes (the model's threshold with its default rates)
            DDPACK_STANDBYS="1",  # the testbed's jobs have none unless asked; with a spare, a node's worth live there
            **gate.settings,
        )  # fmt: skip
        expected = reference_checksum(folder, [*gate.train_args.split(), "--recovery"], ranks=4, cwd=folder)
        first = gate.held(log, 4)  # mid-training, and held there until the node is lost
        text = wait_in_log(log, lambda text: len(SPARE_STANDBY_LINE.findall(text)) == 2, "the spare's two standbys")
        assert set(SPARE_STANDBY_LINE.findall(text)) == {"ddnode3"}, brief(text)
        try:
            lost_at = time.time()
            subprocess.run(["scontrol", "update", "nodename=ddnode2", "state=down", "reason=ddpack-spare-test"], check=True)
            signal_tasks(job, "ddnode2")  # a node that fails takes its processes with it (Slurm may have killed them already)
            gate.open(first)
            wait_in_log(log, lambda text: "recovery: trained global step" in text, "the recovery")
            state, requeues = wait_for_end(job, log)
        finally:
            subprocess.run(["scontrol", "update", "nodename=ddnode2", "state=resume"], capture_output=True)  # if Slurm has not
    text = log.read_text()
    assert (state, requeues) == ("COMPLETED", 0), brief(text)
    assert "ddpack: training on ddnode1,ddnode2; spare: ddnode3" in text, text
    assert re.search(rf"ddpack: image: sent \S+ \(\d+ MiB\) once, by sbcast, to ddnode1,ddnode2,ddnode3 as {stage_dir(os.getuid())}/\S+\.sqsh", text), text
    assert [command.split()[0] for command in readers.commands.values()] == ["sbcast"], readers.commands  # one read, however many nodes
    assert (
        "ddpack: ddnode2 left the training: its ranks were replaced in process by the standbys on the spare ddnode3 (ranks 2,3 on ddnode3); "
        "the step goes on, and a restart places the ranks there (training on ddnode1,ddnode3)"
    ) in text, brief(text)
    assert "ddpack: ddnode2 left the job (srun: node failure): fenced" in text, brief(text)  # srun's line, passed on
    assert "store task: ddnode2 left the job (set DOWN): fenced, its members are counted dead" in text, brief(text)
    assert "restarting it in this allocation" not in text and all_agree(text, 4) and set(outcome.checksums(text)) == {expected}, brief(text)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(starts_of(metrics)) == 1, brief(text)
    steps = [record["global_step"] for record in records if record["kind"] == "progress"]
    assert steps == sorted(set(steps)) and steps[-1] == records[-1]["total_steps"], steps  # no global step trained twice
    recovery = next(record for record in records if record["kind"] == "recovery")
    assert recovery["hosts"] == ["ddnode1", "ddnode1", "ddnode3", "ddnode3"], recovery
    decisions = [json.loads(line) for line in (metrics.parent / "decisions.jsonl").read_text().splitlines()]
    assert any(d["kind"] == "placement" and (d.get("lost"), d.get("spare")) == ("ddnode2", "ddnode3") for d in decisions), decisions
    staged = {node: sorted(p.name for p in node_stage_dir(node, os.getuid()).glob("*.sqsh")) for node in NODES}
    assert len({tuple(names) for names in staged.values()}) == 1 and len(staged["ddnode1"]) == 1, staged
    assert unpacks(job) == 3 and reuses(job) == 0  # each node once, in the one training step
    next_step = next(record for record in records if record["kind"] == "progress" and record["time"] > lost_at)
    stages = ", ".join(f"{name} {recovery[name]:.3f}" for name in ("decide_s", "abort_s", "new_group_s", "state_s", "first_step_s", "total_s"))
    print(f"node lost, in process: global step {next_step['global_step']} logged {next_step['time'] - lost_at:.2f} s after DOWN + SIGKILL ({stages})")


def test_one_node_that_cannot_stage_reads_the_shared_file_alone_and_the_job_trains(sqsh: Path, shared: Path) -> None:
    """Three nodes stage by sbcast; ddnode2's staging folder is a plain file there (a node whose local disk cannot
    take the image: it refuses at the prepare step, before anything is copied). ddnode2 alone reads the shared
    squashfs, named in one line and one record, its container made from it before the first step; ddnode1 and ddnode3
    get their copies by sbcast and train from them; the run completes on all three. The shared file is read by sbcast
    once and by ddnode2's import (K = 1 node), where the code before issue 63 sent all three nodes to it."""
    clear_staged_images()
    blocker = node_stage_dir("ddnode2", os.getuid())
    blocker.write_text("not a folder")
    folder = submission_folder(shared, "one-bad-node")
    try:
        with OpenCounter(sqsh) as readers:
            job, _, log = submit(
                folder, "one-bad-node", ("--partition=big", "--nodes=3", "--ntasks-per-node=1"), "pyxis-per-task.sbatch",
                DDPACK_SQSH=str(sqsh), DDPACK_MOUNTS=f"{shared}:/fsx", DDPACK_STAGE="sbcast",
                DDPACK_TRAIN_ARGS="--dataset-size 1024 --epochs 1 --log-every 10",
            )  # fmt: skip
            state, requeues = wait_for_end(job, log)
        assert blocker.read_text() == "not a folder"  # refused, never used or removed
    finally:
        blocker.unlink(missing_ok=True)
    text = log.read_text()
    assert (state, requeues) == ("COMPLETED", 0), text
    mine = stage_dir(os.getuid())
    alone = rf"ddpack: image: ddnode2 reads {sqsh} from the shared file alone \(DDPACK_STAGE_DIR={mine} is not a folder; it is not used\); "
    assert re.search(alone + "the other nodes keep their copies", text), text
    assert re.search(rf"ddpack: image: sent {sqsh} \(\d+ MiB\) once, by sbcast, to ddnode1,ddnode3 as {mine}/\S+\.sqsh", text), text
    assert all_agree(text, 3), text
    run_dir = folder / "runs" / f"one-bad-node-{job}"
    staged = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines() if '"staging"' in line]
    assert [(r["choice"], r.get("nodes", r.get("node"))) for r in staged] == [("sent", "ddnode1,ddnode3"), ("shared", "ddnode2")]
    assert [p.suffix for p in node_stage_dir("ddnode1", os.getuid()).glob("*.sqsh")] == [".sqsh"]
    assert [p.suffix for p in node_stage_dir("ddnode3", os.getuid()).glob("*.sqsh")] == [".sqsh"]
    commands = [(command.split() or ["?"])[0] for command in readers.commands.values()]  # a process gone by then reads ""
    assert commands.count("sbcast") == 1 and len(commands) >= 2, readers.commands  # sbcast, then ddnode2's import alone
    assert unpacks(job) == 3  # each node once: ddnode2 from the shared file (its container made first), the others from their copies


def test_a_node_with_a_full_dev_shm_is_swapped_for_the_spare_before_training_and_the_same_job_completes(sqsh: Path, shared: Path) -> None:
    """Three nodes, one a spare (sbatch --nodes=3, DDPACK_SPARE_NODES=1), the preflight first; ddnode2's /dev/shm is a
    full 1 MiB tmpfs in its own mount namespace, which its containers bind as enroot does. The preflight's node checks
    fail it there (and only there); the job swaps the spare in, in one line and one record naming the node, the check
    and the value, and trains on ddnode1 and ddnode3 to the end: the same job, no requeue."""
    folder = submission_folder(shared, "full-shm")
    with full_shm("ddnode2"):
        job, metrics, log = submit(
            folder, "full-shm", ("--partition=big", "--nodes=3", "--ntasks-per-node=1"), "pyxis-per-task.sbatch",
            DDPACK_SQSH=str(sqsh), DDPACK_MOUNTS=f"{shared}:/fsx", DDPACK_SPARE_NODES="1", DDPACK_PREFLIGHT="1",
            DDPACK_TRAIN_ARGS="--dataset-size 1024 --epochs 1 --log-every 10",
        )  # fmt: skip
        state, requeues = wait_for_end(job, log)
    text = log.read_text()
    assert (state, requeues) == ("COMPLETED", 0), text
    assert "preflight: FAIL node ddnode2: shm-free: 0 B free of 1.0 MiB" in text, text
    assert re.search(r"ddpack: preflight failed on node ddnode2 \(shm-size, shm-free\): shm-size: /dev/shm 1\.0 MiB .*; swapped for a spare: "
                     r"training on ddnode1,ddnode3 in this job, without ddnode2 here and in its restarts \(DDPACK_SPARE_NODES=1\)", text), text  # fmt: skip
    assert "ddpack: training on ddnode1,ddnode3; spare: none; without ddnode2 (failed the preflight's node checks)" in text, text
    assert all_agree(text, 2), text
    (start,) = starts_of(metrics)
    assert sorted(set(start["hosts"])) == ["ddnode1", "ddnode3"] and start["slurm_restart_count"] == 0
    run_dir = folder / "runs" / f"full-shm-{job}"
    records = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    (swapped,) = [r for r in records if r["kind"] == "preflight"]
    assert (swapped["result"], swapped["nodes"], swapped["training"]) == ("swapped", ["ddnode2"], "ddnode1,ddnode3"), swapped
    assert {c["node"] for c in swapped["failed_checks"]} == {"ddnode2"} and "shm-free" in {c["check"] for c in swapped["failed_checks"]}
    report = json.loads((run_dir / "preflight.json").read_text())
    assert {r["node"] for r in report["node_checks"] if r["status"] == "fail"} == {"ddnode2"}
    assert {r["host"] for r in report["identity"]} == {"ddnode1", "ddnode2", "ddnode3"}  # the spare was checked with the rest


# Two epochs of 29 steps (4096 samples, 90% trained, 4 ranks x 32): snapshots at 20 and 40, held at batch 30 of each start.
STANDBY_ARGS = "--dataset-size 4096 --epochs 2 --log-every 1 --snapshot-every 20"
START_LINE = re.compile(r"\[rank (\d+)/4\] start: rank \d+ world 4 .* host (\S+) task \S+ pid (\d+)")
STANDBY_LINE = re.compile(r"\[standby\] standby s0 on (\S+): warm, watching 4 ranks")
SPARE_STANDBY_LINE = re.compile(r"\[standby\] standby s[01] on (\S+): warm, watching 4 ranks")
RECOVERED_LINE = re.compile(
    r"\[rank (\d+)/4\] recovery: rank 3 lost in generation 0 \(\w+\); s0 takes rank 3; forming generation 1 in this process \(pid (\d+)\)"
)


def started(text: str) -> dict[int, tuple[str, int]]:
    """Each rank's (host, pid) from its start lines in `text` (the last one a rank printed)."""
    return {int(rank): (host, int(pid)) for rank, host, pid in START_LINE.findall(text)}


def wait_in_log(log: Path, found: Callable[[str], bool], what: str, timeout: float = 120) -> str:
    """The job's log once `found` holds for it (its lines are the job's own: nothing here waits on the host's speed)."""
    deadline = time.monotonic() + timeout
    while not found(text := log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"{what} not within {timeout:.0f} s:\n{stuck(text)}"
        time.sleep(0.05)
    return text


def test_a_killed_rank_is_training_again_in_the_same_job_without_reading_or_unpacking_the_image_again(sqsh: Path, shared: Path) -> None:
    """DDPACK_STANDBYS=1: each training step has a fifth task, a warm standby of the trainer in the job's container.
    First rank 3 and the standby are SIGKILLed together while the ranks are held mid-training: in-process recovery cannot
    work (the standby is dead), says so, and the job restarts the step in the same allocation, in the containers the
    first step unpacked, from the last snapshot (the nodes hold the image from the job before: staged copies are reused,
    the shared file is not opened at all; a container that job left on the node it lost is removed by this one). Then,
    held again, rank 3 of the restarted step is SIGKILLed: the standby, on the other node, takes its place in the same
    step, the survivors keep their processes, no global step is trained twice, and the run ends with the checksum of an
    uninterrupted run. The seconds from that kill to the next logged step are printed."""
    key = subprocess.run(["python3", "-I", "-S", f"{ROOT}/enroot/ddpack_job.py", "key", str(sqsh)], capture_output=True, text=True)
    for node in NODES:  # the job before's copies (the test above sends them; run alone, this one lays them down)
        staged = node_stage_dir(node, os.getuid())
        if not (staged / f"{key.stdout.strip()}.sqsh").exists():
            staged.mkdir(mode=0o700, exist_ok=True)
            shutil.copyfile(sqsh, staged / f"{key.stdout.strip()}.sqsh")
    folder = submission_folder(shared, "killed")
    gate = hold_training(folder, 30, f"{shared}:/fsx", STANDBY_ARGS)
    with OpenCounter(sqsh) as readers:
        job, metrics, log = submit(
            folder, "killed", ("--ntasks-per-node=2",), "pyxis-per-task.sbatch",
            DDPACK_SQSH=str(sqsh), DDPACK_MOUNTS=f"{shared}:/fsx", DDPACK_TRAIN_ARGS=gate.train_args, DDPACK_STANDBYS="1", **gate.settings,
        )  # fmt: skip
        # The uninterrupted run's checksum, on this host while the job starts (the same flags; --recovery, which the
        # standbys imply, derives each step's RNG from it: a trajectory setting).
        expected = reference_checksum(folder, [*gate.train_args.split(), "--recovery"], ranks=4, cwd=folder)
        first = gate.held(log, 4)  # mid-training, held there until rank 3 and the standby are killed
        standby_node = STANDBY_LINE.findall(wait_in_log(log, STANDBY_LINE.search, "the standby"))[0]
        both_killed_at = time.time()
        assert signal_tasks(job, "ddnode2", signal.SIGKILL, rank=3) and signal_tasks(job, standby_node, signal.SIGKILL, rank=4), brief(log)
        gate.open(first)
        gate.held(log, 4, seen=(first,))  # the restarted step, held at its own batch 30
        restarted_step = "restarting it in this allocation"
        segment = wait_in_log(log, lambda text: bool(STANDBY_LINE.search(text.rpartition(restarted_step)[2])), "the restart's standby")
        segment = segment.rpartition(restarted_step)[2]
        survivors, standbys = started(segment), STANDBY_LINE.findall(segment)
        assert sorted(survivors) == [0, 1, 2, 3] and len(standbys) == 1, segment
        dead_node = survivors[3][0]
        assert standbys[0] != dead_node, segment  # the standby is on another node than the rank that dies
        killed_at = time.time()
        assert signal_tasks(job, dead_node, signal.SIGKILL, rank=3), brief(log)
        gate.open()
        wait_in_log(log, lambda text: "recovery: trained global step" in text, "the recovery")
        state, requeues = wait_for_end(job, log)
    text = log.read_text()
    assert (state, requeues) == ("COMPLETED", 0), brief(text)
    assert re.search(rf"ddpack: image: all 2 nodes hold {stage_dir(os.getuid())}/\S+\.sqsh already; the shared filesystem is not read", text), text
    assert readers.pids == {}, readers.commands
    # The fallback, said and recorded: the standby died with the rank it would have replaced.
    assert "ddpack: in-process recovery fell back to this decision: a collective failed" in text and "the standby is dead (s0" in text, brief(text)
    crashed = r"(?: when its task on ddnode\d crashed)?"
    again = r"(?:, on ddnode\d again \(no other node\))?"
    restarted = rf"ddpack: the step failed \(exit \d+\){crashed}; restarting it in this allocation on ddnode\d,ddnode\d{again} from its last snapshot"
    assert len(re.findall(restarted, text)) == 1, brief(text)
    # The second death: recovered in the restarted step's processes, which end it as an uninterrupted run ends.
    after = text.rpartition("restarting it in this allocation")[2]
    # Each survivor recovered in the process it started in (its pid), and started no other.
    kept = {int(rank): int(pid) for rank, pid in RECOVERED_LINE.findall(after)}
    assert kept == {rank: pid for rank, (_, pid) in survivors.items() if rank != 3}, brief(text)
    assert "[rank 3/4] standby took rank 3: state of rank" in after, brief(text)
    assert {rank for rank, _, _ in START_LINE.findall(after) if rank != "3"} == {"0", "1", "2"} and len(START_LINE.findall(after)) == 5, brief(after)
    assert "ddpack: the step's tasks that ended badly were ranks replaced in process (1 recovery); every rank ended 0" in after, brief(text)
    assert all_agree(after, 4) and set(outcome.checksums(after)) == {expected}, brief(text)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    starts = [index for index, record in enumerate(records) if record["kind"] == "start"]
    assert len(starts) == 2 and records[starts[1]]["global_step"] % 20 == 0 and records[starts[1]]["slurm_restart_count"] == 0
    steps = [record["global_step"] for record in records[starts[1] :] if record["kind"] == "progress"]
    assert steps == sorted(set(steps)) and steps[-1] == records[-1]["total_steps"], steps  # no global step trained twice
    assert unpacks(job) == 2 and reuses(job) == 2  # the restart started in the containers the first step unpacked
    assert not list(Path("/tmp/enroot/data").glob("*/*/pyxis_ddpack-*")), "a job's container was left on a node"
    recovery = next(record for record in records if record["kind"] == "recovery")
    next_step = next(record for record in records[starts[1] :] if record["kind"] == "progress" and record["time"] > killed_at)
    stages = ", ".join(f"{name} {recovery[name]:.3f}" for name in ("decide_s", "abort_s", "new_group_s", "state_s", "first_step_s", "total_s"))
    print(f"killed rank, in-process: global step {next_step['global_step']} logged {next_step['time'] - killed_at:.2f} s after the SIGKILL ({stages})")
    again = next(record for record in records[starts[1] :] if record["kind"] == "progress")
    print(
        f"killed rank and standby, today's restart in place: global step {again['global_step']} logged {again['time'] - both_killed_at:.1f} s "
        f"after the SIGKILL (the survivors wait up to 5 s for a standby's decision first), from the snapshot at {records[starts[1]]['global_step']}"
    )
