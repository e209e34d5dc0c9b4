"""A user's own framework under ddpack: real PyTorch Lightning and Hugging Face `Trainer` projects
(tests/frameworks/, each a `train.py`) launched as `srun` launches a step's tasks, with faults injected: a
preemption signal that reaches one rank, a rank frozen in its training step, and Lightning with no adapter.
The launcher's supervisor and the adapters' rules on their own come first."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ddp_jobs import Job, start_env_mode, start_slurm_step, subdir, wait_for

from entrypoint.supervise import exit_status
from testbed.env import ROOT, clean_env
from testbed.readme_examples import python_block
from train import run_folder

PROJECTS = ROOT / "tests" / "frameworks"


# ---------------------------------------------------------------- the supervisor's rules


def test_after_a_stop_signal_any_ending_but_done_bad_input_or_hung_is_a_preemption() -> None:
    assert exit_status(0, None, pushed=False) == 0 and exit_status(-9, None, pushed=False) == 137  # no signal: as it ended
    assert exit_status(138, signal.SIGUSR1, pushed=False) == 138  # it stopped itself
    assert exit_status(0, signal.SIGUSR1, pushed=False) == 0  # it finished before it had to stop
    assert exit_status(1, signal.SIGUSR1, pushed=False) == 138  # it crashed on the way out: requeue it all the same
    assert exit_status(124, signal.SIGTERM, pushed=False) == 124  # a hang the watchdog ended is a failure, not a preemption
    # Pushed (SIGTERM on its behalf, or aborted and killed): Lightning's SIGTERMException exits 0 mid-training.
    assert exit_status(0, signal.SIGUSR1, pushed=True) == 138 and exit_status(-9, signal.SIGUSR1, pushed=True) == 138
    assert exit_status(2, signal.SIGUSR1, pushed=True) == 2  # bad input is never retried


def entrypoint(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "entrypoint", *args], env=clean_env(**env), capture_output=True, text=True, timeout=60)


def test_a_bad_stop_grace_is_one_line_and_exit_2() -> None:
    result = entrypoint("--", "true", DDPACK_STOP_GRACE="1m")
    assert result.returncode == 2
    assert result.stderr == "entrypoint: error: DDPACK_STOP_GRACE='1m' is not a number of seconds in (0, 3600]; set it to one or unset it\n"


def test_a_users_command_is_supervised_and_the_bundles_own_are_not() -> None:
    plans = [json.loads(entrypoint("--print-plan", *args).stdout) for args in (["--", "python", "my.py"], [], ["--preflight"])]
    assert [plan["supervised"] for plan in plans] == [True, False, False]


def test_a_program_that_ignores_sigusr1_is_stopped_with_sigterm_and_requeued(tmp_path: Path) -> None:
    """A script with no handler of its own: SIGUSR1 (ignored in the child) becomes SIGTERM, and the step ends 138."""
    script = tmp_path / "loop.py"
    script.write_text(
        "import signal, time\nprint('ignored:', signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN, flush=True)\nwhile True:\n    time.sleep(0.1)\n"
    )
    job = start_slurm_step(tmp_path, [1], ["--", sys.executable, str(script)])
    wait_for(lambda: "ignored: True" in job.output(0), 30, "the script to start with SIGUSR1 ignored")
    job.send(signal.SIGUSR1, [0])
    assert job.wait(60) == [138], job.output()
    assert "entrypoint: SIGUSR1 received; the program has 60 s to stop (DDPACK_STOP_GRACE)" in job.output(0)


def test_a_program_that_will_not_stop_leaves_its_stacks_and_ends_requeueable(tmp_path: Path) -> None:
    """scancel or the time limit (SIGTERM): a program that catches it but is stuck (here in a function of its own)
    is aborted after the grace with every thread's Python stack in the log and the run folder's forensics, then
    killed; the step ends 143."""
    script = tmp_path / "stuck.py"
    script.write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, lambda *_: None)\n"
        "def wait_for_a_peer_that_never_answers():\n    while True:\n        time.sleep(0.1)\n"
        "print('stuck', flush=True)\nwait_for_a_peer_that_never_answers()\n"
    )
    forensics = tmp_path / "forensics"
    job = start_slurm_step(tmp_path, [1], ["--", sys.executable, str(script)], rank_env={0: {"DDPACK_STOP_GRACE": "2", "DDPACK_FORENSICS_DIR": str(forensics)}})
    wait_for(lambda: "stuck" in job.output(0), 30, "the script to start")
    job.send(signal.SIGTERM, [0])
    assert job.wait(60) == [143], job.output()
    out = job.output(0)
    assert "entrypoint: the program did not stop within 2 s of SIGTERM; its threads' stacks follow (SIGABRT)" in out
    assert "Fatal Python error: Aborted" in out and "in wait_for_a_peer_that_never_answers" in out, out
    assert f"entrypoint: the stacks are in {forensics / run_folder.rank_stacks(0)}" in out  # named as the watchdog names them
    saved = (forensics / run_folder.rank_stacks(0)).read_text()
    assert saved.startswith("rank 0 host ") and "did not stop within 2 s of SIGTERM" in saved and "in wait_for_a_peer_that_never_answers" in saved


def test_a_run_of_one_process_stops_on_its_own_signal_and_records_the_segment(tmp_path: Path) -> None:
    """No process group: the signal is this rank's verdict at the next step; the metrics get the segment's start,
    its progress (the first step's) and its end, and the exit is 128+N with the checkpoint named."""
    import os

    import ddpack_run

    metrics = tmp_path / "m.jsonl"
    run = ddpack_run.Run(metrics_file=str(metrics), hang_timeout=0, start_step=40, total_steps=100)
    assert not run.step_done(samples=8, loss=0.5) and run.global_step == 41
    os.kill(os.getpid(), signal.SIGUSR1)
    assert run.step_done(samples=8, loss=0.4) and run.global_step == 42
    with pytest.raises(SystemExit) as stopped:
        run.exit_stopped("ckpt.pt")
    assert stopped.value.code == 138 and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # its handler is gone again
    kinds = [(r["kind"], r.get("global_step"), r.get("outcome")) for r in map(json.loads, metrics.read_text().splitlines())]
    assert kinds == [("start", 40, None), ("progress", 41, None), ("end", 42, "stopped")]
    assert json.loads(metrics.read_text().splitlines()[-1])["snapshot"] == "ckpt.pt"


# A user's own script (no torch, no ddpack, 100 steps of 0.05 s), as the README asks of a program run with
# DDPACK_COMMAND: it notes SIGUSR1 in its handler, saves its step and exits 128+10.
USER_SCRIPT = """
import json, os, signal, sys, time
rank, stop = int(os.environ["RANK"]), []
signal.signal(signal.SIGUSR1, lambda *_: stop.append(1))
state = f"state-{rank}.json"
step = json.load(open(state))["step"] if os.path.exists(state) else 0
print(f"rank {rank} starts at step {step}", flush=True)
while step < 100:
    if stop:
        json.dump({"step": step}, open(state, "w"))
        print(f"rank {rank} saved step {step} on SIGUSR1", flush=True)
        sys.exit(138)
    step += 1
    time.sleep(0.05)
print(f"rank {rank} done at step {step}", flush=True)
"""


@pytest.mark.dist
def test_a_script_with_its_own_sigusr1_handler_gets_the_signal_saves_exits_138_and_resumes(tmp_path: Path) -> None:
    """Slurm's SIGUSR1 reaches every process of the step, the launcher passes it on once more: the script's
    handler runs, it saves and exits 138, which the supervisor keeps; the next start continues from the save."""
    (tmp_path / "user_train.py").write_text(USER_SCRIPT)
    first = start_slurm_step(subdir(tmp_path, "first"), [2], ["--", sys.executable, "user_train.py"], cwd=tmp_path)
    wait_for(lambda: all(" starts at step 0" in first.output(rank) for rank in (0, 1)), 60, "both ranks to start")
    first.send(signal.SIGUSR1, [0, 1])
    assert first.wait(60) == [138, 138], first.output()
    saved = sorted(int(json.loads((tmp_path / f"state-{rank}.json").read_text())["step"]) for rank in (0, 1))
    second = start_slurm_step(subdir(tmp_path, "second"), [2], ["--", sys.executable, "user_train.py"], cwd=tmp_path)
    assert second.wait(60) == [0, 0], second.output()
    assert sorted(int(second.output(r).split(" starts at step ")[1].split()[0]) for r in (0, 1)) == saved and min(saved) > 0
    assert all("done at step 100" in second.output(rank) for rank in (0, 1))


# ---------------------------------------------------------------- real frameworks


def start_project(tmp_path: Path, project: str, run: Path, step: str, **env: str) -> Job:
    """Two ranks of a project's train.py, as the per-task template's step runs them: Slurm's variables as
    Lightning reads them (job name other than `interactive`, --ntasks-per-node), the run folder as the
    working directory, and the template's DDPACK_METRICS_FILE and DDPACK_FORENSICS_DIR."""
    pytest.importorskip("lightning" if project.startswith("lightning") else "transformers")
    run.mkdir(parents=True, exist_ok=True)
    task_env = {
        "SLURM_JOB_NAME": "ddpack",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NODELIST": "127.0.0.1",
        "DDPACK_METRICS_FILE": str(run / "metrics.jsonl"),
        "DDPACK_FORENSICS_DIR": str(run / "forensics"),
        **env,
    }
    script = PROJECTS / project / "train.py"
    return start_slurm_step(subdir(tmp_path, step), [2], ["--", sys.executable, str(script)], cwd=run, rank_env={0: task_env, 1: task_env})


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def progressed(run: Path, count: int) -> bool:
    path = run / "metrics.jsonl"
    return path.exists() and path.read_text().count('"kind": "progress"') >= count


@pytest.mark.dist
def test_a_lightning_run_preempted_on_one_rank_stops_on_all_resumes_and_finishes(tmp_path: Path) -> None:
    """SIGUSR1 to rank 1 alone mid-training: both ranks stop at one step and exit 138 after the framework's own
    checkpoint; a second start (the requeue) resumes from it and finishes with agreeing checksums; the
    metrics file holds both segments and `make report` draws them. The Hugging Face adapter stops through the same
    agreement (ddpack_run.Run's); its preemption, requeue and resume from checkpoint-N are tests/test_pyxis.py's, as is
    a frozen Lightning rank named with its stacks (those local twins cost 56 s of CI and proved nothing more)."""
    run, project = tmp_path / "run", "lightning_project"
    first = start_project(tmp_path, project, run, "first", STEP_SLEEP_S="0.01")
    wait_for(lambda: progressed(run, 3), 120, "training to report progress")
    first.send(signal.SIGUSR1, [1])
    assert first.wait(120) == [138, 138], first.output()
    stops = [first.ends(rank)[-1] for rank in (0, 1)]
    assert [(end.outcome, end.signal) for end in stops] == [("stopped", "SIGUSR1")] * 2, stops
    assert stops[0].global_step == stops[1].global_step and Path(str(stops[0].snapshot)).exists(), stops

    second = start_project(tmp_path, project, run, "second", SLURM_RESTART_COUNT="1")
    assert second.wait(180) == [0, 0], second.output()
    ends = [second.ends(rank)[-1] for rank in (0, 1)]
    assert [end.outcome for end in ends] == ["done", "done"] and ends[0].checksum == ends[1].checksum, ends
    starts = [r for r in records(run) if r["kind"] == "start"]
    assert [s["global_step"] for s in starts] == [0, stops[0].global_step], starts  # resumed where it stopped
    assert ends[0].global_step > stops[0].global_step
    progress = [r for r in records(run) if r["kind"] == "progress"]
    assert all(len(r["rank_step_s"]) == 2 for r in progress) and any(r.get("samples_per_s") for r in progress)

    report = subprocess.run([sys.executable, "-m", "ddpack.jobs.report", str(run)], env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    page = (run / "report.html").read_text()
    assert "<tr><td>segments</td><td>2</td></tr>" in page and "<td>stopped</td>" in page and "<td>done</td>" in page


@pytest.mark.dist
def test_lightning_without_the_adapter_never_deadlocks_past_the_grace_and_is_requeued(tmp_path: Path) -> None:
    """Slurm's SIGUSR1 reaches every rank. Lightning alone would checkpoint inside its handler and call scontrol;
    under the supervisor it installs no SIGUSR1 handler, is told to stop with SIGTERM (whose own handler
    broadcasts inside the handler and may deadlock), and is aborted with its stacks after the grace: either
    way the step ends 138, which the template requeues."""
    run = tmp_path / "run"
    job = start_project(tmp_path, "lightning_project", run, "bare", DDPACK_ADAPTER="0", EPOCHS="50", STEP_SLEEP_S="0.01", DDPACK_STOP_GRACE="15")
    wait_for(lambda: "Initializing distributed" in job.output(1), 120, "training to start")
    job.send(signal.SIGUSR1, [0, 1])
    assert job.wait(120) == [138, 138], job.output()
    out = job.output()
    assert "Handling auto-requeue signal" not in out and "scontrol" not in out
    assert out.count("entrypoint: SIGUSR1 received; the program has 15 s to stop (DDPACK_STOP_GRACE)") == 2


# The README's loop run as written, its steps counted by testbed/held_task.py's Hold around ddpack_run's step_done:
# HOLD_AT's step waits for the test's gate, so the test signals a loop that is still running, however fast the host.
HELD_LOOP = """import runpy
import ddpack_run
from testbed.held_task import Hold

hold, step_done = Hold.from_environment(), ddpack_run.Run.step_done


def held_step_done(self, *args, **kwargs):
    hold.tick()
    return step_done(self, *args, **kwargs)


ddpack_run.Run.step_done = held_step_done
runpy.run_path("myloop.py", run_name="__main__")
"""


@pytest.mark.dist
def test_the_readmes_own_loop_stops_on_one_ranks_signal_resumes_and_finishes(tmp_path: Path) -> None:
    """The README's myloop.py as written: SIGUSR1 to rank 1 stops both at one step (138) after rank 0 saved;
    the second start continues from that step and both finish on the same parameters. Its 2,000 steps take
    seconds, so both ranks are held at step 5 while the signal reaches rank 1 (an idle CI machine once finished
    the loop before the test's signal)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "myloop.py").write_text(python_block("# myloop.py"))
    (run / "held_loop.py").write_text(HELD_LOOP)
    gate = run / "gate"
    env = {"DDPACK_METRICS_FILE": str(run / "metrics.jsonl"), "DDPACK_FORENSICS_DIR": str(run / "forensics"), "HOLD_AT": "5",
           "HOLD_UNTIL": str(gate)}  # fmt: skip
    loop = ["--", sys.executable, "held_loop.py"]
    first = start_slurm_step(subdir(tmp_path, "first"), [2], loop, cwd=run, rank_env={0: env, 1: env})
    wait_for(lambda: all(" held at batch 5 " in first.output(rank) for rank in (0, 1)), 60, "both ranks held at step 5")
    first.send(signal.SIGUSR1, [1])
    wait_for(lambda: "got SIGUSR1 while held" in first.output(1), 60, "the signal to reach rank 1")
    gate.touch()
    assert first.wait(60) == [138, 138], first.output()
    stopped = {end.global_step for end in first.ends()}
    assert len(stopped) == 1 and 5 <= min(stopped) < 2000 and (run / "loop.pt").is_file()
    second = start_slurm_step(subdir(tmp_path, "second"), [2], loop, cwd=run, rank_env={0: env, 1: env})
    assert second.wait(120) == [0, 0], second.output()
    ends = second.ends()
    assert [end.global_step for end in ends] == [2000, 2000] and ends[0].checksum == ends[1].checksum, ends
    assert [r["global_step"] for r in records(run) if r["kind"] == "start"] == [0, *stopped]
    assert [r["global_step"] for r in records(run) if r["kind"] == "eval"] == [500, 1000, 1500, 2000]  # its run.eval_done, once a step


SHAPES = {
    # name: (start the job, the ranks' Lightning environment). torchrun --standalone (`--nproc-per-node` alone) is left
    # out: the frameworks read the same torchrun variables as under Slurm (TorchElasticEnvironment), and the launcher's
    # standalone plan is tests/test_train_dist.py's (22 s of CI for nothing more).
    # torchrun under Slurm with one worker a node: two Lightning+transformers imports where 2 x 2 paid four (35 s).
    "srun-per-task": (lambda tmp, argv: start_slurm_step(tmp, [2], argv, rank_env=dict.fromkeys(range(2), SLURM_TASKS)), "SLURMEnvironment"),
    "torchrun-under-slurm": (
        lambda tmp, argv: start_slurm_step(tmp, [1, 1], argv, nproc_per_node=1, rank_env=dict.fromkeys(range(2), SLURM_NODES)),
        "TorchElasticEnvironment",
    ),
    "docker-env": (lambda tmp, argv: start_env_mode(tmp, 2, argv, env={"NODES": "2", "DEVICES": "1"}), "LightningEnvironment"),
}
SLURM_TASKS = {"SLURM_JOB_NAME": "ddpack", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NODELIST": "127.0.0.1", "NODES": "1", "DEVICES": "2"}
SLURM_NODES = {"SLURM_JOB_NAME": "ddpack", "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_NODELIST": "127.0.0.[1-2]", "NODES": "2", "DEVICES": "1"}


@pytest.mark.dist
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_lightning_and_hugging_face_see_the_ranks_the_launcher_resolved(tmp_path: Path, shape: str) -> None:
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    start, environment = SHAPES[shape]
    job = start(tmp_path, ["--", sys.executable, str(PROJECTS / "who.py")])
    assert job.wait(180) == [0] * len(job.procs), job.output()
    seen = [json.loads(line.split("who ", 1)[1]) for line in job.output().splitlines() if line.startswith("who ")]
    assert sorted(s["env"][0] for s in seen) == list(range(len(seen))) and len(seen) in (2, 4), seen
    for ranks in seen:
        assert ranks["hf"] == ranks["env"] and ranks["lightning"] == ranks["env"], ranks
        assert ranks["lightning_environment"] == environment, ranks


ABORTS_AFTER_ITS_END = """import os, sys
import ddpack_run
run = ddpack_run.Run(start_step=0, total_steps=1, hang_timeout=0)
run.step_done(samples=1)
run.{how}
os.abort()  # what torch's C++ teardown at exit did to a finished rank: "terminate called without an active exception"
"""


@pytest.mark.parametrize(("how", "expected"), [("done()", 0), ("failed('boom', 3)", 3)])
def test_a_program_that_recorded_its_end_then_aborted_on_its_way_out_ends_as_it_recorded(tmp_path: Path, how: str, expected: int) -> None:
    """The supervisor hands the program DDPACK_END_FILE; ddpack_run writes its end there; an abort after it (not one
    the supervisor sent) ends the step with the recorded status. A program that recorded nothing keeps its 134."""
    from entrypoint.supervise import supervise

    env = clean_env(DDPACK_METRICS_FILE=str(tmp_path / "metrics.jsonl"))
    program = tmp_path / "program.py"
    program.write_text(ABORTS_AFTER_ITS_END.format(how=how))
    assert supervise([sys.executable, str(program)], env, grace_s=10) == expected
    program.write_text("import os\nos.abort()\n")
    assert supervise([sys.executable, str(program)], env, grace_s=10) == 134


# ---------------------------------------------------------------- results from any program: eval records


def eval_records(metrics: Path) -> list[dict]:
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if r["kind"] == "eval"]


def test_an_own_loops_eval_done_writes_its_numbers_at_its_step_and_leaves_out_what_is_not_one(tmp_path: Path) -> None:
    import ddpack_run

    metrics = tmp_path / "m.jsonl"
    run = ddpack_run.Run(metrics_file=str(metrics), hang_timeout=0)
    for _ in range(3):
        run.step_done(loss=1.0)
    torch = pytest.importorskip("torch")
    kept = run.eval_done(loss=torch.tensor(0.25), accuracy=0.75, tokens=1000, note="text", flag=True, nan=float("nan"))
    run.eval_done(loss=0.125, step=10)
    assert kept == {"loss": 0.25, "accuracy": 0.75, "tokens": 1000}
    assert [{k: v for k, v in r.items() if k not in ("kind", "time")} for r in eval_records(metrics)] == [
        {"global_step": 3, "loss": 0.25, "accuracy": 0.75, "tokens": 1000},
        {"global_step": 10, "loss": 0.125},
    ]


LIGHTNING_WITH_VALIDATION = """
import lightning as L, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from ddpack_run.lightning import DdpackCallback

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]))
        self.log("val_mae", (self.net(batch[0]) - batch[1]).abs().mean())
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

