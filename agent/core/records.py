"""`@dataclass` as the standard library's, with the methods it writes compiled in one piece.

Python 3.11 and 3.12 compile each method a dataclass gets on its own: six compiles for a frozen class (__init__,
__repr__, __eq__, __hash__, __setattr__, __delattr__), 0.5-1 ms a class. A one-shot `gpuwarden preflight` defines
some forty such classes before its first check runs, a fifth of its whole time. Here the class is given to the
standard decorator for what is cheap (its fields, `fields()`, `replace()`, `asdict()`, `__match_args__`), and
the methods it would write are written by the same rules as one source and compiled once. Python 3.13 writes them
in one piece itself: there this is the standard decorator.

Only what this project uses is taken: frozen or not, slots (handed to the standard decorator whole: it makes a new
class, with the pickling a frozen one needs), fields with defaults or default factories, and __post_init__.
"""
from __future__ import annotations

import dataclasses
import reprlib
import sys
from typing import Any, Callable, TypeVar

T = TypeVar("T")

_BATCHED_BY_PYTHON = sys.version_info >= (3, 13)


def dataclass(cls: type[T] | None = None, /, *, frozen: bool = False, slots: bool = False
              ) -> Any:
    """`@dataclass`, `@dataclass(frozen=True)`, `@dataclass(frozen=True, slots=True)`: as dataclasses.dataclass."""
    def wrap(c: type[T]) -> type[T]:
        if _BATCHED_BY_PYTHON or slots:
            return dataclasses.dataclass(c, frozen=frozen, slots=slots)
        return _one_compile(c, frozen)

    return wrap if cls is None else wrap(cls)


def _one_compile(cls: type[T], frozen: bool) -> type[T]:
    own = dict(cls.__dict__)  # what the class body defines itself, before the standard decorator adds anything
    doc = own.get("__doc__")
    if not doc:
        cls.__doc__ = cls.__name__  # else the standard decorator takes the signature (inspect) for a docstring
    # The fields, __dataclass_fields__ and __match_args__ as the standard decorator has them; its methods not.
    dataclasses.dataclass(cls, init=False, repr=False, eq=False)
    fields = dataclasses.fields(cls)
    if any(not f.init or f.kw_only for f in fields) or any(
            getattr(base, "__dataclass_fields__", None) for base in cls.__mro__[1:]):
        raise TypeError(f"{cls.__qualname__}: a field without init, keyword-only, or a dataclass base: "
                        "use dataclasses.dataclass")
    names = {"__dataclass_cls__": cls, "__dataclass_object__": object, "__dataclass_missing__": dataclasses.MISSING,
             "__dataclass_frozen_error__": dataclasses.FrozenInstanceError}
    params, body = [], []
    for f in fields:
        if f.default is not dataclasses.MISSING:
            names[f"__dflt_{f.name}__"] = f.default
            params.append(f"{f.name}=__dflt_{f.name}__")
            value = f.name
        elif f.default_factory is not dataclasses.MISSING:
            names[f"__factory_{f.name}__"] = f.default_factory
            params.append(f"{f.name}=__dataclass_missing__")
            value = f"__factory_{f.name}__() if {f.name} is __dataclass_missing__ else {f.name}"
        else:
            params.append(f.name)
            value = f.name
        body.append(f"  __dataclass_object__.__setattr__(self, {f.name!r}, {value})" if frozen
                    else f"  self.{f.name} = {value}")
    if hasattr(cls, "__post_init__"):
        body.append("  self.__post_init__()")
    source = [f"def __init__(self, {', '.join(params)}):", *(body or ["  pass"])]

    shown = [f for f in fields if f.repr]
    source.append("def __repr__(self):")
    source.append("  return self.__class__.__qualname__ + f\"(" +
                  ", ".join(f"{f.name}={{self.{f.name}!r}}" for f in shown) + ")\"")
    compared = [f for f in fields if f.compare]
    self_tuple = "(" + "".join(f"self.{f.name}," for f in compared) + ")"
    other_tuple = "(" + "".join(f"other.{f.name}," for f in compared) + ")"
    source += ["def __eq__(self, other):",
               "  if other.__class__ is self.__class__:",
               f"    return {self_tuple} == {other_tuple}",
               "  return NotImplemented"]
    hashed = [f for f in fields if (f.compare if f.hash is None else f.hash)]
    source += ["def __hash__(self):", "  return hash((" + "".join(f"self.{f.name}," for f in hashed) + "))"]
    if frozen:
        field_names = tuple(f.name for f in fields)
        names["__dataclass_field_names__"] = field_names
        for method, args, call in (("__setattr__", "name, value", "__setattr__(name, value)"),
                                   ("__delattr__", "name", "__delattr__(name)")):
            source += [f"def {method}(self, {args}):",
                       "  if type(self) is __dataclass_cls__ or name in __dataclass_field_names__:",
                       "    raise __dataclass_frozen_error__(f\"cannot "
                       + ("assign to" if method == "__setattr__" else "delete") + " field {name!r}\")",
                       f"  super(__dataclass_cls__, self).{call}"]
    made: dict[str, Any] = {}
    exec("\n".join(source), names, made)

    def put(name: str, fn: Callable[..., Any]) -> None:
        if name in own:  # the class body's own method stands, as with the standard decorator
            return
        fn.__qualname__ = f"{cls.__qualname__}.{fn.__name__}"
        setattr(cls, name, fn)

    put("__init__", made["__init__"])
    put("__repr__", reprlib.recursive_repr()(made["__repr__"]))
    put("__eq__", made["__eq__"])
    # The standard decorator's hash rule: a frozen class with __eq__ hashes its compared fields, a mutable one is
    # unhashable, a __hash__ the class body wrote stands.
    explicit_hash = "__hash__" in own and not (own["__hash__"] is None and "__eq__" in own)
    if not explicit_hash:
        if frozen:
            put("__hash__", made["__hash__"])
        else:
            cls.__hash__ = None  # type: ignore[assignment]
    if frozen:
        for method in ("__setattr__", "__delattr__"):
            if method in own:
                raise TypeError(f"Cannot overwrite attribute {method} in class {cls.__name__}")
            put(method, made[method])
    params_made = cls.__dataclass_params__  # type: ignore[attr-defined]
    params_made.init = params_made.repr = params_made.eq = True
    params_made.frozen = frozen  # what a dataclass deriving from this one checks
    if not doc:
        cls.__doc__ = doc
    return cls
