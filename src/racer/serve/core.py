"""The engine core of ``racer serve``: one ``racer.BatchDecoder`` stepped in a loop that
takes commands and gives events (``racer.serve.events``), token ids only. It never
waits for HTTP work: parsing, templating, detokenising and answering happen on the API
side, which ``racer.serve.core_client`` connects to it.

``racer serve`` runs the core in a process of its own (``run_engine_process``), so that
the decoding loop and the HTTP event loop do not share one interpreter; a caller that
holds a decoder already can run it on a thread (``CoreClient.in_thread``). Either way
only the core's thread runs torch: it loads the model and times it there too, since
OpenMP gives each thread that opens parallel regions a team of its own, and on a
small CPU one team's regions run much slower once another thread's team exists
(docs/serving.md).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from racer.serve.events import (BuildFailed, Cancel, Command, Event, Failed, Finished, Ready, Stepped, Stop, Submit,
                                Tokens)

Receive = Callable[[bool], list[Command]]  # block: wait for at least one command
Send = Callable[[list[Event]], None]


class EngineCore:
    """Steps ``decoder`` while it has work; between steps, takes the commands that came.
    One step's events go out together: ``Stepped`` first (so that a client reading
    /metrics after its answer sees the step), then each request's ``Tokens`` and, for a
    request that ended, its ``Finished``."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self._stopping = False
        self._last = dict(decoder.seconds)
        self._hand_off = 0.0  # reading commands and sending events, since the last Stepped
        self._send: Send = lambda events: None

    def run(self, receive: Receive, send: Send) -> None:
        self._send = send
        while not (self._stopping and not self.decoder.busy):
            started, busy = time.perf_counter(), self.decoder.busy
            commands = receive(not busy)
            if busy:  # waiting for work is not counted: it is what the other parts leave of the wall time
                self._hand_off += time.perf_counter() - started
            refused = self._take(commands)
            if refused:
                send(refused)
            if not self.decoder.busy:
                continue
            events = self._step()
            sending = time.perf_counter()
            send(events)
            self._hand_off += time.perf_counter() - sending

    def _take(self, commands: list[Command]) -> list[Event]:
        refused: list[Event] = []
        for command in commands:
            if isinstance(command, Submit):
                if self._stopping:
                    refused.append(Failed(command.key, "the server is shutting down"))
                    continue
                try:
                    self.decoder.submit(command.ids, command.options, scope=command.scope, request_id=command.key)
                except ValueError as err:  # a prompt or options the API side let through
                    refused.append(Failed(command.key, str(err), refused=True))
            elif isinstance(command, Cancel):
                self.decoder.cancel(command.key)
            elif isinstance(command, Stop):
                self._stopping = True
                for key in self.decoder.in_flight:
                    self.decoder.cancel(key)
        return refused

    def _step(self) -> list[Event]:
        decoder = self.decoder
        try:
            updates = decoder.step(early=self._early)
        except Exception as err:  # noqa: BLE001 - one bad step fails its requests, not the server
            traceback.print_exc()
            failed: list[Event] = [Failed(key, f"{type(err).__name__}: {err}") for key in decoder.in_flight]
            self.decoder = decoder.fresh()
            self._last = dict(self.decoder.seconds)
            return failed
        seconds = {part: value - self._last.get(part, 0.0) for part, value in decoder.seconds.items()}
        self._last = dict(decoder.seconds)
        seconds["hand_off"], self._hand_off = self._hand_off, 0.0
        return [Stepped(decoder.active, decoder.waiting, decoder.idle_drafters, seconds), *self._events(updates)]

    def _events(self, updates: list[Any]) -> list[Event]:
        events: list[Event] = []
        for update in updates:
            if update.tokens:
                events.append(Tokens(update.request, update.tokens, update.sources, update.step, update.tree_size))
            if update.done:
                events.append(Finished(update.request, self.decoder.result(update.request)))
        return events

    def _early(self, updates: list[Any]) -> None:
        """A first token goes out as soon as its prefill computed it."""
        sending = time.perf_counter()
        self._send(self._events(updates))
        self._hand_off += time.perf_counter() - sending


@dataclass
class EngineSpec:
    """How to build the engine in its own process (what ``racer serve`` was given)."""

    model: str | None
    method: str
    dtype: str = "float32"
    device: str | None = None
    max_batch: int = 8
    prefill_chunk: int = 2048
    threads: int | None = None
    prefix_cache_mib: int = 0

    def build(self, announce: Callable[[str], None]) -> Any:
        import racer

        announce(f"loading {self.model or racer.DEFAULT_MODEL} ({self.dtype}); the port opens when it is ready")
        model, tokenizer = racer.load_model(self.model, dtype=self.dtype, device=self.device, announce=announce)
        decoder = racer.BatchDecoder(model, tokenizer, self.method, max_batch=self.max_batch,
                                     prefill_chunk=self.prefill_chunk, detokenize=False,
                                     prefix_cache_mib=self.prefix_cache_mib)
        decoder.calibrate(announce=announce)
        return decoder


def _end_with(parent: int) -> None:
    """End this process as soon as ``parent`` is gone, even mid-load or mid-step (a
    killed API process must not leave an engine behind, calibrating or decoding)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="racer-parent-watch", daemon=True).start()


def run_engine_process(spec: EngineSpec, commands: Any, events: Any, parent: int) -> None:
    """The engine process: build the engine, say ``Ready`` (or ``BuildFailed``), then run
    the core until told to stop or until the API process is gone (its end of the pipe
    closes, or ``parent``, its pid, is no longer this process's parent: it may have died
    before this process got here). Signals are the API process's to handle: it drains,
    then sends ``Stop``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _end_with(parent)
    if spec.threads:
        from racer import use_threads

        use_threads(spec.threads)

    def announce(text: str) -> None:
        print(f"racer serve: {text}", file=sys.stderr, flush=True)

    try:
        decoder = spec.build(announce)
    except BaseException as err:  # noqa: BLE001 - said to the API process, which exits with it
        bad_input = isinstance(err, (ValueError, LookupError))
        events.send([BuildFailed(str(err) if bad_input else f"{type(err).__name__}: {err}", bad_input)])
        return
    events.send([Ready(decoder.facts.max_positions, decoder.max_batch)])

    def receive(block: bool) -> list[Command]:
        taken: list[Command] = []
        try:
            if block:
                taken.append(commands.recv())
            while commands.poll(0):
                taken.append(commands.recv())
        except (EOFError, OSError):  # the API process is gone
            taken.append(Stop())
        return taken

    try:
        EngineCore(decoder).run(receive, events.send)
    except (BrokenPipeError, EOFError, OSError):
        pass  # the API process is gone: nobody to answer
