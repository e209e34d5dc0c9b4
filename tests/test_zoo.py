"""Users' own models (tests/plugins/zoo.py) under the trainer's promises, on two gloo ranks as a user
runs them (`--task plugins.zoo:NAME` from the project folder): ranks end with identical parameters
and buffers, and a model with state beyond its parameters (BatchNorm statistics, dropout, random
augmentation in DataLoader workers) stopped mid-epoch resumes bit for bit."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from ddp_jobs import reference_checksum, run_train, start_slurm_step, stopped_mid_epoch_then_resumed

from testbed.readme_examples import write_mytask
from train.config import parse_config

PROJECT = Path(__file__).resolve().parent  # the user's project folder: `--task plugins.zoo:...` imports from here

# Epochs of 60-120 steps, so that a signal after step 10-20 lands mid-epoch.
CNN = ["--task", "plugins.zoo:cnn", "--dataset-size", "2048", "--batch-size", "8", "--epochs", "2"]
GPT = ["--task", "plugins.zoo:gpt", "--batch-size", "8", "--epochs", "2", "--amp", "--grad-accum", "2", "--clip-grad-norm", "1.0"]
FILES = ["--task", "plugins.zoo:image_files", "--batch-size", "8", "--epochs", "2", "--num-workers", "2"]


@pytest.mark.dist
@pytest.mark.parametrize(
    ("args", "after_step"),
    [pytest.param(CNN, 20, id="cnn-batchnorm"), pytest.param(GPT, 10, id="gpt-dropout-amp-accum-clip")],
)
def test_a_model_with_state_beyond_parameters_agrees_and_resumes_bit_exact(tmp_path: Path, args: list[str], after_step: int) -> None:
    # The uninterrupted run: both ranks end with the same parameters and buffers (BatchNorm's running
    # statistics differed between ranks before the trainer broadcast rank 0's after the last forward).
    expected = reference_checksum(tmp_path, args, cwd=PROJECT)
    _, resumed = stopped_mid_epoch_then_resumed(tmp_path, args, after_step=after_step, cwd=PROJECT)
    assert set(resumed.checksums()) == {expected}


@pytest.mark.dist
def test_files_with_random_augmentation_through_workers_resume_bit_exact(tmp_path: Path) -> None:
    from plugins.zoo import write_image_files

    data = tmp_path / "images"
    write_image_files(data, size=768)
    env = {"ZOO_DATA_DIR": str(data)}
    expected = reference_checksum(tmp_path, FILES, cwd=PROJECT, env=env)
    _, resumed = stopped_mid_epoch_then_resumed(tmp_path, FILES, after_step=10, cwd=PROJECT, env=env)
    assert set(resumed.checksums()) == {expected}


@pytest.mark.dist
def test_gpt_progress_shows_the_gradient_norm(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    job = start_slurm_step(tmp_path, [2], [*GPT, "--max-steps", "6", "--log-every", "3", "--snapshot-dir", "", "--metrics-file", str(metrics)], cwd=PROJECT)
    assert job.wait() == [0, 0], job.output()
    assert "grad_norm " in job.output(0)
    norms = [line for line in metrics.read_text().splitlines() if '"progress"' in line and '"grad_norm"' in line]
    assert len(norms) == 2, metrics.read_text()


@pytest.mark.dist
def test_frozen_layers_stay_as_they_were_and_ranks_agree(tmp_path: Path) -> None:
    args = ["--task", "plugins.zoo:frozen", "--epochs", "2"]
    reference_checksum(tmp_path, args, cwd=PROJECT)
    (snapshot,) = sorted((tmp_path / "reference" / "snap").glob("snapshot-*.pt"))[-1:]
    trained = torch.load(snapshot, weights_only=True)["model"]
    from plugins.zoo import frozen

    initial = frozen(parse_config(args)).model.state_dict()
    assert torch.equal(trained["0.weight"], initial["0.weight"]) and torch.equal(trained["0.bias"], initial["0.bias"])
    assert not torch.equal(trained["2.weight"], initial["2.weight"])


@pytest.mark.dist
def test_an_unused_head_trains_with_find_unused_parameters(tmp_path: Path) -> None:
    reference_checksum(tmp_path, ["--task", "plugins.zoo:two_heads", "--epochs", "1", "--find-unused-parameters"], cwd=PROJECT)


@pytest.mark.dist
def test_an_unused_head_without_the_flag_is_one_line_naming_it(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    args = ["--task", "plugins.zoo:two_heads", "--epochs", "1", "--snapshot-dir", str(tmp_path / "snap"), "--metrics-file", str(metrics)]
    job = start_slurm_step(tmp_path, [2], args, cwd=PROJECT)
    assert job.wait() == [2, 2], job.output()
    errors = [line for line in job.output().splitlines() if "error" in line.lower()]
    assert errors == [
        "train: error: the model has parameters that forward did not use (auxiliary.weight, auxiliary.bias); pass --find-unused-parameters"
    ], job.output()
    assert "Traceback" not in job.output()
    assert not metrics.exists() and not (tmp_path / "snap").exists()


def test_the_readme_task_trains_as_its_first_command_shows(tmp_path: Path) -> None:
    """README: `python -m train --task mytask:make --epochs 2`, run from the folder that holds mytask.py."""
    write_mytask(tmp_path)
    result = run_train("--task", "mytask:make", "--epochs", "2", "--snapshot-dir", "", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = [float(line.rsplit(" ", 1)[1]) for line in result.stdout.splitlines() if "done: eval_accuracy" in line]
    assert len(accuracy) == 2 and accuracy[-1] > 0.8, result.stdout


@pytest.mark.dist
def test_a_task_in_the_project_folder_is_found_from_a_run_folder(tmp_path: Path) -> None:
    """As the templates run it: the working directory is the run folder; DDPACK_PROJECT_DIR names the
    submission folder that holds the user's module."""
    write_mytask(tmp_path)
    run_dir = tmp_path / "runs" / "job-1"
    run_dir.mkdir(parents=True)
    job = start_slurm_step(run_dir, [2], ["--task", "mytask:make", "--epochs", "1", "--snapshot-dir", ""], cwd=run_dir,
                           rank_env={rank: {"DDPACK_PROJECT_DIR": str(tmp_path)} for rank in range(2)})  # fmt: skip
    assert job.wait() == [0, 0], job.output()
    assert "task my-cnn" in job.output() and len(set(job.checksums())) == 1


