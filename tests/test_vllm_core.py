"""The pure core of racer's vLLM proposer (``racer.integrations.vllm.ChainDrafts``):
no vLLM needed. It must follow requests through batch rows that are reordered,
preempted, refilled and finished, with nothing but each row's context to go on."""

from __future__ import annotations

import re
import sys

import pytest

from racer.drafting.tree import TreeBuilder
from racer.integrations.vllm import ChainDrafts, best_chain

TEXT = [5, 6, 7, 8, 9, 10, 11, 12] * 4  # repetitive: RACER's retrieval drafts its continuation


class Verifier:
    """Stands in for vLLM: each request continues ``TEXT``-like text; a chain is
    accepted as far as it matches the true continuation, then one token of its own."""

    def __init__(self, truth: list[int], prompt: int) -> None:
        self.truth, self.context = truth, truth[:prompt]

    def step(self, chain: list[int]) -> list[int]:
        at = len(self.context)
        accepted = 0
        while accepted < len(chain) and at + accepted < len(self.truth) and chain[accepted] == self.truth[at + accepted]:
            accepted += 1
        new = self.truth[at : at + accepted + 1]
        self.context = self.context + new
        return new


def run(drafts: ChainDrafts, requests: list[Verifier], chains: list[list[int]]) -> tuple[list, list]:
    sampled = [r.step(c) for r, c in zip(requests, chains)]
    return sampled, drafts.propose(sampled, [r.context for r in requests])


def test_the_best_chain_maximises_expected_accepted_tokens_within_the_limit():
    builder = TreeBuilder(0, 8)
    builder.add_path([1, 2, 3])  # a long chain of middling nodes
    builder.add_child(0, 4)  # one sure node
    tree = builder.build()
    index = {tree.tokens[i]: i for i in range(len(tree))}
    probs = [1.0] * len(tree)
    for token, p in ((1, 0.6), (2, 0.6), (3, 0.6), (4, 0.95)):
        probs[index[token]] = p
    assert [tree.tokens[i] for i in best_chain(tree, probs, 3)] == [1, 2, 3]  # 0.6 + 0.36 + 0.216 > 0.95
    assert [tree.tokens[i] for i in best_chain(tree, probs, 1)] == [4]
    assert best_chain(tree, [1.0] + [0.0] * (len(tree) - 1), 3) == []
    # Reached with at least 0.3: token 3 (0.216) is cut, and [1, 2] (0.96) still beats [4].
    assert [tree.tokens[i] for i in best_chain(tree, probs, 3, min_prob=0.3)] == [1, 2]
    # At 0.4 token 2 (0.36) goes too, and the sure node wins.
    assert [tree.tokens[i] for i in best_chain(tree, probs, 3, min_prob=0.4)] == [4]
    assert [tree.tokens[i] for i in best_chain(tree, probs, 3, min_prob=0.99)] == []


def test_a_probability_floor_shortens_chains_and_a_bad_one_is_refused(monkeypatch):
    from racer.integrations.vllm import min_prob_from_env

    lengths = {}
    for floor in (0.0, 0.9):
        drafts = ChainDrafts("racer", tokens=5, min_prob=floor)
        request = Verifier(TEXT + [99], prompt=12)
        chains = drafts.propose([[request.context[-1]]], [request.context])
        total = 0
        for _ in range(6):
            total += len(chains[0])
            _, chains = run(drafts, [request], chains)
        lengths[floor] = total
    assert lengths[0.9] < lengths[0.0]
    with pytest.raises(ValueError, match="min_prob"):
        ChainDrafts("racer", min_prob=1.5)
    monkeypatch.setenv("RACER_VLLM_MIN_PROB", "often")
    with pytest.raises(ValueError, match="RACER_VLLM_MIN_PROB"):
        min_prob_from_env()
    monkeypatch.setenv("RACER_VLLM_MIN_PROB", "1.5")
    with pytest.raises(ValueError, match="RACER_VLLM_MIN_PROB"):
        min_prob_from_env()
    monkeypatch.setenv("RACER_VLLM_MIN_PROB", "0.2")
    assert min_prob_from_env() == 0.2
    monkeypatch.delenv("RACER_VLLM_MIN_PROB")
    assert min_prob_from_env() is None  # auto: measured (racer.budget.chain)


