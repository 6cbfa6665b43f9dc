# cython: language_level=3
"""The compiled core of uform: handles over `uform.h`, and nothing the pure-Python face can do.

Every function here receives values the face has already normalized (see `uform/config.py` and
`uform/batch.py`): ints, floats, encoded paths, C-contiguous numpy arrays and byte memoryviews. It
copies scalars into the C structs, pins every buffer as a typed memoryview for the whole call (so C
reads the caller's memory, never a copy), runs the native call without the GIL, and turns a failed
status into the matching `uform.Error` subclass with the library's message.
"""

cimport cython
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memset

from uform.uform cimport *

import numpy as np

from uform.errors import DeviceError, Busy, Error, InvalidArgument, InvalidCheckpoint, InvalidHandle, OutOfMemory, PeerError, StorageError, Unsupported

# The C library's numbering of the enumerations whose Python values are names, keyed by those names.
C_ENUMS = {
    "modality": {
        "text": uform_modality_text_k,
        "image": uform_modality_image_k,
        "video": uform_modality_video_k,
        "audio": uform_modality_audio_k,
    },
    "objective": {
        "masked": uform_objective_masked_k,
        "contrastive": uform_objective_contrastive_k,
        "joint": uform_objective_joint_k,
    },
    "negatives": {"ambient": uform_negatives_ambient_k, "named": uform_negatives_named_k},
    "determinism": {"bitwise": uform_determinism_bitwise_k, "fast": uform_determinism_fast_k},
    "scalar": {
        "f32": uform_scalar_f32_k,
        "f16": uform_scalar_f16_k,
        "bf16": uform_scalar_bf16_k,
        "i8": uform_scalar_i8_k,
    },
    "pair_loss_form": {
        "derived": uform_pair_loss_derived_k,
        "balanced": uform_pair_loss_balanced_k,
        "ranked": uform_pair_loss_ranked_k,
        "sigmoid": uform_pair_loss_sigmoid_k,
    },
    "late_interaction_side": {
        "none": uform_late_interaction_none_k,
        "query": uform_late_interaction_query_k,
        "document": uform_late_interaction_document_k,
        "query_and_document": uform_late_interaction_query_and_document_k,
    },
    "capability": {
        "ram": uform_capability_ram_k, "vram": uform_capability_vram_k, "mesh": uform_capability_mesh_k,
        # the media formats this build decodes
        "jpeg": uform_capability_jpeg_k, "png": uform_capability_png_k, "webp": uform_capability_webp_k,
        "wav": uform_capability_wav_k, "flac": uform_capability_flac_k, "mp3": uform_capability_mp3_k,
        "ogg": uform_capability_ogg_k, "mp4": uform_capability_mp4_k, "webm": uform_capability_webm_k,
        "mkv": uform_capability_mkv_k,
    },
}
MAX_TEMPERATURE_GROUPS = UFORM_MAX_TEMPERATURE_GROUPS
MAX_MATRYOSHKA_DIMENSIONS = UFORM_MAX_MATRYOSHKA_DIMENSIONS
MAX_NOTE_BYTES = UFORM_MAX_NOTE_BYTES

# Modalities and sides travel as uint32 arrays read through enum pointers: the sizes must agree.
if sizeof(uform_modality_t) != sizeof(uint32_t) or sizeof(uform_late_interaction_side_t) != sizeof(uint32_t):
    raise ImportError("uform: this compiler's C enumerations are not 32 bits wide")

cdef dict _ERRORS = {
    uform_status_invalid_argument_k: InvalidArgument,
    uform_status_invalid_handle_k: InvalidHandle,
    uform_status_busy_k: Busy,
    uform_status_unsupported_k: Unsupported,
    uform_status_out_of_memory_k: OutOfMemory,
    uform_status_io_k: StorageError,
    uform_status_invalid_checkpoint_k: InvalidCheckpoint,
    uform_status_device_k: DeviceError,
    uform_status_peer_k: PeerError,
}

# Where an empty buffer points: C reads nothing from it, but a NULL could mean "absent".
cdef uint64_t _nothing = 0


cdef int check(uform_status_t status, const char* message, str verb) except -1:
    """Raises the error a failed status stands for, with the library's message as its text."""
    if status == uform_status_success_k:
        return 0
    text = message.decode("utf-8", "replace") if message != NULL else f"{verb} failed with status {<int>status}"
    raise _ERRORS.get(status, Error)(text)


