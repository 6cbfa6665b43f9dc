"""What a step answers: its `Stats`, and the embeddings it scored as `Rows` of a `Scalar` inside an `Arena`."""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Mapping
from typing import Any, Callable, Iterator, Optional

import numpy as np

from .errors import Busy

__all__ = ["Scalar", "Stats", "Arena", "Rows", "Stepped"]


class Scalar(str, enum.Enum):
    """The scalar type outputs land in; `I8` stores `round(127 * x)` of unit-norm vectors."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    I8 = "i8"


_ALIGNMENT = 64
_ITEM_BYTES = {Scalar.F32: 4, Scalar.F16: 2, Scalar.BF16: 2, Scalar.I8: 1}
_DTYPES = {Scalar.F32: np.float32, Scalar.F16: np.float16, Scalar.BF16: np.uint16, Scalar.I8: np.int8}


class Stats:
    """What one step reports, read as attributes or as a read-only mapping.

    `stats.loss` and `stats["loss"]` are the same number; `dict(stats)`, `keys()`, `values()` and
    `get()` read it as a mapping. One field is named `items` (the items this process contributed),
    so `stats.items` is that count, not the mapping method: use `dict(stats).items()` for pairs.
    Losses of terms that did not run read NaN.

    Fields: `step` (after this update), `learning_rate` (used by this update), `loss` (the weighted
    total), `masked_loss`, `contrastive_loss`, `late_interaction_loss`, `choices_loss`, `image_loss`, `video_loss`, `audio_loss`, `grad_norm`
    (before clipping), `items`, `tokens`, `truncated_items`, `masked_positions` (the positions the
    masked term scored), `contrastive_rows` (the anchor rows the contrastive term counted),
    `choice_items` (the items whose choices the choices term scored), `query_rows` (the query rows
    the late-interaction term counted), `masked_patches` (the media tokens, image patches, video tubelets and audio chunks, hidden and
    reconstructed),
    `host_seconds` (from the call until the step's inputs were validated, packed and queued for
    upload: the time a GPU waits for the host),
    `skipped` (no term scored anything, or a loss or the gradient was not finite: the weights, the
    moments and `step` stayed as they were), and `inverse_temperatures` and `biases` (one per
    temperature group, the values this step scored with).
    """

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_values", dict(values))

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"Stats has no field {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Stats are read-only")

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stats) and self._values == other._values

    __hash__ = None  # type: ignore[assignment]

    def keys(self):
        """The field names, in the C struct's order."""
        return self._values.keys()

    def values(self):
        """The field values, in the C struct's order."""
        return self._values.values()

    def get(self, key: str, default: Any = None) -> Any:
        """The field's value, or `default` when there is no such field."""
        return self._values.get(key, default)

    def __dir__(self):
        return sorted(set(object.__dir__(self)) | set(self._values))

    def __reduce__(self):
        return (Stats, (self._values,))

    def __repr__(self) -> str:
        def show(value: Any) -> str:
            if isinstance(value, float):
                return "nan" if math.isnan(value) else f"{value:.6g}"
            if isinstance(value, list):
                return "[" + ", ".join(show(entry) for entry in value) + "]"
            return repr(value)

        return "Stats(" + ", ".join(f"{key}={show(value)}" for key, value in self._values.items()) + ")"


