"""RACER's shared memory (``racer.drafting.shared``, ``memory=shared``): one automaton
and copy-logit table per scope that every request of it writes into, read beside each
request's own; against brute force, bounded, scoped, and never a change to an output."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import LOSSLESS_NEW_TOKENS, hf_greedy, lossless_questions
from racer import Decoder, parse_method
from racer.drafting.shared import SharedMemory
from racer.engine.loop import BatchDecoder
from racer.engine.memory import DrafterMemory
from test_retrieval import check_links, contents, oracle_borders, oracle_retrieve, oracle_state


@settings(max_examples=120, deadline=None)
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=40), min_size=1, max_size=4),
       st.integers(2, 4), st.integers(0, 30), st.data())
def test_requests_writing_in_turn_match_the_oracle_at_every_step(streams, n, extra, data):
    """Several live requests write their prompts and tokens into one automaton in an
    interleaved order, with eviction; each request's matching state, borders and
    retrieval are those of brute force over what the automaton holds."""
    capacity = n + 1 + extra
    shared = SharedMemory(n=n, nodes=capacity, k=2)
    cuts = [data.draw(st.integers(0, len(s))) for s in streams]
    contexts = [list(s[:cut]) for s, cut in zip(streams, cuts)]
    for ctx in contexts:
        shared.begin(ctx, None)
    pending = [list(s[cut:]) for s, cut in zip(streams, cuts)]
    while any(pending):
        who = data.draw(st.sampled_from([i for i, p in enumerate(pending) if p]))
        contexts[who].append(pending[who].pop(0))
        shared.extend(contexts[who])
        automaton = shared.automaton
        trie = contents(automaton)
        assert automaton.live <= capacity
        check_links(automaton, trie)
        for ctx in contexts:
            state = shared.state(ctx)
            assert automaton.string(state) == oracle_state(trie, ctx[-(n - 1):])
            for root in range(5):
                borders = {automaton.string(b) for b in automaton.borders(root, state=state)}
                assert borders == oracle_borders(trie, ctx, root)
                got = automaton.retrieve(root, 5, state=state)
                assert [(-c.freq, len(c.path)) for c in got] == oracle_retrieve(trie, borders, 5)


def _memory(spec: str = "racer:memory=shared", scopes: int = 16) -> DrafterMemory:
    return DrafterMemory(lambda: parse_method(spec).drafter, rated=True, limit=8, scopes=scopes)


def _drafted(session, root: int) -> set[int]:
    return set(session.draft(root, 64).tokens[1:])


PHRASE = [50, 51, 52, 53, 54, 55, 56, 57, 58]
TAIL = list(range(60, 70))  # n-grams start at every position the window slides over


def test_a_request_drafts_from_what_a_live_request_of_its_scope_wrote_and_not_another_scopes():
    memory = _memory()
    writer = memory.begin(("user", "a"), [1, 2, 3] + PHRASE + TAIL, None)
    same = memory.begin(("user", "a"), [7, 8, 50, 51], None)
    other = memory.begin(("user", "b"), [7, 8, 50, 51], None)
    alone = memory.begin(None, [7, 8, 50, 51], None)
    # The writer is still live: what it wrote is already there for its scope.
    assert set(PHRASE[3:]) <= _drafted(same, 52)
    tree = same.draft(52, 64)
    assert any(f and f[0] == "shared" for f in tree.features[1:])  # rated apart from its own
    for session in (other, alone):
        assert not _drafted(session, 52) & set(PHRASE[3:])
    # Tokens the writer accepts later reach its scope too.
    from racer.drafting.tree import DraftTree

    for token in [80, 81, 82, 83, 84, 85, 86, 87, 88, 89] + [80, 81]:
        writer.observe(DraftTree.single(token), None, [0])
    same.observe(DraftTree.single(80), None, [0])
    assert {82, 83} <= _drafted(same, 81)
    other.observe(DraftTree.single(80), None, [0])
    assert not _drafted(other, 81) & {82, 83}


def test_the_shared_table_answers_until_the_requests_own_row_takes_over():
    memory = _memory()
    first = memory.begin("s", [1, 2, 3], np.array([[10, 11], [20, 21], [30, 31]]))
    # A request with no predictions over its prompt (vLLM's case) drafts the rows the
    # first one wrote, tagged as shared rows.
    second = memory.begin("s", [4, 5, 3], None)
    tree = second.draft(3, 8)
    assert tree.tokens[1] == 30 and tree.features[1][0] == "shared-logits"
    from racer.drafting.tree import DraftTree

    second.observe(DraftTree.single(3), np.array([[77, 78]]), [0])
    tree = second.draft(3, 8)
    assert tree.tokens[1] == 77 and tree.features[1][0] == "logits"  # its own row now
    memory.end(first)
    memory.end(second)


def test_shared_memories_are_bounded_in_nodes_and_scopes():
    memory = _memory("racer:memory=shared:shared_nodes=200", scopes=3)
    rng = np.random.default_rng(0)
    for i in range(40):
        session = memory.begin(("user", str(i % 5)), rng.integers(0, 300, 120).tolist(), None)
        memory.end(session)
    assert len(memory.shared) == 3 and set(memory.shared) == {("user", str(i)) for i in (2, 3, 4)}
    assert all(s.automaton.live <= 200 for s in memory.shared.values())
    assert all(s.automaton.evictions > 0 for s in memory.shared.values())
    assert all(drafter._shared is None for _, (drafter, _) in memory.pool._idle.values())  # idle: none held


def test_other_memory_options_share_nothing():
    memory = _memory("racer")
    memory.end(memory.begin("s", [1, 2, 3], None))
    assert not memory.shared
    with pytest.raises(ValueError, match="shared_nodes"):
        parse_method("racer:memory=shared:shared_nodes=3")
    with pytest.raises(ValueError, match="memory"):
        parse_method("racer:memory=everyone")


def test_real_model_requests_sharing_a_memory_decode_as_alone(real):
    """Eight real requests (four questions, each asked twice) through four rows with one
    shared memory that earlier and live requests write into meanwhile: every answer is
    plain greedy's, and the repeats drafted from what the first askers wrote."""
    from racer import encode_prompt

    model, tokenizer = real
    questions = lossless_questions()[1::5][:4] * 2
    prompts = [encode_prompt(tokenizer, q.chat, chat=True) for q in questions]
    decoder = Decoder(model, tokenizer, "racer")
    decoder.calibrate()
    batch = BatchDecoder(model, tokenizer, "racer:memory=shared", max_batch=4, prefill_chunk=64, cost=decoder.cost)
    tokens = LOSSLESS_NEW_TOKENS // 2
    ids = [batch.submit(p, max_new_tokens=tokens, scope="server") for p in prompts]
    while batch.busy:
        batch.step()
    results = [batch.result(i) for i in ids]
    assert [r.tokens for r in results] == [hf_greedy(model, p, tokens) for p in prompts]
    assert sum(r.drafter_stats["accepted_shared"] for r in results[4:]) > tokens // 2
    assert batch.memory.shared["server"].writers == len(prompts)


