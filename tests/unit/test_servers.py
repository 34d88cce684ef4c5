"""Serving backends' pure decisions: CPU split, KV-cache size, arguments, metrics, lag."""

from __future__ import annotations

import pytest

from vcfslm.serving import servers
from vcfslm.serving.servers import VLLM, ServerSpec


def test_split_cpus_reserves_the_last_ones_for_the_client():
    assert servers.split_cpus(range(24, 48), 1) == (list(range(24, 47)), [47])
    assert servers.split_cpus([0, 1], 0) == ([0, 1], [0, 1])
    with pytest.raises(ValueError, match="leave none"):
        servers.split_cpus([0, 1], 2)


def test_kv_cache_is_whole_gib_with_headroom():
    # Phi-3-mini: 384 KiB per token; 16 slots x 144 tokens x 1.5 = 1.27 GiB -> 2.
    per_token = servers.kv_bytes_per_token({"num_attention_heads": 32, "num_key_value_heads": 32,
                                            "hidden_size": 3072, "num_hidden_layers": 32})
    assert per_token == 2 * 32 * 32 * 96 * 2
    assert servers.kv_cache_gib(per_token, 16, 144) == 2
    assert servers.kv_cache_gib(1000, 1, 10) == 1
    # GQA and a head_dim override count.
    assert servers.kv_bytes_per_token({"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                       "hidden_size": 3072, "num_hidden_layers": 2}) == 2 * 2 * 8 * 128 * 2


def test_server_argv_sets_slots_context_and_the_features_as_asked():
    spec = ServerSpec(name="vllm", port=9000, prefix_caching=False)
    argv = servers.server_argv(spec, model_dir="/m", served_name="x", slots=16, max_model_len=640, numa_node=3)
    assert argv[:2] == ["serve", "/m"]
    assert argv[argv.index("--port") + 1] == "9003"
    assert argv[argv.index("--max-num-seqs") + 1] == "16"
    assert argv[argv.index("--max-model-len") + 1] == "640"
    assert "--enable-chunked-prefill" in argv and "--no-enable-prefix-caching" in argv
    assert "--api-key" not in argv          # the key travels in the environment only
    assert "--enforce-eager" not in argv    # vLLM compiles the model unless told otherwise
    eager = servers.server_argv(ServerSpec(name="vllm", enforce_eager=True), model_dir="/m", served_name="x",
                                slots=16, max_model_len=640, numa_node=0)
    assert eager[-1] == "--enforce-eager"


def test_spec_round_trips_and_refuses_bad_settings():
    spec = ServerSpec(name="vllm", reserved_cores=1, kv_cache_gib=4)
    assert ServerSpec.of_record(spec.to_dict()) == spec
    assert ServerSpec.of_record(None).in_process
    with pytest.raises(ValueError, match="server must be one of"):
        ServerSpec(name="tgi")
    with pytest.raises(ValueError, match="reserved cores"):
        ServerSpec(name="vllm", reserved_cores=-1)


def test_metrics_are_summed_over_labels_and_buckets_dropped():
    text = ('# HELP x\nvllm:num_preemptions_total{engine="0"} 2.0\nvllm:num_preemptions_total{engine="1"} 3.0\n'
            'vllm:request_queue_time_seconds_bucket{le="1"} 9\nvllm:request_queue_time_seconds_sum 1.5\n'
            'vllm:request_queue_time_seconds_count 3\nbroken line\nvllm:x NaN\n')
    m = servers.parse_metrics(text)
    assert m == {"vllm:num_preemptions_total": 5.0, "vllm:request_queue_time_seconds_sum": 1.5,
                 "vllm:request_queue_time_seconds_count": 3.0}


def test_metric_deltas_per_window():
    before = {"vllm:num_preemptions_total": 5.0, "vllm:request_queue_time_seconds_sum": 1.0,
              "vllm:request_queue_time_seconds_count": 2.0}
    after = {"vllm:num_preemptions_total": 7.0, "vllm:request_queue_time_seconds_sum": 4.0,
             "vllm:request_queue_time_seconds_count": 8.0, "vllm:kv_cache_usage_perc": 0.1}
    samples = [{"vllm:kv_cache_usage_perc": 0.6, "vllm:num_requests_waiting": 3.0}, after]
    d = servers.metric_deltas(VLLM, before, after, samples)
    assert d["preemptions"] == 2.0 and d["queue_time_s_mean"] == pytest.approx(0.5)
    assert d["kv_cache_usage_max"] == 0.6 and d["waiting_max"] == 3.0


def test_lag_problem_names_the_late_requests():
    assert servers.lag_problem([0.01, 0.2], 0.5) is None
    problem = servers.lag_problem([0.01, 0.7, 0.9], 0.5)
    assert "2 request(s) late" in problem and "0.900 s" in problem


def test_fact_lines_keep_how_the_server_runs():
    log = "noise\nINFO Chunked prefill is enabled with max_num_batched_tokens=640.\nINFO CPU KV cache size: 9 tokens\n"
    lines = servers.fact_lines(VLLM, log)
    assert lines[0].startswith("INFO Chunked prefill") and any("KV cache" in x for x in lines)


def test_the_report_says_how_a_server_served():
    from vcfslm.analysis.report_render import server_text

    facts = {"name": "vllm", "version": "0.32.0", "chunked_prefill": True, "prefix_caching": False,
             "max_num_seqs": 16, "kv_cache_gib": 2, "startup_s": 149.2, "peak_rss_bytes": {"1": 1e9, "2": 15.2e9}}
    text = server_text(facts)
    assert text.startswith("served by vllm 0.32.0, one server per vNUMA node")
    assert "chunked prefill on" in text and "prefix caching off" in text and "149 s" in text and "15.20 GB" in text
    assert "eager" not in text
    assert ", eager (--enforce-eager: no torch.compile, slower steps than the compiled server)" in server_text(
        {**facts, "enforce_eager": True})
    assert server_text(None) == "" and server_text({}) == ""
