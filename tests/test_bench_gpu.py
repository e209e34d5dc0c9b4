"""`make bench-gpu`'s own code, on the CPU at tiny sizes (`--dry-run-on-cpu`): the bench that measures the trainer
against a bare DDP loop on a GPU must run, and print its comparisons with real ratios and its profiles, wherever no GPU
is lent (the --compile side and the GPU-bound batch are the same code with other flags, left out for time)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

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
