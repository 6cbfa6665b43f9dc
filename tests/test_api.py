"""The Python surface: configs as dataclasses and dicts, enums, errors, lifetimes, stats, rows, tapes.

Every test trains a tiny model (depth 1, hidden 128, 4 rows of 32 columns) on the RAM executor,
so each one takes milliseconds.
"""

import dataclasses
import math
import os
import pathlib
import re
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import safetensors.numpy

import uform
from uform import (
    Arena,
    BatchShape,
    Contrastive,
    Edges,
    Executor,
    LateInteractionSide,
    Mesh,
    Modality,
    Negatives,
    Objective,
    PairLossForm,
    Scalar,
    Schedule,
    Tape,
    Trainer,
    TrainerBatch,
    TrainerConfig,
    TrainerStepConfig,
    _native,
)
from uform.config import normalize_trainer_config

HIDDEN = 128


def tiny_config(**overrides):
    config = dict(
        depth=1,
        hidden=HIDDEN,
        batch=dict(max_rows_per_device=4, max_columns_per_row=32),
        objective=Objective.JOINT,
        schedule=dict(steps=10),
        seed=7,
    )
    config.update(overrides)
    return config


def pair_batch(**overrides):
    batch = dict(
        modalities=[Modality.TEXT, Modality.TEXT],
        contents=["a small red panda", "Red pandas eat bamboo."],
        relations=dict(attract=Edges(offsets=[0, 1, 2], ids=[1, 0])),
    )
    batch.update(overrides)
    return batch


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


# ---------------------------------------------------------------------------------------------- #
#  Version, capabilities, enums                                                                    #
# ---------------------------------------------------------------------------------------------- #


def test_version_and_capabilities():
    assert re.fullmatch(r"\d+\.\d+\.\d+", uform.__version__)
    assert uform.__version__ == _native.version()
    capabilities = uform.capabilities()
    assert isinstance(capabilities, set)
    assert {"ram", "mesh"} <= capabilities  # meshes of several processes join RAM executors in every build
    formats = {"jpeg", "png", "webp", "wav", "flac", "mp3", "ogg", "mp4", "webm", "mkv"}
    assert capabilities <= {"ram", "vram", "mesh"} | formats


@pytest.mark.parametrize("chosen, spin_count", [({}, "0"), (dict(OMP_WAIT_POLICY="active"), "30000000000"),
                                                  (dict(GOMP_SPINCOUNT="1000"), "1000")])
