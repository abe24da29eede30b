"""Every strategy on one device with W ranks: 2 ranks sharing one GPU in ``benchmarks/gpu_check.py``.

Usage: ``mpiexec -n 2 python tests/scripts/gpu_strategies.py OUT.json SPEC [SPEC ...]``, where SPEC
is a registered name (``mpi_asa16``) or ``NAME@key=value+key=value`` (``mpi_topk@ratio=1.0``).
``GPU_STRATEGIES_DEVICE=cpu`` runs the same on the CPU (a smoke run of this script; no AMP there).

For each spec, every rank starting from a different random initialisation (setup must broadcast
rank 0's weights):

1. **fp32** (``32-true``): STEPS steps of batch B on the device. Where the spec has a tolerance in
   :data:`TOLERANCE` (exact exchanges, and the exact settings of the lossy ones) the weights must
   equal one process at batch W·B (``tiny_task.one_process_reference``, on the device). Ranks must
   hold identical weights after every step (synchronous rules) or at the end of ``fit``
   (asynchronous rules and DiLoCo, whose ranks differ between exchanges by design).
2. **AMP** (CUDA only): the same with ``precision="16-mixed"``, i.e. a GradScaler. Ranks must be
   identical in the same way, the loss finite and every rank's loss scale the same; the distance
   to the fp32 reference is reported, not judged.

Rank 0 rewrites OUT.json after each spec, so a run cut short keeps what finished. A spec that
raises is recorded with its error and the next spec trains on fresh communicators.
"""
import hashlib
import json
import math
import os
import sys
import time
import traceback
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader

warnings.filterwarnings("ignore")
import pytorch_lightning as pl  # noqa: E402
from mpi4py import MPI  # noqa: E402

import lightning_mpi  # noqa: E402
from tests.quiet_trainer import QUIET  # noqa: E402
from tiny_task import dataset, make_net, one_process_reference  # noqa: E402  (beside this script)

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
DEVICE = os.environ.get("GPU_STRATEGIES_DEVICE", "cuda")
B, STEPS, LR = 4, 6, 0.2

#: max |Δw| against one process at batch W·B, for the specs that must equal it
TOLERANCE = {
    "mpi_allreduce": 1e-5,
    "mpi_asa": 1e-5,
    "mpi_asa16": 5e-3,
    "mpi_asa_bf16": 5e-3,
    "mpi_zero": 1e-5,
    "mpi_zero_bf16": 5e-3,
    "mpi_topk@ratio=1.0+topk_packing=pairs": 1e-5,
    "mpi_powersgd@rank=64+min_compression_rate=0.0+error_feedback=false": 1e-5,
    "mpi_diloco@period=1+outer_lr=1.0+outer_momentum=0.0": 1e-5,
}
#: strategy classes whose replicas are identical after every step (the rest: at the end of fit)
PER_STEP_CLASSES = ("SyncStrategy", "CompressedSyncStrategy", "PowerSGDStrategy")


def parse_value(text):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def make_strategy(spec):
    name, _, rest = spec.partition("@")
    if not rest:
        return name
    class_name, params, _ = lightning_mpi.STRATEGIES[name]
    kwargs = dict(params)
    for item in rest.split("+"):
        key, _, value = item.partition("=")
        kwargs[key] = parse_value(value)
    return getattr(lightning_mpi, class_name)(**kwargs)


def per_step(spec):
    name = spec.partition("@")[0]
    return lightning_mpi.STRATEGIES[name][0] in PER_STEP_CLASSES or name.startswith("mpi_zero")


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = make_net()
        self.losses = []

    def training_step(self, batch, _):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def flat_weights(module):
    return torch.cat([p.detach().float().reshape(-1).cpu() for p in module.parameters()])


class ReplicaCheck(pl.Callback):
    """After every step: do all ranks hold bitwise-identical weights? Also keeps the weights at
    the start of training (rank 0's, after setup's broadcast) for the reference."""

    def __init__(self):
        self.mismatches = 0
        self.initial = {}

    def on_train_start(self, trainer, pl_module):
        self.initial = {k: v.detach().clone() for k, v in pl_module.net.state_dict().items()}

    def on_train_batch_end(self, trainer, pl_module, *args):
        digest = hashlib.sha1(flat_weights(pl_module).numpy().tobytes()).hexdigest()
        if len(set(COMM.allgather(digest))) != 1:
            self.mismatches += 1


