"""Run playbooks on many hosts: all hosts in parallel (bounded pool), steps in order per host.

One host's failure (a step, its connection, even a bug) never stops the others;
the summary has one row per host with changed/ok/failed counts and durations. Each
host gets one connection for the whole run (every playbook and step), and its facts
are gathered in batches (playbook.run_step), so a converged host costs one SSH
handshake and one round trip.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import PlaybookError, TransportError
from ..node_selection import GUEST_PARALLEL_CAP, parallelism
from ..progress import NullReporter, Reporter
from .context import HostContext
from .playbook import Playbook, StepResult, host_variables, run_step
from .transport import Transport


@dataclass
class HostSummary:
    """What the run did on one host."""

    host: str
    steps: list[StepResult] = field(default_factory=list)
    duration: float = 0.0
    error: str | None = None  # why the host failed (connect or the failed step), None = fine
    note: str | None = None   # e.g. dry run against an unreachable host
    records: dict[str, Any] = field(default_factory=dict)  # step data, e.g. verified facts

    @property
    def changed(self) -> int:
        return sum(s.status == "changed" for s in self.steps)

    @property
    def ok(self) -> int:
        return sum(s.status == "ok" for s in self.steps)

    @property
    def failed(self) -> int:
        return sum(s.status == "failed" for s in self.steps) or int(self.error is not None)

    @property
    def succeeded(self) -> bool:
        return self.error is None

    def row(self) -> dict[str, Any]:
        return {"host": self.host, "changed": self.changed, "ok": self.ok, "failed": self.failed,
                "duration_s": round(self.duration, 3), "error": self.error, "note": self.note}


@dataclass
class RunSummary:
    """Every host's summary, in inventory order."""

    hosts: list[HostSummary]
    dry_run: bool = False
    duration: float = 0.0
    log_dir: Path | None = None

    @property
    def ok(self) -> bool:
        return all(h.succeeded for h in self.hosts)

    @property
    def failed_hosts(self) -> list[HostSummary]:
        return [h for h in self.hosts if not h.succeeded]

    @property
    def changed(self) -> int:
        return sum(h.changed for h in self.hosts)

    def host(self, name: str) -> HostSummary:
        for h in self.hosts:
            if h.host == name:
                return h
        raise KeyError(name)

    def commands(self) -> dict[str, list[str]]:
        """Per host, the commands that ran (or, in a dry run, would run), in order."""
        return {h.host: [c for s in h.steps for c in s.commands] for h in self.hosts}

    def rows(self) -> list[dict[str, Any]]:
        return [h.row() for h in self.hosts]

    def raise_for_failures(self) -> None:
        """PlaybookError naming each failed host and why (for callers that stop on failure)."""
        if not self.ok:
            lines = [f"{h.host}: {h.error}" for h in self.failed_hosts]
            raise PlaybookError(f"{len(lines)} of {len(self.hosts)} host(s) failed:\n" + "\n".join(lines))


@dataclass(frozen=True)
class StepSettings:
    """What every host's steps run with, the same on each host.

    dry_run: gather facts and plan the commands, run none; wheel: the project wheel the
    steps push; templates_dir: where templates are read from (None: the shipped ones).
    """

    dry_run: bool = False
    wheel: Any = None
    templates_dir: Path | None = None


def run_hosts(inventory, playbooks: Sequence[Playbook], nodes: Sequence, connect: Callable[[Any], Transport],
              *, reporter: Reporter | None = None, settings: StepSettings | None = None,
              max_workers: int | None = None, log_dir: Path | None = None) -> RunSummary:
    """Run `playbooks` on every node in parallel; `connect(node)` opens its Transport.

    settings: dry run, wheel and templates (StepSettings; None: a real run, no wheel);
    max_workers: hosts worked on at once (None: every node up to GUEST_PARALLEL_CAP).
    """
    reporter = reporter or NullReporter()
    settings = settings or StepSettings()
    started = time.monotonic()

    def one(node) -> HostSummary:
        return _run_host(inventory, playbooks, node, connect, reporter, settings)

    workers = parallelism(max_workers, len(nodes), GUEST_PARALLEL_CAP)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="guest") as pool:
        hosts = list(pool.map(one, nodes))
    return RunSummary(hosts, settings.dry_run, time.monotonic() - started, log_dir)


def _run_host(inventory, playbooks, node, connect, reporter: Reporter, settings: StepSettings) -> HostSummary:
    dry_run = settings.dry_run
    started = time.monotonic()
    summary = HostSummary(node.name)
    total = sum(len(p.steps) for p in playbooks)
    reporter.update(node.name, "connecting")
    transport = None
    try:
        transport = connect(node)
    except TransportError as exc:
        if not dry_run:
            summary.error = str(exc)
            summary.duration = time.monotonic() - started
            reporter.update(node.name, f"FAILED: {exc}")
            return summary
        summary.note = f"not reachable, planned as a fresh guest ({exc})"
    ctx = HostContext(inventory, node, host_variables(inventory, node), transport, settings.wheel,
                      templates_dir=settings.templates_dir, records=summary.records, reporter=reporter)
    k = 0
    every = [step for playbook in playbooks for step in playbook.steps]
    try:
        for playbook in playbooks:
            ctx.base_dir = Path(playbook.path).parent
            for step in playbook.steps:
                k += 1
                reporter.update(node.name, f"step {k}/{total} {playbook.name}: {step.name}")
                result = run_step(playbook, step, ctx, dry_run=dry_run, ahead=every[k:])
                summary.steps.append(result)
                if result.status == "failed":
                    summary.error = f"{playbook.name} step {k}/{total} ({step.name}): {result.error}"
                    break
            if summary.error:
                break
    except Exception as exc:  # noqa: BLE001 - a bug on one host must not stop the others
        summary.error = f"internal error at step {k}/{total}: {type(exc).__name__}: {exc}"
        reporter.log(f"{node.name}: {''.join(traceback.format_exception(exc)).rstrip()}")
    finally:
        if transport is not None:
            transport.close()
    summary.duration = time.monotonic() - started
    if summary.error:
        reporter.update(node.name, f"FAILED: {summary.error.splitlines()[0]}")
    else:
        verb = "would change" if dry_run else "changed"
        reporter.update(node.name, f"done: {summary.changed} {verb}, {summary.ok} ok "
                                   f"in {summary.duration:.1f}s")
    return summary
