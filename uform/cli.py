"""The `uform` command: train from a TOML config, embed a dataset, describe a checkpoint.

    uform train CONFIG                      # trains, evaluates, checkpoints; run again to resume, or to make
                                            # the final evaluation that a stop during the last step left
    uform train CONFIG --host-domain-index I   # process I of a [mesh] of several
    uform embed CHECKPOINT INPUT OUTPUT     # one table, tar shard or folder in, .npy or .parquet out
    uform info CHECKPOINT                   # geometry, step, config, tensor sizes; exit 1 where no reader loads it

A config's sections mirror the Python configs: `[trainer]` is a `uform.TrainerConfig` (with
`[trainer.batch]`, `[trainer.schedule]`, ...; docs/python.md), `[data]` a `uform.data.Dataset`, and
`[evaluation]`, `[checkpoints]`, `[run]` and `[mesh]` are this command's own; the fields of all but `[trainer]`
are listed below. Relative paths are read from the config's folder. docs/tutorial.md has a complete
example.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import signal
import struct
import sys
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

import uform
from .config import Modality, TrainerConfig, enum_member, enum_names, normalize, real, scalar_member, unsigned
from .data import FORMATS, BadRecord, Dataset, Stream, check_schema, list_shards, load_media, make_group, normalize_dataset, records
from .data.dataset import check_columns, refused_item
from .data.readers import columns_of_first_record
from .data.stream import CURSOR_KEYS, UnusableEpochs, check_paired
from .errors import Error, InvalidArgument, InvalidCheckpoint, PeerError, Unsupported, unknown_field
from .logs import RunLog

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, packaged
    import tomli as tomllib


def _count(value: Any, path: str) -> int:
    return unsigned(value, 32, path)


def _text(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{path}: expected a string, got {type(value).__name__}")
    return value


def _minutes(value: Any, path: str, zero: str = "0 saves by steps alone") -> float:
    minutes = real(value, path)
    if not (math.isfinite(minutes) and minutes >= 0):
        raise InvalidArgument(f"{path}: {minutes} is not a number of minutes, 0 or more ({zero})")
    return minutes


def _timeout(value: Any, path: str) -> float:
    minutes = _minutes(value, path, "0 waits the default 5")
    if minutes > 1e9 / 60:  # the library's bound, a billion seconds
        raise InvalidArgument(f"{path}: {minutes:g} minutes; at most {1e9 / 60:.6g} (a billion seconds)")
    return minutes


def _as_given(value: Any, path: str) -> Any:
    return value  # checked where it is read, as [data]'s fields are


def _field(kind, doc: str, **default):
    return field(metadata={"kind": kind, "doc": doc}, **default)


@dataclass
class Run:
    """Where a run lives and runs."""

    folder: Optional[str] = _field(_text, "Checkpoints and logs; absent: runs/NAME beside the config NAME.toml.",
                                   default=None)
    device: str = _field(_text, "auto (a GPU when there is one), gpu or cpu.", default="auto")
    threads: Optional[int] = _field(_count, "CPU threads; 0 or absent: every core. A GPU run ignores it, saying so.",
                                    default=None)


@dataclass
class Checkpoints:
    """When a run saves, and how many checkpoints it keeps."""

    every_steps: Optional[int] = _field(_count, "Save every this many steps; 0 or absent: not by steps.", default=None)
    every_minutes: Optional[float] = _field(_minutes, "Save when this many minutes passed since the last save; "
                                            "0: not by time.", default=30.0)
    keep: int = _field(_count, "The newest checkpoints kept; older ones are deleted.", default=3)


@dataclass
class Evaluation:
    """Retrieval on a held-out split: each record's first column finds its second, and back."""

    paths: Sequence[str] = _field(_as_given, "Held-out files, folders or glob patterns.")
    columns: Union[Sequence[str], Mapping, None] = _field(
        _as_given, "Two columns: a list of two of [data]'s, or a table of column = modality; absent: [data]'s "
        "first two.", default=None)
    format: Optional[str] = _field(_text, "As [data].format.", default=None)
    every_steps: Optional[int] = _field(_count, "Evaluate every this many steps, and at the end; 0 or absent: at "
                                       "the end alone.", default=None)
    max_records: int = _field(_count, "Held-out records read at most; 2 or more.", default=1000)


@dataclass
class MeshSection:
    """A run of several processes on CPUs, each started with `uform train CONFIG --host-domain-index I`."""

    host_domain_count: int = _field(_count, "The processes of the run; 1: this process alone.", default=1)
    directory: Optional[str] = _field(_text, "A folder every process sees, where they meet; absent: the run "
                                      "folder's `mesh`.", default=None)
    job: str = _field(_text, "The run's name under `directory`: one folder name.", default="train")
    timeout_minutes: float = _field(_timeout, "How long a process waits for the others: to meet, and at "
                                    "every step; 0: the default.", default=5.0)


_SECTIONS = {"run": Run, "trainer": TrainerConfig, "data": Dataset, "evaluation": Evaluation, "checkpoints": Checkpoints,
             "mesh": MeshSection}


def _plain_section(kind: type, value: Any, path: str) -> Any:
    """A section of plain fields as its dataclass, naming an unknown key, a missing one or a wrong type."""
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{path}: expected a table of keys")
    names = {f.name: f for f in dataclasses.fields(kind)}
    for key in value:
        if key not in names:
            raise unknown_field(path, key, names)
    given = {}
    for name, f in names.items():
        if value.get(name) is not None:
            given[name] = f.metadata["kind"](value[name], f"{path}.{name}")
        elif f.default is dataclasses.MISSING:
            raise InvalidArgument(f"{path}.{name}: missing; {f.metadata['doc']}")
    return kind(**given)


def _evaluation_columns(columns: Any, data: Dataset) -> Any:
    """`[evaluation] columns` as a table of column = modality: as given, or named in a list with the modalities
    `[data]` gives them, or absent, `[data]`'s first two columns."""
    if columns is None:
        return dict(list(data.columns.items())[:2])
    if isinstance(columns, Mapping):
        return columns  # checked as [data]'s are
    if not isinstance(columns, list):
        raise InvalidArgument(f"evaluation.columns: expected a list of two of [data]'s columns or a table of "
                              f"column = modality, got {type(columns).__name__}")
    if len(columns) != 2:  # said first: it is the count that is wrong, whatever the names
        raise InvalidArgument(f"evaluation.columns: retrieval needs two columns, a query's and its target's; got "
                              f"{len(columns)}")
    known = {**data.negatives, **data.columns}
    for number, name in enumerate(columns):
        if not isinstance(name, str):
            raise InvalidArgument(f"evaluation.columns[{number}]: expected a column name, got {type(name).__name__}")
        if name not in known:
            raise InvalidArgument(f"evaluation.columns[{number}]: {name!r} is none of [data]'s columns "
                                  f"({', '.join(map(repr, known))}), so its modality is unknown; give it in a table, "
                                  f"columns = {{ {name} = \"text\", ... }}")
        if name in columns[:number]:
            raise InvalidArgument(f"evaluation.columns[{number}]: {name!r} again; retrieval needs two different "
                                  f"columns, a query's and its target's")
    return {name: known[name] for name in columns}


@dataclass
class TrainConfig:
    """A `uform train` config, every section checked, every relative path made absolute."""

    path: str
    run: Run
    trainer: Dict[str, Any]
    data: Dataset
    evaluation: Optional[Evaluation]
    checkpoints: Checkpoints
    mesh: MeshSection


def load_config(path: str) -> TrainConfig:
    """Reads and checks a TOML config; `InvalidArgument` names the first field at fault."""
    try:
        with open(path, "rb") as file:
            sections = tomllib.load(file)
    except tomllib.TOMLDecodeError as error:
        raise InvalidArgument(f"CONFIG: {path}: not TOML: {error}") from None
    except UnicodeDecodeError as error:  # TOML is UTF-8; tomllib decodes the file whole before it parses
        raise InvalidArgument(f"CONFIG: {path}: not TOML: byte {error.start} is not UTF-8 text") from None
    except FileNotFoundError:
        raise InvalidArgument(f"CONFIG: {path}: no such file") from None
    except OSError as error:
        raise InvalidArgument(f"CONFIG: {path}: {error.strerror or error}") from None
    for name in sections:
        if name not in _SECTIONS:
            raise InvalidArgument(f"{name}: unknown section (one of {', '.join(_SECTIONS)})")
    for name in ("trainer", "data"):
        if name not in sections:
            raise InvalidArgument(f"{name}: missing section")
    here = os.path.dirname(os.path.abspath(path))

    def resolve(entry):
        return os.path.join(here, os.path.expanduser(entry))

    def owned(entry):
        """A path of the run's own (its folder, the checkpoint it resumes, where its processes meet), with `..` tidied
        away so that every message shows it plainly. Data paths stay as given: a checkpoint records its shards by them,
        and messages tidy them as they show them."""
        return os.path.normpath(resolve(entry))

    trainer = dict(sections["trainer"])
    normalize(TrainerConfig, trainer, "trainer")  # checks every field now, named as the config names it
    if trainer.get("resume") is not None:
        trainer["resume"] = owned(trainer["resume"])
    data = normalize_dataset(sections["data"])
    data.paths = [resolve(entry) for entry in data.paths]
    check_paired(data, str(trainer.get("objective", "")).lower())
    evaluation = None
    if "evaluation" in sections:
        evaluation = _plain_section(Evaluation, sections["evaluation"], "evaluation")
        columns = _evaluation_columns(evaluation.columns, data)
        checked = normalize_dataset(dict(paths=evaluation.paths, columns=columns, format=evaluation.format), "evaluation")
        if len(checked.columns) != 2:
            given = "" if evaluation.columns is not None else ", taken from [data]'s as it gives none"
            raise InvalidArgument(f"evaluation.columns: retrieval needs two columns, a query's and its target's; "
                                  f"got {len(checked.columns)}{given}")
        evaluation.paths, evaluation.columns = [resolve(entry) for entry in checked.paths], checked.columns
    run = _plain_section(Run, sections.get("run", {}), "run")
    if run.device not in ("auto", "gpu", "cpu"):
        raise InvalidArgument(f"run.device: {run.device!r} is not one of 'auto', 'gpu', 'cpu'")
    stem = os.path.splitext(os.path.basename(path))[0]
    if run.folder is not None and not run.folder.strip():
        raise InvalidArgument(f"run.folder: empty; leave it out for runs/{stem} beside the config, or name a folder")
    run.folder = owned(run.folder) if run.folder is not None else os.path.join(here, "runs", stem)
    if evaluation is not None and evaluation.max_records < 2:
        raise InvalidArgument(f"evaluation.max_records: {evaluation.max_records}; retrieval needs at least two records")
    checkpoints = _plain_section(Checkpoints, sections.get("checkpoints", {}), "checkpoints")
    if checkpoints.keep < 1:
        raise InvalidArgument("checkpoints.keep: 0; a run keeps at least its newest checkpoint")
    mesh = _plain_section(MeshSection, sections.get("mesh", {}), "mesh")
    if mesh.host_domain_count < 1 or mesh.host_domain_count > 65536:
        raise InvalidArgument(f"mesh.host_domain_count: {mesh.host_domain_count}; a run has 1 to 65536 processes")
    if mesh.host_domain_count > 1 and run.device == "gpu":
        raise Unsupported("mesh.host_domain_count: meshes of several processes train on CPUs (run.device = \"cpu\"); "
                          "GPU meshes need NCCL, which this build lacks")
    if not mesh.job or "/" in mesh.job or mesh.job in (".", "..") or len(mesh.job.encode()) > 200:
        raise InvalidArgument(f"mesh.job: {mesh.job!r} is not one folder name (no '/', not '.' or '..', at most "
                              "200 bytes)")
    if mesh.directory is not None and not mesh.directory.strip():
        raise InvalidArgument("mesh.directory: empty; leave it out for the run folder's mesh/, or name a folder")
    mesh.directory = owned(mesh.directory) if mesh.directory is not None else os.path.join(run.folder, "mesh")
    if os.path.exists(mesh.directory) and not os.path.isdir(mesh.directory):  # before the run folder is made
        raise InvalidArgument(f"mesh.directory: {mesh.directory} is not a folder")
    return TrainConfig(path, run, trainer, data, evaluation, checkpoints, mesh)


