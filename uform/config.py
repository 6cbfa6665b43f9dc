"""Enumerations and config dataclasses: the shape of a training run, in Python's words.

Every config type is a dataclass and may equally be given as a plain dict with the same keys, at
any nesting level. Absent fields, and fields given as `None`, derive: the C library reads zero as
"derive the documented default" (see `uform.h`). The few it cannot derive are named here when
missing. An unknown key raises `InvalidArgument` naming its full path, as does a value of the wrong
type.

`normalize_trainer_config` and `normalize_step_config` turn either form into the plain nested dicts
of C-ready values (ints, floats, uint32 arrays, encoded paths) that the compiled core converts into
the C structs by name: the dataclasses' fields are the structs' members (`tests/test_config.py`).
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import operator
import os
import re
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from . import _native
from .errors import ConfigWarning, InvalidArgument, unknown_field
from .outputs import Arena, Scalar

__all__ = [
    "Modality",
    "Objective",
    "Negatives",
    "Determinism",
    "PairLossForm",
    "LateInteractionSide",
    "ImageShape",
    "VideoShape",
    "AudioShape",
    "BatchShape",
    "Masking",
    "Contrastive",
    "LateInteraction",
    "Choices",
    "Schedule",
    "TrainerConfig",
    "TrainerStepConfig",
]

# ---------------------------------------------------------------------------------------------- #
#  Enumerations                                                                                    #
# ---------------------------------------------------------------------------------------------- #


class Modality(str, enum.Enum):
    """What the bytes of one training item hold."""

    TEXT = "text"  #: UTF-8 text, tokenized as bytes.
    IMAGE = "image"  #: An encoded image file (JPEG, PNG, WebP).
    VIDEO = "video"  #: An encoded video file.
    AUDIO = "audio"  #: An encoded audio file.


class Objective(str, enum.Enum):
    """Which losses a training step relaxes."""

    MASKED = "masked"  #: Masked reconstruction alone.
    CONTRASTIVE = "contrastive"  #: The pairwise contrastive loss alone.
    JOINT = "joint"  #: Both, joined at the final-norm states.


class Negatives(str, enum.Enum):
    """Which pairs the contrastive loss pushes apart."""

    AMBIENT = "ambient"  #: Repel edges, and every pair no edge names.
    NAMED = "named"  #: Repel edges alone.


class Determinism(str, enum.Enum):
    """Whether a run's bits repeat: the same seed and batches, the same bits, on the same GPU."""

    BITWISE = "bitwise"  #: Every sum in a fixed order: runs repeat bit for bit.
    FAST = "fast"  #: cuDNN's attention (off Hopper) adds query gradients as they land: ~4 % faster, last bits vary.


class PairLossForm(enum.IntEnum):
    """How a contrastive term turns a row of scores into forces, numbered as the C library numbers them."""

    DERIVED = 0  #: The term's own form: sigmoid for pooled embeddings, ranked for token vectors.
    BALANCED = 1  #: Sigmoid cross-entropy per cell, attract and repel halves normalized apart.
    RANKED = 2  #: Sigmoid cross-entropy of every positive's score over every negative's.
    SIGMOID = 3  #: SigLIP's sigmoid cross-entropy per cell, every cell weighed alike.


class LateInteractionSide(enum.IntEnum):
    """Which side of a late-interaction score an item takes, numbered as the C library numbers them."""

    NONE = 0  #: The item takes no part in late interaction.
    QUERY = 1  #: The item's tokens score the documents it attracts and repels.
    DOCUMENT = 2  #: The item's tokens are scored by the queries naming it.
    QUERY_AND_DOCUMENT = 3  #: The item plays both sides.


# ---------------------------------------------------------------------------------------------- #
#  Field kinds: how one field's Python value becomes its C value                                   #
# ---------------------------------------------------------------------------------------------- #


