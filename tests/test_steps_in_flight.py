"""Steps in flight: a step begun before the one ahead of it lands trains exactly as one after another.

On a GPU the executor's worker begins the next deferred step (packs, uploads and queues it) before
it ends the one in flight, so the device never waits for the host between steps. The library queues
such a step as if the step ahead applies, and runs it again when that one is skipped instead: the
poisoned batches below check that correction. On the CPU a step runs whole when it begins, so the
same tests check the contract there. The GPU cases are skipped, never faked, without a GPU.
"""
import numpy as np
import pytest

import uform
from uform import _native
from uform.batch import normalize_batch

testing = pytest.importorskip("uform._testing")

@pytest.fixture
def rng():
    return np.random.default_rng()


BACKENDS = ["ram", pytest.param("vram", marks=pytest.mark.skipif(not testing.available("vram"),
                                                                  reason="no CUDA backend in this build or no GPU"))]

CONFIG = dict(depth=1, hidden=128, objective=uform.Objective.JOINT, seed=5,
              batch=dict(max_rows_per_device=12, max_columns_per_row=64, max_segments_per_device=12),
              schedule=dict(steps=50, warmup_steps=2))

# An attract edge weighed near the float limit: the loss or the gradient overflows and the step is skipped.
POISON = dict(attract=uform.Edges(offsets=[0, 1] + [1] * 11, ids=[2], weights=[3.4e38]))


def batch(rng, poisoned=False):
    texts = ["".join(chr(c) for c in rng.integers(97, 123, rng.integers(10, 60))) for _ in range(12)]
    pairs = uform.Edges(offsets=list(range(13)), ids=[i ^ 1 for i in range(12)])
    return dict(modalities=["text"] * 12, contents=texts, relations=POISON if poisoned else dict(attract=pairs))


def init(executor, backend):
    return uform.Trainer.init_vram(executor, CONFIG) if backend == "vram" else uform.Trainer.init_ram(executor, CONFIG)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def executor(backend):
    with (uform.Executor.for_vram() if backend == "vram" else uform.Executor.for_ram(threads=2)) as made:
        yield made


class Recorder:
    """Stands in for a trainer's native handle and records the order of its steps' halves."""

    def __init__(self, native):
        self.native, self.calls = native, []

    def step_begin(self, inputs, *args):
        self.calls.append(("begin", id(inputs)))
        return self.native.step_begin(inputs, *args)

    def step_end(self, inputs):
        self.calls.append(("end", id(inputs)))
        return self.native.step_end(inputs)

    def __getattr__(self, name):
        return getattr(self.native, name)


def same_stats(have, want):
    for field in ("loss", "grad_norm", "learning_rate"):
        a, b = getattr(have, field), getattr(want, field)
        assert np.float32(a).tobytes() == np.float32(b).tobytes(), f"{field}: {a} != {b}"
    assert (have.step, have.skipped, have.tokens, have.items) == (want.step, want.skipped, want.tokens, want.items)


def test_deferred_steps_in_flight_train_bit_for_bit_as_blocking_ones(rng, executor, backend, tmp_path):
    # Two poisoned batches in a row: the step behind each is queued on a wrong guess and run again.
    plan = [False, False, True, True, False, True, False, False]
    batches = [batch(rng, poisoned) for poisoned in plan]
    with init(executor, backend) as one_by_one, init(executor, backend) as in_flight:
        want = [one_by_one.step(b) for b in batches]
        recorder = Recorder(in_flight._native)
        in_flight._native = recorder
        deferred = in_flight.deferred()
        submitted = [deferred.step(b) for b in batches]
        have = [d.wait() for d in submitted]
        in_flight._native = recorder.native
        # A poisoned batch's loss now and then stays finite, just: then both runs apply it alike.
        assert [s.stats.skipped for s in have] == [s.stats.skipped for s in want]
        assert sum(s.stats.skipped for s in have) >= 2
        for h, w in zip(have, want):
            same_stats(h.stats, w.stats)
        assert in_flight._weights().tobytes() == one_by_one._weights().tobytes()
        one_by_one.save(tmp_path / "one_by_one.safetensors")
        in_flight.save(tmp_path / "in_flight.safetensors")
    assert (tmp_path / "one_by_one.safetensors").read_bytes() == (tmp_path / "in_flight.safetensors").read_bytes()
    began = [i for i, (half, _) in enumerate(recorder.calls) if half == "begin"]
    ended = [i for i, (half, _) in enumerate(recorder.calls) if half == "end"]
    assert len(began) == len(ended) == len(batches)
    overlapped = sum(b < e for b, e in zip(began[1:], ended[:-1]))  # step k + 1 began before step k ended
    if backend == "vram":
        assert overlapped >= len(batches) // 2, recorder.calls
    else:
        assert overlapped == 0, "the CPU runs a step whole: nothing to overlap"


