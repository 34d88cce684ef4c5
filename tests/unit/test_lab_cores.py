"""`lab up --cores-per-node K`: which CPUs each guest gets, how it is held to them, what the
lab records and the VMs it describes (pure parts; tests/integration/test_lab_cores_sshd.py runs it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from vcfslm.cli import main
from vcfslm.errors import UsageError
from vcfslm.inventory_load import parse_inventory
from vcfslm.lab import cores, generate, guests, lab
from vcfslm.lab.process import ProcessRecord

WRITABLE = cores.CpusetView(Path("/sys/fs/cgroup/cpuset"), mounted=True, writable=True)


def test_each_node_gets_the_next_k_of_the_usable_cpus():
    assert cores.allocate(2, 1, [0, 1]) == [(0,), (1,)]
    assert cores.allocate(2, 2, [7, 1, 3, 5, 9]) == [(1, 3), (5, 7)]   # sorted, gaps kept
    assert cores.allocate(1, 3, range(4)) == [(0, 1, 2)]


@pytest.mark.parametrize(("nodes", "k"), [(3, 1), (2, 2), (1, 3)])
def test_more_cpus_than_there_are_is_a_usage_error_naming_them(nodes, k):
    with pytest.raises(UsageError, match=rf"needs {nodes * k} CPUs; this process may use 2 \(0-1\)"):
        cores.allocate(nodes, k, [0, 1])


def test_zero_cores_per_node_is_a_usage_error():
    with pytest.raises(UsageError, match="at least 1"):
        cores.allocate(1, 0, [0, 1])


def test_the_cpuset_is_chosen_where_it_is_mounted_and_writable():
    assert cores.choose_mechanism(WRITABLE)[0] == cores.CPUSET
    unmounted = cores.CpusetView(Path("/x"), mounted=False, writable=False)
    assert cores.choose_mechanism(unmounted) == (cores.AFFINITY, "no cgroup v1 cpuset controller at /x")
    read_only = cores.CpusetView(Path("/x"), mounted=True, writable=False, own="/box")
    assert cores.choose_mechanism(read_only) == (cores.AFFINITY, "/x/box is not writable by this user")


def test_own_cpuset_is_read_from_proc_self_cgroup():
    text = "4:memory:/a\n3:cpuset:/lab/box\n0::/\n"
    assert cores.parse_own_cpuset(text) == "/lab/box"
    assert cores.parse_own_cpuset("2:cpuacct,cpu:/\n0::/user.slice\n") == "/"     # cgroup v2 only
    assert cores.parse_own_cpuset("3:cpuset,cpu:/\n") == "/"


def test_each_guest_gets_a_cpuset_below_one_parent_per_lab_folder(tmp_path):
    planned = cores.plan_guests(tmp_path, ["slm-01", "slm-02"], 1, [0, 1],
                                cores.CpusetView(WRITABLE.root, True, True, own="/box"))
    parent = f"/sys/fs/cgroup/cpuset/box/{cores.lab_cgroup_name(tmp_path)}"
    assert planned == {"slm-01": cores.GuestCores((0,), cores.CPUSET, f"{parent}/slm-01"),
                       "slm-02": cores.GuestCores((1,), cores.CPUSET, f"{parent}/slm-02")}
    assert cores.lab_cgroup_name(tmp_path) != cores.lab_cgroup_name(tmp_path / "other")
    assert cores.lab_cgroup_name(tmp_path).startswith("vcfslm-lab-")
    fallback = cores.plan_guests(tmp_path, ["slm-01"], 2, [0, 1], cores.CpusetView(Path("/x"), False, False))
    assert fallback == {"slm-01": cores.GuestCores((0, 1), cores.AFFINITY, None)}
    assert cores.plan_guests(tmp_path, ["slm-01"], None, [0], WRITABLE) == {"slm-01": None}


def test_guest_cores_describe_and_round_trip():
    one = cores.GuestCores((1,), cores.CPUSET, "/sys/fs/cgroup/cpuset/vcfslm-lab-x/slm-02")
    assert one.describe() == "CPU 1 (cpuset)"
    assert cores.GuestCores((2, 3), cores.AFFINITY).describe() == "CPUs 2-3 (affinity)"
    assert cores.GuestCores.from_json(json.loads(json.dumps(one.to_json()))) == one


def _guest(name: str = "slm-01", own: cores.GuestCores | None = None) -> guests.Guest:
    return guests.Guest(name=name, address="127.0.0.11", bench_address="127.0.1.11", port=40000, user="me",
                        key="/k", known_hosts="/kh", workdir="/w", host_public_key="", config="/c", log="/l",
                        process=ProcessRecord(10, 20, "sshd"), cores=own)


def _state(tmp_path: Path, guest_list: list[guests.Guest], k: int | None) -> lab.LabState:
    return lab.LabState(dir=tmp_path, nodes=len(guest_list), vcsim=None, guests=guest_list,
                        inventory=tmp_path / "inventory.yaml", env_file=tmp_path / "lab.env",
                        bench_port=29500, cores_per_node=k)


def test_state_records_cores_per_node_and_each_guests_cpus(tmp_path):
    own = cores.GuestCores((1,), cores.CPUSET, "/sys/fs/cgroup/cpuset/vcfslm-lab-x/slm-02")
    state = _state(tmp_path, [_guest("slm-01", cores.GuestCores((0,), cores.AFFINITY)), _guest("slm-02", own)], 1)
    lab.save_state(state)
    data = json.loads(state.state_file.read_text())
    assert data["cores_per_node"] == 1
    assert data["guests"][1]["cores"] == {"cpus": "1", "mechanism": "cpuset", "cgroup": own.cgroup}
    again = lab.load_state(tmp_path)
    assert again.to_json() == state.to_json()
    assert again.cores_per_node == 1 and again.guests[1].cores == own


def test_a_state_written_before_cores_per_node_still_loads(tmp_path):
    data = _state(tmp_path, [_guest()], None).to_json()
    del data["cores_per_node"]
    for g in data["guests"]:
        del g["cores"]
    (tmp_path / "state.json").write_text(json.dumps(data))
    old = lab.load_state(tmp_path)
    assert old.cores_per_node is None and old.guests[0].cores is None
    assert lab.cpus_text(old.guests[0].cores) == "shared CPUs"


def test_a_guest_is_reused_only_on_the_cpus_asked():
    zero = cores.GuestCores((0,), cores.CPUSET, "/a")
    assert lab.same_cpus(None, None)
    assert lab.same_cpus(zero, cores.GuestCores((0,), cores.AFFINITY))   # same CPUs, however held
    assert not lab.same_cpus(zero, cores.GuestCores((1,), cores.CPUSET, "/b"))
    assert not lab.same_cpus(zero, None) and not lab.same_cpus(None, zero)


def test_status_shows_each_guests_cpus(tmp_path):
    own = cores.GuestCores((1,), cores.CPUSET, "/c")
    lab.save_state(_state(tmp_path, [_guest("slm-01"), _guest("slm-02", own)], None))
    assert [row.cpus for row in lab.status(tmp_path)] == ["shared CPUs", "CPU 1 (cpuset)"]


@pytest.mark.parametrize(("k", "numa_nodes", "ranks"), [(1, 1, (1, 1)), (2, 1, (1, 2)), (4, 2, (2, 2))])
def test_a_vm_of_its_own_cores_is_sized_to_them(k, numa_nodes, ranks):
    shape = generate.MachineShape(cpus=k, numa_nodes=numa_nodes, memory_gib=16, own_cores=True)
    vm = generate.vm_section(shape)
    assert (vm["vcpus"], vm["vnuma_nodes"]) == (k, numa_nodes)
    # one rank per vNUMA node with all its CPUs: it binds the node, which its cpuset narrows
    assert generate.lab_ranks(shape) == ranks


def test_machine_shape_of_a_guests_own_cpus_counts_those_and_their_numa_nodes(tmp_path):
    for node, cpulist in (("node0", "0-3"), ("node1", "4-7")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "meminfo").write_text("Node 0 MemTotal:  8388608 kB\n")
        (tmp_path / node / "cpulist").write_text(cpulist + "\n")
    assert generate.machine_shape(sys_nodes=tmp_path, cpus=(2,)) == generate.MachineShape(1, 1, 16, True)
    assert generate.machine_shape(sys_nodes=tmp_path, cpus=(3, 4)) == generate.MachineShape(2, 2, 16, True)
    assert not generate.machine_shape(sys_nodes=tmp_path).own_cores


def test_lab_files_size_the_vms_to_the_guests_own_cores(tmp_path, monkeypatch):
    from vcfslm.lab import vcsim

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(lab, "seed_guest_venv", lambda path: None)
    state = _state(tmp_path, [_guest("slm-01", cores.GuestCores((0,), cores.CPUSET, "/a"))], 1)
    state.vcsim = vcsim.Vcsim(url="u", host="127.0.0.1", port=8989, user="a", ca_file="/ca.pem", hosts=4,
                              template="t", api_version="6.5", log="l", process=ProcessRecord(10, 20, "m"))
    lab.write_lab_files(state, "pw")
    inventory = parse_inventory(state.inventory.read_text(), str(state.inventory))
    assert (inventory.vm.vcpus, inventory.bench.ranks_per_node, inventory.bench.threads_per_rank) == (1, 1, 1)
    assert yaml.safe_load(state.inventory.read_text())["vm"]["cores_per_socket"] == 1


def test_too_many_cores_is_exit_2_with_nothing_started(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "usable_cpus", lambda: [0, 1])
    result = CliRunner().invoke(main, ["lab", "up", "--dir", str(tmp_path), "--nodes", "2",
                                       "--cores-per-node", "2"])
    assert result.exit_code == 2, result.output
    assert "--cores-per-node 2 for 2 node(s) needs 4 CPUs; this process may use 2 (0-1)" in result.output
    assert not (tmp_path / "state.json").exists() and not (tmp_path / "vcsim").exists()
    bad = CliRunner().invoke(main, ["lab", "up", "--dir", str(tmp_path), "--cores-per-node", "0"])
    assert bad.exit_code == 2
    fresh = CliRunner().invoke(main, ["lab", "up", "--dir", str(tmp_path), "--fresh-guests",
                                      "--cores-per-node", "1", "--nodes", "1"])
    assert fresh.exit_code == 2 and "does not apply to --fresh-guests" in fresh.output
