"""A fake OpenAI-compatible streaming server with known token timings, for the HTTP client's
tests: it answers /health, /version, /v1/models, /metrics and streaming /v1/completions the
way vLLM does (one event per token with its token id, usage, then [DONE]).

Behaviour, from the constructor or, run as a script, from the environment:
  first_s     seconds before the first token (FAKE_FIRST_S)
  token_s     seconds between tokens (FAKE_TOKEN_S)
  mode        "ok" | "stall" (stops sending after `stall_after` tokens, keeps the
              connection open) | "drop" (closes the connection after `stall_after` tokens) |
              "5xx" (answers 503) | "open" (takes any key)  (FAKE_MODE)
  die_after   exit the whole process after this many completions (FAKE_DIE_AFTER; 0: never)

As a script it takes vLLM's `serve` arguments (`[entry.py] serve MODEL --port P ...`,
anything else ignored), so a bench run can start it from a launch script as if it were
vLLM: the rank's key arrives in VLLM_API_KEY.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeServer:
    def __init__(self, key: str = "k", *, first_s: float = 0.05, token_s: float = 0.02, mode: str = "ok",
                 stall_after: int = 2, die_after: int = 0, host: str = "127.0.0.1", port: int = 0,
                 uds: str | None = None):
        self.key, self.first_s, self.token_s, self.mode = key, first_s, token_s, mode
        self.stall_after, self.die_after = stall_after, die_after
        self.completions = 0
        self.running = 0                 # streams in progress (vllm:num_requests_running)
        # Keys taken beside `key` while a rotation rolls (VCFSLM_PREVIOUS_API_KEYS, as vLLM's entry takes them).
        self.previous_keys: list[str] = []
        self.bodies: list[dict] = []
        self.lock = threading.Lock()
        self.httpd = (_UnixHTTPServer(uds, self._handler()) if uds
                      else ThreadingHTTPServer((host, port), self._handler()))
        self.httpd.daemon_threads = True

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def start(self) -> FakeServer:
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def metrics_text(self) -> str:
        return ("# HELP vllm:num_preemptions_total preemptions\n"
                f'vllm:num_preemptions_total{{engine="0"}} {self.completions // 4}.0\n'
                f'vllm:request_queue_time_seconds_sum{{engine="0"}} {0.01 * self.completions}\n'
                f'vllm:request_queue_time_seconds_count{{engine="0"}} {self.completions}.0\n'
                'vllm:request_queue_time_seconds_bucket{engine="0",le="0.1"} 3.0\n'
                'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
                'vllm:num_requests_waiting{engine="0"} 0.0\n'
                f'vllm:num_requests_running{{engine="0"}} {self.running}.0\n'
                f'vllm:request_success_total{{engine="0",finished_reason="length"}} {self.completions}.0\n')

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _authorized(self) -> bool:
                keys = [fake.key, *fake.previous_keys]
                return fake.mode == "open" or self.headers.get("Authorization") in [f"Bearer {k}" for k in keys]

            def _send(self, status: int, body: str, kind: str = "application/json") -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, "")
                elif self.path == "/version":
                    self._send(200, json.dumps({"version": "fake-1.0"}))
                elif self.path == "/metrics":
                    self._send(200, fake.metrics_text(), "text/plain")
                elif self.path == "/v1/models":
                    if self._authorized():
                        self._send(200, json.dumps({"data": [{"id": "m"}]}))
                    else:
                        self._send(401, json.dumps({"error": "Unauthorized"}))
                else:
                    self._send(404, "{}")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                with fake.lock:
                    fake.bodies.append(body)
                if not self._authorized():
                    self._send(401, json.dumps({"error": "Unauthorized"}))
                    return
                if fake.mode == "5xx":
                    self._send(503, json.dumps({"error": "overloaded"}))
                    return
                with fake.lock:
                    fake.running += 1
                try:
                    self._stream(body)
                finally:
                    with fake.lock:
                        fake.running -= 1

            def _stream(self, body: dict) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                n = int(body.get("max_tokens", 4))
                time.sleep(fake.first_s)
                for i in range(n):
                    if i and fake.mode in ("stall", "drop") and i >= fake.stall_after:
                        if fake.mode == "drop":
                            self.wfile.flush()
                            self.connection.shutdown(2)
                            return
                        time.sleep(3600)
                    if i:
                        time.sleep(fake.token_s)
                    event = {"choices": [{"index": 0, "text": f" t{i}", "token_ids": [100 + i],
                                          "finish_reason": "length" if i == n - 1 else None}]}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                usage = {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
                self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
                self.wfile.flush()
                with fake.lock:
                    fake.completions += 1
                    if fake.die_after and fake.completions >= fake.die_after:
                        os._exit(3)

        return Handler


class _UnixHTTPServer(ThreadingHTTPServer):
    """The same server on a Unix socket (vLLM's --uds)."""

    address_family = socket.AF_UNIX

    def server_bind(self) -> None:
        self.socket.bind(self.server_address)
        self.server_name, self.server_port = "localhost", 0

    def get_request(self):
        conn, _ = self.socket.accept()
        return conn, ("127.0.0.1", 0)


def main(argv: list[str]) -> int:
    args = [a for a in argv if not a.endswith(".py")]
    if args[:1] == ["serve"]:
        args = args[2:]
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--uds", default=None)
    known, _ = p.parse_known_args(args)
    server = FakeServer(os.environ["VLLM_API_KEY"], first_s=float(os.environ.get("FAKE_FIRST_S", "0.05")),
                        token_s=float(os.environ.get("FAKE_TOKEN_S", "0.02")),
                        mode=os.environ.get("FAKE_MODE", "ok"), die_after=int(os.environ.get("FAKE_DIE_AFTER", "0")),
                        host=known.host, port=known.port, uds=known.uds)
    server.previous_keys = os.environ.get("VCFSLM_PREVIOUS_API_KEYS", "").split()
    where = known.uds or f"{known.host}:{known.port}"
    print(f"fake server on {where}; Chunked prefill is enabled (fake)", flush=True)
    server.httpd.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
