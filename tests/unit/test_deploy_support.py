"""Builders shared by the deploy tests: a small cluster inventory (two vNUMA nodes per VM,
one rank on each, three nodes) serving a local model folder, and its deployment."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from vcfslm.deploy import tls
from vcfslm.deploy.desired import SUPERVISORD, DeploymentTls, plan_deployment
from vcfslm.inventory import parse_inventory

KEY = "k3y-Sekr1t-0123456789abcdefABCDEF"
NODES = ("slm-01", "slm-02", "slm-03")
BENCH_IPS = {"slm-01": "10.20.1.11", "slm-02": "10.20.1.12", "slm-03": "10.20.1.13"}


def model_folder(tmp: Path) -> Path:
    """A model folder as `vcfslm model write` leaves it: its config.json is enough here."""
    model = tmp / "models" / "tiny-llm"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2,
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "max_position_embeddings": 4096}))
    return model


def inventory_doc(tmp: Path, *, model: str | None = None) -> dict:
    """A lab-like cluster of three 4-vCPU VMs, two vNUMA nodes each, one rank per node."""
    return {
        "name": "slm",
        "vcenter": {"host": "vc.example.local", "user": "administrator@vsphere.local",
                    "password_env": "VCFSLM_VCENTER_PASSWORD"},
        "placement": {"datacenter": "DC0", "cluster": "DC0_C0", "datastore": "LocalDS_0",
                      "folder": "vcfslm", "template": "vcfslm-template",
                      "networks": {"management": {"portgroup": "VM Network", "netmask": "255.255.255.0"},
                                   "bench": {"portgroup": "bench-pg", "netmask": "255.255.255.0"}}},
        "vm": {"vcpus": 4, "cores_per_socket": 2, "vnuma_nodes": 2, "memory_gb": 16,
               "host_numa_nodes": [0, 1]},
        "nodes": [{"name": name, "host": f"esx0{i}.example.local", "management_ip": f"10.20.0.{11 + i}",
                   "bench_ip": BENCH_IPS[name]} for i, name in enumerate(NODES)],
        "guest": {"user": "root", "model": model or str(model_folder(tmp)), "workdir": str(tmp / "work")},
        "bench": {"ranks_per_node": 2, "threads_per_rank": 2, "batch_sizes": [1, 2], "input_tokens": [16, 32],
                  "output_tokens": 8, "serve": {"slots": 6, "vllm": {"reserved_cores": 0}}},
        "serve": {},
    }


def dump(doc: dict) -> str:
    return yaml.safe_dump(doc, sort_keys=False)


def build(doc: dict, label: str = "cluster.yaml"):
    return parse_inventory(dump(doc), label)


def inventory(tmp: Path, serve: dict | None = None, vllm: dict | None = None, **guest):
    """The cluster with `serve` as its serve section, `vllm` merged into bench.serve.vllm."""
    doc = inventory_doc(tmp)
    doc["serve"] = dict(serve or {})
    doc["bench"]["serve"]["vllm"].update(vllm or {})
    doc["guest"].update(guest)
    return build(doc)


_CA = tls.make_ca("slm")
CERTIFICATES = DeploymentTls(_CA.cert, {ip: tls.issue(_CA, [ip]) for ip in BENCH_IPS.values()},
                             None)
CERTIFICATES = DeploymentTls(_CA.cert, CERTIFICATES.nodes, CERTIFICATES.nodes[BENCH_IPS["slm-01"]])


def deployment(inv, key: str = KEY, supervisor: str = SUPERVISORD, nodes=None, certificates=None, api_keys=None):
    """The deployment's plan, with one CA and its certificates made once per test session."""
    return plan_deployment(inv, key, {n.name: supervisor for n in inv.nodes}, nodes,
                           tls=certificates or CERTIFICATES, api_keys=api_keys)
