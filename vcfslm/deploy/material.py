"""The deployment's secrets on the operator's machine: the key file, and beside it the
deployment's CA and the certificates it signed (`<key file's stem>-tls/`, every file
0600, the folder 0700), or the operator's own certificate for the door.

A client of the deployment finds the CA it must trust from the key file it was given
(`client_ca`), so `bench --endpoint URL --key-file F` verifies the door as `serve up
--key-file F` set it up.
"""

from __future__ import annotations

import stat
from collections.abc import Sequence
from pathlib import Path

from ..errors import Problem
from . import tls
from .desired import DeploymentTls
from .keys import KeyFileError, write_private


def tls_folder(key_file: str | Path) -> Path:
    path = Path(key_file).expanduser()
    return path.with_name(f"{path.stem}-tls")


def ca_file(key_file: str | Path) -> Path:
    """The deployment CA's certificate beside `key_file` (what clients trust)."""
    return tls_folder(key_file) / "ca.pem"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except FileNotFoundError:
        return None


def _inventory_path(inventory, value: str) -> Path:
    path = Path(value).expanduser()
    if not path.is_absolute() and inventory.source not in ("<memory>", "<inventory>"):
        path = Path(inventory.source).resolve().parent / path
    return path


def _problem(inventory, key: str, message: str) -> KeyFileError:
    return KeyFileError([Problem(str(inventory.source), None, None, f"serve.front_door.{key}", message)])


def operator_door(inventory, router_ip: str) -> tls.Pair:
    """The door's certificate and key from the files the inventory names, checked: both
    readable, the key private (0600), valid now, naming the router node's address."""
    door = inventory.serve.front_door
    cert_path = _inventory_path(inventory, door.tls_cert_file)
    key_path = _inventory_path(inventory, door.tls_key_file)
    try:
        mode = stat.S_IMODE(key_path.stat().st_mode)
        pair = tls.Pair(cert_path.read_text(), key_path.read_text())
    except OSError as exc:
        raise _problem(inventory, "tls_cert_file", f"{exc.filename}: {exc.strerror}") from None
    if mode & 0o077:
        raise _problem(inventory, "tls_key_file", f"{key_path} is open to group or others (mode {mode:04o}): "
                                                  f"chmod 600 {key_path}")
    problems = tls.problems(pair, [router_ip])
    if problems:
        raise _problem(inventory, "tls_cert_file", f"{cert_path}: " + "; ".join(problems))
    return pair


def deployment_tls(inventory, key_file: str | Path, node_ips: Sequence[str], router_ip: str,
                   *, write: bool = True) -> tuple[DeploymentTls, list[str]]:
    """The deployment's certificates, and the files this call made: the CA beside the key
    (made at the first serve up), a certificate per node address (kept while it serves
    that address for a month more), the door's (the router node's own, or the operator's).
    With write=False (a dry run) nothing is saved."""
    folder = tls_folder(key_file)
    made: list[str] = []

    def save(name: str, text: str) -> None:
        if write:
            if not folder.exists():
                folder.mkdir(parents=True, mode=0o700)
            write_private(folder / name, text)
        made.append(str(folder / name))

    ca_cert, ca_key = _read(folder / "ca.pem"), _read(folder / "ca.key")
    if ca_cert and ca_key:
        ca = tls.Pair(ca_cert, ca_key)
    else:
        ca = tls.make_ca(inventory.serve.name or inventory.name)
        save("ca.pem", ca.cert)
        save("ca.key", ca.key)
    nodes = {}
    for ip in sorted(set(node_ips)):
        cert, key = _read(folder / f"{ip}.pem"), _read(folder / f"{ip}.key")
        held = tls.Pair(cert, key) if cert and key else None
        pair = tls.current_or_new(ca, held, [ip])
        if pair is not held:
            save(f"{ip}.pem", pair.cert)
            save(f"{ip}.key", pair.key)
        nodes[ip] = pair
    settings = inventory.serve.front_door
    if settings.tls and settings.tls_cert_file:
        door_ca = None
        if settings.tls_ca_file:
            try:
                door_ca = _inventory_path(inventory, settings.tls_ca_file).read_text()
            except OSError as exc:
                raise _problem(inventory, "tls_ca_file", f"{exc.filename}: {exc.strerror}") from None
        return DeploymentTls(ca.cert, nodes, operator_door(inventory, router_ip), door_ca, operator_door=True), made
    return DeploymentTls(ca.cert, nodes, nodes[router_ip] if settings.tls else None), made


def client_ca(key_file: str | Path | None, inventory=None) -> str | None:
    """What a vcfslm client trusts at the door: the inventory's tls_ca_file when it names
    one, else the deployment CA beside the key file when there is one (None: the system's
    trust store)."""
    if inventory is not None and inventory.serve.front_door.tls_ca_file:
        return str(_inventory_path(inventory, inventory.serve.front_door.tls_ca_file))
    if inventory is not None and inventory.serve.front_door.tls_cert_file:
        return None
    if key_file is not None and ca_file(key_file).is_file():
        return str(ca_file(key_file))
    return None
