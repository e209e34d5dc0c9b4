"""A user's project in the image, without Docker: reading the project (`ddpack.images.app`), the build's bad
input (one line, exit 2, before anything is built), explaining pip's torch conflicts (docker/install-app.py),
and how `entrypoint` finds the project's command and scripts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest

from ddpack.errors import HostError
from ddpack.images.app import check_torch_requirements, left_out_note, read_app, stage_app
from entrypoint.cli import parse_args
from entrypoint.plan import PlanError, from_app_dir, trainer_command
from testbed.env import ROOT, clean_env
from testbed.readme_examples import write_cpu_ddp


def load_installer():
    spec = importlib.util.spec_from_file_location("install_app", ROOT / "docker" / "install-app.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------- reading the project


def test_the_readme_project_is_read_with_its_requirements_code_and_command(tmp_path: Path) -> None:
    app = read_app(write_cpu_ddp(tmp_path / "cpu-ddp"), "python ddp.py 4 2")
    assert app.name == "cpu-ddp" and app.requirements == ("tqdm",) and app.requirements_from == "requirements.txt"
    assert app.files == (PurePosixPath("ddp.py"), PurePosixPath("requirements.txt"))
    assert app.command == ("python", "ddp.py", "4", "2") and app.revision == ""  # not a git repository
    assert len(app.digest) == 12


def test_what_stays_out_of_the_code_layer(tmp_path: Path) -> None:
    project = write_cpu_ddp(tmp_path / "proj")
    for name in (".git/HEAD", "pkg/__pycache__/m.cpython-311.pyc", ".venv/bin/python", "runs/ddpack-1/snapshots/s.pt", "logs/a.out",
                 "data/big.bin", "pkg/model.py", "pkg/runs/keep.py", "notes.tmp"):  # fmt: skip
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("x")
    (project / ".dockerignore").write_text("# data stays on /fsx\ndata/\n*.tmp\n!keep.tmp\n")
    files = {f.as_posix() for f in read_app(project).files}
    # runs/ and logs/ only at the top: a package's own `runs` module folder goes in
    assert files == {"ddp.py", "requirements.txt", "pkg/model.py", "pkg/runs/keep.py"}


def test_likely_secrets_beside_the_code_stay_out_of_the_image_unless_asked_for_by_name(tmp_path: Path) -> None:
    """A git-ignored .env, keys, .netrc, .aws/ and .ssh/ are not code: left out of the code layer (and its digest) and
    named in one line; a `!NAME` line in the project's .dockerignore ships one on purpose."""
    project = write_cpu_ddp(tmp_path / "proj")
    for name in (".env", ".env.local", "certs/server.pem", "tls.key", ".netrc", ".aws/credentials", ".ssh/id_ed25519", "pkg/ca.pem"):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("SECRET=hunter2\n")
    (project / "envs.py").write_text("NAMES = ()\n")  # a name like a secret's is not one
    app = read_app(project)
    assert {f.as_posix() for f in app.files} == {"ddp.py", "requirements.txt", "envs.py"}
    assert [p.as_posix() for p in app.left_out] == [".aws", ".env", ".env.local", ".netrc", ".ssh", "certs/server.pem", "pkg/ca.pem", "tls.key"]
    assert left_out_note(app) == (
        "images: left out of the image as likely secrets: .aws/, .env, .env.local, .netrc, .ssh/, certs/server.pem, pkg/ca.pem, tls.key; "
        f"to ship one on purpose, add a line !NAME (e.g. !.aws) to {project / '.dockerignore'}"
    )
    context = tmp_path / "context"
    stage_app(app, context)
    assert "hunter2" not in "".join(p.read_text() for p in (context / "app").rglob("*") if p.is_file())
    (project / ".dockerignore").write_text("!certs/server.pem\n!.aws\n")
    wanted = read_app(project)
    assert {"certs/server.pem", ".aws/credentials"} <= {f.as_posix() for f in wanted.files} and ".env" not in {f.as_posix() for f in wanted.files}
    assert [p.as_posix() for p in wanted.left_out] == [".env", ".env.local", ".netrc", ".ssh", "pkg/ca.pem", "tls.key"]
    assert left_out_note(read_app(write_cpu_ddp(tmp_path / "clean"))) is None


