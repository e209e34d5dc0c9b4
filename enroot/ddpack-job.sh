# ddpack-job.sh — what every ddpack Slurm template shares; sourced by enroot/*.sbatch (bash 4.2+).
#
#   ddpack_setup NAME          the umask (DDPACK_UMASK, 077), the run directory, locked for this job (a second live
#                              job that names it is refused), the watchdog's secret (DDPACK_JOB_TOKEN) and the
#                              banner line (sets DDPACK_RUN_DIR)
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
#                              the job's training nodes; a failure restarts it in this allocation while it can
#                              (ddpack_after_step), then the job ends or goes back to the queue (ddpack_leave).
#                              Exits the script with the last step's status
#   ddpack_after_step RC       decide, from the training step's exit status, to end, restart here or requeue
#                              (sets ddpack_next; see the function); one line says which and why
#   ddpack_leave               remove the container; requeue when ddpack_after_step decided so, else give the run
#                              folder's lock back
#
# Run directories: one run, one folder. A new submission gets runs/<job name>-<job id> in the submission
# folder; a requeue keeps its job id and so continues its own folder; to continue an earlier run in a new
# job, name its folder with DDPACK_RUN_DIR (the banner prints the line to use). Two jobs submitted from one
# folder therefore never resume each other's snapshots.

ddpack_start_marker=.ddpack-this-start

ddpack_die() {
    echo "ddpack: error: $*" >&2
    ddpack_record step-end verdict=end reason=bad-input exit=2 text="error: $*"
    exit 2
}

ddpack_setup() {
    local name=$1
    # Every DDPACK_* value against ddpack_settings.py's table (the one ddpack submit checks too), before the run
    # folder is touched: one line each, exit 2. (A run folder from before the table has no copy of it.)
    [ -z "${ddpack_settings_py}" ] || "${ddpack_python}" -I -S -c "${ddpack_settings_py}" check || exit 2
    ddpack_private_files
    if [ -n "${DDPACK_RUN_DIR:-}" ]; then
        ddpack_run_origin="continuing ${DDPACK_RUN_DIR} (DDPACK_RUN_DIR)"
        [ -e "${DDPACK_RUN_DIR}/${ddpack_start_marker}" ] || ddpack_run_origin="new run in ${DDPACK_RUN_DIR} (DDPACK_RUN_DIR); a requeue continues it"
    else
        DDPACK_RUN_DIR=${SLURM_SUBMIT_DIR}/runs/${name}-${SLURM_JOB_ID}
        if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then
            ddpack_run_origin="requeued: continuing its run from the last snapshot"
        else
            ddpack_run_origin="new run; a requeue continues it; to continue it in another job: sbatch --export=ALL,DDPACK_RUN_DIR=${DDPACK_RUN_DIR} ..."
        fi
    fi
    export DDPACK_RUN_DIR
    # Made here when missing, then used only when it is this user's (not a link, nobody else can write or swap it),
    # and only by this job while it lives: another live job that names it is refused, naming the holder.
    ddpack_node lock "${DDPACK_RUN_DIR}" --job "${SLURM_JOB_ID}" || exit 2
    ddpack_recording=1   # the run folder is this job's now: its decisions are recorded there
    : >"${DDPACK_RUN_DIR}/${ddpack_start_marker}"   # forensics newer than this were written during this start
    # The hang watchdog's keys in the rendezvous store carry this secret, which only this start's ranks know (made
    # here, never sent through slurmctld; srun hands it to each task): another user who reaches the store's port
    # cannot name them.
    DDPACK_JOB_TOKEN=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
    export DDPACK_JOB_TOKEN
    # The time closes the line: `ddpack status` dates the segment this start begins, for a program that writes no records.
    echo "ddpack: job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST}, run dir ${DDPACK_RUN_DIR} (${ddpack_run_origin}), at $(date +%Y-%m-%dT%H:%M:%S%z)"
    ddpack_record start nodes="${SLURM_JOB_NODELIST}" origin="${ddpack_run_origin}"
}