def test_openmp_workers_sleep_at_once_unless_the_user_chose(chosen, spin_count, tmp_path):
    # libgomp reads the policy once, as it loads: a fresh process each, where OMP_DISPLAY_ENV has it say
    # what it read. The choice is uform's for that load only, so the environment stays the user's.
    env = {name: value for name, value in os.environ.items() if name not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(chosen, OMP_DISPLAY_ENV="verbose", PYTHONPATH=os.path.dirname(os.path.dirname(uform.__file__)))
    run = subprocess.run([sys.executable, "-c", "import os, uform; print(os.environ.get('OMP_WAIT_POLICY'))"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert run.returncode == 0, run.stderr
    assert f"GOMP_SPINCOUNT = '{spin_count}'" in run.stderr
    assert run.stdout.strip() == chosen.get("OMP_WAIT_POLICY", "None")


def test_enums_match_the_c_library():
    assert [m.value for m in Modality] == ["text", "image", "video", "audio"]
    assert [o.value for o in Objective] == ["masked", "contrastive", "joint"]
    assert [n.value for n in Negatives] == ["ambient", "named"]
    assert Modality("text") is Modality.TEXT and Modality.TEXT == "text"
    # Integer enums carry the C library's own numbers.
    assert {m.name.lower(): m.value for m in PairLossForm} == _native.C_ENUMS["pair_loss_form"]
    assert {m.name.lower(): m.value for m in LateInteractionSide} == _native.C_ENUMS["late_interaction_side"]
    assert (PairLossForm.DERIVED, PairLossForm.SIGMOID) == (0, 3)
    assert (LateInteractionSide.NONE, LateInteractionSide.QUERY_AND_DOCUMENT) == (0, 3)
    assert {s.value for s in Scalar} == set(_native.C_ENUMS["scalar"])
    # Python's string values map onto the C values, which differ from positions.
    assert _native.C_ENUMS["modality"]["text"] == 1
    assert _native.C_ENUMS["objective"]["joint"] == 3
    assert _native.C_ENUMS["negatives"]["named"] == 2


def test_enum_fields_take_members_or_values():
    by_member = normalize_trainer_config(tiny_config(objective=Objective.CONTRASTIVE, contrastive=dict(
        negatives=Negatives.NAMED, pair_loss=PairLossForm.BALANCED)))
    by_value = normalize_trainer_config(tiny_config(objective="contrastive", contrastive=dict(
        negatives="named", pair_loss=1)))
    assert by_member == by_value
    assert by_member["objective"] == _native.C_ENUMS["objective"]["contrastive"]
    assert by_member["contrastive"]["negatives"] == _native.C_ENUMS["negatives"]["named"]
    assert by_member["contrastive"]["pair_loss"] == 1


# ---------------------------------------------------------------------------------------------- #
#  Errors                                                                                          #
# ---------------------------------------------------------------------------------------------- #


def test_error_hierarchy():
    expected = {
        uform.InvalidArgument: ValueError,
        uform.InvalidHandle: RuntimeError,
        uform.Busy: RuntimeError,
        uform.Unsupported: NotImplementedError,
        uform.OutOfMemory: MemoryError,
        uform.StorageError: OSError,
    }
    for error, builtin in expected.items():
        assert issubclass(error, uform.Error) and issubclass(error, builtin)
    assert issubclass(uform.InvalidCheckpoint, uform.InvalidArgument)
    assert issubclass(uform.Error, Exception)
    assert uform.InvalidArgument.__module__ == "uform"


def test_c_errors_raise_the_matching_class_with_the_c_message(cpu):
    with pytest.raises(uform.InvalidArgument, match=r"^config\.hidden: 200\b") as caught:
        Trainer.init_ram(cpu, tiny_config(hidden=200))
    assert isinstance(caught.value, ValueError)
    with pytest.raises(uform.InvalidArgument, match=r"config\.schedule\.steps"):
        Trainer.init_ram(cpu, tiny_config(schedule=dict()))


@pytest.mark.skipif("vram" in uform.capabilities(), reason="this build has a CUDA backend")
def test_for_vram_is_unsupported_without_cuda(cpu):
    with pytest.raises(uform.Unsupported) as caught:
        Executor.for_vram()
    assert isinstance(caught.value, NotImplementedError)
    assert str(caught.value)  # the C library's message, not an empty one
    with pytest.raises(uform.Unsupported):
        Executor.for_vram([0])
    with pytest.raises(uform.InvalidArgument, match=r"^executor: a RAM executor"):  # as uform.h promises
        Trainer.init_vram(cpu, tiny_config())


def test_for_ram_takes_zero_threads_for_every_core_as_absent_does(cpu):
    # uform.h: 0 uses every core. The CPU backend's reductions do not depend on the threads, so each trains alike.
    with Executor.for_ram(threads=0) as every, Executor.for_ram() as absent:
        losses = []
        for executor in (every, absent, cpu):
            with Trainer.init_ram(executor, tiny_config()) as trainer:
                losses.append(trainer.step(pair_batch()).stats.loss)
    assert losses[0] == losses[1] == losses[2]
    with pytest.raises(uform.InvalidArgument, match=r"^threads: 1025 is over 1024$"):
        Executor.for_ram(threads=1025)


def test_save_to_a_missing_folder_is_a_storage_error(trainer, tmp_path):
    missing = tmp_path / "no" / "such" / "folder" / "checkpoint.safetensors"
    with pytest.raises(uform.StorageError) as caught:
        trainer.save(missing)
    assert isinstance(caught.value, OSError)
    assert "folder" in str(caught.value)


# ---------------------------------------------------------------------------------------------- #
#  Configs: dataclasses and dicts                                                                  #
# ---------------------------------------------------------------------------------------------- #


def test_dataclass_and_dict_configs_are_equivalent(cpu):
    as_dataclass = TrainerConfig(
        depth=1,
        hidden=HIDDEN,
        batch=BatchShape(max_rows_per_device=4, max_columns_per_row=32),
        objective=Objective.JOINT,
        schedule=Schedule(steps=10, learning_rate=2e-3),
        contrastive=Contrastive(temperature_groups=2, matryoshka_dimensions=[64, 128]),
        seed=7,
    )
    as_dict = tiny_config(
        schedule=dict(steps=10, learning_rate=2e-3),
        contrastive=dict(temperature_groups=2, matryoshka_dimensions=np.array([64, 128], np.uint32)),
    )
    mixed = tiny_config(
        batch=dict(max_rows_per_device=4, max_columns_per_row=32, image=uform.ImageShape()),
        schedule=Schedule(steps=10, learning_rate=2e-3),
        contrastive=dict(temperature_groups=2, matryoshka_dimensions=(64, 128)),
    )
    normalized = [normalize_trainer_config(config) for config in (as_dataclass, as_dict, mixed)]
    dimensions = [n["contrastive"].pop("matryoshka_dimensions") for n in normalized]
    assert normalized[0] == normalized[1] == normalized[2]
    for d in dimensions:
        assert d.dtype == np.uint32 and d.tolist() == [64, 128]

    # The same config, either way, trains the same numbers.
    batch = pair_batch(temperature_groups=[0, 1])
    losses, weights = [], []
    for config in (as_dataclass, as_dict):
        with Trainer.init_ram(cpu, config) as trainer:
            losses.append([trainer.step(batch).stats.loss for _ in range(2)])
            weights.append(trainer._weights())
    assert losses[0] == losses[1]
    assert np.array_equal(weights[0], weights[1])
    assert not math.isnan(losses[0][0])


def test_absent_and_none_fields_derive():
    fields = {f.name for f in dataclasses.fields(Contrastive)}
    assert all(getattr(Contrastive(), name) is None for name in fields)
    with_none = normalize_trainer_config(tiny_config(masking=dict(text_weight=None), contrastive=None))
    without = normalize_trainer_config(tiny_config())
    assert with_none == without
    assert without["masking"]["text_weight"] == 0.0
    assert without["contrastive"]["negatives"] == 0
    assert without["resume"] is None


@pytest.mark.parametrize(
    "config, message",
    [
        (tiny_config(batch=dict(max_rowz=4)), "config.batch.max_rowz: unknown field (did you mean max_rows_per_device?)"),
        (tiny_config(depht=1), "config.depht: unknown field (did you mean depth?)"),
        (tiny_config(schedule=dict(steps=10, warmup=3)), "config.schedule.warmup: unknown field (did you mean warmup_steps?)"),
        (tiny_config(batch=dict(image=dict(patch=16))), "config.batch.image.patch: unknown field (did you mean patch_side?)"),
        (tiny_config(contrastive=dict(negative="named")), "config.contrastive.negative: unknown field (did you mean negatives?)"),
    ],
)
def test_unknown_keys_name_their_full_path(cpu, config, message):
    with pytest.raises(uform.InvalidArgument) as caught:
        Trainer.init_ram(cpu, config)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(depth=-1), "config.depth"),
        (dict(depth="1"), "config.depth"),
        (dict(depth=1.0), "config.depth"),
        (dict(depth=True), "config.depth"),
        (dict(hidden=2**32), "config.hidden"),
        (dict(seed=2**64), "config.seed"),
        (dict(seed=-1), "config.seed"),
        (dict(objective="jiont"), "config.objective"),
        (dict(objective=Modality.TEXT), "config.objective"),
        (dict(schedule=dict(steps=10, learning_rate="fast")), "config.schedule.learning_rate"),
        (dict(schedule=dict(steps=-10)), "config.schedule.steps"),
        (dict(contrastive=dict(pair_loss=9)), "config.contrastive.pair_loss"),
        (dict(contrastive=dict(matryoshka_dimensions=[64, -1])), "config.contrastive.matryoshka_dimensions[1]"),
        (dict(contrastive=dict(matryoshka_dimensions=[64, 32, 64])), "config.contrastive.matryoshka_dimensions[2]"),
        (dict(batch=[4, 32]), "config.batch"),
        (dict(resume=42), "config.resume"),
    ],
)
def test_wrong_types_name_the_field(cpu, overrides, field):
    with pytest.raises(uform.InvalidArgument) as caught:
        Trainer.init_ram(cpu, tiny_config(**overrides))
    assert str(caught.value).startswith(field + ":"), str(caught.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        # A NaN prints as nan whatever its sign bit, as C's printf would not.
        (dict(schedule=dict(steps=10, learning_rate=float("nan"))), "config.schedule.learning_rate: nan is not in [0, 1]"),
        (dict(schedule=dict(steps=10, learning_rate=-float("nan"))), "config.schedule.learning_rate: nan is not in [0, 1]"),
        (dict(resume=""), "config.resume: empty; leave it NULL (None in Python) to start a new run"),
        (dict(batch=dict(max_rows_per_device=600, max_columns_per_row=16)),
         "config.batch.max_segments_per_device: 4800 is over 4096 (derived as 8 per row: give it, 4096 or fewer)"),
        (dict(batch=dict(max_rows_per_device=600, max_columns_per_row=16, max_segments_per_device=5000)),
         "config.batch.max_segments_per_device: 5000 is over 4096"),
        (dict(batch=dict(max_columns_per_row=16), masking=dict(token_mean_span=17)),
         "config.masking.token_mean_span: 17 is over config.batch.max_columns_per_row = 16, so spans would be cut "
         "at items' ends and fewer positions chosen than token_mask_probability"),
    ],
)
def test_values_the_c_library_refuses_are_worded_exactly(cpu, overrides, message):
    with pytest.raises(uform.InvalidArgument) as caught:
        Trainer.init_ram(cpu, tiny_config(**overrides))
    assert str(caught.value) == message


