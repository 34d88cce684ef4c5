"""Platform files and probe JSON: what one rank of a platform draws on, and clear errors
(file, line, key; exit 2 through the CLI) for missing or absurd values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vcfslm.analysis.calibration import rank_rates
from vcfslm.errors import PlatformError
from vcfslm.hardware import load_platform, parse_platform, platform_from_flags, platform_from_probe

ROOT = Path(__file__).resolve().parents[2]

GOOD = """\
name: test
numa_nodes: 4
cpus_per_numa_node: 24
bandwidth_gbs: 80
gemm_tflops_per_cpu: 0.5
"""


def test_shipped_platforms_load_and_give_rank_rates():
    testbed = load_platform(ROOT / "platforms" / "vx650v4-6747p.yaml")
    bom = load_platform("vx650v4-6737p")        # by name, from the shipped folder
    for p in (testbed, bom):
        assert (p.numa_nodes, p.cpus_per_numa_node, p.ranks, p.threads, p.basis) == (4, 24, 4, 24, "spec")
    assert rank_rates(testbed).read_gbs == pytest.approx(92.4)
    assert rank_rates(testbed).gemm_tflops == pytest.approx(0.72 * 24)
    # the BOM: the same memory channels, two thirds of the cores behind the same vCPUs
    assert rank_rates(bom).read_gbs == rank_rates(testbed).read_gbs
    assert rank_rates(bom).gemm_tflops == pytest.approx(rank_rates(testbed).gemm_tflops * 2 / 3)


def test_layout_changes_share_the_node_and_keep_the_sockets_bandwidth():
    p = parse_platform(GOOD, "p.yaml")
    eight = p.with_changes(ranks_per_node=8)
    assert (eight.ranks_per_numa_node, eight.threads) == (2, 12)
    assert rank_rates(eight).read_gbs == pytest.approx(40.0)          # two ranks share a node
    assert rank_rates(eight).gemm_tflops == pytest.approx(0.5 * 12)
    two_nodes = p.with_changes(vnuma_nodes=2)                          # the same host, two bigger nodes
    assert (two_nodes.numa_nodes, two_nodes.cpus_per_numa_node, two_nodes.bandwidth_gbs) == (2, 48, 160.0)
    assert rank_rates(p.with_changes(threads_per_rank=12)).gemm_tflops == pytest.approx(6.0)
    with pytest.raises(PlatformError, match="threads_per_rank 48 x 1 rank"):
        p.with_changes(threads_per_rank=48)
    with pytest.raises(PlatformError, match="does not split evenly over 4 vNUMA nodes"):
        p.with_changes(ranks_per_node=6)


def test_probe_curve_rescaled_to_a_rank_share():
    text = GOOD + "decode_linears: {rows: [1, 16], gbs: [80, 40], threads: 24, read_gbs: 80}\n"
    p = parse_platform(text, "p.yaml")
    same = rank_rates(p)
    assert same.decode_gbs == pytest.approx((80.0, 40.0))
    shared = rank_rates(p.with_changes(ranks_per_node=8))    # half the bandwidth, half the threads
    per = [1 / 80 * 2, 1 / 80 * 2 + (1 / 40 - 1 / 80) * 2]
    assert shared.decode_gbs == pytest.approx(tuple(1 / x for x in per))


@pytest.mark.parametrize("old, new, line", [
    ("bandwidth_gbs: 80\n", "", "p.yaml:1:1: bandwidth_gbs: required key is missing"),
    ("bandwidth_gbs: 80", "bandwidth_gbs: 80000",
     "p.yaml:4:1: bandwidth_gbs: Input should be less than or equal to 2000 (got 80000)"),
    ("gemm_tflops_per_cpu: 0.5", "gemm_tflops_per_cpu: -1",
     "p.yaml:5:1: gemm_tflops_per_cpu: Input should be greater than 0 (got -1)"),
    ("numa_nodes: 4", "numa_nodes: four",
     "p.yaml:2:1: numa_nodes: Input should be a valid integer, unable to parse string as an integer (got 'four')"),
    ("name: test", "name: test\nbandwith_gbs: 1", "p.yaml:2:1: bandwith_gbs: unknown key (did you mean 'bandwidth_gbs'?)"),
    ("name: test", "name: test\nname: again", "p.yaml:2:1: name: duplicate key"),
])
def test_platform_file_errors_name_file_line_and_key(old, new, line):
    with pytest.raises(PlatformError) as err:
        parse_platform(GOOD.replace(old, new), "p.yaml")
    assert line in str(err.value).splitlines()


def test_layout_that_does_not_fit_is_refused_in_the_file():
    with pytest.raises(PlatformError) as err:
        parse_platform(GOOD + "threads_per_rank: 32\n", "p.yaml")
    assert "threads_per_rank 32 x 1 rank(s) per vNUMA node needs 32 vCPUs; a node has 24" in str(err.value)


def probe_rows(nodes: int = 2, **over):
    row = {"numa_node": 0, "read_gbs": 30.0, "threads": 8, "triad_gbs": 28.0,
           "gemm": {"tflops": 0.8, "threads": 8},
           "decode_linears": {"rows": [1, 4, 16], "gbs": [30.0, 30.0, 12.0], "threads": 8}}
    row.update(over)
    return [{**row, "numa_node": i} for i in range(nodes)]


def test_probe_json_is_a_measured_platform(tmp_path):
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe_rows()))
    p = load_platform(path)
    assert (p.numa_nodes, p.cpus_per_numa_node, p.bandwidth_gbs, p.basis) == (2, 8, 30.0, "measured")
    assert p.gemm_tflops_per_cpu == pytest.approx(0.1)
    r = rank_rates(p)
    assert r.decode_rows == (1, 4, 16) and r.decode_gbs == pytest.approx((30.0, 30.0, 12.0))


def test_probe_json_without_gemm_or_bandwidth_is_refused(tmp_path):
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe_rows(gemm=None, read_gbs=0)))
    with pytest.raises(PlatformError) as err:
        load_platform(path)
    lines = str(err.value).splitlines()
    assert f"{path}: [0].read_gbs: missing or not a positive number" in lines
    assert (f"{path}: [1].gemm: missing the GEMM rate (probe run with --no-gemm, or an older vcfslm)"
            in lines)
    path.write_text("[1, 2")
    with pytest.raises(PlatformError, match="not valid JSON"):
        load_platform(path)
    with pytest.raises(PlatformError, match="file not found"):
        load_platform(tmp_path / "nope.yaml")


def test_flags_make_a_platform_and_refuse_absurd_values():
    p = platform_from_flags(40.0, 2.0, threads_per_rank=4)
    r = rank_rates(p)
    assert (r.read_gbs, r.gemm_tflops) == (40.0, pytest.approx(2.0))
    with pytest.raises(PlatformError) as err:
        platform_from_flags(40000.0, 2.0)
    assert str(err.value).startswith("--bandwidth-gbs: ")


def test_probe_rows_helper_is_a_valid_list():
    assert platform_from_probe(probe_rows(1)).numa_nodes == 1


def test_a_spec_platforms_stream_bandwidth_is_carried_into_the_fits_probe_units():
    from vcfslm.analysis.calibration import PHI3_MINI_DIMS, stream_transfer
    from vcfslm.analysis.perfmodel import Observation, RankRates, Scenario

    measured = RankRates(36.0, 0.45, (1, 4), (42.0, 40.0), triad_gbs=30.0)
    obs = [Observation(Scenario(1, 128, 8), 250.0, 3.0, measured, PHI3_MINI_DIMS)]
    transfer = stream_transfer(obs)
    assert (transfer.read, transfer.linear, transfer.triad_gbs) == pytest.approx((1.2, 1.4, 30.0))
    testbed = load_platform(ROOT / "platforms" / "vx650v4-6747p.yaml")
    r = rank_rates(testbed, transfer)
    assert r.read_gbs == pytest.approx(92.4 * 1.2) and r.linear_gbs == pytest.approx(92.4 * 1.4)
    assert r.gemm_tflops == rank_rates(testbed).gemm_tflops
    # without a triad (a CSV's rates, an older run) nothing is carried; nor onto a measured platform
    assert stream_transfer([Observation(Scenario(1, 128, 8), 250.0, 3.0, RankRates(36.0, 0.45),
                                        PHI3_MINI_DIMS)]) is None
    probed = platform_from_flags(40.0, 0.5).model_copy(update={"basis": "measured"})
    assert rank_rates(probed, transfer) == rank_rates(probed)