def test_kept_shared_keeps_its_lineage_and_writes_a_resent_conversation_once():
    """``memory=kept-shared``: a request takes the drafter of its conversation, as
    ``kept`` does, and the scope's memory beside it; the text that drafter held is
    counted once in both automata, and another lineage drafts from it."""
    from racer.drafting.tree import DraftTree

    memory = _memory("racer:memory=kept-shared")
    talk_a, talk_b = [1, 2, 3] + PHRASE + TAIL, list(range(200, 240))
    a, b = memory.begin("s", talk_a, None), memory.begin("s", talk_b, None)
    for token in (90, 91, 92):
        a.observe(DraftTree.single(token), None, [0])
    memory.end(a)
    memory.end(b)
    resent = talk_a + [90, 91, 92] + [93, 94, 95]
    again = memory.begin("s", resent, None)
    assert again.drafter is a.drafter
    shared = memory.shared["s"]
    n = shared.automaton.n
    for automaton in (again.drafter.automaton, shared.automaton):
        freq = contents(automaton)
        assert freq[tuple(talk_a[:n])] == 1  # not relearnt, not rewritten
        assert freq[tuple(resent[-n:])] == 1  # what is new reaches both
    # The other lineage's drafter has never seen talk_a: it drafts it from the scope's memory.
    other = memory.begin("s", [7, 8, 50, 51], None)
    assert other.drafter is b.drafter
    assert set(PHRASE[3:]) <= _drafted(other, 52)
    assert shared.writers == 4


def test_real_agent_sessions_with_kept_and_shared_memory_decode_as_alone(real):
    """Two agent sessions, each call resending the conversation, through two rows with
    ``memory=kept-shared``: each call's drafter holds its conversation and the scope's
    memory holds both; every answer is plain greedy's."""
    from racer import encode_prompt
    from racer.bench.questions import load_questions

    model, tokenizer = real
    calls = load_questions("agent_sessions")
    sessions = [[q for q in calls if q.session == name][:2] for name in ("session-0", "session-1")]
    batch = BatchDecoder(model, tokenizer, "racer:memory=kept-shared", max_batch=2, prefill_chunk=256, check=False)
    tokens = 32
    asked = []
    for turn in range(2):  # both sessions' calls of a turn decode together
        ids = [batch.submit(s[turn].chat, max_new_tokens=tokens, scope="server") for s in sessions]
        while batch.busy:
            batch.step()
        asked += [(s[turn], batch.result(i)) for s, i in zip(sessions, ids)]
    for question, result in asked:
        assert result.tokens == hf_greedy(model, encode_prompt(tokenizer, question.chat, chat=True), tokens)
    assert batch.memory.shared["server"].writers == 4
    assert sum(r.drafter_stats["accepted_shared"] for _, r in asked) > 0
