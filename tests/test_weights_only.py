"""Weights-only checkpoints, for release, and the encoder that holds the weights alone; and the note a
caller keeps in either kind of checkpoint.

`save(path, weights_only=True)` writes the weights, the step and the config without AdamW's moments: a
third of the file, read by `safetensors` and by `Encoder.load`, refused by `resume`. An encoder of either
kind of file embeds bit for bit alike, and takes the weights and one pass's activations, not a trainer's
moments, gradients and saved activations.

`save(path, note=...)` stores text as `__metadata__.note`, escaped into the header, and
`uform.checkpoint_note(path)` reads it back byte for byte, as `safetensors` does. A noted checkpoint
resumes and loads as one without; a note the library cannot store is refused by name and leaves the
previous file as it was.
"""
import json
import os
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy

import uform

TEXT = uform.Modality.TEXT
TINY = dict(depth=1, hidden=128, objective=uform.Objective.JOINT, seed=5, schedule=dict(steps=100),
            batch=dict(max_rows_per_device=4, max_columns_per_row=32, max_segments_per_device=8))
ITEMS = ["a small red panda", "Red pandas eat bamboo.", "x", "y" * 100, "the cat sat on the mat"] * 5


def pairs():
    return dict(modalities=[TEXT] * 4, contents=["red panda", "bamboo", "a cat", "a mat"],
                relations=dict(attract=uform.Edges(offsets=[0, 1, 2, 3, 4], ids=[1, 0, 3, 2])))


@pytest.fixture(scope="module")
def cpu():
    with uform.Executor.for_ram(threads=2) as executor:
        yield executor


@pytest.fixture(scope="module")
def saved(cpu, tmp_path_factory):
    """The same run after three steps, saved whole and weights-only."""
    folder = tmp_path_factory.mktemp("saved")
    whole, weights = str(folder / "whole.safetensors"), str(folder / "weights.safetensors")
    with uform.Trainer.init_ram(cpu, TINY) as trainer:
        for _ in range(3):
            trainer.step(pairs())
        trainer.save(whole)
        trainer.save(weights, weights_only=True)
    return whole, weights


def metadata(path):
    with safetensors.safe_open(path, framework="numpy") as file:
        return file.metadata()


def rewrite(source, destination, metadata=None, extra=None):
    """`source` with its `__metadata__` updated by `metadata` and the tensors of `extra` ({name: float32 array}) added."""
    with open(source, "rb") as file:
        whole = file.read()
    (length,) = struct.unpack("<Q", whole[:8])
    header, data = json.loads(whole[8:8 + length]), whole[8 + length:]
    header["__metadata__"].update(metadata or {})
    for name, values in (extra or {}).items():
        values = np.asarray(values, np.float32)
        header[name] = dict(dtype="F32", shape=list(values.shape), data_offsets=[len(data), len(data) + values.nbytes])
        data += values.tobytes()
    text = json.dumps(header).encode()
    with open(destination, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text + data)
    return str(destination)


# ---------------------------------------------------------------------------------------------- #
#  The file                                                                                        #
# ---------------------------------------------------------------------------------------------- #


def test_a_weights_only_file_holds_the_weights_alone(saved):
    whole, weights = saved
    assert abs(os.path.getsize(weights) / os.path.getsize(whole) - 1 / 3) < 0.01
    everything, kept = safetensors.numpy.load_file(whole), safetensors.numpy.load_file(weights)
    assert not any(name.startswith("adamw.") for name in kept)
    assert set(kept) == {name for name in everything if not name.startswith("adamw.")}
    for name, values in kept.items():
        assert values.dtype == np.float32 and values.tobytes() == everything[name].tobytes(), name
    # The metadata says what the file is; the step and the config are the whole checkpoint's.
    assert metadata(weights) == dict(metadata(whole), weights_only="true")
    assert metadata(weights)["step"] == "3"


def test_an_encoder_embeds_either_file_bit_for_bit_alike(cpu, saved):
    whole, weights = saved
    with uform.Encoder.load(whole, cpu) as first, uform.Encoder.load(weights, cpu) as second:
        assert first.hidden == second.hidden == 128
        for scalar in uform.Scalar:
            # 25 items of up to 100 bytes take several passes through the encoder's rows.
            expected = np.array(first.embed([TEXT] * len(ITEMS), ITEMS, scalar=scalar))
            assert np.array(second.embed([TEXT] * len(ITEMS), ITEMS, scalar=scalar)).tobytes() == expected.tobytes()
        deferred = second.deferred().embed([TEXT] * 2, ITEMS[:2]).wait()
        assert np.array(deferred).tobytes() == np.array(first.embed([TEXT] * 2, ITEMS[:2])).tobytes()