class Arena:
    """Reusable memory where a step's embeddings land.

    Pass it as `TrainerStepConfig(arena=...)` or to `Encoder.embed`. It grows to the largest step it
    served and is reused by the next: the `Rows` a step answers are views into it, valid until the
    arena's next use. Copy them (`numpy.array(rows)`) to keep them longer. A verb claims the arena
    from its submission until it finishes, so each deferred step in flight needs its own arena:
    naming a claimed one raises `uform.Busy`.
    """

    __slots__ = ("_storage", "_capacity", "_held", "__weakref__")

    def __init__(self) -> None:
        self._storage: Optional[np.ndarray] = None  # 64-byte aligned uint8 view
        self._capacity = 0
        self._held = threading.Lock()  # from a verb's submission until it finishes, released on the worker

    def _claim(self, path: str) -> Callable[[], None]:
        """Holds the arena from now until the answer is called; `Busy` naming `path` if another holds it."""
        if not self._held.acquire(blocking=False):
            raise Busy(f"{path}: a verb still in flight lands in this Arena; "
                       "each deferred verb in flight needs its own Arena")
        return self._held.release

    def _claim_for(self, call: Any, path: str) -> Any:
        """`call`, holding the arena from now until it returns or raises; `Busy` naming `path` if another holds it."""
        release = self._claim(path)

        def holding() -> Any:
            try:
                return call()
            finally:
                release()

        return holding

    @property
    def capacity(self) -> int:
        """Bytes the arena holds now."""
        return self._capacity

    def _reserve(self, nbytes: int) -> np.ndarray:
        """A 64-byte aligned uint8 array of `nbytes`, growing the arena when it is too small."""
        if nbytes > self._capacity or self._storage is None:
            capacity = max(nbytes, 2 * self._capacity, _ALIGNMENT)
            raw = np.empty(capacity + _ALIGNMENT, np.uint8)
            start = (-raw.ctypes.data) % _ALIGNMENT
            self._storage = raw[start : start + capacity]
            self._capacity = capacity
        return self._storage[:nbytes]

    def __repr__(self) -> str:
        return f"Arena({self._capacity} bytes)"


class Rows:
    """Embeddings a step scored: `shape == (items, hidden)` scalars of type `scalar`, inside an `Arena`.

    `numpy.asarray(rows)` or `rows.numpy()` is a view without a copy: float32, float16 or int8
    (`round(127 * x)` of unit-norm vectors); BF16 reads as its raw uint16 bits. `to_float32()`
    converts any of them to float32. The view is valid until the arena's next use.
    """

    __slots__ = ("_array", "_scalar", "_truncated_items")

    def __init__(self, memory: np.ndarray, scalar: Scalar, shape: tuple, truncated_items: Optional[int] = None) -> None:
        self._scalar = Scalar(scalar)
        self._array = memory.view(_DTYPES[self._scalar]).reshape(shape)
        self._truncated_items = truncated_items

    @property
    def scalar(self) -> Scalar:
        """The scalar type the rows landed as."""
        return self._scalar

    @property
    def truncated_items(self) -> Optional[int]:
        """Items `Encoder.embed` fitted to a row of the checkpoint's `batch.max_columns_per_row` tokens:
        texts cut, images shrunk, video and audio cut at the end.

        None on a training step's rows, whose `Stats.truncated_items` counts them.
        """
        return self._truncated_items

    @property
    def shape(self) -> tuple:
        """(items, hidden)."""
        return self._array.shape

    def __len__(self) -> int:
        return self._array.shape[0]

    def numpy(self) -> np.ndarray:
        """The rows as a numpy view in their own scalar type (BF16 as raw uint16)."""
        return self._array

    def __array__(self, dtype: Any = None, copy: Optional[bool] = None) -> np.ndarray:
        if dtype is None or np.dtype(dtype) == self._array.dtype:
            return self._array.copy() if copy else self._array
        if copy is False:
            raise ValueError(f"Rows of {self._scalar.value} cannot be read as {np.dtype(dtype)} without a copy")
        return self._array.astype(dtype)

    def to_float32(self) -> np.ndarray:
        """The rows converted to a new float32 array, whatever their scalar type."""
        if self._scalar is Scalar.BF16:
            return (self._array.astype(np.uint32) << 16).view(np.float32)
        if self._scalar is Scalar.I8:
            return self._array.astype(np.float32) / np.float32(127)
        return self._array.astype(np.float32)

    def __repr__(self) -> str:
        return f"Rows({self.shape[0]} x {self.shape[1]} {self._scalar.value})"


class Stepped:
    """What one step answers: its `stats`, and the `embeddings` it scored when an arena was given."""

    __slots__ = ("stats", "embeddings")

    def __init__(self, stats: Stats, embeddings: Optional[Rows] = None) -> None:
        self.stats = stats
        self.embeddings = embeddings

    def __iter__(self):  # `stats, embeddings = trainer.step(...)`
        return iter((self.stats, self.embeddings))

    def __repr__(self) -> str:
        return f"Stepped(stats={self.stats!r}, embeddings={self.embeddings!r})"
