"""Options defined once: type, default, one line of doc and one check, in one place.

A rule's hyperparameters and the options every strategy takes are dataclass fields made with
:func:`option`. Everything that shows an option reads that one definition:

- the constructor (a keyword-only dataclass ``__init__``) and its validation (:func:`validate`,
  one check per option, one message format: the option, its value and what it must be);
- the strategy classes' signatures, which LightningCLI reads for ``--help`` and ``--print_config``
  (:func:`parameters`), and their docstrings (:func:`args_section`);
- the argument tables in ``docs/strategies.md`` (:func:`markdown_table`), which a test compares
  with the code.

No torch, no MPI, no Lightning: rules and strategies both build on it.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

from typing_extensions import dataclass_transform

#: A check: ``check(name, value)`` returns the value to keep (a float for a number given as an
#: int) or raises ``ValueError`` naming the option, its value and what it must be.
Check = Callable[[str, Any], Any]

_T = TypeVar("_T")

#: ``Optional[X]``/``Union[X, Y]`` and ``X | Y`` (which is another type at run time).
_UNIONS = (Union, types.UnionType)


def option(*, default: Any, doc: str, check: Check | None = None) -> Any:
    """A dataclass field with its default, one line of doc and its check (keywords: type checkers
    see the default only as ``default=``).

    Without ``check``, the annotation decides: a ``Literal`` accepts its values, ``bool`` accepts
    ``True``/``False``; anything else is not checked.
    """
    return dataclasses.field(default=default, metadata={"doc": doc, "check": check})


def with_default(cls: type, name: str, default: Any) -> Any:
    """Option ``name`` of options class ``cls`` with another default (for a subclass), the same doc and check."""
    return dataclasses.field(default=default, metadata=cls.__dataclass_fields__[name].metadata)  # type: ignore[attr-defined]  # a dataclass


@dataclass_transform(kw_only_default=True, field_specifiers=(option, with_default, dataclasses.field))
def options_class(cls: type[_T]) -> type[_T]:
    """Make ``cls`` a keyword-only dataclass of options and append an ``Args:`` section, built from
    the fields, to its docstring (so ``help()`` and LightningCLI show every option)."""
    cls = dataclasses.dataclass(kw_only=True)(cls)
    cls.__doc__ = with_args_section(cls.__doc__ or "", documented(cls))
    return cls


# -- checks -------------------------------------------------------------------------------------------
def integer(low: int) -> Check:
    """An ``int`` (not a bool) ≥ ``low``."""

    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} is out of range: it must be an integer >= {low}")
        return value

    return check


def number(low: float = -math.inf, high: float = math.inf, *, low_open: bool = False, high_open: bool = False) -> Check:
    """A real number (int or float, not a bool) in the interval, kept as a float."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"

    def check(name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}={value!r} is not a number: it must be in {left}{low}, {high}{right}")
        too_low = value <= low if low_open else value < low
        too_high = value >= high if high_open else value > high
        if too_low or too_high or math.isnan(value):
            raise ValueError(f"{name}={value!r} is out of range: it must be in {left}{low}, {high}{right}")
        return float(value)

    return check


def choice(values: Sequence[Any]) -> Check:
    """One of ``values``."""

    def check(name: str, value: Any) -> Any:
        if isinstance(value, bool) != any(isinstance(v, bool) for v in values) or value not in values:
            raise ValueError(f"{name}={value!r} is not allowed: choose one of {list(values)}")
        return value

    return check


def optional(inner: Check) -> Check:
    """``None``, or what ``inner`` accepts."""

    def check(name: str, value: Any) -> Any:
        return None if value is None else inner(name, value)

    return check


