"""Each strategy's typed, documented constructor arguments, the same for every frontend.

A class here turns its arguments into a :class:`~lightning_mpi.rules.base.Rule` (which validates
them, so a bad value raises ``ValueError`` at construction) and passes the rest on with
``**kwargs`` to the frontend's base strategy (the options every strategy takes: see
``MPIStrategy``). :mod:`lightning_mpi.strategies.build` puts each of them on the base strategy of
every frontend, so ``lightning_mpi.EASGDStrategy`` (Trainer, ``pytorch_lightning``),
``lightning_mpi.lightning.EASGDStrategy`` and ``lightning_mpi.fabric.EASGDStrategy`` take the same
arguments. ``LightningCLI`` (jsonargparse) reads the signatures and these docstrings, and follows
``**kwargs`` into the base strategy, so ``--trainer.strategy.lr_scaling=sqrt`` works too.
"""
from __future__ import annotations

from typing import Any, Literal, Optional

from lightning_mpi.rules.averaging import ModelAveragingRule
from lightning_mpi.rules.base import Rule
from lightning_mpi.rules.compressed import CompressedSyncRule
from lightning_mpi.rules.easgd import EASGDRule
from lightning_mpi.rules.gossip import GoSGDRule
from lightning_mpi.rules.server import ADAGRule, AEASGDRule, AGNRule, DownpourRule, DynSGDRule, EAMSGDRule
from lightning_mpi.rules.sync import SyncRule
from lightning_mpi.strategies.aids import MomentumCorrection


class SyncOptions:
    """Synchronous data parallelism: every step, average gradients (or weights) over all ranks.

    Registered as ``mpi_allreduce``, ``mpi_asa``, ``mpi_asa16`` and ``mpi_asa_bf16``.

    Args:
        exchange: ``"allreduce"``: one ``MPI_Allreduce`` per bucket. ``"asa"``: Theano-MPI's
            Alltoall → local fp32 sum → Allgather.
        wire: ``"fp32"``, ``"fp16"`` or ``"bf16"`` on the wire (16-bit needs ``exchange="asa"``):
            half the bytes, fp32 accumulation, one rounding of the sum.
        average: ``"gradients"`` (W ranks × batch B = one process × batch W·B), ``"weights"``
            (Theano-MPI's AWAGD: local step, then average weights) or ``"weights+momentum"``
            (also average the optimizer's momentum/moment buffers).
        bucket_mb: exchange bucket size in MiB (> 0).
        overlap: start each bucket's exchange from the gradient hooks as soon as its gradients
            are ready, so it runs behind the rest of backward.
        segment_mb: each bucket is exchanged as a pipeline of segments of this size (MiB): the
            cast and sum of one segment overlap the transfer of the next.
        topology_aware: reduce within each node over shared memory, exchange only among node
            leaders across the network, then broadcast within the node.
        first_bucket_mb: size of the first bucket in MiB (> 0): small, so that the exchange
            starts after the last layer or two of backward.
        **kwargs: the options every strategy takes (see ``MPIStrategy``): ``log_stats``
            (exchange time, bytes and skipped steps under ``mpi/sync/``), ``abort_on_exception``,
            ``collective_timeout``, ``lr_scaling``, ``warmup_steps``.
    """

    def __init__(
        self,
        exchange: Literal["allreduce", "asa"] = "allreduce",
        wire: Literal["fp32", "fp16", "bf16"] = "fp32",
        average: Literal["gradients", "weights", "weights+momentum"] = "gradients",
        bucket_mb: float = 25.0,
        overlap: bool = True,
        segment_mb: float = 4.0,
        topology_aware: bool = False,
        first_bucket_mb: float = 1.0,
        **kwargs: Any,
    ) -> None:
        rule = SyncRule(
            exchange=exchange,
            wire=wire,
            average=average,
            bucket_mb=bucket_mb,
            overlap=overlap,
            segment_mb=segment_mb,
            topology_aware=topology_aware,
            first_bucket_mb=first_bucket_mb,
        )
        super().__init__(rule=rule, **kwargs)  # type: ignore[call-arg]


