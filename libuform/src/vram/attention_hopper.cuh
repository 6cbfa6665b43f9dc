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
 *  A unit of work is 128 tokens of one item and one head. A persistent grid of one block a
 *  multiprocessor takes units from a counter in device memory as blocks run out, so blocks that
 *  draw short items take more of them. In a block, two warpgroups own 64 of the unit's tokens each
 *  and one thread of a third loads: the unit's own tiles into one of two buffers (the next unit's
 *  land while this one's are used), and the other side's tiles of 128 tokens through a ring of two
 *  stages (128-byte swizzle; past the item's end the tiles hold the next item's tokens, or zeros
 *  past the tensor, and are masked). The two warpgroups take turns issuing their products
 *  (`take_turn`), so the tensor cores run one's products while the other takes its element-wise
 *  work. Each product's operand that is itself a product's result (p, d s, their transposes) goes
 *  from the accumulator's registers straight into the next `wgmma`: the accumulator's layout, 16
 *  columns at a time, is the layout `wgmma` wants for an operand held in registers.
 *
 *  Given the rotary cosines and sines that turned q and k, a table of each token's (`rope.cu` fills
 *  it), d q and d k take the inverse turn in registers as they are written: the gradient of q and k
 *  before the turn, with no pass of its own over d qkv. The loading thread copies the unit's rows of
 *  the table beside its tiles, so the write reads them from shared memory: read from global memory
 *  there, or computed there or by the idle warps, they held up each unit's end.
 *
 *  The backward pass is two passes that each recompute the scores, rather than one that adds each
 *  block's share of d q from several blocks: 7 products of a block's size against 5, and in
 *  exchange no float atomics and no stored scores. Every output element is written once, by one
 *  thread, from sums in a fixed order, whichever block takes its unit: the same inputs give the same
 *  bits, run to run.
 *
 *  The instructions exist on sm_90a only; the host launches these kernels on compute capability 9.0
 *  alone, and a build for another target traps rather than return without writing.
 */
#ifndef UFORM_VRAM_ATTENTION_HOPPER_CUH_
#define UFORM_VRAM_ATTENTION_HOPPER_CUH_

#include "matmul_hopper.cuh"

