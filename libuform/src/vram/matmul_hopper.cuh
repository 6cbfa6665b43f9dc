/**
 *  @file   matmul_hopper.cuh
 *  @brief  d (m, n) = epilogue(a (m, k) x b (n, k)^T) on Hopper's tensor cores, bf16 operands, float32
 *          accumulation: the product whose epilogue cuBLASLt runs slowly (GELU's gradient).
 *
 *  Both operands are row-major with k contiguous ("K-major"). A persistent grid of one block a
 *  multiprocessor walks 128 x 128 tiles of d. In a block, one thread loads 128 x 64 slices of a and b
 *  with the tensor memory accelerator into a ring of five stages (128-byte swizzle, zeros past the
 *  matrices' edges), and two warpgroups take the tiles in turn: each multiplies its tile's slices
 *  with `wgmma` (two 64 x 128 x 16 instructions per 16 columns of k), holding the 128 x 128 sums in
 *  registers, then runs the epilogue while the other warpgroup multiplies its own tile. Each
 *  warpgroup owns a 128 x 128 bf16 tile of shared memory: the loading thread fills it with the
 *  tile's aux while the products run, the epilogue replaces each element with its result in place,
 *  and the tensor memory accelerator stores it to d, so no thread waits on global memory:
 *
 *    plain:          d = bf16(sum)
 *    gelu:           d = bf16(gelu(sum)), aux = bf16(sum)  (aux stored first, through the same tile)
 *    gelu_backward:  d = bf16(sum * gelu'(aux))            (aux: the sums before GELU, bf16)
 *
 *  GELU (tanh form) and its slope take the hardware's tanh: one special-function op an element,
 *  where `tanhf` or an exponential and a division would make the epilogue outlast a k = 512 tile's
 *  products.
 *
 *  Tiles 192 columns wide, and results stored from registers rather than through shared memory, were
 *  tried and measured slower a training step (`bench/RESULTS.md`, 2026-12-05, session 11).
 *
 *  Every output element is one thread's sum over k in a fixed order: deterministic, no split of k.
 *  The instructions exist on sm_90a only: the host launches the kernel on compute capability 9.0
 *  alone (`uform_hopper_ready`), and a build of it for another target traps rather than return
 *  without writing d (as it would where the driver compiled the PTX, e.g. `CUDA_FORCE_PTX_JIT=1`).
 */
#ifndef UFORM_VRAM_MATMUL_HOPPER_CUH_
#define UFORM_VRAM_MATMUL_HOPPER_CUH_

#include <cuda.h> /* CUtensorMap and its encoder's signature: the function is found at run time */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

enum uform_hopper_epilogue_t {
    uform_hopper_plain_k,
    uform_hopper_gelu_k,
    uform_hopper_gelu_backward_k,
};

namespace uform_hopper {

constexpr int tile_m = 128, tile_n = 128, tile_k = 64, stages = 5;
static_assert((2 * stages + 6) * 8 <= 128, "the barriers fit their 128 bytes");
constexpr int consumers = 128, threads = 3 * consumers; /* two warpgroups multiply, one thread of the third loads */
constexpr unsigned tile_bytes = tile_m * tile_k * 2;      /* one stage of a, and of b: 16 KiB each */
constexpr unsigned half_bytes = tile_m * 64 * 2;          /* 64 columns of an output tile: one 128-byte-swizzled box */
constexpr size_t shared_bytes =
    1024 /* alignment */ + 2 * stages * tile_bytes + 2 * 2 * half_bytes + 128 /* barriers */;
static_assert(shared_bytes <= 227 * 1024, "a block's shared memory fits a Hopper multiprocessor");

/** GELU (tanh form) at x, with the hardware's tanh. */
__device__ __forceinline__ float gelu(float x) {
    float t, inner = x * fmaf(0.7978845608f * 0.044715f, x * x, 0.7978845608f);
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(inner));
    return 0.5f * x * (1.0f + t);
}

/** The slope of GELU (tanh form) at x, with the hardware's tanh (relative error about 2^-11). */
__device__ __forceinline__ float gelu_slope(float x) {
    float square = x * x, t;
    float inner = x * fmaf(0.7978845608f * 0.044715f, square, 0.7978845608f);
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(inner));
    float rise = fmaf(3.0f * 0.7978845608f * 0.044715f, square, 0.7978845608f); /* d inner / dx */
    return fmaf(0.5f, t, 0.5f) + 0.5f * x * fmaf(-t, t, 1.0f) * rise;
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ uint32_t shared_address(void const* pointer) {
    return (uint32_t)__cvta_generic_to_shared(pointer);
}

