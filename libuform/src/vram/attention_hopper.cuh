/**
 *  @file   attention_hopper.cuh
 *  @brief  Bidirectional attention within each item of the packed stream on Hopper's tensor cores,
 *          forward and backward, in the manner of FlashAttention-3: the copy engine loads, `wgmma`
 *          multiplies, the softmax runs online in registers, and nothing of size tokens^2 is stored.
 *
 *  qkv (tokens, 3 hidden) holds each token's queries, keys and values, head h in columns
 *  64h .. 64h + 63 of each third; items are runs of tokens, each attending within itself.
 *
 *    forward:            out = softmax(q k^T / 8) v, and each query's log-sum-exp `lse`
 *    backward, queries:  d q, and delta = rowsum(d out * out) of each query, for the keys' pass
 *    backward, keys:     d k and d v
 *
 *  A block takes 128 tokens of one item and one head: two warpgroups own 64 each and one thread
 *  of a third loads the other side's tiles of 128 tokens through two stages (128-byte swizzle;
 *  past the item's end the tiles hold the next item's tokens, or zeros past the tensor, and are
 *  masked). The two warpgroups take turns issuing their products (`take_turn`), so the tensor
 *  cores run one's products while the other takes its element-wise work. Each product's operand
 *  that is itself a product's result (p, d s, their transposes) goes from the accumulator's
 *  registers straight into the next `wgmma`: the accumulator's layout, 16 columns at a time, is
 *  the layout `wgmma` wants for an operand held in registers.
 *
 *  The backward pass is two passes that each recompute the scores, rather than one that adds each
 *  block's share of d q from several blocks: 7 products of a block's size against 5, and in
 *  exchange no atomics and no stored scores. Every output element is written once, by one thread,
 *  from sums in a fixed order: the same inputs give the same bits, run to run.
 *
 *  The instructions exist on sm_90a only; the host launches these kernels on compute capability 9.0
 *  alone, and a build for another target traps rather than return without writing.
 */
#ifndef UFORM_VRAM_ATTENTION_HOPPER_CUH_
#define UFORM_VRAM_ATTENTION_HOPPER_CUH_

#include "matmul_hopper.cuh"

namespace uform_flash {

constexpr int width = 64, block_q = 128, block_k = 128, stages = 2;
constexpr int consumers = 128, threads = 3 * consumers; /* two warpgroups multiply, one thread of the third loads */
constexpr unsigned box_bytes = 128 * width * 2;         /* 128 rows of one head: 16 KiB */
/* Shared memory: the alignment's slack, the tiles, the keys' pass's statistics, the barriers. */
constexpr size_t forward_bytes = 1024 + (1 + 2 * stages) * box_bytes + 128;
constexpr size_t queries_bytes = 1024 + (3 + 2 * stages) * box_bytes + 128;
constexpr size_t keys_bytes = 1024 + (2 + 2 * stages) * box_bytes + 2 * stages * 2 * block_q * sizeof(float) + 128;

struct arguments_t {
    __nv_bfloat16* out;       /* forward: (tokens, hidden) */
    __nv_bfloat16* d_qkv;     /* backward: (tokens, 3 hidden), the items' rows written */
    float* lse;               /* (heads, stride): each query's log-sum-exp of its scaled scores, natural log */
    float* delta;             /* (heads, stride): each query's rowsum(d out * out), the queries' pass writes */
    uint32_t const* segments; /* (items, 4): each item's first token and length, then two words not read */
    int hidden, stride;       /* stride: at least the tokens */
    int blocks;               /* 128-token blocks of the longest item: the grid's x is items x blocks */
};

constexpr float scale = 0.125f, scale_log2 = 0.125f * 1.4426950409f; /* 1 / sqrt(width), and times log2(e) */

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using namespace uform_hopper;

/** o (64 x 64, this warpgroup's fragment) += p (64 x 16, registers) x v (16 x 64, shared, v's rows contiguous). */
__device__ __forceinline__ void multiply_pv(float (&o)[32], uint32_t const (&p)[4], uint64_t v) {
#define UFORM_F8(i)                                                                                                    \
    "+f"(o[i + 0]), "+f"(o[i + 1]), "+f"(o[i + 2]), "+f"(o[i + 3]), "+f"(o[i + 4]), "+f"(o[i + 5]), "+f"(o[i + 6]),    \
        "+f"(o[i + 7])
    asm volatile("{ .reg .pred p; setp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "{%32, %33, %34, %35}, %36, p, 1, 1, 1; }"
                 : UFORM_F8(0), UFORM_F8(8), UFORM_F8(16), UFORM_F8(24)
                 : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(v));
#undef UFORM_F8
}

