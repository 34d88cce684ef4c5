"""The deployment's certificates (deploy/tls.py, pure) and their files on the operator's
machine (deploy/material.py): a CA made once, a certificate per node address kept while it
serves, the operator's own door certificate checked, every file 0600."""

from __future__ import annotations

import datetime as dt
import ssl
import stat

import pytest
import yaml
from test_deploy_support import BENCH_IPS, inventory_doc

from vcfslm.deploy import material, tls
from vcfslm.deploy.keys import KeyFileError
from vcfslm.errors import InventoryError
from vcfslm.inventory import parse_inventory

NOW = dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc)


@pytest.fixture(scope="module")
def ca() -> tls.Pair:
    return tls.make_ca("slm", NOW)


def test_a_server_certificate_names_its_address_and_is_signed_by_the_ca(ca):
    pair = tls.issue(ca, ["10.20.1.11"], NOW)
    assert tls.covered_hosts(pair.cert) == {"10.20.1.11"}
    assert tls.problems(pair, ["10.20.1.11"], ca.cert, NOW) == []
    assert pair.key.splitlines()[1] not in repr(pair)                           # the key is never in a repr


def test_problems_name_what_is_wrong(ca):
    pair = tls.issue(ca, ["10.20.1.11"], NOW)
    other = tls.make_ca("other", NOW)
    assert tls.problems(pair, ["10.20.1.12"], ca.cert, NOW) == ["does not name 10.20.1.12 (subjectAltName)"]
    assert tls.problems(pair, ["10.20.1.11"], other.cert, NOW) == ["not signed by the deployment's CA"]
    late = NOW + dt.timedelta(days=tls.SERVER_DAYS + 1)
    assert any(p.startswith("expires") for p in tls.problems(pair, ["10.20.1.11"], None, late))
    early = NOW - dt.timedelta(days=1)
    assert any(p.startswith("not valid before") for p in tls.problems(pair, ["10.20.1.11"], None, early))
    mixed = tls.Pair(pair.cert, tls.issue(ca, ["10.20.1.11"], NOW).key)
    assert tls.problems(mixed, ["10.20.1.11"], None, NOW) == ["the private key does not belong to the certificate"]
    assert tls.problems(tls.Pair("junk", pair.key), [], None, NOW)[0].startswith("not a PEM certificate")


def test_a_certificate_is_kept_until_a_month_before_its_end_then_issued_again(ca):
    pair = tls.issue(ca, ["10.20.1.11"], NOW)
    assert tls.current_or_new(ca, pair, ["10.20.1.11"], NOW) is pair
    near_end = NOW + dt.timedelta(days=tls.SERVER_DAYS - 10)
    renewed = tls.current_or_new(ca, pair, ["10.20.1.11"], near_end)
    assert renewed is not pair and tls.problems(renewed, ["10.20.1.11"], ca.cert, near_end) == []
    assert tls.current_or_new(ca, pair, ["10.20.1.12"], NOW) is not pair       # the node's address changed


def test_pythons_own_tls_accepts_the_chain(ca, tmp_path):
    """What every client here does (ssl's default context): the CA as the only trust."""
    pair = tls.issue(ca, ["127.0.0.1"])
    (tmp_path / "ca.pem").write_text(ca.cert)
    (tmp_path / "s.pem").write_text(pair.cert)
    (tmp_path / "s.key").write_text(pair.key)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "s.pem", tmp_path / "s.key")
    client = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    assert client.verify_mode == ssl.CERT_REQUIRED and client.check_hostname
    assert len(client.get_ca_certs()) == 1


# ------------------------------------------------------------------ the files beside the key


def inv(tmp_path, door: dict | None = None):
    doc = inventory_doc(tmp_path)
    doc["serve"] = {"front_door": door or {}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(doc))
    return parse_inventory(path.read_text(), str(path))


def test_the_first_up_makes_the_ca_and_a_certificate_per_node_then_keeps_them(tmp_path):
    key_file = tmp_path / "keys" / "slm.key"
    ips = list(BENCH_IPS.values())
    first, made = material.deployment_tls(inv(tmp_path), key_file, ips, ips[0])
    folder = tmp_path / "keys" / "slm-tls"
    assert sorted(made) == sorted(str(folder / n) for n in ["ca.pem", "ca.key", *(f"{ip}{x}" for ip in ips
                                                                                   for x in (".pem", ".key"))])
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in folder.iterdir())
    assert first.door == first.nodes[ips[0]]
    for ip in ips:
        assert tls.problems(first.nodes[ip], [ip], first.ca_cert) == []
    assert material.client_ca(key_file) == str(folder / "ca.pem")
    again, made = material.deployment_tls(inv(tmp_path), key_file, ips, ips[0])
    assert made == [] and again == first


def test_a_dry_run_saves_nothing(tmp_path):
    key_file = tmp_path / "slm.key"
    _, made = material.deployment_tls(inv(tmp_path), key_file, ["10.20.1.11"], "10.20.1.11", write=False)
    assert made and not (tmp_path / "slm-tls").exists()


def test_plain_http_only_when_the_inventory_says_so(tmp_path):
    certificates, _ = material.deployment_tls(inv(tmp_path, {"tls": False}), tmp_path / "k.key",
                                              ["10.20.1.11"], "10.20.1.11")
    assert certificates.door is None and certificates.nodes        # the router's hop keeps TLS


def operator_files(tmp_path, hosts=("10.20.1.11",), key_mode=0o600):
    own_ca = tls.make_ca("corp")
    pair = tls.issue(own_ca, list(hosts))
    (tmp_path / "door.pem").write_text(pair.cert)
    (tmp_path / "door.key").write_text(pair.key)
    (tmp_path / "door.key").chmod(key_mode)
    (tmp_path / "corp-ca.pem").write_text(own_ca.cert)
    return pair


def test_the_operators_certificate_serves_the_door(tmp_path):
    pair = operator_files(tmp_path)
    door = {"tls_cert_file": "door.pem", "tls_key_file": "door.key", "tls_ca_file": "corp-ca.pem"}
    certificates, _ = material.deployment_tls(inv(tmp_path, door), tmp_path / "k.key", ["10.20.1.11"], "10.20.1.11")
    assert certificates.door == pair and certificates.operator_door
    assert certificates.door_ca == (tmp_path / "corp-ca.pem").read_text()
    assert material.client_ca(tmp_path / "k.key", inv(tmp_path, door)) == str(tmp_path / "corp-ca.pem")


@pytest.mark.parametrize(("hosts", "mode", "said"), [
    (("10.20.1.99",), 0o600, "does not name 10.20.1.11"),
    (("10.20.1.11",), 0o644, "chmod 600"),
])
def test_an_operators_certificate_that_cannot_serve_is_refused(tmp_path, hosts, mode, said):
    operator_files(tmp_path, hosts, mode)
    door = {"tls_cert_file": "door.pem", "tls_key_file": "door.key"}
    with pytest.raises(KeyFileError) as info:
        material.deployment_tls(inv(tmp_path, door), tmp_path / "k.key", ["10.20.1.11"], "10.20.1.11")
    assert said in str(info.value) and "serve.front_door.tls_" in str(info.value) and info.value.exit_code == 2


@pytest.mark.parametrize("door", [{"tls_cert_file": "a.pem"}, {"tls": False, "tls_cert_file": "a.pem",
                                                                "tls_key_file": "a.key"}])
def test_the_inventory_refuses_half_a_certificate_or_one_with_tls_off(tmp_path, door):
    with pytest.raises(InventoryError, match="front_door"):
        inv(tmp_path, door)
