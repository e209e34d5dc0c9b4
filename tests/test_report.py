"""Seeing a run: per-rank step times, MFU, TensorBoard scalars and `make report`'s page and image."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from ddp_jobs import metrics_step, start_slurm_step, subdir, wait_for
from torch import nn

from testbed.env import ROOT, clean_env
from train.config import parse_config
from train.metrics import MetricsFile, format_share
from train.perf import RankTimes, SlowRanks, count_flops_per_sample, mfu, preflight_peak, table_peak

USER_DIR = Path(__file__).resolve().parent

# ---------------------------------------------------------------- FLOPs, peaks, MFU (by hand)


def mlp_flops_by_hand(inputs: int, hidden: int, outputs: int) -> int:
    """Linear(in, h) -> Linear(h, out), a sample: forward 2*in*h + 2*h*out; backward, the second layer's
    input and weight gradients (2*h*out each) and the first layer's weight gradient (2*in*h: its input
    needs none). Bias adds, activations and BatchNorm are not matmul work and are not counted."""
    return 2 * inputs * hidden * 2 + 2 * hidden * outputs * 3


def test_flops_per_sample_match_a_hand_count_and_leave_the_model_and_rng_as_they_were() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.5), nn.Linear(64, 1))
    x = torch.randn(32, 20)
    running = model[1].running_mean.clone()
    torch.manual_seed(7)
    flops = count_flops_per_sample(model, (x, x.sum(1, keepdim=True)), nn.MSELoss(), nullcontext)
    after = torch.rand(3)
    torch.manual_seed(7)
    assert flops == mlp_flops_by_hand(20, 64, 1) == 5504
    assert torch.equal(after, torch.rand(3)), "dropout drew random numbers: the run's RNG moved"
    assert torch.equal(model[1].running_mean, running), "BatchNorm's running statistics moved"
    assert model.training and all(p.grad is None for p in model.parameters())
    # 1,000 samples/s of 5,504 FLOPs on 2 devices of 1 GFLOP/s peak each use 0.2752% of them.
    assert mfu(1000, flops, 1e9, 2) == pytest.approx(1000 * 5504 / 2e9)
    assert [format_share(x) for x in (0.002752, 0.452, 2.31e-6)] == ["0.28%", "45.20%", "0.00023%"]


@pytest.mark.parametrize(
    ("name", "precision", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "tf32", 494.7),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L4", "bf16", 121.0),
        ("Tesla V100-SXM2-16GB", "bf16", None),
        ("Some Future GPU", "bf16", None),
    ],
)
def test_gpu_peaks_come_from_the_table_by_name_and_precision(name: str, precision: str, tflops: float | None) -> None:
    peak = table_peak(name, precision)
    assert (peak.flops_per_s / 1e12 if peak else None) == (pytest.approx(tflops) if tflops else None)


def test_a_preflight_peak_is_the_median_rank_in_the_precision_it_measured(tmp_path: Path) -> None:
    path = tmp_path / "preflight.json"
    path.write_text(json.dumps({"backend": "gloo", "compute": [{"rank": r, "host": "a", "gflops": g} for r, g in enumerate((10, 30, 20))]}))
    assert preflight_peak(path, "fp32").flops_per_s == 20e9
    assert preflight_peak(path, "bf16") is None  # a CPU preflight measures fp32
    path.write_text('{"backend": "gloo", "comp')
    assert preflight_peak(path, "fp32") is None
    assert preflight_peak(tmp_path / "none.json", "fp32") is None


def test_the_slow_rank_is_named_only_when_clearly_slower() -> None:
    # Slots per rank: window seconds, data wait, sync wait, summed over 10 steps.
    times = RankTimes.from_sums([0.3, 0.0, 0.2, 0.3, 0.0, 0.2, 0.3, 0.25, 0.0], 10)
    assert times.busy_s == pytest.approx([0.01, 0.01, 0.03])
    assert times.slowest(["a", "b", "c"]) == "slow rank 2 (c) busy 30.0 ms/step, 25.0 of it waiting for data against a median of 10.0"
    assert RankTimes.from_sums([0.3, 0.0, 0.2, 0.3, 0.0, 0.19], 10).slowest(["a", "b"]) is None
    assert RankTimes.slots(1, 3, 1.0, 2.0, 3.0) == [0, 0, 0, 1.0, 2.0, 3.0, 0, 0, 0]


def test_tensorboard_without_the_package_is_one_line_and_exit_2(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--tensorboard", "tb"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs the tensorboard package" in err and "requirements.txt" in err


def test_a_segments_start_record_is_written_before_the_first_record_with_what_is_known_by_then(tmp_path: Path) -> None:
    known = {"flops_per_sample": None}
    refused = MetricsFile(str(tmp_path / "refused.jsonl"))
    refused.opening("start", lambda: dict(known))
    refused.close()
    assert not (tmp_path / "refused.jsonl").exists(), "a run refused before its first record leaves no file"
    metrics = MetricsFile(str(tmp_path / "m.jsonl"))
    metrics.opening("start", lambda: dict(known))
    known["flops_per_sample"] = 4480.0
    metrics.write("progress", global_step=1)
    metrics.write("progress", global_step=2)
    metrics.close()
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["start", "progress", "progress"]
    assert records[0]["flops_per_sample"] == 4480.0 and records[0]["time"] <= records[1]["time"]


# ---------------------------------------------------------------- make report: bad input


def run_report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddpack.jobs.report", *args], env=clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)


def write_metrics(folder: Path, lines: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder


RECORDS = [
    json.dumps({"time": 100.0, "kind": "start", "world_size": 1, "hosts": ["a"], "global_step": 0, "total_steps": 2}),
    json.dumps({"time": 101.0, "kind": "progress", "global_step": 1, "loss": 1.0, "samples_per_s": 10.0}),
    json.dumps({"time": 102.0, "kind": "progress", "global_step": 2, "loss": 0.5, "samples_per_s": 12.0}),
]


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("no-folder", "is not a folder; give the run folder that holds metrics.jsonl"),
        ("no-metrics", "holds no metrics.jsonl"),
        ("empty", "has no records"),
    ],
)
def test_bad_runs_are_one_line_and_exit_2_and_write_nothing(tmp_path: Path, layout: str, message: str) -> None:
    run = tmp_path / "run"
    if layout == "no-metrics":
        run.mkdir()
    elif layout == "empty":
        write_metrics(run, [])
    result = run_report(str(run))
    assert result.returncode == 2, result
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
    assert not (run / "report.html").exists()


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path: Path) -> None:
    run = write_metrics(tmp_path / "run", [*RECORDS, RECORDS[2][:25]])
    result = run_report(str(run), "--png")
    assert result.returncode == 0, result.stderr
    assert "warning: skipped" in result.stderr and "torn" in result.stderr
    assert (run / "report.html").stat().st_size > 10_000 and (run / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in run.iterdir() if p.name.startswith(".")], "a temporary file was left behind"


def test_a_torn_line_before_a_later_starts_records_is_skipped_not_the_whole_run(tmp_path: Path) -> None:
    """A start killed mid-write, then a requeued start appending after its half line: the report skips that line."""
    run = write_metrics(tmp_path / "run", [RECORDS[0], RECORDS[1][:30] + RECORDS[2], *RECORDS[2:]])
    result = run_report(str(run))
    assert result.returncode == 0, result.stderr
    assert "warning: skipped line 2 of" in result.stderr and "torn" in result.stderr
    assert (run / "report.html").stat().st_size > 10_000


# ---------------------------------------------------------------- a real run, stopped, resumed, reported


@pytest.mark.dist
def test_a_stopped_and_resumed_two_rank_run_with_a_straggler_reports_every_chart(tmp_path: Path) -> None:
    """A preflight step, then training whose rank 1 is 15 ms slower a step, stopped by SIGTERM and resumed:
    the progress lines name rank 1, the metrics carry both ranks and MFU by the hand count, TensorBoard gets
    the scalars, and the report shows every chart, both segments and the preflight, linking to nothing."""
    run = tmp_path / "run"
    metrics, board = run / "metrics.jsonl", run / "tb"
    slow = {r: {"SLOW_RANK": "1", "SLOW_RANK_MS": "15"} for r in range(2)}
    args = ["--task", "plugins.slow_rank:task", "--epochs", "1", "--batch-size", "32", "--log-every", "5", "--snapshot-every", "10"]
    args += ["--snapshot-dir", str(run / "snap"), "--metrics-file", str(metrics), "--tensorboard", str(board)]
    preflight = ["--preflight", "--preflight-json", str(run / "preflight.json"), "--preflight-seconds", "2"]
    pre = start_slurm_step(subdir(tmp_path, "pre"), [2], [*preflight, *args], cwd=USER_DIR)
    assert pre.wait() == [0, 0], pre.output()
    first = start_slurm_step(subdir(tmp_path, "first"), [2], args, cwd=USER_DIR, rank_env=slow)
    wait_for(lambda: metrics_step(metrics) >= 20, 90, "step 20")
    first.send(signal.SIGTERM, [0])
    assert first.wait() == [143, 143], first.output()
    second = start_slurm_step(subdir(tmp_path, "second"), [2], args, cwd=USER_DIR, rank_env=slow)
    assert second.wait() == [0, 0], second.output()

    assert re.search(r"\[rank 0/2\] epoch .* loss .* mfu [\d.]+% eta .*; slow rank 1 \(\S+\) busy", second.output()), second.output()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    starts = [r for r in records if r["kind"] == "start"]
    assert len(starts) == 2 and starts[0]["global_step"] == 0 and starts[1]["global_step"] >= 20
    assert starts[0]["flops_per_sample"] == mlp_flops_by_hand(16, 64, 1)
    assert starts[0]["peak_source"].startswith("preflight: median measured fp32 matmul")
    progress = [r for r in records if r["kind"] == "progress"]
    for record in progress:
        assert record["mfu"] == pytest.approx(record["samples_per_s"] * 4480 / (starts[-1]["peak_flops_per_s"] * 2))
    busy = [[s - w for s, w in zip(r["rank_step_s"], r["rank_sync_s"], strict=True)] for r in progress]
    assert sum(b[1] > b[0] + 0.010 for b in busy) >= len(busy) - 2, busy  # rank 1 is 15 ms busier a step

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in board.glob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/samples_per_s", "train/mfu", "step_time_ms/rank0", "step_time_ms/rank1"} <= tags

    result = run_report(str(run), "--png")
    assert result.returncode == 0, result.stderr
    page = (run / "report.html").read_text()
    for section in ("loss", "throughput", "ranks", "timeline", "preflight", "settings"):
        assert f"id='{section}'" in page
    assert page.count('src="data:image/png;base64,') == 6
    assert not re.search(r"""(?:href|src)=["'](?!data:)""", page), "the page links outside itself"
    assert "<td>stopped</td>" in page and "<td>done</td>" in page and "SIGTERM" in page
    assert (run / "report.png").read_bytes()[:4] == b"\x89PNG"
    screenshot_in_chromium(run / "report.html", tmp_path / "screenshot.png")


