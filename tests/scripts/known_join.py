"""For the test scripts with ``heal="replace"`` (``heal_train.py``, ``hybrid_heal.py``): the
survivors wait for a replacement at the first batch after its spawn instead of training on
meanwhile, so that it joins at a known step (the spawn's batch + 2). The look at whether the spawn
(in a thread of its own) has ended, and rank 0's poll of whether the new processes are ready, which
both answer at once, are made to wait for them (up to the join's timeout), in these scripts only."""

import time

import lightning_mpi.strategies.replacement as replacement
from lightning_mpi.comm.respawn import JOIN_TIMEOUT


def _waiting(answers_at_once):
    def waits(*args) -> bool:
        deadline = time.monotonic() + JOIN_TIMEOUT
        while not answers_at_once(*args):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    return waits


def survivors_wait_for_the_join() -> None:
    replacement.Growing.done = _waiting(replacement.Growing.done)
    replacement.poll_ready = _waiting(replacement.poll_ready)
