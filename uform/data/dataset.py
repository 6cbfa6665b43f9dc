"""What a dataset is to uform: its shards, the columns of a record, and how a record becomes a group.

A group is the items of one record that attract each other (its `columns`), the hard negatives they
repel (its `negatives`), a weight on those edges, and the choices its first item offers. Records
that cannot make a group are bad: `Dataset.bad_records` says whether they are skipped, counted
with their location, or refused.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..config import Modality, enum_member, unsigned
from ..errors import InvalidArgument, unknown_field
from .readers import FORMATS, READERS, columns_of_first_record, media_kind, pick, read_media, shard_format


class BadRecord(InvalidArgument):
    """A record that makes no group: a missing value, an empty caption, a file that is missing or no
    image. Its text begins with the record's location, `shard:key`."""


@dataclass
class Dataset:
    """Where the records are and what their columns mean; the `[data]` section of a `uform train` config.

    `columns` maps each column whose items attract each other to its modality (`{"caption": "text",
    "jpg;png": "image"}`); a text column holds the text, an image, audio or video column a path
    (relative to the table's folder) or the file's bytes. In tar shards and folders a column is a
    file extension, and `jpg;png` takes whichever the sample has.
    """

    paths: Sequence[str] = field(metadata={"doc": "Files, folders or glob patterns, read in sorted order."})
    columns: Mapping[str, Any] = field(metadata={"doc": "Columns whose items attract each other, and their modalities."})
    negatives: Mapping[str, Any] = field(default_factory=dict, metadata={
        "doc": "Hard-negative columns and their modalities: their items repel the row's, both ways. A value may be a list."})
    weight: Optional[str] = field(default=None, metadata={"doc": "A column weighing the row's edges; absent weighs one."})
    choices: Optional[str] = field(default=None, metadata={"doc": "A column of the legal bytes the row's first item offers."})
    choice_targets: Optional[str] = field(default=None, metadata={"doc": "A column of their target probabilities."})
    format: Optional[str] = field(default=None, metadata={"doc": "jsonl, csv, parquet, tar or folder; absent: by extension."})
    bad_records: str = field(default="skip", metadata={"doc": "skip (and count) or refuse a record that makes no group."})
    shuffle_buffer: int = field(default=1024, metadata={"doc": "Records shuffled together; 0 keeps file order."})
    max_groups_per_step: Optional[int] = field(default=None, metadata={
        "doc": "Records (groups) per device's step at most; 0 or absent: as many as fit."})
    prefetch: int = field(default=2, metadata={"doc": "Batches assembled ahead of the step that trains."})


def normalize_dataset(value: Any, path: str = "data") -> Dataset:
    """A `Dataset` given as itself or a dict, checked field by field; errors name the field."""
    if isinstance(value, Dataset):
        given = {f.name: getattr(value, f.name) for f in fields(Dataset)}
    elif isinstance(value, Mapping):
        names = {f.name for f in fields(Dataset)}
        for key in value:
            if key not in names:
                raise unknown_field(path, key, names)
        given = dict(value)
    else:
        raise InvalidArgument(f"{path}: expected a uform.data.Dataset or a dict, got {type(value).__name__}")
    for name in ("paths", "columns"):
        if given.get(name) is None:
            raise InvalidArgument(f"{path}.{name}: missing; {Dataset.__dataclass_fields__[name].metadata['doc']}")
    paths = given["paths"]
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths or not all(isinstance(entry, (str, os.PathLike)) for entry in paths):
        raise InvalidArgument(f"{path}.paths: expected a list of files, folders or glob patterns")
    dataset = Dataset(paths=[os.fspath(entry) for entry in paths],
                      columns=_modalities(given["columns"], f"{path}.columns", required=True),
                      negatives=_modalities(given.get("negatives") or {}, f"{path}.negatives", required=False))
    attracting = {name for column in dataset.columns for name in column.split(";")}
    for column in dataset.negatives:  # a group repelling a copy of its own item learns to tell nothing apart
        for name in column.split(";"):
            if name in attracting:
                raise InvalidArgument(f"{path}.negatives.{column}: {name!r} is also one of {path}.columns; each group "
                                      "would repel a copy of its own item")
    for name in ("weight", "choices", "choice_targets"):
        column = given.get(name)
        if column is not None and not isinstance(column, str):
            raise InvalidArgument(f"{path}.{name}: expected a column name, got {type(column).__name__}")
        setattr(dataset, name, column)
    if (dataset.choices is None) != (dataset.choice_targets is None):
        raise InvalidArgument(f"{path}.{'choice_targets' if dataset.choice_targets is None else 'choices'}: missing; "
                              "choices and choice_targets come together")
    if given.get("format") is not None and given["format"] not in FORMATS:
        raise InvalidArgument(f"{path}.format: {given['format']!r} is not one of {', '.join(FORMATS)}")
    dataset.format = given.get("format")
    if given.get("bad_records", "skip") not in ("skip", "refuse"):
        raise InvalidArgument(f"{path}.bad_records: {given['bad_records']!r} is neither 'skip' nor 'refuse'")
    dataset.bad_records = given.get("bad_records", "skip")
    dataset.shuffle_buffer = unsigned(given.get("shuffle_buffer", 1024), 32, f"{path}.shuffle_buffer")
    if given.get("max_groups_per_step") is not None:
        dataset.max_groups_per_step = unsigned(given["max_groups_per_step"], 32, f"{path}.max_groups_per_step")
    dataset.prefetch = max(1, unsigned(given.get("prefetch", 2), 16, f"{path}.prefetch"))
    return dataset