# ---------------------------------------------------------------- torch.compile


@pytest.mark.dist
def test_compile_stops_snapshots_and_resumes_bit_exact(tmp_path: Path) -> None:
    """Inductor compiles each rank's model (CPU: C++ through g++); snapshots hold the user's module's
    own names, so a compiled run resumes as an eager one does. Half the eager test's data (64 steps an epoch, the stop
    near step 21): compiling is the cost, not the steps, and the stop still lands mid-epoch."""
    args = [*CNN, "--dataset-size", "1024", "--compile"]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # one cache for the three runs, as on a node
    expected = reference_checksum(tmp_path, args, cwd=PROJECT, env=env)
    _, resumed = stopped_mid_epoch_then_resumed(tmp_path, args, after_step=20, cwd=PROJECT, env=env)
    assert set(resumed.checksums()) == {expected}


def run_writing(tmp: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """One process that would write its snapshots and metrics under `tmp`."""
    return run_train(*args, "--snapshot-dir", str(tmp / "snap"), "--metrics-file", str(tmp / "m.jsonl"), cwd=PROJECT, **env)


def assert_refused(result: subprocess.CompletedProcess[str], tmp: Path, message: str) -> None:
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(errors) == 1 and message in errors[0], result.stdout + result.stderr
    assert not (tmp / "snap").exists() and not (tmp / "m.jsonl").exists()


def test_compile_without_a_compiler_is_one_line_before_training(tmp_path: Path) -> None:
    result = run_writing(tmp_path, "--task", "plugins.zoo:cnn", "--compile", CXX=str(tmp_path / "no-such-g++"))
    assert_refused(result, tmp_path, "train: error: --compile needs a C++ compiler on CPU and found none")


def test_a_model_torch_cannot_compile_is_one_line_at_the_first_step(tmp_path: Path) -> None:
    """A compiler that answers --version but fails every compilation: inductor fails at the first
    step, as it does on a model it cannot build."""
    broken = tmp_path / "g++"
    broken.write_text('#!/bin/sh\n[ "$1" = --version ] && exec g++ --version\necho "cc1plus: internal compiler error" >&2\nexit 1\n')
    broken.chmod(0o755)
    result = run_writing(tmp_path, "--task", "plugins.zoo:cnn", "--compile", CXX=str(broken), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    assert_refused(result, tmp_path, "train: error: --compile: torch cannot compile this model (InductorError")


def test_sync_batchnorm_on_cpu_is_one_line(tmp_path: Path) -> None:
    result = run_writing(tmp_path, "--task", "plugins.zoo:cnn", "--sync-batchnorm")
    assert_refused(result, tmp_path, "train: error: --sync-batchnorm needs CUDA devices")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--clip-grad-norm", "-1"], "python -m train: error: argument --clip-grad-norm: '-1' is not > 0; see --help"),
        (["--optimizer", "lamb"], "python -m train: error: argument --optimizer: invalid choice: 'lamb'"),
    ],
)
def test_a_bad_flag_value_is_one_line(tmp_path: Path, flags: list[str], message: str) -> None:
    assert_refused(run_writing(tmp_path, *flags), tmp_path, message)


def test_sync_batchnorm_converts_on_cuda_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The conversion itself, without a GPU: prepare_module on a CUDA device converts every BatchNorm
    (moving to the device is stubbed; the GPU tier runs it for real)."""
    from plugins.zoo import small_cnn

    from train.model import prepare_module

    monkeypatch.setattr(torch.nn.Module, "to", lambda self, *a, **k: self)
    module = prepare_module(small_cnn(), parse_config(["--sync-batchnorm"]), torch.device("cuda", 0))
    kinds = [type(m).__name__ for m in module.modules() if "BatchNorm" in type(m).__name__]
    assert kinds == ["SyncBatchNorm", "SyncBatchNorm"]
