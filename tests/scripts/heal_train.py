"""Training that loses a rank and heals (``heal="shrink"``), once per phase, in one launch
(tests/strategies/test_heal.py).

Usage: ``lightning-mpi --heal -n 10 heal_train.py OUT_DIR`` (Open MPI with ULFM; CI; or ``-n 12``),
the phases 0 to 4 below; ``lightning-mpi --heal -n 5 heal_train.py OUT_DIR auto`` runs only the
``mpi_auto`` phases (``auto``: Fabric, W 5 -> 4 -> 3 -> 2, a loss inside a decision's probe, one in
its redo's switch, one in the exchange; ``auto_replace``: the Trainer with ``heal="replace"``, 2 -> 1 -> 2);
``lightning-mpi --heal -n 3 --spares 2 heal_train.py OUT_DIR replace_rules`` runs six
``heal="replace"`` phases (``replace_downpour``, ``replace_powersgd``, ``replace_easgd``,
``replace_gosgd``, ``replace_zero``: the Trainer with DOWNPOUR, PowerSGD, EASGD, GoSGD and ZeRO with
Adam, see :func:`_replace_rule_phase`; ``replace_fabric``: a Fabric loop with Adam, see
:func:`replace_fabric_phase`; each loses its last rank at step 1 and lets a replacement in: the
first spare, launch rank 3, in the first phase, a spawned process in the others; the second spare
is never used, a spare waiting in the first phase's strategy construction), then ``drain_heal``
(DOWNPOUR with ``heal="shrink"``, W 3 -> 2: one survivor heals after its last batch, the other while
still training, :func:`drain_heal_phase`);
``lightning-mpi --heal -n 4 heal_train.py OUT_DIR gosgd`` runs only the two
asynchronous phases, each a Fabric loop whose last rank dies at Fabric step FABRIC_KILL, and whose
survivors notice it when they do (no collective while training):

- ``downpour`` (``DownpourStrategy``, the center sharded over the ranks' windows, W 4 -> 3): the
  survivors notice through a progress thread, the error channel or the final barrier, rebuild the
  center (their shards, the lost one from the freshest pull) and train on; they record what went
  into the rebuild, what came out, and every commit they made on the healed run;
- ``gosgd`` (``GoSGDStrategy``, 3 -> 2): the survivors heal, renormalise their gossip weights and
  end in the consensus; they record their drain's (θ, w) and message counts.

0. one Fabric loop per rule whose state a heal carries, each built over the ranks left by the one
   before, its last rank dying at Fabric step FABRIC_KILL (before its backward: the survivors
   find the exchange of that step failed), each finishing FABRIC_STEPS: ``topk`` (top-k with
   error feedback, W 10 -> 9), ``powersgd`` (9 -> 8), ``diloco`` (PERIOD, an outer exchange in
   the kill step; 8 -> 7), ``streaming`` (Streaming DiLoCo, STREAMING: the exchange started at
   the kill step is in flight over the next step; 7 -> 6), ``weights`` (``SyncStrategy(average=
   "weights")``; 6 -> 5). With ``-n 12`` (outside CI) each has two ranks more.
1. ``trainer``: the Trainer on the five left with ``SyncStrategy(exchange="asa", heal="shrink")``
   (gradient hooks, overlapped buckets), ``self.log(..., sync_dist=True)`` every step (Lightning's
   ``reduce``), validation at every epoch's end, a ``ModelCheckpoint`` and an ``EarlyStopping``;
   rank 0 dies in the middle of writing the checkpoint of step SAVE_KILL_CI (its ``torch.save``,
   in the validation at the end of epoch 1): the survivors heal in the save, launch rank 1
   becomes rank 0 and writes it, and the next validation is sharded over the four left (W 5 -> 4).
   With ``-n 12`` the Trainer starts on seven and loses three ranks, each where Lightning is
   elsewhere (W 7 -> 6 -> 5 -> 4):
   - rank 0 SIGKILLs itself at the start of step KILL_STEP (the second batch of the second epoch):
     the survivors heal in the middle of an epoch, launch rank 1 becomes rank 0 (it prints the
     heal lines and writes the checkpoints from then on);
   - launch rank 6 dies at the end of its validation batch at step VAL_KILL (the first validation
     after that heal, its loader sharded anew over six): the survivors heal in the validation's
     epoch-end reduce, and the next validation is sharded over the five left;
   - launch rank 1, rank 0 by then, dies in the middle of writing the checkpoint of step SAVE_KILL
     (its ``torch.save``): the survivors heal in the save, the new rank 0 (launch rank 2) writes it.
   They train on to MAX_STEPS, the training loader sharded anew from each next epoch. From the
   next phase on every process records under its rank after this one (the four left -> 0-3).
1b. ``replace``: a second Trainer run on the four left, ``SyncStrategy(heal="replace")``: the last
   rank dies at step REPLACE_KILL (mid-epoch); the three survivors heal, at the next batch
   spawn a replacement and let it in at the one after; it runs this script (it starts at this
   phase: :func:`main`), joins, takes the survivors' state and the lost rank's shard, and trains
   on with them to REPLACE_STEPS (validation and the default ``ModelCheckpoint`` on); it writes
   under launch rank REPLACEMENT.
2. ``fabric``: then, in the same processes, ``L.Fabric`` with
   ``ModelAveragingStrategy(period=PERIOD, heal="shrink")`` built after that heal (it spans the
   survivors and the replacement); the last of them (the replacement) dies at Fabric step
   FABRIC_KILL, in a period whose weight average the three left then make, and they finish
   FABRIC_STEPS.
3. ``easgd``: the same with ``EASGDStrategy(period=PERIOD)`` on the three left (5 -> 4 -> 3 -> 2).
4. ``min_ranks``: a Fabric run with ``min_ranks=2`` on those two loses one more rank; the survivor
   raises ``RankFailedError`` (what ``--max-restarts`` takes over from).

``lightning-mpi --heal -n 4 heal_train.py OUT_DIR outer`` (outside CI) runs OUTER_PHASES, each on
the processes the one before left, a replacement recording under OUTER_REPLACEMENT + the index
of the phase that spawned it:

- ``topk_replace``, ``diloco_replace``, ``streaming_replace``: the Trainer with ``heal="replace"``
  at W = 4 on top-k with error feedback, DiLoCo (OUTER_PERIOD) and Streaming DiLoCo (STREAMING,
  fp32); the last rank (from the second phase on, the replacement of the phase before) dies at
  step REPLACE_KILL (Streaming DiLoCo: STREAMING_KILL), a replacement joins at step 3 (Streaming
  DiLoCo: ready at step 2 while fragment 0's exchange is in flight, let in at step 3),
  REPLACE_STEPS in all;
- ``diloco_end``: a Fabric loop on ``DiLoCoStrategy(period=OUTER_PERIOD, heal="shrink")``, no loss
  while training; the last rank dies inside ``finish_training``'s final average (W 4 -> 3);
- ``streaming_end``: the Trainer on Streaming DiLoCo (STREAMING_END, fp32, ``heal="shrink"``) for
  END_STEPS without checkpoints, ending with an exchange in flight; the last rank dies inside ``on_train_end``'s final
  average when it is to start fragment END_DIES_AT's exchange (W 3 -> 2).

``lightning-mpi --heal -n 5 heal_train.py OUT_DIR zero`` (outside CI) runs two ZeRO phases
(``SyncStrategy(exchange="asa", shard_optimizer=True, heal="shrink")``, Adam; every rank also keeps
its buddy's shard):

- ``zero``: a Fabric loop; launch rank 4 dies at Fabric step 3 (W 5 -> 4: its shard is rebuilt from
  rank 3's mirror), launch rank 1 at step 6 (W 4 -> 3: from rank 0's mirror), each before its
  backward after a barrier (the survivors find the reduce-scatter of that step failed and redo it);
  ZERO_STEPS in all;
- ``zero_trainer``: the Trainer on the three left, with gradient clipping (by the global norm) and
  a learning-rate schedule, a ``ModelCheckpoint`` at each epoch's end (sharded optimizer files);
  launch rank 3 dies at the start of step ZERO_TRAINER_KILL (W 3 -> 2), ZERO_TRAINER_STEPS in all.

The survivors write their final weights and the whole optimizer state (gathered).

Every process appends a record per step to ``OUT_DIR/steps.<rank>.jsonl`` (its rank at launch):
the phase, step, world size, its batch's sample indices and (Fabric) its own gradients' inputs.
The survivors of each phase write ``OUT_DIR/<phase>.<rank>.json``: initial and final weights,
what the strategy's stats said, its healing history.
"""

