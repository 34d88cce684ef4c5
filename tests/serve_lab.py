"""What the serving tests on the lab share: a free loopback port, the fake OpenAI server
(tests/fake_openai.py) standing in for vLLM's interpreter, the lab's inventory serving on
both guests with launch scripts rendered as the vllm playbook renders them, and the CLI run
against the lab."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from vcfslm.guest import vllm as guest_vllm
from vcfslm.guest.templates import render_template
from vcfslm.inventory_load import load_inventory

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".venv-vllm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_python(folder: Path, token_s: float | None = None) -> Path:
    """An 'interpreter' for the launch scripts that runs the fake server instead of vLLM."""
    path = folder / "fake-python"
    pace = f"export FAKE_TOKEN_S={token_s}\n" if token_s is not None else ""
    path.write_text(f"#!/usr/bin/env bash\nexport PYTHONPATH={ROOT}\n{pace}"
                    f"exec {sys.executable} -m tests.fake_openai \"$@\"\n")
    path.chmod(0o755)
    return path


def serve_inventory(lab, tmp: Path, token_s: float | None = None) -> Path:
    """The lab's inventory serving on both guests, the fake server in vLLM's place."""
    doc = yaml.safe_load(lab.inventory.read_text())
    model = tmp / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "vocab_size": 512, "num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 128,
        "num_hidden_layers": 2, "max_position_embeddings": 4096}))
    doc["guest"]["model"] = str(model)
    doc["guest"]["workdir"] = str(tmp / "work")
    doc["bench"]["serve"]["vllm"]["venv"] = str(VLLM_VENV)
    base = free_port()
    doc["serve"] = {"nodes": ["slm-01", "slm-02"], "port": base if base < 60000 else 18200,
                    "router": {"port": free_port(), "prometheus_port": free_port(), "health_check_interval_s": 1},
                    "front_door": {"port": free_port()}, "health_timeout_s": 60}
    path = tmp / "serve.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    python = fake_python(tmp, token_s)
    for item in guest_vllm.launch_scripts(load_inventory(path)):
        dest = Path(item["dest"])
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(render_template("vllm.sh.j2", {**item["vars"], "python": str(python), "entry": "vllm-entry.py",
                                                       "kv_cache_gib": 1, "use_numactl": False, "env_file": ""}))
        dest.chmod(0o755)
    return path


def lab_cli(lab, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`vcfslm ARGS` against the lab's vCenter and guests."""
    env = {**os.environ, **lab.env, "VCFSLM_STATE": str(lab.dir / "state.json")}
    return subprocess.run([sys.executable, "-m", "vcfslm.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)