def test_resume_refuses_a_weights_only_file(cpu, saved):
    whole, weights = saved
    with pytest.raises(uform.InvalidCheckpoint,
                       match=r"^resume: .*weights\.safetensors is a weights-only checkpoint: it holds no optimizer "
                             r"moments, so no run resumes from it; resume from a whole checkpoint .*Encoder\.load"):
        uform.Trainer.init_ram(cpu, dict(TINY, resume=weights))
    with uform.Trainer.init_ram(cpu, dict(TINY, resume=whole)) as trainer:  # the whole one still resumes
        assert trainer.step(pairs()).stats.step == 4


async def test_deferred_save_of_the_weights_alone(cpu, tmp_path):
    path = tmp_path / "deferred.safetensors"
    with uform.Trainer.init_ram(cpu, TINY) as trainer:
        deferred = trainer.deferred()
        steps = [deferred.step(pairs()) for _ in range(2)]
        assert await deferred.save(path, weights_only=True) is None
        assert all(step.done() for step in steps)  # it landed after the steps submitted before it
        assert deferred.save(path, weights_only=True).wait() is None
        weights = trainer._weights()
    assert metadata(str(path))["weights_only"] == "true" and metadata(str(path))["step"] == "2"
    assert not any(name.startswith("adamw.") for name in safetensors.numpy.load_file(str(path)))
    kept = np.concatenate([t.ravel() for t in safetensors.numpy.load_file(str(path)).values()])
    assert np.array_equal(np.sort(kept[kept != 0]), np.sort(weights[weights != 0]))


def test_bad_destinations_are_refused_as_by_save(cpu, tmp_path):
    with uform.Trainer.init_ram(cpu, TINY) as trainer:
        trainer.step(pairs())
        path = tmp_path / "kept.safetensors"
        trainer.save(path, weights_only=True)
        before = path.read_bytes()
        missing = tmp_path / "no" / "such" / "folder" / "weights.safetensors"
        for weights_only in (False, True):
            with pytest.raises(uform.StorageError, match=r"^path: cannot write .*folder.*No such file"):
                trainer.save(missing, weights_only=weights_only)
            for folder in (str(tmp_path) + "/", str(tmp_path), tmp_path):
                with pytest.raises(uform.InvalidArgument, match=r"^path: .* names a folder, not a file"):
                    trainer.save(folder, weights_only=weights_only)
            with pytest.raises(uform.InvalidArgument, match=r"^path: expected a path, got int"):
                trainer.save(7, weights_only=weights_only)
            with pytest.raises(uform.StorageError, match=r"^path: cannot write"):
                trainer.deferred().save(missing, weights_only=weights_only).wait()
        for wrong in ("yes", 1, 0.0):
            with pytest.raises(uform.InvalidArgument, match=r"^weights_only: expected True or False"):
                trainer.save(path, weights_only=wrong)
            with pytest.raises(uform.InvalidArgument, match=r"^weights_only: expected True or False"):
                trainer.deferred().save(path, weights_only=wrong).wait()
        assert path.read_bytes() == before  # every refusal left the last file as it was
        assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.safetensors"]  # and no temporary file
        trainer.save(path, weights_only=np.bool_(True))
        assert metadata(str(path))["weights_only"] == "true"
        trainer.save(path, weights_only=None)  # absent, as everywhere: the whole checkpoint
        assert "weights_only" not in metadata(str(path))
    with pytest.raises(uform.InvalidHandle, match=r"^trainer: used after free\(\)"):
        trainer.save(path, weights_only=True)


# ---------------------------------------------------------------------------------------------- #
#  Files that lie about their kind                                                                 #
# ---------------------------------------------------------------------------------------------- #


