"""The simulated cluster (benchmarks/cluster.py): hosts with their own hostnames, traffic over a
rate-limited link, and nothing left behind.

The link check is a lower bound from physics, not a performance assertion: 8 MB cannot cross a
100 Mbit/s link in less than 0.64 s, so a transfer that takes >= 0.5 s proves the bytes went
over the shaped veth and not through shared memory (which moves 8 MB in a few ms).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import cluster as simcluster  # noqa: E402
from benchmarks.cluster import SimCluster  # noqa: E402

_reason = simcluster.unavailable_reason()
needs_netns = pytest.mark.skipif(_reason is not None, reason=_reason or "")

RANK_SCRIPT = textwrap.dedent(
    """
    import socket, time
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    hosts = comm.allgather(socket.gethostname())
    if rank == 0:
        print("HOSTS", ",".join(hosts), flush=True)

    # Allreduce gives the right sum.
    x = np.arange(1000, dtype=np.float64) * (rank + 1)
    y = np.empty_like(x)
    comm.Allreduce(x, y, op=MPI.SUM)
    ok = np.array_equal(y, np.arange(1000, dtype=np.float64) * (size * (size + 1) / 2))
    ok = comm.allreduce(ok, op=MPI.LAND)
    if rank == 0:
        print("SUM_OK", ok, flush=True)

    # 8 MB from rank 0 to rank 1, timed until rank 1 acknowledges it has all of it.
    nbytes = 8_000_000
    buf = np.full(nbytes, 7, dtype=np.uint8) if rank == 0 else np.empty(nbytes, dtype=np.uint8)
    ack = np.zeros(1, dtype=np.uint8)
    comm.Barrier()
    if rank == 0:
        t0 = time.perf_counter()
        comm.Send(buf, dest=1, tag=1)
        comm.Recv(ack, source=1, tag=2)
        print("TRANSFER_S", time.perf_counter() - t0, flush=True)
    elif rank == 1:
        comm.Recv(buf, source=0, tag=1)
        assert buf[0] == 7 and buf[-1] == 7
        comm.Send(ack, dest=0, tag=2)
    """
)


def _ours(tag: str) -> list[str]:
    left = [n for n in simcluster.list_namespaces() if n.startswith(tag + "-")]
    if simcluster.NETNS_ETC.is_dir():
        left += [p.name for p in simcluster.NETNS_ETC.iterdir() if p.name.startswith(tag + "-")]
    return left


def _leftovers_of(pid: int) -> list[str]:
    prefix = f"{simcluster.PREFIX}{pid}-"
    left = [n for n in simcluster.list_namespaces() if n.startswith(prefix)]
    if simcluster.NETNS_ETC.is_dir():
        left += [p.name for p in simcluster.NETNS_ETC.iterdir() if p.name.startswith(prefix)]
    return left


# ------------------------------------------------------------------ no root needed
def test_arguments_are_validated():
    with pytest.raises(ValueError, match="n_hosts"):
        SimCluster(0)
    with pytest.raises(ValueError, match="rate"):
        SimCluster(2, rate="fast")
    with pytest.raises(ValueError, match="delay"):
        SimCluster(2, delay="1 minute")
    assert simcluster._seconds("50ms") == pytest.approx(0.05) and simcluster._seconds("200us") == pytest.approx(2e-4)
    assert simcluster._rate_bits("100mbit") == 100e6
    assert simcluster._rate_bits("10gbit") == 10e9


# ------------------------------------------------------------------ root: real namespaces
@needs_netns
@pytest.mark.netns
@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_two_hosts_cross_the_link(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    with SimCluster(2, rate="100mbit") as c:
        tag = c.tag
        assert len(_ours(tag)) > 0
        res = c.run_mpi([sys.executable, str(script)], ranks_per_host=1, timeout=60)
        assert res.returncode == 0, f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if " " in line)

    hosts = lines["HOSTS"].split(",")
    assert hosts == c.hosts, hosts  # each rank sees its own host's name
    assert len(set(hosts)) == 2
    assert lines["SUM_OK"] == "True"
    # 8 MB at 100 Mbit/s needs >= 0.64 s on the wire; shared memory would take milliseconds.
    transfer_s = float(lines["TRANSFER_S"])
    assert transfer_s >= 0.5, f"8 MB took {transfer_s:.3f}s: the traffic did not cross the 100mbit link"

    assert _ours(tag) == [], f"left behind: {_ours(tag)}"
    assert not c._launch_dir


PING_SCRIPT = textwrap.dedent(
    """
    import time
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    b = np.zeros(8, np.uint8)
    comm.Barrier()
    t = time.perf_counter()
    for _ in range(5):
        if comm.rank == 0:
            comm.Send(b, dest=1)
            comm.Recv(b, source=1)
        else:
            comm.Recv(b, source=0)
            comm.Send(b, dest=0)
    if comm.rank == 0:
        print("RTT_S", (time.perf_counter() - t) / 5, flush=True)
    """
)


@needs_netns
@pytest.mark.netns
@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_the_delay_line_holds_each_host_egress_for_the_delay(tmp_path, monkeypatch):
    """Without netem (forced here), ``delay`` comes from the delay line: a round trip between two
    hosts crosses two host egresses, so it cannot take less than twice the delay (a lower bound
    from the mechanism, not a timing assertion); and nothing is left behind."""
    if not Path("/dev/net/tun").exists():
        pytest.skip("no /dev/net/tun")
    monkeypatch.setattr(SimCluster, "_has_netem", lambda self: False)
    script = tmp_path / "ping.py"
    script.write_text(PING_SCRIPT)
    with SimCluster(2, rate="100mbit", delay="20ms") as c:
        tag = c.tag
        assert c._delay_line is not None and c._delay_line.is_alive()
        res = c.run_mpi([sys.executable, str(script)], ranks_per_host=1, timeout=60)
        assert res.returncode == 0, f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr[-4000:]}"
    rtt = float(dict(line.split(" ", 1) for line in res.stdout.splitlines() if " " in line)["RTT_S"])
    assert rtt >= 0.04, f"a round trip took {rtt * 1e3:.1f} ms: the 20 ms delay line was not on the path"
    assert _ours(tag) == [], f"left behind: {_ours(tag)}"
    assert c._delay_line is None


@needs_netns
@pytest.mark.netns
@pytest.mark.timeout(60)
def test_sigterm_removes_everything_and_cleanup_removes_leftovers():
    cli = [sys.executable, str(REPO / "benchmarks" / "cluster.py")]
    # 1) SIGTERM while a job runs: the CLI tears the cluster down on its way out.
    proc = subprocess.Popen([*cli, "run", "--hosts", "2", "--rate", "100mbit", "--", "sleep", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while len(_leftovers_of(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_leftovers_of(proc.pid)) >= 3, "cluster never came up"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _leftovers_of(proc.pid) == []

    # 2) SIGKILL leaves everything behind; `cleanup` (stale runs only) removes it.
    proc = subprocess.Popen([*cli, "run", "--hosts", "2", "--", "sleep", "30"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(_leftovers_of(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(_leftovers_of(proc.pid)) >= 3
    out = subprocess.run([*cli, "cleanup"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert _leftovers_of(proc.pid) == [], out.stdout
