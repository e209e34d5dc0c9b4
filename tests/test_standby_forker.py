"""The store task's source of new standbys (train/standby_forker.py): forked warm once its imports are done (a request
before that waits for them), cold once it is gone, in each case with the launcher's environment and the trainer's flags
plus --standby."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from train import standby_forker
from train.standby_forker import StandbyForker


def wait_for(check, timeout_s: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.02)
    raise AssertionError("not within the time")


def writing_main(out: Path):  # type: ignore[no-untyped-def]
    """A trainer's `main` that writes what it was started with."""

    def main(argv: Sequence[str]) -> int:
        seen = {
            "argv": list(argv),
            "env": os.environ.get("WHO"),
            "pid": os.getpid(),
            "term": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        }
        (out / f"{os.getpid()}.json").write_text(json.dumps(seen))
        return 0

    return main


def records(out: Path) -> list[dict]:
    """What each forked standby wrote (named by its pid)."""
    return [json.loads(p.read_text()) for p in sorted(out.glob("[0-9]*.json"))]


def printed(line: str) -> None:
    print(line, flush=True)


def test_a_new_standby_is_forked_warm_with_the_launchers_environment_and_standby_added(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    warmed = tmp_path / "warmed"
    monkeypatch.setattr(standby_forker, "warm_imports", warmed.touch)  # what it imports is not this test's point
    forker = StandbyForker({"WHO": "launcher"}, ["--recovery", "--store-task"], writing_main(tmp_path), printed)
    try:
        wait_for(warmed.exists)
        forker.spawn(1)
        forker.spawn(2)
        found = wait_for(lambda: len(records(tmp_path)) == 2 and records(tmp_path))
    finally:
        forker.close()
    assert [r["argv"] for r in found] == [["--recovery", "--store-task", "--standby"]] * 2
    assert {r["env"] for r in found} == {"launcher"} and all(r["term"] for r in found)  # its watcher takes SIGTERM
    assert {r["pid"] for r in found}.isdisjoint({os.getpid(), forker.pid})
    assert os.environ.get("WHO") is None  # this process's environment is its own
    with pytest.raises(ChildProcessError):
        os.waitpid(forker.pid, os.WNOHANG)  # reaped by close()
    out = capfd.readouterr().out
    assert re.search(
        rf"^store task: new standbys fork warm from pid {forker.pid} \(their imports done in [0-9.]+s\)$", out, re.M
    ), out
    said = [line for line in out.splitlines() if line.startswith("store task: a standby took")]
    pids = {int(line.rsplit("pid ", 1)[1].rstrip(")")) for line in said}
    assert [line.split(";")[0] for line in said] == [f"store task: a standby took a place in generation {g}" for g in (1, 2)], said
    assert pids == {r["pid"] for r in found} and all(line.split("; ")[1].startswith("started a new one (pid") for line in said), said


def test_a_request_while_the_forker_imports_is_forked_once_it_is_warm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """A death in the job's first seconds: the request waits in the pipe for the warm-up, and the standby is forked
    after it, never started cold beside an import half done."""
    monkeypatch.setattr(standby_forker, "warm_imports", lambda: time.sleep(1.0))
    forker = StandbyForker({"WHO": "launcher"}, ["--recovery"], writing_main(tmp_path), printed)
    try:
        forker.spawn(1)  # at once: the forker is still importing
        found = wait_for(lambda: records(tmp_path))
    finally:
        forker.close()
    assert [r["argv"] for r in found] == [["--recovery", "--standby"]]
    out = capfd.readouterr().out
    warm, started = out.index("store task: new standbys fork warm"), out.index(f"started a new one (pid {found[0]['pid']})")
    assert warm < started and "cold" not in out, out


def test_once_the_forker_is_gone_the_store_task_starts_a_standby_cold_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "standby.py"
    script.write_text("import json, os, sys\nopen(os.environ['OUT'], 'w').write(json.dumps(sys.argv[1:]))\n")
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, str(script), "--flag"])
    out = tmp_path / "cold.json"
    lines: list[str] = []
    forker = StandbyForker({"OUT": str(out)}, ["--flag"], writing_main(tmp_path), lines.append)
    os.kill(forker.pid, signal.SIGKILL)
    wait_for(lambda: os.waitpid(forker.pid, os.WNOHANG)[0] == forker.pid)
    forker.spawn(3)
    forker.close()
    assert json.loads(wait_for(lambda: out.exists() and out.read_text())) == ["--flag", "--standby"]
    assert len(lines) == 1 and re.fullmatch(
        r"store task: a standby took a place in generation 3; started a new one cold \(pid \d+\): the forker has ended", lines[0]
    ), lines


def test_a_store_task_that_cannot_serve_ends_its_forker_before_it_says_it_is_warm(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The store's port is taken: the store task says it cannot serve, and its forker (still importing) is ended then,
    so the job's log does not say next that new standbys fork warm (seen on the test cluster before)."""
    import socket

    from train import recovery

    monkeypatch.setattr(standby_forker, "warm_imports", lambda: time.sleep(1.0))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for name, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(taken.getsockname()[1]), "WORLD_SIZE": "2"}.items():
            monkeypatch.setenv(name, value)
        forker = StandbyForker({}, ["--recovery"], writing_main(Path("/nonexistent")), printed)
        try:
            assert recovery.serve_store(standbys=1, connect_s=5, log=printed, respawn=forker) == 1
        finally:
            forker.close()
    time.sleep(1.5)  # past the forker's warm-up, had it lived
    out = capfd.readouterr().out
    assert "store task: cannot serve the job's store at 127.0.0.1:" in out and "fork warm" not in out, out
    with pytest.raises(ChildProcessError):
        os.waitpid(forker.pid, os.WNOHANG)  # reaped