def version():
    """The C library's version, as "MAJOR.MINOR.PATCH"."""
    return uform_version().decode("ascii")


def capabilities():
    """The `uform_capability_t` bits this build and machine have."""
    return uform_capabilities()


# ---------------------------------------------------------------------------------------------- #
#  Handles                                                                                         #
# ---------------------------------------------------------------------------------------------- #


@cython.no_gc_clear  # what a handle borrows must outlive it, even inside a collected cycle
cdef class Handle:
    """One native handle, freed with `free()` or when collected; the handles it borrows live until then."""

    cdef void* handle
    cdef tuple borrowed
    cdef str noun  # how messages name it: "executor", "mesh", "trainer", "encoder"
    cdef uform_status_t (*release)(void*, const char**) noexcept nogil
    cdef uform_status_t (*measure)(void*, size_t*, const char**) noexcept nogil  # trainers' and encoders'

    @property
    def alive(self):
        return self.handle != NULL

    cdef void* live(self) except NULL:
        if self.handle == NULL:
            raise InvalidHandle(f"{self.noun}: used after free()")
        return self.handle

    def free(self):
        """Frees the handle and lets go of what it borrows; harmless when already freed."""
        cdef const char* message = NULL
        cdef uform_status_t status
        if self.handle == NULL:
            return
        with nogil:
            status = self.release(self.handle, &message)
        check(status, message, f"freeing the {self.noun}")
        self.handle = NULL
        self.borrowed = None

    def memory(self):
        """For tests: bytes of backend memory the buffers of a trainer's or an encoder's replica take."""
        cdef size_t bytes = 0
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef void* handle = self.live()
        if self.measure == NULL:
            raise InvalidArgument(f"{self.noun}: holds no replica to measure")
        with nogil:
            status = self.measure(handle, &bytes, &message)
        check(status, message, f"measuring the {self.noun}")
        return bytes

    def __dealloc__(self):
        # Subclasses hold no objects of their own: what a handle borrows sits in `borrowed`, which
        # Cython lets go of only after this free.
        if self.handle != NULL:
            with nogil:
                self.release(self.handle, NULL)


# ---------------------------------------------------------------------------------------------- #
#  Executors and meshes                                                                            #
# ---------------------------------------------------------------------------------------------- #


cdef class ExecutorHandle(Handle):
    """One `uform_executor_t`."""

    def __cinit__(self):
        self.noun = "executor"
        self.release = uform_executor_free

    @staticmethod
    def for_ram(size_t threads, size_t devices=1):
        cdef ExecutorHandle executor = ExecutorHandle()
        cdef const char* message = NULL
        cdef uform_status_t status
        with nogil:
            status = uform_executor_init_ram_devices(threads, devices, &executor.handle, &message)
        check(status, message, "uform_executor_init_ram_devices")
        return executor

    @staticmethod
    def for_vram(devices):
        """`devices`: a uint32 array of device ordinals, or None for every visible device."""
        cdef ExecutorHandle executor = ExecutorHandle()
        cdef const uint32_t[::1] ordinals
        cdef const uint32_t* pointer = NULL
        cdef size_t count = 0
        cdef const char* message = NULL
        cdef uform_status_t status
        if devices is not None:
            ordinals = devices
            count = ordinals.shape[0]
            pointer = _per_item(ordinals)
        with nogil:
            status = uform_executor_init_vram(pointer, count, &executor.handle, &message)
        check(status, message, "uform_executor_init_vram")
        return executor


def mesh_abandon():
    """`uform_mesh_abandon`: every wait for peers in progress in this process ends at once."""
    uform_mesh_abandon()


