"""``racer chat``: a terminal chat that tints every token by the draft source that
proposed it, as the chat page of ``racer serve`` does. Multi-turn through the chat
template; ``/reset``, ``/method NAME``, ``/help``, ``/quit``; Ctrl-C stops the answer
being written and keeps the chat going."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable

from rich.console import Console
from rich.text import Text

from racer import Decoder, GenerationOptions, GenerationResult, TokenSpans, parse_method

# The page's colours (serve/static/chat.css) where the terminal shows them; three
# that stay apart in 16 colours elsewhere (the pastels would all become white).
STYLES = {"retrieval": "black on #cfe3ff", "logits": "black on #ffe2b3", "both": "black on #c8f0cf", "none": ""}
STYLES_16 = {"retrieval": "black on cyan", "logits": "black on yellow", "both": "black on green", "none": ""}


def styles(console: Console) -> dict[str, str]:
    return STYLES if console.color_system in ("truecolor", "256") else STYLES_16


HELP = ("/reset starts a new conversation · /method NAME switches the draft method (e.g. pld, racer:capacity=16) · "
        "/quit leaves · Ctrl-C stops an answer")


def legend(console: Console) -> Text:
    text = Text("tokens: ")
    for name, label in (("retrieval", "retrieval"), ("logits", "copy-logit table"), ("both", "both"),
                        ("none", "model's own")):
        text.append(f" {label} ", style=styles(console)[name] or "underline")
        text.append(" ")
    return text


class Chat:
    """One conversation with one model; the draft method can change between turns."""

    def __init__(self, model: Any, tokenizer: Any, method: str, options: GenerationOptions,
                 console: Console, system: str | None = None) -> None:
        self.model, self.tokenizer, self.options, self.console = model, tokenizer, options, console
        self.system = system
        self.styles = styles(console)
        self.messages: list[dict] = []
        self.method = method
        self._checked = False
        self.decoder = self._decoder(method)

    def _decoder(self, method: str) -> Decoder:
        # The model is self-tested once, with the first method.
        decoder = Decoder(self.model, self.tokenizer, parse_method(method), check=not self._checked)
        self._checked = True
        decoder.calibrate(announce=lambda line: self.console.print(line, style="dim"))
        return decoder

    def command(self, line: str) -> bool:
        """Run a /command; False when the chat should end."""
        name, _, argument = line.partition(" ")
        if name in ("/quit", "/exit"):
            return False
        if name == "/reset":
            self.messages = []
            self.console.print("new conversation", style="dim")
        elif name == "/method":
            if not argument.strip():
                self.console.print(f"method: {self.method} (give one: /method NAME)", style="dim")
            else:
                try:
                    self.decoder, self.method = self._decoder(argument.strip()), argument.strip()
                    self.console.print(f"method: {self.method}", style="dim")
                except ValueError as err:
                    self.console.print(f"racer: error: {err}", style="red")
        else:
            self.console.print(HELP, style="dim")
        return True

    def answer(self, prompt: str) -> GenerationResult:
        """Stream the answer to ``prompt``, tinted; a Ctrl-C ends it after the step
        under way (a step stopped halfway could leave the drafter's memory half
        updated for the next turn)."""
        self.messages.append({"role": "user", "content": prompt})
        result = GenerationResult.empty()
        spans = TokenSpans(self.tokenizer)
        shown = 0
        stopped = False
        opening = [{"role": "system", "content": self.system}] if self.system else []
        stream = self.decoder.stream(opening + self.messages, self.options, result=result)
        started = time.perf_counter()
        interrupted = threading.Event()
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set()) if main else None
        try:
            for _ in stream:
                shown = self._show(spans, result, shown)
                if interrupted.is_set():
                    stopped = True
                    break
        finally:
            stream.close()
            if main:
                signal.signal(signal.SIGINT, previous)
        seconds = time.perf_counter() - started
        self._show(spans, result, shown, final=True)
        self.console.print()
        self.messages.append({"role": "assistant", "content": spans.text})
        self.console.print(self._summary(result, seconds, stopped), style="dim")
        return result

    def _show(self, spans: TokenSpans, result: GenerationResult, shown: int, final: bool = False) -> int:
        new = len(result.tokens) - len(spans.tokens)
        if new > 0:
            start = len(spans.tokens)
            spans.add(result.tokens[start:], result.token_sources[start:], result.token_steps[start:])
        if final:
            spans.finish()  # the text held back for the answer's last token
        end = len(spans.text) if final else (spans.ends[-1] if spans.ends else 0)
        if end <= shown:
            return shown
        text = Text()
        at = shown
        for length, source, _ in spans.spans(shown, end):
            text.append(spans.text[at : at + length], style=self.styles.get(source, ""))
            at += length
        self.console.print(text, end="")
        return end

    def _summary(self, result: GenerationResult, seconds: float, stopped: bool) -> str:
        mat = result.mat
        rate = len(result.tokens) / seconds if seconds > 0 else 0.0
        counts = " · ".join(f"{name} {count}" for name, count in result.provenance.items())
        return (f"{self.method}: {len(result.tokens)} tokens, MAT {mat:.2f}, {rate:.1f} tokens/s ({counts})"
                + (" · stopped" if stopped else ""))


def run(chat: Chat, read: Callable[[str], str]) -> int:
    """The read-answer loop: ``read`` asks for the next line (EOF ends the chat)."""
    chat.console.print(legend(chat.console))
    chat.console.print(HELP, style="dim")
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            chat.console.print()
            return 0
        except KeyboardInterrupt:  # at the prompt: a fresh line, as a shell gives
            chat.console.print()
            continue
        if not line:
            continue
        if line.startswith("/"):
            if not chat.command(line):
                return 0
            continue
        chat.answer(line)