namespace uform_flash {

constexpr int width = 64, block_q = 128, block_k = 128, stages = 2; /* stages: the backward passes' ring */
constexpr int consumers = 128, threads = 3 * consumers; /* two warpgroups multiply, one thread of the third loads */
constexpr unsigned box_bytes = 128 * width * 2;         /* 128 rows of one head: 16 KiB */
constexpr unsigned turns_bytes = block_q * (width / 2) * sizeof(float2); /* a unit's cosines and sines: 32 KiB */
constexpr size_t keys_extra = 2 * stages * 2 * block_q * sizeof(float); /* the keys' pass's statistics */

/** A block's shared memory (`layout_t`): its two buffers of `resident` tiles and their turns (where `turned`), the
 *  ring, `extra`, the barriers. */
constexpr size_t block_bytes(int resident, size_t extra, bool turned = true) {
    return 1024 /* alignment */ + 2 * (resident * box_bytes + (turned ? turns_bytes : 0)) + 2 * stages * box_bytes +
           extra + (4 + 2 * stages) * 8 + 8;
}
static_assert(block_bytes(3, 0) <= 227 * 1024, "the queries' pass fits a multiprocessor's shared memory");

struct arguments_t {
    __nv_bfloat16* out;       /* forward: (tokens, hidden) */
    __nv_bfloat16* d_qkv;     /* backward: (tokens, 3 hidden), the items' rows written */
    float* lse;               /* (heads, stride): each query's log-sum-exp of its scaled scores, natural log */
    float* delta;             /* (heads, stride): each query's rowsum(d out * out), the queries' pass writes */
    uint32_t const* segments; /* (items, 4): each item's first token and length, then two words not read */
    unsigned* counter;        /* (2): the next unit to take, the blocks done taking; zeros between launches */
    float2 const* turns;      /* backward: (tokens, 32), the rotary cosines and sines that turned q and k, or NULL */
    int hidden, heads, stride; /* stride: at least the tokens */
    int blocks;               /* 128-token blocks of the longest item */
    int units;                /* items x heads x blocks, which the blocks of the grid take in turn */
};

/** A tile to load: the tensor map and the column where its 64 columns start. */
struct box_t {
    CUtensorMap const* map;
    int column;
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
    warpgroup 0's, which warpgroup 1 opens; warpgroup 0 takes one turn more at the end, the one
    warpgroup 1's last pass opened, so every arrival is matched (`multiply_units`). */
__device__ __forceinline__ void take_turn(int group) { asm volatile("bar.sync %0, 256;" ::"r"(3 + group) : "memory"); }
__device__ __forceinline__ void pass_turn(int group) { asm volatile("bar.arrive %0, 256;" ::"r"(4 - group) : "memory"); }

/** In this warpgroup's turn at the tensor cores (or at once, without `turns`), o += p x rows: p, 64 x 128 from
 *  registers in 8 slices of 16 columns, times 128 rows of a tile in shared memory; returns with the product done. */
__device__ __forceinline__ void accumulate_in_turn(int group, float (&o)[32], uint32_t const (&p)[8][4],
                                                   uint8_t const* rows, bool turns = true) {
    pin32(o);
    if (turns) take_turn(group);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int t = 0; t != 8; ++t) multiply_pv(o, p[t], descriptor(rows + t * 16 * 128));
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    if (turns) pass_turn(group);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    pin32(o);
}

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
/** One block's unit of work: 128 tokens (from `start` on) of one item, for one head. */
struct unit_t {
    int head, first, length, start; /* the item's first token in the stream and its length */
};

/** The unit at `index` (items, then heads, then blocks of 128 tokens: an item's blocks run side by side and share
 *  their reads of the other side's tiles through L2), or false where the item ends before its block. */
__device__ __forceinline__ bool unit_at(arguments_t const& args, int index, unit_t* unit) {
    int block = index % args.blocks, rest = index / args.blocks;
    unit->head = rest % args.heads;
    int item = rest / args.heads;
    unit->first = (int)args.segments[4 * item], unit->length = (int)args.segments[4 * item + 1];
    unit->start = block * block_q;
    return unit->start < unit->length;
}

/*  A block's shared memory: two buffers of its units' `resident` tiles (one being used while the next unit's load),
    each followed by the unit's rows of the turns where the kernel takes turns (`turned`), the ring of `stages` pairs of
    tiles streamed past them, the caller's `extra` bytes, then the barriers. */
struct layout_t {
    uint8_t* resident[2];
    uint8_t* ring;
    uint8_t* extra;
    uint64_t *resident_full, *resident_empty, *full, *empty; /* [2], [2], [stages], [stages] */
    int* taken; /* [2]: the unit each resident buffer holds; `units` or more for none left */
};

/** The turns of the unit whose `resident` tiles are at `tiles`: (128 rows, 32 pairs). */
template <int resident>
__device__ __forceinline__ float2 const* turns_after(uint8_t const* tiles) {
    return (float2 const*)(tiles + resident * box_bytes);
}

template <int resident, bool turned = true>
__device__ __forceinline__ layout_t lay_out(uint8_t* raw, size_t extra) {
    layout_t l;
    uint8_t* base = raw + ((1024 - (shared_address(raw) & 1023)) & 1023);
    size_t const buffer = resident * box_bytes + (turned ? turns_bytes : 0);
    l.resident[0] = base, l.resident[1] = base + buffer;
    l.ring = base + 2 * buffer;
    l.extra = l.ring + 2 * stages * box_bytes;
    l.resident_full = (uint64_t*)(l.extra + extra);
    l.resident_empty = l.resident_full + 2, l.full = l.resident_empty + 2, l.empty = l.full + stages;
    l.taken = (int*)(l.empty + stages);
    if (threadIdx.x == 0) {
        for (int b = 0; b != 2; ++b) barrier_init(&l.resident_full[b], 1), barrier_init(&l.resident_empty[b], 8);
        for (int s = 0; s != stages; ++s) barrier_init(&l.full[s], 1), barrier_init(&l.empty[s], 8);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    /* Launched as the kernel before it drains: nothing is read before that one ends. */
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    return l;
}

/*  The loading thread: takes units from the shared counter until none is left (blocks that draw short items take
    more of them), and for each, its `resident` tiles (the unit's 128 tokens; `resident_box(unit, i)` gives tile i's
    map and column), then the item's blocks of 128 tokens of two streamed tiles each (`streamed_box`) through the
    ring, one pass round the ring continuing the last. Which block computes a unit changes nothing in its result. */
template <int resident, typename resident_t, typename streamed_t>
__device__ __forceinline__ void load(arguments_t const& args, layout_t const& l, resident_t resident_box,
                                     streamed_t streamed_box) {
    unsigned entry = 0;
    for (unsigned turn = 0;; ++turn) {
        int b = turn % 2, index;
        unit_t unit;
        barrier_wait(&l.resident_empty[b], ((turn / 2) & 1) ^ 1);
        do index = (int)atomicAdd(&args.counter[0], 1u);
        while (index < args.units && !unit_at(args, index, &unit));
        l.taken[b] = index;
        if (index >= args.units) {
            /* The last block to run out zeroes the counter for the next launch: no block takes a unit after it. */
            if (atomicAdd(&args.counter[1], 1u) == gridDim.x - 1) args.counter[0] = 0, args.counter[1] = 0;
            barrier_arrive(&l.resident_full[b]);
            return;
        }
        /* The unit's rows of the turns, a block of bytes (rows past the item are not read). */
        unsigned turned = args.turns ? (unsigned)min(block_q, unit.length - unit.start) * (width / 2) * 8 : 0;
        barrier_expect(&l.resident_full[b], resident * box_bytes + turned);
        for (int i = 0; i != resident; ++i) {
            box_t box = resident_box(unit, i);
            load_box(l.resident[b] + i * box_bytes, box.map, &l.resident_full[b], box.column, unit.first + unit.start);
        }
        if (turned)
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         :
                         : "r"(shared_address(l.resident[b] + resident * box_bytes)),
                           "l"(args.turns + (size_t)(unit.first + unit.start) * (width / 2)), "r"(turned),
                           "r"(shared_address(&l.resident_full[b]))
                         : "memory");
        for (int j = 0; j * block_k < unit.length; ++j, ++entry) {
            int stage = entry % stages;
            barrier_wait(&l.empty[stage], ((entry / stages) & 1) ^ 1);
            barrier_expect(&l.full[stage], 2 * box_bytes);
            for (int i = 0; i != 2; ++i) {
                box_t box = streamed_box(unit, i);
                load_box(l.ring + (2 * stage + i) * box_bytes, box.map, &l.full[stage], box.column,
                         unit.first + j * block_k);
            }
        }
    }
}

/** The loading warpgroup's part: it gives its registers up, and its first thread loads. */
template <int resident, typename resident_t, typename streamed_t>
__device__ __forceinline__ void loader(arguments_t const& args, layout_t const& l, resident_t resident_box,
                                       streamed_t streamed_box) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 2 * consumers) load<resident>(args, l, resident_box, streamed_box);
}

