"""One reader per file layout: each turns one shard (a file or a folder) into records, in file order.

A record is `(key, values)`: `key` names it inside its shard, as messages show it (`line 13` of a
JSONL or CSV file, counted from one as editors count; `row 12 (the 13th)` of a Parquet file, whose
rows are numbered from zero; a sample's key in a tar file or a folder) and `values` maps each column
the dataset asks for to what the shard holds. Text columns arrive as `str`; media columns as `bytes`, a path (`str`, from a table, resolved
against the table's folder), or a `FileSlice` read only when its batch is assembled, so a process
never reads the pictures of the records other processes train on. Every reader can start at a
record number, which is how a resumed stream continues mid-shard without replaying what came before.

A shard that breaks off (a download cut short, a damaged file) ends with one more record whose
values are an `InvalidArgument` saying where and how: the stream counts it as a bad record, or
refuses it, as the dataset asks, so no record is lost without a word.
"""

from __future__ import annotations

import codecs
import csv
import io
import itertools
import json
import os
import sys
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
            return _whole(file.read(-1 if self.size is None else self.size), self.size)


def _whole(data: bytes, size: Optional[int]) -> bytes:
    """`data`, unless a member's bytes stop short of the size its header gave: an archive cut short."""
    if size is not None and len(data) < size:
        raise EOFError(f"cut short: the file ends {len(data)} bytes into this {size}-byte member")
    return data


def counted(noun: str, index: int) -> str:
    """A place numbered from zero, with its ordinal beside it so that it reads one way only: `row 12 (the 13th)`."""
    ordinal = index + 1
    suffix = "th" if ordinal % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(ordinal % 10, "th")
    return f"{noun} {index} (the {ordinal}{suffix})"


def _broken(where: str, reason: object) -> Tuple[str, InvalidArgument]:
    """The record a shard ends with where it breaks off: the stream names it as bad."""
    return where, InvalidArgument(f"the shard breaks off here ({reason}); any records after this point are lost")


def _unreadable(reason: str) -> Tuple[str, InvalidArgument]:
    """The one record of a shard that is no file of its layout at all."""
    return "byte offset 0", InvalidArgument(reason)


def shard_format(path: str, given: Optional[str], field_path: str = "data.paths") -> str:
    """The layout of one shard: `given`, or what its extension (or being a folder) says."""
    section = field_path.split(".")[0]
    if given is not None:
        if os.path.isdir(path) != (given == "folder"):  # read as it is not, it would fail with no field to name
            what = "a folder" if os.path.isdir(path) else "a file"
            raise InvalidArgument(f"{field_path}: {path!r} is {what}, which {section}.format = {given!r} does not "
                                  f"read; leave {section}.format out to read each path by its extension or as a folder")
        return given
    if os.path.isdir(path):
        return "folder"
    extension = os.path.splitext(path)[1].lower()
    if extension not in _EXTENSIONS:
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
    counts as a record, whose values are None, so the stream can name it as bad. Bytes that are not
    UTF-8 stay in its strings as lone surrogates, as in CSV, so the text holding them is named. A
    byte-order mark opening the file (as Windows tools write UTF-8) is no part of the first record."""
    with open(path, "rb") as lines:
        records = ((number, line) for number, line in enumerate(lines, 1) if line.strip())
        for number, line in itertools.islice(records, start, None):
            if number == 1 and line.startswith(codecs.BOM_UTF8):
                line = line[len(codecs.BOM_UTF8):]
            try:
                values = json.loads(line.decode("utf-8", "surrogateescape"))
            except ValueError:
                values = None
            yield f"line {number}", values if isinstance(values, dict) else None


def _csv_rows(file: Any) -> Any:
    """A CSV reader whose fields may be as long as a JSONL line's values: the module's default limit of 128 KiB
    would end a shard at its first long text (the limit is the process's; raising it harms no other reader)."""
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    return csv.reader(file)


class _Lines:
    """A file's lines as a csv reader takes them, keeping those of the row it reads (`taken`)."""

    def __init__(self, file: Any) -> None:
        self.file, self.taken = file, []

    def __iter__(self) -> "_Lines":
        return self

    def __next__(self) -> str:
        line = next(self.file)
        self.taken.append(line)
        return line


def _never_closed(lines: List[str]) -> bool:
    """Whether a row's lines end inside a quoted field: a quote left open reads every line after it into the
    field, which the csv module, not strict, answers without a word at the file's end."""
    try:
        next(csv.reader(io.StringIO("".join(lines)), strict=True), None)
    except csv.Error as error:
        return "unexpected end of data" in str(error)
    return False


def read_csv(path: str, start: int = 0, text_columns: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Any]]:
    """A header row names the columns; every later row is a record (quoted fields may span lines, and
    is named by the line it begins on); blank lines are no records, as `csv.DictReader` has it. A
    byte-order mark opening the file is skipped (`utf-8-sig`), as for JSONL. A quote never closed
    takes the rest of the file into its record: that record is the shard breaking off, so the records
    read into it are not lost silently (each row is held until the next is read, to tell)."""
    with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as file:
        lines = _Lines(file)
        rows, number, line, held = _csv_rows(lines), 0, 1, None
        try:
            header = next(rows, None)
            while header is not None:
                line = rows.line_num + 1  # where the next row begins
                lines.taken = []
                row = next(rows, None)
                if row is None:
                    break
                if not row:
                    continue
                if held is not None:
                    yield held
                    held = None
                if number >= start:  # a short row lacks the fields past its end; a long row's extra ones are dropped
                    held, held_lines = (f"line {line}", dict(zip(header, row))), lines.taken
                number += 1
            if held is not None and _never_closed(held_lines):
                held = _broken(held[0], f"a quote opened in this record is never closed, so the file's last "
                                        f"{len(held_lines)} lines were read into it")
        except csv.Error as error:  # a field over even the raised limit; a NUL byte before Python 3.11
            held = _broken(f"line {line}", error)  # where the row it could not read begins
        if held is not None:
            yield held


