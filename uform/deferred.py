"""Deferred verbs: one worker thread per executor, and answers both awaitable and waitable.

Every verb on a trainer, blocking or deferred, is a `(future, call)` pair put on its executor's
queue, so verbs run in the order they were submitted: a blocking `trainer.step` waits behind the
deferred steps submitted before it. The native call inside releases the GIL, so other Python
threads and the event loop run while the library works.

A GPU step is a `TwoPhase` call: the worker begins the next step submitted (validates, packs and
uploads its batch and queues its work) before it ends the one in flight, so the device runs one
step after another with no wait for the host between them, as long as the caller keeps two submitted.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable, Optional

from .errors import Busy

__all__ = ["Deferred"]

_STOP = object()

# How long the worker waits for the next step before ending the one in flight: a quarter of the last
# step's time, at most this. A loop that keeps two steps submitted submits the next within a
# millisecond of the last one landing; any other caller waits for the device anyway, past this.
_PATIENCE_SECONDS = 0.005


class TwoPhase:
    """A verb in two halves: `begin` queues its work on the device and returns; `end` waits for it and
    answers. Calling it runs both. With `overlaps` false (the CPU runs a step whole in `begin`), the
    worker never holds it begun while it begins another.

    `begin` releases what it holds when it raises; `end` releases it whether it returns or raises.
    """

    __slots__ = ("begin", "end", "overlaps", "began")

    def __init__(self, begin: Callable[[], None], end: Callable[[], Any], overlaps: bool) -> None:
        self.begin, self.end, self.overlaps = begin, end, overlaps
        self.began = threading.Event()  # set once `begin` returned or raised, or the verb was cancelled

    def __call__(self) -> Any:
        try:
            self.begin()
        finally:
            self.began.set()
        return self.end()


class Deferred:
    """The answer of a deferred verb, before and after it lands.

    `await deferred` and `deferred.wait()` both return the verb's result (a `Stepped` for `step`,
    None for `save`, `Rows` for `embed`, `Answers` for `embed_tokens` and `text_choose`) or raise its
    error. Cancelling the awaiting task stops the waiting, never the verb: a submitted verb always runs.
    A verb's error that nobody awaited or waited for is logged (logger "uform") once its `Deferred`
    is collected, as asyncio logs a task's exception that was never retrieved: a fire-and-forget
    save that failed does not fail silently.
    """

    __slots__ = ("_future", "_verb", "_retrieved")

    def __init__(self, future: concurrent.futures.Future, verb: str) -> None:
        self._future = future
        self._verb = verb
        self._retrieved = False

    @classmethod
    def _failed(cls, error: BaseException, verb: str) -> "Deferred":
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_exception(error)
        return cls(future, verb)

    def done(self) -> bool:
        """True once the verb has returned or raised."""
        return self._future.done()

    def add_done_callback(self, callback: Callable[["Deferred"], Any]) -> None:
        """Calls `callback(deferred)` once the verb has landed: on the executor's worker thread as it lands,
        or at once on this thread when it already has. There `wait()` returns at once, and deferred verbs may
        be submitted; a blocking verb raises `Busy`. What the callback raises is logged (logger "uform"); a
        `callback` that is not callable raises `TypeError` here, not there."""
        if not callable(callback):
            raise TypeError(f"callback: expected a callable taking the Deferred, got {type(callback).__name__}")
        # The Deferred lives until its callback has run, and then no longer through it: the future keeps its
        # callbacks, and a reference from there would make a cycle that only the collector breaks, leaving an
        # error nobody retrieved untold until it ran.
        holder = [self]

        def call(_: concurrent.futures.Future) -> None:
            deferred = holder.pop()
            try:
                callback(deferred)
            except BaseException:  # SystemExit or KeyboardInterrupt too: the worker must live on
                logging.getLogger("uform").exception("a callback of the deferred %s raised", deferred._verb)

        self._future.add_done_callback(call)

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Blocks until the verb lands, then returns its result or raises its error.

        Raises `TimeoutError` when `timeout` seconds pass first; the verb still runs. Raises `Busy` when
        called, before the verb landed, on an executor's own worker thread, which would wait for itself.
        """
        if not self._future.done() and any(threading.current_thread() is worker._thread for worker in list(_workers)):
            raise Busy(f"the deferred {self._verb}: waited for on the executor's own worker thread (in a Deferred's "
                       "callback, say), where it can never land; await it or wait from another thread")
        landed, _ = concurrent.futures.wait([self._future], timeout)
        if not landed:
            raise TimeoutError(f"the deferred {self._verb} did not land within {timeout} s")
        self._retrieved = True
        return self._future.result()

    def __await__(self):
        if not self._future.done():
            loop = asyncio.get_running_loop()
            landed = loop.create_future()

            def settle() -> None:
                if not landed.done():  # the awaiting task may have been cancelled meanwhile
                    landed.set_result(None)

            def notify(_: concurrent.futures.Future) -> None:
                try:
                    loop.call_soon_threadsafe(settle)
                except RuntimeError:  # the loop closed before the verb landed: nobody waits
                    pass

            self._future.add_done_callback(notify)
            yield from landed.__await__()
        self._retrieved = True
        return self._future.result()

    def __del__(self) -> None:
        if not self._retrieved:  # pending or landed: its error, if any, is told once it has one
            self._future.add_done_callback(_VerbReport(self._verb))

    def __repr__(self) -> str:
        if not self._future.done():
            state = "pending"
        elif self._future.exception() is not None:
            state = f"failed: {type(self._future.exception()).__name__}"
        else:
            state = "done"
        return f"<Deferred {self._verb} {state}>"