def _modalities(value: Any, path: str, required: bool) -> Dict[str, Modality]:
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{path}: expected a dict of column names to modalities")
    if required and not value:
        raise InvalidArgument(f"{path}: empty; name at least one column and its modality")
    return {str(name): enum_member(Modality, modality, f"{path}.{name}") for name, modality in value.items()}


# ---------------------------------------------------------------------------------------------- #
#  Shards and their schema                                                                         #
# ---------------------------------------------------------------------------------------------- #


def list_shards(dataset: Dataset, path: str = "data") -> List[Tuple[str, str]]:
    """Every shard as (path, layout), in the order the paths list them, each pattern's matches sorted.
    Errors name `{path}.paths[i]`, `path` being the config section the dataset came from."""
    shards = []
    for number, entry in enumerate(dataset.paths):
        field_path = f"{path}.paths[{number}]"
        matches = sorted(glob.glob(entry)) if glob.has_magic(entry) else [entry]
        if not matches:
            raise InvalidArgument(f"{field_path}: {entry!r} matches no file")
        for match in matches:
            if not os.path.exists(match):
                raise InvalidArgument(f"{field_path}: {match!r}: no such file or folder")
            shards.append((match, shard_format(match, dataset.format, field_path)))
    return shards


def text_columns(dataset: Dataset) -> Tuple[str, ...]:
    """The column names, alternatives split apart, whose values are text."""
    named = list(dataset.columns.items()) + list(dataset.negatives.items())
    return tuple(name for column, modality in named if modality is Modality.TEXT for name in column.split(";"))


def check_schema(dataset: Dataset, shards: List[Tuple[str, str]], path: str = "data") -> None:
    """Every column the dataset names is in every shard's header, or its first record: before any step,
    so a misspelt column fails at once, naming itself and the shard."""
    wanted = [(f"{path}.columns.{name}", name) for name in dataset.columns]
    wanted += [(f"{path}.negatives.{name}", name) for name in dataset.negatives]
    wanted += [(f"{path}.{kind}", getattr(dataset, kind)) for kind in ("weight", "choices", "choice_targets")
               if getattr(dataset, kind) is not None]
    if check_columns(shards, wanted) == len(shards):  # refused now, before a run makes its folder
        raise no_records(shards, path)


def no_records(shards: List[Tuple[str, str]], path: str = "data") -> InvalidArgument:
    """The refusal of a dataset whose shards hold no record, naming its first."""
    count, first = len(shards), shards[0][0]
    return InvalidArgument(f"{path}.paths: " + (f"{first} holds" if count == 1 else f"the {count} shards, from {first}, hold")
                           + " no records")