/** A multiplying warpgroup's sequence over the units its loading thread took: `step(unit, resident tiles, ring
 *  entry)` per unit, once its tiles landed; the turns opened and closed around all of them. */
template <typename step_t>
__device__ __forceinline__ void multiply_units(arguments_t const& args, layout_t const& l, step_t step) {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
    int const group = threadIdx.x / consumers, lane = threadIdx.x % 32;
    if (group == 1) pass_turn(1);
    unsigned entry = 0;
    for (unsigned turn = 0;; ++turn) {
        int b = turn % 2;
        barrier_wait(&l.resident_full[b], (turn / 2) & 1);
        int index = ((int volatile*)l.taken)[b];
        if (index >= args.units) break;
        unit_t unit;
        unit_at(args, index, &unit);
        step(unit, l.resident[b], entry);
        if (lane == 0) barrier_arrive(&l.resident_empty[b]); /* the step's last products have finished */
    }
    if (group == 0) take_turn(0); /* warpgroup 1's last pass */
}
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/*  The forward's softmax of block j of scores s (64 x 128, this warpgroup's fragment), kept online: masks the keys
    past the item's end (only the block the item ends in has any), moves the rows' running
    `maximum`, rescales their `sum` and returns in `correction` what rescales their output, turns s into the block's
    probabilities and adds them to `sum`. Thread (warp w, lane l) holds keys 8c + 2(l % 4) and the next (values 4c,
    4c + 1) of query row 16w + l / 4, and the same keys 8 rows below (4c + 2, 4c + 3). */
