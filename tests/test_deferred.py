"""Deferred verbs: order, answers, errors, and that neither the event loop nor the GIL is held.

Most tests train a tiny model (depth 1, hidden 128); the ones about concurrency need a step long
enough to watch, about a fifth of a second on one thread (depth 2, hidden 256, 8 rows of 256).
"""

import asyncio
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import safetensors.numpy

import uform
from uform import Edges, Executor, Modality, Objective, Trainer

TINY = dict(
    depth=1,
    hidden=128,
    batch=dict(max_rows_per_device=4, max_columns_per_row=32),
    objective=Objective.JOINT,
    schedule=dict(steps=10),
)
SLOW = dict(
    depth=2,
    hidden=256,
    batch=dict(max_rows_per_device=8, max_columns_per_row=256),
    objective=Objective.JOINT,
    schedule=dict(steps=10),
)


def pair_batch(**overrides):
    batch = dict(
        modalities=[Modality.TEXT, Modality.TEXT],
        contents=["a small red panda", "Red pandas eat bamboo."],
        relations=dict(attract=Edges(offsets=[0, 1, 2], ids=[1, 0])),
    )
    batch.update(overrides)
    return batch


def slow_batch():
    return dict(modalities=["text"] * 8, contents=[f"item {i} " * 36 for i in range(8)])


@pytest.fixture
def cpu():
    executor = Executor.for_ram(threads=1)
    yield executor
    executor.free()


@pytest.fixture
def trainer(cpu):
    trainer = Trainer.init_ram(cpu, TINY)
    yield trainer
    trainer.free()


@pytest.fixture
def slow(cpu):
    trainer = Trainer.init_ram(cpu, SLOW)
    started = time.perf_counter()
    trainer.step(slow_batch())  # warm up, and make sure a step is long enough to watch
    assert time.perf_counter() - started > 0.03, "the slow configuration is too fast to observe concurrency"
    yield trainer
    trainer.free()


async def test_awaited_steps_land_in_submission_order(trainer):
    deferred = trainer.deferred()
    answers = [deferred.step(pair_batch()) for _ in range(4)]
    assert all(isinstance(answer, uform.Deferred) for answer in answers)
    stepped = [await answer for answer in reversed(answers)]  # awaiting order does not matter
    assert [s.stats.step for s in reversed(stepped)] == [1, 2, 3, 4]
    assert all(isinstance(s, uform.Stepped) and s.stats.items == 2 for s in stepped)
    assert all(answer.done() for answer in answers)
    assert (await answers[0]).stats.step == 1  # awaiting twice answers the same


async def test_deferred_save_lands_after_the_steps_before_it(trainer, tmp_path):
    deferred = trainer.deferred()
    steps = [deferred.step(pair_batch()) for _ in range(3)]
    saved = deferred.save(tmp_path / "checkpoint.safetensors")
    assert await saved is None
    assert all(step.done() for step in steps)
    tensors = safetensors.numpy.load_file(str(tmp_path / "checkpoint.safetensors"))
    assert tensors
    with uform.Executor.for_ram(threads=1) as cpu:
        resumed = Trainer.init_ram(cpu, dict(TINY, resume=str(tmp_path / "checkpoint.safetensors")))
        try:
            assert resumed.step(pair_batch()).stats.step == 4  # the checkpoint holds all three steps
        finally:
            resumed.free()


def test_wait_returns_the_result_and_done_tracks_it(slow):
    first = slow.deferred().step(slow_batch())
    second = slow.deferred().step(slow_batch())
    assert not second.done()  # it waits behind the first
    stepped = second.wait()
    assert second.done() and first.done()
    assert isinstance(stepped, uform.Stepped) and stepped.stats.step == 3
    assert first.wait().stats.step == 2
    assert "done" in repr(second)


def test_a_done_callback_runs_as_the_verb_lands_or_at_once_and_what_it_raises_is_logged(slow, caplog):
    calls = []

    def record(deferred):
        calls.append((deferred.wait().stats.step, threading.current_thread() is threading.main_thread()))

    answer = slow.deferred().step(slow_batch())
    answer.add_done_callback(record)
    assert answer.wait().stats.step == 2
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:  # the worker calls it just after the answer is set
        time.sleep(0.001)
    assert calls == [(2, False)]  # on the worker thread, where wait() returns at once
    answer.add_done_callback(record)
    assert calls == [(2, False), (2, True)]  # landed already: at once, here

    def broken(_):
        raise ValueError("the callback broke")

    answer.add_done_callback(broken)
    answer.add_done_callback(lambda _: sys.exit(3))  # on the worker, it would end the thread every verb needs
    later = slow.deferred().step(slow_batch())
    later.add_done_callback(lambda _: sys.exit(3))
    assert later.wait().stats.step == 3 and slow.deferred().step(slow_batch()).wait(timeout=30).stats.step == 4
    logged = [record for record in caplog.records if record.name == "uform"]
    assert [record.getMessage() for record in logged] == ["a callback of the deferred step raised"] * 3
    assert [type(record.exc_info[1]) for record in logged] == [ValueError, SystemExit, SystemExit]