import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
OUT, RANK, W = Path("."), 0, 1  # set by main(); the test imports Indexed and make_net without MPI
N, B, LR, VAL = 60, 4, 0.1, 20  # W = 5: 12 samples, 3 batches per rank and epoch; W = 4: 15, 4 batches
KILL_STEP, VAL_KILL, SAVE_KILL, MAX_STEPS = 4, 6, 9, 12  # W = 7: 3 batches per rank and epoch
SAVE_KILL_CI = 6  # -n 10: W = 5, 3 batches per rank and epoch: the checkpoint at the end of epoch 1
FABRIC_KILL, FABRIC_STEPS, PERIOD = 3, 6, 2
REPLACE_KILL, REPLACE_STEPS = 1, 8  # W = 4: 4 batches per rank and epoch
REPLACEMENT = 12  # what a replacement records under: no launch rank
GOSGD_P = 0.5
TOPK_RATIO = 0.25
STREAMING = {"period": 4, "fragments": 2, "overlap_steps": 1, "mix_alpha": 0.5}
# the ``outer`` launch: Streaming DiLoCo at the Trainer's end with an exchange in flight and two more
# fragments to average (fragment 0 starts after step END_STEPS, 1 and 2 have steps since)
STREAMING_END, END_STEPS, END_DIES_AT = {"period": 6, "fragments": 3, "overlap_steps": 1, "mix_alpha": 0.5}, 8, 2
OUTER_PERIOD = 4  # DiLoCo in the ``outer`` launch: outer steps after steps 4 and 8
# its streaming_replace phase: a rank dies at step 0, a replacement is ready at step 2 while fragment 0's
# exchange is in flight, and is let in at step 3 (mid-epoch: no checkpoint completed the exchange)
STREAMING_KILL = 0
ZERO_KILLS, ZERO_STEPS, ZERO_LR = {3: 4, 6: 1}, 9, 0.01  # the zero launch (Fabric): step -> launch rank lost
ZERO_TRAINER_KILL, ZERO_TRAINER_STEPS, ZERO_CLIP, ZERO_GAMMA = 2, 8, 0.5, 0.7  # then the Trainer, W 3 -> 2
AUTO_DECIDES, AUTO_KILL, AUTO_STEPS = 5, 8, 11  # mpi_auto: its first decision after step 5 (PROBE_STEPS)
AUTO_REPLACE_KILL, AUTO_REPLACE_STEPS = 7, 14  # W = 2: 8 batches per rank and epoch
AUTO_END_STEPS, AUTO_END_DIES_AT = 4, 1  # mpi_auto's first arm to the end, before its first decision
DRAIN_STEPS, DRAIN_SLOW_S = 10, 0.5  # the replace_rules launch's last phase: W 3 -> 2, rank 0 slow


