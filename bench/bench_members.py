"""In-process recovery's protocol at scale, on this machine: simulated members against one TCPStore (issue 62, point 6).

What grows with the job is the store's traffic: every member writes a signed heartbeat every HEARTBEAT_S, and every
standby reads all of them as often. This drives the real code (train/recovery_channel.py's Channel, train/recovery.py's
Standby) with `--nodes` x `--ranks` simulated members, the members' beats written by a few writer processes (each
member's `set` a request of its own, as a process of its own would send it), and one real standby watching:
- capacity: what the store answers on this machine, `set`s back to back from the writer processes (ops/s);
- each trial: the members beat for --warm-s, one member stops and a survivor reports its collective failed (as a
  SIGKILLed rank's survivor does); the time from that moment to the standby's decision in the store is one sample.
It prints the store's ops/s while the members beat (heartbeats written and read), the capacity beside it, the decision
time's p50 and p99, and as its last line:
  bench-members: 8192 members (1024 nodes x 8), store ops/s S, death to decision p50 A s, p99 B s
(goal: B <= 1.0). The members' writes are HMAC-signed as a job's are (a token is set).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.distributed as dist

from entrypoint.plan import JOB_TOKEN_VAR
from train import recovery
from train.recovery_channel import Beat, Channel

TOKEN = "0123456789abcdef0123456789abcdef"


def client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30), wait_for_workers=False)


def environ(trial: int) -> dict[str, str]:
    """Each trial under its own start (SLURM_STEP_ID): its own keys, as a new step of a job has."""
    return {JOB_TOKEN_VAR: TOKEN, "SLURM_STEP_ID": str(trial), "SLURM_RESTART_COUNT": "0"}


def hammer(port: int, seconds: float, out: multiprocessing.Queue) -> None:
    """Back-to-back sets for `seconds`: the store's capacity, seen by one client."""
    store, done, until = client(port), 0, time.monotonic() + seconds
    while time.monotonic() < until:
        store.set(f"capacity/{os.getpid()}/{done % 64}", "x" * 80)
        done += 1
    out.put(done)


def beat(
    port: int,
    trial: int,
    members: list[str],
    stop_member: str,
    stop_at: multiprocessing.Value,
    finish: multiprocessing.Event,
    out: multiprocessing.Queue,
) -> None:
    """Write each of `members`' heartbeats every HEARTBEAT_S (as late as the store lets it), but `stop_member`'s after
    `stop_at` (its death)."""
    channel = Channel.of_job(client(port), environ(trial), print)
    count, sent = 0, 0
    while not finish.is_set():
        began = time.monotonic()
        count += 1
        dead = stop_at.value and time.time() >= stop_at.value
        for member in members:
            if not (dead and member == stop_member):
                channel.beat(member, Beat(count, f"n{int(member[1:]) // 8}"))
                sent += 1
        time.sleep(max(0.0, recovery.HEARTBEAT_S - (time.monotonic() - began)))
    out.put(sent)


def standby(port: int, trial: int, world: int, until: float) -> None:
    """The real standby's watch loop (train.recovery.Standby), on its own client, until its decision or `until`."""
    os.environ.update(environ(trial), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    watcher = recovery.Standby(world_size=world, host="spare", log=lambda line: None, index=0, launched=1)
    while time.monotonic() < until and watcher.channel.decision(0, world) is None:
        began = time.monotonic()
        watcher._watch()
        time.sleep(max(0.0, recovery.HEARTBEAT_S - (time.monotonic() - began)))
    watcher.heartbeat.stop()


def trial(port: int, number: int, world: int, writers: int, warm_s: float) -> tuple[float | None, float]:
    """One death: (seconds from it to the decision, or None past 30 s; the store's ops/s meanwhile)."""
    members = [f"r{rank}" for rank in range(world)]
    victim = members[world // 2 + 1]
    stop_at, finish = multiprocessing.Value("d", 0.0), multiprocessing.Event()
    until = time.monotonic() + warm_s + 30
    out: multiprocessing.Queue = multiprocessing.Queue()
    procs = [
        multiprocessing.Process(target=beat, args=(port, number, members[i::writers], victim, stop_at, finish, out)) for i in range(writers)
    ]
    watcher = multiprocessing.Process(target=standby, args=(port, number, world, until))
    for proc in [*procs, watcher]:
        proc.start()
    began = time.time()
    channel = Channel.of_job(client(port), environ(number), print)
    time.sleep(warm_s)
    stop_at.value = died = time.time()
    channel.report_failure(0, members[0])  # a survivor's collective failed, as it does at once on a SIGKILL
    decided = None
    while time.monotonic() < until:
        if channel.decision(0, world) is not None:
            decided = time.time() - died
            break
        time.sleep(0.005)
    finish.set()
    sent = sum(out.get() for _ in procs)
    for proc in procs:
        proc.join()
    watcher.terminate()
    watcher.join()
    return decided, sent / (time.time() - began)


def capacity(port: int, writers: int, seconds: float = 3.0) -> float:
    out: multiprocessing.Queue = multiprocessing.Queue()
    procs = [multiprocessing.Process(target=hammer, args=(port, seconds, out)) for _ in range(writers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return sum(out.get() for _ in procs) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--ranks", type=int, default=8, help="ranks a node")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--writers", type=int, default=2, help="processes writing the members' beats")
    parser.add_argument("--warm-s", type=float, default=3.0, help="seconds of beats before each death")
    args = parser.parse_args()
    world = args.nodes * args.ranks
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    cap = capacity(server.port, args.writers)
    print(f"store capacity here: {cap:,.0f} set/s ({args.writers} clients back to back, {os.cpu_count()} cores)", flush=True)
    times, rates = [], []
    for number in range(args.trials):
        decided, rate = trial(server.port, number + 1, world, args.writers, args.warm_s)
        rates.append(rate)
        times.append(decided if decided is not None else float("inf"))
        shown = f"{decided:.3f} s" if decided is not None else "none within 30 s"
        print(f"trial {number + 1}: death to decision {shown}; heartbeats written {rate:,.0f}/s", flush=True)
    ops = statistics.median(rates)
    p50 = statistics.median(times)
    p99 = sorted(times)[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    need = world / recovery.HEARTBEAT_S
    print(
        f"the protocol asks {need:,.0f} heartbeat writes/s of the store (every member every {recovery.HEARTBEAT_S:g} s) and a read of all"
    )
    print(f"{world} keys per standby as often; capacity here {cap:,.0f} set/s")
    print(
        f"bench-members: {world} members ({args.nodes} nodes x {args.ranks}), store ops/s {ops:,.0f}, death to decision p50 {p50:.3f} s, p99 {p99:.3f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
