"""The step model calibrated on a serving window's measured steps: the bench's own loop run on
a modelled clock whose steps cost other than the fit says (decode, the piece beside it and a
lone prompt's own part each off by its own factor); the ratios read back from the window's
step log, and the simulator on the calibrated model giving the loop's TTFT and TPOT."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_sim import DIMS, LIMITS, VCFSLM_POLICY, modelled_bench_window

from vcfslm.serve.scheduler import record_fields
from vcfslm.serving.decisions import ServeSpec
from vcfslm.serving.step_log import groups_of
from vcfslm.sim.calibrate import Calibration, MeasuredSteps, apply, calibrate
from vcfslm.sim.cost import StepModel
from vcfslm.sim.fleet import simulate_window

DECODE, PIECE, IDLE = 1.4, 1.8, 1.5


def fitted() -> StepModel:
    """What a static fit might say: 60 ms + 2 ms a lane, 2 ms a prompt token, 20 ms idle."""
    lanes = (0.0, *(0.06 + 0.002 * b for b in range(1, 33)))
    return StepModel(lanes, 2e-7, 2e-3, 0.004, 1e-15, 0.02, DIMS, 32, attention_pair=1e9)


def served(m: StepModel) -> StepModel:
    """The serving steps as they really cost: each kind off by its own factor (a lone prompt's
    step, its pieces too, by IDLE)."""
    return replace(m, lane_s=tuple(v * DECODE for v in m.lane_s), kv_token_s=m.kv_token_s * DECODE,
                   prompt_token_s=m.prompt_token_s * PIECE, prompt_head_s=m.prompt_head_s * PIECE,
                   attention_s=m.attention_s * PIECE, idle_lane_s=m.idle_lane_s * IDLE,
                   idle_piece_scale=IDLE / PIECE)


def bench_window(true: StepModel, spec: ServeSpec, load: float):
    out = modelled_bench_window(true, spec, load)
    return out, record_fields(out, spec, LIMITS)


def p50(xs):
    return sorted(xs)[len(xs) // 2]


def test_the_ratios_of_each_kind_of_step_are_read_back_from_a_windows_step_log():
    spec = ServeSpec(loads=(0.5,), input_tokens=(128,), output_tokens=16, duration_s=300.0, warmup_s=5.0,
                     cooldown_s=5.0, slots=16)
    _, rec = bench_window(served(fitted()), spec, 0.5)
    groups = groups_of(rec["step_costs"])
    kinds = {("decode" if g.lanes and not g.prompt_tokens else "piece" if g.lanes else "idle") for g in groups}
    assert kinds == {"decode", "piece", "idle"}
    c = calibrate([(fitted(), MeasuredSteps(tuple(groups), dict(VCFSLM_POLICY.chunks)))])
    assert c.decode == pytest.approx(DECODE, rel=0.01)
    assert c.piece == pytest.approx(PIECE, rel=0.01)
    assert c.idle == pytest.approx(IDLE, rel=0.01)
    assert c.steps == sum(g.steps for g in groups) and min(c.decode_steps, c.piece_steps, c.idle_steps) > 0


def test_the_calibrated_model_predicts_the_windows_latencies_where_the_static_fit_misses():
    spec = ServeSpec(loads=(0.6,), input_tokens=(128,), output_tokens=16, duration_s=300.0, warmup_s=5.0,
                     cooldown_s=5.0, slots=16)
    calibration_window = bench_window(served(fitted()), replace(spec, seed=7), 0.4)[1]
    c = calibrate([(fitted(), MeasuredSteps(tuple(groups_of(calibration_window["step_costs"])),
                                            dict(VCFSLM_POLICY.chunks)))])
    # Held out: another seed's window, at another load.
    _, truth = bench_window(served(fitted()), spec, 0.6)
    plain = simulate_window(fitted(), VCFSLM_POLICY, spec, 0.6, 128, LIMITS)[0]
    tuned = simulate_window(apply(fitted(), c), VCFSLM_POLICY, spec, 0.6, 128, LIMITS)[0]
    for what in ("ttft_s", "tpot_ms"):
        measured = p50(truth[what])
        assert abs(p50(getattr(plain, what)) / measured - 1) > 0.2
        assert p50(getattr(tuned, what)) == pytest.approx(measured, rel=0.02)


def test_no_measured_steps_leave_the_fit_as_it_is():
    c = calibrate([])
    assert (c.decode, c.piece, c.idle, c.steps) == (1.0, 1.0, 1.0, 0)
    assert apply(fitted(), c) == fitted()
    assert c.statement() == "no serving steps to calibrate on"
    assert Calibration(1.2, 1.0, 1.0, 10).statement() == "calibrated on measured serving steps: decode steps x1.20 (10 steps)"
