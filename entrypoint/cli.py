"""`entrypoint [--print-plan] [--nproc-per-node N] [--backend B] [--] [COMMAND ...]`.

Parses only its own leading options, so everything after them belongs to the command untouched:
`entrypoint python my_train.py --lr 3e-4`. Leading flags that are not the entrypoint's go to the
default trainer: `docker run IMAGE --epochs 3` runs `python -m train --epochs 3`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict

from entrypoint.plan import (
    BACKENDS,
    Host,
    Options,
    Plan,
    PlanError,
    app_command,
    from_app_dir,
    resolve_plan,
    seconds_up_to_an_hour,
    trainer_command,
)
from entrypoint.supervise import stop_grace, supervise

USAGE = f"""usage: entrypoint [--print-plan] [--nproc-per-node N] [--backend {{{",".join(BACKENDS)}}}]
                  [--preflight [--preflight-json PATH] [--preflight-seconds S] [--preflight-strict]]
                  [--] [COMMAND ...]

Resolve where this process stands in a DDP job (torchrun, Slurm srun with or without pyxis,
docker run -e RANK=..., or nothing) and exec COMMAND (default: the image's app command, $DDPACK_APP_CMD,
else python -m train; leading flags go to python -m train) with RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT, DDPACK_BACKEND set.
A command of your own runs under a small parent that makes a preemption (SIGUSR1, SIGTERM) end in 128+N
within $DDPACK_STOP_GRACE seconds (60), whatever the program does with the signal (entrypoint/supervise.py).

options:
  --print-plan          print the resolved plan as JSON and exit
  --nproc-per-node N    start N processes per node under torchrun (one Slurm task per node)
  --backend B           process-group backend (default: $DDPACK_BACKEND, else nccl with CUDA, else gloo)
  --preflight           instead of training, check the job under the same plan: ranks agree on image,
                        bundle, torch, CUDA/NCCL; all-reduce and point-to-point bandwidth; per-rank
                        compute (stragglers); the snapshot folder (trainer flags such as --snapshot-dir
                        are read as the trainer reads them). Exit 0 pass, 1 a check failed, 2 bad input
  --preflight-json PATH also write the preflight report as JSON (rank 0)
  --preflight-seconds S time budget of the preflight's measurements (default 30)
  --preflight-strict    fail on stragglers and slow links too (default: warn)
  -h, --help            show this help and exit
"""

PREFLIGHT_VALUES = ("--preflight-json", "--preflight-seconds")


class UsageError(ValueError):
    """A malformed entrypoint option."""


def preflight_command(trainer_flags: Sequence[str], values: dict[str, str | None]) -> tuple[str, ...]:
    """The preflight program in place of the trainer, under the same interpreter and safe path."""
    own = [item for name, value in values.items() for item in (name, value) if item is not None]  # flags: None
    return (*trainer_command()[:-1], "train.preflight", *own, *trainer_flags)


def _seconds(text: str) -> str:
    if seconds_up_to_an_hour(text) is None:
        raise UsageError(f"--preflight-seconds={text!r} is not a number of seconds in (0, 3600]")
    return text


def parse_args(args: Sequence[str], environ: Mapping[str, str] = os.environ) -> tuple[Options, bool]:
    """Split the entrypoint's own options from the command; returns (options, print_plan). With no
    command, an image built with a project (`make image APP=DIR APP_CMD=...`) runs the project's command;
    a relative script of the project is found from any working directory (`from_app_dir`)."""
    nproc: int | None = None
    backend: str | None = None
    print_plan = preflight = False
    preflight_values: dict[str, str | None] = {}
    rest = list(args)
    while rest:
        arg = rest[0]
        name, eq, inline = arg.partition("=")
        if arg == "--":
            rest.pop(0)
            break
        if arg in ("--print-plan", "--preflight"):
            print_plan, preflight = print_plan or arg == "--print-plan", preflight or arg == "--preflight"
            rest.pop(0)
        elif arg == "--preflight-strict":
            preflight_values[arg] = None
            rest.pop(0)
        elif name in ("--nproc-per-node", "--nproc_per_node", "--backend", *PREFLIGHT_VALUES):
            rest.pop(0)
            if not eq:
                if not rest:
                    raise UsageError(f"{name} needs a value")
                inline = rest.pop(0)
            if name == "--backend":
                backend = inline
            elif name in PREFLIGHT_VALUES:
                preflight_values[name] = _seconds(inline) if name == "--preflight-seconds" else inline
            else:
                try:
                    nproc = int(inline)
                except ValueError:
                    raise UsageError(f"{name}={inline!r} is not an integer") from None
        else:
            break
    if rest and os.path.basename(rest[0]) == "entrypoint":
        # `enroot start NAME entrypoint ...`: enroot's /etc/rc already runs the image's ENTRYPOINT
        # with the arguments, so the command is this launcher again. Resolve once, here: the inner
        # one would see this one's variables and take the job for a `docker run -e` one.
        before = list(args[: len(args) - len(rest)])
        return parse_args((before[:-1] if before[-1:] == ["--"] else before) + rest[1:], environ)
    if preflight_values and not preflight:
        raise UsageError(f"{next(iter(preflight_values))} is an option of --preflight; add --preflight")
    if preflight:
        if rest and not rest[0].startswith("-"):
            raise UsageError(
                f"--preflight runs the bundle's check in place of the trainer, not {rest[0]!r}; "
                "drop the command and pass trainer flags (e.g. --snapshot-dir DIR) if any"
            )
        command = preflight_command(rest, preflight_values)
    elif not rest:
        command = from_app_dir(app_command(environ) or trainer_command(), environ.get("DDPACK_APP_DIR"))
    elif rest[0].startswith("-"):
        command = (*trainer_command(), *rest)  # trainer flags with no command: they are the trainer's
    else:
        command = from_app_dir(rest, environ.get("DDPACK_APP_DIR"))
    return Options(command=command, nproc_per_node=nproc, backend=backend), print_plan


def plan_json(plan: Plan) -> str:
    """The plan as one JSON document (argv as a list, env as an object)."""
    data = asdict(plan)
    data["argv"] = list(plan.argv)
    data["env"] = dict(plan.env)
    data["supervised"] = supervised(plan)
    return json.dumps(data, indent=2, sort_keys=True)


def is_bundle_command(argv: Sequence[str]) -> bool:
    """The bundle's trainer or preflight, which stop on SIGUSR1/SIGTERM by themselves (agreed, then 128+N)."""
    prefix = trainer_command()[:-1]
    return tuple(argv[: len(prefix)]) == prefix and tuple(argv[len(prefix) : len(prefix) + 1]) in (("train",), ("train.preflight",))