def test_the_mark_and_the_tensors_must_agree(cpu, saved, tmp_path):
    whole, weights = saved
    # Marked weights-only, yet holding a moment.
    path = rewrite(weights, tmp_path / "moment.safetensors", extra={"adamw.first.final_norm": np.zeros(128)})
    for load in (lambda: uform.Encoder.load(path, cpu), lambda: uform.Trainer.init_ram(cpu, dict(TINY, resume=path))):
        with pytest.raises(uform.InvalidCheckpoint, match=r"weights_only|weights-only"):
            load()
    with pytest.raises(uform.InvalidCheckpoint,
                       match=r'^path: .* says __metadata__\.weights_only is "true" yet holds the moment adamw\.first\.final_norm'):
        uform.Encoder.load(path, cpu)
    # Marked whole ("false", as a hand-edited file may say), yet without the moments.
    path = rewrite(weights, tmp_path / "false.safetensors", metadata=dict(weights_only="false"))
    with pytest.raises(uform.InvalidCheckpoint, match=r"lacks the tensor adamw\.first\.text\.embedding"):
        uform.Encoder.load(path, cpu)
    # A mark that is neither.
    path = rewrite(whole, tmp_path / "yes.safetensors", metadata=dict(weights_only="yes"))
    for load in (lambda: uform.Encoder.load(path, cpu), lambda: uform.Trainer.init_ram(cpu, dict(TINY, resume=path))):
        with pytest.raises(uform.InvalidCheckpoint, match=r'__metadata__\.weights_only "yes" is neither "true" nor "false"'):
            load()
    # A whole file that says "false" is what it always was.
    path = rewrite(whole, tmp_path / "whole.safetensors", metadata=dict(weights_only="false"))
    with uform.Trainer.init_ram(cpu, dict(TINY, resume=path)) as trainer:
        assert trainer.step(pairs()).stats.step == 4


# ---------------------------------------------------------------------------------------------- #
#  Memory                                                                                          #
# ---------------------------------------------------------------------------------------------- #


def test_an_encoder_holds_the_weights_and_one_pass(cpu, tmp_path):
    """Counted as the bytes of the buffers each takes from the backend (the backend's own scratch aside):
    at the same geometry an encoder takes a fraction of a trainer, and a deeper model costs it the weights
    of its extra blocks and nothing more, where a trainer also keeps every block's activations."""
    taken = {}
    for depth in (1, 4):
        path = tmp_path / f"depth{depth}.safetensors"
        config = dict(TINY, depth=depth, batch=dict(max_rows_per_device=8, max_columns_per_row=64))
        with uform.Trainer.init_ram(cpu, config) as trainer:
            trainer.save(path, weights_only=True)
            parameters, trained = trainer._handle().parameters(), trainer._handle().memory()
        with uform.Encoder.load(path, cpu) as encoder:
            taken[depth] = parameters, trained, encoder._handle().memory()
    (shallow, _, shallow_encoder), (deep, deep_trainer, deep_encoder) = taken[1], taken[4]
    assert deep_encoder < deep_trainer / 3  # at hidden 128 the media projections and decoders weigh as much as 4 blocks
    assert deep_encoder - shallow_encoder == 4 * (deep - shallow)  # float32 weights on the CPU, nothing per block


# ---------------------------------------------------------------------------------------------- #
#  Notes                                                                                           #
# ---------------------------------------------------------------------------------------------- #

# Quotes, backslashes, newlines and every other control character, non-ASCII, a line separator that
# JavaScript once refused, a character past the Basic Multilingual Plane, and JSON inside the text.
NOTE = ('{"cursor": {"shard": 2}, "path": "C:\\\\runs\\\\a \\"b\\""}\n\ttab\r' + "".join(map(chr, range(1, 32)))
        + "\x7f café 東京 \u2028 😀 \\u0041 /")


@pytest.fixture(scope="module")
def notes(cpu, tmp_path_factory):
    """One run after two steps, saved whole and weights-only, each with and without the note."""
    folder = tmp_path_factory.mktemp("notes")
    paths = {name: str(folder / f"{name}.safetensors") for name in ("plain", "noted", "weights", "noted_weights")}
    with uform.Trainer.init_ram(cpu, TINY) as trainer:
        for _ in range(2):
            trainer.step(pairs())
        trainer.save(paths["plain"])
        trainer.save(paths["noted"], note=NOTE)
        trainer.save(paths["weights"], weights_only=True)
        trainer.deferred().save(paths["noted_weights"], weights_only=True, note=NOTE).wait()
    return paths


