"""The GPU tier (`pytest -m gpu`): the trainer, the gradient-sync hook's CUDA branch, the preflight's bf16
matmul, its nvidia-smi node checks and strict copy rates, and the node checks on a real NVIDIA GPU. Skipped where torch sees none (CI); run on a lent GPU
(see the README's Tests section for how and what it last showed)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_jobs import grad_sync_pair_reports, metrics_step, reference_checksum, start_slurm_step, subdir, wait_for

import testbed.env
from train import recovery
from train.gpu import driver_version, required_driver, set_tf32, version_tuple

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def ranks_see_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every other tier hides the GPUs from the processes it starts (testbed/env.py); this one is about them."""
    monkeypatch.setattr(testbed.env, "gpus_visible", True)

TESTS = Path(__file__).resolve().parent  # where plugins.* live, as a user's task module would
SHORT = ["--epochs", "1", "--dataset-size", "4096", "--batch-size", "64", "--log-every", "8"]


def start_record(metrics: Path) -> dict:
    return next(record for record in map(json.loads, metrics.read_text().splitlines()) if record["kind"] == "start")


@pytest.mark.parametrize(
    ("flags", "precision"),
    [([], "tf32"), (["--amp"], "bf16"), (["--grad-accum", "2"], "tf32"), (["--amp", "--bf16-grads"], "bf16"), (["--no-tf32"], "fp32")],
    ids=["fp32-as-tf32", "amp", "grad-accum", "amp-bf16-grads", "no-tf32"],
)
def test_the_trainer_runs_on_one_gpu_with_nccl(tmp_path: Path, flags: list[str], precision: str) -> None:
    metrics = tmp_path / "metrics.jsonl"
    job = start_slurm_step(tmp_path, [1], [*SHORT, *flags, "--snapshot-dir", "", "--metrics-file", str(metrics)])
    assert job.wait(300) == [0], job.output()
    out = job.output(0)
    assert "backend nccl device cuda:0" in out and "checksums agree across 1 ranks" in out, out
    start = start_record(metrics)
    expected = precision if torch.cuda.get_device_capability(0)[0] >= 8 or precision != "tf32" else "fp32"
    assert start["precision"] == expected and start["device"] == torch.cuda.get_device_name(0)
    progress = [record for record in map(json.loads, metrics.read_text().splitlines()) if record["kind"] == "progress"]
    assert progress, metrics.read_text()
    if start["peak_source"] is not None:  # a GPU of the data-sheet table (H100, A100, ...): MFU against it
        assert start["peak_source"].startswith("data sheet:") and all(0 < record["mfu"] < 1 for record in progress), progress[-1]


def test_a_stop_on_the_gpu_resumes_bit_for_bit(tmp_path: Path) -> None:
    """Two ranks can share one GPU only over gloo (NCCL refuses a duplicate GPU), so the stop and resume
    runs on one rank with nccl: SIGTERM mid-epoch, the snapshot, the rerun, the uninterrupted checksum.
    Each forward sleeps 30 ms (plugins.slow_rank), so that the signal lands mid-run on a fast GPU."""
    args = ["--task", "plugins.slow_rank:task", "--epochs", "2", "--batch-size", "64", "--log-every", "1"]
    env = {"SLOW_RANK": "0", "SLOW_RANK_MS": "30"}
    want = reference_checksum(tmp_path, args, ranks=1, cwd=TESTS, env=env)
    snap, metrics = tmp_path / "snap", tmp_path / "stopped.jsonl"
    full = [*args, "--snapshot-dir", str(snap), "--snapshot-every", "1000"]
    stopped = start_slurm_step(subdir(tmp_path, "stopped"), [1], [*full, "--metrics-file", str(metrics)], cwd=TESTS, rank_env={0: env})
    wait_for(lambda: metrics_step(metrics) >= 20, 180, "step 20")
    stopped.send(signal.SIGTERM, [0])
    assert stopped.wait(120) == [143], stopped.output()
    end = stopped.ends(0)[-1]
    assert end.outcome == "stopped" and 20 <= end.global_step < 128, stopped.output()
    resumed = start_slurm_step(subdir(tmp_path, "resumed"), [1], full, cwd=TESTS, rank_env={0: env})
    assert resumed.wait(300) == [0], resumed.output()
    assert f"resuming from {snap}" in resumed.output(0) and resumed.checksums() == [want], resumed.output()