__device__ __forceinline__ void pin32(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i != 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/*  The two warpgroups take turns issuing their products: each waits for its turn (named barrier 3 + its
    group, completed by the other's arrival) and passes it on once its products are queued, so the
    tensor cores run one warpgroup's products while the other takes its softmax. The first turn is
    warpgroup 0's; warpgroup 1 opens it, and does not pass its last turn, which no one waits for. */
__device__ __forceinline__ void take_turn(int group) { asm volatile("bar.sync %0, 256;" ::"r"(3 + group) : "memory"); }
__device__ __forceinline__ void pass_turn(int group) { asm volatile("bar.arrive %0, 256;" ::"r"(4 - group) : "memory"); }

/** 2^x, the hardware's approximation: -inf gives 0. */
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ uint32_t pack(float x, float y) {
    __nv_bfloat162 pair = __floats2bfloat162_rn(x, y);
    return *(uint32_t*)&pair;
}
#endif

__global__ void __launch_bounds__(threads, 1) forward(__grid_constant__ CUtensorMap const qkv, arguments_t args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t raw[];
    uint8_t* base = raw + ((1024 - (shared_address(raw) & 1023)) & 1023);
    uint8_t* q_tile = base;
    uint8_t* k_tiles = base + box_bytes;
    uint8_t* v_tiles = k_tiles + stages * box_bytes;
    uint64_t* q_full = (uint64_t*)(v_tiles + stages * box_bytes);
    uint64_t* k_full = q_full + 1;
    uint64_t* v_full = k_full + stages;
    uint64_t* empty = v_full + stages;
    asm volatile("griddepcontrol.wait;" ::: "memory"); /* launched as the kernel before drains: read nothing before */
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    int const item = blockIdx.x / args.blocks, head = blockIdx.y;
    int const first = (int)args.segments[4 * item], length = (int)args.segments[4 * item + 1];
    int const q0 = blockIdx.x % args.blocks * block_q;
    if (q0 >= length) return;
    int const key_blocks = (length + block_k - 1) / block_k;
    if (threadIdx.x == 0) {
        barrier_init(q_full, 1);
        for (int s = 0; s != stages; ++s) barrier_init(&k_full[s], 1), barrier_init(&v_full[s], 1), barrier_init(&empty[s], 8);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (threadIdx.x >= 2 * consumers) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x != 2 * consumers) return;
        barrier_expect(q_full, box_bytes);
        load_box(q_tile, &qkv, q_full, head * width, first + q0);
        for (int j = 0; j != key_blocks; ++j) {
            int stage = j % stages;
            barrier_wait(&empty[stage], ((j / stages) & 1) ^ 1);
            barrier_expect(&k_full[stage], box_bytes);
            load_box(k_tiles + stage * box_bytes, &qkv, &k_full[stage], args.hidden + head * width, first + j * block_k);
            barrier_expect(&v_full[stage], box_bytes);
            load_box(v_tiles + stage * box_bytes, &qkv, &v_full[stage], 2 * args.hidden + head * width,
                     first + j * block_k);
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    int const group = threadIdx.x / consumers, lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
    float o[32], maximum[2] = {-INFINITY, -INFINITY}, sum[2] = {0, 0};
#pragma unroll
    for (int i = 0; i != 32; ++i) o[i] = 0;
    barrier_wait(q_full, 0);
    if (group == 1) pass_turn(1);
    uint8_t const* q_rows = q_tile + group * 64 * 128;
    for (int j = 0; j != key_blocks; ++j) {
        int stage = j % stages;
        float s[64];
        barrier_wait(&k_full[stage], (j / stages) & 1);
        take_turn(group);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        uint8_t const* k_rows = k_tiles + stage * box_bytes;
#pragma unroll
        for (int step = 0; step != width / 16; ++step)
            multiply(s, descriptor(q_rows + step * 32), descriptor(k_rows + step * 32), step > 0);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        pass_turn(group);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        pin(s);
        /* Thread (warp w, lane l) holds keys 8c + 2(l % 4) and the next (values 4c, 4c + 1) of query row
           16w + l / 4, and the same keys 8 rows below (4c + 2, 4c + 3). Maxima are of the unscaled scores. */
        int const key0 = j * block_k + 2 * (lane % 4);
        float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int c = 0; c != 16; ++c)
#pragma unroll
            for (int e = 0; e != 4; ++e) {
                float x = key0 + 8 * c + (e & 1) < length ? s[4 * c + e] : -INFINITY;
                s[4 * c + e] = x;
                block_max[e / 2] = fmaxf(block_max[e / 2], x);
            }
        float correction[2], shift[2];
#pragma unroll
        for (int r = 0; r != 2; ++r) {
            block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 1));
            block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 2));
            float next = fmaxf(maximum[r], block_max[r]); /* finite: every block holds a key of the item */
            correction[r] = exp2_approx((maximum[r] - next) * scale_log2);
            maximum[r] = next;
            shift[r] = -next * scale_log2;
            sum[r] *= correction[r];
        }
