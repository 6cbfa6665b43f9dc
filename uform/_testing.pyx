# cython: language_level=3
"""Each backend's operations, one by one, for the tests.

Every function takes numpy arrays and the backend's name ("ram", the CPU reference, or "vram",
CUDA), opens a device and a context planned for these inputs, uploads them (activations as the
backend's element type: float32 on the CPU, bfloat16 on the GPU, rounded to nearest even), calls
the operation through the backend's table, synchronizes and downloads fresh
float32 arrays. Operations that accumulate (`+=`) take the starting gradient as an argument and
return the sum; none changes its arguments. A backend's failure raises `RuntimeError` with its
message.
"""
import numpy as np

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memset


cdef extern from "uform.h" nogil:
    ctypedef enum uform_status_t:
        uform_status_success_k
    ctypedef enum uform_pair_loss_form_t:
        uform_pair_loss_derived_k
        uform_pair_loss_balanced_k
        uform_pair_loss_ranked_k
        uform_pair_loss_sigmoid_k
    enum:
        UFORM_MAX_MATRYOSHKA_DIMENSIONS


cdef extern from "backend.h" nogil:
    char* uform_message()

    ctypedef struct uform_tensor_t:
        size_t offset
        size_t rows
        size_t cols
        int decays

    ctypedef struct uform_layout_t:
        size_t count
        uform_tensor_t* tensors
        size_t total

    ctypedef struct uform_segment_t:
        uint32_t start
        uint32_t length
        uint32_t row
        uint32_t column

    ctypedef enum uform_element_t:
        uform_element_f32_k
        uform_element_bf16_k

    ctypedef struct uform_plan_t:
        size_t tokens
        size_t segments
        size_t columns
        size_t hidden
        size_t heads
        int contrastive
        size_t pairs, query_span
        const uform_layout_t* layout

    ctypedef struct uform_items_t:
        const uform_segment_t* segments
        const uform_segment_t* host_segments
        size_t count
        size_t longest

    ctypedef struct uform_contrastive_setup_t:
        uform_pair_loss_form_t form
        size_t dimensions_count
        uint32_t dimensions[UFORM_MAX_MATRYOSHKA_DIMENSIONS]

    ctypedef struct uform_span_t:
        uint32_t start, length

    ctypedef struct uform_late_interaction_setup_t:
        const uform_span_t* spans
        const uint32_t* queries
        const uint32_t* offsets
        const uint32_t* documents
        const uint8_t* cells
        const float* weights
        size_t count, pairs
        uform_pair_loss_form_t form

    ctypedef struct uform_terms_t:
        int masked_ran, contrastive_ran, choices_ran, late_ran
        float text_weight, choices_weight, late_weight

    ctypedef struct uform_update_t:
        float* weights
        void* compute
        const float* gradients
        float* first
        float* second
        const double* scalars
        float learning_rate, beta1, beta2, epsilon, weight_decay, clip_norm
        uform_terms_t terms
        uint64_t step

    ctypedef struct uform_backend_t:
        const char* name
        uform_element_t activations
        uform_status_t (*device_open)(uint32_t, void**)
        void (*device_close)(void*)
        uform_status_t (*context_create)(void*, const uform_plan_t*, void**)
        void (*context_destroy)(void*)
        uform_status_t (*synchronize)(void*)
        size_t (*statistics_floats)(const uform_plan_t*)
        uform_status_t (*allocate)(void*, size_t, void**)
        void (*release)(void*, void*)
        uform_status_t (*upload)(void*, void*, const void*, size_t)
        uform_status_t (*download)(void*, void*, const void*, size_t)
        uform_status_t (*zero)(void*, void*, size_t)
        uform_status_t (*convert)(void*, void*, const float*, size_t)
        uform_status_t (*matmul)(void*, void*, const void*, const void*, const void*, size_t, size_t, size_t, int, int,
                                 uform_element_t)
        uform_status_t (*matmul_gelu)(void*, void*, void*, const void*, const void*, size_t, size_t, size_t)
        uform_status_t (*matmul_gelu_backward)(void*, void*, const void*, const void*, const void*, size_t, size_t,
                                               size_t)
        uform_status_t (*embedding_forward)(void*, void*, const void*, const uint32_t*, size_t, size_t)
        uform_status_t (*embedding_backward)(void*, float*, const void*, const uint32_t*, const uint32_t*, size_t,
                                             size_t, size_t)
        uform_status_t (*rmsnorm_forward)(void*, void*, float*, const void*, const float*, size_t, size_t)
        uform_status_t (*rmsnorm_backward)(void*, void*, float*, const void*, const void*, const float*, const float*,
                                           size_t, size_t)
        uform_status_t (*rope_forward)(void*, void*, const uint32_t*, size_t, size_t)
        uform_status_t (*rope_backward)(void*, void*, const uint32_t*, size_t, size_t)
        uform_status_t (*attention_forward)(void*, void*, float*, const void*, const uform_items_t*, size_t, size_t)
        uform_status_t (*attention_backward)(void*, void*, const void*, const void*, const float*, const void*,
                                             const uint32_t*, int, const uform_items_t*, size_t, size_t)
        uform_status_t (*gelu_forward)(void*, void*, const void*, size_t)
        uform_status_t (*gelu_backward)(void*, void*, const void*, const void*, size_t)
        uform_status_t (*gather_rows)(void*, void*, const void*, const uint32_t*, size_t, size_t)
        uform_status_t (*scatter_rows)(void*, void*, const void*, const uint32_t*, size_t, size_t)
        uform_status_t (*cross_entropy)(void*, double*, void*, const void*, const uint32_t*, size_t, size_t, float)
        uform_status_t (*choices)(void*, double*, void*, float*, const void*, const uint32_t*, const uint8_t*,
                                  const float*, size_t, float)
        uform_status_t (*pool_forward)(void*, float*, const void*, const uform_items_t*, size_t)
        uform_status_t (*pool_backward)(void*, void*, const float*, const uform_items_t*, size_t)
        uform_status_t (*contrastive)(void*, double*, float*, float*, float*, float*, const float*, const float*,
                                      const float*, const uint8_t*, const float*, const uint32_t*, size_t, size_t,
                                      const uform_contrastive_setup_t*, float)
        uform_status_t (*normalize_rows)(void*, float*, const void*, size_t, size_t)
        uform_status_t (*normalize_rows_backward)(void*, void*, const float*, const float*, const void*, size_t, size_t)
        uform_status_t (*late_interaction)(void*, double*, float*, float*, float*, const float*, size_t, size_t,
                                           const float*, const float*, const uform_late_interaction_setup_t*, float)
        uform_status_t (*patch_loss)(void*, double*, void*, const void*, const float*, size_t, size_t, float)
        uform_status_t (*sum_squares)(void*, double*, const float*, size_t)
        uform_status_t (*adamw)(void*, const uform_update_t*)

    const uform_backend_t* uform_testing_backend(const char* name)

    enum:
        uform_scalar_masked_loss_k
        uform_scalar_contrastive_loss_k
        uform_scalar_norm_squared_k
        uform_scalars_k


