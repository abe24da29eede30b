"""What a rule carries through a heal: its state read on this rank alone (:func:`kept_state`, what
the survivors' new binding loads), and on rank 0, when ``heal="replace"`` lets new ranks in, what
it keeps and what it hands to them (:func:`split_for_new_ranks`). Which rules heal, what each one
keeps and how its interrupted operations are redone: the table in :mod:`.healing_rules`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_mpi.rules.auto import BoundAuto
from lightning_mpi.rules.averaging import BoundModelAveraging
from lightning_mpi.rules.base import BoundRule
from lightning_mpi.rules.diloco import BoundDiLoCo
from lightning_mpi.rules.easgd import BoundEASGD
from lightning_mpi.rules.gossip import GoSGDRule
from lightning_mpi.rules.server import ServerRule
from lightning_mpi.rules.server.heal import joined_state
from lightning_mpi.rules.sync import BoundSync

#: Rules whose ranks step on their own gradients and exchange in ``after_step`` every ``period``
#: steps, with a state that each rank holds whole (``state_dict`` makes no collective): whether
#: an ``after_step`` exchanged, from the state before it and the rule after it.
LOCAL_STEP_RULES: dict[type, Callable[[Any, dict[str, Any]], bool]] = {
    BoundModelAveraging: lambda bound, before: bound.averages != before["averages"],
    BoundEASGD: lambda bound, before: (
        bound.transport.size > 1 and bound.steps != before["steps"] and bound.steps % bound.rule.period == 0
    ),
    # DiLoCo and Streaming DiLoCo: an exchange completed when an outer step was made
    BoundDiLoCo: lambda bound, before: bound.outer_steps != before["outer_steps"],
}


def local_state(bound: Any) -> dict[str, Any]:
    """The bound rule's state read on this rank alone: its ``heal_state()`` where it has one (a
    ``state_dict()`` that gathers would need the other ranks), else its ``state_dict()``."""
    heal_state = getattr(bound, "heal_state", None)
    state: dict[str, Any] = heal_state() if heal_state is not None else bound.state_dict()
    return state


def kept_state(bound: BoundRule | None) -> dict[str, Any] | None:
    """What the bound rule carries into the healed run (its state, read locally: the other ranks
    are not reachable any more), ``None`` when no rule is live (nothing to bind again); raises
    ``LookupError`` naming why for a rule that cannot heal yet."""
    if bound is None:
        return None
    if isinstance(bound, BoundAuto):  # before heal_state: BoundAuto answers for its arm's attributes
        from lightning_mpi.strategies.healing_auto import auto_kept_state

        return auto_kept_state(bound)
    if type(bound) is BoundSync:
        return {"skipped_steps": bound.skipped_steps}
    if type(bound) in LOCAL_STEP_RULES or hasattr(bound, "heal_state"):
        # model averaging: its counters; EASGD: its counter and the center (replicated: every
        # survivor holds it whole); the weights are the module's. A rule with a heal_state says
        # itself what it keeps (the table in healing_rules)
        return local_state(bound)
    raise LookupError(f"{type(bound).__name__} keeps state that is not rebuilt after a heal yet")


def split_for_new_ranks(rule: Any, state: dict[str, Any], n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """On rank 0 when ``n`` new ranks are let in (``heal="replace"``): the state rank 0 binds the
    rule again with, and the state each new rank takes (it starts from rank 0's weights):

    - without rank 0's own part (``"local"``: its residuals); a new rank starts with none;
    - a parameter-server rule: as a rank that joined (no shard of the center yet; the survivors'
      shards are re-cut over the grown run: :func:`~lightning_mpi.rules.server.heal.joined_state`);
    - GoSGD: rank 0's mixing weight split evenly between itself and the new ranks, which hold its
      θ, so Σw and the consensus Σwθ/Σw are unchanged; a new rank keeps its own generator;
    - ZeRO: as a rank that joined (no optimizer shard of its own: the survivors' shards, the whole
      state, are resharded over the grown run when the optimizer is sharded again:
      :meth:`~.optimizer_sharding.OptimizerSharding.attach`).
    """
    handed = {key: value for key, value in state.items() if key != "local"}
    healed = handed.get("healed")
    if isinstance(handed.get("zero_heal"), dict):
        handed["zero_heal"] = {"joined": True}
    if isinstance(rule, ServerRule) and isinstance(healed, dict):
        handed["healed"] = joined_state(healed)
    elif isinstance(rule, GoSGDRule) and isinstance(healed, dict):
        share = float(healed["weight"]) / (n + 1)
        state = {**state, "healed": {**healed, "weight": share}}
        handed["healed"] = {"weight": share, "pushes": 0, "drained": bool(healed["drained"])}
    return state, handed
