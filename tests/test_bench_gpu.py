"""`make bench-gpu`'s own code, on the CPU at tiny sizes (`--dry-run-on-cpu`): the bench that measures the trainer
against a bare DDP loop on a GPU must run, and print its comparisons with real ratios and its profiles, wherever no GPU
is lent (the --compile side and the GPU-bound batch are the same code with other flags, left out for time)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from recorded_gpus import gpu_facts, recorded

from testbed.env import ROOT, clean_env


def test_the_gpu_bench_runs_on_the_cpu_and_prints_both_comparisons(tmp_path: Path) -> None:
    argv = [sys.executable, str(ROOT / "bench" / "bench_gpu.py"), "--dry-run-on-cpu", "--rounds", "1", "--steps", "10", "--no-compile",
            "--gpu-bound-batch", "0", "--profile", "profiles"]  # fmt: skip
    out = subprocess.run(argv, env=clean_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)  # a folder relative to here
    assert out.returncode == 0, out.stdout + out.stderr
    matmul = re.search(r"^matmul bf16 .* preflight/bare (\d+\.\d+) \(goal >= 0\.85\)$", out.stdout, re.M)
    gpt_line = r"^GPT ~92M bf16, .* trainer (\d+\.\d+) ms/step, bare DDP loop (\d+\.\d+) ms/step, trainer/bare (\d+\.\d+) \(goal <= 1\.03\)"
    gpt = re.search(gpt_line, out.stdout, re.M)
    assert matmul and gpt, out.stdout
    trainer, bare, ratio = (float(gpt.group(i)) for i in (1, 2, 3))
    assert trainer > 0 and bare > 0 and abs(ratio - trainer / bare) < 0.01 and float(matmul.group(1)) > 0
    for side in ("trainer", "bare"):
        profiled = re.search(rf"^profile, {side}, (\d+) steady steps: (\d+\.\d+) ms/step wall", out.stdout, re.M)
        assert profiled and int(profiled.group(1)) == 7 and float(profiled.group(2)) > 0, out.stdout  # 10 steps, 3 of them warm-up
        assert "aten::" in (tmp_path / "profiles" / f"profile-{side}.txt").read_text()
        assert json.loads((tmp_path / "profiles" / f"profile-{side}.json").read_text())["host_ops_ms"] > 0


def test_the_host_bench_prints_the_trainer_against_the_bare_loop_with_its_phases() -> None:
    """`make bench-host`'s own code, one short round: the last line's figures agree with each other."""
    argv = [sys.executable, str(ROOT / "bench" / "bench_host.py"), "--rounds", "1", "--steps", "61"]
    out = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    last = out.stdout.strip().splitlines()[-1]
    figures = re.match(r"bench-host: trainer (\d+) µs/step, bare (\d+) µs/step, overhead (-?\d+) µs/step \(goal <= 150\); trainer - bare by phase", last)
    assert figures, out.stdout
    trainer, bare, overhead = (int(figures.group(i)) for i in (1, 2, 3))
    assert trainer > 0 and bare > 0 and abs(trainer - bare - overhead) <= 1, last
    assert "buckets: trainer 14, bare 14, the 92M GPT on a GPU 13" in out.stdout and "stand-in: its CUDA event" in out.stdout, out.stdout


def test_gpu_check_s_preflight_step_is_a_strict_preflight_and_its_summary_holds_every_node_check(tmp_path: Path) -> None:
    """make gpu-check's preflight step: argv the entrypoint accepts as a strict preflight, and each of the report's node
    checks (value, threshold, the GPUs it names) in the summary with the time the cheap checks took."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from entrypoint.cli import parse_args
    from train.preflight.node import gpu_node_checks
    from train.preflight.report import Report

    argv = gpu_check.preflight_argv(tmp_path)
    options, _ = parse_args(argv[3:])
    assert options.command[2:] == ("-m", "train.preflight", "--preflight-strict", "--preflight-seconds", "10", "--preflight-json",
                                   str(tmp_path / "preflight.json"), "--snapshot-dir", "")  # fmt: skip
    rows = gpu_node_checks(gpu_facts(), recorded("failing", dmesg="failing"))
    (tmp_path / "preflight.json").write_text(Report(8, "nccl", 10.0, node_checks=rows, node_check_s=0.412).to_json())
    figures = gpu_check.preflight_figures(tmp_path / "preflight.json")
    assert figures[0] == "node checks took 412.0 ms on the slowest node"
    assert figures[1:] == [
        f"{row.check}: {row.status} {row.value}{f' [{row.device}]' if row.device else ''} (threshold: {row.threshold})" for row in rows
    ]
    assert "ecc: fail GPU 3: 2 uncorrected [GPU 3 (00000000:5D:00.0)] (threshold: 0 uncorrected ECC errors since the driver loaded)" in figures
    assert gpu_check.preflight_figures(tmp_path / "none.json")[0].startswith("no report at none.json")
