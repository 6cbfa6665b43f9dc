# cython: language_level=3
"""The CPU backend's operations, one by one, for the tests.

Each function takes numpy arrays (converted to C-contiguous float32, uint32 or uint8 as the
operation reads them), builds a `uform_ram_context_t` with `threads` threads, calls the operation
through `uform_ram_backend`'s table without the GIL and returns fresh arrays. Operations that
accumulate (`+=`) take the starting gradient as an argument and return the sum; none changes its
arguments.
"""
import numpy as np

from libc.stdint cimport uint8_t, uint32_t, uint64_t


cdef extern from "uform.h" nogil:
    ctypedef enum uform_pair_loss_form_t:
        uform_pair_loss_derived_k
        uform_pair_loss_balanced_k
        uform_pair_loss_ranked_k
        uform_pair_loss_sigmoid_k
    enum:
        UFORM_MAX_MATRYOSHKA_DIMENSIONS


cdef extern from "internal.h" nogil:
    ctypedef struct uform_segment_t:
        uint32_t start
        uint32_t length
        uint32_t row
        uint32_t column

    ctypedef struct uform_contrastive_setup_t:
        uform_pair_loss_form_t form
        size_t dimensions_count
        uint32_t dimensions[UFORM_MAX_MATRYOSHKA_DIMENSIONS]

    ctypedef struct uform_ram_context_t:
        int threads

    ctypedef struct uform_backend_t:
        const char* name
        void* (*allocate)(void*, size_t) noexcept nogil
        void (*release)(void*, void*) noexcept nogil
        void (*upload)(void*, void*, const void*, size_t) noexcept nogil
        void (*download)(void*, void*, const void*, size_t) noexcept nogil
        void (*zero)(void*, void*, size_t) noexcept nogil
        void (*matmul)(void*, float*, const float*, const float*, size_t, size_t, size_t, int, int,
                       float) noexcept nogil
        void (*embedding_forward)(void*, float*, const float*, const uint32_t*, size_t, size_t) noexcept nogil
        void (*embedding_backward)(void*, float*, const float*, const uint32_t*, size_t, size_t,
                                   size_t) noexcept nogil
        void (*rmsnorm_forward)(void*, float*, float*, const float*, const float*, size_t, size_t) noexcept nogil
        void (*rmsnorm_backward)(void*, float*, float*, const float*, const float*, const float*, const float*,
                                 size_t, size_t) noexcept nogil
        void (*rope_forward)(void*, float*, const uint32_t*, size_t, size_t) noexcept nogil
        void (*rope_backward)(void*, float*, const uint32_t*, size_t, size_t) noexcept nogil
        void (*attention_forward)(void*, float*, float*, const float*, const uform_segment_t*, size_t, size_t,
                                  size_t) noexcept nogil
        void (*attention_backward)(void*, float*, const float*, const float*, const float*, const float*,
                                   const uform_segment_t*, size_t, size_t, size_t) noexcept nogil
        void (*gelu_forward)(void*, float*, const float*, size_t) noexcept nogil
        void (*gelu_backward)(void*, float*, const float*, const float*, size_t) noexcept nogil
        void (*gather_rows)(void*, float*, const float*, const uint32_t*, size_t, size_t) noexcept nogil
        void (*scatter_rows)(void*, float*, const float*, const uint32_t*, size_t, size_t) noexcept nogil
        double (*cross_entropy)(void*, float*, const float*, const uint32_t*, size_t, size_t,
                                float) noexcept nogil
        void (*pool_forward)(void*, float*, const float*, const uform_segment_t*, size_t, size_t) noexcept nogil
        void (*pool_backward)(void*, float*, const float*, const uform_segment_t*, size_t, size_t) noexcept nogil
        double (*contrastive)(void*, float*, float*, float*, float*, const float*, const float*, const float*,
                              const uint8_t*, const float*, const uint32_t*, size_t, size_t,
                              const uform_contrastive_setup_t*, float) noexcept nogil
        double (*sum_squares)(void*, const float*, size_t) noexcept nogil
        void (*adamw)(void*, float*, const float*, float*, float*, size_t, float, float, float, float, float, float,
                      uint64_t) noexcept nogil

    const uform_backend_t uform_ram_backend


PAIR_LOSS_FORMS = {
    "balanced": uform_pair_loss_balanced_k,
    "ranked": uform_pair_loss_ranked_k,
    "sigmoid": uform_pair_loss_sigmoid_k,
}


# Pointers into arrays the caller keeps alive; NULL for empty ones, which no operation reads.