def check_columns(shards: List[Tuple[str, str]], wanted: Sequence[Tuple[str, str]]) -> int:
    """Each column of `wanted`, (the field or argument that named it, the column), is in every shard's header,
    or in one of its first 64 records that read (one record lacking it is a bad record, not a misspelt column);
    `InvalidArgument` names the field, the shard and the columns it has otherwise. Answers how many shards hold
    no record at all."""
    empty = 0
    for path, layout in shards:
        offered = columns_of_first_record(path, layout, most=64)
        if offered is None:
            empty += 1  # an empty shard has no records to be wrong
            continue
        for field_path, column in wanted:
            twice = [name for name in column.split(";") if offered.count(name) > 1]
            if twice:  # a record would hold the last one's value, silently
                raise InvalidArgument(f"{field_path}: {path}'s header names {twice[0]!r} {offered.count(twice[0])} "
                                      "times; rename all but one")
            if not any(name in offered for name in column.split(";")):
                if layout == "tar":  # a sample split apart explains a missing file better: read_tar names it
                    for _ in READERS["tar"](path):
                        pass
                where = "header has" if layout in ("csv", "parquet") else "first records have"
                noun = "file" if layout in ("tar", "folder") else "column"
                raise InvalidArgument(f"{field_path}: {path}'s {where} no {noun} {column!r} "
                                      f"(it has {', '.join(map(repr, offered)) or 'nothing'})")
    return empty


# ---------------------------------------------------------------------------------------------- #
#  Records into groups                                                                             #
# ---------------------------------------------------------------------------------------------- #


@dataclass
class Group:
    """One record's items, ready to pack: `items` are (modality, value), the first `positives` attract each other."""

    location: str
    items: List[Tuple[Modality, Any]]
    positives: int
    weight: float = 1.0
    choices: Optional[bytes] = None
    choice_targets: Optional[List[float]] = None
    folder: str = ""
    columns: List[str] = field(default_factory=list)  # the column each item came from, to name it when it is bad


def make_group(dataset: Dataset, location: str, values: Any, folder: str) -> Group:
    """The group one record makes, or `BadRecord` naming `location` and what is wrong. Reads no media file."""
    if values is None:
        raise BadRecord(f"{location}: not a record (a line that is no JSON object?)")
    if isinstance(values, InvalidArgument):  # a shard that breaks off: the reader says where and how
        raise BadRecord(f"{location}: {values}")
    items = [(modality, _value(values, column, modality, location)) for column, modality in dataset.columns.items()]
    columns = list(dataset.columns)
    positives = len(items)
    for column, modality in dataset.negatives.items():
        value = pick(values, column)  # absent, null or an empty cell: this record has no hard negative of the column
        for entry in [] if value is None or value == "" else value if isinstance(value, list) else [value]:
            if entry is None:
                raise BadRecord(f"{location}: {column!r} holds a null")
            items.append((modality, _checked(entry, column, modality, location)))
            columns.append(column)
    group = Group(location, items, positives, folder=folder, columns=columns)
    if dataset.weight is not None:
        group.weight = _weight(_present(values, dataset.weight, location), location, dataset.weight)
    if dataset.choices is not None:
        group.choices, group.choice_targets = _choices(values, dataset, location)
    return group


def _present(values: Mapping, column: str, location: str) -> Any:
    """The value of `column`, or `BadRecord` saying whether the record lacks it or gives it as null (JSON's `null`,
    Parquet's null)."""
    value = pick(values, column)
    if value is None:
        given = any(name in values for name in column.split(";"))
        raise BadRecord(f"{location}: {column!r} is null" if given else f"{location}: no {column!r}")
    return value


def _value(values: Mapping, column: str, modality: Modality, location: str) -> Any:
    return _checked(_present(values, column, location), column, modality, location)


def _checked(value: Any, column: str, modality: Modality, location: str) -> Any:
    if isinstance(value, InvalidArgument):  # a reader's verdict, such as a caption that is no UTF-8
        raise BadRecord(f"{location}: {column!r} is {value}")
    if modality is Modality.TEXT:
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError:
                raise BadRecord(f"{location}: {column!r} is not UTF-8 text") from None
        if not isinstance(value, str):
            raise BadRecord(f"{location}: {column!r} holds {type(value).__name__} {value!r:.40}, not text")
        if not value.strip():
            raise BadRecord(f"{location}: {column!r} is empty")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRecord(f"{location}: {column!r} is not UTF-8 text") from None
    elif isinstance(value, str) and not value:
        raise BadRecord(f"{location}: {column!r} is an empty path")
    return value


def _weight(value: Any, location: str, column: str) -> float:
    try:
        weight = float(value)
    except (TypeError, ValueError):
        raise BadRecord(f"{location}: {column!r} is {value!r}, not a number") from None
    if not (math.isfinite(weight) and weight > 0):
        raise BadRecord(f"{location}: {column!r} is {weight}, not a positive weight")
    return weight