#pragma unroll
        for (int c = 0; c != 16; ++c)
#pragma unroll
            for (int e = 0; e != 4; ++e) {
                float p = exp2_approx(fmaf(s[4 * c + e], scale_log2, shift[e / 2]));
                s[4 * c + e] = p;
                sum[e / 2] += p;
            }
#pragma unroll
        for (int c = 0; c != 8; ++c)
#pragma unroll
            for (int e = 0; e != 4; ++e) o[4 * c + e] *= correction[e / 2];
        uint32_t p[8][4]; /* keys 16t..16t+15 as the register operand: rows r and r + 8, keys 2(l % 4) and + 8 */
#pragma unroll
        for (int t = 0; t != 8; ++t) {
            p[t][0] = pack(s[8 * t + 0], s[8 * t + 1]);
            p[t][1] = pack(s[8 * t + 2], s[8 * t + 3]);
            p[t][2] = pack(s[8 * t + 4], s[8 * t + 5]);
            p[t][3] = pack(s[8 * t + 6], s[8 * t + 7]);
        }
        barrier_wait(&v_full[stage], (j / stages) & 1);
        pin32(o);
        take_turn(group);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        uint8_t const* v_rows = v_tiles + stage * box_bytes;
#pragma unroll
        for (int t = 0; t != 8; ++t) multiply_pv(o, p[t], descriptor(v_rows + t * 16 * 128));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        if (group == 0 || j + 1 != key_blocks) pass_turn(group);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        pin32(o);
        if (lane == 0) barrier_arrive(&empty[stage]);
    }
#pragma unroll
    for (int r = 0; r != 2; ++r) {
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
        sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
    }
#pragma unroll
    for (int r = 0; r != 2; ++r) {
        int row = q0 + group * 64 + warp * 16 + lane / 4 + 8 * r;
        if (row >= length) continue;
        size_t token = (size_t)first + row;
        float inverse = 1.0f / sum[r];
        __nv_bfloat16* out = args.out + token * args.hidden + head * width + 2 * (lane % 4);
#pragma unroll
        for (int c = 0; c != 8; ++c)
            *(uint32_t*)(out + 8 * c) = pack(o[4 * c + 2 * r] * inverse, o[4 * c + 2 * r + 1] * inverse);
        if (lane % 4 == 0)
            args.lse[(size_t)head * args.stride + token] = (maximum[r] * scale_log2 + log2f(sum[r])) * 0.69314718056f;
    }
#else
    __trap();
#endif
}


#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/** Writes a warpgroup's 64 x 64 fragment times `factor` as bf16 to rows `row0`.. of `out` (row stride `pitch`),
 *  the rows before `rows` only. */
__device__ __forceinline__ void write_rows(float const (&d)[32], __nv_bfloat16* out, size_t pitch, int row0, int rows,
                                           float factor) {
    int const lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
#pragma unroll
    for (int r = 0; r != 2; ++r) {
        int row = row0 + warp * 16 + lane / 4 + 8 * r;
        if (row >= rows) continue;
        __nv_bfloat16* at = out + (size_t)row * pitch + 2 * (lane % 4);
#pragma unroll
        for (int c = 0; c != 8; ++c) *(uint32_t*)(at + 8 * c) = pack(d[4 * c + 2 * r] * factor, d[4 * c + 2 * r + 1] * factor);
    }
}

