"""comm/errors: one rank's failure becomes a RankFailedError on the others; on one rank here, the
failing rank's own view (posting, the thread hand-over, generations). Three ranks telling each
other are in test_comm_on_three_ranks.py; dead ranks under ULFM in test_ulfm.py."""

import pickle

import pytest

from lightning_mpi.comm.errors import ErrorChannel, ProcessFailed, RankFailedError, describe, process_failure
from lightning_mpi.comm.transport import Transport


def test_describe_names_the_type_and_the_message():
    assert describe(ValueError("bad lr")) == "ValueError: bad lr"
    assert describe(KeyboardInterrupt()) == "KeyboardInterrupt"


def test_rank_failed_error_says_who_and_survives_pickling():
    error = RankFailedError(2, "ValueError: bad lr")
    assert "rank 2 failed with ValueError: bad lr" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rank, copy.error, str(copy)) == (2, "ValueError: bad lr", str(error))


@pytest.mark.timeout(10)
def test_process_failed_is_a_rank_failure_that_names_the_ranks():
    failed = ProcessFailed((3, 1), "allreduce", "MPI_ERR_PROC_FAILED")
    assert isinstance(failed, RankFailedError) and failed.ranks == (1, 3) and failed.rank == 1
    assert str(failed) == (
        "lightning_mpi: ranks 1, 3 of the communicator died (MPI_ERR_PROC_FAILED in allreduce); "
        "the survivors can heal (lightning_mpi.comm.ulfm.heal)"
    )
    unknown = ProcessFailed((), "a progress thread", "MPI_ERR_REVOKED")
    assert unknown.rank == -1
    assert str(unknown).startswith("lightning_mpi: a rank of the communicator died (MPI_ERR_REVOKED")
    copy = pickle.loads(pickle.dumps(failed))
    assert (type(copy), copy.ranks, copy.where, str(copy)) == (ProcessFailed, failed.ranks, failed.where, str(failed))


@pytest.mark.timeout(10)
def test_process_failure_finds_a_failure_behind_other_exceptions():
    failed = ProcessFailed((2,), "x")
    try:
        try:
            raise failed
        except ProcessFailed as inner:
            raise RuntimeError("a library wrapped it") from inner
    except RuntimeError as outer:
        assert process_failure(outer) is failed
    assert process_failure(ValueError("not a failure")) is None
    assert process_failure(None) is None


class _OneRankDead:
    """A communicator of one rank that this process knows dead (what ``Get_failed`` says under
    ULFM after a peer died)."""

    def __init__(self, MPI):
        self._group = MPI.COMM_SELF.Get_group

    def Get_failed(self):
        return self._group()

    def Get_group(self):
        return self._group()


@pytest.mark.timeout(10)
def test_mpi_err_other_is_a_process_failure_only_on_a_communicator_with_a_dead_rank(MPI):
    """libnbc fails a schedule that meets a dead peer with MPI_ERR_OTHER: with a rank of the
    communicator known dead it heals like MPI_ERR_PROC_FAILED; anywhere else it is the error it is."""
    error = MPI.Exception(MPI.ERR_OTHER)
    failed = process_failure(error, _OneRankDead(MPI), "barrier")
    assert isinstance(failed, ProcessFailed)
    assert (failed.ranks, failed.where, failed.error_class) == ((0,), "barrier", "MPI_ERR_OTHER")
    assert process_failure(error) is None  # no communicator: nothing says a rank died
    assert process_failure(error, MPI.COMM_SELF, "barrier") is None  # nobody dead
    assert process_failure(MPI.Exception(MPI.ERR_TRUNCATE), _OneRankDead(MPI)) is None


@pytest.fixture
def channel(MPI):
    channel = ErrorChannel(MPI.COMM_SELF, linger_seconds=0.0)
    yield channel
    channel.close()


def test_a_send_still_in_flight_when_the_channel_closes_is_kept_for_the_life_of_the_process(MPI):
    """An error or an acknowledgement sent to a rank that died (or is cut off) may never complete.
    Dropped at ``close``, mpi4py would free the request, and Open MPI aborts a process whose freed
    send fails later ("Send error after request freed": seen in an 8-rank partition); one that
    ended with an error is over."""
    from lightning_mpi.comm import resources

    class InFlight:
        def Test(self):
            return False

    class Failed:
        def Test(self):
            raise MPI.Exception(MPI.ERR_OTHER)

    channel = ErrorChannel(MPI.COMM_SELF, linger_seconds=0.0)
    in_flight, failed = (InFlight(), b"payload"), (Failed(), b"")
    channel._sends += [in_flight, failed]
    before = len(resources._PENDING_FOREVER)
    channel.close()
    assert resources._PENDING_FOREVER[before:] == [in_flight]


def test_a_healthy_channel_checks_quietly(channel):
    channel.check()
    assert channel.failure is None and channel.posted is None


def test_after_posting_every_check_raises_a_fresh_error(channel):
    boom = ValueError("boom")
    channel.post(boom)
    channel.post(RuntimeError("later"))  # once per generation: the first error stands
    assert channel.posted is boom
    raised = []
    for _ in range(2):
        with pytest.raises(RankFailedError, match=r"rank 0 failed with ValueError: boom") as info:
            channel.check()
        raised.append(info.value)
    assert raised[0] is not raised[1], "one object re-raised would chain every traceback onto it"
    channel.linger()  # nobody to wait for


def test_a_thread_failure_is_raised_as_itself_first_then_as_the_run_failure(channel):
    error = OSError("disk full")
    channel.post_from_thread(error)
    with pytest.raises(OSError) as info:
        channel.check()
    assert info.value is error
    with pytest.raises(RankFailedError, match="OSError: disk full"):
        channel.check()


def test_the_next_generation_forgets_the_failed_run(channel):
    channel.post(ValueError("boom"))
    channel.next_generation()
    assert channel.generation == 1 and channel.failure is None and channel.posted is None
    channel.check()


def test_transports_watch_the_channel(MPI, channel):
    transport = Transport(MPI.COMM_SELF, errors=channel)
    transport.watch()
    channel.post(ValueError("boom"))
    with pytest.raises(RankFailedError):
        transport.watch()


def test_close_is_safe_twice(MPI):
    channel = ErrorChannel(MPI.COMM_SELF)
    channel.close()
    channel.close()
    assert channel.comm is None
