"""Was a probe taken on a quiet machine (vcfslm/steadiness.py): /proc/stat, the share, the verdict."""

from __future__ import annotations

import pytest

from vcfslm import steadiness as st

# /proc/stat as a 2-CPU Linux writes it (user nice system idle iowait irq softirq steal guest
# guest_nice), with the lines the parser has no use for.
BEFORE = """\
cpu  25334 0 6945 14080 254 0 145 339 0 0
cpu0 12510 0 3134 7617 89 0 14 168 0 0
cpu1 12823 0 3810 6463 164 0 131 170 0 0
intr 260875 0 0 0 0
ctxt 409597
btime 1700000000
processes 7000
procs_running 3
softirq 1 2 3
"""
# 2 s later: cpu0 busy +150 ticks (user 120, system 20, softirq 10), cpu1 +100 (user 100), and
# 12 ticks of steal on cpu1.
AFTER = """\
cpu  25554 0 6965 14130 254 0 155 351 0 0
cpu0 12630 0 3154 7667 89 0 24 168 0 0
cpu1 12923 0 3810 6463 164 0 131 182 0 0
intr 261000 0 0 0 0
ctxt 409999
"""


def test_parse_proc_stat_reads_every_cpu_line_and_nothing_else():
    parsed = st.parse_proc_stat(BEFORE)
    assert parsed == {None: st.CpuJiffies(busy=25334 + 6945 + 145, idle=14080 + 254, steal=339),
                      0: st.CpuJiffies(busy=12510 + 3134 + 14, idle=7617 + 89, steal=168),
                      1: st.CpuJiffies(busy=12823 + 3810 + 131, idle=6463 + 164, steal=170)}


def test_parse_proc_stat_takes_an_old_kernels_four_fields_and_skips_broken_lines():
    parsed = st.parse_proc_stat("cpu  10 2 3 40\ncpu0 10 2 3 40\ncpu1 x y z w\ncpu2 1 2\ncpufreq 1 2 3 4\n")
    assert parsed == {None: st.CpuJiffies(busy=15, idle=40, steal=0), 0: st.CpuJiffies(busy=15, idle=40, steal=0)}
    assert st.parse_proc_stat("") == {}


def test_others_share_is_busy_time_less_the_probes_own_over_wall_time_times_cpus():
    # 2.5 s busy on the two CPUs in 2 s, 1.5 s of it the probe's: others 1.0 s of 4 CPU-seconds.
    others = st.others_cpu(BEFORE, AFTER, [0, 1], own_cpu_s=1.5, wall_s=2.0, ticks_per_s=100)
    assert others == st.OthersCpu(cpus=2, wall_s=2.0, own_s=1.5, others_s=pytest.approx(1.0),
                                  share=pytest.approx(0.25), steal_share=pytest.approx(0.12 / 4))
    assert others.to_dict() == {"cpus": 2, "wall_s": 2.0, "own_s": 1.5, "others_s": 1.0, "share": 0.25,
                                "steal_share": 0.03, "unknown": None}


def test_others_share_counts_only_the_cpus_the_probe_could_use():
    # Pinned to CPU 1: its 1.0 s busy, 0.5 s the probe's; what ran on CPU 0 is no one's concern.
    others = st.others_cpu(BEFORE, AFTER, [1], own_cpu_s=0.5, wall_s=2.0, ticks_per_s=100)
    assert (others.cpus, others.others_s, others.share) == (1, pytest.approx(0.5), pytest.approx(0.25))
    # No CPU list: every CPU the file lists.
    assert st.others_cpu(BEFORE, AFTER, None, 1.5, 2.0, 100).share == pytest.approx(0.25)


def test_the_probes_own_time_above_the_ticks_counted_is_no_negative_share():
    others = st.others_cpu(BEFORE, AFTER, [0, 1], own_cpu_s=2.6, wall_s=2.0, ticks_per_s=100)
    assert (others.others_s, others.share) == (0.0, 0.0)


