"""The CPU image built for real, run as Docker and as pyxis would; secrets; the two-container smoke."""

from __future__ import annotations

import io
import json
import re
import tarfile
from pathlib import Path

import pytest
from docker_support import engine_or_skip, host_ca_bundle

import docker
from ddpack.errors import HostError
from ddpack.jobs.smoke import SHM_SIZE, run_smoke
from testbed.readme_examples import write_mytask

pytestmark = pytest.mark.docker


@pytest.fixture(scope="session")
def client() -> docker.DockerClient:
    return engine_or_skip()


@pytest.fixture(scope="session")
def image(client: docker.DockerClient, cpu_image: str) -> str:
    return cpu_image


def run(client: docker.DockerClient, image: str, command: list[str] | str, **kwargs) -> tuple[int, str]:
    container = client.containers.run(image, command=command, detach=True, **kwargs)
    try:
        code = container.wait(timeout=300)["StatusCode"]
        return code, container.logs().decode(errors="replace")
    finally:
        container.remove(force=True)


def test_cpu_image_has_cpu_torch_numpy_and_no_cuda_packages(client: docker.DockerClient, image: str) -> None:
    probe = (
        "import importlib.metadata as m, warnings, torch, numpy; warnings.simplefilter('error');"
        "torch.from_numpy(numpy.ones(2));"
        "print(torch.__version__, torch.version.cuda, torch.distributed.is_gloo_available(),"
        " sorted(d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].lower().startswith('nvidia')))"
    )
    code, out = run(client, image, ["python", "-c", probe])
    assert code == 0, out
    assert out.strip().endswith("+cpu None True []"), out
    assert "Failed to initialize NumPy" not in out


def test_bytecode_ships_and_what_no_runtime_loads_is_left_out(client: docker.DockerClient, image: str) -> None:
    """A fresh container (pyxis: every job, every node) imports torch and the trainer without compiling."""
    probe = (
        "import os, sys, torch, torch.distributed, numpy, train.trainer, train.preflight.comm, entrypoint.cli;"
        "missing = [n for n, m in list(sys.modules.items()) if isinstance(getattr(m, '__cached__', None), str) and not os.path.exists(m.__cached__)];"
        "site = os.path.dirname(os.path.dirname(torch.__file__));"
        "tests = [r for r, _, _ in os.walk(site) if os.path.basename(r) == 'tests'];"
        "gtests = [n for n in os.listdir(os.path.join(site, 'torch', 'bin')) if n.startswith('test_') or n.endswith('Test')];"
        "print(len(sys.modules), missing[:5], os.path.exists(os.path.join(site, 'torch', 'include')),"
        " os.path.exists(os.path.join(site, 'torch', 'test')), tests[:3], gtests[:3],"
        " os.access(os.path.join(site, 'torch', 'bin', 'torch_shm_manager'), os.X_OK))"
    )
    code, out = run(client, image, ["python", "-c", probe], user="4242:4242")
    assert code == 0, out
    modules, rest = out.strip().split(" ", 1)
    # torch's C++ headers stay for torch.compile (the image has its compiler); torch_shm_manager stays:
    # DataLoader workers use it under the file_system sharing strategy.
    assert int(modules) > 500 and rest == "[] True False [] [] True", out


def test_docker_run_with_no_arguments_trains(client: docker.DockerClient, image: str) -> None:
    code, out = run(client, image, [], environment={"OMP_NUM_THREADS": "1"})
    assert code == 0, out
    assert "[rank 0/1] start: rank 0 world 1" in out and "checksums agree across 1 ranks" in out


