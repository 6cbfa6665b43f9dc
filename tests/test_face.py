"""The Python face where it meets the user: buffers read when a verb runs, arenas claimed by one verb
at a time, what inference cuts, what steps count, messages in the user's words, and the worker's order.

Every test trains a tiny model (depth 1, hidden 128) on the RAM executor. Tests that need verbs to
wait in the queue hold the executor's worker on a gate rather than racing a slow step.
"""

import ast
import contextlib
import pathlib
import threading

import numpy as np
import pytest

import uform
from uform import Arena, Edges, Executor, LateInteractionSide, Objective, PairLossForm, Tape, Trainer
from uform.batch import normalize_batch
from uform.config import normalize_trainer_config

HIDDEN = 128
TEXTS = ["a small red panda", "Red pandas eat bamboo."]


def tiny_config(**overrides):
    config = dict(
        depth=1,
        hidden=HIDDEN,
        batch=dict(max_rows_per_device=4, max_columns_per_row=64),
        objective=Objective.JOINT,
        schedule=dict(steps=10),
        seed=7,
    )
    config.update(overrides)
    return config


def pair_batch(**overrides):
    batch = dict(modalities=["text", "text"], contents=TEXTS, relations=dict(attract=Edges([0, 1, 2], [1, 0])))
    batch.update(overrides)
    return batch


@contextlib.contextmanager
def held(executor):
    """Keeps the executor's worker busy until the block ends: verbs submitted inside wait in its queue.

    At most 20 s, so a blocking verb inside the block, which would wait for the worker, fails late
    rather than hangs.
    """
    gate = threading.Event()
    executor._worker_thread().submit(lambda: gate.wait(20))
    try:
        yield
    finally:
        gate.set()


@pytest.fixture
def cpu():
    executor = Executor.for_ram(threads=2)
    yield executor
    executor.free()


@pytest.fixture
def trainer(cpu):
    trainer = Trainer.init_ram(cpu, tiny_config())
    yield trainer
    trainer.free()


@pytest.fixture
def encoder(cpu, tmp_path):
    """An encoder over an untrained checkpoint whose rows hold 64 columns."""
    checkpoint = tmp_path / "encoder.safetensors"
    with Trainer.init_ram(cpu, tiny_config()) as trainer:
        trainer.save(checkpoint)
    encoder = uform.Encoder.load(checkpoint, cpu)
    yield encoder
    encoder.free()


# ---------------------------------------------------------------------------------------------- #
#  Buffers are read when the verb runs                                                             #
# ---------------------------------------------------------------------------------------------- #


def tape_of(texts):
    data = np.frombuffer("".join(texts).encode(), np.uint8).copy()
    offsets = np.zeros(len(texts) + 1, np.uint64)
    np.cumsum([len(text.encode()) for text in texts], out=offsets[1:])
    return Tape(data, offsets)


def test_offsets_changed_while_a_step_waits_are_refused_when_it_runs(cpu, trainer):
    tape = tape_of(TEXTS)
    with held(cpu):
        waiting = trainer.deferred().step(pair_batch(contents=tape))  # Python's checks pass now
        tape.offsets[-1] = 10**9  # the caller's own array, which C reads when the step runs
    with pytest.raises(uform.InvalidArgument, match=r"^batch\.contents\.offsets.*past the tape's size"):
        waiting.wait()
    assert trainer.step(pair_batch()).stats.step == 1  # the refused step changed nothing


def test_contents_changed_while_a_step_waits_are_what_it_trains_on(cpu, trainer):
    later = ["a large red panda", "Red pandas eat apples."]  # the same lengths, so the offsets still fit
    tape = tape_of(TEXTS)
    with held(cpu):
        waiting = trainer.deferred().step(pair_batch(contents=tape))
        tape.data[:] = np.frombuffer("".join(later).encode(), np.uint8)
    with Trainer.init_ram(cpu, tiny_config()) as control:
        assert waiting.wait().stats.loss == control.step(pair_batch(contents=later)).stats.loss


