"""The one registry of arrival processes: its names are the ones the spec, the inventory,
the `--arrival` flag and the records accept, the gaps are the seeded draws they always
were, and a new load pattern is one entry."""

from __future__ import annotations

import random
from typing import get_args

import pytest
from click.testing import CliRunner

from vcfslm import arrivals, results, serving
from vcfslm.arrivals import ArrivalProcess
from vcfslm.cli import main
from vcfslm.inventory import Serve
from vcfslm.serving import ServeSpec


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
