"""Where generation ends: the model's end tokens, stop strings and the token limit; and
what of an answer's text is shown: never a stop string, never a character still being
written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence


@dataclass
class Emitted:
    """Tokens emitted by one pass and whether generation ends with them."""

    tokens: list[int]
    done: bool


def end_token_ids(model_ends: Iterable[int], tokenizer: Any) -> set[int]:
    """Every end-of-sequence id: the model's configs' (``ModelFacts.end_ids``) and the
    tokenizer's."""
    ids = set(model_ends)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class Stopper:
    """Cuts the tokens a pass emits at the first end token, stop string or limit."""

    def __init__(self, tokenizer: Any, end_ids: set[int], stop: Sequence[str], limit: int) -> None:
        self.tokenizer, self.end_ids, self.stop, self.limit = tokenizer, end_ids, list(stop), limit
        # A stop string of m characters spans at most m tokens, plus byte-split pieces.
        self.window = 4 * max((len(s) for s in self.stop), default=0) + 4
        self.reason = "length"

    def cut(self, emitted: list[int], new: Sequence[int]) -> Emitted:
        out: list[int] = []
        for token in new:
            if len(emitted) + len(out) >= self.limit:
                return Emitted(out, True)
            out.append(int(token))
            if token in self.end_ids:
                self.reason = "eos"
                return Emitted(out, True)
            if self.stop:
                tail = (emitted + out)[-self.window :]
                text = self.tokenizer.decode(tail)
                if any(s in text for s in self.stop):
                    self.reason = "stop"
                    return Emitted(out, True)
        return Emitted(out, len(emitted) + len(out) >= self.limit)


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """``text`` up to the first stop string, which is left out (as OpenAI and vLLM do),
    and whether one was found."""
    found = [text.find(s) for s in stops if s in text]
    return (text[: min(found)], True) if found else (text, False)


def visible_text(text: str, stops: Sequence[str], final: bool) -> str:
    """What of a growing answer's ``text`` can be shown now: everything before a stop
    string; before the end, also not a trailing partial character (its other bytes are
    still to come) nor a tail that may be the start of a stop string (``StopText``, for
    a text that is not re-decoded whole each time)."""
    from racer.engine.detokenize import StopText

    if not final and text.endswith("\ufffd"):
        found = [text.find(s) for s in stops if s and s in text]
        if not found:
            text = text[:-1]
    return StopText(stops).add(text, final=final)


def answer_text(tokenizer: Any, tokens: Sequence[int], stops: Sequence[str]) -> str:
    """A finished answer's text: its tokens decoded, up to the stop string that ended it."""
    if tokenizer is None:  # callers that work in token ids only
        return ""
    return cut_at_stop(tokenizer.decode(list(tokens), skip_special_tokens=True), stops)[0]