/** The bf16 pair at (row, column) of a 128-byte-swizzled tile of 64 columns. */
__device__ __forceinline__ float2 tile_pair(uint8_t const* tile, int row, int column) {
    return __bfloat1622float2(*(__nv_bfloat162 const*)(tile + row * 128 + (((column / 8) ^ (row % 8)) * 16) +
                                                       (column % 8) * 2));
}
#endif

/*  The queries' pass: d q for 128 queries of an item and a head, over all its keys, as the forward
    walks them (s = q k^T and p again from the log-sum-exps, d p = d o v^T, d s = p (d p - delta),
    d q += d s k with d s from registers); delta = rowsum(d o * o) of its queries is taken from the
    tiles and kept for the keys' pass. */
__global__ void __launch_bounds__(threads, 1)
    backward_queries(__grid_constant__ CUtensorMap const qkv, __grid_constant__ CUtensorMap const d_out_map,
                     __grid_constant__ CUtensorMap const out_map, arguments_t args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t raw[];
    uint8_t* base = raw + ((1024 - (shared_address(raw) & 1023)) & 1023);
    uint8_t* q_tile = base;
    uint8_t* d_out_tile = base + box_bytes;
    uint8_t* out_tile = base + 2 * box_bytes;
    uint8_t* k_tiles = base + 3 * box_bytes;
    uint8_t* v_tiles = k_tiles + stages * box_bytes;
    uint64_t* q_full = (uint64_t*)(v_tiles + stages * box_bytes);
    uint64_t* k_full = q_full + 1;
    uint64_t* v_full = k_full + stages;
    uint64_t* empty = v_full + stages;
    asm volatile("griddepcontrol.wait;" ::: "memory"); /* launched as the kernel before drains: read nothing before */
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    int const item = blockIdx.x / args.blocks, head = blockIdx.y;
    int const first = (int)args.segments[4 * item], length = (int)args.segments[4 * item + 1];
    int const q0 = blockIdx.x % args.blocks * block_q;
    if (q0 >= length) return;
    int const key_blocks = (length + block_k - 1) / block_k;
    if (threadIdx.x == 0) {
        barrier_init(q_full, 1);
        for (int s = 0; s != stages; ++s) barrier_init(&k_full[s], 1), barrier_init(&v_full[s], 1), barrier_init(&empty[s], 8);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x >= 2 * consumers) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x != 2 * consumers) return;
        barrier_expect(q_full, 3 * box_bytes);
        load_box(q_tile, &qkv, q_full, head * width, first + q0);
        load_box(d_out_tile, &d_out_map, q_full, head * width, first + q0);
        load_box(out_tile, &out_map, q_full, head * width, first + q0);
        for (int j = 0; j != key_blocks; ++j) {
            int stage = j % stages;
            barrier_wait(&empty[stage], ((j / stages) & 1) ^ 1);
            barrier_expect(&k_full[stage], box_bytes);
            load_box(k_tiles + stage * box_bytes, &qkv, &k_full[stage], args.hidden + head * width, first + j * block_k);
            barrier_expect(&v_full[stage], box_bytes);
            load_box(v_tiles + stage * box_bytes, &qkv, &v_full[stage], 2 * args.hidden + head * width,
                     first + j * block_k);
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    int const group = threadIdx.x / consumers, lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
    float const* lse = args.lse + (size_t)head * args.stride + first;
    float row_lse[2], delta[2];
    barrier_wait(q_full, 0);
#pragma unroll
    for (int r = 0; r != 2; ++r) { /* the quad's four threads take 16 columns each of rows r and r + 8 */
        int row = group * 64 + warp * 16 + lane / 4 + 8 * r;
        float partial = 0;
#pragma unroll
        for (int c = 0; c != 16; c += 2) {
            float2 o = tile_pair(out_tile, row, 16 * (lane % 4) + c), d = tile_pair(d_out_tile, row, 16 * (lane % 4) + c);
            partial += o.x * d.x + o.y * d.y;
        }
        partial += __shfl_xor_sync(0xffffffffu, partial, 1);
        partial += __shfl_xor_sync(0xffffffffu, partial, 2);
        delta[r] = partial;
        bool valid = q0 + row < length;
        row_lse[r] = valid ? lse[q0 + row] * 1.4426950409f : INFINITY; /* p = 0 past the item */
        if (valid && lane % 4 == 0) args.delta[(size_t)head * args.stride + first + q0 + row] = partial;
    }
    float d_q[32];
#pragma unroll
    for (int i = 0; i != 32; ++i) d_q[i] = 0;
    uint8_t const* q_rows = q_tile + group * 64 * 128;
    uint8_t const* d_out_rows = d_out_tile + group * 64 * 128;
    if (group == 1) pass_turn(1);
    for (int j = 0; j != key_blocks; ++j) {
        int stage = j % stages;
        uint8_t const* k_rows = k_tiles + stage * box_bytes;
        uint8_t const* v_rows = v_tiles + stage * box_bytes;
        float s[64], dp[64];
        barrier_wait(&k_full[stage], (j / stages) & 1);
        barrier_wait(&v_full[stage], (j / stages) & 1);
        take_turn(group);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int step = 0; step != width / 16; ++step)
            multiply(s, descriptor(q_rows + step * 32), descriptor(k_rows + step * 32), step > 0);
#pragma unroll
        for (int step = 0; step != width / 16; ++step)
            multiply(dp, descriptor(d_out_rows + step * 32), descriptor(v_rows + step * 32), step > 0);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        pass_turn(group);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        pin(s), pin(dp);
        int const key0 = j * block_k + 2 * (lane % 4);
        uint32_t ds[8][4];
#pragma unroll
        for (int t = 0; t != 8; ++t)
#pragma unroll
            for (int h = 0; h != 4; ++h) {
                float v[2];
#pragma unroll
                for (int e = 0; e != 2; ++e) {
                    int i = 8 * t + 2 * h + e, r = h % 2; /* value i: key 8(i / 4) + (i % 2), row r */
                    float p = key0 + 8 * (i / 4) + (i % 2) < length ? exp2_approx(fmaf(s[i], scale_log2, -row_lse[r])) : 0.0f;
                    v[e] = p * (dp[i] - delta[r]);
                }
                ds[t][h] = pack(v[0], v[1]);
            }
        pin32(d_q);
        take_turn(group);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int t = 0; t != 8; ++t) multiply_pv(d_q, ds[t], descriptor(k_rows + t * 16 * 128));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        if (group == 0 || j + 1 != key_blocks) pass_turn(group);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        pin32(d_q);
        if (lane == 0) barrier_arrive(&empty[stage]);
    }
    write_rows(d_q, args.d_qkv + (size_t)(first + q0) * 3 * args.hidden + head * width, 3 * (size_t)args.hidden,
               group * 64, length - q0, scale);
