"""The hang watchdog's store on a shared cluster (issue 41, point 9): the rendezvous store answers anyone who
reaches its port, so another user could set the hang mark (the job ends 124), name their own hosts for
unresponsive-nodes (and Slurm's ExcNodeList), or kill the watchdog thread with a malformed value.

Here a real TCPStore serves two ranks' watchdogs that hold the job's token (DDPACK_JOB_TOKEN), and the attacker
is another process run as another Unix user (`ddmallory`, when the tests run as root): it lists the store's keys
(TCPStore's list_keys names them all), then writes un-tokened marks, the marks under the old key names, and
garbage, forged and copied values under the real keys. The watchdog declares no hang, names no foreign host,
and its thread lives; the token never appears in a key. The token's contract (16-128 hex characters or unset;
malformed: exit 2 in one line) and its way through the launcher are here too.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from store_attacker import run_as_another_user

from entrypoint.plan import JOB_TOKEN_VAR, PlanError, job_token
from testbed.env import ROOT
from train.job_keys import BadValue, store_prefix
from train.watchdog import EXIT_HANG, Progress, Watchdog, job_store, unsigned_store_note

TOKEN = "3f9a0c1d5e7b2468ace013579bdf8642"
VICTIM_ENV = {JOB_TOKEN_VAR: TOKEN, "SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0", "SLURM_STEP_ID": "0"}


# ---------------------------------------------------------------- the token's contract


@pytest.mark.parametrize("token", ["0123456789abcdef", TOKEN, "ABCDEF0123456789" * 8])
def test_a_token_is_16_to_128_hex_characters(token: str) -> None:
    assert job_token({JOB_TOKEN_VAR: token}) == token
    assert job_token({}) is None  # docker run -e, torchrun by hand: one user's machine, no secret


@pytest.mark.parametrize(
    ("token", "shape"),
    [
        ("", "empty"),
        ("abc", "3 characters"),
        ("a" * 129, "129 characters"),
        ("z" * 32, "32 characters, not all hex"),
        (TOKEN + " ", "33 characters, not all hex"),
    ],
)
def test_a_malformed_token_is_one_error_naming_the_variable_never_the_value(token: str, shape: str) -> None:
    with pytest.raises(PlanError) as info:
        job_token({JOB_TOKEN_VAR: token})
    message = str(info.value)
    assert message.startswith(f"{JOB_TOKEN_VAR} ({shape}) is not 16-128 hex characters; expected ") and "\n" not in message
    assert not token.strip() or token.strip() not in message


def one_line_exit_2(result: subprocess.CompletedProcess[str], program: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith(f"{program}: error: {JOB_TOKEN_VAR} (5 characters, not all hex)")
    assert "xyz!?" not in result.stderr


def test_a_malformed_token_stops_the_launcher_and_the_trainer_with_exit_2(tmp_path: Path) -> None:
    env = {**os.environ, JOB_TOKEN_VAR: "xyz!?"}
    launcher = subprocess.run(
        [sys.executable, "-m", "entrypoint", "--print-plan"], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    one_line_exit_2(launcher, "entrypoint")
    trainer = subprocess.run(
        [sys.executable, "-m", "train"], env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    one_line_exit_2(trainer, "train")


def test_a_malformed_token_stops_ddpack_run_with_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import ddpack_run

    monkeypatch.setenv(JOB_TOKEN_VAR, "xyz!?")
    with pytest.raises(SystemExit) as info:
        ddpack_run.Run()
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"ddpack_run: error: {JOB_TOKEN_VAR} (5 characters, not all hex)")


# One write a line: two ranks share the pipe, and an unbuffered print writes each piece on its own ("tokentoken ..." in
# a CI run, where the two ranks' pieces interleaved).
PRINT_TOKEN = f"import os; os.write(1, f\"token {{os.environ.get('{JOB_TOKEN_VAR}')}} {{os.environ.get('RANK')}}\\n\".encode())"


def test_the_launcher_hands_the_token_to_the_command() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    result = subprocess.run(
        [sys.executable, "-m", "entrypoint", "--", sys.executable, "-c", PRINT_TOKEN],
        env={**env, JOB_TOKEN_VAR: TOKEN},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert f"token {TOKEN} 0" in result.stdout


@pytest.mark.dist
def test_the_launcher_hands_the_token_to_every_rank_torchrun_starts() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "MASTER_", "TORCHELASTIC"))}
    result = subprocess.run(
        [sys.executable, "-m", "entrypoint", "--nproc-per-node", "2", "--", sys.executable, "-c", PRINT_TOKEN],
        env={**env, JOB_TOKEN_VAR: TOKEN},
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(line.split()[-1] for line in result.stdout.splitlines() if line.startswith("token ")) == ["0", "1"], (
        result.stdout[-2000:] + result.stderr[-2000:]  # CI once saw neither rank's line, with exit 0
    )
    assert result.stdout.count(f"token {TOKEN} ") == 2


# ---------------------------------------------------------------- a real store


def client(port: int) -> Callable[[], Any]:
    return lambda: dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=5), wait_for_workers=False)


def test_a_signed_value_holds_only_under_its_own_key_start_and_token(server: dist.TCPStore) -> None:
    """What an attacker who reads the store could try with the ranks' own values: move one to another key, replay
    one from an earlier step of the job (a restart in the same allocation keeps the token), or sign with a guess."""
    step0 = job_store(VICTIM_ENV, name="ddpack-watchdog", deadline_s=5, connect=client(server.port))
    step1 = job_store({**VICTIM_ENV, "SLURM_STEP_ID": "1"}, name="ddpack-watchdog", deadline_s=5, connect=client(server.port))
    step0.set("hang", '{"rank": 0, "time": 1.0}')
    assert step0.get("hang") == '{"rank": 0, "time": 1.0}'
    signed = server.get(step0.prefix + "hang")
    server.set(step0.prefix + "hb/1", signed)
    server.set(step1.prefix + "hang", signed)
    for store, key in ((step0, "hb/1"), (step1, "hang")):
        with pytest.raises(BadValue, match=f"not signed with this job's {JOB_TOKEN_VAR}"):
            store.get(key)
    guessed = job_store({**VICTIM_ENV, JOB_TOKEN_VAR: "0" * 32}, name="ddpack-watchdog", deadline_s=5, connect=client(server.port))
    assert guessed.prefix != step0.prefix  # another token, other key names
    guessed.prefix = step0.prefix
    guessed.set("hang", '{"rank": 0, "time": 1.0}')
    with pytest.raises(BadValue):
        step0.get("hang")
    assert TOKEN not in step0.prefix and step0.prefix.startswith("ddpack-watchdog/") and step0.prefix.endswith("/0.0.0/")


# ---------------------------------------------------------------- another user on the cluster

# The attacker's program: standard TCPStore client calls, nothing of ddpack's. It lists the keys, then for
# `seconds` cycles through its writes (each value held ~50 ms, then the next), and prints the keys it saw.
ATTACK = r"""
import datetime, hashlib, hmac, json, os, sys, time
import torch.distributed as dist

