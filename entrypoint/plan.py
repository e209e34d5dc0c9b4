"""Launch plan: what the environment says about this process's place in a DDP job.

Data flows one way: environment -> detect mode -> resolve a frozen `Plan` -> (validated on the way)
-> exec. Every function here is pure over its inputs (`environ`, `Options`, `Host`) so the whole
resolution is table-testable without Slurm, torchrun or Docker.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from entrypoint.hostlist import HostlistError, expand_hostlist, expand_tasks_per_node

# Defined here, in the launcher, which must never import train (see supervise.py): the trainer's flags
# (train.config) take their choices from these.
BACKENDS = ("gloo", "nccl", "mpi", "ucc")
CPU_BIND_CHOICES = ("auto", "none")  # the trainer's --cpu-bind
DEFAULT_MASTER_PORT = 29500
# Ports derived from a Slurm job id land in [15000, 30000): below Linux's default ephemeral range
# (32768-60999), so a rendezvous port never collides with an outgoing connection's source port.
SLURM_PORT_LOW = 15000
SLURM_PORT_SPAN = 15000
SLURM_STEPS_PER_JOB_PORTS = 16
# The job's secret (docs/security.md): the templates make it from /dev/urandom inside the batch script, so it never
# passes through slurmctld, and srun hands it to every task; the hang watchdog signs its rendezvous-store values
# with it (train/watchdog.py), because the store answers any user on the cluster who can reach the port.
JOB_TOKEN_VAR = "DDPACK_JOB_TOKEN"
_JOB_TOKEN = re.compile(r"[0-9A-Fa-f]{16,128}")


def seconds_up_to_an_hour(text: str) -> float | None:
    """`text` as a number of seconds in (0, 3600], or None when it is not one (the caller names the setting)."""
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 < value <= 3600 else None


def job_token(environ: Mapping[str, str]) -> str | None:
    """The job's secret (DDPACK_JOB_TOKEN), or None where there is none (`docker run -e`, torchrun by hand, a
    laptop: one user's machine). A value that is set but is not 16-128 hex characters is refused rather than
    used or ignored: an empty one is what a failed `$(...)` in a job script leaves, and running unprotected on
    a shared cluster without a word is what the variable exists to prevent. The error names the length, never
    the value: it is a secret, and errors end up in job logs."""
    raw = environ.get(JOB_TOKEN_VAR)
    if raw is None:
        return None
    if not _JOB_TOKEN.fullmatch(raw):
        shape = "empty" if not raw else f"{len(raw)} characters" + ("" if re.fullmatch(r"[0-9A-Fa-f]*", raw) else ", not all hex")
        raise PlanError(
            f"{JOB_TOKEN_VAR} ({shape}) is not 16-128 hex characters; expected the job's secret as the ddpack templates "
            "make it (32 hex characters from /dev/urandom) or unset it"
        )
    return raw


def trainer_command() -> tuple[str, ...]:
    """The bundle's trainer, run by the same interpreter as the launcher (the image's venv).

    `-P` (Python 3.11+) keeps the working directory off the front of sys.path: `python -m train` in a
    project folder with its own `train.py` or `train/` (the commonest names in ML repositories) would
    otherwise run that instead of the bundle, silently. `--task module:factory` still imports from
    the working directory, which the trainer appends to the path."""
    safe_path = ("-P",) if sys.version_info >= (3, 11) else ()
    return (sys.executable, *safe_path, "-m", "train")


def app_command(environ: Mapping[str, str]) -> tuple[str, ...] | None:
    """The command an image with a user's project runs when given none (DDPACK_APP_CMD, set by
    `make image APP=DIR APP_CMD=...`); None when there is none."""
    text = environ.get("DDPACK_APP_CMD", "").strip()
    if not text:
        return None
    try:
        return tuple(shlex.split(text))
    except ValueError as exc:
        raise PlanError(f"DDPACK_APP_CMD={text!r} is not a command line ({exc})") from None


def python_script_index(argv: Sequence[str]) -> int | None:
    """Where the script of `python [options] SCRIPT ...` is in argv (None for -m, -c or another program)."""
    if not argv or not os.path.basename(argv[0]).startswith("python"):
        return None
    index = 1
    while index < len(argv):
        word = argv[index]
        if word in ("-m", "-c", "-"):
            return None
        if word in ("-W", "-X", "--check-hash-based-pycs"):
            index += 2
            continue
        if not word.startswith("-"):
            return index
        index += 1
    return None


def from_app_dir(argv: Sequence[str], app_dir: str | None, is_file: Callable[[str], bool] = os.path.isfile) -> tuple[str, ...]:
    """A relative script that is not in the working directory but in the project's folder (DDPACK_APP_DIR)
    is run from there: `python train.py` works in any working directory, as the templates' run folder.
    The program itself (`./run.sh`) and Python's script are the words looked at; nothing else changes."""
    words = list(argv)
    if not app_dir:
        return tuple(words)
    script = python_script_index(words)
    for index in (0, script) if script is not None else (0,):
        word = words[index]
        relative = not os.path.isabs(word) and (index > 0 or "/" in word)
        if relative and not is_file(word) and is_file(os.path.join(app_dir, word)):
            words[index] = os.path.normpath(os.path.join(app_dir, word))
    return tuple(words)