def screenshot_in_chromium(page: Path, shot: Path) -> None:
    """Where Chromium is installed (CI installs it), the page must render in a real browser: a full-size
    screenshot whose pixels are not one colour (images that failed to decode leave an empty page)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--screenshot={shot}", "--window-size=1200,5200", page.as_uri()],
        capture_output=True,
        timeout=120,
        check=True,
    )
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))
    assert pixels.shape[0] == 5200 and pixels.shape[1] == 1200
    assert float(pixels[:, :, :3].std()) > 0.05, "the screenshot is blank"
    # The charts reach far down the page: its lower half is not empty either.
    assert float(pixels[2600:, :, :3].std()) > 0.05


def test_a_slow_rank_is_judged_over_twenty_steps_however_often_lines_come() -> None:
    """With --log-every 1 one step's noise would name a different rank on each line: the judge pools the
    latest windows until they cover 20 steps, and drops older ones, so a straggler that recovered is let go."""
    judge = SlowRanks(["a", "b"])

    def window(busy_a: float, busy_b: float, steps: int = 1) -> list[float]:  # slots: step, data wait, sync wait
        return [0.05 * steps, 0.0, (0.05 - busy_a) * steps, 0.05 * steps, 0.0, (0.05 - busy_b) * steps]

    assert [judge.judge(window(0.010, 0.030), 1) for _ in range(19)] == [None] * 19  # too few steps yet
    assert judge.judge(window(0.010, 0.030), 1) == "slow rank 1 (b) busy 30.0 ms/step against a median of 20.0 over the last 20 steps"
    assert judge.judge(window(0.010, 0.010), 1) is not None  # one quick step does not acquit it
    assert judge.judge(window(0.010, 0.010, 20), 20) is None  # twenty do: the older windows are dropped
    noise = [judge.judge(window(0.030, 0.010) if step % 2 else window(0.010, 0.030), 1) for step in range(40)]
    assert noise == [None] * 40  # each rank slow on every other step: no straggler, and none named
