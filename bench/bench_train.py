"""Trainer figures, each side by side with its competitor in one run (A B A B ..., medians, ratios):

1. the trainer against the seed tutorial's approach on the tutorial's workload (2 gloo ranks, batch
   32 per rank, 2048 samples, SGD lr 1e-3, no momentum): training samples/s, start-up excluded; and,
   to show what binding alone gives, the tutorial bound to CPUs as the trainer binds its ranks;
2. the trainer against a minimal hand-written DDP loop (same model, AdamW, constant LR, batches cut
   from tensors), on the seed workload and on a compute-heavier MLP: the overhead ratio;
3. the per-step floor (one bare all-reduce of the gradient's size + one local step; and the
   gradient exchanged by one all-gather instead, as the trainer syncs small buckets), unbound and
   bound to CPUs as the trainer binds its ranks, the faster taken, next to the trainer's step time;
4. a map-style dataset whose __getitem__ waits ~1 ms: samples/s with 0 and with 2 DataLoader
   workers per rank;
5. the heavy MLP eager against `--compile` (inductor, C++ through g++): the steady step time (the
   progress windows after the first, which holds the compilation) and the whole run's wall time with
   inductor's cache cold (a new node's first job) and warm (a later job on the node).

Every process runs with OMP_NUM_THREADS=1 (2 ranks on this 2-core machine). The trainer runs as
users run it, with progress lines every --log-every=100 steps and no snapshots; its figures come
from rank 0's metrics file, the baselines' from their own JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from train.distributed import free_port  # noqa: E402

RANKS = 2


def run_job(argv: list[str], extra_env: dict[str, str] | None = None) -> str:
    """Start RANKS processes of `argv` as one gloo job; returns rank 0's stdout."""
    port = str(free_port())
    procs = []
    for rank in range(RANKS):
        env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT}:{BENCH}",
            "RANK": str(rank),
            "WORLD_SIZE": str(RANKS),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(RANKS),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1",
            **(extra_env or {}),
        }
        procs.append(subprocess.Popen(argv, env=env, cwd=BENCH, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"bench_train: {' '.join(argv[:4])} failed ({proc.returncode}): {err.strip().splitlines()[-1:]}")
        outputs.append(out)
    return outputs[0]


def trainer_records(*flags: str, env: dict[str, str] | None = None) -> list[dict]:
    """Rank 0's metrics records of one trainer run."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        argv = [sys.executable, "-P", "-m", "train", "--snapshot-dir", "", "--log-every", "100", "--metrics-file", str(metrics), *flags]
        run_job(argv, env)
        return [json.loads(line) for line in metrics.read_text().splitlines()]


def trainer(*flags: str, env: dict[str, str] | None = None) -> dict:
    return [r for r in trainer_records(*flags, env=env) if r["kind"] == "end"][-1]


def steady_and_wall(*flags: str, env: dict[str, str] | None = None) -> dict:
    """Median samples/s of the progress windows after the first, and the run's wall time."""
    started = time.monotonic()
    records = trainer_records(*flags, env=env)
    windows = [r["samples_per_s"] for r in records if r["kind"] == "progress"][1:]
    return {"samples_per_s": statistics.median(windows), "wall_s": time.monotonic() - started}


def baseline(which: str, *flags: str) -> dict:
    out = run_job([sys.executable, str(BENCH / "ddp_baselines.py"), which, *flags])
    return json.loads(out.strip().splitlines()[-1])


def side_by_side(repeats: int, runs: dict[str, Callable[[], dict]], key: str = "samples_per_s") -> dict[str, list[float]]:
    """Each run once per round, rounds interleaved; every round's figure of each."""
    seen: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            seen[name].append(fn()[key])
    return seen


def medians(seen: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in seen.items()}


def trainer_on(task: str, seed: list[str]) -> dict:
    """The trainer on the seed data with `task`'s model, AdamW and a constant LR, as the bare loop and
    the floor train."""
    return trainer(*seed, *(["--task", f"bench_tasks:{task}"] if task == "heavy" else []), "--lr-schedule", "constant")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=40, help="epochs of the 2048-sample workloads")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of each side-by-side comparison")
    parser.add_argument("--only", choices=("tutorial", "bare", "floor", "loader", "compile"), action="append", help="run only these parts")
    opts = parser.parse_args()
    parts = opts.only or ["tutorial", "bare", "floor", "loader", "compile"]
    epochs = str(opts.epochs)
    seed = ["--dataset-size", "2048", "--batch-size", "32", "--epochs", epochs]
    print(f"trainer  {RANKS} gloo ranks on this machine, OMP_NUM_THREADS=1, medians of {opts.repeats} interleaved rounds")

    if "tutorial" in parts:
        seen = side_by_side(
            opts.repeats,
            {
                "tutorial": lambda: baseline("tutorial", "--epochs", epochs, "--lr", "1e-3"),
                "trainer": lambda: trainer(*seed, "--optimizer", "sgd", "--momentum", "0", "--lr", "1e-3", "--lr-schedule", "constant"),
                "tutorial bound": lambda: baseline("tutorial", "--epochs", epochs, "--lr", "1e-3", "--cpu-bind", "auto"),
            },
        )
        got = medians(seen)
        rounds = " ".join(f"{a / b:.2f}" for a, b in zip(seen["trainer"], seen["tutorial"], strict=True))
        print(f"1 tutorial  seed workload, SGD: tutorial {got['tutorial']:9,.0f} samples/s   trainer {got['trainer']:9,.0f} samples/s")
        print(f"1 tutorial  trainer / tutorial = {got['trainer'] / got['tutorial']:.2f}x   (target >= 1.5x; round by round {rounds})")
        print(
            f"1 tutorial  the tutorial bound to CPUs as the trainer binds (--cpu-bind auto): {got['tutorial bound']:9,.0f} samples/s, "
            f"trainer / that = {got['trainer'] / got['tutorial bound']:.2f}x"
        )

    if "bare" in parts:
        for task in ("regression", "heavy"):
            got = medians(
                side_by_side(
                    opts.repeats,
                    {
                        "bare": lambda task=task: baseline("bare", "--epochs", epochs, "--task", task),
                        "trainer": lambda task=task: trainer_on(task, seed),
                    },
                    key="steps_per_s",
                )
            )
            print(
                f"2 bare loop {task:10}  bare {1e3 / got['bare']:6.3f} ms/step   trainer {1e3 / got['trainer']:6.3f} ms/step   "
                f"overhead {got['bare'] / got['trainer']:.3f}x   (target <= 1.05x)"
            )

    if "floor" in parts:
        for task in ("regression", "heavy"):
            # The floor job (unbound, and bound as the trainer binds) and the trainer alternate, 3
            # rounds; medians of each figure; the floor is the faster of the two.
            floors, bound, steps = [], [], []
            for _ in range(3):
                floors.append(baseline("floor", "--task", task))
                bound.append(baseline("floor", "--task", task, "--cpu-bind", "auto"))
                steps.append(1 / trainer_on(task, seed)["steps_per_s"])
            fig = {key: statistics.median(f[key] for f in floors) for key in floors[0]}
            fig_bound = {key: statistics.median(f[key] for f in bound) for key in bound[0]}
            step = statistics.median(steps)
            alone = min(fig["all_reduce_s"], fig["exchange_s"]) + fig["local_step_s"]
            all_reduce_loop = min(fig["loop_blocking_s"], fig["loop_polling_s"], fig_bound["loop_blocking_s"], fig_bound["loop_polling_s"])
            print(
                f"3 floor     {task:10}  alone: all-reduce of {int(fig['grad_elements']):,} floats {fig['all_reduce_s'] * 1e3:.3f} ms "
                f"(exchanged: {fig['exchange_s'] * 1e3:.3f} ms) + local step {fig['local_step_s'] * 1e3:.3f} ms = {alone * 1e3:.3f} ms (medians)"
            )
            print(
                f"3 floor     {task:10}  together, a loop of both: all-reduce blocking {fig['loop_blocking_s'] * 1e3:.3f} ms, polling "
                f"{fig['loop_polling_s'] * 1e3:.3f} ms; exchanged, polling {fig['loop_exchange_s'] * 1e3:.3f} ms per iteration"
            )
            print(
                f"3 floor     {task:10}  the same loops bound to CPUs as the trainer binds: all-reduce blocking {fig_bound['loop_blocking_s'] * 1e3:.3f} ms, "
                f"polling {fig_bound['loop_polling_s'] * 1e3:.3f} ms; exchanged, polling {fig_bound['loop_exchange_s'] * 1e3:.3f} ms per iteration"
            )
            fastest = min(all_reduce_loop, fig["loop_exchange_s"], fig_bound["loop_exchange_s"])
            print(
                f"3 floor     {task:10}  trainer {step * 1e3:.3f} ms/step = {step / all_reduce_loop:.2f}x the faster all-reduce loop (target <= 1.2x), "
                f"{step / fastest:.2f}x the fastest loop, {step / alone:.2f}x the medians alone"
            )

    if "loader" in parts:
        slow = ["--task", "bench_tasks:slow_samples", "--dataset-size", "2048", "--batch-size", "32", "--epochs", "2"]
        got = medians(
            side_by_side(
                opts.repeats,
                {"0 workers": lambda: trainer(*slow, "--num-workers", "0"), "2 workers": lambda: trainer(*slow, "--num-workers", "2")},
            )
        )
        print(
            f"4 loader    1 ms/sample dataset: 0 workers {got['0 workers']:7,.0f} samples/s   2 workers/rank {got['2 workers']:7,.0f} samples/s   "
            f"({got['2 workers'] / got['0 workers']:.1f}x)"
        )

    if "compile" in parts:
        heavy = [*seed, "--task", "bench_tasks:heavy", "--lr-schedule", "constant"]
        with tempfile.TemporaryDirectory() as cache:
            cold = steady_and_wall(*heavy, "--compile", env={"TORCHINDUCTOR_CACHE_DIR": cache})  # once: the cache fills here
            seen = {"eager": [], "compiled": []}
            walls = {"eager": [], "compiled": []}
            for _ in range(opts.repeats):
                for name, extra in (("eager", []), ("compiled", ["--compile"])):
                    got = steady_and_wall(*heavy, *extra, env={"TORCHINDUCTOR_CACHE_DIR": cache})
                    seen[name].append(got["samples_per_s"])
                    walls[name].append(got["wall_s"])
        step = {name: RANKS * 32 / statistics.median(values) * 1e3 for name, values in seen.items()}
        rounds = " ".join(f"{a / b:.2f}" for a, b in zip(seen["compiled"], seen["eager"], strict=True))
        print(
            f"5 compile   heavy MLP: eager {step['eager']:.3f} ms/step   compiled {step['compiled']:.3f} ms/step   "
            f"compiled / eager speed = {step['eager'] / step['compiled']:.2f}x   (round by round {rounds})"
        )
        print(
            f"5 compile   whole run ({epochs} epochs): eager {statistics.median(walls['eager']):.1f} s   compiled, inductor cache warm "
            f"{statistics.median(walls['compiled']):.1f} s, cold {cold['wall_s']:.1f} s"
        )


if __name__ == "__main__":
    main()