def _choices(values: Mapping, dataset: Dataset, location: str):
    choices, targets = _present(values, dataset.choices, location), _present(values, dataset.choice_targets, location)
    if isinstance(choices, str):
        choices = choices.encode("utf-8")
    if not isinstance(choices, bytes) or not choices or len(set(choices)) != len(choices):
        raise BadRecord(f"{location}: {dataset.choices!r} is {choices!r}, not distinct bytes to choose from")
    given = targets
    if isinstance(targets, str):  # CSV holds a JSON list, or numbers between spaces
        try:
            targets = json.loads(targets) if targets.lstrip().startswith("[") else [float(t) for t in targets.split()]
        except ValueError:
            targets = None
    try:
        targets = [float(target) for target in targets]
    except (TypeError, ValueError):
        raise BadRecord(f"{location}: {dataset.choice_targets!r} is {given!r}, not a list of numbers (a JSON list, or "
                        "numbers between spaces)") from None
    if len(targets) != len(choices):
        raise BadRecord(f"{location}: {dataset.choice_targets!r} has {len(targets)} targets for {len(choices)} choices")
    if not all(math.isfinite(t) and t >= 0 for t in targets) or abs(sum(targets) - 1) > 1e-3:
        raise BadRecord(f"{location}: {dataset.choice_targets!r} are no probabilities summing to one: {targets}")
    return choices, targets


def load_media(group: Group) -> Group:
    """The group with every media value read into bytes; `BadRecord` for a file that is missing or of
    another kind than its column's modality."""
    items = []
    for index, (modality, value) in enumerate(group.items):
        if modality is not Modality.TEXT:
            named = f"{group.location}: {column_of(group, index)!r}"
            try:
                value = read_media(value, group.folder)
            except (OSError, EOFError, TypeError) as error:
                if isinstance(error, FileNotFoundError) and isinstance(value, str):  # often text in a media column
                    shown = value if len(value) <= 60 else value[:57] + "..."
                    raise BadRecord(f"{named} names no file ({shown!r}); a column declared {modality.value} "
                                    "holds a path or the file's bytes") from None
                raise BadRecord(f"{named}: {error}") from None
            kind = media_kind(value[:16])
            if kind != modality.value:
                what = ("(an empty file)" if not value else f"(the bytes are {kind})" if kind
                        else f"(they begin {value[:8]!r})")
                raise BadRecord(f"{named}: declared {modality.value}, but {len(value)} bytes that are no "
                                f"{modality.value} file {what}")
        items.append((modality, value))
    return dataclasses.replace(group, items=items)


def column_of(group: Group, item: int) -> str:
    """The column the group's `item`-th item came from."""
    return group.columns[item] if item < len(group.columns) else f"item {item}"


_ITEM_FIELD = re.compile(r"^(?:batch\.)?(?:contents|modalities|bags|sides|choices|choice_targets|temperature_groups)"
                         r"\[(\d+)\](?:\[\d+\])?: ")


def refused_item(error: BaseException) -> Optional[Tuple[int, str]]:
    """(item, why) when the library refused a batch for one of its items (a trainer's `batch.contents[20]: not a
    readable PNG image: ...`, an encoder's `contents[20]: ...`), the item counted over the whole batch as given;
    None when it faults the batch as a whole."""
    match = _ITEM_FIELD.match(str(error))
    return (int(match.group(1)), str(error)[match.end():]) if match else None


def records(dataset: Any, start: Tuple[int, int] = (0, 0), path: str = "data") -> Iterator[Tuple[str, Any, str]]:
    """Every record of the dataset in file order, as (location, values, folder), from (shard, offset);
    errors name `{path}.paths[i]`."""
    dataset = normalize_dataset(dataset, path)
    shards = list_shards(dataset, path)
    texts = text_columns(dataset)
    for number in range(start[0], len(shards)):
        path, layout = shards[number]
        folder = os.path.dirname(os.path.abspath(path)) if layout not in ("folder",) else os.path.abspath(path)
        shown = os.path.normpath(path)  # a location is for reading: `data/../more/a.jsonl` as `more/a.jsonl`
        for key, values in READERS[layout](path, start[1] if number == start[0] else 0, texts):
            yield f"{shown}:{key}", values, folder
