"""Render jinja2 templates from the shipped templates/ folder (StrictUndefined: a
missing variable is an error, never an empty string in a launch script)."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2

from ..errors import PlaybookError
from ..resources import resource_dir


@functools.lru_cache(maxsize=4)
def _environment(folder: str) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(folder),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # shell scripts and config files, not HTML
    )


def render_template(name: str, context: Mapping[str, Any], folder: str | Path | None = None) -> str:
    """Render templates/<name> with `context`; errors name the template and the variable."""
    env = _environment(str(folder or resource_dir("templates")))
    try:
        return env.get_template(name).render(**context)
    except jinja2.TemplateNotFound as exc:
        raise PlaybookError(f"template {name!r} not found in {folder or resource_dir('templates')}") from exc
    except jinja2.UndefinedError as exc:
        raise PlaybookError(f"template {name}: {exc.message}") from exc
    except jinja2.TemplateSyntaxError as exc:
        raise PlaybookError(f"template {exc.name or name}:{exc.lineno}: {exc.message}") from exc
