"""Table-driven plan resolution: environment (+ options) -> Plan, across all four modes."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from entrypoint.plan import Host, Options, PlanError, resolve_plan, slurm_master_port

HOST = Host(cpu_count=8, nvidia_device_files=0, free_port=40123)
GPU_HOST = Host(cpu_count=96, nvidia_device_files=8, free_port=40123)


def slurm(
    procid: int = 0,
    ntasks: int = 1,
    localid: int = 0,
    nodeid: int = 0,
    tpn: str = "1",
    nodes: str = "node1",
    job: int = 4242,
    step: int = 0,
    **extra: str,
) -> dict[str, str]:
    env = {
        "SLURM_JOB_ID": str(job),
        "SLURM_STEP_ID": str(step),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_STEP_TASKS_PER_NODE": tpn,
        "SLURM_STEP_NODELIST": nodes,
    }
    env.update(extra)
    return env


PORT_4242 = slurm_master_port(4242, 0)

# (id, environ, options, host, expected subset of the plan's fields and env)
CASES: list[tuple[str, dict[str, str], Options, Host, dict[str, Any]]] = [
    # ---- torchelastic: pass-through
    (
        "torchrun-rank1",
        {
            "TORCHELASTIC_RUN_ID": "abc",
            "RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "h0",
            "MASTER_PORT": "29400",
        },
        Options(),
        HOST,
        {
            "mode": "torchelastic",
            "launcher": "exec",
            "rank": 1,
            "world_size": 4,
            "local_rank": 1,
            "master_addr": "h0",
            "master_port": 29400,
            "backend": "gloo",
            "env.DDPACK_BACKEND": "gloo",
            "env.OMP_NUM_THREADS": "4",
            "env.RANK": None,
        },
    ),
    (
        "torchrun-wins-over-slurm",
        {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", **slurm(procid=0, ntasks=1)},
        Options(),
        HOST,
        {"mode": "torchelastic", "world_size": 2},
    ),
    (
        "torchrun-keeps-omp-and-backend",
        {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "1", "OMP_NUM_THREADS": "3", "DDPACK_BACKEND": "gloo"},
        Options(),
        HOST,
        {"env.OMP_NUM_THREADS": None, "env.DDPACK_BACKEND": None},
    ),
    (
        "torchrun-cuda-nccl",
        {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"},
        Options(),
        GPU_HOST,
        {"backend": "nccl", "env.OMP_NUM_THREADS": "12"},
    ),
    # ---- Slurm, one task per process
    (
        "slurm-single-task",
        slurm(),
        Options(),
        HOST,
        {
            "mode": "slurm",
            "launcher": "exec",
            "rank": 0,
            "world_size": 1,
            "master_addr": "node1",
            "master_port": PORT_4242,
            "env.RANK": "0",
            "env.LOCAL_WORLD_SIZE": "1",
        },
    ),
    (
        "slurm-2x2-rank3",
        slurm(procid=3, ntasks=4, localid=1, nodeid=1, tpn="2(x2)", nodes="ip-10-4-[33-34]"),
        Options(),
        HOST,
        {
            "rank": 3,
            "world_size": 4,
            "local_rank": 1,
            "local_world_size": 2,
            "node_rank": 1,
            "nnodes": 2,
            "master_addr": "ip-10-4-33",
            "env.NODE_RANK": "1",
            "env.OMP_NUM_THREADS": "4",
        },
    ),
    (
        "slurm-uneven-tpn",
        slurm(procid=9, ntasks=10, localid=1, nodeid=2, tpn="4(x2),2", nodes="gpu[01-03]"),
        Options(),
        HOST,
        {"rank": 9, "local_world_size": 2, "node_rank": 2, "master_addr": "gpu01"},
    ),
    (
        "slurm-mixed-hostlist",
        slurm(procid=0, ntasks=6, tpn="1(x6)", nodes="ip-10-4-[33-35,40],gpu[01-02]"),
        Options(),
        HOST,
        {"master_addr": "ip-10-4-33", "nnodes": 6, "launcher": "exec"},
    ),
    (
        "slurm-rack-hostlist",
        slurm(procid=0, ntasks=4, tpn="1(x4)", nodes="rack[1-2]-node[01-02]"),
        Options(),
        HOST,
        {"master_addr": "rack1-node01"},
    ),
    (
        "slurm-zero-padded",
        slurm(procid=1, ntasks=2, tpn="1(x2)", nodeid=1, nodes="gpu[008-009]"),
        Options(),
        HOST,
        {"master_addr": "gpu008", "node_rank": 1},
    ),
    (
        "slurm-explicit-master-wins",
        slurm(MASTER_ADDR="10.0.0.9", MASTER_PORT="23456"),
        Options(),
        HOST,
        {"master_addr": "10.0.0.9", "master_port": 23456},
    ),
    ("slurm-cpus-per-task", slurm(SLURM_CPUS_PER_TASK="6"), Options(), HOST, {"env.OMP_NUM_THREADS": "6"}),
    ("slurm-user-omp-kept", slurm(OMP_NUM_THREADS="2", SLURM_CPUS_PER_TASK="6"), Options(), HOST, {"env.OMP_NUM_THREADS": None}),
    (
        "slurm-salloc-job-name-ignored",
        slurm(SLURM_JOB_NAME="interactive", SLURM_NTASKS="8"),
        Options(),
        HOST,
        {"mode": "slurm", "world_size": 1},
    ),
    (
        "slurm-job-vars-only-is-not-a-step",
        {"SLURM_JOB_ID": "5", "SLURM_JOB_NAME": "bash", "SLURM_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"},
        Options(),
        HOST,
        {"mode": "single", "world_size": 1},
    ),
    (
        "slurm-jobid-fallback",
        {k: v for k, v in slurm(job=99).items() if k != "SLURM_JOB_ID"} | {"SLURM_JOBID": "99"},
        Options(),
        HOST,
        {"master_port": slurm_master_port(99, 0)},
    ),
    ("slurm-step-changes-port", slurm(step=3), Options(), HOST, {"master_port": slurm_master_port(4242, 3)}),
    (
        "slurm-gpu-per-task",
        slurm(procid=5, ntasks=16, localid=5, tpn="8(x2)", nodes="p5-[1-2]", CUDA_VISIBLE_DEVICES="5"),
        Options(),
        GPU_HOST,
        {"launcher": "exec", "backend": "nccl", "local_rank": 5, "local_world_size": 8},
    ),
    ("slurm-backend-override", slurm(DDPACK_BACKEND="gloo"), Options(), GPU_HOST, {"backend": "gloo"}),
    (
        "slurm-ipv6-master",
        slurm(procid=0, ntasks=2, tpn="1(x2)", nodes="n[1-2]", MASTER_ADDR="[fd00::1]"),
        Options(nproc_per_node=2),
        HOST,
        {"master_addr": "fd00::1", "argv_has": f"--rdzv-endpoint=[fd00::1]:{PORT_4242}"},
    ),
    # ---- Slurm, one task per node -> torchrun
    (
        "slurm-task-per-node-gpus",
        slurm(procid=1, ntasks=2, nodeid=1, tpn="1(x2)", nodes="p4d-[7-8]"),
        Options(),
        GPU_HOST,
        {
            "launcher": "torchrun",
            "world_size": 16,
            "local_world_size": 8,
            "rank": None,
            "nnodes": 2,
            "argv_has": "--nproc-per-node=8",
            "env.OMP_NUM_THREADS": "12",
            "env.PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        },
    ),
    (
        "slurm-task-per-node-nproc",
        slurm(procid=0, ntasks=2, tpn="1(x2)", nodes="c[1-2]", job=777, SLURM_CPUS_PER_TASK="8"),
        Options(nproc_per_node=4),
        HOST,
        {"launcher": "torchrun", "world_size": 8, "argv_has": "--rdzv-id=777", "env.OMP_NUM_THREADS": "2"},
    ),
    (
        "slurm-torchrun-endpoint",
        slurm(procid=0, ntasks=2, tpn="1(x2)", nodes="c[1-2]"),
        Options(nproc_per_node=2),
        HOST,
        {"argv_has": f"--rdzv-endpoint=c1:{PORT_4242}", "argv_has2": "--nnodes=2"},
    ),
    ("slurm-one-gpu-is-direct", slurm(CUDA_VISIBLE_DEVICES="0"), Options(), GPU_HOST, {"launcher": "exec", "backend": "nccl"}),
    # ---- plain environment (docker run -e ...)
    (
        "env-rank0",
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "rank0"},
        Options(),
        HOST,
        {
            "mode": "env",
            "rank": 0,
            "world_size": 2,
            "master_addr": "rank0",
            "master_port": 29500,
            "local_rank": 0,
            "node_rank": 0,
            "env.LOCAL_WORLD_SIZE": "1",
        },
    ),
    (
        "env-rank1-port",
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "rank0", "MASTER_PORT": "1234"},
        Options(),
        HOST,
        {"rank": 1, "node_rank": 1, "master_port": 1234},
    ),
    (
        "env-local-ranks",
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"},
        Options(),
        HOST,
        {"node_rank": 1, "env.OMP_NUM_THREADS": "4"},
    ),
    ("env-world1-no-master", {"RANK": "0", "WORLD_SIZE": "1"}, Options(), HOST, {"master_addr": "127.0.0.1"}),
    (
        "env-ipv6-bare",
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "fd00::2"},
        Options(),
        HOST,
        {"master_addr": "fd00::2", "env.MASTER_ADDR": "fd00::2"},
    ),
    (
        "env-torchrun-per-container",
        {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "node0"},
        Options(nproc_per_node=2),
        HOST,
        {
            "mode": "env",
            "launcher": "torchrun",
            "world_size": 4,
            "node_rank": 1,
            "argv_has": "--rdzv-endpoint=node0:29500",
            "argv_has2": "--rdzv-id=ddpack",
        },
    ),
    (
        "env-torchrun-rdzv-id",
        {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "fd00::3", "RDZV_ID": "run7"},
        Options(nproc_per_node=2),
        HOST,
        {"argv_has": "--rdzv-endpoint=[fd00::3]:29500", "argv_has2": "--rdzv-id=run7"},
    ),
    (
        "env-backend-option",
        {"RANK": "0", "WORLD_SIZE": "1"},
        Options(backend="nccl"),
        HOST,
        {"backend": "nccl", "env.DDPACK_BACKEND": "nccl"},
    ),
    # ---- nothing set
    (
        "single",
        {},
        Options(),
        HOST,
        {
            "mode": "single",
            "launcher": "exec",
            "rank": 0,
            "world_size": 1,
            "master_addr": "127.0.0.1",
            "master_port": 40123,
            "env.OMP_NUM_THREADS": "8",
            "env.WORLD_SIZE": "1",
        },
    ),
    ("single-gpu-visible", {"CUDA_VISIBLE_DEVICES": "0,1"}, Options(), HOST, {"backend": "nccl"}),
    ("single-cuda-hidden", {"CUDA_VISIBLE_DEVICES": ""}, Options(), GPU_HOST, {"backend": "gloo"}),
    ("single-device-files", {}, Options(), GPU_HOST, {"backend": "nccl"}),
    (
        "single-standalone",
        {},
        Options(nproc_per_node=4),
        HOST,
        {
            "launcher": "torchrun",
            "world_size": 4,
            "argv_has": "--standalone",
            "argv_has2": "--nproc-per-node=4",
            "env.OMP_NUM_THREADS": "2",
        },
    ),
    ("single-master-port-given", {"MASTER_PORT": "31000"}, Options(), HOST, {"master_port": 31000}),
]


def _field(plan: Any, key: str) -> Any:
    if key.startswith("env."):
        return plan.env.get(key[4:])
    return getattr(plan, key)


@pytest.mark.parametrize(("environ", "options", "host", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_plan_resolution(environ: dict[str, str], options: Options, host: Host, expected: dict[str, Any]) -> None:
    plan = resolve_plan(environ, options, host)
    for key, want in expected.items():
        if key.startswith("argv_has"):
            assert want in plan.argv, f"{want} not in {plan.argv}"
        else:
            assert _field(plan, key) == want, key


def test_there_are_at_least_thirty_environments() -> None:
    assert len(CASES) >= 30
    assert {resolve_plan(e, o, h).mode for _, e, o, h, _ in CASES} == {"torchelastic", "slurm", "env", "single"}


def test_torchrun_shape_runs_torchrun_through_the_agent_module_with_the_command_after_no_python() -> None:
    plan = resolve_plan(
        slurm(procid=0, ntasks=2, tpn="1(x2)", nodes="c[1-2]"), Options(command=("python", "my.py", "--lr", "3e-4"), nproc_per_node=2), HOST
    )
    assert plan.argv[:4] == (sys.executable, "-m", "entrypoint.agent", "--shutdown-timeout=30")
    assert plan.argv[-5:] == ("--no-python", "python", "my.py", "--lr", "3e-4")


@pytest.mark.parametrize(
    "environ",
    [slurm(), slurm(ntasks=2, tpn="1(x2)", nodes="g[1-2]"), {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2"}, {}],
    ids=["slurm-exec", "slurm-torchrun", "torchelastic", "single"],
)
def test_nccl_jobs_get_the_aws_nccl_defaults_only_where_the_job_left_them_unset(environ: dict[str, str]) -> None:
    """The image sets no NCCL_* (pyxis would let it beat the job's export); the launcher fills them in."""
    plan = resolve_plan({**environ, "NCCL_DEBUG": "INFO"}, Options(), GPU_HOST)
    assert plan.backend == "nccl"
    assert "NCCL_DEBUG" not in plan.env  # the job's INFO stands
    assert plan.env["NCCL_SOCKET_IFNAME"] == "^lo,docker,veth" and plan.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert not [name for name in resolve_plan(environ, Options(), HOST).env if "NCCL" in name]  # gloo: none


def test_shutdown_timeout_comes_from_its_setting() -> None:
    plan = resolve_plan({"DDPACK_SHUTDOWN_TIMEOUT": "75"}, Options(nproc_per_node=2), HOST)
    assert "--shutdown-timeout=75" in plan.argv


def test_default_command_is_the_trainer_under_this_interpreter_with_a_safe_path() -> None:
    assert resolve_plan({}, Options(), HOST).argv == (sys.executable, "-P", "-m", "train")


def test_slurm_ports_avoid_the_ephemeral_range_and_differ_between_steps() -> None:
    ports = {slurm_master_port(job, step) for job in range(0, 5000, 7) for step in range(3)}
    assert all(15000 <= p < 30000 for p in ports)
    assert slurm_master_port(10, 0) != slurm_master_port(10, 1)


# (id, environ, options, substrings the one-line error must contain)
BAD: list[tuple[str, dict[str, str], Options, tuple[str, ...]]] = [
    ("rank-not-int", {"RANK": "one", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, Options(), ("RANK='one'", "non-negative integer")),
    ("rank-negative", {"RANK": "-1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, Options(), ("RANK='-1'",)),
    ("rank-ge-world", {"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, Options(), ("RANK=2", "WORLD_SIZE=2")),
    ("world-zero", {"RANK": "0", "WORLD_SIZE": "0"}, Options(), ("WORLD_SIZE='0'",)),
    ("rank-without-world", {"RANK": "0"}, Options(), ("WORLD_SIZE is not set",)),
    ("no-master", {"RANK": "0", "WORLD_SIZE": "2"}, Options(), ("MASTER_ADDR is not set", "WORLD_SIZE=2")),
    ("nnodes-no-master", {"NNODES": "2", "NODE_RANK": "0"}, Options(nproc_per_node=2), ("MASTER_ADDR is not set",)),
    ("rank-with-nproc", {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, Options(nproc_per_node=2), ("NNODES",)),
    ("port-too-big", {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, Options(), ("MASTER_PORT='70000'", "1-65535")),
    ("port-zero", {"MASTER_PORT": "0"}, Options(), ("MASTER_PORT='0'",)),
    ("port-text", slurm(MASTER_PORT="http"), Options(), ("MASTER_PORT='http'",)),
    ("backend-unknown-env", {"DDPACK_BACKEND": "nccl2"}, Options(), ("DDPACK_BACKEND='nccl2'", "gloo")),
    ("backend-unknown-option", {}, Options(backend="tcp"), ("--backend='tcp'",)),
    (
        "local-rank-ge-local-world",
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h"},
        Options(),
        ("LOCAL_RANK=2",),
    ),
    ("slurm-bad-hostlist", slurm(nodes="node[1-2"), Options(), ("SLURM_STEP_NODELIST='node[1-2'", "hostlist")),
    ("slurm-bad-tpn", slurm(tpn="2(2)"), Options(), ("SLURM_STEP_TASKS_PER_NODE='2(2)'",)),
    ("slurm-tpn-sum", slurm(procid=0, ntasks=5, tpn="2(x2)", nodes="n[1-2]"), Options(), ("adds up to 4", "SLURM_STEP_NUM_TASKS=5")),
    ("slurm-tpn-nodes", slurm(procid=0, ntasks=4, tpn="2(x2)", nodes="n[1-3]"), Options(), ("2 nodes", "has 3")),
    ("slurm-procid-ge-ntasks", slurm(procid=4, ntasks=4, tpn="2(x2)", nodes="n[1-2]"), Options(), ("SLURM_PROCID=4",)),
    ("slurm-localid-outside", slurm(procid=1, ntasks=4, localid=2, tpn="2(x2)", nodes="n[1-2]"), Options(), ("SLURM_LOCALID=2", "2 tasks")),
    ("slurm-nodeid-outside", slurm(procid=1, ntasks=2, nodeid=2, tpn="1(x2)", nodes="n[1-2]"), Options(), ("SLURM_NODEID=2",)),
    ("slurm-procid-text", slurm(SLURM_PROCID="x"), Options(), ("SLURM_PROCID='x'",)),
    ("slurm-cpus-zero", slurm(SLURM_CPUS_PER_TASK="0"), Options(), ("SLURM_CPUS_PER_TASK='0'",)),
    (
        "slurm-nproc-with-many-tasks",
        slurm(procid=0, ntasks=4, tpn="2(x2)", nodes="n[1-2]"),
        Options(nproc_per_node=2),
        ("--nproc-per-node", "one Slurm task per node"),
    ),
    ("nproc-zero", {}, Options(nproc_per_node=0), ("--nproc-per-node=0",)),
    ("shutdown-timeout-zero", {"DDPACK_SHUTDOWN_TIMEOUT": "0"}, Options(nproc_per_node=2), ("DDPACK_SHUTDOWN_TIMEOUT='0'", ">= 1")),
    ("shutdown-timeout-text", {"DDPACK_SHUTDOWN_TIMEOUT": "1m"}, Options(nproc_per_node=2), ("DDPACK_SHUTDOWN_TIMEOUT='1m'",)),
    ("cpu-bind-unknown", {"DDPACK_CPU_BIND": "cores"}, Options(nproc_per_node=2), ("DDPACK_CPU_BIND='cores'", "auto, none")),
]


@pytest.mark.parametrize(("environ", "options", "needles"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_clear_line(environ: dict[str, str], options: Options, needles: tuple[str, ...]) -> None:
    with pytest.raises(PlanError) as info:
        resolve_plan(environ, options, HOST)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message
