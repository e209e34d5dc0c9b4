"""Recorded nvidia-smi outputs of a healthy and a failing 8-GPU H100 node (tests/nvidia_smi/, in nvidia-smi's own
formats), as a runner the preflight's node checks take (train/preflight/node.py Runner)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from train.preflight.node import NodeFacts, Runner

RECORDED = Path(__file__).resolve().parent / "nvidia_smi"


def recorded(kind: str, *, dmesg: str | None = None, drop_gpu: str | None = None) -> Runner:
    """A runner that answers nvidia-smi's calls with tests/nvidia_smi/h100-KIND.* (and dmesg with `dmesg`'s file,
    else as a host with kernel.dmesg_restrict=1 does)."""

    def run(argv: Sequence[str], timeout_s: float) -> tuple[int, str]:
        if argv[0] == "dmesg" and dmesg:
            return 0, (RECORDED / f"h100-{dmesg}.dmesg.txt").read_text()
        if argv[0] == "dmesg":
            return 1, "dmesg exited 1: dmesg: read kernel buffer failed: Operation not permitted"
        suffix = {"--query-gpu": "query.csv", "-q": "row-remap.txt", "nvlink": "nvlink.txt"}[argv[1].split("=")[0]]
        text = (RECORDED / f"h100-{kind}.{suffix}").read_text()
        if drop_gpu is not None and suffix == "query.csv":
            text = "".join(line for line in text.splitlines(keepends=True) if not line.startswith(f"{drop_gpu},"))
        return 0, text

    return run


def gpu_facts(asked: int = 8) -> NodeFacts:
    return NodeFacts(
        node="p5-3", gpus=True, gpus_asked=asked, shm_need=1 << 30, shm_why="the NCCL floor", efa_expected=False, driver="550.127.08"
    )
