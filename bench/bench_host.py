"""The GPU step's host work, measured on a CPU: the trainer's CUDA path against a bare DDP loop (`make bench-host`).

On an eager GPT on a GPU the host launches the step's kernels, and at bench_gpu's size the host's time shows almost
one for one in the step time: whatever the trainer adds to a bare DDP loop on the host is the gap bench_gpu sees. That
host work does not need a GPU to be seen. Both sides here run, on one core, the GPU bench's op graph (bench_tasks'
GPT: 12 layers, the same 148 parameter tensors, bf16 autocast, fused AdamW) at a size with almost no compute, in
one-rank gloo groups:
- the trainer (train.Trainer, in process) on its CUDA path's branches (train/step_path.py's `cuda_shaped`): DDP's
  C++ all-reduce hook, the stop flags read a step late, batches cut from gathered chunks. What cannot exist without
  CUDA has a stand-in, named in the output;
- the bare loop: bench_gpu's competitor, line for line (DDP's defaults, zero_grad(set_to_none=True), slices of the
  token tensors).
DDP's bucket caps are scaled down in both processes so the tiny model gets as many buckets as the 92M one gets on a
GPU (named in the output: a stand-in too).

Each round is a fresh process that runs both, a step of each in turn (A B A B at the finest grain: one core, one
allocator, the same caches); a side's figure is the median of the rounds' median steady step, in the process's CPU
time (every thread's), which a busy shared machine inflates less than wall time.
`--confirmed`: the trainer's step as --recovery runs it (train/step_path.py's `confirmed`: DDP's C++ hook still syncs,
and the host waits for the step's end and asks the backend's error state before the optimizer), to measure what a
confirmed step costs against the same bare loop; its stand-ins are named as the others are.
The last line: `bench-host: trainer T µs/step, bare B µs/step, overhead D µs/step (goal <= 150)`, then the trainer's
time less the bare loop's by phase (data, zero_grad, forward, backward, hook, sync, optimizer, poll, the rest; a
phase's own line above gives each side's).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(BENCH)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

ROUNDS = 5
STEPS = 300
WARMUP = 50  # DDP rebuilds its buckets at step 2; the allocator and the caches settle well before this
BATCH = 2
# The GPU bench's GPT at almost no compute: the same layers and parameter tensors, tiny widths.
HOST_SHAPE = {"vocab": 256, "block_size": 8, "dim": 24, "heads": 12, "layers": 12, "dropout": 0.0}
GOAL_US = 150
PHASES = ("data", "zero_grad", "forward", "backward", "hook", "sync", "optimizer", "poll", "rest")


# ---------------------------------------------------------------- the same buckets as on the GPU


def bucket_count(model: torch.nn.Module, first: int, cap: int) -> int:
    """How many buckets DDP makes of `model`'s gradients at these byte caps (its parameters in reverse, as DDP
    takes them)."""
    params = [p for p in model.parameters() if p.requires_grad][::-1]
    return len(dist._compute_bucket_assignment_by_size(params, [first, cap])[0])


def scale_buckets() -> tuple[int, float]:
    """Scale DDP's default caps (first bucket 1 MiB, then 25 MiB) in this process until the host-bound GPT makes as
    many buckets as the GPU bench's GPT makes at the real ones; returns that count and the scale."""
    from bench_tasks import GPT_SHAPE
    from torch.nn.parallel import distributed as ddp_module

    from testbed.gpt import TinyGPT

    first, cap = dist._DEFAULT_FIRST_BUCKET_BYTES, int(ddp_module._DEFAULT_BUCKET_CAP_MB * 2**20)
    with torch.device("meta"):
        want = bucket_count(TinyGPT(**GPT_SHAPE), first, cap)
    small = TinyGPT(**HOST_SHAPE)
    low, high = 1e-6, 1.0
    for _ in range(60):  # bisect on the scale: fewer buckets as it grows
        mid = (low * high) ** 0.5
        if bucket_count(small, max(1, int(first * mid)), max(1, int(cap * mid))) > want:
            low = mid
        else:
            high = mid
    dist._DEFAULT_FIRST_BUCKET_BYTES = max(1, int(first * high))
    ddp_module._DEFAULT_BUCKET_CAP_MB = cap * high / 2**20
    return want, high


