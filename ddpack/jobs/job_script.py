"""The job script `ddpack submit` writes into the run folder: one of the pyxis templates (enroot/pyxis-per-task.sbatch,
enroot/pyxis-torchrun.sbatch) with the run's #SBATCH options in place of the template's and its settings exported at
the top, nothing inherited from the submitting shell's DDPACK_* variables (a sweep's script picks its point's folder,
command and values by the array index): the script in the run folder is the whole job, and `ddpack resubmit` sends it
again. Rendering only: no file is written here but the script and the helpers it sources (`write_job`).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

from ddpack.errors import HostError
from ddpack.job_side import ENROOT
from ddpack.jobs.submit_checks import TEMPLATES, SubmitSettings, per_point, recovery_plan
from ddpack.jobs.sweep_points import sweep_command, sweep_env
from train import run_folder

# The job's files beside its script (enroot/ddpack_job.py's docstring says what each holds).
HELPERS = ("ddpack-job.sh", "ddpack_job.py", "ddpack_node.py", "ddpack_records.py", "ddpack_settings.py", "ddpack_slurm.py", "ddpack_staging.py",
           "ddpack_step.py", "ddpack_step_records.py", "ddpack_training.py")  # fmt: skip


def sbatch_directive(option: str) -> str:
    """An --sbatch-arg as an #SBATCH line takes it: a value with a space in double quotes (sbatch reads an unquoted
    second word as a directive of its own, and refuses it)."""
    name, sep, value = option.partition("=")
    return f'{name}="{value}"' if sep and re.search(r"\s", value) else option


def slurm_options(settings: SubmitSettings) -> dict[str, str | None]:
    """Slurm's own options the user gave by name (sbatch's spelling without its dashes)."""
    return {"account": settings.account, "qos": settings.qos, "constraint": settings.constraint, "reservation": settings.reservation,
            "dependency": settings.dependency}  # fmt: skip


def sbatch_lines(settings: SubmitSettings, run_dir: Path) -> list[str]:
    """The job's #SBATCH options; a sweep's array writes each point's log in that point's run folder (`%a`)."""
    per_node = 1 if settings.template == "torchrun" else settings.tasks_per_node
    count = len(settings.points) if settings.sweep else 0
    limit = f"%{settings.sweep_parallel}" if settings.sweep_parallel else ""
    log = run_dir / "%a" / run_folder.LOGS / run_folder.job_log("%A_%a") if count else run_dir / run_folder.LOGS / run_folder.job_log("%j")
    lines = [
        f"--job-name={settings.job_name}",
        f"--nodes={settings.nodes + settings.spares}",
        f"--ntasks-per-node={per_node}",
        *([f"--gpus-per-node={settings.gpus_per_node}"] if settings.gpus_per_node else []),
        *([f"--partition={settings.partition}"] if settings.partition else []),
        *([f"--time={settings.time_limit}"] if settings.time_limit else []),
        *([f"--array=0-{count - 1}{limit}"] if count else []),
        *(f"--{key}={value}" for key, value in slurm_options(settings).items() if value),
        *([] if settings.share else ["--exclusive"]),  # a point that asks less than a node shares (submit_checks.point_share)
        f"--output={log}",
        "--open-mode=append",
        "--signal=USR1@90",
        "--requeue",
        "--no-kill",
        *(sbatch_directive(option) for option in settings.sbatch_args),
    ]
    return [f"#SBATCH {line}" for line in lines]


def exported(settings: SubmitSettings, run_dir: Path, sqsh: Path) -> dict[str, str]:
    """The settings the job script exports; a sweep's script sets DDPACK_RUN_DIR and DDPACK_COMMAND a point
    (sweep_block), its settings otherwise the same for every point."""
    values = {
        "DDPACK_HOME": str(run_dir / run_folder.JOB),
        "DDPACK_RUN_DIR": str(run_dir),
        "DDPACK_SQSH": str(sqsh),
        "DDPACK_MOUNTS": settings.mounts,
    }
    if settings.sweep:
        del values["DDPACK_RUN_DIR"]
    elif settings.command:  # a JSON list: every word reaches every rank's exec exactly as given (ddpack_words)
        values["DDPACK_COMMAND"] = json.dumps(list(settings.command))
    if settings.spares:
        values["DDPACK_SPARE_NODES"] = str(settings.spares)
    # The count the run has, resolved here (--standbys, else the table's default for this job): the script says it.
    values["DDPACK_STANDBYS"] = str(recovery_plan(settings).standbys)
    if settings.template == "torchrun":
        values["DDPACK_NPROC"] = str(settings.tasks_per_node)
    return {**values, **{name: value for name, value in settings.env.items() if not per_point(settings, value)}}


def sweep_block(settings: SubmitSettings, sweep_dir: Path) -> list[str]:
    """A sweep's script: each array task picks its point's run folder and command (a JSON list, as DDPACK_COMMAND is).
    A sweep with no command (the bundled trainer, its points told apart by an --env value such as DDPACK_TRAIN_ARGS)
    sets no DDPACK_COMMAND: the job refuses one beside DDPACK_TRAIN_ARGS, and `[]` would be one."""
    every = settings.points
    commands = [
        "ddpack_commands=(",
        # Each command a JSON list in single quotes; the comment is the point as JSON (no newline can end it early).
        *(
            f"    {shlex.quote(json.dumps(sweep_command(settings.command, point, i)))}  # {json.dumps(point)}"
            for i, point in enumerate(every)
        ),
        ")",
    ]
    return [
        f"# A sweep of {len(every)} points, one a task of the array: the point's run folder{' and command' if settings.command else ''}.",
        f'ddpack_point=${{SLURM_ARRAY_TASK_ID:?"this script is a sweep of {len(every)} points: sbatch --array=0-{len(every) - 1} it"}}',
        *(commands if settings.command else []),
        *per_point_env(settings, every),
        f"export DDPACK_RUN_DIR={shlex.quote(str(sweep_dir))}/${{ddpack_point}}",
        *(['export DDPACK_COMMAND="${ddpack_commands[ddpack_point]}"'] if settings.command else []),
    ]


def per_point_env(settings: SubmitSettings, every: list[dict[str, str]]) -> list[str]:
    """Each --env value with a {NAME} in it, one a point (an array a variable, picked by the array task)."""
    lines = []
    for number, (name, value) in enumerate(item for item in settings.env.items() if per_point(settings, item[1])):
        values = [sweep_env({name: value}, point, i)[name] for i, point in enumerate(every)]
        lines += [
            f"ddpack_env_{number}=({' '.join(shlex.quote(v) for v in values)})",
            f'export {name}="${{ddpack_env_{number}[ddpack_point]}}"',
        ]
    return lines


def render_script(settings: SubmitSettings, run_dir: Path, sqsh: Path) -> str:
    """The template with this run's #SBATCH options and settings: the whole job, as submitted."""
    template = (ENROOT / TEMPLATES[settings.template]).read_text()
    head, marker, body = template.partition("set -uo pipefail\n")
    if not marker:
        raise HostError(f"enroot/{TEMPLATES[settings.template]} has no 'set -uo pipefail' line to put the settings after", code=1)
    comments = [line for line in head.splitlines() if not line.lstrip("#").startswith("SBATCH")]
    settings_block = [
        "# ddpack submit: this run's settings (run.json records them). None is inherited from the submitting shell.",
        "for ddpack_var in $(compgen -e | grep '^DDPACK_'); do unset \"${ddpack_var}\"; done",
        "unset SLURM_EXPORT_ENV  # sbatch --export named what the job takes from the shell; every step gets all of this script's",
        *(f"export {name}={shlex.quote(value)}" for name, value in exported(settings, run_dir, sqsh).items()),
        *(sweep_block(settings, run_dir) if settings.sweep else []),
    ]
    return "\n".join([comments[0], *sbatch_lines(settings, run_dir), *comments[1:], marker.rstrip("\n"), *settings_block, ""]) + body


def write_job(run_dir: Path, script: str) -> Path:
    """The job script and the helpers it sources, copied into the run folder: what ran stays with the run."""
    job = run_dir / run_folder.JOB
    job.mkdir()
    for helper in HELPERS:
        shutil.copy2(ENROOT / helper, job / helper)
    path = job / run_folder.JOB_SCRIPT
    path.write_text(script)
    path.chmod(0o700)
    (run_dir / run_folder.LOGS).mkdir()
    return path
