"""Load through one endpoint, end to end: the endpoint driver (vcfslm/endpoint/)
against fake OpenAI servers (tests/fake_openai.py) behind a real vLLM router
(.venv-vllm/bin/vllm-router, as `make vllm` installs it): the per-server split of every
window, a server killed and restarted inside a window, a router that stops answering,
and the report's scale-out table from a run at 1 and 2 nodes. Then the whole command on
the lab's two guests (real sshd): `serve up`'s deployment (router, nginx front door,
supervisord) in front of fake servers, `bench --serve --deployment --scale-out 1,2 --fault`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from tests.fake_openai import FakeServer
from tests.serve_lab import VLLM_VENV, free_port, lab_cli, serve_inventory
from vcfslm.analysis.report import ReportOptions, write_report
from vcfslm.cli import main
from vcfslm.endpoint.client import EndpointLaunch, Target, run_endpoint
from vcfslm.errors import BenchError
from vcfslm.matrix import serve_matrix
from vcfslm.results import read_meta, read_serve_records
from vcfslm.runspec import EndpointSpec, RunSpec
from vcfslm.serving.decisions import ServeSpec
from vcfslm.serving.servers import ServerSpec

pytestmark = pytest.mark.integration

ROUTER = VLLM_VENV / "bin" / "vllm-router"
KEY = "endpoint-key"

if not ROUTER.exists() and not os.environ.get("CI"):
    pytest.skip(f"no vllm-router at {ROUTER} (make vllm)", allow_module_level=True)


class Server(FakeServer):
    """The fake vLLM server, serving at most `streams` requests at once (the others wait: a
    capacity, so a threshold), and able to crash: its listening socket and every stream in
    flight closed at once, as a SIGKILL leaves them."""

    def __init__(self, *args, streams: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.slots = threading.Semaphore(streams) if streams else None
        self.open: set[socket.socket] = set()
        self.in_flight = 0
        self.dead = False
        accept = self.httpd.process_request

        def process_request(request, client_address):
            if self.dead:                   # killed: a connection still in the backlog is reset
                request.close()
                return
            self.open.add(request)
            accept(request, client_address)

        self.httpd.process_request = process_request
        self.httpd.handle_error = lambda request, client_address: None     # a dropped peer is the point

    def _handler(self):
        base, fake = super()._handler(), self

        class Limited(base):
            def do_POST(self):
                with fake.lock:
                    fake.in_flight += 1
                try:
                    if fake.slots is None:
                        return base.do_POST(self)
                    with fake.slots:
                        return base.do_POST(self)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

        return Limited

    def crash(self) -> None:
        # Streams first: the serving loop takes up to its 0.5 s poll to stop, time enough for
        # the streams in flight to finish, which a SIGKILL would not let them do.
        self.dead = True
        for conn in list(self.open):
            try:
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            except OSError:
                pass
        self.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Router:
    """vllm-router on loopback in front of `workers`, round robin, checking their health every second."""

    def __init__(self, workers: list[str], log: Path, port: int | None = None):
        self.port = port or free_port()
        self.workers, self.log = workers, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> Router:
        self.proc = subprocess.Popen(
            [str(ROUTER), "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(free_port()),
             "--policy", "round_robin", "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
             "--worker-urls", *self.workers], stdout=self.log.open("a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"vllm-router did not listen on {self.port}: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def cleanup():
    things: list = []
    yield things
    for thing in reversed(things):
        try:
            thing.stop() if isinstance(thing, Router) else thing.close()
        except Exception:  # noqa: BLE001 - a server a test crashed is already closed
            pass


def spec_of(tmp: Path, url: str, servers: tuple[str, ...], run_id: str, nodes: tuple[int, ...] = (1,),
            faults: tuple[str, ...] = (), **serve) -> RunSpec:
    settings = {"loads": (8.0,), "input_tokens": (16,), "output_tokens": 8, "duration_s": 5.0, "warmup_s": 0.0,
                "cooldown_s": 0.0, "drain_s": 5.0, "warmup_windows": 0, "repeats": 1, "seed": 3, **serve}
    spec = ServeSpec(**settings)
    key_file = tmp / "key"
    key_file.write_text(KEY + "\n")
    return RunSpec(run_id=run_id, mode="endpoint", model="m", matrix=serve_matrix(spec), threads=1, serve=spec,
                   slos={"B": {"tpot_ms": 100.0, "ttft_s": 0.5}}, server=ServerSpec(name="vllm"),
                   endpoint=EndpointSpec(url=url, key_file=str(key_file), nodes=nodes, servers=servers,
                                         faults=faults, vocab=500))


def test_every_window_is_split_by_the_servers_counters(tmp_path, cleanup):
    a = Server(KEY, first_s=0.02, token_s=0.01).start()
    b = Server(KEY, first_s=0.02, token_s=0.01).start()
    router = Router([a.url, b.url], tmp_path / "router.log").start()
    cleanup += [a, b, router]
    spec = spec_of(tmp_path, router.url, (a.url, b.url), "split", loads=(6.0, 12.0), duration_s=4.0)
    run = run_endpoint(spec, EndpointLaunch(key=KEY, runs_dir=tmp_path / "runs"))
    records = read_serve_records(tmp_path / "runs" / "split" / "serving.jsonl")
    assert [r.load for r in records] == [6.0, 12.0] and run.meta.complete
    for r in records:
        assert r.valid and r.failed == 0 and r.endpoint == router.url and r.endpoint_nodes == 1
        # Every request of the window is counted here (no warm-up, no cool-down): the servers'
        # own counters add up to what the client saw finish, and the router used both.
        assert sum(r.server_requests.values()) == r.completed == r.window_finished == r.offered
        assert all(n > 0 for n in r.server_requests.values()) and set(r.server_requests) == {a.url, b.url}
    assert a.completions + b.completions == sum(r.completed for r in records)


def test_a_server_killed_in_the_window_is_accounted_and_no_request_is_lost(tmp_path, cleanup):
    a = Server(KEY, first_s=0.05, token_s=0.05).start()
    b = Server(KEY, first_s=0.05, token_s=0.05).start()
    router = Router([a.url, b.url], tmp_path / "router.log").start()
    cleanup += [b, router]
    port = a.port
    back: list[Server] = []
    cut: list[int] = []

    def kill(fault) -> int:
        # A kill between two streams would cut none (the router then just sends elsewhere):
        # wait, up to 1.5 s, for one in flight, so the test always sees a cut stream accounted.
        deadline = time.monotonic() + 1.5
        while a.in_flight == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        cut.append(a.in_flight)
        a.crash()

        def restart():
            back.append(Server(KEY, first_s=0.05, token_s=0.05, port=port).start())

        threading.Timer(2.0, restart).start()
        return 4242

    spec = spec_of(tmp_path, router.url, (a.url, b.url), "fault", loads=(10.0,), duration_s=7.0,
                   faults=("kill:fake-1/vllm-node0@3",))
    target = Target(router.url, 1, (a.url, b.url), {"fake-1/vllm-node0": a.url})
    run_endpoint(spec, EndpointLaunch(key=KEY, runs_dir=tmp_path / "runs", scale=lambda n: target, kill=kill))
    cleanup += back
    (r,) = read_serve_records(tmp_path / "runs" / "fault" / "serving.jsonl")
    f = r.fault
    assert f["target"] == "fake-1/vllm-node0" and f["pid"] == 4242
    assert 2.9 <= f["start_s"] <= 3.5
    assert 1.5 <= f["restart_s"] <= 4.0 and f["end_s"] == pytest.approx(f["start_s"] + f["restart_s"], abs=0.01)
    # The streams in flight on the killed server failed: each one counted as a miss, none lost.
    assert cut[0] >= 1 and f["failed_all"] >= 1 and f["failed_all"] >= f["failed"] and r.failed >= f["failed"]
    assert f["detect_s"] is not None and f["detect_s"] >= 0
    assert any("dropped" in e or "stalled" in e for e in f["errors"])
    assert r.completed + r.unfinished == r.offered and r.unfinished >= r.failed
    assert f["requests_during"] > 0 and f["attainment_during"]["B"] is not None
    assert f["requests_after"] > 0 and f["attainment_after"]["B"] is not None
    # Its counter, read every 2 s, started again at 0: what it finished before the kill stays counted.
    assert a.url in r.server_resets and r.server_requests[a.url] > 0


def test_a_router_that_stops_answering_stops_the_run_and_resume_continues(tmp_path, cleanup):
    a = Server(KEY, first_s=0.02, token_s=0.01).start()
    router = Router([a.url], tmp_path / "router.log").start()
    cleanup += [a, router]
    spec = spec_of(tmp_path, router.url, (a.url,), "door", loads=(6.0, 8.0), duration_s=4.0)
    served = tmp_path / "runs" / "door" / "serving.jsonl"

    def kill_the_router_in_the_second_window():
        while not served.exists():
            time.sleep(0.05)
        time.sleep(1.0)
        router.stop()

    threading.Thread(target=kill_the_router_in_the_second_window, daemon=True).start()
    with pytest.raises(BenchError, match="stopped answering"):
        run_endpoint(spec, EndpointLaunch(key=KEY, runs_dir=tmp_path / "runs"))
    assert [r.load for r in read_serve_records(served)] == [6.0]
    assert "stopped answering" in read_meta(tmp_path / "runs" / "door").failure
    again = Router([a.url], tmp_path / "router.log", port=router.port).start()
    cleanup.append(again)
    run = run_endpoint(spec, EndpointLaunch(key=KEY, runs_dir=tmp_path / "runs", resume=True))
    assert [r.load for r in read_serve_records(served)] == [6.0, 8.0] and run.meta.complete
    assert run.meta.failure is None


def test_the_report_reads_the_scale_out_from_one_and_two_nodes(tmp_path, cleanup):
    # One stream at a time, about 0.24 s each (0.2 s to the first token): a server holds about
    # 4 req/s, and the TTFT limit of 1 s leaves 0.8 s of queueing. 1.5 req/s per server
    # (a quarter of that) passes with a wide margin even on a loaded machine; 6 per server
    # and beyond queues without bound and fails. 3 req/s on one server (near 3/4 of it) may
    # go either way in a 5 s window, so one node's threshold is 1.5 or 3; two nodes hold 3
    # (1.5 each) and fail 12.
    servers = [Server(KEY, first_s=0.2, token_s=0.005, streams=1).start() for _ in range(3)]
    one = Router([servers[0].url], tmp_path / "router-1.log").start()
    two = Router([servers[1].url, servers[2].url], tmp_path / "router-2.log").start()
    cleanup += [*servers, one, two]
    stages = {1: Target(one.url, 1, (servers[0].url,)), 2: Target(two.url, 2, (servers[1].url, servers[2].url))}
    spec = spec_of(tmp_path, one.url, (), "scale", nodes=(1, 2), loads=(1.5, 3.0, 12.0), duration_s=5.0,
                   drain_s=4.0)
    spec = spec.replaced(slos={"B": {"tpot_ms": 100.0, "ttft_s": 1.0}})
    run_endpoint(spec, EndpointLaunch(key=KEY, runs_dir=tmp_path / "runs", scale=stages.__getitem__))
    run = tmp_path / "runs" / "scale"
    assert {r.endpoint_nodes for r in read_serve_records(run / "serving.jsonl")} == {1, 2}
    out = write_report([run], tmp_path / "report", ReportOptions(peaks=(8,)))
    (curve,) = out.report.serving.scale_outs
    rows = {r.nodes: r for r in curve.rows}
    assert sorted(rows) == [1, 2] and rows[1].measured in (1.5, 3.0) and rows[2].measured == 3.0
    assert rows[2].ideal == 2 * rows[1].measured
    assert rows[2].efficiency == pytest.approx(rows[2].measured / rows[2].ideal)
    md = (out.out_dir / "report.md").read_text()
    assert "Scale-out under serving (through one endpoint)" in md and "nodes on the measured cluster curve" in md
    result = CliRunner().invoke(main, ["report", str(run), "--out", str(tmp_path / "cli-report")])
    assert result.exit_code == 0, result.output
    assert "Scale-out under serving (through one endpoint)" in (tmp_path / "cli-report" / "report.md").read_text()


# ------------------------------------------------------------------ through serve up's deployment


def test_scale_out_and_a_fault_through_serve_ups_deployment(lab, tmp_path):
    inventory = serve_inventory(lab, tmp_path, token_s=0.01)
    key_file = tmp_path / "slm.key"
    try:
        up = lab_cli(lab, "serve", "up", str(inventory), "--key-file", str(key_file), "--no-install", "--output", "json")
        assert up.returncode == 0, up.stderr[-3000:]
        done = lab_cli(lab, "bench", "--serve", "--deployment", str(inventory), "--key-file", str(key_file),
                      "--scale-out", "1,2", "--rates", "6", "--duration", "5", "--warmup-s", "0", "--cooldown-s", "0",
                      "--input-tokens", "16", "--output-tokens", "8", "--repeats", "1",
                      "--fault", "kill:slm-01/vllm-node0@2", "--runs-dir", str(tmp_path / "runs"), "--run-id", "dep",
                      "--output", "json", timeout=600)
        assert done.returncode == 0, done.stderr[-4000:]
        run = tmp_path / "runs" / "dep"
        records = read_serve_records(run / "serving.jsonl")
        assert [r.endpoint_nodes for r in records] == [1, 2]
        stages = read_meta(run).guests["endpoint"]["stages"]
        for r in records:
            servers = stages[str(r.endpoint_nodes)]["servers"]
            assert r.endpoint == json.loads(up.stdout)["endpoint"].removesuffix("/v1")
            assert sorted(r.endpoint_servers) == sorted(servers) and len(servers) % r.endpoint_nodes == 0
            # Each server's counter, read from this machine, splits the window (the killed one's
            # from before the kill and since its restart).
            assert set(r.server_requests) == set(servers) and all(n is not None for n in r.server_requests.values())
            assert 0 < sum(r.server_requests.values()) <= r.window_finished
            # The supervisor brought the killed server back inside the window.
            f = r.fault
            assert f["target"] == "slm-01/vllm-node0" and f["pid"] > 0 and f["end_s"] is not None
            assert 0 < f["restart_s"] < 30 and r.completed + r.unfinished == r.offered
        assert (stages["2"]["programs"].keys() > stages["1"]["programs"].keys())
        report = lab_cli(lab, "report", str(run), "--out", str(tmp_path / "report"))
        assert report.returncode == 0, report.stderr[-2000:]
        md = (tmp_path / "report" / "report.md").read_text()
        assert "Faults through the router" in md and "slm-01/vllm-node0" in md
    finally:
        down = lab_cli(lab, "serve", "down", str(inventory))
    assert down.returncode == 0, down.stderr[-2000:]
