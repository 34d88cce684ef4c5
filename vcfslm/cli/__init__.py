"""The `vcfslm` command line: a click group over the library, and the only place real
drivers are built. User errors become one message on stderr and an exit code
(0 ok, 1 failure, 2 bad input), never a traceback.
"""

from __future__ import annotations

import importlib
import sys

import click

from .. import __version__
from ..errors import VcfslmError
from .console import LINE_ENDS
from .logs import configure_logging

# Command modules, each with a COMMANDS list. Imported eagerly: they must import
# torch, transformers, pyVmomi and paramiko lazily, inside their commands.
COMMAND_MODULES = ("validate", "lab", "vcenter", "guests", "bench", "report", "predict", "model", "serve")


class VcfslmGroup(click.Group):
    """A click group that turns VcfslmError into a message and its exit code."""

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


def _register() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{name}":
                continue  # that command family is not part of this build
            raise
        for command in module.COMMANDS:
            main.add_command(command)


_register()
