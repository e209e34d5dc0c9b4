"""The GPU node's checks without a GPU: a fake /dev/nvidia0 and a stubbed driver version under a fake
root, torch's CUDA build and device count stubbed. What only a GPU can show is in the gpu tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import train.gpu
from train.distributed import DeviceError, select_device
from train.gpu import device_nodes, driver_version, gpus_expected, required_driver, set_tf32, why_no_cuda

PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.183.01  Sun May 12 19:39:15 UTC 2024\nGCC version:  gcc 11.4.0\n"
OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16-I3-B03-4-3)\n"


def node(root: Path, driver: str | None = None, gpus: int = 0) -> Path:
    """A fake node: /proc/driver/nvidia/version holding `driver`, and /dev/nvidia0.. for `gpus`."""
    (root / "dev").mkdir(parents=True)
    for index in range(gpus):
        (root / "dev" / f"nvidia{index}").touch()
    (root / "dev" / "nvidiactl").touch()  # not a GPU
    if driver is not None:
        (root / "proc/driver/nvidia").mkdir(parents=True)
        (root / "proc/driver/nvidia/version").write_text(driver)
    return root


@pytest.fixture
def cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch as if it were the GPU image's (CUDA 13.0) on a node where CUDA does not come up."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_the_driver_version_is_read_from_either_kernel_module_and_from_sysfs(tmp_path: Path) -> None:
    assert driver_version(node(tmp_path / "a", PROPRIETARY)) == "535.183.01"
    assert driver_version(node(tmp_path / "b", OPEN)) == "580.65.06"
    sysfs = node(tmp_path / "c") / "sys/module/nvidia"
    sysfs.mkdir(parents=True)
    (sysfs / "version").write_text("570.86.15\n")
    assert driver_version(tmp_path / "c") == "570.86.15"
    assert driver_version(node(tmp_path / "d")) is None
    assert device_nodes(node(tmp_path / "e", gpus=2)) == ["nvidia0", "nvidia1"]
    assert (required_driver("13.0"), required_driver("12.8"), required_driver("11.8")) == ("580.65.06", "525.60.13", "450.80.02")


@pytest.mark.usefixtures("cuda_build")
def test_an_old_driver_is_named_with_the_version_this_torch_needs_not_sent_to_gloo(tmp_path: Path) -> None:
    why = why_no_cuda({}, node(tmp_path / "old", PROPRIETARY, gpus=8))
    assert why.startswith("the node's NVIDIA driver is 535.183.01 but this torch is built for CUDA 13.0, which needs driver 580.65.06 or newer")
    assert "update the node's driver" in why and "--backend gloo" not in why
    assert why_no_cuda({}, node(tmp_path / "none")).startswith("no NVIDIA driver answers on this node")
    assert why_no_cuda({"CUDA_VISIBLE_DEVICES": ""}, node(tmp_path / "hidden", OPEN, gpus=1)).startswith("CUDA_VISIBLE_DEVICES='' hides every GPU")
    unpassed = why_no_cuda({}, node(tmp_path / "unpassed", OPEN))
    assert unpassed.startswith("the NVIDIA driver 580.65.06 is loaded but no GPU reached this process (device nodes here: none)")


@pytest.mark.usefixtures("cuda_build")
def test_a_gpu_node_whose_gpus_torch_cannot_use_is_an_error_not_a_quiet_fall_back_to_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(train.gpu, "ROOT", node(tmp_path / "old", PROPRIETARY, gpus=8))
    for backend in (None, "nccl"):  # auto (python -m train alone) and nccl (entrypoint saw /dev/nvidia0)
        with pytest.raises(DeviceError, match=r"torch sees none: the node's NVIDIA driver is 535\.183\.01 .* needs driver 580\.65\.06"):
            select_device(backend)
    assert select_device("gloo") == ("gloo", torch.device("cpu"))  # asked for by name: trains on CPUs
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not gpus_expected({"CUDA_VISIBLE_DEVICES": ""}) and select_device(None) == ("gloo", torch.device("cpu"))
    monkeypatch.setattr(train.gpu, "ROOT", node(tmp_path / "cpu-node"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert select_device(None) == ("gloo", torch.device("cpu"))  # the GPU image on a CPU node: gloo, as before


@pytest.mark.usefixtures("cuda_build")
def test_gpus_slurm_promised_that_torch_cannot_see_are_an_error_even_where_slurm_hides_them(tmp_path: Path, monkeypatch) -> None:
    """A GPU partition whose nodes have no GPU for this job (GRES without device files: Slurm sets
    CUDA_VISIBLE_DEVICES=NoDevFiles, which otherwise reads as hidden on purpose) names the promise, not a silent CPU run."""
    monkeypatch.setattr(train.gpu, "ROOT", node(tmp_path / "cpu-node"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "NoDevFiles")
    monkeypatch.setenv("SLURM_GPUS_ON_NODE", "2")
    with pytest.raises(DeviceError, match=r"Slurm gave this job 2 GPU\(s\) on this node \(SLURM_GPUS_ON_NODE\) but torch sees none: no NVIDIA driver"):
        select_device(None)
    assert select_device("gloo") == ("gloo", torch.device("cpu"))  # asked for by name: trains on CPUs
    monkeypatch.delenv("SLURM_GPUS_ON_NODE")
    assert select_device(None) == ("gloo", torch.device("cpu"))


def test_the_node_helper_refuses_a_gpu_job_on_a_node_without_the_gpus_before_staging(tmp_path: Path) -> None:
    """enroot/ddpack_node.py prepare --gpus N (the job's first step on every node, before the image is staged or
    unpacked): a node with fewer GPU devices answers nogpu, and the template ends the job on it in one line."""
    import subprocess
    import sys

    from testbed.env import ROOT, clean_env

    helper = ROOT / "enroot" / "ddpack_node.py"
    argv = [sys.executable, "-I", "-S", str(helper), "prepare", "--dir", str(tmp_path / "stage"), "--job", "7", "--keep", "2", "--gpus", "2"]
    out = subprocess.run(argv, env=clean_env(SLURMD_NODENAME="ddnode1"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("nogpu ddnode1 0 GPU device(s)"), out.stdout + out.stderr
    assert not (tmp_path / "stage").exists()  # nothing staged, nothing removed (the cluster tier runs the template's side)


def test_tf32_is_on_by_default_on_ampere_and_later_and_off_with_no_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    from train.config import parse_config
    from train.perf import precision

    assert parse_config([]).tf32 and not parse_config(["--no-tf32"]).tf32
    gpu = torch.device("cuda", 0)
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        for capability, enabled, on in (((9, 0), True, True), ((8, 0), True, True), ((7, 0), True, False), ((9, 0), False, False)):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
            assert set_tf32(gpu, enabled) is on and torch.backends.cuda.matmul.allow_tf32 is on and torch.backends.cudnn.allow_tf32 is on
            assert precision(gpu, amp=False) == ("tf32" if on else "fp32") and precision(gpu, amp=True) == "bf16"
        torch.backends.cuda.matmul.allow_tf32 = False
        assert set_tf32(torch.device("cpu"), True) is False and torch.backends.cuda.matmul.allow_tf32 is False  # CPUs untouched
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_efa_devices_are_found_by_their_driver_and_nccls_network_by_its_log(tmp_path: Path) -> None:
    from train.gpu import capture_nccl_log, efa_devices, nccl_network, nccl_warnings

    drivers = tmp_path / "sys/bus/pci/drivers"
    for name, driver in (("rdmap16s27", "efa"), ("efa_x", "efa"), ("mlx5_0", "mlx5_core")):
        (drivers / driver).mkdir(parents=True, exist_ok=True)
        (tmp_path / f"sys/class/infiniband/{name}/device").mkdir(parents=True)
        (tmp_path / f"sys/class/infiniband/{name}/device/driver").symlink_to(drivers / driver)
    assert efa_devices(tmp_path) == ["efa_x", "rdmap16s27"] and efa_devices(tmp_path / "none") == []

    environ = {"NCCL_DEBUG": "WARN"}
    log = capture_nccl_log(environ)
    assert log is not None and environ == {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(log)}
    assert nccl_network(log) == "?"  # nothing written yet
    log.write_text("ip-10-1-2-3:77:77 [0] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v7)\n"
                   "ip-10-1-2-3:77:77 [0] NCCL INFO Using network AWS Libfabric\n")
    assert nccl_network(log) == "AWS Libfabric"
    log.write_text("h:1:1 [0] NCCL INFO NET/Socket : Using [0]ens5:10.1.2.3<0>\nh:1:1 [0] NCCL INFO Using network Socket\n")
    assert nccl_network(log) == "Socket"
    log.write_text("h:1:1 [0] NCCL INFO Using network Socket\nh:1:1 [0] NCCL WARN NET/Socket : no usable interface found\n")
    assert nccl_warnings(log) == ["h:1:1 [0] NCCL WARN NET/Socket : no usable interface found"] and nccl_warnings(None) == []
    assert capture_nccl_log({"NCCL_DEBUG": "info"}) is None and capture_nccl_log({"NCCL_DEBUG_FILE": "/x"}) is None  # the job reads it


def test_only_the_gpu_tier_shows_the_processes_it_starts_the_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU tier as written hid the GPU from every rank it started (8 of 9 failed on an H200): the tests' child
    environment hides the GPUs unless the tier turns them on, and then passes on what this process sees."""
    import testbed.env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert testbed.env.clean_env()["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.setattr(testbed.env, "gpus_visible", True)
    assert testbed.env.clean_env()["CUDA_VISIBLE_DEVICES"] == "2,3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert "CUDA_VISIBLE_DEVICES" not in testbed.env.clean_env()
    gpu_tier = (Path(__file__).parent / "test_gpu.py").read_text()
    assert 'monkeypatch.setattr(testbed.env, "gpus_visible", True)' in gpu_tier and "autouse=True" in gpu_tier
