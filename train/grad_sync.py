"""DDP's gradient all-reduce, done by a communication hook that also carries the stop flags and, on
CPU, waits without sleeping.

Stop flags: each rank appends one count per stop signal to the first bucket, so the ranks agree to
stop at the same step with no collective of their own (a separate all-reduce of one int costs
~0.8 ms between two local gloo ranks, half of the seed workload's whole step).

Waiting: a gloo all-reduce runs on the process group's worker threads while the training thread
blocks. On a small or virtualised CPU node a blocked thread that goes idle is woken late: between
two local ranks here an all-reduce of 21 floats takes 0.3 ms at the median but 2-4 ms at the 90th
percentile (a scheduler tick), and that tail, not the bytes, sets the step time. So on CPU the hook
launches every bucket's all-reduce asynchronously, as DDP does, and in the last bucket's hook (the
end of backward, when nothing is left to overlap) polls the outstanding work with sched_yield,
which keeps the core from idling while letting the gloo threads run. The reducer then finds every
future complete. bench/bench_train.py measures the difference against plain DDP. On CUDA the
all-reduce runs on NCCL's stream and nothing waits on the host, so the hook only unpacks.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as real objects.
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import GradBucket

from train.distributed import wait_polling, waits_by_polling
from train.signals import PreemptionWatcher


@dataclass
class _Pending:
    work: dist.Work
    joined: torch.Tensor
    size: int
    carries_flags: bool
    result: torch.futures.Future


class GradientSync:
    """The hook (register with `ddp_model.register_comm_hook(None, sync.hook)`) and `poll()`.

    `poll()` at a step boundary returns the stop signal the ranks agreed on, the same on every rank:
    the first of the watched signals that any rank had received when its gradients went into the
    all-reduce. On CPU it reads the step just finished. On CUDA it reads the step before, whose copy
    to the host was queued a step ago, so the host never waits for the device; every rank lags by
    the same one step, so they still stop at the same boundary.
    """

    def __init__(self, watcher: PreemptionWatcher, world_size: int, device: torch.device) -> None:
        self.watcher, self.world_size, self.poll_wait = watcher, world_size, waits_by_polling(device)
        self._local: torch.Tensor | None = None  # this rank's counts, on the gradients' device
        self._marked = False
        self._summed: torch.Tensor | None = None  # every rank's counts after the last gradient sync
        self._pending: list[_Pending] = []
        self._in_flight: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def _counts(self, buffer: torch.Tensor) -> torch.Tensor:
        if self._local is None or self._local.dtype != buffer.dtype or self._local.device != buffer.device:
            self._local = torch.zeros(len(self.watcher.signals), dtype=buffer.dtype, device=buffer.device)
            self._marked = False
        if not self._marked and self.watcher.received is not None:
            self._local[self.watcher.signals.index(self.watcher.received)] = 1  # a kernel launch on CUDA, no host sync
            self._marked = True
        return self._local

    def hook(self, state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        size = buffer.numel()
        first = bucket.index() == 0
        # Divide, then sum, as DDP's own reducer does. The first bucket is copied once to append the
        # counts (divided too, which keeps them > 0); the others are reduced in place.
        joined = torch.cat([buffer, self._counts(buffer)]).div_(self.world_size) if first else buffer.div_(self.world_size)
        work = dist.all_reduce(joined, async_op=True)
        if not self.poll_wait:

            def unpack(fut: torch.futures.Future) -> torch.Tensor:
                out = fut.value()[0]
                if first:
                    self._summed = out[size:]
                return out[:size]  # DDP reads the gradients from the returned tensor: no copy back

            return work.get_future().then(unpack)
        result: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._pending.append(_Pending(work, joined, size, first, result))
        if bucket.is_last():
            self._complete_pending()
        return result

    def _complete_pending(self) -> None:
        pending, self._pending = self._pending, []
        for item in pending:
            wait_polling(item.work)
            if item.carries_flags:
                self._summed = item.joined[item.size :]
            item.result.set_result(item.joined[: item.size])

    def poll(self) -> signal.Signals | None:
        summed, self._summed = self._summed, None
        if summed is None:
            return None
        if summed.device.type == "cuda":
            ready, host = self._in_flight, torch.empty(summed.shape, dtype=summed.dtype, pin_memory=True)
            host.copy_(summed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._in_flight = (host, event)
            if ready is None:
                return None
            ready[1].synchronize()  # recorded a whole step ago: done long since
            counts = ready[0].tolist()
        else:
            counts = summed.tolist()
        for sig, count in zip(self.watcher.signals, counts, strict=True):
            if count > 0:
                return sig
        return None
