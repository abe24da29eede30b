"""What every parameter-server rule shares: a center variable θ̃ sharded over *all* ranks.

Every rank trains and every rank hosts 1/W of θ̃ in an ``MPI.Win.Allocate`` window (see
:mod:`lightning_mpi.comm.window`): no rank sits idle as a server and none is a bottleneck. A
commit or pull is one atomic accumulate-family RMA operation per shard under a passive-target
``Lock(SHARED)``; a per-rank progress thread lets commits land while the host computes. The
server clock (commits so far) is a counter on rank 0 advanced with ``Fetch_and_op``; each
commit's staleness is ``clock before this commit − clock at this worker's last pull`` (the number
of other commits the worker did not see).

Server-side scalings (DynSGD, ADAG) are computed by the committing worker from values it reads
atomically from the server (the clock, the current center) just before it commits; the add itself
is an atomic ``Accumulate``, so no update is ever lost.

Non-finite values never reach the center. A rank whose local gradients hold inf/NaN (a NaN loss)
skips its own update (:class:`~lightning_mpi.rules.base.LocalStepGuard`, counted in
``skipped_steps``); and if a worker's weights or its commit are non-finite anyway (an optimizer
that overflowed), the commit is dropped, counted in ``skipped_commits`` with one warning, and the
worker restarts from the current center (EAMSGD: with zero momentum).

What a dying worker can and cannot do to the center. A commit is W one-sided operations, one per
shard, each atomic per element (``Accumulate``); the worker's main thread makes them between two
training steps. An exception from the training code (``training_step``, the data, a callback) is
raised inside a step, never between the shard operations of a commit, so the center only ever
holds whole commits. A worker stopped in the middle of a commit (SIGKILL, a segfault, or a
``KeyboardInterrupt`` that Python delivers between two shard operations) leaves the shards it
reached updated and the others not: every element is still the old value or the old value plus
the delta (never a torn float), the center stays finite, but that one commit is partially
applied. Either way the
run ends (an exception fails it on every rank, a lost rank ends the job), the center lives only in
the ranks' memory, and a run resumes from the last checkpoint: checkpoints are written atomically and
their center is read after a barrier, i.e. with every rank's commits so far applied whole and no
commit in flight.

Healing (``heal="shrink"``): the survivors rebuild the center from their own shards and, for a
lost shard, the freshest copy a survivor pulled, cut it anew over themselves and train on;
:mod:`lightning_mpi.rules.server.heal` says what is rebuilt from what and what is lost. A survivor
keeps (:meth:`BoundServerRule.heal_state`) its shard of the center (read again once every survivor
agreed to heal), the center it last pulled and the clock then, the clock on old rank 0, its
counters and momentum. Workers keep their weights; one whose commit was interrupted restarts from
the center. Nothing is redone while training (a commit is one-sided:
:meth:`~BoundServerRule.healable_after_step`); the final commit, the barrier after it and the read
of the center are redone over the survivors on the rebuilt center, a completed last commit not made
twice (:meth:`~BoundServerRule.healable_train_end`). A rank let in (``heal="replace"``) holds no
shard yet: the survivors' shards are re-cut over the grown run (:meth:`~BoundServerRule.hand_over`).

Checkpoints: :meth:`BoundServerRule.state_dict` is collective (the strategy calls it on every
rank when Lightning saves): the whole center (read one-sidedly, unpadded), the server clock, and
every rank's steps, commits and EAMSGD momentum. A resume re-shards the center over the new world
size, resets the clock and gives each rank its own local state (rank ``r mod W_saved``'s when W
changed).

The rules themselves and their defaults: :mod:`lightning_mpi.rules.server.rules`; their formulas:
:mod:`lightning_mpi.rules.server.commits`.
"""

from __future__ import annotations

import time
import warnings
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_mpi.comm.progress import ProgressThread
from lightning_mpi.comm.transport import Transport
from lightning_mpi.comm.window import Counters, DecisionBoard, ShardedVector
from lightning_mpi.options import integer, number, option, options_class
from lightning_mpi.rules.base import BoundLocalStepRule, Execute, Operation, Rule, all_finite, one_sided
from lightning_mpi.rules.easgd import FlatParams
from lightning_mpi.rules.server.commits import staleness
from lightning_mpi.rules.server.heal import gather_and_rebuild, joined_state, padded