class Indexed(Dataset):
    """``N`` regression samples, each with its index (to reconstruct who trained on what)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(N, 6, generator=g)
        self.y = self.x @ torch.randn(6, 1, generator=g) + 0.1 * torch.randn(N, 1, generator=g)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        return i, self.x[i], self.y[i]


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def record(**entry) -> None:
    entry["t"] = round(time.time(), 2)
    with open(OUT / f"steps.{RANK}.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


def weights(net: nn.Module) -> list:
    return [p.detach().double().flatten().tolist() for p in net.parameters()]


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


FROZEN = "frozen.pid"


def freeze() -> None:
    """This rank hangs (SIGSTOP: every thread stopped, nothing answers), after writing its pid to
    OUT/FROZEN; the process beside it kills it (lightning_mpi.comm.watchdog), and the survivors heal."""
    (OUT / FROZEN).write_text(str(os.getpid()))
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGSTOP)


def frozen_rank_alive() -> bool | None:
    """Whether the process that :func:`freeze` stopped still exists (``None``: none froze)."""
    path = OUT / FROZEN
    if not path.exists():
        return None
    try:
        os.kill(int(path.read_text()), 0)
    except ProcessLookupError:
        return False
    return True


def _never(module: Any) -> bool:
    return False


def _dies_in_the_final_average(fragment: int) -> None:
    """This process SIGKILLs itself inside DiLoCo's ``on_train_end`` (the final average), when it is
    about to start fragment ``fragment``'s exchange: the survivors are then inside that exchange,
    the exchanges before it in the average completed (their result already in the weights)."""
    from lightning_mpi.rules.diloco import BoundDiLoCo

    end, start = BoundDiLoCo.on_train_end, BoundDiLoCo._start

    def on_train_end(self) -> None:
        self.ending = True
        end(self)

    def _start(self, index: int) -> None:
        if getattr(self, "ending", False) and index == fragment:
            die()
        start(self, index)

    BoundDiLoCo.on_train_end, BoundDiLoCo._start = on_train_end, _start


def _trainer_model(
    phase: str,
    val_phase: str,
    dies: Callable[[Any], bool],
    dies_validating: Callable[[Any], bool] = _never,
    dies_saving: Callable[[Any], bool] = _never,
    dies_in_final_average: int | None = None,
    configure: Callable[[Any], Any] | None = None,
    freezes: bool = False,
):
    """The Trainer phases' LightningModule: records each training step under ``phase`` and each
    validation batch under ``val_phase``, logs with ``sync_dist=True`` (Lightning's reduce: a place to
    notice a loss), and SIGKILLs this process (``freezes``: SIGSTOPs it, :func:`freeze`) at the start
    of a batch where ``dies(module)``, at
    the end of a validation batch where ``dies_validating(module)``, and in the middle of writing a
    checkpoint (its ``torch.save``, after a first chunk) where ``dies_saving(module)``, and, on the
    last rank, in the final average of a DiLoCo rule at fragment ``dies_in_final_average``.
    ``configure(module)``: its ``configure_optimizers`` (SGD at LR by default)."""
    import lightning as L

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, batch_idx):
            index, x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, sync_dist=True)
            record(
                phase=phase,
                step=self.global_step,
                epoch=self.current_epoch,
                batch=batch_idx,
                world=self.trainer.world_size,
                rank=self.global_rank,
                indices=index.tolist(),
            )
            return loss

        def on_train_batch_start(self, batch, batch_idx):
            if dies(self):
                freeze() if freezes else die()

        def validation_step(self, batch, batch_idx):
            index, x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)
            record(phase=val_phase, step=self.global_step, world=self.trainer.world_size, indices=index.tolist())

        def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
            if dies_validating(self):
                die()

        def on_save_checkpoint(self, checkpoint):
            # every rank gets here (Lightning's dump, before the strategy's save); only rank 0 writes
            if dies_saving(self):

                def save_then_die(obj, f, *args, **kwargs):
                    f.write(b"half a checkpoint")
                    f.flush()
                    die()

                torch.save = save_then_die

        def on_train_end(self):
            # Lightning calls this before the strategy's on_train_end (the rule's final average)
            if dies_in_final_average is not None and self.global_rank == self.trainer.world_size - 1:
                _dies_in_the_final_average(dies_in_final_average)

        def val_dataloader(self):
            return DataLoader(torch.utils.data.Subset(Indexed(), range(VAL)), batch_size=B)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR) if configure is None else configure(self)

        def train_dataloader(self):
            return DataLoader(Indexed(), batch_size=B, shuffle=True)

    return Net()


def _trainer_fit(model, strategy, **trainer_args) -> dict:
    """``Trainer.fit`` of ``model`` on ``strategy`` (CPU, no logger, no sanity check); what the
    Trainer phases report: initial and final weights, the heal stats and history, where it ended."""
    import lightning as L

    initial = weights(model.net)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        logger=False,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    trainer.fit(model)
    return {
        "initial": initial,
        "final": weights(model.net),
        "stats": {k: v for k, v in strategy.stats().items() if k.startswith("mpi/heal/")},
        "history": strategy._core.healing.history,
        # the operations a later heal would compare (counted from the let-in on every rank)
        "operations": strategy._core.healing.completed,
        "world_size": trainer.world_size,
        "rank": trainer.global_rank,
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
    }


def trainer_phase() -> dict:
    from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

    from lightning_mpi.lightning import SyncStrategy

    if W == 12:  # -n 12 (outside CI): three losses, W 7 -> 4
        model = _trainer_model(
            "trainer",
            "validation",
            lambda m: m.global_step == KILL_STEP and RANK == 0,
            dies_validating=lambda m: m.global_step == VAL_KILL and RANK == 6,
            dies_saving=lambda m: m.global_step == SAVE_KILL and RANK == 1,
        )
    else:  # -n 10 (CI): rank 0 dies in the middle of writing the checkpoint of step SAVE_KILL_CI, W 5 -> 4
        model = _trainer_model(
            "trainer", "validation", _never, dies_saving=lambda m: m.global_step == SAVE_KILL_CI and RANK == 0
        )
    return _trainer_fit(
        model,
        SyncStrategy(exchange="asa", heal="shrink", min_ranks=2),
        max_steps=MAX_STEPS,
        # after each heal: the epoch-end checkpoints (rank 0 writes; the path is broadcast) and the
        # early-stopping decision (a reduce) go on over the survivors
        callbacks=[ModelCheckpoint(dirpath=OUT / "checkpoints", save_top_k=-1), EarlyStopping("val_loss", patience=99)],
    )


# -- heal="replace" (kept apart from the shrink phases) ----------------------------------------------------
def replace_phase() -> dict:
    """The Trainer with ``heal="replace"`` on the four left: launch rank 3 dies at the start of step
    REPLACE_KILL; the survivors finish that step on three ranks, spawn a replacement at the next
    one and wait for it at the one after, where it joins (taking rank 3's shard for the rest of the
    epoch); from the next epoch all four are
    sharded anew. The replacement enters here too (from :func:`main`) and returns the same record."""
    from lightning_mpi.lightning import SyncStrategy

    model = _trainer_model("replace", "replace_val", lambda m: m.global_step == REPLACE_KILL and RANK == 3)
    strategy = SyncStrategy(heal="replace")
    # the default ModelCheckpoint writes under default_root_dir
    return _trainer_fit(model, strategy, max_steps=REPLACE_STEPS, default_root_dir=OUT / "replace")


#: the ``replace_rules`` launch: its phases, and the launch rank each phase's replacement records under
REPLACE_RULE_PHASES = {
    "replace_downpour": 13,
    "replace_powersgd": 17,
    "replace_easgd": 18,
    "replace_gosgd": 14,
    "replace_zero": 15,
    "replace_fabric": 16,
}


def _replace_rule_phase(phase: str, strategy_class: str, configure=None, freezes: bool = False, **options) -> dict:
    """The Trainer with ``heal="replace"`` on the three ranks there are: the last rank dies at the
    start of step REPLACE_KILL; the survivors heal, spawn a replacement at their next batch and wait
    for it at the one after (:func:`survivors_wait_for_the_join`), where it joins with the lost rank's shard; it runs
    this script from this phase and records under REPLACE_RULE_PHASES[phase]."""
    import lightning_mpi.lightning as strategies

    dies = lambda m: m.global_step == REPLACE_KILL and m.trainer.global_rank == m.trainer.world_size - 1  # noqa: E731
    model = _trainer_model(phase, f"{phase}_val", dies, configure=configure, freezes=freezes)
    strategy = getattr(strategies, strategy_class)(heal="replace", **options)
    result = _trainer_fit(model, strategy, max_steps=REPLACE_STEPS, enable_checkpointing=False)
    if freezes:
        result["frozen_alive"] = frozen_rank_alive()
    bound = strategy.bound_rule
    if hasattr(bound, "commits"):  # a parameter-server rule: its commits, the last rebuild (the join)
        result["commits"] = bound.commits
        result["last_rebuild_lost"] = None if bound.last_heal is None else bound.last_heal["lost"]
    if options.get("shard_optimizer"):
        result["optimizer"] = _whole_optimizer_state(strategy)
    return result


def drain_heal_phase() -> dict:
    """DOWNPOUR with ``heal="shrink"`` on the three ranks there are (the replace_rules launch's last
    phase), its survivors healing in two places at once: rank 1 is in the end of training's drain of
    the preemption votes when the last rank dies (in its own ``on_train_end``, once rank 1 is in the
    drain), while rank 0, slow (DRAIN_SLOW_S per step), still trains. Rank 0 heals in a step and
    drains the votes restarted over the two at its end; rank 1 must drain them again, or each waits
    in another collective for good. No ``sync_dist``, no checkpoint: nothing keeps the ranks in step."""
    import lightning as L

    from lightning_mpi.lightning import DownpourStrategy

    in_drain = OUT / "drain_heal.rank1"

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_net()

        def training_step(self, batch, batch_idx):
            index, x, y = batch
            if self.global_rank == 0:
                time.sleep(DRAIN_SLOW_S)
            record(phase="drain_heal", step=self.global_step, world=self.trainer.world_size, rank=self.global_rank)
            return nn.functional.mse_loss(self.net(x), y)

        def on_train_end(self):
            # Lightning calls it before the strategy's on_train_end (the drain)
            if self.trainer.world_size == 3 and self.global_rank == 1:
                in_drain.write_text("")
            if self.trainer.world_size == 3 and self.global_rank == 2:
                deadline = time.monotonic() + 60
                while not in_drain.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                time.sleep(0.3)  # rank 1 is inside the drain by then
                die()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self):
            return DataLoader(Indexed(), batch_size=B, shuffle=True)

    model = Net()
    strategy = DownpourStrategy(heal="shrink")
    return _trainer_fit(model, strategy, max_steps=DRAIN_STEPS, enable_checkpointing=False, limit_val_batches=0)


def replace_downpour_phase() -> dict:
    """The last rank hangs (SIGSTOP) instead of dying: the process beside it kills it once it has been
    stopped for ``lightning-mpi --freeze-timeout`` (lightning_mpi.comm.watchdog), the survivors heal,
    and a spare takes its place."""
    return _replace_rule_phase("replace_downpour", "DownpourStrategy", freezes=True)


def replace_gosgd_phase() -> dict:
    return _replace_rule_phase("replace_gosgd", "GoSGDStrategy")


def replace_powersgd_phase() -> dict:
    return _replace_rule_phase("replace_powersgd", "PowerSGDStrategy")


def replace_easgd_phase() -> dict:
    """The last rank, spawned in the phase before, hangs (SIGSTOP): Open MPI 5.0.11's detector does
    not watch processes spawned after the launch (the survivors waited for good, before the
    watchdog), the process beside it does, and kills it."""
    return _replace_rule_phase("replace_easgd", "EASGDStrategy", freezes=True)


def replace_fabric_phase() -> dict:
    """A Fabric loop with ``heal="replace"`` and Adam on the three ranks there are, its state in a
    dictionary (``{"model", "optimizer", "step"}``) given to ``fabric.strategy.let_in`` at the top of
    each iteration: the last rank dies at step REPLACE_KILL; the survivors heal in that step's
    exchange, spawn a replacement at the next ``let_in`` and wait for it at the one after
    (:func:`survivors_wait_for_the_join`); the replacement runs this script from this phase, takes the state there and
    goes on from its step. Each rank's batch is picked by step, rank and world size."""
    import lightning as L

    from lightning_mpi.fabric import SyncStrategy as FabricSync

    strategy = FabricSync(heal="replace")
    fabric = L.Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    net = make_net()
    initial = weights(net)
    model, opt = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=ZERO_LR))
    data = Indexed()
    state = {"model": model, "optimizer": opt, "step": 0}
    joined_at = None
    while state["step"] < REPLACE_STEPS:
        if fabric.strategy.let_in(state):
            joined_at = state["step"]
        step = state["step"]
        if step == REPLACE_KILL and joined_at is None and fabric.global_rank == fabric.world_size - 1:
            die()
        index = [(step * 7 + fabric.global_rank * B + k) % N for k in range(B)]
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(data.x[index]), data.y[index]))
        opt.step()
        record(phase="replace_fabric", step=step, epoch=0, batch=step, world=fabric.world_size,
               rank=fabric.global_rank, indices=index)
        state["step"] += 1
    strategy.finish_training()
    return {
        "initial": initial,
        "final": weights(net),
        "optimizer": _as_lists((i, opt.optimizer.state[p]) for i, p in enumerate(net.parameters())),
        "history": strategy._core.healing.history,
        "operations": strategy._core.healing.completed,
        "stats": {k: v for k, v in strategy.stats().items() if k.startswith("mpi/heal/")},
        "world_size": fabric.world_size,
        "global_step": state["step"],
        "joined_at": joined_at,
    }


