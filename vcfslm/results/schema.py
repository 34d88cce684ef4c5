"""The run files' field types, checked by pydantic, and its findings in this project's words.

Run files are input like any other: each object is validated against its dataclass's
annotations before it is built, so a hand-edited or foreign file fails naming the file,
line and field instead of with a TypeError deep inside the report. Every number a record
carries is a count, a time or a rate: integers are at least 0 (`AtLeastOne`: at least 1),
floats finite and at least 0. Unknown keys are ignored (newer writers may add some).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Annotated, Any

from annotated_types import Ge
from pydantic import AllowInfNan, Strict, TypeAdapter, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

SCHEMA_VERSION = 1

Findings = list[tuple[str, str]]        # (key path, what is wrong with it)


def got(value: Any) -> str:
    """How a finding names what it found instead: the JSON kind of `value`."""
    return "null" if value is None else type(value).__name__


def _list_of(plural: str) -> WrapValidator:
    """A list check whose finding says what the list holds ("a list of numbers")."""
    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        if not isinstance(value, list):
            raise PydanticCustomError("list_of", "expected a list of {plural}, got {got}",
                                      {"plural": plural, "got": got(value)})
        return handler(value)
    return WrapValidator(check)


def _not_newer(value: int) -> int:
    if value > SCHEMA_VERSION:
        raise PydanticCustomError("schema_newer", "version {v} is newer than this vcfslm reads (up to {max}): "
                                  "upgrade vcfslm", {"v": value, "max": SCHEMA_VERSION})
    return value


def one_of(allowed: Sequence[str]) -> WrapValidator:
    """A value that must be one of `allowed` (a finding lists them)."""
    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        value = handler(value)
        if value not in allowed:
            raise PydanticCustomError("one_of", "expected one of {allowed}, got {value}",
                                      {"allowed": ", ".join(allowed), "value": repr(value)})
        return value
    return WrapValidator(check)


Count = Annotated[int, Strict(), Ge(0)]
AtLeastOne = Annotated[int, Strict(), Ge(1)]
Number = Annotated[float, Strict(), AllowInfNan(False), Ge(0)]    # a time or a rate; an int will do
Text = Annotated[str, Strict()]
Flag = Annotated[bool, Strict()]
Object = Annotated[dict[str, Any], Strict()]
Numbers = Annotated[list[Number], _list_of("numbers")]
Counts = Annotated[list[Count], _list_of("integers")]
Texts = Annotated[list[Text], _list_of("strings")]
NumberLists = Annotated[list[Numbers], _list_of("lists")]
Version = Annotated[int, Strict(), Ge(1), WrapValidator(lambda v, handler: _not_newer(handler(v)))]

# pydantic's error types -> what a finding says (the custom types above carry their own words)
_EXPECTED = {"int_type": "an integer", "float_type": "a number", "string_type": "a string",
             "bool_type": "true or false", "dict_type": "an object", "typed_dict_type": "an object"}


class SchemaError(ValueError):
    """A JSON object breaks a run file's schema; `findings` holds one (key, message) per problem."""

    def __init__(self, findings: Sequence[tuple[str, str]]):
        self.findings = list(findings)
        super().__init__("; ".join(f"{k}: {m}" if k else m for k, m in self.findings))


@functools.cache
def _adapter(cls: Any) -> TypeAdapter:
    return TypeAdapter(cls)


def schema_findings(cls: Any, data: Any) -> Findings:
    """Every way `data` breaks the schema of `cls` (a dataclass or a TypedDict), in field order."""
    if not isinstance(data, dict):
        return [("", f"expected a JSON object, got {got(data)}")]
    try:
        _adapter(cls).validate_python(data)
    except ValidationError as exc:
        return [finding(e) for e in exc.errors(include_url=False)]
    return []


def finding(error: Any) -> tuple[str, str]:
    """One pydantic error as (key path, message): `tpot_ms[2]`, `matrix.batch_sizes[1]`."""
    return key_path(error["loc"]), message(error)


def key_path(loc: Sequence[str | int]) -> str:
    key = ""
    for part in loc:
        if isinstance(part, int):
            key += f"[{part}]"
        elif not part.startswith("<"):          # a union's tag (see runs.py), not a key
            key += f".{part}" if key else part
    return key


def message(error: Any) -> str:
    kind, value = error["type"], error.get("input")
    if kind == "missing":
        return "required field missing"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {got(value)}"
    if kind == "finite_number":
        return f"expected a finite number, got {value}"
    if kind == "greater_than_equal":
        least = error["ctx"]["ge"]
        return f"must be at least {least}, got {value}" if least else f"must not be negative, got {value}"
    return error["msg"]                         # the custom types' own words
