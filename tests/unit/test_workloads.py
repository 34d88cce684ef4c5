"""Workloads (vcfslm/workloads.py): reading JSONL requests and Mooncake traces with file:line
errors, the named mixes, a replay's timing at a time scale, conversations whose turns carry
their history, and the CLI's --workload and --time-scale."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from vcfslm.cli import main
from vcfslm.errors import InventoryError, WorkloadError
from vcfslm.serve.scheduler import Arrivals
from vcfslm.serving.decisions import ServeSpec
from vcfslm.serving.window_plan import Ask, WindowPlan
from vcfslm.serving.workloads import (
    MIXES,
    MOONCAKE_BLOCK_TOKENS,
    Workload,
    length_bucket,
    parse_workload,
    segment_ids,
    stable_key,
)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def poisson(rate: float, rng: random.Random) -> float:
    return rng.expovariate(rate)


def plan(workload: Workload, rate: float, duration_s: float, seed: int = 1, think_s: float = 0.0) -> WindowPlan:
    return WindowPlan(workload, rate, duration_s, random.Random(seed), poisson, think_s=think_s)


# ------------------------------------------------------------------ reading


def test_fixed_and_mixes_parse_and_bad_names_say_what_is_known():
    w = parse_workload("fixed:128/16")
    assert (w.kind, w.name, w.input_tokens, w.output_tokens, w.max_input) == ("fixed", "fixed:128/16", 128, 16, 128)
    chat = parse_workload("chat")
    assert chat.kind == "mix" and chat.mix is MIXES["chat"] and chat.multi_turn and len(chat.digest) == 12
    assert not parse_workload("rag").multi_turn
    for bad, words in (("fixed:128", "fixed:IN/OUT"), ("fixed:0/16", "at least one token"),
                       ("sharegpt", "unknown workload 'sharegpt'")):
        with pytest.raises(WorkloadError, match=words) as info:
            parse_workload(bad)
        assert info.value.exit_code == 2


def test_a_jsonl_file_reads_its_requests_and_its_digest_follows_its_bytes(tmp_path):
    path = write_jsonl(tmp_path / "reqs.jsonl", [{"input_tokens": 100, "output_tokens": 10},
                                                {"input_tokens": 2000, "output_tokens": 50}])
    w = parse_workload(str(path))
    assert w.kind == "requests" and w.name == "file:reqs.jsonl" and [r.input_tokens for r in w.rows] == [100, 2000]
    assert (w.max_input, w.max_output, w.replay, w.multi_turn) == (2000, 50, False, False)
    again = parse_workload(str(path))
    write_jsonl(path, [{"input_tokens": 100, "output_tokens": 11}])
    assert again.digest == w.digest != parse_workload(str(path)).digest
    # The spec carries it whole to the workers and reads back equal.
    spec = ServeSpec(loads=(1.0,), input_tokens=(2000,), output_tokens=50, workload=w)
    assert ServeSpec.of_record(json.loads(json.dumps(spec.to_dict()))) == spec


def test_every_bad_row_is_named_by_file_line_and_key(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"input_tokens": 10, "output_tokens": 5}),
        "{not json",
        json.dumps({"input_tokens": 0, "output_tokens": 5}),
        json.dumps({"input_tokens": 10}),
        json.dumps({"input_tokens": 10, "output_tokens": 5, "colour": "red"}),
        json.dumps({"input_tokens": 10, "output_tokens": 5, "prefix_tokens": 20, "conversation": "a"}),
        json.dumps({"input_tokens": 10, "output_tokens": 5, "turn": 1}),
        json.dumps([1, 2]),
    ]) + "\n")
    with pytest.raises(WorkloadError) as info:
        parse_workload(str(path))
    # The lines that are not objects stop the read first, each with its line.
    assert [str(p) for p in info.value.problems] == [
        f"{path}:2: not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        f"{path}:8: each line is a JSON object, got list"]
    path.write_text("\n".join(line for line in path.read_text().splitlines() if line.startswith("{\"")) + "\n")
    with pytest.raises(WorkloadError) as info:
        parse_workload(str(path))
    assert [str(p) for p in info.value.problems] == [
        f"{path}:2: input_tokens: expected a whole number of at least 1, got 0",
        f"{path}:3: output_tokens: missing",
        f"{path}:4: colour: unknown key; a request has input_tokens, output_tokens, arrival_s, conversation, turn, "
        "prefix_tokens, think_s",
        f"{path}:5: prefix_tokens: 20 shared tokens in a prompt of 10",
        f"{path}:6: turn: a turn belongs to a conversation"]


def test_a_replay_needs_every_arrival_time_and_the_file_must_exist(tmp_path):
    path = write_jsonl(tmp_path / "half.jsonl", [{"input_tokens": 10, "output_tokens": 5, "arrival_s": 0.0},
                                                {"input_tokens": 10, "output_tokens": 5}])
    with pytest.raises(WorkloadError, match=r"half.jsonl: arrival_s: 1 of 2 requests carry an arrival time"):
        parse_workload(str(path))
    with pytest.raises(WorkloadError, match=r"missing.jsonl: workload: cannot read the workload file"):
        parse_workload(str(tmp_path / "missing.jsonl"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(WorkloadError, match="holds no requests"):
        parse_workload(str(empty))


def test_a_mooncake_trace_reads_milliseconds_and_its_blocks(tmp_path):
    path = write_jsonl(tmp_path / "mc.jsonl", [
        {"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 600, "output_length": 10, "hash_ids": [1, 3]},
        {"timestamp": 3000, "input_length": 300, "output_length": 10, "hash_ids": [4]}])
    w = parse_workload(f"mooncake:{path}")
    assert w.kind == "mooncake" and w.name == "mooncake:mc.jsonl" and w.replay
    assert [r.arrival_s for r in w.rows] == [0.0, 1.5, 3.0] and w.rows[0].blocks == (1, 2)
    # Three requests over 3 s plus one mean gap of 1.5 s: 2/3 requests/s.
    assert w.mean_rate == pytest.approx(3 / 4.5)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"timestamp": 0, "input_length": 100, "output_length": 5,
                                                "hash_ids": [1, 2]},
                                               {"input_length": 100, "output_length": 5},
                                               {"timestamp": -5, "input_length": 100, "output_length": 5,
                                                "hash_ids": ["x"]}])
    with pytest.raises(WorkloadError) as info:
        parse_workload(f"mooncake:{bad}")
    assert [str(p) for p in info.value.problems] == [
        f"{bad}:1: hash_ids: 2 blocks of {MOONCAKE_BLOCK_TOKENS} tokens for 100 input tokens",
        f"{bad}:2: timestamp: missing (milliseconds from the trace's start)",
        f"{bad}:3: timestamp: expected a non-negative number, got -5",
        f"{bad}:3: hash_ids: expected a list of whole numbers, got ['x']"]


# ------------------------------------------------------------------ drawing a window


def test_sampled_lengths_follow_the_mix_and_stay_in_its_bounds():
    rag = parse_workload("rag")
    asks = plan(rag, rate=50.0, duration_s=40.0).first
    mix = MIXES["rag"]
    assert len(asks) == pytest.approx(2000, rel=0.1)
    ins = [a.input_tokens for a in asks]
    outs = [a.output_tokens for a in asks]
    # Log-normal by median and mean: the drawn median and mean come back (the clip trims a little).
    assert statistics.median(ins) == pytest.approx(mix.system_tokens + mix.prompt.median, rel=0.1)
    assert statistics.mean(outs) == pytest.approx(mix.output.mean, rel=0.15)
    assert min(ins) >= mix.system_tokens + mix.prompt.low and max(ins) <= mix.max_context
    assert all(mix.output.low <= o <= mix.output.high for o in outs)
    # Every RAG prompt starts with the same system prompt, then its own tokens.
    assert all(a.segments[0] == (stable_key("system", "rag"), mix.system_tokens) for a in asks)
    assert len({a.segments[1][0] for a in asks}) == len(asks)
    assert all(sum(n for _, n in a.segments) == a.input_tokens for a in asks)


def test_a_replay_keeps_the_traces_gaps_scaled_to_the_load(tmp_path):
    # A request every 2 s: the trace's own rate is 0.5/s.
    path = write_jsonl(tmp_path / "t.jsonl", [{"input_tokens": 10 + i, "output_tokens": 4, "arrival_s": 2.0 * i}
                                              for i in range(10)])
    w = parse_workload(str(path))
    assert w.mean_rate == pytest.approx(0.5) and w.rate_of_scale(4.0) == pytest.approx(2.0)
    p = plan(w, rate=2.0, duration_s=30.0)
    assert p.time_scale == pytest.approx(4.0)
    times = [a.arrival_s for a in p.first]
    # At 4x the gaps are 0.5 s, across the trace's end too (it wraps round after 20 s of trace).
    assert all(b - a == pytest.approx(0.5) for a, b in zip(times, times[1:], strict=False))
    assert len(times) == pytest.approx(60, abs=1) and times[0] < 0.5 + 1e-9
    # The rows come in the trace's order from a seeded offset, and wrap.
    lengths = [a.input_tokens - 10 for a in p.first]
    assert all((b - a) % 10 == 1 for a, b in zip(lengths, lengths[1:], strict=False))
    assert [a.arrival_s for a in plan(w, 2.0, 30.0, seed=1).first] == times
    assert [a.input_tokens for a in plan(w, 2.0, 30.0, seed=2).first] != [a.input_tokens for a in p.first]


def test_mooncake_blocks_with_equal_ids_are_equal_tokens(tmp_path):
    path = write_jsonl(tmp_path / "mc.jsonl", [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [7, 8]},
        {"timestamp": 100, "input_length": 600, "output_length": 5, "hash_ids": [7, 9]}])
    asks = sorted(plan(parse_workload(f"mooncake:{path}"), rate=2.0, duration_s=1.0).first,
                  key=lambda a: a.input_tokens)
    short, long = (segment_ids(a.segments, 1000) for a in asks)
    assert len(short) == 600 and len(long) == 700
    assert short[:512] == long[:512] and short[512:600] != long[512:600]


def test_conversations_carry_their_history_as_the_next_turns_prefix():
    chat = parse_workload("chat")
    p = plan(chat, rate=4.0, duration_s=200.0, think_s=1.0)
    mix = MIXES["chat"]
    # Conversations start at rate / mean turns, so requests arrive at about the rate.
    assert len(p.first) == pytest.approx(200.0 * 4.0 / mix.turns, rel=0.15)
    first = p.first[0]
    assert first.turn == 0 and first.prefix_tokens == mix.system_tokens
    followed = []
    ask: Ask | None = first
    at = first.arrival_s
    while ask is not None:
        followed.append(ask)
        at += 2.0
        ask = p.follow(ask, produced=ask.output_tokens, replied_at=at)
        assert ask is None or ask.arrival_s >= at
    # Find a conversation with at least two turns and check the second carries the first.
    for start in p.first:
        nxt = p.follow(start, produced=30, replied_at=start.arrival_s + 1.0)
        if nxt is not None:
            break
    else:
        pytest.fail("no conversation had a second turn")
    assert nxt.turn == 1 and nxt.prefix_tokens == start.input_tokens + 30
    assert nxt.segments[:len(start.segments)] == start.segments
    assert nxt.segments[len(start.segments)][1] == 30         # the reply, then the new question
    history = segment_ids(nxt.segments, 5000)[:nxt.prefix_tokens]
    assert history[:start.input_tokens] == segment_ids(start.segments, 5000)
    assert nxt.input_tokens == nxt.prefix_tokens + nxt.segments[-1][1] <= mix.max_context


def test_a_files_conversation_keeps_its_turns_and_its_stated_prefix(tmp_path):
    path = write_jsonl(tmp_path / "conv.jsonl", [
        {"conversation": "a", "turn": 0, "input_tokens": 50, "output_tokens": 20},
        {"conversation": "a", "turn": 1, "input_tokens": 120, "output_tokens": 10, "prefix_tokens": 70,
         "think_s": 0},
        {"conversation": "a", "turn": 2, "input_tokens": 200, "output_tokens": 10, "prefix_tokens": 180}])
    w = parse_workload(str(path))
    assert w.multi_turn and w.mean_turns == 3.0
    p = plan(w, rate=3.0, duration_s=10.0)
    one = p.first[0]
    assert (one.turn, one.input_tokens, one.prefix_tokens) == (0, 50, 0)
    two = p.follow(one, produced=20, replied_at=one.arrival_s + 1.0)
    assert two is not None and (two.turn, two.input_tokens, two.prefix_tokens) == (1, 120, 70)
    assert two.arrival_s == one.arrival_s + 1.0                 # its think time: 0
    assert segment_ids(two.segments, 900)[:50] == segment_ids(one.segments, 900)
    three = p.follow(two, produced=10, replied_at=two.arrival_s + 1.0)
    # A stated prefix longer than the history is cut to the history (120 + 10).
    assert three is not None and three.prefix_tokens == 130 and three.input_tokens == 200
    assert p.follow(three, produced=10, replied_at=three.arrival_s + 1.0) is None


def test_the_scheduler_plans_a_conversations_next_turn_when_its_reply_ends():
    spec = ServeSpec(loads=(2.0,), input_tokens=(4096,), output_tokens=1024, duration_s=60.0, warmup_s=0.0,
                     cooldown_s=0.0, workload=parse_workload("chat"), think_s=0.5)
    planner = Arrivals(spec, 2.0, 4096, random.Random(3))
    before = len(planner.requests)
    r = planner.requests[0]
    r.produced = 25
    planner.replied(r, r.arrival_s + 1.0)
    added = planner.requests[before:]
    assert all(a.ask.turn == 1 and a.prefix_tokens == r.input_tokens + 25 for a in added)
    with pytest.raises(ValueError, match="requests/s, not users"):
        ServeSpec(load_kind="users", loads=(2.0,), workload=parse_workload("chat"))


def test_length_buckets():
    assert [length_bucket(n) for n in (1, 255, 256, 1023, 1024, 4095, 4096, 10**6)] == [
        "<256", "<256", "256–1023", "256–1023", "1024–4095", "1024–4095", "≥4096", "≥4096"]


# ------------------------------------------------------------------ the command line


def test_the_cli_refuses_a_bad_workload_with_exit_2_and_its_line(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"input_tokens": 10, "output_tokens": 5}) + "\n" + json.dumps({"input_tokens": 3})
                    + "\n")
    result = CliRunner().invoke(main, ["bench", "--local", "--serve", "--rates", "1", "--workload", str(path),
                                       "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2, result.output
    assert f"error: {path}:2: output_tokens: missing" in result.output.splitlines()
    assert not (tmp_path / "runs").exists()
    result = CliRunner().invoke(main, ["bench", "--local", "--serve", "--workload", "rag", "--time-scale", "2",
                                       "--runs-dir", str(tmp_path / "runs")])
    assert result.exit_code == 2 and "--time-scale" in result.output


def test_the_inventorys_workload_file_is_read_from_its_folder(tmp_path):
    import yaml

    from vcfslm.inventory_load import load_inventory, serve_settings

    brief = Path(__file__).resolve().parents[2] / "inventories" / "vx650v4-4node.yaml"
    doc = yaml.safe_load(brief.read_text())
    doc["bench"]["serve"] = {}
    folder = tmp_path / "site"
    folder.mkdir()
    write_jsonl(folder / "reqs.jsonl", [{"input_tokens": 64, "output_tokens": 8}])
    for value, expected in (("reqs.jsonl", str(folder / "reqs.jsonl")),
                            ("mooncake:reqs.jsonl", f"mooncake:{folder / 'reqs.jsonl'}"),
                            ("chat", "chat"), ("fixed:128/16", "fixed:128/16")):
        doc["bench"]["serve"]["workload"] = value
        (folder / "cluster.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
        assert serve_settings(load_inventory(folder / "cluster.yaml"))["workload"] == expected
    doc["bench"]["serve"]["workload"] = "reqs.jsonl"
    doc["bench"]["serve"]["time_scales"] = [0]
    (folder / "cluster.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(InventoryError, match=r"cluster.yaml:\d+:\d+: bench.serve.time_scales.0"):
        load_inventory(folder / "cluster.yaml")


def test_size_picks_a_workload_by_the_name_bench_took():
    from vcfslm.cli.report import workload_matches

    assert workload_matches("chat@965b2b8c4e18", "chat") and not workload_matches("chat@965b2b8c4e18", "rag")
    assert workload_matches("mooncake:t.jsonl@ab12", "mooncake:t.jsonl")
    assert workload_matches("", "fixed") and workload_matches("", "fixed:128/16")
    assert not workload_matches("rag@1", "fixed")
