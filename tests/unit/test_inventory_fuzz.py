"""The loader never raises anything but InventoryError, whatever the text."""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vcfslm.errors import InventoryError
from vcfslm.inventory_load import parse_inventory

BRIEF = yaml.safe_load((Path(__file__).resolve().parents[2] / "inventories" / "vx650v4-4node.yaml").read_text())

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
                    st.text(max_size=12))
values = st.recursive(scalars, lambda c: st.one_of(st.lists(c, max_size=4),
                                                   st.dictionaries(st.text(max_size=8), c, max_size=4)),
                      max_leaves=12)


def _load(text: str) -> None:
    try:
        parse_inventory(text, "fuzz.yaml")
    except InventoryError as exc:
        assert exc.problems and all(p.file == "fuzz.yaml" for p in exc.problems)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=200))
def test_arbitrary_text(text):
    _load(text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["vcenter", "placement", "vm", "nodes", "guest", "bench", "slos", "name"]),
       values)
def test_brief_with_one_section_replaced(section, value):
    data = dict(BRIEF)
    data[section] = value
    _load(yaml.safe_dump(data))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["vcpus", "cores_per_socket", "vnuma_nodes", "memory_gb"]),
       st.integers(-5, 400))
def test_vm_numbers(key, number):
    data = {**BRIEF, "vm": {**BRIEF["vm"], key: number}}
    _load(yaml.safe_dump(data))