# ---------------------------------------------------------------- one side, in its own process


def one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    torch.set_num_threads(1)


def host_model() -> torch.nn.Module:
    from testbed.gpt import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(**HOST_SHAPE)


def host_tokens(size: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, HOST_SHAPE["vocab"], (size, HOST_SHAPE["block_size"] + 1), generator=gen)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def cpu_now() -> float:
    """This process's CPU seconds, every thread's (gloo's included): the host work itself. On a shared machine
    wall time also counts the time other processes had the core; CPU time does not."""
    return time.process_time()


class Clock:
    """CPU seconds per phase, over the steady steps only."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(PHASES, 0.0)
        self.steps: list[float] = []
        self.counting = False

    def add(self, phase: str, seconds: float) -> None:
        if self.counting:
            self.spent[phase] += seconds

    def timed(self, phase: str, call: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(call)  # DDP reads a comm hook's signature
        def run(*args: Any, **kwargs: Any) -> Any:
            began = cpu_now()
            try:
                return call(*args, **kwargs)
            finally:
                self.add(phase, cpu_now() - began)

        return run

    def result(self, buckets: int, stand_ins: list[str]) -> dict[str, Any]:
        steady = self.steps[WARMUP:]
        return {
            "step_us": statistics.median(steady) * 1e6,
            "phases_us": {k: v / len(steady) * 1e6 for k, v in self.spent.items()},
            "buckets": buckets,
            "stand_ins": stand_ins,
        }


def bucket_sizes(model: torch.nn.Module) -> int:
    """How many buckets DDP synced in the steady state (after its rebuild at the second step)."""
    logged = model._get_ddp_logging_data()
    return len(str(logged.get("rebuilt_bucket_sizes") or logged["bucket_sizes"]).split(","))


class BareLoop:
    """bench_gpu's bare DDP loop (testbed.gpt.bare_ddp_step), one step a call, each phase timed."""

    def __init__(self, steps: int) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from testbed.gpt import bare_ddp_step

        self.bare_ddp_step = bare_ddp_step  # imported once, not in each timed step
        self.clock = Clock()
        self.model = DistributedDataParallel(host_model())
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=True)
        self.tokens = host_tokens(BATCH * steps).tensors
        self.step = 0

    def __call__(self) -> None:
        clock = self.clock
        clock.counting = self.step >= WARMUP
        began = mark = cpu_now()

        def ended(phase: str) -> None:
            nonlocal mark
            now = cpu_now()
            clock.add(phase, now - mark)
            mark = now

        self.bare_ddp_step(self.model, self.optimizer, self.tokens, self.step, BATCH, torch.device("cpu"), ended)
        clock.steps.append(mark - began)
        self.step += 1


