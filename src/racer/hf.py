"""racer from Hugging Face ``generate``: ``model.generate(**inputs, custom_generate=racer.hf.generate,
racer_method="racer")`` decodes with racer's engine and returns what ``generate`` returns.

``generate`` prepares the inputs, the generation config, the logits processors and the
stopping criteria as it always does, then calls ``racer.hf.generate`` in place of its
own loop. What it prepared is honoured or refused by name, never ignored:

- the prompt rows of ``input_ids`` (left padding and ``attention_mask`` included): each
  row decodes as it would alone, through the batch engine, and comes back padded as
  ``generate`` pads (``pad_token_id`` after a row's end);
- the processors racer's exact sampling applies (repetition penalty, temperature,
  top-k, top-p, in ``generate``'s order; with ``do_sample=False`` greedy): any other is
  a ``ValueError`` naming it, as are beam search, assisted or contrastive decoding,
  ``output_scores``/``output_logits``/``output_attentions``/``output_hidden_states``;
- the stopping criteria: ``max_length``/``max_new_tokens``, ``eos_token_id`` (one or
  several: exactly those end a row, as in ``generate``), ``StopStringCriteria``
  (``stop_strings``), ``MaxTimeCriteria`` (``max_time``, checked after each step);
  another criterion is refused by name;
- ``streamer``: given the same tokens, in the same pieces, as ``generate``'s own loop;
- ``num_return_sequences`` with sampling: each copy of a prompt is its own row;
- ``return_dict_in_generate``: a ``GenerateDecoderOnlyOutput`` with ``sequences`` only.

Sampling draws each row's seed from torch's default generator, so ``torch.manual_seed``
makes a call repeatable. One engine per model, method and batch size is kept on the
model: its drafters remember earlier calls, as a ``racer.Decoder``'s do.

``hub_generate`` is the same for ``custom_generate="<folder>"`` (``custom_generate/`` at
the repository's root), which hands its function ``generate``'s raw arguments.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from racer import BatchDecoder
from racer.engine import ModelFacts

SCOPE = "hf.generate"  # the memory scope of every request made through generate
_CHECKED: "weakref.WeakSet[Any]" = weakref.WeakSet()  # models whose tree verification was self-tested
_ENGINES_ATTRIBUTE = "_racer_hf_engines"
_LOCK_ATTRIBUTE = "_racer_hf_lock"

# Model inputs generate prepares itself, each checked below; anything else is refused.
_PREPARED_INPUTS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache", "past_key_values"}


def generate(model: Any, input_ids: torch.Tensor, logits_processor: Any = None, stopping_criteria: Any = None,
             generation_config: Any = None, synced_gpus: bool | None = None, streamer: Any = None,
             racer_method: str = "racer", **model_kwargs: Any) -> Any:
    """``custom_generate`` for ``model.generate``: decodes ``input_ids`` with racer's
    ``racer_method`` (a method spec: ``racer``, ``pld``, ``rest``, ``token-recycling``,
    ``logitspec``, ``none``, with options such as ``racer:capacity=16``) and returns the
    sequences tensor, or a ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate``."""
    from transformers.generation import GenerateDecoderOnlyOutput

    config = generation_config if generation_config is not None else model.generation_config
    held_back = _held_back_by_generate(model)
    if streamer is None:
        streamer = held_back.get("streamer")
    _refuse_modes(config, held_back.get("assistant_model"))
    sampling = _sampling(logits_processor, bool(config.do_sample))
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids: expected a 2-D tensor of token ids (racer.hf.generate decodes decoder-only "
                         "language models from their token ids)")
    stops = _Stops.of(stopping_criteria, input_ids.shape[1])
    prompts = _prompts(input_ids, model_kwargs)
    if not isinstance(racer_method, str):
        raise ValueError(f"racer_method: expected a method spec such as 'racer' or 'pld:max_ngram=3', "
                         f"got {type(racer_method).__name__}")
    pad = config._pad_token_tensor if hasattr(config, "_pad_token_tensor") else None
    pad_id = int(pad.reshape(-1)[0]) if pad is not None else config.pad_token_id
    with model.__dict__.setdefault(_LOCK_ATTRIBUTE, threading.Lock()):  # one call at a time per model
        rows = _Decoding(_engine(model, racer_method, len(prompts)), prompts, input_ids, stops, streamer, pad_id)
        new = rows.run(sampling)
    sequences = _padded(input_ids, new, pad_id)
    if config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def hub_generate(model: Any, **arguments: Any) -> Any:
    """The function of the Hub-shaped ``custom_generate/generate.py``: ``generate``
    hands it its own arguments unprepared, so it passes them back to ``model.generate``
    with ``custom_generate=racer.hf.generate``, after turning ``stop_strings`` (with
    ``tokenizer``) into the ``StopStringCriteria`` that ``generate`` cannot build for a
    callable (it does not hand the tokenizer on)."""
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import StopStringCriteria

    config = arguments.get("generation_config")
    stop_strings = arguments.pop("stop_strings", None)
    if stop_strings is None and config is not None and getattr(config, "stop_strings", None) is not None:
        import copy

        config = arguments["generation_config"] = copy.deepcopy(config)
        stop_strings, config.stop_strings = config.stop_strings, None
    tokenizer = arguments.pop("tokenizer", None)
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings: pass the model's tokenizer as tokenizer= to turn them into tokens")
        criteria = StoppingCriteriaList(arguments.get("stopping_criteria") or [])
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
        arguments["stopping_criteria"] = criteria
    arguments.setdefault("racer_method", "racer")
    return model.generate(custom_generate=generate, **arguments)


# -- what generate prepared --------------------------------------------------------------
def _held_back_by_generate(model: Any) -> dict[str, Any]:
    """The streamer and assistant model given to the ``generate`` call that called us.
    transformers hands a callable ``custom_generate`` neither (after putting the prompt
    into the streamer), so they are read from that call's frame."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            break
        names = frame.f_locals
        if (frame.f_code.co_name == "generate" and names.get("self") is model
                and frame.f_code.co_filename.replace("\\", "/").endswith("generation/utils.py")):
            return {name: names.get(name) for name in ("streamer", "assistant_model")}
        frame = frame.f_back
    return {}