# What the job writes is its user's alone: run folders, snapshots (weights and optimizer state), metrics,
# forensics, staged images. DDPACK_UMASK (077) is the umask of the script and so of every step (srun passes it to
# its tasks); 027 lets your group read, for a team that shares runs. The job's log was opened by Slurm before this
# script ran, with the umask sbatch was called under: it is narrowed to the same mode here.
ddpack_private_files() {
    local mask=${DDPACK_UMASK:-077} log
    [[ "${mask}" =~ ^0?[0-7]{3}$ ]] || ddpack_die "DDPACK_UMASK=${mask} is not an octal umask such as 077 (yours alone) or 027 (your group may read)"
    umask "${mask}"
    while IFS= read -r log; do
        [ -f "${log}" ] && [ -O "${log}" ] && [ ! -L "${log}" ] && chmod "$(printf '%o' $((0666 & ~8#${mask})))" "${log}"
    done < <(scontrol show job "${SLURM_JOB_ID}" 2>/dev/null | sed -n 's/^ *Std\(Out\|Err\)=//p' | sort -u)
    return 0
}

# ddpack_node VERB ARGS...: enroot/ddpack_node.py (standard-library Python: the staging folder, leases, the run
# folder's lock), run with this host's python3. Its text is read once, where this helper is sourced, and handed
# to python3 -c: a node that runs it needs no path to the checkout.
# The system's python3 in isolated mode (-I -S: no PYTHON* variables, no user or site packages; it starts in ~20 ms).
ddpack_node_file=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/ddpack_node.py   # the batch host's own verbs (stage) run it by name
ddpack_node_py=$(cat "${ddpack_node_file}" 2>/dev/null)
ddpack_settings_py=$(cat "$(dirname "${BASH_SOURCE[0]}")/ddpack_settings.py" 2>/dev/null)
ddpack_python=$(command -v /usr/bin/python3 || command -v python3 || echo python3)
ddpack_node() {
    [ -n "${ddpack_node_py}" ] || ddpack_die "cannot read ddpack_node.py beside ddpack-job.sh; set DDPACK_HOME to ddpack's enroot/ folder"
    "${ddpack_python}" -I -S -c "${ddpack_node_py}" "$@"
}

# ddpack_record KIND NAME=VALUE...: one decision of the job as a record in the run folder (decisions.jsonl: a start,
# the placement, the staging choice and why, the step's end and what follows), which `ddpack status` reads; the
# line printed beside it is for people. A record that cannot be written costs a warning, never the job.
ddpack_recording=""
ddpack_record() {
    [ -n "${ddpack_recording}" ] && [ -n "${ddpack_node_py}" ] || return 0
    ddpack_node record "${DDPACK_RUN_DIR}" "$@" || true
}

