"""Run on W ranks: ZeroRule + the sharded optimizer against plain ASA + the full optimizer.

Usage: ``mpiexec -n W python tests/scripts/zero_equivalence.py OUT.json``. Rank 0 writes a dict of
cases. Each case trains two copies of one model side by side on the same batches, driving the
rules as the strategies do (``on_train_start``; per step: backward, ``before_step``, clipping,
``optimizer.step()``, ``after_step``; ``on_train_end``): copy A with ``SyncRule(exchange="asa")`` and
the user's optimizer, copy B with ``ZeroRule`` and the same optimizer sharded. It records the
largest weight difference, the largest difference of the optimizer state (B's shards consolidated
against A's ``state_dict()``), whether all ranks hold the same weights, and how much optimizer
state each rank holds.
"""
import copy
import hashlib
import json
import sys
import warnings

import torch
from torch import nn

warnings.filterwarnings("ignore")
from mpi4py import MPI  # noqa: E402

from lightning_mpi.comm.transport import Transport  # noqa: E402
from lightning_mpi.rules.sync import SyncRule  # noqa: E402
from lightning_mpi.rules.zero import ZeroRule  # noqa: E402
from lightning_mpi.rules.zero.state import consolidate, is_elementwise, state_numel  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
T = Transport(COMM, timeout=120)
B = 4