cdef class MeshHandle(Handle):
    """One `uform_mesh_t`; it keeps its executor's handle alive."""

    cdef uint32_t count

    def __cinit__(self):
        self.noun = "mesh"
        self.release = uform_mesh_free

    @staticmethod
    def bootstrap(ExecutorHandle executor not None, uint32_t index, uint32_t count, bytes directory, bytes job,
                  double timeout_seconds):
        cdef MeshHandle mesh = MeshHandle()
        cdef uform_mesh_bootstrap_t config
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_executor_t devices = executor.live()
        memset(&config, 0, sizeof(config))
        config.host_domain_index = index
        config.host_domain_count = count
        if directory is not None:
            config.directory = directory
        if job is not None:
            config.job = job
        config.timeout_seconds = timeout_seconds
        with nogil:
            status = uform_mesh_bootstrap(devices, &config, &mesh.handle, &message)
        check(status, message, "uform_mesh_bootstrap")
        mesh.borrowed = (executor,)
        mesh.count = count if count else 1
        return mesh

    def gather(self, const uint8_t[::1] data):
        """Every process's bytes, in host-domain order: a list of `bytes`."""
        cdef uform_mesh_t mesh = self.live()
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef void* gathered = NULL
        cdef uint64_t[::1] sizes = np.zeros(self.count, dtype=np.uint64)
        cdef const uint8_t* start = &data[0] if data.shape[0] else NULL
        cdef size_t length = data.shape[0]
        with nogil:
            status = uform_mesh_gather(mesh, start, length, &gathered, &sizes[0], &message)
        check(status, message, "uform_mesh_gather")
        parts, offset = [], 0
        try:
            for size in sizes:
                parts.append((<const char*>gathered)[offset:offset + size])
                offset += size
        finally:
            uform_mesh_gathered_free(gathered)
        return parts

    def refuse(self, str reason):
        """Takes this process's part in the collective its peers are in, refusing it with `reason`."""
        cdef uform_mesh_t mesh = self.live()
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef bytes text = reason.encode("utf-8", "replace")
        cdef const char* pointer = text
        with nogil:
            status = uform_mesh_refuse(mesh, pointer, &message)
        check(status, message, "uform_mesh_refuse")


# ---------------------------------------------------------------------------------------------- #
#  Batches: pinned buffers                                                                         #
# ---------------------------------------------------------------------------------------------- #


cdef class TapePin:
    """Keeps one tape's data and offsets pinned while C reads them."""

    cdef const uint8_t[::1] data
    cdef const uint64_t[::1] offsets

    cdef int fill(self, uform_tape_t* tape, object pinnable) except -1:
        """`pinnable`: (a byte memoryview, uint64 count + 1 offsets, the bytes or elements the data holds), or None.

        C checks the offsets against `size` as it reads them, so offsets changed after the checks
        in Python, while a deferred verb waits, cannot send it past the data.
        """
        memset(tape, 0, sizeof(uform_tape_t))
        if pinnable is None:
            return 0
        data, offsets, tape.size = pinnable
        self.data = data
        self.offsets = offsets
        tape.data = <const void*>&_nothing
        if self.data.shape[0]:
            tape.data = <const void*>&self.data[0]
        tape.offsets = &self.offsets[0]
        tape.count = self.offsets.shape[0] - 1
        return 0


cdef class ItemsPin:
    """Keeps the items every verb reads pinned while C reads them: their modalities and contents."""

    cdef const uint32_t[::1] modalities
    cdef TapePin contents

    cdef size_t fill(self, const uform_modality_t** modalities, uform_tape_t* contents, object kinds,
                     object pinnable) except? 0:
        """`kinds`: a uint32 array of C modalities; `pinnable` as `TapePin.fill` takes it. Answers the count."""
        self.modalities = kinds
        self.contents = TapePin()
        modalities[0] = <const uform_modality_t*>_per_item(self.modalities)
        self.contents.fill(contents, pinnable)
        return self.modalities.shape[0]


cdef class EdgesPin:
    """Keeps one edge set's offsets, ids and weights pinned while C reads them."""

    cdef const uint32_t[::1] offsets
    cdef const uint32_t[::1] ids
    cdef const float[::1] weights

    cdef int fill(self, uform_edges_view_t* edges, object arrays) except -1:
        """`arrays`: (uint32 offsets, uint32 ids, float32 weights or None), or None for the empty set."""
        memset(edges, 0, sizeof(uform_edges_view_t))
        if arrays is None:
            return 0
        offsets, ids, weights = arrays
        self.offsets = offsets
        self.ids = ids
        edges.offsets = &self.offsets[0]
        edges.ids = _per_item(self.ids)
        edges.ids_count = self.ids.shape[0]
        if weights is not None:
            self.weights = weights
            edges.weights = <const float*>&_nothing
            if self.weights.shape[0]:
                edges.weights = &self.weights[0]
        return 0


cdef const uint32_t* _per_item(const uint32_t[::1] values) noexcept:
    if values.shape[0] == 0:
        return <const uint32_t*>&_nothing
    return &values[0]


