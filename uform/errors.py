"""The errors uform raises: one base, each subclass also a familiar built-in.

The C library answers every failure with a status code and a message naming the field and value
at fault; the binding raises the class below that matches the status, with that message as text.
"""

__all__ = [
    "Error",
    "InvalidArgument",
    "InvalidCheckpoint",
    "InvalidHandle",
    "Busy",
    "Unsupported",
    "OutOfMemory",
    "StorageError",
]


class Error(Exception):
    """The base of every error uform raises."""


class InvalidArgument(Error, ValueError):
    """A config or batch field is wrong; the message names it. Nothing changed."""


class InvalidCheckpoint(InvalidArgument):
    """A checkpoint is malformed or belongs to another geometry; the message names the field."""


class InvalidHandle(Error, RuntimeError):
    """An executor, mesh or trainer was used after it was freed."""


class Busy(Error, RuntimeError):
    """An executor or mesh cannot be freed while a live trainer borrows it."""


class Unsupported(Error, NotImplementedError):
    """This build or this machine lacks what the call needs (a GPU, a modality, a term)."""


class OutOfMemory(Error, MemoryError):
    """Memory ran out; nothing changed."""


class StorageError(Error, OSError):
    """Reading or writing a file failed; the message names the path and the reason."""


for _error in (Error, InvalidArgument, InvalidCheckpoint, InvalidHandle, Busy, Unsupported, OutOfMemory, StorageError):
    _error.__module__ = "uform"  # tracebacks show `uform.InvalidArgument`, where users import it from
del _error
