"""`vcfslm bench`'s options, each declared once: its flag and help, the RunSpec field it sets,
the inventory key it defaults from, its one default, the runs it applies to and whether a
`--resume` may change it (as vLLM's `EngineArgs` declares each engine option once and makes
its command line from that).

From `SETTINGS` come the click options (`bench_options`, shown in `--help` by what an option
is for) and the run spec (`bench_spec.resolve`). A new option is one `Setting` here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from .. import arrivals
from ..contract import ACCEPTED_COMPILE_MODES
from ..runspec import parse_fault
from ..servers import SERVERS
from .common import INVENTORY_ENV, int_list

MODES = frozenset({"local", "cluster", "endpoint"})   # where a run goes
KINDS = frozenset({"static", "serve"})                # what it measures
EVERYWHERE = MODES | KINDS


def only(*names: str) -> frozenset[str]:
    """The runs a flag applies to: the modes and kinds named (a mode or kind not named: all of them)."""
    given = frozenset(names)
    return (given & MODES or MODES) | (given & KINDS or KINDS)


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()   # no default of the CLI's own: the RunSpec's (or its part's) default holds


@dataclass(frozen=True)
class Setting:
    """One option of `vcfslm bench`."""

    name: str                          # the click parameter, the key of the flags' dict
    flags: tuple[str, ...]             # e.g. ("--ranks",); () for a setting only the inventory gives
    group: str                         # the --help section it shows in
    help: str = ""
    spec: str | None = None            # the RunSpec field it sets ("matrix.repeats", "serve.slots");
                                       # None: how the run is driven, not what it is
    inventory: str | None = None       # the inventory key it defaults from ("bench.repeats")
    read_in: frozenset[str] = MODES    # the modes whose runs read that key
    default: Any = UNSET               # without the flag or the inventory key
    applies: frozenset[str] = EVERYWHERE   # the runs the flag is accepted for (only(...))
    resume: bool = False               # a --resume may change it
    to_spec: Callable[[Any], Any] | None = None   # the flag's value as the field takes it
    option: dict[str, Any] = field(default_factory=dict)   # click.option's other arguments
    refusal: str | None = None         # the message when given where it does not apply


def float_list(ctx, param, value: str | None) -> list[float] | None:
    """click callback: '0.5,1,2' -> [0.5, 1.0, 2.0] (positive numbers)."""
    if value is None:
        return None
    try:
        values = [float(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None
    if not values or any(not v > 0 for v in values):
        raise click.BadParameter(f"expected positive numbers, got {value!r}")
    return values


def url_list(ctx, param, value: str | None) -> list[str] | None:
    """click callback: 'http://a:1,http://b:2' -> the URLs, each without a trailing slash."""
    if value is None:
        return None
    urls = [v.strip().rstrip("/") for v in value.split(",") if v.strip()]
    bad = [u for u in urls if not u.startswith("http://")]
    if not urls or bad:
        raise click.BadParameter(f"expected comma-separated http:// URLs, got {value!r}")
    return urls


def fault_text(ctx, param, value: str | None) -> str | None:
    """click callback: a fault as the spec keeps it (`kill:NODE/PROGRAM@SECONDS`)."""
    if value is None:
        return None
    try:
        return parse_fault(value).text
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _negated(flag: bool) -> bool:
    return not flag


WHERE = "Where it runs"
MEASURES = "What it measures"
RANKS = "How the ranks run"
JUDGING = "How it is judged"
SERVING = "Serving (--serve)"
ENDPOINT = "Through one endpoint (--serve --endpoint URL | --deployment INVENTORY)"
RUN = "The run folder and its output"
GROUPS = (WHERE, MEASURES, RANKS, JUDGING, SERVING, ENDPOINT, RUN)

SETTINGS: tuple[Setting, ...] = (
    # -- where it runs
    Setting("local", ("--local",), WHERE, applies=only("local"), resume=True, option={"is_flag": True},
            help="Run on this machine (torchrun standalone, numactl pinning), no VM needed."),
    Setting("inventory", ("-i", "--inventory"), WHERE, resume=True, option={"metavar": "FILE"},
            help=f"Inventory YAML (default: ${INVENTORY_ENV}, then the last provisioned)."),
    Setting("nodes", ("--nodes",), WHERE, spec="nodes", applies=only("cluster"),
            option={"type": click.IntRange(min=1)}, help="Cluster mode: the first N inventory nodes."),
    Setting("hosts", ("--hosts",), WHERE, spec="nodes", applies=only("cluster"), option={"metavar": "A,B"},
            to_spec=lambda text: [h.strip() for h in text.split(",") if h.strip()],
            help="Cluster mode: these inventory nodes."),
    Setting("dry_run", ("--dry-run",), WHERE, applies=only("cluster"), resume=True, option={"is_flag": True},
            help="Cluster mode: print the torchrun commands and stop."),
    Setting("trust_new_hosts", ("--trust-new-hosts",), WHERE, applies=only("cluster"), resume=True,
            option={"is_flag": True}, help="Cluster mode: record unknown SSH host keys."),
    Setting("timeout", ("--timeout",), WHERE, spec="timeout_s", inventory="bench.timeout_s", read_in=only("cluster"),
            applies=only("local", "cluster"), resume=True, option={"type": float},
            help="Whole-run timeout in seconds (default: the inventory's bench.timeout_s on the cluster, "
                 "none locally)."),
    # -- what it measures
    Setting("model", ("--model",), MEASURES, spec="model", inventory="guest.model", default="synthetic:tiny",
            applies=only("local", "endpoint"), resume=True, option={"metavar": "SRC"},
            help="Model: folder, hub id, synthetic:PRESET[,layers=N] (phi-3-mini, llama-3.2-3b, qwen2.5-7b, "
                 "...: `vcfslm model presets`), synthetic:config=PATH, synthetic:tiny (local; default: the "
                 "inventory's guest.model, else synthetic:tiny; through an endpoint: else the one it serves)."),
    Setting("batch_sizes", ("--batch-sizes",), MEASURES, spec="matrix.batch_sizes", inventory="bench.batch_sizes",
            default=(1, 4, 8, 16), applies=only("local", "static"), resume=True,
            option={"callback": int_list, "metavar": "LIST"},
            help="Streams per rank, comma-separated (default 1,4,8,16)."),
    Setting("input_tokens", ("--input-tokens",), MEASURES, spec="matrix.input_tokens",
            inventory="bench.input_tokens", default=(128, 512, 1024), applies=only("local", "endpoint"),
            resume=True, option={"callback": int_list, "metavar": "LIST"},
            help="Prompt lengths, comma-separated (default 128,512,1024)."),
    Setting("output_tokens", ("--output-tokens",), MEASURES, spec="matrix.output_tokens",
            inventory="bench.output_tokens", default=128, resume=True, option={"type": click.IntRange(min=2)},
            help="Generated tokens per stream (default 128)."),
    Setting("warmup", ("--warmup",), MEASURES, spec="matrix.warmup", inventory="bench.warmup", default=1,
            applies=only("local", "static"), resume=True, option={"type": click.IntRange(min=0)},
            help="Discarded windows per scenario (default 1)."),
    Setting("repeats", ("--repeats",), MEASURES, spec="matrix.repeats", inventory="bench.repeats", default=3,
            resume=True, option={"type": click.IntRange(min=1)},
            help="Measured windows per scenario, or per load when serving (default 3)."),
    Setting("scenarios", ("--scenarios",), MEASURES, spec="scenarios", applies=only("local", "cluster", "static"),
            resume=True, option={"metavar": "PATTERNS"},
            help="Only these BATCHxINPUT scenarios, '*' wildcard (e.g. '1x*,16x128')."),
    Setting("seed", ("--seed",), MEASURES, spec="seed", default=0, applies=only("local", "endpoint"), resume=True,
            option={"type": int}, help="Weights/prompt seed (default 0)."),
    Setting("compile_mode", ("--compile",), MEASURES, spec="compile_mode", inventory="bench.compile",
            default="compile", applies=only("local", "cluster"), resume=True,
            option={"type": click.Choice(ACCEPTED_COMPILE_MODES)},
            help="Decode step: compile (torch.compile over one packed copy of the weights: the measurement "
                 "mode) or eager (a baseline); autotune, freezing and default are older names of compile "
                 "(default: the inventory's bench.compile, else compile)."),
    # -- how the ranks run
    Setting("ranks", ("--ranks",), RANKS, spec="ranks", inventory="bench.ranks_per_node",
            read_in=only("local", "cluster"), default=1, applies=only("local"), resume=True,
            option={"type": click.IntRange(min=1)},
            help="Ranks (model replicas) on this machine (local; default: the inventory's bench.ranks_per_node, "
                 "else 1)."),
    Setting("threads", ("--threads",), RANKS, spec="threads", inventory="bench.threads_per_rank",
            read_in=only("cluster"), applies=only("local"), resume=True, option={"type": click.IntRange(min=1)},
            help="Threads per rank (local; default: the CPUs shared evenly)."),
    Setting("no_numactl", ("--no-numactl",), RANKS, spec="numactl", applies=only("local"), resume=True,
            to_spec=_negated, option={"is_flag": True}, help="Do not pin ranks with numactl (local)."),
    Setting("no_probe", ("--no-probe",), RANKS, spec="probe.enabled", applies=only("local", "cluster"), resume=True,
            to_spec=_negated, option={"is_flag": True},
            help="Skip the rank probes: no roofline, no performance model."),
    Setting("probe_mib", ("--probe-mib",), RANKS, spec="probe.mib", applies=only("local", "cluster"), resume=True,
            option={"type": click.IntRange(min=16)},
            help="Bandwidth probe buffer in MiB per rank (default: the workers' own, 1024)."),
    # -- how it is judged
    Setting("slo_specs", ("--slo",), JUDGING, spec="slos", inventory="slos", default={},
            option={"multiple": True, "metavar": "SLO"},
            help="The run's SLOs instead of the inventory's, e.g. 'B:tpot<=200ms,ttft<=5s' (repeatable): "
                 "recorded in meta.json; a serving run's goodput and sweep judge by them."),
    Setting("percentile", ("--percentile",), JUDGING, spec="percentile", inventory="slo.percentile", default="p90",
            option={"type": click.Choice(["p50", "p90", "p99"])},
            help="The static rule the run records, the report's default: the percentile of streams that must "
                 "meet each limit (default: the inventory's slo.percentile, else p90)."),
    Setting("attainment", ("--attainment",), JUDGING, spec="serve.attainment", inventory="slo.attainment",
            applies=only("serve"), option={"type": click.FloatRange(0, 1, min_open=True, max_open=True),
                                            "metavar": "SHARE"},
            refusal="--attainment only applies to --serve runs (static cells are judged by --percentile)",
            help="Serve: the share of requests that must meet every limit at once; the sweep bisects on it "
                 "(default: the inventory's slo.attainment, else 0.9)."),
    # -- serving
    Setting("serve", ("--serve",), SERVING, applies=only("serve"), option={"is_flag": True},
            help="Serving mode: continuous batching under arriving requests (instead of static batches); needs "
                 "--rates or --users (or the inventory's bench.serve)."),
    Setting("rates", ("--rates",), SERVING, inventory="bench.serve.rates", applies=only("serve"),
            option={"callback": float_list, "metavar": "LIST"},
            help="Serve: open-loop arrival rates per rank, requests/s (e.g. 0.5,1,2)."),
    Setting("users", ("--users",), SERVING, inventory="bench.serve.users", applies=only("serve"),
            option={"callback": int_list, "metavar": "LIST"},
            help="Serve: closed-loop users per rank (e.g. 4,8,16), instead of --rates."),
    Setting("slots", ("--slots",), SERVING, spec="serve.slots", inventory="bench.serve.slots", applies=only("serve"),
            option={"type": click.IntRange(min=1)},
            help="Serve: the batch cap, streams a rank decodes together (default 16; through a deployment: its "
                 "serve.max_num_seqs)."),
    Setting("chunk_tokens", ("--chunk-tokens",), SERVING, spec="serve.chunk_tokens",
            inventory="bench.serve.chunk_tokens", applies=only("local", "cluster", "serve"),
            option={"type": click.IntRange(min=1)},
            help="Serve, vcfslm's engine: the most prompt tokens one step takes beside the decodes (default: "
                 "the largest whose FLOPs fit under the decode step's bandwidth floor on the rank's probes; the "
                 "records keep the value used)."),
    Setting("batched_tokens", ("--batched-tokens",), SERVING, spec="serve.batched_tokens",
            inventory="bench.serve.batched_tokens", applies=only("local", "cluster", "serve"),
            option={"type": click.IntRange(min=1)},
            help="Serve, vcfslm's engine: the most prompt tokens one step takes when two or more requests wait "
                 "to go in, or nothing decodes: several prompts per step (default 2048, vLLM's "
                 "max_num_batched_tokens on its CPU server)."),
    Setting("duration", ("--duration",), SERVING, spec="serve.duration_s", inventory="bench.serve.duration_s",
            applies=only("serve"), option={"type": click.FloatRange(min=0, min_open=True)},
            help="Serve: seconds of arrivals per window (default 60)."),
    Setting("warmup_s", ("--warmup-s",), SERVING, spec="serve.warmup_s", inventory="bench.serve.warmup_s",
            applies=only("serve"), option={"type": click.FloatRange(min=0)},
            help="Serve: seconds at a window's start excluded from the metrics (default 5)."),
    Setting("cooldown_s", ("--cooldown-s",), SERVING, spec="serve.cooldown_s", inventory="bench.serve.cooldown_s",
            applies=only("serve"), option={"type": click.FloatRange(min=0)},
            help="Serve: seconds at a window's end excluded from the metrics (default 5)."),
    Setting("arrival", ("--arrival",), SERVING, spec="serve.arrival", inventory="bench.serve.arrival",
            applies=only("serve"), option={"type": click.Choice(arrivals.OPEN_LOOP)},
            help=f"Serve: open-loop arrival process (default {arrivals.DEFAULT})."),
    Setting("burstiness", ("--burstiness",), SERVING, spec="serve.burstiness", inventory="bench.serve.burstiness",
            applies=only("serve"), option={"type": click.FloatRange(min=0, min_open=True)},
            help="Serve: gamma shape; 1 is Poisson, below 1 burstier (default 1)."),
    Setting("think_s", ("--think-s",), SERVING, spec="serve.think_s", inventory="bench.serve.think_s",
            applies=only("serve"), option={"type": click.FloatRange(min=0)},
            help="Serve: closed-loop mean think time between a reply and the next request."),
    Setting("lengths", ("--lengths",), SERVING, spec="serve.lengths", inventory="bench.serve.lengths",
            applies=only("serve"), option={"type": click.Choice(["fixed", "uniform"])},
            help="Serve: request lengths, the nominal ones or uniform in [half, nominal]."),
    Setting("length_low", (), SERVING, spec="serve.length_low", inventory="bench.serve.length_low",
            applies=only("serve")),
    Setting("workload", ("--workload",), SERVING, inventory="bench.serve.workload", applies=only("serve"),
            option={"metavar": "NAME|FILE"},
            help="Serve: what the requests look like: fixed:IN/OUT, a mix (chat, rag), a JSONL file of requests "
                 "(input_tokens, output_tokens; optional arrival_s, conversation, turn, prefix_tokens, think_s) "
                 "or mooncake:FILE (a Mooncake trace). Default: --input-tokens and --output-tokens, fixed."),
    Setting("time_scales", ("--time-scale",), SERVING, inventory="bench.serve.time_scales", applies=only("serve"),
            option={"callback": float_list, "metavar": "LIST"},
            help="Serve, a replayed workload: speed-ups of its own times (2: twice as fast), as loads instead of "
                 "--rates (each is the trace's mean rate times it)."),
    Setting("sweep", ("--sweep",), SERVING, spec="serve.sweep", inventory="bench.serve.sweep", applies=only("serve"),
            option={"is_flag": True, "default": None},
            help="Serve: after the loads, bisect towards each SLO's largest passing load (below the smallest, "
                 "halving it, when even that fails)."),
    Setting("sweep_steps", ("--sweep-steps",), SERVING, spec="serve.sweep_steps", inventory="bench.serve.sweep_steps",
            applies=only("serve"), option={"type": click.IntRange(min=0)},
            help="Serve: loads the sweep adds per SLO and context, halving below the smallest and bisecting "
                 "(default 3)."),
    Setting("sweep_precision", ("--sweep-precision",), SERVING, spec="serve.sweep_precision", applies=only("serve"),
            option={"type": click.FloatRange(min=0, min_open=True), "metavar": "X"},
            help="Serve: after bisecting, add loads inside the gap and windows where the replicates disagree "
                 "until the threshold's 95% interval (up to the first failing load) is narrower than X times "
                 "the threshold (default 0.25) ..."),
    Setting("sweep_budget", ("--sweep-budget",), SERVING, spec="serve.sweep_budget_s", applies=only("serve"),
            option={"type": click.FloatRange(min=0), "metavar": "S"},
            help="Serve: ... or until those extra windows, and every window below the smallest load, took S "
                 "seconds (default 600; 0: none). The run says which stopped it."),
    Setting("server", ("--server",), SERVING, spec="server", inventory="bench.serve.server", default="vcfslm",
            applies=only("local", "cluster", "serve"), option={"type": click.Choice(SERVERS)},
            help="Serve: who serves, vcfslm's own rank engine or vLLM's CPU server, one per vNUMA node, driven "
                 "over its OpenAI streaming API (default: the inventory's bench.serve.server, else vcfslm)."),
    Setting("server_python", ("--server-python",), SERVING, applies=only("local", "cluster", "serve"),
            option={"metavar": "PATH"},
            help="Serve --local: the interpreter of the server's own venv (default $VCFSLM_VLLM_PYTHON, else "
                 ".venv-vllm/bin/python, as `make vllm` installs)."),
    # -- through one endpoint
    Setting("endpoint", ("--endpoint",), ENDPOINT, spec="endpoint.url", applies=only("endpoint"),
            option={"metavar": "URL"},
            help="Serve: load one endpoint from this machine (e.g. http://10.0.0.11:8000, a `serve up` front "
                 "door) instead of each rank's server; --rates are then the whole deployment's requests/s."),
    Setting("deployment", ("--deployment",), ENDPOINT, spec="endpoint.deployment", applies=only("endpoint"),
            to_spec=_absolute, option={"metavar": "INVENTORY", "type": click.Path(dir_okay=False)},
            help="Serve: load the endpoint of this inventory's `serve up` deployment (its status names the "
                 "endpoint and the servers; SSH to its nodes)."),
    Setting("key_file", ("--key-file",), ENDPOINT, spec="endpoint.key_file", applies=only("endpoint"), resume=True,
            to_spec=_absolute, option={"metavar": "FILE", "type": click.Path(dir_okay=False)},
            help="Serve --endpoint/--deployment: the file holding the endpoint's API key."),
    Setting("endpoint_nodes", ("--endpoint-nodes",), ENDPOINT, spec="endpoint.nodes", default=(1,),
            applies=only("endpoint"), to_spec=lambda n: (n,),
            option={"type": click.IntRange(min=1), "metavar": "N"},
            help="Serve --endpoint: nodes behind it, as the records and the scale-out table count them "
                 "(default 1; with --deployment: the deployed ones)."),
    Setting("scale_out", ("--scale-out",), ENDPOINT, spec="endpoint.nodes", applies=only("endpoint"), to_spec=tuple,
            option={"callback": int_list, "metavar": "LIST"},
            help="Serve --deployment: node counts to measure one after the other (e.g. 1,2), `serve up --nodes "
                 "N` before each; the report's scale-out table reads them."),
    Setting("faults", ("--fault",), ENDPOINT, spec="endpoint.faults", applies=only("endpoint"),
            to_spec=lambda text: (text,), option={"callback": fault_text, "metavar": "kill:NODE/PROGRAM@S"},
            help="Serve --deployment: in each measured window, kill that server S seconds after the window "
                 "starts (e.g. kill:slm-01/vllm-node0@20); its supervisor restarts it."),
    Setting("server_metrics", ("--server-metrics",), ENDPOINT, spec="endpoint.servers", applies=only("endpoint"),
            to_spec=tuple, option={"callback": url_list, "metavar": "URL,URL"},
            help="Serve --endpoint: the servers behind it, whose /metrics split each window's requests (default "
                 "with --deployment: its servers)."),
    # -- the run folder
    Setting("run_id", ("--run-id",), RUN, spec="run_id", help="Run folder name (default: the mode, the nodes and "
                                                               "the time)."),
    Setting("runs_dir", ("--runs-dir",), RUN, resume=True,
            option={"default": "runs", "show_default": True, "type": click.Path(file_okay=False)},
            help="Where run folders go."),
    Setting("resume", ("--resume",), RUN, resume=True, option={"metavar": "RUN"},
            help="Continue run RUN (an id under --runs-dir, or its folder); finished scenarios are kept."),
    Setting("label", ("--label",), RUN, spec="label", resume=True, help="Free-text label stored in meta.json."),
    Setting("output", ("--output", "-o"), RUN, resume=True,
            option={"type": click.Choice(["text", "json"]), "default": "text", "show_default": True},
            help="Output format."),
)

BY_NAME = {s.name: s for s in SETTINGS}
# RunSpec field -> the flag that sets it, for messages about bad values.
FIELD_FLAGS = {"serve": "--serve", "endpoint": "--endpoint"}
for _setting in SETTINGS:
    if _setting.spec and _setting.flags and _setting.to_spec is not _negated:
        FIELD_FLAGS.setdefault(_setting.spec.partition(".")[0], _setting.flags[-1])
# The flags that make a run one through an endpoint.
ENDPOINT_FLAGS = frozenset(s.name for s in SETTINGS if s.group == ENDPOINT)


def flag_text(names) -> str:
    """The flags of these settings, as the user typed them: `--batch-sizes, --fault`."""
    return ", ".join(BY_NAME[n].flags[-1] if BY_NAME[n].flags[-1].startswith("--") else BY_NAME[n].flags[0]
                     for n in names)


class GroupedCommand(click.Command):
    """A command whose --help shows its options in the sections `SETTINGS` names."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                setting = BY_NAME.get(param.name or "")
                sections.setdefault(setting.group if setting else "Other options", []).append(record)
        for title in (*GROUPS, "Other options"):
            if title in sections:
                with formatter.section(title):
                    formatter.write_dl(sections[title])


def bench_options(command: Callable) -> Callable:
    """Every declared option with a flag, onto `command`, in the declared order."""
    for setting in reversed(SETTINGS):
        if setting.flags:
            command = click.option(*setting.flags, setting.name, help=setting.help,
                                   **{"default": None, **setting.option})(command)
    return command
