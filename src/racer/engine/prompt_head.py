"""The LM head over a prompt's positions, after the prompt's first token has left.

A drafter that reads the model's predictions over the prompt (``Needs.prompt``) needs
the full-vocabulary logits at every prompt position, but the first token needs only the
last. So the prefill keeps the logits of its last position and the final hidden states
of the others (a forward hook on the model's base, whose output is the LM head's
input); the head runs over them once the first token is out, before the request's
first draft.

Only the top ids of each position are kept, so a family's monotone post-processing of
the logits (a soft cap, a scale) changes nothing. A model whose head is more than its
output embeddings over its base's last hidden state is found out on its first prompt:
the head's top ids at the last position must be (as a set) those of the model's own logits there;
where they are not, this model's prompts get the model's own logits at every position,
in the prefill pass, from then on.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from racer.engine.host import to_host
from racer.fastpaths.kernels import LinearKernels

HEAD_CHUNK = 256  # prompt positions per LM-head product: bounds the logits held at once


def latest_positions(tokens: Sequence[int]) -> np.ndarray:
    """The positions at which each of ``tokens`` occurs for the last time, ascending
    (the last position always among them)."""
    values = np.asarray(tokens, dtype=np.int64)
    _, first_from_end = np.unique(values[::-1], return_index=True)
    return np.sort(len(values) - 1 - first_from_end)


def spread(rows: np.ndarray, at: np.ndarray, length: int) -> np.ndarray:
    """``rows`` placed at positions ``at`` of ``length`` rows, -1 at the others."""
    out = np.full((length, rows.shape[1]), -1, dtype=rows.dtype)
    out[at] = rows
    return out


def _decoder(model: Any) -> Any:
    try:
        return model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return getattr(model, "base_model", None)


class PromptHead:
    """Captures a model's final hidden states in prefill passes, and turns them into
    the top ids of the LM head later."""

    def __init__(self, model: Any, kernels: LinearKernels | None = None) -> None:
        """``kernels``: where given and the verifier's kernels have built oneDNN-packed
        weights, the head's products run on the packed copy ("hybrid"), which computes
        this wide product faster than the model's own layer (never built for this alone:
        the copy doubles the weights' memory)."""
        self.base = _decoder(model)
        self.head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.kernels = kernels
        # None: not checked yet; False: this model's head is not what ``top_ids`` computes.
        self.trusted: bool | None = None if self.base is not None and self.base is not model and self.head is not None \
            else False

    @property
    def usable(self) -> bool:
        return self.trusted is not False

    @contextmanager
    def capture(self) -> Iterator[list[torch.Tensor]]:
        """The decoder's last hidden states of each pass inside the block, one
        (positions, hidden) tensor per pass (none where the pass went around it)."""
        captured: list[torch.Tensor] = []

        def keep(module: Any, args: Any, output: Any) -> None:
            hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            captured.append(hidden[0].detach())

        handle = self.base.register_forward_hook(keep)
        try:
            yield captured
        finally:
            handle.remove()

    def missed(self) -> None:
        """A prefill pass gave no hidden states to capture: this model's passes do not
        go through the hooked module, so it is never used again."""
        self.trusted = False

    def top_ids(self, hidden: torch.Tensor, last_logits: torch.Tensor, k: int) -> np.ndarray | None:
        """The ``k`` top ids of the LM head at each row of ``hidden``, whose last row
        is the position the model's own ``last_logits`` (1, vocab) came from; None (and
        never again for this model) where the two disagree there."""
        rows = []
        with torch.inference_mode():
            if self.trusted is None:
                # Checked with the model's own layer, as ``last_logits`` were computed:
                # another kernel's rounding could reorder a near tie at rank k.
                mine = to_host(torch.topk(self.head(hidden[-1:]), k, dim=-1).indices)
                own = to_host(torch.topk(last_logits[-1:], k, dim=-1).indices)
                self.trusted = set(mine[0].tolist()) == set(own[0].tolist())
                if not self.trusted:
                    return None
            packed = self.kernels is not None and self.kernels.ready("hybrid")
            with self.kernels.using("hybrid") if packed else nullcontext():
                for start in range(0, hidden.shape[0], HEAD_CHUNK):
                    logits = self.head(hidden[start : start + HEAD_CHUNK])
                    rows.append(torch.topk(logits, k, dim=-1).indices)
            return to_host(torch.cat(rows))
