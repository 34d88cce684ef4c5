"""Where things are on a guest, stated once for the guest stage, the launcher and the worker:
the layout (venv, scripts, models, runs; `GuestPaths`), the operator's Inductor cache, and
the model reference a worker on a guest is given (a synthetic shape, a folder pushed to the
guest, or a hub id).

Pure: no I/O beyond `Path.is_dir` on the operator's model path, no third-party imports."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from . import presets
from .serving.servers import VLLM


@dataclass(frozen=True)
class GuestPaths:
    """Where the guest stage puts things on every guest; the bench stage reads the same places."""

    workdir: str
    venv: str
    python: str
    torchrun: str
    launch_dir: str
    env_file: str
    rank_script: str
    hosts_file: str
    runs_dir: str
    models_dir: str
    wheels_dir: str
    wheelhouse_dir: str
    inductor_cache_dir: str
    # vLLM's CPU server (bench.serve.server: vllm): a venv of its own, never vcfslm's; its
    # entry file and one launch script per vNUMA node (vllm-node<N>.sh) are in launch_dir.
    vllm_venv: str
    vllm_python: str
    vllm_entry: str


# The Inductor cache of ranks that run on this machine (`bench --local`, the lab's guests)
# when TORCHINDUCTOR_CACHE_DIR does not name one: kept across runs, so a graph compiled
# once is loaded, not compiled, by every later run of the same torch and shapes.
HOST_INDUCTOR_CACHE = "~/.cache/vcfslm/inductor"


def host_inductor_cache(explicit: str | None, environ) -> Path:
    """`explicit`, else $TORCHINDUCTOR_CACHE_DIR, else HOST_INDUCTOR_CACHE (user expanded)."""
    return Path(explicit or environ.get("TORCHINDUCTOR_CACHE_DIR") or HOST_INDUCTOR_CACHE).expanduser()


def layout_paths(workdir: str, venv: str, vllm_venv: str) -> GuestPaths:
    """The guest layout under `workdir`, with vcfslm's venv and vLLM's (pure)."""
    work, venv, vllm_venv = workdir.rstrip("/"), venv.rstrip("/"), vllm_venv.rstrip("/")
    launch = f"{work}/launch"
    return GuestPaths(workdir=work, venv=venv, python=f"{venv}/bin/python",
                      torchrun=f"{venv}/bin/torchrun", launch_dir=launch,
                      env_file=f"{launch}/env.sh", rank_script=f"{launch}/rank.sh",
                      hosts_file=f"{launch}/hosts", runs_dir=f"{work}/runs",
                      models_dir=f"{work}/models", wheels_dir=f"{work}/wheels",
                      wheelhouse_dir=f"{work}/wheelhouse",
                      inductor_cache_dir=f"{work}/cache/inductor",
                      vllm_venv=vllm_venv, vllm_python=f"{vllm_venv}/bin/python",
                      vllm_entry=f"{launch}/{VLLM.entry}")


def guest_paths(inventory) -> GuestPaths:
    """The inventory's guest layout (the guest stage's reading; the bench gets it in its
    NodeTargets)."""
    work = inventory.guest.workdir.rstrip("/")
    return layout_paths(work, inventory.guest.venv_path, inventory.bench.serve.vllm.venv_path(work))


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# A path the user wrote as one, even before the folder exists on this machine.
_PATH_PREFIXES = ("/", "./", "../", "~")


def model_kind(model: str) -> str | None:
    """'synthetic', 'dir' (a local folder pushed to the guest), 'hub', or None (none of these)."""
    if model.startswith("synthetic:"):
        return "synthetic"
    if model.startswith(_PATH_PREFIXES) or Path(model).expanduser().is_dir():
        return "dir"
    if _HUB_ID.match(model):
        return "hub"
    return None


def model_slug(model: str) -> str:
    """A model source as one folder name (the guest's staged-model folders)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-")


def synthetic_config_on_guest(models_dir: str, model: str) -> str:
    """Where a `synthetic:config=PATH` source's config file is staged on a guest."""
    return f"{models_dir.rstrip('/')}/{model_slug(model)}/config.json"


def guest_model(model: str, models_dir: str) -> str:
    """A model source as the worker on a guest names it: synthetic spec (a config file at
    its staged place under `models_dir`), hub id, or staged folder (pure)."""
    if model_kind(model) == "dir":
        return f"{models_dir.rstrip('/')}/{Path(model).expanduser().name}"
    if model_kind(model) == "synthetic":
        spec = presets.parse_synthetic(model)
        if spec.config_path is not None:
            staged = synthetic_config_on_guest(models_dir, model)
            return str(presets.SyntheticSpec(config_path=staged, layers=spec.layers))
    return model


def model_ref(inventory) -> str:
    """The inventory's guest.model as the worker on a guest names it (guest_model)."""
    return guest_model(inventory.guest.model, guest_paths(inventory).models_dir)