def _refuse_modes(config: Any, assistant_model: Any) -> None:
    """Greedy decoding or sampling only: the other modes of ``generate``, by the field
    that asks for them."""
    asked = [(getattr(config, "num_beams", 1) or 1) > 1 and "num_beams > 1 (beam search)",
             assistant_model is not None and "assistant_model (assisted decoding: racer drafts itself)",
             getattr(config, "prompt_lookup_num_tokens", None) is not None
             and "prompt_lookup_num_tokens (use racer_method='pld')",
             getattr(config, "assistant_early_exit", None) is not None and "assistant_early_exit",
             getattr(config, "use_mtp", False) and "use_mtp",
             (getattr(config, "penalty_alpha", None) or 0) > 0 and "penalty_alpha (contrastive search)",
             getattr(config, "dola_layers", None) is not None and "dola_layers (DoLa decoding)",
             getattr(config, "constraints", None) is not None and "constraints",
             getattr(config, "force_words_ids", None) is not None and "force_words_ids"]
    asked += [getattr(config, name, False) and f"{name} (racer.hf.generate returns the sequences only)"
              for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")]
    asked = [reason for reason in asked if reason]
    if asked:
        raise ValueError(f"{asked[0]}: racer.hf.generate decodes greedily (do_sample=False) or samples "
                         "(do_sample=True), with the same output as generate's own loop; it does not do this")


def _sampling(processors: Any, do_sample: bool) -> dict[str, Any]:
    """racer's sampling fields for ``generate``'s prepared logits processors, which must
    be ones racer applies, in the order it applies them. Without ``do_sample`` the
    warpers leave the most likely token where it is: greedy, as in ``generate``."""
    from transformers.generation.logits_process import (LogitNormalization, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    order = [RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper]
    fields: dict[str, Any] = {"temperature": 1.0} if do_sample else {}
    last = -1
    for processor in processors or []:
        kind = type(processor)
        if kind is LogitNormalization:  # renormalize_logits: the same tokens, the same draws
            continue
        if kind not in order:
            raise ValueError(f"logits_processor: {kind.__name__} is not one racer applies (it applies "
                             "repetition_penalty, temperature, top_k and top_p, exactly)")
        index = order.index(kind)
        if index <= last:
            raise ValueError(f"logits_processor: {kind.__name__} out of generate's order (repetition penalty, "
                             "temperature, top-k, top-p) or given twice")
        last = index
        if kind in (TopKLogitsWarper, TopPLogitsWarper) and (
                processor.filter_value != -float("inf") or processor.min_tokens_to_keep != 1):
            raise ValueError(f"logits_processor: {kind.__name__} with filter_value={processor.filter_value} and "
                             f"min_tokens_to_keep={processor.min_tokens_to_keep}; racer applies -inf and 1")
        if kind is RepetitionPenaltyLogitsProcessor:
            if processor.prompt_ignore_length is not None:
                raise ValueError("repetition_penalty: prompt_ignore_length is not one racer applies")
            fields["repetition_penalty"] = float(processor.penalty)
        elif not do_sample:
            continue
        elif kind is TemperatureLogitsWarper:
            fields["temperature"] = float(processor.temperature)
        elif kind is TopKLogitsWarper:
            fields["top_k"] = int(processor.top_k)
        else:
            fields["top_p"] = float(processor.top_p)
    return fields


@dataclass
class _Stops:
    """Where rows end: ``max_new`` tokens, the ``end_ids`` and, checked token by token,
    the stop-string criteria; every row at ``deadline`` (``time.time()``)."""

    max_new: int
    end_ids: tuple[int, ...] = ()
    strings: list = field(default_factory=list)
    deadline: float | None = None

    @staticmethod
    def of(criteria: Any, prompt_length: int) -> "_Stops":
        from transformers.generation.stopping_criteria import (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria,
                                                               StopStringCriteria)

        max_length, end_ids, strings, deadline = None, (), [], None
        for criterion in criteria or []:
            if isinstance(criterion, MaxLengthCriteria):
                max_length = min(max_length or criterion.max_length, criterion.max_length)
            elif isinstance(criterion, EosTokenCriteria):
                end_ids = tuple(sorted(set(end_ids) | {int(t) for t in criterion.eos_token_id.reshape(-1).tolist()}))
            elif isinstance(criterion, StopStringCriteria):
                strings.append(criterion)
            elif isinstance(criterion, MaxTimeCriteria):
                ends = criterion.initial_timestamp + criterion.max_time
                deadline = ends if deadline is None else min(deadline, ends)
            else:
                raise ValueError(f"stopping_criteria: {type(criterion).__name__} is not one racer applies (it "
                                 "applies max_length, eos_token_id, stop_strings and max_time)")
        if max_length is None:
            raise ValueError("max_length: generate set no length limit (pass max_new_tokens or max_length)")
        # generate emits at least one token, even past max_length.
        return _Stops(max(1, max_length - prompt_length), end_ids, strings, deadline)

    def stop_string_at(self, row: torch.Tensor, tokens: list[int], start: int) -> int | None:
        """The count of ``tokens`` after which a stop string ends the row, checking from
        token ``start`` on (``row``: its prompt, as generate holds it). A criterion reads
        only the last ``maximum_token_len`` ids of a sequence, so only those are built."""
        if not self.strings:
            return None
        window = max(criterion.maximum_token_len for criterion in self.strings)
        before = (row[-window:].tolist() + tokens[max(0, start - window) : start])[-window:]
        context = before + tokens[start:]
        for end in range(start + 1, len(tokens) + 1):
            upto = len(before) + end - start
            tail = context[max(0, upto - window) : upto]
            ids = torch.tensor([tail], dtype=row.dtype, device=row.device)
            if any(bool(criterion(ids, None)[0]) for criterion in self.strings):
                return end
        return None


def _prompts(input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> list[list[int]]:
    """Each row's prompt tokens (those its attention mask keeps), after checking the
    model inputs generate prepared."""
    unknown = sorted(name for name, value in model_kwargs.items()
                     if name not in _PREPARED_INPUTS and value is not None)
    if unknown:
        raise ValueError(f"{unknown[0]}: racer.hf.generate takes a prompt as input_ids (with attention_mask); "
                         f"it does not take {', '.join(unknown)}")
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        # generate makes an empty cache for its own loop; racer keeps its own.
        if cache is not None and (not hasattr(cache, "get_seq_length") or cache.get_seq_length() > 0):
            raise ValueError(f"{name}: racer.hf.generate starts from the prompt; it does not continue a cache")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids: expected at least one prompt of at least one token, got shape "
                         f"{tuple(input_ids.shape)}")
    mask = model_kwargs.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(input_ids)
    elif mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask: expected the shape of input_ids {tuple(input_ids.shape)}, "
                         f"got {tuple(mask.shape)}")
    keep = mask.to(torch.bool)
    positions = model_kwargs.get("position_ids")
    if positions is not None:
        # A prompt decodes at positions 0, 1, ... of the tokens its mask keeps, as
        # generate numbers them itself; positions of the caller's own are refused.
        expected = (keep.long().cumsum(-1) - 1).clamp(min=0)
        if positions.shape[-1] != input_ids.shape[1] or not torch.equal(
                positions.expand_as(expected).to(expected.device)[keep], expected[keep]):
            raise ValueError("position_ids: racer places each prompt's tokens at positions 0, 1, ...; "
                             "leave position_ids to generate")
    prompts = []
    for row, kept in zip(input_ids, keep):
        ids = row[kept].tolist()
        if not ids:
            raise ValueError("attention_mask: a row masks every token of its prompt")
        prompts.append(ids)
    return prompts


# -- the engine ------------------------------------------------------------------------
def _engine(model: Any, method: str, rows: int) -> BatchDecoder:
    """The engine kept on ``model`` for ``method`` and ``rows`` (one per dtype and
    device the model has had)."""
    facts = ModelFacts.of(model)
    key = (method, rows, str(facts.device), str(getattr(model, "dtype", "")))
    engines = model.__dict__.setdefault(_ENGINES_ATTRIBUTE, {})
    engine = engines.get(key)
    if engine is None:
        check = model not in _CHECKED
        # One row prefills its whole prompt in one pass, as racer.Decoder does.
        chunk = facts.max_positions if rows == 1 else 512
        engine = BatchDecoder(model, None, method, max_batch=rows, prefill_chunk=chunk, check=check,
                              detokenize=False, memory_limit=rows)
        _CHECKED.add(model)
        engines[key] = engine
    return engine


def _forget(engine: BatchDecoder) -> None:
    engines = engine.model.__dict__.get(_ENGINES_ATTRIBUTE, {})
    for key in [key for key, kept in engines.items() if kept is engine]:
        del engines[key]


class _Decoding:
    """One ``generate`` call's rows on the engine: the tokens each emitted, cut where a
    stop string or the time limit ends it, and the streamer fed position by position."""

    def __init__(self, engine: BatchDecoder, prompts: list[list[int]], input_ids: torch.Tensor, stops: _Stops,
                 streamer: Any, pad_id: int | None) -> None:
        self.engine, self.prompts, self.input_ids, self.stops = engine, prompts, input_ids, stops
        self.streamer, self.pad_id = streamer, pad_id
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.done = [False] * len(prompts)
        self.streamed = 0

    def run(self, sampling: dict[str, Any]) -> list[list[int]]:
        engine = self.engine
        seeds = [int(torch.randint(0, 2**62, (1,))) if sampling.get("temperature", 0) > 0 else None
                 for _ in self.prompts]
        ids = [engine.submit(prompt, scope=SCOPE, chat=False, max_new_tokens=self.stops.max_new,
                             end_ids=self.stops.end_ids, seed=seed, **sampling)
               for prompt, seed in zip(self.prompts, seeds)]
        row_of = {request: row for row, request in enumerate(ids)}
        try:
            while not all(self.done):
                for update in engine.step():
                    row = row_of.get(update.request)
                    if row is not None and not self.done[row]:
                        self._add(row, update.tokens, update.done)
                if self.stops.deadline is not None and time.time() > self.stops.deadline:
                    self.done = [True] * len(self.done)
                flying = set(engine.in_flight)
                for row, request in enumerate(ids):
                    if self.done[row] and request in flying:
                        engine.cancel(request)
                self._stream()
            while any(request in engine.in_flight for request in ids):  # the cancelled ones
                engine.step()
            for request in ids:
                engine.result(request)
        except BaseException:
            # A step that failed or was interrupted may leave the engine half-way: the
            # next call builds a new one.
            _forget(engine)
            raise
        if self.streamer is not None:
            self.streamer.end()
        return self.tokens

    def _add(self, row: int, tokens: list[int], done: bool) -> None:
        start = len(self.tokens[row])
        self.tokens[row].extend(tokens)
        end = self.stops.stop_string_at(self.input_ids[row], self.tokens[row], start)
        if end is not None:
            del self.tokens[row][end:]
            done = True
        self.done[row] = done

    def _stream(self) -> None:
        """Each position once every row has it or has ended (an ended row gives the pad
        token), as generate's loop puts one token per row per step."""
        if self.streamer is None:
            return
        while any(self.streamed < len(t) for t in self.tokens) and all(
                self.streamed < len(t) or done for t, done in zip(self.tokens, self.done)):
            column = [t[self.streamed] if self.streamed < len(t) else self.pad_id or 0 for t in self.tokens]
            self.streamer.put(torch.tensor(column, dtype=torch.long))
            self.streamed += 1


def _padded(input_ids: torch.Tensor, new: list[list[int]], pad_id: int | None) -> torch.Tensor:
    """``input_ids`` with each row's new tokens after it, rows that ended early padded
    with ``pad_id`` as generate pads them."""
    width = max(len(tokens) for tokens in new)
    if pad_id is None and any(len(tokens) < width for tokens in new):
        raise ValueError("pad_token_id: rows ended at different lengths and the generation config has no "
                         "pad_token_id to fill the rest with")
    out = torch.full((input_ids.shape[0], width), pad_id if pad_id is not None else 0, dtype=input_ids.dtype,
                     device=input_ids.device)
    for row, tokens in enumerate(new):
        out[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, out], dim=1)