# ddpack_decide VERDICT REASON EXIT SENTENCE: the step's end decided (completed, end, requeue or restart), said
# and recorded.
ddpack_decide() {
    echo "ddpack: $4"
    ddpack_record step-end verdict="$1" reason="$2" exit="$3" text="$4"
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

# ddpack_words ARRAY SETTING: the words of a command setting (DDPACK_COMMAND, DDPACK_TRAIN_ARGS, DDPACK_PREFLIGHT_ARGS,
# DDPACK_LAUNCH_ARGS) into ARRAY. A value that starts with [ is a JSON list of strings, each word exactly as given
# (spaces, quotes, backslashes, empty words: what `ddpack submit -- CMD` writes); any other value is split on
# whitespace, the hand-made form.
ddpack_words_py='
import json, shlex, sys
name, text = sys.argv[1:]
try:
    words = json.loads(text)
except ValueError as why:
    print(f"{name} starts with [ but is not a JSON list ({why}); write it as a JSON list of strings, or as words without a leading [")
    sys.exit(2)
if not isinstance(words, list) or not all(isinstance(word, str) for word in words):
    print(f"{name} is JSON but not a list of strings; write each argument as a string")
    sys.exit(2)
print(" ".join(shlex.quote(word) for word in words))
'
ddpack_words() {
    # No nameref (bash 4.3): the array's name is checked, then assigned by name.
    case "$1" in '' | [!a-zA-Z_]* | *[!a-zA-Z0-9_]*) ddpack_die "ddpack_words: '$1' is not an array name" ;; esac
    local ddpack_words_setting=$2 ddpack_words_quoted
    local ddpack_words_value=${!ddpack_words_setting:-}
    case "${ddpack_words_value}" in
    "["*)
        ddpack_words_quoted=$("${ddpack_python}" -I -S -c "${ddpack_words_py}" "${ddpack_words_setting}" "${ddpack_words_value}") ||
            ddpack_die "${ddpack_words_quoted}"
        eval "$1=(${ddpack_words_quoted})"
        ;;
    *) read -r -a "$1" <<<"${ddpack_words_value}" ;;
    esac
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
    [ -n "${ddpack_container_name}" ] || return 0
    # One task per node, with the node's own enroot (the one pyxis runs). Under container_scope=job pyxis
    # calls it pyxis_<job>_<name> and removes it itself, so a missing pyxis_<name> is not an error. The nodes
    # are the job's as Slurm lists them now: a node it lost is gone from the list.
    local nodes
    nodes=$(ddpack_job_nodelist)
    srun --ntasks-per-node=1 --nodes="$(scontrol show hostnames "${nodes}" | wc -l)" --ntasks="$(scontrol show hostnames "${nodes}" | wc -l)" \
        --nodelist="${nodes}" bash -c 'enroot remove -f "pyxis_$1" >/dev/null 2>&1 || true' _ "${ddpack_container_name}"
    ddpack_container_name=""
}

# The job's nodes as Slurm lists them now (a hostlist): a --no-kill job that lost a node no longer holds it,
# while SLURM_JOB_NODELIST still names it.
ddpack_job_nodelist() {
    local listed
    listed=$(scontrol show job "${SLURM_JOB_ID}" 2>/dev/null | sed -n 's/^ *NodeList=//p' | head -n1)
    case "${listed}" in '' | '(null)') listed=${SLURM_JOB_NODELIST:-} ;; esac
    echo "${listed}"
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
    ddpack_image=$("${ddpack_python}" -I -S "${ddpack_node_file}" stage "$1") || exit $?
}

# --------------------------------------------------------------------------- training, restarted in place
#
# DDPACK_SPARE_NODES=K: the job's last K nodes are spares (ask sbatch for --nodes=<training nodes + K>);
# training runs on the others, and a restart swaps a spare in for a node that failed.

ddpack_bad_nodes=""   # comma-separated: nodes a hang's forensics named, over the whole job
ddpack_last_nodes=""  # the nodes the last training step ran on
ddpack_next=""        # ddpack_after_step's decision: end, restart or requeue

ddpack_train() {
    local rc spares=${DDPACK_SPARE_NODES:-0}
    case "${spares}" in '' | *[!0-9]*) ddpack_die "DDPACK_SPARE_NODES=${spares} is not a whole number of nodes" ;; esac
    case "${DDPACK_RESTART_IN_PLACE:-1}" in 0 | 1) ;; *) ddpack_die "DDPACK_RESTART_IN_PLACE=${DDPACK_RESTART_IN_PLACE} is not 1 (restart a failed step in this allocation) or 0 (requeue)" ;; esac
    ddpack_placement=()
    if [ "${spares}" -gt 0 ]; then
        ddpack_place || ddpack_die "DDPACK_SPARE_NODES=${spares}: ${ddpack_short}"
        echo "ddpack: training on ${ddpack_last_nodes}; spare: $(ddpack_spares_now)"
        ddpack_record placement nodes="${ddpack_last_nodes}" spares="$(ddpack_spares_now)"
    fi
    while :; do
        "${ddpack_step[@]}" ${ddpack_placement[@]+"${ddpack_placement[@]}"} "$@"
        rc=$?
        ddpack_after_step "${rc}"
        [ "${ddpack_next}" = restart ] || break
        : >"${DDPACK_RUN_DIR}/${ddpack_start_marker}"   # forensics newer than this belong to the restart
    done
    ddpack_leave
    exit "${rc}"
}

