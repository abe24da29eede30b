"""Run on W ranks in a directory holding ``data/wikitext-2.txt``: Lightning's demo ``LightningLSTM``
under every ``mpi_*`` name, in one launch.

Its ``train_dataloader`` uses a custom batch sampler (``SequenceSampler``) that Lightning cannot
rebuild around a ``DistributedSampler`` (``ddp`` stops with "Lightning can't inject a (distributed)
sampler into your batch sampler"); the strategies deal its batches to the ranks instead. Rank 0
writes argv[1]: per name, a digest of every batch each rank trained on, the number of
steps, and whether the ranks ended on identical weights.
"""
import hashlib
import importlib
import json
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402

PACKAGE = os.environ.get("LIGHTNING_PACKAGE", "pytorch_lightning")
pl = importlib.import_module(PACKAGE)
lstm_demo = importlib.import_module(f"{PACKAGE}.demos.lstm")
WikiText2 = importlib.import_module(f"{PACKAGE}.demos.transformer").WikiText2
COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
STEPS = int(os.environ.get("DEMO_STEPS", "3"))
# DEMO_SMALL=1 keeps the demo module, its data and its batch sampler, with a narrower network
# (the full one has about 10M parameters here and takes minutes for 16 fits on 2 cores).
SMALL = os.environ.get("DEMO_SMALL") == "1"


def make_model(vocab):
    model = lstm_demo.LightningLSTM(vocab_size=vocab)
    if SMALL:
        model.model = lstm_demo.SimpleLSTM(vocab_size=vocab, ninp=32, nhid=32, nlayers=2)
    return model


class SeenBatches(pl.Callback):
    """Records which batches this rank trained on (a digest of each batch's tokens)."""

    def __init__(self):
        self.first_tokens = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.first_tokens.append(hashlib.sha1(batch[0].numpy().tobytes()).hexdigest()[:12])


def digest(module):
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in module.parameters())).hexdigest()


vocab = WikiText2(download=False).vocab_size
results = {}
for name in lightning_mpi.STRATEGIES:
    torch.manual_seed(RANK)
    model = make_model(vocab)
    seen = SeenBatches()
    trainer = pl.Trainer(strategy=name, max_epochs=1, limit_train_batches=STEPS, callbacks=[seen], **QUIET)
    trainer.fit(model)
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    results[name] = {
        "seen": COMM.allgather(seen.first_tokens),
        "identical": len(set(COMM.allgather(digest(model)))) == 1,
        "finite": finite,
        "global_step": trainer.global_step,
        "batches_per_rank": len(trainer.train_dataloader),
    }
if RANK == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"results": results, "batches_in_sampler": len(lstm_demo.SequenceSampler(WikiText2(download=False), 20))}, f)
