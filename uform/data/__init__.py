"""Datasets as users hold them, as step batches: tables (JSONL, CSV, Parquet) and shards (tar files in
WebDataset's layout, folders of files with a caption beside each).

>>> from uform.data import Dataset, Stream
>>> pairs = Dataset(paths=["pairs.jsonl"], columns={"question": "text", "answer": "text"})
>>> with Stream(pairs, trainer_config) as stream:
...     step = next(stream)            # a StepBatch: .batch for trainer.step, .cursor to resume after it
...     trainer.step(step.batch)

docs/data.md describes the stream; docs/data-tables.md and docs/data-shards.md each reader.
"""

from .dataset import BadRecord, Dataset, Group, check_schema, list_shards, load_media, make_group, normalize_dataset, records
from .readers import FORMATS, FileSlice, media_kind, read_csv, read_folder, read_jsonl, read_parquet, read_tar
from .stream import StepBatch, Stream, assemble

__all__ = [
    "Dataset",
    "Stream",
    "StepBatch",
    "BadRecord",
    "Group",
    "FileSlice",
    "FORMATS",
    "records",
    "make_group",
    "load_media",
    "assemble",
    "list_shards",
    "check_schema",
    "normalize_dataset",
    "media_kind",
    "read_jsonl",
    "read_csv",
    "read_parquet",
    "read_tar",
    "read_folder",
]
