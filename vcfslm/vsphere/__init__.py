"""vCenter side of vcfslm: desired VM, observed state, diff, preflight, and the drivers.

Pure modules (no I/O): `desired` (inventory -> desired VM per node), `state`
(observed snapshot data), `changes` (desired vs observed -> typed changes),
`preflight` (read-only checks over a snapshot), `credentials` (password lookup,
masked). Side effects: `driver` (the only pyVmomi import), `tags` (the only
Automation SDK import: tagging and content-library deploy), orchestrated by
`reconcile`.
"""
