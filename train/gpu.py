"""What a GPU node's NVIDIA stack is, read from the files the driver publishes (no NVML, no nvidia-smi:
neither is in the image): the driver, the GPUs passed in, the EFA devices, the network NCCL chose (from
its own log); and the matmul precision the trainer asks for on it.

Why files: under pyxis and Docker the container sees the host's /proc and the device nodes it was
given, so `/proc/driver/nvidia/version` names the host driver even when torch cannot use it, which is
exactly when the user needs to hear its version. Every function reads under ROOT (or `root`), so that
tests can give a fake /dev/nvidia0 and a stubbed driver version.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping, MutableMapping
from pathlib import Path

import torch

ROOT = Path("/")

# The oldest Linux driver each CUDA major version runs on (NVIDIA's CUDA compatibility table, "minimum
# required driver version for CUDA minor version compatibility"): torch's wheels for CUDA 13 need R580.
MIN_DRIVER_FOR_CUDA: dict[int, tuple[int, ...]] = {13: (580, 65, 6), 12: (525, 60, 13), 11: (450, 80, 2)}

# CUDA_VISIBLE_DEVICES values that hide every GPU on purpose (entrypoint/plan.py, which never imports torch, keeps its own).
HIDDEN = ("", "-1", "NoDevFiles")


def gpus_hidden(environ: Mapping[str, str]) -> bool:
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and visible.strip() in HIDDEN


def driver_version(root: Path | None = None) -> str | None:
    """The loaded NVIDIA kernel driver's version (`580.65.06`), or None when no driver answers here."""
    root = root or ROOT
    proc = root / "proc/driver/nvidia/version"
    try:
        found = re.search(r"Kernel Module(?: for \S+)?\s+(\d+(?:\.\d+)+)", proc.read_text())
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        text = (root / "sys/module/nvidia/version").read_text().strip()
    except OSError:
        return None
    return text if re.fullmatch(r"\d+(?:\.\d+)+", text) else None


def device_nodes(root: Path | None = None) -> list[str]:
    """The GPU device nodes this process was given (/dev/nvidia0, ...): what a container runtime passes in."""
    root = root or ROOT
    return sorted(path.name for path in (root / "dev").glob("nvidia[0-9]*"))


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def required_driver(cuda: str) -> str | None:
    """The oldest driver that runs a torch built for CUDA `cuda` ("13.0"), as text; None when unknown."""
    need = MIN_DRIVER_FOR_CUDA.get(int(cuda.split(".")[0]))
    return ".".join(f"{part:02d}" if i else str(part) for i, part in enumerate(need)) if need else None


def why_no_cuda(environ: Mapping[str, str], root: Path | None = None) -> str:
    """Why torch sees no CUDA device here, in words that say what to do: an old driver names its version
    and the one this torch needs (the advice to use gloo would have 8 GPUs train on CPU)."""
    root = root or ROOT
    cuda = torch.version.cuda
    if cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build: use the GPU image (make image-gpu), or --backend gloo"
    driver, need = driver_version(root), required_driver(cuda)
    if driver is None:
        return (
            "no NVIDIA driver answers on this node (no /proc/driver/nvidia/version): run on a GPU node and give the container "
            "its GPUs (docker run --gpus all; under pyxis, enroot's nvidia hook), or --backend gloo to train on CPUs"
        )
    if need is not None and version_tuple(driver) < version_tuple(need):
        return (
            f"the node's NVIDIA driver is {driver} but this torch is built for CUDA {cuda}, which needs driver {need} or newer: "
            "update the node's driver, or build the image with a torch for an older CUDA "
            "(make image-gpu BUILD_ARGS='--build-arg TORCH_VERSION=... --build-arg TORCH_INDEX_URL=...')"
        )
    if gpus_hidden(environ):
        return f"CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r} hides every GPU: unset it or name the GPUs, or --backend gloo to train on CPUs"
    nodes = ", ".join(device_nodes(root)) or "none"
    return (
        f"the NVIDIA driver {driver} is loaded but no GPU reached this process (device nodes here: {nodes}): give the container "
        "its GPUs (docker run --gpus all; under pyxis the nvidia hook, with NVIDIA_VISIBLE_DEVICES=all as the image sets it)"
    )


