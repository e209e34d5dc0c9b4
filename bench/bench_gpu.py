"""GPU figures, each side by side with its competitor in one run (A B A B ..., medians, ratios), on one GPU:

1. the preflight's bf16 matmul rate (train/preflight/compute.py: 8192^3, best of its chunks) against a bare
   `torch.matmul` loop into a preallocated output timed with CUDA events, and both against the data sheet's
   dense bf16 peak (train/perf.py): goal, the preflight at 85 % or more of the bare loop;
2. the trainer's step on a GPT of ~92M parameters (GPT-2 small's shape, 8192-token vocabulary, 512 tokens a
   sample) in bf16 (`--amp`) against a bare DDP loop on the same model, data, optimizer (fused AdamW) and
   precision, one rank with NCCL: goal, the trainer within 1.03x of the bare loop; with the trainer's MFU.

Without a GPU it says so in one line and stops. `--dry-run-on-cpu` runs the same code on the CPU at tiny
sizes, to check the bench itself; its figures mean nothing.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(BENCH)]

import torch  # noqa: E402

from train.distributed import DistContext  # noqa: E402
from train.perf import table_peak  # noqa: E402
from train.preflight.compute import matmul_gflops, matmul_shape  # noqa: E402

ROUNDS = 5
BATCH = 16  # samples (of 512 tokens) a step


def bare_matmul_gflops(device: torch.device, seconds: float) -> float:
    """The floor's competitor: the preflight's shapes, a preallocated output, CUDA events."""
    n, dtype = matmul_shape(device)
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    out = torch.empty(n, n, dtype=dtype, device=device)
    torch.matmul(a, b, out=out)
    times = 0
    started = time.perf_counter()
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        begin.record()
    while time.perf_counter() - started < seconds:
        for _ in range(10):
            torch.matmul(a, b, out=out)
        times += 10
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # keep the host's clock honest about the queue
    if device.type == "cuda":
        end.record()
        end.synchronize()
        elapsed = begin.elapsed_time(end) / 1e3
    else:
        elapsed = time.perf_counter() - started
    return 2 * n**3 * times / elapsed / 1e9


def matmul_rounds(device: torch.device, seconds: float, rounds: int = ROUNDS) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    ctx = DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, backend=backend, device=device, host="bench")
    pre, bare = [], []
    for _ in range(rounds):
        pre.append(matmul_gflops(ctx, seconds))
        bare.append(bare_matmul_gflops(device, seconds))
    peak = table_peak(torch.cuda.get_device_name(device), "bf16") if device.type == "cuda" else None
    p, b = statistics.median(pre), statistics.median(bare)
    print(f"matmul bf16 8192^3 ({rounds} rounds, medians): preflight {p / 1e3:,.1f} TFLOP/s, bare torch.matmul {b / 1e3:,.1f} TFLOP/s, "
          f"preflight/bare {p / b:.3f} (goal >= 0.85)")
    if peak:
        print(f"  against the data sheet ({peak.source}, {peak.flops_per_s / 1e12:,.0f} TFLOP/s): bare {b * 1e9 / peak.flops_per_s:.1%}, "
              f"preflight {p * 1e9 / peak.flops_per_s:.1%}")


# ---------------------------------------------------------------- the GPT step: trainer against a bare DDP loop


def bare_gpt_loop(steps: int, tiny: bool) -> None:
    """One rank of a bare DDP loop (the competitor), run as its own process; prints ms a step after warm-up."""
    import torch.distributed as dist
    from bench_tasks import gpt_model, gpt_tokens
    from torch.nn.parallel import DistributedDataParallel

    from testbed.gpt import next_token_loss

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    model = DistributedDataParallel(gpt_model(tiny).to(device), device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    inputs, targets = gpt_tokens(BATCH * steps, tiny).tensors
    warmup, times = max(3, steps // 5), []
    for step in range(steps):
        x = inputs[step * BATCH : (step + 1) * BATCH].to(device, non_blocking=True)
        y = targets[step * BATCH : (step + 1) * BATCH].to(device, non_blocking=True)
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = next_token_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    times.append((time.perf_counter() - started) / (steps - warmup))
    print(json.dumps({"step_s": times[0]}), flush=True)
    dist.destroy_process_group()


def one_rank_env(**extra: str) -> dict[str, str]:
    from train.distributed import free_port

    return {
        **os.environ,
        "PYTHONPATH": f"{ROOT}:{BENCH}",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        **extra,
    }


def bare_step_s(steps: int, tiny: bool) -> float:
    argv = [sys.executable, str(Path(__file__).resolve()), "--bare-loop", str(steps), *(["--dry-run-on-cpu"] if tiny else [])]
    env = one_rank_env(**({"CUDA_VISIBLE_DEVICES": ""} if tiny else {}))
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["step_s"]


def trainer_step_s(steps: int, tiny: bool) -> tuple[float, float | None]:
    """The trainer's mean step seconds over its progress windows after the first (which holds the warm-up), and its MFU."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        window = max(5, steps // 5)
        argv = [sys.executable, "-m", "train", "--task", "bench_tasks:gpt", "--amp", "--batch-size", str(BATCH), "--optimizer", "adamw",
                "--lr", "3e-4", "--lr-schedule", "constant", "--dataset-size", str(BATCH * steps), "--epochs", "1", "--log-every", str(window),
                "--snapshot-dir", "", "--metrics-file", str(metrics), "--hang-timeout", "0"]
        env = one_rank_env(**({"BENCH_GPT_TINY": "1", "CUDA_VISIBLE_DEVICES": ""} if tiny else {}))
        subprocess.run(argv, env=env, cwd=BENCH, capture_output=True, text=True, timeout=900, check=True)
        progress = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "progress"][1:]
    if not progress:
        raise SystemExit("bench_gpu: the trainer ran too few steps for a window after the first; raise --steps")
    return statistics.mean(r["rank_step_s"][0] for r in progress), statistics.median(r["mfu"] for r in progress) if "mfu" in progress[0] else None


