"""The one registry of arrival processes: its names are the ones the spec, the inventory,
the `--arrival` flag and the records accept, the gaps are the seeded draws they always
were, and a new load pattern is one entry."""

from __future__ import annotations

import random
from typing import get_args

import pytest
from click.testing import CliRunner

from vcfslm import results
from vcfslm.cli import main
from vcfslm.inventory import Serve
from vcfslm.serving import arrivals
from vcfslm.serving import decisions as serving
from vcfslm.serving.arrivals import ArrivalProcess
from vcfslm.serving.decisions import ServeSpec


def test_the_registry_names_each_process_once():
    assert arrivals.OPEN_LOOP == ("poisson", "gamma")
    assert arrivals.RECORDED == ("poisson", "gamma", "closed")
    assert arrivals.LOAD_KINDS == ("rate", "users")
    assert [p.open_loop for p in arrivals.PROCESSES] == [True, True, False]
    assert arrivals.DEFAULT in arrivals.OPEN_LOOP and ServeSpec().arrival == arrivals.DEFAULT


def test_every_reader_takes_its_names_from_the_registry():
    assert get_args(Serve.model_fields["arrival"].annotation) == arrivals.OPEN_LOOP
    assert Serve.model_fields["arrival"].default == arrivals.DEFAULT
    assert serving.LOAD_KINDS == arrivals.LOAD_KINDS
    # The records' checks still spell their own tuples (results.py is being split): equal until
    # they import these.
    assert results.SERVE_ARRIVALS == arrivals.RECORDED
    assert results.SERVE_LOAD_KINDS == arrivals.LOAD_KINDS


def test_the_arrival_flag_offers_the_open_loop_names():
    result = CliRunner().invoke(main, ["bench", "--local", "--serve", "--rates", "1", "--arrival", "closed"])
    assert result.exit_code == 2, result.output
    assert "'closed' is not one of 'poisson', 'gamma'" in result.output


def test_a_record_names_the_closed_loop_for_users():
    assert ServeSpec(load_kind="users", loads=(2,)).arrival_kind == "closed"
    assert ServeSpec(arrival="gamma", burstiness=0.5).arrival_kind == "gamma"
    assert arrivals.recorded_name("rate", "poisson") == "poisson"


@pytest.mark.parametrize(("arrival", "burstiness"), [("poisson", 1.0), ("gamma", 1.0), ("gamma", 0.25),
                                                     ("poisson", 4.0)])
def test_the_seeded_gaps_are_the_draws_they_were(arrival, burstiness):
    """Both open-loop names draw the gamma family (exponential at shape 1) from the
    window's generator, one gap at a time: a resumed run's windows see the same requests."""
    times = serving.arrival_times(3.0, 20.0, random.Random(42), burstiness, arrival)
    rng, t, expected = random.Random(42), 0.0, []
    while True:
        t += rng.expovariate(3.0) if burstiness == 1.0 else rng.gammavariate(burstiness, 1 / (3.0 * burstiness))
        if t >= 20.0:
            break
        expected.append(t)
    assert times == expected


def test_a_closed_loop_has_no_arrival_clock():
    with pytest.raises(ValueError, match="closed is a closed loop"):
        serving.arrival_times(1.0, 10.0, random.Random(0), arrival="closed")
    with pytest.raises(KeyError, match="unknown arrival process 'steady'; known: poisson, gamma, closed"):
        arrivals.process("steady")


def test_a_new_load_pattern_is_one_entry(monkeypatch):
    """Evenly spaced requests, added to the registry alone: the spec accepts it and the
    window's plan draws its gaps."""
    def steady(rate, count, rng, burstiness=1.0):
        return [1.0 / rate] * count

    processes = (*arrivals.PROCESSES, ArrivalProcess("steady", "rate", steady))
    monkeypatch.setattr(arrivals, "PROCESSES", processes)
    monkeypatch.setattr(arrivals, "REGISTRY", {p.name: p for p in processes})
    monkeypatch.setattr(arrivals, "OPEN_LOOP", tuple(p.name for p in processes if p.open_loop))

    spec = ServeSpec(loads=(2.0,), arrival="steady", duration_s=5.0, warmup_s=1.0, cooldown_s=1.0)
    plan = serving.open_loop_plan(spec, 2.0, 128, random.Random(0))
    assert [p.arrival_s for p in plan] == [0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5]
    assert spec.arrival_kind == "steady"


