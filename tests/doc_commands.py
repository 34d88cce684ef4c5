"""The commands README.md and docs/*.md show, checked as written.

Every line of a ```bash block is a command (a trailing backslash continues it; `#` starts a
comment). Each is checked without running it:

- `vcfslm ...` (or `.venv/bin/vcfslm ...`): the CLI parses it with `--help` appended, so a
  command, subcommand or option that does not exist fails (click rejects an unknown option
  while parsing, before it acts on --help);
- `make TARGET...`: each target is a rule of the Makefile;
- `python benchmarks/X.py --opt ...`: the script exists and each `--opt` is an option its
  argparse defines (a string literal in its source);
- `bash FILE`: the file exists.

Other programs (cp, export, `.`) are shell and pass. Inline code spans in prose are held to
the same rule for `make` targets and benchmark scripts: every one they name exists, with
the options they give.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def doc_files() -> list[Path]:
    """README.md and every page under docs/."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def section(text: str, heading: str) -> str:
    """The text under `heading` (a whole line) up to the next heading of its level or above."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    start = lines.index(heading) + 1
    fenced = False
    for end in range(start, len(lines)):
        line = lines[end]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif (not fenced and line.startswith("#") and line.lstrip("#").startswith(" ")
              and len(line) - len(line.lstrip("#")) <= level):
            return "\n".join(lines[start:end])
    return "\n".join(lines[start:])


def bash_blocks(text: str) -> list[str]:
    """The bodies of the ```bash blocks of a markdown text (indented blocks included)."""
    return [m.group(1) for m in re.finditer(r"^[ \t]*```bash[ \t]*\n(.*?)^[ \t]*```", text, re.S | re.M)]


def commands(block: str) -> list[list[str]]:
    """The commands of one bash block as argv lists: continuations joined, comments dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        argv = shlex.split(line, comments=True)
        if argv:
            out.append(argv)
    return out


def block_commands(path: Path, heading: str) -> list[list[str]]:
    """The commands of the first ```bash block under `heading` in `path`."""
    blocks = bash_blocks(section(path.read_text(), heading))
    assert blocks, f"{path.name}: no bash block under {heading!r}"
    return commands(blocks[0])


def _strip(argv: list[str]) -> list[str]:
    """argv without leading VAR=value assignments and sudo, cut at a redirection or pipe."""
    while argv and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]) or argv[0] == "sudo"):
        argv = argv[1:]
    for i, arg in enumerate(argv):
        if arg in ("|", "||", "&&", ";", "&") or arg.startswith((">", "<", "2>")):
            return argv[:i]
    return argv


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    targets = set()
    for m in re.finditer(r"^([A-Za-z0-9_.%/$() -]+?)\s*:(?![=:])", text, re.M):
        targets.update(t for t in m.group(1).split() if not t.startswith("."))
    return targets


def script_options(script: Path) -> set[str]:
    """The long options a benchmark script defines: every "--name" string literal in it."""
    return set(re.findall(r"""["'](--[A-Za-z0-9][A-Za-z0-9-]*)["']""", script.read_text()))


def check_benchmark(args: list[str], root: Path = ROOT) -> list[str]:
    """A `benchmarks/X.py ARGS` invocation: the script exists and defines each option given."""
    script = root / args[0]
    if not script.is_file():
        return [f"{args[0]}: no such script"]
    known = script_options(script)
    return [f"{args[0]}: no option {opt}" for opt in (a.split("=", 1)[0] for a in args[1:])
            if opt.startswith("--") and opt not in known]


def check_command(argv: list[str], root: Path = ROOT) -> list[str]:
    """What is wrong with one shell command as a doc shows it (empty: nothing)."""
    argv = _strip(list(argv))
    if not argv:
        return []
    prog, args = argv[0], argv[1:]
    shown = shlex.join(argv)
    if prog == "vcfslm" or prog.endswith("/vcfslm"):
        from click.testing import CliRunner

        from vcfslm.cli import main

        result = CliRunner().invoke(main, [*args, "--help"])
        if result.exit_code != 0:
            return [f"{shown}: exit {result.exit_code}: {result.output.strip().splitlines()[-1:]}"]
        return []
    if prog == "make":
        targets = make_targets()
        return [f"{shown}: no make target {t!r}" for t in args
                if not t.startswith("-") and "=" not in t and t not in targets]
    if re.fullmatch(r"(\S*/)?python3?", prog):
        if args and args[0].startswith("benchmarks/"):
            return [f"{shown}: {p}" for p in check_benchmark(args, root)]
        if args and not args[0].startswith("-") and not (root / args[0]).is_file():
            return [f"{shown}: no such file {args[0]}"]
        return []
    if prog == "bash" and args and not args[0].startswith("-") and not (root / args[0]).is_file():
        return [f"{shown}: no such file {args[0]}"]
    return []


def check_text(text: str, root: Path = ROOT) -> list[str]:
    """Every problem with the commands of a markdown text: its bash blocks' commands, and the
    make targets and benchmark scripts its inline code names."""
    problems = []
    for block in bash_blocks(text):
        for argv in commands(block):
            problems += check_command(argv, root)
    prose = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        for m in re.finditer(r"(?:^|[\s(])make ([a-z][\w-]*)", span):
            if m.group(1) not in make_targets():
                problems.append(f"`{span}`: no make target {m.group(1)!r}")
        m = re.search(r"(benchmarks/[\w-]+\.py)((?:\s+[^\s`]+)*)", span)
        if m:
            try:
                words = shlex.split(m.group(1) + m.group(2))
            except ValueError:
                words = [m.group(1)]
            problems += [f"`{span}`: {p}" for p in check_benchmark(_strip(words), root)]
    for name in re.findall(r"\bbenchmarks/[\w-]+\.py\b", prose):
        if not (root / name).is_file():
            problems.append(f"{name}: no such script")
    return list(dict.fromkeys(problems))