def test_a_real_too_small_for_float32_is_refused_not_defaulted(cpu):
    """1e-50 would reach C as 0, which derives the default: a learning rate 47 orders of magnitude off."""
    with pytest.raises(uform.InvalidArgument, match=r"^config\.schedule\.learning_rate: 1e-50 rounds to 0 as a float32"):
        Trainer.init_ram(cpu, tiny_config(schedule=dict(steps=10, learning_rate=1e-50)))
    with pytest.raises(uform.InvalidArgument, match=r"^config\.masking\.token_mask_probability: -1e-60 rounds to 0"):
        Trainer.init_ram(cpu, tiny_config(masking=dict(token_mask_probability=-1e-60)))
    with Trainer.init_ram(cpu, tiny_config(schedule=dict(steps=10, learning_rate=1e-40, warmup_steps=1))) as trainer:
        trainer.step(pair_batch())
        assert 0 < trainer.step(pair_batch()).stats.learning_rate < 1e-39  # a subnormal float32 is kept as given


def test_seed_takes_the_whole_uint64_range(cpu):
    losses = []
    for seed in (2**64 - 1, 2**64 - 2):
        with Trainer.init_ram(cpu, tiny_config(seed=seed)) as trainer:
            losses.append(trainer.step(pair_batch()).stats.loss)
    assert losses[0] != losses[1]  # the seed reached the library whole: the draws differ


def test_step_config_dict_and_dataclass(trainer):
    arena = Arena()
    by_dict = trainer.step(pair_batch(), dict(arena=arena, outputs_scalar="f16"))
    assert by_dict.embeddings.scalar is Scalar.F16
    by_class = trainer.step(pair_batch(), TrainerStepConfig(arena=arena, outputs_scalar=Scalar.I8))
    assert by_class.embeddings.scalar is Scalar.I8
    with pytest.raises(uform.InvalidArgument, match=r"^config\.arenna: unknown field \(did you mean arena\?\)$"):
        trainer.step(pair_batch(), dict(arenna=arena))
    with pytest.raises(uform.InvalidArgument, match=r"^config\.arena: expected a uform\.Arena"):
        trainer.step(pair_batch(), dict(arena=bytearray(1024)))
    with pytest.raises(uform.InvalidArgument, match=r"^config\.outputs_scalar:"):
        trainer.step(pair_batch(), dict(outputs_scalar="f64"))