torch.manual_seed(0)
x = torch.randn(64, 4)
data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)
trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, callbacks=[DdpackCallback(hang_timeout=0)])
trainer.fit(Regression(), data, data)
"""

HF_WITH_EVALUATION = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from ddpack_run.hf import DdpackCallback

class Tokens(torch.utils.data.Dataset):
    def __init__(self, count):
        self.data = torch.randint(0, 64, (count, 8), generator=torch.Generator().manual_seed(0))
    def __len__(self):
        return len(self.data)
    def __getitem__(self, index):
        return {"input_ids": self.data[index], "labels": self.data[index]}

model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=1, n_head=2))
args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, max_steps=4, eval_strategy="steps", eval_steps=2,
                         save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True)
Trainer(model=model, args=args, train_dataset=Tokens(32), eval_dataset=Tokens(16), callbacks=[DdpackCallback(hang_timeout=0)]).train()
"""


@pytest.mark.dist
@pytest.mark.parametrize(("framework", "program", "steps", "names"), [
    ("lightning", LIGHTNING_WITH_VALIDATION, [4, 8], {"val_loss", "val_mae", "epoch"}),
    ("transformers", HF_WITH_EVALUATION, [2, 4], {"eval_loss", "eval_runtime", "epoch"}),
])  # fmt: skip
def test_a_frameworks_own_validation_metrics_are_eval_records_with_no_user_code(
    tmp_path: Path, framework: str, program: str, steps: list[int], names: set[str]
) -> None:
    """The adapters alone (DdpackCallback, no eval_done in the program): each validation's own numbers, at its step;
    Lightning's sanity check (two batches before training) is no result and writes none."""
    pytest.importorskip(framework)
    (tmp_path / "program.py").write_text(program)
    metrics = tmp_path / "metrics.jsonl"
    done = subprocess.run([sys.executable, "program.py"], cwd=tmp_path, env=clean_env(DDPACK_METRICS_FILE=str(metrics)),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    evals = eval_records(metrics)
    assert [r["global_step"] for r in evals] == steps, evals
    assert all(names <= set(r) and all(isinstance(r[n], int | float) for n in names) for r in evals), evals
