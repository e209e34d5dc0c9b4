"""`make smoke`: a two-container gloo DDP job with plain Docker (SDK), no compose.

Each variant first runs `entrypoint --preflight` in two containers (the same launch and trainer
flags), then the training in two more.
Variant `pair`: one process per container (RANK 0 and 1, MASTER_ADDR = rank 0's container name).
Variant `torchrun`: one torchrun per container with two local processes (world size 4, c10d).
Logs stream with a container prefix; at the end a report: exit codes, final loss, steps/s and whether
every rank's parameter checksum agrees. The bundled trainer's run folder (metrics, preflight.json) is
build/smoke/VARIANT-ID on the host, mounted into both containers as a job's shared folder is; its
run report (`make report`) is written there and its path printed. An image built with a project's command (`make image APP=DIR
APP_CMD=...`) runs that command instead, with no arguments, as `docker run IMAGE` would: its report is the
containers' exit codes. Containers and the network are removed on every exit path.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from docker.client import DockerClient
from docker.errors import ImageNotFound, NotFound
from docker.models.containers import Container

from ddpack.errors import HostError, run_verb
from ddpack.images.engine import docker_client
from ddpack.jobs.report import write_report
from train import run_folder
from train.outcome import read_ends
from train.preflight.verdict import read_verdict

TRAINER_ARGS = ("--epochs", "3", "--log-every", "25", "--snapshot-dir", "/tmp/snapshots")
# DataLoader workers hand batches over in /dev/shm; Docker's default 64 MB kills them on real datasets.
SHM_SIZE = "2g"
# The preflight runs first, in its own two containers, with the same launch and trainer flags.
PREFLIGHT_ARGS = ("--preflight-seconds", "10")
# The run folder on the host (a job's shared folder) and where the containers see it.
RUNS_DIR = Path("build/smoke")
RUN_MOUNT = "/run/ddpack"


@dataclass
class Member:
    name: str
    container: Container
    lines: list[str] = field(default_factory=list)
    exit_code: int | None = None


def _stream(member: Member, lock: threading.Lock) -> None:
    buffer = b""
    for chunk in member.container.logs(stream=True, follow=True):
        buffer += chunk
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            line = raw.decode(errors="replace")
            member.lines.append(line)
            with lock:
                print(f"{member.name:>4} | {line}", flush=True)
    if buffer:
        member.lines.append(buffer.decode(errors="replace"))


def _member_env(variant: str, node: int, master: str) -> tuple[dict[str, str], list[str]]:
    if variant == "pair":
        return {"RANK": str(node), "WORLD_SIZE": "2", "MASTER_ADDR": master, "MASTER_PORT": "29500"}, []
    return {"NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": master, "MASTER_PORT": "29500", "RDZV_ID": "smoke"}, [
        "--nproc-per-node",
        "2",
    ]


def app_command(client: DockerClient, image: str) -> str:
    """The project command an image runs by default (its io.ddpack.app.command label), "" for none."""
    try:
        labels = client.images.get(image).attrs["Config"].get("Labels") or {}
    except ImageNotFound:
        raise HostError(f"image {image} not found; build it first: make image", code=2) from None
    return labels.get("io.ddpack.app.command", "")


def run_smoke(image: str, variant: str, timeout_s: float, trainer_args: tuple[str, ...] = TRAINER_ARGS) -> bool:
    """Run one smoke variant: the preflight in two containers, then training in two more; returns True
    when every check passes (and prints the report)."""
    client = docker_client()
    command = app_command(client, image)
    run_id = uuid.uuid4().hex[:8]
    network = client.networks.create(f"ddpack-smoke-{run_id}", driver="bridge")
    world = 2 if variant == "pair" else 4
    runs = f"the image's own command ({command})" if command else "the bundled trainer"
    print(f"smoke[{variant}]: {image}, 2 containers, world size {world}, network {network.name}, running {runs}", flush=True)
    run_dir = RUNS_DIR / f"{variant}-{run_id}"
    run_dir.mkdir(parents=True, exist_ok=True)
    preflight_args = ("--preflight", *PREFLIGHT_ARGS, "--preflight-json", f"{RUN_MOUNT}/{run_folder.PREFLIGHT}")
    # The project's program takes no trainer flags: the image runs it as it is.
    trainer_args = () if command else (*trainer_args, "--metrics-file", f"{RUN_MOUNT}/{run_folder.METRICS}")
    try:
        preflight = _run_phase(
            client, image, variant, network.name, f"{run_id}-preflight", (*preflight_args, *trainer_args), timeout_s, run_dir
        )
        if not _preflight_report(variant, preflight, timeout_s, run_dir):
            return False
        training = _run_phase(client, image, variant, network.name, run_id, trainer_args, timeout_s, run_dir)
        if command:
            return _app_report(variant, training, timeout_s)
        ok = _report(variant, training, world, timeout_s)
        _say_where_the_run_report_is(variant, run_dir)
        return ok
    finally:
        network.remove()


def _say_where_the_run_report_is(variant: str, run_dir: Path) -> None:
    """Writes the run report and prints where it is. A run that failed before its first record leaves no
    metrics: that is said in a line, not raised, since the failure above is what the user needs to see."""
    if not (run_dir / run_folder.METRICS).is_file():
        print(f"smoke[{variant}]: no run report (the run wrote no metrics: it ended before its first step)")
        return
    try:
        report = write_report(run_dir)[0]
    except HostError as exc:
        print(f"smoke[{variant}]: no run report ({exc})")
        return
    print(f"smoke[{variant}]: run report {report} (make it again: make report RUN={run_dir})")


def _run_phase(
    client: DockerClient, image: str, variant: str, network: str, name: str, args: tuple[str, ...], timeout_s: float, run_dir: Path
) -> list[Member]:
    """Two containers on `network` running `args`, streamed with a prefix, waited for, removed; both
    see `run_dir` at RUN_MOUNT, as a job's ranks see their shared folder."""
    members: list[Member] = []
    lock = threading.Lock()
    try:
        master = f"ddpack-smoke-{name}-0"
        for node in range(2):
            env, launcher_args = _member_env(variant, node, master)
            container = client.containers.run(
                image,
                command=[*launcher_args, *args],
                name=f"ddpack-smoke-{name}-{node}",
                hostname=f"ddpack-smoke-{name}-{node}",
                network=network,
                environment={**env, "OMP_NUM_THREADS": "1"},
                detach=True,
                labels={"io.ddpack.smoke": name},
                shm_size=SHM_SIZE,
                volumes={str(run_dir.absolute()): {"bind": RUN_MOUNT, "mode": "rw"}},
            )
            members.append(Member(f"c{node}", container))
        threads = [threading.Thread(target=_stream, args=(m, lock), daemon=True) for m in members]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout_s
        for member in members:
            remaining = max(1.0, deadline - time.monotonic())
            try:
                member.exit_code = member.container.wait(timeout=remaining)["StatusCode"]
            except Exception:  # requests' ReadTimeout: the job overran
                member.exit_code = None
        for thread in threads:
            thread.join(timeout=5)
        return members
    finally:
        for member in members:
            with contextlib.suppress(NotFound):
                member.container.remove(force=True)