class Net(nn.Module):
    """Odd sizes (buckets and chunks cut parameters apart), a 0-dim parameter, a frozen one and one
    that is not contiguous (its bucket keeps fp32 master weights)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, 13)
        self.b = nn.Linear(13, 5)
        self.scale = nn.Parameter(torch.tensor(1.3))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.strided = nn.Parameter(torch.randn(4, 5).t() * 0.1)

    def forward(self, x):
        out = self.b(torch.tanh(self.a(x))) * self.scale + self.frozen.sum()
        return out + (out @ self.strided).sum(-1, keepdim=True)


def gather_optimizer_state(bound):
    """The ZeRO rule's whole optimizer state in torch's format, on every rank (a collective that
    holds every shard on every rank at once: for small models and tests; checkpoints write shards)."""
    return consolidate(bound.transport.allgather_object(bound.optimizer_state()))


def batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(W * B, 7, generator=g)
    y = torch.randn(W * B, 5, generator=g)
    return x[RANK * B : (RANK + 1) * B], y[RANK * B : (RANK + 1) * B]


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def weights_hash(model) -> str:
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def max_state_diff(full_a, full_b, frozen) -> float:
    """Largest state difference; a frozen parameter has no sharded state (Adagrad makes one at
    construction for every parameter, the sharded optimizer keeps none for parameters it never steps)."""
    worst = 0.0
    expected = set(full_a["state"]) - set(frozen)
    assert expected == set(full_b["state"]), (sorted(full_a["state"]), sorted(full_b["state"]))
    for index, state in full_a["state"].items():
        if index in frozen:
            continue
        for key, value in state.items():
            other = full_b["state"][index][key]
            if isinstance(value, torch.Tensor):
                worst = max(worst, (value.double() - other.double()).abs().max().item() if value.numel() else 0.0)
    for ga, gb in zip(full_a["param_groups"], full_b["param_groups"]):
        assert {k: v for k, v in ga.items()} == {k: v for k, v in gb.items()}, (ga, gb)
    return worst


def run(make_optimizer, steps=6, clip=None, clip_type=2.0, accumulate=1, wire="fp32", scheduler=None,
        bucket_mb=0.0002, overlap=True, poison_step=None, inflight=2, reload_at=None, sync_every_backward=False):
    model_a = Net()
    model_b = copy.deepcopy(model_a)
    rule_a = SyncRule(exchange="asa", wire=wire).bind(T, trainable(model_a))
    rule_b = ZeroRule(wire=wire, bucket_mb=bucket_mb, overlap=overlap, inflight_buckets=inflight).bind(T, trainable(model_b))
    opt_a, opt_b = make_optimizer(model_a), make_optimizer(model_b)
    sched_a = scheduler(opt_a) if scheduler else None
    sched_b = scheduler(opt_b) if scheduler else None  # made before sharding, as Lightning does
    assert rule_b.shard_optimizer(opt_b) is opt_b
    rule_a.on_train_start()
    rule_b.on_train_start()
    skipped = [0, 0]
    nan_filled = []
    for step in range(steps):
        for model, rule, opt, k in ((model_a, rule_a, opt_a, 0), (model_b, rule_b, opt_b, 1)):
            for micro in range(accumulate):
                rule.sync_enabled = sync_every_backward or micro == accumulate - 1
                x, y = batch(step, micro)
                loss = nn.functional.mse_loss(model(x), y) / accumulate
                if step == poison_step and RANK == W - 1:
                    loss = loss * float("inf")
                loss.backward()
            rule.sync_enabled = True
            ok = rule.before_step(opt)
            if not ok:
                skipped[k] += 1
                if k == 1:  # every rank's gradients are NaN, so that a GradScaler skips everywhere too
                    nan_filled.append(all(bool(torch.isnan(t.grad).all()) for g in opt.param_groups for t in g["params"]))
                opt.zero_grad()
                continue
            if clip is not None:
                if k == 0:
                    torch.nn.utils.clip_grad_norm_(trainable(model), clip, norm_type=clip_type)
                else:
                    rule.clip_grad_norm_(clip, norm_type=clip_type)
            opt.step()
            rule.after_step(opt)
            opt.zero_grad()
        if sched_a:
            sched_a.step()
            sched_b.step()
        if reload_at == step:  # a fresh copy of B resumes from B's shard states and goes on
            saved = {k: v.clone() for k, v in model_b.state_dict().items()}
            shard = rule_b.optimizer_state()
            shard = copy.deepcopy(shard)
            rule_b.close()
            model_b = Net()
            model_b.load_state_dict(saved)
            rule_b = ZeroRule(wire=wire, bucket_mb=bucket_mb, overlap=overlap, inflight_buckets=inflight).bind(T, trainable(model_b))
            fresh = make_optimizer(model_b)
            if scheduler:  # as Lightning resumes: scheduler made with the optimizer, states loaded after setup
                sched_state, sched_b = sched_b.state_dict(), scheduler(fresh)
            rule_b.shard_optimizer(fresh)
            rule_b.load_optimizer_state(shard)
            if scheduler:
                sched_b.load_state_dict(sched_state)
            opt_b = fresh
    rule_a.on_train_end()
    rule_b.on_train_end()
    diff = max((pa - pb).abs().max().item() for pa, pb in zip(model_a.parameters(), model_b.parameters()))
    full_b = gather_optimizer_state(rule_b)
    frozen = [i for i, p in enumerate(p for g in opt_a.param_groups for p in g["params"]) if not p.requires_grad]
    state_diff = max_state_diff(opt_a.state_dict(), full_b, frozen)
    held = state_numel(rule_b.optimizer_state())
    full_state = sum(v.numel() for p, st in opt_a.state.items() if p.requires_grad
                     for k, v in st.items() if is_elementwise(k, v))
    per_key = len([k for k, v in opt_a.state[model_a.a.weight].items() if is_elementwise(k, v)])
    hashes = COMM.allgather(weights_hash(model_b))
    chunks = sum(b.plan.chunk for b in rule_b.buckets)
    rule_a.close()
    rule_b.close()
    return {
        "diff": diff,
        "state_diff": state_diff,
        "replicas_equal": len(set(hashes)) == 1,
        "held": COMM.allgather(held),
        "full": full_state,
        "per_key": per_key,
        "chunk_total": chunks,
        "buckets": len(rule_b.buckets),
        "skipped": skipped,
        "nan_filled": nan_filled,
        "lr": [g["lr"] for g in opt_b.param_groups],
        "hook_launches": rule_b.hook_launches,
    }


def bf16_weights(steps=6):
    """bf16 parameters ("bf16-true"): the buckets keep fp32 master weights, the parameters get their
    bf16 rounding; compared with fp32 training (A) the difference is bf16's resolution, not more."""
    model_a = Net()
    model_b = copy.deepcopy(model_a).to(torch.bfloat16)
    model_c = copy.deepcopy(model_b)  # plain bf16 data parallelism: bf16 weights, bf16 Adam state
    rule_a = SyncRule(exchange="asa").bind(T, trainable(model_a))
    rule_b = ZeroRule(bucket_mb=0.0002).bind(T, trainable(model_b))
    rule_c = SyncRule(exchange="asa").bind(T, trainable(model_c))
    opt_a, opt_b, opt_c = adam(model_a), adam(model_b), adam(model_c)
    rule_b.shard_optimizer(opt_b)
    for step in range(steps):
        for model, rule, opt in ((model_a, rule_a, opt_a), (model_b, rule_b, opt_b), (model_c, rule_c, opt_c)):
            x, y = batch(step)
            dtype = next(model.parameters()).dtype
            nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
            assert rule.before_step(opt)
            opt.step()
            rule.after_step(opt)
            opt.zero_grad()
    masters = [b.master.dtype for b in rule_b.buckets if b.master is not None]
    diff = max((pa - pb.float()).abs().max().item() for pa, pb in zip(model_a.parameters(), model_b.parameters()))
    plain = max((pa - pc.float()).abs().max().item() for pa, pc in zip(model_a.parameters(), model_c.parameters()))
    rule_c.close()
    hashes = COMM.allgather(hashlib.sha1(b"".join(p.detach().float().numpy().tobytes() for p in model_b.parameters())).hexdigest())
    rule_a.close()
    rule_b.close()
    return {"diff": diff, "plain_bf16_diff": plain, "replicas_equal": len(set(hashes)) == 1, "masters": [str(d) for d in masters],
            "buckets": len(rule_b.buckets)}


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def adamw_groups(model):
    return torch.optim.AdamW(
        [{"params": list(model.a.parameters()) + [model.frozen], "lr": 3e-2, "weight_decay": 0.1},
         {"params": list(model.b.parameters()) + [model.scale, model.strided], "lr": 5e-3}],
        lr=1e-2, weight_decay=0.01,
    )


