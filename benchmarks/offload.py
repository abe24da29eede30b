"""Peak memory and step time of activation offload: no offload, ``save_on_cpu`` and ``LMSOffload``.

    OMP_NUM_THREADS=1 python benchmarks/offload.py                 # CUDA if present, else CPU + disk
    OMP_NUM_THREADS=1 python benchmarks/offload.py --device cpu --side 96 --cap-mb 800
    python benchmarks/offload.py --device cuda --side 128 --cap-mb 4096
    OMP_NUM_THREADS=1 python benchmarks/offload.py --device cpu --model mlp --repeats 3
    python benchmarks/offload.py --device cuda --arms gpu --cap-mb 16384             # issue 16's arms
    python benchmarks/offload.py --device cuda --model gpt --precision bf16-mixed --arms gpu --no-search

Model: the 3D U-Net of ``examples/segmentation3d.py`` (two levels, BatchNorm, in-place ReLU),
``--channels`` wide, ``--convs`` convolutions per block, on one ``side^3`` synthetic volume per
step: its memory is activations, not weights. On CPU the default is 6 convolutions per block, an
activation-dominated model: with the paper's 2, the working set of forward and backward itself
(about 75 MiB at 64^3 and 8 channels in a no-grad forward, which no offloading can remove) is as
large as all saved activations together, and offloading can remove at most about a third of the
training peak (measured: -28% at 2 convolutions per block, -45% at 4). Training runs under Lightning's ``Trainer`` (SGD with momentum), each configuration in a
fresh process so that peak memory is that run's alone:

* ``none``: plain training.
* ``save_on_cpu``: ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` around each training
  batch (a callback enters it in ``on_train_batch_start``, leaves it in ``on_train_batch_end``).
  On a CPU-only machine this copies each saved tensor to another CPU tensor: more memory, not
  less; it is listed for completeness.
* ``LMSOffload``: ``LMSOffload(target="cpu")`` on CUDA, ``LMSOffload(target="disk")`` on CPU
  (spill files in ``--directory``), default settings otherwise.

Memory: on CUDA ``torch.cuda.max_memory_allocated`` (total, and above what is allocated when
training starts: the activation peak). On CPU the kernel's peak RSS of the process
(``ru_maxrss``; total, and above the RSS when training starts: the training peak; the process
baseline of Python, torch and Lightning is the same in every run). With ``--repeats``, each mode
runs that many times in alternating order and the table shows medians.

Allocator (CPU): the three runs share ``GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1048576:
glibc.malloc.hugetlb=1``, so the comparison isolates offloading. The threshold is what
``LMSOffload`` sets for itself on CPU (glibc's default keeps freed activations in its heap, and
peak RSS would not drop); huge pages remove the page-fault cost that the threshold brings (on the
VM this was written on, about +30% step time without them). Two more rows show what an untuned
process gets: ``none`` and ``LMSOffload`` under glibc's defaults (the callback still sets its
threshold, without huge pages). Step time: median over the
steps after the first (warm-up).

IBM's use case: the largest ``side`` (multiples of ``--side-step``) that trains one step under a memory cap,
without and with ``LMSOffload``. On CUDA the cap is ``torch.cuda.set_per_process_memory_fraction``
(a run fits when it does not raise out-of-memory). On CPU a run fits when its peak RSS stays under
the cap; measured after the fact, exactly (``ru_maxrss`` is the kernel's high-water mark), which is
what a hard RSS limit would enforce, without needing root for a cgroup.

``--model mlp``: a deep MLP (``--depth`` Linear+ReLU layers, ``--width`` wide, ``--batch`` rows,
default 16 x 256 at 16384), activation-dominated and of low arithmetic intensity: no convolution
hides the I/O or the page faults. No offload and ``LMSOffload(target="disk")``, each under three
allocator settings at startup: ``defaults`` (nothing set: what a new user runs),
``thp`` (``THP_MEM_ALLOC_ENABLE=1``) and ``tuned`` (glibc's threshold and huge pages), all six arms
interleaved ``--repeats`` times in alternating order, each a fresh process; medians. Peak memory
is the process's peak RSS (``ru_maxrss``), compared with no offload under glibc's defaults. Per
step it also reports CPU time (user + system, every thread of the process: the I/O thread too)
and minor page faults, which on a shared machine say more than wall time does.

``--arms``: which runs to compare (default ``none save_on_cpu LMSOffload``; ``gpu`` stands for
issue 16's list: torchtune's ``OffloadActivations``, a prefetch sweep, and non-reentrant
activation checkpointing alone and with each offloader; see ``benchmarks/offload_arms.py``).
``--model gpt``: a plain GPT-like transformer (``--depth`` blocks, ``--width`` wide, ``--seq``
tokens, ``--batch`` sequences, default 12 x 1024 x 1024 x 8), best with ``--precision
bf16-mixed``; no largest-input search. On CUDA each run also reports ``max_memory_reserved`` and
pinned host memory (``torch.cuda.host_memory_stats()`` beside ``LMSOffload``'s pool count).

A table goes to stdout; a PNG and a JSON file to ``--results`` (default ``benchmarks/results``):
``offload_<device>.*``, ``offload_<device>_gpt.*``, ``offload_<device>_mlp.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
REPO = HERE.parent
MiB = 2**20

sys.path.insert(0, str(HERE))
from offload_arms import DEFAULT_ARMS, GPU_ARMS, parse_arm  # noqa: E402
from offload_report import _peak, mlp_table, plot, table  # noqa: E402


# --- one run, in this process -------------------------------------------------------------------
def run_once(mode: str, device: str, side: int, channels: int, convs: int, steps: int, directory: str | None, cap_mb: float | None,
             model: str = "unet", depth: int = 16, width: int = 256, batch: int = 16384, precision: str = "32-true",
             seq: int = 1024, vocab: int = 8192) -> dict:
    """Train ``steps`` steps of arm ``mode`` in this process and measure; returns a JSON-able dict."""
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    sys.path.insert(0, str(REPO / "examples"))
    sys.path.insert(0, str(REPO))
    from offload_arms import GPT, blocks_of, checkpoint_blocks, offloader_callbacks, pinned_snapshot
    from segmentation3d import UNet3d

    arm = parse_arm(mode)
    torch.manual_seed(0)
    if device == "cuda" and cap_mb is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(cap_mb * MiB / total, 1.0))

    class OneVolume(Dataset):
        """The same synthetic sample every step (no extra memory for a dataset): one volume
        (U-Net) or one batch of feature rows (MLP)."""

        def __init__(self) -> None:
            if model == "mlp":
                self.x = torch.randn(batch, width)
                self.y = torch.randint(0, 10, (batch,))
            elif model == "gpt":
                tokens = torch.randint(0, vocab, (batch, seq + 1))
                self.x, self.y = tokens[:, :-1], tokens[:, 1:]
            else:
                self.x = torch.randn(1, side, side, side)
                self.y = (self.x[0] > 0.5).long()

        def __len__(self) -> int:
            return steps

        def __getitem__(self, i):
            return self.x, self.y

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if model == "mlp":
                layers: list = []
                for _ in range(depth):
                    layers += [nn.Linear(width, width), nn.ReLU()]
                self.net = nn.Sequential(*layers, nn.Linear(width, 10))
            elif model == "gpt":
                self.net = GPT(vocab, width, depth, seq)
            else:
                self.net = UNet3d(channels, convs=convs)
            if arm.checkpoint:
                checkpoint_blocks(blocks_of(self.net, model))

        def training_step(self, batch, batch_idx):
            x, y = batch
            if model in ("mlp", "gpt"):  # the loader adds a batch dimension of 1 around the one batch
                x, y = x[0], y[0]
            out = self.net(x)
            if model == "gpt":
                out, y = out.reshape(-1, vocab), y.reshape(-1)
            return nn.functional.cross_entropy(out, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Probe(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.cpu: list[tuple[float, float, int]] = []  # user s, system s, minor page faults

        def on_train_start(self, trainer, pl_module):
            self.base_rss = _current_rss()
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.base_alloc = torch.cuda.memory_allocated()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if device == "cuda":
                torch.cuda.synchronize()
            self.t0, self.ru0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if device == "cuda":
                torch.cuda.synchronize()
                self.pinned = pinned_snapshot(lms)  # the last step's, before teardown frees the pool
            self.times.append(time.perf_counter() - self.t0)
            ru = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process, I/O included
            self.cpu.append((ru.ru_utime - self.ru0.ru_utime, ru.ru_stime - self.ru0.ru_stime, ru.ru_minflt - self.ru0.ru_minflt))

    result = {"mode": mode, "device": device, "model": model, "side": side, "channels": channels, "convs": convs,
              "precision": precision, "ok": True}
    try:
        offloaders, lms = offloader_callbacks(arm, device, directory, pl)
    except ImportError as error:  # torchtune (or its torchao) is not installed
        return dict(result, ok=False, skipped=f"{arm.offloader} not installed ({error})")
    probe = Probe()
    callbacks: list = [*offloaders, probe]
    trainer = pl.Trainer(
        accelerator=device, devices=1, max_steps=steps, callbacks=callbacks, logger=False, precision=precision,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0,
    )
    try:
        trainer.fit(Module(), DataLoader(OneVolume(), batch_size=1))
    except torch.OutOfMemoryError as error:  # the GPU cap
        result.update(ok=False, error=str(error).splitlines()[0])
        return result
    result["step_s"] = statistics.median(probe.times[1:] or probe.times)
    cpu = probe.cpu[1:] or probe.cpu
    result["user_s"] = statistics.median(c[0] for c in cpu)
    result["sys_s"] = statistics.median(c[1] for c in cpu)
    result["minflt"] = statistics.median(c[2] for c in cpu)
    result["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["base_rss"] = probe.base_rss
    if device == "cuda":
        result["peak_alloc"] = torch.cuda.max_memory_allocated()
        result["peak_reserved"] = torch.cuda.max_memory_reserved()
        result["base_alloc"] = probe.base_alloc
        result.update(getattr(probe, "pinned", {}))
    if lms is not None and lms.last_stats is not None:
        s = lms.last_stats
        result.update(offloaded=s.offloaded_bytes, hidden_ms=s.hidden_ms, exposed_ms=s.exposed_ms)
    if device == "cpu" and cap_mb is not None:
        result["ok"] = result["peak_rss"] <= cap_mb * MiB
    return result


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --- the driver: one fresh process per run ------------------------------------------------------
# Allocator settings a run starts with (CPU): what the comparison holds fixed.
ALLOCATORS = {
    # glibc's mmap threshold (what LMSOffload sets for itself) and huge pages for glibc's mmaps
    "tuned": {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576:glibc.malloc.hugetlb=1"},
    # what a new user gets: nothing set (LMSOffload still sets its mmap threshold)
    "defaults": {},
    # torch's own switch: CPU tensors of 2 MiB and more on transparent huge pages
    "thp": {"THP_MEM_ALLOC_ENABLE": "1"},
}


def run_in_subprocess(mode: str, args: argparse.Namespace, side: int, steps: int, cap_mb: float | None = None,
                      glibc_defaults: bool = False, allocator: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode, "--device", args.device, "--side", str(side),
           "--channels", str(args.channels), "--convs", str(args.convs), "--steps", str(steps),
           "--model", args.model, "--depth", str(args.depth), "--width", str(args.width), "--batch", str(args.batch),
           "--precision", args.precision, "--seq", str(args.seq), "--vocab", str(args.vocab)]
    if args.directory:
        cmd += ["--directory", args.directory]
    if cap_mb is not None:
        cmd += ["--cap-mb", str(cap_mb)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
    for name in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE"):
        env.pop(name, None)
    if allocator is None:
        allocator = "defaults" if glibc_defaults else "tuned"
    if args.device == "cpu":
        env.update(ALLOCATORS[allocator])
    begin = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall_s = time.perf_counter() - begin
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        # CPU allocation failures and the like: the run did not fit
        return {"mode": mode, "side": side, "ok": False, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    result = json.loads(lines[-1])
    result["wall_s"] = wall_s  # the whole run: start-up, imports and teardown with the steps
    if glibc_defaults:
        result["mode"] += " (glibc defaults)"
    result["allocator"] = allocator
    return result


def largest_side(mode: str, args: argparse.Namespace, start: int, progress=None) -> tuple[int, list[dict]]:
    """Walk up the sides from ``start`` in steps of ``--side-step`` until a run does not fit;
    ``progress(best, trials)`` after each trial (a walk cut short still tells how far it got)."""
    best, trials, side = 0, [], start
    while side <= args.max_side:
        result = run_in_subprocess(mode, args, side, steps=1, cap_mb=args.cap_mb)
        trials.append(result)
        print(f"  {mode:<11} side {side:>3}: {'fits' if result['ok'] else 'does not fit'}"
              + (f" (peak {_peak(result, args.device) / MiB:.0f} MiB)" if "peak_rss" in result else ""), flush=True)
        if not result["ok"]:
            break
        best, side = side, side + args.side_step
        if progress is not None:
            progress(best, trials)
    return best, trials


def _run_summary(result: dict, device: str) -> str:
    """One line per run for the log: its figures, so a benchmark cut short still shows them."""
    if "step_s" not in result:
        return result.get("skipped") or f"failed: {result.get('error', '?')}"
    peak = _peak(result, device) - (result["base_alloc"] if device == "cuda" else result["base_rss"])
    return f"step {result['step_s']:.3f} s, training peak {peak / MiB:.0f} MiB above start, run {result.get('wall_s', 0):.0f} s"


def _median_row(results: list[dict]) -> dict:
    """One row per mode: the median step time and peak over repeats (all runs kept in "runs")."""
    ok = [r for r in results if "step_s" in r]
    if not ok:
        return results[0]
    row = dict(ok[0], runs=results)
    for key in ("step_s", "peak_rss", "peak_alloc", "peak_reserved", "hidden_ms", "exposed_ms", "user_s", "sys_s", "minflt"):
        if key in row:
            row[key] = statistics.median(r[key] for r in ok)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    parser.add_argument("--side", type=int, default=None, help="volume side (multiple of 4); default 64 on CPU, 160 on CUDA")
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--convs", type=int, default=None, help="convolutions per U-Net block (default 6 on CPU, 2 on CUDA)")
    parser.add_argument("--steps", type=int, default=3, help="steps per run; the first is warm-up")
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, in alternating order; medians are reported")
    parser.add_argument("--directory", default=None, help="spill directory for the disk target (default: a temporary one)")
    parser.add_argument("--cap-mb", type=float, default=None, help="memory cap for the largest-input search (default: 768 on CPU, 8192 on CUDA)")
    parser.add_argument("--max-side", type=int, default=None, help="stop the search here (default 128 on CPU, 320 on CUDA)")
    parser.add_argument("--side-step", type=int, default=None, help="search granularity (default 8 on CPU, 16 on CUDA)")
    parser.add_argument("--no-search", action="store_true", help="skip the largest-input search")
    parser.add_argument("--search-only", action="store_true", help="run only the largest-input search (no arms)")
    parser.add_argument("--search-start", type=int, default=32, help="first side the search tries")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    parser.add_argument("--model", choices=["unet", "mlp", "gpt"], default="unet",
                        help="unet: the 3D U-Net; mlp: a deep MLP (--depth Linear+ReLU layers, --width wide, "
                             "--batch rows), activation-dominated and of low arithmetic intensity: nothing hides the I/O; "
                             "gpt: a GPT-like transformer (--depth blocks, --width, --seq, --batch, --vocab)")
    parser.add_argument("--depth", type=int, default=None, help="MLP layers (16) or GPT blocks (12)")
    parser.add_argument("--width", type=int, default=None, help="MLP width (256) or GPT width (1024)")
    parser.add_argument("--batch", type=int, default=None, help="MLP rows (16384) or GPT sequences (8)")
    parser.add_argument("--seq", type=int, default=1024, help="GPT sequence length")
    parser.add_argument("--vocab", type=int, default=8192, help="GPT vocabulary")
    parser.add_argument("--precision", default="32-true", help="Lightning precision, e.g. bf16-mixed")
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS),
                        help="runs to compare (see offload_arms.py), or 'gpu' for issue 16's list")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the JSON and PNG go")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    gpt = args.model == "gpt"
    args.depth = args.depth or (12 if gpt else 16)
    args.width = args.width or (1024 if gpt else 256)
    args.batch = args.batch or (8 if gpt else 16384)
    args.arms = list(GPU_ARMS) if args.arms == ["gpu"] else args.arms
    for arm in args.arms:
        try:
            parse_arm(arm)  # a bad arm fails here, not in a worker
        except ValueError as error:
            parser.error(str(error))
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = args.device == "cuda"
    args.side = args.side or (160 if gpu else 64)
    args.convs = args.convs or (2 if gpu else 6)
    args.max_side = args.max_side or (320 if gpu else 128)
    args.side_step = args.side_step or (16 if gpu else 8)

    if args.worker is not None:
        print(json.dumps(run_once(args.worker, args.device, args.side, args.channels, args.convs, args.steps, args.directory,
                                  args.cap_mb, args.model, args.depth, args.width, args.batch, args.precision, args.seq, args.vocab)))
        return

    args.cap_mb = args.cap_mb or (8192.0 if gpu else 768.0)
    own_directory = args.directory is None and not gpu
    if own_directory:
        args.directory = tempfile.mkdtemp(prefix="lms-bench-")
    try:
        if args.model == "mlp":
            _benchmark_mlp(args)
        else:
            _benchmark(args, gpu)
    finally:
        if own_directory:
            shutil.rmtree(args.directory, ignore_errors=True)


def _benchmark(args: argparse.Namespace, gpu: bool) -> None:
    what = (f"model=gpt depth={args.depth} width={args.width} seq={args.seq} batch={args.batch}" if args.model == "gpt"
            else f"side={args.side} channels={args.channels} convs={args.convs}")
    print(f"device={args.device} {what} precision={args.precision} steps={args.steps} repeats={args.repeats} "
          f"directory={args.directory} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
    modes = [] if args.search_only else args.arms
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    args.results.mkdir(parents=True, exist_ok=True)
    stem = args.results / (f"offload_{args.device}" + ("_gpt" if args.model == "gpt" else ""))
    search: dict = {}

    def save_so_far() -> None:
        # after every run: a benchmark cut short (a GPU lease, a stage timeout) keeps what finished
        rows = [_median_row(runs[mode]) for mode in modes if runs[mode]]
        stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows, "search": search}, indent=2, default=str))

    for repeat in range(args.repeats):
        # Alternate the order so that drift in machine load does not favour one mode.
        for mode in modes if repeat % 2 == 0 else modes[::-1]:
            runs[mode].append(run_in_subprocess(mode, args, args.side, args.steps))
            print(f"  {mode} (run {repeat + 1}/{args.repeats}): {_run_summary(runs[mode][-1], args.device)}", flush=True)
            save_so_far()
    rows = [_median_row(runs[mode]) for mode in modes]
    if not gpu and set(DEFAULT_ARMS) <= set(modes):
        for mode in ("none", "LMSOffload"):
            rows.append(run_in_subprocess(mode, args, args.side, args.steps, glibc_defaults=True))
            print(f"  {mode} (glibc defaults): done", flush=True)
    if not args.no_search and args.model == "unet":
        print(f"largest side under {args.cap_mb:.0f} MiB:", flush=True)
        def progress(mode: str, done: list[dict]):
            def record(best: int, trials: list[dict]) -> None:
                search[mode], search["trials"] = best, done + trials
                save_so_far()

            return record

        search["none"], trials_none = largest_side("none", args, args.search_start, progress("none", []))
        search["LMSOffload"], trials_lms = largest_side(
            "LMSOffload", args, max(search["none"], args.search_start), progress("LMSOffload", trials_none))
        search["trials"] = trials_none + trials_lms

    print()
    print(table(rows, args.device))
    print("* against the none run with the same allocator settings")
    if search:
        n, m = search["none"], search["LMSOffload"]
        ratio = f"{(m / n) ** 3:.2f}x the volume" if n else "n/a"
        print(f"\nLargest side that trains under {args.cap_mb:.0f} MiB: none {n}^3, LMSOffload {m}^3 ({ratio}).")
    stem.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows, "search": search}, indent=2, default=str))
    plot(rows, search, args, stem.with_suffix(".png"))
    print(f"\nwrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")


def _benchmark_mlp(args: argparse.Namespace) -> None:
    """No offload against LMSOffload on the MLP, under each allocator setting, every arm a fresh
    process, the arms interleaved (alternating order) ``--repeats`` times; medians."""
    arms = [(mode, alloc) for alloc in ("defaults", "thp", "tuned") for mode in ("none", "LMSOffload")]
    print(f"device={args.device} model=mlp depth={args.depth} width={args.width} batch={args.batch} steps={args.steps} "
          f"repeats={args.repeats} directory={args.directory} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {arm: [] for arm in arms}
    for repeat in range(args.repeats):
        for mode, alloc in arms if repeat % 2 == 0 else arms[::-1]:
            runs[(mode, alloc)].append(run_in_subprocess(mode, args, args.side, args.steps, allocator=alloc))
            print(f"  {mode} ({alloc}, run {repeat + 1}/{args.repeats}): done", flush=True)
    rows = [_median_row(runs[arm]) for arm in arms]
    print()
    print(mlp_table(rows, arms))
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / f"offload_{args.device}_mlp.json"
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2, default=str))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