# ---------------------------------------------------------------------------------------------- #
#  Batches                                                                                         #
# ---------------------------------------------------------------------------------------------- #


def same_stats(a, b):
    """Stats equal field by field, NaN (a term that did not run) equal to NaN; the host's time is a
    measurement, not a result."""
    assert a.keys() == b.keys()
    for key in a.keys() - {"host_seconds"}:
        both_nan = isinstance(a[key], float) and math.isnan(a[key]) and math.isnan(b[key])
        assert both_nan or a[key] == b[key], key
    return True


def test_batch_dataclass_and_dict_train_alike(cpu):
    batch_dict = pair_batch(bags=[0, 1], sides=[LateInteractionSide.NONE, 0])
    batch_class = TrainerBatch(
        modalities=["text", "text"],
        contents=[b"a small red panda", bytearray("Red pandas eat bamboo.", "utf-8")],
        bags=np.array([0, 1], np.int64),
        sides=[0, 0],
        relations=dict(attract=dict(offsets=np.array([0, 1, 2], np.uint32), ids=(1, 0))),
    )
    stats = []
    for batch in (batch_dict, batch_class):
        with Trainer.init_ram(cpu, tiny_config()) as trainer:
            stats.append(trainer.step(batch).stats)
    assert same_stats(stats[0], stats[1])
    assert stats[0].items == 2 and stats[0].tokens == len("a small red panda") + len("Red pandas eat bamboo.")


def overrun_tape():
    """A tape whose offsets were fine when made, then changed in place to run past its data."""
    offsets = np.array([0, 1, 2], np.uint64)
    tape = Tape(b"abc", offsets)
    offsets[2] = 9
    return tape


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(relations=dict(attract=dict(offsets=[0, 1, 2], ids=[1, 0]))),
            None,  # the good batch, as a control
        ),
        (
            dict(contents=["a", "b", "c"], modalities=["text"] * 3, relations=dict(attract=Edges([0, 1, 2], [1, 0]))),
            "batch.relations.attract.offsets: 3 entries, expected 4, one more than the items",
        ),
        (dict(modalities=["text"]), "batch.modalities: 1 entry, expected 2, one per item"),
        (dict(modalities=["text", "txt"]), "batch.modalities[1]:"),
        (dict(bags=[0, 1, 2]), "batch.bags: 3 entries, expected 2, one per item"),
        (dict(temperature_groups=[0]), "batch.temperature_groups: 1 entry, expected 2, one per item"),
        (dict(sides=[0, 1, 2]), "batch.sides: 3 entries, expected 2, one per item"),
        (dict(sides=[0, "query"]), "batch.sides[1]:"),
        (dict(bags=[0, -1]), "batch.bags[1]: -1 is negative"),
        (dict(relations=dict(attract=Edges([0, 1, 2], [1, 2**32]))), "batch.relations.attract.ids[1]: 4294967296 exceeds"),
        (dict(relations=dict(repel=Edges([0, 1, 2], [1, -3]))), "batch.relations.repel.ids[1]: -3 is negative"),
        (dict(relations=dict(ignore=Edges([0, 1, 2], [1.5, 0]))), "batch.relations.ignore.ids: expected unsigned integers"),
        (
            dict(relations=dict(attract=Edges([0, 1, 2], [1, 0], weights=[1.0]))),
            "batch.relations.attract.weights: 1 entry, expected 2, one per id",
        ),
        (dict(relations=dict(atract=Edges([0, 1, 2], [1, 0]))), "batch.relations.atract: unknown field"),
        (dict(relations=dict(attract=dict(offsets=[0, 1, 2], idz=[1, 0]))), "batch.relations.attract.idz: unknown field"),
        (dict(content=["x", "y"]), "batch.content: unknown field"),
        (lambda: dict(contents=overrun_tape()), "batch.contents.offsets: the last offset 9 is past the data's 3 bytes"),
        (dict(choices=["yn"]), "batch.choices: 1 entry, expected 2, one per item"),
        (dict(contents="just one string"), "batch.contents: expected a list of entries or a uform.Tape"),
    ],
)
def test_batch_lengths_and_values_checked_in_python(trainer, overrides, message):
    if callable(overrides):
        overrides = overrides()
    if message is None:
        assert trainer.step(pair_batch(**overrides)).stats.step == 1
        return
    with pytest.raises(uform.InvalidArgument) as caught:
        trainer.step(pair_batch(**overrides))
    assert str(caught.value).startswith(message), str(caught.value)
    # Nothing reached the library: the run is still at step zero and trains on.
    assert trainer.step(pair_batch()).stats.step == 1


