"""What a batch-1 decode step costs beyond its weight reads, by how the compiled step is
called: each path's step against a pass of the same linears alone, paired step by step.

    .venv/bin/python benchmarks/step_call_path.py                 # 8 Phi-3-mini layers, 300 steps
    .venv/bin/python benchmarks/step_call_path.py --layers 2 --steps 40 --cpp-wrapper --guards

One engine, one packed model and one KV store; the step is compiled once per path and the
paths then take turns, step by step, the order flipping every step, so the host's bandwidth
drift (2x within seconds here) hits them alike. Each row is the median of its per-turn ratio
to the linears alone (every packed linear once, back to back, through vcfslm::linear: the
step's weight reads and nothing else), with the interquartile range. Paths:
- the engine's compiled step: Inductor's Python wrapper, each linear an extern call to
  vcfslm::linear (oneDNN's packed kernel, or dense-bf16's ATen ops);
- with --cpp-wrapper, the same step under Inductor's C++ wrapper (no Python between the
  kernels' calls; each graph then takes a C++ compile of its wrapper);
- with --guards, the step with Dynamo's guards not evaluated before the graph
  (torch.compiler.set_stance(skip_guard_eval_unsafe=True)): what the ~2000 guards of an
  8-layer step (~7000 at full shape) cost per step. The engine keeps them: they are what
  tells a changed module (its shapes, its kernel plan) from an unchanged one.

A second table runs the step paths again with every linear's kernel skipped (an
uninitialised output of its shape): each path's own code in warm caches, without the weight
stream. The first table's excess over the linears alone, less this, is what the step waits on
caches the weight stream emptied.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_efficiency import cpu_line, linear_kernels, linears_pass, spec_for  # noqa: E402

from vcfslm.bench.pages import ask_for_huge_pages  # noqa: E402

ask_for_huge_pages()   # the rank's environment (rank.sh)

import torch  # noqa: E402

from vcfslm.engine.decode import DecodeEngine, synthetic_prompt  # noqa: E402
from vcfslm.engine.model import load_model  # noqa: E402

PROMPT = 32
STEP = "step, compiled (Inductor's Python wrapper)"


def cpp_wrapper_backend(gm, example_inputs):
    """Inductor with its C++ wrapper: a backend of its own, so Dynamo keeps this graph beside
    the engine's (its cache entries are per backend)."""
    from torch._inductor.compile_fx import compile_fx

    with torch._inductor.config.patch(cpp_wrapper=True):
        return compile_fx(gm, example_inputs)


def turns(paths: dict, steps: int) -> dict[str, list[float]]:
    """Each path's (prepare, run) in turns, the order flipping every turn; run alone timed."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for turn in range(steps):
        for name in names if turn % 2 == 0 else names[::-1]:
            prepare, run = paths[name]
            prepare()
            started = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - started)
    return times


def table(times: dict[str, list[float]], base: str, first_call_s: dict[str, float] | None = None) -> list[str]:
    """A markdown table: each path's median ms and the median of its per-turn ratio to `base`,
    with the interquartile range (and its first call, when given)."""
    compile_head = " first call s (its compile) |" if first_call_s else ""
    lines = [f"| path | median ms | / {base} (interquartile range) |{compile_head}",
             "|---|---|---|" + ("---|" if first_call_s else "")]
    for name, seconds in times.items():
        ratios = [a / b for a, b in zip(seconds, times[base], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        first = f" {first_call_s[name]:.1f} |" if first_call_s else ""
        lines.append(f"| {name} | {statistics.median(seconds) * 1000:.2f} | {statistics.median(ratios):.3f} "
                     f"({q1:.3f}-{q3:.3f}) |{first}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8, help="Phi-3-mini layers (32: the full model)")
    ap.add_argument("--steps", type=int, default=300, help="turns: each path runs this many steps")
    ap.add_argument("--cpp-wrapper", action="store_true", help="also time the step under Inductor's C++ wrapper")
    ap.add_argument("--guards", action="store_true", help="also time the step with Dynamo's guards not evaluated")
    ap.add_argument("--skipped-steps", type=int, default=200,
                    help="turns of the second table (every kernel skipped); 0: no second table")
    args = ap.parse_args()
    # Quartiles need two turns at least.
    if args.steps < 2:
        ap.error(f"--steps {args.steps}: at least 2")
    if args.skipped_steps < 0 or args.skipped_steps == 1:
        ap.error(f"--skipped-steps {args.skipped_steps}: 0 (no second table) or at least 2")
    print(cpu_line())
    replica = load_model(spec_for(args.layers), seed=0, max_context=PROMPT + 8)
    engine = DecodeEngine(replica.model, "compile")
    linears_alone = linears_pass(engine.model, rows=1, compiled=True)

    def nothing() -> None:
        pass

    with torch.inference_mode():
        prompt = synthetic_prompt(1, PROMPT, replica.config.vocab_size, seed=1)
        store = engine.store_for(1, PROMPT + 8)
        token = engine.prefill(prompt, store).argmax(-1).view(1, 1).contiguous()
        position = torch.full((1, 1), PROMPT, dtype=torch.long)
        # One live lane in store row 0, its logits kept: a batch-1 generation's step inputs.
        rows, live, keep = torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.bool), torch.zeros(1, dtype=torch.long)

        def step():
            engine.run_step(token, position, rows, live, keep, lanes=1)

        def step_unguarded():
            # The guards were evaluated on this step's first call (below), which picked the
            # graph; from then on only the step's inputs change, never the modules.
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                step()

        paths = {"linears alone, through vcfslm::linear": (nothing, linears_alone),
                 STEP: (nothing, step)}
        if args.cpp_wrapper:
            # The engine's eager step, traced again under a backend of its own.
            wrapped = torch.compile(lambda: engine.run_step(token, position, rows, live, keep, lanes=1, eager=True),
                                    backend=cpp_wrapper_backend, fullgraph=True, dynamic=False)
            paths["step, Inductor's C++ wrapper"] = (nothing, wrapped)
        if args.guards:
            paths["step, guards not evaluated"] = (nothing, step_unguarded)
        first_call_s = {}
        for name, (prepare, run) in paths.items():   # each step path compiles its graph here
            prepare()
            started = time.perf_counter()
            run()
            first_call_s[name] = time.perf_counter() - started
        times = turns(paths, args.steps)
        skipped = {}
        if args.skipped_steps:
            steps_only = {name: path for name, path in paths.items() if name.startswith("step")}
            with linear_kernels(skip=True):
                skipped = turns(steps_only, args.skipped_steps)
    base = next(iter(paths))
    print(f"engine: {spec_for(args.layers)}, {engine.label}; batch 1, {args.steps} turns")
    print("\n".join(table(times, base, first_call_s)))
    if skipped:
        print(f"every linear's kernel skipped (the step's own code, warm caches), {args.skipped_steps} turns:")
        print("\n".join(table(skipped, STEP)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
