"""Batches: tapes of variable-length entries, edge sets, and one step's items.

Python checks here only what the C library cannot: the lengths of arrays that C receives as bare
pointers, tape offsets against the length of their data, and conversions of values into the C
types. Ordering, ranges, finiteness and capacity are the C library's to judge, and its messages
name the field just as these do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np

from . import _native
from .config import LateInteractionSide, Modality, article, enum_member, float32_array, unsigned_array
from .errors import InvalidArgument, unknown_field

__all__ = ["Tape", "Edges", "TrainerBatch"]

_NO_OFFSETS = np.zeros(1, np.uint64)


class Tape:
    """N variable-length entries in one contiguous buffer, with N + 1 offsets.

    `data` is any C-contiguous buffer (bytes, bytearray, a numpy array, a memoryview); entry `i`
    spans items `[offsets[i], offsets[i + 1])` of it: bytes for byte buffers, elements for float32
    arrays (the choice targets). When `offsets` is a C-contiguous `numpy.uint64` array, nothing is
    copied: the library reads the caller's memory when the verb runs, deferred ones included (see
    docs/python.md for what may change meanwhile). Other offsets (a list, another dtype) are
    converted once. Texts in a numpy array of str are not a buffer of UTF-8: give them as contents
    themselves, or gather them with `Tape.from_list`.

    >>> tape = Tape(b"redpanda", numpy.array([0, 3, 8], dtype=numpy.uint64))
    >>> len(tape), bytes(tape[1])
    (2, b'panda')
    """

    __slots__ = ("_data", "_view", "_items", "_offsets")

    def __init__(self, data: Any, offsets: Any) -> None:
        try:
            view = memoryview(data)
        except TypeError:
            raise InvalidArgument(f"tape.data: expected a contiguous buffer, got {type(data).__name__}") from None
        if isinstance(data, np.ndarray) and data.dtype.kind == "U":  # its buffer is UCS-4 code points, not UTF-8
            raise InvalidArgument("tape.data: a numpy array of str; give the texts as contents or to Tape.from_list")
        if not view.c_contiguous:
            raise InvalidArgument("tape.data: the buffer is not C-contiguous")
        self._data = data
        self._view = view.cast("B") if view.ndim != 1 or view.format != "B" else view
        try:  # entries read in the data's own items: floats stay floats
            self._items = self._view.cast(view.format) if view.itemsize > 1 else self._view
        except (TypeError, ValueError):
            self._items = self._view
        if isinstance(offsets, np.ndarray) and offsets.dtype == np.uint64 and offsets.ndim == 1:
            self._offsets = np.ascontiguousarray(offsets)
        else:
            self._offsets = unsigned_array(offsets, np.uint64, "tape.offsets")
        self._check("tape")

    def _check(self, path: str) -> None:
        """Offsets are count + 1 long and the last stays inside the data; the C library checks their order."""
        if len(self._offsets) == 0:
            raise InvalidArgument(f"{path}.offsets: empty, expected count + 1 entries")
        last, available = int(self._offsets[-1]), len(self._items)
        if last > available:
            unit = "bytes" if self._items.itemsize == 1 else "elements"
            raise InvalidArgument(f"{path}.offsets: the last offset {last} is past the data's {available} {unit}")

    @classmethod
    def from_list(cls, entries: Sequence[Any]) -> "Tape":
        """Gathers a list of entries into one tape, the one copy this path makes.

        Entries of `str` (encoded as UTF-8), bytes, bytearray or byte buffers make a byte tape;
        float sequences or float arrays make a float32 tape with offsets counted in elements.
        """
        return _gather(entries, "entries")

    @property
    def data(self) -> Any:
        """The buffer the tape was made over."""
        return self._data

    @property
    def offsets(self) -> np.ndarray:
        """The count + 1 offsets, a `numpy.uint64` array."""
        return self._offsets

    @property
    def is_float32(self) -> bool:
        """True when the entries are float32 elements rather than bytes."""
        return self._items.format == "f"

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def __getitem__(self, index: int) -> memoryview:
        count = len(self)
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"tape indices must be integers, not {type(index).__name__}")
        if index < 0:
            index += count
        if not 0 <= index < count:
            raise IndexError(f"tape index out of range: {count} entries")
        return self._items[int(self._offsets[index]) : int(self._offsets[index + 1])]

    def __repr__(self) -> str:
        kind = "float32" if self.is_float32 else "bytes" if self._items.itemsize == 1 else f"'{self._items.format}' items"
        return f"Tape({len(self)} entries, {len(self._items)} {kind})"

    def _pinnable(self, path: str, float32: bool):
        """The (bytes view, uint64 offsets, size) the compiled core pins, after the checks only Python can make.

        The size counts the data's bytes or elements: C checks the offsets against it again as the verb runs.
        """
        self._check(path)
        if float32 and not self.is_float32 and len(self._items) > 0:  # an empty buffer's format does not matter
            raise InvalidArgument(f"{path}: expected a float32 tape, got items of format {self._items.format!r}")
        if not float32 and self._items.itemsize != 1:
            raise InvalidArgument(f"{path}: expected a tape of bytes, got items of format {self._items.format!r}")
        return self._view, self._offsets, len(self._items)


def _entry_bytes(entry: Any, path: str) -> Optional[bytes]:
    """An entry as bytes, or None when it is not byte-like."""
    if isinstance(entry, str):
        try:
            return entry.encode("utf-8")
        except UnicodeEncodeError as error:  # a lone surrogate, which no UTF-8 text holds
            raise InvalidArgument(f"{path}: not encodable as UTF-8 ({error.reason} at {error.start})") from None
    if isinstance(entry, (bytes, bytearray)):
        return bytes(entry)
    if isinstance(entry, (memoryview, np.ndarray)):
        view = memoryview(entry)
        if view.itemsize == 1:
            return view.tobytes()
    return None


def _gather_bytes(entries: Sequence[Any], path: str) -> Tape:
    chunks = []
    for i, entry in enumerate(entries):
        chunk = _entry_bytes(entry, f"{path}[{i}]")
        if chunk is None:
            raise InvalidArgument(f"{path}[{i}]: expected str or bytes, got {type(entry).__name__}")
        chunks.append(chunk)
    offsets = np.zeros(len(chunks) + 1, np.uint64)
    np.cumsum([len(chunk) for chunk in chunks], out=offsets[1:])
    return Tape(np.frombuffer(b"".join(chunks), np.uint8), offsets)


def _gather_floats(entries: Sequence[Any], path: str) -> Tape:
    arrays = [float32_array(entry, f"{path}[{i}]") for i, entry in enumerate(entries)]
    offsets = np.zeros(len(arrays) + 1, np.uint64)
    np.cumsum([len(array) for array in arrays], out=offsets[1:])
    data = np.concatenate(arrays) if arrays else np.zeros(0, np.float32)
    return Tape(data, offsets)


def _gather(entries: Sequence[Any], path: str) -> Tape:
    if isinstance(entries, (str, bytes, bytearray, memoryview)) or not hasattr(entries, "__len__"):
        raise InvalidArgument(f"{path}: expected a list of entries, got {type(entries).__name__}")
    if all(_is_byte_like(entry) for entry in entries):
        return _gather_bytes(entries, path)
    return _gather_floats(entries, path)


def _is_byte_like(entry: Any) -> bool:
    if isinstance(entry, (str, bytes, bytearray)):
        return True
    if isinstance(entry, (memoryview, np.ndarray)):
        return memoryview(entry).itemsize == 1
    return False


def _tape(value: Any, path: str, float32: bool) -> Tape:
    if isinstance(value, Tape):
        return value
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not hasattr(value, "__len__"):
        raise InvalidArgument(f"{path}: expected a list of entries or a uform.Tape, got {type(value).__name__}")
    return _gather_floats(value, path) if float32 else _gather_bytes(value, path)


@dataclass
class Edges:
    """One edge set over a step's items, as compressed sparse rows.

    Item `i` links to `ids[offsets[i]:offsets[i + 1]]`, ascending within each run, weighed by
    `weights` (absent weighs every edge one).
    """

    offsets: Any = field(metadata={"doc": "The step's items + 1 offsets into ids."})
    ids: Any = field(metadata={"doc": "Item indices each item links to, ascending within each run."})
    weights: Any = field(default=None, metadata={"doc": "The weight of each edge; absent weighs every edge one."})


@dataclass
class TrainerBatch:
    """This process's share of one step."""

    modalities: Sequence[Union[Modality, str]] = field(metadata={"doc": "The modality of each item."})
    contents: Union[Sequence[Union[str, bytes]], Tape] = field(
        metadata={"doc": "Each item's bytes, UTF-8 text or an encoded file, or a tape of them."}
    )
    bags: Any = field(default=None, metadata={"doc": "The bag of each item; items sharing a bag land on one device."})
    temperature_groups: Any = field(default=None, metadata={"doc": "The temperature group of each item."})
    sides: Any = field(default=None, metadata={"doc": "The late-interaction side of each item; absent makes every item NONE."})
    choices: Union[Sequence[Union[str, bytes]], Tape, None] = field(
        default=None, metadata={"doc": "Each item's legal choices, one byte each; an item offering none makes no choice."}
    )
    choice_targets: Union[Sequence[Any], Tape, None] = field(
        default=None, metadata={"doc": "The target probability of each choice, float32, summing to one per item."}
    )
    relations: Optional[Mapping] = field(
        default=None, metadata={"doc": "The contrastive targets: a dict of `attract`, `repel`, `ignore` Edges."}
    )


