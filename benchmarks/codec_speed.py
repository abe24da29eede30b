#!/usr/bin/env python3
"""Where a compressed exchange spends its CPU time: encode, decode, error feedback, sum, top-k.

    python benchmarks/codec_speed.py                                   # this checkout only
    python benchmarks/codec_speed.py --baseline /tmp/base              # side by side with older files
    python benchmarks/codec_speed.py --mpi shm                         # + real exchanges, 2 ranks here
    python benchmarks/codec_speed.py --mpi 1gbit                       # + 2 simulated hosts at 1 Gbit/s (root)
    python benchmarks/codec_speed.py --device cuda --json codecs.json  # on a GPU: torch against cupy

``--baseline DIR`` loads ``codecs.py``, ``collectives.py`` and ``sparse.py`` from ``DIR`` (e.g. the
previous commit's ``lightning_mpi/comm/`` files, ``git show HEAD~1:lightning_mpi/comm/codecs.py >
DIR/codecs.py`` ...) and times them in the same process, interleaved with the current ones, so
that both see the same machine load. Every figure is the median of ``--repeat`` runs.

One process, one thread (like one rank of ``benchmarks/compression.py``), ``--world`` ranks
simulated by a loopback transport (Alltoall and Allgather are local copies of the wire rows):

- row codecs (``[world, n / world]`` rows): ``encode``, ``decode``, ``encode+EF`` (residual added,
  encoded, decoded, residual updated), and ``exchange`` = all the CPU work one rank does in one
  ASA exchange with error feedback on both stages (``asa_mean_steps``), also without feedback;
- top-k (1%): ``select`` (indices of the k largest magnitudes) and ``exchange`` (feedback, select,
  pack, scatter-add of every rank's pairs, mean: ``topk_mean_steps``).

``--device cuda`` runs the same operations on CUDA tensors, timed by wall clock between two
``torch.cuda.synchronize()``, and compares torch's code (``LIGHTNING_MPI_CUPY=0``) with the fused
cupy kernels (:mod:`lightning_mpi.comm.cupy_kernels`) in the same process, interleaved; without
cupy only the torch column is measured. The JSON rows then name the versions ``torch`` and ``cupy``.

MB/s is fp32 input bytes (4 n) per second. ``--mpi`` adds real 2-rank exchanges: the blocking
exchange time, the same Alltoall + Allgather with no codec work ("MPI only"), and the bytes each
rank sends. Prints tables; ``--json PATH`` also writes the numbers. Not a test.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

ROW_CODECS = ("fp16", "int8", "onebit")
TOPK_RATIO = 0.01


# ------------------------------------------------------------------------------ implementations ---
class Impl:
    """One version of the codec modules: ``codecs``, ``collectives``, ``sparse``; ``cupy`` (on
    CUDA) says whether the fused cupy kernels may run (the ``LIGHTNING_MPI_CUPY`` switch)."""

    def __init__(self, name: str, codecs, collectives, sparse, cupy: bool | None = None) -> None:
        self.name, self.codecs, self.collectives, self.sparse = name, codecs, collectives, sparse
        self.cupy = cupy

    def wrap(self, fn):
        """``fn`` run with this version's cupy switch (nothing to switch when ``cupy`` is None)."""
        if self.cupy is None:
            return fn
        from lightning_mpi.comm.cupy_kernels import ENV_SWITCH

        def switched():
            os.environ[ENV_SWITCH] = "1" if self.cupy else "0"
            try:
                fn()
            finally:
                os.environ.pop(ENV_SWITCH, None)

        return switched

    @classmethod
    def current(cls) -> "Impl":
        from lightning_mpi.comm import codecs, collectives, sparse

        return cls("after", codecs, collectives, sparse)

    @classmethod
    def from_dir(cls, directory: str, name: str = "before") -> "Impl":
        mods = {}
        for mod in ("codecs", "collectives", "sparse"):
            spec = importlib.util.spec_from_file_location(f"_{name}_{mod}", Path(directory) / f"{mod}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            mods[mod] = module
        return cls(name, mods["codecs"], mods["collectives"], mods["sparse"])

    def topk_workspace(self, k: int, world: int, numel: int):
        try:
            return self.sparse.TopKWorkspace(k, world, DEVICE, numel)
        except TypeError:  # older signature: no selection scratch
            return self.sparse.TopKWorkspace(k, world, DEVICE)


class Loopback:
    """A stand-in transport for one rank of ``size``: collectives are local copies, no waiting."""

    def __init__(self, size: int, rank: int = 0) -> None:
        self.size, self.rank = size, rank

    def ialltoall(self, send, recv):
        recv.copy_(send)
        return iter(())

    def iallgather(self, send, recv):
        recv.copy_(send.expand_as(recv))
        return iter(())


def _run(steps) -> None:
    for _ in steps:
        pass


#: The local tables time this thread's CPU seconds by default: on a shared machine, wall time
#: also counts the time other processes hold the core (``--clock wall`` to see that).
CLOCK = time.thread_time
#: Where the local tables' tensors live (``--device``); on CUDA every timing is bracketed by
#: ``torch.cuda.synchronize()`` so it covers the kernels, not just their launches.
DEVICE = torch.device("cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, repeat: int, prepare=None, clock=None) -> float:
    clock = clock or CLOCK
    times = []
    for _ in range(repeat):
        if prepare is not None:
            prepare()
        _sync()
        begin = clock()
        fn()
        _sync()
        times.append(clock() - begin)
    return statistics.median(times) * 1e3


# ------------------------------------------------------------------------------- measurements ---
def row_ops(impl: Impl, codec_name: str, n: int, world: int):
    """(op name, callable, prepare) for one row codec on ``n`` floats."""
    from lightning_mpi.comm.collectives import ASAWorkspace

    codec = impl.codecs.get_codec(codec_name)
    n -= n % world
    chunk = n // world
    gen = torch.Generator().manual_seed(0)
    grad = (torch.randn(world, chunk, generator=gen) * 1e-3).to(DEVICE)
    rows = grad.clone()
    wire = torch.empty(world, codec.wire_numel(chunk), dtype=codec.wire_dtype, device=DEVICE)
    out = torch.empty(world, chunk, device=DEVICE)
    residual = torch.zeros(world, chunk, device=DEVICE)
    flat = torch.empty(n, device=DEVICE)
    work = ASAWorkspace.for_buffer(flat, world, codec)
    owner = torch.zeros(chunk, device=DEVICE)
    loop = Loopback(world)
    codec.encode(grad, wire)

    def refill() -> None:
        rows.copy_(grad)

    def refill_flat() -> None:
        flat.view(world, chunk).copy_(grad)

    return [
        ("encode", lambda: codec.encode(grad, wire), None),
        ("decode", lambda: codec.decode(wire, out), None),
        ("encode+EF", lambda: impl.collectives.encode_with_feedback_(codec, rows, wire, residual, out), refill),
        ("exchange, EF", lambda: _run(impl.collectives.asa_mean_steps(loop, flat, codec, work, residual.view(-1), owner)), refill_flat),
        ("exchange, no EF", lambda: _run(impl.collectives.asa_mean_steps(loop, flat, codec, work)), refill_flat),
    ]


def topk_ops(impl: Impl, n: int, world: int):
    sparse = impl.sparse
    k = sparse.topk_count(n, TOPK_RATIO)
    gen = torch.Generator().manual_seed(0)
    grad = (torch.randn(n, generator=gen) * 1e-3).to(DEVICE)
    flat = grad.clone()
    residual = torch.zeros(n, device=DEVICE)
    work = impl.topk_workspace(k, world, n)
    loop = Loopback(world)

    def refill() -> None:
        flat.copy_(grad)

    return [
        ("select", lambda: sparse.topk_select(grad, k), None),
        ("exchange, EF", lambda: _run(sparse.topk_mean_steps(loop, flat, k, work, residual)), refill),
        ("exchange, no EF", lambda: _run(sparse.topk_mean_steps(loop, flat, k, work)), refill),
    ]


def measure_local(impls: list[Impl], sizes: list[int], codecs: list[str], world: int, repeat: int) -> list[dict]:
    results = []
    for n in sizes:
        for codec in codecs:
            ops = {impl.name: [(op, impl.wrap(fn), prepare) for op, fn, prepare in
                               (row_ops(impl, codec, n, world) if codec != "topk" else topk_ops(impl, n, world))]
                   for impl in impls}
            names = [op[0] for op in ops[impls[0].name]]
            for i, op in enumerate(names):
                samples = {impl.name: [] for impl in impls}
                for _ in range(repeat):  # interleaved: every version sees the same load
                    for impl in impls:
                        _, fn, prepare = ops[impl.name][i]
                        samples[impl.name].append(median_ms(fn, 1, prepare))
                row = {"codec": codec, "op": op, "numel": n, "device": DEVICE.type}
                for impl in impls:
                    row[f"{impl.name}_ms"] = statistics.median(samples[impl.name])
                results.append(row)
                print(_fmt_row(row, impls), flush=True)
    return results


def _fmt_row(row: dict, impls: list[Impl]) -> str:
    cells = [row["codec"], row["op"], f"{row['numel'] / 1e6:g}M"]
    for impl in impls:
        ms = row[f"{impl.name}_ms"]
        cells += [f"{ms:,.2f}", f"{4 * row['numel'] / ms / 1e3:,.0f}"]
    if len(impls) == 2:
        cells.append(f"{row[impls[0].name + '_ms'] / row[impls[1].name + '_ms']:.1f}x")
    return "| " + " | ".join(cells) + " |"


def header(impls: list[Impl]) -> str:
    cols = ["codec", "op", "floats"]
    for impl in impls:
        cols += [f"{impl.name} ms", f"{impl.name} MB/s"]
    if len(impls) == 2:
        cols.append("speed-up")
    return "| " + " | ".join(cols) + " |\n|" + "|".join("---" for _ in cols) + "|"


# ------------------------------------------------------------------------------------ MPI part ---
def mpi_worker(args) -> None:
    from mpi4py import MPI

    from lightning_mpi.comm.collectives import ASAWorkspace
    from lightning_mpi.comm.transport import Transport

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    transport = Transport(comm)
    world, rank = transport.size, transport.rank
    impls = [Impl.current()] + ([Impl.from_dir(args.baseline)] if args.baseline else [])

    def drive(steps) -> None:
        for request in steps:
            request.Wait()

    results = []
    for n in args.sizes_numel:
        n -= n % world
        chunk = n // world
        for codec_name in args.codecs:
            for impl in impls:
                gen = torch.Generator().manual_seed(rank)
                grad = torch.randn(n, generator=gen) * 1e-3
                flat = grad.clone()
                residual = torch.zeros(n)
                if codec_name == "topk":
                    k = impl.sparse.topk_count(n, TOPK_RATIO)
                    work = impl.topk_workspace(k, world, n)
                    wire_send, wire_recv = work.send, work.recv
                    sent = (world - 1) * wire_send.numel() * 4

                    def exchange():
                        drive(impl.sparse.topk_mean_steps(transport, flat, k, work, residual))

                    def mpi_only():
                        comm.Iallgather(wire_send, wire_recv).Wait()
                else:
                    codec = impl.codecs.get_codec(codec_name)
                    work = ASAWorkspace.for_buffer(flat, world, codec)
                    owner = torch.zeros(chunk)
                    sent = 2 * (world - 1) * work.send_wire[0].numel() * work.send_wire.element_size()

                    def exchange():
                        drive(impl.collectives.asa_mean_steps(transport, flat, codec, work, residual, owner))

                    def mpi_only():
                        comm.Ialltoall(work.send_wire, work.recv_wire).Wait()
                        comm.Iallgather(work.mine_wire, work.recv_wire).Wait()

                def prepare():
                    flat.copy_(grad)
                    comm.Barrier()

                exchange()  # warm-up (allocations, communicator setup)
                t_ex = median_ms(exchange, args.repeat, prepare, time.perf_counter)
                mpi_only()
                t_mpi = median_ms(mpi_only, args.repeat, lambda: comm.Barrier(), time.perf_counter)
                row = {"codec": codec_name, "impl": impl.name, "numel": n, "exchange_ms": t_ex, "mpi_only_ms": t_mpi, "sent_bytes": sent}
                row = comm.allreduce([row])  # every rank's figures
                if rank == 0:
                    merged = dict(row[0])
                    merged["exchange_ms"] = max(r["exchange_ms"] for r in row)
                    merged["mpi_only_ms"] = max(r["mpi_only_ms"] for r in row)
                    results.append(merged)
    if rank == 0:
        Path(args.out).write_text(json.dumps(results))


def run_mpi(setting: str, args) -> list[dict]:
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"codec_speed_mpi_{os.getpid()}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--mpi-worker", "--out", str(out), "--repeat", str(args.repeat),
           "--sizes", *map(str, args.sizes), "--codecs", *args.codecs]
    if args.baseline:
        cmd += ["--baseline", args.baseline]
    if setting == "shm":
        mpiexec = str(Path(sys.executable).parent / "mpiexec")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
        subprocess.run([mpiexec, "-n", "2", *cmd], env=env, check=True, timeout=1800)
    else:
        from benchmarks.cluster import SimCluster

        with SimCluster(2, rate=setting) as cluster:
            res = cluster.run_mpi(cmd, timeout=1800)
            if res.returncode != 0:
                print(res.stdout[-3000:], res.stderr[-6000:], file=sys.stderr)
                raise SystemExit(f"MPI run failed ({res.returncode})")
    rows = json.loads(out.read_text())
    out.unlink()
    return rows


def cuda_impls() -> tuple[list[Impl], str]:
    """torch's code and the cupy kernels on CUDA (torch alone, and why, when cupy is missing)."""
    from lightning_mpi.comm import cupy_kernels

    torch_impl = Impl.current()
    torch_impl.name, torch_impl.cupy = "torch", False
    if cupy_kernels.cupy_module() is None:
        return [torch_impl], f"skipped: cupy not installed ({cupy_kernels.why_not()})"
    cupy_impl = Impl.current()
    cupy_impl.name, cupy_impl.cupy = "cupy", True
    return [torch_impl, cupy_impl], f"cupy {cupy_kernels.cupy_module().__version__}"


# ------------------------------------------------------------------------------------- driver ---
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1, 6.3, 25], help="millions of floats")
    ap.add_argument("--codecs", nargs="+", default=[*ROW_CODECS, "topk"], choices=[*ROW_CODECS, "int4", "bf16", "topk"])
    ap.add_argument("--world", type=int, default=2, help="ranks simulated by the loopback transport")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--baseline", help="directory with older codecs.py, collectives.py, sparse.py")
    ap.add_argument("--mpi", choices=["shm", "1gbit", "10gbit"], help="also time real 2-rank exchanges")
    ap.add_argument("--skip-local", action="store_true")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu", help="local tables: thread CPU time or wall time")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="local tables on CUDA tensors: torch against the cupy kernels, wall time")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--mpi-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes_numel = [int(round(s * 1e6)) for s in args.sizes]
    if args.mpi_worker:
        mpi_worker(args)
        return
    torch.set_num_threads(1)
    global CLOCK, DEVICE
    CLOCK = time.thread_time if args.clock == "cpu" and args.device == "cpu" else time.perf_counter
    DEVICE = torch.device(args.device)
    report: dict = {"sizes": args.sizes, "world": args.world, "repeat": args.repeat, "clock": args.clock, "device": args.device}
    if not args.skip_local:
        if args.device == "cuda":
            impls, report["cupy"] = cuda_impls()
            what = f"CUDA work of one rank ({torch.cuda.get_device_name()}), wall time between synchronizes"
        else:
            impls = ([Impl.from_dir(args.baseline)] if args.baseline else []) + [Impl.current()]
            what = f"CPU work of one rank, 1 thread, {args.clock} time"
        print(f"\n{what}, world {args.world} (loopback), median of {args.repeat}; "
              f"top-k at {TOPK_RATIO:.0%}; MB/s = fp32 input bytes / s")
        print(header(impls))
        report["local"] = measure_local(impls, args.sizes_numel, args.codecs, args.world, args.repeat)
    if args.mpi:
        rows = run_mpi(args.mpi, args)
        report["mpi"] = {"setting": args.mpi, "rows": rows}
        print(f"\nReal exchange, 2 ranks ({args.mpi}), blocking, slowest rank, median of {args.repeat}")
        print("| codec | version | floats | exchange ms | MPI only ms | exchange - MPI ms | MB sent/rank |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['codec']} | {r['impl']} | {r['numel'] / 1e6:g}M | {r['exchange_ms']:,.1f} | {r['mpi_only_ms']:,.1f} | "
                  f"{r['exchange_ms'] - r['mpi_only_ms']:,.1f} | {r['sent_bytes'] / 1e6:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