PAIR_LOSS_FORMS = {
    "balanced": uform_pair_loss_balanced_k,
    "ranked": uform_pair_loss_ranked_k,
    "sigmoid": uform_pair_loss_sigmoid_k,
}

F32, ACT = "f32", "act"  # how an array travels: float32 always, or as the backend's activations


def available(name):
    """Whether this build and machine have the backend: "ram" always, "vram" with CUDA and a GPU."""
    return uform_testing_backend(name.encode()) != NULL


def to_bf16(array):
    """float32 -> bfloat16 bits, rounded to nearest even, as the GPU rounds."""
    bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def from_bf16(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to(name, array):
    """`array` as float32 after the trip through the backend's activations: bf16-rounded on the GPU."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if Session(name).bf16:
        return from_bf16(to_bf16(array)).reshape(array.shape)
    return array.copy()


cdef class Session:
    """One backend's device and a context planned for one call, with the buffers taken for it."""

    cdef const uform_backend_t* backend
    cdef void* device
    cdef void* context
    cdef list buffers
    cdef uform_layout_t layout
    cdef uform_tensor_t tensor
    cdef readonly bint bf16

    def __cinit__(self, str name, int threads=2, size_t tokens=1, size_t segments=1, size_t columns=1,
                  size_t hidden=64, bint contrastive=False, size_t parameters=0, bint decays=False, size_t pairs=0,
                  size_t query_span=0):
        self.buffers = []
        self.backend = uform_testing_backend(name.encode())
        if self.backend == NULL:
            raise RuntimeError(uform_message().decode())
        self.bf16 = self.backend.activations == uform_element_bf16_k
        self.tensor.offset, self.tensor.rows, self.tensor.cols, self.tensor.decays = 0, 1, parameters, decays
        self.layout.count, self.layout.tensors, self.layout.total = 1, &self.tensor, parameters
        cdef uform_plan_t plan
        memset(&plan, 0, sizeof(plan))
        plan.tokens, plan.segments, plan.columns = max(tokens, 1), max(segments, 1), max(columns, 1)
        plan.hidden, plan.heads, plan.contrastive, plan.layout = hidden, max(hidden // 64, 1), contrastive, &self.layout
        plan.pairs, plan.query_span = pairs, query_span
        self.check(self.backend.device_open(threads if name == "ram" else 0, &self.device))
        self.check(self.backend.context_create(self.device, &plan, &self.context))

    cdef check(self, uform_status_t status):
        if status != uform_status_success_k:
            raise RuntimeError(uform_message().decode())

    cdef size_t element(self, str kind):
        return 2 if kind == ACT and self.bf16 else 4

    cdef void* take(self, size_t nbytes) except NULL:
        cdef void* pointer = NULL
        self.check(self.backend.allocate(self.context, max(nbytes, 1), &pointer))
        self.buffers.append(<size_t>pointer)
        return pointer

    cdef void* put(self, array, str kind=F32) except NULL:
        """A device copy of a float array (as `kind`), or of a uint32 / uint8 / float64 array as is."""
        array = np.ascontiguousarray(array)
        if array.dtype.kind == "f" and array.dtype != np.float64:
            array = to_bf16(array) if kind == ACT and self.bf16 else np.ascontiguousarray(array, dtype=np.float32)
        cdef const uint8_t[::1] raw = array.reshape(-1).view(np.uint8)
        cdef void* pointer = self.take(raw.shape[0])
        if raw.shape[0]:
            self.check(self.backend.upload(self.context, pointer, &raw[0], raw.shape[0]))
        return pointer

    def get(self, size_t address, shape, str kind=F32):
        """A float32 array read back from a device buffer of `kind`."""
        self.check(self.backend.synchronize(self.context))
        count = int(np.prod(shape))
        raw = np.empty(count * self.element(kind), dtype=np.uint8)
        cdef uint8_t[::1] view = raw
        if count:
            self.check(self.backend.download(self.context, &view[0], <void*>address, raw.shape[0]))
        values = from_bf16(raw.view(np.uint16)) if kind == ACT and self.bf16 else raw.view(np.float32)
        return values.reshape(shape).copy()

    def get_bytes(self, size_t address, size_t count):
        self.check(self.backend.synchronize(self.context))
        raw = np.zeros(count, dtype=np.uint8)
        cdef uint8_t[::1] view = raw
        if count:
            self.check(self.backend.download(self.context, &view[0], <void*>address, count))
        return raw

    def get_double(self, size_t address):
        self.check(self.backend.synchronize(self.context))
        cdef double value = 0
        self.check(self.backend.download(self.context, &value, <void*>address, sizeof(double)))
        return value

    def __dealloc__(self):
        if self.context != NULL:
            self.backend.synchronize(self.context)
            for pointer in self.buffers:
                self.backend.release(self.context, <void*><size_t>pointer)
            self.backend.context_destroy(self.context)
        if self.device != NULL:
            self.backend.device_close(self.device)


def _segments(segments):
    """(start, length) pairs as the (count, 4) uint32 layout of `uform_segment_t`."""
    pairs = np.asarray(segments, dtype=np.int64).reshape(-1, 2)
    table = np.zeros((len(pairs), 4), dtype=np.uint32)
    table[:, :2] = pairs
    return table


cdef uform_items_t _items(Session session, table) except *:
    cdef uform_items_t items
    cdef const uint32_t[:, ::1] host = table
    items.segments = <const uform_segment_t*>session.put(table)
    items.host_segments = <const uform_segment_t*>&host[0, 0] if len(table) else NULL
    items.count = len(table)
    items.longest = int(table[:, 1].max()) if len(table) else 0
    return items


def backend_name(backend="ram"):
    return Session(backend).backend.name.decode()


def memory_roundtrip(data, backend="ram"):
    """Allocates len(data) bytes and returns what it read: fresh, after an upload, after zeroing."""
    source = np.frombuffer(bytes(data), dtype=np.uint8)
    cdef Session s = Session(backend)
    cdef size_t size = source.size
    cdef void* memory = s.take(size)
    fresh = s.get_bytes(<size_t>memory, size)
    if size:
        s.check(s.backend.upload(s.context, memory, <const void*><size_t>source.ctypes.data, size))
    uploaded = s.get_bytes(<size_t>memory, size)
    s.check(s.backend.zero(s.context, memory, size))
    return fresh, uploaded, s.get_bytes(<size_t>memory, size)


def matmul(a, b, c=None, bint a_transposed=False, bint b_transposed=False, bint accumulate=False,
           bint float_output=False, int threads=2, backend="ram"):
    """d (m, n) = a x b [+ c]: `accumulate` adds into c in place, else c (when given) is a residual
    added on the way into a fresh d; `a` is stored (k, m) when transposed, `b` (n, k). With
    `float_output` c and d are float32 whatever the backend's activations."""
    cdef size_t m = a.shape[1] if a_transposed else a.shape[0]
    cdef size_t k = a.shape[0] if a_transposed else a.shape[1]
    cdef size_t n = b.shape[0] if b_transposed else b.shape[1]
    if (b.shape[1] if b_transposed else b.shape[0]) != k:
        raise ValueError(f"inner dimensions differ: a gives {k}, b gives {b.shape}")
    cdef Session s = Session(backend, threads)
    out_kind = F32 if float_output else ACT
    cdef void* a_pointer = s.put(a, ACT)
    cdef void* b_pointer = s.put(b, ACT)
    cdef void* c_pointer = NULL if c is None else s.put(np.asarray(c).reshape(m, n), out_kind)
    cdef void* d_pointer = c_pointer if accumulate else s.put(np.full((m, n), np.nan, np.float32), out_kind)
    cdef uform_element_t element = uform_element_f32_k if float_output or not s.bf16 else uform_element_bf16_k
    s.check(s.backend.matmul(s.context, d_pointer, c_pointer, a_pointer, b_pointer, m, n, k, a_transposed,
                             b_transposed, element))
    return s.get(<size_t>d_pointer, (m, n), out_kind)


def matmul_gelu(a, b, int threads=2, backend="ram"):
    """(activated, up) of the fused slot: up = a x b^T, activated = gelu(up); None where the backend has no slot."""
    cdef Session s = Session(backend, threads)
    if s.backend.matmul_gelu == NULL:
        return None
    cdef size_t m = a.shape[0], k = a.shape[1], n = b.shape[0]
    cdef void* a_pointer = s.put(a, ACT)
    cdef void* b_pointer = s.put(b, ACT)
    cdef void* up = s.take(m * n * s.element(ACT))
    cdef void* activated = s.take(m * n * s.element(ACT))
    s.check(s.backend.matmul_gelu(s.context, activated, up, a_pointer, b_pointer, m, n, k))
    return s.get(<size_t>activated, (m, n), ACT), s.get(<size_t>up, (m, n), ACT)


def matmul_gelu_backward(a, b, up, int threads=2, backend="ram"):
    """d_up = (a x b) * gelu'(up) of the fused slot, `up` as `matmul_gelu` left it; None where the backend
    has no slot. The context is planned for a model whose MLP weight (4 hidden, hidden) holds b."""
    cdef size_t planned = max(b.shape[0], (b.shape[1] + 3) // 4)
    cdef Session s = Session(backend, threads, hidden=planned)
    if s.backend.matmul_gelu_backward == NULL:
        return None
    cdef size_t m = a.shape[0], k = a.shape[1], n = b.shape[1]
    cdef void* a_pointer = s.put(a, ACT)
    cdef void* b_pointer = s.put(b, ACT)
    cdef void* up_pointer = s.put(up, ACT)
    cdef void* d_up = s.take(m * n * s.element(ACT))
    s.check(s.backend.matmul_gelu_backward(s.context, d_up, up_pointer, a_pointer, b_pointer, m, n, k))
    return s.get(<size_t>d_up, (m, n), ACT)


def embedding_forward(table, ids, int threads=2, backend="ram"):
    ids = np.ascontiguousarray(ids, dtype=np.uint32)
    cdef Session s = Session(backend, threads)
    cdef size_t tokens = ids.size, hidden = table.shape[1]
    cdef void* out = s.take(tokens * hidden * s.element(ACT))
    s.check(s.backend.embedding_forward(s.context, out, s.put(table, ACT), <uint32_t*>s.put(ids), tokens, hidden))
    return s.get(<size_t>out, (tokens, hidden), ACT)


def embedding_backward(d_table, d_out, ids, int threads=2, backend="ram"):
    ids = np.ascontiguousarray(ids, dtype=np.uint32)
    vocabulary, hidden = d_table.shape
    order = np.argsort(ids, kind="stable").astype(np.uint32)
    offsets = np.zeros(vocabulary + 1, np.uint32)
    np.cumsum(np.bincount(ids, minlength=vocabulary), out=offsets[1:])
    cdef Session s = Session(backend, threads)
    cdef float* table = <float*>s.put(d_table)
    s.check(s.backend.embedding_backward(s.context, table, s.put(d_out, ACT), <uint32_t*>s.put(order),
                                         <uint32_t*>s.put(offsets), ids.size, hidden, vocabulary))
    return s.get(<size_t>table, d_table.shape)


def rmsnorm_forward(x, gain, int threads=2, backend="ram"):
    """Returns (out, rstd)."""
    cdef Session s = Session(backend, threads)
    cdef size_t tokens = x.shape[0], hidden = x.shape[1]
    cdef void* out = s.take(tokens * hidden * s.element(ACT))
    cdef float* rstd = <float*>s.take(tokens * 4)
    s.check(s.backend.rmsnorm_forward(s.context, out, rstd, s.put(x, ACT), <float*>s.put(gain), tokens, hidden))
    return s.get(<size_t>out, x.shape, ACT), s.get(<size_t>rstd, (tokens,))


def rmsnorm_backward(d_x, d_gain, d_out, x, gain, rstd, int threads=2, backend="ram", bint planned=True):
    """Returns (d_x, d_gain) after accumulating into copies of the given ones; `planned=False`
    makes the call past a context planned for one token, as a caller past its plan would."""
    cdef size_t tokens = x.shape[0], hidden = x.shape[1]
    cdef Session s = Session(backend, threads, tokens=tokens if planned else 1, hidden=hidden)
    cdef void* d_x_pointer = s.put(d_x, ACT)
    cdef float* d_gain_pointer = <float*>s.put(d_gain)
    s.check(s.backend.rmsnorm_backward(s.context, d_x_pointer, d_gain_pointer, s.put(d_out, ACT), s.put(x, ACT),
                                       <float*>s.put(gain), <float*>s.put(rstd), tokens, hidden))
    return s.get(<size_t>d_x_pointer, x.shape, ACT), s.get(<size_t>d_gain_pointer, (hidden,))


def _rope(qkv, positions, bint forward, int threads, backend):
    positions = np.ascontiguousarray(positions, dtype=np.uint32)
    cdef Session s = Session(backend, threads)
    cdef size_t tokens = qkv.shape[0], hidden = qkv.shape[1] // 3
    cdef void* pointer = s.put(qkv, ACT)
    operation = s.backend.rope_forward if forward else s.backend.rope_backward
    s.check(operation(s.context, pointer, <uint32_t*>s.put(positions), tokens, hidden))
    return s.get(<size_t>pointer, qkv.shape, ACT)


def rope_forward(qkv, positions, int threads=2, backend="ram"):
    return _rope(qkv, positions, True, threads, backend)


def rope_backward(d_qkv, positions, int threads=2, backend="ram"):
    return _rope(d_qkv, positions, False, threads, backend)


def _attention_session(backend, threads, table, tokens, hidden):
    columns = int(table[:, 1].max()) if len(table) else 1
    return Session(backend, threads, tokens=tokens, segments=len(table), columns=columns, hidden=hidden)


def attention_forward(qkv, segments, out=None, lse=None, int threads=2, backend="ram"):
    """Returns (out, statistics): (heads, tokens) log-sum-exps on the CPU, the backend's own layout elsewhere.
    Rows no segment covers keep the given `out` and `lse` (zeros by default)."""
    table = _segments(segments)
    cdef size_t tokens = qkv.shape[0], hidden = qkv.shape[1] // 3
    cdef Session s = _attention_session(backend, threads, table, tokens, hidden)
    cdef uform_plan_t plan
    memset(&plan, 0, sizeof(plan))
    plan.tokens, plan.segments, plan.heads = tokens, max(len(table), 1), hidden // 64
    plan.columns, plan.hidden = max(int(table[:, 1].max()) if len(table) else 1, 1), hidden
    cdef size_t statistics_floats = s.backend.statistics_floats(&plan)
    cdef uform_items_t items = _items(s, table)
    heads = int(hidden // 64)
    shape = (heads, int(tokens)) if statistics_floats == heads * tokens else (int(statistics_floats),)
    cdef void* result = s.put(np.zeros((tokens, hidden), np.float32) if out is None else out, ACT)
    cdef float* statistics = <float*>s.put(np.zeros(shape, np.float32) if lse is None else lse)
    s.check(s.backend.attention_forward(s.context, result, statistics, s.put(qkv, ACT), &items, tokens, hidden))
    return s.get(<size_t>result, (tokens, hidden), ACT), s.get(<size_t>statistics, shape)


def attention_backward(d_out, out, statistics, qkv, segments, positions=None, int threads=2, backend="ram",
                       bint again=False):
    """Returns d_qkv, which the operation writes whole (NaN-filled before, to prove it). Given the `positions` that
    turned qkv's queries and keys (`rope_forward`), the gradient of qkv before the turn. `again` returns a second
    call's, told that its positions are the first's (as a backward pass tells every layer's call but the first)."""
    table = _segments(segments)
    cdef size_t tokens = qkv.shape[0], hidden = qkv.shape[1] // 3
    cdef Session s = _attention_session(backend, threads, table, tokens, hidden)
    cdef uform_items_t items = _items(s, table)
    cdef void* d_qkv = s.put(np.full(qkv.shape, np.nan, np.float32), ACT)
    cdef uint32_t* turns = NULL if positions is None else <uint32_t*>s.put(np.ascontiguousarray(positions, np.uint32))
    cdef void* d_out_pointer = s.put(d_out, ACT)
    cdef void* out_pointer = s.put(out, ACT)
    cdef float* statistics_pointer = <float*>s.put(statistics)
    cdef void* qkv_pointer = s.put(qkv, ACT)
    cdef int call
    for call in range(2 if again else 1):
        if call:
            d_qkv = s.put(np.full(qkv.shape, np.nan, np.float32), ACT)
        s.check(s.backend.attention_backward(s.context, d_qkv, d_out_pointer, out_pointer, statistics_pointer,
                                             qkv_pointer, turns, call, &items, tokens, hidden))
    return s.get(<size_t>d_qkv, qkv.shape, ACT)


def gelu_forward(x, int threads=2, backend="ram"):
    cdef Session s = Session(backend, threads)
    cdef void* out = s.take(x.size * s.element(ACT))
    s.check(s.backend.gelu_forward(s.context, out, s.put(x, ACT), x.size))
    return s.get(<size_t>out, x.shape, ACT)


def gelu_backward(d_out, x, bint in_place=False, int threads=2, backend="ram"):
    """Returns d_in, written whole; `in_place` passes one buffer as d_out and d_in, as the core does."""
    cdef Session s = Session(backend, threads)
    cdef void* d_out_pointer = s.put(d_out, ACT)
    cdef void* d_in = d_out_pointer if in_place else s.put(np.full(x.shape, np.nan, np.float32), ACT)
    s.check(s.backend.gelu_backward(s.context, d_in, d_out_pointer, s.put(x, ACT), x.size))
    return s.get(<size_t>d_in, x.shape, ACT)


def gather_rows(x, rows, int threads=2, backend="ram"):
    rows = np.ascontiguousarray(rows, dtype=np.uint32)
    cdef Session s = Session(backend, threads)
    cdef void* out = s.take(rows.size * x.shape[1] * s.element(ACT))
    s.check(s.backend.gather_rows(s.context, out, s.put(x, ACT), <uint32_t*>s.put(rows), rows.size, x.shape[1]))
    return s.get(<size_t>out, (rows.size, x.shape[1]), ACT)


def scatter_rows(d_in, d_out, rows, int threads=2, backend="ram"):
    rows = np.ascontiguousarray(rows, dtype=np.uint32)
    cdef Session s = Session(backend, threads)
    cdef void* pointer = s.put(d_in, ACT)
    s.check(s.backend.scatter_rows(s.context, pointer, s.put(d_out, ACT), <uint32_t*>s.put(rows), rows.size,
                                   d_in.shape[1]))
    return s.get(<size_t>pointer, d_in.shape, ACT)


def pool_forward(states, segments, int threads=2, backend="ram"):
    table = _segments(segments)
    cdef Session s = Session(backend, threads, tokens=states.shape[0], segments=len(table))
    cdef uform_items_t items = _items(s, table)
    cdef float* pooled = <float*>s.put(np.full((len(table), states.shape[1]), np.nan, np.float32))
    s.check(s.backend.pool_forward(s.context, pooled, s.put(states, ACT), &items, states.shape[1]))
    return s.get(<size_t>pooled, (len(table), states.shape[1]))


def pool_backward(d_states, d_pooled, segments, int threads=2, backend="ram"):
    table = _segments(segments)
    cdef Session s = Session(backend, threads, tokens=d_states.shape[0], segments=len(table))
    cdef uform_items_t items = _items(s, table)
    cdef void* pointer = s.put(d_states, ACT)
    s.check(s.backend.pool_backward(s.context, pointer, <float*>s.put(d_pooled), &items, d_states.shape[1]))
    return s.get(<size_t>pointer, d_states.shape, ACT)


def cross_entropy(logits, targets, float scale=1.0, d_logits=None, int threads=2, backend="ram"):
    """Returns (loss, d_logits); `d_logits` starts from the given array (NaN by default)."""
    targets = np.ascontiguousarray(targets, dtype=np.uint32)
    cdef Session s = Session(backend, threads)
    cdef double* loss = <double*>s.put(np.full(1, np.nan))
    cdef void* gradient = s.put(np.full(logits.shape, np.nan, np.float32) if d_logits is None else d_logits, ACT)
    s.check(s.backend.cross_entropy(s.context, loss, gradient, s.put(logits, ACT), <uint32_t*>s.put(targets),
                                    targets.size, logits.shape[1], scale))
    shape = logits.shape if d_logits is None else d_logits.shape
    return s.get_double(<size_t>loss), s.get(<size_t>gradient, shape, ACT)


def patch_loss(predictions, targets, float scale=1.0, int threads=2, backend="ram"):
    """Returns (loss, d_predictions) for predictions and float32 targets of one shape (rows, width)."""
    targets = np.ascontiguousarray(targets, dtype=np.float32)
    cdef Session s = Session(backend, threads, tokens=max(predictions.shape[0], 1))
    cdef double* loss = <double*>s.put(np.full(1, np.nan))
    cdef void* gradient = s.put(np.full(predictions.shape, np.nan, np.float32), ACT)
    s.check(s.backend.patch_loss(s.context, loss, gradient, s.put(predictions, ACT), <float*>s.put(targets),
                                 predictions.shape[0], predictions.shape[1], scale))
    return s.get_double(<size_t>loss), s.get(<size_t>gradient, predictions.shape, ACT)


def choices(logits, offered, targets=None, float scale=1.0, int threads=2, backend="ram"):
    """Returns (loss, d_logits, probabilities) for logits (rows, 256) and, per row, the offered bytes
    (a bytes object each) and their targets (float32 arrays, or None for probabilities alone);
    d_logits starts NaN, so a row the operation leaves unwritten shows."""
    offsets = np.concatenate([[0], np.cumsum([len(b) for b in offered])]).astype(np.uint32)
    data = np.frombuffer(b"".join(offered) or b"\0", dtype=np.uint8)
    cdef size_t count = len(offered)
    cdef Session s = Session(backend, threads)
    cdef double* loss = <double*>s.put(np.full(1, np.nan))
    cdef void* gradient = s.put(np.full(logits.shape, np.nan, np.float32), ACT)
    total = int(offsets.sum() and offsets.max())  # the last offset: the bytes offered in all
    cdef float* probabilities = <float*>s.put(np.full(max(total, 1), np.nan, np.float32))
    cdef float* aimed = NULL
    if targets is not None:
        aimed = <float*>s.put(np.concatenate([np.asarray(t, np.float32) for t in targets] + [np.zeros(1, np.float32)]))
    s.check(s.backend.choices(s.context, loss, gradient, probabilities, s.put(logits, ACT), <uint32_t*>s.put(offsets),
                              <uint8_t*>s.put(data), aimed, count, scale))
    flat = s.get(<size_t>probabilities, (max(total, 1),))
    split = [flat[offsets[i]:offsets[i + 1]] for i in range(count)]
    if targets is None:
        return None, None, split
    return s.get_double(<size_t>loss), s.get(<size_t>gradient, logits.shape, ACT), split


def normalize_rows(x, int threads=2, backend="ram"):
    """Each row of x (activations) over its norm, float32."""
    cdef Session s = Session(backend, threads)
    cdef float* out = <float*>s.take(max(x.size, 1) * 4)
    s.check(s.backend.normalize_rows(s.context, out, s.put(x, ACT), x.shape[0], x.shape[1]))
    return s.get(<size_t>out, x.shape)


def normalize_rows_backward(d_out, out, x, int threads=2, backend="ram"):
    """The adjoint of `normalize_rows` at x (out its result): d_x, activations."""
    cdef Session s = Session(backend, threads)
    cdef void* d_in = s.put(np.full(x.shape, np.nan, np.float32), ACT)
    s.check(s.backend.normalize_rows_backward(s.context, d_in, <float*>s.put(d_out), <float*>s.put(out),
                                              s.put(x, ACT), x.shape[0], x.shape[1]))
    return s.get(<size_t>d_in, x.shape, ACT)


def late_interaction(vectors, spans, rows, float log_inverse_temperature=0.0, float bias=0.0, form="ranked",
                     float scale=1.0, int threads=2, backend="ram"):
    """Returns (loss, d_vectors, d_log_inverse_temperature, d_bias) for float32 unit `vectors`,
    `spans` [(start, length)] of scored items, and `rows` [(query span, [(document span, cell, weight)])]
    with cell 1 attract, 2 repel."""
    cdef Session s = Session(backend, threads, segments=max(len(spans), len(rows)),
                             pairs=sum(len(named) for _, named in rows),
                             query_span=max([spans[query][1] for query, _ in rows] or [0]))
    offsets = np.concatenate([[0], np.cumsum([len(named) for _, named in rows])]).astype(np.uint32)
    named = [entry for _, entries in rows for entry in entries] or [(0, 0, 0.0)]
    cdef uform_late_interaction_setup_t setup
    setup.spans = <uform_span_t*>s.put(np.asarray(spans, np.uint32).reshape(-1, 2))
    setup.queries = <uint32_t*>s.put(np.asarray([query for query, _ in rows] or [0], np.uint32))
    setup.offsets = <uint32_t*>s.put(offsets)
    setup.documents = <uint32_t*>s.put(np.asarray([d for d, _, _ in named], np.uint32))
    setup.cells = <uint8_t*>s.put(np.asarray([c for _, c, _ in named], np.uint8))
    setup.weights = <float*>s.put(np.asarray([w for _, _, w in named], np.float32))
    setup.count, setup.pairs, setup.form = len(rows), int(offsets.max()), PAIR_LOSS_FORMS[form]
    cdef double* loss = <double*>s.put(np.full(1, np.nan))
    cdef float* d_vectors = <float*>s.put(np.full(vectors.shape, np.nan, np.float32))
    cdef float* d_log_t = <float*>s.put(np.zeros(1, np.float32))
    cdef float* d_bias = <float*>s.put(np.zeros(1, np.float32))
    s.check(s.backend.late_interaction(s.context, loss, d_vectors, d_log_t, d_bias, <float*>s.put(vectors),
                                       vectors.shape[0], vectors.shape[1],
                                       <float*>s.put(np.full(1, log_inverse_temperature, np.float32)),
                                       <float*>s.put(np.full(1, bias, np.float32)), &setup, scale))
    return (s.get_double(<size_t>loss), s.get(<size_t>d_vectors, vectors.shape), s.get(<size_t>d_log_t, (1,))[0],
            s.get(<size_t>d_bias, (1,))[0])


def contrastive(pooled, log_inverse_temperature, bias, cells, weights, groups, dimensions, form, float scale=1.0,
                d_pooled=None, d_log_inverse_temperature=None, d_bias=None, int threads=2, backend="ram"):
    """Returns (loss, d_pooled, d_log_inverse_temperature, d_bias, normalized).

    `cells` and `weights` are (items, items); `groups` (items) or None; `form` one of
    PAIR_LOSS_FORMS' names; gradients accumulate into copies of the given ones (zeros by default).
    """
    pooled = np.ascontiguousarray(pooled, dtype=np.float32)
    log_inverse_temperature = np.ascontiguousarray(log_inverse_temperature, dtype=np.float32)
    bias = np.ascontiguousarray(bias, dtype=np.float32)
    cells, weights = np.ascontiguousarray(cells, dtype=np.uint8), np.ascontiguousarray(weights, dtype=np.float32)
    cdef size_t items = pooled.shape[0], hidden = pooled.shape[1]
    if cells.shape != (items, items) or weights.shape != (items, items):
        raise ValueError("cells and weights must be (items, items)")
    if len(dimensions) > UFORM_MAX_MATRYOSHKA_DIMENSIONS:
        raise ValueError("too many dimensions")
    d_pooled = np.zeros_like(pooled) if d_pooled is None else d_pooled
    d_log_inverse_temperature = (np.zeros_like(log_inverse_temperature) if d_log_inverse_temperature is None
                                 else d_log_inverse_temperature)
    d_bias = np.zeros_like(bias) if d_bias is None else d_bias
    cdef uform_contrastive_setup_t setup
    setup.form = PAIR_LOSS_FORMS[form]
    setup.dimensions_count = len(dimensions)
    for index, dimension in enumerate(dimensions):
        setup.dimensions[index] = dimension
    cdef Session s = Session(backend, threads, segments=items, hidden=hidden, contrastive=True)
    cdef double* loss = <double*>s.put(np.full(1, np.nan))
    cdef float* d_pooled_pointer = <float*>s.put(d_pooled)
    cdef float* d_temperature = <float*>s.put(d_log_inverse_temperature)
    cdef float* d_bias_pointer = <float*>s.put(d_bias)
    cdef float* normalized = <float*>s.put(np.full_like(pooled, np.nan))
    cdef const uint32_t* groups_pointer = NULL if groups is None else <uint32_t*>s.put(np.asarray(groups, np.uint32))
    s.check(s.backend.contrastive(s.context, loss, d_pooled_pointer, d_temperature, d_bias_pointer, normalized,
                                  <float*>s.put(pooled), <float*>s.put(log_inverse_temperature), <float*>s.put(bias),
                                  <uint8_t*>s.put(cells), <float*>s.put(weights), groups_pointer, items, hidden,
                                  &setup, scale))
    return (s.get_double(<size_t>loss), s.get(<size_t>d_pooled_pointer, pooled.shape),
            s.get(<size_t>d_temperature, log_inverse_temperature.shape), s.get(<size_t>d_bias_pointer, bias.shape),
            s.get(<size_t>normalized, pooled.shape))


def sum_squares(x, int threads=2, backend="ram"):
    cdef Session s = Session(backend, threads)
    cdef double* total = <double*>s.put(np.full(1, np.nan))
    s.check(s.backend.sum_squares(s.context, total, <float*>s.put(x), x.size))
    return s.get_double(<size_t>total)


def adamw(weights, gradients, first, second, float learning_rate, float beta1, float beta2, float epsilon,
          float weight_decay, float gradient_scale, uint64_t step, losses=(1.0, float("nan")), int threads=2,
          backend="ram"):
    """Returns (weights, first, second, compute) after one update of copies of the given ones, as one decaying
    tensor whose gradients clipping scales by `gradient_scale` (<= 1). `compute` is the activation copy the
    backend refreshed, or None on float32 backends. `losses` (masked, contrastive) set the poisoning test:
    NaN marks a term that did not run."""
    cdef size_t count = weights.size
    cdef Session s = Session(backend, threads, parameters=count, decays=weight_decay != 0)
    scalars = np.zeros(uform_scalars_k)
    scalars[uform_scalar_masked_loss_k], scalars[uform_scalar_contrastive_loss_k] = losses
    scalars[uform_scalar_norm_squared_k] = 1.0 / gradient_scale ** 2 if gradient_scale < 1 else 0.25
    cdef uform_update_t update
    memset(&update, 0, sizeof(update))
    update.weights = <float*>s.put(weights)
    update.compute = s.take(count * 2) if s.bf16 else NULL
    update.gradients = <float*>s.put(gradients)
    update.first, update.second = <float*>s.put(first), <float*>s.put(second)
    update.scalars = <double*>s.put(scalars)
    update.learning_rate, update.beta1, update.beta2, update.epsilon = learning_rate, beta1, beta2, epsilon
    update.weight_decay, update.clip_norm, update.terms.text_weight = weight_decay, 1.0, 1.0
    update.terms.masked_ran, update.terms.contrastive_ran = not np.isnan(losses[0]), not np.isnan(losses[1])
    update.step = step
    s.check(s.backend.adamw(s.context, &update))
    compute = None if update.compute == NULL else s.get(<size_t>update.compute, weights.shape, ACT)
    return (s.get(<size_t>update.weights, weights.shape), s.get(<size_t>update.first, weights.shape),
            s.get(<size_t>update.second, weights.shape), compute)


# ---------------------------------------------------------------------------------------------- #
#  Media                                                                                          #
# ---------------------------------------------------------------------------------------------- #

cdef extern from "media/media.h" nogil:
    ctypedef struct uform_media_grid_t:
        uint32_t frames, rows, columns
        int truncated

    const char* uform_media_formats()
    uform_status_t uform_image_patches(const uint8_t*, size_t, uint32_t, uint32_t, size_t, float*,
                                       uform_media_grid_t*, const char*, const char**)
    uform_status_t uform_video_tubelets(const uint8_t*, size_t, uint32_t, uint32_t, uint32_t, uint32_t, size_t,
                                        float*, uform_media_grid_t*, const char*, const char**)
    uform_status_t uform_audio_chunks(const uint8_t*, size_t, uint32_t, uint32_t, size_t, float*,
                                      uform_media_grid_t*, const char*, const char**)


def media_formats():
    """The formats this build decodes, as the library lists them: "jpeg,png,..."."""
    return uform_media_formats().decode()


cdef _media_result(uform_status_t status, const char* message, float[::1] out, size_t token_floats,
                   uform_media_grid_t grid, shape):
    """The tokens written, shaped (tokens, *shape), and the grid as a dict; a failure raises uform's error."""
    from uform.errors import Error, InvalidArgument, OutOfMemory, Unsupported
    if status != uform_status_success_k:
        text = message.decode() if message != NULL else f"status {<int>status} without a message"
        raise {1: InvalidArgument, 4: Unsupported, 5: OutOfMemory}.get(<int>status, Error)(text)
    tokens = <size_t>grid.frames * grid.rows * grid.columns
    array = np.asarray(out)[:tokens * token_floats].reshape((tokens,) + shape).copy()
    return array, dict(frames=grid.frames, rows=grid.rows, columns=grid.columns, truncated=bool(grid.truncated))


def image_patches(const uint8_t[::1] data, uint32_t patch_side=16, uint32_t channels=3, size_t max_tokens=256,
                  field="batch.contents[0]"):
    """(patches of shape (tokens, patch_side, patch_side, channels), grid) for an encoded image."""
    cdef size_t floats = <size_t>patch_side * patch_side * channels
    cdef float[::1] out = np.empty(max(max_tokens * floats, 1), dtype=np.float32)
    cdef uform_media_grid_t grid
    cdef const char* message = NULL
    cdef bytes name = field.encode()
    cdef const char* c_name = name
    cdef const uint8_t* bytes_ = &data[0] if data.shape[0] else NULL
    cdef size_t length = data.shape[0]
    with nogil:
        status = uform_image_patches(bytes_, length, patch_side, channels, max_tokens, &out[0], &grid, c_name,
                                     &message)
    return _media_result(status, message, out, floats, grid, (patch_side, patch_side, channels))


def video_tubelets(const uint8_t[::1] data, uint32_t patch_side=16, uint32_t tube_frames=2, uint32_t frame_stride=1,
                   uint32_t channels=3, size_t max_tokens=256, field="batch.contents[0]"):
    """(tubelets of shape (tokens, tube_frames, patch_side, patch_side, channels), grid) for an encoded video."""
    cdef size_t floats = <size_t>tube_frames * patch_side * patch_side * channels
    cdef float[::1] out = np.empty(max(max_tokens * floats, 1), dtype=np.float32)
    cdef uform_media_grid_t grid
    cdef const char* message = NULL
    cdef bytes name = field.encode()
    cdef const char* c_name = name
    cdef const uint8_t* bytes_ = &data[0] if data.shape[0] else NULL
    cdef size_t length = data.shape[0]
    with nogil:
        status = uform_video_tubelets(bytes_, length, patch_side, tube_frames, frame_stride, channels, max_tokens,
                                      &out[0], &grid, c_name, &message)
    return _media_result(status, message, out, floats, grid, (tube_frames, patch_side, patch_side, channels))


def audio_chunks(const uint8_t[::1] data, uint32_t sample_rate=16000, uint32_t chunk_samples=400,
                 size_t max_tokens=256, field="batch.contents[0]"):
    """(chunks of shape (tokens, chunk_samples), grid) for an encoded audio file."""
    cdef float[::1] out = np.empty(max(max_tokens * chunk_samples, 1), dtype=np.float32)
    cdef uform_media_grid_t grid
    cdef const char* message = NULL
    cdef bytes name = field.encode()
    cdef const char* c_name = name
    cdef const uint8_t* bytes_ = &data[0] if data.shape[0] else NULL
    cdef size_t length = data.shape[0]
    with nogil:
        status = uform_audio_chunks(bytes_, length, sample_rate, chunk_samples, max_tokens, &out[0], &grid, c_name,
                                    &message)
    return _media_result(status, message, out, chunk_samples, grid, (chunk_samples,))