def article(noun: str) -> str:
    """`noun` after "a" or "an", as its first letter sounds: "a Modality", "an Objective"."""
    return f"{'an' if noun[:1].lower() in ('a', 'e', 'i', 'o', 'u') else 'a'} {noun}"


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def unsigned(value: Any, bits: int, path: str) -> int:
    """An unsigned integer of `bits` bits, or `InvalidArgument` naming `path`."""
    if isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(f"{path}: expected an unsigned integer, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidArgument(f"{path}: expected an unsigned integer, got {type(value).__name__} {_describe(value)}") from None
    if number < 0:
        raise InvalidArgument(f"{path}: {number} is negative, expected an unsigned integer")
    if number >> bits:
        raise InvalidArgument(f"{path}: {number} exceeds 2**{bits} - 1")
    return number


def real(value: Any, path: str) -> float:
    """A real number, or `InvalidArgument` naming `path`. Finiteness and ranges are the C library's to judge."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidArgument(f"{path}: expected a number, got {type(value).__name__} {_describe(value)}")
    try:
        return float(value)
    except OverflowError:
        raise InvalidArgument(f"{path}: {_describe(value)} does not fit a float") from None


def unsigned_array(values: Any, dtype: Any, path: str) -> np.ndarray:
    """A one-dimensional C-contiguous array of `dtype` (uint32 or uint64) from a sequence or an array.

    An array already of that dtype and contiguous is returned as is, so C reads the caller's memory;
    anything else is converted once. Negative, too large or non-integer entries raise `InvalidArgument`
    naming `path` and the entry.
    """
    dtype = np.dtype(dtype)
    limit = int(np.iinfo(dtype).max)
    if isinstance(values, np.ndarray):
        array = values
    elif isinstance(values, (str, bytes, bytearray)) or not hasattr(values, "__len__") and not hasattr(values, "__iter__"):
        raise InvalidArgument(f"{path}: expected a sequence of unsigned integers, got {type(values).__name__}")
    else:
        try:
            array = np.asarray(values if hasattr(values, "__len__") else list(values))
        except (ValueError, TypeError, OverflowError) as failure:
            raise InvalidArgument(f"{path}: expected a sequence of unsigned integers ({failure})") from None
    if array.ndim != 1:
        raise InvalidArgument(f"{path}: expected one dimension, got shape {array.shape}")
    if array.dtype == dtype:
        return np.ascontiguousarray(array)
    if array.size == 0:
        return np.zeros(0, dtype)
    kind = array.dtype.kind
    if kind in "iu":
        smallest, largest = int(array.min()), int(array.max())
        if smallest < 0:
            raise InvalidArgument(f"{path}[{int(array.argmin())}]: {smallest} is negative, expected an unsigned integer")
        if largest > limit:
            raise InvalidArgument(f"{path}[{int(array.argmax())}]: {largest} exceeds 2**{dtype.itemsize * 8} - 1")
        return array.astype(dtype)
    if kind == "O":
        return np.array([unsigned(entry, dtype.itemsize * 8, f"{path}[{i}]") for i, entry in enumerate(array)], dtype)
    first = _describe(array[0].item()) if kind in "fc" else _describe(array[0])
    raise InvalidArgument(f"{path}: expected unsigned integers, got {array.dtype} (such as {first})")


def float32_array(values: Any, path: str) -> np.ndarray:
    """A one-dimensional C-contiguous float32 array; a float32 array that already is one is kept as is."""
    if isinstance(values, np.ndarray):
        array = values
    elif isinstance(values, (str, bytes, bytearray)) or not hasattr(values, "__len__"):
        raise InvalidArgument(f"{path}: expected a sequence of numbers, got {type(values).__name__}")
    else:
        try:
            array = np.asarray(values)
        except (ValueError, TypeError) as failure:
            raise InvalidArgument(f"{path}: expected a sequence of numbers ({failure})") from None
    if array.ndim != 1:
        raise InvalidArgument(f"{path}: expected one dimension, got shape {array.shape}")
    if array.dtype == np.float32:
        return np.ascontiguousarray(array)
    if array.size == 0:
        return np.zeros(0, np.float32)
    if array.dtype.kind not in "iuf":
        raise InvalidArgument(f"{path}: expected numbers, got {array.dtype}")
    with np.errstate(over="ignore"):  # an overflow is named below, as the caller gave it, not as the inf it became
        converted = array.astype(np.float32)
    overflowed = np.flatnonzero(np.isinf(converted) & np.isfinite(array))
    if overflowed.size:
        first = int(overflowed[0])
        raise InvalidArgument(f"{path}[{first}]: {array[first]} exceeds float32's range (magnitudes up to "
                              f"{float(np.finfo(np.float32).max):.8g})")
    return converted


class _Kind:
    """How one field's value becomes what the compiled core copies into the C struct."""

    def __call__(self, value: Any, path: str) -> Any:  # pragma: no cover - every kind overrides it
        raise NotImplementedError


class _Unsigned(_Kind):
    def __init__(self, bits: int, multiple: int = 1) -> None:
        self.bits = bits
        self.multiple = multiple

    def __call__(self, value, path):
        if value is None:
            return 0
        number = unsigned(value, self.bits, path)
        if number % self.multiple:
            raise InvalidArgument(f"{path}: {number} is not a multiple of {self.multiple}")
        return number


class _Real(_Kind):
    """A float32 field of the C config, where 0 derives the default: a nonzero value that float32 holds only as
    zero would silently become the default, so it is refused."""

    def __call__(self, value, path):
        number = 0.0 if value is None else real(value, path)
        if number != 0 and abs(number) < 1e-44 and np.float32(number) == 0:  # no overflow warning asked for
            raise InvalidArgument(f"{path}: {_describe(value)} rounds to 0 as a float32, which would derive the "
                                  f"default; leave it out (or None) for the default, or a magnitude of at least 1.4e-45")
        return number


class _Choice(_Kind):
    """An enumeration member, name or value, as the C library numbers it (`_native.C_ENUMS[table]`)."""

    def __init__(self, enumeration: type, table: Optional[str] = None) -> None:
        self.enumeration = enumeration
        self.table = table

    def __call__(self, value, path):
        if value is None:
            return 0
        return enum_value(self.enumeration, value, path, self.table)

    def name_of(self, number: int) -> Any:
        """The name Python and TOML take for the member the C library numbers `number`; `number` where none is."""
        if self.table is not None:
            value = next((name for name, numbered in _native.C_ENUMS[self.table].items() if numbered == number), None)
            member = None if value is None else self.enumeration(value)
        else:
            member = next((m for m in self.enumeration if m.value == number), None)
        return number if member is None else member.name.lower()


class _Path(_Kind):
    def __call__(self, value, path):
        if value is None:
            return None
        return encode_path(value, path)


class _Dimensions(_Kind):
    def __call__(self, value, path):
        if value is None:
            return None
        return unsigned_array(value, np.uint32, path)


class _Nested(_Kind):
    def __init__(self, kind: type) -> None:
        self.kind = kind

    def __call__(self, value, path):
        return normalize(self.kind, value, path)


class _Required(_Kind):
    """A field the C library cannot derive: absent, it is named here rather than reaching C as zero."""

    def __init__(self, kind: _Kind, hint: str) -> None:
        self.kind = kind
        self.hint = hint

    def __call__(self, value, path):
        if value is None:
            raise InvalidArgument(f"{path}: missing; {self.hint}")
        return self.kind(value, path)


def _names(enumeration: type) -> str:
    return ", ".join(repr(name.lower()) for name in enumeration.__members__)


def enum_member(enumeration: type, value: Any, path: str) -> enum.Enum:
    """A member given as itself, its name in any case ("ranked", "RANKED") or its value.

    `InvalidArgument` naming `path` otherwise, listing the names.
    """
    if isinstance(value, enumeration):
        return value
    member = None
    if isinstance(value, str) and not isinstance(value, enum.Enum):
        member = enumeration.__members__.get(value.upper())
    elif not isinstance(value, (bool, np.bool_, enum.Enum)):  # True is not BALANCED, nor is another enum's member
        try:
            member = enumeration(value)
        except (ValueError, TypeError):
            pass
    if member is None:
        names = _names(enumeration)
        raise InvalidArgument(f"{path}: {_describe(value)} is not {article(enumeration.__name__)} (one of {names})")
    return member


def enum_value(enumeration: type, value: Any, path: str, table: Optional[str] = None) -> int:
    """The C value of an enumeration member: its own value, or its entry in `_native.C_ENUMS[table]`."""
    member = enum_member(enumeration, value, path)
    return int(member.value) if table is None else int(_native.C_ENUMS[table][member.value])


def encode_path(value: Any, path: str) -> bytes:
    """A file-system path as the bytes C reads."""
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise InvalidArgument(f"{path}: expected a path, got {type(value).__name__} {_describe(value)}")
    try:
        encoded = os.fsencode(value)
    except UnicodeEncodeError as error:  # a lone surrogate, say, which no file name holds
        raise InvalidArgument(f"{path}: {_describe(value)} cannot be encoded as a file name ({error.reason})") from None
    if b"\0" in encoded:
        raise InvalidArgument(f"{path}: a path may not hold a NUL character")
    return encoded


def _kind(f: dataclasses.Field) -> Callable[[Any, str], Any]:
    return f.metadata["kind"]


def normalize(kind: type, value: Any, path: str) -> dict:
    """One config dataclass, given as itself, a dict or `None`, as a dict of C-ready values."""
    fields = dataclasses.fields(kind)
    if value is None:
        given: Mapping = {}
    elif isinstance(value, kind):
        given = {f.name: getattr(value, f.name) for f in fields}
    elif isinstance(value, Mapping):
        names = {f.name for f in fields}
        for key in value:
            if key not in names:
                raise unknown_field(path, key, names)
        given = value
    else:
        raise InvalidArgument(f"{path}: expected {article(kind.__name__)} or a dict, got {type(value).__name__}")
    for f in fields:
        _say_zero_derives(f, given.get(f.name), f"{path}.{f.name}")
    return {f.name: _kind(f)(given.get(f.name), f"{path}.{f.name}") for f in fields}


def _say_zero_derives(f: dataclasses.Field, value: Any, path: str) -> None:
    """Warns where a real 0 given on purpose derives a default that is not 0 (`bias = 0` starting at -10, a weight
    of 0 weighing 1): the C library reads 0 as absent, so a value meant as zero would be lost unsaid. Counts and
    sizes are left alone: their 0 is seldom meant as one, and a recorded config holds the 0 they derive when the
    term they size is off."""
    derived = re.search(r"[Aa]bsent derives (.+?)\.?(?: \(|$)", f.metadata.get("doc", ""))
    if isinstance(_kind(f), _Real) and isinstance(value, numbers.Real) and not isinstance(value, bool) and value == 0 \
            and derived and derived.group(1) not in ("0", "0."):
        warnings.warn(f"{path}: 0 is read as absent, so it derives {derived.group(1)}, not 0 (the smallest value that "
                      "is not 0 comes nearest to 0)", ConfigWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The `stacklevel` of the first frame outside this package: where the config came from."""
    level, frame, package = 1, sys._getframe(1), os.path.dirname(os.path.abspath(__file__))
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def enum_names(kind: type, values: Mapping) -> dict:
    """A config of `kind` as the C library records it (a checkpoint's `__metadata__.config`), each enumeration's
    number replaced by its member's name as Python and TOML take it (`"objective": "joint"`). Fields `kind`
    lacks, and numbers no member has, stay as they are."""
    named = dict(values)
    for f in dataclasses.fields(kind):
        value, field_kind = named.get(f.name), _kind(f)
        if isinstance(field_kind, _Required):
            field_kind = field_kind.kind
        if isinstance(field_kind, _Nested) and isinstance(value, Mapping):
            named[f.name] = enum_names(field_kind.kind, value)
        elif isinstance(field_kind, _Choice) and isinstance(value, int) and not isinstance(value, bool):
            named[f.name] = field_kind.name_of(value)
    return named


def _field(kind: Callable[[Any, str], Any], *, required: bool = False, doc: str = ""):
    """`kind(value, path)` makes the C value; `required` makes the dataclass take the field positionally."""
    metadata = {"kind": kind, "doc": doc}
    return field(metadata=metadata) if required else field(default=None, metadata=metadata)


_U32, _U64, _F32 = _Unsigned(32), _Unsigned(64), _Real()

# ---------------------------------------------------------------------------------------------- #
#  Config dataclasses                                                                              #
# ---------------------------------------------------------------------------------------------- #


@dataclass
class ImageShape:
    """How image items are cut into patches."""

    patch_side: Optional[int] = _field(_U32, doc="Pixels on a patch's side; absent derives 16.")
    channels: Optional[int] = _field(_U32, doc="Absent derives 3.")


@dataclass
class VideoShape:
    """How video items are cut into tubelets."""

    patch_side: Optional[int] = _field(_U32, doc="Absent derives 16.")
    tube_frames: Optional[int] = _field(_U32, doc="Frames in one tubelet; absent derives 2.")
    frame_stride: Optional[int] = _field(_U32, doc="Frames skipped between kept frames; absent derives 1.")
    channels: Optional[int] = _field(_U32, doc="Absent derives 3.")


@dataclass
class AudioShape:
    """How audio items are cut into chunks."""

    chunk_samples: Optional[int] = _field(_U32, doc="Samples in one chunk; absent derives 400.")
    sample_rate: Optional[int] = _field(_U32, doc="Samples per second audio is resampled to; absent derives 16000.")


@dataclass
class BatchShape:
    """What one device's step carries at most.

    A row is one packed sequence of `max_columns_per_row` token positions (bytes, for text);
    segments are the items packed into rows. Items longer than a row are cut to it, in training
    and in `Encoder.embed` alike.

    **Absent, it derives 64 rows of 512 columns per device**: a trainer then holds activations for
    32,768 token positions, whatever the items. Give the shape the items need.
    """

    max_rows_per_device: Optional[int] = _field(_U32, doc="Absent derives 64.")
    max_segments_per_device: Optional[int] = _field(_U32, doc="Items one device takes; absent derives 8 per row.")
    max_columns_per_row: Optional[int] = _field(_U32, doc="Token positions in a row; absent derives 512.")
    max_bags_per_device: Optional[int] = _field(_U32, doc="Absent derives max_segments_per_device.")
    max_choices_per_item: Optional[int] = _field(_U32, doc="Legal bytes one item offers; absent makes no choices.")
    image: Union[ImageShape, dict, None] = _field(_Nested(ImageShape))
    video: Union[VideoShape, dict, None] = _field(_Nested(VideoShape))
    audio: Union[AudioShape, dict, None] = _field(_Nested(AudioShape))


@dataclass
class Masking:
    """How the masked objective corrupts a batch and weighs its heads."""

    token_mask_probability: Optional[float] = _field(_F32, doc="Share of text positions chosen; absent derives 0.15.")
    token_mean_span: Optional[float] = _field(_F32, doc="Mean span length, 1 to max_columns_per_row; absent derives 3.")
    replace_fraction: Optional[float] = _field(_F32, doc="Chosen positions shown as the mask id; absent derives 0.8.")
    random_fraction: Optional[float] = _field(_F32, doc="Chosen positions shown as a random byte; absent derives 0.1.")
    image_mask_ratio: Optional[float] = _field(_F32, doc="Absent derives 0.75.")
    video_mask_ratio: Optional[float] = _field(_F32, doc="Absent derives 0.9.")
    audio_mask_ratio: Optional[float] = _field(_F32, doc="Absent derives 0.5.")
    text_weight: Optional[float] = _field(_F32, doc="Absent derives 1.")
    image_weight: Optional[float] = _field(_F32, doc="Absent derives 1.")
    video_weight: Optional[float] = _field(_F32, doc="Absent derives 1.")
    audio_weight: Optional[float] = _field(_F32, doc="Absent derives 1.")


@dataclass
class Contrastive:
    """How the contrastive loss scores the pooled embeddings."""

    matryoshka_dimensions: Optional[Sequence[int]] = _field(_Dimensions(), doc="Prefix widths; absent derives [hidden].")
    temperature_groups: Optional[int] = _field(_U32, doc="Learnable (temperature, bias) pairs; absent derives 1.")
    inverse_temperature: Optional[float] = _field(_F32, doc="Initial inverse temperature; absent derives 10.")
    bias: Optional[float] = _field(_F32, doc="Initial bias; absent derives -10.")
    negatives: Union[Negatives, str, None] = _field(_Choice(Negatives, "negatives"), doc="Absent derives Negatives.AMBIENT.")
    ambient_repulsion_weight: Optional[float] = _field(_F32, doc="Weight of each ambient negative; absent derives 1.")
    max_edges_per_device: Optional[int] = _field(
        _U32, doc="Attract + repel + ignore edges, at most 2^24; absent derives 64 per segment.")
    pair_loss: Union[PairLossForm, str, int, None] = _field(_Choice(PairLossForm), doc="Absent keeps sigmoid.")


@dataclass
class LateInteraction:
    """How the late-interaction loss scores token vectors."""

    weight: Optional[float] = _field(_F32, doc="The loss weight; absent trains no token head.")
    width: Optional[int] = _field(_U32, doc="The token vectors' width, a multiple of 8; absent derives 128.")
    inverse_temperature: Optional[float] = _field(_F32, doc="The learned scale's start; absent derives 1.")
    bias: Optional[float] = _field(_F32, doc="The learned bias's start; absent derives 0.")
    max_query_span: Optional[int] = _field(
        _U32, doc="A query's rows: cut to it and padded up to it; absent derives 32 (or what a row leaves).")
    max_query_tokens_per_device: Optional[int] = _field(
        _U32, doc="Query rows a step carries; absent derives max_segments_per_device x max_query_span.")
    max_documents_per_device: Optional[int] = _field(
        _U32, doc="Document-side items a step carries; absent derives max_segments_per_device.")
    max_document_tokens_per_device: Optional[int] = _field(
        _U32, doc="Document rows a step carries; absent derives the batch's tokens.")
    pair_loss: Union[PairLossForm, str, int, None] = _field(_Choice(PairLossForm), doc="Absent keeps ranked.")


@dataclass
class Choices:
    """The choices term: read when its weight is positive, which needs `batch.max_choices_per_item`."""

    weight: Optional[float] = _field(_F32, doc="The loss weight.")


@dataclass
class Schedule:
    """The learning-rate schedule: linear warm-up, then cosine to the minimum at `steps`."""

    steps: int = _field(_Required(_U64, "the steps the run takes, which the cosine schedule spans"), required=True,
                        doc="Steps the run takes, which the cosine spans; required.")
    learning_rate: Optional[float] = _field(_F32, doc="Absent derives 1e-3.")
    min_learning_rate: Optional[float] = _field(_F32, doc="Absent derives learning_rate / 10.")
    warmup_steps: Optional[int] = _field(_U64, doc="Absent (or 0) derives steps / 20; 1 warms up over none.")


@dataclass
class TrainerConfig:
    """A training run's geometry, objectives and schedule.

    `depth`, `hidden`, `objective` and `schedule.steps` are required: absent (or None), each raises
    `InvalidArgument` naming it, `config.depth: missing; ...`, before any C call (the dataclass, like
    any, raises `TypeError` when one is left out of its constructor). **A config without `batch`
    derives 64 rows of 512 columns per device** (see `BatchShape`): give it whenever items are short.
    """

    depth: int = _field(_Required(_U32, "the transformer blocks to stack"), required=True,
                        doc="Transformer blocks stacked; required.")
    hidden: int = _field(_Required(_Unsigned(32, multiple=128), "the embedding width, a multiple of 128"),
                         required=True, doc="Embedding width, a multiple of 128; required.")
    objective: Union[Objective, str] = _field(_Required(_Choice(Objective, "objective"), f"one of {_names(Objective)}"),
                                              required=True, doc="Which losses the run relaxes; required.")
    schedule: Union[Schedule, dict] = _field(_Nested(Schedule), required=True, doc="Its `steps` are required.")
    batch: Union[BatchShape, dict, None] = _field(_Nested(BatchShape),
                                                  doc="Absent derives 64 rows of 512 columns per device.")
    resume: Union[str, os.PathLike, None] = _field(_Path(), doc="The checkpoint to continue from.")
    masking: Union[Masking, dict, None] = _field(_Nested(Masking))
    contrastive: Union[Contrastive, dict, None] = _field(_Nested(Contrastive))
    late_interaction: Union[LateInteraction, dict, None] = _field(_Nested(LateInteraction))
    choices: Union[Choices, dict, None] = _field(_Nested(Choices))
    seed: Optional[int] = _field(_U64, doc="The base of every keyed draw, up to 2**64 - 1.")
    determinism: Union[Determinism, str, None] = _field(_Choice(Determinism, "determinism"),
                                                        doc="Absent derives Determinism.BITWISE; the CPU ignores it.")


def optional_arena(value: Any, path: str) -> Optional[Arena]:
    """An `Arena` or None; `InvalidArgument` naming `path` otherwise."""
    if value is not None and not isinstance(value, Arena):
        raise InvalidArgument(f"{path}: expected a uform.Arena, got {type(value).__name__}")
    return value


def scalar_member(value: Any, path: str) -> Scalar:
    """A `Scalar` given as itself, its name or its value; absent is F32."""
    return Scalar.F32 if value is None else enum_member(Scalar, value, path)


@dataclass
class TrainerStepConfig:
    """Where a step lands the embeddings it scored, when a caller wants them."""

    arena: Optional[Arena] = _field(optional_arena, doc="A uform.Arena the embeddings land in; absent skips the copy.")
    outputs_scalar: Union[Scalar, str, None] = _field(scalar_member, doc="The scalar they land as; absent lands F32.")


def normalize_trainer_config(config: Any) -> dict:
    """A `TrainerConfig` or dict as nested dicts of C-ready values."""
    if config is None:
        raise InvalidArgument("config: required, a TrainerConfig or a dict")
    return normalize(TrainerConfig, config, "config")


def normalize_step_config(config: Any) -> dict:
    """A `TrainerStepConfig` or dict as `{"arena": Arena or None, "outputs_scalar": Scalar}`."""
    return normalize(TrainerStepConfig, config, "config")