def test_the_token_files_of_cloud_and_hub_tools_stay_out_of_the_image_and_their_folders_other_files_do_not(tmp_path: Path) -> None:
    """A home folder copied into a project brings its tools' tokens: gcloud's, Azure's, Hugging Face's (the cache's
    token and stored_tokens, the older ~/.huggingface/), Docker's and Kubernetes' configs, git's credentials, direnv's
    .envrc and a credentials.json, at any depth; left out and named like the rest. The rest of a .cache/huggingface/
    (models) or a .config/ is not a secret, nor a module named like one."""
    project = write_cpu_ddp(tmp_path / "proj")
    tokens = (".envrc", "credentials.json", "conf/credentials.json", ".huggingface/token", ".cache/huggingface/token",
              ".cache/huggingface/stored_tokens", ".config/gcloud/application_default_credentials.json", ".azure/msal_token_cache.json",
              ".git-credentials", ".docker/config.json", ".kube/config", "home/.config/gcloud/credentials.db")  # fmt: skip
    for name in tokens:
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("hf_hunter2\n")
    for kept in ("credentials.py", ".cache/huggingface/hub/config.json", ".config/app.yaml"):
        (project / kept).parent.mkdir(parents=True, exist_ok=True)
        (project / kept).write_text("x = 1\n")
    app = read_app(project)
    assert {f.as_posix() for f in app.files} == {
        "ddp.py", "requirements.txt", "credentials.py", ".cache/huggingface/hub/config.json", ".config/app.yaml",
    }  # fmt: skip
    assert [p.as_posix() for p in app.left_out] == [
        ".azure", ".cache/huggingface/stored_tokens", ".cache/huggingface/token", ".config/gcloud", ".docker", ".envrc", ".git-credentials",
        ".huggingface", ".kube", "conf/credentials.json", "credentials.json", "home/.config/gcloud",
    ]  # fmt: skip
    stage_app(app, tmp_path / "context")
    assert "hf_hunter2" not in "".join(p.read_text() for p in (tmp_path / "context" / "app").rglob("*") if p.is_file())
    (project / ".dockerignore").write_text("!.cache/huggingface/token\n")  # shipped on purpose, by name
    assert ".cache/huggingface/token" in {f.as_posix() for f in read_app(project).files}


def test_the_digest_follows_code_and_requirements(tmp_path: Path) -> None:
    project = write_cpu_ddp(tmp_path / "proj")
    first = read_app(project).digest
    (project / "ddp.py").write_text((project / "ddp.py").read_text() + "# changed\n")
    second = read_app(project).digest
    (project / "requirements.txt").write_text("tqdm==4.66.5\n")
    assert len({first, second, read_app(project).digest}) == 3


def test_git_revision_and_dirty_state_are_recorded(tmp_path: Path) -> None:
    project = write_cpu_ddp(tmp_path / "proj")
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "first"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert read_app(project).revision == head
    (project / "ddp.py").write_text("# edited\n")
    assert read_app(project).revision == f"{head}-dirty"


def test_pyproject_dependencies_and_requirement_includes(tmp_path: Path) -> None:
    pyproject = tmp_path / "pp"
    (pyproject / "src" / "mypkg").mkdir(parents=True)
    (pyproject / "src" / "mypkg" / "__init__.py").write_text("")
    (pyproject / "pyproject.toml").write_text('[project]\nname = "mypkg"\ndependencies = ["tqdm>=4", "pyyaml"]\n')
    app = read_app(pyproject)
    assert app.requirements == ("tqdm>=4", "pyyaml") and app.requirements_from == "pyproject.toml"
    included = tmp_path / "inc"
    (included / "reqs").mkdir(parents=True)
    (included / "requirements.txt").write_text("-r reqs/base.txt\n--constraint=reqs/pins.txt\nrich  # pretty logs\n")
    (included / "reqs" / "base.txt").write_text("# base\ntqdm\n")
    (included / "reqs" / "pins.txt").write_text("tqdm==4.66.5\n")
    assert read_app(included).requirements == ("tqdm", "-c tqdm==4.66.5", "rich")


