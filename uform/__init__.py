"""uform trains multimodal transformer encoders on GPUs, fast, and on the CPU as an exact reference.

>>> import uform
>>> with uform.Executor.for_ram() as cpu, uform.Trainer.init_ram(cpu, dict(
...     depth=1, hidden=128, batch=dict(max_rows_per_device=4, max_columns_per_row=32),
...     objective=uform.Objective.JOINT, schedule=dict(steps=10))) as trainer:
...     stepped = trainer.step(dict(
...         modalities=[uform.Modality.TEXT] * 2,
...         contents=["a small red panda", "Red pandas eat bamboo."],
...         relations=dict(attract=uform.Edges(offsets=[0, 1, 2], ids=[1, 0]))))
...     print(stepped.stats.loss)

Blocking verbs live on `Trainer`; `trainer.deferred()` has the same verbs answering a `Deferred`
that is awaitable and `.wait()`-able. Every native call releases the GIL.
"""

from __future__ import annotations

import concurrent.futures
import importlib.machinery
import os
import threading
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

# libgomp's waiting workers spin for some milliseconds before they sleep. Between a step's many short
# parallel regions that keeps the cores from other work that wants them (a loader's thread, another
# process), and slows the step too: on 2 cores beside a loader thread, 893 ms a step against 685 ms
# passive, which costs a few ms a step on idle cores (bench/RESULTS.md, 2026-12-03). So, unless the user
# chose a policy or a spin count, workers sleep at once. libgomp reads this once, as it loads, which is
# here, when `_native` loads libuform; a libgomp.so.1 loaded before (torch loads its own copy, which
# then serves uform too) keeps what it read. Set for this load only: child processes inherit the
# user's environment, not uform's choice.
_wait_chosen = "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ
if not _wait_chosen:
    os.environ["OMP_WAIT_POLICY"] = "passive"


def _load_openblas():
    """Loads OpenBLAS from the `scipy-openblas32` wheel by its full path, so that libuform, which names
    it, finds it loaded: an editable install's libuform lives in the checkout, where its run path
    (beside the wheel in site-packages) leads nowhere."""
    import ctypes

    import scipy_openblas32

    ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so"),
                mode=ctypes.RTLD_GLOBAL)


try:
    try:
        from . import _native
    except ImportError as missing:
        if "libscipy_openblas" not in str(missing):
            raise
        _load_openblas()
        from . import _native
