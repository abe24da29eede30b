"""comm/errors: one rank's failure becomes a RankFailedError on the others; on one rank here, the
failing rank's own view (posting, the thread hand-over, generations). Three ranks telling each
other are in test_comm_on_three_ranks.py."""

import pickle

import pytest

from lightning_mpi.comm.errors import ErrorChannel, RankFailedError, describe
from lightning_mpi.comm.transport import Transport


def test_describe_names_the_type_and_the_message():
    assert describe(ValueError("bad lr")) == "ValueError: bad lr"
    assert describe(KeyboardInterrupt()) == "KeyboardInterrupt"


def test_rank_failed_error_says_who_and_survives_pickling():
    error = RankFailedError(2, "ValueError: bad lr")
    assert "rank 2 failed with ValueError: bad lr" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.rank, copy.error, str(copy)) == (2, "ValueError: bad lr", str(error))


@pytest.fixture
def channel(MPI):
    channel = ErrorChannel(MPI.COMM_SELF, linger_seconds=0.0)
    yield channel
    channel.close()


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
