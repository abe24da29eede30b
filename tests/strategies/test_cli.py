"""Issue 7: strategies through LightningCLI, rank-0-only output, exchange stats in the user's loggers.

Every multi-rank case runs for real under ``mpiexec -n 2`` with a hard timeout, so a hang fails
fast instead of eating CI. Runs are kept to a few batches: these tests check wiring, not learning
(``tests/test_examples.py`` checks that the examples learn).
"""
from __future__ import annotations

import csv
import re
import runpy
import sys
import textwrap
import time

import pytest

from tests.mpi_utils import REPO, mpi_env, run_mpi

DIGITS = str(REPO / "examples" / "digits.py")
CONFIG = str(REPO / "examples" / "configs" / "digits_easgd.yaml")
MPI_NAMES = ("mpi_allreduce", "mpi_asa", "mpi_asa16", "mpi_easgd", "mpi_downpour", "mpi_adag", "mpi_gosgd")


def _short_run(tmp_path) -> list[str]:
    """A few batches, no sanity check: enough to build the Trainer, exchange and report."""
    return ["--trainer.max_epochs=1", "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=2",
            "--trainer.num_sanity_val_steps=0", "--trainer.enable_progress_bar=false",
            "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}"]


def _strategy_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("strategy=")]
    assert len(lines) == 1, f"expected one strategy= line (rank 0 only), got {lines}\n{stdout[-2000:]}"
    return lines[0]


# -- 1. swapping strategies from the command line and from YAML ------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_strategy_by_registered_name(tmp_path):
    result = run_mpi(2, [DIGITS, "fit", "--trainer.strategy=mpi_easgd", *_short_run(tmp_path)], timeout=280, cwd=tmp_path)
    line = _strategy_line(result.stdout)
    assert line.startswith("strategy=EASGDStrategy rule=easgd period=4 alpha=None"), line
    assert "world_size=2" in result.stdout


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_strategy_by_class_path_with_arguments(tmp_path):
    args = [DIGITS, "fit", "--trainer.strategy=lightning_mpi.EASGDStrategy", "--trainer.strategy.alpha=0.5",
            "--trainer.strategy.period=2", *_short_run(tmp_path)]
    result = run_mpi(2, args, timeout=280, cwd=tmp_path)
    assert _strategy_line(result.stdout) == "strategy=EASGDStrategy rule=easgd period=2 alpha=0.5"


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_strategy_from_yaml_config_file(tmp_path):
    # the file sets period=2, alpha=0.4; the command line overrides the epochs and batches
    result = run_mpi(2, [DIGITS, "fit", f"--config={CONFIG}", *_short_run(tmp_path)], timeout=280, cwd=tmp_path)
    assert _strategy_line(result.stdout) == "strategy=EASGDStrategy rule=easgd period=2 alpha=0.4"


def _digits_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run ``examples/digits.py fit ARGS --print_config`` in this process: (exit code, stdout, stderr).

    ``--print_config`` exits before anything is built or launched, so one process is the whole
    story; running it here saves a Lightning import per call (several seconds each on 2 cores)."""
    monkeypatch.setattr(sys, "argv", [DIGITS, "fit", *args, "--print_config"])
    monkeypatch.syspath_prepend(str(REPO / "examples"))  # as `python examples/digits.py` has it: digits_data
    digits = runpy.run_path(DIGITS, run_name="digits_cli")
    capsys.readouterr()
    with pytest.raises(SystemExit) as ended:
        digits["main"]()
    out = capsys.readouterr()
    return ended.value.code or 0, out.out, out.err


@pytest.mark.timeout(300)
def test_print_config_shows_strategy_and_arguments(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def print_config(*args: str) -> str:
        code, stdout, stderr = _digits_cli(monkeypatch, capsys, *args)
        assert code == 0, stderr[-3000:]
        return stdout

    by_class = print_config("--trainer.strategy=lightning_mpi.EASGDStrategy", "--trainer.strategy.alpha=0.5")
    assert re.search(r"strategy:\n\s+class_path: lightning_mpi\.EASGDStrategy\n\s+init_args:\n\s+period: 4\n\s+alpha: 0\.5\n",
                     by_class), by_class[:1500]
    from_file = print_config(f"--config={CONFIG}")
    assert "class_path: lightning_mpi.EASGDStrategy" in from_file and "alpha: 0.4" in from_file, from_file[:1500]
    assert "strategy: mpi_easgd" in print_config("--trainer.strategy=mpi_easgd")


@pytest.mark.mpi
@pytest.mark.timeout(180)
def test_unknown_strategy_name_exits_with_the_list_on_every_rank(tmp_path):
    start = time.monotonic()
    result = run_mpi(2, [DIGITS, "fit", "--trainer.strategy=mpi_nope", f"--trainer.default_root_dir={tmp_path}"],
                     timeout=170, cwd=tmp_path, check=False)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: unknown strategy 'mpi_nope'")]
    assert len(errors) == 2, f"expected the error once per rank:\n{result.stderr[-3000:]}"
    for name in MPI_NAMES:
        assert all(name in line for line in errors), (name, errors)
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert time.monotonic() - start < 160  # mostly import time; a hang would hit the timeout


# -- 2. rank-0-only output ---------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_rich_progress_bar_and_model_summary_only_on_rank_zero(tmp_path):
    args = [DIGITS, "fit", "--trainer.strategy=mpi_asa", "--trainer.callbacks+=RichProgressBar",
            "--trainer.callbacks+=RichModelSummary", "--trainer.enable_progress_bar=true",
            "--trainer.enable_model_summary=true", "--trainer.max_epochs=1", "--trainer.limit_train_batches=5",
            "--trainer.limit_val_batches=2", "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}"]
    result = run_mpi(2, args, timeout=280, cwd=tmp_path)
    combined = result.stdout + result.stderr
    assert combined.count("Trainable params") == 1, combined[-3000:]
    assert combined.count("MulticlassAccuracy") == 1, combined[-3000:]  # one summary table
    assert len(re.findall(r"Epoch 0/0 ", combined)) == 1, combined[-3000:]  # one progress bar
    assert "5/5" in combined


# -- 3. exchange stats reach the user's loggers -----------------------------------------------------
_LOGGING_SCRIPT = """
    import sys
    import pytorch_lightning as pl
    from pytorch_lightning.demos.boring_classes import BoringModel
    from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger
    from tests.quiet_trainer import QUIET
    import lightning_mpi  # noqa: F401

    strategy, root = sys.argv[1], sys.argv[2]
    trainer = pl.Trainer(
        strategy=strategy, max_steps=12, limit_val_batches=0, log_every_n_steps=2,
        **dict(QUIET, logger=[CSVLogger(root, name="csv", version=0), TensorBoardLogger(root, name="tb", version=0)]),
    )
    trainer.fit(BoringModel())
