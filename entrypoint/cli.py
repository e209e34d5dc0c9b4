"""`entrypoint [--print-plan] [--nproc-per-node N] [--backend B] [--] [COMMAND ...]`.

Parses only its own leading options, so everything after them belongs to the command untouched:
`entrypoint python my_train.py --lr 3e-4`. Leading flags that are not the entrypoint's go to the
default trainer: `docker run IMAGE --epochs 3` runs `python -m train --epochs 3`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict

from entrypoint.plan import BACKENDS, Host, Options, Plan, PlanError, default_command, resolve_plan

USAGE = f"""usage: entrypoint [--print-plan] [--nproc-per-node N] [--backend {{{",".join(BACKENDS)}}}] [--] [COMMAND ...]

Resolve where this process stands in a DDP job (torchrun, Slurm srun with or without pyxis,
docker run -e RANK=..., or nothing) and exec COMMAND (default: python -m train) with RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, MASTER_PORT, DDPACK_BACKEND set.

options:
  --print-plan          print the resolved plan as JSON and exit
  --nproc-per-node N    start N processes per node under torchrun (one Slurm task per node)
  --backend B           process-group backend (default: $DDPACK_BACKEND, else nccl with CUDA, else gloo)
  -h, --help            show this help and exit
"""


class UsageError(ValueError):
    """A malformed entrypoint option."""


def parse_args(args: Sequence[str]) -> tuple[Options, bool]:
    """Split the entrypoint's own options from the command; returns (options, print_plan)."""
    nproc: int | None = None
    backend: str | None = None
    print_plan = False
    rest = list(args)
    while rest:
        arg = rest[0]
        name, eq, inline = arg.partition("=")
        if arg == "--":
            rest.pop(0)
            break
        if arg == "--print-plan":
            print_plan = True
            rest.pop(0)
        elif name in ("--nproc-per-node", "--nproc_per_node", "--backend"):
            rest.pop(0)
            if not eq:
                if not rest:
                    raise UsageError(f"{name} needs a value")
                inline = rest.pop(0)
            if name == "--backend":
                backend = inline
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
        return parse_args((before[:-1] if before[-1:] == ["--"] else before) + rest[1:])
    if not rest:
        command = default_command()
    elif rest[0].startswith("-"):
        command = (*default_command(), *rest)  # trainer flags with no command: they are the trainer's
    else:
        command = tuple(rest)
    return Options(command=command, nproc_per_node=nproc, backend=backend), print_plan


def plan_json(plan: Plan) -> str:
    """The plan as one JSON document (argv as a list, env as an object)."""
    data = asdict(plan)
    data["argv"] = list(plan.argv)
    data["env"] = dict(plan.env)
    return json.dumps(data, indent=2, sort_keys=True)


def execute(plan: Plan) -> None:
    """Replace this process with the plan's command; returns only by raising."""
    env = {**os.environ, **plan.env}
    os.execvpe(plan.argv[0], list(plan.argv), env)


def main(argv: Sequence[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] in (["-h"], ["--help"]):
        sys.stdout.write(USAGE)
        return 0
    try:
        options, print_plan = parse_args(args)
        plan = resolve_plan(os.environ, options, Host.probe())
    except (UsageError, PlanError) as exc:
        print(f"entrypoint: error: {exc}", file=sys.stderr)
        return 2
    if print_plan:
        print(plan_json(plan))
        return 0
    sys.stdout.flush()
    try:
        execute(plan)
    except FileNotFoundError:
        print(f"entrypoint: error: command not found: {plan.argv[0]!r}; check the image's PATH", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"entrypoint: error: command not executable: {plan.argv[0]!r}", file=sys.stderr)
        return 126
    return 0  # unreachable: execvpe does not return


if __name__ == "__main__":
    sys.exit(main())
