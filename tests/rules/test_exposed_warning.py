"""The slow-exchange warning of the every-step rules, with an injected clock (no MPI)."""

import warnings

import pytest

from lightning_mpi.rules.exposed_warning import (
    WARMUP,
    WINDOW,
    ExposedExchangeWarning,
    exposed_exchange_message,
)


def test_the_message_names_both_times_and_the_fix_only_past_w_minus_1_steps_of_compute():
    assert exposed_exchange_message("the every-step asa exchange (wire=fp16)", 0.049, 0.05, world=2) is None
    text = exposed_exchange_message("the every-step asa exchange (wire=fp16)", 0.06, 0.05, world=2)
    assert "asa exchange (wire=fp16)" in text and "60 ms" in text and "50 ms" in text
    assert "2 ranks process fewer samples per second" in text and "mpi_auto" in text
    assert exposed_exchange_message("x", 0.06, 0.05, world=3) is None  # 3 ranks: up to 2 steps' compute
    assert exposed_exchange_message("x", 0.10, 0.05, world=3) is not None
    assert exposed_exchange_message("x", 9.0, 0.05, world=1) is None  # nothing to exchange


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _steps(warning: ExposedExchangeWarning, clock: Clock, compute: float, wait: float, n: int) -> None:
    for _ in range(n):
        clock.now += compute
        warning.wait_begins()
        clock.now += wait
        warning.wait_ends()
        clock.now += 0.001  # the optimizer step: neither
        warning.step_ends()


@pytest.mark.parametrize(("wait", "warns"), [(0.12, True), (0.08, False)])
def test_rank_0_warns_once_from_the_medians_after_the_warm_up(wait, warns):
    clock = Clock()
    warning = ExposedExchangeWarning("the exchange", rank=0, world=2, clock=clock)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _steps(warning, clock, compute=0.1, wait=5.0, n=WARMUP)  # warm-up steps are not timed
        _steps(warning, clock, compute=0.1, wait=wait, n=WINDOW - 1)
        assert not seen and warning.armed
        _steps(warning, clock, compute=0.1, wait=wait, n=1)
        assert len(seen) == int(warns) and warning.warned is warns and not warning.armed
        _steps(warning, clock, compute=0.1, wait=5.0, n=3 * WINDOW)  # decided: never again
    assert len(seen) == int(warns)


def test_other_ranks_one_rank_and_a_disarmed_warning_never_warn():
    for warning in (ExposedExchangeWarning("x", rank=1, world=2), ExposedExchangeWarning("x", rank=0, world=1)):
        assert not warning.armed
    clock = Clock()
    warning = ExposedExchangeWarning("x", rank=0, world=2, clock=clock)
    warning.disarm()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _steps(warning, clock, compute=0.01, wait=1.0, n=WARMUP + WINDOW + 1)
    assert not seen
