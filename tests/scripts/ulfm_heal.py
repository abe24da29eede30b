"""A run that loses a rank three times and heals each time (tests/comm/test_ulfm.py).

Usage: ``lightning-mpi --heal -n 3 ulfm_heal.py OUT_DIR`` (Open MPI). Three phases of
STEPS steps; at step KILL_AT of each, the last rank writes the time to ``OUT_DIR/kill.<phase>``
and SIGKILLs itself:

1. ``allreduce``: blocking ``Transport.allreduce_`` of a torch tensor;
2. ``iallreduce``: ``Iallreduce`` polled with ``Test`` between bits of computation, as the
   overlapped buckets are (the rank killed is the replacement spawned after phase 1);
3. ``window``: one-sided adds into a :class:`ShardedVector` served by a progress thread, while the
   main thread computes without MPI calls and checks its error channel between steps; at the kill
   step the survivors compute until the thread reports the loss, so that the progress thread is
   what notices however late ULFM's detector fires (the rank killed is the replacement spawned
   after phase 2).

On :class:`ProcessFailed` the survivors :func:`heal_run`, agree on the first step that not all of
them completed and redo it; after phases 1 and 2 they :func:`grow_run` one replacement, which runs
this script, :func:`join_run`\\ s, learns the phase and step from rank 0 and takes part. Every step
each rank contributes 1.0, so a step's sum is the size of the communicator it ran on. Each
process writes ``OUT_DIR/out.<pid>.json``: its sums, what it caught, and the timings.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from mpi4py import MPI

from lightning_mpi.comm.healing import HealedRun, build_run, grow_run, heal_run, join_run
from lightning_mpi.comm.progress import ProgressThread
from lightning_mpi.comm.errors import ProcessFailed, failures_raised
from lightning_mpi.comm.ulfm import mark_finished
from lightning_mpi.comm.window import ShardedVector

torch.set_num_threads(1)
OUT = Path(sys.argv[1])
PHASES = ("allreduce", "iallreduce", "window")
STEPS, KILL_AT, NUMEL, TIMEOUT, THREAD_WAIT = 24, 8, 12, 60.0, 30.0


class Run:
    """This process's side of the run: its rebuilt pieces, position and records."""

    def __init__(self) -> None:
        joined = join_run(TIMEOUT)
        self.spawned = joined is not None
        if joined is None:
            base = MPI.COMM_WORLD.Dup()
            self.run = HealedRun(base, *build_run(base, TIMEOUT))
            self.phase, self.step = 0, 0
        else:
            self.run = joined
            self.phase, self.step = self.transport.broadcast_object(None)
        self.sums: dict[str, dict[int, float]] = {p: {} for p in PHASES}
        self.sizes: dict[str, dict[int, int]] = {p: {} for p in PHASES}
        self.events: list[dict] = []
        self.window: ShardedVector | None = None
        self.thread: ProgressThread | None = None
        self.adds = 0
        self.window_check: dict | None = None

    @property
    def name(self) -> str:
        return PHASES[self.phase]

    @property
    def transport(self):
        return self.run.transport

    # -- the one-sided phase's pieces, rebuilt on every transport ------------------------------------
    def open_window(self) -> None:
        t = self.transport
        self.window = ShardedVector(t.comm, NUMEL, resources=t.resources)
        self.window.init_local(torch.zeros(NUMEL))
        self.thread = ProgressThread.probing(
            t.comm, 0.0005, "ulfm test window", resources=t.resources, on_error=t.report_thread_failure
        )
        self.adds = 0
        t.barrier(agree=True)

    def close_window(self) -> None:
        if self.thread is not None:
            self.thread.close()
        self.window, self.thread = None, None  # never touched again: its memory is freed by the heal

    # -- one step of each phase ---------------------------------------------------------------------
    def run_step(self) -> None:
        t = self.transport
        if self.step == KILL_AT and t.rank == t.size - 1 and self.name != "window":
            self.die()  # once per phase: a replacement joins at this step and must live
        ones = torch.ones(4)
        if self.name == "allreduce":
            t.allreduce_(ones)
            self.record(float(ones[0]))
        elif self.name == "iallreduce":
            request = t.comm.Iallreduce(MPI.IN_PLACE, ones.numpy())
            with failures_raised(t.comm, "iallreduce"):
                while not request.Test():
                    sum(i * i for i in range(2000))  # backward, in between polls
            self.record(float(ones[0]))
        else:
            if self.window is None:
                self.open_window()
            if self.step == KILL_AT and t.rank == t.size - 1:
                self.die()
            if self.step == KILL_AT and not (OUT / "healed.window").exists():
                self.await_thread_error()  # until the loss is healed: after it, step KILL_AT is redone
            with failures_raised(t.comm, "a window"):
                self.window.add(torch.ones(NUMEL))
            self.adds += 1
            deadline = time.perf_counter() + 0.004
            while time.perf_counter() < deadline:  # computing, no MPI call: only the thread probes
                sum(i * i for i in range(500))
            if self.thread.error is not None:  # what errors.check() raises first (report_thread_failure)
                raise self.thread.error
            self.record(float(t.size))

    def await_thread_error(self) -> None:
        """Compute without MPI calls until the progress thread reports the loss (at most
        THREAD_WAIT seconds), then raise it, so that the thread is what notices however slowly ULFM's detector
        propagates on a loaded machine: a survivor that went on would reach the final barrier and
        notice there first."""
        deadline = time.perf_counter() + THREAD_WAIT
        while self.thread.error is None and time.perf_counter() < deadline:
            sum(i * i for i in range(500))
        if self.thread.error is not None:
            raise self.thread.error

    def record(self, total: float) -> None:
        self.sums[self.name][self.step] = total
        self.sizes[self.name][self.step] = self.transport.size
        if self.events and self.events[-1]["next_step_at"] is None:
            self.events[-1]["next_step_at"] = time.time()  # the first step completed after a heal

    def die(self) -> None:
        """SIGKILL this process, the first time in this phase."""
        marker = OUT / f"kill.{self.name}"
        if marker.exists():
            return
        marker.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    # -- failures --------------------------------------------------------------------------------------
    def heal(self, failure: ProcessFailed) -> None:
        detected = time.time()
        run = self.run = heal_run(self.transport, self.run.base, before_release=self.close_window)
        # A survivor may have completed the interrupted step while another did not: redo from the
        # first step that not every survivor completed.
        self.step = min(self.transport.allgather_object(self.step))
        healed_collective_at = time.time()  # the first collective completed on the healed communicator
        event = {
            "healed_collective_at": healed_collective_at,
            "phase": self.name,
            "caught": type(failure).__name__,
            "where": failure.where,
            "error_class": failure.error_class,
            "ranks": list(failure.ranks),
            "detected_at": detected,
            "lost": list(run.healed.lost),
            "old_ranks": list(run.healed.old_ranks),
            "heal_seconds": run.healed.seconds,
            "shrinks": run.healed.shrinks,
            "size": self.transport.size,
            "next_step_at": None,
        }
        self.events.append(event)
        if self.name == "window":
            (OUT / "healed.window").touch()
            self.open_window()
            return
        event["respawn_started_at"] = time.time()
        run = self.run = grow_run(run, __file__, [str(OUT)])
        self.transport.broadcast_object((self.phase, self.step))  # the new rank's position
        event["respawned_at"] = time.time()
        event["size_after_respawn"] = self.transport.size
        event["respawn_attempts"] = run.respawned.attempts

    def finish(self) -> dict:
        if self.window is not None:
            self.transport.barrier()
            total = self.window.read(torch.zeros(NUMEL))
            adds = self.transport.allgather_object(self.adds)
            self.close_window_collectively(total, adds)
        return {
            "spawned": self.spawned,
            "rank": self.transport.rank,
            "size": self.transport.size,
            "sums": self.sums,
            "sizes": self.sizes,
            "events": self.events,
            "window": self.window_check,
        }

    def close_window_collectively(self, total: torch.Tensor, adds: list[int]) -> None:
        self.window_check = {"total": total.tolist(), "adds": adds}
        self.thread.close()
        self.window.free()
        self.window = self.thread = None


def main() -> None:
    run = Run()
    while run.phase < len(PHASES):
        try:
            while run.step < STEPS:
                run.run_step()
                run.step += 1
            if run.name != "window":
                run.phase, run.step = run.phase + 1, 0
                continue
            result = run.finish()
            break
        except ProcessFailed as failure:
            run.heal(failure)
    result["clean_exit"] = True
    (OUT / f"out.{os.getpid()}.json").write_text(json.dumps(result))
    mark_finished(run.run.base)  # lightning-mpi --heal: a lost replacement is no failure of the job
    run.run.close()  # before MPI_Finalize: see lightning_mpi.comm.ulfm.free


if __name__ == "__main__":
    main()
