"""/proc/cpuinfo, read and parsed: the CPU flags the engine's kernel choices rest on.

Standard library only, and no import from the rest of vcfslm: vcfslm.engine.gemv uses it
where the wheel's build hook loads that module on its own (hatch_build.py)."""

from __future__ import annotations

from pathlib import Path


def parse_cpu_flags(cpuinfo: str) -> set[str]:
    """The flag set of the first CPU in /proc/cpuinfo."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def read_cpuinfo() -> str:
    """/proc/cpuinfo's text ("" where there is none)."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
