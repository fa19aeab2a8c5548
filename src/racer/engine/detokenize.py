"""A growing answer's text, decoded as its tokens come, in time linear in its length;
and what of it may be shown while it grows (never a stop string, never a character
still being written).

Decoding the whole answer again for every token is quadratic; decoding each token
alone is wrong (byte-level tokens split characters, SentencePiece drops a word's
leading space at the start of a decode, clean-up rules join a token to the next).
``Detokenizer`` decodes a short window: the tokens since the text was last known
complete, with the ones before them as left context, and gives out what the window's
text adds to its context's (the prefix and read offsets of Hugging Face's text
generation server and vLLM). Where the tokenizer cleans up spaces (``" ."`` becomes
``"."`` once the dot comes), text is given out one token late and a few characters
short, so that no later token can change what was given.
"""

from __future__ import annotations

from typing import Any, Sequence

# transformers' clean-up rules join at most 4 characters (" n't", " 've", " 're"):
# a rule still being completed starts within the last 3 characters.
_CLEAN_UP_REACH = 3


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _complete(text: str) -> str:
    """``text`` without a trailing run of replacement characters (bytes of a character
    whose other bytes are still to come)."""
    return text.rstrip("\ufffd")


class Detokenizer:
    """``add(tokens)`` returns the text they complete; ``finish()`` the rest. The
    pieces joined are the tokens' text as ``tokenizer.decode(tokens,
    skip_special_tokens=True)`` gives it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""  # everything given out
        self._prefix = 0  # the window starts here: left context the new tokens are decoded after
        self._read = 0  # the text of tokens[:read] has all been given out
        self._ahead = 0  # characters given out beyond tokens[:read]'s
        self._cautious = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        self._candidate: tuple[int, str] | None = None  # cautious: a token count and its text, to settle on

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=True)

    def add(self, tokens: Sequence[int]) -> str:
        """The text ``tokens`` complete (possibly none yet)."""
        if not tokens:
            return ""
        self.tokens.extend(int(t) for t in tokens)
        return self._give(final=False)

    def finish(self) -> str:
        """The text not given out yet: the answer is complete."""
        return self._give(final=True)

    def _give(self, final: bool) -> str:
        n = len(self.tokens)
        base = self._decode(self._prefix, self._read)
        whole = self._decode(self._prefix, n)
        settled: tuple[int, str] | None = None  # a token count whose whole text is now out, and that text
        if final:
            stable = whole
        elif self._cautious:
            before = self._decode(self._prefix, n - 1)
            stable = _complete(whole[: _common_prefix(before, whole)])
            stable = stable[: max(len(stable) - _CLEAN_UP_REACH, 0)]
            candidate, self._candidate = self._candidate, (n - 1, before)
            if candidate is not None and candidate[0] > self._read and stable.startswith(candidate[1]):
                settled = candidate
        else:
            stable = _complete(whole)
            if len(stable) == len(whole):
                settled = (n, whole)
        given = len(base) + self._ahead
        if not stable.startswith(base) or len(stable) < given:
            return ""
        piece = stable[given:]
        self.text += piece
        if settled is not None:
            # Every character of tokens[:settled] is out: they become the next window's context.
            self._prefix, self._read, self._ahead = self._read, settled[0], len(stable) - len(settled[1])
            self._candidate = None
        else:
            self._ahead += len(piece)
        return piece


class StopText:
    """What of a growing text may be shown, given its stop strings: everything before
    the first stop string (which is left out, as OpenAI and vLLM do); before the end,
    not a tail that may be the start of one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.shown = ""
        self._held = ""
        self.stopped = False

    def add(self, piece: str, final: bool = False) -> str:
        """What of ``piece`` (the text's next characters) may be shown now."""
        if self.stopped:
            return ""
        text = self._held + piece
        if not self.stops:
            self._held = ""
            self.shown += text
            return text
        # A stop string may begin in what was shown: search from where it could start.
        reach = max(len(s) for s in self.stops) - 1
        tail = self.shown[-reach:] if reach else ""
        window = tail + text
        found = [window.find(s) for s in self.stops if s in window]
        if found:
            self.stopped = True
            end = max(min(found) - len(tail), 0)
            out, self._held = text[:end], ""
            self.shown += out
            return out
        hold = 0 if final else max((n for s in self.stops for n in range(min(len(s) - 1, len(window)), 0, -1)
                                    if window.endswith(s[:n])), default=0)
        hold = min(hold, len(text))
        out, self._held = text[: len(text) - hold], text[len(text) - hold :]
        self.shown += out
        return out