#else
    __trap();
#endif
}

/*  The keys' pass: d k and d v for 128 keys of an item and a head, over all its queries, with the
    scores transposed so each warpgroup holds its 64 keys' rows: s^T = k q^T, p^T from the queries'
    log-sum-exps, d p^T = v d o^T, d s^T = p^T (d p^T - delta); d v += p^T d o and d k += d s^T q take
    p^T and d s^T from registers. */
__global__ void __launch_bounds__(threads, 1)
    backward_keys(__grid_constant__ CUtensorMap const qkv, __grid_constant__ CUtensorMap const d_out_map,
                  arguments_t args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t raw[];
    uint8_t* base = raw + ((1024 - (shared_address(raw) & 1023)) & 1023);
    uint8_t* k_tile = base;
    uint8_t* v_tile = base + box_bytes;
    uint8_t* q_tiles = base + 2 * box_bytes;
    uint8_t* d_out_tiles = q_tiles + stages * box_bytes;
    float* statistics = (float*)(d_out_tiles + stages * box_bytes); /* [group][stage][lse, delta][query] */
    uint64_t* kv_full = (uint64_t*)(statistics + 2 * stages * 2 * block_q);
    uint64_t* q_full = kv_full + 1;
    uint64_t* empty = q_full + stages;
    asm volatile("griddepcontrol.wait;" ::: "memory"); /* launched as the kernel before drains: read nothing before */
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    int const item = blockIdx.x / args.blocks, head = blockIdx.y;
    int const first = (int)args.segments[4 * item], length = (int)args.segments[4 * item + 1];
    int const k0 = blockIdx.x % args.blocks * block_k;
    if (k0 >= length) return;
    int const query_blocks = (length + block_q - 1) / block_q;
    if (threadIdx.x == 0) {
        barrier_init(kv_full, 1);
        for (int s = 0; s != stages; ++s) barrier_init(&q_full[s], 1), barrier_init(&empty[s], 8);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x >= 2 * consumers) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
        if (threadIdx.x != 2 * consumers) return;
        barrier_expect(kv_full, 2 * box_bytes);
        load_box(k_tile, &qkv, kv_full, args.hidden + head * width, first + k0);
        load_box(v_tile, &qkv, kv_full, 2 * args.hidden + head * width, first + k0);
        for (int i = 0; i != query_blocks; ++i) {
            int stage = i % stages;
            barrier_wait(&empty[stage], ((i / stages) & 1) ^ 1);
            barrier_expect(&q_full[stage], 2 * box_bytes);
            load_box(q_tiles + stage * box_bytes, &qkv, &q_full[stage], head * width, first + i * block_q);
            load_box(d_out_tiles + stage * box_bytes, &d_out_map, &q_full[stage], head * width, first + i * block_q);
        }
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    int const group = threadIdx.x / consumers, lane = threadIdx.x % 32;
    float const* lse = args.lse + (size_t)head * args.stride + first;
    float const* delta = args.delta + (size_t)head * args.stride + first;
    float d_k[32], d_v[32];
#pragma unroll
    for (int i = 0; i != 32; ++i) d_k[i] = 0, d_v[i] = 0;
    barrier_wait(kv_full, 0);
    uint8_t const* k_rows = k_tile + group * 64 * 128;
    uint8_t const* v_rows = v_tile + group * 64 * 128;
    if (group == 1) pass_turn(1);
    for (int i = 0; i != query_blocks; ++i) {
        int stage = i % stages;
        uint8_t const* q_rows = q_tiles + stage * box_bytes;
        uint8_t const* d_out_rows = d_out_tiles + stage * box_bytes;
        /* The block's 128 queries' log-sum-exps (infinite past the item: p = 0) and deltas, through this
           warpgroup's shared copy for the stage (rewritten two blocks on, after the next sync). */
        float* column_lse = statistics + (group * stages + stage) * 2 * block_q;
        float* column_delta = column_lse + block_q;
        {
            int query = i * block_q + threadIdx.x % consumers;
            bool valid = query < length;
            column_lse[threadIdx.x % consumers] = valid ? lse[query] * 1.4426950409f : INFINITY;
            column_delta[threadIdx.x % consumers] = valid ? delta[query] : 0.0f;
            group_sync(group);
        }
        float s[64], dp[64];
        barrier_wait(&q_full[stage], (i / stages) & 1);
        take_turn(group);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int step = 0; step != width / 16; ++step)
            multiply(s, descriptor(k_rows + step * 32), descriptor(q_rows + step * 32), step > 0);
#pragma unroll
        for (int step = 0; step != width / 16; ++step)
            multiply(dp, descriptor(v_rows + step * 32), descriptor(d_out_rows + step * 32), step > 0);
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        pass_turn(group);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        pin(s), pin(dp);
        uint32_t p[8][4], ds[8][4];
#pragma unroll
        for (int t = 0; t != 8; ++t)
#pragma unroll
            for (int h = 0; h != 4; ++h) {
                float pv[2], dv[2];
#pragma unroll
                for (int e = 0; e != 2; ++e) {
                    int v = 8 * t + 2 * h + e, column = 8 * (v / 4) + 2 * (lane % 4) + (v % 2); /* value v's query */
                    float x = exp2_approx(fmaf(s[v], scale_log2, -column_lse[column])); /* 0 past the item */
                    pv[e] = x;
                    dv[e] = x * (dp[v] - column_delta[column]);
                }
                p[t][h] = pack(pv[0], pv[1]);
                ds[t][h] = pack(dv[0], dv[1]);
            }
        pin32(d_v), pin32(d_k);
        take_turn(group);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
        for (int t = 0; t != 8; ++t) multiply_pv(d_v, p[t], descriptor(d_out_rows + t * 16 * 128));
#pragma unroll
        for (int t = 0; t != 8; ++t) multiply_pv(d_k, ds[t], descriptor(q_rows + t * 16 * 128));
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        if (group == 0 || i + 1 != query_blocks) pass_turn(group);
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        pin32(d_v), pin32(d_k);
        if (lane == 0) barrier_arrive(&empty[stage]);
    }
    size_t pitch = 3 * (size_t)args.hidden;
    __nv_bfloat16* rows = args.d_qkv + (size_t)(first + k0) * pitch + head * width;
    write_rows(d_k, rows + args.hidden, pitch, group * 64, length - k0, scale);
    write_rows(d_v, rows + 2 * args.hidden, pitch, group * 64, length - k0, 1.0f);