def _text(members: list[Member]) -> str:
    return "\n".join(line for m in members for line in m.lines)


def _preflight_report(variant: str, members: list[Member], timeout_s: float, run_dir: Path) -> bool:
    """The preflight's verdict from its record in the run folder (train/preflight/verdict.py), not its log."""
    verdict = read_verdict(run_dir / run_folder.PREFLIGHT)
    ok = all(m.exit_code == 0 for m in members) and verdict is not None and verdict[0]
    said = verdict[1] if verdict else f"preflight: no verdict (no readable {run_folder.PREFLIGHT})"
    print(f"smoke[{variant}]: {said}; exit codes { ({m.name: m.exit_code for m in members}) }")
    if not ok:
        _show_failures(variant, members, timeout_s)
        print(f"smoke[{variant}]: FAIL (the preflight failed; training not started)", flush=True)
    return ok


def _report(variant: str, members: list[Member], world: int, timeout_s: float) -> bool:
    """The trainer's run, judged from its ranks' end records (train/outcome.py): all done, checksums agreeing."""
    ends = read_ends(_text(members))
    sums = [end.checksum for end in ends if end.outcome == "done" and end.checksum is not None]
    main = next((end for end in ends if end.rank == 0), None)
    codes = {m.name: m.exit_code for m in members}
    agree = len(sums) == world and len(set(sums)) == 1
    ok = all(code == 0 for code in codes.values()) and agree and main is not None and main.outcome == "done"
    print(f"smoke[{variant}]: exit codes {codes}")
    if main is not None and main.outcome == "done":
        loss = f"{main.final_loss:.5f}" if main.final_loss is not None else "n/a"
        print(f"smoke[{variant}]: final loss {loss}, steps/s {main.steps_per_s:.1f}, global steps {main.global_step}")
    elif main is not None:
        print(f"smoke[{variant}]: rank 0 ended {main.outcome} (exit {main.exit_code}): {main.reason or main.signal or ''}")
    print(f"smoke[{variant}]: checksums {'agree' if agree else 'DISAGREE or missing'} ({len(sums)}/{world} ranks: {sorted(set(sums))})")
    return _verdict(variant, members, timeout_s, ok)


def _app_report(variant: str, members: list[Member], timeout_s: float) -> bool:
    """A project's own program: what can be judged from outside is that every container exited 0."""
    codes = {m.name: m.exit_code for m in members}
    print(f"smoke[{variant}]: exit codes {codes}")
    return _verdict(variant, members, timeout_s, all(code == 0 for code in codes.values()))


def _verdict(variant: str, members: list[Member], timeout_s: float, ok: bool) -> bool:
    """A report's last words: the failed containers' last lines where it failed, then PASS or FAIL; `ok` again."""
    if not ok:
        _show_failures(variant, members, timeout_s)
    print(f"smoke[{variant}]: {'PASS' if ok else 'FAIL'}", flush=True)
    return ok


def _show_failures(variant: str, members: list[Member], timeout_s: float) -> None:
    for member in members:
        if member.exit_code != 0:
            why = "timed out" if member.exit_code is None else f"exit {member.exit_code}"
            print(f"smoke[{variant}]: {member.name} failed ({why} after at most {timeout_s:.0f}s); its last lines:", file=sys.stderr)
            for line in member.lines[-15:]:
                print(f"    {line}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ddpack.jobs.smoke", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--image", required=True, help="the CPU image to run, e.g. ddpack:1a2b3c4 (or a project's, from make image APP=DIR)"
    )
    parser.add_argument("--variant", choices=("pair", "torchrun", "all"), default="all")
    parser.add_argument("--timeout", type=float, default=300, help="seconds each variant may take")
    opts = parser.parse_args(argv)
    variants = ("pair", "torchrun") if opts.variant == "all" else (opts.variant,)

    def body() -> int:
        results = [run_smoke(opts.image, v, opts.timeout) for v in variants]
        if not all(results):
            raise HostError("smoke run failed; see the report above")
        return 0

    return run_verb("smoke", body)


if __name__ == "__main__":
    raise SystemExit(main())
