"""The core both frontends' strategies hold: checks before any collective, one definition of what
the user reads and sets (world size 1, in this process)."""

from __future__ import annotations

import pytest

from lightning_mpi.strategies.core import CoreAttribute, StrategyCore
from lightning_mpi.strategies.lightning_api import fabric_api
from lightning_mpi.strategies.replacement import LoopAccess

pytestmark = pytest.mark.timeout(120)

LOOP = LoopAccess(snapshot=lambda _: {}, step=lambda _: 0, batches_done=lambda _: 0)


def _no_environment():
    raise AssertionError("the environment (a collective) was built before the arguments were checked")


@pytest.mark.parametrize(
    ("rule", "options", "named"),
    [
        ("SyncRule()", {}, "rule="),
        (None, {"collective_timeout": 0}, "collective_timeout=0"),
        (None, {"implicit_momentum_correction": True}, "implicit_momentum_correction=True"),
        (None, {"min_ranks": 2}, "min_ranks=2"),
    ],
)
def test_every_argument_is_checked_before_the_first_collective(rule, options, named):
    with pytest.raises(ValueError, match=named):
        StrategyCore(rule, options, fabric_api("lightning_fabric"), _no_environment, lambda state: None, LOOP)


def _core_attributes(cls: type) -> dict[str, CoreAttribute]:
    return {name: value for name, value in vars(cls).items() if isinstance(value, CoreAttribute)}


def test_both_frontends_show_the_same_core_attributes_with_the_cores_docs():
    from lightning_mpi.strategies.build import fabric_classes, trainer_classes

    trainer = _core_attributes(trainer_classes("pytorch_lightning")["MPIStrategy"])
    fabric = _core_attributes(fabric_classes("lightning_fabric")["MPIStrategy"])
    assert set(trainer) == set(fabric) >= {"rule", "bound_rule", "transport", "collective_timeout"}
    for name, attribute in trainer.items():
        assert attribute.__doc__ and attribute.__doc__ == getattr(StrategyCore, name).__doc__, name


@pytest.mark.parametrize("package", ["pytorch_lightning", "lightning_fabric"])
def test_a_core_attribute_reads_and_sets_through_the_core(package):
    import lightning_mpi.lightning_fabric
    from lightning_mpi import EASGDStrategy

    cls = EASGDStrategy if package == "pytorch_lightning" else lightning_mpi.lightning_fabric.EASGDStrategy
    strategy = cls(alpha=0.5, collective_timeout=30.0, lr_scaling="sqrt", warmup_steps=3)
    assert strategy.rule is strategy._core.runner.rule and strategy.rule.alpha == 0.5
    assert strategy.bound_rule is None
    assert (strategy.lr_scaling, strategy.warmup_steps, strategy.implicit_momentum_correction) == ("sqrt", 3, False)
    assert strategy.collective_timeout == 30.0 and strategy.abort_on_exception is False
    strategy.collective_timeout = 5
    assert strategy._core.failures.timeout == 5.0
    with pytest.raises(ValueError, match="collective_timeout=-1"):
        strategy.collective_timeout = -1
    with pytest.raises(AttributeError, match="'rule'"):
        strategy.rule = None
    assert strategy.transport is strategy._core.failures.transport
    assert strategy.stats() == {}
