# ddpack-job.sh — what every ddpack Slurm template shares; sourced by enroot/*.sbatch (bash 4.2+).
#
# The job's decisions are made by one standard-library Python program, enroot/ddpack_job.py and the files beside it
# (one a concern; ddpack_job.py's docstring lists them and every verb): the settings, the run folder, the staging, the
# placement, a restart in place or a requeue, the nodes kept out, and the records `ddpack status` reads. What stays here is what must be shell: the umask, the srun lines the templates build (as arrays,
# every word as given), and the exec into that program, which then runs the steps and the requeue.

# One line naming the bad input, recorded as the job's end once it has a run folder; exit 2 (never requeued).
ddpack_die() {
    echo "ddpack: error: $*" >&2
    ddpack_record step-end verdict=end reason=bad-input exit=2 text="error: $*"
    exit 2
}

# ddpack_setup NAME: every setting checked, the run folder chosen and locked for this job, the banner (ddpack_job.py
# setup: sets DDPACK_RUN_DIR); the umask and the watchdog's secret (DDPACK_JOB_TOKEN).
ddpack_setup() {
    # What the job writes is its user's alone: run folders, snapshots (weights and optimizer state), metrics, forensics,
    # staged images. DDPACK_UMASK is the umask of the script and so of every step (srun passes it to its tasks); 027 lets
    # your group read, for a team that shares runs.
    local mask
    ddpack_value mask DDPACK_UMASK
    [[ "${mask}" =~ ^0?[0-7]{3}$ ]] && umask "${mask}"
    ddpack_ask DDPACK_RUN_DIR setup -- "$1"   # see ddpack_job.py setup (a job name may start with -)
    export DDPACK_RUN_DIR
    ddpack_recording=1   # the run folder is this job's now: its decisions are recorded there
    # The hang watchdog's keys in the rendezvous store carry this secret, which only this start's ranks know (made
    # here, never sent through slurmctld; srun hands it to each task): another user who reaches the store's port
    # cannot name them.
    DDPACK_JOB_TOKEN=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
    export DDPACK_JOB_TOKEN
}

# ddpack_job VERB ARGS...: enroot/ddpack_job.py, the job's one program (standard-library Python: every decision the
# job makes), run with this host's system python3 in isolated mode (-I -S: no PYTHON* variables, no user or site
# packages; it starts in ~20 ms). It sends the nodes the text of ddpack_node.py, what they run: they need no checkout.
ddpack_job_file=$(CDPATH='' cd -- "$(dirname "${BASH_SOURCE[0]}")" && pwd)/ddpack_job.py
ddpack_python=$(command -v /usr/bin/python3 || command -v python3 || echo python3)

# The settings table's defaults (ddpack_settings.py defaults: the one place each is written), for ddpack_value.
declare -gA ddpack_defaults=()
ddpack_defaults_line=$("${ddpack_python}" -I -S "${ddpack_job_file%/*}/ddpack_settings.py" defaults) ||
    { echo "ddpack: error: cannot read the settings table (ddpack_settings.py beside ddpack-job.sh); set DDPACK_HOME to ddpack's enroot/ folder" >&2; exit 2; }
eval "${ddpack_defaults_line}"

# ddpack_value VAR NAME: VAR set to setting NAME as the job sees it: its value, else the table's default.
ddpack_value() {
    local ddpack_value_given=${!2-}
    printf -v "$1" '%s' "${ddpack_value_given:-${ddpack_defaults[$2]-}}"
}
ddpack_job() {
    [ -f "${ddpack_job_file}" ] || ddpack_die "cannot read ddpack_job.py beside ddpack-job.sh; set DDPACK_HOME to ddpack's enroot/ folder"
    ddpack_lc_ctype=${LC_CTYPE-"(unset)"} "${ddpack_python}" -I -S "${ddpack_job_file}" "$@"
}

