"""Fresh lab guests as plans (lab/fresh.py): names, addresses, network commands, mounts,
the start script, teardown lists, and the fresh-guest inventory (lab/generate.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

from vcfslm.guest.playbook import load_playbook
from vcfslm.inventory_load import parse_inventory
from vcfslm.lab import fresh, generate

LAB = Path("/var/lab")


def _plan(nodes: int = 2, net: int = 7) -> fresh.LabPlan:
    return fresh.lab_plan(LAB, nodes, net)


def test_template_packages_cover_what_the_base_playbook_installs():
    # An offline guest cannot fetch them: the template (the lab's fresh root) must carry them.
    base = load_playbook("base")
    wanted = {p for step in base.steps if step.kind == "packages" for p in step.args["apt"]}
    assert wanted <= set(fresh.TEMPLATE_PACKAGES)
    assert {"openssh-server", "python3"} <= set(fresh.TEMPLATE_PACKAGES)


def test_root_key_follows_the_recipe_not_the_order():
    key = fresh.root_key()
    assert fresh.root_key(tuple(reversed(fresh.TEMPLATE_PACKAGES))) == key
    assert fresh.root_key((*fresh.TEMPLATE_PACKAGES, "jq")) != key
    assert fresh.root_tarball(Path("/c"), key) == Path(f"/c/fresh-roots/debian-bookworm-minbase-{key}.tar")


def test_debootstrap_runs_in_a_private_mount_namespace():
    argv = fresh.debootstrap_argv(Path("/b/root"), "http://mirror/debian")
    assert argv[:4] == ["unshare", "--mount", "--propagation", "private"]
    assert argv[4:] == ["debootstrap", "--variant=minbase",
                        "--include=" + ",".join(fresh.TEMPLATE_PACKAGES), "bookworm", "/b/root",
                        "http://mirror/debian"]


def test_mirror_from_deb822_and_one_line_sources():
    deb822 = ("Types: deb\nURIs: http://deb.debian.org/debian\nSuites: bookworm\n\n"
              "Types: deb\nURIs: http://deb.debian.org/debian-security\n")
    assert fresh.mirror_from_sources(deb822) == "http://deb.debian.org/debian"
    assert fresh.mirror_from_sources("deb http://security.debian.org/ bookworm-security main\n"
                                     "deb [arch=amd64] http://ftp.de.debian.org/debian bookworm main\n"
                                     ) == "http://ftp.de.debian.org/debian"
    assert fresh.mirror_from_sources("# nothing\n") is None


def test_names_and_addresses_of_a_lab():
    plan = _plan(3)
    assert plan.tag == fresh.lab_tag(LAB) and len(plan.tag) == 6
    assert fresh.lab_plan(Path("/other"), 3, 7).tag != plan.tag   # two labs never share names
    assert [g.name for g in plan.guests] == ["slm-01", "slm-02", "slm-03"]
    assert [g.management_ip for g in plan.guests] == ["198.18.7.11", "198.18.7.12", "198.18.7.13"]
    assert [g.bench_ip for g in plan.guests] == ["198.19.7.11", "198.19.7.12", "198.19.7.13"]
    assert {g.operator_ip for g in plan.guests} == {"198.18.7.1"}
    assert plan.guests[0].netns == f"vcfslm-{plan.tag}-slm-01"
    assert plan.bench_netns == f"vcfslm-{plan.tag}-bench"
    assert all(len(g.host_veth) <= 15 and len(g.bench_veth) <= 15 for g in plan.guests)
    assert plan.guests[1].dir == "/var/lab/fresh/slm-02"
    assert plan.guests[1].sshd_config == f"/etc/ssh/vcfslm-{plan.guests[1].netns}.conf"
    assert fresh.LabPlan.from_json(plan.to_json()) == plan


def test_pick_net_keeps_the_recorded_one_and_avoids_other_labs():
    used = fresh.used_nets(["10.0.0.5/24", "198.18.1.1/32", "198.18.2.1/32", "198.18.9.11/32"])
    assert used == {1, 2}
    assert fresh.pick_net(used) == 3
    assert fresh.pick_net(used, preferred=5) == 5
    assert fresh.pick_net(used, preferred=2) == 3


def test_guest_network_has_no_way_out_and_bench_stays_in_lab_namespaces():
    plan = _plan()
    guest = plan.guests[0]
    cmds = fresh.guest_network_commands(plan, guest)
    text = [" ".join(c) for c in cmds]
    assert not any("route" in t for t in text)      # no default route, in any namespace
    # the operator's namespace holds only the point-to-point management end
    in_operator_ns = [c for c in cmds if c[:2] == ["ip", "addr"]]
    assert in_operator_ns == [["ip", "addr", "add", "198.18.7.1", "peer", "198.18.7.11/32",
                               "dev", guest.host_veth]]
    assert ["ip", "-n", guest.netns, "addr", "add", "198.19.7.11/24", "dev", "eth1"] in cmds
    assert ["ip", "link", "set", guest.bench_veth, "netns", plan.bench_netns] in cmds
    assert ["ip", "-n", plan.bench_netns, "link", "set", guest.bench_veth, "master", "br0"] in cmds
    assert any(c[:3] == ["ip", "link", "add"] and str(fresh.BENCH_MTU) in c for c in cmds)
    switch = fresh.bench_switch_commands(plan)
    assert switch[0] == ["ip", "netns", "add", plan.bench_netns]
    assert not any("addr" in c for c in switch)


def test_mounts_root_first_sys_read_only_and_a_dev_of_its_own():
    guest = _plan().guests[0]
    mounts = fresh.mount_plan(guest, "/var/lab/fresh/lower")
    root = guest.root
    assert mounts[0] == fresh.Mount(root, "overlay", "overlay",
                                    f"lowerdir=/var/lab/fresh/lower,upperdir={guest.upper},"
                                    f"workdir={guest.work}")
    by_target = {m.target: m for m in mounts}
    assert by_target[f"{root}/proc"].fstype == "proc"
    assert by_target[f"{root}/sys"].fstype == "sysfs"
    assert by_target[f"{root}/sys"].options.startswith("ro,")
    assert by_target[f"{root}/dev"].fstype == "tmpfs"
    # the guest gets a few device nodes, never the operator's whole /dev
    binds = [m for m in mounts if m.fstype is None]
    assert {m.source for m in binds} == {f"/dev/{d}" for d in fresh.DEVICES}
    assert "/dev/sda" not in {m.source for m in binds}
    targets = [m.target for m in mounts]
    assert all(targets.index(f"{root}/dev") < targets.index(m.target) for m in binds)
    assert fresh.Mount("/r/sys", "sysfs", "sysfs", "ro").argv() == \
        ["mount", "-t", "sysfs", "-o", "ro", "sysfs", "/r/sys"]
    assert fresh.Mount("/r/dev/null", None, "/dev/null").argv() == \
        ["mount", "--bind", "/dev/null", "/r/dev/null"]


def test_start_script_mounts_then_execs_the_chrooted_sshd_in_the_guests_namespaces():
    plan = _plan()
    guest = plan.guests[1]
    argv = fresh.start_argv(guest, plan.lower)
    assert argv[:7] == ["ip", "netns", "exec", guest.netns, "unshare", "--uts", "sh"]
    script = argv[-1].splitlines()
    assert script[0] == "set -e"
    assert script[-1] == f"exec chroot {guest.root} /usr/sbin/sshd -D -e -f {guest.sshd_config}"
    assert "hostname slm-02" in script
    assert script.index(f"touch {guest.root}/dev/null") < \
        script.index(f"mount --bind /dev/null {guest.root}/dev/null")


def test_guest_files_name_the_guest_and_resolve_nothing():
    guest = _plan().guests[0]
    files = fresh.guest_files(guest, authorized_key="ssh-ed25519 AAAA client",
                              host_key="PRIVATE", host_public_key="ssh-ed25519 BBBB host")
    assert files["/etc/hostname"] == ("slm-01\n", 0o644)
    assert "127.0.1.1\tslm-01" in files["/etc/hosts"][0]
    assert "nameserver" not in files["/etc/resolv.conf"][0]
    assert files["/root/.ssh/authorized_keys"] == ("ssh-ed25519 AAAA client\n", 0o600)
    assert files["/etc/ssh/ssh_host_ed25519_key"] == ("PRIVATE", 0o600)
    config = files[guest.sshd_config][0]
    assert "ListenAddress 198.18.7.11:22" in config
    assert "PermitRootLogin prohibit-password" in config and "PasswordAuthentication no" in config


def test_teardown_touches_only_what_the_plan_made_and_unmounts_deepest_first():
    plan = _plan()
    g1, g2 = plan.guests
    mounts = ["/", "/proc", "/var/lab/fresh", "/var/lab/fresh/slm-01/root",
              "/var/lab/fresh/slm-01/root/proc", "/var/lab/freshness", "/var/lab2/fresh"]
    down = fresh.teardown_plan(plan, existing_netns=[g1.netns, plan.bench_netns, "someone-else"],
                               existing_links=[g1.host_veth, "eth0", "vfabcdefm01"],
                               mount_points=mounts)
    assert down.kill_netns == (g1.netns, plan.bench_netns)
    assert down.delete_netns == (g1.netns, plan.bench_netns)
    assert down.delete_links == (g1.host_veth,)
    assert down.unmount == ("/var/lab/fresh/slm-01/root/proc", "/var/lab/fresh/slm-01/root",
                            "/var/lab/fresh")
    assert down.remove == (g1.dir, g2.dir, plan.lower, plan.dir)


def test_teardown_of_one_guest_keeps_the_switch_and_the_shared_layer():
    plan = _plan()
    g1, g2 = plan.guests
    one = fresh.LabPlan(plan.tag, plan.net, plan.dir, plan.bench_netns, (g2,))
    down = fresh.teardown_plan(one, [g1.netns, g2.netns, plan.bench_netns], [g2.host_veth],
                               ["/var/lab/fresh", "/var/lab/fresh/slm-01/root"], whole=False)
    assert down.kill_netns == (g2.netns,)
    assert down.unmount == ()
    assert down.remove == (g2.dir,)


def test_mount_points_decode_octal_escapes():
    info = ("22 1 8:1 / / rw,relatime - ext4 /dev/vda rw\n"
            "90 22 0:50 / /tmp/my\\040lab/fresh rw - tmpfs vcfslm-fresh rw\n")
    assert fresh.mount_points(info) == ["/", "/tmp/my lab/fresh"]


def test_fresh_inventory_is_offline_with_its_own_workdir_and_a_jumbo_bench_network():
    shape = generate.MachineShape(cpus=2, numa_nodes=1, memory_gib=24)
    plan = _plan()
    doc = generate.lab_inventory(
        vcenter=generate.LabVcenter(host="127.0.0.1", port=8989, user="u", ca_bundle="/ca.pem",
                                    template="t"),
        nodes=[generate.LabNode(g.name, f"DC0_C0_H{g.index}", g.management_ip,
                                g.bench_ip, fresh.SSH_PORT) for g in plan.guests],
        guest=generate.LabGuestLogin(user="root", ssh_key="/k", known_hosts="/kh", workdir="/lab/work"),
        bench_port=29500, shape=shape)
    before = yaml.safe_dump(doc)
    out = generate.fresh_guest_document(doc, wheelhouse="/cache/wheelhouse/abc",
                                        workdir=fresh.GUEST_WORKDIR, management_mtu=1500,
                                        bench_mtu=fresh.BENCH_MTU, bench_netmask=fresh.BENCH_NETMASK)
    assert yaml.safe_dump(doc) == before                  # the input document is left alone
    inv = parse_inventory(yaml.safe_dump(out), "fresh.yaml")
    assert inv.guest.wheelhouse == "/cache/wheelhouse/abc" and inv.guest.torch_index_url is None
    assert inv.guest.workdir == "/opt/vcfslm"
    assert inv.placement.networks.bench.mtu == 9000
    assert str(inv.placement.networks.bench.netmask) == "255.255.255.0"
    assert inv.bench.compile == "eager"
    assert [str(n.management_ip) for n in inv.nodes] == ["198.18.7.11", "198.18.7.12"]


def test_lab_state_records_the_fresh_plan_and_the_wheelhouse(tmp_path):
    from vcfslm.lab import lab

    state = lab.LabState(dir=tmp_path, nodes=2, vcsim=None, guests=[],
                         inventory=tmp_path / "inventory.yaml", env_file=tmp_path / "lab.env",
                         bench_port=29500, fresh=_plan(), wheelhouse="/cache/wheelhouse/abc")
    lab.save_state(state)
    loaded = lab.load_state(tmp_path)
    assert loaded.fresh == _plan() and loaded.wheelhouse == "/cache/wheelhouse/abc"
    plain = lab.LabState(dir=tmp_path, nodes=1, vcsim=None, guests=[],
                         inventory=tmp_path / "i", env_file=tmp_path / "e", bench_port=1)
    assert lab.LabState.from_json(plain.to_json()).fresh is None
