"""Bandwidth probe (real, small buffer) and roofline arithmetic; placement parsers."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from vcfslm import roofline
from vcfslm import steadiness as st
from vcfslm.bench import placement, probe


def test_roofline_arithmetic():
    # 7.445 GB of weights at 35 GB/s: the brief's 213 ms floor
    assert roofline.roofline_tpot_ms(7.445e9, 35.0) == pytest.approx(212.71, abs=0.01)
    assert roofline.roofline_tpot_ms(1e9, 0) is None
    step = roofline.decode_step_bytes(7_445_000_000, 393_216, batch=16, context_tokens=192)
    assert step == 7_445_000_000 + 16 * 192 * 393_216
    assert roofline.mean_decode_context(128, 128) == 192
    assert roofline.mean_decode_context(128, 1) == 128


def test_probe_returns_positive_sane_figures():
    pytest.importorskip("torch")
    bw = probe.measure_bandwidth(threads=1, mib=64, repeats=2)
    assert 0.1 < bw.read_gbs < 2000 and 0.1 < bw.triad_gbs < 2000
    assert bw.threads == 1 and bw.buffer_bytes == 64 * 1024 * 1024


def test_a_sustained_read_reads_whole_passes_of_at_least_the_bytes_asked():
    pytest.importorskip("torch")
    read = probe.SustainedRead(mib=4)
    assert read.buffer_bytes == 4 * 1024 * 1024
    sustained = read.gbs(read.buffer_bytes * 3)
    assert 0.1 < sustained < 2000 and read.fastest_pass_gbs >= sustained * (1 - 1e-9)

    class Counted:
        passes = 0

        def sum(self):
            Counted.passes += 1

    read.buffer = Counted()
    for nbytes, passes in ((0, 1), (1, 1), (read.buffer_bytes, 1), (read.buffer_bytes + 1, 2),
                           (5 * read.buffer_bytes, 5)):
        Counted.passes = 0
        read.gbs(nbytes)
        assert Counted.passes == passes, nbytes


def test_probe_module_prints_json():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-m", "vcfslm.bench.probe", "--mib", "32", "--repeats", "1",
                          "--threads", "1"], capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["read_gbs"] > 0 and result["threads"] == 1 and "cpu_affinity" in result
    assert result["gemm"]["tflops"] > 0 and result["gemm"]["k"] == 3072 and result["gemm"]["n"] == 8192


NUMA_MAPS = """\
7f0000000000 bind:0 anon=2048 dirty=2048 N0=2048 kernelpagesize_kB=4
7f1000000000 bind:0 anon=10 dirty=10 N0=6 N1=4 kernelpagesize_kB=4
7f2000000000 default file=/usr/lib/libc.so.6 mapped=100 N1=100 kernelpagesize_kB=4
7f3000000000 default anon=2 N0=2 kernelpagesize_kB=2048
"""

NUMACTL_SHOW = """\
policy: bind
preferred node: 1
physcpubind: 24 25 26
cpubind: 1
nodebind: 1
membind: 1
preferred:
"""


def test_parse_numa_maps():
    per_node = placement.parse_numa_maps(NUMA_MAPS)
    assert per_node == {0: (2048 + 6) * 4096 + 2 * 2048 * 1024, 1: (4 + 100) * 4096}
    assert placement.dominant_node(per_node) == 0
    assert placement.dominant_node({}) is None


def test_parse_numactl_show():
    show = placement.parse_numactl_show(NUMACTL_SHOW)
    assert show["policy"] == "bind" and show["preferred_node"] == "1"
    assert show["physcpubind"] == [24, 25, 26] and show["membind"] == [1] and show["preferred"] == []


def test_cpu_flags_and_bf16_facts():
    flags = placement.parse_cpu_flags("processor: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    facts = placement.bf16_facts(None, flags)
    assert facts["amx"] and facts["avx512_bf16"] and "amx_bf16" in facts["cpu_flags"]
    assert not placement.bf16_facts(None, {"avx2"})["amx"]


def test_node_cpu_lists_and_nodes_of_cpus(tmp_path):
    for node, cpus in ((0, "0-1,4"), (1, "2-3")):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(cpus + "\n")
    nodes = placement.node_cpu_lists(tmp_path)
    assert nodes == {0: (0, 1, 4), 1: (2, 3)}
    assert placement.nodes_of_cpus([3, 4], nodes) == [0, 1]


def test_placement_facts_of_this_process():
    torch = pytest.importorskip("torch")
    facts = placement.placement_facts(torch)
    assert facts["cpus"] >= 1 and facts["threads"] == torch.get_num_threads()
    assert facts["cpu_capability"] and facts["versions"]["torch"] == torch.__version__
    assert facts["memory_numa_node"] is not None
    assert isinstance(facts["onednn_bf16"], bool)


def test_flop_counts_and_floors_of_the_phi3_mini_shape():
    from vcfslm.engine.model import phi3_mini_config

    pytest.importorskip("transformers")
    config = phi3_mini_config()
    # 113.2M matrix parameters per layer and token, 32 layers, lm_head 3072 x 32064
    per_token = 2 * (113_246_208 * 32)
    assert roofline.prefill_flops(config, 1, 1) == pytest.approx(per_token + 4 * 3072 * 32 + 2 * 3072 * 32064)
    b16 = roofline.prefill_flops(config, 16, 32)
    assert b16 == pytest.approx(16 * 32 * per_token + 4 * 16 * 32 * 16.5 * 3072 * 32 + 16 * 2 * 3072 * 32064)
    assert 3.7e12 < b16 < 3.9e12  # ~3.9 TFLOP for 512 prompt tokens, the usual estimate
    step = roofline.decode_step_flops(config, 16, 48)
    assert step == pytest.approx(16 * (per_token + 2 * 3072 * 32064) + 4 * 16 * 48 * 3072 * 32)
    # floors: the larger of memory and compute
    assert roofline.roofline_ttft_s(1e12, 0.5, weight_bytes=7.6e9, read_gbs=38) == pytest.approx(2.0)
    assert roofline.roofline_ttft_s(1e10, 0.5, weight_bytes=7.6e9, read_gbs=38) == pytest.approx(0.2)
    assert roofline.roofline_ttft_s(1e12, None) is None
    assert roofline.roofline_tpot_ms(7.6e9, 38.0, step_flops=1.2e11, tflops=0.4) == pytest.approx(300.0)
    assert roofline.roofline_tpot_ms(7.6e9, 38.0, step_flops=1.2e10, tflops=0.4) == pytest.approx(200.0)


def test_gemm_probe_measures_every_candidate_kernel():
    pytest.importorskip("torch")
    rate = probe.measure_gemm(threads=1, rows=(32,), k=256, n=512, repeats=1)
    assert rate.tflops > 0 and rate.rows == 32 and rate.kernel.startswith(("engine", "F.linear"))
    assert len(rate.rates) == 2 and max(rate.rates.values()) == pytest.approx(rate.tflops, rel=1e-3)
    bw = probe.measure_bandwidth(threads=1, mib=32, repeats=1)
    assert set(bw.read_kernels) == {"sum", "sgemv", "engine bf16 linear"}
    assert bw.read_gbs == pytest.approx(max(bw.read_kernels.values()), rel=0.01)



def test_gemm_probe_stops_growing_m_once_a_call_is_compute_bound(monkeypatch):
    # Calls far under the bound: every M is measured; every call over it: the first M only.
    pytest.importorskip("torch")
    monkeypatch.setattr(probe, "GEMM_LARGER_M_BELOW_S", 60.0)
    both = probe.measure_gemm(threads=1, rows=(16, 32), k=256, n=512, repeats=1)
    assert {key.rpartition(" M=")[2] for key in both.rates} == {"16", "32"}
    monkeypatch.setattr(probe, "GEMM_LARGER_M_BELOW_S", 0.0)
    first = probe.measure_gemm(threads=1, rows=(16, 32), k=256, n=512, repeats=1)
    assert {key.rpartition(" M=")[2] for key in first.rates} == {"16"} and first.rows == 16

STATUS = """\
Name:\tpython
Tgid:\t4242
Cpus_allowed:\tffffff
Cpus_allowed_list:\t24-47
Mems_allowed:\t00000000,00000002
Mems_allowed_list:\t1
voluntary_ctxt_switches:\t10
"""

# field 39 (the CPU last run on) is 31 here; the command name holds spaces and parentheses
TASK_STAT = ("4243 (pt worker (1)) S 4242 4242 100 0 -1 4194560 10 0 0 0 5 1 0 0 20 0 26 0 1000 "
             "123456 789 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 31 0 0 0 0 0")


def test_status_binding_and_task_cpu_from_proc_text():
    assert placement.parse_status_binding(STATUS) == {"cpus": "24-47", "mems": "1"}
    assert placement.parse_status_binding("Name:\tx\n") == {}
    assert placement.parse_task_cpu(TASK_STAT) == 31
    assert placement.parse_task_cpu("4243 (short) S 1 2") is None
    assert placement.parse_task_cpu("garbage") is None


def test_thread_cpus_reads_every_task(tmp_path):
    for tid, cpu, allowed in ((4242, 24, "24-47"), (4243, 31, "31")):
        task = tmp_path / str(tid)
        task.mkdir()
        (task / "stat").write_text(TASK_STAT.replace("4243", str(tid)).replace(" 17 31 ", f" 17 {cpu} "))
        (task / "status").write_text(STATUS.replace("24-47", allowed))
    threads = placement.thread_cpus(tmp_path)
    assert threads == {4242: {"cpu": 24, "allowed": "24-47"}, 4243: {"cpu": 31, "allowed": "31"}}
    assert placement.single_cpu_threads(threads) == [31]


@pytest.mark.parametrize("kw, expected", [
    (dict(process_cpus="24-47", process_mems="1", intended_cpus="24-47", intended_node=1), []),
    (dict(process_cpus="0-95", process_mems="0-3", intended_cpus="24-47", intended_node=1),
     ["placement: process CPUs 0-95 != intended 24-47", "placement: memory nodes 0-3 != intended node 1"]),
    (dict(process_cpus="24-47", process_mems="1", intended_cpus="24-47", intended_node=1, memory_node=0),
     ["placement: most memory on node 0, intended node 1"]),
    (dict(process_cpus="24-47", process_mems=None, intended_cpus=None, intended_node=None,
          threads={1: {"cpu": 30}, 2: {"cpu": 5}, 3: {"cpu": 50}}),
     ["placement: threads ran on CPU(s) 5,50 outside 24-47"]),
    (dict(process_cpus=None, process_mems=None, intended_cpus="24-47", intended_node=1), []),
])
def test_placement_problems(kw, expected):
    assert placement.placement_problems(**kw) == expected


def test_placement_facts_read_the_binding_given_at_start_not_the_bound_main_thread(monkeypatch):
    """OpenMP binds the main thread to one core; the facts keep what numactl gave the process."""
    monkeypatch.setenv("VCFSLM_CPUS", "0-3")
    monkeypatch.setenv("VCFSLM_NUMA_NODE", "0")
    monkeypatch.setenv("VCFSLM_PIN", "numactl")
    facts = placement.placement_facts(None, {"cpus": "0-3", "mems": "0"})
    assert facts["cpu_affinity"] == "0-3" and facts["cpus"] == 4 and facts["memory_nodes_allowed"] == "0"
    monkeypatch.setenv("VCFSLM_PIN", "none")  # nothing applied the intent: nothing to compare
    assert placement.placement_facts(None, {"cpus": "0-95", "mems": "0-3"})["problems"] == []
    monkeypatch.setenv("VCFSLM_PIN", "numactl")
    wrong = placement.placement_facts(None, {"cpus": "0-95", "mems": "0"})
    assert wrong["problems"][0] == "placement: process CPUs 0-95 != intended 0-3"


def test_decode_linears_curve_is_measured_per_row_count():
    pytest.importorskip("torch")
    curve = probe.measure_decode_linears(threads=1, rows=(1, 4, 16), mib=32, repeats=1)
    assert curve.rows == (1, 4, 16) and len(curve.gbs) == 3 and all(g > 0 for g in curve.gbs)
    assert curve.buffer_bytes >= 30 * 1024 * 1024 and curve.threads == 1


# ---------------------------------------------------------------- a probe that notices a busy machine


def test_probe_json_carries_each_figures_spread_and_the_verdict():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-m", "vcfslm.bench.probe", "--mib", "16", "--repeats", "3",
                          "--threads", "1", "--no-gemm"], capture_output=True, text=True, check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["spreads"]) == {"read", "triad"}
    for spread in result["spreads"].values():
        assert set(spread) == {"passes", "best_s", "median_s", "spread"} and spread["passes"] == 3
        assert spread["spread"] == pytest.approx(spread["median_s"] / spread["best_s"] - 1, abs=1e-3)
    steadiness = result["steadiness"]
    assert steadiness["spreads"] == result["spreads"]
    assert steadiness["verdict"] == ("busy" if steadiness["reasons"] else "steady")
    assert steadiness["limits"] == {"spread": st.SPREAD_LIMIT, "others_share": st.OTHERS_SHARE_LIMIT,
                                    "steal_share": st.STEAL_SHARE_LIMIT,
                                    "shortest_pass_s": st.SHORTEST_JUDGED_PASS_S}
    # 16 MiB passes take well under 10 ms: kept, not judged.
    assert steadiness["unjudged"] == [name for name, s in result["spreads"].items()
                                      if s["best_s"] < st.SHORTEST_JUDGED_PASS_S]
    others = steadiness["others_cpu"]
    # Linux has /proc/stat: the share is measured over the CPUs the probe was given.
    assert others["unknown"] is None and 0 <= others["share"] <= 1
    assert others["cpus"] == len(placement.parse_cpu_list(result["cpu_affinity"]))
    assert others["wall_s"] > 0 and others["own_s"] > 0


def test_the_whole_probe_is_watched_and_judged():
    pytest.importorskip("torch")
    probed = probe.measure_probe(threads=1, mib=16, repeats=2, gemm=False)
    assert probed.gemm is None and probed.decode_linears is None
    assert set(probed.steadiness.spreads) == {"read", "triad"}
    assert probed.bandwidth.steadiness == probed.steadiness.to_dict()
    assert probed.steadiness.others.wall_s > 0


def test_best_keeps_the_fastest_pass_and_records_every_pass():
    clock = iter([0.0, 3.0, 3.0, 4.0, 4.0, 6.0])   # passes of 3, 1 and 2 s (the first, untimed call aside)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
        with probe._recording() as outer:
            with probe._recording() as inner:
                best = probe._best(lambda: None, 3)
    assert best == 1.0 and inner == outer == [(3.0, 1.0, 2.0)]
    assert probe._RECORDINGS == []
    assert probe._passes_of([(3.0, 1.0), (2.0, 1.5)], 1.5) == (2.0, 1.5)
    assert probe._passes_of([(3.0, 1.0), (1.0, 2.0)], 1.0) is None    # two calls match: unknown, not a guess


def test_the_decode_curve_is_judged_at_its_first_row():
    curve = probe.DecodeLinears(rows=(1, 4, 16), gbs=(20.0, 10.0, 5.0), kernel="k", threads=1, buffer_bytes=1,
                                seconds=1.0)
    runs = [(1.0, 1.01, 1.02), (2.0, 2.6, 2.2), (4.0, 4.1, 4.0)]
    assert probe._curve_spreads(curve, runs) == {"decode linears at 1 row": st.Spread(3, 1.0, 1.01)}
    assert probe._curve_spreads(curve, runs[:2]) == {}     # calls that do not line up with the rows


def _node_json(numa_node, verdict: st.Steadiness | None) -> dict:
    row = {"read_gbs": 21.7, "triad_gbs": 18.0, "read_kernel": "sum", "threads": 2, "buffer_bytes": 64 << 20,
           "cpu_affinity": "0-1", "gemm": {"tflops": 0.438, "kernel": "engine onednn"},
           "decode_linears": {"rows": [1, 2], "gbs": [24.4, 23.0]}}
    if verdict is not None:
        row["steadiness"] = verdict.to_dict()
    return row


QUIET = st.OthersCpu(cpus=2, wall_s=9.0, own_s=17.9, others_s=0.05, share=0.003, steal_share=0.0)
LOADED = st.OthersCpu(cpus=2, wall_s=9.0, own_s=9.0, others_s=8.8, share=0.49, steal_share=0.0)
SPREADS = {"read": st.Spread(5, 1.0, 1.01), "triad": st.Spread(5, 1.0, 1.02)}


@pytest.fixture
def fake_probe_runs(monkeypatch):
    """`vcfslm probe --no-numactl` with the probe process's JSON given, not measured."""
    rows: list[dict] = []

    def run(cmd, **kwargs):
        assert cmd[1:3] == ["-m", "vcfslm.bench.probe"]
        return subprocess.CompletedProcess(cmd, 0, stdout=json.dumps(rows.pop(0)) + "\n", stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    return rows


def test_probe_command_says_a_busy_machine_in_text_and_json(fake_probe_runs):
    from click.testing import CliRunner

    from vcfslm.cli import main

    busy = st.judge(SPREADS, LOADED)
    fake_probe_runs.append(_node_json(None, busy))
    result = CliRunner().invoke(main, ["probe", "--no-numactl"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "the whole machine: busy: other processes took 49% of the 2 CPUs the probe ran on (limit 10%)" in lines
    assert ("warning: the probe of the whole machine was taken on a busy machine: its figures are likely low; "
            "rerun `vcfslm probe` on a quiet machine before scaling SLOs or predicting from them") in lines
    assert ("|       all |  0-1 |       2 |      21.7 |         sum |       18.0 |         64 |        0.438 | "
            "engine onednn |                   1:24 2:23 |    busy |") in lines

    fake_probe_runs.append(_node_json(None, busy))
    result = CliRunner().invoke(main, ["probe", "--no-numactl", "-o", "json"])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert row["steadiness"] == busy.to_dict() and row["numa_node"] is None
    assert result.stderr.splitlines() == [
        "warning: the probe of the whole machine was taken on a busy machine: its figures are likely low; "
        "rerun `vcfslm probe` on a quiet machine before scaling SLOs or predicting from them"]


def test_probe_command_on_a_quiet_machine_and_from_an_older_probe(fake_probe_runs):
    from click.testing import CliRunner

    from vcfslm.cli import main

    fake_probe_runs.append(_node_json(None, st.judge(SPREADS, QUIET)))
    result = CliRunner().invoke(main, ["probe", "--no-numactl"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "the whole machine: steady: spreads read 1.0%, triad 2.0%; others took 0.3% of 2 CPUs" in lines
    assert not any("warning" in line for line in lines)
    # A probe process without the check (an older vcfslm on the node): a dash, no claim either way.
    fake_probe_runs.append(_node_json(None, None))
    result = CliRunner().invoke(main, ["probe", "--no-numactl", "-o", "json"])
    assert result.exit_code == 0 and result.stderr == ""
    assert "steadiness" not in json.loads(result.stdout)[0]
    fake_probe_runs.append(_node_json(None, None))
    result = CliRunner().invoke(main, ["probe", "--no-numactl"], env={"COLUMNS": "300"})
    assert not any(line.startswith("the whole machine:") for line in result.stdout.splitlines())
    assert ("|       all |  0-1 |       2 |      21.7 |         sum |       18.0 |         64 |        0.438 | "
            "engine onednn |                   1:24 2:23 |       - |") in result.stdout.splitlines()
