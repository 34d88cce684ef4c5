"""`python -m vcfslm`: the `vcfslm` command."""

from .cli import main

main(prog_name="vcfslm")