__device__ __forceinline__ void soften(float (&s)[64], float (&maximum)[2], float (&sum)[2], float (&correction)[2],
                                       int j, int length) {
    int const key0 = j * block_k + 2 * (threadIdx.x % 32 % 4);
    if ((j + 1) * block_k > length) /* the block the item ends in; the others skip ~14 % of their instructions */
#pragma unroll
        for (int c = 0; c != 16; ++c)
#pragma unroll
            for (int e = 0; e != 4; ++e)
                if (key0 + 8 * c + (e & 1) >= length) s[4 * c + e] = -INFINITY;
    float block_max[2] = {-INFINITY, -INFINITY}; /* of the unscaled scores */
#pragma unroll
    for (int c = 0; c != 16; ++c)
#pragma unroll
        for (int e = 0; e != 4; ++e) block_max[e / 2] = fmaxf(block_max[e / 2], s[4 * c + e]);
    float shift[2];
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
}

/** Probabilities s as `wgmma`'s register operand: keys 16t..16t+15, rows r and r + 8, keys 2(l % 4) and + 8. */
__device__ __forceinline__ void pack_operand(uint32_t (&p)[8][4], float const (&s)[64]) {
#pragma unroll
    for (int t = 0; t != 8; ++t) {
        p[t][0] = pack(s[8 * t + 0], s[8 * t + 1]);
        p[t][1] = pack(s[8 * t + 2], s[8 * t + 3]);
        p[t][2] = pack(s[8 * t + 4], s[8 * t + 5]);
        p[t][3] = pack(s[8 * t + 6], s[8 * t + 7]);
    }
}

/** Issues s = q k^T (64 x 128, over a head's 64 columns; each operand's rows in shared memory), uncommitted. */
__device__ __forceinline__ void issue_scores(float (&s)[64], uint8_t const* q_rows, uint8_t const* k_rows) {
#pragma unroll
    for (int step = 0; step != width / 16; ++step)
        multiply(s, descriptor(q_rows + step * 32), descriptor(k_rows + step * 32), step > 0);
}
#endif

/*  The forward pass: out and lse for 128 queries of an item and a head (resident: q), over the item's
    keys and values (streamed through the ring), the softmax kept online: each block of scores moves the
    running maximum, rescales the running sum and output, and adds its own. It takes no turns, so its
    layout leaves their shared memory out. Without `turns` (a trial) the two warpgroups issue their products as
    they come rather than in turns: each sums its own rows, so the same bits. */