def replace_zero_phase() -> dict:
    """ZeRO with Adam: the survivors rebuild the optimizer state from their shards and buddy copies
    at the heal (over two), then reshard it over three when the replacement is let in."""
    adam = lambda module: torch.optim.Adam(module.parameters(), lr=ZERO_LR)  # noqa: E731
    return _replace_rule_phase("replace_zero", "SyncStrategy", configure=adam, exchange="asa", shard_optimizer=True)


def _fabric_loop(
    strategy,
    phase: str,
    stride: int,
    count_ranks: bool,
    settle: bool = False,
    linger: float = 0,
    dies_in_final_average: int | None = None,
) -> dict:
    """A Fabric loop on ``strategy`` whose last rank dies at step ``FABRIC_KILL``; each rank's batch
    is picked by its current rank and world size (a heal changes both). ``count_ranks``: Lightning's
    collectives go on after the heal (an ``all_reduce`` of ones every step). ``settle``: a barrier
    first, so that the rank dies once every rank completed the step before's exchange, and the
    survivors find the loss in the exchange of the kill step itself, which they all redo (a rank
    lost right after a collective that some survivors completed and others did not is reconciled
    by taking its result, which the replays here do not model). ``linger``: the survivors wait that
    many seconds at step FABRIC_KILL, so that ranks not in step (no collective while training) are
    likely to notice the loss mid-training rather than at the end (where it heals too).
    ``dies_in_final_average``: no rank dies while training; the last one dies in the final average
    of a DiLoCo rule (``finish_training``), at that fragment's exchange."""
    import lightning as L

    fabric = L.Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    net = make_net()
    initial = weights(net)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    data = Indexed()
    for step in range(FABRIC_STEPS):
        if step == FABRIC_KILL and settle:
            fabric.barrier()
        if step == FABRIC_KILL and fabric.global_rank == fabric.world_size - 1 and dies_in_final_average is None:
            die()
        if step == FABRIC_KILL and linger:
            time.sleep(linger)
        index = [(step * stride + fabric.global_rank * B + k) % N for k in range(B)]
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(data.x[index]), data.y[index]))
        opt.step()  # every PERIOD steps the exchange: the heal happens here, and it is redone
        world = fabric.world_size
        extra = {}
        if count_ranks:
            extra["ones"] = float(fabric.all_reduce(torch.tensor([1.0]), reduce_op="sum"))
        record(phase=phase, step=step, world=world, rank=fabric.global_rank, indices=index, **extra)
    if dies_in_final_average is not None and fabric.global_rank == fabric.world_size - 1:
        _dies_in_the_final_average(dies_in_final_average)
    strategy.finish_training()  # every rank's weights become the consensus (EASGD: the center)
    return {
        "initial": initial,
        "final": weights(net),
        "stats": {k: v for k, v in strategy.stats().items() if k.startswith("mpi/heal/")},
        "history": strategy._core.healing.history,
        "world_size": fabric.world_size,
    }


