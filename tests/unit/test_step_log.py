"""A window's steps by what they carried: the sums kept, and a record's entry read back."""

from __future__ import annotations

import pytest

from vcfslm.serving.step_log import StepLog, attention_pairs, groups_of


def test_steps_are_summed_by_lanes_and_prompt_tokens_and_read_back():
    log = StepLog()
    log.add(1, [], 130, 0.08)
    log.add(1, [], 132, 0.10)
    log.add(4, [(0, 8, False)], 520, 0.20)
    log.add(0, [(120, 128, True)], 0, 0.30)
    doc = log.to_json()
    assert doc == {"0+8": [1, 0.3, 0, 128 * 129 - 120 * 121, 1], "1+0": [2, 0.18, 262, 0, 0],
                   "4+8": [1, 0.2, 520, 72, 0]}
    idle, one, four = groups_of(doc)
    assert (one.lanes, one.prompt_tokens, one.steps) == (1, 0, 2)
    assert one.mean_s == pytest.approx(0.09) and one.mean_context == 131
    assert (four.lanes, four.prompt_tokens, four.mean_s, four.mean_attention_pairs) == (4, 8, pytest.approx(0.2), 72)
    assert (idle.lanes, idle.mean_last_pieces) == (0, 1)
    assert attention_pairs(0, 8) == 72


@pytest.mark.parametrize("bad, says", [({"1-0": [1, 0.1, 0, 0, 0]}, "is not '<lanes>+<prompt tokens>'"),
                                       ({"1+0": [1, 0.1]}, "must be [steps, seconds, context_tokens, attention_pairs, last_pieces]"),
                                       ({"1+0": [0, 0.1, 0, 0, 0]}, "must be positive")])
def test_a_malformed_entry_is_named(bad, says):
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        groups_of(bad)
