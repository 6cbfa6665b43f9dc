/**
 *  @file   vram.h
 *  @brief  The CUDA backend's shared pieces: its context, its scratch, error checks, bfloat16.
 *
 *  One file per operation, as in `ram/`, each with its kernels and their host launcher side by
 *  side. Launchers enqueue on the context's stream and return at once; a kernel's failure at
 *  launch is reported by the launcher (`uform_vram_launched`), one during execution by the next
 *  `synchronize`. Activations are `__nv_bfloat16`; arithmetic is float32, reductions that the
 *  core reads are double. No kernel uses atomics on floats, so every result is the same bits run
 *  after run: each sum is split into fixed pieces and the pieces are added in a fixed order.
 */
#ifndef UFORM_VRAM_H_
#define UFORM_VRAM_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <utility>

#include "backend.h"

typedef __nv_bfloat16 uform_bf16_t;

/** The core's message formatter, handed over when the plug-in is loaded. */
extern uform_fail_t uform_vram_fail;

/** Scratch the context plans once, one region per operation that needs one. */
typedef enum uform_vram_scratch_t {
    uform_vram_scratch_blas_k = 0,        /* cuBLASLt's workspace */
    uform_vram_scratch_attention_k,       /* the own attention's unit counter, each query's delta, the rotary table */
    uform_vram_scratch_rmsnorm_k,         /* partial sums of the gain's gradient */
    uform_vram_scratch_reduce_k,          /* partial sums of losses and of the squared norm */
    uform_vram_scratch_contrastive_k,     /* the contrastive term's rows, in double */
    uform_vram_scratch_adamw_k,           /* the layout's tensors, as AdamW walks them */
    uform_vram_scratch_late_k,            /* late interaction's scores, their gradients and each query row's nearest rows */
    uform_vram_scratch_count_k,
} uform_vram_scratch_t;

typedef struct uform_vram_device_t {
    int ordinal;
    int multiprocessors;
    char name[256];
} uform_vram_device_t;

typedef struct uform_vram_context_t {
    int ordinal, multiprocessors;
    cudaStream_t stream;
    cudaEvent_t fences[uform_fences_k];
    void* blas;      /* cublasLtHandle_t */
    void* matmuls;   /* matmul.cu's cache of planned products */
    void* attention; /* attention.cu's handle and cache of planned graphs */
    uform_plan_t plan;
    void* scratch[uform_vram_scratch_count_k];
    size_t scratch_bytes[uform_vram_scratch_count_k];
    bool attention_turns; /* the own attention forward's warpgroups take turns (`UFORM_ATTENTION_TURNS=0`: not) */
} uform_vram_context_t;

/* Every operation file says how much scratch it plans for; backend.cu takes it all at once. */
size_t uform_vram_blas_scratch(uform_plan_t const* plan);
size_t uform_vram_attention_scratch(uform_plan_t const* plan);
size_t uform_vram_rmsnorm_scratch(uform_plan_t const* plan);
size_t uform_vram_reduce_scratch(uform_plan_t const* plan);
size_t uform_vram_contrastive_scratch(uform_plan_t const* plan);
size_t uform_vram_adamw_scratch(uform_plan_t const* plan);
size_t uform_vram_late_interaction_scratch(uform_plan_t const* plan);

/* Handles some files keep in the context beside their scratch. */
uform_status_t uform_vram_matmul_open(uform_vram_context_t* context);
void uform_vram_matmul_close(uform_vram_context_t* context);
uform_status_t uform_vram_attention_open(uform_vram_context_t* context);
/** Whether a step's attention can be recorded as part of a graph: the own kernels can; cuDNN's plans its graphs and
 *  sizes its workspace (a synchronize and an allocation) on first meeting a shape of items, which a recording refuses. */
/** Lays out `items` for cuDNN: lengths (count), and offsets (count + 1) of their qkv and output rows. */
uform_status_t uform_vram_attention_items(uform_vram_context_t* context, int32_t* lengths, int64_t* ragged_qkv,
                                         int64_t* ragged_o, uform_items_t const* items, size_t hidden);
void uform_vram_attention_close(uform_vram_context_t* context);
/** The library's own attention (`attention_hopper.cuh`), in place of cuDNN's on Hopper unless `UFORM_HOPPER_ATTENTION=0`
 *  says no: the tensor-map encoder it launches with, or NULL where it does not run (another GPU, told not to). Its
 *  statistics are each query's log-sum-exp, (heads, tokens); its backward pass takes (heads, tokens) floats of the
 *  attention's scratch, then the tokens' rotary cosines and sines, which it fills there. */