def supervised(plan: Plan) -> bool:
    """Whether the plan's command runs under entrypoint.supervise: a command of the user's, run as this rank."""
    return plan.launcher == "exec" and not is_bundle_command(plan.argv)


def standbys_refused(plan: Plan, environ: Mapping[str, str]) -> str | None:
    """Why DDPACK_STANDBYS cannot hold for this plan, or None. It makes the bundled trainer's last ranks standbys
    (`--standbys`); any other program would take them for ranks, and under torchrun a task is not a rank. auto (the
    settings table's default) asks nothing of a task: the job's program resolves it and hands the step the count it
    started, so a task that still sees auto was started with no standby beside it."""
    value = environ.get("DDPACK_STANDBYS", "").strip()
    if not value.strip("0") or value == "auto":
        return None
    if plan.launcher == "torchrun":
        return f"DDPACK_STANDBYS={value} needs one process a rank, and torchrun (--nproc-per-node) starts a node's ranks itself; unset it"
    if not is_bundle_command(plan.argv):
        return f"DDPACK_STANDBYS={value} starts standbys of the bundled trainer, which this command is not ({plan.argv[0]}); unset it"
    return None


def execute(plan: Plan, grace_s: float) -> int:
    """Replace this process with the plan's command (returns only by raising), or supervise a user's own."""
    env = {**os.environ, **plan.env}
    if supervised(plan):
        return supervise(plan.argv, env, grace_s)
    os.execvpe(plan.argv[0], list(plan.argv), env)
    return 0  # unreachable: execvpe does not return


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] in (["-h"], ["--help"]):
        sys.stdout.write(USAGE)
        return 0
    try:
        options, print_plan = parse_args(args)
        plan = resolve_plan(os.environ, options, Host.probe())
        if (refused := standbys_refused(plan, os.environ)) is not None:
            raise PlanError(refused)
        grace_s = stop_grace(os.environ)
    except (UsageError, PlanError, ValueError) as exc:
        print(f"entrypoint: error: {exc}", file=sys.stderr)
        return 2
    if print_plan:
        print(plan_json(plan))
        return 0
    sys.stdout.flush()
    try:
        return execute(plan, grace_s)
    except FileNotFoundError:
        print(f"entrypoint: error: command not found: {plan.argv[0]!r}; check the image's PATH", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"entrypoint: error: command not executable: {plan.argv[0]!r}", file=sys.stderr)
        return 126


if __name__ == "__main__":
    sys.exit(main())
