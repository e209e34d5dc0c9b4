"""ddpack on DDPACK_TEST_NODES (16) emulated nodes: a second Slurm instance beside the test cluster (testbed/emulated_cluster.py),
real slurmctld, slurmd, srun, sbcast, pyxis and enroot, the job program unchanged, stub ranks and a 1 MB image.

What holds whatever the host's speed: the job program's Slurm calls (by command), its steps and its Python starts per
start and per spare swap are the same at 2 and at 16 nodes; one node that cannot stage reads the shared file alone; a
spare replaces a lost node. The quick tier holds the cluster's configuration and guard rails."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from testbed import emulated_cluster as ec
from testbed.scale_jobs import ScaleJobs, build_stub
from testbed.slurm_cluster import ClusterUnavailable


@pytest.fixture(scope="module")
def emulated() -> Iterator[ScaleJobs]:
    """DDPACK_TEST_NODES emulated nodes, brought up for this module and torn down after it (the test cluster untouched)."""
    count = ec.nodes_wanted()
    before = ec.test_cluster_now()
    try:
        ec.up(count, busy_ok=True, need_cpu=False)  # the counts need no CPU figures
    except ClusterUnavailable as why:
        if os.environ.get("CI"):
            pytest.fail(f"CI must be able to emulate {count} nodes: {why}")
        pytest.skip(str(why))
    work = Path(tempfile.mkdtemp(prefix="ddpack-scale-", dir="/tmp"))
    try:
        work.chmod(0o755)
        (work / "logs").mkdir()
        (work / "ready").mkdir()
        (work / "ready").chmod(0o777)
        yield ScaleJobs(work, build_stub(work))
    finally:
        ec.down()
        shutil.rmtree(work, ignore_errors=True)
    assert ec.test_cluster_now() == before  # its daemons and slurm.conf as they were


@pytest.mark.slurm
@pytest.mark.pyxis
def test_emulated_nodes_cost_the_same_slurm_calls_steps_and_python_starts_at_2_as_at_16_one_bad_node_costs_one_and_a_spare_swaps_in(
    emulated: ScaleJobs,
) -> None:
    """Cold starts (prepare, the holder step, sbcast, install, training) at 2 and at N nodes: the batch host's Slurm
    commands by command, its steps and Python starts, each node's Python starts and the nodes' own Slurm calls are equal.
    Then at N nodes, one node's staging folder a plain file: that node alone reads the shared squashfs (K = 1 node's
    enroot create from it), named in one line and one record; the others unpack their own copies. Then a spare swap at 3
    and at N nodes (one a spare): a training node set DOWN is replaced by the spare, and the swap's Slurm calls, steps and
    Python starts are equal at both sizes."""
    nodes = ec.nodes_wanted()
    small, big = emulated.start("cold", 2), emulated.start("cold", nodes)
    counts = ("calls", "steps", "python_batch", "python_per_node", "node_side_calls")
    assert {c: getattr(small, c) for c in counts} == {c: getattr(big, c) for c in counts}
    assert big.calls.get("sbcast") == 1 and big.shared_readers == 0  # every node staged: none read the shared file

    bad_node = f"ds{nodes // 2}"
    bad = emulated.start("bad", nodes, bad=bad_node)
    assert bad.shared_readers == 1, emulated.log(bad.job)
    line = f"ddpack: image: {bad_node} reads {emulated.image} from the shared file alone (DDPACK_STAGE_DIR="
    assert line in emulated.log(bad.job), emulated.log(bad.job)
    run_dir = emulated.work / "runs" / f"scale-{bad.job}"
    records = [json.loads(text) for text in (run_dir / "decisions.jsonl").read_text().splitlines() if '"staging"' in text]
    assert [(r["choice"], r.get("node")) for r in records if r["choice"] == "shared"] == [("shared", bad_node)]
    staged = [node for node in ec.node_names(nodes) if list((ec.DISKS / node / emulated.stage.name).glob("*.sqsh"))]
    assert staged == [node for node in ec.node_names(nodes) if node != bad_node]

    # A spare swap at 3 and at N nodes (one a spare): a training node set DOWN is replaced by the spare, and the swap's
    # Slurm calls, steps and Python starts are equal at both sizes.
    three, many = emulated.swap(3), emulated.swap(nodes)
    for swap, size in ((three, 3), (many, nodes)):
        before, after = swap.ranks_on
        victim, spare = f"ds{size - 1}", f"ds{size}"
        assert victim in before and spare not in before and victim not in after and spare in after, swap.ranks_on
    assert three.calls and three.steps, three
    assert {c: getattr(three, c) for c in counts} == {c: getattr(many, c) for c in counts}


def test_the_emulated_cluster_has_its_own_name_ports_and_files_and_never_writes_the_test_clusters() -> None:
    """The second instance's slurm.conf: its own cluster name, controller port, state, spool, pid and log files (each
    node's by %n), one port a node, unique and below the launcher's MASTER_PORT range [15000, 30000), and no path of
    the test cluster's but the plugstack it reads."""
    text = ec.scale_conf(64)
    settings = [line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith(("#", "NodeName", "PartitionName"))]
    values = dict(settings)
    assert values["ClusterName"] == "ddscale" and values["SlurmctldPort"] == "6917"
    assert all("/etc/slurm/" not in value for key, value in settings if key != "PlugStackConfig")
    assert all(
        "ddscale" in values[key] for key in ("StateSaveLocation", "SlurmdSpoolDir", "SlurmctldPidFile", "SlurmdPidFile", "SlurmdLogFile")
    )
    ports = [
        int(word.split("=")[1])
        for line in text.splitlines()
        if line.startswith("NodeName")
        for word in line.split()
        if word.startswith("Port=")
    ]
    assert len(ports) == len(set(ports)) == 64 and max(ports) < 15000 and min(ports) > 6917
    assert "Nodes=ds[1-64]" in text