def interleaved(steps: int, cuda_path: bool = True, confirmed: bool = False) -> dict[str, Any]:
    """train.Trainer on its CUDA path's branches, in this process, and after each of its steps one step of the bare
    loop (its time left out of the trainer's): A B A B at the finest grain, the same core, caches and allocator."""
    from testbed.gpt import next_token_loss
    from train.config import parse_config
    from train.distributed import init_distributed
    from train.grad_sync import GradientSync
    from train.metrics import MetricsFile, RankLog
    from train.signals import PreemptionWatcher
    from train.step_path import StepPath
    from train.tasks import Task
    from train.trainer import Trainer
    from train.watchdog import Phase, Progress

    clock = Clock()
    names = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward", Phase.SYNC: "sync", Phase.OPTIMIZER: "optimizer"}

    class TimedProgress(Progress):
        """The trainer's own phase marks, timed: data, forward, backward, sync, optimizer, and from a step's end to
        the next step's data (its bookkeeping, the stop flags' poll); a bare step runs at each step's end."""

        __slots__ = ("bare", "began", "current", "mark")

        def __init__(self, bare: BareLoop) -> None:
            super().__init__()
            self.bare, self.current = bare, "rest"
            self.began = self.mark = cpu_now()

        def _to(self, phase: str) -> None:
            now = cpu_now()
            clock.add(self.current, now - self.mark)
            self.current, self.mark = phase, now

        def enter(self, phase: str) -> None:
            super().enter(phase)
            self._to("data" if phase == Phase.DATA else names.get(phase, "rest"))

        def step_done(self, step: int) -> None:
            super().step_done(step)
            self._to("rest")

        def next_step(self) -> None:
            """At the stop-flag poll, the last thing of a step: close the trainer's step, run a bare one."""
            now = cpu_now()
            clock.add(self.current, now - self.mark)
            clock.steps.append(now - self.began)
            clock.counting = len(clock.steps) >= WARMUP
            self.bare()
            self.began = self.mark = cpu_now()
            self.current = "rest"

    # The Python hook, where the path still has one (--bf16-grads, the CPU path): its time is inside backward.
    GradientSync.hook = clock.timed("hook", GradientSync.hook)  # type: ignore[method-assign]
    GradientSync.alone = clock.timed("hook", GradientSync.alone)  # type: ignore[method-assign]
    config = parse_config(["--amp", "--batch-size", str(BATCH), "--optimizer", "adamw", "--lr", "3e-4", "--lr-schedule", "constant",
                           "--dataset-size", str(BATCH * steps), "--epochs", "1", "--log-every", str(10 * steps), "--snapshot-dir", "",
                           "--hang-timeout", "0", "--cpu-bind", "none"])  # fmt: skip
    device = torch.device("cpu")
    ctx = init_distributed("gloo", device, 300)
    bare = BareLoop(steps)
    task = Task("bench-host", host_model(), host_tokens(BATCH * steps), next_token_loss, tokens_per_sample=HOST_SHAPE["block_size"])
    watcher = PreemptionWatcher()
    path = StepPath.cuda_shaped(device) if cuda_path else StepPath.for_device(device)
    if confirmed:
        path = dataclasses.replace(path, confirmed=True)
    progress = TimedProgress(bare)
    with open(os.devnull, "w") as quiet:
        trainer = Trainer(config, task, ctx, RankLog(0, 1, quiet), MetricsFile(None), watcher, progress, path=path)
        model = trainer.model
        model.zero_grads = clock.timed("zero_grad", model.zero_grads)  # type: ignore[method-assign]
        poll = clock.timed("poll", model.agreed_stop)

        def agreed_stop() -> Any:
            agreed = poll()
            progress.next_step()
            return agreed

        model.agreed_stop = agreed_stop  # type: ignore[method-assign]
        trainer.fit()
    watcher.restore()
    # zero_grad is timed inside the data phase, poll inside the rest, the Python hook inside backward: each counted once.
    clock.spent["data"] -= clock.spent["zero_grad"]
    clock.spent["rest"] -= clock.spent["poll"]
    clock.spent["backward"] -= clock.spent["hook"]
    result = {"trainer": clock.result(bucket_sizes(model.ddp), path.stand_ins), "bare": bare.clock.result(bucket_sizes(bare.model), [])}
    paired = [t - b for t, b in zip(clock.steps[WARMUP:], bare.clock.steps[WARMUP:], strict=False)]
    result["paired_us"] = statistics.median(paired) * 1e6
    dist.destroy_process_group()
    return result


