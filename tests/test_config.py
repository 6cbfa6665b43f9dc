"""One config, stated where each language needs it: the struct in `uform.h`, its declaration in
`uform.pxd`, the Python dataclasses, and the table in `libuform/src/config_fields.h` that derives,
checks and records it. Each place names the same fields, and every field a user sets reaches the
checkpoint's metadata as given."""
import dataclasses
import json
import os
import re
import struct
import warnings

import numpy as np
import pytest

import uform

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Every field of `TrainerConfig`, each given a valid value that no zero derives.
EVERY_FIELD = dict(
    depth=1, hidden=128, objective="joint", seed=7, determinism="fast",
    batch=dict(max_rows_per_device=3, max_segments_per_device=9, max_columns_per_row=60, max_bags_per_device=5,
               max_choices_per_item=12, image=dict(patch_side=8, channels=1),
               video=dict(patch_side=4, tube_frames=3, frame_stride=2, channels=4),
               audio=dict(chunk_samples=100, sample_rate=8000)),
    masking=dict(token_mask_probability=0.2, token_mean_span=2.5, replace_fraction=0.7, random_fraction=0.2,
                 image_mask_ratio=0.6, video_mask_ratio=0.7, audio_mask_ratio=0.4, text_weight=0.5, image_weight=0.25,
                 video_weight=2, audio_weight=3),
    contrastive=dict(matryoshka_dimensions=[64, 128], temperature_groups=2, inverse_temperature=5, bias=-3,
                     negatives="named", ambient_repulsion_weight=0.5, max_edges_per_device=77, pair_loss="balanced"),
    late_interaction=dict(weight=0.5, width=16, inverse_temperature=2, bias=0.5, max_query_span=8,
                          max_query_tokens_per_device=40, max_documents_per_device=6,
                          max_document_tokens_per_device=100, pair_loss="sigmoid"),
    choices=dict(weight=0.3),
    schedule=dict(steps=100, learning_rate=0.01, min_learning_rate=0.001, warmup_steps=7),
)


def dataclass_fields(kind, prefix=""):
    """The dotted paths of a config dataclass's fields, nested dataclasses entered."""
    paths = []
    for field in dataclasses.fields(kind):
        nested = getattr(field.metadata["kind"], "kind", None)
        if dataclasses.is_dataclass(nested):
            paths += dataclass_fields(nested, f"{prefix}{field.name}.")
        else:
            paths.append(prefix + field.name)
    return paths


def leaves(tree, prefix=""):
    """A nested dict as {dotted path: value}."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(leaves(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def struct_fields(members, name, prefix=""):
    """The dotted paths of struct `name`'s members, given {struct: [(type, member)]}, nested structs entered."""
    paths = []
    for kind, member in members[name]:
        paths += struct_fields(members, kind, f"{prefix}{member}.") if kind in members else [prefix + member]
    return paths


def header_structs():
    text = re.sub(r"/\*.*?\*/|//[^\n]*", "", open(os.path.join(ROOT, "libuform", "include", "uform.h")).read(), flags=re.S)
    members = {}
    for name, body in re.findall(r"typedef struct (\w+) \{(.*?)\} \1;", text, flags=re.S):
        declarations = [re.match(r"(.*?)\s*(\w+)(\[.*\])?$", line.strip()) for line in body.split(";") if line.strip()]
        members[name] = [(match.group(1).split()[-1].rstrip("*"), match.group(2)) for match in declarations]
    return members


def pxd_structs():
    text = open(os.path.join(ROOT, "uform", "uform.pxd")).read()
    members = {}
    for name, body in re.findall(r"ctypedef struct (\w+):\n((?: {8}.*\n)+)", text):
        members[name] = [(line.split()[-2].rstrip("*"), line.split()[-1].split("[")[0]) for line in body.splitlines()]
    return members


def test_the_header_the_pxd_and_the_dataclasses_name_the_same_fields():
    header = struct_fields(header_structs(), "uform_trainer_init_vram_t")
    assert struct_fields(pxd_structs(), "uform_trainer_init_vram_t") == header
    # Python gives the dimensions as one array, which C takes as a pointer and its count.
    assert sorted(dataclass_fields(uform.TrainerConfig)) == sorted(
        set(header) - {"contrastive.matryoshka_dimensions_count"})