def test_any_uid_with_a_login_shell_finds_entrypoint_and_the_venv(client: docker.DockerClient, image: str) -> None:
    """pyxis: no ENTRYPOINT, PATH reset by /etc/profile, the submitting user's uid, host variables."""
    script = "command -v entrypoint; command -v python; entrypoint --print-plan; python -c 'import torch, train, entrypoint'"
    code, out = run(
        client,
        image,
        ["/bin/sh", "-lc", script],
        entrypoint=[],
        user="31337:31337",
        environment={
            "PATH": "/host/bin:/usr/bin:/bin",
            "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_PROCID": "1",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "0",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
            "SLURM_STEP_NODELIST": "gpu[07-08]",
            "SLURM_JOB_ID": "9",
        },
    )
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "/usr/local/bin/entrypoint" and lines[1] == "/opt/ddpack/venv/bin/python"
    plan = json.loads("\n".join(lines[2:]))
    assert plan["mode"] == "slurm" and plan["rank"] == 1 and plan["master_addr"] == "gpu07"
    code, out = run(
        client,
        image,
        ["sh", "-c", "cd /workspace && touch ok && python -m train --epochs 1 --snapshot-dir snaps"],
        entrypoint=[],
        user="4242",
    )
    assert code == 0 and "snapshot saved: snaps/snapshot-" in out, out


def test_dataloader_workers_and_a_users_task_from_the_working_directory(client: docker.DockerClient, image: str) -> None:
    """`docker run -v $PWD:/workspace IMAGE --task mymodule:factory` with worker processes, given the
    shared memory `make smoke` gives its containers."""
    tests_dir = Path(__file__).resolve().parent
    args = ["--task", "plugins.augmented_task:make", "--epochs", "1", "--num-workers", "2", "--snapshot-dir", ""]
    code, out = run(
        client, image, args, volumes={str(tests_dir): {"bind": "/workspace", "mode": "ro"}}, shm_size=SHM_SIZE, environment={"OMP_NUM_THREADS": "1"}
    )
    assert code == 0, out
    assert "task augmented" in out and "checksums agree across 1 ranks" in out


def test_the_readme_task_under_docker_run_on_two_ranks(client: docker.DockerClient, image: str, tmp_path: Path) -> None:
    """README: `docker run --rm -v "$PWD":/workspace ddpack:dev --nproc-per-node 2 --task mytask:make --epochs 2`."""
    write_mytask(tmp_path)
    args = ["--nproc-per-node", "2", "--task", "mytask:make", "--epochs", "2", "--snapshot-dir", ""]
    code, out = run(client, image, args, volumes={str(tmp_path): {"bind": "/workspace", "mode": "ro"}}, environment={"OMP_NUM_THREADS": "1"})
    assert code == 0, out
    assert "task my-cnn" in out and "epoch 2 done: eval_accuracy" in out and "checksums agree across 2 ranks" in out


def test_torch_compile_works_in_the_image(client: docker.DockerClient, image: str) -> None:
    """A user's own torch.compile, as any uid: inductor generates C++ and builds it with the image's g++ against
    torch's headers, writing its cache where that uid can. That is all the trainer's --compile needs of the image; the
    trainer's own compiled runs (stop, snapshot, resume bit for bit, and the one line where inductor cannot build) are
    tests/test_zoo.py's, on the same torch. (Its run in here as well cost 12 s more, 45 against 33 here, and proved nothing more.)"""
    probe = "import torch; f = torch.compile(lambda x: (x * 2).sin() + 1); print(torch.allclose(f(torch.ones(8)), (torch.ones(8) * 2).sin() + 1))"
    code, out = run(client, image, ["python", "-c", probe], entrypoint=[], user="4242:4242", environment={"OMP_NUM_THREADS": "1"})
    assert code == 0 and "True" in out.splitlines(), out


def test_image_config_entrypoint_env_and_labels(client: docker.DockerClient, image: str) -> None:
    config = client.images.get(image).attrs["Config"]
    assert config["Entrypoint"] == ["/usr/local/bin/entrypoint"]
    env = dict(item.split("=", 1) for item in config["Env"])
    assert env["PYTHONPATH"] == "" and env["LD_LIBRARY_PATH"] == "" and env["PATH"].startswith("/opt/ddpack/venv/bin:")
    labels = config["Labels"]
    assert labels["io.ddpack.variant"] == "cpu" and labels["io.ddpack.torch.version"] == "2.13.0+cpu"
    assert labels["org.opencontainers.image.version"] == "pytest"
    assert re.fullmatch(r"[0-9a-f]{40}(-dirty)?", labels["org.opencontainers.image.revision"])
    assert labels["org.opencontainers.image.source"]


