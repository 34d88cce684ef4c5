"""The run contract: the facts that bind inventory, guest, bench, cli and analysis, each
stated once.

Every stage that needs one of these imports it from here and never re-derives it:

- compile modes of the decode step, and their legacy names;
- the guest layout (where the guest stage puts the venv, scripts, models and runs) and the
  model reference the worker on a guest is given;
- node selection (`--nodes N` / `--hosts A,B`);
- the scenario matrix and its `--scenarios` filter;
- run ids;
- the progress-line format the worker writes and the operator parses;
- the `RunMeta` builder.

Pure: no I/O beyond `Path.is_dir` on the operator's model path, no third-party imports.
"""

from __future__ import annotations

# The decode step's compile modes, as runs record them (meta.json matrix.compile, each
# record's placement.compile_mode). Earlier versions offered Inductor freezing and GEMM
# autotuning, which held a second copy of the weights; those names now mean "compile".
COMPILE_MODES = ("compile", "eager")
LEGACY_COMPILE_MODES = {"autotune": "compile", "freezing": "compile", "default": "compile"}
# Every name a user or an old run may give (the CLI's and the worker's choices).
ACCEPTED_COMPILE_MODES = (*COMPILE_MODES, *LEGACY_COMPILE_MODES)
# Modes whose figures are the instrument's: eager leaves every op between the linears
# unfused, so its TPOT carries per-op overhead and is a baseline, not a measurement.
MEASUREMENT_MODES = ("compile",)


def normalize_compile_mode(mode: str) -> str:
    """A compile mode by its current name ('autotune' -> 'compile'); ValueError if unknown."""
    mode = LEGACY_COMPILE_MODES.get(mode, mode)
    if mode not in COMPILE_MODES:
        raise ValueError(f"unknown compile mode {mode!r}; known: {', '.join(COMPILE_MODES)}")
    return mode