@options_class
class ServerRule(Rule):
    """Hyperparameters of a parameter-server rule. Use the subclasses."""

    asynchronous = True

    period: int = option(default=5, doc="local steps between commits (≥ 1).", check=integer(1))
    progress_interval: float = option(
        default=5e-4,
        doc="seconds between the progress thread's `Iprobe` calls, in (0, 1].",
        check=number(0.0, 1.0, low_open=True),
    )

    @abstractmethod
    def bind(self, transport: Transport, params: Sequence[Tensor]) -> BoundServerRule:
        """The rule's own :class:`BoundServerRule` subclass over ``params``."""


class BoundServerRule(BoundLocalStepRule):
    """The running parameter-server rule. Windows and the progress thread live from
    ``on_train_start`` (collective) to ``close()`` (collective).

    A subclass implements :meth:`exchange`, its rule's commit and pull; everything else (windows,
    clock and staleness, dropped commits, checkpoints, statistics) is here.
    """

    #: Start every worker from the center (the delta-committing rules); the elastic rules keep
    #: each worker's own weights.
    starts_from_center = True

    def __init__(self, rule: ServerRule, transport: Transport, params: Sequence[Tensor]) -> None:
        super().__init__(transport, params, rule.name)
        self.rule = rule
        self.flat = FlatParams(self.params, transport.size)
        self.numel = self.flat.bucket.numel
        n = self.flat.flat.numel()
        self.ref = torch.zeros(n, dtype=self.flat.flat.dtype)  # θ at the last pull (= θ̃ pulled)
        self.scratch = torch.zeros_like(self.ref)
        self.momentum_bufs: list[Tensor] = []  # EAMSGD's: zeroed with a dropped commit, checkpointed
        self.steps = 0
        self.commits = 0
        self.skipped_commits = 0  # commits dropped because their delta held inf/NaN
        self.clock_at_pull = 0
        self.final_clock = 0  # the server clock at the end of training (the windows are gone after close)
        # the windows and the progress thread exist from on_train_start to close
        self.center: ShardedVector | None = None
        self.clock: Counters | None = None
        self.board: DecisionBoard | None = None
        self.progress: ProgressThread | None = None
        self.training = False
        self.restored = False  # True once a checkpoint's center and clock went into the windows
        self._pending: dict[str, Any] | None = None
        self.started = False  # on_train_start ran: a heal binds again and starts the new binding
        self._exchanging = False  # inside a commit: a loss there leaves it partly applied (.heal)
        self._final_committed = False  # on_train_end's commit completed: its redo after a heal skips it
        self._kept: dict[str, Any] | None = None  # what heal_state() returned, refreshed at close
        self._healed: dict[str, Any] | None = None  # a heal_state() to rebuild from in on_train_start
        #: the last rebuild after a heal: the center, the clock, the lost ranks, who each was taken from
        self.last_heal: dict[str, Any] | None = None
        self._reset_window_stats()

    def windows(self) -> tuple[ShardedVector, Counters]:
        """The center and the clock; they exist from ``on_train_start`` to ``close``."""
        if self.center is None or self.clock is None:
            raise RuntimeError(f"lightning_mpi: the {self.rule.name} rule's windows exist only while it trains")
        return self.center, self.clock

    # -- lifecycle ---------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        comm, resources = self.transport.comm, self.transport.resources
        # Windows are made by blocking collectives: every rank must be here (and none failed) first.
        self.transport.barrier(agree=True)
        if self.transport.size > 1:
            self.progress = ProgressThread.probing(
                comm,
                self.rule.progress_interval,
                f"{self.rule.name} (a parameter-server rule)",
                resources=resources,
                on_error=self.transport.report_thread_failure,
            )
        self.center = center = ShardedVector(comm, self.ref.numel(), self.ref.dtype, resources=resources)
        self.clock = clock = Counters(comm, 1, resources=resources)
        self.board = DecisionBoard(comm, resources=resources)
        initial = self.flat.pull_host().clone()
        clock0 = 0
        healed, self._healed = self._healed, None
        if healed is None:
            self._final_committed = False  # a new fit (after a heal: as kept)
        if healed is not None:  # after a heal: the center rebuilt over the survivors (.heal)
            self.last_heal = gather_and_rebuild(self.transport, healed)
            initial, clock0 = padded(self.last_heal["center"], self.ref.numel()), int(self.last_heal["clock"])
        elif self._pending is not None:
            initial = self._padded(self._pending["center"])
            clock0 = int(self._pending["clock"])
            self._pending = None
            self.restored = True
        center.init_local(initial)
        if self.transport.rank == 0 and clock0:
            clock.set_all(torch.tensor([clock0]).numpy())
        self.transport.barrier()  # every shard is set before anyone reads or commits (with the timeout)
        self.ref.copy_(initial)
        if healed is not None and not healed["interrupted"] and not healed.get("joined"):
            # this worker's own weights go on, against the center it last pulled (laid out anew)
            self.ref.copy_(padded(healed["ref"][: self.numel], self.ref.numel()))
            clock0 = int(healed["clock_at_pull"])
        elif self.starts_from_center or healed is not None:  # an interrupted commit, a new rank: the center
            self.flat.push(initial)
            if healed is not None:
                for buf in self.momentum_bufs:
                    buf.zero_()
        self.clock_at_pull = clock0
        self.training = True
        self.started = True
        self._t0 = time.perf_counter()

    def _advance(self) -> None:
        """Count one local step; every ``period`` steps, commit."""
        self.steps += 1
        if self.center is not None and self.steps % self.rule.period == 0:
            self.commit()

    def commit(self) -> None:
        """One exchange with the server (see module docstring); a non-finite commit is dropped."""
        assert self.center is not None and self.clock is not None
        theta = self.flat.pull_host()
        if not all_finite([theta]):  # checked before the clock ticks: a dropped commit is no commit
            self._drop_commit()
            return
        self._exchanging = True  # until the commit completed (or was dropped): see .heal
        tick = self.clock.fetch_add(0, 1)
        stale = staleness(tick, self.clock_at_pull)
        if not self.exchange(theta, stale):
            self._drop_commit()
            self._exchanging = False
            return
        self.clock_at_pull = tick + 1
        self.commits += 1
        self._exchanging = False
        self._record_staleness(stale)

    def exchange(self, theta: Tensor, stale: int) -> bool:
        """The rule's commit of this worker's weights ``theta`` (``stale`` commits by others since
        its last pull), then its pull: update :attr:`center`, the parameters and :attr:`ref`.

        Returns ``False``, having committed nothing, when the commit holds inf or NaN."""
        raise NotImplementedError

    def pull_(self, center: Tensor) -> None:
        """Take ``center`` (the center as of this commit) as the weights and the new reference."""
        self.ref.copy_(center)
        self.flat.push(center)

    def _drop_commit(self) -> None:
        """Skip a commit whose values hold inf/NaN: count it, warn once, and restart this worker
        from the current center (its own weights are beyond use; EAMSGD momentum is zeroed)."""
        assert self.center is not None and self.clock is not None
        self.skipped_commits += 1
        if self.skipped_commits == 1:
            warnings.warn(
                f"lightning_mpi: rank {self.transport.rank}'s {self.rule.name} commit holds inf/NaN; it was not "
                "committed (the center is untouched) and this worker restarts from the center. Further "
                "drops are counted in stats()['skipped_commits'] without a warning.",
                RuntimeWarning,
                stacklevel=3,
            )
        self.pull_(self.center.read(self.scratch))
        self.clock_at_pull = int(self.clock.read()[0])
        for buf in self.momentum_bufs:
            buf.zero_()

    def on_train_end(self) -> None:
        """Commit what is left, wait for every rank's last commit, then take the center.

        Every rule, the elastic ones included, commits the steps since its last exchange: the
        center is what every rank ends on, so work that never reached it would be lost (at world
        size 1 a run shorter than ``period`` would end on its initial weights)."""
        if self.center is None:
            return
        self.training = False
        if self.steps % self.rule.period and not self._final_committed:
            self.commit()
        self._final_committed = True  # a redo after a heal does not commit these steps again
        self.transport.barrier()  # every rank's last commit has landed (with the collective timeout)
        assert self.clock is not None  # made with the center
        self.final_clock = int(self.clock.read()[0])
        self.center.read(self.scratch)
        self.flat.push(self.scratch)
        self.ref.copy_(self.scratch)

    def take_center(self, center: Tensor, clock: int) -> None:
        """Leave ``center`` (the final center, as :meth:`on_train_end` leaves it on another rank) in
        the parameters, and ``clock`` as the final clock: that result, for a survivor that missed its
        completion in a heal."""
        self.training = False
        self._final_committed = True
        self.final_clock = clock
        self.flat.push(center.to(self.ref.dtype))
        self.ref.copy_(center)

    # -- healing (module docstring) -------------------------------------------------------------------
    def healable_after_step(self, optimizer: Any, execute: Execute) -> None:
        # a commit is one-sided: a loss a window notices heals here; an interrupted commit is settled
        # by the rebuild of the center, nothing is redone
        execute(one_sided("the commit", lambda bound: bound.after_step(optimizer)))

    def healable_train_end(self, execute: Execute) -> None:
        execute(
            Operation(
                "the final commit",
                lambda bound: bound.on_train_end(),
                result=lambda bound, _: (bound.flat.pull_host().clone(), bound.final_clock),
                take=lambda bound, sent, _: bound.take_center(*sent),
                collective=lambda bound, _: bound.transport.size > 1,
            )
        )

    def hand_over(self, kept: dict[str, Any], joining: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """A rank let in joins as a rank with no shard of the center yet: the survivors' shards are
        re-cut over the grown run (:func:`~lightning_mpi.rules.server.heal.joined_state`)."""
        kept, handed = super().hand_over(kept, joining)
        if isinstance(handed.get("healed"), dict):
            handed["healed"] = joined_state(handed["healed"])
        return kept, handed

    @property
    def restart_after_heal(self) -> bool:
        """Once started, on every survivor alike (training or in ``on_train_end``): the center
        is rebuilt collectively in the new binding's ``on_train_start``."""
        return self.started

    def heal_state(self) -> dict[str, Any]:
        """What a heal keeps, read on this rank alone (:mod:`.heal`): its shard of the center
        and, on old rank 0, the clock (both read again from the windows' memory when the failed
        run is released: :meth:`close`), the center as it last pulled it and the clock then, whether
        a commit was interrupted, its counters and EAMSGD momentum. Before training started:
        nothing (the new binding starts over the survivors when training starts)."""
        if not self.started:
            return {}
        local = None if self.center is None else self.center.local
        if local is None or self.clock is None:
            raise LookupError(
                f"the {self.rule.name} rule's center exists only while it trains, and a rank was lost after it ended"
            )
        hosted = self.clock.hosted()
        self._kept = {
            "old_rank": self.transport.rank,
            "old_world": self.transport.size,
            "numel": self.numel,
            "shard": torch.from_numpy(local.copy()),
            "clock": None if hosted is None else int(hosted[0]),
            "ref": self.ref.clone(),
            "clock_at_pull": self.clock_at_pull,
            "interrupted": self._exchanging,
            "final_committed": self._final_committed,
            **self._local_state(),
            "skipped_commits": self.skipped_commits,
        }
        return {"healed": self._kept}

    def _refresh_kept(self) -> None:
        """The failed run is being released (every survivor agreed to heal, none commits any more):
        read this rank's shard and clock again into what :meth:`heal_state` kept."""
        kept, self._kept = self._kept, None
        if kept is None or self.center is None or self.center.local is None or self.clock is None:
            return
        kept["shard"].copy_(torch.from_numpy(self.center.local))
        hosted = self.clock.hosted()
        if hosted is not None:
            kept["clock"] = int(hosted[0])

    def close(self) -> None:
        if self.transport.abandoned:
            self._refresh_kept()  # before the windows are dropped (they are freed after this)
        if self.training and not self.transport.abandoned:
            # fit did not reach on_train_end, yet the run was not abandoned (a frontend that
            # closes without a failure handler): freeing a window is collective and the other
            # ranks may never join, so leave it to process exit rather than hang.
            self.center = self.clock = self.board = None
        # After a failed run the frees below are no-ops: the next run reclaims the windows.
        self.training = False
        for attr in ("board", "clock", "center"):
            obj = getattr(self, attr)
            if obj is not None:
                obj.free()
                setattr(self, attr, None)
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    # -- state -------------------------------------------------------------------------------------
    def _padded(self, center: Tensor) -> Tensor:
        """A saved (unpadded) center laid out for this world size: re-shards a checkpoint from any W."""
        return padded(center.reshape(-1)[: self.numel].to(self.ref.dtype), self.ref.numel())

    def _local_state(self) -> dict[str, Any]:
        return {"steps": self.steps, "commits": self.commits, "momentum": [b.clone() for b in self.momentum_bufs]}

    def _apply_local_state(self, state: dict[str, Any]) -> None:
        """This rank's steps, commits and momentum: its own entry when the world size is unchanged,
        else rank ``r mod W_saved``'s (the step count, which sets when commits happen, is the same
        on every rank that ran whole epochs)."""
        ranks = state.get("ranks") or [state]
        mine = ranks[self.transport.rank % len(ranks)]
        self.steps = int(mine["steps"])
        self.commits = int(mine.get("commits", 0))
        # a checkpoint of a rule without momentum buffers restores none of them
        for buf, saved in zip(self.momentum_bufs, mine.get("momentum", []), strict=False):
            buf.copy_(saved)

    def state_dict(self) -> dict[str, Any]:
        """Collective (the strategy calls it on every rank): the whole center (read one-sidedly,
        unpadded, so any world size can re-shard it), the server clock, and every rank's own steps,
        commits and EAMSGD momentum under ``"ranks"``; the top-level ``steps``/``commits``/``momentum``
        are this rank's.

        The center is read after a barrier: every rank is inside this call, so no commit is in
        flight and every commit so far is in the snapshot whole (the same snapshot on every rank)."""
        if self.center is not None and self.clock is not None:
            self.transport.barrier()
            center = self.center.read(torch.empty_like(self.ref))
            clock = int(self.clock.read()[0])
        elif self._pending is not None:
            center, clock = self._padded(self._pending["center"]), int(self._pending["clock"])
        else:  # before training (0), or after it: the final center is in the weights (on_train_end)
            center, clock = self.flat.pull_host().clone(), self.final_clock
        local = self._local_state()
        ranks = self.transport.allgather_object(local) if self.transport.size > 1 else [local]
        return {
            "kind": self.rule.name,
            "center": center[: self.numel].clone(),
            "clock": clock,
            "world_size": self.transport.size,
            **local,
            "ranks": ranks,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the center, the clock and this rank's local state (see :meth:`state_dict`)."""
        if not state:  # a heal before training started: nothing kept
            return
        if "healed" in state:  # a heal_state(): counters now, the center in on_train_start
            healed = self._healed = state["healed"]
            self._apply_local_state(healed)
            self.skipped_commits = int(healed["skipped_commits"])
            self._final_committed = bool(healed["final_committed"])
            return
        saved = state.get("kind", self.rule.name)
        if saved != self.rule.name:
            raise ValueError(
                f"lightning_mpi: checkpoint holds {saved!r} rule state, but this run uses {self.rule.name!r}"
            )
        if self.center is None:  # the usual case: restored in on_train_start, once the windows exist
            self._pending = dict(state)
            self._apply_local_state(state)
            return
        # Already running: every rank rewrites its own shard; rank 0 resets the clock.
        center, clock = self.windows()
        center.init_local(self._padded(state["center"]))
        if self.transport.rank == 0:
            clock.set_all(torch.tensor([int(state["clock"])]).numpy())
        self.clock_at_pull = int(state["clock"])
        self._apply_local_state(state)

    # -- stats -------------------------------------------------------------------------------------
    def _reset_window_stats(self) -> None:
        # running aggregates, not a list: stats() may never be called (no logger), and a list
        # would then grow by one entry per commit for the whole run
        self._stale_sum = 0
        self._stale_max = 0
        self._commits_window = 0
        self._t0 = time.perf_counter()
        center = getattr(self, "center", None)  # None before the windows exist (and inside __init__)
        if center is not None:
            center.bytes_sent = 0
            center.wait_seconds = 0.0

    def _record_staleness(self, stale: int) -> None:
        self._stale_sum += stale
        self._stale_max = max(self._stale_max, stale)
        self._commits_window += 1

    def stats(self) -> dict[str, float]:
        """Since the previous call: staleness mean/max, commits/s, bytes sent, seconds in RMA; and
        the run's totals of commits, skipped (non-finite) local steps and dropped commits."""
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        n = self._commits_window
        out = {
            "staleness_mean": float(self._stale_sum / n) if n else 0.0,
            "staleness_max": float(self._stale_max),
            "commits_per_s": n / elapsed,
            "bytes_sent": float(self.center.bytes_sent) if self.center is not None else 0.0,
            "wait_seconds": float(self.center.wait_seconds) if self.center is not None else 0.0,
            "commits": float(self.commits),
            "skipped_steps": float(self.guard.skipped_steps),
            "skipped_commits": float(self.skipped_commits),
        }
        self._reset_window_stats()
        return out
