"""torchft's arms of benchmarks/goodput.py: a supervisor, its lighthouse and one replica group per process.

    python benchmarks/goodput_torchft.py supervise OUT --replicas 3 [--algo ddp|diloco] [--hosts h0,h1,h2]
    python benchmarks/goodput_torchft.py worker OUT --replica 1 --replicas 3 --lighthouse http://HOST:PORT

torchft (``pip install torchft-nightly``) has no Lightning integration: the replica is a plain torch
loop on ``goodput_model``'s MLP, data and optimizer (the same as our arms'), ``--batch`` samples per
replica and step, with torchft's fault-tolerant pieces:

- ``--algo ddp``: ``torchft.Manager`` + ``torchft.DistributedDataParallel`` + ``torchft.Optimizer``
  on ``torchft.ProcessGroupGloo`` (asynchronous quorum, as in torchft's ``train_ddp.py``): every
  step asks the lighthouse for the quorum, averages the gradients among the participants and
  commits only if every participant's allreduce succeeded (``manager.should_commit``);
- ``--algo diloco``: ``torchft.local_sgd.DiLoCo`` (synchronous quorum, as torchft requires): the
  same inner SGD for ``--sync-every`` steps, then the pseudo-gradients averaged and an outer SGD
  step (lr 0.7, Nesterov momentum 0.9, torchft's and the paper's values).

Each replica group is one process: a ``TCPStore`` of its own (torchft's per-group store; the
Manager only connects to it), a Manager that advertises the host's name, and the lighthouse on
the supervisor's host. A replica that joins late or restarts heals from a live one (torchft's HTTP
checkpoint transport) at the step the others are at.

torchft does not restart processes; ``supervise`` does, as a cluster scheduler would: it starts
``torchft_lighthouse`` (``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``, the
README's values; a majority rule of its own keeps a quorum from splitting), then the replicas
(on the simulated hosts of ``benchmarks/cluster.py`` when ``--hosts`` names them, one per
replica), and starts again every replica that exits with an error or a signal, until ``OUT/stop``
exists. A stopped (SIGSTOP) replica is alive to it, so it stays as it is: the lighthouse drops it
from the quorum when its heartbeats stop (5 s, the default ``--heartbeat_timeout_ms``).

What the benchmark reads, under OUT (the same files as ``goodput_worker.py``'s):

- ``progress``: replica 0 appends ``time step participants pid`` after every committed step
  (``step``: the manager's committed steps, times ``--sync-every`` for DiLoCo: inner steps, so
  that the useful samples of a line are its step's participants x ``--batch`` per inner step);
- ``discarded``: replica 0 appends ``time step steps pid`` for every step the manager did not
  commit (``steps``: the inner steps thrown away with it);
- ``pids/<pid>``: every replica writes its replica id at its first committed step;
- ``ready/<replica>``: written when its manager is up; the first launch waits for all of them;
- ``weights/<pid>``: ``replica step digest`` after the step ``OUT/stop`` asks for;
- ``supervisor.log``: every start and exit of a replica.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

#: torchft's README starts its lighthouse with these (min_replicas 1: a lone replica may train on)
LIGHTHOUSE_OPTIONS = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]
#: torchft's train_ddp.py: gloo gives up on a peer after 5 s, the manager's other calls after 30 s
PG_TIMEOUT_S = 5
MANAGER_TIMEOUT_S = 30
#: how long a replica waits for a quorum before it fails (and is started again)
QUORUM_TIMEOUT_S = 30
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9


def missing() -> str | None:
    """Why torchft's arms cannot run in this environment, or None."""
    try:
        import torchft  # noqa: F401
    except Exception as error:  # ImportError, or a broken install
        return f"torchft does not import ({type(error).__name__}: {error}); pip install torchft-nightly"
    if lighthouse_binary() is None:
        return "torchft_lighthouse is not installed beside this Python"
    return None


