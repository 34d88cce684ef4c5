"""/proc/cpuinfo, read and parsed: the CPU flags a rank records (vcfslm.bench.placement).

Standard library only, and no import from the rest of vcfslm."""

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