class CompressedSyncOptions:
    """Average gradients every step with a lossy wire format and error feedback.

    Registered as ``mpi_asa_int8``, ``mpi_topk`` and ``mpi_onebit``.

    Args:
        codec: ``"int8"`` (ASA with per-chunk min-max 8-bit quantization, fp32 sums),
            ``"topk"`` (each rank sends its ``ratio`` largest-magnitude entries as (index, value)
            pairs) or ``"onebit"`` (ASA with signs and two per-chunk scales).
        ratio: fraction of entries sent by ``"topk"``, in (0, 1].
        error_feedback: keep what was not sent and add it to the next step's gradient; the
            residuals are saved in checkpoints.
        momentum_correction: Deep Gradient Compression's momentum correction (``"topk"`` only):
            momentum is applied locally before sparsification; use an optimizer without momentum
            with it. (Not the asynchronous strategies' ``momentum_correction``, which lowers the
            optimizer's momentum by the momentum that asynchrony adds.)
        momentum: momentum of ``momentum_correction``, in [0, 1).
        ratio_warmup_steps: steps over which the top-k ratio falls geometrically from 1 to
            ``ratio`` (0 = none).
        bucket_mb: exchange bucket size in MiB (> 0).
        overlap: start each bucket's exchange from the gradient hooks during backward.
        segment_mb: each bucket is exchanged as a pipeline of segments of this size (MiB).
        first_bucket_mb: size of the first bucket in MiB (> 0).
        **kwargs: the options every strategy takes (see ``MPIStrategy``): ``log_stats`` (exchange
            time, bytes on the wire, compression factor under ``mpi/compressed/``),
            ``abort_on_exception``, ``collective_timeout``, ``lr_scaling``, ``warmup_steps``.
    """

    def __init__(
        self,
        codec: Literal["int8", "topk", "onebit"] = "int8",
        ratio: float = 0.01,
        error_feedback: bool = True,
        momentum_correction: bool = False,
        momentum: float = 0.9,
        ratio_warmup_steps: int = 0,
        bucket_mb: float = 25.0,
        overlap: bool = True,
        segment_mb: float = 4.0,
        first_bucket_mb: float = 1.0,
        **kwargs: Any,
    ) -> None:
        rule = CompressedSyncRule(
            codec=codec,
            ratio=ratio,
            error_feedback=error_feedback,
            momentum_correction=momentum_correction,
            momentum=momentum,
            ratio_warmup_steps=ratio_warmup_steps,
            bucket_mb=bucket_mb,
            overlap=overlap,
            segment_mb=segment_mb,
            first_bucket_mb=first_bucket_mb,
        )
        super().__init__(rule=rule, **kwargs)  # type: ignore[call-arg]


class EASGDOptions:
    """Synchronous EASGD (Zhang et al. 2015), center replicated on every rank: registered as ``mpi_easgd``.

    Args:
        period: τ, local steps between elastic exchanges (≥ 1); one allreduce per exchange.
        alpha: elastic moving rate α in (0, 1]; ``None`` = 0.9 / world size (Zhang et al.'s β = 0.9).
        **kwargs: the options every strategy takes (see ``MPIStrategy``); ``log_stats`` logs
            exchange time and bytes under ``mpi/easgd/``.
    """

    def __init__(self, period: int = 4, alpha: Optional[float] = None, **kwargs: Any) -> None:
        super().__init__(rule=EASGDRule(period=period, alpha=alpha), **kwargs)  # type: ignore[call-arg]


class ModelAveragingOptions:
    """Periodic model averaging / local SGD: registered as ``mpi_model_avg``.

    Args:
        period: local steps between weight averages (≥ 1).
        sync_warmup_steps: first steps with synchronous gradient averaging (≥ 0). (Formerly
            ``warmup_steps``, which now means the learning-rate warm-up, as on every strategy.)
        **kwargs: the options every strategy takes (see ``MPIStrategy``); ``log_stats`` logs
            exchange time under ``mpi/model_avg/``.
    """

    def __init__(self, period: int = 4, sync_warmup_steps: int = 0, **kwargs: Any) -> None:
        rule = ModelAveragingRule(period=period, sync_warmup_steps=sync_warmup_steps)
        super().__init__(rule=rule, **kwargs)  # type: ignore[call-arg]


class AsyncOptions(MomentumCorrection):
    """Base of the asynchronous strategies: stop decisions without per-step barriers (Trainer),
    and optional momentum correction.

    Args:
        rule: the asynchronous rule (the subclasses build it from their arguments).
        momentum_correction: lower the explicit momentum by the implicit momentum 1 − 1/W that W
            asynchronous workers add (Mitliagkas et al. 2016): μ → max(0, μ − (1 − 1/W)). It
            corrects the optimizer's momentum (SGD ``momentum``, Adam-family ``betas[0]``) for each
            update, so schedulers and checkpoints keep your value and a resume at another W
            corrects afresh; for ``mpi_eamsgd`` it corrects the rule's Nesterov momentum δ instead.
            Rank 0 prints both values at train start and logs them as ``mpi/momentum_explicit`` and
            ``mpi/momentum_implicit``; it warns when the correction clamps to 0 or there is no
            momentum to correct.
        **kwargs: the options every strategy takes (see ``MPIStrategy``).
    """

    def __init__(self, rule: Rule, momentum_correction: bool = False, **kwargs: Any) -> None:
        self._init_momentum_correction(momentum_correction)
        super().__init__(rule=rule, **kwargs)  # type: ignore[call-arg]