def test_a_done_callback_that_is_not_callable_is_refused_at_once(slow, caplog):
    answer = slow.deferred().step(slow_batch())
    for wrong, kind in ((None, "NoneType"), ("print", "str")):
        with pytest.raises(TypeError, match=f"^callback: expected a callable taking the Deferred, got {kind}$"):
            answer.add_done_callback(wrong)
    assert answer.wait().stats.step == 2
    with pytest.raises(TypeError, match="^callback: "):  # landed already: refused alike
        answer.add_done_callback(None)
    assert not [record for record in caplog.records if record.name == "uform"]  # nothing failed later, on the worker


def test_wait_times_out_but_the_verb_still_runs(slow):
    answer = slow.deferred().step(slow_batch())
    with pytest.raises(TimeoutError):
        answer.wait(timeout=0.001)
    assert answer.wait().stats.step == 2


async def test_errors_surface_where_awaited(trainer):
    deferred = trainer.deferred()
    good = deferred.step(pair_batch())
    refused_by_c = deferred.step(pair_batch(relations=dict(attract=Edges([0, 1, 2], [7, 0]))))
    refused_by_python = deferred.step(pair_batch(bags=[0, 1, 2]))  # the answer, not the call, raises
    after = deferred.step(pair_batch())
    assert (await good).stats.step == 1
    with pytest.raises(uform.InvalidArgument, match=r"batch\.relations\.attract"):
        await refused_by_c
    with pytest.raises(uform.InvalidArgument, match=r"^batch\.bags: 3 entries, expected 2, one per item$"):
        await refused_by_python
    with pytest.raises(uform.InvalidArgument, match=r"^batch\.bags"):
        refused_by_python.wait()
    assert (await after).stats.step == 2  # the bad ones changed nothing
    assert "failed: InvalidArgument" in repr(refused_by_c)


def test_an_error_nobody_retrieved_is_logged_once_its_deferred_is_dropped(trainer, tmp_path, caplog):
    import gc

    deferred = trainer.deferred()
    deferred.save(str(tmp_path / "absent" / "x.safetensors"))  # dropped at once, before it lands
    failed = deferred.step(pair_batch(bags=[0, 1, 2]))
    retrieved = deferred.step(pair_batch(bags=[0, 1, 2]))
    with pytest.raises(uform.InvalidArgument):
        retrieved.wait()
    good = deferred.step(pair_batch())
    good.wait()
    del failed, retrieved, good
    gc.collect()
    logged = [record for record in caplog.records if record.name == "uform"]
    assert [record.getMessage() for record in logged] == [
        "the deferred save failed, and its Deferred was dropped without being awaited or waited for",
        "the deferred step failed, and its Deferred was dropped without being awaited or waited for"]
    assert "absent" in str(logged[0].exc_info[1]) and isinstance(logged[1].exc_info[1], uform.InvalidArgument)


def test_an_error_nobody_retrieved_is_logged_as_its_deferred_is_dropped_after_its_callback_ran(slow, tmp_path, caplog):
    """Told when the last reference goes, as for one without a callback: not when the collector next runs."""
    import gc

    landed, deferred = [], slow.deferred()
    ahead = deferred.step(slow_batch())
    failed = deferred.save(str(tmp_path / "absent" / "x.safetensors"))  # fails on the worker, behind the step
    assert not failed.done()
    failed.add_done_callback(landed.append)
    ahead.wait()
    while not landed:
        time.sleep(0.01)
    landed.clear()
    gc.disable()  # the reference count alone must free it
    try:
        del failed
        assert [record.getMessage() for record in caplog.records if record.name == "uform"] == [
            "the deferred save failed, and its Deferred was dropped without being awaited or waited for"]
    finally:
        gc.enable()


def test_blocking_verbs_wait_behind_deferred_ones(slow, tmp_path):
    deferred = slow.deferred()
    queued = [deferred.step(slow_batch()) for _ in range(2)]
    assert not queued[-1].done()
    stepped = slow.step(slow_batch())
    assert all(answer.done() for answer in queued)
    assert [answer.wait().stats.step for answer in queued] == [2, 3]
    assert stepped.stats.step == 4
    late = deferred.step(slow_batch())
    slow.save(tmp_path / "behind.safetensors")
    assert late.done() and (tmp_path / "behind.safetensors").exists()


