"""A dataset as an endless stream of step batches: shuffled, packed, shared among processes, resumable.

Every process reads the same sequence, which does not depend on how many processes there are:

1. Each epoch lists the shards in an order keyed on (seed, epoch) and reads their records in turn.
2. Consecutive blocks of `shuffle_buffer` records are each permuted, keyed on the seed, the epoch and
   where the block starts. A block is where shuffling happens, and its start is where a stream resumes.
3. Records become groups (bad ones are skipped and counted, or refused), and groups are packed, in
   order, into device batches: as many as fill one device's rows the way the library packs them
   (first fit, items cut to a row), its segments, bags and edges, and `max_groups_per_step`. An
   epoch's last batch ends with it, so a batch never holds one record twice.
4. Process `i` of `n` trains on device batches `i`, `i + n`, `i + 2n`, ... of that sequence.

A whole epoch that makes no usable batch (every record bad) stops the stream with an error that counts
the bad records and gives the first reasons, rather than reading the bad records forever.

Every process scans every record's framing and text, but reads the media files only of its own
batches. A step's cursor is where the next step's first device batch starts: (epoch, shard, offset of
the block in that shard, records of the block already taken). Saved in a checkpoint's note, it lets a run
continue the same sequence exactly, mid-epoch, on any number of processes: none repeats or skips a
batch, as their union is the same sequence of device batches.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..batch import Edges, Tape
from ..config import Modality, TrainerConfig, enum_names, normalize_trainer_config, unsigned
from ..errors import InvalidArgument, Unsupported
from .dataset import (BadRecord, Dataset, Group, check_schema, column_of, list_shards, load_media, make_group,
                      no_records, normalize_dataset, refused_item, text_columns)
from .readers import READERS

_CURSOR_FIELDS = ("epoch", "shard", "offset", "skip", "batch")  # where the stream stands
CURSOR_KEYS = _CURSOR_FIELDS + ("seed", "shuffle_buffer", "shards")  #: every key of a `StepBatch.cursor`


@dataclass
class StepBatch:
    """What one step of this process trains on, and where the stream stands after it.

    `batch` is a `TrainerBatch` dict for `trainer.step` (a `uform.Decoded` when the stream decodes
    ahead), or None when every group of this process's share was bad. `cursor` (a dict of plain values) resumes the stream after this step. `locations`
    name the batch's groups, `bad_records` the records found bad while making it, and `groups` are
    the groups themselves (media read), the batch's items in their order.
    """

    batch: Optional[Dict[str, Any]]
    cursor: Dict[str, Any]
    locations: List[str] = field(default_factory=list)
    bad_records: List[str] = field(default_factory=list)
    groups: List[Group] = field(default_factory=list)
    decoded: bool = False  #: whether `batch` is a `uform.Decoded`: its media decoded ahead


_REASONS = 3  # the bad records an error about a whole epoch quotes


class UnusableEpochs:
    """Notices a whole epoch that made no usable batch, so a dataset whose every record is bad stops with
    an error naming its paths, counting its bad records and quoting the first, instead of being read
    forever. `note` each stretch of the stream in order, with the cursor after it."""

    def __init__(self, paths: Sequence[str], cursor: Optional[Dict[str, Any]] = None, field_path: str = "data.paths") -> None:
        self.paths, self.field_path = list(paths), field_path
        self.last = dict(cursor or dict(epoch=0, shard=0, offset=0, skip=0))
        self.since: Optional[Dict[str, Any]] = None
        self.bad, self.reasons = 0, []

    def note(self, cursor: Dict[str, Any], usable: bool, bad: int = 0, reasons: Sequence[str] = ()) -> None:
        begun, self.last = self.last, cursor
        if usable:
            self.since, self.bad, self.reasons = None, 0, []
            return
        if self.since is None:
            self.since = begun
        self.bad += bad
        self.reasons += list(reasons[:max(0, _REASONS - len(self.reasons))])
        at_an_epochs_start = all(self.since.get(name, 0) == 0 for name in ("shard", "offset", "skip"))
        if cursor["epoch"] >= self.since["epoch"] + (1 if at_an_epochs_start else 2):
            shown = ", ".join(self.paths[:3]) + (f" and {len(self.paths) - 3} more" if len(self.paths) > 3 else "")
            first = f"; the first: {'; '.join(self.reasons)}" if self.reasons else ""
            raise InvalidArgument(f"{self.field_path}: a whole epoch of {shown} made no usable batch: "
                                  f"{self.bad} bad records{first}")


class _Capacity:
    """What one device's step holds, with the library's derived defaults; packs groups the way it does."""

    def __init__(self, config: Dict[str, Any], dataset: Dataset) -> None:
        batch = config["batch"]
        self.rows = batch["max_rows_per_device"] or 64
        self.columns = batch["max_columns_per_row"] or 512
        self.segments = batch["max_segments_per_device"] or 8 * self.rows
        self.bags = batch["max_bags_per_device"] or self.segments
        self.edges = config["contrastive"]["max_edges_per_device"] or 64 * self.segments
        self.choices = batch["max_choices_per_item"]
        self.groups = dataset.max_groups_per_step or self.segments
        self.clear()

    def clear(self) -> None:
        self.row_fill: List[int] = []
        self.used_segments = self.used_edges = self.used_groups = 0

    def lengths(self, group: Group) -> List[int]:
        """Each item's columns: text cut to a row (one column less for an item offering choices, which
        ends with its choice position); any media item takes a whole row until the library's decoders
        say how many patches it makes."""
        lengths = []
        for index, (modality, value) in enumerate(group.items):
            choosing = int(index == 0 and group.choices is not None)
            if modality is Modality.TEXT:
                lengths.append(min(len(value.encode("utf-8")), self.columns - choosing) + choosing)
            else:
                lengths.append(self.columns)
        return lengths

    def add(self, group: Group, lengths: List[int]) -> bool:
        """Packs the group when it fits beside what is packed already; False (nothing changed) otherwise."""
        positives, negatives = group.positives, len(group.items) - group.positives
        edges = positives * (positives - 1) + 2 * positives * negatives
        if (self.used_groups + 1 > min(self.groups, self.bags) or self.used_segments + len(lengths) > self.segments
                or self.used_edges + edges > self.edges):
            return False
        fill = list(self.row_fill)
        for length in lengths:  # first fit in item order, as the library packs
            row = next((row for row, used in enumerate(fill) if used + length <= self.columns), len(fill))
            if row == len(fill):
                if row == self.rows:
                    return False
                fill.append(0)
            fill[row] += length
        self.row_fill = fill
        self.used_segments += len(lengths)
        self.used_edges += edges
        self.used_groups += 1
        return True


def check_paired(dataset: Dataset, objective: str, path: str = "data") -> None:
    """Refuses one column where the objective has a contrastive term, which attracts the items of one record."""
    if len(dataset.columns) < 2 and objective in ("contrastive", "joint"):
        (name,) = dataset.columns
        raise InvalidArgument(f"{path}.columns: {name!r} alone: the {objective} objective's contrastive term attracts "
                              "the items of one record, so each record needs two columns or more (a query's and its "
                              "target's, a caption's and its image's); with one, set trainer.objective = \"masked\"")


class Stream:
    """Step batches for this process, from a `Dataset`, packed for the trainer `config`'s geometry.

    >>> with Stream(dict(paths=["pairs.jsonl"], columns=dict(question="text", answer="text")), config) as stream:
    ...     for step in itertools.islice(stream, 100):
    ...         trainer.step(step.batch)

    A thread reads, decodes and assembles the next `dataset.prefetch` batches while a step runs. The
    schema is checked here, before any step: a column missing from a shard raises `InvalidArgument`
    naming it. `cursor`, a `StepBatch.cursor` of an earlier run over the same shards, seed and
    `shuffle_buffer`, continues that run's sequence; `process_index` of `process_count` picks this
    process's share (a mesh's `host_domain_index` and `host_domain_count`). `decode_ahead` has the thread
    decode the batches' media too.
    """

    def __init__(self, dataset: Any, config: Any, process_index: int = 0, process_count: int = 1,
                 cursor: Optional[Dict[str, Any]] = None) -> None:
        self.dataset = normalize_dataset(dataset)
        normalized = normalize_trainer_config(config)
        check_paired(self.dataset, enum_names(TrainerConfig, normalized)["objective"])
        self.seed = normalized["seed"]
        self.count = unsigned(process_count, 32, "process_count")
        if not self.count:
            raise InvalidArgument("process_count: 0; a stream is read by one process or more")
        self.index = unsigned(process_index, 32, "process_index")
        if self.index >= self.count:
            raise InvalidArgument(f"process_index: {self.index} is not below process_count = {self.count}")
        self.capacity = _Capacity(normalized, self.dataset)
        if self.dataset.choices is not None and not self.capacity.choices:
            raise InvalidArgument("data.choices: config.batch.max_choices_per_item is absent, so no "
                                  "item may offer choices")
        self.shards = list_shards(self.dataset)
        check_schema(self.dataset, self.shards)
        self.texts = text_columns(self.dataset)
        self.start = self._checked_cursor(cursor)
        self._decode: Optional[Callable[[Any], Any]] = None
        self._queue: "queue.Queue" = queue.Queue(self.dataset.prefetch)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="uform-data", daemon=True)
        self._thread.start()

    def _checked_cursor(self, cursor: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        fresh = dict(epoch=0, shard=0, offset=0, skip=0, batch=0)
        fresh.update(seed=self.seed, shuffle_buffer=self.dataset.shuffle_buffer, shards=[path for path, _ in self.shards])
        if cursor is None:
            return fresh
        if not isinstance(cursor, dict):
            raise InvalidArgument(f"cursor: expected a dict, got {type(cursor).__name__}")
        missing = [name for name in CURSOR_KEYS if name not in cursor]
        if missing:
            raise InvalidArgument(f"cursor: lacks {', '.join(missing)}; a StepBatch.cursor holds every one of "
                                  f"{', '.join(CURSOR_KEYS)}")
        for name in ("seed", "shuffle_buffer"):
            if cursor.get(name) != fresh[name]:
                field_path = "config.seed" if name == "seed" else f"data.{name}"
                raise InvalidArgument(f"{field_path}: the stream being resumed read {name} = {cursor.get(name)!r}, "
                                      f"now {fresh[name]!r}; the same sequence needs the same {name}")
        then, now = cursor.get("shards"), fresh["shards"]
        if then != now:  # a dataset may have thousands of shards: name the first that differs, not them all
            if isinstance(then, list):
                at = next((k for k, (a, b) in enumerate(zip(then, now)) if a != b), min(len(then), len(now)))
                was, new = (paths[at] if at < len(paths) else None for paths in (then, now))
                tidied = [os.path.normpath(path) if isinstance(path, str) else path for path in (was, new)]
                if tidied[0] != tidied[1]:  # shown with `..` tidied away, unless that is all that differs
                    was, new = tidied
                differ = (f"{len(then)} shards, now {len(now)}, the first difference at shard {at}: "
                          f"{was!r} then, {new!r} now")
            else:
                differ = f"shards of digest {then!r}, now {len(now)} other{'s' if len(now) != 1 else ''}"
            raise InvalidArgument(f"data.paths: the stream being resumed read {differ}; the same sequence needs the "
                                  "same shards")
        for name in _CURSOR_FIELDS:
            fresh[name] = unsigned(cursor.get(name), 64, f"cursor.{name}")
        if fresh["shard"] >= len(self.shards):
            raise InvalidArgument(f"cursor.shard: {fresh['shard']} is past the last of the {len(self.shards)} shards; "
                                  "a StepBatch.cursor never is")
        return fresh

    # -- the sequence every process reads alike ------------------------------------------------ #

    def _positioned(self) -> Iterator[Tuple[Tuple[int, int, int, int], Optional[Tuple[str, Any, str]]]]:
        """Every record from the start cursor on, endlessly, with its position (epoch, shard, offset, index);
        None, with the next epoch's first position, where an epoch ends."""
        start = self.start
        epoch, shard, offset, skip = start["epoch"], start["shard"], start["offset"], start["skip"]
        size = max(1, self.dataset.shuffle_buffer)
        shuffled = self.dataset.shuffle_buffer > 0
        while not self._stopping.is_set():
            order = (np.random.default_rng([self.seed, epoch]).permutation(len(self.shards)) if shuffled
                     else np.arange(len(self.shards)))
            records = self._records(order, shard, offset)
            read_any = False
            while True:
                block = list(itertools.islice(records, size))
                if not block:
                    break
                read_any = True
                block_shard, block_offset = block[0][0], block[0][1]
                permutation = (np.random.default_rng([self.seed, epoch, block_shard, block_offset]).permutation(len(block))
                               if shuffled else range(len(block)))
                for index in range(skip, len(block)):
                    yield (epoch, block_shard, block_offset, index), block[permutation[index]][2]
                skip = 0
            if not read_any and shard == 0 and offset == 0:  # a table of a header alone, say
                raise no_records(self.shards)
            epoch, shard, offset = epoch + 1, 0, 0
            yield (epoch, 0, 0, 0), None  # the epoch's end

    def _records(self, order: np.ndarray, shard: int, offset: int):
        """(shard position in the epoch's order, offset in that shard, (location, values, folder)) from a position on."""
        for position in range(shard, len(order)):
            path, layout = self.shards[order[position]]
            folder = os.path.abspath(path) if layout == "folder" else os.path.dirname(os.path.abspath(path))
            first = offset if position == shard else 0
            shown = os.path.normpath(path)  # as `records` names it
            for number, (key, values) in enumerate(READERS[layout](path, first, self.texts), first):
                yield position, number, (f"{shown}:{key}", values, folder)

    def _device_batches(self) -> Iterator[Tuple[List[Group], List[str], Tuple[int, int, int, int]]]:
        """Groups packed into device batches, each with the bad records met before the next batch's first and
        where that next batch begins: the position of the record that did not fit, or the next epoch's first."""
        capacity, groups, bad = self.capacity, [], []
        unusable = UnusableEpochs([path for path, _ in self.shards], self.start)
        packed, bad_in_epoch, reasons = False, 0, []  # since the epoch began
        for position, record in self._positioned():
            if record is None:  # an epoch ends its last batch, which so never holds a record twice
                if groups:
                    yield groups, bad, position
                    bad = []
                groups = []
                epoch, shard, offset, skip = position
                unusable.note(dict(epoch=epoch, shard=shard, offset=offset, skip=skip), packed, bad_in_epoch, reasons)
                packed, bad_in_epoch, reasons = False, 0, []
                continue
            location, values, folder = record
            try:
                group = make_group(self.dataset, location, values, folder)
                if group.choices is not None and len(group.choices) > capacity.choices:
                    raise BadRecord(f"{location}: offers {len(group.choices)} choices, over config.batch."
                                    f"max_choices_per_item = {capacity.choices}")
                lengths = capacity.lengths(group)
                if groups and capacity.add(group, lengths):
                    groups.append(group)
                    continue
                if groups:
                    yield groups, bad, position
                    groups, bad = [], []  # handed out: a record too big for any batch must not reopen them
                capacity.clear()
                if not capacity.add(group, lengths):
                    raise BadRecord(f"{location}: its {len(lengths)} items do not fit one device's step "
                                    f"({capacity.rows} rows of {capacity.columns} columns, {capacity.segments} segments, "
                                    f"{capacity.edges} edges)")
                groups, packed = [group], True
            except BadRecord as error:
                self._bad(error, bad)
                bad_in_epoch += 1
                reasons = reasons if len(reasons) == _REASONS else reasons + [str(error)]

    def _bad(self, error: BadRecord, bad: List[str]) -> None:
        if self.dataset.bad_records == "refuse":
            raise error
        bad.append(str(error))

    # -- this process's share ------------------------------------------------------------------ #

    def _steps(self) -> Iterator[StepBatch]:
        """This process's device batch of each step, assembled, with the cursor after the step.

        A step is done with its last device batch: the cursor is where the next batch begins, known then, so a
        record refused after it (under "refuse") stops the run after this step, not before.
        """
        step_bad: List[str] = []
        own: Optional[List[Group]] = None
        first = self.start["batch"]
        unusable = UnusableEpochs([path for path, _ in self.shards], self.start)
        for number, (groups, bad, following) in enumerate(self._device_batches()):
            step_bad += bad
            if number % self.count == self.index:
                own = groups
            if (number + 1) % self.count == 0:
                epoch, shard, offset, skip = following
                cursor = dict(self.start, epoch=epoch, shard=shard, offset=offset, skip=skip, batch=first + number + 1)
                step = self._decoded(self._assemble(own or [], cursor, step_bad))
                unusable.note(cursor, step.batch is not None or not own, len(step.bad_records), step.bad_records)
                yield step
                step_bad, own = [], None

    def _assemble(self, groups: List[Group], cursor: Dict[str, Any], bad: List[str]) -> StepBatch:
        loaded = []
        for group in groups:
            try:
                loaded.append(load_media(group))
            except BadRecord as error:
                self._bad(error, bad)
        return StepBatch(assemble(loaded, self.dataset) if loaded else None, cursor,
                         [group.location for group in loaded], bad, loaded)

    def decode_ahead(self, decode: Callable[[Any], Any]) -> None:
        """Has the thread decode each batch's images, video and audio with `decode` (a trainer's `decode`),
        so the device never waits for them; batches it assembled before are decoded as they are taken. A
        record whose media `decode` refuses is bad, as when the step refuses it."""
        self._decode = decode

    def _decoded(self, step: StepBatch) -> StepBatch:
        """The step with its media decoded ahead, its records whose media the library refuses left out."""
        while self._decode is not None and step.batch is not None:
            try:
                return StepBatch(self._decode(step.batch), step.cursor, step.locations, step.bad_records, step.groups,
                                 decoded=True)
            except (InvalidArgument, Unsupported) as error:  # Unsupported: a format this build does not decode
                retried = self.without_refused(step, error)  # raises BadRecord under "refuse"
                if retried is None:
                    return step  # a fault of the batch as a whole: the step reports it
                step = retried
        return step

    def without_refused(self, step: StepBatch, error: BaseException) -> Optional[StepBatch]:
        """After `trainer.step(step.batch)` refused `error`: when it names one of the batch's items
        (`batch.contents[20]: not a readable PNG image`), the record that item came from is bad. Under
        `bad_records = "skip"` answers the step without that record (its `batch` None when it was the
        only one), the record's location and the library's reason added to `bad_records`; under
        "refuse" raises `BadRecord` naming it. None when the error faults the batch as a whole."""
        found = refused_item(error)
        if found is None or not step.groups:
            return None
        item, why = found
        group = 0
        while group < len(step.groups) and item >= len(step.groups[group].items):
            item -= len(step.groups[group].items)
            group += 1
        if group == len(step.groups):
            return None
        bad = step.groups[group]
        message = f"{bad.location}: {column_of(bad, item)!r}: {why}"
        bad_records = list(step.bad_records)
        self._bad(BadRecord(message), bad_records)
        kept = step.groups[:group] + step.groups[group + 1:]
        return StepBatch(assemble(kept, self.dataset) if kept else None, step.cursor, [g.location for g in kept],
                         bad_records, kept)

    # -- the thread ahead of the steps --------------------------------------------------------- #

    def _produce(self) -> None:
        try:
            for step in self._steps():
                while not self._stopping.is_set():
                    try:
                        self._queue.put(step, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stopping.is_set():
                    return
        except BaseException as error:  # noqa: BLE001 - it belongs to whoever takes the next batch
            self._queue.put(error)

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> StepBatch:
        if self._stopping.is_set():
            raise StopIteration
        step = self._queue.get()
        if isinstance(step, BaseException):
            self._stopping.set()
            raise step
        if self._decode is not None and not step.decoded:  # assembled before `decode_ahead`: decoded here
            step = self._decoded(step)
        return step

    def close(self) -> None:
        """Stops the thread ahead of the steps; harmless when already closed."""
        self._stopping.set()
        while self._thread.is_alive():
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exception: Any) -> None:
        self.close()