cdef void* _landing(uint8_t[::1] embeddings) noexcept:
    """Where C writes embeddings: NULL for none, never NULL for an empty array, which the caller keeps alive."""
    if embeddings is None:
        return NULL
    if embeddings.shape[0] == 0:
        return <void*>&_nothing
    return <void*>&embeddings[0]


cdef class StepInputs:
    """One step's `uform_trainer_step_t` and every buffer it points into, pinned until collected."""

    cdef uform_trainer_step_t step
    cdef ItemsPin items
    cdef const uint32_t[::1] bags
    cdef const uint32_t[::1] groups
    cdef const uint32_t[::1] sides
    cdef TapePin choices
    cdef TapePin choice_targets
    cdef EdgesPin attract
    cdef EdgesPin repel
    cdef EdgesPin ignore
    cdef object source

    def __cinit__(self, dict batch):
        """`batch`: the dict `uform.batch.normalize_batch` answers."""
        memset(&self.step, 0, sizeof(uform_trainer_step_t))
        self.source = batch  # whatever the views were made from stays alive with them
        self.items, self.choices, self.choice_targets = ItemsPin(), TapePin(), TapePin()
        self.attract, self.repel, self.ignore = EdgesPin(), EdgesPin(), EdgesPin()
        self.step.count = self.items.fill(&self.step.modalities, &self.step.contents, batch["modalities"],
                                          batch["contents"])
        if batch["bags"] is not None:
            self.bags = batch["bags"]
            self.step.bags = _per_item(self.bags)
        if batch["temperature_groups"] is not None:
            self.groups = batch["temperature_groups"]
            self.step.temperature_groups = _per_item(self.groups)
        if batch["sides"] is not None:
            self.sides = batch["sides"]
            self.step.sides = <const uform_late_interaction_side_t*>_per_item(self.sides)
        self.choices.fill(&self.step.choices, batch["choices"])
        self.choice_targets.fill(&self.step.choice_targets, batch["choice_targets"])
        self.attract.fill(&self.step.attract, batch["attract"])
        self.repel.fill(&self.step.repel, batch["repel"])
        self.ignore.fill(&self.step.ignore, batch["ignore"])

    cdef int ready(self, embeddings, int scalar, DecodedHandle decoded) except -1:
        """Points the step at its media decoded ahead and at where its embeddings land, and clears its stats."""
        self.step.decoded = NULL if decoded is None else decoded.live()
        self.step.embeddings = _landing(embeddings)
        self.step.embeddings_scalar = <uform_scalar_t>scalar
        memset(&self.step.stats, 0, sizeof(uform_trainer_stats_t))
        return 0

    @property
    def count(self):
        return self.step.count

    @property
    def has_media(self):
        """Whether any item is an image, a video or audio: what `uform_trainer_decode` decodes."""
        cdef size_t i
        for i in range(self.step.count):
            if self.step.modalities[i] != uform_modality_text_k:
                return True
        return False


def tape_addresses(tape):
    """The (data, offsets) addresses C receives for `tape`: tests compare them with the caller's arrays."""
    cdef uform_tape_t view
    cdef TapePin pin = TapePin()
    pin.fill(&view, tape._pinnable("tape", tape.is_float32))
    return <size_t>view.data, <size_t>view.offsets


# ---------------------------------------------------------------------------------------------- #
#  Trainers                                                                                        #
# ---------------------------------------------------------------------------------------------- #


cdef dict _stats(const uform_trainer_stats_t* stats):
    cdef uint32_t groups = min(stats.temperature_groups, <uint32_t>UFORM_MAX_TEMPERATURE_GROUPS)
    return {
        "step": stats.step,
        "learning_rate": stats.learning_rate,
        "loss": stats.loss,
        "masked_loss": stats.masked_loss,
        "contrastive_loss": stats.contrastive_loss,
        "late_interaction_loss": stats.late_interaction_loss,
        "image_loss": stats.image_loss,
        "video_loss": stats.video_loss,
        "audio_loss": stats.audio_loss,
        "choices_loss": stats.choices_loss,
        "grad_norm": stats.grad_norm,
        "items": stats.items,
        "tokens": stats.tokens,
        "truncated_items": stats.truncated_items,
        "masked_positions": stats.masked_positions,
        "contrastive_rows": stats.contrastive_rows,
        "choice_items": stats.choice_items,
        "query_rows": stats.query_rows,
        "masked_patches": stats.masked_patches,
        "host_seconds": stats.host_seconds,
        "skipped": stats.skipped != 0,
        "inverse_temperatures": [stats.inverse_temperatures[i] for i in range(groups)],
        "biases": [stats.biases[i] for i in range(groups)],
    }