def test_the_proposer_times_only_steps_that_decoded_the_same_requests(monkeypatch):
    import numpy as np
    from types import SimpleNamespace as NS

    from racer.integrations.vllm import RacerProposer

    monkeypatch.delenv("RACER_VLLM_MIN_PROB", raising=False)
    config = NS(speculative_config=NS(num_speculative_tokens=4), model_config=NS(hf_config=NS(eos_token_id=2)),
                scheduler_config=NS(max_num_seqs=4))
    proposer = RacerProposer(config)

    def call(requests: list[Verifier], sampled: list[list[int]]) -> list[list[int]]:
        width = max(len(r.context) for r in requests)
        ids = np.zeros((len(requests), width), dtype=np.int64)
        for i, r in enumerate(requests):
            ids[i, : len(r.context)] = r.context
        return proposer.propose(sampled, np.array([len(r.context) for r in requests]), ids)

    a = Verifier(TEXT + [99], prompt=12)
    chains = call([a], [[a.context[-1]]])  # a's first step: its prefill was in the pass
    assert len(proposer.budget.steps) == 0
    for _ in range(3):
        chains = call([a], [a.step(chains[0])])
    assert len(proposer.budget.steps) == 3
    rows, drafted, emitted, seconds = proposer.budget.steps[-1]
    assert rows == 1 and emitted >= 1 and seconds > 0
    b = Verifier([40, 41, 42, 43] * 8, prompt=6)
    chains = call([a, b], [a.step(chains[0]), [b.context[-1]]])  # b joins: not a decoding step
    assert len(proposer.budget.steps) == 3
    call([a, b], [a.step(chains[0]), b.step(chains[1])])
    assert len(proposer.budget.steps) == 4 and proposer.budget.steps[-1][0] == 2


def test_a_request_drafts_its_repeated_text_and_accepts_it():
    drafts = ChainDrafts("racer", tokens=5)
    request = Verifier(TEXT + [99], prompt=12)
    first = request.context[:-1] + [request.context[-1]]
    chains = drafts.propose([[first[-1]]], [request.context])
    accepted = proposed = decoding = 0
    for _ in range(6):
        chain = chains[0]
        sampled, chains = run(drafts, [request], chains)
        if sampled[0]:  # empty once the text is done: the row has finished
            proposed += len(chain)
            accepted += len(sampled[0]) - 1
            decoding += 1
    assert accepted >= 10 and drafts.rebuilt == 0
    # Its counts of verified chains: what was proposed, accepted, and expected by the
    # acceptance model (no more than the chains' lengths, more than nothing).
    assert (drafts.drafted, drafts.accepted) == (proposed, accepted)
    assert 0 < drafts.expected <= drafts.drafted
    assert drafts.proposals == 1 + decoding and 0 <= drafts.empty < drafts.proposals  # a finished row proposes nothing


def test_chains_that_overreach_raise_the_floor_by_their_calibration():
    """A chain is its tree's best-rated path, so its rates run high; accepted over
    expected tokens of recent chains scales the floor up by as much (never down)."""
    from racer.integrations import vllm

    drafts = ChainDrafts("racer", tokens=5, min_prob=0.2)
    assert drafts.calibration() == 1.0  # nothing verified yet
    drafts._recent = [50.0, 100.0]
    assert drafts.calibration() == pytest.approx((50 + vllm.CALIBRATION_PRIOR) / (100 + vllm.CALIBRATION_PRIOR))
    drafts._recent = [300.0, 100.0]
    assert drafts.calibration() == 1.0  # underconfident chains keep the floor as it is
    drafts._recent = [0.0, 1000.0]
    assert drafts.calibration() == 0.25
    # Overreaching chains are cut shorter than calibrated ones at the same floor.
    lengths = {}
    for recent in ([0.0, 0.0], [10.0, 1000.0]):
        drafts = ChainDrafts("racer", tokens=8, min_prob=0.2)
        request = Verifier(TEXT + [99], prompt=12)
        chains = drafts.propose([[request.context[-1]]], [request.context])
        total = 0
        for _ in range(4):
            drafts._recent = list(recent)
            total += len(chains[0])
            _, chains = run(drafts, [request], chains)
        lengths[tuple(recent)] = total
    assert lengths[(10.0, 1000.0)] < lengths[(0.0, 0.0)]
    # Its window: halved once the expected tokens pass it.
    drafts = ChainDrafts("racer", tokens=5)
    request = Verifier(TEXT * 8 + [99], prompt=12)
    chains = drafts.propose([[request.context[-1]]], [request.context])
    drafts._recent = [1000.0, vllm.CALIBRATION_WINDOW]
    _, chains = run(drafts, [request], chains)
    assert drafts._recent[1] < vllm.CALIBRATION_WINDOW