__device__ __forceinline__ void barrier_init(uint64_t* barrier, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(barrier)), "r"(count));
}

__device__ __forceinline__ void barrier_expect(uint64_t* barrier, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(barrier)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void barrier_arrive(uint64_t* barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(shared_address(barrier)) : "memory");
}

/** Waits until the barrier's phase of this parity has completed. */
__device__ __forceinline__ void barrier_wait(uint64_t* barrier, unsigned parity) {
    uint32_t done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(shared_address(barrier)), "r"(parity)
                     : "memory");
    } while (!done);
}

/** Loads the box at (column, row) of a 2-D tensor into shared memory, counted on `barrier`. */
__device__ __forceinline__ void load_box(void* destination, CUtensorMap const* map, uint64_t* barrier, int column,
                                         int row) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%3, %4}], [%2];"
                 :
                 : "r"(shared_address(destination)), "l"(map), "r"(shared_address(barrier)), "r"(column), "r"(row)
                 : "memory");
}

/** Stores shared memory to the box at (column, row) of a 2-D tensor; parts past its edges are not written. */
__device__ __forceinline__ void store_box(CUtensorMap const* map, void const* source, int column, int row) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 :
                 : "l"(map), "r"(shared_address(source)), "r"(column), "r"(row)
                 : "memory");
}

/** Waits at a named barrier for the 128 threads of warpgroup `group` (barrier 0 is __syncthreads'). */
__device__ __forceinline__ void group_sync(int group) {
    asm volatile("bar.sync %0, 128;" ::"r"(group + 1) : "memory");
}

/** A shared-memory matrix descriptor: K-major rows of 128 bytes, 128-byte swizzle, 8-row groups 1 KiB apart. */
__device__ __forceinline__ uint64_t descriptor(void const* pointer) {
    uint64_t address = shared_address(pointer);
    return ((address & 0x3FFFF) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}

/** d (64 x 128, this warpgroup's fragment) += a (64 x 16) x b (128 x 16)^T, or = when `accumulate` is 0. */
__device__ __forceinline__ void multiply(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
#define UFORM_F8(i)                                                                                                    \
    "+f"(d[i + 0]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]),    \
        "+f"(d[i + 7])
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                 "%64, %65, p, 1, 1, 0, 0; }"
                 : UFORM_F8(0), UFORM_F8(8), UFORM_F8(16), UFORM_F8(24), UFORM_F8(32), UFORM_F8(40), UFORM_F8(48),
                   UFORM_F8(56)
                 : "l"(a), "l"(b), "r"(accumulate));
#undef UFORM_F8
}