cdef class DecodedHandle(Handle):
    """One `uform_decoded_t`: a batch's media decoded ahead of its step."""

    def __cinit__(self):
        self.noun = "decoded batch"
        self.release = uform_decoded_free


ctypedef uform_status_t (*stepping_t)(uform_trainer_t, uform_trainer_step_t*, const char**) noexcept nogil


cdef class TrainerHandle(Handle):
    """One `uform_trainer_t`; it keeps its executor's and mesh's handles alive until freed."""

    def __cinit__(self):
        self.noun = "trainer"
        self.release = uform_trainer_free
        self.measure = uform_trainer_memory

    @staticmethod
    def init(bint vram, ExecutorHandle executor not None, dict config, MeshHandle mesh):
        """`config`: the nested dict `uform.config.normalize_trainer_config` answers."""
        cdef TrainerHandle trainer = TrainerHandle()
        cdef uform_trainer_init_vram_t c
        cdef const uint32_t[::1] dimensions
        cdef bytes resume = config["resume"]
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_executor_t devices = executor.live()
        cdef uform_mesh_t peers = NULL if mesh is None else mesh.live()
        # Cython converts each dict of pointer-free fields into its struct by the `.pxd`'s names; the contrastive
        # struct points at its dimensions, so its scalars are copied one by one.
        memset(&c, 0, sizeof(c))
        if resume is not None:
            c.resume = resume
        c.depth, c.hidden, c.objective, c.seed = config["depth"], config["hidden"], config["objective"], config["seed"]
        c.determinism = config["determinism"]
        c.batch, c.masking, c.late_interaction = config["batch"], config["masking"], config["late_interaction"]
        c.choices, c.schedule = config["choices"], config["schedule"]
        contrastive = config["contrastive"]
        if contrastive["matryoshka_dimensions"] is not None:
            dimensions = contrastive["matryoshka_dimensions"]
            if dimensions.shape[0]:
                c.contrastive.matryoshka_dimensions = &dimensions[0]
                c.contrastive.matryoshka_dimensions_count = dimensions.shape[0]
        c.contrastive.temperature_groups = contrastive["temperature_groups"]
        c.contrastive.inverse_temperature = contrastive["inverse_temperature"]
        c.contrastive.bias = contrastive["bias"]
        c.contrastive.negatives = contrastive["negatives"]
        c.contrastive.ambient_repulsion_weight = contrastive["ambient_repulsion_weight"]
        c.contrastive.max_edges_per_device = contrastive["max_edges_per_device"]
        c.contrastive.pair_loss = contrastive["pair_loss"]
        with nogil:
            if vram:
                status = uform_trainer_init_vram(devices, &c, peers, &trainer.handle, &message)
            else:
                status = uform_trainer_init_ram(devices, &c, peers, &trainer.handle, &message)
        check(status, message, "uform_trainer_init_vram" if vram else "uform_trainer_init_ram")
        trainer.borrowed = (executor, mesh)
        return trainer

    def decode(self, StepInputs inputs):
        """Decodes the batch's media ahead of its step; answers a `DecodedHandle`, or None for a batch of text."""
        cdef DecodedHandle decoded = DecodedHandle()
        cdef uform_decoded_t made = NULL
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_trainer_t trainer = self.live()
        with nogil:
            status = uform_trainer_decode(trainer, &inputs.step, &made, &message)
        check(status, message, "uform_trainer_decode")
        if made == NULL:
            return None
        decoded.handle = made
        return decoded

    cdef int _stepping(self, stepping_t verb, str name, StepInputs inputs) except -1:
        """Calls one of the step's verbs on `inputs`, without the GIL."""
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_trainer_t trainer = self.live()
        with nogil:
            status = verb(trainer, &inputs.step, &message)
        return check(status, message, name)

    def step(self, StepInputs inputs, embeddings, int scalar, DecodedHandle decoded=None):
        """Runs one step; `embeddings` is a writable uint8 array of items x hidden scalars, or None."""
        inputs.ready(embeddings, scalar, decoded)
        self._stepping(uform_trainer_step, "uform_trainer_step", inputs)
        return _stats(&inputs.step.stats)

    def step_begin(self, StepInputs inputs, embeddings, int scalar, DecodedHandle decoded=None):
        """Queues one step and returns before it lands; `inputs`, `embeddings` and `decoded` stay borrowed until
        `step_end`."""
        inputs.ready(embeddings, scalar, decoded)
        self._stepping(uform_trainer_step_begin, "uform_trainer_step_begin", inputs)

    def step_end(self, StepInputs inputs):
        """Waits for the earliest step begun, which must be `inputs`'s, and answers its stats."""
        self._stepping(uform_trainer_step_end, "uform_trainer_step_end", inputs)
        return _stats(&inputs.step.stats)

    def save(self, bytes path, bint weights_only, bytes note):
        """Writes a checkpoint; `weights_only` leaves out the optimizer's moments; `note` (UTF-8 without NUL,
        or None) rides in its metadata."""
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_trainer_t trainer = self.live()
        cdef const char* destination = path
        cdef const char* text = NULL
        if note is not None:
            text = note
        with nogil:
            if weights_only:
                status = uform_trainer_save_weights_noted(trainer, destination, text, &message)
            else:
                status = uform_trainer_save_noted(trainer, destination, text, &message)
        check(status, message, "uform_trainer_save_weights_noted" if weights_only else "uform_trainer_save_noted")

    def parameters(self):
        """How many floats the flat weights (and gradients) hold."""
        cdef size_t total = 0
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_trainer_t trainer = self.live()
        with nogil:
            status = uform_trainer_weights(trainer, NULL, &total, &message)
        check(status, message, "uform_trainer_weights")
        return total

    def weights(self):
        """A copy of the flat float32 weights, in the layout's order."""
        cdef size_t total = self.parameters()
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_trainer_t trainer = self.live()
        weights = np.empty(total, np.float32)
        cdef float[::1] landing = weights
        cdef float* pointer = &landing[0] if total else NULL
        with nogil:
            status = uform_trainer_weights(trainer, pointer, &total, &message)
        check(status, message, "uform_trainer_weights")
        return weights

    def probe(self, StepInputs inputs, DecodedHandle decoded=None):
        """A step's forward, loss and backward without the update: (stats dict, float32 gradients)."""
        cdef size_t total = self.parameters()
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_trainer_t trainer = self.live()
        gradients = np.zeros(total, np.float32)
        cdef float[::1] landing = gradients
        cdef float* pointer = &landing[0] if total else NULL
        inputs.step.embeddings = NULL
        inputs.step.decoded = NULL if decoded is None else decoded.live()
        memset(&inputs.step.stats, 0, sizeof(uform_trainer_stats_t))
        with nogil:
            status = uform_trainer_probe(trainer, &inputs.step, pointer, &message)
        check(status, message, "uform_trainer_probe")
        return _stats(&inputs.step.stats), gradients