def side_main(steps: int, cuda_path: bool, confirmed: bool) -> None:
    one_core()
    buckets, scale = scale_buckets()
    result = interleaved(steps, cuda_path, confirmed)
    result.update(gpu_buckets=buckets, bucket_scale=scale)
    print(json.dumps(result), flush=True)


# ---------------------------------------------------------------- A B A B


def run_round(steps: int, path: str, confirmed: bool) -> dict[str, Any]:
    from train.distributed import free_port

    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{BENCH}", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}  # fmt: skip
    argv = [sys.executable, str(Path(__file__).resolve()), "--round", "--steps", str(steps), "--path", path]
    argv += ["--confirmed"] if confirmed else []
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"bench_host: a round failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, choices=range(1, 101), metavar="N", help="A B rounds (medians)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"steps a side runs (the first {WARMUP} are warm-up)")
    parser.add_argument("--path", choices=("cuda", "cpu"), default="cuda",
                        help="the trainer's branches: the CUDA path's (default; what a GPU runs) or the CPU path's (what a CPU node runs)")
    parser.add_argument("--confirmed", action="store_true", help="the trainer's step as --recovery runs it: confirmed before the optimizer")
    parser.add_argument("--round", action="store_true", help=argparse.SUPPRESS)  # one round's own process
    args = parser.parse_args()
    if args.steps <= WARMUP + 10:
        parser.error(f"--steps must be above {WARMUP + 10}: the first {WARMUP} are warm-up")
    if args.round:
        side_main(args.steps, args.path == "cuda", args.confirmed)
        return 0
    rounds = [run_round(args.steps, args.path, args.confirmed) for _ in range(args.rounds)]
    seen = {side: [r[side] for r in rounds] for side in ("trainer", "bare")}
    first = rounds[0]
    confirmed = ", confirmed (--recovery)" if args.confirmed else ""
    print(f"bench-host: the trainer's {args.path.upper()} path{confirmed}, torch {torch.__version__}, one core, one-rank gloo, "
          f"GPT {HOST_SHAPE['layers']} layers (bench_gpu's op graph, widths {HOST_SHAPE['dim']}), batch {BATCH} x {HOST_SHAPE['block_size']} "
          f"tokens, bf16 autocast, {args.steps} steps ({WARMUP} warm-up), {args.rounds} rounds A B A B")  # fmt: skip
    print(f"  buckets: trainer {first['trainer']['buckets']}, bare {first['bare']['buckets']}, the 92M GPT on a GPU {first['gpu_buckets']} "
          f"(stand-in: DDP's caps scaled by {first['bucket_scale']:.2e} in both processes)")  # fmt: skip
    for stand_in in first["trainer"]["stand_ins"]:
        print(f"  stand-in: {stand_in}")
    medians = {side: {phase: statistics.median(r["phases_us"][phase] for r in runs) for phase in PHASES} for side, runs in seen.items()}
    print("  µs a step  " + " ".join(f"{phase:>9}" for phase in PHASES))
    for side in seen:
        print(f"  {side:<9}  " + " ".join(f"{medians[side][phase]:9.1f}" for phase in PHASES))
    t = statistics.median(r["step_us"] for r in seen["trainer"])
    b = statistics.median(r["step_us"] for r in seen["bare"])
    rounds_text = ", ".join(f"{tr['step_us']:.0f}/{ba['step_us']:.0f}" for tr, ba in zip(seen["trainer"], seen["bare"], strict=True))
    paired = statistics.median(r["paired_us"] for r in rounds)
    print(f"  each round (trainer/bare µs): {rounds_text}; the median of each step's difference, median over rounds: {paired:.0f} µs")
    split = ", ".join(f"{phase} {medians['trainer'][phase] - medians['bare'][phase]:+.0f}" for phase in PHASES)
    print(f"bench-host: trainer {t:.0f} µs/step, bare {b:.0f} µs/step, overhead {t - b:.0f} µs/step (goal <= {GOAL_US}); "
          f"trainer - bare by phase, µs: {split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
