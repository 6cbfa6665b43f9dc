"""One reader per file layout: each turns one shard (a file or a folder) into records, in file order.

A record is `(key, values)`: `key` names it inside its shard (a table's row number, a sample's key
in a tar file or a folder) and `values` maps each column the dataset asks for to what the shard
holds. Text columns arrive as `str`; media columns as `bytes`, a path (`str`, from a table, resolved
against the table's folder), or a `FileSlice` read only when its batch is assembled, so a process
never reads the pictures of the records other processes train on. Every reader can start at a
record number, which is how a resumed stream continues mid-shard without replaying what came before.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import tarfile
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..errors import InvalidArgument

FORMATS = ("jsonl", "csv", "parquet", "tar", "folder")
_EXTENSIONS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".tar": "tar"}


@dataclass(frozen=True)
class FileSlice:
    """`size` bytes at `offset` of the file at `path`: a media file inside a tar shard, or beside a caption."""

    path: str
    offset: int = 0
    size: Optional[int] = None

    def read(self) -> bytes:
        with open(self.path, "rb") as file:
            file.seek(self.offset)
            return file.read(-1 if self.size is None else self.size)


def shard_format(path: str, given: Optional[str], field_path: str = "data.paths") -> str:
    """The layout of one shard: `given`, or what its extension (or being a folder) says."""
    if given is not None:
        return given
    if os.path.isdir(path):
        return "folder"
    extension = os.path.splitext(path)[1].lower()
    if extension not in _EXTENSIONS:
        section = field_path.split(".")[0]
        raise InvalidArgument(f"{field_path}: {path!r} has no known extension ({', '.join(sorted(_EXTENSIONS))}) "
                              f"and is no folder; name its layout in {section}.format")
    return _EXTENSIONS[extension]


def pick(values: Dict[str, Any], column: str) -> Any:
    """The value of `column`, where a column may list alternatives, "jpg;png;webp", of which the first present wins."""
    for name in column.split(";"):
        if name in values:
            return values[name]
    return None


# ---------------------------------------------------------------------------------------------- #
#  Tables: a row is a record, its columns named by a header or by keys                            #
# ---------------------------------------------------------------------------------------------- #


def read_jsonl(path: str, start: int = 0, text_columns: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Any]]:
    """One JSON object per line; blank lines are no records. A line that is no JSON object still
    counts as a record, whose values are None, so the stream can name it as bad."""
    with open(path, "rb") as lines:
        records = (line for line in lines if line.strip())
        for number, line in enumerate(itertools.islice(records, start, None), start):
            try:
                values = json.loads(line)
            except ValueError:
                values = None
            yield str(number), values if isinstance(values, dict) else None


def read_csv(path: str, start: int = 0, text_columns: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Any]]:
    """A header row names the columns; every later row is a record (quoted fields may span lines)."""
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as file:
        rows = csv.DictReader(file)
        for number, row in enumerate(itertools.islice(rows, start, None), start):
            yield str(number), {key: value for key, value in row.items() if key is not None}


def read_parquet(path: str, start: int = 0, text_columns: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Any]]:
    """Row groups are read one at a time; a resumed stream skips whole row groups by their row counts."""
    parquet = _pyarrow_parquet()
    table = parquet.ParquetFile(path)
    first = 0
    for group in range(table.num_row_groups):
        rows = table.metadata.row_group(group).num_rows
        if first + rows <= start:
            first += rows
            continue
        for offset, values in enumerate(table.read_row_group(group).to_pylist()):
            if first + offset >= start:
                yield str(first + offset), values
        first += rows


def parquet_columns(path: str) -> List[str]:
    return list(_pyarrow_parquet().ParquetFile(path).schema_arrow.names)


def _pyarrow_parquet():
    try:
        import pyarrow.parquet
    except ImportError:
        raise InvalidArgument("data.paths: reading Parquet needs pyarrow: pip install pyarrow") from None
    return pyarrow.parquet


def csv_columns(path: str) -> List[str]:
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as file:
        return next(csv.reader(file), [])


# ---------------------------------------------------------------------------------------------- #
#  Shards: a record is every file sharing one key, its columns named by their extensions           #
# ---------------------------------------------------------------------------------------------- #


def split_key(name: str) -> Tuple[str, str]:
    """WebDataset's rule: the key is the path up to the first dot of the file's name, the column the rest."""
    folder, base = os.path.split(name)
    stem, dot, extension = base.partition(".")
    return os.path.join(folder, stem) if folder else stem, extension.lower() if dot else ""


def _sample(key: str, files: Dict[str, Any], text_columns: Tuple[str, ...], read) -> Tuple[str, Dict[str, Any]]:
    """Reads text columns now, so their lengths can be packed; leaves media as slices."""
    values = {}
    for extension, where in files.items():
        if extension in text_columns:
            try:
                values[extension] = read(where).decode("utf-8")
            except UnicodeDecodeError as error:
                values[extension] = InvalidArgument(f"not UTF-8 ({error.reason} at byte {error.start})")
        else:
            values[extension] = where
    return key, values


def read_tar(path: str, start: int = 0, text_columns: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Any]]:
    """Consecutive members sharing a key make a record, as WebDataset writes them. Members are found
    by their headers alone: a skipped or foreign record's data is never read. A leading `./` (as
    `tar -C folder .` writes) is no part of a key. A key that comes back after another sample's files
    is refused: the archive was written in directory order, not with each sample's files together."""
    with open(path, "rb") as file, tarfile.open(fileobj=file, mode="r:") as archive:
        def read(where: FileSlice) -> bytes:
            file.seek(where.offset)
            return file.read(where.size)

        number, key, files, ended = -1, None, {}, set()
        for member in archive:
            if not member.isfile():
                continue
            name = member.name[2:] if member.name.startswith("./") else member.name
            member_key, extension = split_key(name)
            if member_key != key:
                if member_key in ended:
                    raise InvalidArgument(
                        f"{path}: {member.name!r} returns to sample {member_key!r} after sample {key!r}; a sample's "
                        "files must stand together: write the shard in name order, "
                        "`tar --sort=name -cf SHARD.tar -C FOLDER .`")
                ended.add(key)
                if number >= start:
                    yield _sample(key, files, text_columns, read)
                number, key, files = number + 1, member_key, {}
            if number >= start:
                files[extension] = FileSlice(path, member.offset_data, member.size)
        if key is not None and number >= start:
            yield _sample(key, files, text_columns, read)