# ---------------------------------------------------------------------------------------------- #
#  Arenas: one verb in flight at a time                                                            #
# ---------------------------------------------------------------------------------------------- #


def test_an_arena_serves_one_step_in_flight(cpu, trainer):
    arena = Arena()
    with held(cpu):
        first = trainer.deferred().step(pair_batch(), dict(arena=arena))
        second = trainer.deferred().step(pair_batch(), dict(arena=arena))
        with pytest.raises(uform.Busy, match=r"^config\.arena: .*each deferred verb in flight needs its own Arena"):
            second.wait()
        with pytest.raises(uform.Busy, match=r"^config\.arena:"):
            trainer.step(pair_batch(), dict(arena=arena))  # blocking verbs are refused alike, at once
        other = trainer.deferred().step(pair_batch(), dict(arena=Arena()))
    kept = first.wait().embeddings
    assert other.wait().stats.step == 2  # the refused steps never ran
    assert not np.array_equal(kept.numpy(), other.wait().embeddings.numpy())  # nothing wrote over the first
    assert trainer.step(pair_batch(), dict(arena=arena)).stats.step == 3  # released once the first landed
    refused = trainer.deferred().step(pair_batch(relations=dict(attract=Edges([0, 1, 2], [7, 0]))), dict(arena=arena))
    with pytest.raises(uform.InvalidArgument, match=r"batch\.relations\.attract"):
        refused.wait()
    assert trainer.step(pair_batch(), dict(arena=arena)).stats.step == 4  # and released after a failure


def test_an_arena_serves_one_embed_in_flight(cpu, encoder):
    arena = Arena()
    with held(cpu):
        first = encoder.deferred().embed(["text"] * 2, TEXTS, arena=arena)
        with pytest.raises(uform.Busy, match=r"^arena: .*needs its own Arena"):
            encoder.embed(["text"] * 2, TEXTS, arena=arena)
    assert first.wait().shape == (2, HIDDEN)
    assert encoder.embed(["text"] * 2, TEXTS, arena=arena).shape == (2, HIDDEN)


# ---------------------------------------------------------------------------------------------- #
#  What inference cuts, what steps count                                                           #
# ---------------------------------------------------------------------------------------------- #


def test_embed_counts_the_items_it_cut_to_the_row(trainer, encoder):
    head = "x" * 64  # the checkpoint's max_columns_per_row
    rows = encoder.embed(["text"] * 2, [head + "red panda", head + "bamboo"])
    assert rows.truncated_items == 2
    assert np.array_equal(rows.numpy()[0], rows.numpy()[1])  # cut at byte 64, the two read alike
    assert encoder.embed(["text"] * 2, TEXTS).truncated_items == 0
    assert "max_columns_per_row" in uform.Encoder.embed.__doc__
    assert trainer.step(pair_batch(), dict(arena=Arena())).embeddings.truncated_items is None  # Stats count those


def test_stats_count_what_each_term_scored(trainer):
    stats = trainer.step(pair_batch()).stats
    assert stats.masked_positions == stats["masked_positions"] > 0
    assert stats.contrastive_rows == stats["contrastive_rows"] == 2  # each item attracts the other
    assert "masked_positions" in uform.Stats.__doc__ and "contrastive_rows" in uform.Stats.__doc__


# ---------------------------------------------------------------------------------------------- #
#  Messages in the user's words                                                                    #
# ---------------------------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(depth=None), "config.depth: missing; "),
        (dict(hidden=None), "config.hidden: missing; the embedding width, a multiple of 128"),
        (dict(objective=None), "config.objective: missing; one of 'masked', 'contrastive', 'joint'"),
        (dict(schedule=dict()), "config.schedule.steps: missing; "),
        (dict(schedule=None), "config.schedule.steps: missing; "),
    ],
)
def test_a_missing_required_field_is_named_before_the_c_call(config, message):
    given = {key: value for key, value in tiny_config(**config).items() if value is not None}
    with pytest.raises(uform.InvalidArgument) as caught:
        normalize_trainer_config(given)
    assert str(caught.value).startswith(message), str(caught.value)