def cupy_launches():
    """Kernel launches of lightning_mpi's cupy kernels in this process so far (0 without cupy)."""
    from lightning_mpi.comm.cupy_kernels import total_launches

    return total_launches()


def fit(spec, precision):
    torch.manual_seed(100 + RANK)  # a different initialisation on every rank
    model, check = Module(), ReplicaCheck()
    launches = cupy_launches()
    trainer = pl.Trainer(strategy=make_strategy(spec), accelerator=DEVICE, devices=1, precision=precision,
                         max_epochs=1, callbacks=[check], **QUIET)
    trainer.fit(model, DataLoader(dataset(W * B * STEPS), batch_size=B, shuffle=False))
    weights = flat_weights(model)
    ranks_identical_end = all(torch.equal(weights, w) for w in COMM.allgather(weights))
    reference = one_process_reference(check.initial, W, B, STEPS, LR, device=DEVICE)
    # on the CPU: Lightning's teardown moved the module back there, the reference is on the device
    diff = max((model.net.state_dict()[k].float().cpu() - reference[k].float().cpu()).abs().max().item() for k in reference)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scales = COMM.allgather(None if scaler is None else float(scaler.get_scale()))
    return {
        "precision": precision,
        "global_step": trainer.global_step,
        "diff": diff,
        "mismatches": check.mismatches,
        "ranks_identical_end": ranks_identical_end,
        "loss_first": model.losses[0] if model.losses else None,
        "loss_last": model.losses[-1] if model.losses else None,
        "grad_scaler": scaler is not None,
        "scales": scales,
        "cupy_launches": cupy_launches() - launches,
    }


def judge(spec, run, amp):
    """Why a run failed ([] when it passed)."""
    why = []
    if "error" in run:
        return [f"raised {run['error']}"]
    if not amp and run["global_step"] != STEPS:  # (a GradScaler may skip a step)
        why.append(f"global_step {run['global_step']} != {STEPS}")
    if run["loss_last"] is None or not math.isfinite(run["loss_last"]):
        why.append(f"loss {run['loss_last']}")
    if per_step(spec) and run["mismatches"]:
        why.append(f"ranks differed after {run['mismatches']} steps")
    if not run["ranks_identical_end"]:
        why.append("ranks differ at the end")
    tol = TOLERANCE.get(spec)
    if not amp and tol is not None and not run["diff"] <= tol:
        why.append(f"max |Δw| against one process {run['diff']:.3g} > {tol:g}")
    if amp and (not run["grad_scaler"] or len(set(run["scales"])) != 1):
        why.append(f"GradScaler {'missing' if not run['grad_scaler'] else 'scales differ: ' + str(run['scales'])}")
    return why


def main():
    out, specs = sys.argv[1], sys.argv[2:]
    report = {"device": DEVICE, "world": W, "steps": STEPS, "batch": B,
              "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else None, "results": []}
    precisions = ["32-true"] + (["16-mixed"] if DEVICE == "cuda" else [])
    for spec in specs:
        entry = {"spec": spec, "tolerance": TOLERANCE.get(spec), "identical": "after every step" if per_step(spec) else "at the end"}
        for precision in precisions:
            begin = time.perf_counter()
            try:
                run = fit(spec, precision)
            except Exception as error:  # recorded; the next fit trains on fresh communicators
                where = traceback.extract_tb(error.__traceback__)[-1]
                run = {"precision": precision, "error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                       "where": f"{where.filename}:{where.lineno} ({where.name})"}
                traceback.print_exc()
            run["seconds"] = time.perf_counter() - begin
            run["failures"] = judge(spec, run, amp=precision != "32-true")
            entry["amp" if precision != "32-true" else "fp32"] = run
        entry["ok"] = not any(entry[k]["failures"] for k in ("fp32", "amp") if k in entry)
        report["results"].append(entry)
        if RANK == 0:
            with open(out, "w") as f:
                json.dump(report, f, indent=1)
            print(f"{spec}: {'ok' if entry['ok'] else 'FAILED'}", flush=True)


if __name__ == "__main__":
    main()