class DownpourOptions:
    """DOWNPOUR against a center sharded over all ranks: registered as ``mpi_downpour``.

    Args:
        period: local steps between commits (≥ 1); default 5 (dist-keras).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see ``AsyncMPIStrategy``) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/downpour/``.
    """

    def __init__(self, period: int = 5, progress_interval: float = 5e-4, **kwargs: Any) -> None:
        super().__init__(rule=DownpourRule(period=period, progress_interval=progress_interval), **kwargs)  # type: ignore[call-arg]


class AGNOptions:
    """Accumulated gradient normalization (Hermans 2017): commit delta / period. ``mpi_agn``.

    Args:
        period: local steps between commits (≥ 1); default 3 (AGN divides the delta by it).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see ``AsyncMPIStrategy``) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/agn/``.
    """

    def __init__(self, period: int = 3, progress_interval: float = 5e-4, **kwargs: Any) -> None:
        super().__init__(rule=AGNRule(period=period, progress_interval=progress_interval), **kwargs)  # type: ignore[call-arg]


class ADAGOptions:
    """ADAG (Hermans 2017): commit delta / (‖θ̃ − θ̃_pulled‖²/η + 1), global norm. ``mpi_adag``.

    Args:
        period: local steps between commits (≥ 1); default 5 (dist-keras).
        eta: η > 0; default 0.1 (a commit is halved once the center moved by ‖·‖² = η since the pull).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see ``AsyncMPIStrategy``) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/adag/``.
    """

    def __init__(self, period: int = 5, eta: float = 0.1, progress_interval: float = 5e-4, **kwargs: Any) -> None:
        rule = ADAGRule(period=period, eta=eta, progress_interval=progress_interval)
        super().__init__(rule=rule, **kwargs)  # type: ignore[call-arg]


class DynSGDOptions:
    """DynSGD: commit delta / (staleness + 1). ``mpi_dynsgd``.

    Args:
        period: local steps between commits (≥ 1); default 5.
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see ``AsyncMPIStrategy``) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/dynsgd/``.
    """

    def __init__(self, period: int = 5, progress_interval: float = 5e-4, **kwargs: Any) -> None:
        super().__init__(rule=DynSGDRule(period=period, progress_interval=progress_interval), **kwargs)  # type: ignore[call-arg]


class AEASGDOptions:
    """Asynchronous EASGD (Zhang et al. 2015) against the sharded center. ``mpi_aeasgd``.

    Args:
        period: τ, local steps between elastic exchanges (≥ 1); default 8.
        alpha: α in (0, 1]; ``None`` = 0.9 / world size.
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see ``AsyncMPIStrategy``) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/aeasgd/``.
    """

    def __init__(self, period: int = 8, alpha: Optional[float] = None, progress_interval: float = 5e-4,
                 **kwargs: Any) -> None:
        rule = AEASGDRule(period=period, alpha=alpha, progress_interval=progress_interval)
        super().__init__(rule=rule, **kwargs)  # type: ignore[call-arg]


class EAMSGDOptions:
    """Asynchronous EASGD with Nesterov momentum (Zhang et al. 2015). ``mpi_eamsgd``.

    Use plain SGD without momentum in ``configure_optimizers``: the rule adds Nesterov momentum.

    Args:
        period: τ (≥ 1); default 8.
        alpha: α in (0, 1]; ``None`` = 0.9 / world size.
        momentum: δ in [0, 1); default 0.9 (dist-keras; Zhang et al. use 0.99). With
            ``momentum_correction=True`` the rule runs with max(0, δ − (1 − 1/W)).
        progress_interval: seconds between the progress thread's ``Iprobe`` calls.
        **kwargs: ``momentum_correction`` (see ``AsyncMPIStrategy``) and the options every
            strategy takes; ``log_stats`` logs staleness, commits/s, bytes and RMA wait under ``mpi/eamsgd/``.
    """

    def __init__(self, period: int = 8, alpha: Optional[float] = None, momentum: float = 0.9,
                 progress_interval: float = 5e-4, **kwargs: Any) -> None:
        rule = EAMSGDRule(period=period, alpha=alpha, momentum=momentum, progress_interval=progress_interval)
        super().__init__(rule=rule, **kwargs)  # type: ignore[call-arg]


class GoSGDOptions:
    """GoSGD gossip (Blot et al. 2016): push to a random peer with probability p. ``mpi_gosgd``.

    Args:
        p: probability of a push after each step, in (0, 1]; default 0.1.
        seed: seed of each rank's gossip generator (rank added).
        **kwargs: ``momentum_correction`` (see ``AsyncMPIStrategy``) and the options every
            strategy takes; ``log_stats`` logs weight, pushes/s, bytes and time under ``mpi/gosgd/``.
    """

    def __init__(self, p: float = 0.1, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(rule=GoSGDRule(p=p, seed=seed), **kwargs)  # type: ignore[call-arg]
