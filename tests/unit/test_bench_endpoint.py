"""Load through one endpoint (vcfslm/endpoint/): the per-server split, the fault's
account, the front door's outage, the flags that become the spec, and the driver itself
against a fake server standing in for an endpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.fake_openai import FakeServer
from vcfslm.cli import main
from vcfslm.endpoint.client import EndpointLaunch, Target, requests_split, run_endpoint, text_prompt
from vcfslm.endpoint.faults import endpoint_outage, fault_accounting
from vcfslm.errors import BenchError, UsageError
from vcfslm.matrix import serve_matrix
from vcfslm.results import read_meta, read_serve_records
from vcfslm.runspec import EndpointSpec, Fault, RunSpec, parse_fault
from vcfslm.serve.http_backend import request_prompt_ids
from vcfslm.serve.scheduler import Request
from vcfslm.serving.decisions import ServeSpec
from vcfslm.serving.servers import ServerSpec
from vcfslm.serving.window_plan import Ask

LIMITS = {"B": {"tpot_ms": 100.0, "ttft_s": 1.0}}


def request(index, arrival, *, ttft=0.2, tpot_ms=20.0, tokens=5, error=None, counted=True, started=None):
    """A request as the HTTP window leaves it: done (times set) or failed (error set)."""
    r = Request(index, None, arrival, 16, tokens, counted, started_s=arrival if started is None else started)
    if error is None:
        r.first_s = arrival + ttft
        r.last_s = r.first_s + tpot_ms / 1000.0 * (tokens - 1)
        r.produced = tokens
    else:
        r.error = error
    return r


class CountingFake(FakeServer):
    """The fake vLLM server; in mode "502" it answers completions as nginx does when the router
    behind it is gone."""

    def _handler(self):
        base, fake = super()._handler(), self

        class Door(base):
            def do_POST(self):
                if fake.mode != "502":
                    return base.do_POST(self)
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._send(502, "<html>502 Bad Gateway</html>", "text/html")

        return Door


# ------------------------------------------------------------------ the per-server split


def test_the_split_is_each_servers_counter_increase():
    split, resets = requests_split([{"http://a:1": 10.0, "http://b:1": 4.0}, {"http://a:1": 17.0, "http://b:1": 9.0}])
    assert split == {"http://a:1": 7, "http://b:1": 5} and resets == []


def test_a_counter_that_went_down_restarted_and_counts_what_it_finished_before_and_since():
    reads = [{"http://a:1": 10.0, "http://b:1": 4.0},
             {"http://a:1": 14.0, "http://b:1": 6.0},          # a sample during the window
             {"http://a:1": None, "http://b:1": 8.0},          # a is down: its read fails
             {"http://a:1": 3.0, "http://b:1": 9.0}]           # back, counting from 0
    split, resets = requests_split(reads)
    assert split == {"http://a:1": 4 + 3, "http://b:1": 5} and resets == ["http://a:1"]


def test_an_unread_server_is_none_not_zero():
    split, _ = requests_split([{"http://a:1": 10.0, "http://b:1": None}, {"http://a:1": 12.0, "http://b:1": 3.0}])
    assert split == {"http://a:1": 2, "http://b:1": None}


# ------------------------------------------------------------------ the front door


def test_requests_refused_in_a_row_say_the_endpoint_stopped_answering():
    reqs = [request(i, i * 0.1) for i in range(5)]
    reqs += [request(5 + i, 0.5 + i * 0.1, error="ConnectionRefusedError: [Errno 111] Connection refused")
             for i in range(6)]
    why = endpoint_outage(reqs)
    assert why is not None and "5 requests in a row from 0.5 s" in why and "Connection refused" in why


def test_gateway_errors_count_and_a_success_between_breaks_the_run():
    bad = "HTTP 502: Bad Gateway"
    reqs = [request(i, i * 0.1, error=bad) for i in range(4)] + [request(4, 0.4)]
    reqs += [request(5 + i, 0.5 + i * 0.1, error=bad) for i in range(4)]
    assert endpoint_outage(reqs) is None
    reqs.append(request(9, 0.9, error="HTTP 504: Gateway Time-out"))
    assert "HTTP 502" in endpoint_outage(reqs)


def test_a_router_without_a_healthy_server_is_answering_not_gone():
    # vllm-router's 503 while every server is out of rotation: failed requests, not an outage.
    reqs = [request(i, i * 0.1, error="HTTP 503: No available workers (all circuits open or unhealthy)")
            for i in range(8)]
    assert endpoint_outage(reqs) is None


def test_failures_inside_an_injected_fault_are_the_faults_not_the_door():
    reqs = [request(i, 1.0 + i * 0.1, error="HTTP 502: Bad Gateway") for i in range(8)]
    assert endpoint_outage(reqs, [(0.9, 2.0)]) is None
    assert endpoint_outage(reqs, [(0.9, None)]) is None          # not back yet: the fault lasts
    assert endpoint_outage(reqs, [(0.9, 1.2)]) is not None       # after it ended, the door


def test_dropped_streams_are_not_an_outage():
    reqs = [request(i, i * 0.1, error="the stream ended before [DONE] (the connection was dropped)")
            for i in range(8)]
    assert endpoint_outage(reqs) is None


# ------------------------------------------------------------------ the fault's account


def test_the_fault_counts_failures_after_the_kill_and_judges_during_and_after():
    reqs = [request(0, 1.0), request(1, 2.0),                                       # before: met
            request(10, 3.0, error="HTTP 500: before the kill"),                    # not the fault's
            request(2, 4.5, error="the stream ended before [DONE] (the connection was dropped)"),
            request(3, 4.8, error="HTTP 502: Bad Gateway"),
            request(4, 5.0, ttft=3.0),                                              # during: too slow
            request(5, 5.5),                                                        # during: met
            request(6, 9.0), request(7, 9.5),                                       # after: met
            request(9, 8.5, error="HTTP 503: No available workers"),                # after: the router's lag
            request(8, 4.9, error="HTTP 502: Bad Gateway", counted=False)]          # warm-up: counted apart
    never_sent = Request(11, None, 19.0, 16, 5, False)                          # due in the cool-down
    reqs.append(never_sent)
    failed_at = {10: 3.1, 2: 5.0, 3: 5.2, 8: 5.1, 9: 8.5}
    out = fault_accounting(reqs, failed_at, start_s=5.0, end_s=8.0, limits=LIMITS, cutoff_s=20.0)
    assert out["start_s"] == 5.0 and out["end_s"] == 8.0 and out["restart_s"] == 3.0
    assert out["failed"] == 3 and out["failed_all"] == 4            # every failure from the kill on
    assert out["detect_s"] == pytest.approx(3.5)                     # the kill to the last failed request sent
    assert out["requests_during"] == 2 and out["attainment_during"] == {"B": 0.5}
    assert out["requests_after"] == 3 and out["attainment_after"] == {"B": pytest.approx(2 / 3, abs=1e-4)}
    assert "HTTP 502: Bad Gateway" in out["errors"]


def test_a_server_not_back_leaves_the_end_open_and_nothing_after():
    reqs = [request(0, 5.5, error="stalled: no event before the window's cutoff")]
    out = fault_accounting(reqs, {}, start_s=5.0, end_s=None, limits=LIMITS, cutoff_s=20.0)
    assert out["end_s"] is None and out["restart_s"] is None
    assert out["failed"] == 1 and out["detect_s"] == 0.5             # sent after the kill, failed at the cutoff
    assert out["requests_after"] == 0 and out["attainment_after"] == {"B": None}


def test_streams_cut_by_the_kill_alone_mean_the_router_sent_nothing_more_to_it():
    reqs = [request(0, 4.0, error="the stream ended before [DONE] (the connection was dropped)"), request(1, 6.0)]
    out = fault_accounting(reqs, {0: 5.1, 1: 6.4}, start_s=5.0, end_s=9.0, limits=LIMITS, cutoff_s=20.0)
    assert out["failed"] == 1 and out["detect_s"] == 0.0


def test_no_failure_means_no_detection_time():
    out = fault_accounting([request(0, 6.0)], {0: 6.3}, start_s=5.0, end_s=7.0, limits=LIMITS, cutoff_s=20.0)
    assert out["failed"] == 0 and out["detect_s"] is None and out["attainment_during"] == {"B": 1.0}


# ------------------------------------------------------------------ the spec


def test_a_fault_parses_and_reads_back_the_same():
    assert parse_fault("kill:slm-01/vllm-node0@20") == Fault("slm-01", "vllm-node0", 20.0)
    assert parse_fault("kill:a/b@.5").text == "kill:a/b@0.5"
    for bad in ("kill:slm-01@20", "stop:a/b@1", "kill:a/b@x", "kill:a/b@-1"):
        with pytest.raises(ValueError, match="kill:NODE/PROGRAM@SECONDS"):
            parse_fault(bad)


def test_the_endpoint_spec_checks_its_url_node_counts_and_faults():
    spec = EndpointSpec(url="http://127.0.0.1:8000/", key_file="k", nodes=(1, 2), faults=("kill:a/b@3",))
    assert spec.url == "http://127.0.0.1:8000" and spec.fault_list == [Fault("a", "b", 3.0)]
    assert EndpointSpec(url="http://10.0.0.11:8000/v1", key_file="k").url == "http://10.0.0.11:8000"   # as serve up prints it
    assert EndpointSpec(url="https://10.0.0.11:8000/v1", key_file="k").url == "https://10.0.0.11:8000"   # TLS at the door
    for bad in ({"url": "127.0.0.1:8000"}, {"url": "ftp://h:443"}, {"url": "http://h:1/api"}, {"nodes": (1, 1)}, {"nodes": (0,)}, {"faults": ("kill:a@3",)},
                {"faults": ("kill:a/b@3", "kill:a/c@4")}):
        with pytest.raises(ValueError):
            EndpointSpec(key_file="k", **bad)


def test_prompts_are_the_same_for_the_same_seed_or_the_same_segments():
    def req(index: int, ask: Ask | None = None) -> Request:
        return Request(index, None, 0.0, 16, 4, True, ask=ask)

    assert request_prompt_ids(3, req(7), 1000) == request_prompt_ids(3, req(7), 1000) != request_prompt_ids(3, req(8), 1000)
    assert all(3 <= t < 1000 for t in request_prompt_ids(3, req(7), 1000))
    text = text_prompt(3, req(7))
    assert text == text_prompt(3, req(7)) and len(text.split()) == 16
    # A workload's segments decide the prompt whatever the seed and index: a conversation's
    # history is the same tokens in every turn that carries it.
    shared = Ask(0.0, 16, 4, ((11, 10), (12, 6)))
    assert request_prompt_ids(3, req(7, shared), 1000) == request_prompt_ids(9, req(8, shared), 1000)
    longer = Ask(0.0, 20, 4, ((11, 10), (13, 10)))
    assert request_prompt_ids(0, req(1, longer), 1000)[:10] == request_prompt_ids(0, req(2, shared), 1000)[:10]
    assert text_prompt(3, req(7, shared)) == text_prompt(5, req(1, shared))


# ------------------------------------------------------------------ the driver


@pytest.fixture
def fake():
    server = CountingFake("secret", first_s=0.02, token_s=0.005).start()
    yield server
    server.close()


def endpoint_spec(url: str, key_file: Path, run_id: str = "ep", **serve) -> RunSpec:
    settings = {"loads": (4.0,), "input_tokens": (8,), "output_tokens": 4, "duration_s": 1.5, "warmup_s": 0.0,
                "cooldown_s": 0.0, "drain_s": 2.0, "warmup_windows": 0, "repeats": 1, **serve}
    spec = ServeSpec(**settings)
    return RunSpec(run_id=run_id, mode="endpoint", model="m", matrix=serve_matrix(spec), threads=1, serve=spec,
                   server=ServerSpec(name="vllm"),
                   endpoint=EndpointSpec(url=url, key_file=str(key_file), servers=(url,), vocab=1000))


def test_the_driver_writes_a_run_whose_split_sums_to_what_finished(fake, tmp_path):
    url = f"http://127.0.0.1:{fake.port}"
    spec = endpoint_spec(url, tmp_path / "key", loads=(4.0, 6.0))
    run = run_endpoint(spec, EndpointLaunch(key="secret", runs_dir=tmp_path))
    records = read_serve_records(tmp_path / "ep" / "serving.jsonl")
    assert [r.load for r in records] == [4.0, 6.0] and run.meta.complete
    for r in records:
        assert r.valid and r.endpoint == url and r.endpoint_nodes == 1 and r.nodes == 1 and r.failed == 0
        assert r.server_requests == {url: r.window_finished} and r.window_finished == r.completed > 0
    assert all(isinstance(b["prompt"], list) for b in fake.bodies)        # token ids: the vocab is known
    meta = read_meta(tmp_path / "ep")
    assert meta.mode == "endpoint" and RunSpec.of_meta(meta).endpoint.url == url
    assert meta.guests["endpoint"]["stages"]["1"]["model"] == "m"


def test_resume_keeps_the_windows_it_has(fake, tmp_path):
    url = f"http://127.0.0.1:{fake.port}"
    run_endpoint(endpoint_spec(url, tmp_path / "key"), EndpointLaunch(key="secret", runs_dir=tmp_path))
    done = fake.completions
    spec = endpoint_spec(url, tmp_path / "key", loads=(4.0, 6.0))
    run_endpoint(spec, EndpointLaunch(key="secret", runs_dir=tmp_path, resume=True))
    records = read_serve_records(tmp_path / "ep" / "serving.jsonl")
    assert [r.load for r in records] == [4.0, 6.0]
    assert fake.completions - done == records[1].window_finished       # only the new load was measured


def test_a_router_without_servers_fails_requests_but_the_run_goes_on(fake, tmp_path):
    fake.mode = "5xx"                                     # 503: the router answers, no server behind it
    run_endpoint(endpoint_spec(f"http://127.0.0.1:{fake.port}", tmp_path / "key"),
                 EndpointLaunch(key="secret", runs_dir=tmp_path))
    (r,) = read_serve_records(tmp_path / "ep" / "serving.jsonl")
    assert r.completed == 0 and r.failed == r.unfinished == r.offered > 0 and "HTTP 503" in r.errors[0]


def test_an_endpoint_that_takes_any_key_is_refused(fake, tmp_path):
    fake.mode = "open"
    with pytest.raises(BenchError, match="does not check the key"):
        run_endpoint(endpoint_spec(f"http://127.0.0.1:{fake.port}", tmp_path / "key"),
                     EndpointLaunch(key="secret", runs_dir=tmp_path))


def test_a_door_that_refuses_everything_stops_the_run_and_keeps_nothing_of_that_window(fake, tmp_path):
    url = f"http://127.0.0.1:{fake.port}"
    fake.mode = "502"                                     # the router behind the door is gone
    with pytest.raises(BenchError, match="stopped answering"):
        run_endpoint(endpoint_spec(url, tmp_path / "key"), EndpointLaunch(key="secret", runs_dir=tmp_path))
    meta = read_meta(tmp_path / "ep")
    assert "stopped answering" in meta.failure and not meta.complete
    assert not (tmp_path / "ep" / "serving.jsonl").exists()


def test_several_node_counts_need_a_deployment_to_change(tmp_path):
    spec = endpoint_spec("http://127.0.0.1:1", tmp_path / "key")
    spec = spec.replaced(endpoint=spec.endpoint.model_copy(update={"nodes": (1, 2)}))
    with pytest.raises(UsageError, match="--deployment"):
        run_endpoint(spec, EndpointLaunch(key="k", runs_dir=tmp_path))


def test_a_stage_asks_its_scale_for_the_node_count(fake, tmp_path):
    url = f"http://127.0.0.1:{fake.port}"
    spec = endpoint_spec(url, tmp_path / "key")
    spec = spec.replaced(endpoint=spec.endpoint.model_copy(update={"nodes": (1, 2)}))
    asked = []

    def scale(n):
        asked.append(n)
        return Target(url, n, (url,))

    run_endpoint(spec, EndpointLaunch(key="secret", runs_dir=tmp_path, scale=scale))
    assert asked == [1, 2]
    assert [r.endpoint_nodes for r in read_serve_records(tmp_path / "ep" / "serving.jsonl")] == [1, 2]


# ------------------------------------------------------------------ the flags


def _bench(*args):
    return CliRunner().invoke(main, ["bench", *args])


@pytest.mark.parametrize(("args", "message"), [
    (["--serve", "--rates", "1", "--endpoint", "http://h:1"], "--key-file FILE"),
    (["--serve", "--rates", "1", "--endpoint", "http://h:1", "--key-file", "k", "--scale-out", "1,2"],
     "--scale-out change or break the deployment: use --deployment"),
    (["--serve", "--rates", "1", "--endpoint", "http://h:1", "--key-file", "k", "--fault", "kill:a/b@1"],
     "--fault change or break"),
    (["--serve", "--rates", "1", "--endpoint", "http://h:1", "--key-file", "k", "--ranks", "2"],
     "--ranks do not apply to a run through an endpoint"),
    (["--local", "--serve", "--rates", "1", "--endpoint", "http://h:1", "--key-file", "k"], "--local do not apply"),
    (["--rates", "1", "--endpoint", "http://h:1", "--key-file", "k"], "--rates only apply to --serve runs"),
    (["--serve", "--rates", "1", "--endpoint", "http://h:1", "--deployment", "x.yaml", "--key-file", "k"],
     "one of them"),
    (["--serve", "--rates", "1", "--deployment", "x.yaml", "--key-file", "k", "--fault", "kill:a@1"],
     "a fault is kill:NODE/PROGRAM@SECONDS"),
])
def test_bad_endpoint_flags_exit_2_naming_the_flag(args, message):
    result = _bench(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output


def test_the_flags_become_the_spec_and_the_run_goes_through_the_endpoint(fake, tmp_path):
    url = f"http://127.0.0.1:{fake.port}"
    key = tmp_path / "slm.key"
    key.write_text("secret\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 500}))
    result = _bench("--serve", "--endpoint", url, "--key-file", str(key), "--server-metrics", url,
                    "--endpoint-nodes", "1", "--rates", "5", "--duration", "1.5", "--warmup-s", "0",
                    "--cooldown-s", "0", "--input-tokens", "8", "--output-tokens", "4", "--repeats", "1",
                    "--model", str(model), "--slo", "B:tpot<=200ms,ttft<=2s", "--runs-dir", str(tmp_path),
                    "--run-id", "cli", "-o", "json")
    assert result.exit_code == 0, result.output
    spec = RunSpec.of_meta(read_meta(tmp_path / "cli"))
    ep = spec.endpoint
    assert (spec.mode, ep.url, ep.nodes, ep.servers, ep.prompts, ep.vocab) == ("endpoint", url, (1,), (url,), "ids", 500)
    assert ep.key_file == str(key.resolve()) and "secret" not in (tmp_path / "cli" / "meta.json").read_text()
    assert spec.serve.loads == (5.0,) and spec.slos == {"B": {"tpot_ms": 200.0, "ttft_s": 2.0}}
    assert all(max(b["prompt"]) < 500 for b in fake.bodies)
    doc = json.loads(result.stdout)
    assert doc["run_id"] == "cli" and doc["serving"]["points"][0]["endpoint_nodes"] == 1


def test_a_kill_still_on_its_way_when_the_window_ends_is_waited_for(monkeypatch):
    """An SSH kill that returns only after the window's end: the end waits for the server to
    come back, and the fault has its start, its end and its pid (not a server that never
    answered)."""
    import threading
    import time

    from vcfslm.endpoint import faults
    from vcfslm.serve.openai_client import Endpoint

    answers = iter([False, False])          # down twice, then up
    monkeypatch.setattr(faults, "healthy", lambda endpoint: next(answers, True))
    sent, returned = threading.Event(), threading.Event()

    def slow_kill(fault):
        sent.set()
        returned.wait(5)
        return 4242

    run = faults.FaultRun(Fault("slm-01", "vllm-node0", 0.0), Endpoint("127.0.0.1", 1, "k", "m"), slow_kill,
                          poll_s=0.01, timeout_s=10)
    run.begin(time.perf_counter())
    assert sent.wait(5)
    threading.Timer(0.2, returned.set).start()
    run.finish()                            # the window ends while the kill is on its way
    assert run.pid == 4242 and run.error is None
    assert run.start_s is not None and run.end_s is not None and run.end_s > run.start_s


def test_a_window_that_ends_before_the_kill_is_due_sends_none():
    import time

    from vcfslm.endpoint import faults

    kills = []
    run = faults.FaultRun(Fault("slm-01", "vllm-node0", 30.0), None, kills.append, poll_s=0.01, timeout_s=10)
    run.begin(time.perf_counter())
    run.finish()
    assert kills == [] and run.start_s is None
    _, reasons = run.account(None, {}, {}, 0.0)
    assert reasons == ["the fault kill:slm-01/vllm-node0@30 did not happen: the window ended before it was due"]
