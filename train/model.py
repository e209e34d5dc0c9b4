"""What the trainer does to the user's model before DDP wraps it, and what it tells the user when the
model does not fit the settings: one line naming the flag to change, not DDP's or inductor's page.

Why each check exists:
- torch's SyncBatchNorm raises on CPU tensors ("expected input tensor to be on GPU") at the first
  forward; saying so before training starts names the flag instead.
- torch.compile on CPU generates C++ and needs a working compiler and torch's C++ headers; without
  them the first step fails deep inside inductor (`InvalidCxxCompiler`). Checked up front, so a
  misbuilt image is one line before any rank trains or writes anything.
- A parameter that forward leaves unused makes DDP fail at the second step with a page of advice
  and the parameters' indices; the trainer names the parameters and the flag.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from train.config import Config
from train.distributed import first_line


class SetupError(Exception):
    """A setting that cannot work with this model or machine, found before or at the first step:
    every rank finds it, and nothing has been written."""


# DDP's reducer lists what it waited for in vain: "Parameter indices which did not receive grad for rank 0: 4 5".
UNUSED_INDICES_RE = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


def prepare_module(model: nn.Module, config: Config, device: torch.device) -> nn.Module:
    """The user's module on `device`, with SyncBatchNorm where asked; refuses settings the machine
    cannot run (SetupError)."""
    module = model.to(device)
    if config.sync_batchnorm:
        if device.type != "cuda":
            raise SetupError(
                "--sync-batchnorm needs CUDA devices: torch's SyncBatchNorm does not run on CPU; drop the flag "
                "(each rank then normalises with its own batch, and rank 0's running statistics are kept)"
            )
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if config.compile and device.type == "cpu":
        check_cpu_compiler()
    return module


def compile_module(module: nn.Module, *, world_size: int) -> nn.Module:
    """`torch.compile(module)`, for the trainer's --compile. At one rank dynamo's DDP optimizer is turned off: it splits
    the compiled graph at every DDP bucket so that a bucket's all-reduce can start while backward goes on, and one rank
    has nothing to overlap, only a compiled subgraph (its guards, its launch) a bucket to pay. Measured on the GPU bench's
    op graph (bench_host's CUDA path, 14 buckets, CPU inductor): the compiled step 0.91x and 0.88x the bare eager
    loop's split, 0.62x and 0.65x whole. With more ranks the split stays, for the overlap it buys."""
    if world_size == 1:
        import torch._dynamo as dynamo

        dynamo.config.optimize_ddp = False
    return torch.compile(module)


def check_cpu_compiler() -> None:
    """inductor's CPU code needs a C++ compiler and torch's headers (the images carry both)."""
    from torch._inductor import exc as inductor_exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except inductor_exc.InvalidCxxCompiler as exc:
        raise SetupError(
            f"--compile needs a C++ compiler on CPU and found none ({first_line(exc)}); install g++ or drop --compile"
        ) from None
    headers = Path(torch.__file__).parent / "include" / "ATen"
    if not headers.is_dir():
        raise SetupError(
            f"--compile needs torch's C++ headers and {headers} is missing (trimmed from this image?); rebuild with them or drop --compile"
        )


def unused_parameter_names(exc: BaseException, ddp_model: nn.Module) -> list[str] | None:
    """The names of the parameters DDP says got no gradient, or None when `exc` is not that error.
    DDP's indices count the parameters it syncs (those that require grad, in module order); the
    stop-flag wrapper's `module.` prefix is left off, so the names are the user's own."""
    text = str(exc)
    if "Expected to have finished reduction in the prior iteration" not in text:
        return None
    synced = [name for name, p in ddp_model.module.named_parameters() if p.requires_grad]
    match = UNUSED_INDICES_RE.search(text)
    indices = [int(i) for i in match.group(1).split()] if match else []
    return [synced[i].removeprefix("module.") for i in indices if i < len(synced)]


def explain_setup_failure(exc: RuntimeError, ddp_model: nn.Module) -> SetupError | None:
    """A SetupError that says what to change, for failures that come from the settings, not the run."""
    unused = unused_parameter_names(exc, ddp_model)
    if unused is not None:
        named = f" ({', '.join(unused)})" if unused else ""
        return SetupError(f"the model has parameters that forward did not use{named}; pass --find-unused-parameters")
    from torch._dynamo.exc import TorchDynamoException

    if isinstance(exc, TorchDynamoException):
        return SetupError(f"--compile: torch cannot compile this model ({type(exc).__name__}: {first_line(exc)}); drop --compile")
    return None