def checkpoint_note(bytes path):
    """The note a checkpoint carries, as UTF-8 bytes; empty when it carries none."""
    cdef const char* source = path
    cdef size_t length = 0
    cdef const char* message = NULL
    cdef uform_status_t status
    with nogil:  # first, the note's length
        status = uform_checkpoint_note(source, NULL, 0, &length, &message)
    check(status, message, "uform_checkpoint_note")
    note = bytearray(length + 1)
    cdef char* landing = note
    with nogil:
        status = uform_checkpoint_note(source, landing, length + 1, &length, &message)
    check(status, message, "uform_checkpoint_note")
    return bytes(note[:length])


def media_tokens(uint32_t modality, const uint8_t[::1] content, dict shape):
    """The tokens one media item decodes to under `shape` (the nested dict `normalize(BatchShape, ...)` answers):
    (float32 tokens x width, (frames, rows, columns), whether it was fitted to a row). The first call sizes, the
    second fills: the item is decoded twice, as the width and the count come from the library's own derivation."""
    cdef uform_batch_shape_t c
    cdef uint32_t grid[3]
    cdef size_t count = 0, width = 0
    cdef int truncated = 0
    cdef const char* message = NULL
    cdef uform_status_t status
    cdef const uint8_t* bytes_ = &content[0] if content.shape[0] else NULL
    cdef size_t length = content.shape[0]
    c = shape
    with nogil:
        status = uform_media_tokens_fitted(&c, <uform_modality_t>modality, bytes_, length, NULL, 0, grid, &count,
                                           &width, &truncated, &message)
    check(status, message, "uform_media_tokens_fitted")
    tokens = np.empty((count, width), np.float32)
    cdef float[:, ::1] landing = tokens
    with nogil:
        status = uform_media_tokens_fitted(&c, <uform_modality_t>modality, bytes_, length, &landing[0, 0], count,
                                           grid, &count, &width, &truncated, &message)
    check(status, message, "uform_media_tokens_fitted")
    return tokens, (grid[0], grid[1], grid[2]), bool(truncated)