void* uform_vram_hopper_attention(uform_vram_context_t* context);
uform_status_t uform_vram_hopper_attention_forward(uform_vram_context_t* context, void* encoder, void* out,
                                                   float* statistics, void const* qkv, uform_items_t const* items,
                                                   size_t tokens, size_t hidden);
uform_status_t uform_vram_hopper_attention_backward(uform_vram_context_t* context, void* encoder, void* d_qkv,
                                                    void const* d_out, void const* out, float const* statistics,
                                                    void const* qkv, uint32_t const* positions, int same_positions,
                                                    uform_items_t const* items, size_t tokens, size_t hidden);
/** turns (tokens, 32): each token's rotary cosines and sines, as `rope.cu` rounds them. */
uform_status_t uform_vram_rope_turns(uform_vram_context_t* context, float2* turns, uint32_t const* positions,
                                     size_t tokens);
/** Fills the AdamW scratch with the plan's layout: once, at context creation. */
uform_status_t uform_vram_adamw_plan(uform_vram_context_t* context);

/** A CUDA call's error as a status naming the call. */
static inline uform_status_t uform_vram_check(cudaError_t error, char const* call) {
    if (error == cudaSuccess) return uform_status_success_k;
    (void)cudaGetLastError(); /* clear a sticky launch error so the next call starts clean */
    uform_status_t status = error == cudaErrorMemoryAllocation ? uform_status_out_of_memory_k : uform_status_device_k;
    return uform_vram_fail(NULL, status, "%s: %s (%s)", call, cudaGetErrorString(error), cudaGetErrorName(error));
}

/** After a launch: whether the kernel was accepted. */
static inline uform_status_t uform_vram_launched(char const* kernel) { return uform_vram_check(cudaGetLastError(), kernel); }

static inline uform_vram_context_t* uform_vram(void* context) { return (uform_vram_context_t*)context; }

#if defined(__CUDACC__)
/** Eight bf16 values of one 16-byte load as floats, and back, rounding to nearest even. */
__device__ __forceinline__ void uform_vram_unpack8(uint4 bits, float (&values)[8]) {
    __nv_bfloat162 const* pairs = reinterpret_cast<__nv_bfloat162 const*>(&bits);
#pragma unroll
    for (int k = 0; k != 4; ++k) {
        float2 pair = __bfloat1622float2(pairs[k]);
        values[2 * k] = pair.x, values[2 * k + 1] = pair.y;
    }
}

__device__ __forceinline__ uint4 uform_vram_pack8(float const (&values)[8]) {
    uint4 bits;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&bits);
#pragma unroll
    for (int k = 0; k != 4; ++k) pairs[k] = __floats2bfloat162_rn(values[2 * k], values[2 * k + 1]);
    return bits;
}
#endif

/** Whether kernels launch as the one before them drains (below); `UFORM_DEPENDENT_LAUNCHES=0` turns it off, to
 *  compare. Read once, when the first device opens. */
extern bool uform_vram_dependent_launches;

#if defined(__CUDACC__)
/** The first statement of every kernel of the library. A kernel launched by `uform_vram_launch` may start while the
 *  kernel before it in the stream still runs (Hopper's programmatic dependent launch): this waits until that one has
 *  finished and its writes are visible, then lets the kernel after this one be scheduled in turn, so each launch's
 *  latency hides behind the tail of the kernel before it. Elsewhere it returns at once. */
__device__ __forceinline__ void uform_vram_chain() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/** `kernel<<<grid, block, shared, stream>>>(arguments...)`, allowed to start before the kernel ahead of it ends;
 *  `kernel` must begin with `uform_vram_chain()`. Errors are read as after `<<<>>>`, by `uform_vram_launched`. */
template <typename... Parameters, typename... Arguments>
static inline void uform_vram_launch(void (*kernel)(Parameters...), dim3 grid, dim3 block, size_t shared,
                                     cudaStream_t stream, Arguments&&... arguments) {
    cudaLaunchAttribute overlap;
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {grid, block, shared, stream, &overlap, uform_vram_dependent_launches ? 1u : 0u};
    (void)cudaLaunchKernelEx(&config, kernel, std::forward<Arguments>(arguments)...);
}
#endif

static inline unsigned uform_vram_blocks(size_t count, unsigned threads) {
    size_t blocks = (count + threads - 1) / threads;
    return (unsigned)(blocks ? blocks : 1);
}

/* Operations, one file each; the table in backend.cu points at them. */
uform_status_t uform_vram_matmul(void* context, void* d, void const* c, void const* a, void const* b, size_t m,
                                 size_t n, size_t k, int a_transposed, int b_transposed, uform_element_t d_element);
uform_status_t uform_vram_matmul_gelu(void* context, void* activated, void* up, void const* a, void const* b, size_t m,
                                      size_t n, size_t k);
