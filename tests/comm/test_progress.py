"""The exchange scheduler (comm/engine.ExchangeScheduler) in one process, with stand-in requests: the
progress thread may advance exchanges, and what fails there fails in the training thread; and the
progress thread itself (comm/progress.ProgressThread)."""
import threading
import time

import pytest

from lightning_mpi.comm.engine import ExchangeScheduler


class Request:
    """Stands in for an MPI request: completes when the test says so."""

    def __init__(self) -> None:
        self.done = False

    def Test(self) -> bool:  # noqa: N802  (mpi4py's name)
        return self.done


def two_phase(log: list, first: Request, second: Request, fail_after_first: bool = False):
    log.append("sent")
    yield first
    if fail_after_first:
        raise RuntimeError("decode failed")
    log.append("summed")  # ASA: sum, then the Allgather
    yield second
    log.append("done")


def test_another_thread_advances_an_exchange_to_its_next_phase():
    progress, log, first, second = ExchangeScheduler(timeout=5), [], Request(), Request()
    progress.start(two_phase(log, first, second))
    assert log == ["sent"] and len(progress) == 1
    first.done = True
    driver = threading.Thread(target=progress.try_poll)
    driver.start()
    driver.join()
    assert log == ["sent", "summed"], "the second phase must start without the training thread"
    second.done = True
    progress.wait_all()
    assert log == ["sent", "summed", "done"] and len(progress) == 0


def test_an_error_in_the_progress_thread_is_raised_in_the_training_thread():
    progress, log_a, log_b = ExchangeScheduler(timeout=5), [], []
    a1, b1, b2 = Request(), Request(), Request()
    progress.start(two_phase(log_a, a1, Request(), fail_after_first=True))
    progress.start(two_phase(log_b, b1, b2))
    a1.done = True
    driver = threading.Thread(target=progress.try_poll)  # must not raise in its own thread
    driver.start()
    driver.join()
    with pytest.raises(RuntimeError, match="decode failed"):
        progress.poll()
    assert len(progress) == 1, "the other exchange stays in flight"
    b1.done = b2.done = True
    progress.wait_all()
    assert log_b == ["sent", "summed", "done"]


def test_try_poll_never_waits_for_the_training_thread():
    progress = ExchangeScheduler(timeout=5)
    request, second = Request(), Request()
    second.done = True
    progress.start(two_phase([], request, second))
    waiting = threading.Thread(target=progress.wait_all)
    waiting.start()  # holds nothing while it waits, but take the lock to be sure try_poll skips
    with progress._lock:
        begin = time.perf_counter()
        other = threading.Thread(target=progress.try_poll)
        other.start()
        other.join(timeout=2)
        assert not other.is_alive() and time.perf_counter() - begin < 1
    request.done = True
    waiting.join(timeout=5)
    assert not waiting.is_alive()


def test_progress_thread_polls_only_while_running_and_closes_once():
    from lightning_mpi.comm.progress import ProgressThread

    calls, closed = [], []
    thread = ProgressThread(lambda: calls.append(1), 1e-3, "this test", running=False, on_close=lambda: closed.append(1))
    time.sleep(0.05)
    assert calls == [] and thread.alive, "a paused thread makes no calls"
    thread.start()
    deadline = time.perf_counter() + 5
    while len(calls) < 3 and time.perf_counter() < deadline:
        time.sleep(0.01)
    assert len(calls) >= 3
    thread.pause()
    time.sleep(0.05)  # a call already under way may still finish
    paused_at = len(calls)
    time.sleep(0.05)
    assert len(calls) == paused_at
    thread.close()
    thread.close()
    assert not thread.alive and closed == [1]


def test_a_probing_thread_frees_its_private_communicator_through_the_run(MPI):
    from lightning_mpi.comm.progress import ProgressThread
    from lightning_mpi.comm.resources import RunResources, live_handles

    before = live_handles()
    run = RunResources()
    thread = ProgressThread.probing(MPI.COMM_SELF, 1e-3, "this test", resources=run)
    assert thread.alive and run.counts()[1] == 1
    thread.close()
    assert not thread.alive and run.counts()[1] == 0 and live_handles() == before


def test_try_poll_calls_on_idle_only_once_nothing_is_in_flight():
    """A driver pauses itself in ``on_idle``: not while an exchange is in flight, and under the
    engine's lock, so a ``start`` from the training thread cannot slip between the check and it."""
    progress, log, first, second = ExchangeScheduler(timeout=5), [], Request(), Request()
    idle: list[bool] = []
    starters: list[threading.Thread] = []

    def on_idle() -> None:
        # under the lock: another thread cannot start an exchange now
        starter = threading.Thread(target=progress.start, args=(two_phase([], Request(), Request()),))
        starter.start()
        starter.join(timeout=0.2)
        idle.append(starter.is_alive())
        starters.append(starter)

    progress.start(two_phase(log, first, second))
    progress.try_poll(on_idle=on_idle)
    assert idle == [], "an exchange is in flight"
    first.done = True
    progress.try_poll(on_idle=on_idle)
    assert log == ["sent", "summed"] and idle == [], "the Allgather is in flight"
    second.done = True
    progress.try_poll(on_idle=on_idle)
    assert log == ["sent", "summed", "done"]
    assert idle == [True], "on_idle runs once the exchange is done, with the engine locked"
    starters[0].join(timeout=5)
    assert len(progress) == 1  # the exchange the other thread started once the lock was free


class _OneRankDead:
    """A communicator of one rank that this process knows dead (``Get_failed`` under ULFM)."""

    def __init__(self, MPI):  # noqa: N803  (mpi4py's name)
        self._group = MPI.COMM_SELF.Get_group

    def Get_failed(self):  # noqa: N802
        return self._group()

    def Get_group(self):  # noqa: N802
        return self._group()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("how", ["poll", "wait_all"])
def test_libnbcs_generic_error_on_a_communicator_with_a_dead_rank_is_a_lost_rank(MPI, how):  # noqa: N803
    """Open MPI's non-blocking collectives fail a schedule that meets a dead peer with MPI_ERR_OTHER
    ("Error in NBC_Start_round"). Polled from a gradient hook, that once escaped as a plain MPI
    error and aborted a rank that could heal (8 ranks on 4 simulated hosts, a rank killed: 2 ranks
    lost instead of 1, and the job's exit code 1). On the scheduler's communicator with a rank
    known dead it is a ProcessFailed (the run heals); anywhere else it stays the error it is."""
    from lightning_mpi.comm.errors import ProcessFailed

    class Failing:
        def Test(self):  # noqa: N802
            raise MPI.Exception(MPI.ERR_OTHER)

    def exchange():
        yield Failing()

    for comm, expected in ((_OneRankDead(MPI), ProcessFailed), (None, MPI.Exception)):
        progress = ExchangeScheduler(timeout=5, comm=comm)
        if how == "poll":
            progress.start(exchange())
            with pytest.raises(expected) as raised:
                progress.poll()
        else:
            progress.start(exchange())
            with pytest.raises(expected) as raised:
                progress.wait_all()
        if expected is ProcessFailed:
            assert (raised.value.ranks, raised.value.error_class) == ((0,), "MPI_ERR_OTHER")
            assert raised.value.where == "gradient exchange"
