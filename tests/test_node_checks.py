"""The preflight's node checks (train/preflight/node.py) and its strict GPU floors (train/preflight/throughput.py),
on stand-ins: a fake statvfs for /dev/shm, a fake /sys for RDMA devices, and nvidia-smi outputs of a healthy and a
failing 8-GPU H100 node (tests/nvidia_smi/, in nvidia-smi's own formats) read through an injected runner or a
stand-in `nvidia-smi` on PATH."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from recorded_gpus import RECORDED, gpu_facts, recorded

from testbed.env import ROOT
from train.preflight import node as checks
from train.preflight.node import NodeFacts, gpu_node_checks, gpu_query, memlock_check, node_checks, rdma_checks, shm_checks, shm_need
from train.preflight.report import Report, render
from train.preflight.throughput import GIB, Measured, all_reduce_size, floor_for, judge, node_groups
from train.preflight.verdict import NodeCheck, read_node_checks

MIB = 1 << 20


def fake_statvfs(size: int, free: int):  # type: ignore[no-untyped-def]
    def statvfs(path: str) -> os.statvfs_result:
        block = 4096
        return os.statvfs_result((block, block, size // block, free // block, free // block, 0, 0, 0, 0, 255))

    return statvfs


def by_check(rows: Sequence[NodeCheck]) -> dict[str, NodeCheck]:
    return {row.check: row for row in rows}


# ---------------------------------------------------------------------------- /dev/shm


def test_a_1_mib_dev_shm_fails_naming_it_its_size_and_what_to_do() -> None:
    rows = by_check(shm_checks("ddnode2", 1 << 30, "the NCCL floor", "/dev/shm", fake_statvfs(MIB, MIB)))
    assert rows["shm-size"].status == "fail" and rows["shm-free"].status == "fail"
    assert rows["shm-size"].line() == (
        "node ddnode2: shm-size: /dev/shm 1.0 MiB (threshold: >= 1.0 GiB (the NCCL floor)): /dev/shm is too small for the run's "
        "DataLoader workers and NCCL: mount it larger (docker --shm-size or --ipc=host; under enroot and pyxis it is the host's, "
        "sized by the host's tmpfs: remount it there) or drain the node"
    )


def test_a_large_dev_shm_full_of_other_files_fails_on_free_space_alone() -> None:
    rows = by_check(shm_checks("n1", 256 * MIB, "the CPU floor", "/dev/shm", fake_statvfs(64 << 30, 10 * MIB)))
    assert rows["shm-size"].status == "ok" and rows["shm-free"].status == "fail"
    assert rows["shm-free"].value == "10.0 MiB free of 64.0 GiB" and "ls -la /dev/shm" in rows["shm-free"].action


def test_a_real_folder_stands_in_for_dev_shm(tmp_path: Path) -> None:
    """The path is the default statvfs's: a folder on this machine's disk has room for the CPU floor, and none for an
    absurd need."""
    assert all(row.status == "ok" for row in shm_checks("n1", MIB, "x", str(tmp_path)))
    assert by_check(shm_checks("n1", 1 << 60, "x", str(tmp_path)))["shm-size"].status == "fail"
    assert shm_checks("n1", MIB, "x", str(tmp_path / "none"))[0].value.startswith(f"cannot read {tmp_path}/none (No such file")


def test_the_shm_need_follows_the_dataloader_of_a_task_of_your_own_not_of_the_built_in_ones() -> None:
    assert shm_need(nccl=True, local_ranks=8, workers=8, batch_size=64, task="regression") == (1 << 30, "the NCCL floor")
    assert shm_need(nccl=False, local_ranks=2, workers=0, batch_size=64, task="mine:make")[0] == 256 * MIB
    need, why = shm_need(nccl=True, local_ranks=8, workers=8, batch_size=64, task="mine:make")
    assert need == 8 * 8 * checks.PREFETCH_FACTOR * 64 * checks.ASSUMED_SAMPLE_BYTES and why.startswith(
        "8 ranks x 8 workers x 4 batches of 64"
    )


# ---------------------------------------------------------------------------- locked memory, RDMA devices


def fake_sys(root: Path, devices: dict[str, tuple[str, str]]) -> Path:
    """/sys/class/infiniband with DEVICE -> (driver, port 1's state)."""
    for name, (driver, state) in devices.items():
        device = root / "sys/class/infiniband" / name
        (device / "ports/1").mkdir(parents=True)
        (device / "ports/1/state").write_text(f"{state}\n")
        (root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
        (device / "device").mkdir()
        (device / "device/driver").symlink_to(root / "drivers" / driver)
    return root


def test_memlock_must_be_unlimited_where_rdma_devices_are_and_says_the_slurm_fix() -> None:
    limited = memlock_check("p5-1", ["rdmap16s27"], 64 << 10)
    assert limited.status == "fail" and limited.value == "64.0 KiB" and "PropagateResourceLimitsExcept=MEMLOCK" in limited.action
    assert memlock_check("p5-1", ["rdmap16s27"], resource.RLIM_INFINITY).status == "ok"
    assert memlock_check("cpu-1", [], 64 << 10).status == "ok"  # no RDMA device: nothing pins for the NIC


def test_the_locked_memory_row_reads_the_rdma_devices_under_the_given_root(tmp_path: Path) -> None:
    root = fake_sys(tmp_path, {"rdmap16s27": ("efa", "4: ACTIVE")})
    facts = NodeFacts(node="p5-1", gpus=False, gpus_asked=0, shm_need=MIB, shm_why="x", efa_expected=True)
    rows, seconds = node_checks(facts, statvfs=fake_statvfs(1 << 30, 1 << 30), root=root, memlock=64 << 10)
    assert by_check(rows)["memlock"].status == "fail" and "rdmap16s27" in by_check(rows)["memlock"].threshold
    assert by_check(rows)["efa"].status == "ok" and by_check(rows)["rdma-ports"].status == "ok"
    assert 0 < seconds < 1


def test_a_port_down_and_missing_efa_devices_are_named(tmp_path: Path) -> None:
    root = fake_sys(tmp_path, {"mlx5_0": ("mlx5_core", "4: ACTIVE"), "mlx5_1": ("mlx5_core", "1: DOWN")})
    rows = by_check(rdma_checks("ib-7", root, efa_expected=True))
    assert rows["efa"].status == "fail" and rows["efa"].value == "0 EFA devices"
    assert (
        rows["rdma-ports"].status == "fail" and rows["rdma-ports"].value == "mlx5_1 port 1 DOWN" and rows["rdma-ports"].device == "mlx5_1"
    )
    assert by_check(rdma_checks("ib-7", root, efa_expected=False))["efa"].status == "ok"


def test_a_gloo_job_on_a_node_with_an_idle_infiniband_card_is_not_failed(tmp_path: Path) -> None:
    """A CPU job (gloo, no EFA) registers no memory with a NIC: a finite memlock and a port with no cable are said, not
    a reason to fail the node (with DDPACK_PREFLIGHT=1 every such node would otherwise end the job)."""
    root = fake_sys(tmp_path, {"mlx5_0": ("mlx5_core", "1: DOWN")})
    facts = NodeFacts(node="cpu-3", gpus=False, gpus_asked=0, shm_need=MIB, shm_why="x", efa_expected=False)
    rows, _ = node_checks(facts, statvfs=fake_statvfs(1 << 30, 1 << 30), root=root, memlock=64 << 10)
    assert not [row for row in rows if row.status == "fail"], rows
    assert by_check(rows)["rdma-ports"].status == "warn" and by_check(rows)["memlock"].status == "ok"


# ---------------------------------------------------------------------------- GPUs, from recorded nvidia-smi outputs


def test_a_healthy_h100_node_passes_every_gpu_check() -> None:
    rows = by_check(gpu_node_checks(gpu_facts(), recorded("healthy", dmesg="healthy")))
    assert sorted(rows) == sorted(["gpu-count", "persistence", "compute-mode", "ecc", "throttle", "thermal", "row-remap", "nvlink", "xid"])
    assert {row.status for row in rows.values()} == {"ok"}, [row for row in rows.values() if row.status != "ok"]
    assert rows["gpu-count"].value == "8 (NVIDIA H100 80GB HBM3)" and rows["nvlink"].value == "144 links up on 8 GPUs"


def test_a_failing_h100_node_names_each_bad_gpu_with_its_value_and_threshold() -> None:
    rows = by_check(gpu_node_checks(gpu_facts(), recorded("failing", dmesg="failing")))
    failed = {check: (row.value, row.device) for check, row in rows.items() if row.status == "fail"}
    assert failed == {
        "ecc": ("GPU 3: 2 uncorrected", "GPU 3 (00000000:5D:00.0)"),
        "throttle": ("GPU 5: hardware slowdown, hardware thermal slowdown", "GPU 5 (00000000:AB:00.0)"),
        "compute-mode": ("GPU 7: Prohibited", "GPU 7 (00000000:DB:00.0)"),
        "row-remap": ("00000000:3A:00.0: pending; 00000000:9A:00.0: failed", "00000000:3A:00.0, 00000000:9A:00.0"),
        "nvlink": ("GPU 1: 2 links down", "GPU 1"),
        "xid": ("Xid 79 on 0000:5d:00 (also Xid 13: a program's errors, not the GPU's)", "0000:5d:00"),
    }
    warned = {check: row.value for check, row in rows.items() if row.status == "warn"}
    assert warned == {"persistence": "GPU 6: Disabled", "thermal": "GPU 6: software thermal slowdown"}
    assert (
        rows["row-remap"]
        .line()
        .startswith(
            "node p5-3: row-remap 00000000:3A:00.0, 00000000:9A:00.0: 00000000:3A:00.0: pending; 00000000:9A:00.0: failed "
            "(threshold: no pending or failed row remap): a pending remap is applied by a GPU reset"
        )
    )


def test_a_gpu_missing_from_the_node_fails_the_count_the_job_asked() -> None:
    rows = by_check(gpu_node_checks(gpu_facts(asked=8), recorded("healthy", drop_gpu="3")))
    assert rows["gpu-count"].status == "fail" and rows["gpu-count"].value == "7 (NVIDIA H100 80GB HBM3)"
    assert rows["gpu-count"].threshold == ">= 8 (what the job asked on this node)"
    assert by_check(gpu_node_checks(gpu_facts(asked=4), recorded("healthy", drop_gpu="3")))["gpu-count"].status == "ok"


def test_an_unreadable_kernel_log_is_a_skip_row_that_says_where_to_look() -> None:
    row = by_check(gpu_node_checks(gpu_facts(), recorded("healthy")))["xid"]
    assert (
        row.status == "skip"
        and row.value == "not readable here (dmesg exited 1: dmesg: read kernel buffer failed: Operation not permitted)"
    )
    assert "dmesg | grep Xid" in row.action


def test_the_throttle_field_takes_its_new_name_from_driver_535_54_03() -> None:
    assert gpu_query("535.54.03")[1].endswith(",clocks_event_reasons.active")
    assert gpu_query("550.127.08")[1].endswith(",clocks_event_reasons.active")
    assert gpu_query("535.54.02")[1].endswith(",clocks_throttle_reasons.active")
    assert gpu_query(None)[1].endswith(",clocks_throttle_reasons.active")


STAND_IN = """#!/bin/sh
# nvidia-smi as a failing H100 node answers, from its recorded outputs
case "$*" in
  --query-gpu=*) cat "{dir}/h100-failing.query.csv" ;;
  "-q -d ROW_REMAPPER") cat "{dir}/h100-failing.row-remap.txt" ;;
  "nvlink -s") cat "{dir}/h100-failing.nvlink.txt" ;;
  *) echo "stand-in nvidia-smi: unexpected arguments: $*" >&2; exit 2 ;;
esac
"""


def test_the_commands_run_are_nvidia_smi_s_own_through_a_stand_in_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "nvidia-smi").write_text(STAND_IN.format(dir=RECORDED))
    (tmp_path / "dmesg").write_text("#!/bin/sh\necho 'dmesg: read kernel buffer failed: Operation not permitted' >&2\nexit 1\n")
    for name in ("nvidia-smi", "dmesg"):
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    rows = by_check(gpu_node_checks(gpu_facts(), checks.run_command))
    assert rows["ecc"].status == "fail" and rows["row-remap"].status == "fail" and rows["nvlink"].status == "fail"
    assert rows["xid"].value == "not readable here (dmesg exited 1: dmesg: read kernel buffer failed: Operation not permitted)"


def test_without_nvidia_smi_every_gpu_row_says_it_was_not_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # neither nvidia-smi nor dmesg
    rows = gpu_node_checks(gpu_facts(), checks.run_command)
    assert {row.status for row in rows} == {"skip"}
    assert by_check(rows)["ecc"].value == "not checked (nvidia-smi is not in this container)"
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in by_check(rows)["ecc"].action


# ---------------------------------------------------------------------------- --preflight-strict's GPU floors


def test_the_floors_are_matched_per_gpu_model_and_not_for_pcie_parts() -> None:
    assert floor_for("NVIDIA H100 80GB HBM3").busbw_gbps == 460  # type: ignore[union-attr]
    assert floor_for("NVIDIA H200").busbw_gbps == 431  # type: ignore[union-attr]
    assert floor_for("NVIDIA A100-SXM4-80GB").h2d_gbps == 24  # type: ignore[union-attr]
    assert floor_for("NVIDIA H100 PCIe") is None and floor_for("NVIDIA H200 NVL") is None and floor_for("NVIDIA L4") is None


def measured_node(host: str, *, h2d: Sequence[float], d2d: Sequence[float], busbw: float, gpus: int = 8) -> list[Measured]:
    return [
        Measured(host=host, device_name="NVIDIA H100 80GB HBM3", gpu=i, h2d_gbps=h2d[i], d2d_peer=(i + 1) % gpus, d2d_gbps=d2d[i],
                 busbw_gbps=busbw if i == 0 else None, all_reduce_bytes=16 * GIB, node_gpus=gpus)
        for i in range(gpus)
    ]  # fmt: skip


def test_a_node_below_its_gpu_model_s_floors_fails_naming_the_gpus_and_figures() -> None:
    good = measured_node("p5-1", h2d=[53.1] * 8, d2d=[371.0] * 8, busbw=478.0)
    bad = measured_node("p5-2", h2d=[53.0, 53.2, 21.7, 53.1, 53.0, 52.9, 53.0, 53.1], d2d=[370.0] * 7 + [190.5], busbw=402.3)
    rows = judge([*good, *bad])
    assert [(r.node, r.check, r.status) for r in rows] == [
        ("p5-1", "h2d", "ok"), ("p5-1", "d2d", "ok"), ("p5-1", "all-reduce-busbw", "ok"),
        ("p5-2", "h2d", "fail"), ("p5-2", "d2d", "fail"), ("p5-2", "all-reduce-busbw", "fail"),
    ]  # fmt: skip
    failed = {r.check: (r.value, r.threshold, r.device) for r in rows if r.status == "fail"}
    assert failed == {
        "h2d": ("GPU 2: 21.7 GB/s", ">= 48 GB/s (NVIDIA H100 80GB HBM3)", "GPU 2"),
        "d2d": ("GPU 7->0: 190.5 GB/s", ">= 335 GB/s (NVIDIA H100 80GB HBM3)", "GPU 7->0"),
        "all-reduce-busbw": ("402.3 GB/s at 16 GiB", ">= 460 GB/s at 16 GiB, 8 GPUs (NVIDIA H100 80GB HBM3)", ""),
    }
    assert rows[0].value == "lowest 53.1 GB/s (GPU 0)"


def test_an_all_reduce_of_fewer_than_8_gpus_and_an_unknown_model_are_not_compared_with_a_floor() -> None:
    rows = judge(measured_node("g2", h2d=[50.0, 50.0], d2d=[360.0, 360.0], busbw=300.0, gpus=2))
    assert [(r.check, r.status) for r in rows] == [("h2d", "ok"), ("d2d", "ok"), ("all-reduce-busbw", "skip")]
    rows = judge([Measured(host="l4", device_name="NVIDIA L4", gpu=0, h2d_gbps=12.0)])
    assert [(r.check, r.status, r.value) for r in rows] == [("gpu-floors", "skip", "NVIDIA L4")]


def test_the_all_reduce_size_is_the_floor_s_where_memory_allows_and_halves_down_to_1_gib() -> None:
    assert all_reduce_size(16 * GIB, 139 * GIB) == 16 * GIB
    assert all_reduce_size(16 * GIB, 20 * GIB) == 4 * GIB
    assert all_reduce_size(16 * GIB, 2 * GIB) == 0
    assert all_reduce_size(0, 80 * GIB) == 0
    assert node_groups(["a", "a", "b", "b", "a"]) == [[0, 1, 4], [2, 3]]


# ---------------------------------------------------------------------------- the report and its record


def test_failing_node_checks_are_fail_lines_and_records_the_job_program_reads(tmp_path: Path) -> None:
    rows = [
        *shm_checks("ddnode2", 256 * MIB, "the CPU floor", "/dev/shm", fake_statvfs(MIB, MIB)),
        *shm_checks("ddnode1", 256 * MIB, "the CPU floor", "/dev/shm", fake_statvfs(8 << 30, 8 << 30)),
    ]
    report = Report(2, "gloo", 30.0, node_checks=rows, failures=[row.line() for row in rows if row.status == "fail"])
    lines = render(report)
    fails = [line.removeprefix("preflight: FAIL ").split(":")[:2] for line in lines if line.startswith("preflight: FAIL ")]
    assert fails == [["node ddnode2", " shm-size"], ["node ddnode2", " shm-free"]]
    table = lines[lines.index(next(line for line in lines if line.startswith("node checks"))) + 1 :][:5]
    assert table[0].split() == ["node", "check", "status", "value", "threshold"]
    assert table[1].split()[:4] == ["ddnode2", "shm-size", "FAIL", "/dev/shm"]
    (tmp_path / "preflight.json").write_text(report.to_json())
    assert read_node_checks(tmp_path / "preflight.json") == rows
    assert read_node_checks(tmp_path / "missing.json") == []


def test_a_failed_preflight_s_decision_record_names_the_failing_nodes_and_checks_as_fields(tmp_path: Path) -> None:
    """The job program (standard library only, no train/ on the batch host) reads preflight.json's node_checks and keeps
    each failing one's node, check, value and threshold in its `preflight` decision: what a swap for a spare reads."""
    rows = [
        *shm_checks("ddnode2", 256 * MIB, "the CPU floor", "/dev/shm", fake_statvfs(MIB, MIB)),
        *shm_checks("ddnode1", 256 * MIB, "the CPU floor", "/dev/shm", fake_statvfs(8 << 30, 8 << 30)),
    ]
    report = Report(2, "gloo", 30.0, node_checks=rows, failures=["x"])
    step = f"cat > {tmp_path}/preflight.json <<'EOF'\n{report.to_json()}\nEOF\nexit 1"
    env = {"PATH": os.environ["PATH"], "DDPACK_PREFLIGHT": "1", "DDPACK_RUN_DIR": str(tmp_path), "SLURM_JOB_ID": "41"}
    out = subprocess.run([sys.executable, "-I", "-S", str(ROOT / "enroot/ddpack_job.py"), "preflight", "--", "sh", "-c", step],
                         env=env, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1, out.stderr
    assert "preflight failed (exit 1) on node ddnode2 (shm-size, shm-free); not training" in out.stdout + out.stderr
    record = json.loads((tmp_path / "decisions.jsonl").read_text().splitlines()[-1])
    assert record["kind"] == "preflight" and record["result"] == "failed" and record["nodes"] == ["ddnode2"]
    assert record["failed_checks"] == [row.key() for row in rows if row.status == "fail"]
    assert record["failed_checks"][0] == {
        "node": "ddnode2", "check": "shm-size", "value": "/dev/shm 1.0 MiB", "threshold": ">= 256.0 MiB (the CPU floor)", "device": "",
    }  # fmt: skip
