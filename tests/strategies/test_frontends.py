"""Every Lightning frontend in one environment: names, classes, instances, bad values, imports, CLI."""
from __future__ import annotations

import importlib
import pickle
import subprocess
import sys

import pytest

import lightning_mpi
from lightning_mpi.strategies.build import EXPORTS, STRATEGY_RULES
from tests.mpi_utils import REPO, mpi_env

pytestmark = pytest.mark.timeout(120)

#: frontend package -> (where its registry lives, the attribute)
REGISTRIES = {
    "pytorch_lightning": ("pytorch_lightning.strategies", "StrategyRegistry"),
    "lightning.pytorch": ("lightning.pytorch.strategies", "StrategyRegistry"),
    "lightning_fabric": ("lightning_fabric.strategies", "STRATEGY_REGISTRY"),
    "lightning.fabric": ("lightning.fabric.strategies", "STRATEGY_REGISTRY"),
}


def classes_of(package: str):
    return importlib.import_module(EXPORTS[package])


@pytest.mark.parametrize("package", list(REGISTRIES))
def test_every_name_is_registered_and_builds_the_frontends_class(package):
    module, attribute = REGISTRIES[package]
    registry = getattr(importlib.import_module(module), attribute)
    base = importlib.import_module(module).__dict__.get("ParallelStrategy") or importlib.import_module(
        module.replace(".strategies", ".strategies.parallel")).ParallelStrategy
    for name, (class_name, params, _) in lightning_mpi.STRATEGIES.items():
        strategy = registry.get(name)
        assert type(strategy) is getattr(classes_of(package), class_name), name
        assert isinstance(strategy, base), name
        for key, value in params.items():
            assert getattr(strategy.rule, key) == value, (name, key)


def test_instances_are_accepted_by_their_own_package():
    import lightning as L
    import lightning_fabric
    import pytorch_lightning as pl

    from tests.quiet_trainer import QUIET as quiet

    trainer = L.Trainer(strategy=lightning_mpi.lightning.SyncStrategy(exchange="asa", wire="fp16"), **quiet)
    assert trainer.strategy.rule.wire == "fp16"
    trainer = pl.Trainer(strategy=lightning_mpi.EASGDStrategy(alpha=0.5), **quiet)
    assert trainer.strategy.rule.alpha == 0.5
    fabric = L.Fabric(strategy=lightning_mpi.fabric.GoSGDStrategy(p=0.3), accelerator="cpu")
    assert fabric.strategy.rule.p == 0.3
    fabric = lightning_fabric.Fabric(strategy=lightning_mpi.lightning_fabric.DownpourStrategy(period=2), accelerator="cpu")
    assert fabric.strategy.rule.period == 2


def test_a_strategy_of_the_other_package_is_refused_by_lightning():
    # Documented: each package takes the classes built on it (README, "Which import path").
    import lightning as L

    with pytest.raises(ValueError, match="lightning.pytorch.strategies.Strategy"):
        L.Trainer(strategy=lightning_mpi.SyncStrategy())


@pytest.mark.parametrize("package", list(EXPORTS))
def test_bad_values_name_the_argument_at_construction(package):
    classes = classes_of(package)
    with pytest.raises(ValueError, match=r"alpha=2\.0 is out of range"):
        classes.EASGDStrategy(alpha=2.0)
    with pytest.raises(ValueError, match=r"collective_timeout=0 is out of range"):
        classes.SyncStrategy(collective_timeout=0)
    with pytest.raises(ValueError, match=r"lr_scaling='cubic'"):
        classes.GoSGDStrategy(lr_scaling="cubic")
    with pytest.raises(ValueError, match=r"implicit_momentum_correction='yes'"):
        classes.DownpourStrategy(implicit_momentum_correction="yes")


def test_one_rule_class_serves_every_frontend():
    # No strategy is written per package: every frontend's class trains the same rule class, takes
    # its options, and sits directly on the frontend's MPIStrategy (AsyncMPIStrategy for
    # asynchronous rules), which sits directly on Lightning's ParallelStrategy.
    for class_name, rule_class in STRATEGY_RULES.items():
        for package in EXPORTS:
            module = classes_of(package)
            cls = getattr(module, class_name)
            assert cls.rule_class is rule_class
            parent = module.AsyncMPIStrategy if rule_class.asynchronous else module.MPIStrategy
            assert cls.__mro__[1] is parent, (package, class_name)
            assert module.MPIStrategy.__mro__[1].__name__ == "ParallelStrategy"
            assert cls.__module__ == EXPORTS[package]
            assert cls.__doc__.split("\n")[0] == rule_class.__doc__.split("\n")[0]


@pytest.mark.parametrize("package", list(EXPORTS))
def test_strategies_pickle_by_reference(package):
    cls = classes_of(package).EASGDStrategy
    assert pickle.loads(pickle.dumps(cls)) is cls


def _python(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=mpi_env(), capture_output=True, text=True,
                            timeout=100, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def test_import_lightning_mpi_imports_neither_torch_nor_lightning():
    loaded = _python(
        "import sys, lightning_mpi; "
        "print(sorted(m for m in ('torch', 'pytorch_lightning', 'lightning', 'lightning_fabric') if m in sys.modules))"
    )
    assert loaded == "[]"


@pytest.mark.parametrize("order", ["lightning first", "lightning_mpi first"])
def test_the_unified_package_alone_loads_no_standalone_package(order):
    imports = "import lightning as L; import lightning_mpi" if order == "lightning first" else \
        "import lightning_mpi; import lightning as L"
    loaded = _python(
        f"import sys; {imports}; "
        "t = L.Trainer(strategy='mpi_asa16', logger=False); f = L.Fabric(strategy='mpi_gosgd', accelerator='cpu'); "
        "print(type(t.strategy).__module__, type(f.strategy).__module__, "
        "sorted(m for m in ('pytorch_lightning', 'lightning_fabric') if m in sys.modules))"
    )
    assert loaded == "lightning_mpi.lightning lightning_mpi.fabric []"


def test_the_standalone_package_alone_loads_no_unified_package():
    loaded = _python(
        "import sys, lightning_mpi, pytorch_lightning as pl; t = pl.Trainer(strategy='mpi_easgd', logger=False); "
        "print(type(t.strategy).__module__, 'lightning' in sys.modules)"
    )
    assert loaded == "lightning_mpi False"


@pytest.mark.parametrize("args, rule_class, alpha", [
    (["--trainer.strategy=mpi_easgd"], "EASGDRule", None),
    (["--trainer.strategy=lightning_mpi.lightning.EASGDStrategy", "--trainer.strategy.alpha=0.5"], "EASGDRule", 0.5),
    (["--trainer.strategy=lightning_mpi.lightning.SyncStrategy", "--trainer.strategy.wire=bf16",
      "--trainer.strategy.exchange=asa", "--trainer.strategy.lr_scaling=sqrt"], "SyncRule", None),
])
def test_lightning_cli_of_the_unified_package(args, rule_class, alpha):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    cli = LightningCLI(BoringModel, run=False, args=[*args, "--trainer.logger=false"], save_config_callback=None)
    strategy = cli.trainer.strategy
    assert type(strategy).__module__ == "lightning_mpi.lightning"
    assert type(strategy.rule).__name__ == rule_class
    if alpha is not None:
        assert strategy.rule.alpha == alpha
    if "--trainer.strategy.lr_scaling=sqrt" in args:
        assert strategy.lr_scaling == "sqrt" and strategy.rule.wire == "bf16"