_BATCH_FIELDS = {f.name for f in dataclasses.fields(TrainerBatch)}
_EDGES_FIELDS = {f.name for f in dataclasses.fields(Edges)}
_RELATIONS = ("attract", "repel", "ignore")


def _fields(value: Any, kind: type, names: set, path: str) -> Mapping:
    if isinstance(value, kind):
        return {name: getattr(value, name) for name in names}
    if isinstance(value, Mapping):
        for key in value:
            if key not in names:
                raise unknown_field(path, key, names)
        return value
    raise InvalidArgument(f"{path}: expected {article(kind.__name__)} or a dict, got {type(value).__name__}")


def wrong_count(path: str, given: int, expected: int, each: str = "one per item") -> InvalidArgument:
    """The error of a field of `given` entries where `expected` belong, `each` saying why: "2 entries, expected 3,
    one per item"."""
    return InvalidArgument(f"{path}: {given} {'entry' if given == 1 else 'entries'}, expected {expected}, {each}")


def _per_item(values: Any, items: int, path: str) -> Optional[np.ndarray]:
    if values is None:
        return None
    array = unsigned_array(values, np.uint32, path)
    if len(array) != items:
        raise wrong_count(path, len(array), items)
    return array


def _sides(values: Any, items: int, path: str) -> Optional[np.ndarray]:
    if values is None:
        return None
    if not isinstance(values, np.ndarray) and hasattr(values, "__len__") and not isinstance(values, (str, bytes)):
        values = [int(enum_member(LateInteractionSide, side, f"{path}[{i}]")) for i, side in enumerate(values)]
    return _per_item(values, items, path)