def lighthouse_binary() -> str | None:
    beside = Path(sys.executable).parent / "torchft_lighthouse"
    return str(beside) if beside.exists() else shutil.which("torchft_lighthouse")


def in_host(host: str, cmd: list[str]) -> list[str]:
    """``cmd`` on a simulated host of benchmarks/cluster.py: its network namespace and hostname."""
    return [
        "ip",
        "netns",
        "exec",
        host,
        "unshare",
        "--uts",
        "--",
        "/bin/sh",
        "-c",
        'hostname "$0" && exec "$@"',
        host,
        *cmd,
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# ---- the replica ----


def shard_batches(replica: int, replicas: int, batch: int, epoch: int):
    """This replica's batches of one epoch: its share of the set (every ``replicas``-th sample),
    shuffled by (replica, epoch)."""
    import torch
    from goodput_model import dataset

    data = dataset()
    mine = torch.arange(replica, len(data), replicas)
    generator = torch.Generator().manual_seed(1000 * epoch + replica)
    order = mine[torch.randperm(len(mine), generator=generator)]
    x, y = data.tensors
    for start in range(0, len(order) - batch + 1, batch):
        index = order[start : start + batch]
        yield x[index], y[index]


def worker(args: argparse.Namespace) -> None:
    import torch
    from goodput_model import StopRequest, mlp, optimizer, write_digest
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    out: Path = args.out
    (out / "pids").mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    store = TCPStore(host, 0, is_master=True, wait_for_workers=False)  # this replica group's store
    model = mlp(args.width)
    inner = optimizer(model.parameters())
    diloco = args.algo == "diloco"

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=PG_TIMEOUT_S)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"goodput_{args.replica}",
        store_addr=host,
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname=host,
        use_async_quorum=not diloco,
        timeout=timedelta(seconds=MANAGER_TIMEOUT_S),
        quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
        connect_timeout=timedelta(seconds=10),
    )
    # the first launch starts training once every replica is up (an MPI job starts with all its
    # ranks; a lone early replica would train alone for a while); a restarted one does not wait
    (out / "ready").mkdir(parents=True, exist_ok=True)
    (out / "ready" / str(args.replica)).touch()
    deadline = time.time() + 120
    while len(list((out / "ready").iterdir())) < args.replicas and time.time() < deadline:
        time.sleep(0.05)
    per_commit = args.sync_every if diloco else 1  # inner steps per manager step
    stop = StopRequest(out)
    recorded = False
    attempts = 0  # inner steps since the last sync (DiLoCo)

    def record(before: int) -> bool:
        """After a step that may have committed: the record, the pid file; True when the stop is due."""
        nonlocal recorded
        now, step = time.time(), manager.current_step()
        if step > before:
            if not recorded:
                (out / "pids" / str(os.getpid())).write_text(str(args.replica))
                recorded = True
            if args.replica == 0:
                with open(out / "progress", "a") as log:
                    log.write(f"{now:.4f} {step * per_commit} {manager.num_participants()} {os.getpid()}\n")
        elif args.replica == 0:
            with open(out / "discarded", "a") as log:
                log.write(f"{now:.4f} {before * per_commit} {per_commit} {os.getpid()}\n")
        return stop.due(step * per_commit)

    if diloco:
        from torchft.local_sgd import DiLoCo

        outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        context = DiLoCo(manager, [model], inner, outer, sync_every=args.sync_every)
        net, opt = model, inner
    else:
        import contextlib

        context = contextlib.nullcontext()
        net, opt = DistributedDataParallel(manager, model), Optimizer(manager, inner)
    done = False
    epoch = 0
    with context:
        while not done:
            for x, y in shard_batches(args.replica, args.replicas, args.batch, epoch):
                before = manager.current_step()
                opt.zero_grad()
                nn.functional.cross_entropy(net(x), y).backward()
                opt.step()  # DDP: commits or not; DiLoCo: an inner step, and every sync_every a sync
                attempts += 1
                if diloco and attempts < args.sync_every:
                    continue
                attempts = 0
                if record(before):
                    done = True
                    break
            epoch += 1
    if manager.num_participants() > 1 or args.replicas == 1:
        # a replica that came back too late to commit the stop step with the others syncs alone
        # once they left: its weights are not the job's
        write_digest(out, args.replica, manager.current_step() * per_commit, model)
    os._exit(0)  # the manager's threads and servers would keep a clean exit waiting