class _VerbReport:
    """Logs a verb's error that nobody retrieved."""

    __slots__ = ("verb",)

    def __init__(self, verb: str) -> None:
        self.verb = verb

    def __call__(self, future: concurrent.futures.Future) -> None:
        if future.cancelled() or future.exception() is None:
            return
        try:
            logging.getLogger("uform").error("the deferred %s failed, and its Deferred was dropped without being "
                                             "awaited or waited for", self.verb, exc_info=future.exception())
        except Exception:  # at interpreter exit logging may be gone: nothing left to tell
            pass


class Worker:
    """The thread that runs an executor's verbs in submission order.

    A daemon, so it never keeps the interpreter alive: at exit, verbs not yet started are
    cancelled and only the one already inside the library is waited for, since the process's
    libraries (OpenBLAS, CUDA) must not be torn down under a running native call. It stops when
    its executor is freed or collected. Verbs submitted from the worker itself (say, from a
    future's done-callback) queue like any other; a blocking one there raises `uform.Busy`, as it
    would wait forever for the verb the worker is running.
    """

    def __init__(self, name: str) -> None:
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=_serve, args=(self._queue, self._closing), name=name, daemon=True)
        self._thread.start()
        _workers.add(self)

    def submit(self, call: Callable[[], Any]) -> concurrent.futures.Future:
        """Queues `call` behind every verb submitted before it, from whichever thread."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, call))
        return future

    def run(self, call: Callable[[], Any], verb: str = "verb") -> Any:
        """Runs `call` behind every verb submitted before it, and returns its result.

        Ctrl-C stops only this thread's waiting, never the call on the worker, so an interrupt waits
        for the call to land and is then raised with a note saying how `verb` ended: a caller that
        catches it must not believe the step did not happen and feed the batch again.
        """
        self.refuse_own_thread()
        future = self.submit(call)
        try:
            return future.result()
        except KeyboardInterrupt as interrupt:
            if future.done() and future.exception() is interrupt:  # the call's own, not Ctrl-C's
                raise
            started = "had started" if future.running() or future.done() else "was queued, then ran,"
            _land_despite_interrupts(future)
            error = future.exception()
            ending = "completed" if error is None else f"failed ({type(error).__name__}: {error})"
            if hasattr(interrupt, "add_note"):  # Python 3.11+
                interrupt.add_note(f"uform: the {verb} {started} and {ending} before this interrupt took effect")
            raise

    def refuse_own_thread(self) -> None:
        """Raises `Busy` on the worker's own thread, where waiting for a verb would wait on itself."""
        if threading.current_thread() is self._thread:
            raise Busy("executor: a blocking verb on the executor's own worker thread (in a Deferred's callback, say) "
                       "would wait for itself; submit it with deferred() where the verb has a deferred form, or call it "
                       "from another thread")

    def stop(self) -> None:
        """Lets every verb already submitted run, then ends the thread."""
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _abandon(self) -> None:
        """Cancels the verbs not yet started and ends the thread after the one running, if any."""
        self._closing.set()
        self._queue.put(_STOP)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()


