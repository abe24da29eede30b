"""Healing DiLoCo's outer loop: what a survivor keeps of an exchange in flight, and how the
healed run starts it again or lets a new rank in.

When a rank dies (``heal="shrink"``), an outer exchange may be in flight (Streaming DiLoCo's
``overlap_steps``, or a blocking one cut short). It cannot be completed: it was started on a
communicator with the dead rank. And it cannot simply be read back from the fragment, since an
exchange changes Δ and the feedback residual in place (ASA encodes with error feedback, then
averages into Δ). So, while the healing strategy has set the rule's ``heal_snapshots``,
:class:`ExchangeSnapshots` copies both at every start; :func:`heal_fragments` saves that copy
as the fragment's ``"sent"``; :func:`load_healed` puts it back with status ``restart``, and the
rule starts it again over the survivors at its next hook.

A rank that joins a healed run (``heal="replace"``, :func:`join`) has no replica of its own: its
weights start from θ_global and its residuals at zero. It cannot join an exchange started
without it, so the survivors let it in only at a step with none in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_mpi.rules.outer_checkpoint import save_fragment
from lightning_mpi.rules.outer_fragment import OuterFragment


class ExchangeSnapshots:
    """The Δ and residual each fragment's exchange in flight started from, by fragment index."""

    def __init__(self) -> None:
        self._started_from: dict[int, tuple[Tensor, Tensor | None]] = {}

    def keep(self, index: int, fragment: OuterFragment) -> None:
        """Copy what fragment ``index``'s exchange starts from (call before it starts)."""
        residual = None if fragment.residual is None else fragment.residual.clone()
        self._started_from[index] = (fragment.delta.clone(), residual)

    def clear(self) -> None:
        """Forget them all: no exchange is in flight any more."""
        self._started_from.clear()

    def started_from(self, index: int, rule_name: str) -> tuple[Tensor, Tensor | None]:
        """What fragment ``index``'s exchange in flight started from.

        Raises:
            LookupError: none was kept (the exchange started with snapshots off).
        """
        if index not in self._started_from:
            raise LookupError(f"{rule_name}: an exchange was in flight and its start was not kept (heal_snapshots off)")
        return self._started_from[index]


def heal_fragments(
    fragments: Sequence[OuterFragment], outer: Optimizer, snapshots: ExchangeSnapshots, rule_name: str
) -> tuple[list[dict[str, Any]], list[Tensor | None]]:
    """The replicated entries of every fragment (an exchange in flight as the Δ it started from,
    under ``"sent"``) and this rank's residuals, unpadded: the residual an exchange in flight
    started from, since that exchange will run again from it."""
    entries = []
    residuals = []
    for index, fragment in enumerate(fragments):
        running = fragment.status in ("running", "restart")
        delta, residual = snapshots.started_from(index, rule_name) if running else (fragment.delta, fragment.residual)
        entries.append(save_fragment(fragment, outer, healing=True, sent=delta if running else None))
        residuals.append(None if residual is None else residual[: fragment.numel].clone())
    return entries, residuals


def load_healed(
    fragments: Sequence[OuterFragment],
    saved: Sequence[dict[str, Any]],
    residuals: Sequence[Tensor | None],
    snapshots: ExchangeSnapshots,
) -> None:
    """The rest of a heal, after the replicated entries are loaded: this rank's residuals (the
    owned-chunk ones start at zero: the chunks are cut anew for the new world size), and each
    exchange that was in flight, back in Δ with status ``restart`` (started again by the rule's
    next hook, so that one exchange is in flight at a time) and kept again in ``snapshots``, in
    case another rank dies before it arrives."""
    for index, (fragment, entry) in enumerate(zip(fragments, saved, strict=True)):
        kept = residuals[index]
        if fragment.residual is not None:
            fragment.residual.zero_()
            if kept is not None:
                fragment.residual[: fragment.numel].copy_(kept)
        if fragment.owner_residual is not None:
            fragment.owner_residual.zero_()
        if entry.get("sent") is not None:
            fragment.delta.zero_()
            fragment.delta[: fragment.numel].copy_(entry["sent"])
            fragment.status = "restart"
            snapshots.keep(index, fragment)


def join(fragments: Sequence[OuterFragment], saved: Sequence[dict[str, Any]]) -> None:
    """A new rank's start in a healed run, from the survivors' replicated entries: local weights
    from θ_global (as every rank's after an outer step), residuals at zero.

    Raises:
        ValueError: an exchange was in flight (the survivors must let it in at a step with none).
    """
    if any(entry.get("sent") is not None for entry in saved):
        raise ValueError(
            "lightning_mpi: a new rank cannot join while a DiLoCo exchange is in flight; the survivors let "
            "it in at a step with none (lightning_mpi.strategies.replacement)"
        )
    for fragment in fragments:
        if fragment.residual is not None:
            fragment.residual.zero_()
        if fragment.owner_residual is not None:
            fragment.owner_residual.zero_()
        fragment.local.push(fragment.theta_global)
