"""The vCenter session: login with TLS verified (or insecure, which warns), retries, logout.

Session expiry is healed by logging in again (safe for any call: vCenter refused
it before doing anything); connection resets are retried with backoff only for
calls that are safe to repeat; a vCenter refusing calls for load (throttle.py) is
asked again after a jittered backoff, and named when it keeps refusing.
"""

from __future__ import annotations

import http.client
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pyVim.connect import Disconnect, SmartConnect
from pyVmomi import VmomiSupport, vim, vmodl

from ..errors import VCenterError
from ..progress import NullReporter, Reporter
from .credentials import Secret, ssl_context
from .desired import lowest, parse_version
from .throttle import (
    DEFAULT_BACKOFF,
    Backoff,
    Throttled,
    next_wait,
    throttle_reason,
    throttled_message,
)

log = logging.getLogger(__name__)

TRANSIENT = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError,
             http.client.RemoteDisconnected, http.client.IncompleteRead)


def fault_text(exc: BaseException) -> str:
    """A one-line message for a pyVmomi fault or any exception."""
    if isinstance(exc, vmodl.MethodFault):
        msg = getattr(exc, "msg", None) or ""
        for fm in getattr(exc, "faultMessage", None) or []:
            msg = msg or getattr(fm, "message", "")
        return f"{type(exc).__name__.split('.')[-1]}: {msg}".rstrip(": ") if msg else \
            type(exc).__name__.split(".")[-1]
    return str(exc) or type(exc).__name__


def method_name(fn: Callable) -> str:
    """The API method a callable invokes ("CloneVM_Task"), for logs and errors.

    pyVmomi's bound methods are lambdas closing over a ManagedMethod whose info names it.
    """
    name = getattr(fn, "__name__", "")
    if name and name != "<lambda>":
        return name
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            wsdl = cell.cell_contents.info.wsdlName
        except (AttributeError, ValueError):
            continue
        if isinstance(wsdl, str):
            return wsdl
    return "a vCenter call"


def pyvmomi_version(api: str) -> str:
    """pyVmomi's name of an API release: "6.7" -> vim.version.version12, "8.0.3" -> ...v8_0_3_0."""
    want = parse_version(api)
    for name, version_id in VmomiSupport.versionIdMap.items():
        if name.startswith("vim.version.") and _trimmed(parse_version(version_id)) == _trimmed(want) \
                and want:
            return name
    raise VCenterError(f"pyVmomi does not know vSphere API {api}")


def _trimmed(version: tuple[int, ...]) -> tuple[int, ...]:
    while version and version[-1] == 0:
        version = version[:-1]
    return version


@dataclass(frozen=True)
class SessionOptions:
    """How a session talks to vCenter, the same for every call it makes.

    retries: extra attempts after a reset or an expiry; backoff: first wait (s) before
    retrying a reset; api_pin: the API release to speak ("6.7"); None = the newest both
    sides know; throttle: how long to keep asking a vCenter that refuses calls for load
    (None: the default).
    """

    retries: int = 4
    backoff: float = 0.5
    api_pin: str | None = None
    throttle: Backoff | None = None