template <bool turns>
__global__ void __launch_bounds__(threads, 1) forward(__grid_constant__ CUtensorMap const qkv, arguments_t args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t raw[];
    layout_t const l = lay_out<1, false>(raw, 0);
    if (threadIdx.x >= 2 * consumers)
        return loader<1>(args, l, [&](unit_t const& unit, int) { return box_t{&qkv, unit.head * width}; },
                         [&](unit_t const& unit, int i) { return box_t{&qkv, (1 + i) * args.hidden + unit.head * width}; });
    int const group = threadIdx.x / consumers, lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
    multiply_units(args, l, [&](unit_t const& unit, uint8_t const* tiles, unsigned& entry) {
        float o[32], maximum[2] = {-INFINITY, -INFINITY}, sum[2] = {0, 0};
#pragma unroll
        for (int i = 0; i != 32; ++i) o[i] = 0;
        uint8_t const* q_rows = tiles + group * 64 * 128;
        for (int j = 0; j * block_k < unit.length; ++j, ++entry) {
            int stage = entry % stages;
            uint8_t const* k_rows = l.ring + 2 * stage * box_bytes;
            float s[64], correction[2];
            barrier_wait(&l.full[stage], (entry / stages) & 1);
            if (turns) take_turn(group);
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
            issue_scores(s, q_rows, k_rows);
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            if (turns) pass_turn(group);
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            pin(s);
            soften(s, maximum, sum, correction, j, unit.length);
#pragma unroll
            for (int i = 0; i != 32; ++i) o[i] *= correction[i % 4 / 2];
            uint32_t p[8][4];
            pack_operand(p, s);
            accumulate_in_turn(group, o, p, k_rows + box_bytes, turns);
            if (lane == 0) barrier_arrive(&l.empty[stage]);
        }
#pragma unroll
        for (int r = 0; r != 2; ++r) {
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
            int row = unit.start + group * 64 + warp * 16 + lane / 4 + 8 * r;
            if (row >= unit.length) continue;
            size_t token = (size_t)unit.first + row;
            float inverse = 1.0f / sum[r];
            __nv_bfloat16* out = args.out + token * args.hidden + unit.head * width + 2 * (lane % 4);
#pragma unroll
            for (int c = 0; c != 8; ++c)
                *(uint32_t*)(out + 8 * c) = pack(o[4 * c + 2 * r] * inverse, o[4 * c + 2 * r + 1] * inverse);
            if (lane % 4 == 0)
                args.lse[(size_t)unit.head * args.stride + token] =
                    (maximum[r] * scale_log2 + log2f(sum[r])) * 0.69314718056f;
        }
    });
#else
    __trap(); /* built without sm_90a's instructions: fail loudly, never leave the outputs unwritten */
#endif
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/** Writes a warpgroup's 64 x 64 fragment times `factor` as bf16 to rows `row0`.. of `out` (row stride `pitch`),
 *  the rows before `rows` only. Given the unit's `turns` (`turns_after`), each pair (the thread's columns 2i, 2i + 1)
 *  takes the inverse rotary turn of its row first. */
__device__ __forceinline__ void write_rows(float const (&d)[32], __nv_bfloat16* out, size_t pitch, int row0, int rows,
                                           float factor, float2 const* turns = nullptr) {
    int const lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
#pragma unroll
    for (int r = 0; r != 2; ++r) {
        int row = row0 + warp * 16 + lane / 4 + 8 * r;
        if (row >= rows) continue;
        __nv_bfloat16* at = out + (size_t)row * pitch + 2 * (lane % 4);
#pragma unroll
        for (int c = 0; c != 8; ++c) {
            float x = d[4 * c + 2 * r] * factor, y = d[4 * c + 2 * r + 1] * factor;
            if (turns) {
                float2 t = turns[row * (width / 2) + 4 * c + lane % 4];
                float turned = x * t.x + y * t.y; /* by minus the angle */
                y = y * t.x - x * t.y, x = turned;
            }
            *(uint32_t*)(at + 8 * c) = pack(x, y);
        }
    }
}

/** In this warpgroup's turn at the tensor cores, s = a b^T and t = c e^T (64 x 128 each, over a head's 64 columns;
 *  each operand 64 or 128 rows of a tile in shared memory); returns with both done. */
__device__ __forceinline__ void score_pair(int group, float (&s)[64], uint8_t const* a, uint8_t const* b, float (&t)[64],
                                           uint8_t const* c, uint8_t const* e) {
    take_turn(group);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int step = 0; step != width / 16; ++step)
        multiply(s, descriptor(a + step * 32), descriptor(b + step * 32), step > 0);
#pragma unroll
    for (int step = 0; step != width / 16; ++step)
        multiply(t, descriptor(c + step * 32), descriptor(e + step * 32), step > 0);
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    pass_turn(group);
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    pin(s), pin(t);
}

/** The bf16 pair at (row, column) of a 128-byte-swizzled tile of 64 columns. */
__device__ __forceinline__ float2 tile_pair(uint8_t const* tile, int row, int column) {
    return __bfloat1622float2(*(__nv_bfloat162 const*)(tile + row * 128 + (((column / 8) ^ (row % 8)) * 16) +
                                                       (column % 8) * 2));
}
#endif

/*  The queries' pass: d q for 128 queries of an item and a head (resident: q, d out, out), over the
    item's keys and values (streamed), as the forward walks them: s = q k^T and p again from the
    log-sum-exps, d p = d o v^T, d s = p (d p - delta), d q += d s k with d s from registers. delta =
    rowsum(d o * o) of its queries is taken from the tiles and kept for the keys' pass. */