cdef float* _floats(object array):
    cdef float[::1] view = array.reshape(-1)
    return &view[0] if view.shape[0] else NULL


cdef const float* _const_floats(object array):
    cdef const float[::1] view = array.reshape(-1)
    return &view[0] if view.shape[0] else NULL


cdef const uint32_t* _indices(object array):
    cdef const uint32_t[::1] view = array.reshape(-1)
    return &view[0] if view.shape[0] else NULL


cdef const uint8_t* _bytes(object array):
    cdef const uint8_t[::1] view = array.reshape(-1)
    return &view[0] if view.shape[0] else NULL


def _f32(array):
    return np.ascontiguousarray(array, dtype=np.float32)


def _u32(array):
    return np.ascontiguousarray(array, dtype=np.uint32)


def _copy(array):
    return np.array(array, dtype=np.float32, order="C", copy=True)


def _segments(segments):
    """(start, length) pairs as the (count, 4) uint32 layout of `uform_segment_t`."""
    pairs = np.asarray(segments, dtype=np.int64).reshape(-1, 2)
    table = np.zeros((len(pairs), 4), dtype=np.uint32)
    table[:, :2] = pairs
    return table


cdef uform_ram_context_t _context(int threads):
    cdef uform_ram_context_t context
    context.threads = threads
    return context


def backend_name():
    return uform_ram_backend.name.decode()


def memory_roundtrip(data, int threads=2):
    """Allocates len(data) bytes and returns what it read: fresh, after an upload, after zeroing."""
    source = np.ascontiguousarray(np.frombuffer(bytes(data), dtype=np.uint8))
    cdef size_t size = source.size
    fresh, uploaded, zeroed = (np.full(size, 0xAB, dtype=np.uint8) for _ in range(3))
    cdef uform_ram_context_t context = _context(threads)
    cdef void* memory = uform_ram_backend.allocate(&context, size)
    if memory == NULL:
        raise MemoryError(size)
    cdef const uint8_t* source_pointer = _bytes(source)
    cdef uint8_t[::1] fresh_view = fresh, uploaded_view = uploaded, zeroed_view = zeroed
    if size:
        uform_ram_backend.download(&context, &fresh_view[0], memory, size)
        uform_ram_backend.upload(&context, memory, source_pointer, size)
        uform_ram_backend.download(&context, &uploaded_view[0], memory, size)
        uform_ram_backend.zero(&context, memory, size)
        uform_ram_backend.download(&context, &zeroed_view[0], memory, size)
    uform_ram_backend.release(&context, memory)
    return fresh, uploaded, zeroed


def matmul(a, b, c=None, bint a_transposed=False, bint b_transposed=False, float beta=0.0, int threads=2):
    """c (m, n) = a x b + beta c; `a` is stored (k, m) when transposed, `b` (n, k)."""
    a, b = _f32(a), _f32(b)
    cdef size_t m = a.shape[1] if a_transposed else a.shape[0]
    cdef size_t k = a.shape[0] if a_transposed else a.shape[1]
    cdef size_t n = b.shape[0] if b_transposed else b.shape[1]
    if (b.shape[1] if b_transposed else b.shape[0]) != k:
        raise ValueError(f"inner dimensions differ: a gives {k}, b gives {b.shape}")
    c = np.zeros((m, n), dtype=np.float32) if c is None else _copy(c)
    if c.shape != (m, n):
        raise ValueError(f"c is {c.shape}, expected {(m, n)}")
    cdef uform_ram_context_t context = _context(threads)
    cdef float* c_pointer = _floats(c)
    cdef const float* a_pointer = _const_floats(a)
    cdef const float* b_pointer = _const_floats(b)
    with nogil:
        uform_ram_backend.matmul(&context, c_pointer, a_pointer, b_pointer, m, n, k, a_transposed, b_transposed, beta)
    return c


def embedding_forward(table, ids, int threads=2):
    table, ids = _f32(table), _u32(ids)
    out = np.empty((ids.size, table.shape[1]), dtype=np.float32)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* out_pointer = _floats(out)
    cdef const float* table_pointer = _const_floats(table)
    cdef const uint32_t* ids_pointer = _indices(ids)
    cdef size_t tokens = ids.size, hidden = table.shape[1]
    with nogil:
        uform_ram_backend.embedding_forward(&context, out_pointer, table_pointer, ids_pointer, tokens, hidden)
    return out