def zero_phase() -> dict:
    """ZeRO with Adam under heal: two ranks die (module docstring); their shards come back from the
    survivors' mirrors. Each rank's batch is picked by its current rank and world size."""
    import lightning as L

    from lightning_mpi.fabric import SyncStrategy as FabricSync

    strategy = FabricSync(exchange="asa", shard_optimizer=True, heal="shrink")
    fabric = L.Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    net = make_net()
    initial = weights(net)
    model, opt = fabric.setup(net, torch.optim.Adam(net.parameters(), lr=ZERO_LR))
    data = Indexed()
    launch_rank = RANK
    for step in range(ZERO_STEPS):
        if step in ZERO_KILLS:
            fabric.barrier()
            if launch_rank == ZERO_KILLS[step]:
                die()
        index = [(step * 11 + fabric.global_rank * B + k) % N for k in range(B)]
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(data.x[index]), data.y[index]))
        opt.step()
        record(phase="zero", step=step, world=fabric.world_size, rank=fabric.global_rank, indices=index)
    return {
        "initial": initial,
        "final": weights(net),
        "optimizer": _whole_optimizer_state(strategy),
        "history": strategy._core.healing.history,
        "world_size": fabric.world_size,
    }


def _as_lists(states) -> dict:
    """``(parameter index, its optimizer state)`` pairs as JSON: lists of floats by index."""
    return {str(i): {k: v.double().flatten().tolist() for k, v in entry.items()} for i, entry in states}


def _whole_optimizer_state(strategy) -> dict:
    """The ZeRO rule's optimizer state gathered whole (a collective), as lists by parameter index."""
    from lightning_mpi.rules.zero.state import consolidate

    bound = strategy._core.runner.bound
    whole = consolidate(bound.transport.allgather_object(bound.optimizer_state()))
    return _as_lists(whole["state"].items())


def zero_trainer_phase() -> dict:
    """ZeRO under the Trainer on the three left, clipping and an lr schedule; launch rank 3 dies."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mpi.lightning import SyncStrategy

    def adam(module):
        opt = torch.optim.Adam(module.parameters(), lr=ZERO_LR)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, gamma=ZERO_GAMMA)}

    model = _trainer_model(
        "zero_trainer", "zero_val", lambda m: m.global_step == ZERO_TRAINER_KILL and RANK == 3, configure=adam
    )
    strategy = SyncStrategy(exchange="asa", shard_optimizer=True, heal="shrink")
    result = _trainer_fit(
        model,
        strategy,
        max_steps=ZERO_TRAINER_STEPS,
        gradient_clip_val=ZERO_CLIP,
        callbacks=[ModelCheckpoint(dirpath=OUT / "zero_checkpoints", save_top_k=-1)],
    )
    result["optimizer"] = _whole_optimizer_state(strategy)
    return result


def fabric_phase() -> dict:
    """Model averaging on the four left; one dies in the step of the weight average."""
    from lightning_mpi.fabric import ModelAveragingStrategy

    return _fabric_loop(ModelAveragingStrategy(period=PERIOD, heal="shrink"), "fabric", 7, count_ranks=True)


def easgd_phase() -> dict:
    """EASGD (its center replicated) on the three left; one dies in the elastic exchange's step."""
    from lightning_mpi.fabric import EASGDStrategy

    return _fabric_loop(EASGDStrategy(period=PERIOD, heal="shrink"), "easgd", 5, count_ranks=False)


