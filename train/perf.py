"""Utilisation: the model's FLOPs per sample, a device's peak rate, and MFU.

MFU (model FLOPs utilisation, as PaLM defines it) is the FLOPs the model needs per second at the measured
throughput, over what the devices could do at peak. The FLOPs are counted once, at rank 0's first step, by
torch's FLOP counter over one forward and backward of its first micro-batch (matrix multiplies, convolutions and attention: the
work a peak rate is quoted for), so the figure needs no per-step work at all.

The peak per device comes from, in this order: the preflight's measured matmul rate when the job ran a
preflight (its `preflight.json` beside the metrics file) in the precision the run trains in; the table
below for common GPUs (dense rates from the vendors' data sheets); else, on a CPU, a matmul rate measured
here for a quarter of a second.
"""

from __future__ import annotations

import json
import random
import re
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from train.distributed import first_line

# Dense peak TFLOP/s per GPU: (name tokens that must all appear, bf16, tf32, fp32). None: no such unit.
# Matched in order, so a more specific name (H100 PCIe, L40S) comes before a shorter one (H100, L4).
GPU_PEAK_TFLOPS: tuple[tuple[tuple[str, ...], float | None, float | None, float], ...] = (
    (("H200",), 989.4, 494.7, 66.9),
    (("H100", "PCIe"), 756.0, 378.0, 51.2),
    (("H100",), 989.4, 494.7, 66.9),
    (("A100",), 312.0, 156.0, 19.5),
    (("L40S",), 362.05, 183.0, 91.6),
    (("L40",), 181.05, 90.5, 90.5),
    (("L4",), 121.0, 60.0, 30.3),
    (("A10",), 125.0, 62.5, 31.2),
    (("V100",), None, None, 15.7),
)
CPU_MEASURE_S = 0.25


@dataclass(frozen=True, kw_only=True)
class Peak:
    """One device's peak rate and where the figure came from (said in the start record and the report)."""

    flops_per_s: float
    source: str


def precision(device: torch.device, amp: bool) -> str:
    """The matmul precision the run trains in: bf16 under --amp, tf32 where torch allows it, else fp32."""
    if amp:
        return "bf16"
    if device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def table_peak(device_name: str, precision_name: str) -> Peak | None:
    """The data-sheet rate of a GPU named like torch.cuda.get_device_name() says, in that precision."""
    tokens = set(re.split(r"[\s\-_]+", device_name))
    for names, bf16, tf32, fp32 in GPU_PEAK_TFLOPS:
        if tokens.issuperset(names):
            rate = {"bf16": bf16, "tf32": tf32, "fp32": fp32}[precision_name]
            return Peak(flops_per_s=rate * 1e12, source=f"data sheet: {' '.join(names)} dense {precision_name}") if rate else None
    return None


def preflight_peak(path: Path, precision_name: str) -> Peak | None:
    """The median rank's measured matmul rate from a preflight report, when it measured this precision
    (bf16 on GPUs, fp32 on CPUs: train/preflight/compute.py); None when there is no usable report."""
    try:
        report = json.loads(path.read_text())
        rates = [float(rate["gflops"]) for rate in report.get("compute", [])]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    measured = "bf16" if report.get("backend") == "nccl" else "fp32"
    if not rates or measured != precision_name or median(rates) <= 0:
        return None
    return Peak(flops_per_s=median(rates) * 1e9, source=f"preflight: median measured {measured} matmul ({path})")


def device_peak(device: torch.device, amp: bool, preflight_json: Path | None, measure_cpu: Callable[[], float]) -> Peak | None:
    """The peak to divide by, in the order the module docstring gives; `measure_cpu` returns GFLOP/s."""
    wanted = precision(device, amp)
    if preflight_json is not None and (found := preflight_peak(preflight_json, wanted)):
        return found
    if device.type == "cuda":
        return table_peak(torch.cuda.get_device_name(device), wanted)
    return Peak(flops_per_s=measure_cpu() * 1e9, source=f"measured here: fp32 matmul for {CPU_MEASURE_S:g}s")


def count_flops_per_sample(
    module: nn.Module,
    batch: tuple[torch.Tensor, torch.Tensor],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    autocast: Callable[[], AbstractContextManager],
) -> float:
    """Forward and backward FLOPs per sample of one batch. In eval mode, so BatchNorm's running statistics
    are not updated and dropout draws no random numbers: the run's state and RNG stay as they were, which
    exact resume needs. The gradients it leaves are cleared."""
    inputs, targets = batch
    was_training = module.training
    module.eval()
    try:
        with FlopCounterMode(display=False) as counter:
            with autocast():
                loss = loss_fn(module(inputs), targets)
            loss.backward()
    finally:
        module.train(was_training)
        for parameter in module.parameters():
            parameter.grad = None
    return counter.get_total_flops() / len(inputs)


def mfu(samples_per_s: float, flops_per_sample: float, peak_per_device: float, devices: int) -> float:
    """The share of the devices' peak the model's own FLOPs use at this throughput."""
    return samples_per_s * flops_per_sample / (peak_per_device * devices)


