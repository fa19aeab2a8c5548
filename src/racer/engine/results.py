"""What a generation returns: the new tokens and text, and one record per step."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

from racer.drafting.tree import SOURCE_NAMES


@dataclass
class StepStats:
    """One verification step of a request. The times are the whole step's, which every
    request verified in it shares: with one request, its own."""

    tree_size: int  # nodes verified, root included
    accepted: int  # draft tokens accepted beyond the root (the "a" of 1 + a)
    draft_s: float  # drafting, subtree selection, and the drafters' and acceptance models' updates
    verify_s: float  # the pass, reading it, acceptance and keeping the accepted KV
    candidates: int = 0  # nodes the drafter proposed before the draft budget chose


@dataclass
class GenerationResult:
    """A generation: ``tokens`` as the model emitted them (the token that completed a
    stop string included) and ``text``, their text up to the stop string (left out)."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    steps: list[StepStats] = field(default_factory=list)
    prefill_s: float = 0.0
    prompt_reused: int = 0  # leading prompt tokens whose KV a kept prefix gave (racer.engine.prefixes)
    wall_s: float = 0.0
    stop_reason: str = "length"  # "eos", "stop", "length" or "context"
    drafter_stats: dict = field(default_factory=dict)
    # Per emitted token: which draft source proposed it ("retrieval", "logits", "both",
    # or "none": the model's own token that ends every pass) and the pass that
    # emitted it (0: the prefill, i: ``steps[i - 1]``).
    token_sources: list[str] = field(default_factory=list)
    token_steps: list[int] = field(default_factory=list)

    @classmethod
    def empty(cls, prompt_tokens: int = 0) -> "GenerationResult":
        return cls(tokens=[], text="", prompt_tokens=prompt_tokens)

    def restart(self, prompt_tokens: int) -> None:
        """Empty this result in place for a new request: nothing of the last one stays."""
        self.__dict__.update(GenerationResult.empty(prompt_tokens).__dict__)

    def extend(self, tokens: Sequence[int], sources: Sequence[str], step: int) -> None:
        """Append a pass's emitted ``tokens`` (a prefix of what it accepted, when a stop
        cut it) and their provenance (``sources``, as long as or longer than ``tokens``)."""
        self.tokens.extend(tokens)
        self.token_sources.extend(sources[: len(tokens)])
        self.token_steps.extend([step] * len(tokens))

    @property
    def provenance(self) -> dict[str, int]:
        """How many emitted tokens each source proposed (every name, zeros included)."""
        counts = Counter(self.token_sources)
        return {name: counts.get(name, 0) for name in SOURCE_NAMES[1:] + SOURCE_NAMES[:1]}

    @property
    def passes(self) -> int:
        """Verification passes, the prefill (which yields the first token) included."""
        return 1 + len(self.steps)

    @property
    def mat(self) -> float:
        """Mean accepted tokens: emitted tokens per verification pass."""
        return len(self.tokens) / self.passes if self.tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0