/** Keeps the compiler from moving reads or writes of the sums across the asynchronous products. */
__device__ __forceinline__ void pin(float (&d)[64]) {
#pragma unroll
    for (int i = 0; i != 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

#endif

struct arguments_t {
    int m, n, k;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

/*  The epilogue of a 64 x 128 fragment in place over the warpgroup's tile (GELU's forward takes its
    values in registers first, then writes them as a plain product's). Thread (warp w, lane l)
    holds, for j in 0..15, columns 8j + 2(l % 4) and the next, in row 16w + l / 4 (values 4j, 4j + 1)
    and 8 rows below (4j + 2, 4j + 3). The tile lies as the tensor memory accelerator's two boxes of
    64 columns, 128 bytes a row, with 16-byte chunk c of row r at chunk c ^ (r % 8): the 8 rows a
    warp touches at once fall on distinct chunks, so its 32 accesses take the 32 banks once each.
    A row's aux is read whole before its first result is written: the compiler cannot tell a result's
    address from the next aux's, so a load after each store would wait out its latency 64 times a tile. */
template <uform_hopper_epilogue_t epilogue>
__device__ __forceinline__ void finish(float const (&sums)[64], uint8_t* tile, int row0) {
    int const lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
#pragma unroll
    for (int below = 0; below != 2; ++below) {
        uint8_t* row = tile + (row0 + warp * 16 + lane / 4 + 8 * below) * 128 + 4 * (lane % 4);
        auto at = [&](int j) {
            return (__nv_bfloat162*)(row + (j / 8) * half_bytes + (((j % 8) ^ (lane / 4)) * 16));
        };
        __nv_bfloat162 aux[16];
        if (epilogue == uform_hopper_gelu_backward_k)
#pragma unroll
            for (int j = 0; j != 16; ++j) aux[j] = *at(j);
#pragma unroll
        for (int j = 0; j != 16; ++j) {
            float2 x = make_float2(sums[4 * j + 2 * below], sums[4 * j + 2 * below + 1]);
            if (epilogue == uform_hopper_gelu_backward_k) {
                float2 up = __bfloat1622float2(aux[j]);
                x.x *= gelu_slope(up.x), x.y *= gelu_slope(up.y);
            }
            *at(j) = __floats2bfloat162_rn(x.x, x.y);
        }
    }
}

#endif

/*  Two warpgroups multiply, taking the block's tiles in turn (the block's i-th tile goes to
    warpgroup i % 2), so one's epilogue runs while the other's products do. Slices of every tile
    pass through one ring of stages in the block's tile order: slice s of the block's i-th tile is
    the ring's (i * slices + s)-th entry. A warpgroup starts waiting for its tile's slices only once
    the other has received all of the previous tile's: a stage's barrier tells one pass round the
    ring from the next by parity alone, so no waiter may be two passes ahead of the loads. */
template <uform_hopper_epilogue_t epilogue>
__global__ void __launch_bounds__(threads, 1)
    product(__grid_constant__ CUtensorMap const a_map, __grid_constant__ CUtensorMap const b_map,
            __grid_constant__ CUtensorMap const d_map, __grid_constant__ CUtensorMap const aux_map, arguments_t args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t raw[];
    /* The swizzle needs 1 KiB alignment. Offsetting the pointer itself, not an integer made of it, keeps
       the compiler knowing it is shared memory, so the epilogue's accesses stay `ld.shared`/`st.shared`. */
    uint8_t* base = raw + ((1024 - (shared_address(raw) & 1023)) & 1023);
    uint8_t* a_stages = base;
    uint8_t* b_stages = base + stages * tile_bytes;
    uint8_t* outputs = base + 2 * stages * tile_bytes; /* each warpgroup's output tile */
    uint64_t* full = (uint64_t*)(outputs + 2 * 2 * half_bytes);
    uint64_t* empty = full + stages;
    uint64_t* order = empty + stages;    /* order[g]: warpgroup g may start its next tile's products */
    uint64_t* aux_full = order + 2;      /* aux_full[g]: g's tile holds its aux */
    uint64_t* aux_empty = aux_full + 2;  /* aux_empty[g]: g's last store has read its tile */
    bool const has_aux = epilogue == uform_hopper_gelu_backward_k;
    int const columns_of_tiles = (args.n + tile_n - 1) / tile_n;
    int const tiles = ((args.m + tile_m - 1) / tile_m) * columns_of_tiles, slices = (args.k + tile_k - 1) / tile_k;
    if (threadIdx.x == 0) {
        for (int s = 0; s != stages; ++s) barrier_init(&full[s], 1), barrier_init(&empty[s], 4);
        barrier_init(&order[0], 4), barrier_init(&order[1], 4);
        for (int g = 0; g != 2; ++g) barrier_init(&aux_full[g], 1), barrier_init(&aux_empty[g], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    /* Launched as the kernel before it drains (`dependent` below): nothing is read or written before that one ends. */
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");

    if (threadIdx.x >= 2 * consumers) { /* the loading warpgroup gives its registers up; one thread issues every copy */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x != 2 * consumers) return;
        unsigned entry = 0, turn = 0;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++turn) {
            int row = (tile / columns_of_tiles) * tile_m, column = (tile % columns_of_tiles) * tile_n;
            for (int slice = 0; slice != slices; ++slice, ++entry) {
                int stage = entry % stages;
                barrier_wait(&empty[stage], ((entry / stages) & 1) ^ 1);
                barrier_expect(&full[stage], 2 * tile_bytes);
                load_box(a_stages + stage * tile_bytes, &a_map, &full[stage], slice * tile_k, row);
                load_box(b_stages + stage * tile_bytes, &b_map, &full[stage], slice * tile_k, column);
            }
            /* After the tile's slices, so the ring never waits on an epilogue; the aux lands while they multiply. */
            if (has_aux) {
                int g = turn % 2;
                uint8_t* output = outputs + g * 2 * half_bytes;
                barrier_wait(&aux_empty[g], ((turn / 2) & 1) ^ 1);
                barrier_expect(&aux_full[g], 2 * half_bytes);
                load_box(output, &aux_map, &aux_full[g], column, row);
                load_box(output + half_bytes, &aux_map, &aux_full[g], column + 64, row);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    int const group = threadIdx.x / consumers, lane = threadIdx.x % 32;
    float upper[64], lower[64]; /* the tile's rows 0-63 and 64-127 */
    unsigned turn = group;      /* the block's tile sequence number */
    for (int tile = blockIdx.x + group * gridDim.x; tile < tiles; tile += 2 * gridDim.x, turn += 2) {
        int row0 = (tile / columns_of_tiles) * tile_m, column0 = (tile % columns_of_tiles) * tile_n;
        unsigned entry = turn * slices;
        if (turn > 0) barrier_wait(&order[group], ((turn - 1) / 2) & 1);
        int released = -1; /* the stage whose products are still running, freed once they finish */
        for (int slice = 0; slice != slices; ++slice, ++entry) {
            int stage = entry % stages;
            barrier_wait(&full[stage], (entry / stages) & 1);
            pin(upper), pin(lower);
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
            uint8_t const* a_tile = a_stages + stage * tile_bytes;
            uint8_t const* b_tile = b_stages + stage * tile_bytes;
#pragma unroll
            for (int step = 0; step != tile_k / 16; ++step) { /* 16 columns of k are 32 bytes along a row */
                int accumulate = slice > 0 || step > 0;
                multiply(upper, descriptor(a_tile + step * 32), descriptor(b_tile + step * 32), accumulate);
                multiply(lower, descriptor(a_tile + 64 * 128 + step * 32), descriptor(b_tile + step * 32), accumulate);
            }
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            pin(upper), pin(lower);
            if (released >= 0 && lane == 0) barrier_arrive(&empty[released]);
            released = stage;
        }
        if (lane == 0) barrier_arrive(&order[group ^ 1]); /* every slice of this tile has arrived */
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        pin(upper), pin(lower);
        if (released >= 0 && lane == 0) barrier_arrive(&empty[released]);

        uint8_t* output = outputs + group * 2 * half_bytes;
        bool const leader = threadIdx.x % consumers == 0; /* issues the stores and waits for their reads */
        auto store = [&](CUtensorMap const* map) { /* the leader then waits for the copy to read the tile */
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); /* the writes, seen by the store's copy */
            group_sync(group);
            if (!leader) return;
            store_box(map, output, column0, row0);
            if (column0 + 64 < args.n) store_box(map, output + half_bytes, column0 + 64, row0);
            asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        };
        auto stored = [&] { if (leader) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); };
        if (has_aux)
            barrier_wait(&aux_full[group], (turn / 2) & 1); /* loaded after the last store read the tile */
        else
            group_sync(group); /* the leader has seen the last store read the tile */
        if (epilogue == uform_hopper_gelu_k) { /* the sums before GELU, kept for the backward pass; GELU's values
                                                  are taken in registers while the copy reads them */
            finish<uform_hopper_plain_k>(upper, output, 0);
            finish<uform_hopper_plain_k>(lower, output, 64);
            store(&aux_map);
#pragma unroll
            for (int i = 0; i != 64; ++i) upper[i] = gelu(upper[i]), lower[i] = gelu(lower[i]);
            stored();
            group_sync(group);
            finish<uform_hopper_plain_k>(upper, output, 0);
            finish<uform_hopper_plain_k>(lower, output, 64);
        } else {
            finish<epilogue>(upper, output, 0);
            finish<epilogue>(lower, output, 64);
        }
        store(&d_map);
        stored();
        if (leader && has_aux) barrier_arrive(&aux_empty[group]);
    }
    if (threadIdx.x % consumers == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#else
    __trap(); /* built without sm_90a's instructions: fail loudly, never leave d unwritten */
#endif
}

} // namespace uform_hopper

typedef CUresult (*uform_hopper_encoder_t)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, cuuint64_t const*,
                                           cuuint64_t const*, cuuint32_t const*, cuuint32_t const*,
                                           CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                           CUtensorMapFloatOOBfill);

/** The driver's tensor-map encoder, or NULL where the driver lacks it. */
static inline uform_hopper_encoder_t uform_hopper_encoder(void) {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
        return nullptr;
    return (uform_hopper_encoder_t)function;
}

/** Whether the device runs these kernels: Hopper's 9.0, the target they are compiled for. */
static inline bool uform_hopper_ready(int ordinal) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal);
    return major == 9 && minor == 0;
}

/** Whether the kernels take a product of this shape: rows of 16-byte multiples, sizes and ring entries in 32 bits,
 *  k under 2^21 (its transposing caller's grid). */
static inline bool uform_hopper_fits(size_t m, size_t n, size_t k) {
    if (!n || !k || n % 8 || k % 8 || m >= (1u << 30) || n >= (1u << 30) || k >= (1u << 21)) return false;
    using namespace uform_hopper;
    return ((m + tile_m - 1) / tile_m) * ((n + tile_n - 1) / tile_n) * ((k + tile_k - 1) / tile_k) < (1u << 31);
}

/** Whether every operand starts on 16 bytes, as the tensor maps and the epilogue's vectors need. */
static inline bool uform_hopper_aligned(void const* a, void const* b, void const* d, void const* aux) {
    return !((uintptr_t)a % 16 || (uintptr_t)b % 16 || (uintptr_t)d % 16 || (uintptr_t)aux % 16);
}

/** A tensor map over a row-major bf16 (rows, columns) matrix, read or written in boxes of (box_rows, 64) with the
 *  128-byte swizzle; false where the driver refuses it. */
static inline bool uform_hopper_map(uform_hopper_encoder_t encode, CUtensorMap* map, void const* matrix, size_t rows,
                                    size_t columns, unsigned box_rows) {
    cuuint64_t sizes[2] = {columns, rows}, strides[1] = {columns * 2};
    cuuint32_t box[2] = {64, box_rows}, unit[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, (void*)matrix, sizes, strides, box, unit,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/** Launches d = epilogue(a x b^T) on `stream`; a is (m, k), b is (n, k), d and aux (m, n), all row-major; aux is
 *  written by `gelu`, read by `gelu_backward`. `dependent`: let the blocks be scheduled while the kernel before it
 *  drains (programmatic dependent launch); they wait for it before touching memory. The caller checks
 *  `uform_hopper_fits` and `uform_hopper_aligned` first; this refuses what they refuse. A template, so that only a
 *  file that calls it compiles its three kernels (the attention includes this header). */
template <int = 0>
static inline cudaError_t uform_hopper_product(uform_hopper_encoder_t encode, int multiprocessors, cudaStream_t stream,
                                               bool dependent, uform_hopper_epilogue_t epilogue, __nv_bfloat16* d,
                                               __nv_bfloat16* aux, __nv_bfloat16 const* a,
                                               __nv_bfloat16 const* b, size_t m, size_t n, size_t k) {
    using namespace uform_hopper;
    static_assert(tile_k == 64 && tile_n == 2 * 64, "boxes are 64 columns: 128 bytes, the swizzle's span");
    if (!m) return cudaSuccess;
    if (!uform_hopper_fits(m, n, k) || !uform_hopper_aligned(a, b, d, aux)) return cudaErrorInvalidValue;
    if (epilogue != uform_hopper_plain_k && !aux) return cudaErrorInvalidValue;
    CUtensorMap a_map, b_map, d_map, aux_map;
    if (!uform_hopper_map(encode, &a_map, a, m, k, tile_m) || !uform_hopper_map(encode, &b_map, b, n, k, tile_n) ||
        !uform_hopper_map(encode, &d_map, d, m, n, tile_m) ||
        !uform_hopper_map(encode, &aux_map, aux ? aux : d, m, n, tile_m))
        return cudaErrorInvalidValue;
    arguments_t args = {(int)m, (int)n, (int)k};
    size_t tiles = ((m + tile_m - 1) / tile_m) * ((n + tile_n - 1) / tile_n);
    size_t pairs = (tiles + 1) / 2; /* a block's two warpgroups take a tile each at a time */
    unsigned blocks = (unsigned)(pairs < (size_t)multiprocessors ? pairs : (size_t)multiprocessors);
    void (*kernel)(CUtensorMap, CUtensorMap, CUtensorMap, CUtensorMap, arguments_t) =
        epilogue == uform_hopper_plain_k ? product<uform_hopper_plain_k>
        : epilogue == uform_hopper_gelu_k ? product<uform_hopper_gelu_k>
                                          : product<uform_hopper_gelu_backward_k>;
    cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared_bytes);
    if (error != cudaSuccess) return error;
    cudaLaunchAttribute overlap;
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {dim3(blocks), dim3(threads), shared_bytes, stream, &overlap, dependent ? 1u : 0u};
    return cudaLaunchKernelEx(&config, kernel, a_map, b_map, d_map, aux_map, args);
}

#endif
