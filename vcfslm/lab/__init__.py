"""The local lab: a real vCenter simulator (vcsim) and real sshd guests on one machine.

`lab.up/status/down` run it; `vcsim` builds and starts the simulator; `guests`
starts the loopback SSH guests; `generate` writes the lab inventory and env
file; `process` records and stops exactly the processes the lab started.
"""
