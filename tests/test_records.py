"""records.dataclass behaves as dataclasses.dataclass for every form the project uses: the same class made by each
is compared call by call (construction, defaults, factories, repr, equality, hashing, frozenness, replace, fields,
asdict, pickling, pattern matching, __post_init__, a method of the body's own)."""
from __future__ import annotations

import copy
import dataclasses
import pickle
from typing import Any

import pytest
from gpuwarden.agent.core import records


def _both(frozen: bool, slots: bool = False) -> tuple[type, type]:
    made = []
    for decorate in (dataclasses.dataclass, records.dataclass):
        class Sample:
            """A sample."""

            gpu: int
            name: str = "gpu"
            counts: dict[str, int] = dataclasses.field(default_factory=dict, hash=False)
            seen: tuple[int, ...] = ()

            def total(self) -> int:
                return sum(self.counts.values())

        made.append(decorate(frozen=frozen, slots=slots)(Sample))
    return made[0], made[1]


# Picklable module-level pairs (pickle finds a class by its qualified name).
@dataclasses.dataclass(frozen=True)
class StdFrozen:
    gpu: int
    counts: dict[str, int] = dataclasses.field(default_factory=dict)


@records.dataclass(frozen=True)
class OneFrozen:
    gpu: int
    counts: dict[str, int] = dataclasses.field(default_factory=dict)


@pytest.mark.parametrize("frozen", [False, True])
def test_construction_defaults_and_factories_match(frozen: bool) -> None:
    std, one = _both(frozen)
    for args, kwargs in (((1,), {}), ((2, "x"), {}), ((3,), {"counts": {"a": 1}}), ((), {"gpu": 4, "seen": (1,)})):
        a, b = std(*args, **kwargs), one(*args, **kwargs)
        assert [getattr(a, f.name) for f in dataclasses.fields(a)] == [getattr(b, f.name) for f in
                                                                        dataclasses.fields(b)]
        assert repr(a).replace("test_records._both.<locals>.", "") == repr(b).replace(
            "test_records._both.<locals>.", "")
        assert b.total() == a.total()
    assert one(1).counts is not one(1).counts  # a factory's value is new for each instance
    with pytest.raises(TypeError):
        one()  # the field without a default is required
    with pytest.raises(TypeError):
        one(1, gpu=2)


@pytest.mark.parametrize("frozen", [False, True])
def test_equality_and_hashing_match(frozen: bool) -> None:
    std, one = _both(frozen)
    assert one(1, "a") == one(1, "a")
    assert one(1, "a") != one(1, "b")
    assert (one(1) == std(1)) is False  # another class is never equal, as with the standard decorator
    assert one(1).__eq__(object()) is NotImplemented
    if frozen:
        assert hash(one(1, "a", seen=(1, 2))) == hash(one(1, "a", seen=(1, 2))) == hash(std(1, "a", seen=(1, 2)))
        assert len({one(1, "a"), one(1, "a"), one(2, "a")}) == 2
    else:
        assert std.__hash__ is None and one.__hash__ is None
        with pytest.raises(TypeError):
            hash(one(1))


def test_frozen_refuses_assignment_and_deletion() -> None:
    _, one = _both(True)
    sample = one(1)
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'gpu'"):
        sample.gpu = 2
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot delete field 'name'"):
        del sample.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.other = 1  # not even a new attribute
    _, mutable = _both(False)
    m = mutable(1)
    m.gpu = 5
    assert m.gpu == 5


@pytest.mark.parametrize("frozen", [False, True])
def test_the_dataclasses_functions_work_on_it(frozen: bool) -> None:
    _, one = _both(frozen)
    sample = one(1, counts={"a": 2})
    assert dataclasses.is_dataclass(sample)
    assert [f.name for f in dataclasses.fields(one)] == ["gpu", "name", "counts", "seen"]
    assert dataclasses.asdict(sample) == {"gpu": 1, "name": "gpu", "counts": {"a": 2}, "seen": ()}
    changed = dataclasses.replace(sample, name="x")
    assert changed == one(1, "x", {"a": 2}) and changed is not sample
    assert one.__match_args__ == ("gpu", "name", "counts", "seen")
    match sample:
        case one(gpu, name):  # type: ignore[misc]
            assert (gpu, name) == (1, "gpu")
        case _:
            pytest.fail("no match")
    assert one.__dataclass_params__.frozen is frozen
    assert copy.copy(sample) == sample and copy.deepcopy(sample) == sample


def test_a_frozen_record_pickles_as_the_standard_one() -> None:
    sample = OneFrozen(3, {"x": 1})
    assert pickle.loads(pickle.dumps(sample)) == sample
    assert pickle.loads(pickle.dumps(StdFrozen(3))) == StdFrozen(3)


def test_slots_are_the_standard_decorators() -> None:
    std, one = _both(True, slots=True)
    assert one.__slots__ == std.__slots__ == ("gpu", "name", "counts", "seen")
    assert one(1) == one(1) and hash(one(1)) == hash(one(1))


def test_the_class_bodys_own_methods_stand_and_post_init_runs() -> None:
    @records.dataclass
    class Own:
        a: int
        b: list[int] = dataclasses.field(default_factory=list)

        def __repr__(self) -> str:
            return "own"

        def __eq__(self, other: Any) -> bool:
            return True

        def __post_init__(self) -> None:
            self.b.append(self.a)

    assert repr(Own(1)) == "own" and Own(1) == Own(2)
    assert Own(1).b == [1]
    assert Own.__hash__ is None  # __eq__ written without __hash__: unhashable, as with the standard decorator

    @records.dataclass(frozen=True)
    class Hashed:
        a: int

        def __hash__(self) -> int:
            return 7

    assert hash(Hashed(1)) == 7


def test_recursive_repr_is_cut() -> None:
    _, one = _both(False)
    sample = one(1)
    sample.counts = sample  # type: ignore[assignment]
    assert "..." in repr(sample)


def test_forms_it_does_not_take_are_refused() -> None:
    with pytest.raises(TypeError, match="without init"):
        @records.dataclass
        class NoInit:
            a: int = dataclasses.field(init=False, default=0)
    with pytest.raises(TypeError, match="Cannot overwrite attribute __setattr__"):
        @records.dataclass(frozen=True)
        class Sets:
            a: int

            def __setattr__(self, name: str, value: Any) -> None:
                pass


def test_the_package_uses_this_decorator() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    offenders = []
    for path in [*(root / "agent").rglob("*.py"), *(root / "checks").rglob("*.py")]:
        text = path.read_text()
        if path.name == "records.py" and path.parent.name == "agent":
            continue
        for line in text.splitlines():
            stripped = line.strip()
            if stripped.startswith("from dataclasses import") and "dataclass" in stripped.replace(
                    "make_dataclass", "").split("import", 1)[1].replace(" ", "").split(","):
                offenders.append(f"{path.relative_to(root)}: {stripped}")
            if stripped.startswith("@dataclasses.dataclass"):
                offenders.append(f"{path.relative_to(root)}: {stripped}")
    assert offenders == []
