"""Staging that one bad node cannot break (enroot/ddpack_staging.py), on four stand-in nodes.

The job program's Staging runs in this process against stand-in Slurm commands: `srun` runs the real node program
(ddpack_node.py prepare, receive, install) once for each node it is given, each node with a staging folder of its own
(the node's local disk), and `sbcast` copies the image into each node's receiving folder. One node is made to fail
each way a node can (FAIL_AT): the other three keep their copies; that node alone reads the shared file, named with
why, and gets the job's container made from the shared file. The cluster's own test of the same is
tests/test_pyxis.py's test_one_node_that_cannot_stage_reads_the_shared_file_alone.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from ddpack.job_side import module

NODES = ("ddnode1", "ddnode2", "ddnode3", "ddnode4")
BAD = "ddnode3"

# The stand-in srun: the step's words after its options run once for each node of --nodelist, with the node's name and
# the node's own staging folder (--dir STAGE becomes nodes/NODE). FAKE_FAIL=NODE:WAY makes that node fail one way.
SRUN = r"""
import os, signal, subprocess, sys
from pathlib import Path

root = Path(os.environ["FAKE_ROOT"])
node, way = os.environ.get("FAKE_FAIL", ":").split(":")
args = sys.argv[1:]
nodes = next(a for a in args if a.startswith("--nodelist=")).split("=", 1)[1]
nodes = os.environ["FAKE_NODES"].split(",") if nodes == "ddnode[1-4]" else nodes.split(",")  # the job's hostlist
argv = args[next(i for i, a in enumerate(args) if not a.startswith("-")) :]
if argv == ["true"]:  # a step in the job's container: only the words matter here
    with open(root / "calls.txt", "a") as calls:
        calls.write(" ".join(args) + "\n")
    sys.exit(0)


def on(name):
    words = list(argv)
    words[words.index("--dir") + 1] = str(root / "nodes" / name)
    if (name, way) == (node, "space") and "--need" in words:
        words[words.index("--need") + 1] = str(10**18)
    return words, {**os.environ, "SLURMD_NODENAME": name, "SLURM_STEP_ID": "4"}


if "prepare" in argv or "install" in argv:
    for name in nodes:
        if (name, way) == (node, "silent") and "prepare" in argv:
            continue
        words, env = on(name)
        out = subprocess.run(words, env=env, capture_output=True, text=True)
        sys.stdout.write(out.stdout + out.stderr)
    sys.exit(0)
# The holder step: every node's task holds it until the job program ends it.
(root / "step-nodes").write_text(",".join(nodes))
tasks = []
for name in nodes:
    if (name, way) == (node, "late"):
        continue
    if (name, way) == (node, "receive"):
        (root / "nodes" / name).chmod(0o777)  # a folder others can write: receive refuses it
    words, env = on(name)
    tasks.append(subprocess.Popen(words, env=env))
def end(*_):
    for task in tasks:
        task.kill()
    sys.exit(143)


signal.signal(signal.SIGTERM, end)
while True:
    signal.pause()
"""

# The stand-in sbcast: the image into each node's receiving folder; a node it cannot write to is named as sbcast names
# it, and the others get part of the file (sbcast stops at the first block a node refuses).
SBCAST = r"""
import os, shutil, sys
from pathlib import Path

