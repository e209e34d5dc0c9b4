"""Where a build takes torch and its CA bundle from, tried the way users run it: `python -m ddpack.images.images`
and `make image` in child processes with only the environment (and pip's settings) to go on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpack.errors import HostError
from ddpack.images.build_inputs import PipSettings, TorchWheel, check_wheels_run_on, parse_pip_config_list, resolve_build_inputs
from testbed.env import ROOT, clean_env

CPU_WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
CUDA_WHEEL = "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"
NO_ENGINE = "unix:///tmp/ddpack-no-such.sock"
# Variables through which this machine's own settings could reach the child; each test sets its own.
HOST_SETTINGS = ("WHEELHOUSE", "CA_BUNDLE", "PIP_FIND_LINKS", "PIP_CERT", "SSL_CERT_FILE", "TORCH_VERSION", "BASE_IMAGE")


def wheelhouse(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "wheels"
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


def pem(tmp_path: Path, name: str = "ca.pem") -> Path:
    path = tmp_path / name
    path.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    return path


def user_env(tmp_path: Path, **settings: str) -> dict[str, str]:
    """A user's shell: none of this host's settings, no pip config (os.devnull turns pip's files off)
    unless a test names one, and no engine."""
    env = {k: v for k, v in clean_env().items() if k not in HOST_SETTINGS}
    env.update(PIP_CONFIG_FILE="/dev/null", HOME=str(tmp_path), XDG_CONFIG_HOME=str(tmp_path / "xdg"), DOCKER_HOST=NO_ENGINE)
    env.update(settings)
    return env


def images(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "ddpack.images.images", "--tag", "ddpack:inputs", *args]
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def dry_run(env: dict[str, str], *args: str) -> dict:
    out = images(env, "--dry-run", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def make_image(env: dict[str, str], target: str = "image", *assignments: str) -> subprocess.CompletedProcess[str]:
    """`make image` as the README runs it, engine step skipped (-o) and the build swapped for --dry-run."""
    argv = ["make", "-s", "-o", "engine", target, f"VENV={sys.prefix}", "BUILD_ARGS=--dry-run", *assignments]
    return subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- python -m ddpack.images.images


def test_wheelhouse_and_ca_bundle_from_the_environment_reach_the_build(tmp_path: Path) -> None:
    folder, ca = wheelhouse(tmp_path, CPU_WHEEL, "numpy-2.0.0-cp311-cp311-manylinux_2_28_x86_64.whl"), pem(tmp_path)
    got = dry_run(user_env(tmp_path, WHEELHOUSE=str(folder), CA_BUNDLE=str(ca)))
    assert (got["wheelhouse"], got["wheelhouse_from"], got["torch_wheels"]) == (str(folder), "WHEELHOUSE", [CPU_WHEEL])
    assert (got["ca_bundle"], got["ca_from"]) == (str(ca), "CA_BUNDLE")


def test_defaults_are_pips_find_links_and_cert_from_its_variables(tmp_path: Path) -> None:
    folder, ca = wheelhouse(tmp_path, CPU_WHEEL), pem(tmp_path)
    got = dry_run(user_env(tmp_path, PIP_FIND_LINKS=f"https://example.invalid/simple {folder}", PIP_CERT=str(ca)))
    assert (got["wheelhouse"], got["wheelhouse_from"], got["torch_wheels"]) == (str(folder), "pip find-links", [CPU_WHEEL])
    assert (got["ca_bundle"], got["ca_from"]) == (str(ca), "pip cert")


def test_defaults_from_pips_config_file(tmp_path: Path) -> None:
    folder, ca = wheelhouse(tmp_path, CPU_WHEEL), pem(tmp_path)
    (tmp_path / "pip.conf").write_text(f"[global]\nfind-links = file://{folder}\ncert = {ca}\n")
    got = dry_run(user_env(tmp_path, PIP_CONFIG_FILE=str(tmp_path / "pip.conf")))
    assert (got["wheelhouse"], got["ca_bundle"]) == (str(folder), str(ca))


def test_ssl_cert_file_is_the_last_resort_and_nothing_set_means_the_index(tmp_path: Path) -> None:
    ca = pem(tmp_path)
    got = dry_run(user_env(tmp_path, SSL_CERT_FILE=str(ca)))
    assert (got["wheelhouse"], got["ca_bundle"], got["ca_from"]) == (None, str(ca), "SSL_CERT_FILE")
    got = dry_run(user_env(tmp_path))
    assert (got["wheelhouse"], got["ca_bundle"], got["notes"]) == (None, None, [])


def test_flags_override_the_variables(tmp_path: Path) -> None:
    folder, ca = wheelhouse(tmp_path, CPU_WHEEL), pem(tmp_path, "flag.pem")
    env = user_env(tmp_path, WHEELHOUSE="/nonexistent", CA_BUNDLE="/nonexistent.pem")
    got = dry_run(env, "--wheelhouse", str(folder), "--ca-bundle", str(ca))
    assert (got["wheelhouse"], got["ca_bundle"]) == (str(folder), str(ca))


def test_gpu_build_never_takes_the_cpu_wheel_from_the_default_and_says_so(tmp_path: Path) -> None:
    folder = wheelhouse(tmp_path, CPU_WHEEL)
    got = dry_run(user_env(tmp_path, PIP_FIND_LINKS=str(folder)), "--variant", "gpu")
    assert got["wheelhouse"] is None and got["torch_wheels"] == []
    assert got["notes"] == [f"pip's find-links ({folder}) holds no torch 2.13.0 (not +cpu) wheel; torch comes from the package index"]
    folder = wheelhouse(tmp_path, CUDA_WHEEL)
    assert dry_run(user_env(tmp_path, PIP_FIND_LINKS=str(folder)), "--variant", "gpu")["torch_wheels"] == [CUDA_WHEEL]


@pytest.mark.parametrize(
    ("files", "settings", "args", "message"),
    [
        ((), {"WHEELHOUSE": "/nonexistent/wheels"}, (), "WHEELHOUSE=/nonexistent/wheels is not a directory; point it at a folder of .whl files, or unset it"),
        (
            ("torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",),
            {"WHEELHOUSE": "{wheels}"},
            (),
            "WHEELHOUSE={wheels} holds no torch 2.13.0+cpu wheel for the cpu image (torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl); "
            "add one, set TORCH_VERSION, or unset WHEELHOUSE to use the package index",
        ),
        (
            (CPU_WHEEL,),
            {"WHEELHOUSE": "{wheels}"},
            ("--variant", "gpu"),
            f"WHEELHOUSE={{wheels}} holds no torch 2.13.0 (not +cpu) wheel for the gpu image ({CPU_WHEEL}); "
            "add one, set TORCH_VERSION, or unset WHEELHOUSE to use the package index",
        ),
        (
            (CPU_WHEEL,),
            {"WHEELHOUSE": "{wheels}", "TORCH_VERSION": "2.14.0"},
            (),
            f"WHEELHOUSE={{wheels}} holds no torch 2.14.0+cpu wheel for the cpu image ({CPU_WHEEL}); "
            "add one, set TORCH_VERSION, or unset WHEELHOUSE to use the package index",
        ),
        ((), {"CA_BUNDLE": "/nonexistent/ca.pem"}, (), "CA_BUNDLE=/nonexistent/ca.pem is not a file; point it at a PEM bundle, or unset it"),
    ],
    ids=["missing-folder", "other-torch-version", "gpu-with-cpu-wheel", "torch-version-setting", "missing-ca"],
)
def test_bad_settings_are_one_line_before_anything_is_built(tmp_path: Path, files, settings, args, message) -> None:
    folder = wheelhouse(tmp_path, *files)
    env = user_env(tmp_path, **{k: v.format(wheels=folder) for k, v in settings.items()})
    out = images(env, *args)  # a real build: it must fail on the setting, before it looks for an engine
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"ddpack images: error: {message.format(wheels=folder)}\n"


# ---------------------------------------------------------------- through the Makefile


def test_make_image_passes_what_the_user_set(tmp_path: Path) -> None:
    folder, ca = wheelhouse(tmp_path, CPU_WHEEL), pem(tmp_path)
    out = make_image(user_env(tmp_path), "image", f"WHEELHOUSE={folder}", f"CA_BUNDLE={ca}")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert (got["wheelhouse"], got["ca_bundle"], got["torch_wheels"]) == (str(folder), str(ca), [CPU_WHEEL])


def test_make_image_and_image_gpu_fall_back_to_pips_settings(tmp_path: Path) -> None:
    cpu_folder, ca = wheelhouse(tmp_path, CPU_WHEEL), pem(tmp_path)
    out = make_image(user_env(tmp_path, PIP_FIND_LINKS=str(cpu_folder), PIP_CERT=str(ca)))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert (got["wheelhouse"], got["wheelhouse_from"], got["ca_bundle"]) == (str(cpu_folder), "pip find-links", str(ca))
    out = make_image(user_env(tmp_path, PIP_FIND_LINKS=str(cpu_folder), PIP_CERT=str(ca)), "image-gpu")
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert (got["variant"], got["wheelhouse"], got["ca_bundle"]) == ("gpu", None, str(ca))


def test_make_image_with_a_bad_wheelhouse_fails_with_one_line(tmp_path: Path) -> None:
    out = make_image(user_env(tmp_path), "image", "WHEELHOUSE=/nonexistent/wheels")
    assert out.returncode != 0
    assert "ddpack images: error: WHEELHOUSE=/nonexistent/wheels is not a directory" in out.stderr


# ---------------------------------------------------------------- the rule's pieces


def test_pip_config_list_ranks_the_environment_over_files() -> None:
    text = "global.find-links='/g'\nglobal.cert='/g.pem'\ninstall.find-links='/i /j'\n:env:.cert='/e.pem'\n"
    assert parse_pip_config_list(text) == PipSettings(find_links=("/i", "/j"), cert="/e.pem")
    assert parse_pip_config_list("") == PipSettings()


@pytest.mark.parametrize(
    ("name", "variant", "fits"),
    [
        (CPU_WHEEL, "cpu", True),
        (CPU_WHEEL, "gpu", False),
        (CUDA_WHEEL, "cpu", False),
        (CUDA_WHEEL, "gpu", True),
        ("torch-2.13.0+cu130-cp311-cp311-manylinux_2_28_x86_64.whl", "gpu", True),
        ("torch-2.13.0+cpu-cp311-cp311-win_amd64.whl", "cpu", False),
        ("torch-2.13.1+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "cpu", False),
    ],
)
def test_which_wheels_fit_a_variant(tmp_path: Path, name: str, variant: str, fits: bool) -> None:
    folder = wheelhouse(tmp_path, name)
    inputs_ok = True
    try:
        resolve_build_inputs(variant=variant, torch_version="2.13.0", environ={"WHEELHOUSE": str(folder)}, pip=PipSettings())
    except HostError:
        inputs_ok = False
    assert inputs_ok is fits


def test_a_wheel_for_another_python_or_machine_is_refused_once_the_base_is_known(tmp_path: Path) -> None:
    folder = wheelhouse(tmp_path, "torch-2.13.0+cpu-cp312-cp312-manylinux_2_28_aarch64.whl")
    inputs = resolve_build_inputs(variant="cpu", torch_version="2.13.0", environ={"WHEELHOUSE": str(folder)}, pip=PipSettings())
    with pytest.raises(HostError, match=r"the base py:3\.11 runs cp311 on x86_64: add a matching wheel or choose another BASE_IMAGE") as err:
        check_wheels_run_on(inputs, base="py:3.11", python_tag="cp311", machine="x86_64")
    assert err.value.code == 2
    check_wheels_run_on(inputs, base="py:3.12-arm", python_tag="cp312", machine="aarch64")
    wheel = inputs.torch_wheels[0]
    assert isinstance(wheel, TorchWheel) and wheel.runs_on(python_tag="cp312", machine="aarch64")
