# ddpack-job.sh — what every ddpack Slurm template shares; sourced by enroot/*.sbatch (bash 4.2+).
#
#   ddpack_setup NAME          the run directory and the banner line (sets DDPACK_RUN_DIR)
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
#   ddpack_name_container      pyxis templates with DDPACK_PREFLIGHT=1: set ddpack_container_name, which
#                              both steps pass as --container-name so pyxis unpacks the image once per node
#   ddpack_remove_container    remove that container from every node (pyxis keeps named containers
#                              after the job unless its plugstack.conf sets container_scope=job)
#   ddpack_after_step RC       requeue or not, from the training step's exit status (see the function)
#
# Run directories: one run, one folder. A new submission gets runs/<job name>-<job id> in the submission
# folder; a requeue keeps its job id and so continues its own folder; to continue an earlier run in a new
# job, name its folder with DDPACK_RUN_DIR (the banner prints the line to use). Two jobs submitted from one
# folder therefore never resume each other's snapshots.

ddpack_start_marker=.ddpack-this-start

ddpack_die() {
    echo "ddpack: error: $*" >&2
    exit 2
}

ddpack_setup() {
    local name=$1
    if [ -n "${DDPACK_RUN_DIR:-}" ]; then
        ddpack_run_origin="continuing ${DDPACK_RUN_DIR} (DDPACK_RUN_DIR)"
    else
        DDPACK_RUN_DIR=${SLURM_SUBMIT_DIR}/runs/${name}-${SLURM_JOB_ID}
        if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
            ddpack_run_origin="requeued: continuing its run from the last snapshot"
        else
            ddpack_run_origin="new run; a requeue continues it; to continue it in another job: sbatch --export=ALL,DDPACK_RUN_DIR=${DDPACK_RUN_DIR} ..."
        fi
    fi
    export DDPACK_RUN_DIR
    mkdir -p "${DDPACK_RUN_DIR}" || ddpack_die "cannot create the run directory ${DDPACK_RUN_DIR}; set DDPACK_RUN_DIR to a writable folder on the shared filesystem"
    : >"${DDPACK_RUN_DIR}/${ddpack_start_marker}"   # forensics newer than this were written during this start
    echo "ddpack: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST}, run dir ${DDPACK_RUN_DIR} (${ddpack_run_origin})"
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
        read -r -a ddpack_cmd <<<"${DDPACK_COMMAND}"
        ddpack_cmd=(-- "${ddpack_cmd[@]}")
    else
        read -r -a ddpack_cmd <<<"${DDPACK_TRAIN_ARGS:-}"
    fi
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
        exit "${rc}"
    fi
    if [ "${DDPACK_PREFLIGHT}" = only ]; then
        echo "ddpack: preflight passed; report ${DDPACK_RUN_DIR}/preflight.json"
        exit 0
    fi
}

ddpack_preflight_options() {
    local -a extra
    read -r -a extra <<<"${DDPACK_PREFLIGHT_ARGS:-}"
    ddpack_preflight_opts=(--preflight --preflight-json "$1/preflight.json" ${extra[@]+"${extra[@]}"})
}

ddpack_container_name=""

ddpack_name_container() {
    [ "${DDPACK_PREFLIGHT:-0}" = 1 ] && ddpack_container_name=ddpack-${SLURM_JOB_ID}
    return 0
}

ddpack_remove_container() {
    [ -n "${ddpack_container_name}" ] || return 0
    # One task per node, with the node's own enroot (the one pyxis runs). Under container_scope=job pyxis
    # calls it pyxis_<job>_<name> and removes it itself, so a missing pyxis_<name> is not an error.
    srun --ntasks-per-node=1 --nodes="${SLURM_JOB_NUM_NODES}" \
        bash -c 'enroot remove -f "pyxis_$1" >/dev/null 2>&1 || true' _ "${ddpack_container_name}"
    ddpack_container_name=""
}