def test_a_floor_above_every_current_rate_still_lets_chains_be_tried_and_learnt():
    """Rates start at the prior (0.5); with a floor above it a chain chosen by the rates'
    means would never be verified, so nothing would be learnt and nothing drafted ever.
    Drawn from their posteriors, a repeated text's nodes are tried, found good, and drafted."""
    drafts = ChainDrafts("racer", tokens=5, min_prob=0.6)
    request = Verifier(TEXT * 6 + [99], prompt=12)
    chains = drafts.propose([[request.context[-1]]], [request.context])
    drafted = []
    for _ in range(30):
        drafted.append(len(chains[0]))
        sampled, chains = run(drafts, [request], chains)
        if not sampled[0]:
            break
    assert drafts.accepted >= 10 and sum(n > 0 for n in drafted[-5:]) >= 3


def test_rows_of_one_scope_share_their_acceptance_rates():
    drafts = ChainDrafts("racer", tokens=4)
    a, b = Verifier(TEXT, prompt=12), Verifier([40, 41, 42, 43] * 8, prompt=12)
    drafts.propose([[a.context[-1]], [b.context[-1]]], [a.context, b.context])
    assert drafts.rows[0].session.acceptance is drafts.rows[1].session.acceptance
    alone = ChainDrafts("racer", tokens=4, scope=None)
    alone.propose([[a.context[-1]], [b.context[-1]]], [a.context, b.context])
    assert alone.rows[0].session.acceptance is not alone.rows[1].session.acceptance


def test_the_proposer_reports_its_budget_and_acceptance_every_n_steps(monkeypatch, capsys):
    import numpy as np
    from types import SimpleNamespace as NS

    from racer.integrations.vllm import RacerProposer, stats_every_from_env

    monkeypatch.setenv("RACER_VLLM_STATS", "2")
    config = NS(speculative_config=NS(num_speculative_tokens=4), model_config=NS(hf_config=NS(eos_token_id=2)),
                scheduler_config=NS(max_num_seqs=4))
    proposer = RacerProposer(config)
    request = Verifier(TEXT + [99], prompt=12)
    chains = [[]]
    for step in range(4):
        sampled = [[request.context[-1]]] if step == 0 else [request.step(chains[0])]
        ids = np.array([request.context], dtype=np.int64)
        chains = proposer.propose(sampled, np.array([len(request.context)]), ids)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("racer proposer")]
    assert len(lines) == 2 and "after 4 steps" in lines[1] and f"accepted {proposer.drafts.accepted}," in lines[1]
    share = re.search(r"proposing took ([0-9.]+) ms a step, ([0-9.]+)% of the steps' time", lines[1])
    assert share and float(share.group(1)) > 0 and 0 < float(share.group(2)) <= 100
    monkeypatch.setenv("RACER_VLLM_STATS", "often")
    with pytest.raises(ValueError, match="RACER_VLLM_STATS"):
        stats_every_from_env()


def test_rows_follow_their_requests_through_reordering_preemption_and_finishing():
    drafts = ChainDrafts("racer", tokens=4, idle=2)
    a = Verifier(TEXT, prompt=9)
    b = Verifier([40, 41, 42, 43] * 8, prompt=6)
    chains = drafts.propose([[a.context[-1]], [b.context[-1]]], [a.context, b.context])
    for _ in range(2):
        sampled, chains = run(drafts, [a, b], chains)
    assert drafts.rebuilt == 0 and set(drafts.rows) == {0, 1}
    a_drafter, b_drafter = drafts.rows[0].session.drafter, drafts.rows[1].session.drafter
    # vLLM swaps the rows: each row's context is now the other request's. Each request
    # is found where it moved to, with its own drafter, and drafts its own text.
    b_chain, a_chain = chains[1], chains[0]
    sampled = [b.step(b_chain), a.step(a_chain)]
    chains = drafts.propose(sampled, [b.context, a.context])
    assert (drafts.rebuilt, drafts.moved, drafts.started) == (0, 2, 2)
    assert drafts.rows[0].session.drafter is b_drafter and drafts.rows[1].session.drafter is a_drafter
    assert all(t in (40, 41, 42, 43) for t in chains[0]) and all(t in TEXT for t in chains[1])
    # Request b is preempted (row 0 in prefill again: no sampled tokens), then finishes
    # with the batch shrinking to one row.
    chains = drafts.propose([[], a.step(chains[1])], [b.context, a.context])
    assert chains[0] == [] and 0 not in drafts.rows
    chains = drafts.propose([a.step(chains[1])], [a.context])
    # Row 1 left (the batch shrank) and a now sits in row 0 (vLLM condensed the batch):
    # still a's own drafter, not a new start.
    assert set(drafts.rows) == {0} and drafts.rows[0].session.drafter is a_drafter
    assert (drafts.rebuilt, drafts.moved, drafts.started) == (0, 3, 2)
    assert all(t in TEXT for t in chains[0])
    assert len(drafts.memory) <= 2  # the idle memory kept is bounded