def _pem_blocks(text: str) -> set[str]:
    return {m.group(0) for m in re.finditer(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", text, re.S)}


def ca_material_in_layers(client: docker.DockerClient, image: str, ca: Path, trusting: str | None = None) -> list[str]:
    """Layers of `image` holding the host bundle or a certificate only the host trusts (a proxy's CA): one the bundle of
    `trusting` (the image itself unless named) does not hold."""
    host_blocks = _pem_blocks(ca.read_text())
    code, image_bundle = run(client, trusting or image, ["cat", "/etc/ssl/certs/ca-certificates.crt"], entrypoint=[])
    private = host_blocks - _pem_blocks(image_bundle if code == 0 else "")
    assert private, "the host bundle adds no certificate of its own; this check would prove nothing"
    needles = [block.splitlines()[1].encode() for block in private] + [ca.read_bytes()]
    found = []
    saved = b"".join(client.images.get(image).save(named=True))
    with tarfile.open(fileobj=io.BytesIO(saved)) as outer:
        for member in outer.getmembers():
            if member.isfile() and (member.name.endswith(".tar") or member.name.startswith("blobs/")):
                data = outer.extractfile(member).read()
                if any(needle in data for needle in needles) or b"run/secrets/pip_cert\x00" in data:
                    found.append(member.name)
    return found


def _ca_or_skip() -> Path:
    ca = host_ca_bundle()
    if ca is None:
        pytest.skip("this host passes no CA bundle to builds, so there is none to leak")
    return ca


def test_no_ca_bundle_or_secret_in_any_layer_or_history(client: docker.DockerClient, image: str) -> None:
    assert ca_material_in_layers(client, image, _ca_or_skip()) == []
    assert "BEGIN CERTIFICATE" not in json.dumps(client.api.history(image))


def test_the_leak_check_finds_a_planted_bundle(client: docker.DockerClient, image: str, tmp_path: Path) -> None:
    ca = _ca_or_skip()
    (tmp_path / "ca.crt").write_bytes(ca.read_bytes())
    # One layer of its own (the check reads every layer of what it is given: 13 s for a copy of the whole image).
    (tmp_path / "Dockerfile").write_text("FROM scratch\nCOPY ca.crt /usr/local/share/leaked.crt\n")
    leaky, _ = client.images.build(path=str(tmp_path), tag="ddpack:pytest-leaky", rm=True)
    try:
        assert len(ca_material_in_layers(client, "ddpack:pytest-leaky", ca, trusting=image)) == 1
    finally:
        client.images.remove(leaky.id, force=True)


def test_smoke_pair_variant_passes_and_cleans_up(client: docker.DockerClient, image: str, capsys) -> None:
    """The bundled trainer's pair; the torchrun 2x2 variant runs in `make smoke` (CI's main job) and in the
    README project's smoke (test_app_image), both with the same machinery."""
    assert run_smoke(image, "pair", timeout_s=300)
    out = capsys.readouterr().out
    assert "smoke[pair]: preflight: PASS" in out and "running the bundled trainer" in out and "checksums agree (2/2 ranks" in out
    # The run folder the containers shared holds both ranks' step times, MFU against the preflight's
    # measured peak, and the report made from them.
    run = Path(re.search(r"smoke\[pair\]: run report (\S+)/report\.html \(make it again: make report RUN=\S+\)", out).group(1))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    progress = [r for r in records if r["kind"] == "progress"]
    assert progress and all(len(r["rank_step_s"]) == 2 and r["mfu"] > 0 for r in progress)
    assert next(r for r in records if r["kind"] == "start")["peak_source"].startswith("preflight:")
    assert (run / "report.html").stat().st_size > 10_000
    assert not client.containers.list(all=True, filters={"label": "io.ddpack.smoke"})
    assert not [n for n in client.networks.list() if n.name.startswith("ddpack-smoke-")]


def test_smoke_failure_shows_the_failing_rank_and_still_cleans_up(client: docker.DockerClient, image: str, capsys) -> None:
    assert not run_smoke(image, "pair", timeout_s=120, trainer_args=("--task", "no_such_mod:make"))
    captured = capsys.readouterr()
    assert "c0 failed (exit 2" in captured.err and "train: error: --task 'no_such_mod:make'" in captured.err
    assert "smoke[pair]: no run report (the run wrote no metrics: it ended before its first step)" in captured.out
    assert not client.containers.list(all=True, filters={"label": "io.ddpack.smoke"})


def test_smoke_stops_before_training_when_the_preflight_fails(client: docker.DockerClient, image: str, capsys) -> None:
    assert not run_smoke(image, "pair", timeout_s=120, trainer_args=("--snapshot-dir", "/etc/passwd/snapshots"))
    captured = capsys.readouterr()
    assert "preflight: FAIL storage: cannot write to the snapshot folder /etc/passwd/snapshots (Not a directory" in captured.out
    assert "smoke[pair]: FAIL (the preflight failed; training not started)" in captured.out
    assert "start: rank" not in captured.out
    assert not client.containers.list(all=True, filters={"label": "io.ddpack.smoke"})


def test_smoke_of_a_missing_image_is_one_line(client: docker.DockerClient) -> None:
    with pytest.raises(HostError, match=r"image ddpack:does-not-exist not found; build it first: make image"):
        run_smoke("ddpack:does-not-exist", "pair", timeout_s=10)


def test_the_efa_plugin_is_registered_where_nccls_dlopen_finds_it(client: docker.DockerClient, image: str) -> None:
    """docker/register-ofi-nccl.sh, as Dockerfile.gpu's INSTALL_EFA=1 step runs it, in a Debian image:
    a plugin under lib/x86_64-linux-gnu named libnccl-net-ofi.so (as Debian/Ubuntu installs put it; a
    copy of libz stands in for it) then loads as NCCL loads it, dlopen("libnccl-net.so"); registering its
    folder in ld.so.conf alone would not do that (ld.so.cache files libraries by SONAME). No plugin
    fails the step with one line. (AWS's installer itself cannot be downloaded here.)"""
    script = Path(__file__).resolve().parents[1] / "docker" / "register-ofi-nccl.sh"
    plugin_dir = "/opt/amazon/ofi-nccl/lib/$(uname -m)-linux-gnu"
    shell = (
        f"mkdir -p {plugin_dir} && cp /lib/$(uname -m)-linux-gnu/libz.so.1 {plugin_dir}/libnccl-net-ofi.so && "
        "python -c 'import ctypes; ctypes.CDLL(\"libnccl-net.so\")' 2>/dev/null && echo found-before; "
        "sh /x/register-ofi-nccl.sh && python -c 'import ctypes; ctypes.CDLL(\"libnccl-net.so\"); print(\"dlopen ok\")' && "
        "cat /etc/ld.so.conf.d/ddpack-efa.conf"
    )
    scripts = {str(script.parent): {"bind": "/x", "mode": "ro"}}
    out = client.containers.run(image, ["-c", shell], entrypoint=["sh"], volumes=scripts, remove=True)
    lines = out.decode().splitlines()
    assert "found-before" not in lines and "dlopen ok" in lines, lines
    assert re.fullmatch(r"register-ofi-nccl: /usr/lib/\S+-linux-gnu/libnccl-net.so -> /opt/amazon/ofi-nccl/lib/\S+-linux-gnu/libnccl-net-ofi.so", lines[0])
    assert lines[-2] == "/opt/amazon/efa/lib" and re.fullmatch(r"/opt/amazon/ofi-nccl/lib/\S+-linux-gnu", lines[-1]), lines
    container = client.containers.run(image, ["/x/register-ofi-nccl.sh"], entrypoint=["sh"], volumes=scripts, detach=True)
    try:
        assert container.wait(timeout=60)["StatusCode"] == 1
        assert container.logs().decode().startswith("register-ofi-nccl: no aws-ofi-nccl plugin (libnccl-net*.so) under /opt/amazon/ofi-nccl")
    finally:
        container.remove(force=True)
