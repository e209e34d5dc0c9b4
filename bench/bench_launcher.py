"""The launcher's added start-up time: `entrypoint python -c pass` against `python -c pass`.

Both are timed end to end (fork, exec, interpreter start-up); the difference is what the entrypoint
costs before the training command starts. Medians of --repeats runs, in milliseconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_TASKS": "16",
    "SLURM_PROCID": "9",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
    "SLURM_STEP_NODELIST": "ip-10-4-[33-34]",
}


def median_ms(argv: list[str], env: dict[str, str], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, env=env, check=True)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    opts = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), **SLURM}
    bare = median_ms([sys.executable, "-c", "pass"], env, opts.repeats)
    launched = median_ms([sys.executable, "-m", "entrypoint", sys.executable, "-c", "pass"], env, opts.repeats)
    print(f"launcher python -c pass                 {bare:8.1f} ms")
    print(f"launcher entrypoint python -c pass      {launched:8.1f} ms  (Slurm step, 16 tasks, median of {opts.repeats})")
    print(f"launcher added start-up time            {launched - bare:8.1f} ms")


if __name__ == "__main__":
    main()