def read_parquet(path: str, start: int = 0, text_columns: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Any]]:
    """Row groups are read one at a time; a resumed stream skips whole row groups by their row counts."""
    parquet, first = _pyarrow_parquet(), 0
    try:
        table = parquet.ParquetFile(path)
    except Exception as error:  # pyarrow's own errors: no Parquet file at all
        if start == 0:
            yield _unreadable(f"no Parquet file ({_pyarrow_reason(error)})")
        return
    for group in range(table.num_row_groups):
        rows = table.metadata.row_group(group).num_rows
        if first + rows <= start:
            first += rows
            continue
        try:
            values_of_rows = table.read_row_group(group).to_pylist()
        except Exception as error:
            yield _broken(counted("row group", group), _pyarrow_reason(error))
            return
        for offset, values in enumerate(values_of_rows):
            if first + offset >= start:
                yield counted("row", first + offset), values
        first += rows


def _pyarrow_reason(error: Exception) -> str:
    return f"{type(error).__name__}: {error}".strip()


def parquet_columns(path: str) -> List[str]:
    parquet = _pyarrow_parquet()
    try:
        return list(parquet.ParquetFile(path).schema_arrow.names)
    except Exception as error:
        raise InvalidArgument(f"data.paths: {path}: no Parquet file ({_pyarrow_reason(error)})") from None


def _pyarrow_parquet():
    try:
        import pyarrow.parquet
    except ImportError:
        raise InvalidArgument("data.paths: reading Parquet needs pyarrow: pip install pyarrow") from None
    return pyarrow.parquet


def csv_columns(path: str) -> List[str]:
    with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as file:
        return next(_csv_rows(file), [])


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
            except EOFError as error:
                values[extension] = InvalidArgument(str(error))
        else:
            values[extension] = where
    return key, values


def read_tar(path: str, start: int = 0, text_columns: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Any]]:
    """Consecutive members sharing a key make a record, as WebDataset writes them. Members are found
    by their headers alone: a skipped or foreign record's data is never read. A leading `./` (as
    `tar -C folder .` writes) is no part of a key. A key that comes back after another sample's files
    is refused: the archive was written in directory order, not with each sample's files together.
    An archive that stops before its end marker (two blocks of zeros) ends with a broken record."""
    with open(path, "rb") as file:
        try:
            archive = tarfile.open(fileobj=file, mode="r:")
        except tarfile.TarError as error:  # no tar header where the file starts
            if start == 0:
                yield _unreadable(f"no tar archive ({error})")
            return

        def read(where: FileSlice) -> bytes:
            file.seek(where.offset)
            return _whole(file.read(where.size), where.size)

        number, key, files, ended, members, broken = -1, None, {}, set(), iter(archive), None
        while True:
            try:
                member = next(members)
            except StopIteration:
                break
            except tarfile.TarError as error:  # tarfile notices a member's data cut short
                broken = str(error)
                break
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
        file.seek(archive.offset)  # where tarfile stopped: the end marker, or where the archive broke off
        end = file.read(tarfile.BLOCKSIZE)
        if broken is None and (len(end) < tarfile.BLOCKSIZE or end.strip(b"\0")):
            broken = "the file ends without the archive's end marker" if not end else "no valid member header follows"
        if broken is not None and number + 1 >= start:
            yield _broken(f"byte offset {archive.offset}", broken)


def read_folder(path: str, start: int = 0, text_columns: Tuple[str, ...] = ()) -> Iterator[Tuple[str, Any]]:
    """Files anywhere under the folder, grouped by key (`cat.jpg` beside `cat.txt`), in sorted order. Hidden
    files and folders (`.DS_Store`, `.ipynb_checkpoints/`), which tools leave beside data, are no records."""
    samples: Dict[str, Dict[str, FileSlice]] = {}
    for folder, subfolders, names in os.walk(path):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        for name in names:
            if name.startswith("."):
                continue
            relative = os.path.relpath(os.path.join(folder, name), path)
            key, extension = split_key(relative)
            samples.setdefault(key, {})[extension] = FileSlice(os.path.join(folder, name))
    for key in itertools.islice(sorted(samples), start, None):
        yield _sample(key, samples[key], text_columns, FileSlice.read)


READERS = {"jsonl": read_jsonl, "csv": read_csv, "parquet": read_parquet, "tar": read_tar, "folder": read_folder}


def columns_of_first_record(path: str, layout: str, most: int = 1) -> Optional[List[str]]:
    """The columns a shard offers, as its header says (CSV, Parquet), or as its first `most` records that read
    hold (in order, each once): one that does not read (a line that is no JSON object) is passed over, a bad
    record the stream will name, unless no record among the first 64 reads. None when the shard is empty."""
    if layout == "csv":
        return csv_columns(path) or None
    if layout == "parquet":
        return parquet_columns(path)
    offered: Dict[str, None] = {}
    first, read = None, 0
    for where, values in itertools.islice(READERS[layout](path), 64):
        first = first or (where, values)
        if isinstance(values, dict):
            offered.update(dict.fromkeys(values))
            read += 1
            if read == most:
                break
    if first is None:
        return None
    if not read and isinstance(first[1], InvalidArgument):
        raise InvalidArgument(f"data.paths: {path}: {first[1]}")
    if not read and layout == "jsonl":
        raise InvalidArgument(f"data.paths: {path}: its first line is no JSON object, nor any of the first 64; if it "
                              "is no JSONL file, name its layout in data.format")
    return list(offered)


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