port, seconds, host = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10), wait_for_workers=False)
keys = store.list_keys()
print(os.getuid(), json.dumps(keys), flush=True)
prefixes = sorted({k[: k.index("hb/")] for k in keys if "/hb/" in k})
signed_beat = store.get(prefixes[0] + "hb/0") if prefixes else b"{}"

def beat(sent):
    return json.dumps({"rank": 1, "host": host, "pid": 1, "sent": sent, "step": 7, "phase": "sync", "phase_s": 1.0, "stalled_s": 100.0})

def signed(secret, key, value):
    return hmac.new(secret, (key + "\n" + value).encode(), hashlib.sha256).hexdigest() + " " + value

writes = []
for old in ("ddpack-watchdog/0/", "ddpack-watchdog/0.0.0/", "ddpack-watchdog/"):  # the names before the token
    writes += [(old + "hang", json.dumps({"rank": 0, "time": time.time()})), (old + "hb/1", beat(time.time() - 100))]
for p in prefixes:  # the real names, from list_keys
    mark = json.dumps({"rank": 0, "time": time.time()})
    writes += [
        (p + "hang", mark),                                   # the mark as a rank writes it, unsigned
        (p + "hang", "0" * 64 + " " + mark),                  # with a made-up signature
        (p + "hang", signed(b"00000000000000000000000000000000", p + "hang", mark)),  # signed with a guessed token
        (p + "hang", signed_beat),                            # a real signed value, from another key
        (p + "hang", b"\xff\xfe not text"),
        (p + "hang", "[" * 100000),
        (p + "hb/1", beat(time.time() - 100)),                # rank 1 gone stale, on the attacker's host
        (p + "hb/1", "0" * 64 + " " + beat(time.time() - 100)),
        (p + "hb/1", signed_beat),
        (p + "hb/1", "x" * (5 << 20)),                        # too large
        (p + "summary", '{"behind": 7}'),
        (p + "dumped/1", "nope"),
        (p + "read/1", "{"),
    ]
until = time.monotonic() + seconds
while time.monotonic() < until:
    for key, value in writes:
        store.set(key, value)
        time.sleep(0.05)
"""


def attack(port: int, seconds: float, host: str) -> tuple[subprocess.Popen[str], int]:
    """The attack, run as another user (tests/store_attacker.py)."""
    return run_as_another_user(ATTACK, port, seconds, host)


class Rank:
    """One rank's watchdog on the real store, with the job's token and the ranks' hosts from the process group."""

    def __init__(self, rank: int, progress: Progress, port: int, folder: Path) -> None:
        self.exits: list[int] = []
        self.lines: list[str] = []
        store = job_store(VICTIM_ENV, name="ddpack-watchdog", deadline_s=5, connect=client(port))
        self.dog = Watchdog(
            progress, rank=rank, world_size=2, host=f"node{rank}", timeout_s=1.0, forensics_dir=folder,
            log=self.lines.append, store=store, rank_hosts=["node0", "node1"], exit=self.exits.append,
        )  # fmt: skip

    def warnings(self) -> list[str]:
        return [line for line in self.lines if "ignoring the rendezvous store's value" in line]