def read_folder(path: str, start: int = 0, text_columns: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Any]]:
    """Files anywhere under the folder, grouped by key (`cat.jpg` beside `cat.txt`), in sorted order."""
    samples: Dict[str, Dict[str, FileSlice]] = {}
    for folder, subfolders, names in os.walk(path):
        subfolders.sort()
        for name in names:
            relative = os.path.relpath(os.path.join(folder, name), path)
            key, extension = split_key(relative)
            samples.setdefault(key, {})[extension] = FileSlice(os.path.join(folder, name))
    for key in itertools.islice(sorted(samples), start, None):
        yield _sample(key, samples[key], text_columns, FileSlice.read)


READERS = {"jsonl": read_jsonl, "csv": read_csv, "parquet": read_parquet, "tar": read_tar, "folder": read_folder}


def columns_of_first_record(path: str, layout: str) -> Optional[List[str]]:
    """The columns a shard offers, as its header says (CSV, Parquet) or its first record holds; None when empty."""
    if layout == "csv":
        return csv_columns(path) or None
    if layout == "parquet":
        return parquet_columns(path)
    first = next(READERS[layout](path), None)
    if first is None:
        return None
    return list(first[1] or {})


# ---------------------------------------------------------------------------------------------- #
#  Media: a file's first bytes say whether it can be what its column claims                        #
# ---------------------------------------------------------------------------------------------- #


def media_kind(head: bytes) -> Optional[str]:
    """"image", "audio" or "video" by the file's signature, or None. The library decodes; this only
    turns away, before a step, what no decoder would take (an empty file, an HTML error page)."""
    if head.startswith(b"\xff\xd8\xff") or head.startswith(b"\x89PNG\r\n\x1a\n") or head[8:12] == b"WEBP":
        return "image"
    if head[8:12] == b"WAVE" or head[:4] in (b"fLaC", b"OggS") or head[:3] == b"ID3" or head[:2] in (b"\xff\xfb", b"\xff\xf3"):
        return "audio"
    if head[4:8] == b"ftyp" or head[:4] == b"\x1a\x45\xdf\xa3" or head[8:12] == b"AVI ":
        return "video"
    return None


def read_media(value: Any, folder: str) -> bytes:
    """The bytes of a media value: bytes as they are, a slice read, a path read relative to `folder`."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, FileSlice):
        return value.read()
    if isinstance(value, str):
        return FileSlice(os.path.join(folder, value)).read()
    raise TypeError(f"expected a path or bytes, got {type(value).__name__}")