#else
    __trap();
#endif
}

} // namespace uform_flash

namespace uform_flash {

/** The grid of items x blocks by heads, or false where the sizes outgrow its ints. */
static inline bool grid(size_t count, size_t longest, size_t tokens, size_t hidden, size_t stride, dim3* shape,
                        int* blocks) {
    size_t per_item = (longest + block_q - 1) / block_q;
    if (!count || !per_item || hidden % width || hidden / width > 65535 || count * per_item >= (1u << 31) ||
        3 * hidden * tokens >= (1ull << 40) || stride < tokens || stride * (hidden / width) >= (1ull << 62))
        return false;
    *shape = dim3((unsigned)(count * per_item), (unsigned)(hidden / width));
    *blocks = (int)per_item;
    return true;
}

template <typename... Parameters, typename... Arguments>
static inline cudaError_t launch(void (*kernel)(Parameters...), dim3 shape, size_t shared, cudaStream_t stream,
                                 bool dependent, Arguments... arguments) {
    cudaError_t error = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared);
    if (error != cudaSuccess) return error;
    cudaLaunchAttribute overlap;
    overlap.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    overlap.val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t config = {shape, dim3(threads), shared, stream, &overlap, dependent ? 1u : 0u};
    return cudaLaunchKernelEx(&config, kernel, arguments...);
}

} // namespace uform_flash