root = Path(os.environ["FAKE_ROOT"])
node, way = os.environ.get("FAKE_FAIL", ":").split(":")
source, target = sys.argv[-2], sys.argv[-1]
rest = target.removeprefix(os.environ["DDPACK_STAGE_DIR"] + "/")
nodes = (root / "step-nodes").read_text().split(",")
broken = way == "sbcast" and node in nodes
for name in nodes:
    copy = root / "nodes" / name / rest
    if name == node and way == "sbcast":
        continue
    data = Path(source).read_bytes()
    copy.write_bytes(data[: len(data) // 2] if broken or (name == node and way == "install") else data)
if broken:
    print(f"sbcast: error: REQUEST_FILE_BCAST({node}): No space left on device", file=sys.stderr)
    sys.exit(1)
"""

FAIL_AT = {
    "space": "has too little free space in ",
    "silent": "did not answer the prepare step (srun exit 0)",
    "receive": "could not make a private folder to receive the image (DDPACK_STAGE_DIR=",
    "late": "missed the holder step's deadline (5 s) to make its receiving folder",
    "sbcast": "sbcast: No space left on device",
    "install": "install: received 7 of 14 bytes",
}


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Four stand-in nodes for job 77 (srun, sbcast, scontrol, scancel on PATH), a run folder and a squashfs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, text in {"srun": SRUN, "sbcast": SBCAST}.items():
        (bin_dir / tool).write_text(f"#!{sys.executable}\n{text}")
    listed = "\\n".join(NODES)
    shell = {
        "scontrol": f'case "$1 $2" in\n"show job") echo "   NodeList=ddnode[1-4]" ;;\n"show hostnames") printf "{listed}\\n" ;;\nesac',
        "scancel": "exit 0",
    }
    for tool, body in shell.items():
        (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    (tmp_path / "nodes").mkdir()
    (tmp_path / "run").mkdir(mode=0o700)
    (tmp_path / "images").mkdir(mode=0o755)
    (tmp_path / "images" / "x.sqsh").write_bytes(b"squashfs bytes")
    (tmp_path / "images" / "x.sqsh").chmod(0o644)
    settings = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_ROOT": str(tmp_path),
        "FAKE_NODES": ",".join(NODES),
        "SLURM_JOB_ID": "77",
        "DDPACK_RUN_DIR": str(tmp_path / "run"),
        "DDPACK_STAGE": "sbcast",
        "DDPACK_STAGE_DIR": str(tmp_path / "stage"),
    }
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(module("ddpack_staging"), "HOLD_DEADLINE_S", 5)  # the late node's wait; the others report at once
    return tmp_path


def stage(cluster: Path, container: str = "ddpack-77") -> str:
    """The job program's staging for this start: the path each node's pyxis imports."""
    staging, slurm = module("ddpack_staging"), module("ddpack_slurm")
    return staging.Staging(str(cluster / "images" / "x.sqsh"), cluster / "run", slurm.JobFacts("77"), container).choose()


def records(cluster: Path) -> list[dict]:
    return [json.loads(line) for line in (cluster / "run" / "decisions.jsonl").read_text().splitlines()]


def holding(cluster: Path) -> list[str]:
    """The nodes whose own disk holds a whole staged copy."""
    return [node for node in NODES if [p.stat().st_size for p in (cluster / "nodes" / node).glob("*.sqsh")] == [14]]


@pytest.mark.parametrize("way", sorted(FAIL_AT))
def test_one_node_that_fails_a_staging_step_reads_the_shared_file_alone_and_the_others_keep_their_copies(
    cluster: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    monkeypatch.setenv("FAKE_FAIL", f"{BAD}:{way}")
    sqsh = cluster / "images" / "x.sqsh"
    image = stage(cluster)
    said = capfd.readouterr().out.splitlines()
    assert image.startswith(f"{cluster}/stage/") and image.endswith(".sqsh"), said  # the nodes' own copies, not the shared file
    assert holding(cluster) == ["ddnode1", "ddnode2", "ddnode4"], said
    alone = [line for line in said if line.startswith(f"ddpack: image: {BAD} reads {sqsh} from the shared file alone (")]
    assert len(alone) == 1 and FAIL_AT[way] in alone[0] and alone[0].endswith("; the other nodes keep their copies"), said
    assert any(line.startswith(f"ddpack: image: sent {sqsh} (0 MiB) once, by sbcast, to ddnode1,ddnode2,ddnode4 as ") for line in said), (
        said
    )
    staged = [(r["choice"], r.get("node", r.get("nodes"))) for r in records(cluster) if r["kind"] == "staging"]
    assert staged == [("sent", "ddnode1,ddnode2,ddnode4"), ("shared", BAD)]
    assert FAIL_AT[way] in records(cluster)[-1]["why"]
    made = [line for line in (cluster / "calls.txt").read_text().splitlines() if line.endswith(" true")]
    assert made == [f"--container-image={sqsh} --container-name=ddpack-77 --nodes=1 --ntasks=1 --ntasks-per-node=1 --nodelist={BAD} true"]


def test_sbcast_that_fails_on_a_node_it_does_not_name_sends_every_lacking_node_to_the_shared_file(
    cluster: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (cluster / "bin" / "sbcast").write_text("#!/bin/sh\necho 'sbcast: error: Unable to get sbcast credential' >&2\nexit 1\n")
    sqsh = cluster / "images" / "x.sqsh"
    assert stage(cluster) == str(sqsh) and holding(cluster) == []
    said = capfd.readouterr().out
    assert (
        f"ddpack: image: every node reads {sqsh} (staging failed on every node; ddnode1: sbcast: sbcast: error: Unable to get sbcast credential)"
        in said
    )
    assert [(r["choice"], r.get("node")) for r in records(cluster)] == [("shared", None)]


def test_a_node_that_cannot_stage_in_a_job_with_no_named_container_sends_every_node_to_the_shared_file(
    cluster: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the job's named container there is no way to give one node its own image: one path serves every node."""
    monkeypatch.setenv("FAKE_FAIL", f"{BAD}:space")
    sqsh = cluster / "images" / "x.sqsh"
    assert stage(cluster, container="") == str(sqsh) and holding(cluster) == []
    assert f"(staging failed on {BAD} (has too little free space in " in capfd.readouterr().out
    assert not (cluster / "calls.txt").exists()  # no container made on any node: the shared file serves them all
