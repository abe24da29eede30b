#!/usr/bin/env python3
"""A simulated cluster on one machine: N hosts joined by rate-limited links, and mpiexec across them.

Each host is a network namespace whose processes also get their own UTS namespace, so
``hostname`` / ``socket.gethostname()`` return the host's own name (MPI and Lightning's
``MPIEnvironment`` split nodes by hostname). All hosts hang off one Linux bridge that lives in a
dedicated "switch" namespace, so nothing touches the machine's own network::

    lmpi<pid>-<k>-h0 [eth0 198.18.0.1] ══veth══ p0 ┐
    lmpi<pid>-<k>-h1 [eth0 198.18.0.2] ══veth══ p1 ┼─ br0 198.18.0.254   (namespace lmpi<pid>-<k>-sw,
    ...                                             ┘                      where mpiexec runs)

Every host link is limited to ``rate`` in both directions with ``tc tbf`` (host-side ``eth0``
egress and switch-side ``p<i>`` egress, like a full-duplex switch port); ``delay`` adds a
``netem`` one-way latency on the host side. Only addresses in 198.18.0.0/24 (from the
benchmarking range 198.18.0.0/15) are used.

A kernel without ``netem`` (``sch_netem``) gets the latency from a delay line in this process
instead (:class:`DelayLine`): each host link is then a pair of TAP devices (``eth0`` in the host,
``p<i>`` on the bridge), still shaped by ``tbf``, and a thread copies every frame from one to the
other, those out of a host ``delay`` after they left (in order), those into it at once. One thread serves every link in both directions; it moves
about 900 frames a second per direction at 10 Mbit/s, and its wake-ups add jitter on a busy
machine, so use it for slow links (up to ~100 Mbit/s).

``mpiexec`` (hydra) runs inside the switch namespace and starts one proxy per host through a
stand-in for ssh (``-launcher ssh -launcher-exec <script>``): the script enters the host's
network namespace, gives it its hostname and runs the proxy. Names resolve through
``/etc/netns/<ns>/hosts``, which ``ip netns exec`` bind-mounts over ``/etc/hosts``. Ranks get
``UCX_TLS=tcp,self`` so MPICH's ch4:ucx sends over TCP on the link between hosts instead of
shared memory (the namespaces still share one kernel and /dev/shm); the ranks of one host (one
hydra proxy launched them: ``ranks_per_host`` > 1) share memory through MPICH's node-local path,
as the GPUs of a node do (measured: a 32 MB Allreduce between the two ranks of a host took about 50 ms
this way, about 130 ms over the host's loopback TCP with ``MPIR_CVAR_NOLOCAL=1``, which kept them off it
before; nothing crossed the link either way).

Library use::

    from benchmarks.cluster import SimCluster
    with SimCluster(2, rate="1gbit") as cluster:
        res = cluster.run_mpi([sys.executable, "benchmarks/link_check.py"], ranks_per_host=1)
        print(res.stdout, cluster.traffic())   # bytes the hosts sent over their links so far

CLI::

    python benchmarks/cluster.py run --hosts 2 --rate 1gbit -- python benchmarks/link_check.py
    python benchmarks/cluster.py cleanup            # leftovers of runs whose process is gone
    python benchmarks/cluster.py cleanup --all      # every lmpi* namespace

Needs root, ``ip``/``tc`` (iproute2) and ``unshare`` (util-linux).
"""
from __future__ import annotations

import argparse
import atexit
import collections
import ctypes
import fcntl
import itertools
import json
import os
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PREFIX = "lmpi"
SUBNET = "198.18.0"  # /24 inside the benchmarking range 198.18.0.0/15
SWITCH_IP = f"{SUBNET}.254"
NETNS_ETC = Path("/etc/netns")
HOST_IFACE = "eth0"
MAX_HOSTS = 200

# lmpi<pid>-<k>-h<i> / lmpi<pid>-<k>-sw
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)-(\d+)-(sw|h\d+)$")
_counter = itertools.count()

# The ssh stand-in. hydra calls it as ``<script> [-x] <host> <word>...`` like ssh, which joins
# the words with spaces and hands the string to the remote shell; do the same inside the host.
_LAUNCHER = r"""#!/bin/sh
# ssh stand-in for hydra: run the command inside the simulated host's namespaces.
while [ $# -gt 0 ]; do
    case "$1" in
        -[1246AaCfGgKkMNnqsTtVXxYy]) shift ;;
        -*) shift 2 ;;
        *) break ;;
    esac
done
host="$1"; shift
exec ip netns exec "$host" unshare --uts -- /bin/sh -c 'hostname "$1" && exec /bin/sh -c "$2"' sh "$host" "$*"
"""