# ddpack_ask VAR VERB ARGS...: VAR set to the verb's answer (on fd 3), its lines for people left in the job's log; a
# verb that fails ends the script with its status. Every answer of the job's program reaches the shell this one way.
ddpack_ask() {
    local ddpack_ask_to=$1 ddpack_ask_answer
    shift
    { ddpack_ask_answer=$(ddpack_answer_fd=3 ddpack_job "$@" 3>&1 1>&4 4>&-); } 4>&1 || exit $?
    printf -v "${ddpack_ask_to}" '%s' "${ddpack_ask_answer}"
}

# ddpack_record KIND NAME=VALUE...: one decision of the job as a record in the run folder (decisions.jsonl: a start,
# the placement, the staging choice and why, the step's end and what follows), which `ddpack status` reads; the
# line printed beside it is for people. A record that cannot be written costs a warning, never the job.
ddpack_recording=""
ddpack_record() {
    [ -n "${ddpack_recording}" ] && [ -f "${ddpack_job_file}" ] || return 0
    ddpack_job record "${DDPACK_RUN_DIR}" "$@" || true
}

# Each task of a one-task-per-GPU step gets its share of the node's CPUs (ddpack_job.py cpus-per-task says why).
ddpack_cpus_per_task() {
    local share
    ddpack_ask share cpus-per-task
    [ -z "${share}" ] || export SRUN_CPUS_PER_TASK=${share}
}

# ddpack_container_path VAR P: VAR set to P as the container sees it through DDPACK_MOUNTS, or a one-line error (exit 2).
ddpack_container_path() {
    ddpack_ask "$1" container-path "$2"
}

# Export DDPACK_PROJECT_DIR, where the trainer imports `--task module:factory` from after its working directory: the
# submission folder (or DDPACK_PROJECT_DIR as given), as the container sees it with `container`.
ddpack_project_dir() {
    local dir
    ddpack_ask dir project-dir "${1:-}"
    if [ -n "${dir}" ]; then export DDPACK_PROJECT_DIR=${dir}; else unset DDPACK_PROJECT_DIR; fi
}

# ddpack_command FOLDER: what the training step runs after the entrypoint, in the array ddpack_cmd: `--` and
# DDPACK_COMMAND (your own program), else DDPACK_TRAIN_ARGS (the bundled trainer's flags), else nothing (the image's own
# command or the bundled trainer); and the run folder's defaults (FOLDER as the container sees it), for any program.
ddpack_command() {
    export DDPACK_SNAPSHOT_DIR=$1/snapshots DDPACK_METRICS_FILE=$1/metrics.jsonl DDPACK_FORENSICS_DIR=$1/forensics
    # Once one task of a step has ended, srun gives the others DDPACK_STEP_WAIT seconds to end too, then kills
    # them (srun --wait, read from SLURM_WAIT). Slurm's default waits forever: a rank stopped or frozen
    # (SIGSTOP, a hung driver) outlives the watchdog's exit on the others and holds the job until its time
    # limit. Kept long enough for a rank 0 that saves after the others have left; raise it if yours saves longer.
    ddpack_value SLURM_WAIT DDPACK_STEP_WAIT
    export SLURM_WAIT
    ddpack_words ddpack_cmd COMMAND
}

# ddpack_words ARRAY SETTING: the words of a command setting into ARRAY (ddpack_job.py words: a JSON list of strings,
# each word exactly as given, or words split on whitespace), each word quoted there and assigned here by name.
ddpack_words() {
    case "$1" in '' | [!a-zA-Z_]* | *[!a-zA-Z0-9_]*) ddpack_die "ddpack_words: '$1' is not an array name" ;; esac
    local ddpack_words_quoted
    ddpack_ask ddpack_words_quoted words "$2"
    eval "$1=(${ddpack_words_quoted})"
}

