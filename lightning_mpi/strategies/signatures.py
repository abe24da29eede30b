"""Each strategy class's signature and docstring, made from the one definition of each argument.

A frontend's ``MPIStrategy.__init__`` names its own arguments (``rule``, ``log_stats``, the Lightning
plumbing) and takes the options every strategy takes as ``**options``
(:class:`~.common_options.CommonOptions`). A named strategy (``EASGDStrategy``) takes its rule's
options too. Python cannot see through ``**``, so the classes carry an explicit ``__signature__``
(LightningCLI, ``help()`` and IDEs at run time read it) and a generated ``Args:`` section, both
built here from the definitions: nothing is written twice.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Mapping
from typing import Any

from lightning_mpi.options import Documented, args_section, documented, parameters
from lightning_mpi.rules.base import Rule
from lightning_mpi.strategies.common_options import CommonOptions

#: The class attribute with every argument, documented, in order (read by :func:`strategy_arguments`).
DOCUMENTED_ARGUMENTS = "_documented_arguments"
#: What ``inspect.signature`` reads before the code: LightningCLI, ``help()`` and IDEs see it.
_SIGNATURE = "__signature__"
#: Common options that only some rules take (listed with the rule's own).
_RULE_FAMILY = ("implicit_momentum_correction",)
#: Arguments that Lightning fills in: listed last.
_PLUMBING = ("accelerator", "checkpoint_io", "precision_plugin", "precision")


def check_rule(rule: Any) -> Rule | None:
    """``rule`` when it is ``None`` or a :class:`Rule`, else ``ValueError`` naming it and the fix."""
    if rule is not None and not isinstance(rule, Rule):
        raise ValueError(f"rule={rule!r} must be a lightning_mpi Rule instance (e.g. SyncRule())")
    return rule


def _summary(doc: str | None) -> str:
    """A docstring without its ``Args:`` section."""
    text = inspect.cleandoc(doc or "")
    return text.split("\nArgs:\n", 1)[0].rstrip()


def _with_args(summary: str, arguments: list[Documented]) -> str:
    return f"{summary}\n\n{args_section(arguments, indent='')}\n"


def document_frontend(cls: type, own: Mapping[str, str]) -> None:
    """Give a frontend's ``MPIStrategy`` its full signature and ``Args:`` section: its own
    arguments (documented in ``own``, by name) and the common options."""
    init = vars(cls)["__init__"]  # the class's own function, made once per package
    hints = typing.get_type_hints(init)
    signature = inspect.signature(init)
    mine = [
        Documented(p.name, hints.get(p.name, Any), p.default, own[p.name], None)
        for p in signature.parameters.values()
        if p.name in own
    ]
    common = documented(CommonOptions)
    # The rule, the rule family's option (implicit_momentum_correction: asynchronous rules), this frontend's
    # own, every strategy's, then what Lightning fills in.
    family = [a for a in common if a.name in _RULE_FAMILY]
    arguments = (
        [a for a in mine if a.name == "rule"]
        + family
        + [a for a in mine if a.name != "rule" and a.name not in _PLUMBING]
        + [a for a in common if a.name not in _RULE_FAMILY]
        + [a for a in mine if a.name in _PLUMBING]
    )
    self_parameter = next(iter(signature.parameters.values()))
    setattr(init, _SIGNATURE, inspect.Signature([self_parameter, *parameters(arguments)]))
    cls.__doc__ = _with_args(_summary(cls.__doc__), arguments)
    setattr(cls, DOCUMENTED_ARGUMENTS, arguments)


def strategy_arguments(rule_class: type[Rule], base: Any) -> list[Documented]:
    """Every argument of the strategy that trains ``rule_class`` on ``base``: the rule's options,
    then the base's arguments other than ``rule`` (``implicit_momentum_correction`` only for
    asynchronous rules; a rule option of the same name wins)."""
    rule_options = documented(rule_class)
    names = {o.name for o in rule_options}
    rest = [
        a
        for a in getattr(base, DOCUMENTED_ARGUMENTS)  # set by document_frontend
        if a.name != "rule"
        and a.name not in names
        and (a.name != "implicit_momentum_correction" or rule_class.asynchronous)
    ]
    return rule_options + rest


def named_strategy(name: str, rule_class: type[Rule], base: Any, module: str) -> type:
    """The strategy class ``name`` on ``base`` (a frontend's ``MPIStrategy`` or ``AsyncMPIStrategy``):
    it builds a ``rule_class`` from its arguments and passes the rest to ``base``.

    The class reports ``module`` as its home, so pickling, ``repr`` and LightningCLI class paths
    find it there.
    """
    arguments = strategy_arguments(rule_class, base)
    rule_names = {o.name for o in documented(rule_class)}
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    signature = inspect.Signature([self_parameter, *parameters(arguments)])

    def __init__(self: Any, **kwargs: Any) -> None:
        signature.bind(self, **kwargs)  # TypeError for an argument this strategy does not take
        rule = rule_class(**{k: v for k, v in kwargs.items() if k in rule_names})
        base.__init__(self, rule=rule, **{k: v for k, v in kwargs.items() if k not in rule_names})

    setattr(__init__, _SIGNATURE, signature)
    __init__.__qualname__ = f"{name}.__init__"
    doc = _with_args(_summary(rule_class.__doc__), arguments)
    return type(
        name,
        (base,),
        {
            "__init__": __init__,
            "__module__": module,
            "__qualname__": name,
            "__doc__": doc,
            "rule_class": rule_class,
            DOCUMENTED_ARGUMENTS: arguments,
        },
    )
