"""Serving simulated from measured step costs: one server's scheduler step by step (runs of
plain decode steps jumped over in closed form), fleets of them behind the router's policies,
judged by the bench's own code (docs/predict.md)."""
