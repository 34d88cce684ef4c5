"""The scenario matrix (pure): the static scenarios a run measures, its `--scenarios` filter,
its encoding on the worker's command line and in meta.json, and the matrix a serving run's
workers take."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from .contract import DEFAULT_SLOS

Scenario = tuple[int, int, int]    # (batch per rank, input tokens, output tokens)


def scenario_patterns(text: str | None) -> list[str]:
    """`--scenarios '1x*,16x128'` as its patterns ([] = every scenario)."""
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def scenario_selected(scenario: Scenario, patterns: Sequence[str]) -> bool:
    """Whether BATCHxINPUT matches one of the patterns ('*' wildcard); no patterns, all do."""
    return not patterns or any(fnmatchcase(f"{scenario[0]}x{scenario[1]}", p) for p in patterns)


@dataclass(frozen=True)
class Matrix:
    """What a run measures: the scenarios (batch x input, one output length) and windows."""

    batch_sizes: tuple[int, ...]
    input_tokens: tuple[int, ...]
    output_tokens: int
    warmup: int = 1
    repeats: int = 3

    def scenarios(self, pattern: str | None = None) -> list[Scenario]:
        """Run order: batch, then input length; only those `pattern` selects."""
        patterns = scenario_patterns(pattern)
        return [(b, i, self.output_tokens) for b in sorted(set(self.batch_sizes))
                for i in sorted(set(self.input_tokens))
                if scenario_selected((b, i, self.output_tokens), patterns)]

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "input_tokens": list(self.input_tokens),
                "output_tokens": self.output_tokens, "warmup": self.warmup, "repeats": self.repeats}

    def to_json(self) -> str:
        """The matrix as the launcher hands it to the worker (`--matrix`): one JSON object,
        so the worker reads the same typed values instead of re-parsing comma lists."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Matrix:
        """`to_json`'s inverse, every field required; ValueError says which one is wrong (the
        worker's usage error)."""
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {text!r}")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")

        def count(name: str) -> int:
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name}: expected an integer, got {value!r}")
            return value

        def positives(name: str) -> tuple[int, ...]:
            values = data.get(name)
            if (not isinstance(values, list) or not values
                    or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in values)):
                raise ValueError(f"{name}: expected a list of positive integers, got {values!r}")
            return tuple(values)

        return cls(positives("batch_sizes"), positives("input_tokens"), count("output_tokens"),
                   count("warmup"), count("repeats"))

    @classmethod
    def of_inventory(cls, bench, *, output_tokens: int | None = None,
                     repeats: int | None = None) -> Matrix:
        """The inventory's `bench` matrix, with the run's overrides."""
        return cls(tuple(bench.batch_sizes), tuple(bench.input_tokens),
                   output_tokens or bench.output_tokens, bench.warmup, repeats or bench.repeats)

    @classmethod
    def of_record(cls, matrix: dict[str, Any]) -> Matrix:
        """The matrix as meta.json records it (a scalar where a list belongs is one value)."""
        def ints(value) -> tuple[int, ...]:
            if value is None:
                return ()
            return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))

        outputs = ints(matrix.get("output_tokens"))
        return cls(ints(matrix.get("batch_sizes")), ints(matrix.get("input_tokens")),
                   outputs[0] if outputs else 0, int(matrix.get("warmup", 1) or 0),
                   int(matrix.get("repeats") or 1))


def matrix_record(matrix: Matrix, *, compile_mode: str, scenarios: str | None,
                  seed: int | None = None, serve=None, percentile: str | None = None,
                  server=None) -> dict[str, Any]:
    """meta.json's `matrix`: what the run measures and how (a resume repeats exactly this).
    A serving run adds `serve`: its ServeSpec (vcfslm.serving), whose `attainment` is the
    serving rule; `judging.percentile` is the static rule the run asked for (vcfslm.serving.judging),
    the report's default when it is given none."""
    out = {**matrix.to_dict(), "compile": compile_mode, "scenarios": scenarios}
    if seed is not None:
        out["seed"] = seed
    if percentile is not None:
        out["judging"] = {"percentile": percentile}
    if serve is not None:
        out["serve"] = serve.to_dict()
        if server is not None and not server.in_process:
            out["server"] = server.to_dict()    # an HTTP server served (vcfslm.serving.servers.ServerSpec)
    return out


# ------------------------------------------------------------------ serving runs


def serve_matrix(spec) -> Matrix:
    """The static matrix a serving run's workers take: batch = the slots, the spec's
    contexts. It sizes the numerics gate (run at the slots' batch and context) and makes
    the run's matrix say what shapes were compiled."""
    return Matrix((spec.slots,), tuple(spec.input_tokens), spec.output_tokens, 0, spec.repeats)


def serve_limits(slos: dict[str, Any] | None) -> dict[str, dict[str, float | None]]:
    """SLO name -> {tpot_ms, ttft_s} for the serving worker (goodput, the sweep): the run's
    SLOs, else the defaults."""
    chosen = slos or DEFAULT_SLOS
    return {name: {"tpot_ms": spec.get("tpot_ms"), "ttft_s": spec.get("ttft_s"),
                   **({"ttft_per_token_ms": spec["ttft_per_token_ms"]} if spec.get("ttft_per_token_ms") else {}),
                   **({"percentile": spec["percentile"]} if spec.get("percentile") else {})}
            for name, spec in chosen.items() if isinstance(spec, dict)}


def serve_complete(records: Iterable[Any], spec, world_size: int) -> bool:
    """Every rank has `repeats` windows of every load asked for in every context (a sweep
    may stop its grid early, so there each context needs its first load). Every load
    measured needs all ranks in each window it has: its `repeats` windows when it was
    measured as a grid or bisection load, or the extra windows (numbered from `repeats`)
    the sweep's refinement measured it in when it proposed the load inside a gap."""
    have: dict[tuple, set[tuple[int, int]]] = {}
    for r in records:
        have.setdefault((r.input_tokens, float(r.load)), set()).add((r.rank, r.window))
    ranks = range(world_size)
    full = {(rank, w) for rank in ranks for w in range(spec.repeats)}

    def whole(got: set[tuple[int, int]]) -> bool:
        windows = {w for _, w in got}
        in_grid = any(w < spec.repeats for w in windows)
        return (not in_grid or full <= got) and all((rank, w) in got for rank in ranks for w in windows)

    for input_tokens in spec.input_tokens:
        loads = {load for (i, load) in have if i == input_tokens}
        wanted = {float(min(spec.loads))} if spec.sweep else {float(v) for v in spec.loads}
        if not wanted <= loads or not all(full <= have[(input_tokens, load)] for load in wanted) \
                or not all(whole(have[(input_tokens, load)]) for load in loads):
            return False
    return True


def recorded_scenarios(matrix: dict[str, Any]) -> list[Scenario]:
    """The scenarios a recorded matrix asked for, its `--scenarios` filter applied."""
    return Matrix.of_record(matrix).scenarios(matrix.get("scenarios"))