@pytest.mark.parametrize("before, after, cpus, unknown", [
    (None, AFTER, [0, 1], "no /proc/stat to read"),
    (BEFORE, None, [0, 1], "no /proc/stat to read"),
    (BEFORE, AFTER, [0, 5], "/proc/stat does not list CPU(s) 5"),
    ("intr 1\n", "intr 2\n", None, "/proc/stat lists no CPU"),
])
def test_without_readings_of_the_cpus_the_share_is_unknown_not_guessed(before, after, cpus, unknown):
    others = st.others_cpu(before, after, cpus, own_cpu_s=1.0, wall_s=2.0, ticks_per_s=100)
    assert (others.share, others.others_s, others.steal_share, others.unknown) == (None, None, None, unknown)


def test_spread_is_the_median_pass_over_the_best_less_one():
    assert st.spread_of([1.5, 1.0, 1.1]) == st.Spread(passes=3, best_s=1.0, median_s=1.1)
    assert st.spread_of([1.5, 1.0, 1.1]).spread == pytest.approx(0.1)
    assert st.spread_of([4.0, 1.0, 2.0, 3.0]).spread == pytest.approx(1.5)   # even count: the middle two's mean
    assert st.spread_of([2.0]).to_dict() == {"passes": 1, "best_s": 2.0, "median_s": 2.0, "spread": 0.0}
    with pytest.raises(ValueError, match="at least one"):
        st.spread_of([])
    with pytest.raises(ValueError, match="positive seconds"):
        st.spread_of([1.0, 0.0])


QUIET = st.OthersCpu(cpus=2, wall_s=10.0, own_s=19.8, others_s=0.1, share=0.005, steal_share=0.0)
STEADY_SPREADS = {"read": st.Spread(5, 1.0, 1.01), "triad": st.Spread(5, 2.0, 2.04), "gemm": st.Spread(3, 1.0, 1.0)}


def test_a_quiet_probe_is_steady_and_says_on_what():
    verdict = st.judge(STEADY_SPREADS, QUIET)
    assert (verdict.verdict, verdict.reasons, verdict.busy) == ("steady", (), False)
    assert st.summary_line(verdict.to_dict()) == \
        "steady: spreads read 1.0%, triad 2.0%, gemm 0.0%; others took 0.5% of 2 CPUs"


def test_a_figure_whose_passes_scatter_makes_the_probe_busy():
    spreads = {**STEADY_SPREADS, "triad": st.Spread(5, 2.0, 3.0)}
    verdict = st.judge(spreads, QUIET, spread_limit=0.2)
    assert verdict.verdict == "busy"
    assert verdict.reasons == ("triad: the median of 5 passes ran 50% slower than the best (limit 20%)",)
    # Exactly at the limit is still steady.
    assert st.judge({"read": st.Spread(5, 1.0, 1.25)}, QUIET, spread_limit=0.25).verdict == "steady"


def test_other_processes_on_the_probes_cpus_make_it_busy():
    loaded = st.OthersCpu(cpus=2, wall_s=10.0, own_s=10.0, others_s=9.8, share=0.49, steal_share=0.0)
    verdict = st.judge(STEADY_SPREADS, loaded, others_limit=0.1)
    assert verdict.reasons == ("other processes took 49% of the 2 CPUs the probe ran on (limit 10%)",)
    assert st.summary_line(verdict.to_dict()) == \
        "busy: other processes took 49% of the 2 CPUs the probe ran on (limit 10%)"


def test_the_hypervisors_steal_time_makes_it_busy_too():
    stolen = st.OthersCpu(cpus=1, wall_s=10.0, own_s=8.0, others_s=0.0, share=0.0, steal_share=0.2)
    verdict = st.judge(STEADY_SPREADS, stolen, steal_limit=0.1)
    assert verdict.reasons == ("the hypervisor took 20% of the 1 CPU the probe ran on as steal time (limit 10%)",)


