"""The `vcfslm` command line: a click group over the library, and the only place real
drivers are built. User errors become one message on stderr and an exit code
(0 ok, 1 failure, 2 bad input), never a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import click

from .. import __version__
from ..errors import VcfslmError
from .console import LINE_ENDS
from .logs import configure_logging

# Each command: its module (which lists it in COMMANDS) and the line `vcfslm --help` shows
# for it (its help's first sentence; tests/unit/test_cli_foundation.py holds them equal).
# A module is imported only when its command runs or shows its own help: importing them all
# (pydantic models, the inventory, the results schema) made `vcfslm --help` take about 1 s.
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("bench", "Measure TTFT, TPOT and rank throughput for each (batch per rank, input length)."),
    "destroy": ("vcenter", "Power off and delete the inventory's VMs (only those carrying its ownership marker)."),
    "guests": ("guests", "Prepare existing guests over SSH with playbooks (no VM changes)."),
    "lab": ("lab", "The local lab: a vCenter simulator and SSH guests on this machine."),
    "model": ("model", "Model shapes and folders: the presets a synthetic source names, checkpoints for servers."),
    "plan": ("vcenter", "Show what provision would change in vCenter; change nothing."),
    "predict": ("predict", "Predict TTFT, TPOT, the crossover and the nodes on a target platform, with 95 % "
                           "intervals."),
    "probe": ("bench", "Memory bandwidth, bf16 GEMM rate and decode-batch linear rates per NUMA node, as ranks "
                       "see them."),
    "provision": ("vcenter", "Create or converge the inventory's VMs on vCenter, then prepare the guests."),
    "report": ("report", "Tables, figures, SLO crossover and sizing of one or more runs, as report.html/.md and "
                         "CSV."),
    "schema": ("validate", "Print the inventory's JSON Schema (for yaml-language-server and editors)."),
    "serve": ("serve", "The sized service: vLLM on every vNUMA node behind vLLM's router, one endpoint with a key."),
    "size": ("report", "Nodes needed: ceil(peak streams / single-VM threshold), with the reasoning and 95 % "
                       "intervals."),
    "validate": ("validate", "Check an inventory without contacting anything; show what it describes."),
    "verify": ("guests", "Check inside each guest that its NUMA topology and bench network match the inventory."),
}


class VcfslmGroup(click.Group):
    """The `vcfslm` group: loads a command's module when that command is asked for (click's
    lazy group), and turns VcfslmError into a message and its exit code."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self._present()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and cmd_name in self._present():
            module = importlib.import_module(f"{__name__}.{LAZY_COMMANDS[cmd_name][0]}")
            command = next(c for c in module.COMMANDS if c.name == cmd_name)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The commands and their lines, without importing their modules."""
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            line = LAZY_COMMANDS[name][1] if name in LAZY_COMMANDS else self.commands[name].help
            rows.append((name, click.Command(name, help=line).get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    @staticmethod
    def _present() -> list[str]:
        """The commands whose module this build has (a command family may be left out)."""
        return [name for name, (module, _) in LAZY_COMMANDS.items()
                if importlib.util.find_spec(f"{__name__}.{module}") is not None]

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except VcfslmError as exc:
            LINE_ENDS.write("stderr", f"error: {exc}\n")
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            LINE_ENDS.write("stderr", "interrupted\n")
            sys.exit(130)


@click.group(cls=VcfslmGroup, context_settings={"help_option_names": ["-h", "--help"],
                                                "max_content_width": 100})
@click.version_option(__version__, prog_name="vcfslm")
@click.option("-v", "--verbose", count=True,
              help="More detail: -v info logs and per-rank progress, -vv debug logs (vCenter "
                   "retries and tasks, SSH reconnects, compile events).")
@click.pass_context
def main(ctx: click.Context, verbose: int) -> None:
    """Provision, benchmark and size small-language-model inference on VMware Cloud Foundation.

    \b
    One inventory YAML drives everything:
      vcfslm validate cluster.yaml        check the inventory, show the layout
      vcfslm plan cluster.yaml            what provision would change
      vcfslm provision cluster.yaml       VMs on vCenter, then guests over SSH
      vcfslm bench --nodes 1              single-VM baseline
      vcfslm bench --nodes 4              the cluster
      vcfslm report runs/<id> runs/<id>   tables, figures, SLO crossover
      vcfslm size --peak-streams 256      nodes needed
      vcfslm serve up cluster.yaml        the sized service, behind one endpoint
    The local lab (vCenter simulator + SSH guests): vcfslm lab up
    """
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose
    configure_logging(verbose)
