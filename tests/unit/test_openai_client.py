"""The streaming client against a fake OpenAI server with known token timings and faults."""

from __future__ import annotations

import time

import pytest

from tests.fake_openai import FakeServer
from vcfslm import servers
from vcfslm.serve.openai_client import Endpoint, get, stream_completion


@pytest.fixture
def fake():
    started = []

    def make(**kw):
        server = FakeServer("right-key", **kw).start()
        started.append(server)
        return server

    yield make
    for s in started:
        s.close()


def body(n: int = 5) -> dict:
    return servers.completion_body("m", [5, 6, 7, 8], n)


def stream(server, key="right-key", n=5, within=10.0):
    ep = Endpoint("127.0.0.1", server.port, key, "m")
    return stream_completion(ep, "/v1/completions", body(n), deadline_s=time.perf_counter() + within)


def test_token_times_follow_the_servers_timing(fake):
    server = fake(first_s=0.2, token_s=0.05)
    s = stream(server, n=6)
    assert s.ok and s.status == 200
    assert s.tokens == 6 and len(s.token_s) == 6
    assert s.prompt_tokens == 4                     # the server's usage: what the server counted
    first = s.token_s[0] - s.sent_s
    gaps = [b - a for a, b in zip(s.token_s, s.token_s[1:], strict=False)]
    assert 0.18 <= first < 0.6
    assert all(0.035 <= g < 0.3 for g in gaps)
    # The body asks for exactly the output tokens, from token ids, ignoring EOS, streamed.
    sent = server.bodies[-1]
    assert sent["prompt"] == [5, 6, 7, 8] and sent["max_tokens"] == sent["min_tokens"] == 6
    assert sent["ignore_eos"] is True and sent["stream"] is True and sent["return_token_ids"] is True


def test_a_wrong_key_is_refused_and_said_so(fake):
    s = stream(fake(), key="wrong")
    assert not s.ok and s.status == 401 and "HTTP 401" in s.error and s.token_s == []


def test_a_5xx_answer_is_a_failed_request(fake):
    s = stream(fake(mode="5xx"))
    assert not s.ok and s.status == 503 and "overloaded" in s.error


def test_a_connection_dropped_mid_stream_keeps_the_tokens_seen(fake):
    s = stream(fake(mode="drop", stall_after=2))
    assert not s.ok and "dropped" in s.error
    assert len(s.token_s) == 2 and s.prompt_tokens is None      # no usage event came


def test_a_stalled_stream_gives_up_at_the_deadline(fake):
    started = time.perf_counter()
    s = stream(fake(mode="stall", stall_after=2, token_s=0.01), within=1.0)
    assert not s.ok and "stalled" in s.error
    assert len(s.token_s) == 2
    assert time.perf_counter() - started < 3.0


def test_nothing_listening_is_an_error_not_a_hang(fake):
    server = fake()
    port = server.port
    server.close()
    s = stream_completion(Endpoint("127.0.0.1", port, "k", "m"), "/v1/completions", body(),
                          deadline_s=time.perf_counter() + 5)
    assert not s.ok and ("Refused" in s.error or "Connection" in s.error)


def test_get_health_and_metrics(fake):
    server = fake()
    ep = Endpoint("127.0.0.1", server.port, "right-key", "m")
    assert get(ep, "/health")[0] == 200
    metrics = servers.parse_metrics(get(ep, "/metrics")[1])
    assert metrics["vllm:kv_cache_usage_perc"] == 0.25
    assert "vllm:request_queue_time_seconds_bucket" not in metrics


def test_over_tls_the_client_verifies_the_server_against_its_ca(fake, tmp_path):
    """A deployment's door: streamed with the CA trusted; refused before any request without it."""
    import ssl

    from vcfslm.deploy import tls

    ca, other = tls.make_ca("slm"), tls.make_ca("someone-else")
    pair = tls.issue(ca, ["127.0.0.1"])
    for name, text in (("ca.pem", ca.cert), ("other.pem", other.cert), ("s.pem", pair.cert), ("s.key", pair.key)):
        (tmp_path / name).write_text(text)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "s.pem", tmp_path / "s.key")
    server = FakeServer("right-key", first_s=0.01, token_s=0.01)
    server.httpd.socket = context.wrap_socket(server.httpd.socket, server_side=True)
    server.start()
    try:
        trusted = Endpoint("127.0.0.1", server.port, "right-key", "m", True, str(tmp_path / "ca.pem"))
        s = stream_completion(trusted, "/v1/completions", body(3), deadline_s=time.perf_counter() + 10)
        assert s.ok and s.tokens == 3
        assert get(trusted, "/v1/models")[0] == 200
        for ca_file in (str(tmp_path / "other.pem"), None):       # another CA; the system's store
            untrusting = Endpoint("127.0.0.1", server.port, "right-key", "m", True, ca_file)
            s = stream_completion(untrusting, "/v1/completions", body(3), deadline_s=time.perf_counter() + 10)
            assert not s.ok and "CERTIFICATE_VERIFY_FAILED" in s.error and s.status is None
            with pytest.raises(ssl.SSLCertVerificationError):
                get(untrusting, "/v1/models")
        assert server.completions == 1                             # the refused clients sent nothing
    finally:
        server.close()
