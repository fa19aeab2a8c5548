"""A Llama-pattern decoder stack run as the tensor operations of its transformers
forward, in the same order, without the scaffolding around them.

transformers wraps every layer's forward in decorators (keyword deprecation, output
capture, config defaults, gradient checkpointing) and calls each norm, projection and
rotary helper through ``nn.Module.__call__``. On a small model on a CPU those calls
are a sizeable part of a pass that reads its weights once
(``benchmarks/smollm2-cpu/lean_stack`` times both). ``DecoderStack`` takes the base
model's ``forward`` for the span of a pass and runs the same operations on the same
modules' weights: the embedding, the family's own mask function and rotary module, per
layer the family's own norm and activation, the projections (whatever linear kernel is
installed in them), RoPE with the family's ``rotate_half``, the cache's ``update`` and
the attention implementation the config names.

It is offered only to the families whose modeling code computes exactly this
(``FAMILIES``: others of the same layout add a residual multiplier, clip q/k/v, skip
RoPE in some layers or scale the embeddings, depending on their configs), where the
model has the layout (every layer exactly a self-attention with q/k/v/o projections,
an MLP and two norms, no windows), and where a probe, a prompt and then a masked tree
pass, gives logits bit-identical to the model's own forward (which catches a forward
patched in place); anything else the forward is asked (hidden states, attentions,
embeddings in place of ids), and any pass while a hook is set on one of the stack's
modules, is handed to the model's own forward.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

_LAYER = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}
_MLP = {"gate_proj", "up_proj", "down_proj"}
# transformers model types whose modeling code is the sequence ``DecoderStack.forward`` runs.
FAMILIES = ("llama", "mistral", "qwen2")
_PROBE_PROMPT = 11  # tokens the probe prefills before its tree pass


def _children(module: Any) -> set[str]:
    return {name for name, _ in module.named_children()}


def _own_state(module: Any) -> bool:
    """Whether ``module`` holds parameters or buffers of its own (not its children's):
    an attention sink, a learnt scale, something the Llama pattern does not compute."""
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def _hooked(modules: list[Any]) -> bool:
    from torch.nn.modules import module as nn_module

    globals_ = (nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks)
    return any(globals_) or any(m._forward_hooks or m._forward_pre_hooks for m in modules)


class DecoderStack:
    """The lean forward of one model's base (``model.model``), installed in it by
    ``installed()`` for one pass."""

    def __init__(self, base: Any, family: Any, cache_keyword: str) -> None:
        from transformers.modeling_outputs import BaseModelOutputWithPast

        self.base = base
        self.mask_fn, self.eager = family.create_causal_mask, family.eager_attention_forward
        self.rotate_half = family.rotate_half
        self.cache_keyword = cache_keyword
        self.output = BaseModelOutputWithPast
        self.attention_functions = family.ALL_ATTENTION_FUNCTIONS
        self.stock = type(base).forward.__get__(base)
        self.modules = [m for layer in base.layers for m in layer.modules()]

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: Any = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                use_cache: bool | None = None, **kwargs: Any) -> Any:
        cache = kwargs.pop(self.cache_keyword, None)
        # Anything else asked of the forward (a tensor too: compared by identity, never by value).
        asked = any(value is not None and value is not False for value in kwargs.values())
        if (self.base.training or input_ids is None or inputs_embeds is not None or position_ids is None
                or cache is None or asked or _hooked(self.modules)):
            return self.stock(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              inputs_embeds=inputs_embeds, use_cache=use_cache, **{self.cache_keyword: cache},
                              **kwargs)
        base = self.base
        hidden = base.embed_tokens(input_ids)
        mask = self.mask_fn(config=base.config, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                            position_ids=position_ids)
        cos, sin = base.rotary_emb(hidden, position_ids=position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        shape = hidden.shape[:-1]
        passed = {"position_ids": position_ids, "use_cache": use_cache}
        # Every layer's attention reads the base's config (``_pattern``), switched per pass.
        attend = self.attention_functions.get_interface(base.config._attn_implementation, self.eager)
        rotate_half = self.rotate_half
        for layer in base.layers[: base.config.num_hidden_layers]:
            attn = layer.self_attn
            x = layer.input_layernorm.forward(hidden)
            heads = (*shape, -1, attn.head_dim)
            query = attn.q_proj.forward(x).view(heads).transpose(1, 2)
            key = attn.k_proj.forward(x).view(heads).transpose(1, 2)
            value = attn.v_proj.forward(x).view(heads).transpose(1, 2)
            # In place where a tensor is the pass's own temporary: the same operations in
            # the same order (so the same bits), without allocating a buffer for each.
            query = (query * cos).add_(rotate_half(query).mul_(sin))
            key = (key * cos).add_(rotate_half(key).mul_(sin))
            # The keywords a layer hands on to the cache and the attention function.
            key, value = cache.update(key, value, attn.layer_idx, kwargs=passed)
            out, _ = attend(attn, query, key, value, mask, dropout=0.0, scaling=attn.scaling, **passed)
            hidden = hidden.add_(attn.o_proj.forward(out.reshape(*shape, -1).contiguous()))
            x, mlp = layer.post_attention_layernorm.forward(hidden), layer.mlp
            hidden = hidden.add_(mlp.down_proj.forward(mlp.act_fn(mlp.gate_proj.forward(x)).mul_(mlp.up_proj.forward(x))))
        hidden = base.norm.forward(hidden)
        return self.output(last_hidden_state=hidden, **{self.cache_keyword: cache})

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The base model's forward is ``self.forward`` inside this block (past
        ``nn.Module.__setattr__``: a plain attribute, so ``nn.Module.__call__`` and the
        base's own hooks still run)."""
        self.base.__dict__["forward"] = self.forward
        try:
            yield
        finally:
            self.base.__dict__.pop("forward", None)


def _pattern(model: Any) -> tuple[Any, Any] | None:
    """The base model and its family's modeling module (for the mask function, the
    attention registry and the eager attention it names) where ``model`` has the Llama
    layout this module computes, else None."""
    base = getattr(model, "model", None)
    config = getattr(model, "config", None)
    if base is None or config is None or getattr(base, "config", None) is not config:
        return None
    if getattr(config, "model_type", None) not in FAMILIES:
        return None
    if not all(hasattr(base, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return None
    family = sys.modules.get(type(base).__module__)
    if not all(hasattr(family, name) for name in ("create_causal_mask", "eager_attention_forward",
                                                   "ALL_ATTENTION_FUNCTIONS", "rotate_half")):
        return None
    if getattr(config, "sliding_window", None) is not None:
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return None
    if getattr(config, "_attn_implementation", None) is None:
        return None
    for layer in base.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if _children(layer) != _LAYER or _own_state(layer) or attn is None or mlp is None:
            return None
        if _children(attn) != _ATTENTION or _own_state(attn) or _own_state(mlp):
            return None
        if _children(mlp) != _MLP | {"act_fn"}:
            return None
        if not all(hasattr(attn, name) for name in ("head_dim", "scaling", "layer_idx")) or attn.config is not config:
            return None
        if not all(type(getattr(module, name)) is torch.nn.Linear
                   for module, names in ((attn, _ATTENTION), (mlp, _MLP)) for name in names):
            return None
    return base, family


def _probe_logits(model: Any, cache: Any, facts: Any) -> list[torch.Tensor]:
    """Logits of a short prompt, then of a three-node tree (a root and two children)
    under a 4D additive mask, on ``cache``."""
    device, dtype, vocab, cache_keyword = facts.device, facts.dtype, facts.vocab_size, facts.cache_keyword
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab, (1, _PROBE_PROMPT), generator=generator).to(device)
    tree = torch.randint(vocab, (1, 3), generator=generator).to(device)
    n = _PROBE_PROMPT
    allowed = torch.ones(3, n + 3, dtype=torch.bool)
    allowed[:, n:] = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    mask = torch.zeros(1, 1, 3, n + 3, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min).to(device)
    outputs = []
    with torch.inference_mode():
        out = model(input_ids=prompt, position_ids=torch.arange(n, device=device)[None], use_cache=True,
                    **{cache_keyword: cache})
        outputs.append(out.logits)
        depths = torch.tensor([[n, n + 1, n + 1]], device=device)
        out = model(input_ids=tree, position_ids=depths, attention_mask=mask, use_cache=True,
                    **{cache_keyword: cache})
        outputs.append(out.logits)
    return outputs


_stacks: "weakref.WeakKeyDictionary[Any, DecoderStack | None]" = weakref.WeakKeyDictionary()


def decoder_stack(model: Any, facts: Any, new_cache: Callable[[], Any]) -> DecoderStack | None:
    """``model``'s ``DecoderStack``, worked out once per model, or None where the model
    does not have the Llama layout or the probe's logits differ from its own forward's
    in any bit. ``facts``: the model's ``racer.engine.model_facts.ModelFacts`` (device,
    dtype, vocabulary, cache keyword); ``new_cache`` makes an empty KV cache of the kind
    passes will use."""
    if model in _stacks:
        return _stacks[model]
    stack = None
    found = _pattern(model)
    if found is not None:
        candidate = DecoderStack(*found, facts.cache_keyword)
        try:
            expected = _probe_logits(model, new_cache(), facts)
            with candidate.installed():
                got = _probe_logits(model, new_cache(), facts)
            if all(torch.equal(a, b) for a, b in zip(expected, got)):
                stack = candidate
        except (RuntimeError, TypeError, ValueError, AttributeError, IndexError):
            stack = None
    _stacks[model] = stack
    return stack