# The allocation's nodes that are not the ones training uses now.
ddpack_spares_now() {
    local node spare=()
    for node in $(scontrol show hostnames "$(ddpack_job_nodelist)"); do
        case ",${ddpack_last_nodes}," in *",${node},"*) ;; *) spare+=("${node}") ;; esac
    done
    if [ "${#spare[@]}" -eq 0 ]; then echo none; else (IFS=,; echo "${spare[*]}"); fi
}

# ddpack_placement: the srun options that put a training step on the job's healthy nodes, the ones the last
# step used first, spares after; returns 1 (ddpack_short says why) when fewer are healthy than training needs.
# Healthy: still in the job (Slurm drops a node it lost from a --no-kill job), not down, drained or failing in
# sinfo, not named unresponsive by a hang's forensics during this job.
ddpack_place() {
    local spares=${DDPACK_SPARE_NODES:-0} need listed node per_node healthy=() first=() rest=()
    need=$((${SLURM_JOB_NUM_NODES:-1} - spares))
    [ "${need}" -ge 1 ] || ddpack_die "DDPACK_SPARE_NODES=${spares} leaves no node to train on: the job has ${SLURM_JOB_NUM_NODES:-1}; ask sbatch for --nodes=<training nodes + spares>"
    per_node=${SLURM_NTASKS_PER_NODE:-}
    per_node=${per_node%%(*}
    case "${per_node}" in '' | *[!0-9]*) ddpack_die "a restart in this allocation needs --ntasks-per-node (SLURM_NTASKS_PER_NODE=${SLURM_NTASKS_PER_NODE:-}); the templates set it" ;; esac
    listed=$(ddpack_job_nodelist)
    local -A bad=()
    local -a named_bad
    IFS=, read -r -a named_bad <<<"${ddpack_bad_nodes}"
    for node in ${named_bad[@]+"${named_bad[@]}"}; do bad[${node}]=1; done
    for node in $(ddpack_unhealthy_nodes "${listed}"); do bad[${node}]=1; done
    for node in $(scontrol show hostnames "${listed}"); do
        [ -n "${bad[${node}]+x}" ] && continue
        case ",${ddpack_last_nodes}," in *",${node},"*) first+=("${node}") ;; *) rest+=("${node}") ;; esac
    done
    healthy=(${first[@]+"${first[@]}"} ${rest[@]+"${rest[@]}"})
    if [ "${#healthy[@]}" -lt "${need}" ]; then
        ddpack_short="${#healthy[@]} healthy node(s) left in the allocation and training needs ${need}"
        return 1
    fi
    ddpack_last_nodes=$(IFS=,; echo "${healthy[*]:0:${need}}")
    ddpack_placement=(--nodes="${need}" --ntasks="$((need * per_node))" --nodelist="${ddpack_last_nodes}")
}