def test_every_reason_is_kept_in_order():
    loaded = st.OthersCpu(cpus=2, wall_s=10.0, own_s=10.0, others_s=9.8, share=0.49, steal_share=0.0)
    spreads = {"read": st.Spread(5, 1.0, 1.5), "triad": st.Spread(5, 1.0, 1.0), "gemm": st.Spread(3, 1.0, 2.0)}
    verdict = st.judge(spreads, loaded, spread_limit=0.1, others_limit=0.1)
    assert [r.split(":")[0] for r in verdict.reasons] == ["read", "gemm", "other processes took 49% of the 2 CPUs "
                                                          "the probe ran on (limit 10%)"]


def test_an_unknown_share_is_no_reason_and_is_said_unknown():
    unknown = st.OthersCpu(cpus=2, wall_s=10.0, own_s=19.0, unknown="no /proc/stat to read")
    verdict = st.judge(STEADY_SPREADS, unknown)
    assert verdict.verdict == "steady"
    assert verdict.to_dict()["others_cpu"]["share"] is None
    assert st.summary_line(verdict.to_dict()) == ("steady: spreads read 1.0%, triad 2.0%, gemm 0.0%; others' CPU "
                                                  "time unknown (no /proc/stat to read)")


def test_a_figure_of_passes_too_short_to_judge_is_kept_and_said_but_not_judged():
    spreads = {"read": st.Spread(5, 0.0015, 0.0030), "gemm": st.Spread(3, 0.08, 0.0808)}
    verdict = st.judge(spreads, QUIET, spread_limit=0.1, shortest_pass_s=0.01)
    assert (verdict.verdict, verdict.unjudged) == ("steady", ("read",))
    assert verdict.to_dict()["spreads"]["read"]["spread"] == 1.0 and verdict.to_dict()["unjudged"] == ["read"]
    assert st.summary_line(verdict.to_dict()) == \
        "steady: spreads gemm 1.0% (passes too short to judge: read 100%); others took 0.5% of 2 CPUs"
    # The same passes ten times longer are judged.
    longer = {"read": st.Spread(5, 0.015, 0.030)}
    assert st.judge(longer, QUIET, spread_limit=0.1, shortest_pass_s=0.01).reasons == (
        "read: the median of 5 passes ran 100% slower than the best (limit 10%)",)


def test_the_default_limits_are_recorded_with_the_verdict():
    assert st.judge(STEADY_SPREADS, QUIET).to_dict()["limits"] == {
        "spread": st.SPREAD_LIMIT, "others_share": st.OTHERS_SHARE_LIMIT, "steal_share": st.STEAL_SHARE_LIMIT,
        "shortest_pass_s": st.SHORTEST_JUDGED_PASS_S}


def test_a_recorded_verdict_reads_back_and_an_old_probe_has_none():
    busy = st.judge(STEADY_SPREADS, st.OthersCpu(cpus=2, wall_s=1.0, own_s=1.0, others_s=0.9, share=0.45,
                                                 steal_share=0.0), others_limit=0.1)
    back = st.recorded({"read_gbs": 20.0, "steadiness": busy.to_dict()})
    assert back == st.Recorded(verdict="busy", reasons=busy.reasons, summary=st.summary_line(busy.to_dict()))
    assert back.busy
    for old in ({"read_gbs": 20.0}, {"steadiness": None}, {"steadiness": {"verdict": "maybe"}}, None, "x"):
        assert st.recorded(old) is None


def test_rank_verdicts_go_by_rank_number_and_skip_ranks_without_one():
    steady = {"steadiness": st.judge(STEADY_SPREADS, QUIET).to_dict()}
    ranks = {"10": {"node": "vm3", "probe": steady}, "2": {"node": "vm1", "probe": steady},
             "3": {"node": "vm1", "probe": {"read_gbs": 1.0}}, "4": {"node": "vm2", "probe": None}, "5": None}
    assert [(rank, node) for rank, node, _ in st.rank_verdicts(ranks)] == [("2", "vm1"), ("10", "vm3")]
    assert st.rank_verdicts(None) == [] and st.rank_verdicts({}) == []