except ImportError as error:
    # A checkout's own `uform/` folder, first on sys.path when Python runs inside the checkout, shadows
    # the installed package and has no extension unless built in place; Python then blames a circular import.
    _folder = os.path.dirname(os.path.abspath(__file__))
    if any(os.path.exists(os.path.join(_folder, f"_native{suffix}")) for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        raise  # the extension is there but did not load: its own message says why
    raise ImportError(f"uform: the package imported is the source folder {_folder}, without its compiled extension "
                      "(_native); run from another folder to use the installed package, or build in place with "
                      "`python setup.py build_ext --inplace`") from None
finally:
    if not _wait_chosen:
        del os.environ["OMP_WAIT_POLICY"]
from .batch import Edges, Tape, TrainerBatch, normalize_batch, normalize_choose, normalize_items, normalize_sides
from .config import (
    AudioShape,
    BatchShape,
    Choices,
    Contrastive,
    ImageShape,
    LateInteraction,
    LateInteractionSide,
    Masking,
    Modality,
    Negatives,
    Determinism,
    Objective,
    PairLossForm,
    Schedule,
    TrainerConfig,
    TrainerStepConfig,
    VideoShape,
    encode_path,
    enum_member,
    normalize,
    normalize_step_config,
    normalize_trainer_config,
    optional_arena,
    real,
    scalar_member,
    unsigned,
    unsigned_array,
)
from .deferred import Deferred, TwoPhase, Worker, stop_on_collect
from .errors import (Busy, ConfigWarning, DeviceError, Error, InvalidArgument, InvalidCheckpoint, InvalidHandle,
                     OutOfMemory, PeerError, StorageError, Unsupported)
from .outputs import _ITEM_BYTES, Arena, Rows, Scalar, Stats, Stepped

__version__ = _native.version()
MAX_NOTE_BYTES = _native.MAX_NOTE_BYTES  #: The most UTF-8 bytes a checkpoint's note holds: `UFORM_MAX_NOTE_BYTES`.

__all__ = [
    "__version__",
    "MAX_NOTE_BYTES",
    "capabilities",
    "checkpoint_note",
    "media_tokens",
    "MediaTokens",
    "Executor",
    "Mesh",
    "Trainer",
    "TrainerDeferred",
    "Decoded",
    "Encoder",
    "EncoderDeferred",
    "Answers",
    "Deferred",
    "Modality",
    "Objective",
    "Negatives",
    "Determinism",
    "PairLossForm",
    "LateInteractionSide",
    "Scalar",
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
    "TrainerBatch",
    "TrainerStepConfig",
    "Edges",
    "Tape",
    "Arena",
    "Rows",
    "Stats",
    "Stepped",
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


def __dir__() -> List[str]:
    """What `dir(uform)` and completion offer: the public names and the modules the docs name (`uform.data`,
    `uform.torch`, `uform.cli`, `uform.demo`), not the helpers the package imports for itself."""
    return sorted(set(__all__) | {"data", "torch", "cli", "demo"})


def capabilities() -> set:
    """What this build and machine can do: a set of "ram" (the CPU backend), "vram" (CUDA), "mesh", and the
    media formats it decodes ("jpeg", "png", "webp", "wav", "flac", "mp3", "ogg", "mp4", "webm", "mkv")."""
    bits = _native.capabilities()
    return {name for name, bit in _native.C_ENUMS["capability"].items() if bits & bit}


def checkpoint_note(path: Any) -> Optional[str]:
    """The note `Trainer.save(path, note=...)` stored in a checkpoint, or None when it holds none.

    The file is checked as `Encoder.load` checks its structure (`InvalidCheckpoint` naming what is wrong);
    its tensors are not read.
    """
    note = _native.checkpoint_note(encode_path(path, "path"))
    return note.decode("utf-8") if note else None


class MediaTokens(tuple):
    """What `media_tokens` answers: the pair (tokens, grid), and in `truncated` whether the item exceeded a
    row and was fitted to it (an image shrunk, a video or a sound cut at the end), as a step counts it in
    `truncated_items`."""

    def __new__(cls, tokens: np.ndarray, grid: Tuple[int, int, int], truncated: bool) -> "MediaTokens":
        answer = super().__new__(cls, (tokens, grid))
        answer.truncated = bool(truncated)
        return answer


def media_tokens(modality: Any, content: Any, shape: Any = None) -> MediaTokens:
    """The tokens one image, video or sound decodes to, exactly as a trainer or an encoder whose batch has
    `shape` (a `BatchShape` or a dict; a checkpoint's own is `config["batch"]` in its metadata) reads them:
    (float32 array of tokens x width, (frames, rows, columns)), whose `truncated` says whether the item was
    fitted to a row.

    An image answers its patches in raster order (grid (1, rows, columns)), a video its tubelets by time,
    then row, then column, a sound its chunks (grid (chunks, 1, 1)); each token is `width` values laid out
    as `docs/model.md` ("Media preprocessing") says, fitted to one row of `max_columns_per_row` tokens.
    This is how a model run outside uform (`uform.torch`, an export) reads media as uform's model does.
    `content` is the encoded file as bytes; a modality that is not a media kind, or bytes that are not one
    of its files, raise `InvalidArgument` naming `modality` or `content`.
    """
    kind = enum_member(Modality, modality, "modality")
    if kind is Modality.TEXT:  # named as given: the C library's message would give its numbers
        raise InvalidArgument(f"modality: {kind.value if isinstance(modality, Modality) else modality!r} is not a "
                              "media modality (image, video or audio)")
    if isinstance(content, str) or not isinstance(content, (bytes, bytearray, memoryview, np.ndarray)):
        raise InvalidArgument(f"content: expected the encoded file as bytes, got {type(content).__name__}")
    data = np.frombuffer(content, np.uint8) if not isinstance(content, np.ndarray) else content
    if data.dtype != np.uint8 or data.ndim != 1:
        raise InvalidArgument(f"content: expected a 1-D uint8 array, got {data.dtype} of shape {data.shape}")
    try:
        return MediaTokens(*_native.media_tokens(_native.C_ENUMS["modality"][kind.value], np.ascontiguousarray(data),
                                                 normalize(BatchShape, shape, "shape")))
    except Error as error:  # the C verb names its argument `bytes`; this function's is `content`
        message = str(error)
        if not message.startswith("bytes:"):
            raise
        raise type(error)("content" + message[len("bytes"):]) from None


def _note_bytes(note: Any) -> bytes:
    """A note as the UTF-8 the library stores, refused as the library refuses it: not text, a NUL, over
    `MAX_NOTE_BYTES`. Checked here too for `uform.torch.save`, which writes without the library."""
    if not isinstance(note, str):
        raise InvalidArgument(f"note: expected a str or None, got {type(note).__name__}")
    try:
        encoded = note.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate, which no UTF-8 text holds
        raise InvalidArgument(f"note: not encodable as UTF-8 ({error.reason} at {error.start})") from None
    if b"\0" in encoded:  # C would read the note only up to it
        raise InvalidArgument(f"note: a NUL character at {note.index(chr(0))}; a note is text without one")
    if len(encoded) > MAX_NOTE_BYTES:
        raise InvalidArgument(f"note: {len(encoded)} bytes, over the {MAX_NOTE_BYTES} a checkpoint holds")
    return encoded


def _alive(borrower: Any) -> bool:
    native = borrower._native
    return native is not None and native.alive


class _Native:
    """What the library's objects share: a native handle (None once freed), named `_noun` in messages,
    and `with` blocks that free it."""

    _noun = "handle"
    _native: Any

    @property
    def alive(self) -> bool:
        """False once freed."""
        return _alive(self)

    def _handle(self) -> Any:
        native = self._native
        if native is None:
            raise InvalidHandle(f"{self._noun}: used after free()")
        return native

    def free(self) -> None:  # each kind's own
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, kind: Any, error: Any, trace: Any) -> None:
        try:
            self.free()
        except Busy as busy:
            if error is None:
                raise
            # The block's own exception says what went wrong; a refusal to free would take its place. What still
            # borrows this one holds it until both are collected.
            if hasattr(error, "add_note"):  # Python 3.11 on
                error.add_note(f"uform: {busy}; left to the garbage collector")


class _OnExecutor(_Native):
    """A trainer or an encoder: its verbs run on the worker of the executor it borrows."""

    _executor: Any

    @property
    def executor(self) -> Optional["Executor"]:
        """The executor this borrows; None once freed."""
        return self._executor

    def _worker(self) -> Worker:
        executor = self._executor
        if self._native is None or executor is None:
            raise InvalidHandle(f"{self._noun}: used after free()")
        return executor._worker_thread()


class Executor(_Native):
    """Where work runs: the CPU reference backend (`for_ram`) or a set of GPUs (`for_vram`).

    Verbs of the trainers and encoders on one executor run on its worker thread, one after another, in the order
    they were submitted. Free it with `free()` or a `with` block, after the trainers and meshes that
    borrow it.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("make an Executor with Executor.for_ram() or Executor.for_vram()")

    @classmethod
    def _wrap(cls, native: Any, kind: str) -> "Executor":
        executor = cls.__new__(cls)
        executor._native = native
        executor._kind = kind
        executor._borrowers = weakref.WeakSet()
        executor._worker = None
        executor._lock = threading.Lock()
        return executor

    @classmethod
    def for_ram(cls, threads: Optional[int] = None, devices: Optional[int] = 1) -> "Executor":
        """The CPU reference backend; `threads` a verb uses, the calling one included (0 or absent: every core;
        at most 1024).

        `devices` > 1 simulates that many devices in this process: a trainer spreads each step over them as a mesh
        would, the gather and all-reduce done in memory, so its losses and weights equal one device's up to the
        order of float32 sums. Batch capacities are per device. 0 or None makes one; at most 64.
        """
        count = unsigned(0 if threads is None else threads, 64, "threads")
        spread = unsigned(0 if devices is None else devices, 64, "devices")
        return cls._wrap(_native.ExecutorHandle.for_ram(count, spread), "ram")

    @classmethod
    def for_vram(cls, devices: Optional[Sequence[int]] = None) -> "Executor":
        """GPUs by ordinal, or every visible one when `devices` is absent.

        Raises `uform.Unsupported` in builds without CUDA or on machines without a GPU.
        """
        ordinals = None
        if devices is not None:
            ordinals = unsigned_array(devices, "uint32", "devices")
            if len(ordinals) == 0:
                raise InvalidArgument("devices: empty; leave it absent for every visible device")
        return cls._wrap(_native.ExecutorHandle.for_vram(ordinals), "vram")

    _noun = "executor"

    @property
    def kind(self) -> str:
        """"ram" or "vram"."""
        return self._kind

    def _worker_thread(self) -> Worker:
        with self._lock:
            self._handle()
            if self._worker is None:
                self._worker = Worker(f"uform-{self._kind}-executor")
                stop_on_collect(self, self._worker)
            return self._worker

    def free(self) -> None:
        """Frees the executor and stops its worker; harmless when already freed.

        Raises `uform.Busy` while a live trainer or mesh borrows it.
        """
        with self._lock:
            if self._native is None:
                return
            borrowers = [type(b).__name__.lower() for b in list(self._borrowers) if _alive(b)]
            if borrowers:
                raise Busy(f"executor: borrowed by a live {' and a live '.join(sorted(set(borrowers)))}; free those first")
            self._native.free()
            self._native = None
            worker, self._worker = self._worker, None
        if worker is not None:
            worker.stop()

    def __repr__(self) -> str:
        return f"<uform.Executor {self._kind}{'' if self._native is not None else ' freed'}>"


class Mesh(_Native):
    """The processes of one run and the communicator that joins their devices.

    A trainer borrows its mesh until freed; freeing a mesh that a live trainer borrows raises
    `uform.Busy`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("make a Mesh with Mesh.bootstrap(executor, ...)")

    @classmethod
    def bootstrap(
        cls,
        executor: Executor,
        host_domain_index: int = 0,
        host_domain_count: int = 1,
        directory: Any = None,
        job: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> "Mesh":
        """Joins this process to a run of `host_domain_count` processes meeting under `directory/job`.

        A mesh of one process needs no peers. Several processes, each with a RAM executor, meet through files
        under `directory/job` (an existing folder every process sees; `job` is one folder name) and talk over
        TCP sockets; `timeout` seconds (0 or absent: 300) bound the wait for them, here and at every exchange
        of a step. Raises `uform.PeerError` naming the host domains that never joined; `InvalidArgument` naming
        `host_domain_index`, `directory`, `job` or `timeout`. Ctrl-C (or any exception raised in this thread
        meanwhile) ends the wait at once. See docs/python.md, "Meshes of several processes".
        """
        if not isinstance(executor, Executor):
            raise InvalidArgument(f"executor: expected a uform.Executor, got {type(executor).__name__}")
        index = unsigned(host_domain_index, 32, "host_domain_index")
        count = unsigned(0 if host_domain_count is None else host_domain_count, 32, "host_domain_count")
        folder = None if directory is None else encode_path(directory, "directory")
        name = None if job is None else encode_path(job, "job")
        seconds = 0.0 if timeout is None else real(timeout, "timeout")
        if not 0 <= seconds <= 1e9:  # named as the caller knows it: the C library's field is `timeout_seconds`
            raise InvalidArgument(f"timeout: {timeout!r} is not a number of seconds in [0, 1e9]")
        handle = executor._handle()
        if count <= 1:
            native = _native.MeshHandle.bootstrap(handle, index, count, folder, name, seconds)
        else:  # the wait runs beside this thread, which stays free to take Ctrl-C and abandon it
            met: Dict[str, Any] = {}
            done = threading.Event()  # not the thread's own state, which an interrupted join() may leave wrong

            def meet() -> None:
                try:
                    met["native"] = _native.MeshHandle.bootstrap(handle, index, count, folder, name, seconds)
                except BaseException as error:  # handed to the caller's thread
                    met["error"] = error
                finally:
                    done.set()

            threading.Thread(target=meet, name="uform-mesh-meeting", daemon=True).start()
            try:
                done.wait()
            except BaseException:
                while not done.is_set():  # again until it ends: the wait may not have begun at the first call
                    Mesh.abandon()
                    try:
                        done.wait(0.25)
                    except BaseException:
                        continue
                if "native" in met:
                    met["native"].free()
                raise
            if "error" in met:
                raise met["error"]
            native = met["native"]
        mesh = cls.__new__(cls)
        mesh._native = native
        mesh._index, mesh._count = index, max(count, 1)
        mesh._executor = executor
        mesh._borrowers = weakref.WeakSet()
        executor._borrowers.add(mesh)
        return mesh

    _noun = "mesh"

    @property
    def executor(self) -> Optional[Executor]:
        """The executor whose devices this process brings; None once freed."""
        return self._executor

    @property
    def host_domain_index(self) -> int:
        """This process's index in the run: what `uform.data.Stream`'s `process_index` takes."""
        return self._index

    @property
    def host_domain_count(self) -> int:
        """The processes in the run: what `uform.data.Stream`'s `process_count` takes."""
        return self._count

    @staticmethod
    def abandon() -> None:
        """Ends at once every wait for peers in progress in this process (a `bootstrap`, or an exchange of a
        step or a gather): each raises `uform.PeerError`, and a mesh whose exchange it ends is broken. For a
        program asked to stop while its peers are late or gone; safe from a signal handler."""
        _native.mesh_abandon()

    def gather(self, data: Any) -> List[bytes]:
        """Every process's `data` (bytes), in host-domain order, on every process: what a training loop
        shares between steps, such as a stop one process was asked for, or its share of an evaluation.

        Every process calls it, in the same order among its trainers' steps; the parts may differ in size.
        It runs on the executor's worker, after the verbs submitted before it. Raises `uform.PeerError`
        when a peer hung up or stayed silent past the mesh's timeout.
        """
        native = self._handle()
        try:
            part = bytes(memoryview(data).cast("B"))
        except TypeError:
            refused = InvalidArgument(f"data: expected bytes, got {type(data).__name__}")
            self._refuse(refused, wait=True)
            raise refused from None
        return self._executor._worker_thread().run(lambda: native.gather(part), "gather")

    def _refuse(self, refused: BaseException, wait: bool = False) -> None:
        """Takes this process's part, refused, in the collective its peers are in when a verb refuses its arguments
        before it reaches the library: their step, trainer or gather fails naming this process and `refused`,
        rather than pair itself with this process's next verb. In turn after the verbs submitted before; `wait`
        for it, or leave it queued."""
        if self._count < 2 or self._native is None:
            return
        native, reason = self._native, str(refused)
        worker = self._executor._worker_thread()
        if wait:
            try:
                worker.run(lambda: native.refuse(reason), "mesh refusal")
            except Error:  # the peers' failure is theirs to raise; this process raises its own
                pass
        else:
            worker.submit(lambda: native.refuse(reason))

    def free(self) -> None:
        """Frees the mesh; harmless when already freed. Raises `uform.Busy` while a live trainer borrows it."""
        if self._native is None:
            return
        if any(_alive(trainer) for trainer in list(self._borrowers)):
            raise Busy("mesh: borrowed by a live trainer; free it first")
        self._native.free()
        self._native = None
        self._executor._borrowers.discard(self)
        self._executor = None

    def __repr__(self) -> str:
        return f"<uform.Mesh {self._index} of {self._count}{'' if self._native is not None else ' freed'}>"


class Decoded:
    """A batch with its media decoded by `Trainer.decode`, for `Trainer.step` in the batch's place.

    Holds the batch (pinned, unchanged) and its tokens in host memory (4 bytes a value) until `free()`
    or collection. The same `Decoded` may feed several steps.
    """

    __slots__ = ("_trainer", "_inputs", "_native", "_lock", "_steps", "_freeing")

    def __init__(self, trainer: "Trainer", inputs: Any, native: Any) -> None:
        self._trainer, self._inputs, self._native = trainer, inputs, native
        self._lock, self._steps, self._freeing = threading.Lock(), 0, False

    def _hold(self) -> Any:
        """Counts a step submitted with it, which `_release` uncounts once run; answers the native handle."""
        with self._lock:
            if self._freeing or (self._native is not None and not self._native.alive):
                raise InvalidHandle("decoded batch: used after free()")
            self._steps += 1
            return self._native

    def _release(self) -> None:
        with self._lock:
            self._steps -= 1
            if self._steps or not self._freeing or self._native is None:
                return
        self._native.free()

    def free(self) -> None:
        """Lets go of the decoded tokens now, or once the steps submitted with it have run; harmless when
        already freed. A batch of text holds none."""
        with self._lock:
            self._freeing = True
            if self._steps or self._native is None:
                return
        self._native.free()

    def __repr__(self) -> str:
        state = " freed" if self._freeing else ""
        return f"<uform.Decoded of {self._inputs.count} items{state}>"


class _Ahead:
    """One deferred step's decoding: started by `_Lookahead` when the step before it starts, or at once."""

    __slots__ = ("_decode", "_future")

    def __init__(self, decode) -> None:
        self._decode, self._future = decode, None

    def result(self) -> Any:
        return self._future.result()


class _Lookahead:
    """Decodes deferred steps' media one step ahead, on a thread of its own, in submission order.

    Step k's decoding starts once step k - 1 starts (at once when no media step waits before it), so
    at most one decoded batch waits beside the running step, whatever the number submitted.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: "List[_Ahead]" = []  # submitted, not yet started
        self._queued = 0  # media steps submitted whose step has not begun
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="uform-decode")

    def submit(self, decode) -> "_Lookahead._Step":
        ahead = _Ahead(decode)
        with self._lock:
            if self._queued == 0:
                ahead._future = self._pool.submit(decode)
            else:
                self._waiting.append(ahead)
            self._queued += 1
        return _Lookahead._Step(self, ahead)

    def _begin(self, ahead: _Ahead) -> None:
        with self._lock:
            self._queued -= 1
            if ahead._future is None:  # a step submitted before it never ran: start it now
                self._waiting.remove(ahead)
                ahead._future = self._pool.submit(ahead._decode)
            if self._waiting:
                following = self._waiting.pop(0)
                following._future = self._pool.submit(following._decode)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    class _Step:
        """What a deferred step waits on: its turn starts the next one's decoding."""

        __slots__ = ("_lookahead", "_ahead")

        def __init__(self, lookahead: "_Lookahead", ahead: _Ahead) -> None:
            self._lookahead, self._ahead = lookahead, ahead

        def result(self) -> Any:
            self._lookahead._begin(self._ahead)
            return self._ahead.result()


class Trainer(_OnExecutor):
    """One training run: the weights, the optimizer's moments and the step.

    Every verb blocks until it lands, behind the deferred verbs already submitted on the same
    executor; `deferred()` has the same verbs, each answering a `Deferred` at once. The trainer
    borrows its executor and mesh until freed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("start a run with Trainer.init_ram(...) or Trainer.init_vram(...)")

    @classmethod
    def init_ram(cls, executor: Executor, config: Any, mesh: Optional[Mesh] = None) -> "Trainer":
        """Starts or resumes a run on a RAM executor: the CPU reference backend.

        `config` is a `TrainerConfig` or a dict with the same keys; `mesh`, when given, is borrowed
        until the trainer is freed.
        """
        return cls._init(False, executor, config, mesh)

    @classmethod
    def init_vram(cls, executor: Executor, config: Any, mesh: Optional[Mesh] = None) -> "Trainer":
        """Starts or resumes a run with one replica on each device of a VRAM executor."""
        return cls._init(True, executor, config, mesh)

    @classmethod
    def _init(cls, vram: bool, executor: Executor, config: Any, mesh: Optional[Mesh]) -> "Trainer":
        if not isinstance(executor, Executor):
            raise InvalidArgument(f"executor: expected a uform.Executor, got {type(executor).__name__}")
        if mesh is not None and not isinstance(mesh, Mesh):
            raise InvalidArgument(f"mesh: expected a uform.Mesh, got {type(mesh).__name__}")
        try:
            if executor.kind != ("vram" if vram else "ram"):
                raise InvalidArgument(f"executor: a {executor.kind.upper()} executor; use Trainer.init_{executor.kind}")
            normalized = normalize_trainer_config(config)
        except Exception as refused:  # the peers are making their trainers: they fail alike, naming this process
            if mesh is not None:
                mesh._refuse(refused, wait=True)
            raise
        native = _native.TrainerHandle.init(
            vram, executor._handle(), normalized, None if mesh is None else mesh._handle()
        )
        trainer = cls.__new__(cls)
        trainer._native = native
        trainer._executor = executor
        trainer._mesh = mesh
        trainer._hidden = normalized["hidden"]
        trainer._ahead = None
        executor._borrowers.add(trainer)
        if mesh is not None:
            mesh._borrowers.add(trainer)
        return trainer

    _noun = "trainer"

    @property
    def mesh(self) -> Optional[Mesh]:
        """The mesh this trainer borrows, if any; None once freed."""
        return self._mesh

    def _inputs(self, batch: Any):
        """The pinned inputs of `batch`, its media decoded ahead, and the `Decoded` that holds them, counted
        as held until its `_release`: when `batch` is a `Decoded` of this trainer."""
        if isinstance(batch, Decoded):
            if batch._trainer is not self:
                raise InvalidArgument("batch: a Decoded made by another trainer; decode it with this one")
            return batch._inputs, batch._hold(), batch
        return _native.StepInputs(normalize_batch(batch)), None, None

    def _step_call(self, batch: Any, config: Any, lookahead: Optional["_Lookahead"] = None):
        """Checks and pins the batch, and claims its arena, now; answers the call that runs the step on the worker.

        `lookahead`, for deferred steps, decodes the batch's media while the steps submitted before it run."""
        native = self._handle()
        try:
            inputs, decoded, holder = self._inputs(batch)
        except Exception as refused:  # the peers' step fails alike, naming this process, in turn after those before
            if self._mesh is not None:
                self._mesh._refuse(refused)
            raise
        releases = [] if holder is None else [holder._release]

        def release() -> None:
            for each in releases:
                each()

        try:
            settings = normalize_step_config(config)
            arena, scalar, hidden = settings["arena"], settings["outputs_scalar"], self._hidden
            c_scalar = _native.C_ENUMS["scalar"][scalar.value]
            if arena is not None:
                releases.append(arena._claim("config.arena"))
        except BaseException as refused:
            release()
            if self._mesh is not None and isinstance(refused, Exception):
                self._mesh._refuse(refused)
            raise
        ahead, landing = None, None

        # The library borrows the inputs, the landing and the decoded media from begin to end.
        def begin() -> None:
            nonlocal landing
            try:
                if arena is not None:
                    landing = arena._reserve(inputs.count * hidden * _ITEM_BYTES[scalar])
                native.step_begin(inputs, landing, c_scalar, decoded if ahead is None else ahead.result())
            except BaseException:
                release()
                raise

        def end() -> Stepped:
            try:
                stats = Stats(native.step_end(inputs))
                return Stepped(stats, None if arena is None else Rows(landing, scalar, (inputs.count, hidden)))
            finally:
                release()

        if lookahead is not None and decoded is None and inputs.has_media:  # last: nothing after it raises
            ahead = lookahead.submit(lambda: native.decode(inputs))
        return TwoPhase(begin, end, self._executor.kind == "vram")

    def _save_call(self, path: Any, weights_only: Any, note: Any):
        native = self._handle()
        destination = encode_path(path, "path")
        if weights_only is not None and not isinstance(weights_only, (bool, np.bool_)):  # "no" is truthy: refuse it
            raise InvalidArgument(f"weights_only: expected True or False, got {type(weights_only).__name__} {weights_only!r}")
        text = None if note is None else _note_bytes(note)
        return lambda: native.save(destination, bool(weights_only), text)

    def step(self, batch: Any, config: Any = None) -> Stepped:
        """Applies one optimizer step over this process's items and every peer's.

        `batch` is a `TrainerBatch` or a dict with the same keys; `config` a `TrainerStepConfig` or
        dict, whose `arena` receives the scored embeddings. Answers a `Stepped`.
        """
        worker = self._worker()
        worker.refuse_own_thread()  # before the step claims its arena
        return worker.run(self._step_call(batch, config), "step")

    def _begun_step(self, batch: Any) -> Deferred:
        """For `uform train`: submits `batch`'s step and answers its `Deferred` once the step has begun on the worker
        (validated, packed and queued), so a refused batch is known, and raised here, before the next is read."""
        call = self._step_call(batch, None)
        deferred = Deferred(self._worker().submit(call), "step")
        call.began.wait()
        if deferred._future.done() and deferred._future.exception() is not None:
            deferred.wait()  # raises it, as retrieved
        return deferred

    def save(self, path: Any, weights_only: bool = False, note: Optional[str] = None) -> None:
        """Writes the weights, the optimizer's moments and the step as one safetensors checkpoint.

        The file is written beside `path` and renamed into place, so a crash keeps the previous one.
        `weights_only=True` leaves the moments out, for release: a third of the size, loaded by
        `Encoder.load`, refused by `resume` (`InvalidCheckpoint`). `note`, text of at most
        `MAX_NOTE_BYTES` (1 MiB) as UTF-8, rides in the file's metadata for `checkpoint_note` to read
        back; empty is none. On a mesh of several processes only host domain 0 writes; on the others,
        which hold the same weights, it returns at once and writes nothing.
        """
        call = self._save_call(path, weights_only, note)
        self._worker().run(call, "save")

    def decode(self, batch: Any) -> "Decoded":
        """Decodes the batch's images, video and audio now, on the calling thread and every core.

        Runs beside a step in progress (it never waits for the trainer), so a loop can decode the next
        batch while the device trains this one; pass the answer to `step` in the batch's place. Bad media
        raise here, naming the item. Deferred steps do this on their own, one step ahead.
        """
        native = self._handle()
        inputs = _native.StepInputs(normalize_batch(batch))
        return Decoded(self, inputs, native.decode(inputs) if inputs.has_media else None)

    def deferred(self) -> "TrainerDeferred":
        """The same verbs, each submitted to the executor's worker and answered as a `Deferred`."""
        return TrainerDeferred(self)

    def free(self) -> None:
        """Frees the trainer, after the verbs already submitted, and lets go of its executor and mesh.

        Harmless when already freed.
        """
        native, executor, mesh = self._native, self._executor, self._mesh
        if native is None or executor is None:
            return
        ahead = self._ahead

        def free() -> None:
            if ahead is not None:  # after the steps submitted before: a decoding still running holds the trainer
                ahead.close()
            native.free()

        executor._worker_thread().run(free, "free")
        self._native = self._executor = self._mesh = None
        executor._borrowers.discard(self)
        if mesh is not None:
            mesh._borrowers.discard(self)

    def _probe(self, batch: Any):
        """For tests: a step's loss and gradients without the update, as (Stats, float32 gradients)."""
        native = self._handle()
        inputs, decoded, holder = self._inputs(batch)

        def probe():
            try:
                stats, gradients = native.probe(inputs, decoded)
            finally:
                if holder is not None:
                    holder._release()
            return Stats(stats), gradients

        return self._worker().run(probe, "probe")

    def _weights(self):
        """For tests: the flat float32 weights, in the checkpoint's tensor order."""
        native = self._handle()
        return self._worker().run(native.weights, "weights")

    def __repr__(self) -> str:
        state = "" if self._native is not None else " freed"
        kind = self._executor.kind if self._executor is not None else "?"
        return f"<uform.Trainer on {kind}{state}>"


class TrainerDeferred:
    """A trainer's verbs, each submitted to its executor's worker and answered at once as a `Deferred`.

    Verbs run in the order submitted; errors, the batch's own included, surface where the
    `Deferred` is awaited or waited on.
    """

    __slots__ = ("_trainer",)

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def _submit(self, verb: str, make_call, *args: Any) -> Deferred:
        try:
            worker = self._trainer._worker()
            call = make_call(*args)  # last: it may claim an arena, which only the call releases
        except Exception as error:  # noqa: BLE001 - it belongs to whoever awaits the answer
            return Deferred._failed(error, verb)
        return Deferred(worker.submit(call), verb)

    def step(self, batch: Any, config: Any = None) -> Deferred:
        """`Trainer.step`, deferred: the batch is read now, the step runs on the worker.

        A batch with media has them decoded on a thread of their own while the step submitted before it
        runs, so the device does not wait for the host's decoding."""
        trainer = self._trainer
        if trainer._ahead is None and trainer._native is not None:
            trainer._ahead = _Lookahead()
        return self._submit("step", trainer._step_call, batch, config, trainer._ahead)

    def save(self, path: Any, weights_only: bool = False, note: Optional[str] = None) -> Deferred:
        """`Trainer.save`, deferred."""
        return self._submit("save", self._trainer._save_call, path, weights_only, note)

    def __repr__(self) -> str:
        return f"<uform.TrainerDeferred of {self._trainer!r}>"


class Answers(list):
    """One array per item, as `Encoder.text_choose` and `Encoder.embed_tokens` answer them, and
    `truncated_items`: how many items were cut to fit."""

    def __init__(self, arrays: Any, truncated_items: int) -> None:
        super().__init__(arrays)
        self.truncated_items = int(truncated_items)


class Encoder(_OnExecutor):
    """A checkpoint loaded for inference: pooled embeddings, token vectors and choices, computed as
    training computes them.

    Its geometry comes from the checkpoint itself. It borrows its executor until freed, and its
    verbs run on the executor's worker like a trainer's; `deferred()` has the same verbs answering a
    `Deferred`.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("load an Encoder with Encoder.load(path, executor)")

    @classmethod
    def load(cls, path: Any, executor: Executor) -> "Encoder":
        """Loads a checkpoint written by `Trainer.save`, whole or `weights_only`, onto `executor`.

        Only the weights are read; the encoder holds them and one pass's activations, not a trainer's
        moments and gradients.
        """
        if not isinstance(executor, Executor):
            raise InvalidArgument(f"executor: expected a uform.Executor, got {type(executor).__name__}")
        source = encode_path(path, "path")
        handle = executor._handle()
        native = executor._worker_thread().run(lambda: _native.EncoderHandle.load(handle, source), "load")
        encoder = cls.__new__(cls)
        encoder._native = native
        encoder._executor = executor
        executor._borrowers.add(encoder)
        return encoder

    @property
    def hidden(self) -> int:
        """The embeddings' width."""
        return self._handle().hidden

    _noun = "encoder"

    def _embed_call(self, modalities: Any, contents: Any, scalar: Any, arena: Any):
        """Checks the items and claims the arena now; answers the call that embeds them on the worker."""
        native = self._handle()
        kinds, tape, items = normalize_items(modalities, contents)
        scalar, arena, hidden = scalar_member(scalar, "scalar"), optional_arena(arena, "arena"), native.hidden
        nbytes = items * hidden * _ITEM_BYTES[scalar]
        c_scalar = _native.C_ENUMS["scalar"][scalar.value]

        def embed() -> Rows:
            landing = Arena()._reserve(nbytes) if arena is None else arena._reserve(nbytes)
            truncated = native.embed(kinds, tape, landing, c_scalar)
            return Rows(landing, scalar, (items, hidden), truncated)

        return embed if arena is None else arena._claim_for(embed, "arena")

    def _tokens_call(self, modalities: Any, contents: Any, sides: Any):
        """Checks the items now; answers the call that reads their token vectors on the worker."""
        native = self._handle()
        kinds, tape, items = normalize_items(modalities, contents)
        side_values = normalize_sides(sides, items)

        def embed_tokens() -> Answers:
            vectors, offsets, truncated = native.embed_tokens(kinds, tape, side_values)
            return Answers((vectors[int(offsets[i]):int(offsets[i + 1])] for i in range(items)), truncated)

        return embed_tokens

    def embed_tokens(self, modalities: Sequence[Any], contents: Any, sides: Any = None) -> "Answers":
        """Each item's late-interaction token vectors, unit-norm float32 rows of the token head's width,
        exactly as training scores them: one (rows, width) array per item, views into one buffer, in
        a list whose `truncated_items` counts the items cut to fit.

        `sides` (one `LateInteractionSide` per item; None reads every item as a document) decides how
        an item is read: a query (or an item that is both) is cut to the run's `max_query_span` bytes
        and padded up to it, so it answers that many rows; a document answers one row per byte, up to
        `batch.max_columns_per_row`, or one per patch, tubelet or chunk of an image, a video or a sound
        (only text is a query). Refused for a checkpoint trained without late interaction.
        """
        worker = self._worker()
        worker.refuse_own_thread()
        return worker.run(self._tokens_call(modalities, contents, sides), "embed_tokens")

    def _choose_call(self, texts: Any, choices: Any):
        """Checks the texts and choices now; answers the call that scores them on the worker."""
        native = self._handle()
        text_tape, choice_tape, items = normalize_choose(texts, choices)
        starts = np.array(choice_tape[1], dtype=np.int64)  # where each text's probabilities land
        starts -= starts[0]

        def choose() -> Answers:
            flat = np.empty(max(int(starts[-1]), 1), np.float32)
            truncated = native.choose(text_tape, choice_tape, flat)
            return Answers((flat[starts[i]:starts[i + 1]] for i in range(items)), truncated)

        return choose

    def text_choose(self, texts: Any, choices: Any) -> "Answers":
        """Each text's probabilities over the bytes it may choose: the byte decoder's softmax at a choice
        position after the text, over those bytes only, exactly as the choices term scores it in training.

        `texts` and `choices` are lists of str / bytes (or `Tape`s), one entry of distinct legal bytes
        per text. Answers one float32 array per text, as long as its choices and summing to one: the
        shape `choice_targets` takes, so one model's answers can train another. The list's
        `truncated_items` counts texts cut to fit a row beside their choice position. Any number of
        choices up to 256 is answered, whatever a run's `max_choices_per_item`.
        """
        worker = self._worker()
        worker.refuse_own_thread()
        return worker.run(self._choose_call(texts, choices), "text_choose")

    def embed(self, modalities: Sequence[Any], contents: Any, scalar: Any = Scalar.F32,
              arena: Optional[Arena] = None) -> Rows:
        """Pooled, unit-norm embeddings of any number of items, as `Rows` (items x hidden), as training
        pools an item read as plain contents (a query's padding and a choice position are not added).

        `contents` is a list of str / bytes or a `Tape`, media items as their encoded files. Items that
        do not fit a row of the checkpoint's `batch.max_columns_per_row` tokens are fitted (texts cut,
        images shrunk, video and audio cut at the end); `rows.truncated_items` counts them.
        The rows land in fresh memory, or in `arena` when given (then valid until its next use).
        """
        worker = self._worker()
        worker.refuse_own_thread()  # before the call claims its arena
        return worker.run(self._embed_call(modalities, contents, scalar, arena), "embed")

    def deferred(self) -> "EncoderDeferred":
        """The same verbs, each submitted to the executor's worker and answered as a `Deferred`."""
        return EncoderDeferred(self)

    def free(self) -> None:
        """Frees the encoder, after the verbs already submitted, and lets go of its executor.

        Harmless when already freed.
        """
        native, executor = self._native, self._executor
        if native is None or executor is None:
            return
        executor._worker_thread().run(native.free, "free")
        self._native = self._executor = None
        executor._borrowers.discard(self)

    def __repr__(self) -> str:
        return f"<uform.Encoder{'' if self._native is not None else ' freed'}>"


class EncoderDeferred:
    """An encoder's verbs, each submitted to its executor's worker and answered at once as a `Deferred`."""

    __slots__ = ("_encoder",)

    def __init__(self, encoder: Encoder) -> None:
        self._encoder = encoder

    def embed(self, modalities: Sequence[Any], contents: Any, scalar: Any = Scalar.F32,
              arena: Optional[Arena] = None) -> Deferred:
        """`Encoder.embed`, deferred: the items are read now, embedded on the worker."""
        try:
            worker = self._encoder._worker()
            call = self._encoder._embed_call(modalities, contents, scalar, arena)  # last: it may claim the arena
        except Exception as error:  # noqa: BLE001 - it belongs to whoever awaits the answer
            return Deferred._failed(error, "embed")
        return Deferred(worker.submit(call), "embed")

    def embed_tokens(self, modalities: Sequence[Any], contents: Any, sides: Any = None) -> Deferred:
        """`Encoder.embed_tokens`, deferred: the items are read now, embedded on the worker."""
        try:
            worker = self._encoder._worker()
            call = self._encoder._tokens_call(modalities, contents, sides)
        except Exception as error:  # noqa: BLE001 - it belongs to whoever awaits the answer
            return Deferred._failed(error, "embed_tokens")
        return Deferred(worker.submit(call), "embed_tokens")

    def text_choose(self, texts: Any, choices: Any) -> Deferred:
        """`Encoder.text_choose`, deferred: the inputs are read now, scored on the worker."""
        try:
            worker = self._encoder._worker()
            call = self._encoder._choose_call(texts, choices)
        except Exception as error:  # noqa: BLE001 - it belongs to whoever awaits the answer
            return Deferred._failed(error, "text_choose")
        return Deferred(worker.submit(call), "text_choose")

    def __repr__(self) -> str:
        return f"<uform.EncoderDeferred of {self._encoder!r}>"