__global__ void __launch_bounds__(threads, 1)
    backward_queries(__grid_constant__ CUtensorMap const qkv, __grid_constant__ CUtensorMap const d_out_map,
                     __grid_constant__ CUtensorMap const out_map, arguments_t args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t raw[];
    layout_t const l = lay_out<3>(raw, 0);
    if (threadIdx.x >= 2 * consumers)
        return loader<3>(args, l,
                         [&](unit_t const& unit, int i) {
                             return box_t{i == 0 ? &qkv : i == 1 ? &d_out_map : &out_map, unit.head * width};
                         },
                         [&](unit_t const& unit, int i) { return box_t{&qkv, (1 + i) * args.hidden + unit.head * width}; });
    int const group = threadIdx.x / consumers, lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
    multiply_units(args, l, [&](unit_t const& unit, uint8_t const* tiles, unsigned& entry) {
        uint8_t const* q_rows = tiles + group * 64 * 128;
        uint8_t const* d_out_tile = tiles + box_bytes;
        uint8_t const* out_tile = tiles + 2 * box_bytes;
        uint8_t const* d_out_rows = d_out_tile + group * 64 * 128;
        size_t const statistics = (size_t)unit.head * args.stride + unit.first + unit.start;
        float row_lse[2], delta[2];
#pragma unroll
        for (int r = 0; r != 2; ++r) { /* the quad's four threads take 16 columns each of rows r and r + 8 */
            int row = group * 64 + warp * 16 + lane / 4 + 8 * r;
            float partial = 0;
#pragma unroll
            for (int c = 0; c != 16; c += 2) {
                float2 o = tile_pair(out_tile, row, 16 * (lane % 4) + c);
                float2 d = tile_pair(d_out_tile, row, 16 * (lane % 4) + c);
                partial += o.x * d.x + o.y * d.y;
            }
            partial += __shfl_xor_sync(0xffffffffu, partial, 1);
            partial += __shfl_xor_sync(0xffffffffu, partial, 2);
            delta[r] = partial;
            bool valid = unit.start + row < unit.length;
            row_lse[r] = valid ? args.lse[statistics + row] * 1.4426950409f : INFINITY; /* p = 0 past the item */
            if (valid && lane % 4 == 0) args.delta[statistics + row] = partial;
        }
        float d_q[32];
#pragma unroll
        for (int i = 0; i != 32; ++i) d_q[i] = 0;
        for (int j = 0; j * block_k < unit.length; ++j, ++entry) {
            int stage = entry % stages;
            uint8_t const* k_rows = l.ring + 2 * stage * box_bytes;
            uint8_t const* v_rows = k_rows + box_bytes;
            float s[64], dp[64];
            barrier_wait(&l.full[stage], (entry / stages) & 1);
            score_pair(group, s, q_rows, k_rows, dp, d_out_rows, v_rows);
            int const key0 = j * block_k + 2 * (lane % 4);
            /* Value i: key 8(i / 4) + (i % 2) of row i / 2 % 2. p is 0 past the item's end. */
#pragma unroll
            for (int i = 0; i != 64; ++i) s[i] = exp2_approx(fmaf(s[i], scale_log2, -row_lse[i / 2 % 2]));
            if ((j + 1) * block_k > unit.length) /* only the block the item ends in has keys past it */
#pragma unroll
                for (int i = 0; i != 64; ++i)
                    if (key0 + 8 * (i / 4) + (i % 2) >= unit.length) s[i] = 0.0f;
            uint32_t ds[8][4];
#pragma unroll
            for (int t = 0; t != 8; ++t)
#pragma unroll
                for (int h = 0; h != 4; ++h) {
                    float v[2];
#pragma unroll
                    for (int e = 0; e != 2; ++e) {
                        int i = 8 * t + 2 * h + e, r = h % 2;
                        v[e] = s[i] * (dp[i] - delta[r]);
                    }
                    ds[t][h] = pack(v[0], v[1]);
                }
            accumulate_in_turn(group, d_q, ds, k_rows);
            if (lane == 0) barrier_arrive(&l.empty[stage]);
        }
        write_rows(d_q, args.d_qkv + (size_t)(unit.first + unit.start) * 3 * args.hidden + unit.head * width,
                   3 * (size_t)args.hidden, group * 64, unit.length - unit.start, scale,
                   args.turns ? turns_after<3>(tiles) : nullptr);
    });
#else
    __trap();
#endif
}

