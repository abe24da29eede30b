"""The argument tables of ``docs/strategies.md``, made from the one definition of each argument.

The page marks each table with ``<!-- arguments: KEY -->`` ... ``<!-- /arguments -->``, where KEY
is a strategy class name (its rule's options) or ``common`` (the options every strategy takes).
``python -m lightning_mpi.strategies.reference docs/strategies.md`` rewrites the tables in place;
``--check`` only says whether they are current (a test runs it, so the page cannot drift from
the code).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from lightning_mpi.options import Documented, documented, markdown_table
from lightning_mpi.strategies.build import STRATEGY_RULES, trainer_classes

_TABLE = re.compile(r"(<!-- arguments: (\w+) -->\n)(.*?)(<!-- /arguments -->)", re.S)
_LIGHTNING_PLUMBING = ("rule", "accelerator", "checkpoint_io", "precision_plugin")


def table(key: str) -> str:
    """The markdown table for ``key`` (a strategy class name, or ``"common"``)."""
    if key == "common":
        base = trainer_classes("pytorch_lightning")["MPIStrategy"]
        documented_arguments: list[Documented] = getattr(base, "_documented_arguments")  # noqa: B009  (set by signatures.document_frontend)
        arguments = [a for a in documented_arguments if a.name not in _LIGHTNING_PLUMBING]
        return markdown_table(arguments)
    if key not in STRATEGY_RULES:
        raise ValueError(
            f"<!-- arguments: {key} --> names no strategy: use 'common' or one of {sorted(STRATEGY_RULES)}"
        )
    return markdown_table(documented(STRATEGY_RULES[key]))


def render(text: str) -> str:
    """``text`` with every marked table made anew."""
    return _TABLE.sub(lambda m: f"{m.group(1)}{table(m.group(2))}\n{m.group(4)}", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_mpi.strategies.reference",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("page", type=Path, help="the markdown page, e.g. docs/strategies.md")
    parser.add_argument("--check", action="store_true", help="exit 1 if a table is not current; change nothing")
    args = parser.parse_args(argv)
    old = args.page.read_text()
    new = render(old)
    if args.check:
        if new != old:
            sys.stderr.write(
                f"{args.page}: argument tables are out of date; run "
                f"`python -m lightning_mpi.strategies.reference {args.page}`\n"
            )
            return 1
        return 0
    args.page.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
