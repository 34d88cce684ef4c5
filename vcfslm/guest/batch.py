"""Independent facts gathered in one round trip (pyinfra's fact batching, Ansible's pipelining).

`script(facts, user)` joins the facts' commands into one shell script; each runs in its
own subshell with its own stdin, and its stdout, exit code and stderr come back between
marker lines carrying a random token. `split(facts, result)` cuts that output back into
one `Result` per fact, as if each command had run alone, for the fact's own parser.

Only facts that do not depend on each other may share a batch: the caller batches what
the remaining steps will read, and gathers again after a step changed the host.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PlaybookError
from .facts import Fact
from .transport import Result, Transport, sudo_wrap

HEADER = "# vcfslm fact batch "


def batchable(fact: Fact) -> bool:
    """A fact whose stdin can travel as a here-document (text ending in a newline)."""
    return fact.input is None or (fact.input.endswith("\n") and "\x00" not in fact.input)


@dataclass(frozen=True)
class Batch:
    """The script of some facts and the token its markers carry."""

    facts: tuple[Fact, ...]
    token: str
    user: str

    @property
    def timeout(self) -> float:
        return sum(f.timeout for f in self.facts)

    def command(self, fact: Fact) -> str:
        """A fact's command as it would be sent alone (sudo-wrapped when it needs root)."""
        return sudo_wrap(fact.command, self.user, fact.sudo)

    def script(self) -> str:
        t = self.token
        parts = [f"{HEADER}{t} {len(self.facts)}\n"]
        for i, fact in enumerate(self.facts):
            if fact.input is None:
                stdin, doc = "</dev/null", ""
            else:
                delim = f"{t}_IN_{i}"
                if re.search(rf"^{re.escape(delim)}$", fact.input, re.M):
                    raise ValueError(f"fact {fact.key}: its input holds the batch delimiter")
                stdin, doc = f"<<'{delim}'", f"{fact.input}{delim}\n"
            # stdout goes straight out (fd 3); stderr is captured, with a trailing `x` so its
            # last newlines survive the command substitution; `exit` in a fact ends its subshell.
            parts.append(
                f"printf '%s %d\\n' {t} {i}\n"
                f"{{ __e=$( {{ {{ {self.command(fact)}\n}} {stdin} 2>&1 1>&3 3>&-\n{doc}"
                f"__r=$?; printf x; exit $__r; }} ); __r=$?; }} 3>&1\n"
                f"printf '\\n%s %d %d\\n%s\\n%s %d end\\n' {t} {i} \"$__r\" \"${{__e%x}}\" {t} {i}\n")
        parts.append("true\n")
        return "".join(parts)


def make(facts: Sequence[Fact], user: str, token: str | None = None) -> Batch:
    return Batch(tuple(facts), token or f"__VCFSLM_F{uuid.uuid4().hex}", user)


def split(batch: Batch, result: Result) -> dict[str, Result]:
    """One Result per fact key, from the batch's output; PlaybookError names the first fact
    whose section is missing or torn (the batch stopped there) and what the batch printed."""
    out = result.stdout
    t = batch.token
    pos = 0
    got: dict[str, Result] = {}
    for i, fact in enumerate(batch.facts):
        begin = f"{t} {i}\n"
        at = out.find(begin, pos)
        mid = out.find(f"\n{t} {i} ", at + len(begin)) if at >= 0 else -1
        eol = out.find("\n", mid + 1) if mid >= 0 else -1
        end_marker = f"\n{t} {i} end\n"
        end = out.find(end_marker, eol) if eol >= 0 else -1
        if end < 0:
            tail = (result.stderr.strip() or out[pos:].strip() or "no output").splitlines()[-3:]
            raise PlaybookError(
                f"fact {fact.key}: no answer in the batched facts (fact {i + 1} of "
                f"{len(batch.facts)}; the batch exited {result.exit}): {batch.command(fact)}\n"
                + "\n".join(f"  | {line}" for line in tail))
        stdout = out[at + len(begin):mid]
        code = out[mid + len(f"\n{t} {i} "):eol]
        try:
            exit_code = int(code)
        except ValueError:
            raise PlaybookError(f"fact {fact.key}: unreadable exit code {code!r} in the batched facts: "
                                f"{batch.command(fact)}") from None
        got[fact.key] = Result(batch.command(fact), exit_code, stdout, out[eol + 1:end],
                               result.duration / max(1, len(batch.facts)))
        pos = end + len(end_marker)
    return got


def parse_fact(fact: Fact, result: Result):
    """The fact's parser over its Result; a parser that fails names the fact and its output."""
    try:
        return fact.parse(result)
    except Exception as exc:  # noqa: BLE001 - any parser bug is reported as this fact's
        tail = "\n".join(f"  | {line}" for line in
                         (result.stdout.strip() or result.stderr.strip() or "no output").splitlines()[-3:])
        raise PlaybookError(f"fact {fact.key}: cannot read the output of `{result.cmd}` "
                            f"(exit {result.exit}): {type(exc).__name__}: {exc}\n{tail}") from None


def run_one(transport: Transport, fact: Fact):
    """One fact in its own round trip, parsed."""
    result = transport.run(fact.command, timeout=fact.timeout, sudo=fact.sudo, check=False,
                           input=fact.input)
    return parse_fact(fact, result)


def gather(transport: Transport, facts: Sequence[Fact]) -> tuple[dict[str, object], int]:
    """Every fact's parsed value by key, and the round trips it took: one for all that can
    share a batch (a lone fact, or one whose stdin cannot travel in it, runs alone)."""
    todo = list({f.key: f for f in facts}.values())
    together = [f for f in todo if batchable(f)]
    alone = [f for f in todo if not batchable(f)]
    if len(together) == 1:
        alone, together = alone + together, []
    values = {f.key: run_one(transport, f) for f in alone}
    if together:
        b = make(together, transport.user)
        answers = split(b, transport.run(b.script(), timeout=b.timeout, check=False))
        for f in together:
            values[f.key] = parse_fact(f, answers[f.key])
    return values, len(alone) + bool(together)


# ------------------------------------------------------------------ for scripted transports


_SECTION = re.compile(r"printf '%s %d\\n' (\S+) (\d+)\n\{ __e=\$\( \{ \{ (.*?)\n\} (</dev/null|<<'(\S+)')"
                      r" 2>&1 1>&3 3>&-\n", re.S)


def decode(script: str) -> tuple[str, list[tuple[str, str | None]]] | None:
    """(token, [(command, stdin)]) of a batch script, None when `script` is not one
    (FakeTransport answers each command from its own script)."""
    if not script.startswith(HEADER):
        return None
    token = script[len(HEADER):].split(None, 1)[0]
    facts = []
    for m in _SECTION.finditer(script):
        stdin = None
        if m.group(5):
            rest = script[m.end():]
            stdin = rest[:rest.index(f"{m.group(5)}\n")]
        facts.append((m.group(3), stdin))
    return token, facts


def encode(token: str, results: Sequence[tuple[int, str, str]]) -> str:
    """The stdout a shell prints for a batch whose facts gave these (exit, stdout, stderr)."""
    return "".join(f"{token} {i}\n{out}\n{token} {i} {code}\n{err}\n{token} {i} end\n"
                   for i, (code, out, err) in enumerate(results))