_workers: "weakref.WeakSet[Worker]" = weakref.WeakSet()


def _land_despite_interrupts(future: concurrent.futures.Future) -> None:
    """Waits for `future`; a further Ctrl-C waits on, as the native call under it cannot be stopped."""
    while True:
        try:
            concurrent.futures.wait([future])
            return
        except KeyboardInterrupt:
            continue


def _settle(future: concurrent.futures.Future, call: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = call()
    except BaseException as error:  # noqa: B036 - the verb's error belongs to whoever waits on it
        future.set_exception(error)
    else:
        future.set_result(result)


def _land(future: concurrent.futures.Future, call: TwoPhase) -> float:
    """Ends the step in flight; answers how long to wait for a next step, next time: a quarter of this wait."""
    waited = time.perf_counter()
    try:
        result = call.end()
    except BaseException as error:  # noqa: B036 - the verb's error belongs to whoever waits on it
        future.set_exception(error)
    else:
        future.set_result(result)
    return min(_PATIENCE_SECONDS, (time.perf_counter() - waited) / 4)


def _within(calls: "queue.SimpleQueue[Any]", patience: float) -> Any:
    """The next job, or None where none comes within `patience` seconds.

    A timed `SimpleQueue.get` entered with nothing queued and its lock free takes the lock, and where the
    deadline passed meanwhile (a thread descheduled for a moment), waits on it again with a negative
    timeout: forever, until the next `put` (CPython 3.11, 3.12). A run that waits for its step in flight
    before it submits another then never got it landed. A non-blocking try first leaves the lock taken
    while the queue is empty, so the timed one only waits for a `put` or its timeout.
    """
    try:
        return calls.get(block=False)
    except queue.Empty:
        pass
    try:
        return calls.get(timeout=patience)
    except queue.Empty:  # nothing to begin behind it
        return None


def _serve(calls: "queue.SimpleQueue[Any]", closing: threading.Event) -> None:
    flight = None  # (future, call): a step begun and not ended
    patience, cancelled = 0.0, 0
    while True:
        job = calls.get() if flight is None else _within(calls, patience)
        overlapping = job is not None and job is not _STOP and isinstance(job[1], TwoPhase) and job[1].overlaps
        if flight is not None and (not overlapping or closing.is_set()):
            patience, flight = _land(*flight), None
        if job is None:
            continue
        if job is _STOP:
            if cancelled:
                _tell_cancelled(cancelled)
            return
        future, call = job
        job = None
        if closing.is_set():
            cancelled += future.cancel()
        elif overlapping:
            if future.set_running_or_notify_cancel():
                try:
                    call.begin()
                except BaseException as error:  # noqa: B036 - what is in flight stays in flight
                    future.set_exception(error)
                    call.began.set()
                else:
                    call.began.set()
                    if flight is not None:  # the device has this step queued behind it: end the one ahead
                        patience = _land(*flight)
                    flight = (future, call)
        else:
            _settle(future, call)
        if isinstance(call, TwoPhase):
            call.began.set()  # begun, refused or cancelled: nobody waits for it any longer
        future = call = None  # let go of the trainer and batch before waiting for the next job


def _tell_cancelled(count: int) -> None:
    try:
        logging.getLogger("uform").warning("%d verb(s) were cancelled at interpreter exit before they started (a "
                                           "save among them writes nothing); wait for the last Deferred before "
                                           "exiting", count)
    except Exception:  # at interpreter exit logging may be gone: nothing left to tell
        pass


@atexit.register
def _finish_at_exit() -> None:
    workers = list(_workers)
    for worker in workers:
        worker._abandon()
    for worker in workers:
        if worker._thread is not threading.current_thread():
            worker._thread.join()


def stop_on_collect(owner: Any, worker: Worker) -> None:
    """Stops `worker` when `owner` is garbage-collected, without keeping `owner` alive."""
    weakref.finalize(owner, worker._queue.put, _STOP)
