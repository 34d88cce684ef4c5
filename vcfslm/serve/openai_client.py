"""A streaming client of the OpenAI completions API, standard library only: one request's
life as its user sees it (when it went out, when each token arrived, how it failed).

http.client on a connection of its own per request: no pooling that would let one slow
stream hold up another, no third-party HTTP stack between the clock and the socket.
Server-sent events are read line by line; a token is timed when its chunk is parsed.

The clocks, beside vLLM's own client (`vllm bench serve`, vllm/benchmarks/lib/
endpoint_request_func.py, which the cross-check benchmarks/vllm_crosscheck.py runs
against this one):
- The send time is taken just before the connection is opened and the request written,
  where vLLM's is taken just before its session's post. The window (serve/http_serve.py)
  times TTFT from the planned arrival, so a late send counts against the server there;
  vLLM's starts at its own send.
- The first token is the first event whose choice carries a token (its token ids, or
  text when the server sends no ids); vLLM's is the first event with any choice, even
  one with empty text. A vLLM server sends no choice before the first token, so the
  two are the same event there.
- The last token is the last event that carried one (not the usage event, not [DONE]),
  as vLLM's latency ends at its last event with a choice.
- Output tokens are the server's usage count when it sends one, as vLLM's are; without
  usage this client counts the ids it saw, where vLLM re-tokenizes the text.
- One connection per request: its connect (a loopback handshake, or a round trip to a
  remote front door) is inside the TTFT, where vLLM's pooled keep-alive connections pay
  it only for their first request.
"""

from __future__ import annotations

import functools
import http.client
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Endpoint:
    """One server: where it listens, its key, the model name it serves; over TLS, verified
    against `ca_file` (None: the system's trust store), when `tls`."""

    host: str
    port: int
    key: str = field(repr=False)
    model: str
    tls: bool = False
    ca_file: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}


@dataclass
class Stream:
    """What one streamed completion did (times on the caller's clock)."""

    sent_s: float | None = None
    token_s: list[float] = field(default_factory=list)
    tokens: int = 0                    # the server's own count at the end, else the tokens seen
    prompt_tokens: int | None = None   # the server's count of the prompt (usage), if it sent one
    # Of the prompt, the tokens the server's prefix cache held (usage.prompt_tokens_details:
    # vLLM sends it when started with --enable-prompt-tokens-details); None: not said.
    cached_tokens: int | None = None
    status: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@functools.lru_cache(maxsize=8)
def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """A client's TLS context: the certificate and its name checked, against `ca_file` or the
    system's store (made once per CA: loading it is not free, and a run opens a connection
    per request)."""
    return ssl.create_default_context(cafile=ca_file)


def connection(endpoint: Endpoint, timeout_s: float) -> http.client.HTTPConnection:
    if endpoint.tls:
        return http.client.HTTPSConnection(endpoint.host, endpoint.port, timeout=timeout_s,
                                           context=tls_context(endpoint.ca_file))
    return http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout_s)


def get(endpoint: Endpoint, path: str, timeout_s: float = 5.0) -> tuple[int, str]:
    """(status, body) of a GET; OSError when nothing answers (ssl.SSLError, one of them, when
    the endpoint's certificate is not trusted)."""
    conn = connection(endpoint, timeout_s)
    try:
        conn.request("GET", path, headers=endpoint.headers())
        resp = conn.getresponse()
        return resp.status, resp.read().decode("utf-8", "replace")
    finally:
        conn.close()


def stream_completion(endpoint: Endpoint, path: str, body: dict[str, Any], *, deadline_s: float,
                      clock: Callable[[], float] = time.perf_counter) -> Stream:
    """POST `body` (stream=True) and read its events until [DONE], an error, or `deadline_s`
    on `clock` (a server that stalls past it leaves the request unfinished)."""
    out = Stream()
    remaining = deadline_s - clock()
    if remaining <= 0:
        out.error = "not sent: the window's cutoff had passed"
        return out
    conn = connection(endpoint, remaining)
    try:
        payload = json.dumps(body).encode()
        out.sent_s = clock()
        conn.request("POST", path, body=payload, headers=endpoint.headers())
        resp = conn.getresponse()
        out.status = resp.status
        if resp.status != 200:
            text = resp.read(2000).decode("utf-8", "replace").strip()
            out.error = f"HTTP {resp.status}: {text[:300]}"
            return out
        usage_tokens = None
        done = False
        while not done:
            _set_timeout(conn, deadline_s - clock())
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                done = True
                break
            at = clock()
            try:
                event = json.loads(data)
            except ValueError:
                out.error = f"a malformed event: {data[:120]!r}"
                return out
            if "error" in event:
                out.error = f"the server reported: {json.dumps(event['error'])[:300]}"
                return out
            if event.get("usage"):
                usage_tokens = event["usage"].get("completion_tokens")
                out.prompt_tokens = event["usage"].get("prompt_tokens", out.prompt_tokens)
                details = event["usage"].get("prompt_tokens_details") or {}
                if isinstance(details, dict) and details.get("cached_tokens") is not None:
                    out.cached_tokens = int(details["cached_tokens"])
            for choice in event.get("choices") or []:
                n = _tokens_in(choice)
                out.token_s.extend([at] * n)
        out.tokens = int(usage_tokens) if usage_tokens is not None else len(out.token_s)
        if not done:
            out.error = "the stream ended before [DONE] (the connection was dropped)"
    except TimeoutError:
        out.error = "stalled: no event before the window's cutoff"
    except (OSError, http.client.HTTPException) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return out


def _tokens_in(choice: dict[str, Any]) -> int:
    """Tokens one streamed choice delta carries (its token ids when the server sends them)."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        return len(ids)
    return 1 if choice.get("text") else 0


def _set_timeout(conn: http.client.HTTPConnection, seconds: float) -> None:
    if conn.sock is not None:
        conn.sock.settimeout(max(seconds, 0.001))
