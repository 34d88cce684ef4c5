"""The vCenter password (from the environment, the keyring, or a prompt; always masked) and TLS trust.

Lookup order: the environment variable the inventory names (`vcenter.password_env`),
then the system keyring when the optional `keyring` package is installed
(service "vcfslm", username "<user>@<vcenter host>"), then the `prompt` callback
the CLI passes. The password travels as a `Secret` whose repr/str are masked, so
it cannot leak into logs, exception messages, JSON or run directories by accident;
`scrub()` removes it from any text that came back from a server or a library.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable, Mapping

from ..errors import VCenterError

MASK = "********"
KEYRING_SERVICE = "vcfslm"


class Secret:
    """A string that never shows itself: repr/str/format give a mask; `reveal()` gives it."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        object.__setattr__(self, "_value", value)

    def reveal(self) -> str:
        return self._value

    def scrub(self, text: str) -> str:
        """`text` with every occurrence of the secret replaced by the mask."""
        return text.replace(self._value, MASK) if self._value else text

    def __repr__(self) -> str:
        return f"Secret('{MASK}')"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(("Secret", self._value))

    def __setattr__(self, name, value):
        raise AttributeError("Secret is immutable")

    def __reduce__(self):
        raise TypeError("a Secret is not serialisable")


def ssl_context(ca_bundle: str | None, insecure: bool) -> ssl.SSLContext:
    """TLS verified against `ca_bundle` (or the system store); unverified only when insecure."""
    if insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    return ssl.create_default_context(cafile=ca_bundle) if ca_bundle else ssl.create_default_context()


def keyring_username(user: str, host: str) -> str:
    return f"{user}@{host}"


def _from_keyring(user: str, host: str) -> str | None:
    """The keyring's password, or None when keyring is absent, empty or broken."""
    try:
        import keyring  # optional: not a dependency
    except ImportError:
        return None
    try:
        return keyring.get_password(KEYRING_SERVICE, keyring_username(user, host))
    except Exception:  # a locked or missing backend is "no password there", not a crash
        return None


def resolve_password(vcenter, prompt: Callable[[str], str] | None = None,
                     environ: Mapping[str, str] | None = None,
                     keyring_lookup: Callable[[str, str], str | None] = _from_keyring) -> Secret:
    """The password for `vcenter` (the inventory's vcenter section) as a Secret.

    prompt: called with a question when nothing else has the password (None = no prompt);
    raises VCenterError naming where it looked (never the value) when none is found.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(vcenter.password_env)
    if value:
        return Secret(value)
    value = keyring_lookup(vcenter.user, vcenter.host)
    if value:
        return Secret(value)
    if prompt is not None:
        value = prompt(f"Password for {vcenter.user} on {vcenter.host}")
        if value:
            return Secret(value)
    raise VCenterError(
        f"no vCenter password: set ${vcenter.password_env}, store it in the keyring "
        f"(service '{KEYRING_SERVICE}', user '{keyring_username(vcenter.user, vcenter.host)}'), "
        "or run interactively to be prompted")
