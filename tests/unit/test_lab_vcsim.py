"""Building and starting vcsim: command line, latency flags, build cache (no Go needed here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from vcfslm.lab import vcsim


def test_command_line_carries_options_but_never_the_password(tmp_path: Path):
    opts = vcsim.VcsimOptions(port=0, hosts=4, method_delay={"PowerOnVM_Task": 500, "CloneVM_Task": 1000},
                              delay_ms=20)
    argv = vcsim.command_line(Path("/cache/vcsim"), tmp_path, opts)
    assert argv[0] == "/cache/vcsim"
    flags = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert flags["-listen"] == "127.0.0.1:0"
    assert flags["-host"] == "4"
    assert flags["-template"] == "vcfslm-template"
    assert flags["-tls-dir"] == str(tmp_path / "tls")
    assert flags["-ready-file"] == str(tmp_path / "ready.json")
    assert flags["-method-delay"] == "CloneVM_Task=1000,PowerOnVM_Task=500"
    assert flags["-delay"] == "20"
    assert "-password" not in argv


def test_api_and_record_file_flags(tmp_path: Path):
    flags = dict(zip(*[iter(vcsim.command_line(Path("vcsim"), tmp_path,
                                               vcsim.VcsimOptions(api="8.0.3"))[1:])] * 2, strict=True))
    assert flags["-api"] == "8.0.3"
    assert flags["-record-file"] == str(tmp_path / "soap-records.jsonl")
    assert vcsim.DEFAULT_API == "6.5" and "9.0" in vcsim.API_CHOICES


def test_soap_records_are_read_in_order(tmp_path: Path):
    rec = tmp_path / "r.jsonl"
    rec.write_text('{"method": "CloneVM_Task", "moref": "vm-1"}\n\n{"method": "ReconfigVM_Task", "moref": "vm-2"}\n')
    sim = vcsim.Vcsim.from_json({"url": "u", "host": "h", "port": 1, "user": "u", "ca_file": "c", "hosts": 1,
                                 "template": "t", "process": {"pid": 1, "start_time": 2, "marker": "m"},
                                 "record_file": str(rec), "api": "8.0.3"})
    assert [r["moref"] for r in vcsim.soap_records(sim)] == ["vm-1", "vm-2"]
    assert sim.same_api(vcsim.VcsimOptions(api="8.0.3")) and not sim.same_api(vcsim.VcsimOptions())
    assert vcsim.Vcsim.from_json(sim.to_json()) == sim
    assert vcsim.soap_records(vcsim.Vcsim.from_json({**sim.to_json(), "record_file": ""})) == []


def test_no_latency_flags_by_default(tmp_path: Path):
    argv = vcsim.command_line(Path("vcsim"), tmp_path, vcsim.VcsimOptions())
    assert "-method-delay" not in argv and "-delay" not in argv


def test_parse_method_delay():
    assert vcsim.parse_method_delay("CloneVM_Task=1000, PowerOnVM_Task=5") == {
        "CloneVM_Task": 1000, "PowerOnVM_Task": 5}
    assert vcsim.parse_method_delay("") == {}
    for bad in ("CloneVM_Task", "=5", "A=x", "A=-1"):
        with pytest.raises(ValueError):
            vcsim.parse_method_delay(bad)


def test_source_hash_follows_source_and_compiler():
    base = vcsim.source_hash(b"package main", "go1.19")
    assert base == vcsim.source_hash(b"package main", "go1.19")
    assert base != vcsim.source_hash(b"package main // changed", "go1.19")
    assert base != vcsim.source_hash(b"package main", "go1.22")


def test_cache_root_precedence(tmp_path: Path):
    assert vcsim.cache_root({"VCFSLM_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert vcsim.cache_root({"XDG_CACHE_HOME": "/xdg"}) == Path("/xdg/vcfslm")


def test_missing_toolchain_is_reported_with_the_packages(tmp_path: Path):
    with pytest.raises(vcsim.VcsimUnavailable) as err:
        vcsim.toolchain({"PATH": str(tmp_path), "VCFSLM_GOPATH": str(tmp_path)})
    message = str(err.value)
    assert "govmomi" in message and "golang-github-vmware-govmomi-dev" in message


def test_a_cached_binary_is_reused_without_building(tmp_path: Path, monkeypatch):
    source = tmp_path / "main.go"
    source.write_text("package main\n")
    monkeypatch.setattr(vcsim, "toolchain", lambda: ("/usr/bin/go", "/gopath"))
    monkeypatch.setattr(vcsim, "go_version", lambda go: "go version go1.19")
    key = vcsim.source_hash(source.read_bytes(), "go version go1.19")
    cached = vcsim.binary_path(tmp_path / "cache", key)
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/true\n")

    def no_build(*args, **kwargs):
        raise AssertionError("must not build")

    monkeypatch.setattr(vcsim, "_build", no_build)
    assert vcsim.ensure_built(cache=tmp_path / "cache", source=source) == cached


def test_shipped_source_is_where_the_builder_looks():
    assert vcsim.SOURCE.name == "main.go"
    assert "simulator.VPX()" in vcsim.SOURCE.read_text()


def test_host_names_follow_the_vpx_model():
    assert [vcsim.host_name(i) for i in range(3)] == ["DC0_C0_H0", "DC0_C0_H1", "DC0_C0_H2"]


def test_vcsim_record_round_trips():
    from vcfslm.lab.process import ProcessRecord

    running = vcsim.Vcsim(url="https://127.0.0.1:1/sdk", host="127.0.0.1", port=1, user="u",
                          ca_file="/ca.pem", hosts=4, template="t", api_version="6.5", log="/log",
                          process=ProcessRecord(1, 2, "m"), delay_ms=3, method_delay={"A": 1})
    again = vcsim.Vcsim.from_json(running.to_json())
    assert again == running
    assert again.same_latency(vcsim.VcsimOptions(delay_ms=3, method_delay={"A": 1}))
    assert not again.same_latency(vcsim.VcsimOptions())