def read_config(path):
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        return json.loads(json.loads(file.read(length))["__metadata__"]["config"])


def test_every_field_reaches_the_checkpoint_as_given(tmp_path):
    given = leaves(EVERY_FIELD)
    assert sorted(given) == sorted(set(dataclass_fields(uform.TrainerConfig)) - {"resume"})
    path = tmp_path / "every.safetensors"
    cpu = uform.Executor.for_ram(threads=1)
    with uform.Trainer.init_ram(cpu, EVERY_FIELD) as trainer:
        trainer.save(str(path))
    cpu.free()
    recorded = leaves(read_config(path))
    optimizer = {name for name in recorded if name.startswith("optimizer.")}
    assert sorted(set(recorded) - optimizer) == sorted(given)
    for name, value in leaves(uform.normalize_trainer_config(EVERY_FIELD)).items():  # as C takes them
        if name in recorded:
            if isinstance(value, float):  # written with the 9 digits that tell float32s apart
                recorded[name], value = np.float32(recorded[name]), np.float32(value)
            assert recorded[name] == (value.tolist() if isinstance(value, np.ndarray) else value), name


def test_a_recorded_configs_enumerations_read_back_by_the_names_they_were_given(tmp_path):
    path = tmp_path / "every.safetensors"
    with uform.Executor.for_ram(threads=1) as cpu, uform.Trainer.init_ram(cpu, EVERY_FIELD) as trainer:
        trainer.save(str(path))
    recorded = read_config(path)
    named, given = leaves(uform.config.enum_names(uform.TrainerConfig, recorded)), leaves(EVERY_FIELD)
    choices = ["objective", "determinism", "contrastive.negatives", "contrastive.pair_loss", "late_interaction.pair_loss"]
    assert sorted(name for name in named if named[name] != leaves(recorded)[name]) == sorted(choices)
    assert {name: named[name] for name in choices} == {name: given[name] for name in choices}
    unknown = dict(objective=9, contrastive=dict(pair_loss=0, negatives=True), optimizer=dict(beta1=0.9))
    assert uform.config.enum_names(uform.TrainerConfig, unknown) == dict(
        objective=9, contrastive=dict(pair_loss="derived", negatives=True), optimizer=dict(beta1=0.9))


def field_of(name):
    """The dataclass field a dotted path names."""
    kind = uform.TrainerConfig
    for part in name.split("."):
        field = {f.name: f for f in dataclasses.fields(kind)}[part]
        kind = getattr(field.metadata["kind"], "kind", None)
    return field


def test_a_zero_given_on_purpose_warns_exactly_where_the_library_derives_another_value(tmp_path):
    """The C library reads 0 as absent. Each real field is set to 0 in turn: where the checkpoint then records
    another value, the config warned, naming the field; where it records 0, it did not."""
    cpu = uform.Executor.for_ram(threads=1)
    checked = 0
    for name, value in leaves(EVERY_FIELD).items():
        if not isinstance(field_of(name).metadata["kind"], uform.config._Real):
            continue
        config = json.loads(json.dumps(EVERY_FIELD))
        *parents, last = name.split(".")
        parent = config
        for key in parents:
            parent = parent[key]
        parent[last] = 0
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            try:
                trainer = uform.Trainer.init_ram(cpu, config)
            except uform.InvalidArgument:
                continue  # 0 is no value of this field at all (depth, hidden, steps, ...)
        path = tmp_path / f"{name}.safetensors"
        trainer.save(str(path))
        trainer.free()
        recorded = leaves(read_config(path))[name]
        said = [str(warning.message) for warning in warned if issubclass(warning.category, uform.ConfigWarning)
                and f"config.{name}: 0 is read as absent" in str(warning.message)]
        assert len(said) == (recorded != 0), (name, recorded, said)
        checked += 1
    cpu.free()
    assert checked == 20  # every real field
