"""A shared cluster, tried as two of its users would: ddalice runs jobs, ddmallory plants files where they look.

The test cluster's nodes each have their own /tmp for staging (testbed/slurm_cluster.py), and the shared folder
stands in for /fsx. Every job here is the victim's own (sbatch run as ddalice); each attack of issue 41 that involves
a job is laid down first, as the attacker, and the job must come out unharmed: the planted image never used, no file
of the victim's overwritten or deleted. (A second job refused a live job's run folder, and the run's files private
to its user, are checked on a real training job by tests/test_lifecycle_cluster.py.) docs/security.md says what is
protected and how."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from testbed.env import ROOT
from testbed.slurm_cluster import NODE_DISKS, clear_staged_images, node_stage_dir, stage_dir
from testbed.slurm_jobs import as_user, env, wait_for_exit
from testbed.users import User, attacker, victim

pytestmark = [pytest.mark.pyxis, pytest.mark.usefixtures("pyxis_stack")]

# Only the prepare-and-stage part of a template: the job helper's own functions, run by sbatch on the real nodes.
STAGE_ONLY = """#!/bin/bash
#SBATCH --nodes=2 --ntasks-per-node=1 --output=logs/%x-%j.out
set -uo pipefail
. "${DDPACK_HOME}/ddpack-job.sh"
ddpack_setup stage
ddpack_name_container
ddpack_prepare_nodes "$1"
echo "ddpack-test: image=${ddpack_image}"
ddpack_leave
"""


def users_folder(shared: Path, name: str, owner: User) -> Path:
    folder = shared / "home" / name
    folder.mkdir(parents=True)
    os.chown(folder, owner.uid, owner.gid)
    return folder


def stage_job(folder: Path, user: User, image: Path, **settings: str) -> str:
    """sbatch --wait the staging part of a template as `user` from `folder`; its log."""
    script = folder / "stage.sbatch"
    script.write_text(STAGE_ONLY)
    (folder / "logs").mkdir(exist_ok=True)
    for path in (script, folder / "logs"):
        os.chown(path, user.uid, user.gid)
    runs = as_user(user, {**env(), "DDPACK_HOME": str(ROOT / "enroot"), "DDPACK_STAGE": "sbcast"})
    runs["env"].update(settings)  # type: ignore[attr-defined]
    out = subprocess.run(
        ["sbatch", "--parsable", "--job-name=stage", str(script), str(image)],
        cwd=folder, capture_output=True, text=True, timeout=120, **runs,  # type: ignore[arg-type]
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip().split(";")[0]
    log = folder / "logs" / f"stage-{job}.out"
    assert wait_for_exit(job, timeout=300) == 0, log.read_text() if log.exists() else ""
    return log.read_text()


def plant_as(user: User, path: Path, text: str = "", mode: int = 0o666) -> Path:
    path.write_text(text)
    os.chown(path, user.uid, user.gid)
    path.chmod(mode)
    return path


def test_a_staging_folder_planted_on_the_nodes_is_never_used_and_deletes_nothing(shared: Path) -> None:
    """Three jobs of the victim's, each staging her image with sbcast on both nodes:
    1. The attacker made her staging folder first on ddnode1 (mode 777, an image planted under her image's key and
       a link at the name sbcast used to write through, pointing at her checkpoint) and a link in its place on
       ddnode2: both nodes refuse, the job reads the shared file (one line, naming the first), nothing planted is
       used or changed.
    2. DDPACK_STAGE_DIR names her team's images folder (her own image among a teammate's, and a file named to split
       into `train.py` and `config.yaml`): refused, nothing there deleted, and her project's files are whole.
    3. Nothing planted: the image is sent once and each node's copy is hers alone (0700 folder)."""
    alice, mallory = victim(), attacker()
    clear_staged_images()
    home = users_folder(shared, "alice-stage", alice)
    image = plant_as(alice, home / "img.sqsh", "squashfs" * 100_000, 0o644)
    checkpoint = plant_as(alice, home / "snapshot.pt", "weights", 0o600)
    mine = stage_dir(alice.uid)

    theirs = node_stage_dir("ddnode1", alice.uid)
    theirs.mkdir()
    os.chown(theirs, mallory.uid, mallory.gid)
    theirs.chmod(0o777)
    key = subprocess.run(["python3", str(ROOT / "enroot" / "ddpack_job.py"), "key", str(image)], capture_output=True, text=True, check=True)
    planted = plant_as(mallory, theirs / f"{key.stdout.strip()}.sqsh", "a squashfs of the attacker's")
    for job_id in range(1, 400):  # every job id's old sbcast name, as a link to her checkpoint
        (theirs / f"{key.stdout.strip()}.sqsh.part-{job_id}").symlink_to(checkpoint)
    mallorys = NODE_DISKS / "ddnode2" / "mallory-images"
    mallorys.mkdir()
    os.chown(mallorys, mallory.uid, mallory.gid)
    node_stage_dir("ddnode2", alice.uid).symlink_to(mallorys)
    os.lchown(node_stage_dir("ddnode2", alice.uid), mallory.uid, mallory.gid)
    try:
        text = stage_job(home, alice, image)
        assert f"ddpack-test: image={image}\n" in text, text
        refused = rf"ddpack: image: every node reads {image} \(staging failed on every node; ddnode1: DDPACK_STAGE_DIR={mine} "
        assert re.search(refused + rf"belongs to uid {mallory.uid}", text), text
        assert planted.read_text() == "a squashfs of the attacker's" and checkpoint.read_text() == "weights"
        assert list(mallorys.iterdir()) == []
    finally:
        shutil.rmtree(theirs)
        node_stage_dir("ddnode2", alice.uid).unlink()
        shutil.rmtree(mallorys)

    team = users_folder(shared, "team-images", alice)
    names = ["cpu-ddp.sqsh", "bobs-model.sqsh", "z train.py config.yaml q.sqsh"]
    for name in names:
        plant_as(alice, team / name, "x", 0o644)
    for name in ("train.py", "config.yaml"):
        plant_as(alice, home / name, "mine", 0o644)
    text = stage_job(home, alice, image, DDPACK_STAGE_DIR=str(team), DDPACK_STAGE_KEEP="1")
    assert "which is not an image ddpack staged; point DDPACK_STAGE_DIR at a folder of its own" in text, text
    assert sorted(p.name for p in team.iterdir()) == sorted(names)
    assert (home / "train.py").read_text() == (home / "config.yaml").read_text() == "mine"

    text = stage_job(home, alice, image)
    assert re.search(rf"ddpack: image: sent {image} \(0 MiB\) once, by sbcast, to ddnode1,ddnode2 as {mine}/\S+\.sqsh", text), text
    for node in ("ddnode1", "ddnode2"):
        folder = node_stage_dir(node, alice.uid)
        info = folder.lstat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (alice.uid, 0o700)
        assert sorted(p.name for p in folder.iterdir()) == [".leases", f"{key.stdout.strip()}.sqsh"]  # no .incoming left