# The step's exit status decides, whatever ran (the bundled trainer, your DDPACK_COMMAND, the image's own):
#   0 done; 2 bad input (never retried: the error line says what to fix);
#   128+10 / 128+15 (138, 143) stopped on SIGUSR1/SIGTERM: preempted (or the time limit's warning): back to the
#   queue, requeued up to DDPACK_MAX_RESTARTS (10);
#   anything else (124 a hang the watchdog ended, 137 a SIGKILL such as the OOM killer's or srun's for a rank
#   still frozen DDPACK_STEP_WAIT seconds after the others ended, 1 a crash or a lost peer or node): a failure,
#   retried up to DDPACK_MAX_FAILURE_RESTARTS times (default 1) per run folder. A retry restarts the step in
#   this allocation when enough healthy nodes remain (a spare swapped in for a bad node; DDPACK_RESTART_IN_PLACE=0
#   turns that off), else requeues the job,
#   keeping out the nodes the hang's forensics named unresponsive where the partition has others to spare. A
#   hang is told by its exit 124 or by forensics written during this start (the frozen rank's 137 is the step's
#   status then).
# Sets ddpack_next: end, restart or requeue (ddpack_leave requeues, keeping out ddpack_keep_out).
ddpack_after_step() {
    local rc=$1 restarts=${SLURM_RESTART_COUNT:-0} max=${DDPACK_MAX_RESTARTS:-10} max_failed=${DDPACK_MAX_FAILURE_RESTARTS:-1}
    local failures_file=${DDPACK_RUN_DIR}/.ddpack-failure-restarts failed=0 kind named
    ddpack_next=end ddpack_keep_out=""
    case "${max}" in '' | *[!0-9]*) ddpack_die "DDPACK_MAX_RESTARTS=${max} is not a whole number" ;; esac
    case "${max_failed}" in '' | *[!0-9]*) ddpack_die "DDPACK_MAX_FAILURE_RESTARTS=${max_failed} is not a whole number" ;; esac
    ddpack_report_hint
    case "${rc}" in
    0)
        ddpack_decide completed done "${rc}" "the step completed (exit 0)"   # the run's end, for ddpack status once Slurm has forgotten the job
        return 0
        ;;
    2)
        ddpack_decide end bad-input "${rc}" "the step ended on bad input (exit 2); not requeueing: fix what its error line names and resubmit"
        return 0
        ;;
    138 | 143) kind=preempted ;;
    *) kind=failed ;;
    esac
    local lost what="failed (exit ${rc})" reason=${kind}
    lost=$(ddpack_lost_nodes)
    if [ -n "${lost}" ]; then
        # Slurm SIGTERMs the tasks of a step that lost a node (143): a failure of the node, not a preemption.
        kind=failed what="ended (exit ${rc}) when the job lost ${lost}" reason=lost-node
    fi
    if [ "${kind}" = preempted ]; then
        if [ "${restarts}" -ge "${max}" ]; then
            ddpack_decide end preempted "${rc}" "preempted (exit ${rc}) after ${restarts} restarts, the cap DDPACK_MAX_RESTARTS=${max}; not requeueing ($(ddpack_continue_hint) to continue)"
            return 0
        fi
        ddpack_decide requeue preempted "${rc}" "preempted (exit ${rc}); requeueing job ${SLURM_JOB_ID} (restart $((restarts + 1)) of at most ${max})"
        ddpack_next=requeue
        return 0
    fi
    [ -f "${failures_file}" ] && failed=$(cat "${failures_file}")
    case "${failed}" in '' | *[!0-9]*) failed=0 ;; esac
    local forensics=${DDPACK_RUN_DIR}/forensics
    if [ -z "${lost}" ] && { [ "${rc}" -eq 124 ] || [ "${forensics}/summary.json" -nt "${DDPACK_RUN_DIR}/${ddpack_start_marker}" ]; }; then
        what="ended as hung (exit ${rc}; evidence in ${forensics})" reason=hung
    fi
    if [ "${failed}" -ge "${max_failed}" ] || [ "${restarts}" -ge "${max}" ]; then
        ddpack_decide end "${reason}" "${rc}" "the step ${what} after ${failed} failure restarts, the cap DDPACK_MAX_FAILURE_RESTARTS=${max_failed}; not requeueing ($(ddpack_continue_hint) to continue from its last snapshot)"
        return 0
    fi
    echo "$((failed + 1))" >"${failures_file}.tmp" && mv "${failures_file}.tmp" "${failures_file}"
    local count="failure restart $((failed + 1)) of at most ${max_failed}" without=""
    named=$(ddpack_nodes_named_this_start)
    if [ -n "${named}" ]; then
        ddpack_bad_nodes=${ddpack_bad_nodes:+${ddpack_bad_nodes},}${named}
        without=", without ${named} (named unresponsive)"
    fi
    case "${DDPACK_RESTART_IN_PLACE:-1}" in
    0) ddpack_short="DDPACK_RESTART_IN_PLACE=0" ;;
    1) if ddpack_place; then
        ddpack_record placement nodes="${ddpack_last_nodes}" spares="$(ddpack_spares_now)" without="${named}"
        ddpack_decide restart "${reason}" "${rc}" "the step ${what}; restarting it in this allocation on ${ddpack_last_nodes}${without} from its last snapshot (${count})"
        ddpack_next=restart
        return 0
    fi ;;
    *) ddpack_die "DDPACK_RESTART_IN_PLACE=${DDPACK_RESTART_IN_PLACE} is not 1 (restart a failed step in this allocation) or 0 (requeue)" ;;
    esac
    ddpack_decide requeue "${reason}" "${rc}" "the step ${what}; ${ddpack_short}: requeueing job ${SLURM_JOB_ID} to resume from its last snapshot (${count})"
    ddpack_nodes_to_keep_out
    ddpack_next=requeue
}