# ---------------------------------------------------------------------------------------------- #
#  Checkpoints, each with the stream's cursor in its note                                          #
# ---------------------------------------------------------------------------------------------- #

_CHECKPOINT = re.compile(r"step-(\d+)\.safetensors$")


def resume_changes(checkpoint: str, trainer: Mapping[str, Any]) -> Dict[str, List[Any]]:
    """The fields the config gives that differ from the checkpoint's: {"trainer.schedule.steps": [was, now]}.
    A field left to the library (absent, or 0) is derived again from this config, not read from the checkpoint,
    and is not compared here; reals compare as float32, as the library keeps them."""
    metadata, _ = read_header(checkpoint, "trainer.resume")
    try:
        was = json.loads(metadata.get("config", "{}"))
    except ValueError:
        return {}  # the library refuses such a file itself
    now = normalize(TrainerConfig, dict(trainer, resume=None), "trainer")
    was_named, now_named = enum_names(TrainerConfig, was), enum_names(TrainerConfig, now)  # "joint", not 3
    changed: Dict[str, List[Any]] = {}

    def shown(value: Any) -> Any:
        if isinstance(value, (list, tuple, np.ndarray)):  # matryoshka_dimensions
            return [shown(entry) for entry in np.asarray(value).tolist()]
        return float(np.format_float_positional(np.float32(value), trim="-")) if isinstance(value, float) else value

    def walk(old: Mapping[str, Any], new: Mapping[str, Any], old_named: Mapping[str, Any],
             new_named: Mapping[str, Any], path: str) -> None:
        for name, value in new.items():
            if isinstance(value, Mapping):
                walk(old.get(name) or {}, value, old_named.get(name) or {}, new_named[name], f"{path}.{name}")
            elif shown(value) not in (None, 0, [], "") and name in old and shown(value) != shown(old[name]):
                changed[f"{path}.{name}"] = [shown(old_named[name]), shown(new_named[name])]

    walk(was, now, was_named, now_named, "trainer")
    return changed


def cursor_path(checkpoint: str) -> str:
    """Where older versions wrote a checkpoint's cursor: `step-N.safetensors` had `step-N.cursor.json`."""
    return checkpoint[: -len(".safetensors")] + ".cursor.json"


def checkpoints_in(folder: str) -> List[Tuple[int, str]]:
    """(step, path) of every checkpoint, oldest first. Each is whole: the library writes it beside its
    name and renames it into place, cursor and all."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        match = _CHECKPOINT.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(folder, name)))
    return sorted(found)


def shards_digest(shards: Sequence[str]) -> str:
    """What a note keeps of the cursor's list of shards, which for a large dataset outgrows a note."""
    return "sha256:" + hashlib.sha256(json.dumps(list(shards)).encode()).hexdigest()


def shard_files(shards: Sequence[str]) -> Tuple[str, str]:
    """(the folder the shards share, a digest of each one's path below it and its size): what stays when the
    data moves to another folder or mount, so a run can resume over the same files there. A shard that is a
    folder counts its entries as its size."""
    if not shards:
        return "", ""
    common = os.path.commonpath([os.path.dirname(os.path.abspath(path)) for path in shards])
    files = []
    for path in shards:
        try:
            size = len(os.listdir(path)) if os.path.isdir(path) else os.path.getsize(path)
        except OSError:
            size = None
        files.append([os.path.relpath(os.path.abspath(path), common), size])
    return common, "sha256:" + hashlib.sha256(json.dumps(files).encode()).hexdigest()