def test_numbers_beyond_float32_are_named_as_given_without_numpys_warning(trainer):
    cases = [
        (dict(relations=dict(attract=Edges([0, 1, 2], [1, 0], weights=[1e39, 1]))),
         r"^batch\.relations\.attract\.weights\[0\]: 1e\+39 exceeds float32's range \(magnitudes up to 3\.4028235e\+38\)$"),
        (dict(relations=dict(repel=Edges([0, 1, 2], [1, 0], weights=np.array([1.0, -1e300])))),
         r"^batch\.relations\.repel\.weights\[1\]: -1e\+300 exceeds float32's range"),
        (dict(choices=["yn", "ab"], choice_targets=[[0.5, 0.5], [1.0, 4e38]]),
         r"^batch\.choice_targets\[1\]\[1\]: 4e\+38 exceeds float32's range"),
    ]
    for overrides, message in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy's "overflow encountered in cast" would raise here instead
            with pytest.raises(uform.InvalidArgument, match=message):
                trainer.step(pair_batch(**overrides))
    assert trainer.step(pair_batch()).stats.step == 1  # nothing reached the library
    # The largest float32 itself fits: passed on as given, a finite weight (a step it poisons is skipped).
    trainer.step(pair_batch(relations=dict(attract=Edges([0, 1, 2], [1, 0], weights=[3.4028235e38, 1]))))


def test_c_validation_leaves_the_trainer_usable(cpu):
    with Trainer.init_ram(cpu, tiny_config()) as trainer, Trainer.init_ram(cpu, tiny_config()) as control:
        bad = pair_batch(relations=dict(attract=Edges([0, 1, 2], [5, 0])))  # id 5 names no item
        with pytest.raises(uform.InvalidArgument, match=r"batch\.relations\.attract"):
            trainer.step(bad)
        unordered = pair_batch(contents=Tape(b"abcdef", np.array([0, 4, 2], np.uint64)))
        with pytest.raises(uform.InvalidArgument, match=r"batch\.contents"):
            trainer.step(unordered)
        # The next good batch trains as if the bad ones never came.
        got, expected = trainer.step(pair_batch()), control.step(pair_batch())
        assert got.stats.step == 1
        assert got.stats.loss == expected.stats.loss
        assert np.array_equal(trainer._weights(), control._weights())


# ---------------------------------------------------------------------------------------------- #
#  Lifetimes                                                                                       #
# ---------------------------------------------------------------------------------------------- #


def test_freed_objects_raise_invalid_handle_naming_them(tmp_path):
    cpu = Executor.for_ram(threads=1)
    trainer = Trainer.init_ram(cpu, tiny_config())
    trainer.free()
    trainer.free()  # twice is harmless
    assert not trainer.alive
    with pytest.raises(uform.InvalidHandle, match=r"^trainer: used after free\(\)$") as caught:
        trainer.step(pair_batch())
    assert isinstance(caught.value, RuntimeError)
    with pytest.raises(uform.InvalidHandle, match=r"^trainer:"):
        trainer.save(tmp_path / "never.safetensors")
    with pytest.raises(uform.InvalidHandle, match=r"^trainer:"):
        trainer._weights()
    deferred = trainer.deferred().step(pair_batch())
    with pytest.raises(uform.InvalidHandle, match=r"^trainer:"):
        deferred.wait()
    assert not (tmp_path / "never.safetensors").exists()

    mesh = Mesh.bootstrap(cpu)
    mesh.free()
    mesh.free()
    with pytest.raises(uform.InvalidHandle, match=r"^mesh:"):
        Trainer.init_ram(cpu, tiny_config(), mesh)

    cpu.free()
    cpu.free()
    assert not cpu.alive
    with pytest.raises(uform.InvalidHandle, match=r"^executor: used after free\(\)$"):
        Trainer.init_ram(cpu, tiny_config())
    with pytest.raises(uform.InvalidHandle, match=r"^executor:"):
        Mesh.bootstrap(cpu)


def test_executor_is_busy_while_a_trainer_borrows_it():
    cpu = Executor.for_ram(threads=1)
    trainer = Trainer.init_ram(cpu, tiny_config())
    assert trainer.executor is cpu
    with pytest.raises(uform.Busy, match=r"^executor:") as caught:
        cpu.free()
    assert isinstance(caught.value, RuntimeError)
    # The C library refuses as well, should Python's own check ever be bypassed.
    with pytest.raises(uform.Busy):
        cpu._native.free()
    assert cpu.alive and trainer.step(pair_batch()).stats.step == 1  # nothing dangles
    trainer.free()
    assert trainer.executor is None
    cpu.free()
    assert not cpu.alive


def test_mesh_is_busy_while_a_trainer_borrows_it():
    with Executor.for_ram(threads=1) as cpu:
        mesh = Mesh.bootstrap(cpu, host_domain_index=0, host_domain_count=1)
        trainer = Trainer.init_ram(cpu, tiny_config(), mesh)
        assert trainer.mesh is mesh and mesh.executor is cpu
        with pytest.raises(uform.Busy, match=r"^mesh:"):
            mesh.free()
        with pytest.raises(uform.Busy):
            mesh._native.free()  # the C library refuses too
        assert trainer.step(pair_batch()).stats.step == 1
        trainer.free()
        with pytest.raises(uform.Busy, match=r"^executor: borrowed by a live mesh"):
            cpu.free()
        mesh.free()
        assert not mesh.alive and mesh.executor is None


def test_context_managers_free_on_exit(tmp_path):
    with Executor.for_ram(threads=1) as cpu:
        with Trainer.init_ram(cpu, tiny_config()) as trainer:
            assert trainer.step(pair_batch()).stats.step == 1
        assert not trainer.alive
        with pytest.raises(ZeroDivisionError):
            with Trainer.init_ram(cpu, tiny_config()) as failing:
                1 / 0
        assert not failing.alive
        with Mesh.bootstrap(cpu) as mesh:
            assert mesh.alive
        assert not mesh.alive
    assert not cpu.alive