def test_the_emulated_cluster_refuses_a_host_short_of_memory_or_too_busy_with_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """64 nodes need 64 x 64 MiB + 4 GiB available, and a 1-minute load no higher than the CPUs unless --busy-ok."""
    meminfo = tmp_path / "meminfo"
    real_path = Path

    def fake_path(name: str = "", *rest: str) -> Path:
        return meminfo if name == "/proc/meminfo" else real_path(name, *rest)

    monkeypatch.setattr(ec, "Path", fake_path)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    meminfo.write_text(f"MemTotal: 24000000 kB\nMemAvailable: {(9 << 30) >> 10} kB\n")
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert ec.refusal(64) is None
    meminfo.write_text(f"MemAvailable: {(7 << 30) >> 10} kB\n")
    assert (
        ec.refusal(64)
        == "refusing 64 emulated nodes: 7168 MiB available, 8192 MiB needed (64 x 64 MiB + 4 GiB); free memory or use fewer nodes"
    )
    meminfo.write_text(f"MemAvailable: {(20 << 30) >> 10} kB\n")
    monkeypatch.setattr(os, "getloadavg", lambda: (2.5, 2.0, 1.0))
    assert (ec.refusal(64) or "").startswith("refusing 64 emulated nodes: load 2.50 on 2 CPUs")
    assert ec.refusal(64, busy_ok=True) is None


def test_the_test_clusters_daemons_are_counted_without_zombies() -> None:
    """A daemon's parent that forked it and exited is a zombie until reaped, which can happen during a run: counted, it
    made an untouched test cluster read as changed."""
    child = os.fork()
    if child == 0:
        os._exit(0)
    try:
        while Path(f"/proc/{child}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            pass
        assert not ec._alive(str(child)) and ec._alive(str(os.getpid())) and not ec._alive("999999999")
    finally:
        os.waitpid(child, 0)
