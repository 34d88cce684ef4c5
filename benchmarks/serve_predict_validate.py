"""`vcfslm predict --serve` against the lab: predicted against measured serving on this machine.

One rank of vcfslm's engine on this machine's cores, Phi-3-mini's shape (cut to --layers
layers, so a window costs minutes, not hours), the fixed 128/16 workload (128 prompt, 16
output tokens) under Poisson arrivals:

  1. a static run (batches 1, 4, 8, 16): what `predict` fits its step costs on;
  2. `vcfslm predict --serve` from that fit alone, before anything is served: an SLO this
     machine holds at light load (TPOT 2.5x, TTFT 4x the static batch-1 figures), three rates
     at 0.5, 1 and 2 times the threshold it predicts for it, then per rate the
     attainment and TTFT/TPOT p50, the threshold;
  3. a serving run (`bench --serve`) at the same rates, slots, SLO, windows and seed;
  4. both side by side: per rate the p50s and attainment, predicted against measured, and
     each SLO's threshold. Targets: TTFT and TPOT p50 within 20 %, the threshold within one
     load step (printed, not asserted);
  5. the same again with the step costs calibrated on the serving run's own measured steps
     (`step_costs`, sim/calibrate.py), each load held out: its prediction is calibrated on
     the other loads' windows only.

    flock /tmp/heavy.lock .venv/bin/python benchmarks/serve_predict_validate.py
    .venv/bin/python benchmarks/serve_predict_validate.py --reuse /tmp/serve-predict-runs   # compare again

--rates and --slo fix them instead.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from predict_validate import cpu_line  # noqa: E402  (one CPU line for every benchmark)

VCFSLM = [sys.executable, "-m", "vcfslm.cli"]
TARGET_P50 = 0.20


def run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    started = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode not in (0, 3):
        sys.exit(f"{what} failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    print(f"  {what}: {time.perf_counter() - started:.0f} s", flush=True)
    return done


def measured(serve_dir: Path, slos: dict[str, dict]) -> dict[float, dict]:
    """Per rate: the measured run's pooled windows as the bench judges them (serving.load_results)."""
    from vcfslm.results import read_serve_records
    from vcfslm.serving import decisions as serving

    out = {}
    for load, r in serving.load_results(read_serve_records(serve_dir / "serving.jsonl")).items():
        out[load] = {"requests": r.requests, "ttft_p50": r.ttft_tail(50), "tpot_p50": r.tpot_tail(50),
                     "attainment": {n: r.attainment(s.get("tpot_ms"), s.get("ttft_s")).share for n, s in slos.items()},
                     "meets": {n: serving.meets_limit(r, s, serving.share_for(s)) for n, s in slos.items()}}
    return out


def threshold(meets: dict[float, bool | None]) -> tuple[float | None, float | None]:
    from vcfslm.serving import judging

    return judging.threshold(meets)


def slo_text(name: str, limits: dict) -> str:
    return f"{name}:tpot<={limits['tpot_ms']:g}ms,ttft<={limits['ttft_s']:g}s"


PROBE_RATES = "0.02,0.05,0.1,0.2,0.3,0.5,0.7,1,1.5,2,3,5"


