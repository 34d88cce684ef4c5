"""vCenter side of vcfslm: desired VM, observed state, diff, preflight, and the drivers.

The per-VM settings they all read are one table, `vcfslm/vm_settings.py` (pure; the
inventory and the lab read it too, so it lives beside the inventory, not in here).

Pure modules (no I/O): `desired` (inventory -> desired VM per node), `state`
(observed snapshot data), `snapshot` (property-collector results -> snapshot),
`changes` (desired vs observed -> typed changes), `specs` (changes -> vSphere
specs), `preflight` (read-only checks over a snapshot), `credentials` (password
lookup, masked). Side effects: `session` (login, retries, logout), `tasks`
(waiting on tasks and guest IPs) and `driver` (observe and per-VM changes,
composing them): the only pyVmomi imports; `tags` (the only Automation SDK
import: tagging and content-library deploy); all orchestrated by `reconcile`
(which also runs the per-VM pool).
"""
