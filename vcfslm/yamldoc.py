"""YAML documents checked against a pydantic model, every problem at its file:line:column.

The inventory and the platform files share this: each key's position is kept while
parsing (duplicate keys are problems, not silently last-wins), and pydantic's findings
become `Problem`s that name the file, the line, the column and the key path, with a
"did you mean" for a misspelt key.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from .errors import InputError, Problem

Key = tuple[str | int, ...]


def read_document(path: str | os.PathLike[str], error: type[InputError]) -> str:
    """The text of an input file; `error` (naming the file) when it is missing or unreadable."""
    label = str(path)
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error([Problem(label, None, None, "", "file not found")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error([Problem(label, None, None, "", f"cannot read: {exc}")]) from None


def load_mapping(text: str, label: str, error: type[InputError], what: str) -> tuple[dict, Locator]:
    """A YAML mapping and the locator of its keys; `error` for bad YAML or a document that is not
    a mapping. what: how the error describes the expected mapping."""
    data, positions, problems = load_located(text, label)
    if problems:
        raise error(problems)
    locate = Locator(label, positions)
    if not isinstance(data, dict):
        raise error([locate((), what)])
    return data, locate


def pydantic_problems(exc: ValidationError, data: Any, locate: Locator, root: type[BaseModel],
                      skip: Collection[Key] = ()) -> list[Problem]:
    """Problems of a failed validation of `data` against `root`; findings at `skip` keys are left
    to the caller (it reported them better)."""
    out = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            if loc in skip:
                continue
            out.append(locate(loc, "unknown key" + _did_you_mean(loc, root)))
            continue
        msg = validation_message(err)
        if err["type"] == "missing":
            msg = "required key is missing"
        elif "input" in err and not isinstance(err["input"], (dict, list)):
            msg = f"{msg} (got {err['input']!r})"
        out.append(locate(loc, msg))
    return out


def validation_message(err: dict) -> str:
    """One pydantic finding as a user reads it: a validator's own words without pydantic's
    "Value error, " in front."""
    return err["msg"].removeprefix("Value error, ")


def _did_you_mean(loc: Key, root: type[BaseModel]) -> str:
    """' (did you mean 'x'?)' when an unknown key is close to a known one."""
    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(str(part)) if hasattr(model, "model_fields") else None
        if field is None:
            model = None
            break
        model = _model_in(field.annotation)
    if model is None or not hasattr(model, "model_fields"):
        return ""
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _model_in(annotation: Any) -> Any:
    """The BaseModel class inside an annotation such as list[Node] or Network | None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _model_in(arg)
        if found is not None:
            return found
    return None


class Locator:
    """Turns a key path into a Problem with the best known file position."""

    def __init__(self, label: str, positions: dict[Key, tuple[int, int]]):
        self.label = label
        self.positions = positions

    def __call__(self, key: Key, message: str) -> Problem:
        probe = tuple(key)
        # The deepest known ancestor: a missing key points at its parent mapping.
        while probe and probe not in self.positions:
            probe = probe[:-1]
        line, col = self.positions.get(probe, (None, None))
        return Problem(self.label, line, col, format_key(key), message)


def format_key(key: Key) -> str:
    """('nodes', 2, 'bench_ip') -> 'nodes[2].bench_ip'."""
    out = ""
    for part in key:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def load_located(text: str, label: str) -> tuple[Any, dict[Key, tuple[int, int]], list[Problem]]:
    """Parse YAML keeping each key's (line, column); duplicate keys are problems."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        return None, {}, [Problem(label, line, col, "", f"YAML syntax error: {exc.problem or exc}")]
    except yaml.YAMLError as exc:
        return None, {}, [Problem(label, None, None, "", f"YAML error: {exc}")]
    except RecursionError:
        return None, {}, [Problem(label, None, None, "", "YAML nesting is too deep")]
    positions: dict[Key, tuple[int, int]] = {}
    problems: list[Problem] = []
    if root is not None:
        positions[()] = (root.start_mark.line + 1, root.start_mark.column + 1)
        _walk(root, (), positions, problems, label, set())
    return data, positions, problems


def _walk(node: yaml.Node, key: Key, positions: dict[Key, tuple[int, int]],
          problems: list[Problem], label: str, seen: set[int]) -> None:
    if id(node) in seen:  # aliases may point back up the tree
        return
    seen = seen | {id(node)}
    if isinstance(node, yaml.MappingNode):
        names: set[str] = set()
        for k_node, v_node in node.value:
            name = str(k_node.value)
            child = key + (name,)
            pos = (k_node.start_mark.line + 1, k_node.start_mark.column + 1)
            if name in names and name != "<<":
                problems.append(Problem(label, pos[0], pos[1], format_key(child), "duplicate key"))
            names.add(name)
            positions.setdefault(child, pos)
            _walk(v_node, child, positions, problems, label, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            positions.setdefault(key + (i,), (item.start_mark.line + 1, item.start_mark.column + 1))
            _walk(item, key + (i,), positions, problems, label, seen)