def test_embeddings_of_a_step_in_flight_land_as_a_blocking_steps_do(rng, executor, backend):
    batches = [batch(rng) for _ in range(4)]
    with init(executor, backend) as one_by_one, init(executor, backend) as in_flight:
        want = [one_by_one.step(b, dict(arena=uform.Arena())).embeddings.numpy().copy() for b in batches]
        deferred = in_flight.deferred()
        submitted = [deferred.step(b, dict(arena=uform.Arena())) for b in batches]
        have = [d.wait().embeddings.numpy() for d in submitted]
        for h, w in zip(have, want):
            assert h.tobytes() == w.tobytes()


def test_the_native_halves_keep_their_order_and_refuse_the_rest(rng, executor, backend, tmp_path):
    steps = [_native.StepInputs(normalize_batch(batch(rng))) for _ in range(3)]
    with init(executor, backend) as trainer, init(executor, backend) as reference:
        want = [reference._native.step(s, None, 0) for s in steps]
        native = trainer._native
        with pytest.raises(uform.InvalidArgument, match="no step begun"):
            native.step_end(steps[0])
        native.step_begin(steps[0], None, 0)
        with pytest.raises(uform.InvalidArgument, match="begun already"):
            native.step_begin(steps[0], None, 0)
        native.step_begin(steps[1], None, 0)
        with pytest.raises(uform.Busy, match="end the earliest"):
            native.step_begin(steps[2], None, 0)
        with pytest.raises(uform.InvalidArgument, match="not the earliest"):
            native.step_end(steps[1])
        with pytest.raises(uform.Busy, match="before saving"):
            native.save(str(tmp_path / "never.safetensors").encode(), False, None)
        with pytest.raises(uform.Busy, match="before reading the weights"):
            native.weights()
        with pytest.raises(uform.Busy, match="before a blocking step"):
            native.step(steps[2], None, 0)
        with pytest.raises(uform.InvalidArgument, match="not begun"):
            native.step_end(steps[2])
        have = [native.step_end(steps[0]), native.step_end(steps[1])]
        native.step_begin(steps[2], None, 0)
        have.append(native.step_end(steps[2]))
        assert [h["step"] for h in have] == [1, 2, 3]
        for h, w in zip(have, want):
            assert h["loss"] == w["loss"] and h["grad_norm"] == w["grad_norm"]
        assert trainer._weights().tobytes() == reference._weights().tobytes()


def test_a_resumed_run_in_flight_repeats_an_unbroken_ones_bits(rng, executor, backend, tmp_path):
    """The resumed trainer plans its products afresh, in another order: each shape's choice must not depend on it."""
    batches = [batch(rng) for _ in range(6)]
    with init(executor, backend) as unbroken:
        deferred = unbroken.deferred()
        for d in [deferred.step(b) for b in batches]:
            d.wait()
        want = unbroken._weights()
    with init(executor, backend) as first:
        deferred = first.deferred()
        for d in [deferred.step(b) for b in batches[:3]]:
            d.wait()
        first.save(tmp_path / "half.safetensors")
    config = dict(CONFIG, resume=str(tmp_path / "half.safetensors"))
    with (uform.Trainer.init_vram if backend == "vram" else uform.Trainer.init_ram)(executor, config) as resumed:
        deferred = resumed.deferred()
        assert [d.wait().stats.step for d in [deferred.step(b) for b in batches[3:]]] == [4, 5, 6]
        assert resumed._weights().tobytes() == want.tobytes()
