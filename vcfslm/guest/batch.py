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
                stdin = "</dev/null\n"
            else:
                delim = f"{t}_IN_{i}"
                if re.search(rf"^{re.escape(delim)}$", fact.input, re.M):
                    raise ValueError(f"fact {fact.key}: its input holds the batch delimiter")
                stdin = f"<<'{delim}'\n{fact.input}{delim}\n"
            # Markers open and close the fact's part of both streams (the shell writes them
            # in order with the fact's own output); its subshell keeps `exit` and `cd` to it.
            parts.append(
                f"printf '%s %d\\n' {t} {i}; printf '%s %d\\n' {t} {i} >&2\n"
                f"( {self.command(fact)}\n) {stdin}"
                f"__r=$?; printf '\\n%s %d %d\\n' {t} {i} $__r; printf '\\n%s %d end\\n' {t} {i} >&2\n")
        parts.append("true\n")
        return "".join(parts)


def make(facts: Sequence[Fact], user: str, token: str | None = None) -> Batch:
    return Batch(tuple(facts), token or f"__VCFSLM_F{uuid.uuid4().hex}", user)


def _sections(text: str, token: str, n: int, with_code: bool) -> list[tuple[str, str]]:
    """Each fact's part of one stream as (text, exit code or ""), up to the first torn part.

    stdout parts read `TOKEN i\\n<output>\\nTOKEN i <exit>\\n`; stderr parts
    `TOKEN i\\n<output>\\nTOKEN i end\\n`.
    """
    out: list[tuple[str, str]] = []
    pos = 0
    for i in range(n):
        begin = f"{token} {i}\n"
        at = text.find(begin, pos)
        if at < 0:
            break
        close = f"\n{token} {i} " if with_code else f"\n{token} {i} end\n"
        end = text.find(close, at + len(begin))
        if end < 0:
            break
        after = end + len(close)
        if with_code:
            eol = text.find("\n", after)
            if eol < 0:
                break
            out.append((text[at + len(begin):end], text[after:eol]))
            pos = eol + 1
        else:
            out.append((text[at + len(begin):end], ""))
            pos = after
    return out


def split(batch: Batch, result: Result) -> dict[str, Result]:
    """One Result per fact key, from the batch's output; PlaybookError names the first fact
    whose part is missing or torn (the batch stopped there) and what the batch printed."""
    n = len(batch.facts)
    outs = _sections(result.stdout, batch.token, n, True)
    errs = _sections(result.stderr, batch.token, n, False)
    got: dict[str, Result] = {}
    for i, fact in enumerate(batch.facts):
        code = outs[i][1] if i < len(outs) else ""
        if i >= len(errs) or not code.lstrip("-").isdigit():
            shown = result.stderr.replace(f"{batch.token} ", "#").strip() or result.stdout.strip()
            tail = (shown or "no output").splitlines()[-3:]
            raise PlaybookError(
                f"fact {fact.key}: no answer in the batched facts (fact {i + 1} of {n}; the "
                f"batch exited {result.exit}): {batch.command(fact)}\n"
                + "\n".join(f"  | {line}" for line in tail))
        got[fact.key] = Result(batch.command(fact), int(code), outs[i][0], errs[i][0],
                               result.duration / max(1, n))
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


_SECTION = re.compile(r"printf '%s %d\\n' (\S+) (\d+); printf '%s %d\\n' \S+ \d+ >&2\n\( (.*?)\n\) "
                      r"(?:</dev/null|<<'(\S+)')\n", re.S)


def decode(script: str) -> tuple[str, list[tuple[str, str | None]]] | None:
    """(token, [(command, stdin)]) of a batch script, None when `script` is not one
    (FakeTransport answers each command from its own script)."""
    if not script.startswith(HEADER):
        return None
    token = script[len(HEADER):].split(None, 1)[0]
    facts = []
    for m in _SECTION.finditer(script):
        stdin = None
        if m.group(4):
            head = f"<<'{m.group(4)}'\n"
            start = script.index(head, m.start()) + len(head)
            stdin = script[start:script.index(f"\n{m.group(4)}\n", start - 1) + 1]
        facts.append((m.group(3), stdin))
    return token, facts


def encode(token: str, results: Sequence[tuple[int, str, str]]) -> tuple[str, str]:
    """The (stdout, stderr) a shell prints for a batch whose facts gave these (exit, stdout, stderr)."""
    out = "".join(f"{token} {i}\n{o}\n{token} {i} {code}\n" for i, (code, o, _) in enumerate(results))
    err = "".join(f"{token} {i}\n{e}\n{token} {i} end\n" for i, (_, _, e) in enumerate(results))
    return out, err