def check_for(annotation: Any) -> Check | None:
    """The check an annotation implies: ``Literal`` values, ``bool``, ``Optional`` of either."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return choice(args)
    if annotation is bool:
        return choice([True, False])
    if origin in _UNIONS and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        if len(rest) == 1 and get_origin(rest[0]) is Literal:  # the choices, None among them
            return choice([*get_args(rest[0]), None])
        inner = check_for(Union[rest])  # noqa: UP007 (a Union built at run time)
        return optional(inner) if inner is not None else None
    return None


# -- reading the definitions ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Documented:
    """One option as its definition gives it."""

    name: str
    annotation: Any
    default: Any
    doc: str
    check: Check | None


def documented(cls: type) -> list[Documented]:
    """The documented options of dataclass ``cls``: those a subclass adds first, then its bases'
    (so a rule's own options come before the bucket options it shares), with resolved annotations.

    A field without a doc (``dataclasses.field(init=False, ...)``: a value a subclass fixes) is
    not an option.
    """
    hints = typing.get_type_hints(cls)  # each class's annotations in its own module's namespace
    fields = {field.name: field for field in dataclasses.fields(cls)}
    # An option sits with the class that first defined it (a subclass may change its default,
    # keeping the doc); one that a subclass defines anew, with a doc of its own, sits with that subclass.
    origin: dict[str, type] = {}
    for klass in reversed(cls.__mro__):
        own = vars(klass).get("__dataclass_fields__", {})
        for name in vars(klass).get("__annotations__", {}):
            doc = fields[name].metadata.get("doc") if name in fields else None
            if name in fields and (name not in own or own[name].metadata.get("doc") == doc):
                origin.setdefault(name, klass)
    names = [
        name
        for klass in cls.__mro__
        for name in vars(klass).get("__annotations__", {})
        if name in fields and origin[name] is klass
    ]
    found = []
    for name in names:
        field = fields[name]
        if "doc" in field.metadata and field.init:
            annotation = hints[name]
            found.append(
                Documented(
                    name,
                    annotation,
                    field.default,
                    field.metadata["doc"],
                    field.metadata["check"] or check_for(annotation),
                )
            )
    return found


def validate(instance: Any) -> None:
    """Run every option's check on ``instance`` (a dataclass made with :func:`option` fields), keeping
    the value each check returns."""
    for entry in documented(type(instance)):
        if entry.check is not None:
            object.__setattr__(instance, entry.name, entry.check(entry.name, getattr(instance, entry.name)))


def check_one(cls: type, name: str, value: Any) -> Any:
    """The value that option ``name`` of options class ``cls`` keeps for ``value`` (its check's
    result), or ``ValueError`` as at construction: for options set after construction."""
    for entry in documented(cls):
        if entry.name == name:
            return entry.check(name, value) if entry.check is not None else value
    raise KeyError(f"{cls.__name__} has no option {name!r}")


def parameters(options: Sequence[Documented]) -> list[inspect.Parameter]:
    """Keyword-only signature parameters for ``options`` (LightningCLI reads these)."""
    return [
        inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default, annotation=o.annotation)
        for o in options
    ]


def args_section(options: Sequence[Documented], indent: str = "    ") -> str:
    """A Google-style ``Args:`` block documenting ``options`` (docstring parsers read it)."""
    lines = [f"{indent}Args:"]
    lines += [f"{indent}    {o.name}: {o.doc} Default: ``{o.default!r}``." for o in options]
    return "\n".join(lines)


def with_args_section(doc: str, options: Sequence[Documented]) -> str:
    """``doc`` (a docstring) with an ``Args:`` block for ``options`` appended."""
    if not options:
        return doc
    return inspect.cleandoc(doc).rstrip() + "\n\n" + args_section(options, indent="") + "\n"


def format_annotation(annotation: Any) -> str:
    """A short spelling of a type: ``int``, ``float or None``, ``"fp32" or "bf16"``."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " or ".join(repr(a).replace("'", '"') for a in args)
    if origin in _UNIONS:
        return " or ".join(format_annotation(a) for a in args)
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", repr(annotation))


def markdown_table(options: Sequence[Documented]) -> str:
    """``options`` as the argument table of ``docs/strategies.md``."""
    rows = ["| argument | type | default | meaning |", "|---|---|---|---|"]
    for o in options:
        default = repr(o.default).replace("'", '"')
        rows.append(f"| `{o.name}` | {format_annotation(o.annotation)} | `{default}` | {o.doc} |")
    return "\n".join(rows)