def assemble(groups: List[Group], dataset: Dataset) -> Dict[str, Any]:
    """Groups (media read) as one `TrainerBatch` dict: each group's positives attract each other both
    ways, its negatives and positives repel each other both ways, every edge weighed by the group's
    weight; the group is the items' bag, so a group stays on one device."""
    modalities, contents, bags = [], [], []
    attract: List[List[int]] = []
    repel: List[List[int]] = []
    attract_weights: List[float] = []
    repel_weights: List[float] = []
    choices, targets = [], []
    for bag, group in enumerate(groups):
        base, positives, count = len(contents), group.positives, len(group.items)
        for index, (modality, value) in enumerate(group.items):
            modalities.append(modality)
            contents.append(value)
            bags.append(bag)
            if index < positives:
                attract.append([base + j for j in range(positives) if j != index])
                repel.append(list(range(base + positives, base + count)))
            else:
                attract.append([])
                repel.append(list(range(base, base + positives)))
            attract_weights += [group.weight] * len(attract[-1])
            repel_weights += [group.weight] * len(repel[-1])
            offers = index == 0 and group.choices is not None
            choices.append(group.choices if offers else b"")
            targets.append(np.asarray(group.choice_targets if offers else [], np.float32))
    weighed = dataset.weight is not None
    batch = dict(modalities=modalities, contents=Tape.from_list(contents), bags=bags,
                 relations=dict(attract=_edges(attract, attract_weights if weighed else None)))
    if dataset.negatives:
        batch["relations"]["repel"] = _edges(repel, repel_weights if weighed else None)
    if dataset.choices is not None:
        batch["choices"], batch["choice_targets"] = Tape.from_list(choices), Tape.from_list(targets)
    return batch


def _edges(runs: List[List[int]], weights: Optional[List[float]]) -> Edges:
    offsets = np.zeros(len(runs) + 1, np.uint32)
    np.cumsum([len(run) for run in runs], out=offsets[1:])
    ids = np.fromiter(itertools.chain.from_iterable(runs), np.uint32)
    return Edges(offsets, ids, None if weights is None else np.asarray(weights, np.float32))
