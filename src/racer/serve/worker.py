"""The server's decoding thread: one ``racer.BatchDecoder`` driven step by step, fed by
the HTTP handlers through a thread-safe inbox, answering each request through its own
sink (an asyncio queue on the server's event loop).

Only this thread touches the decoder, and only this thread runs torch: given a
function that builds the decoder, it loads the model and times it there too. OpenMP
gives each thread that opens parallel regions a team of its own, and on a small CPU
one team's regions run much slower once another thread's team exists (docs/serving.md
has the figures); the model must load, be timed and decode on one thread.
A request's life: ``submit`` (refused when the
queue is full) → waiting → decoding (its tokens flow to its sink) → finished (its
result goes to the sink and the decoder keeps nothing of it) or cancelled (a client
that went away: its row is freed at the next step).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from racer import BatchDecoder, GenerationOptions


class QueueFull(Exception):
    """More requests than the batch and the queue hold."""


@dataclass
class Ticket:
    """One request's handle: where its updates go, and how to cancel it."""

    options: GenerationOptions
    prompt: Any
    deliver: Callable[[tuple], None]  # called from the decoding thread
    scope: Any = None  # whose drafter memory it shares (``BatchDecoder.submit``)
    batch_id: int | None = None
    cancelled: bool = False


class DecodingThread:
    """Runs an engine (``racer.BatchDecoder``) on a thread of its own; at most ``max_batch + max_queue``
    requests are held at once. ``decoder``: a ``BatchDecoder``, or a function that
    builds one, called on the engine's thread (``wait_ready`` returns it)."""

    def __init__(self, decoder: BatchDecoder | Callable[[], BatchDecoder], max_queue: int,
                 on_step: Callable[[int, int, list, int], None] | None = None) -> None:
        self.max_queue = max_queue
        self.on_step = on_step
        self._build = decoder if callable(decoder) else None
        self.decoder: BatchDecoder | None = None if callable(decoder) else decoder
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        if self.decoder is not None:
            self._ready.set()
        self._inbox: "queue.Queue[Ticket]" = queue.Queue()
        self._held = 0  # requests submitted and not yet finished
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="racer-decoding", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> BatchDecoder:
        """The decoder, once built (re-raises what building it raised)."""
        if not self._ready.wait(timeout):
            raise TimeoutError("the decoder is not built yet")
        if self._failure is not None:
            raise self._failure
        return self.decoder

    @property
    def capacity(self) -> int:
        return self.wait_ready().max_batch + self.max_queue

    @property
    def held(self) -> int:
        return self._held

    def submit(self, prompt: Any, options: GenerationOptions, deliver: Callable[[tuple], None],
               scope: Any = None) -> Ticket:
        with self._lock:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if self._held >= self.capacity:
                raise QueueFull(f"{self._held} requests are in flight or queued (the most this server holds)")
            self._held += 1
        ticket = Ticket(options, prompt, deliver, scope)
        self._inbox.put(ticket)
        self._wake.set()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        ticket.cancelled = True
        self._wake.set()

    def stop(self, grace: float) -> None:
        """Accept nothing more; let requests in flight finish for up to ``grace`` seconds,
        then cancel the rest and end the thread."""
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + grace
        while self._held and time.monotonic() < deadline:
            time.sleep(0.05)
        for ticket in list(self._tickets.values()):
            ticket.cancelled = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _done(self, ticket: Ticket) -> None:
        with self._lock:
            self._held -= 1

    def _run(self) -> None:
        if self._build is not None:
            try:
                self.decoder = self._build()
            except BaseException as err:  # noqa: BLE001 - handed to wait_ready's caller
                self._failure = err
                return
            finally:
                self._ready.set()
        self._loop()

    def _loop(self) -> None:
        while True:
            decoder = self.decoder  # a failed step replaces it
            while True:
                try:
                    ticket = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if ticket.cancelled:
                    self._done(ticket)
                    ticket.deliver(("cancelled", None))
                    continue
                try:
                    ticket.batch_id = decoder.submit(ticket.prompt, ticket.options, scope=ticket.scope)
                    self._tickets[ticket.batch_id] = ticket
                except ValueError as err:  # the prompt does not fit, bad options
                    self._done(ticket)
                    ticket.deliver(("error", err))
            for batch_id, ticket in list(self._tickets.items()):
                if ticket.cancelled:
                    decoder.cancel(batch_id)
            if not decoder.busy:
                if self._stopping and not self._held:
                    return
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                updates = decoder.step()
            except Exception as err:  # noqa: BLE001 - one bad step fails its requests, not the server
                traceback.print_exc()
                self._fail_all(err)
                continue
            if self.on_step is not None:  # before the answers go: a client that reads /metrics next sees this step
                self.on_step(decoder.active, decoder.waiting, updates, decoder.idle_drafters)
            for update in updates:
                ticket = self._tickets.get(update.request)
                if ticket is None:
                    continue
                if update.tokens:
                    ticket.deliver(("tokens", update))
                if update.done:  # counted out before the answer goes, so a client never sees it held
                    del self._tickets[update.request]
                    self._done(ticket)
                    ticket.deliver(("done", decoder.result(update.request)))

    def _fail_all(self, err: Exception) -> None:
        """A step raised: every request in the batch fails, and the batch starts afresh."""
        for batch_id, ticket in list(self._tickets.items()):
            self._done(ticket)
            ticket.deliver(("error", err))
        self._tickets.clear()
        self.decoder = self.decoder.fresh()


def asyncio_sink(loop: asyncio.AbstractEventLoop) -> tuple["asyncio.Queue[tuple]", Callable[[tuple], None]]:
    """A queue on ``loop`` and a function the decoding thread calls to put into it."""
    box: "asyncio.Queue[tuple]" = asyncio.Queue()

    def deliver(item: tuple) -> None:
        loop.call_soon_threadsafe(box.put_nowait, item)

    return box, deliver