/** Launches the forward pass on `stream`: out (tokens, hidden) for the items' rows and lse (heads, stride). `segments`
 *  holds `count` items as (start, length, -, -) on the device; `longest` is the longest item's length. */
static inline cudaError_t uform_flash_forward(uform_hopper_encoder_t encode, cudaStream_t stream, bool dependent,
                                              __nv_bfloat16* out, float* lse, __nv_bfloat16 const* qkv,
                                              uint32_t const* segments, size_t count, size_t longest, size_t tokens,
                                              size_t hidden, size_t stride) {
    using namespace uform_flash;
    dim3 shape;
    int blocks;
    if (!grid(count, longest, tokens, hidden, stride, &shape, &blocks)) return count ? cudaErrorInvalidValue : cudaSuccess;
    CUtensorMap qkv_map;
    if (!uform_hopper_map(encode, &qkv_map, qkv, tokens, 3 * hidden, block_q)) return cudaErrorInvalidValue;
    uform_flash::arguments_t args = {out, nullptr, lse, nullptr, segments, (int)hidden, (int)stride, blocks};
    return launch(forward, shape, forward_bytes, stream, dependent, qkv_map, args);
}

/** Launches both backward passes on `stream`: d_qkv's rows of the items (other rows untouched), through delta
 *  (heads, stride) floats of scratch. */
static inline cudaError_t uform_flash_backward(uform_hopper_encoder_t encode, cudaStream_t stream, bool dependent,
                                               __nv_bfloat16* d_qkv, float* delta, __nv_bfloat16 const* d_out,
                                               __nv_bfloat16 const* out, float const* lse, __nv_bfloat16 const* qkv,
                                               uint32_t const* segments, size_t count, size_t longest, size_t tokens,
                                               size_t hidden, size_t stride) {
    using namespace uform_flash;
    dim3 shape;
    int blocks;
    if (!grid(count, longest, tokens, hidden, stride, &shape, &blocks)) return count ? cudaErrorInvalidValue : cudaSuccess;
    CUtensorMap qkv_map, d_out_map, out_map;
    if (!uform_hopper_map(encode, &qkv_map, qkv, tokens, 3 * hidden, block_q) ||
        !uform_hopper_map(encode, &d_out_map, d_out, tokens, hidden, block_q) ||
        !uform_hopper_map(encode, &out_map, out, tokens, hidden, block_q))
        return cudaErrorInvalidValue;
    uform_flash::arguments_t args = {nullptr, d_qkv, (float*)lse, delta, segments, (int)hidden, (int)stride, blocks};
    cudaError_t error = launch(backward_queries, shape, queries_bytes, stream, dependent, qkv_map, d_out_map, out_map,
                               args);
    if (error != cudaSuccess) return error;
    return launch(backward_keys, shape, keys_bytes, stream, dependent, qkv_map, d_out_map, args);
}

#endif