def test_a_collected_trainer_lets_go_of_its_executor():
    cpu = Executor.for_ram(threads=1)
    trainer = Trainer.init_ram(cpu, tiny_config())
    trainer.step(pair_batch())
    del trainer
    import gc

    gc.collect()
    cpu.free()
    assert not cpu.alive


# ---------------------------------------------------------------------------------------------- #
#  Stats, rows, arenas                                                                             #
# ---------------------------------------------------------------------------------------------- #

STATS_FIELDS = {
    "step", "learning_rate", "loss", "masked_loss", "contrastive_loss", "late_interaction_loss", "choices_loss", "image_loss", "video_loss", "audio_loss",
    "grad_norm", "items", "tokens", "truncated_items", "masked_positions", "contrastive_rows", "choice_items", "query_rows", "masked_patches", "host_seconds", "skipped",
    "inverse_temperatures", "biases",
}


def test_stats_read_as_attributes_and_as_a_mapping(cpu):
    config = tiny_config(contrastive=dict(temperature_groups=3))
    with Trainer.init_ram(cpu, config) as trainer:
        batch = pair_batch(
            modalities=["text"] * 3,
            contents=["one", "two", "three " * 20],  # the last is longer than a row: cut
            temperature_groups=[0, 2, 2],
            relations=dict(attract=Edges([0, 1, 2, 2], [1, 0])),
        )
        started = time.perf_counter()
        stats = trainer.step(batch).stats
        elapsed = time.perf_counter() - started
    assert 0 < stats.host_seconds < elapsed  # validating and packing, a part of the step
    assert set(stats.keys()) == STATS_FIELDS == set(dict(stats)) == set(stats)
    assert len(stats) == len(STATS_FIELDS) and "loss" in stats and stats.get("lost", 1) == 1
    for key in STATS_FIELDS:
        assert stats[key] is getattr(stats, key) is dict(stats)[key]
    assert list(stats.values()) == [stats[key] for key in stats.keys()]
    assert stats.step == 1 and stats.items == 3
    assert stats.truncated_items == 1 and stats.tokens < 3 + 3 + 120
    assert stats.skipped is False
    assert len(stats.inverse_temperatures) == len(stats.biases) == 3
    assert stats.inverse_temperatures[0] == pytest.approx(10.0) and stats.biases[0] == pytest.approx(-10.0)
    assert math.isfinite(stats.loss) and math.isfinite(stats.contrastive_loss) and math.isfinite(stats.masked_loss)
    assert stats.loss == pytest.approx(stats.masked_loss + stats.contrastive_loss, rel=1e-5)
    assert math.isnan(stats.late_interaction_loss) and math.isnan(stats.choices_loss)
    assert stats.learning_rate > 0 and stats.grad_norm > 0
    with pytest.raises(AttributeError):
        stats.loss = 0.0
    with pytest.raises(TypeError):
        stats["loss"] = 0.0
    with pytest.raises(KeyError):
        stats["lost"]
    with pytest.raises(AttributeError):
        stats.lost
    assert repr(stats).startswith("Stats(step=1, ") and "loss=" in repr(stats)


def _embeddings_at(cpu, scalar):
    """Embeddings a fresh run's first step scores: every scalar sees the same numbers."""
    with Trainer.init_ram(cpu, tiny_config()) as trainer:
        arena = Arena()
        stepped = trainer.step(pair_batch(), TrainerStepConfig(arena=arena, outputs_scalar=scalar))
        return stepped.embeddings, arena


@pytest.mark.parametrize(
    "scalar, dtype, tolerance",
    [(Scalar.F32, np.float32, 0), (Scalar.F16, np.float16, 1e-3), (Scalar.BF16, np.uint16, 8e-3), (Scalar.I8, np.int8, 1 / 127)],
)
def test_rows_in_every_scalar(cpu, scalar, dtype, tolerance):
    reference, _ = _embeddings_at(cpu, Scalar.F32)
    reference = reference.numpy().copy()
    assert reference.dtype == np.float32 and reference.shape == (2, HIDDEN)
    assert np.allclose(np.linalg.norm(reference, axis=1), 1, atol=1e-5)  # pooled embeddings are unit-norm

    rows, arena = _embeddings_at(cpu, scalar)
    assert rows.scalar is scalar and rows.shape == (2, HIDDEN) and len(rows) == 2
    raw = rows.numpy()
    assert raw.dtype == dtype and np.asarray(rows) is raw  # a view, no copy
    assert np.shares_memory(raw, arena._reserve(1))
    converted = rows.to_float32()
    assert converted.dtype == np.float32
    assert np.max(np.abs(converted - reference)) <= tolerance + 1e-7
    if scalar is Scalar.BF16:
        assert np.array_equal(converted, (raw.astype(np.uint32) << 16).view(np.float32))
        assert np.max(np.abs(converted - reference)) > 0  # really rounded to bfloat16
    if scalar is Scalar.I8:
        assert np.array_equal(raw, np.round(127 * reference).astype(np.int8))
    if scalar is Scalar.F16:
        assert np.array_equal(raw, reference.astype(np.float16))
        assert np.array_equal(np.asarray(rows, dtype=np.float32), reference.astype(np.float16).astype(np.float32))


