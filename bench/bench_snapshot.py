"""Snapshot stall: how long training is held per snapshot, background writer against the synchronous write.

The state is the trainer's (`Trainer._state`'s keys) for a 50 M-parameter MLP after one AdamW step:
parameters plus two moments, ~600 MB. Side by side in one run, each round the floors, then A, then B:

- sync: `SnapshotStore.save` on the live state, as snapshots were written before (rank 0 serialises,
  writes, fsyncs and renames while every other rank waits in its next collective): the stall is the
  whole write;
- background: `SnapshotWriter.submit` (the copy into host buffers kept from the last snapshot) is the
  stall; the write runs on its own thread and `write_s` says when it was durable.

Also printed: the floors, the best round of each (one memcpy of the state's bytes for the stall; one write + fsync of the same
bytes for the write) and what the write in flight costs the training thread on this 2-core machine
(the model's step time while a write runs against without one): the writer takes a core here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from train.snapshot import Snapshot, SnapshotStore, SnapshotWriter, Written  # noqa: E402

GOAL = 0.1  # stall <= 0.1 x the synchronous write


def build(width: int, depth: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step(model, optimizer)  # the moments exist, as in any snapshot after the first step
    return model, optimizer


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    width = model[0].in_features
    loss = model(torch.randn(8, width)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, global_step: int) -> Snapshot:
    return Snapshot(
        model=model.state_dict(),
        optimizer=optimizer.state_dict(),
        epoch=0,
        step_in_epoch=global_step,
        global_step=global_step,
        rng=[{"torch": torch.get_rng_state()}],
        world_size=1,
        config={},
    )


def state_bytes(state: Snapshot) -> int:
    tensors = list(state.model.values()) + [t for s in state.optimizer["state"].values() for t in s.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)


def floors(nbytes: int, folder: Path) -> tuple[float, float]:
    """(one memcpy of nbytes, one write + fsync of nbytes) in seconds."""
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst.copy_(src)  # pages faulted in, as the writer's kept buffers are
    started = time.monotonic()
    dst.copy_(src)
    copy_s = time.monotonic() - started
    path = folder / "floor.bin"
    started = time.monotonic()
    with open(path, "wb") as handle:
        handle.write(memoryview(src.numpy()))
        handle.flush()
        os.fsync(handle.fileno())
    write_s = time.monotonic() - started
    path.unlink()
    return copy_s, write_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=12, help="Linear(width, width) layers: 12 x 2048^2 is 50.3 M parameters")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, optimizer = build(args.width, args.depth)
    params = sum(p.numel() for p in model.parameters())
    nbytes = state_bytes(state_of(model, optimizer, 0))
    print(f"snapshot stall: {params / 1e6:.1f} M parameters + AdamW moments ({nbytes / 1e6:,.0f} MB), {args.rounds} rounds A B A B ...")
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        folder = Path(tmp)
        store = SnapshotStore(folder / "snapshots", keep=1)
        written: list[Written] = []
        writer = SnapshotWriter(SnapshotStore(folder / "background", keep=1), written.append)
        writer.submit(state_of(model, optimizer, 0), time.monotonic())  # the host buffers, allocated once per run
        writer.wait()
        sync_s, stall_s, write_s, copy_floor_s, write_floor_s = [], [], [], [], []
        for round_ in range(1, args.rounds + 1):
            copy_floor, write_floor = floors(nbytes, folder)
            copy_floor_s.append(copy_floor)
            write_floor_s.append(write_floor)
            started = time.monotonic()
            store.save(state_of(model, optimizer, round_))
            sync_s.append(time.monotonic() - started)
            writer.submit(state_of(model, optimizer, round_), time.monotonic())
            last = writer.wait()
            assert last is not None
            stall_s.append(last.stall_s)
            write_s.append(last.write_s)
            print(
                f"  round {round_}: floors copy {copy_floor:.3f}s write {write_floor:.3f}s | sync write {sync_s[-1]:.3f}s | "
                f"background: held {stall_s[-1]:.3f}s, durable after {write_s[-1]:.3f}s"
            )
        quiet, busy = [], []
        for _ in range(args.rounds):
            started = time.monotonic()
            step(model, optimizer)
            quiet.append(time.monotonic() - started)
            writer.submit(state_of(model, optimizer, 99), time.monotonic())
            started = time.monotonic()
            step(model, optimizer)
            busy.append(time.monotonic() - started)
            writer.wait()
    copy_floor, write_floor = min(copy_floor_s), min(write_floor_s)  # a floor is the best this machine did
    sync, stall, write = statistics.median(sync_s), statistics.median(stall_s), statistics.median(write_s)
    ratio = stall / sync
    verdict = "met" if ratio <= GOAL else "NOT met"
    print(
        f"median: sync write holds training {sync:.3f}s; background holds it {stall:.3f}s ({ratio:.3f}x the sync write; goal <= {GOAL}x: {verdict})"
    )
    print(f"        background write durable after {write:.3f}s (vs {sync:.3f}s sync)")
    print(
        f"floors: one memcpy of {nbytes / 1e6:,.0f} MB {copy_floor:.3f}s (the stall is {stall / copy_floor:.1f}x it); "
        f"one write+fsync {write_floor:.3f}s (the sync write is {sync / write_floor:.1f}x it)"
    )
    print(
        f"a write in flight on this 2-core machine: the model's step {statistics.median(busy):.3f}s against {statistics.median(quiet):.3f}s without "
        "(the writer thread takes a core; a training node has cores to spare)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