def embedding_backward(d_table, d_out, ids, int threads=2):
    d_table, d_out, ids = _copy(d_table), _f32(d_out), _u32(ids)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* d_table_pointer = _floats(d_table)
    cdef const float* d_out_pointer = _const_floats(d_out)
    cdef const uint32_t* ids_pointer = _indices(ids)
    cdef size_t tokens = ids.size, hidden = d_table.shape[1], vocabulary = d_table.shape[0]
    with nogil:
        uform_ram_backend.embedding_backward(&context, d_table_pointer, d_out_pointer, ids_pointer, tokens, hidden,
                                             vocabulary)
    return d_table


def rmsnorm_forward(x, gain, int threads=2):
    """Returns (out, rstd)."""
    x, gain = _f32(x), _f32(gain)
    out = np.empty_like(x)
    rstd = np.empty(x.shape[0], dtype=np.float32)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* out_pointer = _floats(out)
    cdef float* rstd_pointer = _floats(rstd)
    cdef const float* x_pointer = _const_floats(x)
    cdef const float* gain_pointer = _const_floats(gain)
    cdef size_t tokens = x.shape[0], hidden = x.shape[1]
    with nogil:
        uform_ram_backend.rmsnorm_forward(&context, out_pointer, rstd_pointer, x_pointer, gain_pointer, tokens, hidden)
    return out, rstd


def rmsnorm_backward(d_x, d_gain, d_out, x, gain, rstd, int threads=2):
    """Returns (d_x, d_gain) after accumulating into copies of the given ones."""
    d_x, d_gain = _copy(d_x), _copy(d_gain)
    d_out, x, gain, rstd = _f32(d_out), _f32(x), _f32(gain), _f32(rstd)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* d_x_pointer = _floats(d_x)
    cdef float* d_gain_pointer = _floats(d_gain)
    cdef const float* d_out_pointer = _const_floats(d_out)
    cdef const float* x_pointer = _const_floats(x)
    cdef const float* gain_pointer = _const_floats(gain)
    cdef const float* rstd_pointer = _const_floats(rstd)
    cdef size_t tokens = x.shape[0], hidden = x.shape[1]
    with nogil:
        uform_ram_backend.rmsnorm_backward(&context, d_x_pointer, d_gain_pointer, d_out_pointer, x_pointer,
                                           gain_pointer, rstd_pointer, tokens, hidden)
    return d_x, d_gain


def rope_forward(qkv, positions, int threads=2):
    qkv, positions = _copy(qkv), _u32(positions)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* qkv_pointer = _floats(qkv)
    cdef const uint32_t* positions_pointer = _indices(positions)
    cdef size_t tokens = qkv.shape[0], hidden = qkv.shape[1] // 3
    with nogil:
        uform_ram_backend.rope_forward(&context, qkv_pointer, positions_pointer, tokens, hidden)
    return qkv


def rope_backward(d_qkv, positions, int threads=2):
    d_qkv, positions = _copy(d_qkv), _u32(positions)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* d_qkv_pointer = _floats(d_qkv)
    cdef const uint32_t* positions_pointer = _indices(positions)
    cdef size_t tokens = d_qkv.shape[0], hidden = d_qkv.shape[1] // 3
    with nogil:
        uform_ram_backend.rope_backward(&context, d_qkv_pointer, positions_pointer, tokens, hidden)
    return d_qkv


def attention_forward(qkv, segments, out=None, lse=None, int threads=2):
    """Returns (out, lse); rows no segment covers keep the given `out` and `lse` (zeros by default)."""
    qkv = _f32(qkv)
    table = _segments(segments)
    cdef size_t tokens = qkv.shape[0], hidden = qkv.shape[1] // 3, heads = hidden // 64
    out = np.zeros((tokens, hidden), dtype=np.float32) if out is None else _copy(out)
    lse = np.zeros((heads, tokens), dtype=np.float32) if lse is None else _copy(lse)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* out_pointer = _floats(out)
    cdef float* lse_pointer = _floats(lse)
    cdef const float* qkv_pointer = _const_floats(qkv)
    cdef const uform_segment_t* segments_pointer = <const uform_segment_t*>_indices(table)
    cdef size_t count = len(table)
    with nogil:
        uform_ram_backend.attention_forward(&context, out_pointer, lse_pointer, qkv_pointer, segments_pointer, count,
                                            tokens, hidden)
    return out, lse


