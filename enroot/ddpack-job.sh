# ddpack-job.sh — what every ddpack Slurm template shares; sourced by enroot/*.sbatch (bash 4.2+).
#
#   ddpack_setup NAME          the umask (DDPACK_UMASK, 077), every setting checked, the run directory chosen and locked
#                              for this job, the banner (ddpack_node.py setup: sets DDPACK_RUN_DIR), and the watchdog's
#                              secret (DDPACK_JOB_TOKEN)
#   ddpack_node VERB ARGS...   enroot/ddpack_node.py with the host's python3: staging, leases, the run folder's lock
#   ddpack_container_path P    P as the container sees it through DDPACK_MOUNTS, or a one-line error
#   ddpack_project_dir [container]
#                              export DDPACK_PROJECT_DIR, where the trainer imports `--task module:factory`
#                              from after its working directory: the submission folder (or DDPACK_PROJECT_DIR
#                              as given), as the container sees it with `container`
#   ddpack_command FOLDER      what the training step runs, in the array ddpack_cmd: DDPACK_COMMAND (your own
#                              program, e.g. "python ddp.py --epochs 5"), else DDPACK_TRAIN_ARGS (flags of the bundled
#                              trainer), else nothing: the image's own command (make image APP=DIR APP_CMD=...) or
#                              the bundled trainer. The trainer's run-folder defaults are exported for every case:
#                              DDPACK_SNAPSHOT_DIR=FOLDER/snapshots, DDPACK_METRICS_FILE=FOLDER/metrics.jsonl,
#                              DDPACK_FORENSICS_DIR=FOLDER/forensics
#                              (FOLDER as the container sees the run directory); a program of your own can use them.
#                              Sets SLURM_WAIT=DDPACK_STEP_WAIT (120; 0 waits forever): how long srun lets a step's other
#                              tasks outlive the first one to end before it kills them
#   ddpack_require_pyxis       fail at once when this cluster's srun has no pyxis (--container-image)
#   ddpack_preflight COMMAND...
#                              DDPACK_PREFLIGHT=1: run COMMAND (the template's own srun line with
#                              `entrypoint --preflight`) as a step before training; a failed check ends the
#                              job with its code. DDPACK_PREFLIGHT=only: the check alone (enroot/preflight.sbatch)
#   ddpack_preflight_options FOLDER
#                              the preflight step's entrypoint options (report FOLDER/preflight.json, then
#                              DDPACK_PREFLIGHT_ARGS, e.g. --preflight-strict) in the array ddpack_preflight_opts
#   ddpack_name_container      pyxis templates: set ddpack_container_name (ddpack-<job id>), which every step of
#                              the job passes as --container-name, so pyxis unpacks the image once per node per job
#   ddpack_prepare_nodes SQSH  pyxis templates, one step on every node of the job: remove containers that ended jobs
#                              left behind, and set ddpack_image, what --container-image names: SQSH itself, or its
#                              copy on each node's local disk (DDPACK_STAGE: ddpack_node.py stage)
#   ddpack_remove_container    remove the job's container from every node (pyxis keeps named containers
#                              after the job unless its plugstack.conf sets container_scope=job)
#   ddpack_train CMD...        the training step: the template's ddpack_step (srun and its options), then CMD, on
#                              the job's training nodes, restarted in this allocation while it can, then the job ends
#                              or goes back to the queue: ddpack_node.py train decides (this script execs it)
#   ddpack_leave               remove the container and give the run folder back (a script that trains no step)
#
ddpack_die() {
    echo "ddpack: error: $*" >&2
    ddpack_record step-end verdict=end reason=bad-input exit=2 text="error: $*"
    exit 2
}

