"""ddpack_training.py — the training step, restarted in its allocation while it can, then the job's end or its requeue.

Standard library only, on the batch host: enroot/ddpack_job.py's `train` verb (the template's last line, ddpack_train,
becomes it) runs `Training`. Each restart decision reads Slurm once (ddpack_slurm.JobFacts) and says itself twice: a
line for people and a record for `ddpack status` (ddpack_records).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from ddpack_node import one_line, warn, write_private
from ddpack_records import (
    DECISIONS,
    FAILURE_RESTARTS,
    FORENSICS,
    LOST_NODES,
    MARKER,
    METRICS,
    REPORT,
    RUN_RECORD,
    SUMMARY,
    UNRESPONSIVE_NODES,
    checked_settings,
    give_back_run_folder,
    job_error,
    read_nofollow,
    say,
    write_record,
)
from ddpack_settings import Recovery, recovery, step_program, value
from ddpack_slurm import SQUEUE_TIMEOUT_S, JobFacts, command, hostnames, natural, on_each_node
from ddpack_staging import image_command
from ddpack_step import run_step
from ddpack_step_records import StepRecords, metrics_size


def read_count(path: Path) -> int:
    """The number in `path`; 0 where there is none yet. A file that is there but cannot be read, or holds no number,
    counts as 0 too: the count that follows must then be written, and a restart that cannot be is not made."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return 0
    return int(text) if re.fullmatch(r"[0-9]{1,9}", text) else 0


def task_hosts(nodes: list[str], per_node: int, standbys: int, spares: list[str] | None = None) -> list[str]:
    """Each task's node, in task order, for a step with `standbys` standby tasks after the ranks (SLURM_HOSTFILE): the
    ranks as srun's block distribution places them (`per_node` on each node, in order), then the standbys one a node
    from the first, then the store task (DDPACK_STORE_TASK=1, train/recovery.py's `serve_store`: the job's store in a
    process that is no rank, so that rank 0's death is recovered as any rank's) on the first node, whose name is the
    store's address (MASTER_ADDR). The recovery prefers a standby on another node than the dead rank's (`decide`). The
    nodes go in Slurm's order whatever order the placement chose: each task takes the step's first node
    (SLURM_STEP_NODELIST, which Slurm sorts) for the store's address (entrypoint/plan.py).

    With `spares` (the job's spare nodes, DDPACK_SPARE_NODES) the standbys live there instead, `per_node` on each, in
    order, so that one spare can take a lost node's ranks at once (`decide` prefers standbys all on one node); no
    standby shares a node that trains. The store task goes on the step's first node as ever: a training node, as
    spares are the job's last nodes."""
    nodes = sorted(nodes, key=natural)
    ranks = [node for node in nodes for _ in range(per_node)]
    if not standbys:
        return ranks
    if spares:
        spares = sorted(spares, key=natural)
        return [*ranks, *(node for node in spares for _ in range(per_node)), min(nodes[0], spares[0], key=natural)]
    return [*ranks, *(nodes[index % len(nodes)] for index in range(standbys)), nodes[0]]


def newer(path: Path, than: Path) -> bool:
    """`test PATH -nt THAN`: PATH exists and was changed after THAN (or THAN is missing)."""
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return False
    try:
        return mtime > than.stat().st_mtime_ns
    except OSError:
        return True


def remove_container(facts: JobFacts, name: str) -> None:
    """Remove the job's container from every node it holds now (pyxis keeps named containers after the job unless its
    plugstack.conf sets container_scope=job, when pyxis calls it pyxis_<job>_<name> and removes it itself, so a missing
    pyxis_<name> is not an error). One task per node, with the node's own enroot (the one pyxis runs)."""
    remove = ["bash", "-c", 'enroot remove -f "pyxis_$1" >/dev/null 2>&1 || true', "_", name]
    command(on_each_node(facts.nodelist, len(facts.nodes or []), remove))