def attention_backward(d_out, out, lse, qkv, segments, int threads=2):
    """Returns d_qkv, which the operation writes whole (NaN-filled before, to prove it)."""
    d_out, out, lse, qkv = _f32(d_out), _f32(out), _f32(lse), _f32(qkv)
    table = _segments(segments)
    d_qkv = np.full(qkv.shape, np.nan, dtype=np.float32)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* d_qkv_pointer = _floats(d_qkv)
    cdef const float* d_out_pointer = _const_floats(d_out)
    cdef const float* out_pointer = _const_floats(out)
    cdef const float* lse_pointer = _const_floats(lse)
    cdef const float* qkv_pointer = _const_floats(qkv)
    cdef const uform_segment_t* segments_pointer = <const uform_segment_t*>_indices(table)
    cdef size_t count = len(table), tokens = qkv.shape[0], hidden = qkv.shape[1] // 3
    with nogil:
        uform_ram_backend.attention_backward(&context, d_qkv_pointer, d_out_pointer, out_pointer, lse_pointer,
                                             qkv_pointer, segments_pointer, count, tokens, hidden)
    return d_qkv


def gelu_forward(x, int threads=2):
    x = _f32(x)
    out = np.empty_like(x)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* out_pointer = _floats(out)
    cdef const float* x_pointer = _const_floats(x)
    cdef size_t count = x.size
    with nogil:
        uform_ram_backend.gelu_forward(&context, out_pointer, x_pointer, count)
    return out


def gelu_backward(d_out, x, bint in_place=False, int threads=2):
    """Returns d_in, written whole; `in_place` passes one buffer as d_out and d_in, as the core does."""
    d_out, x = _f32(d_out), _f32(x)
    d_in = _copy(d_out) if in_place else np.full_like(x, np.nan)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* d_in_pointer = _floats(d_in)
    cdef const float* d_out_pointer = _const_floats(d_in if in_place else d_out)
    cdef const float* x_pointer = _const_floats(x)
    cdef size_t count = x.size
    with nogil:
        uform_ram_backend.gelu_backward(&context, d_in_pointer, d_out_pointer, x_pointer, count)
    return d_in


def gather_rows(x, rows, int threads=2):
    x, rows = _f32(x), _u32(rows)
    out = np.empty((rows.size, x.shape[1]), dtype=np.float32)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* out_pointer = _floats(out)
    cdef const float* x_pointer = _const_floats(x)
    cdef const uint32_t* rows_pointer = _indices(rows)
    cdef size_t count = rows.size, width = x.shape[1]
    with nogil:
        uform_ram_backend.gather_rows(&context, out_pointer, x_pointer, rows_pointer, count, width)
    return out


def scatter_rows(d_in, d_out, rows, int threads=2):
    d_in, d_out, rows = _copy(d_in), _f32(d_out), _u32(rows)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* d_in_pointer = _floats(d_in)
    cdef const float* d_out_pointer = _const_floats(d_out)
    cdef const uint32_t* rows_pointer = _indices(rows)
    cdef size_t count = rows.size, width = d_in.shape[1]
    with nogil:
        uform_ram_backend.scatter_rows(&context, d_in_pointer, d_out_pointer, rows_pointer, count, width)
    return d_in


def pool_forward(states, segments, int threads=2):
    states = _f32(states)
    table = _segments(segments)
    pooled = np.full((len(table), states.shape[1]), np.nan, dtype=np.float32)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* pooled_pointer = _floats(pooled)
    cdef const float* states_pointer = _const_floats(states)
    cdef const uform_segment_t* segments_pointer = <const uform_segment_t*>_indices(table)
    cdef size_t count = len(table), hidden = states.shape[1]
    with nogil:
        uform_ram_backend.pool_forward(&context, pooled_pointer, states_pointer, segments_pointer, count, hidden)
    return pooled


def pool_backward(d_states, d_pooled, segments, int threads=2):
    d_states, d_pooled = _copy(d_states), _f32(d_pooled)
    table = _segments(segments)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* d_states_pointer = _floats(d_states)
    cdef const float* d_pooled_pointer = _const_floats(d_pooled)
    cdef const uform_segment_t* segments_pointer = <const uform_segment_t*>_indices(table)
    cdef size_t count = len(table), hidden = d_states.shape[1]
    with nogil:
        uform_ram_backend.pool_backward(&context, d_states_pointer, d_pooled_pointer, segments_pointer, count, hidden)
    return d_states


def cross_entropy(logits, targets, float scale=1.0, d_logits=None, int threads=2):
    """Returns (loss, d_logits); `d_logits` starts from the given array (NaN by default)."""
    logits, targets = _f32(logits), _u32(targets)
    d_logits = np.full(logits.shape, np.nan, dtype=np.float32) if d_logits is None else _copy(d_logits)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* d_logits_pointer = _floats(d_logits)
    cdef const float* logits_pointer = _const_floats(logits)
    cdef const uint32_t* targets_pointer = _indices(targets)
    cdef size_t count = targets.size, classes = logits.shape[1]
    cdef double loss
    with nogil:
        loss = uform_ram_backend.cross_entropy(&context, d_logits_pointer, logits_pointer, targets_pointer, count,
                                               classes, scale)
    return loss, d_logits