"""


def _tensorboard_tags(log_dir) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return set(acc.Tags()["scalars"])


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "strategy, expected",
    [
        ("mpi_asa", ["mpi/sync/exchange_seconds", "mpi/sync/wire_bytes"]),
        ("mpi_downpour", ["mpi/downpour/staleness_mean", "mpi/downpour/staleness_max", "mpi/downpour/bytes_sent",
                          "mpi/downpour/wait_seconds"]),
    ],
)
def test_exchange_stats_in_csv_and_tensorboard(strategy, expected, tmp_path):
    script = tmp_path / "log_stats.py"
    script.write_text(textwrap.dedent(_LOGGING_SCRIPT))
    run_mpi(2, [str(script), strategy, str(tmp_path)], timeout=280, cwd=tmp_path)

    with open(tmp_path / "csv" / "version_0" / "metrics.csv") as f:
        csv_keys = set(next(csv.reader(f)))
    tb_keys = _tensorboard_tags(tmp_path / "tb" / "version_0")
    for keys, where in ((csv_keys, "metrics.csv"), (tb_keys, "TensorBoard events")):
        for key in expected:
            assert key in keys, f"{key} missing from {where}: {sorted(keys)}"


# -- 4. convergence aids (issue 9) from the command line ----------------------------------------------
@pytest.mark.timeout(300)
def test_print_config_shows_convergence_aids_through_kwargs(tmp_path, monkeypatch, capsys):
    # The strategies pass the common options on with **kwargs; jsonargparse must still see them.
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = _digits_cli(
        monkeypatch, capsys, "--trainer.strategy=lightning_mpi.DownpourStrategy",
        "--trainer.strategy.implicit_momentum_correction=true", "--trainer.strategy.lr_scaling=sqrt",
        "--trainer.strategy.warmup_steps=7", "--trainer.strategy.collective_timeout=60")
    assert code == 0, stderr[-3000:]
    assert re.search(r"class_path: lightning_mpi\.DownpourStrategy\n\s+init_args:\n\s+period: 5\n\s+progress_interval: 0\.0005\n"
                     r"\s+implicit_momentum_correction: true\n\s+log_stats: true\n\s+abort_on_exception: false\n"
                     r"\s+collective_timeout: 60\.0\n\s+lr_scaling: sqrt\n\s+warmup_steps: 7\n", stdout), stdout[:2000]
    code, _, stderr = _digits_cli(monkeypatch, capsys, "--trainer.strategy=lightning_mpi.SyncStrategy",
                                  "--trainer.strategy.lr_scaling=cubic")
    assert code != 0 and "lr_scaling" in stderr and "cubic" in stderr, stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_convergence_aids_from_the_command_line_are_announced_once(tmp_path):
    args = [DIGITS, "fit", "--trainer.strategy=lightning_mpi.DownpourStrategy", "--trainer.strategy.implicit_momentum_correction=true",
            "--trainer.strategy.lr_scaling=sqrt", "--trainer.strategy.warmup_steps=3", *_short_run(tmp_path)]
    result = run_mpi(2, args, timeout=280, cwd=tmp_path)
    combined = result.stdout + result.stderr
    assert combined.count("lr_scaling='sqrt': learning rates x1.414 (√W, world size 2), reached after 3 warm-up steps") == 1, combined[-3000:]
    assert combined.count("implicit momentum of 1 - 1/W = 0.5") == 1, combined[-3000:]
    assert "SGD momentum 0.9 -> 0.4" in combined