def gosgd_phase() -> dict:
    """GoSGD (pushes with probability GOSGD_P) on all ranks; one dies mid-training. Besides the
    loop's record: what each survivor brought to the drain's consensus allreduce (its θ and w) and
    the messages it expected there, received, and sent after the heal."""
    from lightning_mpi.fabric import GoSGDStrategy

    strategy = GoSGDStrategy(p=GOSGD_P, heal="shrink")
    runner = strategy._core.runner
    closed: list = []  # the bindings closed, the last being the one that drained
    close = runner.close

    def capture() -> None:
        closed.append(runner.bound)
        close()

    runner.close = capture
    result = _fabric_loop(strategy, "gosgd", 29, count_ranks=False)
    drain = dict(closed[-1].last_drain)
    drain["theta"] = drain["theta"].tolist()
    result["drain"] = drain
    return result


def downpour_phase() -> dict:
    """DOWNPOUR on all ranks, one dies mid-training. Besides the loop's record: each survivor's
    rebuild after the heal (what it kept: its shard, its pulled center, the clock then; what came
    out: the center, the clock, who each lost shard was taken from) and the commits it made on the
    healed run (each DOWNPOUR update, its whole Δ)."""
    import lightning_mpi.rules.server.base as server_base
    from lightning_mpi.fabric import DownpourStrategy
    from lightning_mpi.rules.server.rules import BoundDownpour

    rebuilds: list = []
    commits: list = []
    rebuild, exchange = server_base.gather_and_rebuild, BoundDownpour.exchange

    def gather_and_rebuild(transport, kept):
        out = rebuild(transport, kept)
        rebuilds.append({"kept": kept, "out": out})
        return out

    def recorded_exchange(self, theta, stale):
        update = theta - self.ref
        done = exchange(self, theta, stale)
        if done and rebuilds:  # a commit on the healed run
            commits.append(update.clone())
        return done

    server_base.gather_and_rebuild, BoundDownpour.exchange = gather_and_rebuild, recorded_exchange
    try:
        strategy = DownpourStrategy(period=PERIOD, heal="shrink")
        result = _fabric_loop(strategy, "downpour", 3, count_ranks=False, linger=1.0)
    finally:
        server_base.gather_and_rebuild, BoundDownpour.exchange = rebuild, exchange
    tolist = lambda t: t.double().tolist()  # noqa: E731
    result["rebuilds"] = [
        {
            "kept": {
                "old_rank": r["kept"]["old_rank"],
                "old_world": r["kept"]["old_world"],
                "numel": r["kept"]["numel"],
                "shard": tolist(r["kept"]["shard"]),
                "ref": tolist(r["kept"]["ref"]),
                "clock_at_pull": r["kept"]["clock_at_pull"],
                "clock": r["kept"]["clock"],
                "interrupted": r["kept"]["interrupted"],
            },
            "center": tolist(r["out"]["center"]),
            "clock": r["out"]["clock"],
            "lost": r["out"]["lost"],
            "chosen": {str(k): v for k, v in r["out"]["chosen"].items()},
        }
        for r in rebuilds
    ]
    result["commits"] = [tolist(u) for u in commits]
    return result


def topk_phase() -> dict:
    """Top-k with error feedback (residuals local) on all ranks; one dies in the exchange's step."""
    from lightning_mpi.fabric import CompressedSyncStrategy

    strategy = CompressedSyncStrategy(
        wire="topk", ratio=TOPK_RATIO, ratio_warmup_steps=0, topk_packing="pairs", heal="shrink"
    )
    return _fabric_loop(strategy, "topk", 11, count_ranks=False, settle=True)


def powersgd_phase() -> dict:
    """PowerSGD at rank 1 (warm Q's replicated, residuals local); one dies in the exchange's step."""
    from lightning_mpi.fabric import PowerSGDStrategy

    return _fabric_loop(PowerSGDStrategy(heal="shrink"), "powersgd", 13, count_ranks=False, settle=True)


def weights_phase() -> dict:
    """The synchronous rule averaging weights after every local step; one dies in the step."""
    from lightning_mpi.fabric import SyncStrategy as FabricSync

    return _fabric_loop(FabricSync(average="weights", heal="shrink"), "weights", 23, count_ranks=False, settle=True)


def diloco_phase() -> dict:
    """DiLoCo (its outer state replicated); one dies in the step of an outer exchange."""
    from lightning_mpi.fabric import DiLoCoStrategy

    return _fabric_loop(DiLoCoStrategy(period=PERIOD, heal="shrink"), "diloco", 17, count_ranks=False, settle=True)


def streaming_phase() -> dict:
    """Streaming DiLoCo, two fragments, each exchange overlapped with one inner step; one rank dies
    at the step whose end starts a fragment's exchange: the survivors find it failed while it is in
    flight (over the next inner step) and start it again over themselves."""
    from lightning_mpi.fabric import StreamingDiLoCoStrategy

    strategy = StreamingDiLoCoStrategy(**STREAMING, wire="fp32", heal="shrink")
    return _fabric_loop(strategy, "streaming", 19, count_ranks=False, settle=True)


# -- the ``outer`` launch (outside CI): heal="replace" with the compressed and the DiLoCo rules, then a
# rank lost inside DiLoCo's final average (Fabric, then the Trainer) --------------------------------------
def _replace_trainer(phase: str, strategy, kill_step: int) -> dict:
    """The Trainer with ``heal="replace"`` on every rank: the last rank dies at the start of step
    ``kill_step``; the survivors spawn a replacement at the next step and wait for it at the one
    after (it is let in there, or at the next step without an exchange in flight); REPLACE_STEPS."""
    model = _trainer_model(
        phase, f"{phase}_val", lambda m: m.global_step == kill_step and m.global_rank == m.trainer.world_size - 1
    )
    return _trainer_fit(model, strategy, max_steps=REPLACE_STEPS, default_root_dir=OUT / phase)


