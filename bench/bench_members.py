"""In-process recovery's protocol at scale, on this machine: simulated members against one TCPStore (issue 62, point 6).

What grows with the job is the store's traffic. Every member beats every HEARTBEAT_S in a file on its node; the node's
two writers (train/node_beats.py) write one signed value for the node, with every member's count, to the store; every
standby reads one key per node as often. This drives the real code (train/recovery_channel.py's Channel and NodeBeat,
train/recovery.py's Standby) with `--nodes` x `--ranks` simulated members: a few writer processes each write their nodes'
values, WRITERS times a node each HEARTBEAT_S (each `set` a request of its own, as a node's writer process sends it; the
value built and signed once for the node's writers, and the node-local files, each node's own business, counts in
memory: this host's two cores simulate 2,048 writers), after every member registered its node; one real standby watches:
- capacity: what the store answers on this machine, `set`s back to back from the writer processes (ops/s);
- each trial: the members beat for --warm-s, one member stops and a survivor reports its collective failed (as a
  SIGKILLed rank's survivor does); the time from that moment to the standby's decision in the store is one sample.
It prints the store's ops/s while the members beat (node heartbeats written) beside the capacity, the decision time's
p50 and p99, and as its last line:
  bench-members: 8192 members (1024 nodes x 8), store ops/s S, death to decision p50 A s, p99 B s
(goal: B <= 1.0). The values are HMAC-signed as a job's are (a token is set).
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
from train.node_beats import WRITERS
from train.recovery_channel import Beat, Channel, NodeBeat

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
    nodes: list[int],
    ranks: int,
    stop_member: str,
    stop_at: multiprocessing.Value,
    finish: multiprocessing.Event,
    out: multiprocessing.Queue,
) -> None:
    """Be the writers of `nodes` (each of `ranks` members r<node x ranks + i>): register every member, then write each
    node's value WRITERS times every HEARTBEAT_S (as late as the store lets it), `stop_member`'s count standing still
    after `stop_at` (its death)."""
    channel = Channel.of_job(client(port), environ(trial), print)
    members = {node: [f"r{node * ranks + i}" for i in range(ranks)] for node in nodes}
    for node in nodes:
        for member in members[node]:
            channel.register(member, node_id(node))
    count, sent, stopped, last_ns = 0, 0, 0, 0
    while not finish.is_set():
        began = time.monotonic()
        count, now_ns = count + 1, time.monotonic_ns()
        if not (stop_at.value and time.time() >= stop_at.value):
            stopped, last_ns = count, now_ns  # the stopping member's last beat on its node
        for node in nodes:
            beats = {m: Beat(stopped, f"n{node}", (now_ns - last_ns) // 1_000_000) if m == stop_member else Beat(count, f"n{node}") for m in members[node]}
            key = channel.prefix + channel.node_key(node_id(node))
            sealed = channel.signer.seal(key, NodeBeat.of(f"n{node}", now_ns, beats).text())  # as beat_node makes it
            for _ in range(WRITERS):  # each writer's `set` of the node's value, a request of its own (made once here)
                channel.store.set(key, sealed)
                sent += 1
        time.sleep(max(0.0, recovery.HEARTBEAT_S - (time.monotonic() - began)))
    out.put(sent)


def node_id(node: int) -> str:
    return f"{node:016x}"


def standby(port: int, trial: int, world: int, until: float) -> None:
    """The real standby's watch loop (train.recovery.Standby), on its own client, until its decision or `until`."""
    os.environ.update(environ(trial), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    watcher = recovery.Standby(world_size=world, host="spare", log=lambda line: None, index=0, launched=1)
    while time.monotonic() < until and watcher.channel.decision(0, world) is None:
        began = time.monotonic()
        watcher._watch()
        time.sleep(max(0.0, recovery.HEARTBEAT_S - (time.monotonic() - began)))
    watcher.heartbeat.stop()


def trial(port: int, number: int, nodes: int, ranks: int, writers: int, warm_s: float) -> tuple[float | None, float, str]:
    """One death: (seconds from it to the decision, or None past 30 s; the store's heartbeat writes/s meanwhile; what
    was wrong with the decision: live members counted dead, "" when it named the one death)."""
    world = nodes * ranks
    members = [f"r{rank}" for rank in range(world)]
    victim = members[world // 2 + 1]  # a node's second member: one of its writers
    stop_at, finish = multiprocessing.Value("d", 0.0), multiprocessing.Event()
    until = time.monotonic() + warm_s + 30
    out: multiprocessing.Queue = multiprocessing.Queue()
    procs = [
        multiprocessing.Process(target=beat, args=(port, number, list(range(nodes))[i::writers], ranks, victim, stop_at, finish, out))
        for i in range(writers)
    ]
    watcher = multiprocessing.Process(target=standby, args=(port, number, world, until))
    for proc in [*procs, watcher]:
        proc.start()
    began = time.time()
    channel = Channel.of_job(client(port), environ(number), print)
    time.sleep(warm_s)
    stop_at.value = died = time.time()
    channel.report_failure(0, members[0])  # a survivor's collective failed, as it does at once on a SIGKILL
    decided, wrong = None, ""
    while time.monotonic() < until:
        if (decision := channel.decision(0, world)) is not None:
            decided = time.time() - died
            if decision.fallback is not None or set(decision.dead.values()) != {victim}:  # live members taken for dead
                wrong = f"; but it names {len(decision.dead)} dead ({decision.fallback or 'replaced'})"
            break
        time.sleep(0.005)
    finish.set()
    sent = sum(out.get() for _ in procs)
    for proc in procs:
        proc.join()
    watcher.terminate()
    watcher.join()
    return decided, sent / (time.time() - began), wrong


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
        decided, rate, wrong = trial(server.port, number + 1, args.nodes, args.ranks, args.writers, args.warm_s)
        rates.append(rate)
        times.append(decided if decided is not None and not wrong else float("inf"))  # a wrong decision is no decision
        shown = f"{decided:.3f} s{wrong}" if decided is not None else "none within 30 s"
        print(f"trial {number + 1}: death to decision {shown}; node heartbeats written {rate:,.0f}/s", flush=True)
    ops = statistics.median(rates)
    p50 = statistics.median(times)
    p99 = sorted(times)[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    need = args.nodes * WRITERS / recovery.HEARTBEAT_S
    print(
        f"the protocol asks {need:,.0f} heartbeat writes/s of the store ({WRITERS} writers a node, each every {recovery.HEARTBEAT_S:g} s; "
        f"one a member was {world / recovery.HEARTBEAT_S:,.0f}/s) and a read of {args.nodes} node keys per standby as often"
    )
    print(f"store ops/s {ops:,.0f} while the members beat (node heartbeats written), beside a capacity here of {cap:,.0f} set/s")
    print(
        f"bench-members: {world} members ({args.nodes} nodes x {args.ranks}), store ops/s {ops:,.0f}, death to decision p50 {p50:.3f} s, p99 {p99:.3f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