def test_staging_puts_requirements_and_code_apart(tmp_path: Path) -> None:
    app = read_app(write_cpu_ddp(tmp_path / "proj"))
    stage_app(app, tmp_path / "ctx")
    assert (tmp_path / "ctx" / "app-deps" / "requirements.txt").read_text() == "tqdm\n"
    assert sorted(p.name for p in (tmp_path / "ctx" / "app").iterdir()) == ["ddp.py", "requirements.txt"]
    assert (tmp_path / "ctx" / "app" / "ddp.py").stat().st_mode & 0o444 == 0o444


# ---------------------------------------------------------------------------- bad input: one line, exit 2, nothing built


def images_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "ddpack.images.images", "--tag", "ddpack-badapp:never", *args]
    return subprocess.run(argv, cwd=ROOT, env=clean_env(**env), capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("missing", "APP={p} is not a folder; point APP at your project"),
        ("empty", "APP={p} has neither a requirements file (requirements.txt, or dependencies in pyproject.toml) nor Python code"),
        ("binary-requirements", "APP's requirements file {p}/requirements.txt cannot be read ("),
        ("requirements-folder", "APP's requirements file {p}/requirements.txt cannot be read (Is a directory)"),
        ("local-path", "requirements.txt line 2: '-e ./vendor/lib' is a local path, which the image build cannot reach"),
        ("torch-pin", "APP's requirements.txt asks for 'torch==2.12.0', but the image's torch is 2.13.0+cpu"),
        ("missing-script", "APP_CMD='python train.py' runs train.py, which APP={p} does not have"),
    ],
)
def test_bad_projects_are_one_line_and_exit_2_before_any_build(tmp_path: Path, layout: str, message: str) -> None:
    project = tmp_path / "proj"
    if layout != "missing":
        project.mkdir()
    if layout == "empty":
        (project / "README.md").write_text("no code here")
    elif layout == "binary-requirements":
        (project / "requirements.txt").write_bytes(b"\xff\xfe\x00torch")
    elif layout == "requirements-folder":
        (project / "requirements.txt").mkdir()
    elif layout in ("local-path", "torch-pin", "missing-script"):
        write_cpu_ddp(project)
        extra = {"local-path": "-e ./vendor/lib", "torch-pin": "torch==2.12.0"}.get(layout, "")
        (project / "requirements.txt").write_text(f"tqdm\n{extra}\n")
    out = images_cli("--app", str(project), "--app-cmd", "python train.py" if layout == "missing-script" else "", TORCH_VERSION="2.13.0")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddpack images: error: "), out.stderr
    assert message.format(p=project) in lines[0]
    assert "building" not in out.stdout  # nothing was built, so nothing was tagged


def test_app_cmd_without_app_is_one_line() -> None:
    out = images_cli("--app-cmd", "python train.py")
    assert out.returncode == 2 and out.stderr.strip() == "ddpack images: error: APP_CMD is the command of an APP; set APP to the project folder too"


def test_the_host_check_passes_a_torch_requirement_the_image_satisfies(tmp_path: Path) -> None:
    project = write_cpu_ddp(tmp_path / "proj")
    (project / "requirements.txt").write_text("torch>=2.3\ntorch==2.13.0\nnvidia-nccl-cu13\n")
    check_torch_requirements(read_app(project), "2.13.0+cpu")
    with pytest.raises(HostError, match=r"asks for 'torch<2.13', but the image's torch is 2.13.0"):
        (project / "requirements.txt").write_text("torch<2.13\n")
        check_torch_requirements(read_app(project), "2.13.0")


