"""Hosts: ``--hosts`` entries and hostfiles (MPICH or Open MPI syntax) parsed into
:class:`HostEntry` values, and the check that every host name resolves.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .errors import LaunchError

__all__ = [
    "HostEntry",
    "Hostfile",
    "check_hosts_resolve",
    "parse_host",
    "parse_hostfile",
    "positive_int",
    "read_hostfile",
]

#: Seconds allowed for all host names to resolve together.
RESOLVE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class HostEntry:
    """One host, with the number of slots (ranks it takes per round) when given explicitly."""

    name: str
    slots: int | None = None

    def __str__(self) -> str:
        return self.name if self.slots is None else f"{self.name}:{self.slots}"


def positive_int(text: str, what: str) -> int:
    """``int(text)`` when that is >= 1; otherwise ``ValueError`` naming ``what`` and ``text``."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{what} must be a positive integer, got {text!r}")
    return value


def parse_host(text: str) -> HostEntry:
    """Parse ``name`` or ``name:slots`` (the ``--hosts`` and MPICH hostfile syntax).

    Raises ``ValueError`` for an empty name or slots that are not a positive integer.
    """
    name, sep, slots = text.strip().partition(":")
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"bad host {text!r}: expected 'name' or 'name:slots'")
    if not sep:
        return HostEntry(name)
    return HostEntry(name, positive_int(slots, f"slots of host {name!r}"))


#: The syntax of a hostfile: MPICH's ``host:slots``, Open MPI's ``host slots=K``, or bare host names.
HostfileSyntax = Literal["mpich", "openmpi", "plain"]


@dataclass(frozen=True)
class Hostfile:
    """A parsed hostfile: its entries in order, and which syntax it used.

    ``syntax`` is ``"mpich"`` (``host:slots``), ``"openmpi"`` (``host slots=K``) or ``"plain"``
    (bare host names, which both understand).
    """

    entries: tuple[HostEntry, ...]
    syntax: HostfileSyntax


def parse_hostfile(text: str, source: str = "hostfile") -> Hostfile:
    """Parse hostfile text in MPICH (``host[:slots]``) or Open MPI (``host [slots=K] [max_slots=M]``)
    syntax; ``#`` starts a comment, blank lines are skipped.

    MPICH's extra ``key=value`` fields (e.g. ``ifhn=``) are accepted and ignored, as is Open MPI's
    ``max_slots``. Raises ``ValueError`` naming ``source`` and the line number for a malformed
    line, a file that mixes both syntaxes, or a file without hosts.
    """
    entries: list[HostEntry] = []
    seen: set[HostfileSyntax] = set()
    for lineno, raw in enumerate(text.splitlines(), 1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source} line {lineno} ({raw.strip()!r})"
        slots: int | None = None
        kind: HostfileSyntax
        try:
            if ":" in fields[0]:
                entry = parse_host(fields[0])
                name, slots, kind = entry.name, entry.slots, "mpich"
            else:
                name, kind = fields[0], "plain"
            for extra in fields[1:]:
                key, eq, value = extra.partition("=")
                if not eq:
                    raise ValueError(f"expected key=value after the host name, got {extra!r}")
                if key in ("slots", "max_slots", "max-slots"):
                    if kind == "mpich":
                        raise ValueError("mixes 'host:slots' with 'slots='; use one of them")
                    number = positive_int(value, key)
                    if key == "slots":
                        slots, kind = number, "openmpi"
                # Any other key=value is an MPICH per-host option such as ifhn=eth0: kept by
                # the launcher itself when the file is passed through, not needed for planning.
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if kind != "plain":
            seen.add(kind)
        entries.append(HostEntry(name, slots))
    if not entries:
        raise ValueError(f"{source} lists no hosts")
    if len(seen) > 1:
        raise ValueError(f"{source} mixes MPICH 'host:slots' and Open MPI 'host slots=K' lines; use one syntax")
    return Hostfile(tuple(entries), seen.pop() if seen else "plain")


def read_hostfile(path: str) -> Hostfile:
    """Read and parse ``path`` (see :func:`parse_hostfile`); raises :class:`LaunchError` with the fix."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise LaunchError(
            f"argument --hostfile: cannot read {path!r} ({exc.strerror or exc}); "
            "fix: pass the path of an existing hostfile, one host per line"
        ) from None
    try:
        return parse_hostfile(text, source=f"hostfile {path!r}")
    except ValueError as exc:
        raise LaunchError(
            f"argument --hostfile: {exc}; fix: write one host per line as 'host', "
            "'host:slots' (MPICH) or 'host slots=K' (Open MPI)"
        ) from None


def check_hosts_resolve(names: Sequence[str], timeout: float = RESOLVE_TIMEOUT_S) -> None:
    """Fail unless every host name resolves with ``socket.gethostbyname``, within ``timeout`` s.

    Names are resolved in parallel daemon threads so that a slow DNS costs ``timeout`` once and
    cannot keep the process alive afterwards.
    """
    unique = list(dict.fromkeys(names))
    errors: dict[str, str] = {}

    def resolve(name: str) -> None:
        try:
            socket.gethostbyname(name)
        except OSError as exc:
            errors[name] = getattr(exc, "strerror", None) or str(exc)

    threads = [threading.Thread(target=resolve, args=(n,), daemon=True) for n in unique]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for name, t in zip(unique, threads, strict=True):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            errors.setdefault(name, f"no answer within {timeout:g} s")
    bad = [n for n in unique if n in errors]
    if bad:
        detail = "; ".join(f"{n!r}: {errors[n]}" for n in bad)
        raise LaunchError(
            f"host does not resolve: {detail}; fix: correct the name in --hosts/--hostfile, "
            "add it to /etc/hosts or DNS, or give its IP address"
        )