def topk_replace_phase() -> dict:
    """Top-k with error feedback: the residuals stay local, the replacement starts with none."""
    from lightning_mpi.lightning import CompressedSyncStrategy

    strategy = CompressedSyncStrategy(
        wire="topk", ratio=TOPK_RATIO, ratio_warmup_steps=0, topk_packing="pairs", heal="replace"
    )
    return _replace_trainer("topk_replace", strategy, REPLACE_KILL)


def diloco_replace_phase() -> dict:
    """DiLoCo (outer steps after steps 4 and 8): the replacement takes the outer state, its replica
    starts from θ_global."""
    from lightning_mpi.lightning import DiLoCoStrategy

    return _replace_trainer("diloco_replace", DiLoCoStrategy(period=OUTER_PERIOD, heal="replace"), REPLACE_KILL)


def streaming_replace_phase() -> dict:
    """Streaming DiLoCo (STREAMING): a rank dies at step STREAMING_KILL; the replacement is ready at
    step 2, while fragment 0's exchange is in flight, and is let in at step 3."""
    from lightning_mpi.lightning import StreamingDiLoCoStrategy

    strategy = StreamingDiLoCoStrategy(**STREAMING, wire="fp32", heal="replace")
    return _replace_trainer("streaming_replace", strategy, STREAMING_KILL)


def diloco_end_phase() -> dict:
    """Fabric, DiLoCo (an outer step after step 4, two steps since at the end): the last rank dies in
    ``finish_training``'s final average; the survivors average their own replicas."""
    from lightning_mpi.fabric import DiLoCoStrategy

    strategy = DiLoCoStrategy(period=OUTER_PERIOD, heal="shrink")
    return _fabric_loop(strategy, "diloco_end", 17, count_ranks=False, dies_in_final_average=0)


def streaming_end_phase() -> dict:
    """The Trainer, Streaming DiLoCo (STREAMING_END) for END_STEPS: the last rank dies in
    ``on_train_end``'s final average at fragment END_DIES_AT, after the exchange in flight and the
    fragment before were averaged into the weights."""
    from lightning_mpi.lightning import StreamingDiLoCoStrategy

    model = _trainer_model("streaming_end", "streaming_end_val", _never, dies_in_final_average=END_DIES_AT)
    strategy = StreamingDiLoCoStrategy(**STREAMING_END, wire="fp32", heal="shrink")
    # no checkpoint: the one Lightning saves at the end would complete the exchange in flight first
    return _trainer_fit(model, strategy, max_steps=END_STEPS, enable_checkpointing=False)


OUTER_PHASES = (
    ("topk_replace", topk_replace_phase),
    ("diloco_replace", diloco_replace_phase),
    ("streaming_replace", streaming_replace_phase),
    ("diloco_end", diloco_end_phase),
    ("streaming_end", streaming_end_phase),
)
#: a replacement spawned in the ``outer`` launch records under OUTER_REPLACEMENT + the index of its phase
OUTER_REPLACEMENT = 20


def auto_phase() -> dict:
    """``mpi_auto`` (Fabric, SGD with momentum) on all ranks, W 5 -> 4 -> 3 -> 2. Its first decision
    (after step AUTO_DECIDES) runs the real probe, dry runs and agreements over the ranks, but
    decides on pinned numbers (the link fast, the steps long, every dry run free: every-step ASA, so
    the survivors switch from Streaming DiLoCo, averaging weights and momenta, and keep it at every
    later decision); the last rank dies inside that probe: the survivors heal in the decision and
    redo it over themselves; the last of the four dies as that redo switches (the others in
    Streaming DiLoCo's final average): the three left heal again, put back the weights and momenta
    the decision started from and redo it once more. The last rank of the
    three then dies at Fabric step AUTO_KILL (before its backward, once every rank completed the
    step before's): the survivors heal in ASA's exchange, redo it, and re-decide at the next step
    over the two left. Each step records a digest of the weights (after the switch every rank
    holds the same) and the arm; each survivor reports the rule's ``mpi/auto/*`` stats."""
    import lightning as L

    from lightning_mpi.fabric import AutoStrategy
    from lightning_mpi.rules.auto import choice as auto_choice
    from lightning_mpi.rules.auto import rule as auto_module
    from lightning_mpi.rules.link import Link, LinkProbe, Measurement

    measure = LinkProbe.measure
    probes = [0]

    def pinned(self, step_seconds, exchange, nbytes):
        probes[0] += 1
        if probes[0] == 1 and RANK == 4:
            die()  # inside the first decision's probe, its first collective
        measure(self, step_seconds, exchange, nbytes)  # the real collectives, over the ranks alive
        return Measurement(50.0, Link(1e9 / 8, 1e-4))  # steps of 50 s: whatever ASA's own steps take hides

    switch = auto_module.BoundAuto._switch

    def switch_or_die(self, choice, optimizer):
        if RANK == 3:
            die()  # in the redone decision, as the others average the replicas for the switch
        switch(self, choice, optimizer)

    LinkProbe.measure = pinned
    auto_module.BoundAuto._switch = switch_or_die
    auto_choice.dry_run_exposed = lambda *args: 0.0  # the dry runs run; what they say is pinned
    strategy = AutoStrategy(heal="shrink", min_ranks=1)  # down to two of five: below half, on purpose
    fabric = L.Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    net = make_net()
    initial = weights(net)
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
    data = Indexed()
    for step in range(AUTO_STEPS):
        if step == AUTO_KILL:
            fabric.barrier()
            if fabric.global_rank == fabric.world_size - 1:
                die()
        index = [(step * 31 + fabric.global_rank * B + k) % N for k in range(B)]
        opt.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(data.x[index]), data.y[index]))
        opt.step()
        bound = strategy._core.runner.bound
        digest = sum(float(p.double().sum()) * (i + 1) for i, p in enumerate(net.parameters()))
        arm, decisions = bound.choice.arm, bound.decisions
        record(
            phase="auto",
            step=step,
            world=fabric.world_size,
            rank=fabric.global_rank,
            arm=arm,
            decisions=decisions,
            digest=digest,
        )
    stats = {k: v for k, v in strategy.stats().items() if k.startswith(("mpi/heal/", "mpi/auto/"))}
    strategy.finish_training()
    return {
        "initial": initial,
        "final": weights(net),
        "stats": stats,
        "history": strategy._core.healing.history,
        "world_size": fabric.world_size,
    }