ddpack_setup() {
    # What the job writes is its user's alone: run folders, snapshots (weights and optimizer state), metrics, forensics,
    # staged images. DDPACK_UMASK (077) is the umask of the script and so of every step (srun passes it to its tasks);
    # 027 lets your group read, for a team that shares runs.
    local mask=${DDPACK_UMASK:-077}
    [[ "${mask}" =~ ^0?[0-7]{3}$ ]] && umask "${mask}"
    DDPACK_RUN_DIR=$(ddpack_node setup "$1") || exit $?   # see ddpack_node.py setup
    export DDPACK_RUN_DIR
    ddpack_recording=1   # the run folder is this job's now: its decisions are recorded there
    # The hang watchdog's keys in the rendezvous store carry this secret, which only this start's ranks know (made
    # here, never sent through slurmctld; srun hands it to each task): another user who reaches the store's port
    # cannot name them.
    DDPACK_JOB_TOKEN=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
    export DDPACK_JOB_TOKEN
}

# ddpack_node VERB ARGS...: enroot/ddpack_node.py, the job's one program (standard-library Python: every decision the
# job makes), run with this host's system python3 in isolated mode (-I -S: no PYTHON* variables, no user or site
# packages; it starts in ~20 ms). It hands its own text to the steps it runs on the nodes, which need no checkout.
ddpack_node_file=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/ddpack_node.py
ddpack_python=$(command -v /usr/bin/python3 || command -v python3 || echo python3)
ddpack_node() {
    [ -f "${ddpack_node_file}" ] || ddpack_die "cannot read ddpack_node.py beside ddpack-job.sh; set DDPACK_HOME to ddpack's enroot/ folder"
    "${ddpack_python}" -I -S "${ddpack_node_file}" "$@"
}

# ddpack_record KIND NAME=VALUE...: one decision of the job as a record in the run folder (decisions.jsonl: a start,
# the placement, the staging choice and why, the step's end and what follows), which `ddpack status` reads; the
# line printed beside it is for people. A record that cannot be written costs a warning, never the job.
ddpack_recording=""
ddpack_record() {
    [ -n "${ddpack_recording}" ] && [ -f "${ddpack_node_file}" ] || return 0
    ddpack_node record "${DDPACK_RUN_DIR}" "$@" || true
}

# Each task of a one-task-per-GPU step gets its share of the node's CPUs. srun (Slurm 22.05 and later)
# does not inherit the job's --cpus-per-task, and without one each task may be bound to a single CPU: 8
# GPU ranks and their DataLoader workers on 8 cores of a 96-core node. srun reads SRUN_CPUS_PER_TASK:
# the job's --cpus-per-task when it gave one, else the node's CPUs divided among its tasks. A value the
# job set itself stands.
ddpack_cpus_per_task() {
    [ -n "${SRUN_CPUS_PER_TASK:-}" ] && return 0
    local cpus=${SLURM_CPUS_ON_NODE:-} tasks=${SLURM_NTASKS_PER_NODE:-} share
    if [[ "${SLURM_CPUS_PER_TASK:-}" =~ ^[0-9]+$ ]]; then
        share=${SLURM_CPUS_PER_TASK}
    elif [[ "${cpus}" =~ ^[0-9]+$ && "${tasks}" =~ ^[0-9]+$ ]] && (( tasks > 0 )); then
        share=$(( cpus / tasks ))
    else
        return 0
    fi
    (( share > 1 )) || return 0
    export SRUN_CPUS_PER_TASK=${share}
    echo "ddpack: each task gets ${share} CPUs (SRUN_CPUS_PER_TASK; set it to choose)"
}