def missing_tools() -> list[str]:
    """Names of the tools SimCluster needs that are not on PATH."""
    return [t for t in ("ip", "tc", "unshare", "hostname") if shutil.which(t) is None]


def unavailable_reason() -> str | None:
    """Why a SimCluster cannot be created here, or None when it can."""
    if os.geteuid() != 0:
        return "simulated cluster needs root (network namespaces, veth, tc)"
    missing = missing_tools()
    if missing:
        return f"simulated cluster needs {', '.join(missing)} on PATH"
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(args), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def _rate_bits(rate: str) -> float:
    """'1gbit' -> 1e9; accepts tc's bit units (kbit, mbit, gbit, tbit, bit)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ValueError(f"rate={rate!r}: expected a number with a unit like '100mbit', '1gbit', '10gbit'")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]
    if m.group(3) == "bps":  # tc's 'bps' means bytes per second
        value *= 8
    if value <= 0:
        raise ValueError(f"rate={rate!r}: must be positive")
    return value


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    """Every network namespace this module could have created (any run)."""
    res = _sh("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in res.stdout.splitlines() if line.strip()]
    return [n for n in names if _NAME_RE.match(n)]


def _remove_namespace(ns: str) -> None:
    # Processes keep a namespace alive after `ip netns del`; end them first.
    pids = _sh("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    # Deleting a namespace destroys its devices; a veth's peer in another namespace goes with it.
    _sh("ip", "netns", "del", ns, check=False)
    shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)


def _write_netns_etc(ns: str, files: dict[str, str]) -> None:
    """Files that `ip netns exec <ns>` bind-mounts over /etc/<name>."""
    for attempt in range(5):
        try:
            d = NETNS_ETC / ns
            d.mkdir(parents=True, exist_ok=True)
            for name, text in files.items():
                (d / name).write_text(text)
            return
        except FileNotFoundError:  # another run removed an empty /etc/netns just now
            if attempt == 4:
                raise


def _remove_netns_etc_if_empty() -> None:
    # /etc/netns exists only for these bind mounts; leave no empty one behind.
    try:
        NETNS_ETC.rmdir()  # fails (harmlessly) while anything is in it
    except OSError:
        pass


def cleanup(all_runs: bool = False) -> list[str]:
    """Remove leftovers: namespaces (with their veths and bridge) and /etc/netns entries.

    By default only those of runs whose creating process is gone; ``all_runs`` removes every
    ``lmpi*`` one, also of runs still alive.
    """
    names = set(list_namespaces())
    if NETNS_ETC.is_dir():
        names |= {p.name for p in NETNS_ETC.iterdir() if _NAME_RE.match(p.name)}
    removed = []
    for ns in sorted(names):
        pid = int(_NAME_RE.match(ns).group(1))
        if all_runs or not _pid_alive(pid):
            _remove_namespace(ns)
            removed.append(ns)
    for d in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-launch-*"):
        m = re.match(rf"{PREFIX}(\d+)-", d.name)
        if m and (all_runs or not _pid_alive(int(m.group(1)))):
            shutil.rmtree(d, ignore_errors=True)
    _remove_netns_etc_if_empty()
    return removed


def _mpiexec() -> str:
    """The venv's mpiexec first, then PATH: the launcher's lookup (imported here, not at module load)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lightning_mpi.launcher.checks import find_mpiexec

    return find_mpiexec()


_TUNSETIFF, _IFF_TAP, _IFF_NO_PI, _CLONE_NEWNET = 0x400454CA, 0x0002, 0x1000, 0x40000000


def _seconds(delay: str) -> float:
    """A tc time ('50ms', '200us', '1s') in seconds."""
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", delay)
    if not m:
        raise ValueError(f"delay={delay!r}: expected a tc time like '500us' or '2ms'")
    return float(m.group(1)) * {"us": 1e-6, "ms": 1e-3, "s": 1.0}[m.group(2)]