class Training:
    """The training step, restarted in this allocation while it can, then the job's end or its requeue (ddpack-job.sh's
    ddpack_train). The step's exit status decides, whatever ran (the bundled trainer, your DDPACK_COMMAND, the image's
    own):

    - 0 done; 2 bad input (never retried: the error line says what to fix);
    - 128+10 / 128+15 (138, 143) stopped on SIGUSR1/SIGTERM: preempted (or the time limit's warning): back to the queue,
      requeued up to DDPACK_MAX_RESTARTS;
    - anything else (124 a hang the watchdog ended, 137 a SIGKILL such as the OOM killer's or srun's for a rank still
      frozen DDPACK_STEP_WAIT seconds after the others ended, 1 a crash or a lost peer or node): a failure, retried up to
      DDPACK_MAX_FAILURE_RESTARTS times per run folder. A retry restarts the step in this allocation when enough
      healthy nodes remain (a spare swapped in for a bad node; DDPACK_RESTART_IN_PLACE=0 turns that off), else requeues
      the job, keeping out the nodes a hang's forensics named unresponsive where the partition has others to spare. A
      hang is told by its exit 124 or by forensics written during this start (the frozen rank's 137 is the step's
      status then). A step Slurm ended because the job lost a node (143) is a failure of the node, not a preemption.

    DDPACK_SPARE_NODES=K: the job's last K nodes are spares; training runs on the others, and a restart swaps a spare
    in for a node that failed. Each decision is one line for people and a record for `ddpack status`."""

    def __init__(self, step: list[str], command: list[str], container: str = "", *, tasks_are_ranks: bool = True) -> None:
        env = os.environ
        self.step, self.command, self.container = step, command, container
        self.job, self.run_dir = env["SLURM_JOB_ID"], Path(env["DDPACK_RUN_DIR"])
        names = (
            "DDPACK_SPARE_NODES",
            "DDPACK_RESTART_IN_PLACE",
            "DDPACK_MAX_RESTARTS",
            "DDPACK_MAX_FAILURE_RESTARTS",
            "DDPACK_STANDBYS",
            "DDPACK_STEP_WAIT",
        )
        settings = checked_settings(self.run_dir, names)
        self.spares = int(settings["DDPACK_SPARE_NODES"])
        self.in_place = settings["DDPACK_RESTART_IN_PLACE"] == "1"
        self.max_restarts = int(settings["DDPACK_MAX_RESTARTS"])
        self.max_failed = int(settings["DDPACK_MAX_FAILURE_RESTARTS"])
        self.now = JobFacts(self.job)  # what Slurm says of the job, read once a decision (after_step starts a new one)
        # The standbys with the spares hosting them, and without (where no spare is left to host them).
        self.recovery, self.plain_recovery = self.choose_recovery(settings["DDPACK_STANDBYS"], tasks_are_ranks)
        self.standbys = self.recovery.standbys
        self.step_standbys = 0  # the standbys the step running now started (`standby_step` sets it for each step)
        self.store_task: int | None = None  # the task of the step running now that serves the job's store (its last)
        self.step_spares: list[str] = []  # the spare nodes hosting them ([]: none, or the standbys on the training nodes)
        self.moving = threading.Lock()  # `follow_recovery` and `fence` are called from the step's output readers
        self.lost_in_step: list[str] = []  # the nodes srun said failed in the step running now (`fence`)
        self.step_wait = int(settings["DDPACK_STEP_WAIT"])
        self.restarts = int(env.get("SLURM_RESTART_COUNT") or 0)
        self.failed = 0  # failure restarts counted during this start: the cap holds if the run folder's count is lost
        self.bad_nodes: list[str] = []  # nodes out for the whole job: a hang's forensics named them, the preflight failed them, ...
        self.last_nodes: list[str] = []  # the nodes the last training step ran on
        self.placement: list[str] = []  # srun's options that put the step on them (none: the whole allocation)
        self.short = ""  # why no placement was found
        self.keep_out: list[str] = []
        self.crashed = ""  # the node srun named first for a task that crashed in the last step
        self.progress = ""  # whether the last step wrote progress records: yes, no, "" (no metrics file)
        self.fallback = ""  # why the trainer's in-process recovery fell back to this restart ("": it did not)
        self.recovered = 0  # ranks the last step replaced in process (the trainer's `recovery` records)
        self.crashes: dict[str, int] = {}  # crashes by node during this start: a second one puts the node out for the job
        self.avoid: list[str] = []  # nodes the next placement uses only where no other healthy node is left
        self.preflight_out = self.swapped_by_preflight()  # nodes this start's preflight found bad: out for the whole job
        self.bad_nodes += self.preflight_out
        self.warming: tuple[list[str], subprocess.Popen] | None = None  # the spares' container step and its nodes (`warm_spares`)

    def choose_recovery(self, given: str, tasks_are_ranks: bool) -> tuple[Recovery, Recovery]:
        """The standbys each training step starts (DDPACK_STANDBYS: a count, or auto, the table's rule: one where the job
        asks for no GPUs and its tasks run the bundled trainer). What the tasks run: DDPACK_COMMAND (your program), the
        trainer's flags, or the image's own command as make sqsh's record beside DDPACK_SQSH names it (pyxis templates; a
        bare-metal job runs the bundle's entrypoint, whose command is the trainer). Slurm is asked for the GPUs only
        when the rule needs them. With the spares hosting the standbys, and without them."""
        env = os.environ
        launcher = self.command[: self.command.index("--")] if "--" in self.command else self.command
        torchrun = not tasks_are_ranks or any(word.split("=")[0] in ("--nproc-per-node", "--nproc_per_node") for word in launcher)
        image = image_command(value("DDPACK_SQSH", env)) if self.container else ""
        has_words = bool(env.get("DDPACK_TRAIN_ARGS", "").strip().strip("[]").strip())
        program = step_program(command=bool(env.get("DDPACK_COMMAND")), train_args=has_words, torchrun=torchrun, image_command=image)
        gpus = self.now.gpus_per_node if given == "auto" else 0
        plain = recovery(given, gpus=gpus, program=program)
        return recovery(given, gpus=gpus, program=program, spares=self.spares, per_node=self.per_node), plain

    @functools.cached_property
    def started(self) -> list[str] | None:
        """The nodes the job started on (SLURM_JOB_NODELIST's names, expanded once a start: the decision's own names when
        Slurm lists the same); None when unknown."""
        listed = os.environ.get("SLURM_JOB_NODELIST", "")
        return self.now.nodes if listed == self.now.nodelist else hostnames(listed)

    def run(self) -> int:
        """Train until the job ends here or goes back to the queue; the last step's status."""
        if self.spares > 0:
            if not self.place():
                if self.short.startswith("Slurm did not"):  # not bad input: the job fails, and says why
                    say(f"cannot place the training step: {self.short}")
                    write_record(self.run_dir, "step-end", {"verdict": "end", "reason": "no-placement", "exit": "1", "text": self.short})
                    self.leave("end")
                    return 1
                job_error(self.run_dir, f"DDPACK_SPARE_NODES={self.spares}: {self.short}")
            out = f"; without {','.join(self.preflight_out)} (failed the preflight's node checks)" if self.preflight_out else ""
            say(f"training on {','.join(self.last_nodes)}; spare: {self.spares_now()}{out}")
            placed = {"nodes": ",".join(self.last_nodes), "spares": self.spares_now()}
            write_record(self.run_dir, "placement", {**placed, **({"without": ",".join(self.preflight_out)} if out else {})})
            self.warm_spares()
        if self.recovery.on_spares:
            say(
                f"{self.standbys} standby process(es) start with each training step on the spare nodes ({self.per_node} a spare, "
                f"DDPACK_SPARE_NODES={self.spares}): a rank that dies, or every rank of a node lost, is replaced in process"
            )
        elif self.standbys:
            say(
                f"{self.standbys} standby process(es) start with each training step (DDPACK_STANDBYS): a rank that dies is replaced in process"
            )
        write_record(self.run_dir, "recovery", self.recovery.fields())
        while True:
            sys.stdout.flush()
            before = metrics_size(self.run_dir / METRICS)
            self.spares_warmed(self.last_nodes)
            with contextlib.suppress(OSError):
                (self.run_dir / LOST_NODES).unlink()  # each step's own: a node lost before is out of its placement
            with self.standby_step() as (options, env):
                end = run_step(
                    [*self.step, *options, *self.command],
                    env=env,
                    end_wait=self.step_wait if self.step_standbys else 0,
                    on_recovered=functools.partial(self.follow_recovery, before) if self.step_spares else None,
                    on_node_lost=self.fence if self.step_spares else None,
                    store_task=self.store_task,
                    ranks=self.store_task - self.step_standbys if self.store_task is not None else 0,
                )
            self.crashed = end.crashed
            wrote = StepRecords.read(self.run_dir / METRICS, before)
            if self.step_spares and wrote.hosts:
                with self.moving:
                    self.move_to(wrote.hosts)  # a recovery whose line the step's end cut short: the records say it
            self.progress, self.fallback, self.recovered = wrote.progress, wrote.fallback, wrote.recovered
            code = end.status(self.step_standbys)
            rc = 128 - code if code < 0 else code  # a step killed by a signal: its status as the shell gives it
            if code != end.code:
                which = (
                    f"ranks replaced in process ({self.recovered} recovery)" if self.recovered else "no ranks (the store task, a standby)"
                )
                say(f"the step's tasks that ended badly were {which}; every rank ended {rc}")
            after = self.after_step(rc)
            if after != "restart":
                break
            with contextlib.suppress(OSError):
                (self.run_dir / MARKER).open("w").close()  # forensics newer than this belong to the restart
        self.leave(after)
        return rc

    @functools.cached_property
    def per_node(self) -> int | None:
        """The job's tasks a node (SLURM_NTASKS_PER_NODE, "2" or "2(x3)"); None where it is not one number."""
        text = (os.environ.get("SLURM_NTASKS_PER_NODE") or "").split("(")[0]
        return int(text) if re.fullmatch(r"[0-9]+", text) else None

    def place(self) -> bool:
        """Set the srun options that put a training step on the job's healthy nodes, the ones the last step used first,
        spares after; False (self.short says why) when fewer are healthy than training needs. Healthy: still in the job
        (Slurm drops a node it lost from a --no-kill job), not down, drained or failing in sinfo, not named unresponsive
        by a hang's forensics during this job."""
        env = os.environ
        total = int(env.get("SLURM_JOB_NUM_NODES") or 1)
        need = total - self.spares
        if need < 1:
            job_error(
                self.run_dir,
                f"DDPACK_SPARE_NODES={self.spares} leaves no node to train on: the job has {total}; ask sbatch for --nodes=<training nodes + spares>",
            )
        per_node = self.per_node
        if per_node is None:
            job_error(
                self.run_dir,
                f"a restart in this allocation needs --ntasks-per-node (SLURM_NTASKS_PER_NODE={env.get('SLURM_NTASKS_PER_NODE', '')}); the templates set it",
            )
        listed_names = self.now.nodes
        bad = {*self.bad_nodes, *self.now.unhealthy(listed_names or [])}
        if listed_names is None:
            self.short = "Slurm did not list the job's nodes (scontrol show hostnames failed)"
            return False
        names = [node for node in listed_names if node not in bad]
        healthy = [node for node in names if node in self.last_nodes] + [node for node in names if node not in self.last_nodes]
        healthy = [node for node in healthy if node not in self.avoid] + [node for node in healthy if node in self.avoid]
        if len(healthy) < need:
            self.short = f"{len(healthy)} healthy node(s) left in the allocation and training needs {need}"
            return False
        self.last_nodes = healthy[:need]
        self.placement = [f"--nodes={need}", f"--ntasks={need * per_node}", f"--nodelist={','.join(self.last_nodes)}"]
        return True

    @contextlib.contextmanager
    def standby_step(self) -> Iterator[tuple[list[str], dict[str, str] | None]]:
        """The srun options and environment of the next training step: the placement alone (and srun's environment as
        it is), or with DDPACK_STANDBYS=K, K more tasks of the same step, in the job's container, under the same
        supervision (end records, forensics, the watchdog) as any rank: the trainer's --standbys (its default is
        DDPACK_STANDBYS, which srun hands it) makes the launcher's last K ranks standbys. Their places are named task by
        task (srun --distribution=arbitrary reads them from SLURM_HOSTFILE, a private file that lives for the step):
        the ranks where srun's block distribution puts them, then the standbys one a node from the first (`task_hosts`).
        --overcommit: a standby is one more task than the node's CPUs were divided for (it sleeps while it waits);
        --kill-on-bad-exit=0: a rank that dies does not end the step whatever the cluster's KillOnBadExit; srun's
        --wait (SLURM_WAIT), which kills the step DDPACK_STEP_WAIT seconds after its first task ended, is replaced by
        the same wait after the run has ended (`run_step`, `run_over`): the first task to end is now a rank the others
        outlive, and with the store task (the step's last, `task_hosts`) rank 0 is one of those too."""
        env = os.environ
        # The tasks are handed the count this step starts (the trainer reads its --standbys there): a count asked for
        # that this step cannot start would otherwise make its last ranks standbys that nobody started as such.
        asked = value("DDPACK_STANDBYS", env)
        overrides = {"DDPACK_STANDBYS": "0"} if asked != "auto" and int(asked) else {}
        if value("DDPACK_STORE_TASK", env) != "0":  # no store task without standbys: the last task is a rank
            overrides["DDPACK_STORE_TASK"] = "0"
        none = {**env, **overrides} if overrides else None
        self.step_standbys, self.step_spares, self.lost_in_step, self.store_task = self.standbys, [], [], None
        if not self.standbys:
            yield self.placement, none
            return
        per_node = self.per_node
        nodes = self.last_nodes or self.now.nodes or self.started
        if per_node is None or not nodes:
            why = f"SLURM_NTASKS_PER_NODE={env.get('SLURM_NTASKS_PER_NODE', '')}" if nodes else "Slurm did not list the job's nodes"
            say(f"training without standbys this step: they need the job's nodes and --ntasks-per-node ({why})")
            write_record(
                self.run_dir, "recovery", {"mode": "restart", "standbys": 0, "why": f"this step could not start its standbys ({why})"}
            )
            self.step_standbys = 0
            yield self.placement, none
            return
        if self.recovery.on_spares:
            self.step_spares = self.healthy_spares()
            self.step_standbys = len(self.step_spares) * per_node if self.step_spares else self.plain_recovery.standbys
            if not self.step_spares:
                said = f"{self.step_standbys} on the nodes that train" if self.step_standbys else "none"
                say(f"no spare node is left to host the standbys: this step has {said} ({self.plain_recovery.why})")
                write_record(
                    self.run_dir, "recovery", {**self.plain_recovery.fields(), "why": f"no spare node left; {self.plain_recovery.why}"}
                )
            if not self.step_standbys:
                yield self.placement, none
                return
        hosts = task_hosts(nodes, per_node, self.step_standbys, self.step_spares)
        self.store_task = len(hosts) - 1
        fd, path = tempfile.mkstemp(prefix="ddpack-step-hosts-", text=True)  # 0600, a new name: ours alone
        try:
            with os.fdopen(fd, "w") as out:
                out.write("\n".join(hosts) + "\n")
            step_env = {name: text for name, text in env.items() if name not in ("SLURM_WAIT", "SLURM_NTASKS_PER_NODE")}
            step_env["SLURM_HOSTFILE"] = path
            step_env["DDPACK_STANDBYS"] = str(self.step_standbys)
            step_env["DDPACK_STORE_TASK"] = "1"  # the last task serves the store (`task_hosts`)
            options = [
                f"--nodes={len(nodes) + len(self.step_spares)}",
                f"--ntasks={len(hosts)}",
                "--distribution=arbitrary",
                "--overcommit",
                "--kill-on-bad-exit=0",
            ]
            # A node set DOWN leaves this --no-kill job; without --no-kill on the step, srun kills all its tasks with it.
            options += ["--no-kill"] if self.step_spares else []
            yield options, step_env
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)

    def warm_spares(self) -> None:
        """Make the job's container on the spare nodes now, beside training, so that a swap that brings a spare in starts
        from a container that is there (pyxis reuses a named one) instead of unpacking the image after the node was
        lost, on the swap's critical path: a second for a small image, tens of seconds for a 5 GB one. One step on the
        spares, one task a node running `true` in the job's container (as staging's `alone` makes a node's container);
        a pyxis template only (a bare-metal job has no container), and not where the spares host the standbys: the
        training step's own tasks make it there (and a second maker would race them). Its failure costs that unpack,
        later, nothing else."""
        spares = self.spare_nodes()
        image = next((word.partition("=")[2] for word in self.step if word.startswith("--container-image=")), "")
        if not self.container or not image or not spares or self.recovery.on_spares:
            return
        options = (f"--container-image={image}", f"--container-name={self.container}")
        argv = on_each_node(",".join(spares), len(spares), ["true"], *options)
        try:
            self.warming = (spares, subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL))
        except OSError as why:
            warn(f"{argv[0]}: {one_line(why)}")

    def spares_warmed(self, nodes: list[str] | None = None) -> None:
        """Wait for the spares' container step (`warm_spares`) before a step runs on one of its nodes (two makers of one
        named container on a node would race: the step would start from a half-unpacked one), or before the job leaves
        (`nodes` None: the container is then removed from every node, so its making is stopped first). A step that
        failed says so in one line; the swap's own step makes that node's container then."""
        if self.warming is None:
            return
        spares, proc = self.warming
        if nodes is not None and not set(nodes) & set(spares):
            return
        if nodes is None and proc.poll() is None:
            proc.terminate()  # srun cancels the step on SIGTERM; the container's leaving removes what it left
        if (code := proc.wait()) != 0 and nodes is not None:
            say(
                f"warning: making the job's container on {','.join(spares)} beside training failed (srun exit {code}); this step makes it there"
            )
        self.warming = None

    def healthy_spares(self) -> list[str]:
        """The spare nodes that can host standbys now: not training, not out of the job, not down or drained in sinfo."""
        spare = self.spare_nodes()
        bad = self.now.unhealthy(spare) if spare else set()
        return [node for node in spare if node not in bad]

    def follow_recovery(self, since: int | None) -> None:
        """After a recovery in process (the trainer's `recovery` record names the ranks' hosts): where every rank of a
        node that trained is now on a spare's standbys (the node lost), that spare trains from now on, in this step, and
        the node is no longer one of this step's: one line and a `placement` record, so that a restart places the ranks
        where they are. A rank replaced on a node that still trains moves nothing. Called from the step's readers (the
        recovery's line); after the step, `run` moves by the step's records, read once: each move is said once."""
        with self.moving:
            if hosts := StepRecords.read(self.run_dir / METRICS, since).hosts:
                self.move_to(hosts)

    def fence(self, node: str) -> None:
        """srun says `node` failed: Slurm dropped it from the job (set DOWN). Its name goes to the run folder's LOST_NODES,
        which the step's store task passes on to the standbys as fenced (train/recovery.py `serve_store`): its members
        are counted dead at once, even ones still running, and never join a group again."""
        with self.moving:
            self.lost_in_step.append(node)
            try:
                write_private(self.run_dir / LOST_NODES, "".join(f"{name}\n" for name in self.lost_in_step))
            except OSError as why:
                warn(f"{node} left the job, and {self.run_dir / LOST_NODES} cannot be written ({one_line(why)}): it is not fenced")
                return
        say(f"{node} left the job (srun: node failure): fenced, so that its ranks are counted dead at once and never rejoin")

    def move_to(self, hosts: list[str]) -> None:
        training = list(dict.fromkeys(hosts))
        left = [node for node in self.last_nodes if node not in training]
        joined = [node for node in training if node not in self.last_nodes]
        if not left or not joined:
            return
        self.last_nodes = [node for node in self.last_nodes if node not in left] + joined
        ranks = {node: [rank for rank, host in enumerate(hosts) if host == node] for node in joined}
        took = "; ".join(f"ranks {','.join(map(str, ranks[node]))} on {node}" for node in joined)
        say(
            f"{','.join(left)} left the training: its ranks were replaced in process by the standbys on the spare {','.join(joined)} "
            f"({took}); the step goes on, and a restart places the ranks there (training on {','.join(self.last_nodes)})"
        )
        fields = {"nodes": ",".join(self.last_nodes), "lost": ",".join(left), "spare": ",".join(joined), "how": "in-process"}
        write_record(self.run_dir, "placement", fields)

    def spare_nodes(self) -> list[str]:
        """The allocation's nodes that are not the ones training uses now, nor out of the job."""
        return [node for node in self.now.nodes or [] if node not in self.last_nodes and node not in self.bad_nodes]

    def spares_now(self) -> str:
        """`spare_nodes` for a line or a record ("none" where there is none)."""
        return ",".join(self.spare_nodes()) or "none"

    def swap_out(self, nodes: list[str]) -> bool:
        """The preflight verb's question, answered by the one placement every restart uses: can training start without
        `nodes` (the ones that failed the preflight's node checks)? True when every one is the job's own and the healthy
        nodes left, spares included, are as many as training needs (`place`); False, with self.short saying why, when
        the job has no spare or too few. The nodes are then out of this job (`bad_nodes`): the train verb reads them
        back from the preflight's record (`swapped_by_preflight`)."""
        if self.spares < 1:
            self.short = f"DDPACK_SPARE_NODES=0: no spare node to take {'its' if len(nodes) == 1 else 'their'} place"
            return False
        foreign = [node for node in nodes if node not in self.our_nodes()]
        if foreign:
            self.short = f"{','.join(foreign)} is not a node of this job as Slurm names them"
            return False
        self.bad_nodes += [node for node in nodes if node not in self.bad_nodes]
        if not self.place():
            self.short = f"DDPACK_SPARE_NODES={self.spares}: {self.short}"
            return False
        return True

    def swapped_by_preflight(self) -> list[str]:
        """The nodes this start's preflight swapped out (its `preflight` record with result `swapped`, of this job and
        this restart): the train verb, a process of its own, keeps them out of every placement and of a requeue's
        ExcNodeList. Only names of this job's nodes count, as for a hang's forensics."""
        try:
            lines = read_nofollow(self.run_dir / DECISIONS, limit=None).splitlines()
        except OSError:
            return []
        ours, found = self.our_nodes(), []
        for line in lines:
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if (
                    isinstance(entry, dict)
                    and (entry.get("kind"), entry.get("result")) == ("preflight", "swapped")
                    and (entry.get("slurm_job"), entry.get("restart")) == (self.job, self.restarts)
                    and isinstance(entry.get("nodes"), list)
                ):
                    found += [node for node in entry["nodes"] if node in ours and node not in found]
        return found

    def after_step(self, rc: int) -> str:
        """end, restart or requeue, from the step's exit status; one line says which and why."""
        self.now = JobFacts(self.job)  # this decision's one read of Slurm (when it needs one), for every part of it
        self.report_hint()
        if rc == 0:
            return self.decide("end", "completed", "done", rc, "the step completed (exit 0)")
        if rc == 2:
            said = "the step ended on bad input (exit 2); not requeueing: fix what its error line names and resubmit"
            return self.decide("end", "end", "bad-input", rc, said)
        kind = "preempted" if rc in (138, 143) else "failed"
        what, reason = f"failed (exit {rc})", kind
        lost = self.lost_nodes()
        if lost:
            kind, what, reason = "failed", f"ended (exit {rc}) when the job lost {','.join(lost)}", "lost-node"
        if kind == "preempted":
            if self.restarts >= self.max_restarts:
                return self.decide(
                    "end", "end", "preempted", rc,
                    f"preempted (exit {rc}) after {self.restarts} restarts, the cap DDPACK_MAX_RESTARTS={self.max_restarts}; "
                    f"not requeueing ({self.continue_hint()} to continue)",
                )  # fmt: skip
            if self.progress == "no" and self.restarts >= 1 and self.earlier_start_progress() == "no":
                return self.decide(
                    "end", "end", "no-progress", rc,
                    f"preempted (exit {rc}) with no new step in {self.run_dir / METRICS}, as in the start before it: not requeueing "
                    f"a program that stops before its first step at every start (its lines above say where); {self.continue_hint()} to try again",
                )  # fmt: skip
            return self.decide(
                "requeue", "requeue", "preempted", rc,
                f"preempted (exit {rc}); requeueing job {self.job} (restart {self.restarts + 1} of at most {self.max_restarts})",
            )  # fmt: skip
        counted = self.run_dir / FAILURE_RESTARTS
        failed = max(self.failed, read_count(counted))  # the file may have been lost or reset: memory counts too
        forensics = self.run_dir / FORENSICS
        crashed = ""
        if not lost and (rc == 124 or newer(forensics / SUMMARY, self.run_dir / MARKER)):
            what, reason = f"ended as hung (exit {rc}; evidence in {forensics})", "hung"
        elif not lost and self.crashed in self.our_nodes():  # srun's line shares the pipe with the tasks': ours only
            crashed, reason = self.crashed, "crashed"
            what = f"failed (exit {rc}) when its task on {crashed} crashed"
        if failed >= self.max_failed or self.restarts >= self.max_restarts:
            return self.decide(
                "end", "end", reason, rc,
                f"the step {what} after {failed} failure restarts, the cap DDPACK_MAX_FAILURE_RESTARTS={self.max_failed}; "
                f"not requeueing ({self.continue_hint()} to continue from its last snapshot)",
            )  # fmt: skip
        try:
            write_private(counted, f"{failed + 1}\n", durable=True)
        except OSError as why:  # full, over quota, read-only: a restart that cannot be counted could loop for ever
            return self.decide(
                "end", "end", "uncounted", rc,
                f"the step {what}; not restarting it: the restart cannot be counted in {counted} ({one_line(why)}); "
                f"make room there or fix its permissions, then {self.continue_hint()} to continue from its last snapshot",
            )  # fmt: skip
        self.failed = failed + 1
        count = f"failure restart {failed + 1} of at most {self.max_failed}"
        named = self.named_this_start()
        without = f", without {','.join(named)} (named unresponsive)" if named else ""
        self.bad_nodes += [node for node in named if node not in self.bad_nodes]
        self.avoid = []
        if crashed:
            self.crashes[crashed] = self.crashes.get(crashed, 0) + 1
            if self.crashes[crashed] >= 2:  # twice: the node's fault, not the program's; out for the rest of the job
                named = [*named, crashed]
                without += f", without {crashed} (its tasks crashed twice)"
                if crashed not in self.bad_nodes:
                    self.bad_nodes.append(crashed)
            else:
                self.avoid = [crashed]
        if not self.in_place:
            self.short = "DDPACK_RESTART_IN_PLACE=0"
        elif self.place():
            if crashed in self.avoid:
                without += (
                    f", without {crashed} (its task crashed)" if crashed not in self.last_nodes else f", on {crashed} again (no other node)"
                )
            left_out = ",".join(node for node in [*named, *self.avoid] if node not in self.last_nodes)
            placed = {"nodes": ",".join(self.last_nodes), "spares": self.spares_now(), "without": left_out}
            write_record(self.run_dir, "placement", placed)
            return self.decide(
                "restart", "restart", reason, rc,
                f"the step {what}; restarting it in this allocation on {','.join(self.last_nodes)}{without} from its last snapshot ({count})",
            )  # fmt: skip
        after = self.decide(
            "requeue", "requeue", reason, rc,
            f"the step {what}; {self.short}: requeueing job {self.job} to resume from its last snapshot ({count})",
        )  # fmt: skip
        self.nodes_to_keep_out()
        return after

    def decide(self, after: str, verdict: str, reason: str, rc: int | str, sentence: str) -> str:
        """The step's end decided: said, recorded (the run's end, for `ddpack status` once Slurm has forgotten the job)."""
        if self.fallback and verdict != "completed":
            say(f"in-process recovery fell back to this decision: {self.fallback}")
        say(sentence)
        fields = {"verdict": verdict, "reason": reason, "exit": str(rc), "text": sentence, "progress": self.progress}
        if self.recovered:
            fields["recovered"] = str(self.recovered)
        if self.fallback:
            fields["recovery_fallback"] = self.fallback
        write_record(self.run_dir, "step-end", fields)
        return after

    def earlier_start_progress(self) -> str:
        """The progress of the last step of the start before this one (SLURM_RESTART_COUNT one less), as its step-end
        record has it: "yes", "no" or "" (unknown)."""
        try:
            lines = read_nofollow(self.run_dir / DECISIONS, limit=None).splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("kind") == "step-end" and entry.get("restart") == self.restarts - 1:
                return str(entry.get("progress") or "")
        return ""

    def lost_nodes(self) -> list[str]:
        """The nodes the last step ran on that the job lost (Slurm dropped them from this --no-kill job) or that sinfo
        says are down, drained or failing."""
        ran = self.last_nodes or self.started or []
        if not ran:
            return []
        listed = self.now.nodes
        now = set(ran if listed is None else listed)  # unknown: only sinfo's word counts, never "all were lost"
        bad = self.now.unhealthy(ran)
        return [node for node in ran if node not in now or node in bad]

    def our_nodes(self) -> set[str]:
        """The job's nodes, as it started and as Slurm lists them now: the only names a decision may act on."""
        return {*(self.started or []), *(self.now.nodes or [])}

    def named_this_start(self) -> list[str]:
        """The nodes a hang's forensics named unresponsive during this start. Only names of this job's nodes count: the
        file is written from what ranks said through the rendezvous store, and a name that is not one of ours must never
        reach ExcNodeList."""
        named = self.run_dir / FORENSICS / UNRESPONSIVE_NODES
        if not (named.is_file() and named.stat().st_size and newer(named, self.run_dir / MARKER)):
            return []
        ours = self.our_nodes()
        found: list[str] = []
        for line in named.read_text(errors="replace").splitlines():
            if line in ours and line not in found:
                found.append(line)
        return found

    def nodes_to_keep_out(self) -> None:
        """Keep the nodes a hang's forensics named out of the requeued job when the partition has enough others for it
        (else it would never start again, and a line says so)."""
        if not self.bad_nodes:
            return
        env = os.environ
        partition, needs = env.get("SLURM_JOB_PARTITION", ""), int(env.get("SLURM_JOB_NUM_NODES") or 1)
        out = command(["sinfo", "-h", "-p", partition, "-o", "%D"], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S).stdout.split()
        total = int(out[0]) if out and re.fullmatch(r"[0-9]+", out[0]) else 0
        nodes = ",".join(self.bad_nodes)
        if total - len(self.bad_nodes) < needs:
            why = f"partition {partition or '?'} has {total} nodes and the job needs {needs}"
            say(f"not keeping out {nodes} ({self.why_out(self.bad_nodes, short=True)}): {why}")
            write_record(self.run_dir, "keep-out", {"nodes": nodes, "kept": "no", "why": why})
            return
        self.keep_out = list(self.bad_nodes)

    def why_out(self, nodes: list[str], *, short: bool = False) -> str:
        """Why `nodes` are kept out: they failed this start's preflight, a hang's forensics named them, or their tasks
        crashed twice."""
        crashed = [node for node in nodes if self.crashes.get(node, 0) >= 2]
        checked = [node for node in nodes if node in self.preflight_out and node not in crashed]
        named = len(nodes) - len(crashed) - len(checked)
        reasons = ["failed the preflight's node checks"] if checked else []
        reasons += ["named unresponsive" + ("" if short else " by the hang's forensics")] if named else []
        if crashed:
            reasons.append(f"{'its' if len(crashed) == 1 else 'their'} tasks crashed twice")
        return "; ".join(reasons)

    def leave(self, after: str) -> None:
        """After the last step of this start: the job's container leaves the nodes, then the requeue decided, or the run
        folder is free for another job."""
        self.spares_warmed()
        if self.container:
            remove_container(self.now, self.container)
        if after == "requeue":
            self.requeue()
        else:
            give_back_run_folder(self.run_dir, self.job)

    def requeue(self) -> None:
        """Requeue this job, then keep the named nodes out of its next start. Slurm refuses ExcNodeList for a running
        job, and a requeue SIGTERMs this script and kills it KillWait seconds later (30 by default): TERM is ignored from
        here (by this program and the commands it runs, which inherit that), which keeps it alive for the one update and
        its record that follow."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.stdout.flush()
        if command(["scontrol", "requeue", self.job]).returncode != 0:
            self.decide(
                "end", "end", "requeue-refused", "",
                f"scontrol requeue {self.job} was refused (its line above says why); the job ends here: {self.continue_hint()} to continue",
            )  # fmt: skip
            return
        if not self.keep_out:
            return
        nodes = ",".join(self.keep_out)
        if command(["scontrol", "update", f"JobId={self.job}", f"ExcNodeList={nodes}"]).returncode == 0:
            say(f"keeping {nodes} ({self.why_out(self.keep_out)}) out of the restart")
            write_record(self.run_dir, "keep-out", {"nodes": nodes, "kept": "yes"})
        else:
            say(f"could not keep {nodes} out of the restart (scontrol update refused); it may land there again")
            write_record(self.run_dir, "keep-out", {"nodes": nodes, "kept": "no", "why": "scontrol update refused"})

    def continue_hint(self) -> str:
        """How to continue this run in a new job: `ddpack resubmit` for a run `ddpack submit` made, else the setting (a
        job started by hand leaves a run.json too, which says a template made it: ddpack cannot resubmit that one)."""
        try:
            made_by = json.loads(read_nofollow(self.run_dir / RUN_RECORD, limit=None)).get("settings", {}).get("made_by")
        except (OSError, ValueError, AttributeError):
            return f"resubmit with DDPACK_RUN_DIR={self.run_dir}"
        return f"resubmit with DDPACK_RUN_DIR={self.run_dir}" if made_by == "template" else f"ddpack resubmit {self.run_dir}"

    def report_hint(self) -> None:
        """Where the run's charts come from, once a step has left metrics (a program of your own may write none)."""
        metrics = self.run_dir / METRICS
        if metrics.is_file() and metrics.stat().st_size:
            say(
                f"metrics in {metrics}; for the run report ({self.run_dir / REPORT}) run, in the ddpack checkout: make report RUN={self.run_dir}"
            )