cases = {
    "sgd_momentum": lambda: run(sgd),
    "adam": lambda: run(adam),
    "adamw_two_groups": lambda: run(adamw_groups),
    "clip_norm": lambda: run(adam, clip=0.05),
    "clip_inf_norm": lambda: run(sgd, clip=0.02, clip_type=float("inf")),
    "scheduler": lambda: run(sgd, scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)),
    "accumulate": lambda: run(adam, accumulate=2),
    "no_overlap": lambda: run(adamw_groups, overlap=False),
    # a second backward before the step with the exchange on (manual optimization without no_sync)
    "two_backwards": lambda: run(adam, accumulate=2, sync_every_backward=True),
    "one_bucket": lambda: run(adam, bucket_mb=25.0),
    "pool_of_one": lambda: run(sgd, inflight=1),
    "rmsprop": lambda: run(lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.5)),
    "adagrad": lambda: run(lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, initial_accumulator_value=0.1)),
    "nonfinite": lambda: run(adam, poison_step=2),
    "resume_same_w": lambda: run(adamw_groups, scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)), reload_at=2),
    "bf16": lambda: run(adam, wire="bf16"),
    "bf16_resume": lambda: run(adam, wire="bf16", reload_at=2),
}

results = {name: case() for name, case in cases.items()}
special = {"bf16_weights": bf16_weights()}

errors = {}
try:
    ZeroRule().bind(T, trainable(Net())).shard_optimizer(torch.optim.LBFGS(trainable(Net())))
except ValueError as e:
    errors["lbfgs"] = str(e)
try:
    net = Net()
    ZeroRule().bind(T, trainable(net)).shard_optimizer(torch.optim.Adam(net.a.parameters()))
except ValueError as e:
    errors["missing"] = str(e)
results["errors"] = errors
results["special"] = special

if RANK == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(results, f, indent=1)
