"""Every rank starts from the same model: the same architecture, then rank 0's weights.

Torch and a transport, no Lightning: the strategies call :func:`prepare_module` when they set a
model up.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from lightning_mpi.comm.buffers import make_buckets
from lightning_mpi.comm.transport import Transport


def module_signature(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every entry of the module's state dict, in order."""
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in module.state_dict(keep_vars=True).items()]


def first_difference(signatures: list[list[Any]]) -> str | None:
    """A message naming the first tensor where some rank's signature differs from rank 0's, or None."""
    for rank, theirs in enumerate(signatures):
        if theirs == signatures[0]:
            continue
        for index in range(max(len(theirs), len(signatures[0]))):
            mine = signatures[0][index] if index < len(signatures[0]) else None
            other = theirs[index] if index < len(theirs) else None
            if mine != other:
                return (
                    f"lightning_mpi: ranks built different models. First difference at tensor #{index}: "
                    f"rank 0 has {mine}, rank {rank} has {other}. Build the model the same way on every "
                    "rank (same code, same hyperparameters); random initial values are fine, rank 0's are broadcast."
                )
    return None


def check_same_model(transport: Transport, module: torch.nn.Module) -> None:
    """Every rank must build the same model: compare parameter names, shapes and dtypes.

    A mismatch would make the exchange mix unrelated tensors (or hang on unequal buffer sizes),
    so it is an error on every rank, naming the first difference. One digest is gathered; the
    full signatures only when the digests differ.
    """
    if transport.size == 1:
        return
    signature = module_signature(module)
    digest = hashlib.sha256(repr(signature).encode()).hexdigest()
    if len(set(transport.allgather_object(digest))) == 1:
        return
    message = first_difference(transport.allgather_object(signature))
    if message is not None:
        raise ValueError(message)


def broadcast_module_state(transport: Transport, module: torch.nn.Module) -> None:
    """Make every rank hold rank 0's parameters and buffers (one Bcast per group of floating
    tensors, one per other tensor)."""
    if transport.size == 1:
        return
    tensors = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    for bucket in make_buckets(tensors, 1, bucket_bytes=None, reverse=False):
        bucket.pack()
        transport.broadcast_(bucket.flat, root=0)
        bucket.unpack()
    for t in (*module.parameters(), *module.buffers()):
        if not t.is_floating_point() and t.numel():
            with torch.no_grad():
                transport.broadcast_(t.data if t.is_contiguous() else t.data.contiguous(), root=0)


def prepare_module(transport: Transport, module: torch.nn.Module) -> None:
    """Check that every rank built the same model, then give every rank rank 0's weights."""
    check_same_model(transport, module)
    broadcast_module_state(transport, module)
