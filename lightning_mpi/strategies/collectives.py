"""Lightning's collectives over MPI: ``reduce``, ``all_gather``, ``broadcast``, ``barrier``, and
torchmetrics' sync, so that no ``torch.distributed`` process group is ever created.

Functions of a transport; the strategies' methods of the same names call them. Every collective
spans all ranks: a ``group`` other than ``None`` is refused, since lightning_mpi makes no
process groups.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_mpi.comm.transport import Transport

_REDUCE_OPS = {
    "avg": "mean",
    "mean": "mean",
    "sum": "sum",
    "max": "max",
    "min": "min",
    "product": "prod",
    "prod": "prod",
}


def reduce_op_name(reduce_op: Any) -> str:
    """Map Lightning/torch reduce ops ("mean", "avg", "sum", ReduceOp.SUM, ...) to a short name."""
    name = str(getattr(reduce_op, "name", reduce_op) if reduce_op is not None else "mean").lower()
    name = name.rsplit(".", 1)[-1]
    if name not in _REDUCE_OPS:
        raise ValueError(f"reduce_op={reduce_op!r} is not supported: use one of 'mean', 'sum', 'max', 'min', 'prod'")
    return _REDUCE_OPS[name]


def check_group(group: Any) -> None:
    """Raise ``ValueError`` unless ``group`` is ``None`` (all ranks): there are no process groups."""
    if group is not None:
        raise ValueError(
            f"group={group!r} is not supported: lightning_mpi's collectives always span every rank (it creates no "
            "torch.distributed process groups); pass group=None"
        )


def reduce(transport: Transport, tensor: Any, reduce_op: Any | None = "mean") -> Any:
    """Reduce a tensor over all ranks (``mean`` by default, in float64 for floating tensors and
    means); non-tensors pass through unchanged."""
    if not isinstance(tensor, Tensor):
        return tensor
    op = reduce_op_name(reduce_op)
    if transport.size == 1:
        return tensor
    original_dtype = tensor.dtype
    if tensor.is_floating_point() or op == "mean":
        work = tensor.detach().to(torch.float64, copy=True)
    elif tensor.dtype == torch.bool:
        work = tensor.detach().to(torch.int64)
    else:
        work = tensor.detach().clone()
    work = work.contiguous()
    transport.allreduce_(work, "sum" if op == "mean" else op)
    if op == "mean":
        work /= transport.size
        return work.to(original_dtype if original_dtype.is_floating_point else torch.float32)
    return work.to(original_dtype)


def all_gather(transport: Transport, tensor: Tensor, sync_grads: bool = False) -> Tensor:
    """Stack every rank's tensor (same shape on every rank) into ``[world_size, *shape]``.

    ``sync_grads=True`` is not supported: gradients do not flow back through MPI.
    """
    if sync_grads:
        raise ValueError(
            "sync_grads=True is not supported by lightning_mpi's all_gather: gradients do not flow "
            "through MPI; pass sync_grads=False"
        )
    if transport.size == 1:
        return tensor.unsqueeze(0)
    src = tensor.detach().contiguous()
    out = torch.empty((transport.size, *src.shape), dtype=src.dtype, device=src.device)
    transport.allgather(src.reshape(1, -1), out.view(transport.size, -1))
    return out


def broadcast(transport: Transport, obj: Any, src: int = 0) -> Any:
    """Send a picklable object from rank ``src`` to every rank."""
    if transport.size == 1:
        return obj
    return transport.broadcast_object(obj, root=src)


def barrier(transport: Transport) -> None:
    if transport.size > 1:
        transport.barrier()


def connect_metrics(
    module: torch.nn.Module, distributed: Callable[[], bool], allgather_object: Callable[[Any], list[Any]]
) -> None:
    """Point every torchmetrics ``Metric`` in the module at MPI, so ``compute()`` syncs over it.

    ``distributed()`` says whether metrics sync at all, ``allgather_object(x)`` returns every
    rank's ``x`` over the current run (the strategy's: after a heal, the survivors'; under
    ``heal`` a loss during the sync heals there). Both are asked only when a metric syncs.
    """

    def gather(tensor: Tensor, group: Any = None) -> list[Tensor]:
        # torchmetrics' dist_sync_fn: every rank's tensor; shapes may differ between ranks
        gathered = allgather_object(tensor.detach().cpu())
        return [t.to(tensor.device) for t in gathered]

    for child in module.modules():
        if isinstance(child, Metric):
            child.dist_sync_fn = gather
            child.distributed_available_fn = distributed