def test_make_image_with_app_names_the_image_after_the_folder_and_builds_it_on_the_bundle(tmp_path: Path) -> None:
    project = write_cpu_ddp(tmp_path / "My_Proj")
    out = subprocess.run(
        ["make", "-n", "image", "sqsh", "push", f"APP={project}", "APP_CMD=python ddp.py --name 'a b'", "TAG=t1"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert f"--tag my_proj:t1 --version t1 --app '{project}' --app-cmd \"$APP_CMD\" --bundle-tag ddpack:t1" in out.stdout
    assert "--image my_proj:t1 --output build/my_proj+t1.sqsh" in out.stdout and "--repository my_proj --tag t1" in out.stdout


# ---------------------------------------------------------------------------- pip's conflicts, explained in one line

HELD = {"torch": "2.13.0+cpu"}


def test_a_dependency_that_wants_another_torch_is_named_with_what_it_wanted() -> None:
    pip_output = """ERROR: Cannot install -r /tmp/app-deps/requirements.txt (line 1) because these package versions have conflicting dependencies.

The conflict is caused by:
    The user requested (constraint) torch==2.13.0+cpu
    needs-old-torch 1.0 depends on torch==2.1.0

To fix this you could try to:
1. loosen the range of package versions you've specified
"""
    line = load_installer().explain_conflict(pip_output, HELD)
    assert line == (
        "the app's requirements want another torch than the image's 2.13.0+cpu: needs-old-torch 1.0 depends on torch==2.1.0; "
        "pin a version made for torch 2.13.0, or drop the requirement (the image provides torch)"
    )


def test_a_direct_torch_request_is_named_and_other_conflicts_keep_pips_message() -> None:
    installer = load_installer()
    direct = "The conflict is caused by:\n    The user requested torch>=2.14\n    The user requested (constraint) torch==2.13.0+cpu\n\n"
    assert "the requirements file asks for torch>=2.14;" in installer.explain_conflict(direct, HELD)
    other = "The conflict is caused by:\n    The user requested requests==2.0\n    foo 1.0 depends on requests>=2.30\n\n"
    assert installer.explain_conflict(other, HELD) is None


# ---------------------------------------------------------------------------- entrypoint: the project's command and scripts


def test_no_command_runs_the_projects_command_else_the_trainer() -> None:
    env = {"DDPACK_APP_CMD": "python ddp.py 4 2", "DDPACK_APP_DIR": "/nonexistent-app"}
    assert parse_args([], env)[0].command == ("python", "ddp.py", "4", "2")
    assert parse_args([], {})[0].command == trainer_command()
    # leading flags stay the bundled trainer's, with or without a project
    assert parse_args(["--epochs", "3"], env)[0].command == (*trainer_command(), "--epochs", "3")
    assert parse_args(["--nproc-per-node", "2"], env)[0].command == ("python", "ddp.py", "4", "2")
    with pytest.raises(PlanError, match="DDPACK_APP_CMD=\"python 'unclosed\" is not a command line"):
        parse_args([], {"DDPACK_APP_CMD": "python 'unclosed"})


def test_a_projects_relative_script_is_found_from_any_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = tmp_path / "app"
    (app / "tools").mkdir(parents=True)
    for name in ("ddp.py", "run.sh", "tools/prep.py"):
        (app / name).write_text("")
    work = tmp_path / "run-folder"
    work.mkdir()
    (work / "local.py").write_text("")
    monkeypatch.chdir(work)
    assert from_app_dir(["python", "-u", "ddp.py", "4"], str(app)) == ("python", "-u", f"{app}/ddp.py", "4")
    assert from_app_dir(["python3", "-X", "dev", "tools/prep.py"], str(app)) == ("python3", "-X", "dev", f"{app}/tools/prep.py")
    assert from_app_dir(["./run.sh", "ddp.py"], str(app)) == (f"{app}/run.sh", "ddp.py")  # only the program and a python script
    assert from_app_dir(["python", "local.py"], str(app)) == ("python", "local.py")  # the working directory's own wins
    assert from_app_dir(["python", "-m", "ddp"], str(app)) == ("python", "-m", "ddp")
    assert from_app_dir(["python", "ddp.py"], None) == ("python", "ddp.py")  # no project: nothing changes