# How to continue this run in a new job: `ddpack resubmit` for a run `ddpack submit` made, else the setting (a job
# started by hand leaves a run.json too, which says it was made by a template: ddpack cannot resubmit that one).
ddpack_continue_hint() {
    if [ -f "${DDPACK_RUN_DIR}/run.json" ] && ! grep -q '"made_by": "template"' "${DDPACK_RUN_DIR}/run.json"; then
        echo "ddpack resubmit ${DDPACK_RUN_DIR}"
    else
        echo "resubmit with DDPACK_RUN_DIR=${DDPACK_RUN_DIR}"
    fi
}

# The nodes of HOSTLIST that sinfo says are down, drained, failing or not responding (a trailing *), one a line.
ddpack_unhealthy_nodes() {
    local node state
    while read -r node state; do
        case "${state}" in down* | drain* | drng* | fail* | *'*') echo "${node}" ;; esac
    done < <(sinfo -h -N -n "$1" -o "%N %t" 2>/dev/null)
}

# The nodes the last training step ran on that the job lost (Slurm dropped them from this --no-kill job) or that
# sinfo says are down, drained or failing, comma-separated.
ddpack_lost_nodes() {
    local ran=${ddpack_last_nodes} listed node lost=()
    [ -n "${ran}" ] || ran=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | paste -sd,)
    [ -n "${ran}" ] || return 0
    listed=$(ddpack_job_nodelist)
    local -A now=() bad=()
    for node in $(scontrol show hostnames "${listed}" 2>/dev/null); do now[${node}]=1; done
    for node in $(ddpack_unhealthy_nodes "${ran}"); do bad[${node}]=1; done
    local -a ran_nodes
    IFS=, read -r -a ran_nodes <<<"${ran}"
    for node in ${ran_nodes[@]+"${ran_nodes[@]}"}; do
        if [ -z "${now[${node}]+x}" ] || [ -n "${bad[${node}]+x}" ]; then lost+=("${node}"); fi
    done
    [ "${#lost[@]}" -eq 0 ] || (IFS=,; echo "${lost[*]}")
}

# After the last step of this start: the job's container leaves the nodes, then the requeue ddpack_after_step decided.
ddpack_leave() {
    ddpack_remove_container
    if [ "${ddpack_next}" != requeue ]; then
        ddpack_node unlock "${DDPACK_RUN_DIR}" --job "${SLURM_JOB_ID}"   # the run folder is free for another job
        return 0
    fi
    ddpack_requeue "${ddpack_keep_out}"
}

