"""Multi-process training on PyTorch's own distribution layer (DDP), launched by ``torchrun``.

``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; with ``WORLD_SIZE > 1`` the
trainer joins a process group (NCCL when CUDA is used, gloo on CPU) and wraps the model in
``DistributedDataParallel``. Without those variables everything here is a no-op, so the
single-process path is unchanged.

The ``ranmt`` command line ends a torchrun worker with :func:`exit_worker`, not by returning to the
interpreter: after ``destroy_process_group`` the gloo threads of a group that DDP wrapped stay
alive (a leak in PyTorch, checked on 2.13: ``DistributedDataParallel`` keeps the group's
threads running whatever is deleted), and one of them that drops the last reference to a
tensor made in Python must take the GIL; during interpreter finalization that ends the
thread, and the process aborts with "terminate called without an active exception" (seen
once in CI, after a run that had finished and saved everything).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_name: str) -> tuple[DistContext, torch.device]:
    """Join the process group when launched by torchrun; return (context, this rank's device)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ctx = DistContext(int(os.environ.get("RANK", "0")), world_size,
                      int(os.environ.get("LOCAL_RANK", "0")))
    use_cuda = device_name.startswith("cuda") or (device_name == "auto"
                                                  and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError(f"device '{device_name}' requested but CUDA is not available")
    if use_cuda:
        if ctx.enabled:
            index = ctx.local_rank
        elif device_name.startswith("cuda:"):
            index = int(device_name.split(":", 1)[1])
        else:
            index = 0
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if ctx.enabled and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    return ctx, device


def all_reduce_sum(values: list[float], ctx: DistContext, device: torch.device) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (identity in a single process)."""
    if not ctx.enabled:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.tolist()


def broadcast_object(value, ctx: DistContext):
    """Rank 0's ``value`` on every rank."""
    if not ctx.enabled:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def shutdown(ctx: DistContext) -> None:
    """Leave the process group once every rank is done with it."""
    if ctx.enabled and dist.is_initialized():
        dist.barrier()  # no rank closes its connections while another still reads them
        dist.destroy_process_group()


_HELD_UNTIL_EXIT: list = []
"""This process's ``DistributedDataParallel`` wrappers (:func:`hold_until_exit`)."""


def hold_until_exit(wrapper) -> None:
    """Keep a DDP ``wrapper`` alive until the process ends (a torchrun worker ends with
    :func:`exit_worker`, which runs no destructor). Freed on the main thread, it frees its
    reducer and with it gloo's process group, whose destructor joins gloo's run-loop thread
    while holding the GIL; that thread, still destroying the shutdown barrier's work (which
    holds an earlier broadcast's tensors), waits for the GIL to drop their Python objects:
    a deadlock. Once in CI a worker that had written its summary hung there (gdb: main
    thread in ``~ProcessGroupGloo`` -> ``std::thread::join``, ``pt_gloo_runloop`` in
    ``~AsyncBarrierWork`` -> ``decref_pyobject`` -> ``take_gil``)."""
    _HELD_UNTIL_EXIT.append(wrapper)


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def exit_worker(code: int = 0) -> NoReturn:
    """End this torchrun worker now, skipping interpreter finalization (module docstring):
    the run's files are written and closed by then; stdout and stderr are flushed here."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
