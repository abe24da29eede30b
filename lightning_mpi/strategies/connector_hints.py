"""Lightning's "invalid strategy" error, with a hint when the strategy was meant for lightning_mpi.

Each Trainer and Fabric checks its ``strategy`` flag in its connector's
``_check_config_and_set_final_flags`` and raises ``ValueError("You selected an invalid strategy
name ...")`` there. Nothing of ours runs before that: the flag is compared with a plain list of the
registry's names (for a string, no hook at all; for an object, only ``__eq__`` and ``__repr__``),
and the registry offers no callback for a miss. So this is the one place where Lightning is wrapped
rather than extended: :func:`install` wraps that method (``wrapt``, once per package, at
registration) and, when it raises ``ValueError``, puts :func:`~.names.strategy_hint`'s hint in
front of Lightning's own message. The exception keeps its type, its traceback and Lightning's text,
and nothing that Lightning accepts or refuses changes. If a Lightning version renames the method,
:func:`install` does nothing and the errors are Lightning's own.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Lightning package -> (its connector's module, the method that checks the strategy flag).
CONNECTORS = {
    "pytorch_lightning": (
        "pytorch_lightning.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector._check_config_and_set_final_flags",
    ),
    "lightning.pytorch": (
        "lightning.pytorch.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector._check_config_and_set_final_flags",
    ),
    "lightning_fabric": ("lightning_fabric.connector", "_Connector._check_config_and_set_final_flags"),
    "lightning.fabric": ("lightning.fabric.connector", "_Connector._check_config_and_set_final_flags"),
}

#: Marks a wrapper as ours, so that registering twice wraps once (``_self_``: kept on wrapt's proxy).
_MARK = "_self_lightning_mpi_strategy_hint"


def add_hint(error: ValueError, strategy: Any, package: str) -> None:
    """Put the hint for ``strategy`` (refused by ``package``) in front of ``error``'s message, in place."""
    from lightning_mpi.strategies.names import strategy_hint

    hint = strategy_hint(strategy, package)
    if hint is not None and error.args and isinstance(error.args[0], str):
        error.args = (f"{hint}\n{error.args[0]}", *error.args[1:])


def install(package: str) -> bool:
    """Wrap ``package``'s strategy check (idempotent); returns whether it is wrapped."""
    import wrapt

    module_name, attribute = CONNECTORS[package]
    try:
        module = importlib.import_module(module_name)
        class_name, method_name = attribute.split(".")
        owner = getattr(module, class_name)
        current = owner.__dict__[method_name]
    except (ImportError, AttributeError, KeyError):
        return False  # another Lightning layout: keep Lightning's own messages
    if getattr(current, _MARK, False):
        return True

    def with_hint(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        try:
            return wrapped(*args, **kwargs)
        except ValueError as error:
            add_hint(error, kwargs.get("strategy", args[0] if args else None), package)
            raise

    wrapt.wrap_function_wrapper(module, attribute, with_hint)
    setattr(owner.__dict__[method_name], _MARK, True)
    return True