class PlanError(ValueError):
    """Input that cannot describe a DDP job; the message is the one line the user sees."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """What the user asked for on the entrypoint's own command line."""

    command: tuple[str, ...] = field(default_factory=lambda: trainer_command())
    nproc_per_node: int | None = None
    backend: str | None = None


@dataclass(frozen=True, kw_only=True)
class Host:
    """Facts about the machine, injected so that tests do not depend on the machine they run on."""

    cpu_count: int
    nvidia_device_files: int
    free_port: int

    @staticmethod
    def probe() -> Host:
        """Read the real machine: usable CPUs, /dev/nvidiaN files, and a port free right now."""
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        try:
            nvidia = sum(1 for name in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", name))
        except OSError:
            nvidia = 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        return Host(cpu_count=cpus or 1, nvidia_device_files=nvidia, free_port=port)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The resolved launch: printed by --print-plan, executed otherwise.

    `launcher` is "exec" (run the command as this rank) or "torchrun" (this process becomes a
    torchrun agent that starts `nproc_per_node` ranks). For "torchrun", rank and local rank are
    assigned by torchrun and are None here.
    """

    mode: str
    launcher: str
    rank: int | None
    world_size: int
    local_rank: int | None
    local_world_size: int
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    backend: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------- reading variables


def _int_var(environ: Mapping[str, str], name: str, minimum: int = 0, what: str = "") -> int:
    raw = environ.get(name)
    if raw is None:
        raise PlanError(f"{name} is not set; expected {what or 'an integer'}")
    try:
        value = int(raw.strip())
    except ValueError:
        value = None
    if value is None or value < minimum:
        bound = "a non-negative integer" if minimum == 0 else f"an integer >= {minimum}"
        raise PlanError(f"{name}={raw!r} is not {bound}{'; expected ' + what if what else ''}")
    return value


def _opt_int_var(environ: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    return _int_var(environ, name, minimum) if name in environ else default


def _port_var(environ: Mapping[str, str], name: str, default: int) -> int:
    if name not in environ:
        return default
    raw = environ[name]
    try:
        port = int(raw.strip())
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise PlanError(f"{name}={raw!r} is not a TCP port; expected an integer in 1-65535")
    return port


def bare_host(addr: str) -> str:
    """MASTER_ADDR as a socket wants it: `[fe80::1]` -> `fe80::1`."""
    addr = addr.strip()
    return addr[1:-1] if addr.startswith("[") and addr.endswith("]") else addr


def url_host(addr: str) -> str:
    """A host as a URL or host:port endpoint wants it: bare IPv6 addresses get brackets."""
    return f"[{addr}]" if ":" in addr else addr


def visible_cuda_devices(environ: Mapping[str, str], host: Host) -> int:
    """How many CUDA devices this process may use, without importing torch."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return host.nvidia_device_files
    cvd = cvd.strip()
    if cvd in ("", "-1", "NoDevFiles"):
        return 0
    return len([dev for dev in cvd.split(",") if dev.strip()])


def choose_backend(environ: Mapping[str, str], options: Options, host: Host) -> str:
    """--backend, then DDPACK_BACKEND, then nccl when a CUDA device is visible, else gloo."""
    if options.backend is not None:
        backend, source = options.backend, "--backend"
    elif environ.get("DDPACK_BACKEND"):
        backend, source = environ["DDPACK_BACKEND"], "DDPACK_BACKEND"
    else:
        return "nccl" if visible_cuda_devices(environ, host) > 0 else "gloo"
    if backend not in BACKENDS:
        raise PlanError(f"{source}={backend!r} is not a known backend; expected one of {', '.join(BACKENDS)}")
    return backend


def slurm_master_port(job_id: int, step_id: int) -> int:
    """A port every task of a Slurm step derives alike; concurrent steps of one job differ."""
    slot = job_id * SLURM_STEPS_PER_JOB_PORTS + step_id % SLURM_STEPS_PER_JOB_PORTS
    return SLURM_PORT_LOW + slot % SLURM_PORT_SPAN


def _omp_threads(environ: Mapping[str, str], host: Host, local_procs: int, procs_per_task: int = 1) -> dict[str, str]:
    """OMP_NUM_THREADS for each rank when the user has not set it, so ranks do not oversubscribe.

    Under Slurm a task owns SLURM_CPUS_PER_TASK CPUs, shared only by the ranks that task starts
    (`procs_per_task`: torchrun's children). Elsewhere the usable CPUs are shared by all local ranks.
    """
    if "OMP_NUM_THREADS" in environ:
        return {}
    threads = (
        _int_var(environ, "SLURM_CPUS_PER_TASK", 1) // procs_per_task
        if "SLURM_CPUS_PER_TASK" in environ
        else host.cpu_count // max(1, local_procs)
    )
    return {"OMP_NUM_THREADS": str(max(1, threads))}


# NCCL's settings for AWS clusters: never bootstrap over loopback or container bridges; warnings only; a
# failed collective aborts the rank instead of hanging it. Applied by the launcher where the job has not
# set them, never baked into the image: pyxis lets an image's ENV win over the job's environment ("their
# existing values in the image take precedence"), so an image that set NCCL_DEBUG would silently ignore a
# job's `export NCCL_DEBUG=INFO`, and a wrong NCCL_SOCKET_IFNAME could not be overridden.
NCCL_DEFAULTS = {"NCCL_SOCKET_IFNAME": "^lo,docker,veth", "NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def _nccl_defaults(environ: Mapping[str, str], backend: str) -> dict[str, str]:
    """NCCL_DEFAULTS that the job left unset, for an nccl job."""
    return {name: value for name, value in NCCL_DEFAULTS.items() if name not in environ} if backend == "nccl" else {}


# ---------------------------------------------------------------------------- detecting the mode


def detect_mode(environ: Mapping[str, str]) -> str:
    """torchelastic > slurm (inside a step) > env (RANK/WORLD_SIZE/NNODES given) > single.

    Only step variables make Slurm mode: a shell from `salloc` (SLURM_JOB_NAME=bash/interactive)
    or a batch script carries job variables but is not a task of a step.
    """
    if environ.get("TORCHELASTIC_RUN_ID"):
        return "torchelastic"
    if "SLURM_STEP_ID" in environ and "SLURM_STEP_NUM_TASKS" in environ:
        return "slurm"
    if any(name in environ for name in ("RANK", "WORLD_SIZE", "NNODES")):
        return "env"
    return "single"


# ---------------------------------------------------------------------------- resolving


def _torchrun_argv(
    command: tuple[str, ...], nnodes: int, nproc: int, endpoint: str | None, rdzv_id: str, shutdown_timeout: int
) -> tuple[str, ...]:
    """torchrun as `python -m entrypoint.agent` (torchrun ending on a signal with 128+N), so the
    launcher itself never imports torch."""
    argv = [sys.executable, "-m", "entrypoint.agent", f"--shutdown-timeout={shutdown_timeout}"]
    if endpoint is None:
        argv += ["--standalone"]
    else:
        argv += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]
    argv += [f"--nproc-per-node={nproc}", "--no-python", *command]
    return tuple(argv)


# How long torchrun's agent lets its workers finish after forwarding a stop signal before it kills
# them: rank 0 must finish its step and write its snapshot in that time. Under Slurm keep it within
# KillWait (SIGKILL follows SIGTERM after KillWait seconds, default 30) or stop earlier with
# --signal=USR1@N.
DEFAULT_SHUTDOWN_TIMEOUT = 30

# torchrun's agent forwards only SIGTERM/INT/HUP/QUIT by default and dies of SIGUSR1, which Slurm's
# --signal=USR1@90 sends it; with USR1 in this list (torchrun's --signals-to-handle, as an env var)
# the agent forwards it and the workers snapshot and stop together.
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@dataclass(frozen=True, kw_only=True)
class _Inputs:
    """Everything a resolver reads, passed as one value."""

    mode: str
    environ: Mapping[str, str]
    options: Options
    host: Host
    backend: str


def _plan(inp: _Inputs, launcher: str, argv: tuple[str, ...], env: dict[str, str], **where: Any) -> Plan:
    """The one build of a Plan, whichever the launch: the mode and backend as resolved, `launcher`'s command and
    variables, and where the ranks stand (`where`: Plan's rank, world_size, local_rank, local_world_size, node_rank,
    nnodes, master_addr and master_port)."""
    return Plan(mode=inp.mode, launcher=launcher, backend=inp.backend, argv=argv, env=env, **where)


def _launch_env(inp: _Inputs, local_procs: int, procs_per_task: int = 1) -> dict[str, str]:
    """What every launch sets beside its own variables: the CPU threads of the `local_procs` processes started here
    (_omp_threads) and NCCL's defaults."""
    return {**_omp_threads(inp.environ, inp.host, local_procs, procs_per_task), **_nccl_defaults(inp.environ, inp.backend)}


def _exec_plan(
    inp: _Inputs, *, rank: int, world: int, local_rank: int, local_world: int, node_rank: int, nnodes: int, addr: str, port: int
) -> Plan:
    """This process is the rank: exec the command with the DDP variables set."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world),
        "NODE_RANK": str(node_rank),
        "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "DDPACK_BACKEND": inp.backend,
        **_launch_env(inp, local_world),
    }
    return _plan(inp, "exec", inp.options.command, env, rank=rank, world_size=world, local_rank=local_rank,
                 local_world_size=local_world, node_rank=node_rank, nnodes=nnodes, master_addr=addr, master_port=port)  # fmt: skip


def _torchrun_plan(
    inp: _Inputs, *, nnodes: int, nproc: int, node_rank: int, addr: str, port: int, rdzv_id: str | None, procs_per_task: int = 1
) -> Plan:
    """This process becomes a torchrun agent for `nproc` local ranks; rdzv_id None means --standalone."""
    endpoint = None if rdzv_id is None else f"{url_host(addr)}:{port}"
    shutdown = _opt_int_var(inp.environ, "DDPACK_SHUTDOWN_TIMEOUT", DEFAULT_SHUTDOWN_TIMEOUT, minimum=1)
    argv = _torchrun_argv(inp.options.command, nnodes, nproc, endpoint, rdzv_id or "", shutdown)
    env = {"DDPACK_BACKEND": inp.backend, **_launch_env(inp, nproc, procs_per_task)}
    if "PET_SIGNALS_TO_HANDLE" not in inp.environ:
        env["PET_SIGNALS_TO_HANDLE"] = TORCHRUN_SIGNALS
    return _plan(inp, "torchrun", argv, env, rank=None, world_size=nnodes * nproc, local_rank=None,
                 local_world_size=nproc, node_rank=node_rank, nnodes=nnodes, master_addr=addr, master_port=port)  # fmt: skip


def _resolve_torchelastic(inp: _Inputs) -> Plan:
    """Under torchrun the environment is already right: pass it through, adding only what is absent."""
    environ = inp.environ
    world = _opt_int_var(environ, "WORLD_SIZE", 1, 1)
    local_world = _opt_int_var(environ, "LOCAL_WORLD_SIZE", 1, 1)
    env = {"DDPACK_BACKEND": inp.backend} if "DDPACK_BACKEND" not in environ else {}
    env.update(_launch_env(inp, local_world))
    return _plan(inp, "exec", inp.options.command, env, rank=_opt_int_var(environ, "RANK", 0), world_size=world,
                 local_rank=_opt_int_var(environ, "LOCAL_RANK", 0), local_world_size=local_world,
                 node_rank=_opt_int_var(environ, "GROUP_RANK", 0), nnodes=max(1, world // local_world),
                 master_addr=environ.get("MASTER_ADDR", ""), master_port=_port_var(environ, "MASTER_PORT", 0))  # fmt: skip


def _resolve_slurm(inp: _Inputs) -> Plan:
    """A task of an `srun` step: the step's variables, not the job's, say where this task stands."""
    environ = inp.environ
    world = _int_var(environ, "SLURM_STEP_NUM_TASKS", 1, "the number of tasks in the step")
    rank = _int_var(environ, "SLURM_PROCID", 0, "this task's rank in the step")
    node_rank = _int_var(environ, "SLURM_NODEID", 0, "this task's node index in the step")
    local_rank = _int_var(environ, "SLURM_LOCALID", 0, "this task's index on its node")
    step_id = _int_var(environ, "SLURM_STEP_ID", 0, "the step id")
    job_var = "SLURM_JOB_ID" if "SLURM_JOB_ID" in environ else "SLURM_JOBID"
    job_id = _int_var(environ, job_var, 0, "the job id")

    nodelist_var = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in environ else "SLURM_JOB_NODELIST"
    tpn_var = "SLURM_STEP_TASKS_PER_NODE" if "SLURM_STEP_TASKS_PER_NODE" in environ else "SLURM_TASKS_PER_NODE"
    try:
        hosts = expand_hostlist(environ.get(nodelist_var, ""))
    except HostlistError as exc:
        raise PlanError(f"{nodelist_var}={environ.get(nodelist_var, '')!r} is not a Slurm hostlist: {exc}") from None
    try:
        tasks_per_node = expand_tasks_per_node(environ.get(tpn_var, ""))
    except HostlistError as exc:
        raise PlanError(f"{tpn_var}={environ.get(tpn_var, '')!r} is malformed: {exc}") from None

    if len(tasks_per_node) != len(hosts):
        raise PlanError(
            f"{tpn_var}={environ[tpn_var]!r} describes {len(tasks_per_node)} nodes but "
            f"{nodelist_var} has {len(hosts)}; expected one count per node"
        )
    if sum(tasks_per_node) != world:
        raise PlanError(
            f"{tpn_var}={environ[tpn_var]!r} adds up to {sum(tasks_per_node)} tasks but "
            f"SLURM_STEP_NUM_TASKS={world}; expected them to agree"
        )
    if rank >= world:
        raise PlanError(f"SLURM_PROCID={rank} is not below SLURM_STEP_NUM_TASKS={world}")
    if node_rank >= len(hosts):
        raise PlanError(f"SLURM_NODEID={node_rank} is not below the step's {len(hosts)} nodes")
    local_world = tasks_per_node[node_rank]
    if local_rank >= local_world:
        raise PlanError(f"SLURM_LOCALID={local_rank} is outside node {node_rank}'s {local_world} tasks ({tpn_var}={environ[tpn_var]!r})")

    addr = bare_host(environ["MASTER_ADDR"]) if environ.get("MASTER_ADDR") else hosts[0]
    port = _port_var(environ, "MASTER_PORT", slurm_master_port(job_id, step_id))
    one_task_per_node = all(count == 1 for count in tasks_per_node)
    nproc = inp.options.nproc_per_node
    if nproc is not None and not one_task_per_node:
        raise PlanError(
            f"--nproc-per-node needs one Slurm task per node, but {tpn_var}={environ[tpn_var]!r}; "
            "use --ntasks-per-node=1 or drop --nproc-per-node"
        )
    devices = visible_cuda_devices(environ, inp.host)
    if one_task_per_node and (nproc or devices > 1):
        nproc = nproc or devices
        return _torchrun_plan(
            inp, nnodes=len(hosts), nproc=nproc, node_rank=node_rank, addr=addr, port=port, rdzv_id=str(job_id), procs_per_task=nproc
        )
    return _exec_plan(
        inp,
        rank=rank,
        world=world,
        local_rank=local_rank,
        local_world=local_world,
        node_rank=node_rank,
        nnodes=len(hosts),
        addr=addr,
        port=port,
    )


def _resolve_env(inp: _Inputs) -> Plan:
    """`docker run -e RANK=... -e WORLD_SIZE=... -e MASTER_ADDR=...`: use what is given.

    With --nproc-per-node, each container is one node running torchrun: give NNODES and NODE_RANK
    (not RANK/WORLD_SIZE, which torchrun assigns per process).
    """
    environ = inp.environ
    port = _port_var(environ, "MASTER_PORT", DEFAULT_MASTER_PORT)
    addr = bare_host(environ.get("MASTER_ADDR", ""))
    if inp.options.nproc_per_node is not None:
        if "RANK" in environ or "WORLD_SIZE" in environ:
            raise PlanError(
                "RANK/WORLD_SIZE are set together with --nproc-per-node; torchrun assigns them, so set NNODES and NODE_RANK instead"
            )
        nnodes = _opt_int_var(environ, "NNODES", 1, 1)
        node_rank = _opt_int_var(environ, "NODE_RANK", 0)
        if node_rank >= nnodes:
            raise PlanError(f"NODE_RANK={node_rank} is not below NNODES={nnodes}")
        if nnodes > 1 and not addr:
            raise PlanError(f"NNODES={nnodes} but MASTER_ADDR is not set; set it to node 0's host name or address")
        rdzv_id = environ.get("RDZV_ID", "ddpack")
        return _torchrun_plan(
            inp, nnodes=nnodes, nproc=inp.options.nproc_per_node, node_rank=node_rank, addr=addr or "127.0.0.1", port=port, rdzv_id=rdzv_id
        )
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        missing = "RANK" if "RANK" not in environ else "WORLD_SIZE"
        raise PlanError(f"{missing} is not set; set RANK and WORLD_SIZE together (or neither, for one process)")
    world = _int_var(environ, "WORLD_SIZE", 1, "the number of processes in the job")
    rank = _int_var(environ, "RANK", 0, "this process's global rank")
    if rank >= world:
        raise PlanError(f"RANK={rank} is not below WORLD_SIZE={world}; expected 0..{world - 1}")
    local_world = _opt_int_var(environ, "LOCAL_WORLD_SIZE", 1, 1)
    local_rank = _opt_int_var(environ, "LOCAL_RANK", 0)
    if local_rank >= local_world:
        raise PlanError(f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world}")
    node_rank = _opt_int_var(environ, "NODE_RANK", rank // local_world)
    if world > 1 and not addr:
        raise PlanError(f"WORLD_SIZE={world} but MASTER_ADDR is not set; set it to rank 0's host name or address")
    nnodes = max(1, world // local_world)
    return _exec_plan(
        inp,
        rank=rank,
        world=world,
        local_rank=local_rank,
        local_world=local_world,
        node_rank=node_rank,
        nnodes=nnodes,
        addr=addr or "127.0.0.1",
        port=port,
    )


def _resolve_single(inp: _Inputs) -> Plan:
    """Nothing set: one process on loopback, or `torchrun --standalone` when N processes are asked for."""
    addr = bare_host(inp.environ.get("MASTER_ADDR") or "127.0.0.1")
    port = _port_var(inp.environ, "MASTER_PORT", inp.host.free_port)
    nproc = inp.options.nproc_per_node or 1
    if nproc > 1:
        return _torchrun_plan(inp, nnodes=1, nproc=nproc, node_rank=0, addr=addr, port=port, rdzv_id=None)
    return _exec_plan(inp, rank=0, world=1, local_rank=0, local_world=1, node_rank=0, nnodes=1, addr=addr, port=port)


_RESOLVERS = {
    "torchelastic": _resolve_torchelastic,
    "slurm": _resolve_slurm,
    "env": _resolve_env,
    "single": _resolve_single,
}


def resolve_plan(environ: Mapping[str, str], options: Options, host: Host) -> Plan:
    """The one entry point: environment + options + host facts -> a validated Plan (or PlanError)."""
    if options.nproc_per_node is not None and options.nproc_per_node < 1:
        raise PlanError(f"--nproc-per-node={options.nproc_per_node} is not >= 1")
    cpu_bind = environ.get("DDPACK_CPU_BIND")
    if cpu_bind and cpu_bind not in CPU_BIND_CHOICES:  # read by every rank's trainer; caught here once
        raise PlanError(f"DDPACK_CPU_BIND={cpu_bind!r} is not one of {', '.join(CPU_BIND_CHOICES)}; set it to one of them or unset it")
    job_token(environ)  # read by every rank's watchdog; caught here once, before any rank starts
    mode = detect_mode(environ)
    return _RESOLVERS[mode](_Inputs(mode=mode, environ=environ, options=options, host=host, backend=choose_backend(environ, options, host)))