def in_phase(phase: str, *, counted: bool) -> Progress:
    progress = Progress()
    progress.step_done(7)
    (progress.enter_counted if counted else progress.enter)(phase)
    return progress


def test_another_user_cannot_end_the_job_or_name_a_node_through_the_store(server: dist.TCPStore, tmp_path: Path) -> None:
    """Rank 0 waits in its next all-reduce (past the 1 s hang timeout) while rank 1 runs a long eval: a job that
    must not be ended. The attacker writes for 4 s; then rank 1 freezes (its heartbeats stop) while the attacker
    deletes rank 1's key and forges rank 1's heartbeat on its own host: none of that is evidence, so no verdict and no
    node named; once the key holds rank 1's own last heartbeat again, the hang is found and only node1 is named."""
    ranks = [
        Rank(0, in_phase("sync", counted=False), server.port, tmp_path),
        Rank(1, in_phase("eval", counted=True), server.port, tmp_path),
    ]
    for rank in ranks:
        rank.dog.start()
    time.sleep(0.5)  # a few heartbeats in the store, for the attacker to list and copy
    mallory, uid = attack(server.port, 4.0, "ddmallory-box")
    out, _ = mallory.communicate(timeout=60)
    assert mallory.returncode == 0
    seen_as, listed = out.splitlines()[0].split(" ", 1)
    assert int(seen_as) == uid  # ddmallory's, when this runs as root
    keys = json.loads(listed)
    assert keys and not any(TOKEN in key for key in keys)  # every key is listed; the secret is in none
    assert [rank.exits for rank in ranks] == [[], []] and not (tmp_path / "summary.json").exists()
    assert all(rank.dog._thread.is_alive() for rank in ranks)
    assert [len(rank.warnings()) for rank in ranks] == [1, 1], [rank.lines for rank in ranks]

    ranks[1].dog.stop()  # rank 1 freezes: its last heartbeat stays in the store, and goes stale after 5 s
    key = ranks[1].dog.store.prefix + "hb/1"
    last = server.get(key)
    server.delete_key(key)  # the attacker's first move, made here before the beat can go stale: no race with its start
    mallory, _ = attack(server.port, 4.0, "ddmallory-box")  # then it forges rank 1's heartbeat on its own host
    mallory.communicate(timeout=60)
    assert ranks[0].exits == [] and not (tmp_path / "unresponsive-nodes").exists()  # nothing it wrote was evidence
    assert any("not counted as a stall" in line for line in ranks[0].lines), ranks[0].lines
    server.set(key, last)  # rank 1's own last heartbeat back where it wrote it: the freeze is seen
    deadline = time.monotonic() + 30
    while not ranks[0].exits and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ranks[0].exits == [EXIT_HANG]
    assert (tmp_path / "unresponsive-nodes").read_text() == "node1\n"
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["behind_ranks"] == [1] and "ddmallory" not in json.dumps(summary)


def test_the_key_names_before_the_token_are_not_read(server: dist.TCPStore) -> None:
    """A job without a token keeps the old names (one user's machine); with one, a mark under them is not seen."""
    assert store_prefix("ddpack-watchdog", {}, None) == "ddpack-watchdog/0.0.0/"
    signed = job_store(VICTIM_ENV, name="ddpack-watchdog", deadline_s=5, connect=client(server.port))
    for old in ("ddpack-watchdog/0/", "ddpack-watchdog/0.0.0/"):
        server.set(old + "hang", json.dumps({"rank": 0, "time": time.time()}))
    assert signed.get("hang") is None


def expected_signature(key: str, value: str) -> str:
    """The signature as docs/security.md describes it, computed independently of train.watchdog."""
    return hmac.new(TOKEN.encode(), f"{key}\n{value}".encode(), hashlib.sha256).hexdigest()


def test_values_are_written_signed_as_documented(server: dist.TCPStore) -> None:
    store = job_store(VICTIM_ENV, name="ddpack-watchdog", deadline_s=5, connect=client(server.port))
    store.set("hb/0", "{}")
    assert server.get(store.prefix + "hb/0").decode() == f"{expected_signature(store.prefix + 'hb/0', '{}')} {{}}"


def test_without_a_token_only_a_slurm_job_gets_a_line() -> None:
    environ: Mapping[str, str] = {"SLURM_JOB_ID": "42"}
    assert unsigned_store_note(environ) is not None and JOB_TOKEN_VAR in str(unsigned_store_note(environ))
    assert unsigned_store_note({}) is None and unsigned_store_note(VICTIM_ENV) is None