def test_zero_steps_are_said_to_be_missing_as_zero(cpu):
    with pytest.raises(uform.InvalidArgument, match=r"^config\.schedule\.steps: missing \(0 or absent\); "):
        Trainer.init_ram(cpu, tiny_config(schedule=dict(steps=0)))


def test_hidden_is_a_multiple_of_128_checked_in_python():
    with pytest.raises(uform.InvalidArgument, match=r"^config\.hidden: 200 is not a multiple of 128$"):
        normalize_trainer_config(tiny_config(hidden=200))
    hidden = next(f for f in uform.TrainerConfig.__dataclass_fields__.values() if f.name == "hidden")
    assert "multiple of 128" in hidden.metadata["doc"]


def test_integer_enums_take_their_names_in_any_case():
    for given in ("ranked", "RANKED", "Ranked", PairLossForm.RANKED, 2):
        normalized = normalize_trainer_config(tiny_config(contrastive=dict(pair_loss=given)))
        assert normalized["contrastive"]["pair_loss"] == 2
    sides = normalize_batch(pair_batch(sides=["query", "DOCUMENT"]))["sides"]
    assert sides.tolist() == [LateInteractionSide.QUERY, LateInteractionSide.DOCUMENT]
    with pytest.raises(uform.InvalidArgument) as caught:
        normalize_trainer_config(tiny_config(contrastive=dict(pair_loss="rank")))
    assert str(caught.value) == (
        "config.contrastive.pair_loss: 'rank' is not a PairLossForm (one of 'derived', 'balanced', 'ranked', 'sigmoid')"
    )
    with pytest.raises(uform.InvalidArgument, match=r"^batch\.sides\[1\]: 'side' is not a LateInteractionSide "
                                                    r"\(one of 'none', 'query', 'document', 'query_and_document'\)$"):
        normalize_batch(pair_batch(sides=["none", "side"]))


def test_refusals_take_a_or_an_by_the_sound_of_the_name():
    with pytest.raises(uform.InvalidArgument) as caught:
        normalize_trainer_config(tiny_config(objective="x"))
    assert str(caught.value) == "config.objective: 'x' is not an Objective (one of 'masked', 'contrastive', 'joint')"
    with pytest.raises(uform.InvalidArgument, match=r"^config\.batch\.image: expected an ImageShape or a dict, got int$"):
        normalize_trainer_config(tiny_config(batch=dict(image=3)))
    with pytest.raises(uform.InvalidArgument, match=r"^config\.batch: expected a BatchShape or a dict, got int$"):
        normalize_trainer_config(tiny_config(batch=3))
    assert [uform.config.article(noun) for noun in ("Objective", "Edges", "Modality", "ImageShape", "")] == [
        "an Objective", "an Edges", "a Modality", "an ImageShape", "a "]


def test_lone_surrogates_name_their_field(cpu, trainer, encoder, tmp_path):
    with pytest.raises(uform.InvalidArgument, match=r"^batch\.contents\[1\]: not encodable as UTF-8"):
        trainer.step(pair_batch(contents=["fine", "bad \ud800"]))
    with pytest.raises(uform.InvalidArgument, match=r"^contents\[0\]: not encodable as UTF-8"):
        encoder.embed(["text"], ["\ud800"])
    with pytest.raises(uform.InvalidArgument, match=r"^path: .* cannot be encoded as a file name"):
        trainer.save(str(tmp_path / "\ud800.safetensors"))
    with pytest.raises(uform.InvalidArgument, match=r"^config\.resume: "):
        Trainer.init_ram(cpu, tiny_config(resume="\ud800"))
    assert trainer.step(pair_batch()).stats.step == 1


def test_embed_names_its_own_arguments(encoder):
    with pytest.raises(uform.InvalidArgument) as caught:
        encoder.embed(["text"], ["x"], scalar="f64")
    assert str(caught.value) == "scalar: 'f64' is not a Scalar (one of 'f32', 'f16', 'bf16', 'i8')"
    with pytest.raises(uform.InvalidArgument, match=r"^arena: expected a uform\.Arena"):
        encoder.embed(["text"], ["x"], arena=bytearray(64))
    assert encoder.embed(["text"], ["x"], scalar="BF16").scalar is uform.Scalar.BF16


