"""probe_mtp.vllm.Proposer without an engine: a stand-in runner (fake_engine.py) calls it as vLLM
0.32's model runner does.  Drafts of repeated text are accepted; a request whose drafts fail soon
drafts nothing; finished requests enter the corpus, which stays under its byte cap; requests are
followed when vLLM moves them between rows; bad options are clear errors."""

from __future__ import annotations

import numpy as np
import pytest

from fake_engine import FakeRunner, vllm_config
from probe_mtp.vllm import Proposer


def cycle(ctx):
    """A model that continues the cycle 10..16."""
    return (ctx[-1] - 10 + 1) % 7 + 10 if ctx[-1] >= 10 else 10


def test_repeated_text_drafts_long_accepted_chains():
    proposer = Proposer(vllm_config(k=8))
    runner = FakeRunner(proposer, cycle)
    runner.add([1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 10, 11], 120)
    runner.run()
    stats = proposer.stats
    assert stats["requests"] == stats["finished"] == 1
    assert stats["accepted"] >= 0.9 * stats["drafted"] > 0
    assert runner.passes < 120 / 6  # about 9 tokens a pass once the cycle is in the context


def test_a_request_whose_drafts_fail_soon_drafts_nothing():
    """The model never takes the first draft token: after a few rejected drafts the request's
    estimates fall below min_probability and it drafts nothing; under a clock where a verified
    token costs 3% of a step (vLLM's CPU backend on SmolLM2) it costs what plain decoding costs,
    within 1%."""
    proposer = Proposer(vllm_config(k=8))
    runner = FakeRunner(proposer, lambda ctx: {5: 6, 6: 7, 7: 5}.get(ctx[-1], 5), adversary=True)
    proposer.clock = lambda: runner.passes + 0.03 * runner.positions
    runner.add([5, 6, 7] * 6, 200)
    for _ in range(100):
        runner.step()
    early = proposer.stats["drafted"]
    runner.run()
    assert proposer.stats["accepted"] == 0
    assert proposer.stats["drafted"] == early  # nothing in the last 100 of 200 steps
    assert runner.positions - runner.passes <= early  # verified positions beyond one per step
    assert runner.passes + 0.03 * runner.positions <= 1.01 * 1.03 * 201  # plain decoding: 200 steps and the last


def test_finished_requests_enter_the_corpus_and_draft_the_next_request():
    proposer = Proposer(vllm_config(k=8))
    story = [int(t) for t in np.random.default_rng(0).integers(100, 5000, size=300)]
    runner = FakeRunner(proposer, lambda ctx: story[len(ctx)] if len(ctx) < len(story) else 1)
    runner.add(story[:20], 200)
    runner.run()
    assert proposer.stats["drafted"] <= 16  # random text, 200 steps: next to nothing drafted from its own context
    assert proposer.memory.summary()["corpus_documents"] == 1
    runner.add(story[:20], 200)  # the same request again: the corpus holds its continuation
    passes = runner.passes
    runner.run()
    assert runner.passes - passes < 200 / 5
    assert proposer.stats["accepted"] >= 0.9 * proposer.stats["drafted"] > 0


def test_the_memory_stays_under_its_cap():
    cap_mb = 0.05
    proposer = Proposer(vllm_config(k=4, memory_mb=cap_mb))
    rng = np.random.default_rng(1)
    runner = FakeRunner(proposer, lambda ctx: int(rng.integers(100, 30000)))
    for _ in range(30):
        runner.add(rng.integers(100, 30000, size=200).tolist(), 100)
        runner.add(rng.integers(100, 30000, size=200).tolist(), 100)
        runner.run()
    memory = proposer.memory
    assert proposer.stats["finished"] == 60
    assert 0 < memory.nbytes() <= cap_mb * (1 << 20)
    assert memory.corpus.rebuilds > 0 and len(memory.corpus.documents) < 60  # the oldest went first


def test_requests_are_followed_when_rows_move():
    """Two requests swap rows between steps (vLLM condenses its batch): each keeps its own state."""
    proposer = Proposer(vllm_config(k=8))
    runner = FakeRunner(proposer, cycle)
    runner.add([1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 10], 60)
    runner.add([4, 10, 11, 12, 13, 14, 15, 16, 10, 11, 12], 60)
    for step in range(40):
        runner.step(order=[1, 0] if step % 2 and len(runner.requests) == 2 else None)
    runner.run()
    assert proposer.stats["requests"] == proposer.stats["finished"] == 2
    assert proposer.stats["accepted"] >= 0.9 * proposer.stats["drafted"] > 0


def test_rows_in_prefill_and_the_model_length_get_no_drafts():
    proposer = Proposer(vllm_config(k=8, max_model_len=14))
    buffer = np.zeros((2, 14), dtype=np.int32)
    buffer[0, :12] = [10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13]
    buffer[1, :5] = [1, 2, 3, 4, 5]
    drafts = proposer.propose([[13], []], np.array([12, 5]), buffer)
    assert drafts[1] == [] and len(drafts[0]) == 1  # room for one draft token before max_model_len


@pytest.mark.parametrize("options, message", [
    ({"memory_mb": -1}, "memory_mb"),
    ({"min_probability": 0}, "min_probability"),
    ({"max_ngram": 0}, "max_ngram"),
    ({"max_ngram": 2.5}, "max_ngram"),
    ({"colour": 1}, "unknown probe-mtp proposer options"),
    ({"step_cost": "yes"}, "step_cost"),
])
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(ValueError, match=message):
        Proposer(vllm_config(**options))


def test_a_config_without_draft_tokens_is_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Proposer(vllm_config(k=0))


def _noisy_cycle(seed: int = 0):
    """The cycle, but at about a third of the positions (fixed per position) another token."""
    other = np.random.default_rng(seed).random(4096) < 0.35
    return lambda ctx: 99 if other[len(ctx)] else cycle(ctx)


def _timed_run(per_token: float, step_cost: bool = True):
    """A request decoded under a simulated clock: each engine step costs 1 + per_token * its
    verified tokens.  Returns the proposer, the runner and the simulated seconds."""
    proposer = Proposer(vllm_config(k=8, step_cost=step_cost))
    runner = FakeRunner(proposer, _noisy_cycle())
    proposer.clock = lambda: runner.passes + per_token * runner.positions
    runner.add([1, 2, 3] + [10, 11, 12, 13, 14, 15, 16] * 3, 400)
    runner.run()
    return proposer, runner, runner.passes + per_token * runner.positions


def test_the_proposer_times_steps_and_drafts_what_pays_for_its_time():
    """Half-right drafts: where a verified token costs a tenth of a step the proposer drafts, and
    its fitted line is the clock's; where it costs as much as a step it drafts far less, and
    spends less time than with its chains cut by min_probability alone."""
    cheap, cheap_runner, _ = _timed_run(0.1)
    fixed, per_token = cheap.step_costs.line()
    assert cheap.stats["timed_steps"] >= cheap_runner.passes - 3  # all but the prefill's neighbours
    assert per_token == pytest.approx(0.1, rel=0.15) and fixed == pytest.approx(1.0, rel=0.05)  # (prior: 0.013)
    dear, _, dear_seconds = _timed_run(1.0)
    assert dear.step_costs.line()[1] == pytest.approx(1.0, rel=0.2)  # few wide steps: the prior pulls
    assert dear.stats["drafted"] < 0.5 * cheap.stats["drafted"]
    _, _, uncut_seconds = _timed_run(1.0, step_cost=False)
    assert dear_seconds < 0.97 * uncut_seconds
