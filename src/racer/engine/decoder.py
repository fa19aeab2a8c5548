"""One request at a time: a front over the engine (``racer.engine.loop``) with one row,
whose ``generate`` and ``stream`` submit a request and step until it is done."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from racer.drafting import Drafter, Method
from racer.engine.calibration import announce_on_stderr
from racer.engine.loop import BatchDecoder, PROMPT_WINDOW, resolve_method
from racer.engine.model_facts import ModelFacts
from racer.engine.options import GenerationOptions
from racer.engine.results import GenerationResult
from racer.engine.stopping import visible_text


def _of_engine(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.engine, name), doc=doc)


class _Own:
    """The memory scope of one ``Decoder``: its drafter serves each of its requests in turn."""


class Decoder:
    """Decodes with one model and one draft method, one request at a time. Reusable
    across requests: the drafter decides whether anything it learnt carries over.

    ``method``: a spec such as ``"racer:capacity=16"`` or a ``Drafter``; ``capacity``
    overrides the method's (``"auto"``: each step the draft budget keeps the part of the
    drafter's candidate tree worth verifying on this hardware; a number: a fixed size).
    ``cost``: the step-cost curve (default: measured once per model and hardware and
    cached on disk, see ``calibrate``); a measured ``CostModel`` also says which linear
    kernel verifies each tree size fastest. ``fast_paths``: ``False`` verifies with the
    model's own code only, or a ``FastPaths`` switches each fast path on its own.
    ``check``: self-test tree verification on this model first (and, the first time a
    request's context reaches one of its attention windows, past its windows)."""

    def __init__(self, model: Any, tokenizer: Any, method: str | Drafter | Method = "none", *,
                 capacity: int | str | None = None, cost: Any = None, check: bool = True,
                 fast_paths: Any = True, prompt_window: int = PROMPT_WINDOW) -> None:
        # One drafter serves every request, so the method is resolved once, here; the
        # whole prompt is prefilled in one pass.
        self.engine = BatchDecoder(model, tokenizer, resolve_method(method, capacity), max_batch=1,
                                   prefill_chunk=ModelFacts.of(model).max_positions, cost=cost, check=check,
                                   fast_paths=fast_paths, memory_limit=1, prompt_window=prompt_window)
        self.model, self.tokenizer = model, tokenizer
        self._scope = _Own()

    # What callers read of the engine's set-up.
    method = _of_engine("method", "The draft method and its capacity.")
    facts = _of_engine("facts", "The model's facts (``ModelFacts``).")
    verifier = _of_engine("verifier", "The engine's ``TreeVerifier``, which holds the request's KV.")
    cost = _of_engine("cost", "The step-cost curve the engine learns on.")
    budget = _of_engine("budget", "How much of each candidate tree a step verifies.")

    @property
    def drafter(self) -> Drafter:
        return self.engine.method.drafter

    @property
    def acceptance(self) -> Any:
        """The acceptance model that rates this decoder's drafts (None with a fixed
        capacity, or before the first request)."""
        idle = self.engine.memory.pool.peek(self._scope)
        return None if idle is None else idle[1]

    def calibrate(self, refresh: bool = False,
                  announce: Callable[[str], None] | None = announce_on_stderr) -> None:
        """Read the step-cost table this decoder needs from the disk cache, or measure it
        (tens of seconds on a CPU; ``announce`` is told first): a drafting method uses it
        to choose each tree size's linear kernel, ``capacity=auto`` for the draft budget.
        The first ``generate`` or ``stream`` calls this if nobody did."""
        self.engine.calibrate(refresh, announce)

    def _run(self, prompt: Any, options: GenerationOptions, result: GenerationResult) -> Iterator[list[int]]:
        """Submit, then step until done; yields each pass's new tokens, and leaves the
        request's result in ``result``."""
        engine = self.engine
        engine.calibrate()
        request = engine.submit(prompt, options, scope=self._scope, result=result)
        try:
            while engine.busy:
                for update in engine.step():
                    if update.tokens:
                        yield update.tokens
        finally:
            if engine.busy:  # the caller stopped early (Ctrl-C, a closed generator)
                engine.cancel(request)
                while engine.busy:
                    engine.step()
            engine.result(request)

    # -- public entry points ------------------------------------------------------------
    def generate(self, prompt: Any, options: GenerationOptions | None = None, **fields: Any) -> GenerationResult:
        """Decode ``prompt`` (text, chat messages or token ids) greedily (the default) or
        by exact sampling; returns the new tokens, their text and per-step statistics.
        Options come as a ``GenerationOptions`` and/or as its fields by keyword
        (``max_new_tokens=64, temperature=0.7``)."""
        result = GenerationResult.empty()
        for _ in self._run(prompt, GenerationOptions.of(options, fields), result):
            pass
        return result

    def stream(self, prompt: Any, options: GenerationOptions | None = None, *,
               result: GenerationResult | None = None, **fields: Any) -> Iterator[str]:
        """Yield text as it is accepted (arguments as ``generate``); the pieces join to
        the result's ``text``. Pass ``result`` to collect the statistics; it is emptied
        first."""
        options = GenerationOptions.of(options, fields)
        result = GenerationResult.empty() if result is None else result
        shown = ""
        for _ in self._run(prompt, options, result):
            if self.tokenizer is None:
                continue
            text = visible_text(self.tokenizer.decode(result.tokens, skip_special_tokens=True), options.stop, False)
            if len(text) > len(shown) and text.startswith(shown):
                yield text[len(shown):]
                shown = text
        if result.text.startswith(shown) and len(result.text) > len(shown):
            yield result.text[len(shown):]


def generate(model: Any, tokenizer: Any, prompt: Any, *, method: str | Drafter = "none",
             **options: Any) -> GenerationResult:
    """One-shot generation with ``method`` (options as ``Decoder.generate``); see
    ``Decoder`` to reuse a drafter."""
    return Decoder(model, tokenizer, method).generate(prompt, **options)
