"""Trainer throughput on the seed regression workload: 2 gloo ranks, batch 32 per rank, 2048 samples.

Prints global samples/s and optimizer steps/s as rank 0's metrics file reports them (the figure
excludes process start-up and rendezvous), the median of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def one_run(ranks: int, epochs: int, workdir: Path) -> dict:
    metrics = workdir / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    port = str(free_port())
    procs = []
    for rank in range(ranks):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "RANK": str(rank),
            "WORLD_SIZE": str(ranks),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)),
        }
        args = [
            sys.executable,
            "-m",
            "train",
            "--task",
            "regression",
            "--dataset-size",
            "2048",
            "--batch-size",
            "32",
            "--epochs",
            str(epochs),
            "--snapshot-dir",
            "",
            "--log-every",
            "1000000",
            "--metrics-file",
            str(metrics),
        ]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"bench_train: a rank failed ({proc.returncode}): {err.strip().splitlines()[-1:]}")
    final = [json.loads(line) for line in metrics.read_text().splitlines() if '"final"' in line]
    return final[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [one_run(opts.ranks, opts.epochs, Path(tmp)) for _ in range(opts.repeats)]
    samples = statistics.median(r["samples_per_s"] for r in runs)
    steps = statistics.median(r["steps_per_s"] for r in runs)
    print(f"trainer  regression, {opts.ranks} gloo ranks, batch 32/rank, 2048 samples, {opts.epochs} epochs, median of {opts.repeats}")
    print(f"trainer  samples/s (global)   {samples:12,.0f}")
    print(f"trainer  optimizer steps/s    {steps:12,.1f}")


if __name__ == "__main__":
    main()
