"""The errors uform raises: one base, each subclass also a familiar built-in.

The C library answers every failure with a status code and a message naming the field and value
at fault; the binding raises the class below that matches the status, with that message as text.
"""

import difflib
from typing import Any, Iterable

__all__ = [
    "Error",
    "InvalidArgument",
    "InvalidCheckpoint",
    "InvalidHandle",
    "Busy",
    "Unsupported",
    "OutOfMemory",
    "StorageError",
    "DeviceError",
    "PeerError",
    "ConfigWarning",
]


class Error(Exception):
    """The base of every error uform raises."""


class ConfigWarning(UserWarning):
    """A config field given a value the library takes otherwise than it reads: 0 where 0 derives a default."""


class InvalidArgument(Error, ValueError):
    """A config or batch field is wrong; the message names it. Nothing changed."""


class InvalidCheckpoint(InvalidArgument):
    """A checkpoint is malformed or belongs to another geometry; the message names the field."""


class InvalidHandle(Error, RuntimeError):
    """An executor, mesh or trainer was used after it was freed."""


class Busy(Error, RuntimeError):
    """Something is in use: an executor or mesh a live trainer borrows, an `Arena` a verb in flight
    lands in, or the executor's worker thread, where a blocking verb would wait for itself."""


class Unsupported(Error, NotImplementedError):
    """This build or this machine lacks what the call needs (a GPU, a modality, a term)."""


class OutOfMemory(Error, MemoryError):
    """Memory ran out; nothing changed."""


class StorageError(Error, OSError):
    """Reading or writing a file failed; the message names the path and the reason."""


class DeviceError(Error, RuntimeError):
    """The GPU failed: a CUDA error or a lost device; the message names the call. The run's state on
    that device is unknown: free the trainer and resume from a checkpoint."""


class PeerError(Error, ConnectionError):
    """A mesh's peer did not come, or stopped answering, within the mesh's timeout, or hung up; the message
    names the host domain. After a step fails this way the processes are out of step: free the trainer and
    the mesh, and resume every process from a checkpoint."""


for _error in (Error, InvalidArgument, InvalidCheckpoint, InvalidHandle, Busy, Unsupported, OutOfMemory, StorageError,
               DeviceError, PeerError):
    _error.__module__ = "uform"  # tracebacks show `uform.InvalidArgument`, where users import it from
del _error


def unknown_field(path: str, key: Any, names: Iterable[str]) -> InvalidArgument:
    """`path.key` refused as no field of `names`, with the one it misspells or begins where there is one (a key
    whose last character is mistyped, as `max_rowz` is, included)."""
    names, key_text = sorted(names), str(key)  # the same suggestion run to run, whatever the order of a set of names
    near = ([name for name in names if name.startswith(key_text)]
            or difflib.get_close_matches(key_text, names, n=1, cutoff=0.75)
            or [name for name in names if len(key_text) > 3 and name.startswith(key_text[:-1])])
    return InvalidArgument(f"{path}.{key}: unknown field" + (f" (did you mean {near[0]}?)" if near else ""))