def test_the_note_reads_back_whole_through_uform_and_safetensors(notes):
    for plain, noted in ((notes["plain"], notes["noted"]), (notes["weights"], notes["noted_weights"])):
        assert uform.checkpoint_note(noted) == NOTE
        assert metadata(noted) == dict(metadata(plain), note=NOTE)  # the note is all that differs
        assert uform.checkpoint_note(plain) is None and "note" not in metadata(plain)
        whole, kept = safetensors.numpy.load_file(plain), safetensors.numpy.load_file(noted)
        assert kept.keys() == whole.keys()
        assert all(kept[name].tobytes() == whole[name].tobytes() for name in whole)


def test_an_empty_note_is_none_and_the_longest_fits(cpu, tmp_path):
    path = str(tmp_path / "run.safetensors")
    longest = "é" * (2**19 - 1) + "xy"  # 2^20 bytes of UTF-8
    with uform.Trainer.init_ram(cpu, TINY) as trainer:
        trainer.save(path, note="")
        assert uform.checkpoint_note(path) is None and "note" not in metadata(path)
        trainer.save(path, note=longest)
    assert uform.checkpoint_note(path) == longest and metadata(path)["note"] == longest


def test_a_noted_checkpoint_resumes_and_loads_as_one_without(cpu, notes):
    def resumed(path):
        with uform.Trainer.init_ram(cpu, dict(TINY, resume=path)) as trainer:
            assert trainer.step(pairs()).stats.step == 3
            return trainer._weights()

    assert resumed(notes["noted"]).tobytes() == resumed(notes["plain"]).tobytes()
    items = ["a small red panda", "bamboo", "x" * 40]
    expected = None
    for name in ("plain", "noted", "weights", "noted_weights"):
        with uform.Encoder.load(notes[name], cpu) as encoder:
            embedded = np.array(encoder.embed([TEXT] * len(items), items)).tobytes()
        expected = expected or embedded
        assert embedded == expected, name


@pytest.mark.parametrize("note, message", [
    ("x" * (2**20 + 1), r"^note: 1048577 bytes, over the 1048576 a checkpoint holds$"),
    ("é" * 2**19 + "x", r"^note: 1048577 bytes, over the 1048576"),
    ("before\0after", r"^note: a NUL character at 6"),
    ("lone \ud800 surrogate", r"^note: not encodable as UTF-8 \(surrogates not allowed at 5\)$"),
    (b"bytes", r"^note: expected a str or None, got bytes$"),
    (3, r"^note: expected a str or None, got int$"),
])
def test_a_note_the_library_cannot_store_is_refused_by_name(cpu, tmp_path, note, message):
    path = str(tmp_path / "kept.safetensors")
    with uform.Trainer.init_ram(cpu, TINY) as trainer:
        trainer.save(path, note="the old one")
        trainer.step(pairs())
        for weights_only in (False, True):
            with pytest.raises(uform.InvalidArgument, match=message):
                trainer.save(path, weights_only=weights_only, note=note)
            with pytest.raises(uform.InvalidArgument, match=message):
                trainer.deferred().save(path, weights_only=weights_only, note=note).wait()
    assert uform.checkpoint_note(path) == "the old one" and metadata(path)["step"] == "0"


def test_the_reader_decodes_any_writers_escapes_and_checks_the_file(notes, tmp_path):
    """The header rewritten with every non-ASCII character escaped, surrogate pairs included, reads as the
    same note; a file that is no checkpoint is refused as `Encoder.load` refuses it."""
    with open(notes["noted"], "rb") as file:
        whole = file.read()
    (length,) = struct.unpack("<Q", whole[:8])
    header = json.dumps(json.loads(whole[8:8 + length])).encode()
    assert b"\\ud83d\\ude00" in header and b"\\u2028" in header
    path = tmp_path / "other.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + whole[8 + length:])
    assert uform.checkpoint_note(path) == NOTE
    with open(path, "r+b") as file:
        file.write(b"\xff" * 8)
    with pytest.raises(uform.InvalidCheckpoint, match=r"^path: .*other\.safetensors claims a header of"):
        uform.checkpoint_note(path)
    with pytest.raises(uform.StorageError, match=r"^path: cannot open .*missing\.safetensors"):
        uform.checkpoint_note(tmp_path / "missing.safetensors")
