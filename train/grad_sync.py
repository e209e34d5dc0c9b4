"""DDP's gradient sync, done by a communication hook that also carries the stop flags and, on
CPU, waits without sleeping.

Stop flags: each rank appends one count per stop signal to one bucket, so the ranks agree to stop
at the same step with no collective of their own (a separate all-reduce of one int costs ~0.8 ms
between two local gloo ranks, half of the seed workload's whole step). Appending copies the bucket,
so the flags ride in the smallest bucket of the step before (bucket 0 in the first step): on the
bench's heavy MLP the first bucket is 1 MiB and the last 42 KiB, and with the flags in the 1 MiB
one a step took 5.61 ms against 4.91 (5 interleaved rounds). Every rank sees the same buckets in
the same steps, so every rank picks the same carrier.

Waiting: a gloo all-reduce runs on the process group's worker threads while the training thread
blocks. On a small or virtualised CPU node a blocked thread that goes idle is woken late: between
two local ranks here an all-reduce of 21 floats takes 0.3 ms at the median but 2-4 ms at the 90th
percentile (a scheduler tick), and that tail, not the bytes, sets the step time. So on CPU the hook
launches every bucket's collective asynchronously, as DDP does, and hands DDP the bucket itself as
already done; the trainer calls `finish()` after backward, just before the optimizer, which polls the
outstanding work with sched_yield (the core never idles, the gloo threads still run) and writes each
result into its bucket. DDP must be built with gradient_as_bucket_view=True (`attach` checks), so the
gradients are views of the buckets and the results land in them with no copy; DDP's own
end-of-backward bookkeeping then runs while the collectives are in flight instead of after them.
On CUDA the collective runs on NCCL's stream and nothing waits on the host, so the hook only
unpacks, through a future DDP waits on as usual.

Small buckets on CPU: gloo's ring all-reduce takes 2(N-1) message rounds between N ranks, an
all-gather N-1, and for a small bucket each round costs thread wake-ups, not bytes. So a bucket whose
gathered copies fit in EXCHANGE_MAX_BYTES is exchanged whole with one all-gather and each rank sums
the N rows itself, in rank order, so every rank computes the same gradients bit for bit (for two
ranks, the very sum the all-reduce computes). Between two local ranks here, bench/bench_train.py's
loop of one local step and the sync of 21 floats takes 0.64 ms exchanged against 0.84 ms with the
polled all-reduce; a sweep of bucket sizes put the exchange ~5% ahead at 32 KiB and the all-reduce
ahead at 128 KiB, hence 64 KiB gathered (two ranks x 32 KiB).
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as real objects.
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import GradBucket
from torch.nn.parallel import DistributedDataParallel

from train.distributed import wait_polling, waits_by_polling
from train.signals import PreemptionWatcher

# On CPU, a bucket whose gathered copies (world size x its bytes) fit in this many bytes is exchanged
# whole (one all-gather) and summed on each rank instead of all-reduced: see the module docstring.
EXCHANGE_MAX_BYTES = 64 * 1024


@dataclass
class _Pending:
    work: dist.Work
    joined: torch.Tensor  # this rank's bucket (+ counts); all-reduced in place unless gathered
    gathered: torch.Tensor | None  # every rank's copy of `joined`, one row each, when exchanged
    carries_flags: bool
    bucket: torch.Tensor  # DDP's flat bucket, which the gradients are views of: the result goes here


class GradientSync:
    """The hook (`attach(ddp_model)` registers it), `finish()` (after backward, before the optimizer)
    and `poll()`.

    `poll()` at a step boundary returns the stop signal the ranks agreed on, the same on every rank:
    the first of the watched signals that any rank had received when its gradients went into the
    gradient sync. On CPU it reads the step just finished. On CUDA it reads the step before, whose copy
    to the host was queued a step ago, so the host never waits for the device; every rank lags by
    the same one step, so they still stop at the same boundary.
    """

    def __init__(self, watcher: PreemptionWatcher, world_size: int, device: torch.device) -> None:
        self.watcher, self.world_size, self.poll_wait = watcher, world_size, waits_by_polling(device)
        self._local: torch.Tensor | None = None  # this rank's counts, on the gradients' device
        self._marked = False
        self._summed: torch.Tensor | None = None  # every rank's counts after the last gradient sync
        self._pending: list[_Pending] = []
        self._carrier = 0  # the index of the bucket that carries the flags this step
        self._sizes: list[int] = []  # this step's bucket sizes so far, by index
        self._in_flight: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def _counts(self, buffer: torch.Tensor) -> torch.Tensor:
        if self._local is None or self._local.dtype != buffer.dtype or self._local.device != buffer.device:
            self._local = torch.zeros(len(self.watcher.signals), dtype=buffer.dtype, device=buffer.device)
            self._marked = False
        if not self._marked and self.watcher.received is not None:
            self._local[self.watcher.signals.index(self.watcher.received)] = 1  # a kernel launch on CUDA, no host sync
            self._marked = True
        return self._local

    def attach(self, model: DistributedDataParallel) -> None:
        if not model.gradient_as_bucket_view:
            raise ValueError("GradientSync needs DistributedDataParallel(..., gradient_as_bucket_view=True): it writes results into the buckets")
        model.register_comm_hook(None, self.hook)

    def hook(self, state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        size, index = buffer.numel(), bucket.index()
        # DDP calls the hook once per bucket, in index order, the last one flagged.
        if index == 0:
            self._sizes = []
        self._sizes.append(size)
        carries = index == self._carrier
        if bucket.is_last():  # the next step's carrier: the smallest bucket of this one
            self._carrier = min(range(len(self._sizes)), key=self._sizes.__getitem__)
        # Divide, then sum, as DDP's own reducer does. The carrier is copied once to append the
        # counts (divided too, which keeps them > 0); the others are reduced in place.
        joined = torch.cat([buffer, self._counts(buffer)]).div_(self.world_size) if carries else buffer.div_(self.world_size)
        if not self.poll_wait:
            work = dist.all_reduce(joined, async_op=True)

            def unpack(fut: torch.futures.Future) -> torch.Tensor:
                out = fut.value()[0]
                if carries:
                    self._summed = out[size:]
                return out[:size]  # DDP reads the gradients from the returned tensor: no copy back

            return work.get_future().then(unpack)
        gathered = None
        if joined.numel() * joined.element_size() * self.world_size <= EXCHANGE_MAX_BYTES:
            gathered = joined.new_empty(self.world_size * joined.numel())
            work = dist.all_gather_single(gathered, joined, async_op=True)
        else:
            work = dist.all_reduce(joined, async_op=True)
        self._pending.append(_Pending(work, joined, gathered, carries, buffer))
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)  # DDP finds its own bucket: nothing to copy; finish() fills it
        return done

    def finish(self) -> None:
        """Wait for this step's collectives (polling) and write each result into its bucket, that
        is into the gradients. A no-op on CUDA and in no_sync() micro-batches."""
        pending, self._pending = self._pending, []
        for item in pending:
            wait_polling(item.work)
            # Rows are summed in rank order, the same on every rank, so the ranks' gradients stay identical.
            out = item.gathered.view(self.world_size, -1).sum(0) if item.gathered is not None else item.joined
            size = item.bucket.numel()
            if item.carries_flags:
                self._summed = out[size:]
            if not out.is_set_to(item.bucket):  # all-reduced in place in the bucket: already there
                item.bucket.copy_(out[:size])

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
