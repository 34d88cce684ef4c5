"""`vcfslm model presets`: the shapes a synthetic source names; `vcfslm model write`: a synthetic
model as a checkpoint folder, for servers that load one."""

from __future__ import annotations

from pathlib import Path

import click

from .. import presets
from ..engine.checkpoint import write_checkpoint
from ..engine.model import ModelSourceError, parse_model_spec
from ..errors import Problem, UsageError
from .common import output_option, print_json


@click.group("model")
def model() -> None:
    """Model shapes and folders: the presets a synthetic source names, checkpoints for servers."""


@model.command("presets")
@output_option
def presets_command(output: str) -> None:
    """The published model shapes `synthetic:NAME` builds (random bf16 weights of that exact
    shape), with the numbers that size a replica.

    \b
    Examples:
      vcfslm model presets
      vcfslm bench --local --model synthetic:llama-3.2-3b --batch-sizes 1,16
    """
    rows = [presets.describe_preset(p) for p in presets.PRESETS.values()]
    if output == "json":
        print_json(rows)
        return
    click.echo(f"{'synthetic:NAME':<16} {'family':<7} {'params':>7} {'weights':>8} {'layers':>6} "
               f"{'heads/kv x dim':>15} {'tied':>4} {'KV/token':>9}  hub id")
    for r in rows:
        click.echo(f"{r['name']:<16} {r['family']:<7} {r['params_b']:>6.2f}B {r['weights_gib']:>5.1f} GiB "
                   f"{r['layers']:>6} {r['heads']:>6}/{r['kv_heads']:<2} x {r['head_dim']:<3} "
                   f"{'yes' if r['tied'] else 'no':>4} {r['kv_kib_per_token']:>5.0f} KiB  {r['hub_id']}")
    click.echo("sources: the config.json of each hub id (vcfslm/presets.py names each); "
               "any other shape: synthetic:config=PATH")


@model.command("write")
@click.argument("source")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True, help="Weights seed.")
@output_option
def write(source: str, folder: str, seed: int, output: str) -> None:
    """Write SOURCE (synthetic:NAME[,layers=N] or synthetic:config=PATH) to FOLDER as a Hugging Face checkpoint with a
    word-level tokenizer of its vocabulary: what `bench --serve --server vllm` serves.

    \b
    Examples:
      vcfslm model write synthetic:tiny-64 models/tiny-64
      vcfslm model write synthetic:phi-3-mini models/phi-3-mini     7.6 GB of bf16
    """
    try:
        spec = parse_model_spec(source)
    except ModelSourceError as exc:
        raise UsageError([Problem("", None, None, "SOURCE", str(exc))]) from None
    if spec.kind != "synthetic":
        raise UsageError([Problem("", None, None, "SOURCE", f"{source}: only synthetic:NAME models are written "
                                                            "(a folder or hub id already is a checkpoint)")])
    target = Path(folder)
    if target.exists() and any(target.iterdir()):
        raise UsageError([Problem("", None, None, "FOLDER", f"{folder} exists and is not empty")])
    facts = write_checkpoint(source, target, seed=seed)
    if output == "json":
        print_json({"folder": str(target), **facts})
        return
    click.echo(f"wrote {source} ({facts['params'] / 1e6:.1f} M params, {facts['weight_bytes'] / 1e9:.2f} GB) "
               f"to {target}")


COMMANDS = [model]
