"""The deployment's API key, handled like an SSH private key.

One format, checked wherever a key is read (the operator's key file, a node's copy): a
key goes verbatim into nginx's key map (`"Bearer <key>" 1;`) and into an environment file
that bash sources, so it may hold only the characters of an OAuth bearer token
(RFC 6750's b64token: letters, digits, `-._~+/`, then `=` padding): no quote, `;`,
space, newline, `$` or backquote. A key file that group or others may read is refused,
as ssh refuses such a private key. Every private file is written 0600 from its first
byte (created with that mode, then renamed over the old one), in a folder of mode 0700
when this creates the folder.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from ..errors import Problem, UsageError

KEY_BYTES = 32
MIN_LENGTH = 20
MAX_LENGTH = 512
KEY_RE = re.compile(r"[A-Za-z0-9._~+/-]+=*")
KEY_VARIABLE = "VLLM_API_KEY"
# Keys the servers also take while a key rotation rolls.
PREVIOUS_KEYS_VARIABLE = "VCFSLM_PREVIOUS_API_KEYS"
DEFAULT_FOLDER = "~/.vcfslm/keys"


class KeyFileError(UsageError):
    """A key or key file that cannot be used (exit 2)."""


def new_key() -> str:
    return secrets.token_urlsafe(KEY_BYTES)


def key_problem(key: str) -> str | None:
    """Why `key` is not a usable API key (None: it is). Never quotes the key."""
    if not MIN_LENGTH <= len(key) <= MAX_LENGTH:
        return f"an API key has {MIN_LENGTH} to {MAX_LENGTH} characters; this one has {len(key)}"
    if not KEY_RE.fullmatch(key):
        bad = sorted({c for c in key if not re.fullmatch(r"[A-Za-z0-9._~+/=-]", c)} | (
            {"="} if "=" in key.rstrip("=") else set()))
        shown = ", ".join(repr(c) for c in bad)
        return (f"an API key may hold letters, digits and - . _ ~ + / (then = padding) only; this one has "
                f"{shown}")
    return None


def default_key_file(deployment: str) -> Path:
    return Path(DEFAULT_FOLDER).expanduser() / f"{deployment}.key"


def _refuse(path: str | Path, message: str) -> KeyFileError:
    return KeyFileError([Problem(str(path), None, None, "--key-file", message)])


def read_key_file(path: str | Path) -> str:
    """The key in `path` (one line); exit 2 when the file is open to group or others, empty,
    or not a key."""
    target = Path(path).expanduser()
    try:
        info = target.stat()
    except OSError as exc:
        raise _refuse(path, f"cannot read the API key: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(path, "is not a regular file")
    if info.st_mode & 0o077:
        raise _refuse(path, f"is readable or writable by group or others (mode {stat.S_IMODE(info.st_mode):04o}); "
                            f"the API key must be private: chmod 600 {target}")
    try:
        text = target.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise _refuse(path, f"cannot read the API key: {getattr(exc, 'strerror', None) or exc}") from None
    key = text[:-1] if text.endswith("\n") else text
    if not key:
        raise _refuse(path, "is empty: remove it to have serve up write a new key there")
    problem = key_problem(key)
    if problem:
        raise _refuse(path, problem)
    return key


def write_private(path: str | Path, text: str) -> Path:
    """Write `text` to `path`, mode 0600 from its first byte: a new file made with that mode
    beside it, then renamed over it. The folder is made 0700 when missing."""
    target = Path(path).expanduser()
    if not target.parent.exists():
        target.parent.mkdir(parents=True, mode=0o700)
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with open(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


def write_key_file(path: str | Path, key: str) -> Path:
    problem = key_problem(key)
    if problem:
        raise _refuse(path, problem)
    return write_private(path, key + "\n")


def env_text(key: str, previous: Sequence[str] = ()) -> str:
    """The node's environment file (sourced by bash, read by systemd's EnvironmentFile):
    the key, and the keys the servers also take while a key rotation rolls (space-separated;
    the vLLM entry hands them to vLLM in-process, never on a command line)."""
    for each in (key, *previous):
        problem = key_problem(each)
        if problem:
            raise ValueError(problem)
    text = f"{KEY_VARIABLE}={key}\n"
    return text + (f"{PREVIOUS_KEYS_VARIABLE}={' '.join(previous)}\n" if previous else "")


def key_of_env(text: str, where: str) -> str | None:
    """The key in a node's environment file (None: none); a malformed one is an error naming
    the node's file, as a bad key file is."""
    for line in text.splitlines():
        if line.startswith(KEY_VARIABLE + "="):
            key = line.split("=", 1)[1]
            if not key:
                return None
            problem = key_problem(key)
            if problem:
                raise KeyFileError([Problem(where, None, None, KEY_VARIABLE, problem)])
            return key
    return None


def check_keys(keys: list[str]) -> list[str]:
    """`keys` when every one is usable (the door's map takes them verbatim); ValueError else."""
    if not keys:
        raise ValueError("the door needs at least one API key")
    for key in keys:
        problem = key_problem(key)
        if problem:
            raise ValueError(problem)
    return list(keys)