# A template whose tasks are not each a rank (torchrun's agent starts a node's ranks) cannot start standbys: one line
# for a count asked for; the default (auto) is none here, which ddpack_train tells the job's program.
ddpack_tasks_are_ranks=1
ddpack_no_standbys() {
    local standbys
    ddpack_value standbys DDPACK_STANDBYS
    [[ "${standbys}" =~ ^(0*|auto)$ ]] ||
        ddpack_die "DDPACK_STANDBYS=${DDPACK_STANDBYS} needs one Slurm task per rank, and $1; use pyxis-per-task.sbatch or baremetal.sbatch, or unset it"
    ddpack_tasks_are_ranks=0
}

# Fail at once when this cluster's srun has no pyxis (--container-image).
ddpack_require_pyxis() {
    srun --help 2>/dev/null | grep -q -- '--container-image' ||
        ddpack_die "this cluster's srun has no --container-image (pyxis is not loaded: no plugstack.conf entry on this node), so the job would run on the host; use enroot/baremetal.sbatch or ask for pyxis"
}

# ddpack_preflight STEP...: DDPACK_PREFLIGHT=1 runs the template's own srun line with `entrypoint --preflight` before
# training; a node that fails only node checks is swapped for a spare (DDPACK_SPARE_NODES) and training goes on without
# it; any other failed check, or too few spares, ends the job with its code. DDPACK_PREFLIGHT=only: the check alone
# (enroot/preflight.sbatch).
ddpack_preflight() {
    local mode
    ddpack_job preflight --container "${ddpack_container_name}" -- "$@" || exit $?
    ddpack_value mode DDPACK_PREFLIGHT
    [ "${mode}" != only ] || exit 0
}

# The preflight's entrypoint options (its report FOLDER/preflight.json, then DDPACK_PREFLIGHT_ARGS) in ddpack_preflight_opts.
ddpack_preflight_options() {
    local -a extra
    ddpack_words extra DDPACK_PREFLIGHT_ARGS
    ddpack_preflight_opts=(--preflight --preflight-json "$1/preflight.json" ${extra[@]+"${extra[@]}"})
}

# pyxis templates: every step of the job (the preflight, training, its restarts) runs in one named container, so pyxis
# unpacks the image once per node per job; it leaves every node with the job (pyxis keeps named containers otherwise).
ddpack_container_name=""
ddpack_name_container() {
    ddpack_container_name=ddpack-${SLURM_JOB_ID}
}

ddpack_remove_container() {
    [ -z "${ddpack_container_name}" ] || ddpack_job remove-container --container "${ddpack_container_name}"
    ddpack_container_name=""
}

# ddpack_prepare_nodes SQSH: one step on every node (containers of ended jobs go, the GPUs a GPU job was promised are
# checked), then DDPACK_STAGE's choice (ddpack_staging.py's Staging): ddpack_image is SQSH itself, or its copy on each
# node's local disk, sent there once by sbcast; a node that could not stage has the job's named container made from SQSH
# alone, so its steps reuse that container (ddpack_name_container first).
ddpack_prepare_nodes() {
    ddpack_ask ddpack_image stage --container "${ddpack_container_name}" "$1"
}

# ddpack_train CMD...: the training step (ddpack_step, then CMD) on the job's training nodes. This script becomes
# ddpack_job.py train, which runs it, restarts it in this allocation while it can (a spare node swapped in for a bad
# one), then ends the job or requeues it, keeping out the nodes a hang's forensics named (ddpack_training.py has the rules).
# Nothing after ddpack_train runs (an EXIT trap neither): the program outlives the requeue's SIGTERM only as itself.
ddpack_train() {
    local shape=()
    [ "${ddpack_tasks_are_ranks}" = 1 ] || shape=(--tasks-not-ranks)
    ddpack_lc_ctype=${LC_CTYPE-"(unset)"} exec "${ddpack_python}" -I -S "${ddpack_job_file}" train --container "${ddpack_container_name}" \
        ${shape[@]+"${shape[@]}"} --step-words "${#ddpack_step[@]}" -- "${ddpack_step[@]}" "$@"
}

# The job's container leaves every node, and the run folder is free for another job (a script that trains no step).
ddpack_leave() {
    ddpack_job leave --container "${ddpack_container_name}"
    ddpack_container_name=""
}
