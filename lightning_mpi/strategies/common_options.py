"""The options every strategy takes, beside its rule's, defined once.

Both frontends (:mod:`.trainer`, :mod:`.fabric`) take them as keyword arguments; the strategy
classes show them in their signatures and docstrings, and ``docs/strategies.md`` in its table,
all from the definitions below.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from lightning_mpi.options import integer, number, option, optional, options_class, validate


def _check_heal(name: str, value: Any) -> Any:
    if value not in (None, "shrink", "replace"):
        raise ValueError(f"{name}={value!r} is not one of None, 'shrink', 'replace'")
    return value


@options_class
class CommonOptions:
    """Options every strategy takes."""

    abort_on_exception: bool = option(
        default=False,
        doc="`False`: an exception on one rank propagates there, and every other rank raises "
        "`lightning_mpi.RankFailedError` naming it within seconds, so `try: trainer.fit(...)` works as with one "
        "process; only an exception nobody catches ends every rank. `True`: the failing rank calls `MPI_Abort` at "
        "once.",
    )
    collective_timeout: float | None = option(
        default=1800.0,
        doc="seconds any collective may wait for the other ranks before it raises `CollectiveTimeout` "
        "(> 0; None waits forever): a rank that hangs, or ranks that run different numbers of steps, are caught "
        "this way.",
        check=optional(number(0.0, math.inf, low_open=True)),
    )
    lr_scaling: Literal["linear", "sqrt"] | None = option(
        default=None,
        doc='`"linear"` multiplies every learning rate by the world size W, `"sqrt"` by √W (Goyal et al. 2017), '
        "for the update only: schedulers, `LearningRateMonitor` and checkpoints see your values. Rank 0 says what "
        "it does; the factor is logged as `mpi/lr_scale`.",
    )
    warmup_steps: int = option(
        default=0,
        doc="linear warm-up of that factor from x1 at optimizer step 0 to the full factor at this step (0: none); "
        "counted in optimizer steps, so it resumes where a checkpoint left off.",
        check=integer(0),
    )
    implicit_momentum_correction: bool = option(
        default=False,
        doc="asynchronous rules only: lower the explicit momentum by the implicit momentum 1 - 1/W that W "
        "asynchronous workers add (Mitliagkas et al. 2016), μ → max(0, μ - (1 - 1/W)), for each update (SGD "
        "`momentum`, Adam-family `betas[0]`, EAMSGD's δ). Rank 0 prints both values; they are logged as "
        "`mpi/momentum_explicit` and `mpi/momentum_implicit`.",
    )

    heal: Literal["shrink", "replace"] | None = option(
        default=None,
        doc="`None`: a lost rank ends the run (`RankFailedError` on every survivor, `--max-restarts` relaunches). "
        '`"shrink"`: the survivors of a rank that died heal the run live and go on training on fewer ranks, with '
        "no step lost or repeated. "
        '`"replace"`: the same, then new processes are spawned back up to the starting world size; each takes the '
        "survivors' weights, optimizer, rule and loop state and trains in step (under Fabric, new ranks join where "
        "the loop calls `fabric.strategy.let_in(state)`). Open MPI with ULFM: launch with `lightning-mpi --heal`; "
        "see docs/faults.md for the rules that heal.",
        check=_check_heal,
    )
    min_ranks: int | None = option(
        default=None,
        doc="with `heal`: with fewer survivors than this, raise `RankFailedError` as without `heal`, so that "
        "`--max-restarts` takes over (>= 1). None: more than half of the ranks the run started with, so that a "
        "network partition never leaves two halves training apart (the side with the majority goes on, the other "
        "stops and writes nothing); 1: go on down to one rank.",
        check=optional(integer(1)),
    )

    def __post_init__(self) -> None:
        validate(self)
        if self.min_ranks is not None and self.heal is None:
            raise ValueError(
                f"min_ranks={self.min_ranks!r} is only read when the run heals: set heal='shrink' or "
                "heal='replace' as well, or leave min_ranks=None"
            )