def gpt_rounds(steps: int, tiny: bool, rounds: int = ROUNDS) -> None:
    trainer, bare, mfus = [], [], []
    for _ in range(rounds):
        step_s, used = trainer_step_s(steps, tiny)
        trainer.append(step_s)
        if used is not None:
            mfus.append(used)
        bare.append(bare_step_s(steps, tiny))
    t, b = statistics.median(trainer), statistics.median(bare)
    mfu = f", trainer MFU {statistics.median(mfus):.1%}" if mfus else ""
    print(f"GPT ~92M bf16, batch {BATCH} x 512 tokens, one GPU ({rounds} rounds, medians): trainer {t * 1e3:.2f} ms/step, "
          f"bare DDP loop {b * 1e3:.2f} ms/step, trainer/bare {t / b:.3f} (goal <= 1.03){mfu}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps a GPT run (a fifth of them warm-up)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds a matmul measurement")
    parser.add_argument("--dry-run-on-cpu", action="store_true", help="tiny sizes on the CPU: checks the bench, figures mean nothing")
    parser.add_argument("--rounds", type=int, default=ROUNDS, choices=range(1, 101), metavar="N", help="A B rounds of each comparison (medians)")
    parser.add_argument("--bare-loop", type=int, metavar="STEPS", help=argparse.SUPPRESS)  # the competitor's own process
    args = parser.parse_args()
    if args.bare_loop:
        bare_gpt_loop(args.bare_loop, args.dry_run_on_cpu)
        return 0
    if not torch.cuda.is_available() and not args.dry_run_on_cpu:
        print("bench_gpu: no CUDA GPU here (torch sees none); run it on a GPU node: make bench-gpu")
        return 0
    device = torch.device("cpu") if args.dry_run_on_cpu else torch.device("cuda", 0)
    print(f"bench_gpu: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU dry run'}, torch {torch.__version__}")
    matmul_rounds(device, 0.05 if args.dry_run_on_cpu else args.seconds, args.rounds)
    gpt_rounds(min(args.steps, 30) if args.dry_run_on_cpu else args.steps, args.dry_run_on_cpu, args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
