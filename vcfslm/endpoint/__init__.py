"""Load through one endpoint: the operator's client of a running deployment's front door
(client.py), the faults it injects and the outages it reads (faults.py)."""