/*  The keys' pass: d k and d v for 128 keys of an item and a head (resident: k, v), over the item's
    queries and their d out (streamed), with the scores transposed so each warpgroup holds its 64
    keys' rows: s^T = k q^T, p^T from the queries' log-sum-exps, d p^T = v d o^T, d s^T = p^T (d p^T -
    delta); d v += p^T d o and d k += d s^T q take p^T and d s^T from registers. */
__global__ void __launch_bounds__(threads, 1)
    backward_keys(__grid_constant__ CUtensorMap const qkv, __grid_constant__ CUtensorMap const d_out_map,
                  arguments_t args) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t raw[];
    layout_t const l = lay_out<2>(raw, keys_extra);
    if (threadIdx.x >= 2 * consumers)
        return loader<2>(args, l, [&](unit_t const& unit, int i) { return box_t{&qkv, (1 + i) * args.hidden + unit.head * width}; },
                         [&](unit_t const& unit, int i) { return box_t{i == 0 ? &qkv : &d_out_map, unit.head * width}; });
    int const group = threadIdx.x / consumers, lane = threadIdx.x % 32;
    float* statistics = (float*)l.extra; /* [group][stage][lse, delta][query] */
    multiply_units(args, l, [&](unit_t const& unit, uint8_t const* tiles, unsigned& entry) {
        float const* lse = args.lse + (size_t)unit.head * args.stride + unit.first;
        float const* delta = args.delta + (size_t)unit.head * args.stride + unit.first;
        uint8_t const* k_rows = tiles + group * 64 * 128;
        uint8_t const* v_rows = tiles + box_bytes + group * 64 * 128;
        float d_k[32], d_v[32];
#pragma unroll
        for (int i = 0; i != 32; ++i) d_k[i] = 0, d_v[i] = 0;
        for (int i = 0; i * block_q < unit.length; ++i, ++entry) {
            int stage = entry % stages;
            uint8_t const* q_rows = l.ring + 2 * stage * box_bytes;
            uint8_t const* d_out_rows = q_rows + box_bytes;
            /* The block's 128 queries' log-sum-exps (infinite past the item: p = 0) and deltas, through this
               warpgroup's shared copy for the stage (rewritten two blocks on, after the next sync). */
            float* column_lse = statistics + (group * stages + stage) * 2 * block_q;
            float* column_delta = column_lse + block_q;
            {
                int query = i * block_q + threadIdx.x % consumers;
                bool valid = query < unit.length;
                column_lse[threadIdx.x % consumers] = valid ? lse[query] * 1.4426950409f : INFINITY;
                column_delta[threadIdx.x % consumers] = valid ? delta[query] : 0.0f;
                group_sync(group);
            }
            float s[64], dp[64];
            barrier_wait(&l.full[stage], (entry / stages) & 1);
            score_pair(group, s, k_rows, q_rows, dp, v_rows, d_out_rows);
            uint32_t p[8][4], ds[8][4];
#pragma unroll
            for (int t = 0; t != 8; ++t)
#pragma unroll
                for (int h = 0; h != 4; ++h) {
                    float pv[2], dv[2];
#pragma unroll
                    for (int e = 0; e != 2; ++e) {
                        int v = 8 * t + 2 * h + e, column = 8 * (v / 4) + 2 * (lane % 4) + (v % 2); /* v's query */
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
            pass_turn(group);
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
            pin32(d_v), pin32(d_k);
            if (lane == 0) barrier_arrive(&l.empty[stage]);
        }
        size_t pitch = 3 * (size_t)args.hidden;
        __nv_bfloat16* rows = args.d_qkv + (size_t)(unit.first + unit.start) * pitch + unit.head * width;
        write_rows(d_k, rows + args.hidden, pitch, group * 64, unit.length - unit.start, scale,
                   args.turns ? turns_after<2>(tiles) : nullptr);
        write_rows(d_v, rows + 2 * args.hidden, pitch, group * 64, unit.length - unit.start, 1.0f);
    });
#else
    __trap();
#endif
}

} // namespace uform_flash

