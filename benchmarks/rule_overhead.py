"""What a rule's hooks add to a step of the time-to-quality task, measured against the same step
without them, in the same processes.

Every rank trains the task's model (``benchmarks/ttq_task.py``) with its optimizer on a fixed
batch, in blocks of ``--block`` steps that alternate: with the rule's hooks (``before_step``,
``after_step``; the block ends by completing what is in flight) and without them. The overhead
is the mean difference of neighbouring blocks, so that a machine whose speed drifts (a shared
host) moves both sides alike; rank 0 prints one JSON line per rank's figures::

    mpiexec -n 2 python benchmarks/rule_overhead.py mpi_streaming_diloco:overlap_steps=5 --blocks 16

``ARM`` is a registered local-step strategy name (``mpi_diloco``, ``mpi_streaming_diloco``) with
``name:key=value`` overrides as in ``time_to_quality.py``. With ``--root DIR`` the rule is
imported from another checkout of the repository (a git worktree of an older commit), for a
before/after comparison in one sitting.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arm", help="mpi_diloco or mpi_streaming_diloco, with :key=value overrides")
    parser.add_argument("--blocks", type=int, default=16, help="pairs of blocks (with, without the hooks)")
    parser.add_argument("--block", type=int, default=25, help="steps per block")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose lightning_mpi runs")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(args.root))

    import lightning_mpi.comm  # noqa: F401  (MPI's thread level, before mpi4py initialises it)
    import torch
    from mpi4py import MPI

    from benchmarks import ttq_task
    from benchmarks.ttq_worker import parse_arm
    from lightning_mpi.comm.transport import Transport
    from lightning_mpi.rules.diloco import DiLoCoRule, StreamingDiLoCoRule

    rules = {"mpi_diloco": DiLoCoRule, "mpi_streaming_diloco": StreamingDiLoCoRule}
    name, overrides = parse_arm(args.arm)
    if name not in rules:
        parser.error(f"arm={name!r}: choose one of {sorted(rules)}")
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    module = ttq_task.make_module(ttq_task.TaskConfig())
    optimizer = module.configure_optimizers()
    bound = rules[name](**overrides).bind(Transport(comm), list(module.parameters()))
    bound.on_train_start()
    generator = torch.Generator().manual_seed(comm.rank)
    x = torch.randint(0, 256, (16, 64), generator=generator)
    y = torch.randint(0, 256, (16,), generator=generator)

    def step(hooks: bool) -> None:
        loss = torch.nn.functional.cross_entropy(module.net(x), y)
        optimizer.zero_grad()
        loss.backward()
        if not hooks or bound.before_step(optimizer):
            optimizer.step()
        if hooks:
            bound.after_step(optimizer)

    for _ in range(10):
        step(False)
    with_hooks, without = [], []
    for _ in range(args.blocks):
        for hooks, seconds in ((True, with_hooks), (False, without)):
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(args.block):
                step(hooks)
            if hooks:
                bound._wait()  # noqa: SLF001  (what the block started is its cost)
            seconds.append((time.perf_counter() - start) / args.block)
    bound.close()
    gaps = [a - b for a, b in zip(with_hooks, without, strict=True)]
    mine = (sum(with_hooks) / len(gaps), sum(without) / len(gaps), sum(gaps) / len(gaps), max(gaps) - min(gaps))
    every = comm.gather(mine, root=0)
    if comm.rank == 0:
        print(json.dumps({
            "arm": args.arm, "root": str(args.root), "ranks": comm.size, "blocks": args.blocks, "block": args.block,
            "with_hooks_ms": [round(1e3 * r[0], 1) for r in every],
            "without_ms": [round(1e3 * r[1], 1) for r in every],
            "overhead_ms": [round(1e3 * r[2], 2) for r in every],
            "overhead_spread_ms": [round(1e3 * r[3], 1) for r in every],
        }), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
