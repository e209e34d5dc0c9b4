"""`make gpu-check`: everything ddpack can learn from a lent GPU, in one command and one folder.

For a GPU machine with torch and pytest and nothing else (no Docker, Slurm, network or host extras), run from the
repository's root. In order, each step's output in its own file, a step that fails or runs out of time never
stopping the next:
1. the GPU tier as written (`pytest -m gpu` from the root: the modules that need host extras skip at collection);
2. the preflight with --preflight-strict on every visible GPU: the node checks (nvidia-smi's rows, /dev/shm, locked
   memory) and the copy and all-reduce rates against the GPU model's floors, each row's value in the summary;
3. bench_gpu's GPT step, A B C A B C: the trainer eager, the bare DDP loop, the trainer `--compile`;
4. a profile of trainer and bare loop over 100 steady steps (tables and totals);
5. the same comparison at a batch where the GPU, not the host, sets the step;
6. the preflight's matmul against a bare loop.
`summary.txt` holds the GPU's name, driver, torch, CUDA and the commit, then each step's verdict and figures: paste
it into docs/tests-and-benchmarks.md. The whole stays inside `--budget` seconds (a step is given what is left and
skipped when too little is).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path[:0] = [str(ROOT), str(BENCH)]


@dataclass(frozen=True, kw_only=True)
class Step:
    name: str
    argv: list[str]
    needs_s: int  # about what it takes on an H100: skipped when less than this is left
    figures: tuple[str, ...]  # the output lines that start so are its figures


def identity(commit: str) -> dict[str, str]:
    """What the figures were measured on."""
    import torch

    from train.gpu import driver_version

    cuda = torch.cuda.is_available()
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else "none (torch sees no CUDA GPU)",
        "driver": (driver_version() or "unknown") if cuda else "-",
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "-",
        "commit": commit,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def steps(out: Path, rounds: int, gpt_steps: int) -> list[Step]:
    bench = [sys.executable, str(BENCH / "bench_gpu.py"), "--rounds", str(rounds), "--steps", str(gpt_steps)]
    return [
        Step(name="gpu-tier", argv=[sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"], needs_s=150,
             figures=("FAILED", "ERROR", "SKIPPED")),
        Step(name="preflight", argv=preflight_argv(out), needs_s=40, figures=("preflight: PASS", "preflight: FAIL", "preflight: WARN")),
        Step(name="gpt", argv=[*bench, "--only", "gpt"], needs_s=150, figures=("GPT", "  trainer --compile")),
        Step(name="profile", argv=[*bench, "--only", "profile", "--profile", str(out)], needs_s=40, figures=("profile",)),
        Step(name="gpu-bound", argv=[*bench, "--only", "gpu-bound", "--rounds", "2"], needs_s=60, figures=("GPT",)),
        Step(name="matmul", argv=[*bench, "--only", "matmul", "--seconds", "1"], needs_s=20, figures=("matmul", "  against")),
    ]


def preflight_argv(out: Path) -> list[str]:
    """The strict preflight on every GPU torch sees, one rank each (torchrun --standalone), its report in `out`."""
    import torch

    gpus = max(1, torch.cuda.device_count())
    return [sys.executable, "-m", "entrypoint", f"--nproc-per-node={gpus}", "--preflight", "--preflight-strict", "--preflight-seconds", "10",
            "--preflight-json", str(out / "preflight.json"), "--snapshot-dir", ""]  # fmt: skip


def preflight_figures(report: Path) -> list[str]:
    """Each node check's row from the preflight's report (the cheap checks' time first), or why there is none."""
    try:
        record = json.loads(report.read_text())
    except (OSError, ValueError) as exc:
        return [f"no report at {report.name} ({exc})"]
    lines = [f"node checks took {record.get('node_check_s', 0) * 1000:.1f} ms on the slowest node"]
    for row in record.get("node_checks") or []:
        device = f" [{row['device']}]" if row.get("device") else ""
        lines.append(f"{row['check']}: {row['status']} {row['value']}{device} (threshold: {row['threshold']})")
    return lines


def run_step(step: Step, out: Path, left_s: float) -> tuple[str, list[str]]:
    """Run one step with what is left of the budget; its verdict and its figure lines."""
    if left_s < step.needs_s:
        return f"skipped: {left_s:.0f}s of the budget left, it needs about {step.needs_s}s", []
    log = out / f"{step.name}.txt"
    began = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{ROOT}:{BENCH}"}
    with log.open("w") as sink:
        try:
            code = subprocess.run(step.argv, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, timeout=left_s, check=False).returncode
            verdict = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            verdict = f"stopped at the budget's end ({left_s:.0f}s)"
    lines = log.read_text(errors="replace").splitlines()
    figures = [line for line in lines if line.startswith(step.figures)]
    if step.name == "gpu-tier" and lines:
        figures.append(lines[-1])  # pytest's closing line: N passed, ...
    if step.name == "preflight":
        figures += preflight_figures(out / "preflight.json")
    return f"{verdict} in {time.monotonic() - began:.0f}s (output: {log.name})", figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-check", help="the folder for every file (default build/gpu-check)")
    parser.add_argument("--budget", type=float, default=450, help="seconds for the whole check (default 450: under 8 minutes)")
    parser.add_argument("--rounds", type=int, default=3, help="A B rounds of each comparison (default 3)")
    parser.add_argument("--steps", type=int, default=150, help="steps a GPT run (default 150)")
    parser.add_argument("--commit", default="unknown", help="the commit measured (make passes git's)")
    args = parser.parse_args()
    began = time.monotonic()
    args.out = args.out.resolve()  # the steps run from elsewhere
    args.out.mkdir(parents=True, exist_ok=True)
    who = identity(args.commit)
    (args.out / "identity.json").write_text(json.dumps(who, indent=1) + "\n")
    summary = [f"gpu-check: {who['gpu']}, driver {who['driver']}, torch {who['torch']} (CUDA {who['cuda']}), commit {who['commit']}, {who['date']}"]
    print(summary[0], flush=True)
    if who["driver"] == "-":
        print("gpu-check: no CUDA GPU here; run it on a GPU machine", file=sys.stderr)
        return 2
    verdicts = []
    for step in steps(args.out, args.rounds, args.steps):
        verdict, figures = run_step(step, args.out, args.budget - (time.monotonic() - began))
        verdicts.append(verdict)
        for line in [f"{step.name}: {verdict}", *(f"  {figure.strip()}" for figure in figures)]:
            summary.append(line)
            print(line, flush=True)
        (args.out / "summary.txt").write_text("\n".join(summary) + "\n")
    return 0 if all(verdict.startswith("ok") for verdict in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
