"""A user's project in the image, for real: the README's project (`cpu-ddp`: the walkthrough-style `ddp.py`
and a one-line requirements.txt, tqdm from the package index through the CA bundle) built on the bundle,
smoked in two containers and converted by the README's own command line (the `readme_project` fixture);
then the same project offline from a wheel folder, a code-only change, and a dependency that wants
another torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from docker_support import ReadmeProject, engine_or_skip

import docker
from ddpack.errors import HostError
from ddpack.images.app import read_app
from ddpack.images.images import build_app_image, plan_build

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def client() -> docker.DockerClient:
    return engine_or_skip()


def in_image(client: docker.DockerClient, image: str, script: str, **kwargs) -> str:
    return client.containers.run(image, ["python", "-c", script], remove=True, **kwargs).decode()


def layers(client: docker.DockerClient, image: str) -> list[str]:
    return client.images.get(image).attrs["RootFS"]["Layers"]


def app_build(project: Path, tag: str, bundle: str, command: str = "", **environ: str):
    """A build of the project on the already-built bundle `bundle` (only the app's two layers run)."""
    return plan_build(variant="cpu", tag=tag, environ={**os.environ, **environ}, app=read_app(project, command), bundle_tag=bundle,
                      offline=bool(environ.get("OFFLINE")))  # fmt: skip


def wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
    """A minimal pure-Python wheel (what a company's internal package looks like to pip)."""
    module, dist = name.replace("-", "_"), f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    files = {
        f"{module}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: ddpack-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
        archive.writestr(f"{dist}.dist-info/RECORD", "".join(f"{m},,\n" for m in [*files, f"{dist}.dist-info/RECORD"]))
    return path


def wheelhouse_with_torch(folder: Path) -> Path:
    """A wheel folder holding the host's torch wheel (the build's rule: WHEELHOUSE must hold torch)."""
    folder.mkdir()
    from ddpack.images.images import plan_build as plan

    for torch_wheel in plan(variant="cpu", tag="unused").inputs.torch_wheels:
        os.link(torch_wheel.path, folder / torch_wheel.path.name)
    return folder


def test_the_readme_command_builds_smokes_and_converts_the_project(client: docker.DockerClient, readme_project: ReadmeProject) -> None:
    out = readme_project.output
    assert "images: building cpu-ddp:" in out
    for variant, world in (("pair", 2), ("torchrun", 4)):
        assert f"smoke[{variant}]: preflight: PASS" in out and f"smoke[{variant}]: PASS" in out
        assert "running the image's own command (python ddp.py 4 2)" in out
        assert out.count("[rank 0] trained to epoch 4") >= 2 and f"[rank {world - 1}] trained to epoch 4" in out
    assert "preflight: 4 ranks on 2 hosts" in out  # torchrun 2x2: both containers' ranks in one check
    assert readme_project.sqsh.is_file() and readme_project.sqsh.name == f"{readme_project.image.replace(':', '+')}.sqsh"
    assert not client.containers.list(all=True, filters={"label": "io.ddpack.smoke"})
    assert not [n for n in client.networks.list() if n.name.startswith("ddpack-smoke-")]


def test_torch_is_the_images_own_and_the_project_is_recorded(client: docker.DockerClient, readme_project: ReadmeProject) -> None:
    image, bundle = client.images.get(readme_project.image), client.images.get(readme_project.bundle)
    # The bundle's layers (torch among them) are the project image's first ones; the dependency layer holds tqdm, not a torch.
    assert layers(client, readme_project.image)[: len(layers(client, readme_project.bundle))] == layers(client, readme_project.bundle)
    assert image.attrs["Size"] - bundle.attrs["Size"] < 5 * 2**20
    probe = (
        "import importlib.metadata as m, json, torch, tqdm; from train.preflight.identity import app_label;"
        "print(json.dumps([torch.__version__, torch.__file__, sorted(d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].startswith('nvidia')),"
        " app_label(), __import__('os').getcwd()]))"
    )
    version, path, nvidia, app, cwd = json.loads(in_image(client, readme_project.image, probe))
    digest = read_app(readme_project.folder).digest
    assert (version, path, nvidia) == ("2.13.0+cpu", "/opt/ddpack/venv/lib/python3.11/site-packages/torch/__init__.py", [])
    assert app == f"cpu-ddp@{digest}" and cwd == "/opt/app"
    labels = image.attrs["Config"]["Labels"]
    assert labels["io.ddpack.app.name"] == "cpu-ddp" and labels["io.ddpack.app.digest"] == digest
    assert labels["io.ddpack.app.revision"] == "none" and labels["io.ddpack.app.command"] == "python ddp.py 4 2"
    assert "DDPACK_APP_CMD=python ddp.py 4 2" in image.attrs["Config"]["Env"]
    # Any uid reads the code (pyxis runs tasks as the submitting user), from any working directory.
    out = client.containers.run(readme_project.image, ["sh", "-c", "cd /tmp && entrypoint --print-plan"], user="4242:4242", remove=True, entrypoint=[])
    assert json.loads(out)["argv"] == ["python", "/opt/app/ddp.py", "4", "2"]


def test_a_code_change_rebuilds_only_the_code_layer_and_a_train_module_does_not_shadow_the_bundle(
    client: docker.DockerClient, readme_project: ReadmeProject, tmp_path: Path
) -> None:
    project = tmp_path / "cpu-ddp"
    shutil.copytree(readme_project.folder, project)
    (project / "ddp.py").write_text((project / "ddp.py").read_text() + "# a one-line change\n")
    (project / "train.py").write_text("raise SystemExit('the project train.py ran instead of the bundle')\n")
    tag = "cpu-ddp:pytest-edit"
    build_app_image(app_build(project, tag, readme_project.bundle, "python ddp.py 4 2"))
    try:
        before, after, deps = layers(client, readme_project.image), layers(client, tag), len(layers(client, readme_project.bundle))
        # The bundle's layers and the dependency layer after them are reused; the code layer is new.
        assert len(before) == len(after) and after[: deps + 1] == before[: deps + 1] and after[deps + 1] != before[deps + 1]
        out = client.containers.run(tag, ["--epochs", "1", "--dataset-size", "64", "--snapshot-dir", ""], remove=True).decode()
        assert "done: global step" in out
    finally:
        client.images.remove(tag, force=True)


def test_offline_from_a_wheel_folder(client: docker.DockerClient, readme_project: ReadmeProject, tmp_path: Path) -> None:
    wheels = wheelhouse_with_torch(tmp_path / "wheels")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), "tqdm"], check=True, timeout=300)
    wheel(wheels, "acme-utils", "1.2.0", ("tqdm",))  # a company package, only in the wheel folder
    project = shutil.copytree(readme_project.folder, tmp_path / "cpu-ddp")
    (project / "requirements.txt").write_text("tqdm\nacme-utils==1.2.0\n")
    tag = "cpu-ddp:pytest-offline"
    build_app_image(app_build(project, tag, readme_project.bundle, WHEELHOUSE=str(wheels), OFFLINE="1"))
    try:
        assert in_image(client, tag, "import acme_utils, tqdm, torch; print(acme_utils.VERSION, torch.__version__)").split() == ["1.2.0", "2.13.0+cpu"]
    finally:
        client.images.remove(tag, force=True)


def test_a_dependency_that_wants_another_torch_fails_the_build_with_one_line(
    client: docker.DockerClient, readme_project: ReadmeProject, tmp_path: Path
) -> None:
    wheels = wheelhouse_with_torch(tmp_path / "wheels")
    wheel(wheels, "needs-old-torch", "1.0", ("torch==2.1.0",))
    project = tmp_path / "cpu-ddp"
    shutil.copytree(readme_project.folder, project)
    (project / "requirements.txt").write_text("needs-old-torch\n")
    tag = "cpu-ddp:pytest-conflict"
    with pytest.raises(HostError) as failure:
        build_app_image(app_build(project, tag, readme_project.bundle, WHEELHOUSE=str(wheels), OFFLINE="1"))
    assert failure.value.code == 2
    assert str(failure.value) == (
        "the app's requirements want another torch than the image's 2.13.0+cpu: needs-old-torch 1.0 depends on torch==2.1.0; "
        "pin a version made for torch 2.13.0, or drop the requirement (the image provides torch)"
    )
    with pytest.raises(docker.errors.ImageNotFound):
        client.images.get(tag)
