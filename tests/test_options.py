"""lightning_mpi.options: one definition per option, shown everywhere (constructor, checks, signature,
docstring, the docs' tables)."""

from __future__ import annotations

import inspect
import math
from typing import Literal, Optional

import pytest

from lightning_mpi.options import (
    check_one,
    choice,
    documented,
    integer,
    markdown_table,
    number,
    option,
    options_class,
    optional,
    parameters,
    validate,
    with_default,
)
from tests.mpi_utils import REPO


@options_class
class Base:
    """A base."""

    period: int = option(default=5, doc="steps between exchanges (≥ 1).", check=integer(1))
    wire: Literal["fp32", "bf16"] = option(default="fp32", doc="the wire format.")

    def __post_init__(self) -> None:
        validate(self)


@options_class
class Derived(Base):
    """A derived class."""

    alpha: Optional[float] = option(
        default=None, doc="a rate in (0, 1]; None: automatic.", check=optional(number(0, 1, low_open=True))
    )
    period: int = with_default(Base, "period", default=3)


def test_each_option_is_checked_once_with_one_message_format():
    assert Derived().period == 3 and Derived(alpha=1).alpha == 1.0  # an int kept as a float
    for kwargs, message in [
        ({"period": 0}, "period=0 is out of range: it must be an integer >= 1"),
        ({"period": 2.5}, "period=2.5 is out of range: it must be an integer >= 1"),
        ({"period": True}, "period=True is out of range: it must be an integer >= 1"),
        ({"wire": "fp8"}, "wire='fp8' is not allowed: choose one of ['fp32', 'bf16']"),
        ({"alpha": 0.0}, "alpha=0.0 is out of range: it must be in (0, 1]"),
        ({"alpha": math.nan}, "alpha=nan is out of range: it must be in (0, 1]"),
        ({"alpha": "x"}, "alpha='x' is not a number: it must be in (0, 1]"),
    ]:
        with pytest.raises(ValueError) as raised:
            Derived(**kwargs)
        assert str(raised.value) == message
    with pytest.raises(TypeError):
        Derived(5)  # keyword-only, so no argument binds by position by mistake
    assert choice([True, False])("flag", True) is True
    with pytest.raises(ValueError, match=r"flag=1 is not allowed"):
        choice([True, False])("flag", 1)
    assert check_one(Derived, "period", 7) == 7
    with pytest.raises(ValueError, match="period=0"):
        check_one(Derived, "period", 0)


def test_one_definition_gives_order_signature_docstring_and_table():
    names = [o.name for o in documented(Derived)]
    assert names == ["alpha", "period", "wire"]  # own options first; a changed default keeps its place
    period = documented(Derived)[1]
    assert (period.default, period.doc) == (3, "steps between exchanges (≥ 1).")
    signature = inspect.Signature(parameters(documented(Derived)))
    assert (
        str(signature) == "(*, alpha: Optional[float] = None, period: int = 3, wire: Literal['fp32', 'bf16'] = 'fp32')"
    )
    assert "    period: steps between exchanges (≥ 1). Default: ``3``." in Derived.__doc__
    table = markdown_table(documented(Derived))
    assert '| `wire` | "fp32" or "bf16" | `"fp32"` | the wire format. |' in table
    assert "| `alpha` | float or None | `None` |" in table


def test_the_docs_tables_are_the_code():
    from lightning_mpi.strategies import reference

    page = REPO / "docs" / "strategies.md"
    assert reference.main([str(page), "--check"]) == 0, (
        "run: python -m lightning_mpi.strategies.reference docs/strategies.md"
    )
    keys = set(
        reference._TABLE.findall(page.read_text()) and [m[1] for m in reference._TABLE.findall(page.read_text())]
    )
    from lightning_mpi.strategies.build import STRATEGY_RULES

    assert keys == {*STRATEGY_RULES, "common"}  # every strategy has its table