def test_two_ranks_sharing_the_gpu_over_gloo_sync_like_ddp_and_stop_together() -> None:
    """The hook's CUDA branch with CUDA tensors: gradients equal to DDP's own all-reduce, a signal at rank 1
    alone stops both (read one step late, through pinned memory, so the host never waits), and the bf16
    buckets within bfloat16's rounding, the same on both ranks."""
    reports = grad_sync_pair_reports("cuda")
    for report in reports:
        for name in ("small-last", "large-last"):
            assert report[name]["same_grads"] == [True] * 4, (report["rank"], name)
            assert report[name]["polls"] == [None, None, None, "SIGTERM"], (report["rank"], name)
            assert report[name]["packed"]["close"] == [True] * 4 and report[name]["packed"]["polls"] == [None, None, None, "SIGTERM"]
    for name in ("small-last", "large-last"):
        assert reports[0][name]["packed"]["digests"] == reports[1][name]["packed"]["digests"]


def test_the_preflight_measures_bf16_matmul_and_names_the_driver(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    job = start_slurm_step(tmp_path, [1], ["--preflight", "--preflight-seconds", "10", "--preflight-json", str(report_path), "--snapshot-dir", ""])
    assert job.wait(300) == [0], job.output()
    report = json.loads(report_path.read_text())
    assert report["ok"] and report["compute"][0]["gflops"] > 10_000, report["compute"]  # bf16 tensor cores: tens of TFLOP/s at least
    identity = report["identity"][0]
    assert identity["driver"] == driver_version() and identity["nccl"] != "-" and identity["transport"] != "-", identity


def test_the_strict_preflight_reads_the_gpus_with_nvidia_smi_and_measures_their_copies(tmp_path: Path) -> None:
    """The node checks on a real GPU node (nvidia-smi's formats as this driver writes them, parsed into every row) and
    --preflight-strict's copy rates measured; the rows' values are make gpu-check's to record, not this test's to judge."""
    report_path = tmp_path / "report.json"
    args = ["--preflight", "--preflight-strict", "--preflight-seconds", "10", "--preflight-json", str(report_path), "--snapshot-dir", ""]
    job = start_slurm_step(tmp_path, [1], args)
    job.wait(300)
    report = json.loads(report_path.read_text())
    rows = {row["check"]: row for row in report["node_checks"]}
    assert {"gpu-count", "persistence", "compute-mode", "ecc", "throttle", "row-remap", "nvlink", "xid", "memlock", "shm-free"} <= rows.keys()
    for check in ("gpu-count", "persistence", "compute-mode", "ecc", "throttle", "row-remap", "nvlink"):  # read and parsed here
        assert rows[check]["status"] != "skip", rows[check]
    assert rows["gpu-count"]["value"].startswith(f"{torch.cuda.device_count()} ({torch.cuda.get_device_name(0)})"), rows["gpu-count"]
    assert report["node_check_s"] < 5, report["node_check_s"]
    measured = rows.get("h2d") or rows["gpu-floors"]  # a model without published floors says so
    assert "GB/s" in measured["value"] or measured["check"] == "gpu-floors", measured


def test_the_node_checks_hold_on_a_real_gpu() -> None:
    """The driver is readable and new enough for this torch; TF32 is on where the GPU has it."""
    driver = driver_version()
    need = required_driver(torch.version.cuda or "0")
    assert driver is not None and (need is None or version_tuple(driver) >= version_tuple(need)), (driver, need)
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        assert set_tf32(torch.device("cuda", 0), True) is (torch.cuda.get_device_capability(0)[0] >= 8)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def test_recovery_aborts_the_nccl_group_and_forms_the_next_generation_on_the_same_store(tmp_path: Path) -> None:
    """In-process recovery's GPU half (train/recovery.py): the communicator is aborted, not left to its watchdog, the next
    generation's group forms on the job's store and all-reduces; and the trainer runs with --recovery on NCCL."""
    found = subprocess.run(
        [sys.executable, "-m", "plugins.nccl_regroup"], cwd=TESTS, env=testbed.env.clean_env(PYTHONPATH=f"{testbed.env.ROOT}:{TESTS}"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert found.returncode == 0, found.stdout + found.stderr
    report = json.loads(found.stdout.strip().splitlines()[-1])
    assert report["sums"] == [4.0, 8.0] and report["error_handling"] == "2", report
    metrics = tmp_path / "metrics.jsonl"
    job = start_slurm_step(tmp_path, [1], [*SHORT, "--recovery", "--snapshot-dir", "", "--metrics-file", str(metrics)])
    assert job.wait(300) == [0], job.output()
    assert "backend nccl device cuda:0" in job.output(0) and "checksums agree across 1 ranks" in job.output(0), job.output()
    assert recovery.NCCL_UNPROVEN in job.output(0)  # until the NCCL path has run across two GPUs
