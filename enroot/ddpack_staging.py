"""ddpack_staging.py — the image on the nodes: DDPACK_STAGE's choice for a start, made and carried out on the batch host.

Standard library only (enroot/ddpack_job.py loads it; the host's `ddpack submit` loads `image_key` and
`stage_by_model` from here too, so the key and the model have one definition). What each node does for it is
ddpack_node.py's, the only text the nodes are sent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddpack_node import last_line, one_line, write_line
from ddpack_records import checked_settings, die, job_error, say, write_record
from ddpack_slurm import JobFacts, command, natural, node_program, on_each_node


def image_key(sqsh: Path) -> str:
    """A name for the image: its content's, from make sqsh's record beside it (the Docker image's id and the squash
    options) while the record describes the file as it is; else the file's version (size, modification time, inode
    and path: no read of the file; a copy made again is a new name and is sent again)."""
    info = os.stat(sqsh)
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError):
        record = json.loads(Path(f"{sqsh}.ddpack.json").read_text())
        image_id = str(record["image_id"]).removeprefix("sha256:")
        if re.fullmatch(r"[0-9a-f]{64}", image_id) and record["size"] == info.st_size and record["mtime_ns"] == info.st_mtime_ns:
            options = hashlib_hex(str(record.get("squash_options", "")))[:8]
            return f"{image_id[:24]}-{options}"
    return hashlib_hex(f"file {info.st_size} {int(info.st_mtime)} {info.st_ino} {sqsh}")[:32]


def image_command(sqsh: str) -> str | None:
    """The command the squashfs's image runs when given none (its APP_CMD; "" for none, so the bundled trainer), from
    make sqsh's record beside it while the record describes the file as it is; None when no record says (a squashfs
    made by another tool, by an older ddpack, or changed since): the job then cannot tell what its tasks run."""
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError, KeyError):
        info = os.stat(sqsh)
        record = json.loads(Path(f"{sqsh}.ddpack.json").read_text())
        if record["size"] == info.st_size and record["mtime_ns"] == info.st_mtime_ns and isinstance(record["app_cmd"], str):
            return record["app_cmd"]
    return None


def hashlib_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def check_image(sqsh: str) -> None:
    """The squashfs the job will import is not a file other users can replace: not writable by them, in no folder
    they can write without a sticky bit. Its owner may be anyone: the user chose it (a team's images folder, an
    admin's)."""
    real = Path(os.path.realpath(sqsh))
    info = os.stat(real)
    if info.st_mode & 0o022:
        mode = f"{stat.S_IMODE(info.st_mode):o}"
        die(f"DDPACK_SQSH={sqsh} is writable by other users (mode {mode}): any of them could replace what your job runs; chmod go-w it")
    for folder in real.parents:
        mode = os.stat(folder).st_mode
        if mode & 0o022 and not mode & stat.S_ISVTX:
            die(
                f"DDPACK_SQSH={sqsh}: {folder} is writable by other users and not sticky, so any of them could swap the image; "
                "keep images in a folder only you (or root) can write"
            )


def stage_by_model(nodes: int, fsx: int, bcast: int, unpack: int) -> str:
    """sbcast or off for `nodes` nodes: the model's choice (ddpack/jobs/goodput_model.py, without the tree's few blocks) at
    FSX, SBCAST and UNPACK MB/s: N unpacks from the shared filesystem at once wait size / min(unpack, fsx / N); sbcast
    then an unpack from local disk, size / sbcast + size / unpack."""
    return "sbcast" if nodes * bcast * unpack > fsx * (bcast + unpack) and nodes * unpack > fsx else "off"


HOLD_DEADLINE_S = 120  # seconds the holder step's nodes get to make their receiving folders
SEND_ROUNDS = 3  # sbcast rounds at most: a round that fails on named nodes is sent again to the others
UNPACK_FACTOR = 4  # a compressed squashfs's unpacked size, at most, as a multiple of its own (zstd's here: 3.2)
# sbcast's fan-out before Slurm 23.11: 8 at most, and it sets the first hop alone (every later hop forwards to slurm.conf's
# TreeWidth, 50 by default); from 23.11 it sets every hop (--treewidth, which --fanout names too), up to 64.
SBCAST_FANOUT_BEFORE_23_11 = 8
SBCAST_NODE_ERROR = re.compile(r"REQUEST_FILE_BCAST\(([^)]+)\): (.*)")  # sbcast's line for a node it could not write to


def unpacked_bytes(sqsh: str, size: int) -> int:
    """What enroot takes on a node's disk to unpack the image, for the free-space check, without opening the shared
    file (a start whose nodes all hold a copy reads nothing from it): its own size when make sqsh's record beside it
    says its data is stored uncompressed (`-noD`, make sqsh's default) while the record describes the file, else
    UNPACK_FACTOR times it, the bound for a compressed image (a squashfs copied without its record, as the README's
    `cp` does, is taken as compressed: a node short of room for that reads the shared file alone, with a line)."""
    with contextlib.suppress(OSError, ValueError, AttributeError, TypeError, KeyError):
        info = os.stat(sqsh)
        record = json.loads(Path(f"{sqsh}.ddpack.json").read_text())
        if record["size"] == info.st_size and record["mtime_ns"] == info.st_mtime_ns and "-noD" in str(record["squash_options"]).split():
            return size
    return size * UNPACK_FACTOR


def slurm_version(text: str) -> tuple[int, int] | None:
    """(major, minor) from `sbcast --version`'s line ("slurm 23.11.4", "slurm-wlm 22.05.8"), None when it names none."""
    found = re.search(r"\b(\d+)\.(\d+)(?:\.\d+)?\b", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def sbcast_fanout(wanted: int) -> tuple[int, str]:
    """The fan-out sbcast is given for DDPACK_STAGE_FANOUT=`wanted`, and a line for people when it is not `wanted`. Up to
    8 every Slurm takes it (and asks nothing); above 8, sbcast's version is asked once: 23.11 and later take up to 64 (on
    every hop); before, 8 at most, for the first hop only."""
    if wanted <= SBCAST_FANOUT_BEFORE_23_11:
        return wanted, ""
    said = command(["sbcast", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    version = slurm_version(said)
    if version is not None and version >= (23, 11):
        return wanted, ""
    which = f"Slurm {version[0]}.{version[1]:02d}" if version else f"this sbcast ({said or 'no version given'})"
    return SBCAST_FANOUT_BEFORE_23_11, (
        f"DDPACK_STAGE_FANOUT={wanted}: {which} takes a fan-out of {SBCAST_FANOUT_BEFORE_23_11} at most, for sbcast's first hop only "
        f"(later hops use slurm.conf's TreeWidth); sending with {SBCAST_FANOUT_BEFORE_23_11}"
    )


def by_node(lines: list[str], word: str) -> dict[str, str]:
    """{NODE: why} from the lines `WORD NODE why...` nodes answer (prepare's refuse, install's failed)."""
    found = {}
    for line in lines:
        if line.startswith(f"{word} ") and len(parts := line.split(" ", 2)) > 1:
            found[parts[1]] = parts[2] if len(parts) > 2 else "no reason given"
    return found


class Staging:
    """DDPACK_STAGE's choice for this start, made and carried out on the batch host (ddpack-job.sh's
    ddpack_prepare_nodes): the image's path each node's pyxis imports. One line says the choice and why, and it is
    recorded (decisions.jsonl); a staging that fails is never the job's end.

    - off: every node reads DDPACK_SQSH from the shared filesystem (pyxis 0.19's own way): N reads of the image.
    - sbcast: one read: Slurm's sbcast sends it down a tree (fan-out DDPACK_STAGE_FANOUT) to the nodes' local disk,
      DDPACK_STAGE_DIR/<key>.sqsh, where <key> names the image's content; a node that already holds that key (an
      earlier job's copy) is skipped. DDPACK_STAGE_KEEP keys stay per node, and any key a live job of yours has chosen
      (the leases). DDPACK_STAGE_DIR is yours alone (docs/security.md).
    - auto: the nodes' copies when every node holds the image already (nothing read at all); else sbcast when the model
      (stage_by_model) says the nodes would wait less: from 5 nodes with the table's rates (DDPACK_FSX_MBPS,
      DDPACK_SBCAST_MBPS, DDPACK_UNPACK_MBPS).

    One bad node costs one node: a node that refuses (its folder, too little free space for the copy and its unpack:
    checked before anything is copied), does not answer, misses the holder step's deadline, or whose sbcast or install
    fails reads the shared file alone, with one line and one record naming it and why, and the others keep their
    copies. It gets its own container from the shared file before the job's first step (pyxis then reuses the named
    container there and never opens the local path); with no named container to give it, every node reads the shared
    file, as they all do when no node could stage.

    Every default is the settings table's (ddpack_settings.py)."""

    def __init__(self, sqsh: str, run_dir: Path, facts: JobFacts, container: str = "") -> None:
        self.sqsh, self.run_dir, self.facts, self.job, self.container = sqsh, run_dir, facts, facts.job, container
        numbers = ("DDPACK_STAGE_KEEP", "DDPACK_FSX_MBPS", "DDPACK_SBCAST_MBPS", "DDPACK_UNPACK_MBPS", "DDPACK_STAGE_FANOUT")
        settings = checked_settings(run_dir, ("DDPACK_STAGE", "DDPACK_STAGE_DIR", *numbers))
        self.mode, self.dir = settings["DDPACK_STAGE"], settings["DDPACK_STAGE_DIR"]
        self.keep, self.fsx, self.bcast, self.unpack, self.fanout = (int(settings[name]) for name in numbers)

    def choose(self) -> str:
        """The path --container-image names: the shared file, or each node's local copy (sent now, or held already)."""
        mode, why, key, size = self.mode, "DDPACK_STAGE=off", "", 0
        if self.sqsh.startswith("/"):
            check_image(self.sqsh)  # nobody else can swap what the job runs
        else:
            mode, why = "off", "not a file: pyxis imports it on every node"
        nodes = self.facts.nodelist
        every = self.facts.nodes or []
        count = len(every)  # unknown: the prepare step cannot run, and the nodes read the shared file
        if mode != "off":
            try:
                key, size = image_key(Path(self.sqsh)), os.stat(self.sqsh).st_size
            except OSError:
                mode, why = "off", f"cannot read {self.sqsh}"
        # One step on every node (prepare): containers of this user's jobs that are over (scancelled, timed out, killed
        # with their script) go, and each node checks its staging folder and its free space, leases the key for this job
        # and answers whether it holds a copy it can trust (has / lacks), or why it will not stage (refuse). A GPU job
        # checks that every node has the GPUs it was promised, first.
        gpus = self.facts.gpus_per_node
        need = str(size + unpacked_bytes(self.sqsh, size)) if key else "0"
        answers, rc = self.on_nodes(nodes, count, "prepare", "--key", key, "--size", str(size), "--gpus", str(gpus), "--need", need)
        lines = answers.splitlines()
        short = sorted((line.split(" ", 1)[1] for line in lines if line.startswith("nogpu ")), key=natural)
        none = [entry for entry in short if entry.split()[1] == "0"]
        if none:
            node, has = none[0].split(" ", 1)
            job_error(
                self.run_dir,
                f"this job was promised {gpus} GPU(s) a node, but {node} has {has} here, so the image would train on the CPU "
                "or fail; submit GPU jobs to a partition whose nodes have their GPUs, or drop --gpus-per-node to train on CPUs (not requeued)",
            )
        if short:
            say(
                f"warning: fewer GPU devices than the {gpus} promised a node (MIG slices share one device; else a GPU is missing): {';'.join(short)}"
            )
        answered = {line.split()[1]: line.split()[0] for line in lines if line.startswith(("has ", "lacks ")) and len(line.split()) == 2}
        failing = by_node(lines, "refuse")
        if mode != "off":
            for node in every:
                if node not in answered and node not in failing:
                    failing[node] = f"did not answer the prepare step (srun exit {rc})"
            if not answered:  # no node can stage: the shared file, for all, with the first node's reason
                first = min(failing, key=natural) if failing else ""
                mode = "off"
                why = (
                    f"staging failed on every node; {first}: {failing[first]}" if first else f"staging failed: no node answered (exit {rc})"
                )
            elif failing and not self.container:
                first = min(failing, key=natural)
                mode, why = "off", f"staging failed on {first} ({failing[first]}) and the job names no container to give it its own"
        lacking = sorted((node for node, answer in answered.items() if answer == "lacks"), key=natural)
        if mode == "auto" and lacking:
            mode = stage_by_model(count, self.fsx, self.bcast, self.unpack)
            why = f"DDPACK_STAGE=auto: for {count} node(s) the model has the shared filesystem ahead of sbcast"
        if mode == "off":
            return self.shared(why)
        copy = f"{self.dir}/{key}.sqsh"
        if lacking:
            failing.update(self.send(key, size, lacking))
        elif not failing:
            say(f"image: all {count} nodes hold {copy} already; the shared filesystem is not read")
            write_record(
                self.run_dir, "staging", {"choice": "held", "why": f"every node holds this image's copy (key {key})", "sqsh": self.sqsh}
            )
        if len(failing) == count:
            first = min(failing, key=natural)
            return self.shared(f"staging failed on every node; {first}: {failing[first]}")
        if failing:
            if not lacking:
                kept = count - len(failing)
                say(f"image: {kept} of {count} nodes hold {copy} already")
                write_record(
                    self.run_dir, "staging", {"choice": "held", "why": f"the nodes that staged hold this image's copy (key {key})", "sqsh": self.sqsh}
                )  # fmt: skip
            self.alone(failing)
        return copy

    def shared(self, why: str) -> str:
        say(f"image: every node reads {self.sqsh} ({why})")
        write_record(self.run_dir, "staging", {"choice": "shared", "why": why, "sqsh": self.sqsh})
        return self.sqsh

    def alone(self, failing: dict[str, str]) -> None:
        """Each node that could not stage reads the shared file alone, named, with why: its container (the job's named
        one) made from the shared file now, in one step on those nodes, so that every later step of the job reuses it
        there and never opens the local copy that node lacks."""
        for node in sorted(failing, key=natural):
            say(f"image: {node} reads {self.sqsh} from the shared file alone ({failing[node]}); the other nodes keep their copies")
            write_record(self.run_dir, "staging", {"choice": "shared", "node": node, "why": failing[node], "sqsh": self.sqsh})
        names = sorted(failing, key=natural)
        options = (f"--container-image={self.sqsh}", f"--container-name={self.container}")
        made = command(on_each_node(",".join(names), len(names), ["true"], *options), stdout=subprocess.DEVNULL, text=True)
        if made.returncode != 0:
            say(
                f"warning: making the container from {self.sqsh} on {','.join(names)} failed (srun exit {made.returncode}); their step will try again"
            )

    def on_nodes(self, nodes: str, count: int, verb: str, *args: str) -> tuple[str, int]:
        """ddpack_node.py's VERB on each of `nodes`: (what they printed, srun's status); their warnings pass through."""
        out = command(on_each_node(nodes, count, self.node_verb(verb, *args)), stdout=subprocess.PIPE, text=True)
        return out.stdout, out.returncode

    def node_verb(self, verb: str, *args: str) -> list[str]:
        """A node's VERB with this staging's folder, job and keep (ddpack_node.py parses each once)."""
        return node_program(verb, "--dir", self.dir, "--job", self.job, "--keep", str(self.keep), *args)

    def send(self, key: str, size: int, lacking: list[str]) -> dict[str, str]:
        """sbcast the image to the `lacking` nodes, in rounds (send_round): a round that fails on nodes it can name is
        sent again to the rest, so that one node's failure is that node's alone. Returns the nodes that got no copy, each
        with why; the ones that did are said and recorded."""
        started = time.monotonic()
        self.fanout, capped = sbcast_fanout(self.fanout)
        if capped:
            say(capped)
        failing: dict[str, str] = {}
        pending = lacking
        for _ in range(SEND_ROUNDS):
            if not pending:
                break
            failed, pending = self.send_round(key, size, pending)
            failing.update(failed)
        failing.update({node: f"no copy after {SEND_ROUNDS} sbcast rounds" for node in pending})
        sent = [node for node in lacking if node not in failing]
        if sent:
            seconds = f"{time.monotonic() - started:.3f}"
            nodes = ",".join(sent)
            say(f"image: sent {self.sqsh} ({size // 1048576} MiB) once, by sbcast, to {nodes} as {self.dir}/{key}.sqsh in {seconds} s")
            record = {"choice": "sent", "why": "sbcast to the nodes lacking it", "nodes": nodes, "sqsh": self.sqsh, "seconds": seconds}
            write_record(self.run_dir, "staging", record)
        return failing

    def send_round(self, key: str, size: int, nodes: list[str]) -> tuple[dict[str, str], list[str]]:
        """One sbcast to `nodes`: a step that holds them (sbcast sends to a step's nodes) and makes on each a new private
        folder for it (receive: sbcast never writes through a name another user could have planted), the copy, then each
        node checks it (ours, a plain file, the whole size) and renames it into place (install). Returns (the nodes that
        failed by their own fault, each with why; the nodes to send to again, who failed only because another did).

        sbcast stops for every node at the first one it cannot write to, so a node whose folder was refused or that
        missed the holder's deadline is left out of the round before anything is sent, and a node sbcast names is left out
        of the next."""
        count, hostlist = len(nodes), ",".join(nodes)
        incoming = f".incoming-{self.job}-{os.urandom(8).hex()}"
        try:
            handoff = Path(tempfile.mkdtemp(prefix=f".ddpack-stage-{self.job}.", dir=self.run_dir))
        except OSError:
            return dict.fromkeys(nodes, f"cannot make a folder in {self.run_dir} to hand the sbcast step over"), []
        errors_file = Path(f"{handoff}.err")
        # Each node: the receiving folder (ddpack_node.py receive, the words after $1), then its step's id for sbcast, or
        # why it could not; either way the step holds the node (its task never ends first, whatever KillOnBadExit says).
        script = (
            'if why=$("${@:2}" 2>&1); then echo "${SLURM_STEP_ID}" >"$1/.${SLURMD_NODENAME}"; mv "$1/.${SLURMD_NODENAME}" "$1/${SLURMD_NODENAME}"\n'
            'else printf "%s\\n" "${why}" >"$1/.${SLURMD_NODENAME}"; mv "$1/.${SLURMD_NODENAME}" "$1/${SLURMD_NODENAME}.failed"; fi\n'
            "exec sleep 3600"
        )
        receive = self.node_verb("receive", "--incoming", incoming)
        try:
            with open(errors_file, "w") as errors:  # srun's lines about the step's cancel; only a node's refusal is shown
                holder = subprocess.Popen(
                    on_each_node(hostlist, count, ["bash", "-c", script, "_", str(handoff), *receive], "--quiet"),
                    stdout=subprocess.DEVNULL, stderr=errors,
                )  # fmt: skip
        except OSError as why:
            shutil.rmtree(handoff, ignore_errors=True)
            errors_file.unlink(missing_ok=True)
            return dict.fromkeys(nodes, f"srun: {one_line(why)}"), []
        sent = None
        try:
            deadline = time.monotonic() + HOLD_DEADLINE_S
            while True:
                reported = {entry.name for entry in handoff.iterdir() if not entry.name.startswith(".")}
                ended = holder.poll() is not None
                if all(node in reported or f"{node}.failed" in reported for node in nodes) or ended or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            ready = [node for node in nodes if node in reported]
            failed: dict[str, str] = {}
            for node in nodes:
                if f"{node}.failed" in reported:
                    text = (handoff / f"{node}.failed").read_text().strip()
                    failed[node] = f"could not make a private folder to receive the image ({last_line(text).removeprefix(f'{node}: ')})"
                elif node not in reported:
                    said = [line for line in errors_file.read_text().splitlines() if line.strip() and not line.startswith("srun")]
                    failed[node] = (
                        f"the holder step ended before it made its receiving folder ({said[0] if said else 'no message'})"
                        if ended
                        else f"missed the holder step's deadline ({HOLD_DEADLINE_S} s) to make its receiving folder"
                    )
            step = (handoff / ready[0]).read_text().strip() if ready else ""
            if not failed:
                sent = command(
                    ["sbcast", f"--fanout={self.fanout}", f"--jobid={self.job}.{step}", self.sqsh, f"{self.dir}/{incoming}/{key}.sqsh"],
                    capture_output=True, text=True,
                )  # fmt: skip
            if step:
                command(["scancel", "--quiet", f"{self.job}.{step}"], capture_output=True)
        finally:
            with contextlib.suppress(ProcessLookupError):
                holder.terminate()
            holder.wait()
            shutil.rmtree(handoff, ignore_errors=True)
            errors_file.unlink(missing_ok=True)
        if sent is None:  # a node failed before anything was sent: the others go again without it
            return failed, ready
        # Every node checks what it got (and what sbcast left goes with its receiving folder), whatever sbcast said.
        install = ("--key", key, "--size", str(size), "--incoming", incoming)
        done = command(
            on_each_node(hostlist, count, self.node_verb("install", *install)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        said = [line for line in done.stdout.splitlines() if line.strip()]
        for line in said:
            if line.startswith("ddpack: removed"):
                write_line(sys.stdout, line)
        installed = {line.split()[1] for line in said if line.startswith("installed ") and len(line.split()) == 2}
        why_install = by_node(said, "failed")
        if sent.returncode == 0:
            return {
                node: f"install: {why_install.get(node, 'no answer from the install step')}" for node in nodes if node not in installed
            }, []
        named = {
            found.group(1): found.group(2) for line in (sent.stdout + sent.stderr).splitlines() if (found := SBCAST_NODE_ERROR.search(line))
        }
        failed = {node: f"sbcast: {named[node]}" for node in nodes if node in named and node not in installed}
        others = [node for node in nodes if node not in installed and node not in named]
        if failed:  # sbcast named its bad nodes: the others are sent again without them
            return failed, others
        return {node: f"sbcast: {last_line(sent.stdout + sent.stderr)}" for node in others}, []
