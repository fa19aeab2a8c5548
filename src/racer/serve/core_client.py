"""The API side's handle on the engine core (``racer.serve.core``): the one registry of
the requests in flight, where each one's events go, and how many are held.

A request's life: ``submit`` (refused when the server holds ``max_batch + max_queue``
already, or is stopping) → its ``Tokens`` events as steps emit them → one ``Finished``
(its result, cancelled ones included) or ``Failed``, after which nothing of it is kept.
``cancel`` ends it at the engine's next step. Events reach a request's ``deliver`` on
the thread that reads the core (the process's reader, or the core's own thread).
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import queue
import threading
import time
from typing import Any, Callable, Hashable

from racer import GenerationOptions
from racer.serve.core import EngineCore, EngineSpec, run_engine_process
from racer.serve.events import Cancel, Command, Event, Failed, Finished, Ready, Stepped, Stop, Submit, Tokens, BuildFailed


class QueueFull(Exception):
    """More requests than the batch and the queue hold, or the server is stopping."""


class EngineGone(Exception):
    """The engine core ended (its process died): nothing more can be decoded."""


class CoreClient:
    """Submits requests to an engine core and routes its events back. Build one with
    ``in_process`` (the core in a process of its own) or ``in_thread`` (on a thread of
    this process). ``on_step`` is told of every ``Stepped`` event before the step's
    answers go out."""

    def __init__(self, max_queue: int, on_step: Callable[[Stepped], None] | None = None) -> None:
        self.max_queue, self.on_step = max_queue, on_step
        self._send: Callable[[Command], None] = lambda command: None
        self._ready = threading.Event()
        self._info: Ready | None = None
        self._failure: BaseException | None = None
        self._deliver: dict[int, Callable[[Event], None]] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._stopping = False
        self._gone: str | None = None
        self._join: Callable[[float], None] = lambda timeout: None

    # -- building -------------------------------------------------------------------
    @classmethod
    def in_process(cls, spec: EngineSpec, max_queue: int,
                   on_step: Callable[[Stepped], None] | None = None) -> "CoreClient":
        """The core in a process of its own (spawned: nothing of this process's threads
        or OpenMP teams is inherited), built from ``spec``."""
        client = cls(max_queue, on_step)
        context = multiprocessing.get_context("spawn")
        commands_out, commands_in = context.Pipe(duplex=False)
        events_out, events_in = context.Pipe(duplex=False)
        process = context.Process(target=run_engine_process, args=(spec, commands_out, events_in, os.getpid()),
                                  name="racer-engine", daemon=True)
        process.start()
        commands_out.close()
        events_in.close()
        sending = threading.Lock()

        def send(command: Command) -> None:
            with sending:  # handlers on several threads; one writer at a time
                commands_in.send(command)

        client._send = send

        def read() -> None:
            try:
                while True:
                    client._dispatch(events_out.recv())
            except (EOFError, OSError):
                pass
            process.join(timeout=5)
            client._lost(f"the engine process ended (exit code {process.exitcode})")

        reader = threading.Thread(target=read, name="racer-engine-reader", daemon=True)
        reader.start()

        def join(timeout: float) -> None:
            reader.join(timeout)
            process.join(timeout=1)
            if process.is_alive():
                process.terminate()

        client._join = join
        return client

    @classmethod
    def in_thread(cls, decoder: Any, max_queue: int,
                  on_step: Callable[[Stepped], None] | None = None) -> "CoreClient":
        """The core on a thread of this process. ``decoder``: a ``BatchDecoder``, or a
        function that builds one, called on that thread (so that torch runs on one
        thread only)."""
        client = cls(max_queue, on_step)
        inbox: "queue.Queue[Command]" = queue.Queue()
        client._send = inbox.put

        def receive(block: bool) -> list[Command]:
            taken = [inbox.get()] if block else []
            while True:
                try:
                    taken.append(inbox.get_nowait())
                except queue.Empty:
                    return taken

        def run() -> None:
            try:
                built = decoder() if callable(decoder) else decoder
            except BaseException as err:  # noqa: BLE001 - handed to wait_ready's caller
                client._failure = err
                client._ready.set()
                return
            client._dispatch([Ready(built.facts.max_positions, built.max_batch)])
            client.core = EngineCore(built)
            client.core.run(receive, client._dispatch)
            client._lost("the engine thread ended")

        thread = threading.Thread(target=run, name="racer-decoding", daemon=True)
        thread.start()
        client._join = thread.join
        return client

    # -- the API side's calls ---------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> Ready:
        """The engine's context window and rows, once built (raises what building raised)."""
        if not self._ready.wait(timeout):
            raise TimeoutError("the engine is not built yet")
        if self._failure is not None:
            raise self._failure
        return self._info

    @property
    def capacity(self) -> int:
        return self.wait_ready().max_batch + self.max_queue

    @property
    def held(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._deliver)

    def submit(self, ids: list[int], options: GenerationOptions, deliver: Callable[[Event], None],
               scope: Hashable | None = None) -> int:
        """Queue a checked prompt; its events go to ``deliver``. Returns its key."""
        with self._lock:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if self._gone is not None:
                raise EngineGone(self._gone)
            if len(self._deliver) >= self.capacity:
                raise QueueFull(f"{len(self._deliver)} requests are in flight or queued (the most this server holds)")
            key = next(self._keys)
            self._deliver[key] = deliver
        self._send(Submit(key, ids, options, scope))
        return key

    def cancel(self, key: int) -> None:
        if key in self._deliver:
            self._send(Cancel(key))

    def stop(self, grace: float) -> None:
        """Accept nothing more; let requests in flight finish for up to ``grace`` seconds,
        then cancel the rest and end the core."""
        with self._lock:
            self._stopping = True
        deadline = time.monotonic() + grace
        while self._deliver and self._gone is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._gone is None:
            try:
                self._send(Stop())
            except (OSError, ValueError):
                pass
        self._join(10)

    # -- events from the core ---------------------------------------------------------
    def _dispatch(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Stepped):
                if self.on_step is not None:
                    self.on_step(event)
            elif isinstance(event, Tokens):
                deliver = self._deliver.get(event.key)
                if deliver is not None:
                    deliver(event)
            elif isinstance(event, (Finished, Failed)):
                with self._lock:  # counted out before the answer goes: a client never sees it held
                    deliver = self._deliver.pop(event.key, None)
                if deliver is not None:
                    deliver(event)
            elif isinstance(event, Ready):
                self._info = event
                self._ready.set()
            elif isinstance(event, BuildFailed):
                self._failure = (ValueError(event.message) if event.bad_input
                                 else RuntimeError(f"the engine could not be built: {event.message}"))
                self._ready.set()

    def _lost(self, why: str) -> None:
        """The core ended: every request still held fails, and nothing more is taken."""
        with self._lock:
            self._gone = why
            held, self._deliver = self._deliver, {}
        if not self._ready.is_set():
            self._failure = self._failure or RuntimeError(why)
            self._ready.set()
        for key, deliver in held.items():
            deliver(Failed(key, why))
