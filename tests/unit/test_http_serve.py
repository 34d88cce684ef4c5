"""One HTTP serving window: vcfslm's arrivals against a fake streaming server."""

from __future__ import annotations

import random
import time

import pytest

from tests.fake_openai import FakeServer
from vcfslm.serve.http_serve import http_record_fields, invalid_reasons, run_http_window
from vcfslm.serve.openai_client import Endpoint, Stream, stream_completion
from vcfslm.serving import decisions as serving
from vcfslm.serving import servers
from vcfslm.serving.decisions import ServeSpec

SPEC = ServeSpec(loads=(8.0,), input_tokens=(16,), output_tokens=5, duration_s=3.0, warmup_s=0.5,
                 cooldown_s=0.5, drain_s=3.0)


@pytest.fixture
def server():
    s = FakeServer("key", first_s=0.1, token_s=0.03).start()
    yield s
    s.close()


def sender(server, key="key"):
    ep = Endpoint("127.0.0.1", server.port, key, "m")

    def send(r, deadline):
        return stream_completion(ep, "/v1/completions",
                                 servers.completion_body("m", [3] * r.input_tokens, r.output_tokens),
                                 deadline_s=deadline)
    return send


def test_open_loop_window_counts_the_planned_requests_and_times_them(server):
    rng_seed = 7
    planned = serving.open_loop_plan(SPEC, 8.0, 16, random.Random(rng_seed))
    counted = [p for p in planned if serving.in_span(p.arrival_s, SPEC)]
    out = run_http_window(sender(server), SPEC, 8.0, 16, random.Random(rng_seed))
    fields = http_record_fields(out, SPEC, {"B": {"tpot_ms": 200, "ttft_s": 1}}, "vllm", {"waiting_max": 2.0})
    assert fields["offered"] == len(counted) and fields["completed"] == len(counted) and fields["unfinished"] == 0
    assert fields["failed"] == 0 and fields["errors"] == []
    # The server's timing comes back through the client: 0.1 s to the first token, 30 ms per token.
    ttft = sorted(fields["ttft_s"])
    assert 0.09 <= ttft[len(ttft) // 2] < 0.5
    tpot = sorted(fields["tpot_ms"])
    assert 25 <= tpot[len(tpot) // 2] < 150
    assert all(len(t) == 5 for t in fields["token_s"]) and fields["request_output_tokens"] == [5] * len(counted)
    assert all(s >= a for s, a in zip(fields["sent_s"], fields["arrival_s"], strict=True))
    assert fields["max_queue"] == 2 and fields["server"] == "vllm"
    assert invalid_reasons(out, 0.5) == []
    assert fields["mean_active"] > 0 and fields["rank_tps"] > 0


def test_failed_requests_count_as_unfinished(server):
    server.mode = "5xx"
    out = run_http_window(sender(server), SPEC, 8.0, 16, random.Random(1))
    fields = http_record_fields(out, SPEC, {}, "vllm")
    assert fields["completed"] == 0 and fields["unfinished"] == fields["offered"] > 0
    assert fields["failed"] == fields["offered"] and "HTTP 503" in fields["errors"][0]
    assert len(fields["errors"]) == 1            # the distinct failures, not one per request


def test_a_stalling_server_leaves_requests_unfinished_at_the_cutoff(server):
    server.mode, server.stall_after = "stall", 1
    spec = ServeSpec(loads=(4.0,), input_tokens=(8,), output_tokens=4, duration_s=1.5, warmup_s=0.2,
                     cooldown_s=0.2, drain_s=0.5)
    started = time.perf_counter()
    out = run_http_window(sender(server), spec, 4.0, 8, random.Random(2))
    assert time.perf_counter() - started < spec.cutoff_s + 3
    fields = http_record_fields(out, spec, {}, "vllm")
    assert fields["completed"] == 0 and fields["unfinished"] == fields["offered"]
    assert "stalled" in fields["errors"][0]


def test_a_client_that_sends_late_marks_the_window_invalid():
    def slow_send(r, deadline):
        time.sleep(0.3)                       # every send blocks its thread before it goes out
        now = time.perf_counter()
        return Stream(sent_s=now + 0.7, token_s=[now + 0.8, now + 0.85], tokens=2, status=200)

    spec = ServeSpec(loads=(4.0,), input_tokens=(8,), output_tokens=2, duration_s=1.0, warmup_s=0.1,
                     cooldown_s=0.1)
    out = run_http_window(slow_send, spec, 4.0, 8, random.Random(3))
    reasons = invalid_reasons(out, 0.5)
    assert reasons and "late" in reasons[0] and "lower than planned" in reasons[0]


def test_closed_loop_users_send_again_after_each_reply(server):
    spec = ServeSpec(load_kind="users", loads=(2.0,), input_tokens=(8,), output_tokens=3, duration_s=2.0,
                     warmup_s=0.2, cooldown_s=0.2, think_s=0.0)
    out = run_http_window(sender(server), spec, 2, 8, random.Random(4))
    per_user: dict[int, int] = {}
    for r in out.requests:
        per_user[r.user] = per_user.get(r.user, 0) + 1
    # One request takes ~0.16 s: each user sends several in 2 s, one at a time.
    assert set(per_user) == {0, 1} and min(per_user.values()) >= 4
    for user in (0, 1):
        mine = sorted((r for r in out.requests if r.user == user and r.done), key=lambda r: r.arrival_s)
        assert all(b.arrival_s >= a.last_s - 1e-6 for a, b in zip(mine, mine[1:], strict=False))