def test_numpy_arrays_of_str_are_texts(cpu, encoder):
    texts = np.array(TEXTS)
    assert texts.dtype.kind == "U"
    assert np.array_equal(encoder.embed(["text"] * 2, texts).numpy(), encoder.embed(["text"] * 2, TEXTS).numpy())
    losses = []
    for contents in (texts, TEXTS):
        with Trainer.init_ram(cpu, tiny_config()) as trainer:
            losses.append(trainer.step(pair_batch(contents=contents)).stats.loss)
    assert losses[0] == losses[1]
    with pytest.raises(uform.InvalidArgument, match=r"^tape\.data: a numpy array of str"):
        Tape(texts, [0, 4, 8])  # its buffer is code points, four bytes each, never UTF-8


def test_the_derived_batch_shape_is_documented():
    for doc in (uform.TrainerConfig.__doc__, uform.BatchShape.__doc__):
        assert "64 rows of 512 columns" in doc


# ---------------------------------------------------------------------------------------------- #
#  The worker: submission order, and no waiting on itself                                          #
# ---------------------------------------------------------------------------------------------- #


def test_verbs_submitted_from_the_worker_queue_in_submission_order(cpu, trainer):
    seen = {}
    called = threading.Event()

    def on_done(_):  # runs on the worker, right after the first step lands
        seen["inner"] = trainer.deferred().step(pair_batch())
        seen["inner ran at once"] = seen["inner"].done()
        called.set()

    with held(cpu):
        first = trainer.deferred().step(pair_batch())
        first._future.add_done_callback(on_done)
        between = trainer.deferred().step(pair_batch())  # submitted before the callback's step
    assert called.wait(60)
    assert seen["inner ran at once"] is False
    assert [first.wait().stats.step, between.wait().stats.step, seen["inner"].wait().stats.step] == [1, 2, 3]


def test_a_blocking_verb_on_the_worker_raises_busy(cpu, trainer):
    arena = Arena()
    seen = {}
    called = threading.Event()

    def on_done(_):
        try:
            trainer.step(pair_batch(), dict(arena=arena))
        except uform.Busy as error:
            seen["error"] = error
        called.set()

    with held(cpu):
        first = trainer.deferred().step(pair_batch())
        first._future.add_done_callback(on_done)
    assert called.wait(60)
    assert "deferred()" in str(seen.get("error", ""))
    assert trainer.step(pair_batch(), dict(arena=arena)).stats.step == 2  # the refusal claimed nothing, ran nothing


def test_waiting_on_the_worker_for_a_verb_queued_behind_raises_busy(cpu, trainer):
    seen = {}
    called = threading.Event()

    def on_done(_):
        try:
            trainer.deferred().step(pair_batch()).wait(timeout=30)
        except uform.Busy as error:
            seen["error"] = error
        called.set()

    with held(cpu):
        first = trainer.deferred().step(pair_batch())
        first._future.add_done_callback(on_done)
    assert called.wait(60)
    assert "own worker thread" in str(seen.get("error", ""))  # at once, not after the timeout


# ---------------------------------------------------------------------------------------------- #
#  The package's modules                                                                           #
# ---------------------------------------------------------------------------------------------- #


def test_the_modules_import_one_another_without_a_cycle():
    folder = pathlib.Path(uform.__file__).parent
    imports = {}
    for source in folder.glob("*.py"):
        tree = ast.parse(source.read_text())
        imports[source.stem] = {node.module for node in ast.walk(tree)
                                if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module}
    imports.pop("__init__")

    def reaches(start, goal, path=()):
        return any(name == goal or (name not in path and reaches(name, goal, path + (name,)))
                   for name in imports.get(start, ()))

    assert [name for name in imports if reaches(name, name)] == []