def _open_tap(ns: str, name: str) -> int:
    """A TAP device ``name`` created in namespace ``ns`` (gone when the returned fd is closed)."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns}")
        fd = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TAP | _IFF_NO_PI))
        return fd
    finally:
        libc.setns(own, _CLONE_NEWNET)
        os.close(own)
        os.close(target)


class DelayLine(threading.Thread):
    """Copies frames between paired TAP fds, each ``delay`` seconds after it was read, in order."""

    def __init__(self, delay: float) -> None:
        super().__init__(name="cluster-delay-line", daemon=True)
        self.delay = delay
        self.peer: dict[int, int] = {}
        self.late: set[int] = set()  # fds whose frames wait ``delay`` (the hosts' ends: their egress)
        self.waiting: dict[int, collections.deque] = {}
        self._stop_r, self._stop_w = os.pipe()

    def link(self, host: int, port: int) -> None:
        """Join a host's TAP fd to its switch port's (before :meth:`start`): frames out of the host
        wait ``delay``, frames into it none (as ``netem`` on the host's egress)."""
        a, b = host, port
        self.late.add(host)
        self.peer[a], self.peer[b] = b, a
        self.waiting[a], self.waiting[b] = collections.deque(), collections.deque()

    def run(self) -> None:
        sources = [*self.peer, self._stop_r]
        while True:
            due = min((q[0][0] for q in self.waiting.values() if q), default=None)
            timeout = None if due is None else max(0.0, due - time.monotonic())
            ready, _, _ = select.select(sources, [], [], timeout)
            if self._stop_r in ready:
                return
            now = time.monotonic()
            for fd in ready:
                try:
                    wait = self.delay if fd in self.late else 0.0
                    self.waiting[self.peer[fd]].append((now + wait, os.read(fd, 65536)))
                except OSError:
                    pass
            now = time.monotonic()
            for fd, queue in self.waiting.items():
                while queue and queue[0][0] <= now:
                    try:
                        os.write(fd, queue.popleft()[1])
                    except OSError:  # a device going away at close
                        pass

    def stop(self) -> None:
        if self.is_alive():
            os.write(self._stop_w, b"x")
            self.join(timeout=5)
        for fd in (*self.peer, self._stop_r, self._stop_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.peer.clear()


class LinkReadings:
    """A cluster's link counters (:meth:`SimCluster.traffic`) read on entering (``"start"``), on
    leaving (``"end"``), and at the moments ``watch(self)`` picks, in a thread of its own while
    inside: it calls :meth:`take` and waits with :meth:`wait`, which says when the block was left."""

    def __init__(self, cluster: SimCluster, watch, name: str) -> None:
        self.cluster = cluster
        self.readings: dict[str, dict] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=watch, args=(self,), name=name, daemon=True)

    def __enter__(self) -> LinkReadings:
        self.take("start")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.take("end")

    def take(self, key: str, reading: dict | None = None) -> None:
        """Keep ``reading`` (default: the counters now) as ``key``."""
        self.readings[key] = self.cluster.traffic() if reading is None else reading

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True once the block was left (the watcher should return)."""
        return self._done.wait(seconds)

    def between(self, a: str, b: str, key: str = "between_hosts") -> int | None:
        """Bytes of ``key`` from reading ``a`` to reading ``b`` (None where either was not taken)."""
        r = self.readings
        return r[b][key] - r[a][key] if a in r and b in r else None


class SimCluster:
    """N simulated hosts on one bridge, each link limited to ``rate``; a context manager.

    Args:
        n_hosts: number of hosts (1..200).
        rate: per-host link rate in both directions, in tc units: "100mbit", "1gbit", "10gbit".
        delay: optional one-way latency added at each host's egress, in tc units ("1ms", "200us"):
            ``netem`` where the kernel has it, else a :class:`DelayLine` in this process.
        burst: tbf bucket in bytes; default ``max(rate*1ms, 64 KiB)``.

    Attributes after ``__enter__``: ``hosts`` (hostnames = namespace names), ``addresses``
    (host -> IPv4), ``switch`` (switch namespace), ``iface`` ("eth0", the link inside a host).
    Everything is removed on ``__exit__``, at interpreter exit and on SIGTERM/SIGHUP.
    """

    def __init__(self, n_hosts: int, rate: str = "1gbit", delay: str | None = None, burst: int | None = None):
        if not isinstance(n_hosts, int) or not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts={n_hosts!r}: must be an int in [1, {MAX_HOSTS}]")
        self.rate_bits = _rate_bits(rate)  # validates
        self.rate = rate
        if delay is not None and not re.fullmatch(r"[\d.]+(us|ms|s)", delay):
            raise ValueError(f"delay={delay!r}: expected a tc time like '500us' or '2ms'")
        self.delay = delay
        self.burst = int(burst) if burst is not None else max(int(self.rate_bits / 8 * 1e-3), 65536)
        tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.tag = tag
        self.switch = f"{tag}-sw"
        self.hosts = [f"{tag}-h{i}" for i in range(n_hosts)]
        self.addresses = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(self.hosts)}
        self.iface = HOST_IFACE
        self._launch_dir: Path | None = None
        self._delay_line: DelayLine | None = None
        self._created: list[str] = []
        self._up = False
        self._old_handlers: dict[int, object] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- setup / teardown
    def __enter__(self) -> "SimCluster":
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        atexit.register(self.close)
        self._install_signal_handlers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        self._up = True
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _netns_add(self, ns: str) -> None:
        # Record first: a half-created namespace must still be removed.
        self._created.append(ns)
        _sh("ip", "netns", "add", ns)

    def _create(self) -> None:
        hosts_file = "127.0.0.1\tlocalhost\n" + f"{SWITCH_IP}\t{self.switch}\n" + "".join(
            f"{ip}\t{h}\n" for h, ip in self.addresses.items()
        )
        sw = self.switch
        self._netns_add(sw)
        for ns in [sw, *self.hosts]:
            if ns != sw:
                self._netns_add(ns)
            _write_netns_etc(ns, {"hosts": hosts_file, "hostname": ns + "\n"})
        _sh("ip", "-n", sw, "link", "set", "lo", "up")
        _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", sw, "addr", "add", f"{SWITCH_IP}/24", "dev", "br0")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        user_delay = self.delay is not None and not self._has_netem()
        if user_delay:
            self._delay_line = DelayLine(_seconds(self.delay))
        for i, h in enumerate(self.hosts):
            port = f"p{i}"
            if self._delay_line is not None:  # two TAPs joined by the delay line
                self._delay_line.link(_open_tap(h, HOST_IFACE), _open_tap(sw, port))
            else:
                # Both ends are created in the switch namespace, the host end is moved at once:
                # the machine's own namespace never sees them.
                _sh("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", HOST_IFACE, "netns", h)
            _sh("ip", "-n", sw, "link", "set", port, "master", "br0")
            _sh("ip", "-n", sw, "link", "set", port, "up")
            _sh("ip", "-n", h, "link", "set", "lo", "up")
            _sh("ip", "-n", h, "addr", "add", f"{self.addresses[h]}/24", "dev", HOST_IFACE)
            _sh("ip", "-n", h, "link", "set", HOST_IFACE, "up")
            self._shape(sw, port, delay=None)  # into the host
            self._shape(h, HOST_IFACE, delay=None if user_delay else self.delay)  # out of the host
        if self._delay_line is not None:
            self._delay_line.start()
        self._launch_dir = Path(tempfile.mkdtemp(prefix=f"{self.tag}-launch-"))
        launcher = self._launch_dir / "ssh"
        launcher.write_text(_LAUNCHER)
        launcher.chmod(0o755)
        self._wait_reachable()

    def _has_netem(self) -> bool:
        """Whether this kernel has tc's ``netem`` (tried on the switch namespace's loopback)."""
        res = _sh("ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                  "1ms", check=False)
        _sh("ip", "netns", "exec", self.switch, "tc", "qdisc", "del", "dev", "lo", "root", check=False)
        return res.returncode == 0

    def _shape(self, ns: str, dev: str, delay: str | None) -> None:
        rate = f"{int(self.rate_bits)}bit"
        # latency bounds the queue: enough for a few ms at the rate, like a switch port buffer.
        tbf = ["tbf", "rate", rate, "burst", str(self.burst), "latency", "20ms"]
        if delay:
            res = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
                      "netem", "delay", delay, check=False)
            if res.returncode != 0:
                raise RuntimeError(f"delay={delay!r} needs tc's netem qdisc (kernel module sch_netem), "
                                   f"which this kernel refused: {res.stderr.strip().rstrip('.')}. Leave delay=None.")
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        else:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf)

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        """Wait until every link reports carrier (operstate UP) at both ends.

        A bridge without STP forwards as soon as a port is up, so this is all the waiting needed.
        """
        deadline = time.monotonic() + timeout
        pending = [(self.switch, f"p{i}") for i in range(len(self.hosts))] + [(h, HOST_IFACE) for h in self.hosts]
        while pending:
            ns, dev = pending[0]
            res = _sh("ip", "-n", ns, "-j", "link", "show", dev, check=False)
            try:
                link = json.loads(res.stdout)[0]
                # a TAP with its fd open reports operstate UNKNOWN and carrier (LOWER_UP)
                up = link.get("operstate") == "UP" or "LOWER_UP" in link.get("flags", [])
            except (ValueError, IndexError):
                up = False
            if up:
                pending.pop(0)
            elif time.monotonic() > deadline:
                raise RuntimeError(f"link {dev} in {ns} did not come up: {res.stdout}{res.stderr}")
            else:
                time.sleep(0.05)

    def close(self) -> None:
        """Remove every namespace, link, bridge and file this cluster created. Idempotent."""
        with self._lock:
            if self._delay_line is not None:  # closing the TAPs removes them
                self._delay_line.stop()
                self._delay_line = None
            for ns in reversed(self._created):
                _remove_namespace(ns)
            self._created.clear()
            _remove_netns_etc_if_empty()
            if self._launch_dir is not None:
                shutil.rmtree(self._launch_dir, ignore_errors=True)
                self._launch_dir = None
            self._up = False
            self._restore_signal_handlers()
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def _install_signal_handlers(self) -> None:
        # SIGINT already raises KeyboardInterrupt (-> __exit__). SIGTERM/SIGHUP would kill us
        # without running finally blocks; turn them into SystemExit while the cluster exists.
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGHUP):
            old = signal.getsignal(sig)
            if old in (signal.SIG_DFL, None):
                self._old_handlers[sig] = old
                signal.signal(sig, _raise_exit)

    def _restore_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, old in self._old_handlers.items():
            if signal.getsignal(sig) is _raise_exit:
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old_handlers.clear()

    # ---------------------------------------------------------------- measuring
    def traffic(self) -> dict[str, int]:
        """Bytes the hosts have sent over their links since the cluster was created.

        ``sent``: everything the hosts' egress qdiscs sent (the shaping ``tbf``, or the ``netem``
        above it): frames with their Ethernet, IP and TCP headers, and a TSO/GSO packet counted
        segment by segment with each segment's headers, as it would go on a wire (no preamble, FCS
        or inter-frame gap); retransmissions count again, frames the qdisc dropped do not.
        ``to_mpiexec``: of those, the bytes the switch namespace's own stack received (hydra's
        proxies to ``mpiexec``: PMI and forwarded output; counted by the bridge without the
        14-byte Ethernet header). ``between_hosts``: ``sent - to_mpiexec``, host to host.
        """
        sent = 0
        for host in self.hosts:
            res = _sh("tc", "-n", host, "-s", "-j", "qdisc", "show", "dev", HOST_IFACE)
            sent += next(q["bytes"] for q in json.loads(res.stdout) if q.get("root"))
        res = _sh("ip", "-n", self.switch, "-s", "-j", "link", "show", "br0")
        to_mpiexec = json.loads(res.stdout)[0]["stats64"]["rx"]["bytes"]
        return {"sent": sent, "to_mpiexec": to_mpiexec, "between_hosts": sent - to_mpiexec}

    # ---------------------------------------------------------------- running things
    def mpi_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for mpiexec and the ranks: our env + what forces traffic onto the link."""
        env = dict(os.environ)
        env.update(
            {
                "UCX_TLS": "tcp,self",  # no shared memory / cma between "hosts" on one kernel
                "UCX_NET_DEVICES": HOST_IFACE,
                # The hosts share this machine's cores, which Open MPI cannot see (each host shows all
                # of them): its ranks busy-poll their sockets while they wait and starve the kernel's
                # packet processing on the same cores, and every message across a link then took a
                # scheduler tick (measured: an 8-byte ping-pong between 2 hosts, 8.0 ms; 0.04-0.11 ms
                # with this; MPICH, which waits differently, 0.17 ms). Open MPI sets it itself on
                # a host it sees oversubscribed, as one machine running the ranks of every host is.
                "OMPI_MCA_mpi_yield_when_idle": "1",
                # MPICH's node-local path (shared memory) stays on: hydra counts as local only the
                # ranks its proxy on one host launched, so it joins the ranks of a host, never two hosts
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                "MKL_NUM_THREADS": env.get("MKL_NUM_THREADS", "1"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "")])
        repo = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH", "")]))
        if extra:
            env.update(extra)
        return env

    def in_host(self, host: int | str, cmd: list[str]) -> list[str]:
        """Command line that runs ``cmd`` on one host (its namespace and hostname)."""
        name = self.hosts[host] if isinstance(host, int) else host
        return ["ip", "netns", "exec", name, "unshare", "--uts", "--", "/bin/sh", "-c",
                'hostname "$0" && exec "$@"', name, *cmd]

    def mpiexec_cmd(self, cmd_args: list[str], ranks_per_host: int = 1, hosts: int | None = None,
                    mpiexec_args: list[str] | None = None) -> list[str]:
        """The full command line (run it from the machine's own namespace) for an mpiexec job."""
        if not self._up:
            raise RuntimeError("SimCluster is not up: use it as a context manager")
        if ranks_per_host < 1:
            raise ValueError(f"ranks_per_host={ranks_per_host!r}: must be >= 1")
        use = self.hosts[: hosts or len(self.hosts)]
        mpiexec = [
            _mpiexec(),
            "-launcher", "ssh", "-launcher-exec", str(self._launch_dir / "ssh"),
            "-localhost", self.switch,   # proxies connect back to the switch's bridge address
            "-hosts", ",".join(f"{h}:{ranks_per_host}" for h in use),
            "-n", str(ranks_per_host * len(use)),
            "-ppn", str(ranks_per_host),
            *(mpiexec_args or []),
            *cmd_args,
        ]
        return ["ip", "netns", "exec", self.switch, "unshare", "--uts", "--", "/bin/sh", "-c",
                'hostname "$0" && exec "$@"', self.switch, *mpiexec]

    def run_mpi(self, cmd_args: list[str], ranks_per_host: int = 1, env: dict[str, str] | None = None,
                timeout: float = 120, hosts: int | None = None, mpiexec_args: list[str] | None = None,
                check: bool = False, capture: bool = True, cwd: str | os.PathLike | None = None,
                ) -> subprocess.CompletedProcess:
        """Run ``cmd_args`` on ``ranks_per_host`` ranks on each of the (first ``hosts``) hosts.

        ``cmd_args`` is the program and its arguments (``[sys.executable, "script.py"]``).
        ``env`` adds to :meth:`mpi_env`. On timeout the whole job is killed and
        ``subprocess.TimeoutExpired`` raised; ``check`` raises ``CalledProcessError`` on a
        non-zero exit. Output is captured as text unless ``capture=False``.
        """
        cmd = self.mpiexec_cmd(cmd_args, ranks_per_host, hosts, mpiexec_args)
        pipe = subprocess.PIPE if capture else None
        proc = subprocess.Popen(cmd, stdout=pipe, stderr=pipe, text=True, env=self.mpi_env(env),
                                cwd=cwd, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            # Timeout, Ctrl-C, SIGTERM: take the whole job down (launcher children share its group).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for ns in [self.switch, *self.hosts]:
                for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
            proc.communicate()
            raise
        res = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        if check:
            res.check_returncode()
        return res


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


# -------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="create a cluster, run mpiexec across it, remove it")
    run.add_argument("--hosts", type=int, default=2)
    run.add_argument("--rate", default="1gbit", help="per-host link rate, tc units (default 1gbit)")
    run.add_argument("--delay", default=None, help="one-way latency, tc units (e.g. 1ms)")
    run.add_argument("--ppn", type=int, default=1, help="ranks per host")
    run.add_argument("--timeout", type=float, default=600)
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- program args...")
    clean = sub.add_parser("cleanup", help="remove leftover lmpi* namespaces")
    clean.add_argument("--all", action="store_true", help="also those of runs still alive")
    sub.add_parser("list", help="list lmpi* namespaces")
    args = parser.parse_args(argv)

    if args.cmd == "cleanup":
        removed = cleanup(all_runs=args.all)
        print("removed:", " ".join(removed) if removed else "nothing")
        return 0
    if args.cmd == "list":
        print("\n".join(list_namespaces()))
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run: give the program after --")
    if command[0] in ("python", "python3"):
        command[0] = sys.executable
    try:
        with SimCluster(args.hosts, rate=args.rate, delay=args.delay) as cluster:
            print(f"# {args.hosts} hosts at {args.rate}: " +
                  " ".join(f"{h}={ip}" for h, ip in cluster.addresses.items()), file=sys.stderr, flush=True)
            res = cluster.run_mpi(command, ranks_per_host=args.ppn, timeout=args.timeout, capture=False)
    except KeyboardInterrupt:  # the cluster is already gone (__exit__)
        print("interrupted; cluster removed", file=sys.stderr)
        return 130
    except subprocess.TimeoutExpired:
        print(f"timed out after {args.timeout}s; job killed, cluster removed", file=sys.stderr)
        return 124
    return res.returncode


if __name__ == "__main__":
    sys.exit(main())
