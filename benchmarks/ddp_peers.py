"""Lightning's ``ddp`` with torch's communication hooks: the peers a Lightning user already has.

Names (used as arm/strategy names by the benchmarks):

- ``ddp``: plain DDP, fp32 allreduce of every bucket (gloo on CPU).
- ``ddp_fp16``: ``default_hooks.fp16_compress_hook`` (buckets cast to fp16 for the allreduce).
- ``ddp_powersgd1`` / ``ddp_powersgd4``: ``powerSGD_hook`` with ``PowerSGDState`` at
  ``matrix_approximation_rank`` 1 / 4, error feedback and warm start on, and PowerSGD from the
  second iteration on (``start_powerSGD_iter=2``: torch requires more than 1 with error feedback or
  warm start, because DDP rebuilds its buckets after the first iteration), and all gradients in
  one bucket (see below).

Lightning registers a comm hook only when the root device is CUDA, so on CPU
:class:`HookedDDPStrategy` registers it itself, right after the model is wrapped. Every rank runs
under ``mpiexec``; the node layout (``devices``, ``num_nodes``) is derived from the hostnames.

``powerSGD_hook`` can hang on gloo when DDP has several buckets: with ``throughput.py``'s
17.9M-parameter MLP and DDP's default 25 MB buckets, 2 ranks on CPU (``torch`` 2.13), every rank
stops inside backward at the first PowerSGD step (the third), in three runs of three; the
time-to-quality LM with the same buckets ran (one run, 5 steps). The likely cause: the hook's
``then`` callbacks call ``wait()`` on the next allreduce, and gloo runs future callbacks on its
worker threads (two by default), so two buckets' callbacks can block every worker while the
allreduces they wait for queue behind them. One bucket avoids it, at the price of no overlap
with backward: the PowerSGD peers use :data:`POWERSGD_BUCKET_CAP_MB`; a time-to-quality arm can
still ask for DDP's default (``ddp_powersgd1:bucket_cap_mb=25``).
"""
from __future__ import annotations

from typing import Any, Callable

#: name -> one line on what it exchanges
DDP_PEERS: dict[str, str] = {
    "ddp": "DDP, fp32 allreduce (gloo)",
    "ddp_fp16": "DDP + fp16_compress_hook",
    "ddp_powersgd1": "DDP + powerSGD_hook, rank 1",
    "ddp_powersgd4": "DDP + powerSGD_hook, rank 4",
}

#: PowerSGD from this iteration on; torch requires > 1 with error feedback or warm start
START_POWERSGD_ITER = 2
#: DDP bucket size for the PowerSGD peers: every gradient in one bucket (module docstring)
POWERSGD_BUCKET_CAP_MB = 1024


def is_ddp_peer(name: str) -> bool:
    return name in DDP_PEERS


def comm_hook(name: str) -> tuple[Any, Callable] | None:
    """``(state, hook)`` to register for peer ``name``, or None for plain ``ddp``."""
    if name not in DDP_PEERS:
        raise ValueError(f"name={name!r} is not a ddp peer: choose one of {list(DDP_PEERS)}")
    if name == "ddp":
        return None
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "ddp_fp16":
        return None, default_hooks.fp16_compress_hook  # state None: the default process group
    rank = int(name.removeprefix("ddp_powersgd"))
    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                        start_powerSGD_iter=START_POWERSGD_ITER,
                                        use_error_feedback=True, warm_start=True)
    return state, powerSGD_hook.powerSGD_hook


def hooked_ddp_class():
    """``pytorch_lightning``'s ``DDPStrategy`` with a comm hook registered on any device."""
    from pytorch_lightning.strategies import DDPStrategy

    class HookedDDPStrategy(DDPStrategy):
        """DDPStrategy that registers ``(state, hook)`` after wrapping the model, also on CPU."""

        def __init__(self, state: Any, hook: Callable, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._peer_state, self._peer_hook = state, hook

        def _register_ddp_hooks(self) -> None:
            # Lightning's version returns early unless the root device is CUDA
            self.model.register_comm_hook(self._peer_state, self._peer_hook)

    return HookedDDPStrategy


def node_layout() -> dict[str, int]:
    """``devices`` and ``num_nodes`` for a Trainer under ``mpiexec``, from the ranks' hostnames."""
    import socket

    from mpi4py import MPI

    hosts = MPI.COMM_WORLD.allgather(socket.gethostname())
    per_host = hosts.count(socket.gethostname())
    return {"devices": per_host, "num_nodes": len(hosts) // per_host}


def trainer_kwargs(name: str, **ddp_options: Any) -> dict[str, Any]:
    """Trainer arguments (``strategy``, ``devices``, ``num_nodes``) for ddp peer ``name``, gloo
    backend; ``ddp_options`` go to ``DDPStrategy`` (and on to ``DistributedDataParallel``)."""
    hook = comm_hook(name)
    options = {"process_group_backend": "gloo", **ddp_options}
    if hook is None:
        from pytorch_lightning.strategies import DDPStrategy

        strategy = DDPStrategy(**options)
    else:
        if name.startswith("ddp_powersgd"):
            options.setdefault("bucket_cap_mb", POWERSGD_BUCKET_CAP_MB)
        strategy = hooked_ddp_class()(*hook, **options)
    return {"strategy": strategy, **node_layout()}