def static_batch1(static_dir: Path) -> tuple[float, float]:
    """The static run's median batch-1 TPOT (ms) and TTFT (s)."""
    rows = [json.loads(line) for line in (static_dir / "results.jsonl").read_text().splitlines() if line.strip()]
    ones = [r for r in rows if r["batch_per_rank"] == 1 and r.get("valid", True)]
    tpot = sorted(r["tpot_ms"][0] for r in ones)
    ttft = sorted(r["ttft_s"][0] for r in ones)
    return tpot[len(tpot) // 2], ttft[len(ttft) // 2]


def pick_slo(static_dir: Path) -> str:
    """An SLO this machine can hold at light load: TPOT 2.5x and TTFT 4x the static batch-1 figures."""
    tpot, ttft = static_batch1(static_dir)
    return f"L:tpot<={tpot * 2.5:.0f}ms,ttft<={ttft * 4:.2f}s"


def pick_rates(static_dir: Path, window: list[str], slo: str) -> str:
    """Three rates around the threshold the fit predicts for the SLO: 0.5, 1 and 2 times it."""
    doc = json.loads(run([*VCFSLM, "predict", "--serve", "--results", str(static_dir), *window, "--rates", PROBE_RATES,
                          "--slo", slo, "-o", "json"], "predict --serve (the rates)").stdout)
    (th,) = doc["thresholds"]
    top = th["threshold"] or float(PROBE_RATES.split(",")[0])
    return ",".join(f"{top * f:.3g}" for f in (0.5, 1.0, 2.0))


def parse_slo(text: str) -> tuple[str, dict]:
    name, rest = text.split(":", 1)
    limits = {}
    for part in rest.split(","):
        key, value = part.split("<=")
        if key.strip() == "tpot":
            limits["tpot_ms"] = float(value.strip().removesuffix("ms"))
        else:
            limits["ttft_s"] = float(value.strip().removesuffix("s"))
    return name, limits


def pct(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b or b != b or a != a or abs(b) == float("inf") or abs(a) == float("inf"):
        return "–"
    return f"{a / b - 1:+.1%}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rates", default=None, help="req/s (default: four up to the fit's saturation)")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--slo", default=None, help="e.g. 'L:tpot<=150ms,ttft<=2s' (default: picked from the fit)")
    p.add_argument("--duration", type=float, default=130.0, help="a window's seconds of arrivals")
    p.add_argument("--warm", type=float, default=5.0, help="its warm-up and cool-down, s each")
    p.add_argument("--keep", type=Path, default=Path("/tmp/serve-predict-runs"))
    p.add_argument("--reuse", action="store_true", help="compare the runs already in --keep again")
    p.add_argument("--server", choices=("vcfslm", "vllm"), default="vcfslm",
                   help="the engine measured and predicted: vcfslm's, or vLLM's CPU server (fitted on its own "
                        "static run; its HTTP windows keep no steps, so only the static fit is compared)")
    args = p.parse_args()
    print(cpu_line(), flush=True)
    runs = args.keep
    runs.mkdir(parents=True, exist_ok=True)
    static_dir, serve_dir = runs / "static", runs / "serve"
    model = f"synthetic:phi-3-mini,layers={args.layers}"
    common = ["--local", "--model", model, "--ranks", "1", "--threads", str(args.threads), "--input-tokens", "128",
              "--output-tokens", "16", "--runs-dir", str(runs), "-o", "json"]
    if not args.reuse and not (static_dir / "meta.json").exists():
        run([*VCFSLM, "bench", *common, "--run-id", "static", "--server", args.server, "--batch-sizes", "1,4,8,16",
             "--warmup", "1", "--repeats", "2"], "static run")
    shape = ["--server", args.server, "--slots", str(args.slots), "--input-tokens", "128", "--output-tokens", "16",
             "--duration", f"{args.duration:g}", "--warmup-s", f"{args.warm:g}", "--cooldown-s", f"{args.warm:g}"]
    # The rates and the SLO are chosen from the fit alone, before anything is served, and kept
    # (a --reuse compares against the same ones).
    chosen = runs / "chosen.json"
    kept = json.loads(chosen.read_text()) if chosen.exists() else {}
    slo = args.slo or kept.get("slo") or pick_slo(static_dir)
    rates_text = args.rates or kept.get("rates") or pick_rates(static_dir, shape, slo)
    chosen.write_text(json.dumps({"rates": rates_text, "slo": slo}) + "\n")
    args.rates = rates_text
    window = ["--rates", rates_text, *shape]
    name, limits = parse_slo(slo)
    print(f"SLO {slo}; {model}; {args.slots} slots; rates {args.rates} req/s; {args.duration:g} s windows", flush=True)
    started = time.perf_counter()
    doc = json.loads(run([*VCFSLM, "predict", "--serve", "--results", str(static_dir), *window, "--slo", slo,
                          "-o", "json"], "predict --serve").stdout)
    print(f"  (simulated in {time.perf_counter() - started:.1f} s with the CLI's start)")
    if not args.reuse and not (serve_dir / "meta.json").exists():
        run([*VCFSLM, "bench", *[c for c in common if c not in ("--input-tokens", "128", "--output-tokens", "16")],
             "--run-id", "serve", "--serve", *window, "--repeats", "1", "--slo", slo], "serving run")
    got = measured(serve_dir, {name: limits})
    static_only = {row["load"]: row for row in doc["loads"]}
    print()
    print("1. From the static fit alone (what predict --serve says before anything is served):")
    compare(static_only, got, name, doc["thresholds"][0])
    held_out = calibrated_held_out(static_dir, serve_dir, window, slo, runs / "held-out")
    if held_out:
        print()
        print("2. Calibrated on the serving run's measured steps, each load held out (its prediction "
              "calibrated on the other loads' windows only):")
        compare(held_out, got, name, None)


def calibrated_held_out(static_dir: Path, serve_dir: Path, window: list[str], slo: str, work: Path) -> dict:
    """Per load: predict --serve calibrated on the serving run's steps at every other load (a
    copy of the run without that load's records), the load itself simulated."""
    from vcfslm.results import read_serve_records

    records = read_serve_records(serve_dir / "serving.jsonl")
    if not any(r.step_costs for r in records):
        print("  (the serving run kept no steps: recorded before step_costs; nothing to calibrate on)")
        return {}
    lines = (serve_dir / "serving.jsonl").read_text().splitlines()
    out = {}
    for load in sorted({float(r.load) for r in records}):
        copy = work / f"without-{load:g}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(serve_dir, copy)
        kept = [line for line in lines if line.strip() and float(json.loads(line)["load"]) != load]
        (copy / "serving.jsonl").write_text("\n".join(kept) + "\n")
        for own in (copy / "ranks").glob("serve-*.jsonl"):    # the merged file holds the run's records
            own.unlink()
        doc = json.loads(run([*VCFSLM, "predict", "--serve", "--results", str(static_dir), "--results", str(copy),
                              *window, "--slo", slo, "-o", "json"], f"predict --serve calibrated without {load:g}").stdout)
        print(f"    {doc['notes'][-1]}")
        out[load] = next(row for row in doc["loads"] if row["load"] == load)
    return out


def compare(predicted: dict, got: dict, name: str, fit_threshold: dict | None) -> None:
    """Per load the p50s and the attainment, predicted beside measured; then the threshold and the targets."""
    print(f"| req/s | requests (pred / meas) | TTFT p50 s pred | meas | error | TPOT p50 ms pred | meas | error "
          f"| SLO-{name} met pred | meas |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    errors, covered = [], []
    for load in sorted(set(predicted) | set(got)):
        pr, me = predicted.get(load), got.get(load)
        if pr is None or me is None:
            continue
        t_err, p_err = pct(pr["ttft_s"]["p50"], me["ttft_p50"]), pct(pr["tpot_ms"]["p50"], me["tpot_p50"])
        for which, mv in (("ttft_s", me["ttft_p50"]), ("tpot_ms", me["tpot_p50"])):
            pv = pr[which]["p50"]
            if pv is not None and mv and mv == mv and abs(mv) != float("inf"):
                errors.append(abs(pv / mv - 1))
                interval = pr[which].get("p50_fit_interval")
                if interval and None not in interval:
                    covered.append(interval[0] <= mv <= interval[1])
        print(f"| {load:g} | {pr['requests']} / {me['requests']} | {pr['ttft_s']['p50'] or float('nan'):.3f} | "
              f"{me['ttft_p50']:.3f} | {t_err} | {pr['tpot_ms']['p50'] or float('nan'):.1f} | {me['tpot_p50']:.1f} | "
              f"{p_err} | {pr['attainment'][name] or 0:.0%} | {me['attainment'][name] or 0:.0%} |")
    p_pass, p_fail = threshold({load: row["meets"][name] for load, row in predicted.items()})
    m_pass, m_fail = threshold({load: v["meets"][name] for load, v in got.items()})
    grid = sorted(got)
    steps_apart = None
    if p_pass in grid and m_pass in grid:
        steps_apart = abs(grid.index(p_pass) - grid.index(m_pass))
    elif p_pass == m_pass:
        steps_apart = 0
    print()
    fit = f"; fit interval {fit_threshold['fit_interval']}" if fit_threshold else ""
    print(f"threshold SLO-{name}: predicted {p_pass} req/s (first failing {p_fail}{fit}), "
          f"measured {m_pass} (first failing {m_fail})")
    within = all(e <= TARGET_P50 for e in errors)
    print(f"target p50s within {TARGET_P50:.0%}: {'met' if within else 'NOT met'} "
          f"(largest |error| {max(errors):.1%} over {len(errors)} p50s)" if errors else "no p50 to compare")
    print(f"target threshold within one load step: "
          f"{'met' if steps_apart is not None and steps_apart <= 1 else 'NOT met'} ({steps_apart} steps apart)")
    if covered:
        print(f"fit interval coverage: the measured p50 inside the predicted p50's fit interval in "
              f"{sum(covered)} of {len(covered)}")

if __name__ == "__main__":
    main()
