"""One arm of ``benchmarks/zero.py`` on every rank of an ``mpiexec`` job: train an MLP with Adam,
measure memory and speed, optionally time checkpoint saves and loads. Rank 0 writes ``--out``.

Arms (all drive the exchange directly, no Lightning, so that the rule and not the frontend is
measured; the strategies call the same hooks):

- ``asa`` / ``asa_bf16``: ``SyncRule(exchange="asa")`` (fp32 / bf16 wire) and the full Adam;
- ``zero`` / ``zero_bf16``: ``ZeroRule`` and Adam sharded over the ranks;
- ``zero_mirror``: ``zero`` as ``heal`` runs it: each rank also keeps the buddy copy of another
  rank's shard (``shard_optimizer(mirror=True)``; ``benchmarks/zero_mirror.py``);
- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` (gloo) and the full Adam;
- ``ddp_zero``: the same with ``torch.distributed.optim.ZeroRedundancyOptimizer`` (Adam).

Memory is the process's RSS: after the model is built (``rss_model``), and the kernel's peak
(``ru_maxrss``) after the timed steps, before any checkpoint work. Optimizer state bytes are
counted from the optimizer's own state.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import resource
import socket
import statistics
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lightning_mpi.comm.transport import Transport  # noqa: E402

COMM = MPI.COMM_WORLD
RANK, W = COMM.Get_rank(), COMM.Get_size()
ARMS = ("asa", "asa_bf16", "zero", "zero_bf16", "ddp", "ddp_zero", "zero_mirror")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def state_bytes(optimizer, rule=None) -> int:
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer there
    mirror = getattr(rule, "mirror", None)
    states = [*inner.state.values(), *(mirror.optimizer.state.values() if mirror is not None else [])]
    return sum(v.numel() * v.element_size() for s in states for v in s.values() if torch.is_tensor(v))


def init_gloo() -> None:
    import torch.distributed as dist

    port = None
    if RANK == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = COMM.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=RANK, world_size=W)


class Arm:
    """The model, its exchange and optimizer for one arm, and one training step."""

    def __init__(self, name: str, width: int, depth: int, lr: float = 1e-4) -> None:
        self.name = name
        self.model = mlp(width, depth)
        self.rss_model = rss_mib()
        self.transport = Transport(COMM, timeout=600)
        self.rule = None
        params = list(self.model.parameters())
        if name.startswith("ddp"):
            init_gloo()
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(self.model)
            if name == "ddp_zero":
                from torch.distributed.optim import ZeroRedundancyOptimizer

                self.optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=lr)
            else:
                self.optimizer = torch.optim.Adam(params, lr=lr)
        else:
            from lightning_mpi.rules.sync import SyncRule
            from lightning_mpi.rules.zero import ZeroRule

            self.net = self.model
            wire = "bf16" if name.endswith("bf16") else "fp32"
            rule = ZeroRule(wire=wire) if name.startswith("zero") else SyncRule(exchange="asa", wire=wire)
            self.rule = rule.bind(self.transport, params)
            self.optimizer = torch.optim.Adam(params, lr=lr)
            if name.startswith("zero"):
                self.rule.shard_optimizer(self.optimizer, mirror=name == "zero_mirror")
            self.rule.on_train_start()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(self.net(x), y).backward()
        if self.rule is not None and not self.rule.before_step(self.optimizer):
            return
        self.optimizer.step()
        if self.rule is not None:
            self.rule.after_step(self.optimizer)

    def close(self) -> None:
        if self.rule is not None:
            self.rule.close()
        if self.name.startswith("ddp"):
            import torch.distributed as dist

            dist.destroy_process_group()


# --- checkpoint timings -----------------------------------------------------------------------------
def timed(fn) -> float:
    """Seconds from a barrier before ``fn`` to a barrier after it (the slowest rank's time)."""
    COMM.Barrier()
    begin = time.perf_counter()
    fn()
    COMM.Barrier()
    return time.perf_counter() - begin


def rank0_save(arm: Arm, path: Path) -> None:
    """Lightning's rank-0 save of a replicated state: rank 0 writes everything."""
    from lightning_mpi.checkpoint.files import write_atomic

    if hasattr(arm.optimizer, "consolidate_state_dict"):  # ZeroRedundancyOptimizer: gather onto rank 0 first,
        arm.optimizer.consolidate_state_dict(to=0)       # as Lightning's Strategy.optimizer_state does
    if RANK == 0:
        checkpoint = {"state_dict": arm.model.state_dict(), "optimizer_states": [arm.optimizer.state_dict()]}
        write_atomic(path, lambda f: torch.save(checkpoint, f))


def rank0_load(arm: Arm, path: Path) -> None:
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    arm.model.load_state_dict(checkpoint["state_dict"])
    arm.optimizer.load_state_dict(checkpoint["optimizer_states"][0])


def sharded_save(arm: Arm, path: Path) -> None:
    from lightning_mpi.checkpoint import save_sharded

    spread = {f"state_dict/{name}" for name, _ in arm.model.named_parameters()}  # as the Trainer strategy does
    state = {"state_dict": arm.model.state_dict(), "optimizer_states": [arm.rule.optimizer_state()]}
    save_sharded(path, state, arm.transport, spread=spread)


def sharded_load(arm: Arm, path: Path) -> None:
    from lightning_mpi.checkpoint import load_sharded

    checkpoint = load_sharded(path, weights_only=True)
    arm.model.load_state_dict(checkpoint["state_dict"])
    arm.rule.load_optimizer_state(checkpoint["optimizer_states"][0])


def mpiio_save(arm: Arm, path: Path) -> None:
    """The alternative to one file per rank: one shared file, every rank's serialised shard at its
    offset (``Write_at_all``), rank 0's replicated part in a second file."""
    buffer = io.BytesIO()
    torch.save({"optimizer_states/0": arm.rule.optimizer_state()}, buffer)
    data = buffer.getbuffer()
    sizes = COMM.allgather(len(data))
    path.mkdir(exist_ok=True)
    handle = MPI.File.Open(COMM, str(path / "shards.bin"), MPI.MODE_WRONLY | MPI.MODE_CREATE)
    handle.Write_at_all(sum(sizes[:RANK]), data)
    handle.Sync()
    handle.Close()
    if RANK == 0:
        with open(path / "replicated.pt", "wb") as f:
            torch.save({"state_dict": arm.model.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())


def checkpoint_times(arm: Arm, directory: Path, repeats: int) -> dict:
    directory.mkdir(parents=True, exist_ok=True)
    times: dict[str, list[float]] = {}
    for i in range(repeats):
        if arm.name.startswith("zero"):
            times.setdefault("save_sharded", []).append(timed(lambda: sharded_save(arm, directory / f"s{i}")))
            times.setdefault("load_sharded", []).append(timed(lambda: sharded_load(arm, directory / f"s{i}")))
            times.setdefault("save_mpiio", []).append(timed(lambda: mpiio_save(arm, directory / f"m{i}")))
        else:
            times.setdefault("save_rank0", []).append(timed(lambda: rank0_save(arm, directory / f"r{i}.ckpt")))
            times.setdefault("load_rank0", []).append(timed(lambda: rank0_load(arm, directory / f"r{i}.ckpt")))
    sizes = {}
    if RANK == 0:
        for p in sorted(directory.glob("*0*")):
            sizes[p.name] = sum(f.stat().st_size for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    return {"checkpoint_seconds": {k: statistics.median(v) for k, v in times.items()}, "checkpoint_bytes": sizes}


def parse_worker_args(arms, steps: int, checkpoint_repeats: int) -> argparse.Namespace:
    """The command line every ZeRO benchmark worker takes (this one and zero_lightning_worker.py):
    the arm among ``arms``, the MLP's shape, the batch, the timed steps and the checkpoint timing."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--arm", choices=arms, required=True)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-repeats", type=int, default=checkpoint_repeats)
    parser.add_argument("--out", required=True)
    return parser.parse_args()


def main() -> None:
    args = parse_worker_args(ARMS, steps=12, checkpoint_repeats=3)
    torch.set_num_threads(1)
    rss_start = rss_mib()
    arm = Arm(args.arm, args.width, args.depth)
    g = torch.Generator().manual_seed(RANK)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    seconds = []
    for step in range(args.warmup + args.steps):
        COMM.Barrier()  # each step timed from the same start on every rank
        begin = time.perf_counter()
        arm.step(x, y)
        seconds.append(time.perf_counter() - begin)
    result = {
        "arm": args.arm, "world_size": W, "width": args.width, "depth": args.depth, "batch": args.batch,
        "params": sum(p.numel() for p in arm.model.parameters()),
        "rss_start_mib": COMM.allgather(rss_start), "rss_model_mib": COMM.allgather(arm.rss_model),
        "peak_rss_mib": COMM.allgather(peak_mib()), "rss_end_mib": COMM.allgather(rss_mib()),
        "optimizer_state_mib": COMM.allgather(state_bytes(arm.optimizer, arm.rule) / 2**20),
        "step_seconds": statistics.median(seconds[args.warmup :]),
    }
    result["samples_per_second"] = W * args.batch / result["step_seconds"]
    if args.checkpoint_dir:
        result.update(checkpoint_times(arm, Path(args.checkpoint_dir) / args.arm, args.checkpoint_repeats))
    arm.close()
    if RANK == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
