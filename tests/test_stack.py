"""The lean decoder stack (``racer.fastpaths.stack``): taken where a model has the Llama
layout and the probe agrees to the bit, refused elsewhere, handing to the model's own
forward whatever it does not compute, and decoding exactly what the model's own forward
decodes, on tiny families and on the embedded model."""

from __future__ import annotations

import numpy as np
import torch

from families import FAMILIES, Family, build, greedy, known, prompts as family_prompts, shared_cost

from racer import Decoder
from racer.engine.selftest import random_tree
from racer.engine.verifier import TreeVerifier
from racer.fastpaths import FastPaths
from racer.fastpaths.stack import _pattern

# The families whose tiny configurations have the Llama layout and pass the probe.
LEAN = {"Llama", "Mistral (no window)", "Qwen2 / Qwen2.5"}


def _stack_taken(family: Family) -> bool:
    return TreeVerifier(build(family)).stack is not None


def test_the_stack_is_taken_by_llama_layout_families_only():
    candidates = [f for f in FAMILIES if known(f) and not f.refused]
    taken = {f.label for f in candidates if _stack_taken(f)}
    assert taken == LEAN & {f.label for f in candidates}
    assert not any(f.windowed for f in candidates if f.label in taken)


def test_a_llama_whose_attention_computes_otherwise_is_refused_by_the_probe():
    from transformers.models.llama.modeling_llama import LlamaAttention

    class Halved(LlamaAttention):
        """What a patch or an adapter library might put in place: same modules, other maths."""

        def forward(self, *args, **kwargs):
            out, weights = super().forward(*args, **kwargs)
            return out * 0.5, weights

    model = build(next(f for f in FAMILIES if f.label == "Llama"), seed=4)
    model.model.layers[1].self_attn.__class__ = Halved
    assert _pattern(model) is not None  # the layout alone would take it
    assert TreeVerifier(model).stack is None
    ids = family_prompts(model.config.vocab_size)["short"]
    decoded = Decoder(model, None, "racer:capacity=8", cost=shared_cost()).generate(ids, max_new_tokens=32).tokens
    assert decoded == greedy(model, ids)


def test_lean_logits_are_the_models_own_on_trees_and_prompts(tiny):
    rng = np.random.default_rng(3)
    vocab = tiny.config.vocab_size
    lean, stock = TreeVerifier(tiny), TreeVerifier(tiny, FastPaths(stack=False))
    assert lean.stack is not None and stock.stack is None
    context = [int(t) for t in rng.integers(vocab, size=40)]
    assert torch.equal(lean.prefill(context, keep=0), stock.prefill(context, keep=0))
    for size in (1, 2, 5, 12):
        tree = random_tree(rng, vocab, size, max(1, min(size - 1, 4)))
        got, expected = lean.verify(tree), stock.verify(tree)
        assert torch.equal(got, expected), size
        path = [0] + [i for i in range(1, size) if tree.parents[i] == 0][:1]
        lean.commit(path, size)
        stock.commit(path, size)


def test_what_the_stack_does_not_compute_goes_to_the_models_own_forward(tiny):
    verifier = TreeVerifier(tiny)
    stack = verifier.stack
    assert stack is not None
    ids = torch.tensor([[5, 6, 7]])
    with torch.inference_mode(), stack.installed():
        out = tiny(input_ids=ids, output_hidden_states=True, use_cache=False)
    assert out.hidden_states is not None and len(out.hidden_states) == tiny.config.num_hidden_layers + 1

    calls = []
    handle = tiny.model.layers[0].mlp.register_forward_hook(lambda *args: calls.append(1))
    try:
        verifier.prefill([5, 6, 7, 8])
        verifier.verify(random_tree(np.random.default_rng(0), tiny.config.vocab_size, 3, 2))
    finally:
        handle.remove()
    assert len(calls) == 2  # the hook saw both passes: they ran the model's own layers
    assert "forward" not in tiny.model.__dict__


def test_the_embedded_model_takes_the_stack_and_decodes_the_same_without_it(real):
    model, tok = real
    prompt = "List three prime numbers and explain why each is prime."
    lean = Decoder(model, tok, "racer")
    assert lean.verifier.stack is not None
    stock = Decoder(model, tok, "racer", fast_paths=FastPaths(stack=False))
    assert stock.verifier.stack is None
    assert (lean.generate(prompt, chat=True, max_new_tokens=48).tokens
            == stock.generate(prompt, chat=True, max_new_tokens=48).tokens)


def test_a_tensor_among_the_keywords_goes_to_the_models_own_forward(tiny, monkeypatch):
    # Keywords are told apart by identity: a tensor (flash attention's sequence lengths,
    # say) must not be compared by value, which torch refuses for more than one element.
    stack = TreeVerifier(tiny).stack
    handed = []
    monkeypatch.setattr(stack, "stock", lambda **kwargs: handed.append(kwargs) or "stock")  # the model's is shared
    lengths = torch.tensor([0, 3])
    keyword = stack.cache_keyword
    out = stack.forward(input_ids=torch.tensor([[5, 6, 7]]), position_ids=torch.arange(3)[None],
                        cu_seq_lens_q=lengths, **{keyword: object()})
    assert out == "stock" and handed[0]["cu_seq_lens_q"] is lengths
