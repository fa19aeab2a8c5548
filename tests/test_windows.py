"""Windowed attention: racer's per-layer masks, the support check's reading of every way a
config declares locality, and a self-test that fails when a mask path is broken."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from families import FAMILIES, WINDOW, build
from racer.drafting.tree import TreeBuilder
from racer.engine import support, windows
from racer.engine.selftest import UnsupportedModelError, self_test
from racer.engine.verifier import TreeVerifier
from racer.engine.windows import AttentionLayout, Window


def family(label: str):
    return build(next(f for f in FAMILIES if f.label == label))


def allowed(mask: torch.Tensor) -> np.ndarray:
    return (mask[0, 0] == 0).numpy()


def branching_tree():
    builder = TreeBuilder(5, 8)
    a = builder.add_child(0, 6)  # depth 1, index 1
    builder.add_child(0, 7)  # depth 1, index 2
    builder.add_child(a, 8)  # depth 2, index 3
    return builder.build()


def test_sliding_mask_places_the_window_by_position_not_by_row():
    tree = branching_tree()  # depths 0 1 1 2
    layout = AttentionLayout((Window("sliding", 4),))
    mask = layout.masks(10, torch.tensor(tree.depths), torch.from_numpy(tree.ancestor_mask()), torch.float32,
                         max(tree.depths))
    got = allowed(mask)
    # node at position 10 + d sees cached positions > 10 + d - 4, and its ancestors
    assert got[0, :10].nonzero()[0].tolist() == [7, 8, 9]
    assert got[1, :10].nonzero()[0].tolist() == [8, 9]
    assert got[2, :10].nonzero()[0].tolist() == [8, 9]  # row 2 is at depth 1, like row 1
    assert got[3, :10].nonzero()[0].tolist() == [9]
    assert got[3, 10:].tolist() == [True, True, False, True]  # root, its parent, not the sibling, itself


def test_chunked_mask_keeps_each_node_in_its_chunk():
    tree = branching_tree()
    layout = AttentionLayout((Window("chunked", 8),))
    got = allowed(layout.masks(7, torch.tensor(tree.depths), torch.from_numpy(tree.ancestor_mask()), torch.float32,
                         max(tree.depths)))
    assert got[0, :7].all()  # position 7 is in chunk 0 with every cached position
    assert not got[1, :7].any() and not got[1, 7]  # position 8 starts chunk 1: not even the root
    assert got[1, 8]


def test_keyed_models_get_one_mask_per_layer_type():
    tree = branching_tree()
    keyed = {"full_attention": Window(), "sliding_attention": Window("sliding", 4)}
    layout = AttentionLayout(tuple(keyed.values()), keyed)
    masks = layout.masks(10, torch.tensor(tree.depths), torch.from_numpy(tree.ancestor_mask()), torch.float32,
                         max(tree.depths))
    assert set(masks) == set(keyed)
    assert allowed(masks["full_attention"])[3, :10].all()
    assert allowed(masks["sliding_attention"])[3, :10].sum() == 1


def test_a_window_the_pass_does_not_reach_costs_nothing():
    tree = branching_tree()
    layout = AttentionLayout((Window("sliding", 64),))
    mask = layout.masks(10, torch.tensor(tree.depths), torch.from_numpy(tree.ancestor_mask()), torch.float32,
                         max(tree.depths))
    assert allowed(mask)[:, :10].all()


def test_windowed_trees_match_sequential_decoding_after_branching_commits():
    model = family("Gemma 2")
    rng = np.random.default_rng(3)
    from racer.engine.selftest import random_tree, sequential_logits

    context = rng.integers(model.config.vocab_size, size=WINDOW + 5).tolist()
    verifier = TreeVerifier(model)
    verifier.prefill(context)
    for _ in range(4):  # each step accepts the path to the node furthest from its depth
        tree = random_tree(rng, model.config.vocab_size, 12, 4)
        got = verifier.verify(tree)
        assert (got - sequential_logits(model, context, tree)).abs().max() < 2e-3
        node = max(range(len(tree)), key=lambda i: i - tree.depths[i])
        path = tree.path_to(node)
        verifier.commit(path, len(tree))
        context += [tree.tokens[i] for i in path]
    assert verifier.cached == len(context) > 2 * WINDOW - 4


def test_self_test_refuses_a_broken_window_mask(monkeypatch):
    """Negative control: a mask that forgets the window passes short contexts, so only
    a self-test whose context runs past the window sees it."""
    model = family("Mistral (sliding window)")
    monkeypatch.setattr(Window, "allowed", lambda self, q, k: torch.ones(q.shape[0], k.shape[0], dtype=torch.bool))
    assert self_test(model) <= 2e-3  # a short context cannot tell
    with pytest.raises(UnsupportedModelError, match="past its 16-position window"):
        self_test(model, past_windows=True)


def test_a_decoder_checks_the_windows_when_a_request_first_reaches_one(monkeypatch):
    from families import prompts

    from racer import Decoder

    model = family("Gemma 2")
    monkeypatch.setattr(Window, "allowed", lambda self, q, k: torch.ones(q.shape[0], k.shape[0], dtype=torch.bool))
    decoder = Decoder(model, None, "racer:capacity=4")
    ids = prompts(128)["short"]
    assert len(decoder.generate(ids, max_new_tokens=2).tokens) == 2  # far from the window: nothing to check
    with pytest.raises(UnsupportedModelError, match="window"):
        decoder.generate(ids, max_new_tokens=32)


def test_self_test_refuses_windows_placed_by_row_index(monkeypatch):
    """GPT-Neo's local layers window by row index: without racer's replacement of their
    buffer, branching trees lose keys (the silently wrong output this check now stops)."""
    model = family("GPT-Neo (global + local layers)")
    own = support._gpt_neo_layout
    monkeypatch.setattr(support, "_gpt_neo_layout",
                        lambda model, config: AttentionLayout(own(model, config).windows))
    with pytest.raises(UnsupportedModelError, match="differ from sequential decoding"):
        self_test(model, past_windows=True)


def test_self_test_passes_windowed_families():
    for label in ("Mistral (sliding window)", "Gemma 3", "Llama 4 (chunked)", "GPT-Neo (global + local layers)"):
        model = family(label)
        assert self_test(model) <= 2e-3 and self_test(model, past_windows=True) <= 2e-3


def _config(**fields):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    for name, value in fields.items():
        setattr(config, name, value)
    return SimpleNamespace(config=config, modules=lambda: iter(()))


@pytest.mark.parametrize("fields, message", [
    (dict(layer_types=["full_attention", "mystery_attention"]), r"layer 1 \('mystery_attention'\): racer does not know"),
    (dict(layer_types=["full_attention", "linear_attention"]), r"layer 1 \('linear_attention'\) carries a recurrent"),
    (dict(layer_types=["conv", "full_attention"]), r"layer 0 \('conv'\)"),
    (dict(attention_window=32), "locality racer does not read: attention_window=32"),
    (dict(local_chunk_length=8), "local_chunk_length=8"),
    (dict(layer_types=["sliding_attention", "full_attention"], sliding_window=0), "positive size"),
])
def test_unknown_locality_and_state_are_refused_naming_the_layer(fields, message):
    with pytest.raises(UnsupportedModelError, match=message):
        support.layout(_config(**fields))


def test_every_way_a_config_declares_a_window_is_read():
    layout = support.layout(_config(sliding_window=8))
    assert layout.windows == (Window("sliding", 8),) * 2 and layout.keyed is None
    layout = support.layout(_config(layer_types=["sliding_attention", "full_attention"], sliding_window=8))
    assert layout.keyed == {"sliding_attention": Window("sliding", 8), "full_attention": Window()}
    layout = support.layout(_config(layer_types=["chunked_attention", "full_attention"], attention_chunk_size=8))
    assert layout.keyed["chunked_attention"] == Window("chunked", 8)
    neo = support.layout(family("GPT-Neo (global + local layers)"))
    assert neo.windows == (Window(), Window("sliding", WINDOW)) and len(neo.indexed) == 1
    assert support.layout(_config(sliding_window=None)).windowed is False


def test_indexed_window_gives_the_module_its_buffer_back():
    model = family("GPT-Neo (global + local layers)")
    neo = support.layout(model)
    module = neo.indexed[0].module
    own = module.bias
    mask = torch.zeros(1, 1, 1, 1)
    with pytest.raises(RuntimeError):
        with windows.indexed_windows(neo, {"shared": mask, neo.indexed[0].key: mask}):
            assert module.bias is not own
            raise RuntimeError
    assert module.bias is own and not module._forward_pre_hooks