class MfuMeter:
    """Rank 0's MFU: the peak per device, found at start (start-up, like the imports: a CPU's rate takes a
    quarter of a second to measure), and the model's FLOPs per sample, counted on its first micro-batch
    (as the loader delivered it, in a worker where there are workers: the dataset is never read in this
    process). The eager module is counted, with --compile too. A model the FLOP counter cannot run, or a
    GPU with no known peak, loses the figure (one warning), never the run."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.peak: Peak | None = None
        self.flops_per_sample: float | None = None

    def find_peak(self, device: torch.device, amp: bool, preflight_json: Path | None, measure_cpu: Callable[[], float]) -> None:
        self.peak = device_peak(device, amp, preflight_json, measure_cpu)
        if self.peak is None:
            self.log(
                f"warning: MFU not reported: no peak rate known for {torch.cuda.get_device_name(device)}; "
                "run the job's preflight (DDPACK_PREFLIGHT=1) to measure one"
            )

    def count(
        self,
        module: nn.Module,
        batch: tuple[torch.Tensor, torch.Tensor],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        autocast: Callable[[], AbstractContextManager],
    ) -> None:
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        try:
            with rng_untouched(device):
                self.flops_per_sample = count_flops_per_sample(module, batch, loss_fn, autocast)
        except Exception as exc:
            self.log(f"warning: MFU not reported: counting the model's FLOPs on one batch failed ({type(exc).__name__}: {first_line(exc)})")

    def of(self, samples_per_s: float, devices: int) -> float | None:
        """MFU at this global throughput, once both the peak and the FLOPs are known."""
        if self.flops_per_sample is None or self.peak is None:
            return None
        return mfu(samples_per_s, self.flops_per_sample, self.peak.flops_per_s, devices)

    def start_fields(self) -> dict[str, Any]:
        """For the `start` record, which `make report` reads to draw MFU and say where the peak came from."""
        return {
            "flops_per_sample": self.flops_per_sample,
            "peak_flops_per_s": self.peak.flops_per_s if self.peak else None,
            "peak_source": self.peak.source if self.peak else None,
        }


@contextmanager
def rng_untouched(device: torch.device) -> Iterator[None]:
    """Whatever runs inside (a dataset's random augmentation, a model's dropout) leaves torch's, Python's
    and NumPy's random states as they were: the counting must not move the run off its trajectory."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


# A rank whose busy time a step (the step less its wait for the others' gradients) is this many times the
# median's is named in the progress line: a rank 25% slower holds every other rank back by as much.
SLOW_FACTOR = 1.25
# ...judged over at least this many of the latest steps, however often progress lines come: one step's busy
# time on a shared host varies twofold from rank to rank, so a one-step window (--log-every 1) would name a
# different "slow" rank on nearly every line, while a real straggler stays slow over twenty.
JUDGED_OVER_STEPS = 20


@dataclass(frozen=True, kw_only=True)
class RankTimes:
    """Every rank's mean seconds a step over one progress window, indexed by rank: the whole step, the part
    spent waiting for the next batch, and the part spent waiting for the gradients' all-reduce. A
    straggler waits least for the all-reduce, since the others wait for it; its busy time is the longest."""

    step_s: list[float]
    data_s: list[float]
    sync_s: list[float]

    @classmethod
    def from_sums(cls, sums: list[float], steps: int) -> RankTimes:
        """From the all-reduced slots, three a rank (window seconds, data wait, sync wait), each rank
        having filled its own and left the others zero."""
        per_step = [value / max(steps, 1) for value in sums]
        return cls(step_s=per_step[0::3], data_s=per_step[1::3], sync_s=per_step[2::3])

    @staticmethod
    def slots(rank: int, world_size: int, window_s: float, data_s: float, sync_s: float) -> list[float]:
        """This rank's contribution to the all-reduce: its three figures in its own slots."""
        mine = [0.0] * (3 * world_size)
        mine[3 * rank : 3 * rank + 3] = (window_s, data_s, sync_s)
        return mine

    @property
    def busy_s(self) -> list[float]:
        return [step - sync for step, sync in zip(self.step_s, self.sync_s, strict=True)]

    def slowest(self, hosts: list[str]) -> str | None:
        """`slow rank R (host) busy X ms/step against a median of Y ms` when one is clearly slower, else None."""
        busy = self.busy_s
        if len(busy) < 2:
            return None
        typical = median(busy)
        rank = max(range(len(busy)), key=busy.__getitem__)
        if busy[rank] < SLOW_FACTOR * typical:
            return None
        data = f", {self.data_s[rank] * 1e3:.1f} of it waiting for data" if self.data_s[rank] > 0.5 * busy[rank] else ""
        return f"slow rank {rank} ({hosts[rank]}) busy {busy[rank] * 1e3:.1f} ms/step{data} against a median of {typical * 1e3:.1f}"

    def fields(self) -> dict[str, list[float]]:
        """The metrics record's per-rank columns (seconds a step, indexed by rank)."""
        return {
            "rank_step_s": [round(v, 6) for v in self.step_s],
            "rank_data_s": [round(v, 6) for v in self.data_s],
            "rank_sync_s": [round(v, 6) for v in self.sync_s],
        }


class SlowRanks:
    """Rank 0's judge of stragglers: pools the latest progress windows' shared sums until they cover at
    least JUDGED_OVER_STEPS steps (dropping older windows beyond that), and names a rank only then."""

    def __init__(self, hosts: list[str]) -> None:
        self.hosts = hosts
        self._windows: deque[tuple[list[float], int]] = deque()

    def _steps(self) -> int:
        return sum(steps for _, steps in self._windows)

    def judge(self, sums: list[float], steps: int) -> str | None:
        """`sums`: one window's all-reduced slots (RankTimes.slots); the slow rank's line, or None."""
        self._windows.append((sums, steps))
        while len(self._windows) > 1 and self._steps() - self._windows[0][1] >= JUDGED_OVER_STEPS:
            self._windows.popleft()
        pooled_steps = self._steps()
        if pooled_steps < JUDGED_OVER_STEPS:
            return None
        pooled = [sum(column) for column in zip(*(window for window, _ in self._windows), strict=True)]
        slow = RankTimes.from_sums(pooled, pooled_steps).slowest(self.hosts)
        return f"{slow} over the last {pooled_steps} steps" if slow else None
