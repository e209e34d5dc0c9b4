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


class Staging:
    """DDPACK_STAGE's choice for this start, made and carried out on the batch host (ddpack-job.sh's
    ddpack_prepare_nodes): the image's path each node's pyxis imports. One line says the choice and why, and it is
    recorded (decisions.jsonl); a staging that fails is never the job's end: the nodes read the shared file instead.

    - off: every node reads DDPACK_SQSH from the shared filesystem (pyxis 0.19's own way): N reads of the image.
    - sbcast: one read: Slurm's sbcast sends it down a tree (fan-out DDPACK_STAGE_FANOUT) to the nodes' local disk,
      DDPACK_STAGE_DIR/<key>.sqsh, where <key> names the image's content; a node that already holds that key (an
      earlier job's copy) is skipped. DDPACK_STAGE_KEEP keys stay per node, and any key a live job of yours has chosen
      (the leases). DDPACK_STAGE_DIR is yours alone (docs/security.md).
    - auto: the nodes' copies when every node holds the image already (nothing read at all); else sbcast when the model
      (stage_by_model) says the nodes would wait less: from 5 nodes with the table's rates (DDPACK_FSX_MBPS,
      DDPACK_SBCAST_MBPS, DDPACK_UNPACK_MBPS).

    Every default is the settings table's (ddpack_settings.py)."""

    def __init__(self, sqsh: str, run_dir: Path, facts: JobFacts) -> None:
        self.sqsh, self.run_dir, self.facts, self.job = sqsh, run_dir, facts, facts.job
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
        count = len(self.facts.nodes or [])  # unknown: the prepare step cannot run, and the nodes read the shared file
        if mode != "off":
            try:
                key, size = image_key(Path(self.sqsh)), os.stat(self.sqsh).st_size
            except OSError:
                mode, why = "off", f"cannot read {self.sqsh}"
        # One step on every node (prepare): containers of this user's jobs that are over (scancelled, timed out, killed
        # with their script) go, and each node checks its staging folder, leases the key for this job and answers
        # whether it holds a copy it can trust (has / lacks), or why it will not stage (refuse). A GPU job checks that
        # every node has the GPUs it was promised, first.
        gpus = self.facts.gpus_per_node
        answers, rc = self.on_nodes(nodes, count, "prepare", "--key", key, "--size", str(size), "--gpus", str(gpus))
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
        refused = [line.removeprefix("refuse ") for line in lines if line.startswith("refuse ")]
        answered = [line for line in lines if line.startswith(("has ", "lacks "))]
        if mode != "off" and refused:
            mode, why = "off", f"staging refused on {refused[0]}"
        elif mode != "off" and (rc != 0 or len(answered) != count):
            mode, why = "off", f"staging failed: not every node answered whether it holds the image (exit {rc})"
        lacking = sorted((line.split()[1] for line in answered if line.startswith("lacks ")), key=natural)
        if mode == "auto" and lacking:
            mode = stage_by_model(count, self.fsx, self.bcast, self.unpack)
            why = f"DDPACK_STAGE=auto: for {count} node(s) the model has the shared filesystem ahead of sbcast"
        if mode == "off":
            return self.shared(why)
        copy = f"{self.dir}/{key}.sqsh"
        if not lacking:
            say(f"image: all {count} nodes hold {copy} already; the shared filesystem is not read")
            write_record(
                self.run_dir, "staging", {"choice": "held", "why": f"every node holds this image's copy (key {key})", "sqsh": self.sqsh}
            )
            return copy
        return copy if self.send(key, size, ",".join(lacking)) else self.sqsh

    def shared(self, why: str) -> str:
        say(f"image: every node reads {self.sqsh} ({why})")
        write_record(self.run_dir, "staging", {"choice": "shared", "why": why, "sqsh": self.sqsh})
        return self.sqsh

    def on_nodes(self, nodes: str, count: int, verb: str, *args: str) -> tuple[str, int]:
        """ddpack_node.py's VERB on each of `nodes`: (what they printed, srun's status); their warnings pass through."""
        out = command(on_each_node(nodes, count, self.node_verb(verb, *args)), stdout=subprocess.PIPE, text=True)
        return out.stdout, out.returncode

    def node_verb(self, verb: str, *args: str) -> list[str]:
        """A node's VERB with this staging's folder, job and keep (ddpack_node.py parses each once)."""
        return node_program(verb, "--dir", self.dir, "--job", self.job, "--keep", str(self.keep), *args)

    def send(self, key: str, size: int, lacking: str) -> bool:
        """sbcast the image to the `lacking` nodes into DIR as KEY.sqsh: a step that holds those nodes (sbcast sends to a
        step's nodes) and makes on each a new private folder for it (receive: sbcast never writes through a name another
        user could have planted), the copy, then each node checks it (ours, a plain file, the whole size) and renames it
        into place (install). On a failure one line names the node and why, and this start reads the shared file."""
        count = len(lacking.split(","))  # the lacking nodes' own names
        incoming = f".incoming-{self.job}-{os.urandom(8).hex()}"
        started = time.monotonic()
        try:
            handoff = Path(tempfile.mkdtemp(prefix=f".ddpack-stage-{self.job}.", dir=self.run_dir))
        except OSError:
            return self.failed(
                f"staging the image failed: cannot make a folder in {self.run_dir}; this start reads {self.sqsh} on every node"
            )
        errors_file = Path(f"{handoff}.err")
        # Each node: the receiving folder (ddpack_node.py receive, the words after $1), then its step's id for sbcast, then
        # the step holds the node.
        script = '"${@:2}" || exit 1\necho "${SLURM_STEP_ID}" >"$1/${SLURMD_NODENAME}"\nexec sleep 3600'
        receive = self.node_verb("receive", "--incoming", incoming)
        try:
            with open(errors_file, "w") as errors:  # srun's lines about the step's cancel; only a node's refusal is shown
                holder = subprocess.Popen(
                    on_each_node(lacking, count, ["bash", "-c", script, "_", str(handoff), *receive], "--quiet"),
                    stdout=subprocess.DEVNULL, stderr=errors,
                )  # fmt: skip
        except OSError as why:
            shutil.rmtree(handoff, ignore_errors=True)
            errors_file.unlink(missing_ok=True)
            return self.failed(f"staging the image failed: srun: {one_line(why)}; this start reads {self.sqsh} on every node")
        try:
            deadline = time.monotonic() + 120
            while len(list(handoff.iterdir())) < count:
                if holder.poll() is not None or time.monotonic() > deadline:
                    said = [line for line in errors_file.read_text().splitlines() if line.strip() and not line.startswith("srun")]
                    return self.failed(
                        f"staging the image failed: could not make a private folder to receive it on {lacking} "
                        f"({said[0] if said else 'no message'}); this start reads {self.sqsh} on every node"
                    )
                time.sleep(0.2)
            step = next(handoff.iterdir()).read_text().strip()
            sent = command(
                ["sbcast", f"--fanout={self.fanout}", f"--jobid={self.job}.{step}", self.sqsh, f"{self.dir}/{incoming}/{key}.sqsh"],
                capture_output=True, text=True,
            )  # fmt: skip
            command(["scancel", "--quiet", f"{self.job}.{step}"], capture_output=True)
        finally:
            with contextlib.suppress(ProcessLookupError):
                holder.terminate()
            holder.wait()
            shutil.rmtree(handoff, ignore_errors=True)
            errors_file.unlink(missing_ok=True)
        install = ("--key", key, "--size", str(size), "--incoming", incoming)
        argv = on_each_node(lacking, count, self.node_verb("install", *install))
        if sent.returncode != 0:
            failed = self.failed(
                f"staging the image failed: sbcast to {lacking}: {last_line(sent.stdout + sent.stderr)}; this start reads {self.sqsh} on every node"
            )
            command(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # what sbcast left goes with the receiving folders
            return failed
        done = command(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        said = [line for line in done.stdout.splitlines() if line.strip()]
        removed = [line for line in said if line.startswith("ddpack: removed")]
        if done.returncode != 0:
            first = next((line for line in said if line not in removed), "no message")
            return self.failed(f"staging the image failed on {first}; this start reads {self.sqsh} on every node")
        for line in removed:
            write_line(sys.stdout, line)
        seconds = f"{time.monotonic() - started:.3f}"
        say(f"image: sent {self.sqsh} ({size // 1048576} MiB) once, by sbcast, to {lacking} as {self.dir}/{key}.sqsh in {seconds} s")
        sent_record = {"choice": "sent", "why": "sbcast to the nodes lacking it", "nodes": lacking, "sqsh": self.sqsh, "seconds": seconds}
        write_record(self.run_dir, "staging", sent_record)
        return True

    def failed(self, why: str) -> bool:
        """A staging that failed: one line, and the record of this start reading the shared file instead."""
        say(why)
        write_record(self.run_dir, "staging", {"choice": "shared", "why": why})
        return False