def test_a_moved_request_reads_its_own_slice_of_the_passs_top_k():
    """The pass that verified the chains ran on the batch as it is now, so a request
    that moved rows finds its top-k rows at its new place in the pass."""
    import numpy as np

    drafts = ChainDrafts("racer", tokens=4)
    a = Verifier(TEXT, prompt=12)
    b = Verifier([40, 41, 42, 43] * 8, prompt=12)
    chains = drafts.propose([[a.context[-1]], [b.context[-1]]], [a.context, b.context])
    assert chains[0] and chains[1]
    b_root, a_root = b.context[-1], a.context[-1]
    sampled = [b.step(chains[1]), a.step(chains[0])]  # swapped: b first in the pass
    sizes = [len(chains[1]) + 1, len(chains[0]) + 1]
    topk = np.concatenate([np.full((sizes[0], 8), 1000, dtype=np.int64) + np.arange(8),
                           np.full((sizes[1], 8), 2000, dtype=np.int64) + np.arange(8)])
    drafts.propose(sampled, [b.context, a.context], topk)
    assert drafts.moved == 2
    assert drafts.rows[0].session.drafter.table.row(b_root)[0] == 1000
    assert drafts.rows[1].session.drafter.table.row(a_root)[0] == 2000


def test_a_drafted_chain_that_the_row_did_not_accept_as_proposed_rebuilds_the_row():
    drafts = ChainDrafts("racer", tokens=4)
    a = Verifier(TEXT, prompt=12)
    chains = drafts.propose([[a.context[-1]]], [a.context])
    assert chains[0]  # something to verify
    # The row sampled a token that contradicts its accepted draft: another request now.
    other = [77] * 12 + [chains[0][0] + 1000, 78]
    drafts.propose([[chains[0][0] + 1000, 78]], [other])
    assert drafts.rebuilt == 1


def test_the_module_does_not_import_vllm():
    assert "vllm" not in sys.modules or not hasattr(sys.modules["vllm"], "LLM")


def test_a_shared_memory_lets_a_new_row_draft_what_another_row_wrote_unless_scoped_to_requests(monkeypatch):
    """Under ``memory=shared`` a request's first chain already follows text a live row
    of the server wrote (vLLM gives no prompt logits, so RACER's own memory starts with
    the prompt alone); ``RACER_VLLM_MEMORY_SCOPE=request`` shares nothing."""
    from racer.integrations.vllm import scope_from_env

    story = list(range(100, 140))
    firsts = {}
    for scope in ("server", None):
        drafts = ChainDrafts("racer:memory=shared", tokens=8, scope=scope)
        writer = Verifier(story, prompt=30)
        chains = drafts.propose([[writer.context[-1]]], [writer.context])
        _, chains = run(drafts, [writer], chains)
        # A second request whose prompt ends where the writer's text goes on.
        reader = Verifier([7, 8] + story[10:20] + story[20:30], prompt=12)
        out = drafts.propose([[writer.context[-1]], [reader.context[-1]]], [writer.context, reader.context])
        firsts[scope] = out[1]
    assert firsts["server"][:4] == story[20:24]
    assert firsts[None] == []
    monkeypatch.setenv("RACER_VLLM_MEMORY_SCOPE", "request")
    assert scope_from_env() is None
    monkeypatch.setenv("RACER_VLLM_MEMORY_SCOPE", "user")
    with pytest.raises(ValueError, match="RACER_VLLM_MEMORY_SCOPE"):
        scope_from_env()
    monkeypatch.delenv("RACER_VLLM_MEMORY_SCOPE")
    assert scope_from_env() == "server"