# DDPACK_MOUNTS as pyxis takes --container-mounts: comma-separated SRC[:DST[:FLAGS]] (DST defaults to SRC).
ddpack_container_path() {
    local path=$1 best_src="" best_dst="" entry src dst rest
    local -a entries
    IFS=, read -r -a entries <<<"${DDPACK_MOUNTS:-}"
    for entry in ${entries[@]+"${entries[@]}"}; do
        src=${entry%%:*}
        rest=${entry#"${src}"}
        rest=${rest#:}
        dst=${rest%%:*}
        [ -n "${dst}" ] || dst=${src}
        src=${src%/}
        dst=${dst%/}
        case "${path}/" in
        "${src}"/*)
            if [ "${#src}" -gt "${#best_src}" ]; then
                best_src=${src} best_dst=${dst}
            fi
            ;;
        esac
    done
    [ -n "${best_src}" ] || ddpack_die "${path} is not under any of DDPACK_MOUNTS=${DDPACK_MOUNTS:-} (host:container pairs), so the container cannot reach it; submit from a folder on a mounted filesystem or add its mount to DDPACK_MOUNTS"
    echo "${best_dst}${path#"${best_src}"}"
}

ddpack_project_dir() {
    local dir=${DDPACK_PROJECT_DIR:-${SLURM_SUBMIT_DIR}}
    if [ "${1:-}" = container ]; then
        dir=$(ddpack_container_path "${dir}" 2>/dev/null) || {
            echo "ddpack: ${DDPACK_PROJECT_DIR:-${SLURM_SUBMIT_DIR}} is under none of DDPACK_MOUNTS=${DDPACK_MOUNTS:-}: --task modules are looked for in the run folder only"
            unset DDPACK_PROJECT_DIR
            return 0
        }
    fi
    export DDPACK_PROJECT_DIR=${dir}
}

ddpack_command() {
    export DDPACK_SNAPSHOT_DIR=$1/snapshots DDPACK_METRICS_FILE=$1/metrics.jsonl DDPACK_FORENSICS_DIR=$1/forensics
    # Once one task of a step has ended, srun gives the others DDPACK_STEP_WAIT seconds to end too, then kills
    # them (srun --wait, read from SLURM_WAIT). Slurm's default waits forever: a rank stopped or frozen
    # (SIGSTOP, a hung driver) outlives the watchdog's exit on the others and holds the job until its time
    # limit. Kept long enough for a rank 0 that saves after the others have left; raise it if yours saves longer.
    local wait=${DDPACK_STEP_WAIT:-120}
    case "${wait}" in '' | *[!0-9]*) ddpack_die "DDPACK_STEP_WAIT=${wait} is not a whole number of seconds" ;; esac
    export SLURM_WAIT=${wait}
    ddpack_cmd=()
    if [ -n "${DDPACK_COMMAND:-}" ]; then
        [ -z "${DDPACK_TRAIN_ARGS:-}" ] || ddpack_die "DDPACK_COMMAND and DDPACK_TRAIN_ARGS are both set; DDPACK_TRAIN_ARGS is for the bundled trainer: put your program's arguments in DDPACK_COMMAND"
        ddpack_words ddpack_cmd DDPACK_COMMAND
        ddpack_cmd=(-- ${ddpack_cmd[@]+"${ddpack_cmd[@]}"})
    else
        ddpack_words ddpack_cmd DDPACK_TRAIN_ARGS
    fi
}

# ddpack_words ARRAY SETTING: the words of a command setting into ARRAY (ddpack_node.py words: a JSON list of strings,
# each word exactly as given, or words split on whitespace), each word quoted there and assigned here by name.
ddpack_words() {
    case "$1" in '' | [!a-zA-Z_]* | *[!a-zA-Z0-9_]*) ddpack_die "ddpack_words: '$1' is not an array name" ;; esac
    local ddpack_words_quoted
    ddpack_words_quoted=$(ddpack_node words "$2") || exit 2
    eval "$1=(${ddpack_words_quoted})"
}

ddpack_require_pyxis() {
    srun --help 2>/dev/null | grep -q -- '--container-image' ||
        ddpack_die "this cluster's srun has no --container-image (pyxis is not loaded: no plugstack.conf entry on this node), so the job would run on the host; use enroot/baremetal.sbatch or ask for pyxis"
}

ddpack_preflight() {
    local rc
    case "${DDPACK_PREFLIGHT:-0}" in
    0 | '') return 0 ;;
    1 | only) ;;
    *) ddpack_die "DDPACK_PREFLIGHT=${DDPACK_PREFLIGHT} is not 0, 1 or only" ;;
    esac
    echo "ddpack: preflight (DDPACK_PREFLIGHT=${DDPACK_PREFLIGHT}): checking the job in its own image, plan and network first"
    "$@"
    rc=$?
    if [ "${rc}" -ne 0 ]; then
        ddpack_remove_container
        echo "ddpack: preflight failed (exit ${rc}); not training. The 'preflight: FAIL' lines above name each problem; the report is ${DDPACK_RUN_DIR}/preflight.json"
        ddpack_record preflight result=failed exit="${rc}" report="${DDPACK_RUN_DIR}/preflight.json"
        exit "${rc}"
    fi
    ddpack_record preflight result=passed exit=0 report="${DDPACK_RUN_DIR}/preflight.json"
    if [ "${DDPACK_PREFLIGHT}" = only ]; then
        echo "ddpack: preflight passed; report ${DDPACK_RUN_DIR}/preflight.json"
        exit 0
    fi
}

ddpack_preflight_options() {
    local -a extra
    ddpack_words extra DDPACK_PREFLIGHT_ARGS
    ddpack_preflight_opts=(--preflight --preflight-json "$1/preflight.json" ${extra[@]+"${extra[@]}"})
}

ddpack_container_name=""

ddpack_name_container() {
    ddpack_container_name=ddpack-${SLURM_JOB_ID}
}

ddpack_remove_container() {
    [ -z "${ddpack_container_name}" ] || ddpack_node remove-container "${ddpack_container_name}"
    ddpack_container_name=""
}

# --------------------------------------------------------------------------- the image on the nodes
#
# DDPACK_STAGE decides how the nodes get the squashfs (ddpack_node.py's Staging makes the choice and carries it out):
#   off     every node reads DDPACK_SQSH from the shared filesystem (pyxis 0.19's own way): N reads of the image
#   sbcast  one read: Slurm's sbcast sends it down a tree (fan-out DDPACK_STAGE_FANOUT, at most 8) to the nodes' local
#           disk, DDPACK_STAGE_DIR/<key>.sqsh, where <key> names the image's content; a node that already holds that key
#           (an earlier job's copy) is skipped. DDPACK_STAGE_KEEP (2) keys stay per node, and any key a live job of yours
#           has chosen. DDPACK_STAGE_DIR (default /tmp/ddpack-images-<your uid>) is yours alone (docs/security.md).
#   auto    (the default) the nodes' copies when every node holds the image already (nothing read at all); else sbcast
#           when the model (ddpack/jobs/goodput_model.py) says the nodes would wait less: from 5 nodes with the defaults
#           (DDPACK_FSX_MBPS=1200, DDPACK_SBCAST_MBPS=1000, DDPACK_UNPACK_MBPS=400)
# A GPU job (--gpus-per-node, --gres=gpu:N) checks first that every node has the GPUs it was promised.
ddpack_prepare_nodes() {
    ddpack_image=$(ddpack_node stage "$1") || exit $?
}

# --------------------------------------------------------------------------- training, restarted in place
#
# ddpack_node.py's Training decides (its docstring has the rules): the step's exit status ends the job, restarts the step
# in this allocation (a spare node swapped in for a bad one: DDPACK_SPARE_NODES=K with sbatch --nodes=N+K), or requeues
# the job, keeping out the nodes a hang's forensics named. This script becomes that program: it runs the steps.
ddpack_train() {
    exec "${ddpack_python}" -I -S "${ddpack_node_file}" train --container "${ddpack_container_name}" "${#ddpack_step[@]}" "${ddpack_step[@]}" "$@"
}

# The job's container leaves every node, and the run folder is free for another job (a script that trains no step).
ddpack_leave() {
    ddpack_node leave --container "${ddpack_container_name}"
    ddpack_container_name=""
}