# ------------------------------------------------------------------ a fixed count


@pytest.mark.parametrize("stretch", [True, False])
def test_a_counted_run_draws_exactly_its_count(stretch):
    """N gaps, the first request one gap after 0; the stretch puts the last at N/rate
    (vllm bench serve's normalisation), so the offered rate is the asked one whatever the draw."""
    for seed in range(20):
        times = serving.counted_arrival_times(2.0, 40, random.Random(seed), stretch=stretch)
        assert len(times) == 40 and times == sorted(times) and times[0] > 0
        rng, t, raw = random.Random(seed), 0.0, []
        for _ in range(40):
            t += rng.expovariate(2.0)
            raw.append(t)
        if stretch:
            assert times[-1] == pytest.approx(20.0, rel=1e-12)
            assert times == pytest.approx([v * 20.0 / raw[-1] for v in raw], rel=1e-12)
        else:
            assert times == raw


def test_a_counted_run_draws_as_vllm_bench_serve_does():
    """vllm bench serve draws np.random.gamma(shape=burstiness, scale=1/(rate*burstiness)) per
    request from numpy's global generator seeded with --seed, sums and stretches them. Handed
    a generator in the same MT19937 state, the count draws the same schedule."""
    np = pytest.importorskip("numpy")
    rate, count, seed = 1.0, 40, 3
    np.random.seed(seed)
    delays = [float(np.random.gamma(shape=1.0, scale=1.0 / rate)) for _ in range(count)]
    for i in range(1, count):
        delays[i] += delays[i - 1]
    delays = [d * (count / rate) / delays[-1] for d in delays]
    keys, pos = np.random.RandomState(seed).get_state()[1:3]
    rng = random.Random()
    rng.setstate((3, (*(int(k) for k in keys), int(pos)), None))
    assert serving.counted_arrival_times(rate, count, rng) == pytest.approx(delays, rel=1e-12)


@pytest.mark.parametrize(("arrival", "burstiness", "stretch"), [("poisson", 1.0, True), ("poisson", 1.0, False),
                                                                ("gamma", 0.25, True), ("gamma", 4.0, True)])
def test_a_counted_window_is_the_windows_own_plan(arrival, burstiness, stretch):
    """The window loops plan from (spec, rate, rng): the counted window's rate and duration make
    that plan the counted one, so an HTTP or in-process window sends exactly N requests."""
    for seed in range(30):
        rng = random.Random(seed)
        rate, duration = serving.counted_window(3.0, 25, rng, burstiness, arrival, stretch=stretch)
        assert rng.getstate() == random.Random(seed).getstate()         # not advanced
        spec = ServeSpec(loads=(rate,), arrival=arrival, burstiness=burstiness, duration_s=duration,
                         warmup_s=0.0, cooldown_s=0.0, output_tokens=8)
        plan = serving.open_loop_plan(spec, rate, 64, random.Random(seed))
        counted = serving.counted_arrival_times(3.0, 25, random.Random(seed), burstiness, arrival, stretch=stretch)
        assert [p.arrival_s for p in plan] == pytest.approx(counted, rel=1e-9)
        assert all(serving.in_span(p.arrival_s, spec) for p in plan)


def test_the_window_plan_still_draws_a_poisson_count():
    """The bench's windows keep their fixed duration: the count is the counted run's alone."""
    spec = ServeSpec(loads=(1.0,), duration_s=40.0, warmup_s=0.0, cooldown_s=0.0)
    counts = {len(serving.open_loop_plan(spec, 1.0, 64, random.Random(seed))) for seed in range(10)}
    assert len(counts) > 1


def test_a_count_needs_a_clock_and_a_request():
    with pytest.raises(ValueError, match="closed is a closed loop"):
        serving.counted_arrival_times(1.0, 5, random.Random(0), arrival="closed")
    with pytest.raises(ValueError, match="at least 1"):
        serving.counted_arrival_times(1.0, 0, random.Random(0))
