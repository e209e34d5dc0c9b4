"""GPU figures, each side by side with its competitor in one run (A B A B ..., medians, ratios), on one GPU:

1. the preflight's bf16 matmul rate (train/preflight/compute.py: 8192^3, best of its chunks) against a bare
   `torch.matmul` loop into a preallocated output timed with CUDA events, and both against the data sheet's
   dense bf16 peak (train/perf.py): goal, the preflight at 85 % or more of the bare loop;
2. the trainer's step on a GPT of ~92M parameters (GPT-2 small's shape, 8192-token vocabulary, 512 tokens a
   sample) in bf16 (`--amp`) against a bare DDP loop on the same model, data, optimizer (fused AdamW) and
   precision, one rank with NCCL, at batch 16, where the host's launches set the step: goals, the trainer within
   1.03x of the bare loop, and the trainer with `--compile` no slower than the bare eager loop; with the MFU;
3. the same trainer and bare loop at batch 64 (`--gpu-bound-batch`), where the GPU sets the step: the ratio where
   the GPU is busy;
4. with `--profile DIR`: torch.profiler over 100 steady steps of the trainer (in process, as `python -m train` runs
   it) and of the bare loop: wall, GPU kernel and host op time a step, and each side's op table in DIR.

The host's share of the gap is measured without a GPU by bench/bench_host.py (`make bench-host`). Without a GPU
this says so in one line and stops. `--dry-run-on-cpu` runs the same code on the CPU at tiny sizes, to check the
bench itself; its figures mean nothing.
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(BENCH)]

import torch  # noqa: E402

from train.distributed import DistContext  # noqa: E402
from train.perf import table_peak  # noqa: E402
from train.preflight.compute import matmul_gflops, matmul_shape  # noqa: E402

ROUNDS = 5
BATCH = 16  # samples (of 512 tokens) a step: on an H100 or H200 the host's launches set this step's time
GPU_BOUND_BATCH = 64  # four times as much work a step for the GPU, the same launches for the host: the GPU sets the time
PROFILE_STEPS = 100


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


def bare_gpt_loop(steps: int, tiny: bool, batch: int, profile_to: str | None) -> None:
    """One rank of a bare DDP loop (the competitor), run as its own process; prints ms a step after warm-up.
    `profile_to`: instead, profile PROFILE_STEPS steady steps and write the profiler's figures there (JSON)."""
    import torch.distributed as dist
    from bench_tasks import gpt_model, gpt_tokens
    from torch.nn.parallel import DistributedDataParallel

    from testbed.gpt import bare_ddp_step

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(0)
    model = DistributedDataParallel(gpt_model(tiny).to(device), device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device.type == "cuda")
    tokens = gpt_tokens(batch * steps, tiny).tensors
    warmup = max(3, steps // 5)
    window = StepWindow(device, warmup, steps, profile_to)
    for step in range(steps):
        window.at(step)
        bare_ddp_step(model, optimizer, tokens, step, batch, device)
    window.at(steps)
    dist.destroy_process_group()


class StepWindow:
    """The steady steps' wall time (from `warmup` to the end), or their profile (PROFILE_STEPS of them)."""

    def __init__(self, device: torch.device, warmup: int, steps: int, profile_to: str | None) -> None:
        self.device, self.warmup, self.steps, self.profile_to = device, warmup, steps, profile_to
        self.started = 0.0
        self.profiler: Any = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def at(self, step: int) -> None:
        """Called before step `step` (and with `steps` after the last)."""
        if self.profile_to is not None:
            if step == self.warmup:
                self._sync()
                activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.start()
                self.started = time.perf_counter()
            elif step == min(self.steps, self.warmup + PROFILE_STEPS):
                self._sync()
                wall = time.perf_counter() - self.started
                self.profiler.stop()
                write_profile(self.profiler, step - self.warmup, wall, Path(self.profile_to))
            return
        if step == self.warmup:
            self._sync()
            self.started = time.perf_counter()
        elif step == self.steps:
            self._sync()
            print(json.dumps({"step_s": (time.perf_counter() - self.started) / (self.steps - self.warmup)}), flush=True)


def write_profile(profiler: Any, steps: int, wall_s: float, out: Path) -> None:
    """The profile's totals a step (GPU kernel time, the host's own time in ops) and its op table, as JSON."""
    events = profiler.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
    host_us = sum(e.self_cpu_time_total for e in events)
    table = events.table(sort_by="self_cpu_time_total", row_limit=25)
    out.write_text(json.dumps({"steps": steps, "wall_ms": wall_s * 1e3 / steps, "gpu_kernels_ms": device_us / 1e3 / steps,
                               "host_ops_ms": host_us / 1e3 / steps, "table": table}))  # fmt: skip


def trainer_profile(steps: int, tiny: bool, batch: int, profile_to: str) -> None:
    """The trainer in this process, as `python -m train` runs it, with the profiler on over PROFILE_STEPS steady steps."""
    from bench_tasks import gpt

    from train.config import parse_config
    from train.distributed import init_distributed, select_device
    from train.metrics import MetricsFile, RankLog
    from train.signals import PreemptionWatcher
    from train.trainer import Trainer
    from train.watchdog import Progress

    warmup = max(3, steps // 5)

    config = parse_config(trainer_argv(steps, batch, compiled=False, metrics=None))
    backend, device = select_device(None)
    ctx = init_distributed(backend, device, 300)
    window = StepWindow(device, warmup, steps, profile_to)

    class Marked(Progress):
        def step_done(self, step: int) -> None:
            super().step_done(step)
            window.at(step)

    watcher = PreemptionWatcher()
    with open(os.devnull, "w") as quiet:
        Trainer(config, gpt(config), ctx, RankLog(0, 1, quiet), MetricsFile(None), watcher, Marked()).fit()
    watcher.restore()


def trainer_argv(steps: int, batch: int, *, compiled: bool, metrics: Path | None) -> list[str]:
    window = max(5, steps // 5)
    return ["--task", "bench_tasks:gpt", "--amp", "--batch-size", str(batch), "--optimizer", "adamw", "--lr", "3e-4", "--lr-schedule",
            "constant", "--dataset-size", str(batch * steps), "--epochs", "1", "--log-every", str(window), "--snapshot-dir", "",
            "--hang-timeout", "0", *(["--metrics-file", str(metrics)] if metrics else []), *(["--compile"] if compiled else [])]  # fmt: skip


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


def run_side(argv: list[str], tiny: bool) -> str:
    """Run one side in its own process (from bench/, where the task module is); its stdout, or one line and its
    error's tail when it fails."""
    done = subprocess.run(argv, env=one_rank_env(**tiny_env(tiny)), cwd=BENCH, capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench_gpu: {' '.join(argv[1:4])} ... failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def tiny_env(tiny: bool) -> dict[str, str]:
    return {"BENCH_GPT_TINY": "1", "CUDA_VISIBLE_DEVICES": ""} if tiny else {}


def bare_step_s(steps: int, tiny: bool, batch: int) -> float:
    argv = [sys.executable, str(Path(__file__).resolve()), "--bare-loop", str(steps), "--batch", str(batch), *(["--dry-run-on-cpu"] if tiny else [])]
    return json.loads(run_side(argv, tiny).strip().splitlines()[-1])["step_s"]


def trainer_step_s(steps: int, tiny: bool, batch: int, compiled: bool = False) -> tuple[float, float | None]:
    """The trainer's mean step seconds over its progress windows after the first (which holds the warm-up and, with
    --compile, the compilation), and its MFU."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        argv = [sys.executable, "-m", "train", *trainer_argv(steps, batch, compiled=compiled, metrics=metrics)]
        run_side(argv, tiny)
        progress = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "progress"][1:]
    if not progress:
        raise SystemExit("bench_gpu: the trainer ran too few steps for a window after the first; raise --steps")
    return statistics.mean(r["rank_step_s"][0] for r in progress), statistics.median(r["mfu"] for r in progress) if "mfu" in progress[0] else None


def gpt_rounds(steps: int, tiny: bool, rounds: int = ROUNDS, batch: int = BATCH, compiled: bool = True) -> dict[str, float]:
    """The trainer eager, the trainer --compile and the bare eager loop, A B C A B C ...; prints and returns the medians."""
    sides: dict[str, list[float]] = {"trainer": [], "bare": [], **({"compiled": []} if compiled else {})}
    mfus = []
    for _ in range(rounds):
        step_s, used = trainer_step_s(steps, tiny, batch)
        sides["trainer"].append(step_s)
        if used is not None:
            mfus.append(used)
        sides["bare"].append(bare_step_s(steps, tiny, batch))
        if compiled:
            sides["compiled"].append(trainer_step_s(steps, tiny, batch, compiled=True)[0])
    m = {side: statistics.median(seen) for side, seen in sides.items()}
    mfu = f", trainer MFU {statistics.median(mfus):.1%}" if mfus else ""
    print(f"GPT ~92M bf16, batch {batch} x 512 tokens, one GPU ({rounds} rounds, medians): trainer {m['trainer'] * 1e3:.2f} ms/step, "
          f"bare DDP loop {m['bare'] * 1e3:.2f} ms/step, trainer/bare {m['trainer'] / m['bare']:.3f} (goal <= 1.03){mfu}")
    if compiled:
        print(f"  trainer --compile {m['compiled'] * 1e3:.2f} ms/step, compiled/bare eager {m['compiled'] / m['bare']:.3f} (goal <= 1.00)")
    return m


def profiles(steps: int, tiny: bool, batch: int, out: Path) -> None:
    """torch.profiler over PROFILE_STEPS steady steps of the trainer and of the bare loop: where the step goes."""
    out = out.resolve()  # the sides run from bench/
    out.mkdir(parents=True, exist_ok=True)
    me = str(Path(__file__).resolve())
    flags = ["--batch", str(batch), *(["--dry-run-on-cpu"] if tiny else [])]
    for side, argv in (("trainer", [sys.executable, me, "--trainer-profile", str(steps), *flags]),
                       ("bare", [sys.executable, me, "--bare-loop", str(steps), *flags])):  # fmt: skip
        to = out / f"profile-{side}.json"
        run_side([*argv, "--profile-to", str(to)], tiny)
        figures = json.loads(to.read_text())
        (out / f"profile-{side}.txt").write_text(figures.pop("table"))
        print(f"profile, {side}, {figures['steps']} steady steps: {figures['wall_ms']:.2f} ms/step wall, GPU kernels {figures['gpu_kernels_ms']:.2f} "
              f"ms/step, host in ops {figures['host_ops_ms']:.2f} ms/step (tables: {out}/profile-{side}.txt)")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="steps a GPT run (a fifth of them warm-up)")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds a matmul measurement")
    parser.add_argument("--dry-run-on-cpu", action="store_true", help="tiny sizes on the CPU: checks the bench, figures mean nothing")
    parser.add_argument("--rounds", type=int, default=ROUNDS, choices=range(1, 101), metavar="N", help="A B rounds of each comparison (medians)")
    parser.add_argument("--no-compile", dest="compiled", action="store_false", help="leave out the trainer --compile side")
    parser.add_argument("--gpu-bound-batch", type=int, default=GPU_BOUND_BATCH, metavar="N",
                        help=f"also compare trainer and bare loop at this batch, where the GPU sets the step (0: not; default {GPU_BOUND_BATCH})")
    parser.add_argument("--profile", type=Path, metavar="DIR", help=f"also profile {PROFILE_STEPS} steady steps of trainer and bare loop into DIR")
    parser.add_argument("--only", choices=("matmul", "gpt", "gpu-bound", "profile"), help="run one part alone")
    parser.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)  # the competitor's or the profile's own process
    parser.add_argument("--bare-loop", type=int, metavar="STEPS", help=argparse.SUPPRESS)
    parser.add_argument("--trainer-profile", type=int, metavar="STEPS", help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare_loop:
        bare_gpt_loop(args.bare_loop, args.dry_run_on_cpu, args.batch, args.profile_to)
        return 0
    if args.trainer_profile:
        trainer_profile(args.trainer_profile, args.dry_run_on_cpu, args.batch, args.profile_to)
        return 0
    if not torch.cuda.is_available() and not args.dry_run_on_cpu:
        print("bench_gpu: no CUDA GPU here (torch sees none); run it on a GPU node: make bench-gpu")
        return 0
    device = torch.device("cpu") if args.dry_run_on_cpu else torch.device("cuda", 0)
    steps = min(args.steps, 30) if args.dry_run_on_cpu else args.steps
    print(f"bench_gpu: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU dry run'}, torch {torch.__version__}")
    if args.only in (None, "matmul"):
        matmul_rounds(device, 0.05 if args.dry_run_on_cpu else args.seconds, args.rounds)
    if args.only in (None, "gpt"):
        gpt_rounds(steps, args.dry_run_on_cpu, args.rounds, compiled=args.compiled)
    if args.gpu_bound_batch and args.only in (None, "gpu-bound"):
        gpt_rounds(max(PROFILE_STEPS // 2, steps // 2) if not args.dry_run_on_cpu else steps, args.dry_run_on_cpu, max(1, min(args.rounds, 3)),
                   batch=args.gpu_bound_batch, compiled=False)  # fmt: skip
    if args.profile is not None and args.only in (None, "profile"):
        profiles(PROFILE_STEPS + max(3, PROFILE_STEPS // 4) if not args.dry_run_on_cpu else steps, args.dry_run_on_cpu, BATCH, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
