"""DDP's gradient sync, done by a communication hook that waits without sleeping on CPU, and the
stop flags, which ride in the same sync as gradients of a parameter of their own.

Stop flags: the module DDP wraps gets one more parameter, `stop_flags` (one element per watched
signal, always zero, never trained or saved), and the loss each synced backward starts from gets
`flags . marks` added, which is 0 (so the loss and every other gradient stay exactly as they were)
and whose gradient with respect to the flags is this rank's marks (1 for a signal received). DDP
syncs that gradient in the bucket that holds the parameter, with every other gradient, so the ranks
agree to stop at the same step with no collective of their own (a separate all-reduce of one int
costs ~0.8 ms between two local gloo ranks, half of the seed workload's whole step) and no bucket is
copied to make room: appending the flags to a bucket copied it in and its result back, and on the
bench's heavy MLP (1.05 MiB, one bucket) a step took 5.01 ms that way against 4.49 without the copy.

Waiting: a gloo all-reduce runs on the process group's worker threads while the training thread
blocks. On a small or virtualised CPU node a blocked thread that goes idle is woken late: between
two local ranks here an all-reduce of 21 floats takes 0.3 ms at the median but 2-4 ms at the 90th
percentile (a scheduler tick), and that tail, not the bytes, sets the step time. So on CPU the hook
launches every bucket's collective asynchronously, as DDP does, and hands DDP the bucket itself as
already done; the trainer calls `finish()` after backward, just before the optimizer, which polls the
outstanding work with sched_yield (the core never idles, the gloo threads still run) and leaves each
result in its bucket (where the ranks outnumber their CPUs it sleeps between polls instead: a spinning
waiter would take the CPU from the rank it waits for; train.distributed.crowding). DDP must be built with gradient_as_bucket_view=True (`attach` checks), so the
gradients are views of the buckets and the results land in them with no copy; DDP's own
end-of-backward bookkeeping then runs while the collectives are in flight instead of after them.
On CUDA the collective runs on NCCL's stream and nothing waits on the host: DDP's own built-in all-reduce
hook (C++: one division and one all-reduce a bucket, no Python on the autograd thread) does the sync, and DDP
waits on its future as usual (confirmed steps too: below); ddpack's Python hook there only packs --bf16-grads buckets. The step's choices
by device are train/step_path.py's.

Small buckets on CPU: gloo's ring all-reduce takes 2(N-1) message rounds between N ranks, an
all-gather N-1, and for a small bucket each round costs thread wake-ups, not bytes. So a bucket whose
gathered copies fit in EXCHANGE_MAX_BYTES is exchanged whole with one all-gather and each rank sums
the N rows itself, in rank order, so every rank computes the same gradients bit for bit (for two
ranks, the very sum the all-reduce computes). Between two local ranks here, bench/bench_train.py's
loop of one local step and the sync of 21 floats takes 0.64 ms exchanged against 0.84 ms with the
polled all-reduce; a sweep of bucket sizes put the exchange ~5% ahead at 32 KiB and the all-reduce
ahead at 128 KiB, hence 64 KiB gathered (two ranks x 32 KiB).

Confirmed steps (--recovery, StepPath.confirmed): a step's update is applied whole or not at all. When a peer dies in
the middle of a step's sync, some buckets may have completed and others not (or, on NCCL, an all-reduce aborted on a
dead peer returns with partial sums and no error on the stream); an optimizer step over those gradients would put a
half-summed update into the parameters and the optimizer state, on some ranks and not others. So `finish()` raises
(a collective failure, recovered from as one) before the optimizer can run unless every bucket's collective completed
on this rank. On the CPU path each polled wait raises on a failed collective. On the CUDA path DDP's own C++ hook
still does the sync (no Python a bucket), and `finish()` has the host wait for the step's end (a CUDA event recorded
after DDP made the stream wait on every bucket's collective, polled with recovery's abandon check), then asks the
process group's NCCL backend for its error state (`get_error()`): ProcessGroupNCCL's watchdog sets it, as it sets the
failed work's exception, before it aborts the communicator, so once an aborted kernel has returned the error is there
to read. Where torch's NCCL backend has no `get_error`, ddpack's Python hook keeps each bucket's work instead and
`finish()` checks each one's exception after the same wait (the cost of a Python call a bucket: docs/recovery.md).
A completed ring all-reduce on a rank holds every rank's contribution, so a confirmed step is the uninterrupted run's
step. The gradients a failed step left in the buckets are zeroed at the redone step's start (SyncedModel.zero_grads).
The cost is the host's wait for the device each step (it no longer runs a step ahead) and one query of the error state.

DDPACK_TEST_DIE_IN_SYNC=<rank>:<global step> (tests only: tests/test_recovery_dist.py): the rank of that number
SIGKILLs itself in its comm hook of that step once its first bucket's collective has completed, before it launches
the second, so that the survivors see the first bucket complete and the second fail (a death *between* buckets; the
model needs two buckets or more: --bucket-cap-mb). Armed by the trainer (Trainer._recoverable_step), never otherwise;
it lives in ddpack's hook, so it fires where that hook runs (the CPU path, which the test runs), not under DDP's C++ hook.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as real objects.
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import GradBucket
from torch.nn.parallel import DistributedDataParallel

from train.distributed import wait_polling
from train.signals import PreemptionWatcher
from train.step_path import StepPath
from train.torch_compat import all_gather_into, ddp_buckets_final

# On CPU, a bucket whose gathered copies (world size x its bytes) fit in this many bytes is exchanged
# whole (one all-gather) and summed on each rank instead of all-reduced: see the module docstring.
EXCHANGE_MAX_BYTES = 64 * 1024


@dataclass
class _Pending:
    work: dist.Work
    gathered: torch.Tensor | None  # every rank's copy of the bucket, one row each, when exchanged
    bucket: torch.Tensor  # DDP's flat bucket, which the gradients are views of: the result goes here
    packed: torch.Tensor | None = None  # the bfloat16 copy that was all-reduced (--bf16-grads), unpacked into the bucket


class _WithStopFlags(nn.Module):
    """The user's module with the stop-flag parameter beside it, for DDP to wrap; the trainer trains,
    saves and evaluates the user's module itself. `run`: what runs the module (its compiled form,
    with --compile), kept off the module tree so that DDP sees each parameter once, by the user's
    own names.

    forward returns (the module's output, the flags), and the loss takes the flags from there
    (`carry_flags`): with find_unused_parameters DDP walks the autograd graph from forward's output
    and counts a parameter it does not reach as unused, so flags used outside forward would be
    marked ready twice ("Expected to mark a variable ready only once"). For that walk the flags go
    out through a view (a leaf has no graph to walk); without it, as the parameter itself (no op)."""

    def __init__(self, module: nn.Module, flags: nn.Parameter, run: Callable[..., Any], through_graph: bool) -> None:
        super().__init__()
        self.module, self.stop_flags, self.through_graph = module, flags, through_graph
        object.__setattr__(self, "run", run)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Any, torch.Tensor]:
        flags = self.stop_flags.view_as(self.stop_flags) if self.through_graph else self.stop_flags
        return self.run(*args, **kwargs), flags


class _DoneEvent:
    """Stands in for a CUDA event where the CUDA path runs without CUDA (StepPath.cuda_shaped on a CPU): a CPU
    copy is done when it returns."""

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Reached:
    """A recorded CUDA event (or its stand-in) as something `wait_polling` waits on: the host polls it, with recovery's
    abandon check, instead of blocking in cudaEventSynchronize until the collective timeout."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()


def _no_error() -> str:
    """The error state of gloo standing in for NCCL (StepPath.cuda_shaped on a CPU): gloo keeps none, and needs none
    here, since a failed gloo collective sets an error on DDP's future for its bucket and DDP's wait on that future
    raises it in backward, before finish() and the optimizer."""
    return "SUCCESS"


def comm_error_state(model: DistributedDataParallel, device: torch.device) -> Callable[[], Any] | None:
    """What the confirmed CUDA path asks after the step's end to know that none of DDP's collectives failed: the
    NCCL backend's `get_error()` (ErrorType; SUCCESS until its watchdog saw a collective fail or time out, then the
    first such error, for good). None where the backend has no such call (a torch whose ProcessGroupNCCL lacks it):
    the caller then keeps each bucket's work itself. gloo (the CPU stand-in): `_no_error`, see there."""
    backend = model.process_group._get_backend(device)
    query = getattr(backend, "get_error", None)
    if query is None and device.type == "cpu":
        return _no_error
    return query


class IncompleteSync(RuntimeError):
    """A bucket's collective ended in an error on the confirmed CUDA path (an NCCL communicator aborted on a dead
    peer): the step's gradients may be partial sums, so its update is not applied; recovered from as a peer's death."""

    peer_failure = True  # train.distributed.collective_failure


class _LateRead:
    """The stop flags' sum, read on the host a step late without waiting for the device: each step queues a copy
    of the flags' gradient into one host buffer (pinned on CUDA, reused) and records one event after it; the next
    step reads the buffer once the event has passed. In the steady state the GPU finished the step before last long
    ago and `query()` says so, so the host does not wait; it waits (`synchronize`) only when it runs more than a
    step ahead of the GPU, where waiting costs nothing. Every rank reads the same step, so all still agree."""

    def __init__(self, like: torch.Tensor, cuda: bool) -> None:
        self.host = torch.empty(like.shape, dtype=like.dtype, pin_memory=cuda)
        self.event: Any = torch.cuda.Event() if cuda else _DoneEvent()
        self.pending = False
        self.waits = 0  # how often the host had to wait for the device (the GPU tier reads it)

    def exchange(self, summed: torch.Tensor) -> list[float] | None:
        """The previous step's counts (None at the first read), and this step's queued for the next."""
        counts = None
        if self.pending:
            if not self.event.query():
                self.waits += 1
                self.event.synchronize()
            counts = self.host.tolist()
        self.host.copy_(summed, non_blocking=True)
        self.event.record()
        self.pending = True
        return counts


class GradientSync:
    """`wrap(module)` (before DDP is built), the hook (`attach(ddp_model)` registers it),
    `carry_flags(loss, flags)` (before each synced backward), `finish()` (after backward, before the
    optimizer) and `poll()`.

    `poll()` at a step boundary returns the stop signal the ranks agreed on, the same on every rank:
    the first of the watched signals that any rank had received when its gradients went into the
    gradient sync. On the CPU path it reads the step just finished. On the CUDA path it reads the step
    before, whose copy to the host was queued a step ago (_LateRead), so the host does not wait for the
    device; every rank lags by the same one step, so they still stop at the same boundary. The flags'
    gradient is zeroed with every other gradient, at the start of the next step (SyncedModel.zero_grads).
    """

    def __init__(
        self, watcher: PreemptionWatcher, world_size: int, device: torch.device, compress: bool = False, path: StepPath | None = None
    ) -> None:
        self.path = path if path is not None else StepPath.for_device(device)
        self.watcher, self.world_size, self.device, self.poll_wait = watcher, world_size, device, self.path.polled_sync
        # --bf16-grads: buckets travel as bfloat16 (half the bytes; the sum too is taken in bfloat16 by
        # an all-reduce, in the bucket's dtype by an exchange) and land back in the fp32 gradients.
        self.compress = compress
        self.flags: nn.Parameter | None = None
        self._marks: torch.Tensor | None = None  # this rank's marks, one per watched signal
        self._marked = False
        self._pending: list[_Pending] = []
        self._late: _LateRead | None = None
        self.confirm = self.path.confirmed  # --recovery: the optimizer runs only after the step's sync is confirmed
        self._end: Any = None  # the confirmed CUDA path's event at the step's end (made at the first step)
        self._error_state: Callable[[], Any] | None = None  # the confirmed CUDA path's check with DDP's C++ hook (attach)
        self.die_after_first_bucket = False  # DDPACK_TEST_DIE_IN_SYNC, armed by the trainer for one step (tests only)

    def wrap(self, module: nn.Module, forward: Callable[..., Any] | None = None, find_unused_parameters: bool = False) -> nn.Module:
        """The module to build DDP on: `module` plus the stop-flag parameter, in the dtype of the
        module's parameters so that DDP buckets it with them; `forward` runs the module instead of
        calling it (torch.compile's wrapper of the same module). Called, the result returns
        (output, flags): hand the flags to `carry_flags`. `find_unused_parameters`: as given to DDP."""
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        self.flags = nn.Parameter(torch.zeros(len(self.watcher.signals), dtype=dtype, device=self.device))
        self._marks = torch.zeros_like(self.flags.detach())
        # `is None`, not `or`: torch.compile's wrapper has a __len__ that raises for a module that is no container.
        return _WithStopFlags(module, self.flags, forward if forward is not None else module, find_unused_parameters)

    def attach(self, model: DistributedDataParallel) -> None:
        if not model.gradient_as_bucket_view:
            raise ValueError(
                "GradientSync needs DistributedDataParallel(..., gradient_as_bucket_view=True): it writes results into the buckets"
            )
        if self.flags is None or not any(p is self.flags for p in model.parameters()):
            raise ValueError("GradientSync needs DistributedDataParallel(sync.wrap(module), ...): the stop flags ride in DDP's buckets")
        if self.confirm and not self.poll_wait and not self.compress:
            self._error_state = comm_error_state(model, self.device)  # None: this torch's NCCL keeps no error state
        if self.world_size == 1 and not self.poll_wait and not self.confirm:
            model.register_comm_hook(None, self.alone)
        elif self.poll_wait or self.compress or (self.confirm and self._error_state is None):
            model.register_comm_hook(None, self.hook)
        else:
            # DDP's C++ hook: divide the bucket by the world size, all-reduce it; the gradients are its views.
            model._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)

    def carry_flags(self, loss: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
        """`loss` + flags . marks: the same value, and a backward from it gives the flag parameter this
        rank's marks as its gradient. For the micro-batch whose backward DDP syncs; `flags` as the
        wrapped module's forward returned them."""
        if not self._marked and self.watcher.received is not None:
            self._marks[self.watcher.signals.index(self.watcher.received)] = 1  # a kernel launch on CUDA, no host sync
            self._marked = True
        return loss + torch.dot(flags, self._marks)

    def alone(self, state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """One rank on the CUDA path: a bucket is already its own sum, so no division and no collective (DDP's C++
        hook would launch both, a bucket at a time, for nothing)."""
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    def hook(self, state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        # Divide, then sum, as DDP's own reducer does; every bucket is reduced in place. One rank: nothing to divide.
        buffer = bucket.buffer()
        if self.world_size > 1:
            buffer.div_(self.world_size)
        sent = buffer.to(torch.bfloat16) if self.compress else buffer
        if not self.poll_wait and not self.confirm:  # the unconfirmed CUDA path comes here only to pack --bf16-grads
            future = dist.all_reduce(sent, async_op=True).get_future()
            return future.then(lambda fut: buffer.copy_(fut.value()[0]))
        if self.die_after_first_bucket and bucket.index() == 1:
            self._die_between_buckets()
        gathered = None
        if self.poll_wait and sent.numel() * sent.element_size() * self.world_size <= EXCHANGE_MAX_BYTES:
            gathered = sent.new_empty(self.world_size * sent.numel())
            work = all_gather_into(gathered, sent, async_op=True)
        else:
            work = dist.all_reduce(sent, async_op=True)
        self._pending.append(_Pending(work, gathered, buffer, sent if self.compress and gathered is None else None))
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)  # DDP finds its own bucket: nothing to copy; finish() completes it
        return done

    def finish(self) -> None:
        """Wait for this step's collectives (polling on CPU; on the confirmed CUDA path the host waits for the step's
        end: `_confirm`); an exchanged bucket's rows are summed into the bucket, that is into the gradients. Raises
        a collective failure, before the optimizer can run, when any bucket's collective did not complete. Called
        once a step, after the last micro-batch's backward; a no-op on the unconfirmed CUDA path."""
        pending, self._pending = self._pending, []
        for item in pending:
            if self.poll_wait:
                wait_polling(item.work)
            else:
                item.work.wait()  # NCCL: the current stream waits on the collective, the host does not
            if item.gathered is not None:
                # Rows are summed in rank order, the same on every rank, so the ranks' gradients stay identical.
                torch.sum(item.gathered.view(self.world_size, -1).to(item.bucket.dtype), 0, out=item.bucket)
            elif item.packed is not None:
                item.bucket.copy_(item.packed)
        if self.confirm and not self.poll_wait:
            self._confirm(pending)

    def _confirm(self, pending: list[_Pending]) -> None:
        """The confirmed CUDA path: the host waits until the stream has passed every bucket's collective (DDP made it
        wait on each, or finish() did), then raises IncompleteSync when any of them ended in an error (an aborted
        kernel returns with partial sums): the backend's error state with DDP's C++ hook, else each kept work's."""
        if self._end is None:
            self._end = torch.cuda.Event() if self.path.cuda else _DoneEvent()
        self._end.record()
        wait_polling(_Reached(self._end))
        if self._error_state is not None:
            state = self._error_state()
            if getattr(state, "name", state) != "SUCCESS":  # ErrorType by name (torch.distributed exports no spelling of it)
                raise IncompleteSync(f"the process group's collectives ended in an error ({state}): the step's update is not applied")
            return
        for item in pending:
            if (error := item.work.exception()) is not None:
                raise IncompleteSync(f"a gradient bucket's all-reduce did not complete ({error}): the step's update is not applied")

    def _die_between_buckets(self) -> None:
        """DDPACK_TEST_DIE_IN_SYNC (tests only): once the first bucket's collective has completed here (and so on
        every rank that waits for it), this process dies before it launches the second."""
        self._pending[0].work.wait()
        os.kill(os.getpid(), signal.SIGKILL)

    def poll(self) -> signal.Signals | None:
        summed = self.flags.grad if self.flags is not None else None  # every rank's marks, divided by the world size
        if summed is None:
            return None
        if self.path.late_stop_read:
            if self._late is None:
                self._late = _LateRead(summed, self.path.cuda)
            counts = self._late.exchange(summed)
            if counts is None:
                return None
        else:
            counts = summed.tolist()
        for sig, count in zip(self.watcher.signals, counts, strict=True):
            if count > 0:
                return sig
        return None


def _whole_storages(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """One flat tensor over each distinct storage that `grads` view: DDP's buckets, when they are its bucket views."""
    whole: dict[int, torch.Tensor] = {}
    for grad in grads:
        storage = grad.untyped_storage()
        if storage.data_ptr() not in whole:
            flat = torch.empty(0, dtype=grad.dtype, device=grad.device)
            whole[storage.data_ptr()] = flat.set_(storage, 0, (storage.nbytes() // grad.element_size(),))
    return list(whole.values())


class SyncedModel:
    """The trainer's one front to DDP and the stop protocol: DDP over the user's module with the stop flags
    riding in its gradient sync (GradientSync). A step reads

        synced.zero_grads()                        # last step's gradients gone (after its stop flags were read)
        outputs = synced(inputs)                   # no_sync() around the micro-batches that do not sync
        synced.backward(loss, syncs=True)          # the last micro-batch: this rank's stop marks ride along
        synced.finish()                            # the gradients are summed (before the optimizer)
        agreed = synced.agreed_stop()              # at the step boundary: the same signal, or None, on every rank
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        watcher: PreemptionWatcher,
        world_size: int,
        device: torch.device,
        compress: bool,
        compiled: Callable[..., Any] | None,
        find_unused_parameters: bool,
        path: StepPath | None = None,
        sync_initial_state: bool = True,
    ) -> None:
        """`sync_initial_state`: DDP hands every rank rank 0's parameters and buffers as it is built. False for a group
        re-formed by in-process recovery, where rank 0 may be the standby that took its place, with a model just built:
        the state then comes from the survivor furthest along (Trainer._take_state), never from rank 0."""
        path = path if path is not None else StepPath.for_device(device)
        self.sync = GradientSync(watcher, world_size, device, compress=compress, path=path)
        # Gradients are views of DDP's buckets: the collectives reduce them in place, and backward
        # accumulates into them in place (zero_grads zeroes them, never sets them to None).
        self.ddp = DistributedDataParallel(
            self.sync.wrap(module, forward=compiled, find_unused_parameters=find_unused_parameters),
            device_ids=[device] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            bucket_cap_mb=path.bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            init_sync=sync_initial_state,
        )
        self.sync.attach(self.ddp)
        self._flags: torch.Tensor | None = None
        self._synced = [p for p in self.ddp.parameters() if p.requires_grad]  # the trained parameters and the stop flags
        self._buckets: list[torch.Tensor] | None = None  # DDP's buckets, each whole, once they are final

    @property
    def compress(self) -> bool:
        return self.sync.compress

    def __call__(self, inputs: Any) -> Any:
        outputs, self._flags = self.ddp(inputs)
        return outputs

    def no_sync(self) -> Any:
        return self.ddp.no_sync()

    def train(self) -> None:
        self.ddp.train()

    def zero_grads(self) -> None:
        """Zero every synced gradient, at the start of a step (the stop flags' gradient is read between steps).
        The gradients are views of DDP's buckets from the first synced backward on, and DDP rebuilds its buckets
        once, in the second step's forward, pointing the gradients at the new ones in that backward. From then on
        the buckets are kept and zeroed whole, in one call (a GPT's 149 gradients are 14 buckets): torch's
        `Optimizer.zero_grad` walks the parameters in Python. Before that, and where DDP never rebuilds (with
        find_unused_parameters), the gradients are taken anew each step and zeroed one by one."""
        buckets = self._buckets
        if buckets is None:
            grads = [p.grad for p in self._synced if p.grad is not None]
            if ddp_buckets_final(self.ddp) and len(grads) == len(self._synced):
                self._buckets = buckets = _whole_storages(grads)
            else:
                buckets = grads
        if buckets:
            torch._foreach_zero_(buckets)

    def backward(self, loss: torch.Tensor, *, syncs: bool) -> None:
        """Backward from `loss`; `syncs` for the micro-batch whose backward DDP syncs (the last of a step)."""
        (self.sync.carry_flags(loss, self._flags) if syncs else loss).backward()

    def finish(self) -> None:
        self.sync.finish()

    def agreed_stop(self) -> signal.Signals | None:
        return self.sync.poll()