def test_arena_is_reused_by_the_next_step(trainer):
    arena = Arena()
    first = trainer.step(pair_batch(), dict(arena=arena)).embeddings
    kept = np.array(first)
    second = trainer.step(pair_batch(), dict(arena=arena)).embeddings
    assert np.shares_memory(first.numpy(), second.numpy())
    assert np.array_equal(first.numpy(), second.numpy())  # the first view now reads the second step
    assert not np.array_equal(kept, second.numpy())  # which trained on, so the copy differs
    assert arena._storage.ctypes.data % 64 == 0
    assert trainer.step(pair_batch()).embeddings is None  # no arena, no copy


# ---------------------------------------------------------------------------------------------- #
#  Tapes                                                                                           #
# ---------------------------------------------------------------------------------------------- #


def test_tapes_over_numpy_arrays_copy_nothing():
    data = np.frombuffer(b"a small red pandaRed pandas eat bamboo.", np.uint8).copy()
    offsets = np.array([0, 17, 39], np.uint64)
    tape = Tape(data, offsets)
    assert _native.tape_addresses(tape) == (data.ctypes.data, offsets.ctypes.data)
    assert tape.offsets is offsets and tape.data is data
    assert len(tape) == 2 and bytes(tape[1]) == b"Red pandas eat bamboo." and bytes(tape[-2]) == b"a small red panda"
    assert np.shares_memory(np.asarray(tape[1]), data)
    data[0] = ord("A")
    assert bytes(tape[0]) == b"A small red panda"  # a view of the caller's memory, not a copy
    with pytest.raises(IndexError):
        tape[2]


def test_tapes_over_other_buffers_copy_nothing():
    blob = b"redpanda"
    offsets = np.array([0, 3, 8], np.uint64)
    tape = Tape(blob, offsets)
    assert _native.tape_addresses(tape)[0] == np.frombuffer(blob, np.uint8).ctypes.data
    grid = np.arange(12, dtype=np.uint8).reshape(3, 4)  # any C-contiguous buffer, read as its bytes
    tape = Tape(memoryview(grid), np.array([0, 5, 12], np.uint64))
    assert _native.tape_addresses(tape)[0] == grid.ctypes.data
    assert list(tape[0]) == [0, 1, 2, 3, 4]
    targets = np.array([0.9, 0.1, 1.0], np.float32)
    float_tape = Tape(targets, np.array([0, 2, 3], np.uint64))
    assert float_tape.is_float32 and list(float_tape[0]) == pytest.approx([0.9, 0.1])
    assert _native.tape_addresses(float_tape)[0] == targets.ctypes.data
    # Offsets of another dtype are converted once: C then reads the converted copy.
    signed = np.array([0, 3, 8], np.int64)
    converted = Tape(blob, signed)
    assert converted.offsets.dtype == np.uint64
    assert _native.tape_addresses(converted)[1] != signed.ctypes.data


def test_tape_checks_its_own_shape():
    with pytest.raises(uform.InvalidArgument, match=r"^tape\.offsets: empty"):
        Tape(b"abc", np.zeros(0, np.uint64))
    with pytest.raises(uform.InvalidArgument, match=r"^tape\.offsets: the last offset 4"):
        Tape(b"abc", [0, 4])
    with pytest.raises(uform.InvalidArgument, match=r"^tape\.offsets\[1\]: -1 is negative"):
        Tape(b"abc", [0, -1])
    with pytest.raises(uform.InvalidArgument, match=r"^tape\.data: the buffer is not C-contiguous"):
        Tape(np.zeros((4, 4), np.uint8)[:, 1], [0, 1])
    with pytest.raises(uform.InvalidArgument, match=r"^tape\.data: expected a contiguous buffer"):
        Tape(["a", "b"], [0, 1, 2])


def test_tape_from_list_gathers_once():
    tape = Tape.from_list(["grüße", b"\x00\xff", bytearray(b"xy"), ""])
    assert len(tape) == 4
    assert bytes(tape[0]) == "grüße".encode("utf-8") and len(tape[0]) == 7
    assert bytes(tape[1]) == b"\x00\xff" and bytes(tape[2]) == b"xy" and bytes(tape[3]) == b""
    assert tape.offsets.dtype == np.uint64 and tape.offsets.tolist() == [0, 7, 9, 11, 11]
    floats = Tape.from_list([np.array([0.9, 0.1], np.float32), [1.0], []])
    assert floats.is_float32 and floats.offsets.tolist() == [0, 2, 3, 3]
    assert np.asarray(floats.data).dtype == np.float32


def test_tape_contents_train_as_lists_do(cpu):
    texts = ["a small red panda", "Red pandas eat bamboo."]
    data = np.frombuffer("".join(texts).encode(), np.uint8)
    tape = Tape(data, np.array([0, 17, 39], np.uint64))
    losses = []
    for contents in (texts, tape, Tape.from_list(texts)):
        with Trainer.init_ram(cpu, tiny_config()) as trainer:
            losses.append(trainer.step(pair_batch(contents=contents)).stats.loss)
    assert losses[0] == losses[1] == losses[2]


def test_choice_tapes_are_checked_for_their_kind(trainer):
    with pytest.raises(uform.InvalidArgument, match=r"^batch\.choice_targets: expected a float32 tape"):
        trainer.step(pair_batch(choices=["yn", ""], choice_targets=Tape(b"ab", [0, 2, 2])))
    with pytest.raises(uform.InvalidArgument, match=r"^batch\.choice_targets: 1 entry, expected 2, one per item"):
        trainer.step(pair_batch(choices=["yn", ""], choice_targets=[np.float32([0.9, 0.1])]))
    with pytest.raises(uform.InvalidArgument, match=r"^batch\.contents: expected a tape of bytes"):
        trainer.step(pair_batch(contents=Tape(np.zeros(4, np.float32), [0, 2, 4])))