namespace uform_flash {

/** The arguments' shape of the work (heads, blocks, units) and a grid of one block a multiprocessor, or false where
 *  the sizes outgrow the kernels' ints. */
static inline bool plan(arguments_t* args, size_t count, size_t longest, size_t tokens, size_t hidden, size_t stride,
                        int multiprocessors, dim3* shape) {
    size_t blocks = (longest + block_q - 1) / block_q, heads = hidden / width, units = count * heads * blocks;
    if (!units || hidden % width || units >= (1u << 31) || 3 * hidden * tokens >= (1ull << 40) || stride < tokens ||
        stride * heads >= (1ull << 62) || tokens >= (1u << 31))
        return false;
    args->hidden = (int)hidden, args->heads = (int)heads, args->stride = (int)stride;
    args->blocks = (int)blocks, args->units = (int)units;
    *shape = dim3((unsigned)(units < (size_t)multiprocessors ? units : (size_t)multiprocessors));
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
 *  holds `count` items as (start, length, -, -) on the device; `longest` is the longest item's length; `counter` is
 *  two words of device memory, zeros before the first launch, that every launch leaves zeros. `turns` false: the
 *  warpgroups issue their products without taking turns (a trial; the same bits). */
static inline cudaError_t uform_flash_forward(uform_hopper_encoder_t encode, int multiprocessors, cudaStream_t stream,
                                              bool dependent, __nv_bfloat16* out, float* lse, __nv_bfloat16 const* qkv,
                                              uint32_t const* segments, size_t count, size_t longest, size_t tokens,
                                              size_t hidden, size_t stride, unsigned* counter, bool turns = true) {
    using namespace uform_flash;
    uform_flash::arguments_t args = {out, nullptr, lse, nullptr, segments, counter};
    dim3 shape;
    if (!count) return cudaSuccess;
    if (!plan(&args, count, longest, tokens, hidden, stride, multiprocessors, &shape)) return cudaErrorInvalidValue;
    CUtensorMap qkv_map;
    if (!uform_hopper_map(encode, &qkv_map, qkv, tokens, 3 * hidden, block_q)) return cudaErrorInvalidValue;
    return launch(turns ? forward<true> : forward<false>, shape, block_bytes(1, 0, false), stream, dependent, qkv_map,
                  args);
}

/** Launches both backward passes on `stream`: d_qkv's rows of the items (other rows untouched), through delta
 *  (heads, stride) floats of scratch. `turns` (tokens, 32), the rotary cosines and sines that turned q and k
 *  (`uform_vram_rope_turns`), make d q and d k the gradients before the turn; NULL for none. */
static inline cudaError_t uform_flash_backward(uform_hopper_encoder_t encode, int multiprocessors, cudaStream_t stream,
                                               bool dependent, __nv_bfloat16* d_qkv, float* delta,
                                               __nv_bfloat16 const* d_out, __nv_bfloat16 const* out, float const* lse,
                                               __nv_bfloat16 const* qkv, float2 const* turns,
                                               uint32_t const* segments, size_t count, size_t longest, size_t tokens,
                                               size_t hidden, size_t stride, unsigned* counter) {
    using namespace uform_flash;
    uform_flash::arguments_t args = {nullptr, d_qkv, (float*)lse, delta, segments, counter, turns};
    dim3 shape;
    if (!count) return cudaSuccess;
    if (!plan(&args, count, longest, tokens, hidden, stride, multiprocessors, &shape)) return cudaErrorInvalidValue;
    CUtensorMap qkv_map, d_out_map, out_map;
    if (!uform_hopper_map(encode, &qkv_map, qkv, tokens, 3 * hidden, block_q) ||
        !uform_hopper_map(encode, &d_out_map, d_out, tokens, hidden, block_q) ||
        !uform_hopper_map(encode, &out_map, out, tokens, hidden, block_q))
        return cudaErrorInvalidValue;
    cudaError_t error = launch(backward_queries, shape, block_bytes(3, 0), stream, dependent, qkv_map, d_out_map,
                               out_map, args);
    if (error != cudaSuccess) return error;
    return launch(backward_keys, shape, block_bytes(2, keys_extra), stream, dependent, qkv_map, d_out_map, args);
}

#endif