# ---- the supervisor ----


def supervise(args: argparse.Namespace) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    hosts = args.hosts.split(",") if args.hosts else [None] * args.replicas
    if len(hosts) != args.replicas:
        raise SystemExit(f"--hosts names {len(hosts)} hosts for {args.replicas} replicas")
    port = args.port or free_port()
    log = open(out / "supervisor.log", "a", buffering=1)
    lighthouse = subprocess.Popen(
        [lighthouse_binary() or "torchft_lighthouse", *LIGHTHOUSE_OPTIONS, "--bind", f"0.0.0.0:{port}"],
        stdout=open(out / "lighthouse.log", "a"),
        stderr=subprocess.STDOUT,
    )
    address = f"http://{args.lighthouse_host or socket.gethostname()}:{port}"
    # RUST_LOG=warn: torchft's manager logs several INFO lines per step otherwise (its quorum and
    # commit), which costs a replica about as much I/O as its training on this small model
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "RUST_LOG": "warn"}
    env.setdefault("GLOO_SOCKET_IFNAME", "eth0" if args.hosts else "lo")

    def start(replica: int) -> subprocess.Popen:
        cmd = [sys.executable, str(Path(__file__).resolve()), "worker", str(out), "--replica", str(replica)]
        cmd += ["--replicas", str(args.replicas), "--lighthouse", address, "--algo", args.algo]
        cmd += ["--batch", str(args.batch), "--width", str(args.width), "--sync-every", str(args.sync_every)]
        host = hosts[replica]
        log.write(f"{time.time():.3f} start replica {replica}{' on ' + host if host else ''}\n")
        output = open(out / f"replica{replica}.log", "a")
        return subprocess.Popen(in_host(host, cmd) if host else cmd, env=env, stdout=output, stderr=subprocess.STDOUT)

    procs = {r: start(r) for r in range(args.replicas)}
    finished: set[int] = set()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        while len(finished) < args.replicas:
            time.sleep(0.1)
            for r, proc in list(procs.items()):
                code = proc.poll()
                if code is None or r in finished:
                    continue
                log.write(f"{time.time():.3f} replica {r} exited with {code}\n")
                if code == 0 or (out / "stop").exists():
                    finished.add(r)
                else:
                    procs[r] = start(r)
    finally:
        for proc in [*procs.values(), lighthouse]:
            if proc.poll() is None:
                proc.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("supervise", "worker"):
        p = sub.add_parser(name)
        p.add_argument("out", type=Path)
        p.add_argument("--replicas", type=int, required=True)
        p.add_argument("--algo", choices=["ddp", "diloco"], default="ddp")
        p.add_argument("--batch", type=int, default=32)
        p.add_argument("--width", type=int, default=256)
        p.add_argument("--sync-every", type=int, default=10, help="DiLoCo's inner steps per sync")
    sup = sub.choices["supervise"]
    sup.add_argument("--hosts", help="one simulated host per replica, comma-separated (default: here)")
    sup.add_argument("--lighthouse-host", help="the name or address replicas reach the lighthouse at")
    sup.add_argument("--port", type=int, help="the lighthouse's port (default: a free one)")
    work = sub.choices["worker"]
    work.add_argument("--replica", type=int, required=True)
    work.add_argument("--lighthouse", required=True, help="http://HOST:PORT")
    args = parser.parse_args(argv)
    supervise(args) if args.command == "supervise" else worker(args)


if __name__ == "__main__":
    main()