class Session:
    """One logged-in pyVmomi session; `call` runs API calls with expiry healing and retries.

    vcenter: the inventory's vcenter section; password: a Secret; options: retries,
    backoff, API pin and throttling backoff (SessionOptions); pool_size: HTTPS connections
    kept open (one per thread calling at once); parallel: the workers of this run, named
    when throttling persists.
    """

    def __init__(self, vcenter, password: Secret, reporter: Reporter | None = None,
                 options: SessionOptions = SessionOptions(), pool_size: int = 1,
                 parallel: int | None = None):
        self.cfg = vcenter
        self.api_pin = options.api_pin
        self.password = password
        self.reporter = reporter or NullReporter()
        self.retries = options.retries
        self.backoff = options.backoff
        self.pool_size = pool_size
        self.throttle = options.throttle or DEFAULT_BACKOFF
        self.parallel = parallel
        self.si = None
        self._content = None
        self._login_lock = threading.Lock()

    def connect(self) -> None:
        cfg = self.cfg
        if cfg.insecure:
            self.reporter.log(f"warning: TLS certificate verification is OFF for {cfg.host} "
                              "(vcenter.insecure: true); anyone on the path can read the password")
        try:
            ctx = ssl_context(cfg.ca_bundle, cfg.insecure)
        except (OSError, ssl.SSLError) as exc:
            raise VCenterError(f"cannot read vcenter.ca_bundle {cfg.ca_bundle}: {exc}") from None
        log.debug("connecting to vCenter %s:%s as %s (TLS %s)", cfg.host, cfg.port, cfg.user,
                  "NOT verified" if cfg.insecure else f"verified, CA {cfg.ca_bundle or 'system store'}")
        pinned = [pyvmomi_version(self.api_pin)] if self.api_pin else None
        try:
            self.si = SmartConnect(host=cfg.host, port=cfg.port, user=cfg.user,
                                   pwd=self.password.reveal(), sslContext=ctx,
                                   preferredApiVersions=pinned)
        except vim.fault.InvalidLogin:
            raise VCenterError(f"vCenter {cfg.host} refused the login of {cfg.user}") from None
        except ssl.SSLCertVerificationError as exc:
            raise VCenterError(f"TLS verification of {cfg.host}:{cfg.port} failed ({exc.verify_message}); "
                               "set vcenter.ca_bundle to the CA that signed its certificate") from None
        except (OSError, ssl.SSLError, http.client.HTTPException) as exc:
            raise VCenterError(self.password.scrub(
                f"cannot reach vCenter {cfg.host}:{cfg.port}: {exc}")) from None
        except vmodl.MethodFault as exc:
            raise VCenterError(self.password.scrub(f"vCenter {cfg.host}: {fault_text(exc)}")) from None
        except Exception as exc:  # SmartConnect's plain Exception: no version both sides speak
            if not pinned or "not a VIM server" not in str(exc):
                raise
            raise VCenterError(f"vCenter {cfg.host} does not offer vSphere API {self.api_pin} "
                               "(not in its vimServiceVersions.xml)") from None
        self._size_pool()
        log.debug("logged in to vCenter %s: API %s, session API %s%s", cfg.host, self.api_version,
                  self.session_api_version, " (pinned)" if pinned else "")

    def _size_pool(self) -> None:
        # pyVmomi keeps at most poolSize (default 5) idle HTTPS connections and closes one
        # returned to a full pool, so with more worker threads than that the next call
        # opens a fresh one: TCP + TLS handshakes on the operator's CPU (provision_fanout's
        # 1-VM and 64-VM runs opened 115 connections with the default, 65 with one per worker).
        stub = getattr(self.si, "_stub", None)
        if stub is not None and isinstance(getattr(stub, "poolSize", None), int):
            stub.poolSize = max(stub.poolSize, self.pool_size)
            log.debug("HTTPS connection pool: up to %d connection(s) kept open", stub.poolSize)

    def close(self) -> None:
        if self.si is not None:
            try:
                Disconnect(self.si)
                log.debug("logged out of vCenter %s", self.cfg.host)
            except Exception as exc:  # the session may already be gone; closing is best effort
                log.debug("logout of vCenter %s failed: %s", self.cfg.host, self.text(exc))
            self.si = None
            self._content = None

    @property
    def content(self):
        """The service content, fetched once per session (each `si.content` is a round trip)."""
        if self.si is None:
            raise VCenterError("not connected to vCenter")
        if self._content is None:
            self._content = self.si.RetrieveContent()
        return self._content

    @property
    def api_version(self) -> str:
        """vCenter's API release (About.apiVersion)."""
        return self.content.about.apiVersion

    @property
    def session_api_version(self) -> str:
        """The release this session speaks (what SmartConnect negotiated, or the pin)."""
        stub = getattr(self.si, "_stub", None)
        return VmomiSupport.versionIdMap.get(getattr(stub, "version", None), "") or self.api_version

    @property
    def observed_api(self) -> str:
        """The release both vCenter and this session speak: what property paths may ask for."""
        return lowest(self.api_version, self.session_api_version)

    def text(self, exc: BaseException) -> str:
        """fault_text(exc) with the password masked."""
        return self.password.scrub(fault_text(exc))

    def _relogin(self) -> None:
        with self._login_lock:
            sm = self.content.sessionManager
            try:
                if sm.currentSession is not None:
                    log.debug("vCenter session already renewed by another worker")
                    return
            except vim.fault.NotAuthenticated:
                pass
            self.reporter.log("vCenter session expired: logging in again")
            log.debug("vCenter session expired: logging in again as %s", self.cfg.user)
            sm.Login(self.cfg.user, self.password.reveal())

    def call(self, fn: Callable, *args, idempotent: bool = True, **kwargs):
        """fn(*args) with session-expiry healing and throttling backoff (any call); connection
        resets retried when idempotent. Throttled when vCenter keeps refusing for load."""
        delay = self.backoff
        what = method_name(fn)
        attempt = 0
        refusals = 0
        waited = 0.0
        while True:
            try:
                return fn(*args, **kwargs)
            except vim.fault.NotAuthenticated:
                # Refused before anything happened: safe to repeat any call.
                if attempt == self.retries:
                    raise
                attempt += 1
                log.debug("%s: not authenticated (attempt %d of %d)", what, attempt, self.retries + 1)
                self._relogin()
            except TRANSIENT as exc:
                if not idempotent or attempt == self.retries:
                    raise
                attempt += 1
                log.debug("%s: %s (attempt %d of %d); retrying in %.1f s", what, type(exc).__name__,
                          attempt, self.retries + 1, delay)
                time.sleep(delay)
                delay *= 2
            except (http.client.HTTPException, vmodl.MethodFault) as exc:
                reason = throttle_reason(exc)
                if reason is None:
                    raise
                # Refused for load, not carried out: safe to repeat any call after a wait.
                refusals += 1
                waited += self.throttle_wait(what, reason, refusals, waited)

    def throttle_wait(self, what: str, reason: str, refusals: int, waited: float) -> float:
        """Sleep before asking again after refusal number `refusals` and return the wait (s);
        Throttled when the backoff is spent. waited: seconds already waited on this call."""
        wait = next_wait(self.throttle, refusals, waited)
        if wait is None:
            log.debug("%s: %s, refusal %d: giving up after %.1f s of backoff", what, reason,
                      refusals, waited)
            raise Throttled(throttled_message(what, reason, refusals, waited, self.parallel))
        log.debug("%s: vCenter throttling (%s), refusal %d; asking again in %.1f s", what, reason,
                  refusals, wait)
        time.sleep(wait)
        return wait
