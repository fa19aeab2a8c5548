"""``racer chat``: a multi-turn terminal chat on the real model, in process and driven
in a pseudo-terminal (two turns, a /method switch, Ctrl-C in the middle of an answer)."""

from __future__ import annotations

import io
import os
import re
import sys
import time

import pytest
from rich.console import Console

from racer import Decoder, GenerationOptions
from racer.chat import Chat, run

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_two_turns_answer_the_whole_conversation_as_decoding_it_alone_would(real):
    model, tokenizer = real
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, soft_wrap=True, highlight=False)
    chat = Chat(model, tokenizer, "racer", GenerationOptions(max_new_tokens=40), console)
    first = chat.answer("Name three rivers in Europe.")
    second = chat.answer("Which of them is the longest?")
    plain = Decoder(model, tokenizer, "none")
    assert first.tokens == plain.generate([{"role": "user", "content": "Name three rivers in Europe."}],
                                          max_new_tokens=40).tokens
    conversation = chat.messages[:3]
    assert [m["role"] for m in chat.messages] == ["user", "assistant", "user", "assistant"]
    assert conversation[1]["content"] == first.text
    assert second.tokens == plain.generate(conversation, max_new_tokens=40).tokens
    shown = ANSI.sub("", out.getvalue())
    assert first.text in shown and second.text in shown
    assert "\x1b[" in out.getvalue()  # tinted
    assert re.search(r"racer: \d+ tokens, MAT \d+\.\d\d, [\d.]+ tokens/s \(retrieval \d+ · logits \d+ · both \d+ · "
                     r"none \d+\)", shown)


def test_commands_switch_the_method_reset_and_refuse_a_bad_method(real):
    model, tokenizer = real
    out = io.StringIO()
    chat = Chat(model, tokenizer, "racer", GenerationOptions(max_new_tokens=8), Console(file=out, soft_wrap=True))
    lines = iter(["/method pld", "Hello!", "/method nonsense", "/reset", "/help", "/quit"])
    assert run(chat, lambda prompt: next(lines)) == 0
    text = out.getvalue()
    assert "method: pld" in text and re.search(r"pld: \d+ tokens", text)
    assert "racer: error: " in text and "nonsense" in text
    assert "new conversation" in text and chat.messages == [] and chat.method == "pld"


def test_racer_chat_in_a_terminal(real):
    pexpect = pytest.importorskip("pexpect")
    env = {**os.environ, "COLUMNS": "200", "LINES": "50", "PYTHONUNBUFFERED": "1"}
    child = pexpect.spawn(sys.executable, ["-m", "racer.cli", "chat", "--threads", "1", "--max-new-tokens", "400"],
                          env=env, encoding="utf-8", timeout=600, dimensions=(50, 200))
    try:
        child.expect("you> ")
        child.sendline("Name three rivers in Europe.")
        child.expect(r"racer: (\d+) tokens, MAT")
        child.expect("you> ")
        child.sendline("/method pld")
        child.expect("method: pld")
        child.expect("you> ")
        child.sendline("Count from 1 to 200, separated by commas.")
        child.expect(r"commas\.\r?\n")  # the line typed, echoed
        child.expect(r"\d")  # the answer has begun (tinted: escapes may sit between its characters)
        time.sleep(0.5)
        child.sendintr()  # Ctrl-C in the middle of the answer
        child.expect(r"pld: (\d+) tokens, MAT .* stopped", timeout=60)
        assert int(child.match.group(1)) < 400
        child.expect("you> ")
        child.sendline("/reset")  # still chatting after the Ctrl-C
        child.expect("new conversation")
        child.expect("you> ")
        child.sendeof()
        child.expect(pexpect.EOF, timeout=60)
    finally:
        child.close()
    assert child.exitstatus == 0