def contrastive(pooled, log_inverse_temperature, bias, cells, weights, groups, dimensions, form, float scale=1.0,
                d_pooled=None, d_log_inverse_temperature=None, d_bias=None, int threads=2):
    """Returns (loss, d_pooled, d_log_inverse_temperature, d_bias, normalized).

    `cells` and `weights` are (items, items); `groups` (items) or None; `form` one of
    PAIR_LOSS_FORMS' names; gradients accumulate into copies of the given ones (zeros by default).
    """
    pooled, log_inverse_temperature, bias = _f32(pooled), _f32(log_inverse_temperature), _f32(bias)
    cells, weights = np.ascontiguousarray(cells, dtype=np.uint8), _f32(weights)
    groups = None if groups is None else _u32(groups)
    cdef size_t items = pooled.shape[0], hidden = pooled.shape[1]
    if cells.shape != (items, items) or weights.shape != (items, items):
        raise ValueError("cells and weights must be (items, items)")
    if len(dimensions) > UFORM_MAX_MATRYOSHKA_DIMENSIONS:
        raise ValueError("too many dimensions")
    d_pooled = np.zeros_like(pooled) if d_pooled is None else _copy(d_pooled)
    d_log_inverse_temperature = (np.zeros_like(log_inverse_temperature) if d_log_inverse_temperature is None
                                 else _copy(d_log_inverse_temperature))
    d_bias = np.zeros_like(bias) if d_bias is None else _copy(d_bias)
    normalized = np.full_like(pooled, np.nan)
    cdef uform_contrastive_setup_t setup
    setup.form = PAIR_LOSS_FORMS[form]
    setup.dimensions_count = len(dimensions)
    for index, dimension in enumerate(dimensions):
        setup.dimensions[index] = dimension
    cdef uform_ram_context_t context = _context(threads)
    cdef float* d_pooled_pointer = _floats(d_pooled)
    cdef float* d_temperature_pointer = _floats(d_log_inverse_temperature)
    cdef float* d_bias_pointer = _floats(d_bias)
    cdef float* normalized_pointer = _floats(normalized)
    cdef const float* pooled_pointer = _const_floats(pooled)
    cdef const float* temperature_pointer = _const_floats(log_inverse_temperature)
    cdef const float* bias_pointer = _const_floats(bias)
    cdef const uint8_t* cells_pointer = _bytes(cells)
    cdef const float* weights_pointer = _const_floats(weights)
    cdef const uint32_t* groups_pointer = NULL
    if groups is not None:
        groups_pointer = _indices(groups)
    cdef double loss
    with nogil:
        loss = uform_ram_backend.contrastive(&context, d_pooled_pointer, d_temperature_pointer, d_bias_pointer,
                                             normalized_pointer, pooled_pointer, temperature_pointer, bias_pointer,
                                             cells_pointer, weights_pointer, groups_pointer, items, hidden, &setup,
                                             scale)
    return loss, d_pooled, d_log_inverse_temperature, d_bias, normalized


def sum_squares(x, int threads=2):
    x = _f32(x)
    cdef uform_ram_context_t context = _context(threads)
    cdef const float* x_pointer = _const_floats(x)
    cdef size_t count = x.size
    cdef double total
    with nogil:
        total = uform_ram_backend.sum_squares(&context, x_pointer, count)
    return total


def adamw(weights, gradients, first, second, float learning_rate, float beta1, float beta2, float epsilon,
          float weight_decay, float gradient_scale, uint64_t step, int threads=2):
    """Returns (weights, first, second) after one update of copies of the given ones."""
    weights, first, second, gradients = _copy(weights), _copy(first), _copy(second), _f32(gradients)
    cdef uform_ram_context_t context = _context(threads)
    cdef float* weights_pointer = _floats(weights)
    cdef float* first_pointer = _floats(first)
    cdef float* second_pointer = _floats(second)
    cdef const float* gradients_pointer = _const_floats(gradients)
    cdef size_t count = weights.size
    with nogil:
        uform_ram_backend.adamw(&context, weights_pointer, gradients_pointer, first_pointer, second_pointer, count,
                                learning_rate, beta1, beta2, epsilon, weight_decay, gradient_scale, step)
    return weights, first, second