def _modalities(values: Any, items: int, path: str) -> np.ndarray:
    if values is None:
        raise InvalidArgument(f"{path}: required, one Modality per item")
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise InvalidArgument(f"{path}: expected a list of Modality, got {type(values).__name__}")
    if len(values) != items:
        raise wrong_count(path, len(values), items)
    table = _native.C_ENUMS["modality"]
    return np.array([table[enum_member(Modality, value, f"{path}[{i}]").value] for i, value in enumerate(values)], np.uint32)


def _edges(value: Any, items: int, path: str):
    if value is None:
        return None
    given = _fields(value, Edges, _EDGES_FIELDS, path)
    for name in ("offsets", "ids"):
        if given.get(name) is None:
            raise InvalidArgument(f"{path}.{name}: required")
    offsets = unsigned_array(given["offsets"], np.uint32, f"{path}.offsets")
    if len(offsets) != items + 1:
        raise wrong_count(f"{path}.offsets", len(offsets), items + 1, "one more than the items")
    ids = unsigned_array(given["ids"], np.uint32, f"{path}.ids")
    weights = given.get("weights")
    if weights is not None:
        weights = float32_array(weights, f"{path}.weights")
        if len(weights) != len(ids):
            raise wrong_count(f"{path}.weights", len(weights), len(ids), "one per id")
    return offsets, ids, weights