uform_status_t uform_vram_matmul_gelu_backward(void* context, void* d_up, void const* up, void const* a, void const* b,
                                               size_t m, size_t n, size_t k);
uform_status_t uform_vram_embedding_forward(void* context, void* out, void const* table, uint32_t const* ids,
                                            size_t tokens, size_t hidden);
uform_status_t uform_vram_embedding_backward(void* context, float* d_table, void const* d_out, uint32_t const* order,
                                             uint32_t const* order_offsets, size_t tokens, size_t hidden,
                                             size_t vocabulary);
uform_status_t uform_vram_rmsnorm_forward(void* context, void* out, float* rstd, void const* x, float const* gain,
                                          size_t tokens, size_t hidden);
uform_status_t uform_vram_rmsnorm_backward(void* context, void* d_x, float* d_gain, void const* d_out, void const* x,
                                           float const* gain, float const* rstd, size_t tokens, size_t hidden);
uform_status_t uform_vram_rope_forward(void* context, void* qkv, uint32_t const* positions, size_t tokens,
                                       size_t hidden);
uform_status_t uform_vram_rope_backward(void* context, void* d_qkv, uint32_t const* positions, size_t tokens,
                                        size_t hidden);
size_t uform_vram_statistics_floats(uform_plan_t const* plan);
uform_status_t uform_vram_attention_forward(void* context, void* out, float* statistics, void const* qkv,
                                            uform_items_t const* items, size_t tokens, size_t hidden);
uform_status_t uform_vram_attention_backward(void* context, void* d_qkv, void const* d_out, void const* out,
                                             float const* statistics, void const* qkv, uint32_t const* positions,
                                             int same_positions, uform_items_t const* items, size_t tokens,
                                             size_t hidden);
uform_status_t uform_vram_gelu_forward(void* context, void* out, void const* in, size_t count);
uform_status_t uform_vram_gelu_backward(void* context, void* d_in, void const* d_out, void const* in, size_t count);
uform_status_t uform_vram_gather_rows(void* context, void* out, void const* in, uint32_t const* rows, size_t count,
                                      size_t width);
uform_status_t uform_vram_scatter_rows(void* context, void* d_in, void const* d_out, uint32_t const* rows,
                                       size_t count, size_t width);
uform_status_t uform_vram_pool_forward(void* context, float* pooled, void const* states, uform_items_t const* items,
                                       size_t hidden);
uform_status_t uform_vram_pool_backward(void* context, void* d_states, float const* d_pooled,
                                        uform_items_t const* items, size_t hidden);
uform_status_t uform_vram_cross_entropy(void* context, double* loss, void* d_logits, void const* logits,
                                        uint32_t const* targets, size_t count, size_t classes, float scale);
uform_status_t uform_vram_choices(void* context, double* loss, void* d_logits, float* probabilities,
                                  void const* logits, uint32_t const* offsets, uint8_t const* choices,
                                  float const* targets, size_t count, float scale);
uform_status_t uform_vram_normalize_rows(void* context, float* out, void const* in, size_t rows, size_t width);
uform_status_t uform_vram_normalize_rows_backward(void* context, void* d_in, float const* d_out, float const* out,
                                                  void const* in, size_t rows, size_t width);
uform_status_t uform_vram_late_interaction(void* context, double* loss, float* d_vectors,
                                           float* d_log_inverse_temperature, float* d_bias, float const* vectors,
                                           size_t rows, size_t width, float const* log_inverse_temperature,
                                           float const* bias, uform_late_interaction_setup_t const* setup,
                                           float scale);
uform_status_t uform_vram_patch_loss(void* context, double* loss, void* d_predictions, void const* predictions,
                                     float const* targets, size_t count, size_t width, float scale);
/** *loss = (losses[0] + ... + losses[count - 1], added in a fixed order) / divisor: one launch. */
uform_status_t uform_vram_mean_of_rows(uform_vram_context_t* context, double* loss, double const* losses, size_t count,
                                       double divisor, char const* name);
uform_status_t uform_vram_contrastive(void* context, double* loss, float* d_pooled, float* d_log_inverse_temperature,
                                      float* d_bias, float* normalized, float const* pooled,
                                      float const* log_inverse_temperature, float const* bias, uint8_t const* cells,
                                      float const* weights, uint32_t const* groups, size_t items, size_t hidden,
                                      uform_contrastive_setup_t const* setup, float scale);
uform_status_t uform_vram_sum_squares(void* context, double* sum, float const* x, size_t count);
uform_status_t uform_vram_adamw(void* context, uform_update_t const* update);
uform_status_t uform_vram_convert(void* context, void* activations, float const* source, size_t count);

#endif /* UFORM_VRAM_H_ */