def gpus_promised(environ: Mapping[str, str]) -> int:
    """The GPUs Slurm allocated this job on this node (SLURM_GPUS_ON_NODE: --gpus-per-node, --gres=gpu:N), 0 outside a
    GPU allocation. A GPU partition whose GRES has no device files (CUDA_VISIBLE_DEVICES=NoDevFiles) still says so."""
    text = environ.get("SLURM_GPUS_ON_NODE", "").strip()
    return int(text) if text.isdigit() else 0


def gpus_expected(environ: Mapping[str, str], root: Path | None = None) -> bool:
    """True when this is a CUDA build of torch on a node with NVIDIA GPUs that were not hidden on purpose:
    torch then not seeing them is a fault to report, not a reason to fall back to training on CPUs."""
    root = root or ROOT
    if torch.version.cuda is None or gpus_hidden(environ):
        return False
    return bool(device_nodes(root)) or driver_version(root) is not None


def set_tf32(device: torch.device, enabled: bool) -> bool:
    """TF32 for fp32 matmuls and convolutions on Ampere and later (10-bit mantissa inputs, fp32
    accumulation: the precision every GPU framework trains fp32 in, about 7x an H100's fp32 rate);
    `enabled` False (--no-tf32) keeps full fp32 there too. Returns whether TF32 is on."""
    if device.type != "cuda":
        return False
    on = enabled and torch.cuda.get_device_capability(device)[0] >= 8
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    return on


def efa_devices(root: Path | None = None) -> list[str]:
    """The node's AWS EFA devices (rdmap0s31, ...): InfiniBand-class devices whose kernel driver is efa."""
    root = root or ROOT
    found = []
    for device in sorted((root / "sys/class/infiniband").glob("*")):
        driver = device / "device" / "driver"
        if (driver.is_symlink() and Path(os.readlink(driver)).name == "efa") or device.name.startswith("rdmap"):
            found.append(device.name)
    return found


# What NCCL names its sockets transport in "Using network Socket" (IB: "IB"; aws-ofi-nccl: "AWS Libfabric"
# or "Libfabric", by version).
SOCKETS = "Socket"


def capture_nccl_log(environ: MutableMapping[str, str] = os.environ) -> Path | None:
    """Send NCCL's INIT and NET lines to a file of this process's own (the preflight's; training keeps
    the job's NCCL_DEBUG), before NCCL first reads its settings. None when the job already reads NCCL's
    log itself (NCCL_DEBUG=INFO or TRACE, or NCCL_DEBUG_FILE set): then the transport is not known here."""
    if environ.get("NCCL_DEBUG", "").upper() in ("INFO", "TRACE") or environ.get("NCCL_DEBUG_FILE"):
        return None
    path = Path(tempfile.mkdtemp(prefix="ddpack-nccl-")) / "nccl.log"
    environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,NET", NCCL_DEBUG_FILE=str(path))
    return path


def nccl_network(log: Path | None) -> str:
    """The network NCCL said it uses ("Socket", "IB", "AWS Libfabric"); "?" when its log does not say."""
    try:
        found = re.findall(r"NCCL INFO Using network (.+?)\s*$", log.read_text(errors="replace"), re.MULTILINE) if log else []
    except OSError:
        found = []
    return found[-1] if found else "?"


def nccl_warnings(log: Path | None) -> list[str]:
    """The WARN lines of a log capture_nccl_log redirected, which the job would otherwise have seen on stderr."""
    try:
        return [line for line in log.read_text(errors="replace").splitlines() if " NCCL WARN " in line] if log else []
    except OSError:
        return []