def _interrupt_main_thread(*after_seconds):
    """Sends SIGINT to the main thread after each delay, as Ctrl-C reaches it: a signal sent to the
    process, or raised on another thread, may land on that thread and never wake the waiting one."""
    def send():
        started = time.perf_counter()
        for delay in after_seconds:
            time.sleep(max(0.0, started + delay - time.perf_counter()))
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    sender = threading.Thread(target=send)
    sender.start()
    return sender


def test_ctrl_c_during_a_blocking_step_waits_for_it_and_says_it_completed(slow):
    # The step runs on the worker, which Ctrl-C cannot stop: the interrupt must come after the step
    # landed, saying so, or a loop that catches it would feed the same batch again.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sender = _interrupt_main_thread(0.005, 0.01)  # the second, too, must wait for the step
        with pytest.raises(KeyboardInterrupt) as raised:
            slow.step(slow_batch())
        sender.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert slow.step(slow_batch()).stats.step == 3  # the interrupted step was step 2
    if sys.version_info >= (3, 11):
        assert raised.value.__notes__ == ["uform: the step had started and completed before this interrupt took effect"]


def test_ctrl_c_during_a_blocking_verb_names_the_verb_and_how_it_failed(trainer, tmp_path):
    if sys.version_info < (3, 11):
        pytest.skip("exception notes need Python 3.11")
    release = threading.Event()
    queued = trainer.deferred().step(pair_batch())
    queued._future.add_done_callback(lambda _: release.wait())  # holds the worker until the interrupt
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sender = _interrupt_main_thread(0.02)
        threading.Timer(0.05, release.set).start()
        with pytest.raises(KeyboardInterrupt) as raised:
            trainer.save(tmp_path / "missing" / "checkpoint.safetensors")
        sender.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert queued.wait().stats.step == 1
    [note] = raised.value.__notes__
    assert note.startswith("uform: the save was queued, then ran, and failed (StorageError: path: cannot write ")
    assert note.endswith("before this interrupt took effect")


def test_free_waits_behind_deferred_verbs(cpu):
    trainer = Trainer.init_ram(cpu, SLOW)
    queued = [trainer.deferred().step(slow_batch()) for _ in range(2)]
    trainer.free()
    assert [answer.wait().stats.step for answer in queued] == [1, 2]
    with pytest.raises(uform.InvalidHandle):
        trainer.deferred().step(slow_batch()).wait()


async def test_the_event_loop_runs_while_a_step_does(slow):
    ticks = []

    async def ticker():
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.001)

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    submitted = time.perf_counter()
    stepped = await slow.deferred().step(slow_batch())
    landed = time.perf_counter()
    ticking.cancel()
    during = [tick for tick in ticks if submitted < tick < landed]
    assert stepped.stats.step == 2
    assert landed - submitted > 0.03
    assert len(during) >= 10, f"{len(during)} ticks in {landed - submitted:.3f} s"


async def test_cancelling_the_waiter_does_not_cancel_the_step(slow):
    answer = slow.deferred().step(slow_batch())
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(answer, timeout=0.001)
    assert (await answer).stats.step == 2


def _count_during(call):
    """Runs `call` while another Python thread counts; answers the counts seen in its middle half."""
    progress = []
    stop = threading.Event()

    def count():
        n = 0
        while not stop.is_set():
            n += 1
            if n % 100 == 0:
                progress.append(time.perf_counter())

    counter = threading.Thread(target=count)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    counter.start()
    try:
        time.sleep(0.01)
        started = time.perf_counter()
        result = call()
        ended = time.perf_counter()
    finally:
        stop.set()
        counter.join()
        sys.setswitchinterval(old_interval)
    quarter = (ended - started) / 4
    middle = [t for t in progress if started + quarter < t < ended - quarter]
    return result, middle, ended - started


def test_the_gil_is_released_during_a_blocking_step(slow):
    # The step runs on the executor's worker thread; if it held the GIL through the native call,
    # the counting thread could not run at all in the middle of the step.
    stepped, middle, seconds = _count_during(lambda: slow.step(slow_batch()))
    assert stepped.stats.step == 2 and seconds > 0.03
    assert len(middle) >= 10, f"the counter advanced {len(middle)} times in the middle of a {seconds:.3f} s step"


def test_the_gil_is_released_during_a_probe(slow):
    (stats, gradients), middle, seconds = _count_during(lambda: slow._probe(slow_batch()))
    assert np.any(gradients != 0) and seconds > 0.03
    assert len(middle) >= 10, f"the counter advanced {len(middle)} times in the middle of a {seconds:.3f} s probe"