# ---------------------------------------------------------------------------------------------- #
#  Encoders                                                                                        #
# ---------------------------------------------------------------------------------------------- #


cdef class EncoderHandle(Handle):
    """One `uform_encoder_t`; it keeps its executor's handle alive until freed."""

    cdef readonly size_t hidden

    def __cinit__(self):
        self.noun = "encoder"
        self.release = uform_encoder_free
        self.measure = uform_encoder_memory

    @staticmethod
    def load(ExecutorHandle executor not None, bytes path):
        cdef EncoderHandle encoder = EncoderHandle()
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_executor_t devices = executor.live()
        cdef const char* source = path
        with nogil:
            status = uform_encoder_load(devices, source, &encoder.handle, &encoder.hidden, &message)
        check(status, message, "uform_encoder_load")
        encoder.borrowed = (executor,)
        return encoder

    def embed_tokens(self, modalities, contents, sides):
        """Unit token vectors of pinnable `contents`, read as `sides` (a uint32 array, or None for
        documents): answers (float32 vectors of rows x width, uint64 row offsets, truncated items)."""
        cdef const uint32_t[::1] side_values
        cdef ItemsPin items = ItemsPin()
        cdef uform_encoder_tokens_t tokens
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_encoder_t encoder = self.live()
        memset(&tokens, 0, sizeof(tokens))
        tokens.count = items.fill(&tokens.modalities, &tokens.contents, modalities, contents)
        if sides is not None:
            side_values = sides
            tokens.sides = <const uform_late_interaction_side_t*>_per_item(side_values)
        offsets = np.zeros(tokens.count + 1, np.uint64)
        cdef uint64_t[::1] offset_view = offsets
        tokens.offsets = &offset_view[0]
        with nogil:  # first, the rows each item takes
            status = uform_encoder_embed_tokens(encoder, &tokens, &message)
        check(status, message, "uform_encoder_embed_tokens")
        vectors = np.empty((max(int(offsets[tokens.count]), 1), tokens.width), np.float32)
        cdef float[:, ::1] landing = vectors
        tokens.vectors = &landing[0, 0]
        with nogil:
            status = uform_encoder_embed_tokens(encoder, &tokens, &message)
        check(status, message, "uform_encoder_embed_tokens")
        return vectors[:int(offsets[tokens.count])], offsets, tokens.truncated_items

    def choose(self, texts, choices, probabilities):
        """Fills `probabilities` (float32, one per offered byte) for pinnable `texts` and `choices` tapes;
        answers how many texts were cut."""
        cdef TapePin text_tape = TapePin(), choice_tape = TapePin()
        cdef float[::1] landing = probabilities
        cdef uform_encoder_choose_t choose
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_encoder_t encoder = self.live()
        memset(&choose, 0, sizeof(choose))
        text_tape.fill(&choose.texts, texts)
        choice_tape.fill(&choose.choices, choices)
        choose.count = choose.texts.count
        choose.probabilities = &landing[0]
        with nogil:
            status = uform_encoder_choose(encoder, &choose, &message)
        check(status, message, "uform_encoder_choose")
        return choose.truncated_items

    def embed(self, modalities, contents, embeddings, int scalar):
        """Embeds `contents` (a pinnable byte tape) into `embeddings`, a writable uint8 array of count x hidden scalars.

        Answers how many items were cut to the checkpoint's `max_columns_per_row`.
        """
        cdef ItemsPin items = ItemsPin()
        cdef uform_encoder_embed_t embed
        cdef const char* message = NULL
        cdef uform_status_t status
        cdef uform_encoder_t encoder = self.live()
        memset(&embed, 0, sizeof(embed))
        embed.count = items.fill(&embed.modalities, &embed.contents, modalities, contents)
        embed.embeddings = _landing(embeddings)
        embed.embeddings_scalar = <uform_scalar_t>scalar
        with nogil:
            status = uform_encoder_embed(encoder, &embed, &message)
        check(status, message, "uform_encoder_embed")
        return embed.truncated_items
