"""The CUDA image builds here without a GPU: CUDA build of torch with NCCL compiled in, AWS NCCL
defaults, and the trainer still runs (gloo) when no device is visible."""

from __future__ import annotations

import pytest
from docker_support import TEST_GPU_TAG, build, engine_or_skip

import docker

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def gpu_image() -> tuple[docker.DockerClient, str]:
    client = engine_or_skip()
    build("gpu", TEST_GPU_TAG)
    return client, TEST_GPU_TAG


def test_gpu_image_has_cuda_torch_with_nccl(gpu_image: tuple[docker.DockerClient, str]) -> None:
    client, image = gpu_image
    probe = "import torch, torch.distributed as d; print(torch.__version__, torch.version.cuda, d.is_nccl_available())"
    out = client.containers.run(image, ["python", "-c", probe], entrypoint=[], remove=True).decode()
    version, cuda, nccl = out.split()
    assert "+cpu" not in version and cuda not in ("None", "") and nccl == "True", out


def test_gpu_image_labels_and_nccl_defaults_that_a_job_can_override(gpu_image: tuple[docker.DockerClient, str]) -> None:
    """The image sets no NCCL_* (under pyxis an image's ENV beats the job's); the launcher in the image
    applies the AWS defaults where the job left them unset, and the job's own value where it set one."""
    client, image = gpu_image
    config = client.images.get(image).attrs["Config"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert not [name for name in env if name.startswith("NCCL_")] and env["DDPACK_VARIANT"] == "gpu"
    probe = "import os; print(os.environ['NCCL_DEBUG'], os.environ['NCCL_SOCKET_IFNAME'], os.environ['TORCH_NCCL_ASYNC_ERROR_HANDLING'])"
    out = client.containers.run(image, ["--backend", "nccl", "--", "python", "-c", probe], environment={"NCCL_DEBUG": "INFO"}, remove=True)
    assert out.decode().split() == ["INFO", "^lo,docker,veth", "1"]
    assert config["Labels"]["io.ddpack.variant"] == "gpu" and config["Labels"]["io.ddpack.efa"] == "0"
    assert config["Entrypoint"] == ["/usr/local/bin/entrypoint"]


def test_gpu_image_trains_on_cpu_when_no_device_is_visible(gpu_image: tuple[docker.DockerClient, str]) -> None:
    client, image = gpu_image
    out = client.containers.run(
        image, ["--epochs", "1"], environment={"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}, remove=True
    ).decode()
    assert "backend gloo device cpu" in out and "checksums agree across 1 ranks" in out


def test_submit_builds_a_gpu_jobs_project_on_the_cuda_image_with_its_torch_held(gpu_image: tuple[docker.DockerClient, str], tmp_path) -> None:
    """`ddpack submit --gpus-per-node`'s build (as `make image-gpu APP=DIR`): the project on the bundle's CUDA image
    (the same sources as the tier's image, so from the build cache), torch and the CUDA wheels (nvidia-*) at the
    bundle's versions, and the CUDA torch kept; asked again, nothing is built. The image stays: the cluster tier
    submits this project as a GPU job (tests/test_lifecycle_cluster.py), which then converts it rather than building
    it again. An image of these inputs left on the engine by an earlier session is removed first, so the build is
    this test's own (CI once found one and read it as "not built")."""
    from ddpack.jobs.submit import ensure_image
    from testbed.readme_examples import write_cpu_ddp

    client, image = gpu_image
    project = write_cpu_ddp(tmp_path / "cpu-ddp")
    leftover = ensure_image(project, variant="gpu", build=False)
    if leftover is not None:
        client.images.remove(leftover.ref, force=True)
    choice = ensure_image(project, variant="gpu")
    assert choice is not None and (choice.variant, choice.efa, choice.built) == ("gpu", False, True)
    assert client.images.get(choice.bundle).labels["io.ddpack.variant"] == "gpu"
    held = "import importlib.metadata as m; print(sorted(f'{d.name}=={d.version}' for d in m.distributions() if d.name.startswith(('torch', 'nvidia-'))))"
    app_wheels = client.containers.run(choice.ref, ["python", "-c", held], entrypoint=[], remove=True).decode()
    assert "'torch==2.13.0" in app_wheels and "nvidia-nccl-cu13==" in app_wheels, app_wheels
    assert app_wheels == client.containers.run(image, ["python", "-c", held], entrypoint=[], remove=True).decode()
    probe = "import torch, tqdm; print(torch.version.cuda)"  # the project's own requirement, beside the CUDA torch
    assert client.containers.run(choice.ref, ["python", "-c", probe], entrypoint=[], remove=True).decode().strip() not in ("None", "")
    again = ensure_image(project, variant="gpu")
    assert again is not None and (again.ref, again.image_id, again.built) == (choice.ref, choice.image_id, False)