def test_one_lazy_daemon_worker_per_executor_stopped_by_free():
    cpu = Executor.for_ram(threads=1)
    trainer = Trainer.init_ram(cpu, TINY)
    assert cpu._worker is None  # created at the first verb
    other = Trainer.init_ram(cpu, TINY)
    trainer.step(pair_batch())
    worker = cpu._worker
    assert worker is not None and worker._thread.daemon and worker.alive
    other.deferred().step(pair_batch()).wait()
    assert cpu._worker is worker  # both trainers share their executor's one worker
    assert cpu._worker_thread().run(threading.current_thread) is worker._thread is not threading.current_thread()
    trainer.free()
    other.free()
    cpu.free()
    assert not worker.alive


def test_the_worker_does_not_keep_the_interpreter_alive(tmp_path):
    script = textwrap.dedent(
        """
        import uform
        cpu = uform.Executor.for_ram(threads=1)
        trainer = uform.Trainer.init_ram(cpu, dict(depth=2, hidden=256, objective="joint",
            batch=dict(max_rows_per_device=8, max_columns_per_row=256), schedule=dict(steps=10)))
        batch = dict(modalities=["text"] * 8, contents=["item " * 50] * 8)
        trainer.deferred().step(batch).wait()
        for _ in range(100):  # some 20 s of steps, still queued when the interpreter exits
            trainer.deferred().step(batch)
        print("leaving")
        """
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=str(tmp_path), env=_child_environment())
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "leaving"
    assert time.perf_counter() - started < 15
    assert re.search(r"\d+ verb\(s\) were cancelled at interpreter exit before they started", done.stderr), done.stderr


def _child_environment():
    import os

    environment = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(uform.__file__))
    environment["PYTHONPATH"] = package_root + os.pathsep + environment.get("PYTHONPATH", "")
    return environment


def test_the_worker_begins_the_next_step_before_it_ends_the_one_in_flight():
    """The worker's side of steps in flight, with halves that only record their order: on a GPU they queue work."""
    from uform.deferred import TwoPhase, Worker

    calls = []

    def step(name, fails=False):
        def begin():
            calls.append(f"begin {name}")
            if fails:
                raise uform.InvalidArgument(f"{name}: refused")

        def end():
            calls.append(f"end {name}")
            return name

        return TwoPhase(begin, end, overlaps=True)

    worker = Worker("test-steps-in-flight")
    try:
        gate = threading.Event()
        worker.submit(gate.wait)  # hold the worker until everything is queued
        futures = [worker.submit(step("a")), worker.submit(step("b")), worker.submit(step("c", fails=True)),
                   worker.submit(step("d")), worker.submit(lambda: calls.append("save")), worker.submit(step("e"))]
        gate.set()
        assert [f.result(timeout=10) for f in futures[:2]] == ["a", "b"]
        with pytest.raises(uform.InvalidArgument, match="c: refused"):
            futures[2].result(timeout=10)
        assert futures[3].result(timeout=10) == "d" and futures[5].result(timeout=10) == "e"
        # Each step begins before the one ahead ends; a refused one leaves the one in flight as it was; anything
        # else waits for the step in flight to land; the last step ends once nothing follows it.
        assert calls == ["begin a", "begin b", "end a", "begin c", "begin d", "end b", "end d", "save",
                         "begin e", "end e"]
    finally:
        worker.stop()



class _StallingQueue:
    """A SimpleQueue as CPython's behaves at worst: a timed `get` entered with nothing queued and the queue's lock
    free (as every `get` that took an item leaves it) takes the lock, finds its deadline passed (its thread was
    descheduled a moment), and waits on the lock again with a negative timeout, that is until the next `put`."""

    def __init__(self):
        self.items, self.locked, self.changed = [], False, threading.Condition()

    def put(self, item):
        with self.changed:
            self.items.append(item)
            self.locked = False
            self.changed.notify_all()

    def get(self, block=True, timeout=None):
        import queue

        with self.changed:
            if not self.items and not block:
                self.locked = True
                raise queue.Empty
            stalls = timeout is not None and not self.locked
            self.locked = True
            if not self.changed.wait_for(lambda: self.items, None if stalls else timeout):
                raise queue.Empty
            self.locked = False
            return self.items.pop(0)


def test_a_step_in_flight_lands_though_nothing_follows_it():
    """`uform train` waits for the step in flight before a checkpoint, so nothing follows it: the worker must land it
    however its queue's timed wait behaves (a stalled one held a run on the GPU forever)."""
    import concurrent.futures

    from uform.deferred import _STOP, TwoPhase, _serve

    calls = _StallingQueue()
    worker = threading.Thread(target=_serve, args=(calls, threading.Event()), daemon=True)
    worker.start()
    try:
        for name in ("first", "second"):
            step = TwoPhase(lambda: None, lambda name=name: name, overlaps=True)
            future = concurrent.futures.Future()
            calls.put((future, step))
            assert step.began.wait(timeout=10)
            assert future.result(timeout=10) == name
    finally:
        calls.put(_STOP)
        worker.join(timeout=10)