# The nodes a hang's forensics named unresponsive during this start, comma-separated (none: empty). Only names of
# this job's nodes count: the file is written from what ranks said through the rendezvous store, and a name that is
# not one of ours must never reach ExcNodeList.
ddpack_nodes_named_this_start() {
    local named=${DDPACK_RUN_DIR}/forensics/unresponsive-nodes node ours=()
    [ -s "${named}" ] && [ "${named}" -nt "${DDPACK_RUN_DIR}/${ddpack_start_marker}" ] || return 0
    local -A job_nodes=()
    for node in $(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null) $(scontrol show hostnames "$(ddpack_job_nodelist)" 2>/dev/null); do
        job_nodes[${node}]=1
    done
    while IFS= read -r node; do
        [ -n "${node}" ] && [ -n "${job_nodes[${node}]+x}" ] && ours+=("${node}")
    done <"${named}"
    [ "${#ours[@]}" -eq 0 ] || (IFS=,; echo "${ours[*]}")
}

# Where the run's charts come from, once a step has left metrics (a user's own program may write none).
ddpack_report_hint() {
    [ -s "${DDPACK_RUN_DIR}/metrics.jsonl" ] || return 0
    echo "ddpack: metrics in ${DDPACK_RUN_DIR}/metrics.jsonl; for the run report (${DDPACK_RUN_DIR}/report.html) run, in the ddpack checkout: make report RUN=${DDPACK_RUN_DIR}"
}

# Set ddpack_keep_out to the nodes a hang's forensics named unresponsive during this start, comma-separated,
# when the partition has enough other nodes for the job (else it would never start again, and a line says so).
ddpack_nodes_to_keep_out() {
    local nodes total
    ddpack_keep_out=""
    nodes=${ddpack_bad_nodes}
    [ -n "${nodes}" ] || return 0
    total=$(sinfo -h -p "${SLURM_JOB_PARTITION:-}" -o %D 2>/dev/null | head -n1)
    case "${total}" in '' | *[!0-9]*) total=0 ;; esac
    if [ "$((total - $(tr ',' '\n' <<<"${nodes}" | grep -c .)))" -lt "${SLURM_JOB_NUM_NODES:-1}" ]; then
        echo "ddpack: not keeping out ${nodes} (named unresponsive): partition ${SLURM_JOB_PARTITION:-?} has ${total} nodes and the job needs ${SLURM_JOB_NUM_NODES:-1}"
        ddpack_record keep-out nodes="${nodes}" kept=no why="partition ${SLURM_JOB_PARTITION:-?} has ${total} nodes and the job needs ${SLURM_JOB_NUM_NODES:-1}"
        return 0
    fi
    ddpack_keep_out=${nodes}
}

# Requeue this job, then keep NODES (if any) out of its next start. Slurm refuses ExcNodeList for a running job,
# and a requeue SIGTERMs this script and kills it KillWait seconds later (30 by default): TERM is ignored from here
# (by this script and the commands it runs, which inherit that), which keeps it alive for the one update and its
# record that follow.
ddpack_requeue() {
    local nodes=${1:-}
    trap '' TERM
    if ! scontrol requeue "${SLURM_JOB_ID}"; then
        ddpack_decide end requeue-refused "" "scontrol requeue ${SLURM_JOB_ID} was refused (its line above says why); the job ends here: $(ddpack_continue_hint) to continue"
        return 0
    fi
    [ -n "${nodes}" ] || return 0
    if scontrol update "JobId=${SLURM_JOB_ID}" "ExcNodeList=${nodes}"; then
        echo "ddpack: keeping ${nodes} (named unresponsive by the hang's forensics) out of the restart"
        ddpack_record keep-out nodes="${nodes}" kept=yes
    else
        echo "ddpack: could not keep ${nodes} out of the restart (scontrol update refused); it may land there again"
        ddpack_record keep-out nodes="${nodes}" kept=no why="scontrol update refused"
    fi
}