def normalize_batch(batch: Any, path: str = "batch") -> dict:
    """A `TrainerBatch` or dict as the arrays and pinnable tapes the compiled core hands to C."""
    if batch is None:
        raise InvalidArgument(f"{path}: required, a TrainerBatch or a dict")
    given = _fields(batch, TrainerBatch, _BATCH_FIELDS, path)
    if given.get("contents") is None:
        raise InvalidArgument(f"{path}.contents: required, one entry per item")
    contents = _tape(given["contents"], f"{path}.contents", float32=False)
    items = len(contents)
    normalized = {
        "count": items,
        "modalities": _modalities(given.get("modalities"), items, f"{path}.modalities"),
        "contents": contents._pinnable(f"{path}.contents", float32=False),
        "bags": _per_item(given.get("bags"), items, f"{path}.bags"),
        "temperature_groups": _per_item(given.get("temperature_groups"), items, f"{path}.temperature_groups"),
        "sides": _sides(given.get("sides"), items, f"{path}.sides"),
        "choices": None,
        "choice_targets": None,
    }
    for name, float32 in (("choices", False), ("choice_targets", True)):
        if given.get(name) is not None:
            tape = _tape(given[name], f"{path}.{name}", float32=float32)
            if len(tape) != items:
                raise wrong_count(f"{path}.{name}", len(tape), items)
            normalized[name] = tape._pinnable(f"{path}.{name}", float32=float32)
    relations = given.get("relations")
    if relations is not None and not isinstance(relations, Mapping):
        raise InvalidArgument(f"{path}.relations: expected a dict of attract, repel and ignore edges")
    for key in relations or ():
        if key not in _RELATIONS:
            raise unknown_field(f"{path}.relations", key, _RELATIONS)
    for name in _RELATIONS:
        normalized[name] = _edges((relations or {}).get(name), items, f"{path}.relations.{name}")
    return normalized


def normalize_choose(texts: Any, choices: Any):
    """`text_choose`'s inputs as (pinnable texts tape, pinnable choices tape, count): a list of str /
    bytes or a `Tape` each, as many choices as texts."""
    text_tape = _tape(texts, "texts", float32=False)
    choice_tape = _tape(choices, "choices", float32=False)
    if len(choice_tape) != len(text_tape):
        raise wrong_count("choices", len(choice_tape), len(text_tape), "one per text")
    return text_tape._pinnable("texts", float32=False), choice_tape._pinnable("choices", float32=False), len(text_tape)


def normalize_sides(sides: Any, items: int) -> Optional[np.ndarray]:
    """An encoder's optional late-interaction sides, one per item, as uint32."""
    return _sides(sides, items, "sides")


def normalize_items(modalities: Any, contents: Any):
    """An encoder's inputs as (uint32 modalities, pinnable contents tape, count)."""
    tape = _tape(contents, "contents", float32=False)
    items = len(tape)
    return _modalities(modalities, items, "modalities"), tape._pinnable("contents", float32=False), items