def save_checkpoint(trainer: uform.Trainer, folder: str, step: int, cursor: Dict[str, Any], keep: int) -> str:
    """Saves the checkpoint with the step and the stream's cursor in its note, then deletes all but the
    newest `keep`."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step-{step:09d}.safetensors")
    common, files = shard_files(cursor["shards"])
    written = dict(step=step, cursor=dict(cursor, shards=shards_digest(cursor["shards"])), files=files, data=common)
    trainer.save(path, note=json.dumps(written))
    for _, old in checkpoints_in(folder)[:-keep]:
        os.remove(old)
        if os.path.exists(cursor_path(old)):  # an older version's, beside its checkpoint
            os.remove(cursor_path(old))
    return path


def written_cursor(written: Any) -> Optional[Dict[str, Any]]:
    """The cursor of `written`, a note's JSON, where it has exactly the shape `save_checkpoint` writes
    (`{"step": N, "cursor": {...}}`, every key of a stream's cursor and no other, and since this version where
    the shards were, `files` and `data`); None for anything else: a note of someone else's is its own text,
    whatever its JSON holds."""
    def count(value):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(written, dict) or set(written) not in ({"step", "cursor"}, {"step", "cursor", "files", "data"}):
        return None
    if not count(written["step"]) or not all(isinstance(written.get(name, ""), str) for name in ("files", "data")):
        return None
    cursor = written["cursor"]
    if not isinstance(cursor, dict) or set(cursor) != set(CURSOR_KEYS):
        return None
    shards = cursor["shards"]
    listed = isinstance(shards, list) and all(isinstance(entry, str) for entry in shards)
    if not all(count(value) for name, value in cursor.items() if name != "shards") or not (
            listed or isinstance(shards, str) and shards.startswith("sha256:")):
        return None
    return cursor


def stream_cursor(checkpoint: str, note: Optional[str]) -> Optional[Dict[str, Any]]:
    """The stream's cursor a checkpoint carries in its `note`, or an older version wrote beside it; None
    when it has neither, as one written by `Trainer.save` by hand, whatever its note says."""
    try:
        written = json.loads(note) if note else None
    except ValueError:  # a note of someone else's
        written = None
    cursor = written_cursor(written)
    if cursor is None and os.path.isfile(cursor_path(checkpoint)):
        try:
            with open(cursor_path(checkpoint), encoding="utf-8") as file:
                cursor = written_cursor(json.load(file))
        except ValueError:
            cursor = None
    return cursor


def read_header(path: str, field_path: str = "CHECKPOINT") -> Tuple[Dict[str, str], Dict[str, Any]]:
    """A safetensors file's `__metadata__` and its tensors' entries (dtype, shape, data_offsets); errors
    name `field_path`, the argument or config field that gave the path."""
    try:  # the C library's reader's checks, in its words, so that every command says the same of one file
        with open(path, "rb") as file:
            size, head = os.fstat(file.fileno()).st_size, file.read(8)
            if len(head) != 8:
                raise InvalidArgument(f"{field_path}: {path} is {size} bytes, too short for a safetensors header's "
                                      f"8-byte length")
            (length,) = struct.unpack("<Q", head)
            if length > size - 8:
                raise InvalidArgument(f"{field_path}: {path} claims a header of {length} bytes, but only {size - 8} "
                                      f"bytes follow its length")
            if not 2 <= length <= 64 << 20:
                raise InvalidArgument(f"{field_path}: {path} claims a header of {length} bytes; a header takes 2 "
                                      f"bytes to 64 MiB")
            try:
                header = json.loads(file.read(length))
            except ValueError as error:
                raise InvalidArgument(f"{field_path}: {path}: its header is no JSON: {error}") from None
    except OSError as error:
        raise InvalidArgument(f"{field_path}: {path}: {error.strerror or error}") from None
    metadata = header.pop("__metadata__", {}) or {}
    return metadata, header


# ---------------------------------------------------------------------------------------------- #
#  Evaluation                                                                                      #
# ---------------------------------------------------------------------------------------------- #


@dataclass
class HeldOut:
    """Query and target items of the held-out records, and the bad ones passed over."""

    names: Tuple[str, str]
    modalities: Tuple[Modality, Modality]
    queries: List[Any]
    targets: List[Any]
    bad_records: List[str]
    locations: List[str] = field(default_factory=list)
    said_cut: bool = False  # whether the run has said that items were cut to a row

    def drop(self, record: int) -> None:
        del self.queries[record], self.targets[record], self.locations[record]
        if len(self.queries) < 2:
            raise InvalidArgument(f"evaluation.paths: {len(self.queries)} usable records left; retrieval needs at "
                                  f"least two; the bad ones: {'; '.join(self.bad_records[:3])}")


def read_held_out(evaluation: Evaluation) -> HeldOut:
    dataset = Dataset(paths=evaluation.paths, columns=evaluation.columns, format=evaluation.format)
    check_schema(dataset, list_shards(dataset, "evaluation"), "evaluation")
    names = tuple(dataset.columns)
    queries, targets, bad, locations = [], [], [], []
    for location, values, folder in records(dataset, path="evaluation"):
        if len(queries) == evaluation.max_records:
            break
        try:
            group = load_media(make_group(dataset, location, values, folder))
        except BadRecord as error:
            bad.append(str(error))
            continue
        queries.append(group.items[0][1])
        targets.append(group.items[1][1])
        locations.append(location)
    if len(queries) < 2:
        why = f"; {len(bad)} bad, the first: {'; '.join(bad[:3])}" if bad else ""
        raise InvalidArgument(f"evaluation.paths: {len(queries)} usable records; retrieval needs at least two{why}")
    return HeldOut(names, tuple(dataset.columns.values()), queries, targets, bad, locations)


TIE = 1e-6  # scores this close to a query's own target's tie with it: alike items differ by rounding alone


def retrieval(queries: np.ndarray, targets: np.ndarray) -> Dict[str, float]:
    """Recall@1, recall@10 and the mean reciprocal rank of each query's own target among all targets, expected
    over the orders of the targets that tie with it (within `TIE`): a model that cannot tell n items apart
    scores as chance does among them, never as if it could."""
    scores = queries @ targets.T
    own = np.diagonal(scores)[:, None]
    above = (scores > own + TIE).sum(axis=1)
    tied = (np.abs(scores - own) <= TIE).sum(axis=1)  # itself included: its rank is any of above .. above + tied - 1

    def recall(k: int) -> float:
        return float(np.clip((k - above) / tied, 0.0, 1.0).mean())

    reciprocal = [np.mean(1.0 / np.arange(a + 1, a + t + 1)) for a, t in zip(above, tied)]
    return {"recall@1": recall(1), "recall@10": recall(10), "mrr": float(np.mean(reciprocal))}


def evaluate(trainer: uform.Trainer, executor: uform.Executor, folder: str, held_out: HeldOut,
             refuse: bool = False, mesh: Optional[uform.Mesh] = None) -> Tuple[Optional[Dict[str, Dict]], List[str]]:
    """Retrieval both ways with the trainer's weights as they are, through a weights-only copy, and the
    held-out records the library refused this time (an item it cannot decode). Such a record is dropped
    from `held_out` for good and the embedding retried; under `refuse` it stops the run, named. On a
    `mesh` of several processes each embeds its share of the records (every host_domain_count-th, from
    its index) and host domain 0 alone scores them: the others answer None for the metrics."""
    path = os.path.join(folder, "evaluation.safetensors")
    trainer.save(path, weights_only=True)  # on a mesh, host domain 0 writes it
    index, count = (mesh.host_domain_index, mesh.host_domain_count) if mesh is not None else (0, 1)
    if count > 1:
        mesh.gather(b"")  # the others read it once it is written
    kept, dropped = list(range(index, len(held_out.queries), count)), []
    queries = targets = np.zeros((0, 0), np.float32)
    with uform.Encoder.load(path, executor) as encoder:
        while kept:
            side = 0
            try:
                queries = encoder.embed([held_out.modalities[0]] * len(kept), [held_out.queries[r] for r in kept])
                side = 1
                targets = encoder.embed([held_out.modalities[1]] * len(kept), [held_out.targets[r] for r in kept])
                cut = queries.truncated_items + targets.truncated_items
                if cut and not held_out.said_cut:  # once a run: the log's steps count the training data's
                    held_out.said_cut = True
                    print(f"uform: evaluation: {cut} held-out items are longer than a row and were cut to it; items "
                          "cut to one text tie, and score as chance among them", file=sys.stderr)
                queries, targets = queries.to_float32(), targets.to_float32()
                break
            except (InvalidArgument, Unsupported) as error:  # Unsupported: an item in a format this build lacks
                found = refused_item(error)
                if found is None:
                    raise
                item, why = found
                message = f"{held_out.locations[kept[item]]}: {held_out.names[side]!r}: {why}"
                if refuse:
                    raise BadRecord(message) from None
                dropped.append((kept.pop(item), message))
    shares = [(kept, dropped, queries, targets)]
    if count > 1:
        shares = [_share_read(part) for part in mesh.gather(_share_written(*shares[0]))]
    # Every process drops every share's bad records alike, so that the next evaluation splits one list.
    messages = [message for share in shares for _, message in share[1]]
    for record in sorted((record for share in shares for record, _ in share[1]), reverse=True):
        held_out.drop(record)
    held_out.bad_records.extend(messages)
    if index:
        return None, messages
    order = np.argsort(np.concatenate([np.asarray(share[0], np.int64) for share in shares]), kind="stable")
    queries, targets = (np.concatenate([share[k] for share in shares if len(share[0])])[order] for k in (2, 3))
    forward, backward = held_out.names, held_out.names[::-1]
    return {f"{forward[0]}->{forward[1]}": retrieval(queries, targets),
            f"{backward[0]}->{backward[1]}": retrieval(targets, queries)}, messages


def _share_written(kept: List[int], dropped: List[Tuple[int, str]], queries: np.ndarray, targets: np.ndarray) -> bytes:
    """One process's share of an evaluation as bytes: a JSON header's length and the header, then the embeddings."""
    header = json.dumps(dict(kept=kept, dropped=dropped, shape=list(queries.shape))).encode()
    return struct.pack("<Q", len(header)) + header + queries.astype("<f4").tobytes() + targets.astype("<f4").tobytes()


def _share_read(part: bytes) -> Tuple[List[int], List[Tuple[int, str]], np.ndarray, np.ndarray]:
    (length,) = struct.unpack_from("<Q", part)
    header = json.loads(part[8:8 + length])
    shape, values = tuple(header["shape"]), np.frombuffer(part, "<f4", offset=8 + length).astype(np.float32)
    half = values.size // 2
    return (header["kept"], [tuple(entry) for entry in header["dropped"]], values[:half].reshape(shape),
            values[half:].reshape(shape))


# ---------------------------------------------------------------------------------------------- #
#  uform train                                                                                     #
# ---------------------------------------------------------------------------------------------- #


def open_executor(device: str, threads: Optional[int], names: Tuple[str, str] = ("run.device", "run.threads")):
    """(executor, the trainer's init) on a GPU when asked or, for "auto", when this build and machine have one.
    Errors name the device and the threads as `names` gives them: config fields, or `uform embed`'s options."""
    if device != "cpu":
        if "vram" in uform.capabilities():
            try:
                executor = uform.Executor.for_vram()
            except Unsupported:
                if device == "gpu":
                    raise
            else:
                if threads is not None:  # said, not refused: the same config runs on a machine without a GPU too
                    print(f"uform: {names[1]}: {threads} applies to the CPU only; this run uses the GPU, so it is "
                          "ignored", file=sys.stderr)
                return executor, uform.Trainer.init_vram
        elif device == "gpu":
            raise Unsupported(f"{names[0]}: 'gpu', but this build or machine has no GPU (uform.capabilities() lacks 'vram')")
    try:
        executor = uform.Executor.for_ram(threads=threads)
    except InvalidArgument as error:  # the library names its argument `threads`
        raise type(error)(re.sub(r"^threads: ", f"{names[1]}: ", str(error))) from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if threads and threads > cores:  # allowed, as the library allows it, but never faster
        print(f"uform: {names[1]}: {threads} threads on the {cores} cores this process may use; more threads than "
              "cores make each step slower, not faster", file=sys.stderr)
    return executor, uform.Trainer.init_ram


class _Stop:
    """SIGINT and SIGTERM ask the run to stop after the step in flight, saying so and what a second one would lose;
    the second, of either kind, ends the process at once by the system's default action, even inside a step or a
    save, where no Python handler would run until it returned. While the processes of a mesh meet, with no step to
    finish, the first one ends the wait for the others."""

    def __init__(self) -> None:
        self.signal: Optional[int] = None
        self.meeting = False
        self.finishing = "the step in flight"  # what the first signal lets end before the run stops
        self._previous = {number: signal.signal(number, self._ask) for number in (signal.SIGINT, signal.SIGTERM)}

    def _ask(self, number: int, frame: Any) -> None:
        self.signal = number
        for either in self._previous:
            signal.signal(either, signal.SIG_DFL)
        # Written to the descriptor: the handler may run while this thread is inside a write to sys.stderr.
        # On a terminal, on a line of its own: the progress bar's line has no end yet.
        os.write(2, (("\n" if os.isatty(2) else "") + f"uform: {signal.Signals(number).name}: stopping after "
                     f"{self.finishing}; a second signal stops at once, without saving what the first would\n").encode())
        if self.meeting:
            uform.Mesh.abandon()

    @contextlib.contextmanager
    def during(self, what: str) -> Iterator[None]:
        """Says, to a signal meanwhile, that the run stops once `what` has ended."""
        before, self.finishing = self.finishing, what
        try:
            yield
        finally:
            self.finishing = before

    def restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def step_scalars(stats: uform.Stats) -> Tuple[Dict[str, Any], Dict[str, float]]:
    """Every field a step reports but its number: as they are for `log.jsonl` (a term that did not run
    reads NaN, written null), and as TensorBoard tags: each loss under `loss/`, the counts under `batch/`,
    the per-group temperatures under `contrastive/`, times under `time/`; TensorBoard keeps the finite."""
    record, scalars = {}, {}
    for name, value in dict(stats).items():
        if name == "step":
            continue
        record[name] = value
        if isinstance(value, list):  # one per temperature group
            singular = {"inverse_temperatures": "inverse_temperature", "biases": "bias"}.get(name, name)
            scalars.update({f"contrastive/{singular}/{group}": entry for group, entry in enumerate(value)})
        elif name.endswith("loss"):
            scalars[f"loss/{name}"] = value
        elif name.endswith("seconds"):
            scalars[f"time/{name}"] = value
        elif name in ("learning_rate", "grad_norm"):
            scalars[name] = value
        else:
            scalars[f"batch/{name}"] = float(value)
    return record, scalars


# The library and the Python face name the trainer's config `config` (`config.schedule.learning_rate: ...`),
# as a Python or C caller passes it; a TOML file names it `[trainer]`. A field path, not a file's name.
_TRAINER_FIELD = re.compile(r"(?<![\w./-])config\.(?=(?:%s)\b)"
                            % "|".join(f.name for f in dataclasses.fields(TrainerConfig)))


def as_toml_names(error: Error) -> Error:
    """`error` with the trainer's fields named as the TOML config names them; itself where it names none."""
    message = _TRAINER_FIELD.sub("trainer.", str(error))
    return error if message == str(error) else type(error)(message)


def train(config_path: str, host_domain_index: int = 0) -> int:
    try:
        return _train(config_path, host_domain_index)
    except Error as error:
        renamed = as_toml_names(error)
        if renamed is error:
            raise
        raise renamed from None


def _loader_reason(error: Error, path: str) -> str:
    """The library's message about the file at `path` without its leading `path: PATH`: `PATH: reason`
    becomes `reason`, `PATH is 4 bytes, ...` becomes `it is 4 bytes, ...`."""
    message = str(error)
    named = "path: " + path
    if message.startswith(named + ": "):
        return message[len(named) + 2:]
    return "it" + message[len(named):] if message.startswith(named + " ") else message


def _without_newest(complete: List[Tuple[int, str]], saved_in: str) -> str:
    """What moving the newest checkpoint out of `saved_in` leads to, with any unreadable ones just before it."""
    older, unreadable = complete[:-1], []
    while older:
        try:
            uform.checkpoint_note(older[-1][1])
            break
        except InvalidArgument:
            unreadable.insert(0, os.path.basename(older.pop()[1]))
    moved = f"it and the unreadable {', '.join(unreadable)}" if unreadable else "it"
    if not older:
        return f"move {moved} out of {saved_in} to start the run over: no older readable checkpoint is there"
    before = "" if unreadable else ", the one before it"
    return f"move {moved} out of {saved_in} to resume from {os.path.basename(older[-1][1])}{before}"


_DECODERS = {"jpg": "jpeg", "jpeg": "jpeg", "png": "png", "webp": "webp", "wav": "wav", "flac": "flac", "mp3": "mp3",
             "ogg": "ogg", "mp4": "mp4", "webm": "webm", "mkv": "mkv"}  # a file extension: the decoder it needs


def _say_undecodable(columns: Mapping[str, Modality], field_path: str) -> None:
    """Says which of a folder's or tar shard's media extensions this build cannot decode: such files are bad
    records, each named when it is met."""
    built = uform.capabilities()
    for column, modality in columns.items():
        lacking = [name for name in column.lower().split(";") if name in _DECODERS and _DECODERS[name] not in built]
        if modality != Modality.TEXT and lacking:
            print(f"uform: {field_path}.{column}: this build decodes no {', '.join(lacking)} (uform.capabilities() "
                  "lacks it); such files are bad records", file=sys.stderr)


def _train(config_path: str, index: int) -> int:
    config = load_config(config_path)
    _say_undecodable(config.data.columns, "data.columns")
    if config.evaluation is not None:
        _say_undecodable(config.evaluation.columns, "evaluation.columns")
    count = config.mesh.host_domain_count
    if index >= count:
        raise InvalidArgument(f"--host-domain-index (or $UFORM_HOST_DOMAIN_INDEX): {index} is not below "
                              f"mesh.host_domain_count = {count}")
    folder = config.run.folder
    saved_in = os.path.join(folder, "checkpoints")
    trainer_config = dict(config.trainer)
    steps = trainer_config["schedule"]["steps"]
    if not steps:
        raise InvalidArgument("trainer.schedule.steps: 0; a run takes at least one step")
    cursor, step = None, 0
    complete = checkpoints_in(saved_in)
    if complete:
        step, latest = complete[-1]
        try:
            note = uform.checkpoint_note(latest)
        except InvalidArgument as error:
            # Refused rather than passed over: resuming from an older one would silently redo finished work.
            raise InvalidArgument(f"the run's newest checkpoint {latest} is unreadable ({_loader_reason(error, latest)}); "
                                  + _without_newest(complete, saved_in)) from None
        cursor = stream_cursor(latest, note)
        if cursor is None:
            # Refused rather than resumed with the data from its start: every checkpoint this command writes
            # carries its cursor, so one without was saved by hand, or by an older version that stopped before
            # it wrote the cursor beside it; a resumed run continues its stream exactly or not at all.
            raise InvalidArgument(f"{latest}: no stream cursor in its note (nor in {os.path.basename(cursor_path(latest))} "
                                  f"beside it), so its data cannot continue where it stopped; move it out of {saved_in} "
                                  f"to resume from the one before it, or start a new run from it with [trainer] resume")
        listed = [path for path, _ in list_shards(config.data)]
        written = None
        common, files = shard_files(listed)
        with contextlib.suppress(ValueError):  # an older version's cursor beside a note of another kind
            written = json.loads(note or "{}")
        kept = written.get("files") if isinstance(written, dict) else None  # none: the stream names what differs
        if cursor.get("shards") == shards_digest(listed):  # the stream checks the list itself
            cursor["shards"] = listed
            if files and kept and kept != files:  # allowed: a refused record is mended in place
                print(f"uform: data.paths: a shard's size changed since step {step} was saved (a record mended or "
                      "added in place?); the stream resumes at the same record numbers, so a record added or removed "
                      "before where it stopped shifts what it reads next", file=sys.stderr)
        else:  # the same files, moved to another folder or mount, resume there
            if files and kept and kept != files:
                names = [os.path.relpath(os.path.abspath(path), common) for path in listed]
                named = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                raise InvalidArgument(
                    f"data.paths: {'the shard' if len(listed) == 1 else f'the {len(listed)} shards'} listed now ({named} "
                    f"below {common}) {'is' if len(listed) == 1 else 'are'} not the files step {step} was read from "
                    f"(below {written.get('data')}, their names and sizes kept as a digest): a resumed run reads the same "
                    "files, by name below their folder, size and order, wherever they lie now (only a file left where "
                    "it was may change size, as a mended record does); to train on other data, "
                    f"start a new run from {latest}: in a new run.folder, with [trainer] resume, its data starts over")
            if files and kept:
                these = "the shard" if len(listed) == 1 else f"the {len(listed)} shards"
                print(f"uform: data.paths: {these} read from {written.get('data')} {'is' if len(listed) == 1 else 'are'} "
                      f"in {common} now, of the same size{'s' if len(listed) != 1 else ''}; the stream resumes there",
                      file=sys.stderr)
                cursor["shards"] = listed
        given = trainer_config.get("resume")
        if given and os.path.abspath(given) != os.path.abspath(latest):
            how = (f"to resume from it, move the checkpoints after it out of {saved_in}"
                   if os.path.dirname(os.path.abspath(given)) == os.path.abspath(saved_in)
                   else "to start another run from it, give that run a new run.folder")
            print(f"uform: trainer.resume {given} is passed over: {folder} holds checkpoints, and a run resumes from "
                  f"its newest, {latest}; {how}", file=sys.stderr)
        trainer_config["resume"] = latest
    elif trainer_config.get("resume"):
        if not os.path.isfile(trainer_config["resume"]):
            raise InvalidArgument(f"trainer.resume: {trainer_config['resume']}: no such file")
        given = trainer_config["resume"]
        metadata = read_header(given, "trainer.resume")[0]
        if metadata.get("weights_only") == "true":  # said first: no schedule.steps makes it a run to resume
            raise InvalidCheckpoint(f"trainer.resume: {given} is a weights-only checkpoint: it holds no optimizer "
                                    "moments, so no run resumes from it; resume from a whole checkpoint (saved "
                                    "without weights_only), or load this one for inference with uform embed")
        step = int(metadata.get("step", 0))  # another run's weights: the data starts over
    if step >= steps and complete and config.evaluation is not None and step not in evaluated_steps(folder):
        # A signal during the last step stops the run before its final evaluation: this run makes it, training nothing.
        print(f"uform: {folder} is at step {step}, done training, but its log holds no evaluation of that step (the "
              "run stopped before it); evaluating it now", file=sys.stderr)
    elif step >= steps:
        check_schema(config.data, list_shards(config.data))  # a run with nothing to train still checks its config
        source = folder if complete else f"trainer.resume {trainer_config['resume']}"
        done = (f"already took its {steps} steps" if step == steps
                else f"is at step {step}, past the {steps} steps its config asks for")
        print(f"uform: {source} {done}; raise trainer.schedule.steps above {step} to train on")
        return 0
    # SIGINT and SIGTERM from here on stop the run cleanly, even before its first step.
    stop = _Stop()
    try:
        # The stream first: it checks the schema before the trainer is built, then reads ahead while it is.
        with Stream(config.data, trainer_config, process_index=index, process_count=count, cursor=cursor) as stream, \
                contextlib.ExitStack() as holding:
            if count > 1 and not index:  # host domain 0 holds the folder before the others meet it there
                _made(folder)
                holding.enter_context(_held(folder))
            held_out = read_held_out(config.evaluation) if config.evaluation else None
            executor, init = open_executor("cpu" if count > 1 else config.run.device, config.run.threads)
            with executor, _joined(config, executor, index, stop, len(stream.shards)) as mesh, \
                    init(executor, trainer_config, mesh) as trainer:
                stream.decode_ahead(trainer.decode)
                try:
                    _made(folder)  # only now that the library took the config too
                    if not index:  # host domain 0 saves: a checkpoints folder it cannot make fails now, not after steps
                        _made(saved_in, folder)
                    with _held(folder) if count == 1 else contextlib.nullcontext():
                        return _train_loop(config, trainer, executor, stream, held_out, step, steps,
                                           trainer_config.get("resume"), cursor, stop, mesh)
                finally:
                    stream.close()  # its thread may be decoding with the trainer, which must be idle to be freed
    except _Stopped:
        print(f"uform: stopped by {signal.Signals(stop.signal).name} while the mesh's processes met; nothing saved "
              "yet", file=sys.stderr)
        return 128 + stop.signal
    finally:
        stop.restore()


def evaluated_steps(folder: str) -> set:
    """The steps the run's `log.jsonl` in `folder` holds an evaluation of; none where there is no log. A line cut
    short by a hard kill is passed over."""
    found = set()
    try:
        with open(os.path.join(folder, "log.jsonl"), encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if '"evaluation": ' not in line:  # most lines are steps: not parsed
                    continue
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and "evaluation" in record:
                        found.add(record.get("step"))
    except FileNotFoundError:
        pass
    return found


def _made(folder: str, within: Optional[str] = None) -> None:
    """Makes `folder`, the run folder or one `within` it, refused as the run folder's failure."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as error:
        raise _unusable_folder(within or folder, error) from None


@contextlib.contextmanager
def _held(folder: str) -> Any:
    """Holds the run folder while this run trains (an advisory lock on `folder/.lock`, naming its holder), so that a
    second `uform train` of the same folder is refused rather than let two runs write one run's files."""
    import fcntl
    import socket

    try:
        holder = open(os.path.join(folder, ".lock"), "a+", encoding="utf-8")
    except OSError as error:
        raise _unusable_folder(folder, error) from None
    with holder:
        try:
            fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder.seek(0)
            who = holder.read().strip() or "a process"
            raise InvalidArgument(f"run.folder: {folder} is in use by another `uform train` ({who}); wait for it to "
                                  "end, or give this run another folder") from None
        holder.seek(0), holder.truncate()
        holder.write(f"process {os.getpid()} on {socket.gethostname()}")
        holder.flush()
        yield  # closing the file lets go of the lock


def _joined(config: TrainConfig, executor: uform.Executor, index: int, stop: "_Stop", shards: int) -> Any:
    """This process's place in the run's mesh, once every process is found to run the same config, or a `with`
    block of None for a process alone."""
    mesh = config.mesh
    if mesh.host_domain_count == 1:
        return contextlib.nullcontext()
    if os.path.exists(mesh.directory) and not os.path.isdir(mesh.directory):
        raise InvalidArgument(f"mesh.directory: {mesh.directory} is not a folder")
    try:
        os.makedirs(mesh.directory, exist_ok=True)
    except OSError as error:
        raise InvalidArgument(f"mesh.directory: {mesh.directory}: {error.strerror or error}") from None
    print(f"uform: host domain {index} of {mesh.host_domain_count} waits up to {mesh.timeout_minutes or 5:g} min "
          f"for the others to meet in {os.path.join(mesh.directory, mesh.job)}", file=sys.stderr, flush=True)
    stop.meeting = True
    try:
        joined = uform.Mesh.bootstrap(executor, index, mesh.host_domain_count, mesh.directory, mesh.job,
                                      timeout=60 * mesh.timeout_minutes)
    except InvalidArgument as error:  # named as this command's config names the library's arguments
        message = re.sub(r"^(directory|job|timeout)\b", lambda m: f"mesh.{m.group(1)}", str(error))
        raise InvalidArgument(re.sub(r"^host_domain_index\b", "--host-domain-index", message)) from None
    except PeerError as error:
        if stop.signal is None:  # a wait past the library's `timeout` is one past this command's field
            raise PeerError(re.sub(r"^timeout:", "mesh.timeout_minutes:", str(error))) from None
        raise _Stopped() from None
    finally:
        stop.meeting = False
    try:
        _agreed(joined, config, shards)
    except BaseException:
        joined.free()
        raise
    return joined


def _agreed(mesh: uform.Mesh, config: TrainConfig, shards: int) -> None:
    """Every process of a mesh reads one sequence of the data and evaluates alike: the fields of `[data]` and
    `[evaluation]` that shape them (the library compares `[trainer]`), and the number of shards, are the same on
    every process, or every process refuses the run naming the first that differs. Paths may differ, as mounts do."""
    facts = {f"data.{name}": value for name, value in dataclasses.asdict(config.data).items()
             if name not in ("paths", "prefetch")}
    facts["data.paths"] = f"{shards} shards"
    if config.evaluation is not None:
        facts.update({f"evaluation.{name}": getattr(config.evaluation, name)
                      for name in ("columns", "format", "every_steps", "max_records")})
    written = json.dumps(facts, sort_keys=True, default=str)
    parts = [json.loads(part) for part in mesh.gather(written.encode())]
    for name in sorted(set().union(*parts)):
        values = [part.get(name) for part in parts]
        for other, value in enumerate(values):
            if value != values[0]:
                raise InvalidArgument(f"{name}: {values[0]!r} on host domain 0, {value!r} on host domain {other}; "
                                      "every process of a mesh trains one run from one config")


class _Stopped(Exception):
    """A signal ended the wait for a mesh's peers, before any step."""


def _unusable_folder(folder: str, error: OSError) -> InvalidArgument:
    """`error`, met making or writing into the run folder, named as the config field that gave it."""
    if isinstance(error, FileExistsError):  # a file stands where a folder of the run goes
        return InvalidArgument(f"run.folder: {folder}: a file, not a folder, stands at {error.filename or folder}; "
                               "move it, or name another run.folder")
    where = f" ({error.filename})" if error.filename and error.filename != folder else ""
    return InvalidArgument(f"run.folder: {folder}: {error.strerror or error}{where}")


def _train_loop(config, trainer, executor, stream, held_out, step, steps, resumed, cursor, stop, mesh) -> int:
    import tqdm  # only the command draws a bar

    every, saved_in = config.checkpoints, os.path.join(config.run.folder, "checkpoints")
    index = mesh.host_domain_index if mesh is not None else 0
    try:  # host domain 0 keeps the run's log and its TensorBoard events; the others a log of their own
        log = RunLog(config.run.folder) if not index else RunLog(config.run.folder, f"log.host-domain-{index}.jsonl",
                                                                 events=False)
    except OSError as error:  # a folder that exists but takes no files
        raise _unusable_folder(config.run.folder, error) from None
    changed = resume_changes(resumed, config.trainer) if resumed else {}
    if resumed:  # a change is allowed, as raising `steps` is; said, so that none goes unnoticed
        print(f"uform: resuming {resumed}" + (" with " if changed else "") + ", ".join(
            f"{name} = {now} (was {was})" for name, (was, now) in changed.items()), file=sys.stderr)
    log.write(dict(step=step, started=os.path.abspath(config.path), device=executor.kind, resumed=resumed,
                   **(dict(changed=changed) if changed else {}),
                   **(dict(host_domain=index, host_domains=mesh.host_domain_count) if mesh is not None else {})))
    if held_out and held_out.bad_records:
        log.write(dict(step=step, held_out_bad_records=held_out.bad_records))
        if not index:  # the recall printed later is over the records left
            count = len(held_out.bad_records)
            print(f"uform: evaluation.paths: {count} bad record{'s' if count != 1 else ''} left out of the evaluation, "
                  f"the first: {held_out.bad_records[0]} (all in log.jsonl)", file=sys.stderr)
    unusable = UnusableEpochs([path for path, _ in stream.shards], cursor)
    saved_step, saved_time, cursor, bad = step, time.monotonic(), None, 0
    distinct = set()  # each bad record once, though every epoch meets it again
    evaluated_step = None
    bar = tqdm.tqdm(total=steps, initial=step, unit="step", dynamic_ncols=True, disable=True if index else None)
    # On a GPU one step stays in flight while the next batch is read and begun, so the device goes from one step to
    # the next; before a checkpoint, an evaluation, a stop or the last step the run waits for it to land. A mesh's
    # processes wait for every step, as they agree on each, and a CPU's step has run whole once begun.
    flight, landed_at = None, time.perf_counter()  # the step begun and not landed: (Deferred, data s, begun at, ended)
    overlaps = _steps_overlap(executor)
    cut = False  # whether the run has said that items were cut to a row

    def land() -> None:
        nonlocal flight, step, landed_at, cut
        deferred, data_seconds, began, ended = flight
        flight = None
        stats = deferred.wait().stats
        at, wall = ended[0] if ended else (time.perf_counter(), time.time())  # its callback may not have run yet
        step_seconds, landed_at = at - max(began, landed_at), at  # this step's own time, whichever ran it
        step = stats.step
        record, scalars = step_scalars(stats)
        log.write(dict(step=step, **record, data_seconds=data_seconds, step_seconds=step_seconds),
                  {**scalars, "time/data_seconds": data_seconds, "time/step_seconds": step_seconds,
                   "tokens_per_second": stats.tokens / max(step_seconds, 1e-9)}, at=wall)
        if stats.truncated_items and not cut:  # said once; the log counts them at every step
            cut = True
            bar.write(f"uform: step {step}: {stats.truncated_items} items longer than a row (trainer.batch."
                      "max_columns_per_row) were cut to it; log.jsonl counts them at each step (truncated_items)",
                      file=sys.stderr)
        bar.set_postfix(loss=f"{stats.loss:.3f}", data=f"{data_seconds / max(data_seconds + step_seconds, 1e-9):.0%}",
                        bad=bad, refresh=False)
        bar.update(step - bar.n)

    def saving(after: int) -> bool:
        minutes = bool(every.every_minutes) and time.monotonic() - saved_time >= 60 * every.every_minutes
        return bool((every.every_steps and after % every.every_steps == 0) or minutes) and not index

    def evaluating(after: int) -> bool:
        return bool(held_out and config.evaluation.every_steps and after % config.evaluation.every_steps == 0)

    try:
        several = mesh is not None and mesh.host_domain_count > 1
        while step + (flight is not None) < steps and (several or stop.signal is None):
            waiting = time.perf_counter()
            batch = next(stream)
            data_seconds = time.perf_counter() - waiting
            stopping, idle = _agree(stop, mesh, batch)
            if stopping:
                break  # before the batch: the cursor saved is the one before it
            bad_before, ahead = bad, step + (flight is not None)  # the step this batch follows, if all apply
            after_batch = batch.cursor  # the cursor once this batch is taken: not before, in case it is refused
            began = time.perf_counter()
            deferred, batch, refused = _step(config, trainer, stream, batch, mesh, idle)
            cursor = after_batch
            for message in batch.bad_records:
                log.write(dict(step=ahead, bad_record=message))
            reasons = list(batch.bad_records)
            if refused is not None:
                log.write(dict(step=ahead, refused_batch=refused, locations=batch.locations))
                reasons.append(f"the batch of {batch.locations[0]} and {len(batch.locations) - 1} more: {refused}")
            bad += len(batch.bad_records) + (len(batch.locations) if refused is not None else 0)
            distinct.update(batch.bad_records + (batch.locations if refused is not None else []))
            unusable.note(cursor, deferred is not None, bad - bad_before, reasons)
            if deferred is None:
                continue
            if flight is not None:
                land()  # the one ahead, now that this one is queued behind it
            ended = []  # when the worker finished it: a CPU runs a step whole as it begins, a GPU when it lands
            deferred.add_done_callback(lambda _, ended=ended: ended.append((time.perf_counter(), time.time())))
            flight = (deferred, data_seconds, began, ended)
            after = step + 1  # every step before this one has landed: this one's number, if it applies
            # A CPU has run the step whole as it began: it lands now, so the log and the bar keep up.
            if overlaps and not (several or stop.signal is not None or after >= steps or saving(after) or evaluating(after)):
                continue
            land()
            if saving(step):
                save_checkpoint(trainer, saved_in, step, cursor, every.keep)  # host domain 0 writes for all
                saved_step, saved_time = step, time.monotonic()
            if evaluating(step):
                bar.set_description_str("evaluating")  # the bar stands still meanwhile: said so
                with stop.during(f"the evaluation of step {step}, under way"):
                    _evaluate(trainer, executor, config, held_out, log, step, mesh)
                bar.set_description_str("")
                evaluated_step = step
        if flight is not None:
            land()
    except BadRecord as error:  # under bad_records = "refuse": what trained before the record is kept
        if flight is not None:
            land()
        raise _refused(config, trainer, log, error, step, cursor, saved_step, mesh) from None
    except BaseException as error:
        if flight is not None:  # the step ahead trained: its line is logged before the error ends the run
            with contextlib.suppress(Exception):
                land()
        if isinstance(error, uform.Error):  # the reason, where an unattended run's stderr may be lost
            with contextlib.suppress(Exception):
                log.write(dict(step=step, error=f"{type(error).__name__}: {error}"))
        raise
    finally:
        bar.close()
    with log:
        return _finish(config, trainer, executor, held_out, log, stop, step, cursor, saved_step, evaluated_step,
                       (bad, len(distinct)), mesh)


def _flags(mesh: uform.Mesh, mine: bytes) -> List[bytes]:
    """Every process's flags, as long as this process's: a part of another length means the processes called
    different verbs, and the run cannot go on."""
    parts = mesh.gather(mine)
    if any(len(part) != len(mine) for part in parts):
        raise PeerError("mesh: the processes are out of step (one is not where this one agrees on the next step); "
                        "every process of a run must run the same `uform train` version and config")
    return parts


def _agree(stop: "_Stop", mesh: Optional[uform.Mesh], batch: Any) -> Tuple[bool, bool]:
    """(whether to stop before this batch, whether every process must let the step pass) on a mesh, where the
    processes step together: all stop when any was asked to (each taking the first signal any process got as
    its own), and none steps when a process has no usable record to bring. A process alone decides alone."""
    if mesh is None or mesh.host_domain_count == 1:
        return stop.signal is not None, False
    parts = _flags(mesh, bytes([stop.signal or 0, batch.batch is not None]))
    asked = [part[0] for part in parts if part[0]]
    if asked and stop.signal is None:
        stop.signal = asked[0]
    return bool(asked), not all(part[1] for part in parts)


_PEERS_REFUSED = re.compile(r"^host domain \d+ refused its share of the step: ")


def _steps_overlap(executor) -> bool:
    """Whether a step runs on while the next is read and begun: on a GPU; a CPU runs each whole as it begins."""
    return executor.kind == "vram"


def _step(config, trainer, stream, batch, mesh=None, idle=False):
    """Begins a step on `batch`: (its `Deferred`, once the library has taken it, or None where nothing trains;
    the batch as it ended; why the library refused it as a whole, or None). A record the library refuses (an image it cannot decode) is
    bad: under `bad_records = "skip"` it is left out and the batch retried without it, so the batch's good
    records still train; under "refuse" it stops the run, named. On a mesh every process refuses a step any
    one refuses: the others retry their shares as they were while that one retries without its bad record,
    or all let the step pass when it cannot; `idle`, all let it pass at once (`_agree`)."""
    if idle:
        return None, batch, None
    while batch.batch is not None:
        try:
            return trainer._begun_step(batch.batch), batch, None
        except (InvalidArgument, Unsupported) as error:  # what only the library could judge
            if isinstance(error, Unsupported) and refused_item(error) is None:
                raise  # the run as a whole, not an item in a format this build does not decode
            several = mesh is not None and mesh.host_domain_count > 1
            theirs = several and _PEERS_REFUSED.match(str(error)) is not None
            retried = batch if theirs else stream.without_refused(batch, error)  # raises BadRecord under "refuse"
            # On a mesh every process retries, or none: the one at fault cannot when it found no record to drop.
            can = retried is not None and retried.batch is not None
            if several and not all(part == b"\x01" for part in _flags(mesh, bytes([can]))):
                if theirs:
                    return None, batch, None  # this share was not at fault, and passes with the step
                batch, retried = retried or batch, None
            if retried is not None:
                batch = retried
                continue
            if config.data.bad_records == "refuse":
                raise BadRecord(f"{error} (in the batch of {', '.join(batch.locations)})") from None
            return None, batch, str(error)
    return None, batch, None


def _refused(config, trainer, log, error, step, cursor, saved_step, mesh) -> BadRecord:
    """The run's end when a record is refused: the steps since the last checkpoint are saved (the refused batch
    did not train, and the cursor saved is the one before it), so once the record is mended or removed the
    run resumes where it stopped. On a mesh of several processes the last checkpoint stands."""
    saved_in = os.path.join(config.run.folder, "checkpoints")
    alone = mesh is None or mesh.host_domain_count == 1
    if alone and cursor is not None and step != saved_step:
        save_checkpoint(trainer, saved_in, step, cursor, config.checkpoints.keep)
    log.write(dict(step=step, refused_record=str(error)))
    complete = checkpoints_in(saved_in)
    mend = ("once the record is mended in place (deleting its line would shift the records after it), or with "
            "data.bad_records = \"skip\" to leave it out")
    then = (f"steps to {complete[-1][0]} are saved in {complete[-1][1]}, from which `uform train {config.path}` "
            f"resumes {mend}" if complete else f"nothing trained yet; `uform train {config.path}` starts over {mend}")
    return BadRecord(f"{error}; {then}")


def _finish(config, trainer, executor, held_out, log, stop, step, cursor, saved_step, evaluated_step, bad,
            mesh=None) -> int:
    """Saves what the last checkpoint lacks; then reports a stop, or evaluates the end of the run. A stop
    before the first step saves nothing: a checkpoint of step 0 would hold only what a new start makes. `bad`: the
    records skipped, and how many distinct ones they were."""
    bad, distinct = bad
    saved_in, index = os.path.join(config.run.folder, "checkpoints"), mesh.host_domain_index if mesh else 0
    if cursor is not None and step != saved_step and not index:  # host domain 0 writes for all
        save_checkpoint(trainer, saved_in, step, cursor, config.checkpoints.keep)
    if stop.signal is not None:
        name = signal.Signals(stop.signal).name
        log.write(dict(step=step, stopped=name))
        complete = checkpoints_in(saved_in)
        again = (f"`uform train {config.path} --host-domain-index I` on every process"
                 if mesh is not None and mesh.host_domain_count > 1 else f"`uform train {config.path}`")
        last = held_out is not None and evaluated_step != step and step >= config.trainer["schedule"]["steps"]
        verb = "evaluates it" if last else "resumes"
        if index and cursor is not None:  # host domain 0 saves this step, perhaps still
            then = f"host domain 0 saves step {step} in {saved_in}, from which {again} {verb}"
        else:
            then = (f"{again} {verb} from {complete[-1][1]}" if complete else f"nothing saved yet; {again} starts over")
        at = f"at step {step}, the last, before its final evaluation" if last else f"at step {step}"
        print(f"uform: stopped by {name} {at}; {then}", file=sys.stderr)
        return 128 + stop.signal
    if held_out and evaluated_step != step:
        with stop.during(f"the final evaluation, of step {step}, under way"):
            _evaluate(trainer, executor, config, held_out, log, step, mesh)
        if stop.signal is not None:  # it came during the final evaluation, which ran to its end
            name = signal.Signals(stop.signal).name
            log.write(dict(step=step, stopped=name))
            print(f"uform: stopped by {name} during the final evaluation of step {step}, which ended first; the run "
                  f"is complete, checkpoints in {saved_in}", file=sys.stderr)
            return 128 + stop.signal
    written = f"host domain 0 writes the checkpoints in {saved_in}" if index else f"checkpoints in {saved_in}"
    skipped = f"; {bad} bad record{'s' if bad != 1 else ''} skipped by this command" if bad else ""
    if distinct < bad:
        skipped += f" ({distinct} distinct, met again in later epochs)"
    print(f"uform: trained to step {step}; {written}, log in {log.path}{skipped}")
    return 0


def _evaluate(trainer, executor, config, held_out, log, step, mesh=None) -> None:
    began = time.perf_counter()
    metrics, dropped = evaluate(trainer, executor, config.run.folder, held_out, config.data.bad_records == "refuse",
                                mesh)
    if dropped:
        log.write(dict(step=step, held_out_bad_records=dropped))
    if metrics is None:  # another host domain's share, scored by host domain 0
        return
    log.write(dict(step=step, evaluation=metrics, evaluation_seconds=time.perf_counter() - began),
              {f"evaluation/{direction}/{name}": value for direction, values in metrics.items()
               for name, value in values.items()})
    summary = ", ".join(f"{direction} recall@1 {values['recall@1']:.3f} mrr {values['mrr']:.3f}"
                        for direction, values in metrics.items())
    print(f"uform: step {step}: {summary}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- #
#  uform embed                                                                                     #
# ---------------------------------------------------------------------------------------------- #

_MEDIA_EXTENSIONS = {Modality.IMAGE: ("jpg", "jpeg", "png", "webp"), Modality.AUDIO: ("wav", "flac", "mp3", "ogg"),
                     Modality.VIDEO: ("mp4", "webm", "mkv", "avi", "mov")}


def _column_modality(column: str) -> Modality:
    """What a column holds, guessed from a shard's file extension; any other column is text."""
    for modality, extensions in _MEDIA_EXTENSIONS.items():
        if any(name in extensions for name in column.lower().split(";")):
            return modality
    return Modality.TEXT


# The data layer names what it reads as `uform train`'s config does; `uform embed` takes it as arguments.
_EMBED_NAMES = ((re.compile(r"^data\.paths(\[0\])?: "), "INPUT: "), (re.compile(r"^data\.format: "), "--format: "),
                (re.compile(r"\bin data\.format\b"), "with --format"), (re.compile(r"\bdata\.format\b"), "--format"))


def embed(*args: Any) -> int:
    """`_embed`, its errors naming INPUT and --format where the data layer names [data]'s fields."""
    try:
        return _embed(*args)
    except Error as error:
        message = str(error)
        for pattern, name in _EMBED_NAMES:
            message = pattern.sub(name, message)
        if message == str(error):
            raise
        raise type(error)(message) from None


def _embed(checkpoint: str, source: str, output: str, column: Optional[str], modality: Optional[str],
           layout: Optional[str], scalar: str, device: str, threads: Optional[int], chunk: int) -> int:
    if chunk < 1:
        raise InvalidArgument(f"--chunk: {chunk} is not a positive integer (the items embedded per call)")
    if not output.endswith((".npy", ".parquet")):
        raise InvalidArgument(f"OUTPUT: {output!r} ends in neither .npy nor .parquet")
    if "config" not in read_header(checkpoint, "CHECKPOINT")[0]:  # a file named out of order is found now
        raise InvalidArgument(f"CHECKPOINT: {checkpoint}: its __metadata__ holds no config; it is no uform checkpoint")
    if not os.path.exists(source):
        raise InvalidArgument(f"INPUT: {source}: no such file or folder")
    if not (os.path.isfile(source) or os.path.isdir(source)):  # a pipe: its records would be gone after one read
        raise InvalidArgument(f"INPUT: {source} is neither a file nor a folder (a pipe or a device); the records are "
                              "read more than once, so save them to a file first")
    _check_output(output, source)

    if column is None:
        shards = list_shards(normalize_dataset(dict(paths=[source], columns={"_": "text"}, format=layout)))
        offered = columns_of_first_record(*shards[0]) or []
        if len(offered) != 1:
            raise InvalidArgument(f"--column: {source} has {len(offered)} columns ({', '.join(offered)}); name the one "
                                  "to embed")
        column = offered[0]
    else:  # named as `uform train` names a column the data lacks, the columns it has listed
        check_columns(list_shards(normalize_dataset(dict(paths=[source], columns={column: "text"}, format=layout))),
                      [("--column", column)])
    kind = enum_member(Modality, modality, "--modality") if modality else _column_modality(column)
    if not modality and kind == Modality.TEXT:  # a table's column of file paths holds media, not text
        first = next(iter(records(normalize_dataset(dict(paths=[source], columns={column: kind}, format=layout)))), None)
        value = first[1].get(column) if first and isinstance(first[1], dict) else None
        if isinstance(value, str) and "." in value and "\n" not in value and os.path.isfile(os.path.join(first[2], value)):
            kind = _column_modality(value.rsplit(".", 1)[1])
            if kind != Modality.TEXT:
                print(f"uform embed: {column!r} holds {kind.value} files ({value!r}); embedding them "
                      "(--modality text embeds the paths as text)", file=sys.stderr)
    dataset = normalize_dataset(dict(paths=[source], columns={column: kind}, format=layout, bad_records="refuse"))
    scalar = scalar_member(scalar, "--scalar")
    executor, _ = open_executor(device, threads, ("--device", "--threads"))
    locations, chunks, pending = [], [], []

    def flush(encoder):
        try:
            rows = encoder.embed([kind] * len(pending), [value for _, value in pending], scalar)
        except (InvalidArgument, Unsupported) as error:  # an item only the library could judge, such as an image it cannot decode
            found = refused_item(error)
            if found is None:
                raise
            raise BadRecord(f"{pending[found[0]][0]}: {column!r}: {found[1]}") from None
        chunks.append(np.array(rows))  # a copy: the rows are views valid until the next call
        locations.extend(location for location, _ in pending)
        bar.update(len(pending))
        pending.clear()

    import tqdm  # a count of the records embedded, where stderr is a terminal: their total is known only at the end
    with executor, _load_encoder(checkpoint, executor) as encoder, \
            tqdm.tqdm(unit=" records", disable=None, dynamic_ncols=True) as bar:
        for location, values, folder in records(dataset):
            group = load_media(make_group(dataset, location, values, folder))  # refuses a bad record, naming it
            pending.append((location, group.items[0][1]))
            if len(pending) == chunk:
                flush(encoder)
        if pending:
            flush(encoder)
        width = encoder.hidden
    embeddings = np.concatenate(chunks) if chunks else np.zeros((0, width), np.float32)
    # Written beside OUTPUT, then renamed over it: a signal or a full disk meanwhile leaves OUTPUT as it was.
    partial = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.partial")
    try:
        with open(partial, "wb") as file:
            if output.endswith(".npy"):
                np.save(file, embeddings)
            else:
                _write_parquet(file, locations, embeddings)
        os.replace(partial, output)
    except OSError as error:
        raise InvalidArgument(f"OUTPUT: {output}: {error.strerror or error}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
    print(f"uform: {len(embeddings)} embeddings of {width} {scalar.value} into {output}")
    return 0


def _load_encoder(checkpoint: str, executor: uform.Executor) -> uform.Encoder:
    try:
        return uform.Encoder.load(checkpoint, executor)
    except Error as error:  # the library names its argument `path`
        raise type(error)(re.sub(r"^path: ", "CHECKPOINT: ", str(error))) from None


def _check_output(output: str, source: str) -> None:
    """Refuses, before any record is embedded, an OUTPUT that could not be written or would overwrite INPUT."""
    folder = os.path.dirname(output) or "."
    if not os.path.isdir(folder):
        why = "is no folder" if os.path.exists(folder) else "does not exist"
        raise InvalidArgument(f"OUTPUT: {output}: its folder {folder} {why}")
    if os.path.isdir(output):
        raise InvalidArgument(f"OUTPUT: {output} is a folder; name a file in it")
    if os.path.exists(output) and os.path.samefile(output, source):
        raise InvalidArgument(f"OUTPUT: {output} is INPUT; the embeddings would replace the records")
    if not os.access(output if os.path.exists(output) else folder, os.W_OK):
        raise InvalidArgument(f"OUTPUT: {output}: permission denied (to write {'it' if os.path.exists(output) else folder})")
    if output.endswith(".parquet"):
        _pyarrow_parquet()


def _pyarrow_parquet() -> Any:
    try:
        import pyarrow.parquet
    except ImportError:
        raise InvalidArgument("OUTPUT: writing Parquet needs pyarrow: pip install pyarrow") from None
    return pyarrow.parquet


def _write_parquet(file: Any, locations: List[str], embeddings: np.ndarray) -> None:
    parquet = _pyarrow_parquet()
    import pyarrow  # there, as the line above found
    values = pyarrow.array(embeddings.reshape(-1))
    column = pyarrow.FixedSizeListArray.from_arrays(values, embeddings.shape[1])
    parquet.write_table(pyarrow.table({"location": pyarrow.array(locations, pyarrow.string()), "embedding": column}),
                        file)


# ---------------------------------------------------------------------------------------------- #
#  uform info                                                                                      #
# ---------------------------------------------------------------------------------------------- #


def describe(path: str) -> Dict[str, Any]:
    """What `uform info` prints: the checkpoint's step, geometry, config (enumerations by name) and tensors,
    and its note and the stream's cursor if any."""
    metadata, tensors = read_header(path, "CHECKPOINT")
    if "config" not in metadata:
        raise InvalidArgument(f"CHECKPOINT: {path}: its __metadata__ holds no config; it is no uform checkpoint")
    try:
        config = json.loads(metadata["config"])
    except ValueError:
        config = None
    if not isinstance(config, dict):
        raise InvalidArgument(f"CHECKPOINT: {path}: its __metadata__.config is no JSON object")
    config = enum_names(TrainerConfig, config)  # "objective": "joint", as a TOML file gives it, not the C number
    moments = ("adamw.first.", "adamw.second.")
    weights = {name: entry for name, entry in tensors.items() if not name.startswith(moments)}
    step = metadata.get("step", "0")
    described = dict(
        path=path, bytes=os.path.getsize(path), format=metadata.get("format"),
        step=int(step) if isinstance(step, str) and re.fullmatch(r"\d+", step) else step,  # as written where it is no step count: refused below
        weights_only=metadata.get("weights_only") == "true",
        geometry=dict(depth=config.get("depth"), hidden=config.get("hidden"), heads=(config.get("hidden") or 0) // 64,
                      parameters=sum(int(np.prod(entry["shape"])) for entry in weights.values())),
        config=config,
        tensors={name: dict(dtype=entry["dtype"], shape=entry["shape"],
                            bytes=entry["data_offsets"][1] - entry["data_offsets"][0]) for name, entry in tensors.items()},
    )
    if "note" in metadata:
        described["note"] = metadata["note"]
    cursor = stream_cursor(path, metadata.get("note"))
    if cursor is not None:
        described["cursor"] = cursor
    return described


def loader_verdict(path: str) -> Optional[str]:
    """Why the library refuses the checkpoint at `path`, or None where it loads. The header alone says too
    little: `Encoder.load` also checks the config, every tensor's name, dtype and shape against it, and
    that the data holds them all, as any reader of the file would."""
    try:
        with uform.Executor.for_ram(threads=1) as executor, _load_encoder(path, executor):
            return None
    except InvalidArgument as error:  # the caller names CHECKPOINT itself
        return re.sub(r"^CHECKPOINT: ", "", str(error))


def info(path: str, as_json: bool) -> int:
    try:
        described = describe(path)
    except (Error, OSError) as refused:  # no header to describe: `--json` still answers with the verdict
        if as_json:
            error = re.sub(r"^CHECKPOINT: ", "", str(refused))  # as the loader's verdict below reads: `path` names it
            print(json.dumps(dict(path=path, valid=False, error=error), indent=1))
        raise
    error = loader_verdict(path)
    described["valid"] = error is None
    if error is not None:
        described["error"] = error
    _print_description(described, as_json)
    if error is None:
        return 0
    print(f"uform info: CHECKPOINT: {error}", file=sys.stderr)  # after the summary: the last line a reader sees
    return 1


def _print_description(described: Dict[str, Any], as_json: bool) -> None:
    path = described["path"]
    if as_json:
        print(json.dumps(described, indent=1))
        return
    geometry = described["geometry"]
    print(f"{path}: {described['bytes'] / 1e6:.1f} MB, {described['format']}, step {described['step']}"
          + (", weights only" if described["weights_only"] else ""))
    print(f"geometry: depth {geometry['depth']}, hidden {geometry['hidden']}, {geometry['heads']} heads, "
          f"{geometry['parameters']:,} parameters")
    if "cursor" in described:
        cursor = described["cursor"]
        print(f"stream: epoch {cursor['epoch']}, shard {cursor['shard']}, offset {cursor['offset']} + {cursor['skip']}, "
              f"device batch {cursor['batch']}")
    elif "note" in described:  # someone else's: shown as written
        print("note: " + described["note"])
    print("config: " + json.dumps(described["config"], indent=1))
    width = max(map(len, described["tensors"]), default=0)
    for name, entry in described["tensors"].items():
        print(f"  {name:<{width}}  {entry['dtype']:<5} {str(tuple(entry['shape'])):<16} {entry['bytes']:>12,} bytes")


# ---------------------------------------------------------------------------------------------- #
#  The command line                                                                                #
# ---------------------------------------------------------------------------------------------- #


def sections_help() -> str:
    """The fields of each config section but `[trainer]`, with their defaults and what they mean."""
    lines = []
    for name, kind in (("data", Dataset), ("evaluation", Evaluation), ("checkpoints", Checkpoints), ("run", Run),
                       ("mesh", MeshSection)):
        title = f"[{name}]" + (" (uform.data.Dataset; docs/data.md)" if kind is Dataset else "")
        lines.append(f"{title}: {kind.__doc__.strip().splitlines()[0]}")
        for f in dataclasses.fields(kind):
            default = (f.default if f.default is not dataclasses.MISSING
                       else f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            given = "required" if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING \
                else f"default {json.dumps(default)}" if default not in (None, {}) else "optional"
            lines.append(f"  {f.name:<20} {f.metadata['doc']} ({given})")
        lines.append("")
    return "\n".join(lines)


def _host_domain_index(given: Optional[int]) -> int:
    """`--host-domain-index`, else `$UFORM_HOST_DOMAIN_INDEX`, else 0: as a launcher sets one per process."""
    name, value = ("--host-domain-index", str(given)) if given is not None else \
        ("UFORM_HOST_DOMAIN_INDEX", os.environ.get("UFORM_HOST_DOMAIN_INDEX", "0"))
    if not value.isdigit():
        raise InvalidArgument(f"{name}: {value!r} is not an index, 0 or more")
    return int(value)


def main(argv: Optional[Sequence[str]] = None) -> int:
    # No abbreviations: `--colum` is refused, not taken as `--column` (nor a later option's prefix as another).
    parser = argparse.ArgumentParser(prog="uform", description=__doc__, epilog=sections_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"uform {uform.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    training = commands.add_parser("train", allow_abbrev=False,
                                   help="train from a TOML config, resuming from its run folder's latest checkpoint")
    training.add_argument("config")
    training.add_argument("--host-domain-index", type=int, metavar="I",
                          help="this process's index in a [mesh] of several (default: $UFORM_HOST_DOMAIN_INDEX, or 0)")
    embedding = commands.add_parser("embed", allow_abbrev=False,
                                    help="embed one column of a table, a tar shard or a folder into .npy or .parquet")
    embedding.add_argument("checkpoint")
    embedding.add_argument("input", help="one path, no glob pattern: a JSONL, CSV or Parquet file, one tar shard, "
                                         "or a folder of files grouped by key (its .tar files too: not as shards)")
    embedding.add_argument("output", help="OUTPUT.npy (rows in input order) or OUTPUT.parquet (location, embedding)")
    embedding.add_argument("--column", help="the column (or file extension) to embed; absent: the input's only one")
    embedding.add_argument("--modality", choices=[m.value for m in Modality],
                           help="absent: by the column's extension, or by its first value's when that names a file")
    embedding.add_argument("--format", choices=FORMATS, help="the input's layout; absent: by its extension")
    embedding.add_argument("--scalar", default="f32", choices=[s.value for s in uform.Scalar],
                           help="f32, f16, bf16 (stored as its uint16 bits) or i8 (round(127 x))")
    embedding.add_argument("--device", default="auto", choices=("auto", "gpu", "cpu"))
    embedding.add_argument("--threads", type=int,
                           help="CPU threads; 0 or absent: every core (ignored on a GPU, saying so)")
    embedding.add_argument("--chunk", type=int, default=256, help="items embedded per call")
    described = commands.add_parser("info", allow_abbrev=False,
                                    help="a checkpoint's geometry, step, config and tensor sizes")
    described.add_argument("checkpoint")
    described.add_argument("--json", action="store_true", help="print one JSON object")
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser, with its usage, not the top level's
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    on_main = threading.current_thread() is threading.main_thread()  # where Python runs signal handlers
    terminated = signal.signal(signal.SIGTERM, _raise_terminated) if on_main else None
    warned = warnings.catch_warnings()  # the config's warnings as this command's lines, each once
    warned.__enter__()
    warnings.simplefilter("always", uform.ConfigWarning)
    warnings.showwarning = _say_once(set(), warnings.showwarning)
    try:
        if args.command == "train":
            return train(args.config, _host_domain_index(args.host_domain_index))
        if args.command == "embed":
            return embed(args.checkpoint, args.input, args.output, args.column, args.modality, args.format, args.scalar,
                         args.device, args.threads, args.chunk)
        return info(args.checkpoint, args.json)
    except (KeyboardInterrupt, _Terminated) as stopped:  # before `uform train` handles signals, or in another command
        number = signal.SIGTERM if isinstance(stopped, _Terminated) else signal.SIGINT
        then = " before training began; nothing saved" if args.command == "train" else ""
        print(f"uform: stopped by {number.name}{then}", file=sys.stderr)
        return 128 + number
    except BrokenPipeError:  # a reader that stopped early (`uform info ... | head`) is no failure
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush does not fail again
        return 0
    except (Error, OSError) as error:
        hint = (f"; start every process of the run again (`uform train {args.config} --host-domain-index I`) to "
                "resume from its newest checkpoint") if isinstance(error, PeerError) and args.command == "train" else ""
        if hint and "within the mesh's timeout" in str(error):
            hint = "; mesh.timeout_minutes sets how long a process waits" + hint
        print(f"uform {args.command}: {error}{hint}", file=sys.stderr)
        return 1
    finally:
        warned.__exit__(None, None, None)
        if on_main:  # None: a handler installed from outside Python, which the default stands for
            signal.signal(signal.SIGTERM, signal.SIG_DFL if terminated is None else terminated)


def _say_once(said: set, otherwise: Any) -> Any:
    """`warnings.showwarning` for the command: a config's warning as a line of its own, the trainer's fields named
    as the TOML file names them, each said once however often the config is checked; any other as `otherwise`."""

    def say(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if not issubclass(category, uform.ConfigWarning):
            return otherwise(message, category, filename, lineno, file, line)
        text = re.sub(r"^config\.", "trainer.", str(message))
        if text not in said:
            said.add(text)
            print(f"uform: {text}", file=sys.stderr)

    return say


class _Terminated(BaseException):
    """SIGTERM where no handler of the command's own takes it, raised as KeyboardInterrupt is for SIGINT."""


def _raise_terminated(number: int, frame: Any) -> None:
    raise _Terminated()


if __name__ == "__main__":
    sys.exit(main())
