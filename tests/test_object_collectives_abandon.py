"""Under in-process recovery, a rank waiting in an object collective (a snapshot's RNG gather, the state's broadcast)
ends it on the job's decision as its gradient waits do (train.distributed._finish). gloo tells a dead peer's death to
its ring neighbours only: a rank that is none sat in the gather until the collective timeout while the others formed
the next group without it, and the recovery fell back (seen on the test cluster: rank 3 of 4, 20 s late)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from testbed.env import clean_env
from train.distributed import free_port

# Rank 0 waits in the collective; rank 1 lives but never enters it (a peer stuck behind a dead one). The decision is
# stood in for by abandon_check raising once `decided` exists, which the test writes after a moment.
PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import torch
    from train import distributed
    from train.distributed import broadcast_objects, gather_objects, init_distributed, select_device

    what, decided = sys.argv[1], Path(sys.argv[2])
    ctx = init_distributed(*select_device("gloo"), 30)
    if ctx.rank == 1:
        time.sleep(40)
        os._exit(0)
    def check(waited_s):
        if decided.exists():
            raise RuntimeError(f"decided after {waited_s:.2f}s of waiting")
    distributed.abandon_check = check
    began = time.monotonic()
    try:
        if what == "broadcast":
            broadcast_objects({"state": 1}, ctx, src=1)
        else:
            gather_objects({"rng": 1}, ctx)
    except RuntimeError as exc:
        print(f"ended: {exc} ({time.monotonic() - began:.1f}s)", flush=True)
    os._exit(0)
    """
)


@pytest.mark.dist
def test_a_rank_waiting_in_an_object_collective_ends_it_on_the_decision(tmp_path: Path) -> None:
    """The gather (what the test cluster showed); the broadcast waits through the same `_finish`."""
    what = "gather"
    program, decided = tmp_path / "program.py", tmp_path / "decided"
    program.write_text(PROGRAM)
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(program), what, str(decided)],
            env=clean_env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        time.sleep(3)  # rank 0 waiting by now, or about to (a decision ends the wait whenever it comes)
        decided.touch()
        out, _ = procs[0].communicate(timeout=20)  # within the polls, far inside the collective timeout (30 s)
    finally:
        for proc in procs:
            proc.kill()
    assert "ended: decided after" in out, out