def auto_end_phase() -> dict:
    """``mpi_auto`` under the Trainer on all ranks (W 6 -> 5), AUTO_END_STEPS steps: before its first
    decision (after step AUTO_DECIDES) it trains its first arm, Streaming DiLoCo at its defaults;
    the last rank dies inside ``on_train_end``'s final average, at fragment AUTO_END_DIES_AT's
    exchange (fragment 0's already averaged into the weights): the survivors heal there, put back
    what the average changed and redo it over themselves."""
    from lightning_mpi.lightning import AutoStrategy

    model = _trainer_model("auto_end", "auto_end_val", _never, dies_in_final_average=AUTO_END_DIES_AT)
    strategy = AutoStrategy(heal="shrink")
    result = _trainer_fit(model, strategy, max_steps=AUTO_END_STEPS, enable_checkpointing=False)
    bound = strategy._core.runner.bound
    result["auto"] = {"arm": bound.choice.arm, "decisions": bound.decisions, "steps": bound.steps}
    return result


def auto_replace_phase() -> dict:
    """``mpi_auto`` under the Trainer with ``heal="replace"`` on the two left by :func:`auto_phase`
    (measurements assumed, auto_assumed.py: every-step ASA from the first decision, after step
    AUTO_DECIDES): launch rank 1 dies at the start of step AUTO_REPLACE_KILL; the survivor finishes
    that step alone, spawns a replacement at the next batch and lets it in at the one after; the
    replacement takes the rule's state from the handover and both re-decide over two. The
    replacement enters here (:func:`main`)."""
    from auto_assumed import assumed  # beside this script

    from lightning_mpi.lightning import AutoStrategy

    dies = lambda m: m.global_step == AUTO_REPLACE_KILL and RANK == 1  # noqa: E731
    model = _trainer_model("auto_replace", "auto_replace_val", dies)
    strategy = AutoStrategy(heal="replace", min_ranks=1)  # one of two, until the replacement joins
    with assumed("50000,1000,0.1"):
        result = _trainer_fit(model, strategy, max_steps=AUTO_REPLACE_STEPS, default_root_dir=OUT / "auto_replace")
    bound = strategy._core.runner.bound
    result["auto"] = {"arm": bound.choice.arm, "decisions": bound.decisions, "steps": bound.steps}
    return result


def min_ranks_phase() -> dict:
    """Two ranks left and ``min_ranks=2``: the survivor of one more loss raises ``RankFailedError``."""
    import lightning as L

    from lightning_mpi import RankFailedError
    from lightning_mpi.fabric import SyncStrategy as FabricSync

    strategy = FabricSync(heal="shrink", min_ranks=2)
    fabric = L.Fabric(strategy=strategy, accelerator="cpu")
    fabric.launch()
    net = make_net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=LR))
    data = Indexed()
    try:
        for step in range(4):
            if step == 1 and fabric.global_rank == fabric.world_size - 1:
                die()
            opt.zero_grad()
            fabric.backward(nn.functional.mse_loss(model(data.x[:B]), data.y[:B]))
            opt.step()
    except RankFailedError as error:
        return {"caught": type(error).__name__, "message": str(error), "step": step}
    return {"caught": None}


def main() -> None:
    global OUT, RANK, W
    from mpi4py import MPI

    from known_join import survivors_wait_for_the_join

    survivors_wait_for_the_join()  # every heal="replace" phase joins at a known step

    OUT, RANK, W = Path(sys.argv[1]), MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    phases: tuple = (
        ("topk", topk_phase),
        ("powersgd", powersgd_phase),
        ("diloco", diloco_phase),
        ("streaming", streaming_phase),
        ("weights", weights_phase),
        ("trainer", trainer_phase),
        ("replace", replace_phase),
        ("fabric", fabric_phase),
        ("easgd", easgd_phase),
        ("min_ranks", min_ranks_phase),
    )
    if sys.argv[2:] == ["gosgd"]:
        phases = (("downpour", downpour_phase), ("gosgd", gosgd_phase))
    if sys.argv[2:] == ["outer"]:
        phases = OUTER_PHASES
    if sys.argv[2:] == ["zero"]:
        phases = (("zero", zero_phase), ("zero_trainer", zero_trainer_phase))
    if sys.argv[2:] == ["auto"]:
        phases = (("auto_end", auto_end_phase), ("auto", auto_phase), ("auto_replace", auto_replace_phase))
    if sys.argv[2:] == ["replace_rules"]:
        phases = (
            ("replace_downpour", replace_downpour_phase),
            ("replace_powersgd", replace_powersgd_phase),
            ("replace_easgd", replace_easgd_phase),
            ("replace_gosgd", replace_gosgd_phase),
            ("replace_zero", replace_zero_phase),
            ("replace_fabric", replace_fabric_phase),
            ("drain_heal", drain_heal_phase),
        )
    names = [name for name, _ in phases]
    if os.environ.get("LIGHTNING_MPI_REPLACEMENT"):  # a replacement starts at the phase that spawned it
        current = (OUT / "phase").read_text()
        if current in REPLACE_RULE_PHASES:
            RANK = REPLACE_RULE_PHASES[current]
        else:
            RANK = REPLACEMENT if current in ("replace", "auto_replace") else OUTER_REPLACEMENT + names.index(current)
        phases = phases[names.index(current) :]
    for name, phase in phases:
        mark = OUT / f"phase.{os.getpid()}"  # what a replacement spawned in this phase reads (atomic)
        mark.write_text(name)
        os.replace(mark, OUT / "phase")
        result = phase()
        (OUT / f"{name}.{RANK}.json").write_text(json.dumps(result))
        if name == "trainer":  # the later phases record under the ranks the trainer phase left
            RANK = result["rank"]


if __name__ == "__main__":
    main()