# ---------------------------------------------------------------------------------------------- #
#  Checkpoints and test hooks                                                                      #
# ---------------------------------------------------------------------------------------------- #


def test_save_writes_a_safetensors_file(trainer, tmp_path):
    trainer.step(pair_batch())
    weights = trainer._weights()
    for destination in (tmp_path / "by-path.safetensors", str(tmp_path / "by-str.safetensors")):
        trainer.save(destination)
        tensors = safetensors.numpy.load_file(str(destination))
        saved = np.concatenate([t.ravel() for name, t in tensors.items() if not name.startswith("adamw.")])
        # Every weight the trainer holds is in the file, compared as multisets (the order is the
        # file's); the flat buffer may also hold zeros that pad its tensors apart.
        assert saved.dtype == np.float32 and 0 < saved.size <= weights.size
        assert np.array_equal(np.sort(saved[saved != 0]), np.sort(weights[weights != 0]))
        assert np.count_nonzero(weights == 0) - np.count_nonzero(saved == 0) == weights.size - saved.size


def test_probe_answers_gradients_without_updating(trainer):
    before = trainer._weights()
    assert before.dtype == np.float32 and before.ndim == 1 and before.size > 0
    stats, gradients = trainer._probe(pair_batch())
    assert isinstance(stats, uform.Stats) and stats.items == 2 and math.isfinite(stats.loss)
    assert gradients.dtype == np.float32 and gradients.shape == before.shape
    assert np.all(np.isfinite(gradients)) and np.any(gradients != 0)
    assert np.array_equal(trainer._weights(), before)
    assert trainer.step(pair_batch()).stats.step == 1  # the probe took no step
    assert not np.array_equal(trainer._weights(), before)


# ---------------------------------------------------------------------------------------------- #
#  Encoders                                                                                        #
# ---------------------------------------------------------------------------------------------- #


def test_encoder_embeds_as_the_trainer_scores(cpu, tmp_path):
    checkpoint = tmp_path / "encoder.safetensors"
    with Trainer.init_ram(cpu, tiny_config(objective=Objective.CONTRASTIVE)) as trainer:
        trainer.step(pair_batch())
        trainer.save(checkpoint)
        scored = trainer.step(pair_batch(), dict(arena=Arena())).embeddings  # scored with the saved weights
        scored = np.array(scored)
    with uform.Encoder.load(checkpoint, cpu) as encoder:
        assert encoder.hidden == HIDDEN and encoder.executor is cpu
        texts = ["a small red panda", "Red pandas eat bamboo."]
        rows = encoder.embed([Modality.TEXT] * 2, texts)
        assert rows.scalar is Scalar.F32 and rows.shape == (2, HIDDEN)
        assert np.allclose(np.asarray(rows), scored, atol=1e-5)
        tape = Tape.from_list(texts * 3)  # any number of items, and tapes too
        many = encoder.deferred().embed(["text"] * 6, tape, scalar=Scalar.BF16).wait()
        assert many.shape == (6, HIDDEN)
        assert np.allclose(many.to_float32()[4:], scored, atol=1e-2)
        with pytest.raises(uform.InvalidArgument, match=r"^modalities: 1 entry, expected 2, one per item$"):
            encoder.embed(["text"], texts)
        with pytest.raises(uform.Busy, match=r"^executor: borrowed by a live encoder"):
            cpu.free()
    assert not encoder.alive
    with pytest.raises(uform.InvalidHandle, match=r"^encoder: used after free\(\)$"):
        encoder.embed(["text"], ["x"])
    with pytest.raises(uform.StorageError):
        uform.Encoder.load(tmp_path / "missing.safetensors", cpu)


def test_an_exception_in_a_with_block_is_not_hidden_by_a_refusal_to_free(tmp_path):
    path = tmp_path / "tiny.safetensors"
    with uform.Executor.for_ram(threads=1) as cpu, Trainer.init_ram(cpu, tiny_config()) as trainer:
        trainer.save(path)
    with pytest.raises(ValueError, match="^the block's own") as raised:
        with uform.Executor.for_ram(threads=1) as cpu:
            encoder = uform.Encoder.load(path, cpu)  # left alive: the executor cannot be freed
            raise ValueError("the block's own")
    if sys.version_info >= (3, 11):
        assert raised.value.__notes__ == ["uform: executor: borrowed by a live encoder; free those first; left to the "
                                          "garbage collector"]
    assert cpu.alive
    encoder.free()
    cpu.free()
    with pytest.raises(uform.Busy, match=r"^executor: borrowed by a live encoder"):  # a block that ends well: refused
        with uform.Executor.for_ram(threads=1) as cpu:
            encoder = uform.Encoder.load(path, cpu)
    encoder.free()


def test_dir_offers_the_public_names_not_the_helpers_the_package_imports():
    names = dir(uform)
    assert set(uform.__all__) <= set(names) and {"data", "torch"} <= set(names)
    assert not {"np", "os", "Any", "normalize_batch", "unsigned_array"} & set(names)
    assert uform.normalize_batch  # still there for the package's own modules
