"""What ddpack_run's Lightning callback costs a training step: the same two-rank gloo Lightning job (launched as
srun launches a step's tasks, through `entrypoint`) with and without `DdpackCallback`, interleaved rounds
(A B A B ...), medians and their ratio.

The callback adds, per step, a few clock reads and attribute stores (the watchdog's phases) and, about once a
second of training, one all-reduce of a few floats (the stop flag and every rank's times) — ~1 ms between two
local gloo processes, so the floor of its cost is about 0.1% of a step's time, plus the hooks' Python calls.

    .venv/bin/python bench/bench_frameworks.py [--rounds 5] [--steps 400]
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

# Rank 0 prints the mean ms per step over all steps after the first WARMUP (imports, DDP set-up, first step).
PROGRAM = r"""
import json, os, time
import lightning as L
import torch
from torch import nn

WARMUP = 20
stamps = []


class Clock(L.Callback):
    def on_train_batch_end(self, trainer, *args):
        stamps.append(time.perf_counter())


class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


torch.manual_seed(0)
steps = int(os.environ["BENCH_STEPS"])
x = torch.randn(steps * 64, 32)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)
callbacks = [Clock()]
if os.environ["BENCH_ADAPTER"] == "1":
    from ddpack_run.lightning import DdpackCallback

    callbacks.append(DdpackCallback())
trainer = L.Trainer(
    accelerator="cpu", devices=2, num_nodes=1, strategy="ddp", max_steps=steps, logger=False, enable_checkpointing=False,
    enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
)
trainer.fit(Regression(), loader)
if trainer.global_rank == 0:
    timed = stamps[WARMUP:]
    print("bench " + json.dumps({"ms_per_step": (timed[-1] - timed[0]) / (len(timed) - 1) * 1e3}), flush=True)
torch.distributed.destroy_process_group()
"""


def one_run(program: Path, adapter: bool, steps: int, folder: Path) -> float:
    """Two ranks of `program` with the variables srun gives a step's tasks; rank 0's ms per step."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        job = str(sock.getsockname()[1])  # a job id no other run uses, from which the launcher derives its port
    procs = []
    for rank in range(2):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")
        }
        env |= {
            "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "BENCH_STEPS": str(steps),
            "BENCH_ADAPTER": "1" if adapter else "0", "DDPACK_METRICS_FILE": str(folder / "metrics.jsonl"),
            "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank), "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NUM_NODES": "1",
            "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODELIST": "127.0.0.1",
            "SLURM_JOB_NAME": "bench",
        }  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-m", "entrypoint", "--", sys.executable, str(program)], env=env, cwd=folder,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))  # fmt: skip
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        sys.exit(f"bench_frameworks: a run failed (exit codes {[p.returncode for p in procs]}); run it by hand to see why")
    line = next(line for line in outputs[0].splitlines() if line.startswith("bench "))
    return float(json.loads(line[len("bench ") :])["ms_per_step"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    try:
        import lightning  # noqa: F401
    except ImportError:
        print("bench_frameworks: needs lightning in this venv (make venv installs it)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        program = Path(tmp) / "lightning_bench.py"
        program.write_text(PROGRAM)
        times: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for adapter in (False, True):
                run = Path(tmp) / f"run-{round_}-{int(adapter)}"
                run.mkdir()
                times[adapter].append(one_run(program, adapter, args.steps, run))
    bare, adapted = statistics.median(times[False]), statistics.median(times[True])
    ratios = sorted(a / b for a, b in zip(times[True], times[False], strict=True))
    print(f"frameworks  Lightning, 2 gloo ranks, {args.steps} steps, {args.rounds} interleaved rounds (median ms/step)")
    print(f"frameworks  without DdpackCallback   {bare:8.3f} ms/step   rounds {', '.join(f'{t:.3f}' for t in times[False])}")
    print(f"frameworks  with DdpackCallback      {adapted:8.3f} ms/step   rounds {', '.join(f'{t:.3f}' for t in times[True])}")
    print(f"frameworks  with/without             {adapted / bare:8.3f}x        per-round ratios {ratios[0]:.3f} .. {ratios[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