# The step's exit status decides, whatever ran (the bundled trainer, your DDPACK_COMMAND, the image's own):
#   0 done; 2 bad input (never retried: the error line says what to fix);
#   128+10 / 128+15 (138, 143) stopped on SIGUSR1/SIGTERM: preempted, requeued up to DDPACK_MAX_RESTARTS (10);
#   anything else (124 a hang the watchdog ended, 137 a SIGKILL such as the OOM killer's or srun's for a rank
#   still frozen DDPACK_STEP_WAIT seconds after the others ended, 1 a crash or a lost peer): a failure, retried up
#   to DDPACK_MAX_FAILURE_RESTARTS times (default 1) per run folder, keeping out the nodes the hang's forensics
#   named unresponsive where the partition has others to spare. A hang is told by its exit 124 or by forensics
#   written during this start (the frozen rank's 137 is the step's status then).
ddpack_after_step() {
    local rc=$1 restarts=${SLURM_RESTART_COUNT:-0} max=${DDPACK_MAX_RESTARTS:-10} max_failed=${DDPACK_MAX_FAILURE_RESTARTS:-1}
    local failures_file=${DDPACK_RUN_DIR}/.ddpack-failure-restarts failed=0 kind
    case "${max}" in '' | *[!0-9]*) ddpack_die "DDPACK_MAX_RESTARTS=${max} is not a whole number" ;; esac
    case "${max_failed}" in '' | *[!0-9]*) ddpack_die "DDPACK_MAX_FAILURE_RESTARTS=${max_failed} is not a whole number" ;; esac
    ddpack_report_hint
    case "${rc}" in
    0) return 0 ;;
    2)
        echo "ddpack: the step ended on bad input (exit 2); not requeueing: fix what its error line names and resubmit"
        return 0
        ;;
    138 | 143) kind=preempted ;;
    *) kind=failed ;;
    esac
    if [ "${kind}" = preempted ]; then
        if [ "${restarts}" -ge "${max}" ]; then
            echo "ddpack: preempted (exit ${rc}) after ${restarts} restarts, the cap DDPACK_MAX_RESTARTS=${max}; not requeueing (resubmit with DDPACK_RUN_DIR=${DDPACK_RUN_DIR} to continue)"
            return 0
        fi
        echo "ddpack: preempted (exit ${rc}); requeueing job ${SLURM_JOB_ID} (restart $((restarts + 1)) of at most ${max})"
        ddpack_requeue
        return 0
    fi
    [ -f "${failures_file}" ] && failed=$(cat "${failures_file}")
    case "${failed}" in '' | *[!0-9]*) failed=0 ;; esac
    local what="failed (exit ${rc})" forensics=${DDPACK_RUN_DIR}/forensics
    if [ "${rc}" -eq 124 ] || [ "${forensics}/summary.json" -nt "${DDPACK_RUN_DIR}/${ddpack_start_marker}" ]; then
        what="ended as hung (exit ${rc}; evidence in ${forensics})"
    fi
    if [ "${failed}" -ge "${max_failed}" ] || [ "${restarts}" -ge "${max}" ]; then
        echo "ddpack: the step ${what} after ${failed} failure restarts, the cap DDPACK_MAX_FAILURE_RESTARTS=${max_failed}; not requeueing (resubmit with DDPACK_RUN_DIR=${DDPACK_RUN_DIR} to continue from its last snapshot)"
        return 0
    fi
    echo "$((failed + 1))" >"${failures_file}.tmp" && mv "${failures_file}.tmp" "${failures_file}"
    echo "ddpack: the step ${what}; requeueing job ${SLURM_JOB_ID} to resume from its last snapshot (failure restart $((failed + 1)) of at most ${max_failed})"
    ddpack_nodes_to_keep_out
    ddpack_requeue "${ddpack_keep_out}"
}

# Where the run's charts come from, once a step has left metrics (a user's own program may write none).
ddpack_report_hint() {
    [ -s "${DDPACK_RUN_DIR}/metrics.jsonl" ] || return 0
    echo "ddpack: metrics in ${DDPACK_RUN_DIR}/metrics.jsonl; for the run report (${DDPACK_RUN_DIR}/report.html) run, in the ddpack checkout: make report RUN=${DDPACK_RUN_DIR}"
}

# Set ddpack_keep_out to the nodes a hang's forensics named unresponsive during this start, comma-separated,
# when the partition has enough other nodes for the job (else it would never start again, and a line says so).
ddpack_nodes_to_keep_out() {
    local named=${DDPACK_RUN_DIR}/forensics/unresponsive-nodes nodes total
    ddpack_keep_out=""
    [ -s "${named}" ] && [ "${named}" -nt "${DDPACK_RUN_DIR}/${ddpack_start_marker}" ] || return 0
    nodes=$(paste -sd, "${named}")
    total=$(sinfo -h -p "${SLURM_JOB_PARTITION:-}" -o %D 2>/dev/null | head -n1)
    case "${total}" in '' | *[!0-9]*) total=0 ;; esac
    if [ "$((total - $(wc -l <"${named}")))" -lt "${SLURM_JOB_NUM_NODES:-1}" ]; then
        echo "ddpack: not keeping out ${nodes} (named unresponsive): partition ${SLURM_JOB_PARTITION:-?} has ${total} nodes and the job needs ${SLURM_JOB_NUM_NODES:-1}"
        return 0
    fi
    ddpack_keep_out=${nodes}
}

# Requeue this job, then keep NODES (if any) out of its next start. Slurm refuses ExcNodeList for a running job,
# and a requeue SIGTERMs this script and kills it KillWait seconds later (30 by default): the trap keeps it
# alive for the one update that follows.
ddpack_requeue() {
    local nodes=${1:-}
    trap ':' TERM
    scontrol requeue "${SLURM_JOB_ID}" || return 0
    [ -n "${nodes}" ] || return 0
    if scontrol update "JobId=${SLURM_JOB_ID}" "ExcNodeList=${nodes}"; then
        echo "ddpack: keeping ${nodes} (named unresponsive by the hang's forensics) out of the restart"
    else
        echo "ddpack: could not keep ${nodes} out of the restart (scontrol update refused); it may land there again"
    fi
}
