// Row softmax of the long path: FP32 scores in, P (fp16/bf16, may overwrite the scores in place) and LSE out.
//
// Each visible score is read from memory once (4 B; groups of four keys wholly past a row's causal limit are not
// read: their P is 0) and P written once (2 B) while the row fits on chip:
//  * PIPE (the default from 4096 columns): persistent CTAs; while a CTA reduces and writes one row, the next
//    rows stream into a 2-3 slot shared-memory ring by cp.async, so loads are always in flight and the bytes
//    that wait for their row's max and sum sit in shared memory rather than registers. Rows whose ring does not
//    fit one CTA (on Hopper over 28160 columns; the ring takes what the device lets a block opt in to) are split
//    over a cluster of 2, 4 or 8 CTAs on sm_90 (up to 225280);
//  * PIPE_REGS: persistent CTAs, two an SM, the row in registers and the next one in a single slot: unmasked rows
//    without the attention mass of up to 16384 columns, where PIPE's two slots fit one CTA an SM only and the
//    DRAM outruns one CTA an SM (H200, not H100: regs_preferred);
//  * ROW: one CTA a row, the row in registers (up to 32768 columns; the default below 4096 columns, and for few
//    decode rows that PIPE would split over a cluster: row_preferred);
// Longer rows take TWO_PASS (an online max/sum pass, then a pass that re-reads and writes P), tile by tile so
// that in-place writes never overrun unread scores.
#include "attn_lt.h"

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <vector>

#ifndef ATTN_LT_SOURCE_HASH
#define ATTN_LT_SOURCE_HASH "unknown"
#endif

namespace {

namespace cg = cooperative_groups;

#include "common.cuh"
constexpr int64_t kRowMaxCols = 32768;       // ROW: 1024 threads x 32 floats
constexpr int kMaxCluster = 8;               // portable cluster size

struct Row {
    const float* s;
    char* p;
    float* lse;
    const char* mask;  // mask at (b, h, q, key 0), or nullptr
    int64_t limit;     // last visible key, inclusive (may be negative: all masked)
    bool mask_vec;     // mask keys contiguous and 4-key aligned: 4 keys in one load
};

// A `Row` and where its P goes into its head's attention mass per key (written, or added by PIPE; nullptr: the row
// is not in the mass). Kept out of `Row`: PIPE built without the mass holds its row descriptors in shared memory,
// and the one pointer more cost its masked and 28k-column rows 5-9 % (H200 and H100, against a build without any
// mass code).
struct MassRow : Row {
    float* mass;
};

// Query position and head of row r of block e (the long path's row mapping), shared by the softmax and the merge.
struct RowPlace {
    int64_t b, h, q;
};

template <typename Args>
__device__ __forceinline__ RowPlace row_place(const Args& a, int64_t e, int64_t r) {
    const int64_t R = a.row0 + r;
    return {(a.e0 + e) / a.Hkv, (a.e0 + e) % a.Hkv * a.g + a.gi0 + R / a.Sq, R % a.Sq};
}

// Row r of block e: a `Row`, or a `MassRow` with its mass.
template <typename R>
__device__ __forceinline__ R row_info(const attn_lt_softmax_args& a, int64_t e, int64_t r) {
    const RowPlace at = row_place(a, e, r);
    R w;
    w.s = a.scores + e * a.bs_s + r * a.ld_s;
    w.p = static_cast<char*>(a.probs) + (e * a.bs_p + r * a.ld_p) * 2;
    w.lse = a.lse_local ? a.lse + e * a.rows + r : a.lse + (at.b * a.Hq + at.h) * a.Sq + at.q;
    if constexpr (std::is_same<R, MassRow>::value) {
        const bool in_mass = a.mass_add ? at.q >= a.mass_q0 : at.q == a.Sq - 1;
        w.mass = a.mass != nullptr && in_mass ? a.mass + (at.b * a.Hq + at.h) * a.Sk + a.k0 : nullptr;
    }
    int64_t limit = a.cols - 1;
    if (a.causal) limit = min(limit, at.q + a.Sk - a.Sq - a.k0);
    w.limit = limit;
    w.mask = nullptr;
    w.mask_vec = false;
    if (a.mask_dtype != ATTN_LT_NONE) {
        const int esize = a.mask_dtype == ATTN_LT_BOOL ? 1 : (a.mask_dtype == ATTN_LT_F32 ? 4 : 2);
        const int64_t at_key0 = at.b * a.m_sb + at.h * a.m_sh + at.q * a.m_sq + a.k0 * a.m_sk;
        w.mask = static_cast<const char*>(a.mask) + at_key0 * esize;
        w.mask_vec = a.m_sk == 1 && reinterpret_cast<uintptr_t>(w.mask) % (4 * esize) == 0;
    }
    return w;
}

// The user mask of key j as an additive term (a false bool is -inf).
__device__ __forceinline__ float mask1(int64_t j, const Row& w, const attn_lt_softmax_args& a) {
    const int64_t o = j * a.m_sk;
    switch (a.mask_dtype) {
        case ATTN_LT_BOOL: return reinterpret_cast<const uint8_t*>(w.mask)[o] ? 0.f : -INFINITY;
        case ATTN_LT_F16: return __half2float(reinterpret_cast<const __half*>(w.mask)[o]);
        case ATTN_LT_BF16: return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(w.mask)[o]);
        default: return reinterpret_cast<const float*>(w.mask)[o];
    }
}

// Keys j..j+3 (all visible) of a contiguous, aligned mask row at `base` in one load.
__device__ __forceinline__ float4 mask4(const char* base, int64_t j, int dtype) {
    switch (dtype) {
        case ATTN_LT_BOOL: {
            const uchar4 m = *reinterpret_cast<const uchar4*>(base + j);
            return make_float4(m.x ? 0.f : -INFINITY, m.y ? 0.f : -INFINITY, m.z ? 0.f : -INFINITY,
                               m.w ? 0.f : -INFINITY);
        }
        case ATTN_LT_F16: {
            const uint2 u = *reinterpret_cast<const uint2*>(base + j * 2);
            const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
            const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
            return make_float4(lo.x, lo.y, hi.x, hi.y);
        }
        case ATTN_LT_BF16: {
            const uint2 u = *reinterpret_cast<const uint2*>(base + j * 2);
            const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
            const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
            return make_float4(lo.x, lo.y, hi.x, hi.y);
        }
        default: return *reinterpret_cast<const float4*>(base + j * 4);
    }
}

__device__ __forceinline__ float masked1(float x, int64_t j, const Row& w, const attn_lt_softmax_args& a) {
    if (j > w.limit) return -INFINITY;
    return w.mask ? x + mask1(j, w, a) : x;
}

// Scores v = keys j..j+3 after the causal limit and the user mask; keys past the row are -inf.
__device__ __forceinline__ float4 apply_mask(float4 v, int64_t j, const Row& w, const attn_lt_softmax_args& a) {
    if (j + 3 <= w.limit) {  // every key visible: only the mask applies
        if (w.mask) {
            const float4 m = w.mask_vec ? mask4(w.mask, j, a.mask_dtype)
                                        : make_float4(mask1(j, w, a), mask1(j + 1, w, a), mask1(j + 2, w, a),
                                                      mask1(j + 3, w, a));
            v.x += m.x;
            v.y += m.y;
            v.z += m.z;
            v.w += m.w;
        }
        return v;
    }
    v.x = masked1(v.x, j, w, a);
    v.y = masked1(v.y, j + 1, w, a);
    v.z = masked1(v.z, j + 2, w, a);
    v.w = masked1(v.w, j + 3, w, a);
    return v;
}

// Float4 groups of a row holding a visible key: those up to the group of `limit`, the last visible key (negative:
// none). Groups past them are never loaded, since their P is 0 whatever the scores hold.
__device__ __forceinline__ int64_t visible_groups(int64_t limit) { return limit < 0 ? 0 : limit / 4 + 1; }

// Keys j..j+3 of the row, masked; a group past the visible ones (the row's end, or its causal limit) is not read.
__device__ __forceinline__ float4 load_masked(int64_t j, const Row& w, const attn_lt_softmax_args& a) {
    if (j > w.limit) return make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
    return apply_mask(__ldcs(reinterpret_cast<const float4*>(w.s + j)), j, w, a);
}

template <typename T>
__device__ __forceinline__ void store4(char* p, int64_t j, float a, float b, float c, float d);

template <>
__device__ __forceinline__ void store4<__nv_bfloat16>(char* p, int64_t j, float a, float b, float c, float d) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(a, b), hi = __floats2bfloat162_rn(c, d);
    uint2 u;
    u.x = *reinterpret_cast<uint32_t*>(&lo);
    u.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(p + j * 2) = u;
}

template <>
__device__ __forceinline__ void store4<__half>(char* p, int64_t j, float a, float b, float c, float d) {
    __half2 lo = __floats2half2_rn(a, b), hi = __floats2half2_rn(c, d);
    uint2 u;
    u.x = *reinterpret_cast<uint32_t*>(&lo);
    u.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(p + j * 2) = u;
}

// P of keys j..j+3 stored in the output dtype, and in FP32 into the row's attention mass when it has one and the
// mass is written, not added (keys past the row's `cols` are padding of P and not of the mass).
template <typename OutT>
__device__ __forceinline__ void store_p(const MassRow& w, int64_t j, int64_t cols, float x, float y, float z,
                                        float u) {
    store4<OutT>(w.p, j, x, y, z, u);
    if (w.mass == nullptr) return;
    float* m = w.mass + j;
    if (j + 3 < cols && reinterpret_cast<uintptr_t>(m) % 16 == 0) {
        *reinterpret_cast<float4*>(m) = make_float4(x, y, z, u);
        return;
    }
    const float v[4] = {x, y, z, u};
    for (int i = 0; i < 4 && j + i < cols; ++i) m[i] = v[i];
}

// Block-wide max and sum. Each has one barrier; a kernel gives each reduction its own scratch (red[0], red[1]) and
// has another barrier between two uses of the same scratch.
template <int THREADS>
__device__ __forceinline__ float block_max(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < THREADS / 32 ? red[threadIdx.x & 31] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float* red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = (threadIdx.x & 31) < THREADS / 32 ? red[threadIdx.x & 31] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float max4(float4 v) { return fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)); }

// exp(x - m), with the reference m of an all-masked row taken as 0 so that exp(-inf - m) is 0, never NaN, on the ftz
// MUFU.EX2 (common.cuh's ex2: results below 2^-126, far below what P resolves, are 0). Not the FFMA form
// x log2 e - m log2 e: m log2 e overflows for rows masked with finite minima (-3.4e38, Hugging Face's masks).
__device__ __forceinline__ float ex(float x, float mref) { return ex2((x - mref) * kLog2e); }

// v = exp(v - mref) by component; returns their sum as (x + y) + (z + w), as PIPE sums a float4.
__device__ __forceinline__ float ex4(float4& v, float mref) {
    v.x = ex(v.x, mref);
    v.y = ex(v.y, mref);
    v.z = ex(v.z, mref);
    v.w = ex(v.w, mref);
    return (v.x + v.y) + (v.z + v.w);
}

// The LSE of a row from its max (the reference) and the sum of exp(x - max); -inf for a row with nothing visible.
__device__ __forceinline__ float row_lse(float mx, float sum) { return sum > 0.f ? mx + logf(sum) : -INFINITY; }

__device__ __forceinline__ void finish_row(const Row& w, float mx, float sum) {
    if (threadIdx.x == 0) *w.lse = row_lse(mx, sum);
}

template <int THREADS, int NV, typename OutT>
__global__ void __launch_bounds__(THREADS) softmax_resident(const attn_lt_softmax_args a) {
    __shared__ float red[2][32];
    const MassRow w = row_info<MassRow>(a, blockIdx.x % a.batch, blockIdx.x / a.batch);
    float4 v[NV];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        v[i] = load_masked((int64_t(i) * THREADS + threadIdx.x) * 4, w, a);
        mx = fmaxf(mx, max4(v[i]));
    }
    mx = block_max<THREADS>(mx, red[0]);  // every read of the row happens before this barrier
    const float mref = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) sum += ex4(v[i], mref);
    sum = block_sum<THREADS>(sum, red[1]);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const int64_t j = (int64_t(i) * THREADS + threadIdx.x) * 4;
        if (j < a.cols) store_p<OutT>(w, j, a.cols, v[i].x * inv, v[i].y * inv, v[i].z * inv, v[i].w * inv);
    }
    finish_row(w, mref, sum);
}

// Persistent CTAs (or clusters of C CTAs on sm_90) over rows lin = cluster + k * clusters (lin = row * batch +
// entry). CTA `rank` of a cluster owns float4 groups [rank * seg4, (rank + 1) * seg4) of every row. Slot k % STAGES
// of its ring receives the visible groups of its segment of row k's scores (and, when the mask keys are contiguous
// and 16-byte aligned, of the mask) STAGES - 1 rows ahead. Pass 1 masks in the slot and takes the max, pass 2 turns
// the slot into exp(x - max) and sums, pass 3 scales and stores P into the row's own global region, which no other
// row's prefetch reads. A cluster combines its max and sum through distributed shared memory (parity-double-buffered,
// so one row's exchange never overwrites values another CTA may still read).
struct PipeLayout {
    int64_t n4;          // float4 groups of scores a row
    int64_t seg4;        // float4 groups a CTA owns (a multiple of 4: 16-byte aligned mask segments)
    int64_t mask_bytes;  // mask bytes a slot holds (0: the mask, if any, is read from global memory)
    int64_t slot_bytes;
};

__host__ __device__ inline int mask_esize(int dtype) {
    return dtype == ATTN_LT_BOOL ? 1 : (dtype == ATTN_LT_F32 ? 4 : 2);
}

__host__ __device__ inline PipeLayout pipe_layout(const attn_lt_softmax_args& a, int C) {
    PipeLayout L;
    L.n4 = (a.cols + 3) / 4;
    L.seg4 = C == 1 ? L.n4 : ((L.n4 + C - 1) / C + 3) / 4 * 4;
    L.mask_bytes = 0;
    if (a.mask_dtype != ATTN_LT_NONE && a.m_sk == 1)
        L.mask_bytes = (a.cols < 4 * L.seg4 ? a.cols : 4 * L.seg4) * mask_esize(a.mask_dtype) / 16 * 16;
    L.slot_bytes = L.seg4 * 16 + L.mask_bytes;
    return L;
}

// The attention mass a PIPE kernel is built for: none, written (MassRow::mass: one row a head), or added (kAddMass).
// A kernel without it has no mass code at all: the runtime check alone, in the P store loop or beside it, cost the
// unmasked kernel 8 % at 8k-28k columns on the H200 (16k: 3.07-3.10 against 3.33 TB/s).
enum : int { kNoMass = 0, kWriteMass = 1, kAddMass = 2 };

// kAddMass: each thread sums the FP32 P of its columns over the CTA's consecutive rows of one head in registers
// (MAXV float4 a thread: the widest segment over THREADS) and adds them into the head's mass with atomics (four
// columns in one on sm_90) when the head changes and at the end. Rows are then taken block by block (row r of
// block e is lin = e * rows + r) and each CTA (cluster) takes one contiguous range of them, so that it flushes
// once or twice a launch, not at every head of the chunk with all the others at once.
// The row descriptors: row k in head[k % kHeads], the row STAGES ahead written during row k. Three stages, no mask,
// one CTA a row: kHeads = STAGES + 1, and the last thread writes it at the top of row k (into row k - 1's entry,
// which nobody reads any more), beside the max loop instead of after the row's stores (H200, against a build with
// no mass code: 8k columns 3.52 -> 3.71 TB/s, 16k 3.29 -> 3.57 when 16k rows took three slots; see launch()).
// Otherwise thread 0 at the row's end, into row k's own entry (kHeads = STAGES): the early write slowed clustered
// 28k-column rows by 5 %, and the deeper array alone masked 16k rows by 7 %.
template <int THREADS, int STAGES, bool HAS_MASK, bool CLUSTERED, typename OutT, int MASS = kNoMass, int MAXV = 1>
__global__ void __launch_bounds__(THREADS, 1) softmax_pipe(const attn_lt_softmax_args a) {
    constexpr bool ADD_MASS = MASS == kAddMass;
    constexpr bool kEarlyHead = STAGES >= 3 && !HAS_MASK && !CLUSTERED;
    constexpr int kHeads = kEarlyHead ? STAGES + 1 : STAGES;
    // The row descriptor: without the mass a `Row`, except in clustered masked kernels, whose 28k- and 64k-column
    // rows ran 20-25 % faster with a `MassRow`'s (H100: 1.78 against 1.43 TB/s at 28k, 1.69 against 1.36 at 64k).
    using Head = typename std::conditional<MASS == kNoMass && !(CLUSTERED && HAS_MASK), Row, MassRow>::type;
    extern __shared__ float4 ring[];
    __shared__ float red[2][32];
    __shared__ float part[2][2];  // [max, sum][row parity], read by the other CTAs of the cluster
    (void)part;  // used by the cluster exchange only (sm_90, CLUSTERED): not an unused variable elsewhere
    __shared__ Head head[kHeads];
    unsigned C = 1, rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cg::cluster_group cluster = cg::this_cluster();
    if constexpr (CLUSTERED) {
        C = cluster.num_blocks();
        rank = cluster.block_rank();
    }
#endif
    const PipeLayout L = pipe_layout(a, C);
    const int64_t c0 = int64_t(rank) * L.seg4, c1 = c0 + L.seg4 < L.n4 ? c0 + L.seg4 : L.n4;
    // rows lin = first, first + step, ... below end: strided over the clusters, or (kAddMass) a contiguous range
    const int64_t nrows = a.rows * a.batch, clusters = gridDim.x / C, cid = blockIdx.x / C;
    const int64_t first = ADD_MASS ? cid * nrows / clusters : cid, step = ADD_MASS ? 1 : clusters;
    const int64_t end = ADD_MASS ? (cid + 1) * nrows / clusters : nrows;
    const int esize = mask_esize(a.mask_dtype);
    const int64_t seg_mask_keys = HAS_MASK ? (a.cols < 4 * c1 ? a.cols : 4 * c1) - 4 * c0 : 0;
    const int64_t ring_keys = L.mask_bytes && seg_mask_keys > 0 ? seg_mask_keys * esize / 16 * 16 / esize : 0;
    auto slot_ptr = [&](int slot) { return reinterpret_cast<char*>(ring) + slot * L.slot_bytes; };
    auto set_head = [&](int64_t lin, int hi) {  // one thread
        if (lin < end) {
            head[hi] = ADD_MASS ? row_info<Head>(a, lin / a.rows, lin % a.rows)
                                : row_info<Head>(a, lin % a.batch, lin / a.batch);
        } else {
            head[hi].s = nullptr;
        }
    };
    // Groups wholly past the row's last visible key are not copied (causal rows: the masked corner of a chunk);
    // pass 1 replaces their stale slot entries by -inf without using their values.
    auto issue = [&](int slot, int hi) {  // the ring's slot, the row's descriptor
        const Head& w = head[hi];
        if (w.s != nullptr) {
            const int64_t ce = min(visible_groups(w.limit), c1);
            float4* dst = reinterpret_cast<float4*>(slot_ptr(slot));
            for (int64_t c = c0 + threadIdx.x; c < ce; c += THREADS) cp_async16(dst + (c - c0), w.s + 4 * c);
            if (HAS_MASK && ring_keys && reinterpret_cast<uintptr_t>(w.mask) % 16 == 0) {
                // pass 1 reads the slot's mask for whole visible groups only: the bytes of keys up to the limit
                const int64_t seen = (w.limit + 1 - 4 * c0) * esize;
                const int64_t units = ring_keys * esize / 16, mu = seen <= 0 ? 0 : (seen + 15) / 16;
                char* mdst = slot_ptr(slot) + L.seg4 * 16;
                const char* msrc = w.mask + 4 * c0 * esize;
                for (int64_t u = threadIdx.x; u < (mu < units ? mu : units); u += THREADS)
                    cp_async16(mdst + 16 * u, msrc + 16 * u);
            }
        }
        cp_async_commit();  // possibly empty: keeps one group per row for wait_group
    };
    if (threadIdx.x == 0)
        for (int k = 0; k < STAGES; ++k) set_head(first + int64_t(k) * step, k);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) issue(k, k);
    int slot = 0, hi = 0, parity = 0;
    // ADD_MASS: this thread's columns c0 + threadIdx.x + k * THREADS, summed over the rows of `into`
    float4 acc[MAXV];
#pragma unroll
    for (int k = 0; k < MAXV; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    float* into = nullptr;
    const auto flush = [&]() {
        if (into == nullptr) return;
#pragma unroll
        for (int k = 0; k < MAXV; ++k) {
            const int64_t c = c0 + threadIdx.x + int64_t(k) * THREADS;
            if (c >= c1) break;
            const int64_t j = 4 * c;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            // four columns in one atomic where the head's mass row is 16-byte aligned (j is a multiple of 4)
            if (reinterpret_cast<uintptr_t>(into) % 16 == 0 && j + 3 < a.cols) {
                atomicAdd(reinterpret_cast<float4*>(into + j), acc[k]);
                continue;
            }
#endif
            if (j < a.cols) atomicAdd(into + j, acc[k].x);
            if (j + 1 < a.cols) atomicAdd(into + j + 1, acc[k].y);
            if (j + 2 < a.cols) atomicAdd(into + j + 2, acc[k].z);
            if (j + 3 < a.cols) atomicAdd(into + j + 3, acc[k].w);
        }
    };
    for (int64_t lin = first; lin < end; lin += step) {
        cp_async_wait<STAGES - 2>();  // this row's group is complete (the STAGES - 2 after it may not be)
        __syncthreads();  // ...for every thread's copies; and every thread is done with the previous row's slot
        issue((slot + STAGES - 1) % STAGES, (hi + STAGES - 1) % kHeads);  // the previous row's slot, STAGES - 1 ahead
        const Head w = head[hi];
        if (kEarlyHead && threadIdx.x == THREADS - 1) set_head(lin + int64_t(STAGES) * step, (hi + STAGES) % kHeads);
        const bool from_slot = HAS_MASK && ring_keys && reinterpret_cast<uintptr_t>(w.mask) % 16 == 0;
        const char* slot_mask = slot_ptr(slot) + L.seg4 * 16;
        float4* buf = reinterpret_cast<float4*>(slot_ptr(slot));
        float mx = -INFINITY;
        for (int64_t c = c0 + threadIdx.x; c < c1; c += THREADS) {
            const int64_t j = 4 * c;
            float4 v = buf[c - c0];
            if (HAS_MASK && from_slot && j + 3 - 4 * c0 < ring_keys && j + 3 <= w.limit) {
                const float4 m = mask4(slot_mask, j - 4 * c0, a.mask_dtype);  // shared memory
                v.x += m.x;
                v.y += m.y;
                v.z += m.z;
                v.w += m.w;
                buf[c - c0] = v;
            } else if (HAS_MASK || j + 3 > w.limit) {
                v = apply_mask(v, j, w, a);
                buf[c - c0] = v;
            }
            mx = fmaxf(mx, max4(v));
        }
        mx = block_max<THREADS>(mx, red[0]);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if constexpr (CLUSTERED) {
            if (threadIdx.x == 0) part[0][parity] = mx;
            cluster.sync();
            for (unsigned r = 0; r < C; ++r) mx = fmaxf(mx, *cluster.map_shared_rank(&part[0][parity], r));
        }
#endif
        const float mref = mx == -INFINITY ? 0.f : mx;
        float sum = 0.f;
        for (int64_t c = c0 + threadIdx.x; c < c1; c += THREADS) {
            float4 v = buf[c - c0];
            v.x = ex(v.x, mref);
            v.y = ex(v.y, mref);
            v.z = ex(v.z, mref);
            v.w = ex(v.w, mref);
            buf[c - c0] = v;
            sum += (v.x + v.y) + (v.z + v.w);
        }
        sum = block_sum<THREADS>(sum, red[1]);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if constexpr (CLUSTERED) {
            if (threadIdx.x == 0) part[1][parity] = sum;
            cluster.sync();
            sum = 0.f;
            for (unsigned r = 0; r < C; ++r) sum += *cluster.map_shared_rank(&part[1][parity], r);
        }
#endif
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        if constexpr (ADD_MASS) {
            if (w.mass != into) {  // uniform: every thread sees the same row
                flush();
                into = w.mass;
#pragma unroll
                for (int k = 0; k < MAXV; ++k) acc[k] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int k = 0; k < MAXV; ++k) {
                const int64_t c = c0 + threadIdx.x + int64_t(k) * THREADS;
                if (c < c1) {
                    const float4 v = buf[c - c0];
                    const float4 pv = make_float4(v.x * inv, v.y * inv, v.z * inv, v.w * inv);
                    store4<OutT>(w.p, 4 * c, pv.x, pv.y, pv.z, pv.w);
                    acc[k].x += pv.x;
                    acc[k].y += pv.y;
                    acc[k].z += pv.z;
                    acc[k].w += pv.w;
                }
            }
        } else {
            for (int64_t c = c0 + threadIdx.x; c < c1; c += THREADS) {
                const float4 v = buf[c - c0];
                const float x = v.x * inv, y = v.y * inv, z = v.z * inv, u = v.w * inv;
                if constexpr (MASS == kWriteMass) store_p<OutT>(w, 4 * c, a.cols, x, y, z, u);
                else store4<OutT>(w.p, 4 * c, x, y, z, u);
            }
        }
        if (threadIdx.x == 0) {  // the descriptor written here is read after the next iteration's barrier
            if (rank == 0) *w.lse = row_lse(mref, sum);
            if (!kEarlyHead) set_head(lin + int64_t(STAGES) * step, (hi + STAGES) % kHeads);
        }
        slot = (slot + 1) % STAGES;
        hi = (hi + 1) % kHeads;
        parity ^= 1;
    }
    if constexpr (ADD_MASS) flush();
    cp_async_wait<0>();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (CLUSTERED) cluster.sync();  // no CTA leaves while another may still read its shared memory
#endif
}

// PIPE_REGS (rows of at most kRegsMaxCols columns without a dense mask or the attention mass): persistent CTAs of
// kRegsThreads threads, two an SM. Thread t holds float4 groups t, t + kRegsThreads, ... of its row in registers
// while its one shared-memory slot receives the same groups of the CTA's next row by cp.async. A thread reads back
// only what it copied, so the slot needs no barrier, and the next row streams in during the whole of this one.
// Against PIPE's two slots (at 16k columns 128 KB, one CTA an SM) two CTAs an SM interleave one's reductions with
// the other's loads. Its threads sum their groups in PIPE's 512-thread order, so P and the LSE are PIPE's bit for
// bit (a call that adds the mass, which only PIPE does, gets the same P as one that does not).
constexpr int kRegsThreads = 512, kRegsV = 8;
constexpr int64_t kRegsMaxCols = int64_t(kRegsThreads) * kRegsV * 4;
constexpr size_t kRegsSmem = size_t(kRegsMaxCols) * 4;  // one slot of the longest row (64 KB: two CTAs an SM)
constexpr int64_t kRegsMinCols = 8192;  // AUTO: rows this short keep PIPE (256 threads, three slots, two CTAs an SM)

template <typename OutT>
__global__ void __launch_bounds__(kRegsThreads, 2) softmax_pipe_regs(const attn_lt_softmax_args a) {
    static_assert(kRegsThreads == 512, "PIPE's summation order: its rows past 8192 columns take 512 threads");
    extern __shared__ float4 ring[];
    __shared__ float red[2][32];
    // Row k's descriptor in head[k % 3]: thread 0 writes row k + 2's at the top of row k, into the entry of row
    // k - 1, which every thread read before row k - 1's barriers; row k + 1's is read during row k (its prefetch).
    __shared__ Row head[3];
    const int64_t nrows = a.rows * a.batch, step = gridDim.x;
    const int n4 = static_cast<int>((a.cols + 3) / 4);  // at most kRegsMaxCols / 4: 32-bit column indices
    auto set_head = [&](int64_t lin, int hi) {
        if (lin < nrows) head[hi] = row_info<Row>(a, lin % a.batch, lin / a.batch);
        else head[hi].s = nullptr;
    };
    // This thread's groups of a row into the slot, up to the group of its last visible key (as PIPE: the groups
    // past it are replaced by -inf below without their values being used).
    auto issue = [&](const Row& w) {
        if (w.s != nullptr) {
            const int visible4 = static_cast<int>(min(visible_groups(w.limit), int64_t(n4)));
#pragma unroll
            for (int k = 0; k < kRegsV; ++k) {
                const int c = threadIdx.x + k * kRegsThreads;
                if (c < visible4) cp_async16(ring + c, w.s + 4 * c);
            }
        }
        cp_async_commit();
    };
    if (threadIdx.x == 0) {
        set_head(blockIdx.x, 0);
        set_head(blockIdx.x + step, 1);
    }
    __syncthreads();
    issue(head[0]);
    int hi = 0;
    for (int64_t lin = blockIdx.x; lin < nrows; lin += step) {
        // the last visible key (the causal limit, or the row's end; -1: none), in 32 bits like the columns
        const int limit = static_cast<int>(max(head[hi].limit, int64_t(-1)));
        if (threadIdx.x == 0) set_head(lin + 2 * step, (hi + 2) % 3);
        cp_async_wait<0>();  // this thread's groups of row lin are in the slot
        float4 v[kRegsV];
        float mx = -INFINITY;
#pragma unroll
        for (int k = 0; k < kRegsV; ++k) {
            const int c = threadIdx.x + k * kRegsThreads, j = 4 * c;
            v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (c < n4) {
                v[k] = ring[c];
                if (j + 3 > limit) {  // apply_mask without a dense mask
                    if (j > limit) v[k].x = -INFINITY;
                    if (j + 1 > limit) v[k].y = -INFINITY;
                    if (j + 2 > limit) v[k].z = -INFINITY;
                    v[k].w = -INFINITY;
                }
                mx = fmaxf(mx, max4(v[k]));
            }
        }
        // The max has consumed every value read from the slot: the next row may overwrite it.
        issue(head[(hi + 1) % 3]);
        char* const p = head[hi].p;  // read before this row's barriers (see head)
        float* const lse = head[hi].lse;
        mx = block_max<kRegsThreads>(mx, red[0]);
        const float mref = mx == -INFINITY ? 0.f : mx;
        float sum = 0.f;
#pragma unroll
        for (int k = 0; k < kRegsV; ++k) {
            if (int(threadIdx.x) + k * kRegsThreads < n4) sum += ex4(v[k], mref);
        }
        sum = block_sum<kRegsThreads>(sum, red[1]);
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
        for (int k = 0; k < kRegsV; ++k) {
            const int c = threadIdx.x + k * kRegsThreads;
            if (c < n4) store4<OutT>(p, 4 * c, v[k].x * inv, v[k].y * inv, v[k].z * inv, v[k].w * inv);
        }
        if (threadIdx.x == 0) *lse = row_lse(mref, sum);
        hi = (hi + 1) % 3;
    }
    cp_async_wait<0>();
}

template <int THREADS, int NV, typename OutT>
__global__ void __launch_bounds__(THREADS) softmax_two_pass(const attn_lt_softmax_args a) {
    __shared__ float red[2][32];
    const MassRow w = row_info<MassRow>(a, blockIdx.x % a.batch, blockIdx.x / a.batch);
    // Pass 1: online max and sum.
    float m = -INFINITY, l = 0.f;
    for (int64_t j = int64_t(threadIdx.x) * 4; j < a.cols; j += THREADS * 4) {
        const float4 v = load_masked(j, w, a);
        const float mn = fmaxf(m, max4(v));
        if (mn == -INFINITY) continue;
        l = l * ex(m, mn) + ex(v.x, mn) + ex(v.y, mn) + ex(v.z, mn) + ex(v.w, mn);
        m = mn;
    }
    const float mx = block_max<THREADS>(m, red[0]);
    const float mref = mx == -INFINITY ? 0.f : mx;
    const float sum = block_sum<THREADS>(m == -INFINITY ? 0.f : l * ex(m, mref), red[1]);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    // Pass 2, tile by tile: the writes of tile t cover floats [t*T/2, (t+1)*T/2), which every thread has read
    // by the barrier of tile t; later tiles' reads lie beyond them.
    constexpr int64_t T = int64_t(THREADS) * NV * 4;
    for (int64_t base = 0; base < a.cols; base += T) {
        float4 v[NV];
#pragma unroll
        for (int i = 0; i < NV; ++i) v[i] = load_masked(base + (int64_t(i) * THREADS + threadIdx.x) * 4, w, a);
        __syncthreads();
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            const int64_t j = base + (int64_t(i) * THREADS + threadIdx.x) * 4;
            if (j < a.cols)
                store_p<OutT>(w, j, a.cols, ex(v[i].x, mref) * inv, ex(v[i].y, mref) * inv, ex(v[i].z, mref) * inv,
                              ex(v[i].w, mref) * inv);
        }
    }
    finish_row(w, mref, sum);
}

bool has_clusters() {
    const DeviceInfo* d = nullptr;
    return current_device_info(&d) == cudaSuccess && d->major >= 9;
}

int sm_count() {
    const DeviceInfo* d = nullptr;
    return current_device_info(&d) == cudaSuccess && d->sms > 0 ? d->sms : 1;
}

constexpr int64_t kPipeSmem = 220 * 1024;  // ring bytes a CTA may take where the device allows (sm_90: 227 KB)
constexpr int64_t kPipeMinCols = 4096;       // shorter rows: ROW is faster (less per-row synchronisation)
constexpr int64_t kStaticSmem = 512;         // covers a softmax kernel's static shared memory (PIPE: at most 352 B)
constexpr int64_t kMinOptinSmem = 99 * 1024;  // the smallest opt-in a block of the GPUs built for (sm_86, sm_89)

// Ring bytes a PIPE CTA may take on the current device: kPipeSmem, or less where a block's opt-in maximum is
// smaller (A100 163 KB, sm_86/sm_89 99 KB; kMinOptinSmem where the runtime does not say), so that rows whose ring
// would not fit take ROW or TWO_PASS instead of failing to launch.
int64_t pipe_ring_bytes() {
    const DeviceInfo* d = nullptr;
    const int64_t optin = current_device_info(&d) == cudaSuccess && d->smem_optin > 0 ? d->smem_optin
                                                                                     : kMinOptinSmem;
    return std::min<int64_t>(kPipeSmem, optin - kStaticSmem);
}

// Ring slots PIPE can use with C CTAs a row (0: the ring does not fit).
int pipe_stages(const attn_lt_softmax_args& a, int C) {
    const int64_t slot = pipe_layout(a, C).slot_bytes, ring = pipe_ring_bytes();
    return 3 * slot <= ring ? 3 : (2 * slot <= ring ? 2 : 0);
}

// CTAs a row for PIPE: 1, or on sm_90 the smallest cluster whose segments fit a two-slot ring (0: none fits).
int pipe_cluster(const attn_lt_softmax_args& a) {
    if (pipe_stages(a, 1)) return 1;
    if (!has_clusters()) return 0;
    for (int C = 2; C <= kMaxCluster; C *= 2)
        if (pipe_stages(a, C)) return C;
    return 0;
}

// Resident CTAs (or clusters) of one kernel configuration on one device, asked of the runtime once: the occupancy
// queries and the shared-memory opt-in cost tens of microseconds of host time, which a decode call cannot spare.
struct Residency {
    const void* kernel;
    int dev, C;
    size_t smem;
    int64_t clusters;
};

template <typename Kernel>
cudaError_t residency(Kernel kernel, int threads, size_t smem, int C, bool clustered, cudaLaunchConfig_t cfg,
                      int64_t* out) {
    static std::mutex lock;
    static std::vector<Residency> known;
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    const void* key = reinterpret_cast<const void*>(kernel);
    std::lock_guard<std::mutex> g(lock);
    for (const Residency& r : known) {
        if (r.kernel == key && r.dev == dev && r.C == C && r.smem == smem) {
            *out = r.clusters;
            return cudaSuccess;
        }
    }
    err = opt_in_smem(key, smem);
    if (err != cudaSuccess) return err;
    int64_t clusters = 0;
    if (clustered) {
        int n = 0;
        err = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
        clusters = n;
    } else {
        int per_sm = 0;
        err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
        clusters = int64_t(per_sm) * sm_count();
    }
    if (err != cudaSuccess) return err;
    known.push_back({key, dev, C, smem, clusters});
    *out = clusters;
    return cudaSuccess;
}

// Float4 columns a thread sums in registers when PIPE adds the mass: 16384 columns a CTA with 512 threads (the
// accumulators of the widest segments, 7040 float4, would spill); all of the rows the 256-thread configurations
// take (4096 columns, and 8192 without a mask).
constexpr int kPipeMaxV512 = 8;
constexpr int kPipeMaxV256 = 4096 / 4 / 256, kPipeMaxV256x8k = 8192 / 4 / 256;
constexpr int64_t kPipeMassSeg4 = int64_t(kPipeMaxV512) * 512;

// Whether PIPE with C CTAs a row can add these rows' P into the mass: each CTA's segment fits the accumulators.
bool pipe_sums_mass(const attn_lt_softmax_args& a, int C) { return C > 0 && pipe_layout(a, C).seg4 <= kPipeMassSeg4; }

template <int THREADS, int STAGES, bool CLUSTERED, typename OutT, int MAXV>
cudaError_t launch_pipe(const attn_lt_softmax_args& a, int C, cudaStream_t stream) {
    const bool add = a.mass_add && a.mass != nullptr;
    // the rule (pipe_sums_mass), and this configuration's accumulators
    if (add && (!pipe_sums_mass(a, C) || pipe_layout(a, C).seg4 > int64_t(MAXV) * THREADS))
        return static_cast<cudaError_t>(ATTN_LT_ERR_VARIANT);
    static_assert(MAXV * THREADS >= kPipeMassSeg4 || THREADS == 256, "accumulators for every segment PIPE sums");
    const bool masked = a.mask_dtype != ATTN_LT_NONE;
    const auto kernel =
        add                 ? (masked ? softmax_pipe<THREADS, STAGES, true, CLUSTERED, OutT, kAddMass, MAXV>
                                      : softmax_pipe<THREADS, STAGES, false, CLUSTERED, OutT, kAddMass, MAXV>)
        : a.mass != nullptr ? (masked ? softmax_pipe<THREADS, STAGES, true, CLUSTERED, OutT, kWriteMass>
                                      : softmax_pipe<THREADS, STAGES, false, CLUSTERED, OutT, kWriteMass>)
                            : (masked ? softmax_pipe<THREADS, STAGES, true, CLUSTERED, OutT>
                                      : softmax_pipe<THREADS, STAGES, false, CLUSTERED, OutT>);
    const size_t smem = size_t(STAGES) * size_t(pipe_layout(a, C).slot_bytes);
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = C;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    if (CLUSTERED) {
        cfg.gridDim = dim3(C);  // occupancy is asked per cluster of this shape
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
    int64_t clusters = 0;
    cudaError_t err = residency(kernel, THREADS, smem, C, CLUSTERED, cfg, &clusters);
    if (err != cudaSuccess) return err;
    if (clusters < 1) return cudaErrorInvalidConfiguration;
    clusters = std::min<int64_t>(a.rows * a.batch, clusters);
    cfg.gridDim = dim3(static_cast<unsigned>(clusters * C));
    err = cudaLaunchKernelEx(&cfg, kernel, a);
    return err != cudaSuccess ? err : cudaGetLastError();
}

// Whether PIPE_REGS can take these rows: no dense mask, no attention mass, at most kRegsMaxCols columns.
bool regs_fit(const attn_lt_softmax_args& a) {
    return a.mask_dtype == ATTN_LT_NONE && a.mass == nullptr && a.cols <= kRegsMaxCols;
}

// Whether AUTO gives these rows PIPE_REGS: it can; PIPE's two-slot ring (its kernel for unmasked rows past 8192
// columns) leaves room for one CTA an SM only (kStaticSmem more a CTA covers its static shared memory); and
// the GPU's DRAM is fast enough for one CTA an SM to fall behind it (kRegsMinGbpsPerSm). Measured (bf16, softmax
// alone by tools/bench_softmax.py, and the long path B1 H16 S16k D128 by tools/probe_long_rows.py):
//   H200 (36 GB/s an SM): 12288 columns (PIPE two CTAs an SM) PIPE 3.79 TB/s, PIPE_REGS 3.59; 15360 (one) 3.57
//     against 3.65; 16384 3.59 against 3.64; the long path 14.8-15.0 -> 14.45 ms.
//   H100 (25 GB/s an SM): 16384 PIPE 2.82 TB/s, PIPE_REGS 2.69; the long path 19.05 -> 19.64 ms.
constexpr double kRegsMinGbpsPerSm = 30.0;

bool regs_preferred(const attn_lt_softmax_args& a) {
    if (a.cols <= kRegsMinCols || !regs_fit(a)) return false;
    const DeviceInfo* d = nullptr;
    if (current_device_info(&d) != cudaSuccess || d->dram_gbps_per_sm < kRegsMinGbpsPerSm || d->smem_per_sm <= 0)
        return false;
    const int64_t pipe_cta = 2 * pipe_layout(a, 1).slot_bytes + d->reserved_smem + kStaticSmem;
    return 2 * pipe_cta > d->smem_per_sm;
}

template <typename OutT>
cudaError_t launch_pipe_regs(const attn_lt_softmax_args& a, cudaStream_t stream) {
    if (!regs_fit(a)) return static_cast<cudaError_t>(ATTN_LT_ERR_VARIANT);
    const auto kernel = softmax_pipe_regs<OutT>;
    cudaLaunchConfig_t cfg = {};
    cfg.blockDim = dim3(kRegsThreads);
    cfg.dynamicSmemBytes = kRegsSmem;  // one size for every row length: one residency query
    cfg.stream = stream;
    int64_t ctas = 0;
    cudaError_t err = residency(kernel, kRegsThreads, kRegsSmem, 1, false, cfg, &ctas);
    if (err != cudaSuccess) return err;
    if (ctas < 1) return cudaErrorInvalidConfiguration;
    cfg.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(a.rows * a.batch, ctas)));
    err = cudaLaunchKernelEx(&cfg, kernel, a);
    return err != cudaSuccess ? err : cudaGetLastError();
}

// Whether AUTO gives these rows ROW rather than PIPE over a cluster (pc > 1: on Hopper, unmasked rows past 28160
// columns): decode rows (one query position, Sq = 1), which ROW holds in registers (at most kRowMaxCols columns),
// few of them (at most kRowFewRowsPerSm an SM). PIPE's pipeline then has a handful of rows a cluster to overlap and
// its two cluster barriers a row cost more; ROW runs one CTA a row, every row's loads in flight at once. The rule
// does not look at the mass, so that a call with it and one without run the same kernel (P the same bit for bit):
// ROW writes a decode call's mass, and a call that adds the mass sums these rows' P itself
// (attn_lt_softmax_adds_mass answers 0). Decode only: a prefill call that adds the mass keeps PIPE, which adds it.
// Measured on Hopper only (bf16, unmasked, tools/bench_softmax.py --cols 28672,30720,32768 --heads 8, TB/s of
// PIPE / ROW):
//   H200, 64 rows 0.76-0.95 / 0.91-0.98; 256 1.41-1.58 / 1.56-1.96; 1024 2.09-2.17 / 2.20-2.39; 6144 2.46-2.61 /
//   2.39-2.52. H100: 64 0.66-0.82 / 0.89-0.91; 256 1.22-1.33 / 1.44-1.80; 1024 1.73-1.75 / 1.97-2.06; 6144 2.04 /
//   2.07-2.20. Decode on the long path against forced PIPE (B Hq32 Hkv8 Sk32768, B 4-16, and Sk 30000; without
//   and with the mass): H100 1.0-2.5 % faster, H200 1.3-2.1 %; 64 rows (B2) within 0.4 %; 32 rows (B1 Hkv32) 0-1 %
//   slower.
constexpr int kRowFewRowsPerSm = 8;

bool row_preferred(const attn_lt_softmax_args& a, int pc) {
    if (pc <= 1 || a.Sq != 1 || a.cols > kRowMaxCols || a.mask_dtype != ATTN_LT_NONE) return false;
    return a.rows * a.batch <= int64_t(kRowFewRowsPerSm) * sm_count();
}

// The kernel a launch runs (a forced variant, or by row length, row count, query positions, mask and GPU) and
// PIPE's CTAs a row (0: PIPE cannot);
// `adding`: the kernel of the same rows when the softmax adds their mass (asked before the mass is set).
int resolve_variant(const attn_lt_softmax_args& a, int* pc, bool adding = false) {
    *pc = pipe_cluster(a);
    if (a.variant != ATTN_LT_SOFTMAX_AUTO) return a.variant;
    return a.cols < kPipeMinCols                    ? ATTN_LT_SOFTMAX_ROW
           : !adding && regs_preferred(a)         ? ATTN_LT_SOFTMAX_PIPE_REGS
           : row_preferred(a, *pc)                ? ATTN_LT_SOFTMAX_ROW
           : *pc                                  ? ATTN_LT_SOFTMAX_PIPE
           : a.cols <= kRowMaxCols ? ATTN_LT_SOFTMAX_ROW : ATTN_LT_SOFTMAX_TWO_PASS;
}

template <typename OutT>
cudaError_t launch(const attn_lt_softmax_args& a, cudaStream_t stream) {
    const int64_t c = a.cols;
    int pc = 0;
    const int variant = resolve_variant(a, &pc);
    if (variant == ATTN_LT_SOFTMAX_PIPE) {
        if (pc == 0) return static_cast<cudaError_t>(ATTN_LT_ERR_VARIANT);
        if (pc > 1) return pipe_stages(a, pc) == 3 ? launch_pipe<512, 3, true, OutT, kPipeMaxV512>(a, pc, stream)
                                                   : launch_pipe<512, 2, true, OutT, kPipeMaxV512>(a, pc, stream);
        // Unmasked rows up to 8192 columns: 256 threads a CTA, two CTAs (three slots each) an SM, also when the
        // kernel adds the mass (112 registers; with 512 threads that allowed one CTA an SM). H200, 8k columns:
        // 3.68 -> 3.94 TB/s, with the mass 2.14 -> 3.72. Masked 8k rows keep 512 threads (2.05 against 1.92). A
        // call with the mass and one without must share the configuration: P is then the same bit for bit.
        constexpr int64_t kSmallestRing = kMinOptinSmem - kStaticSmem;
        static_assert(3 * 4096 * (4 + 4) <= kSmallestRing && 3 * 8192 * 4 <= kSmallestRing,
                      "three slots of 4k columns with an fp32 mask, and of 8k without, fit the smallest opt-in");
        if (c <= 4096) return launch_pipe<256, 3, false, OutT, kPipeMaxV256>(a, 1, stream);
        if (c <= 8192 && a.mask_dtype == ATTN_LT_NONE)
            return launch_pipe<256, 3, false, OutT, kPipeMaxV256x8k>(a, 1, stream);
        // Longer rows (AUTO gives some unmasked ones without the mass to PIPE_REGS: regs_preferred): 512 threads and
        // two slots, which fit two CTAs an SM up to 96 KB a slot pair (12k columns, 8k with a bool or 16-bit mask;
        // an fp32 mask's 8k slots take 64 KB, one CTA an SM) where three did not,
        // and measured no slower where neither fits two (three slots -> two: H200 12k columns 3.43 -> 3.73 TB/s,
        // masked 2.63 -> 2.90, 16k 3.61 -> 3.65; H100 masked 8k 2.19 -> 2.66).
        // Except unmasked rows whose mass is added: that kernel (112 registers) runs one CTA an SM with either,
        // and the third slot was faster (H100 16k 2.74 against 2.62). The slots do not change P.
        if (a.mass_add && a.mass != nullptr && a.mask_dtype == ATTN_LT_NONE && pipe_stages(a, 1) == 3)
            return launch_pipe<512, 3, false, OutT, kPipeMaxV512>(a, 1, stream);
        return launch_pipe<512, 2, false, OutT, kPipeMaxV512>(a, 1, stream);
    }
    if (variant == ATTN_LT_SOFTMAX_PIPE_REGS) return launch_pipe_regs<OutT>(a, stream);
    if (a.mass_add && a.mass != nullptr) return static_cast<cudaError_t>(ATTN_LT_ERR_VARIANT);  // PIPE only
    if (a.rows * a.batch > 0x7fffffffLL) return static_cast<cudaError_t>(ATTN_LT_ERR_LENGTH);
    const unsigned grid = static_cast<unsigned>(a.rows * a.batch);
    if (variant == ATTN_LT_SOFTMAX_ROW) {
        if (c <= 512) softmax_resident<128, 1, OutT><<<grid, 128, 0, stream>>>(a);
        else if (c <= 2048) softmax_resident<256, 2, OutT><<<grid, 256, 0, stream>>>(a);
        else if (c <= 4096) softmax_resident<128, 8, OutT><<<grid, 128, 0, stream>>>(a);
        else if (c <= 8192) softmax_resident<512, 4, OutT><<<grid, 512, 0, stream>>>(a);
        else if (c <= 16384) softmax_resident<512, 8, OutT><<<grid, 512, 0, stream>>>(a);
        else if (c <= kRowMaxCols) softmax_resident<1024, 8, OutT><<<grid, 1024, 0, stream>>>(a);
        else return static_cast<cudaError_t>(ATTN_LT_ERR_VARIANT);
    } else if (variant == ATTN_LT_SOFTMAX_TWO_PASS) {
        softmax_two_pass<1024, 4, OutT><<<grid, 1024, 0, stream>>>(a);
    } else {
        return static_cast<cudaError_t>(ATTN_LT_ERR_VARIANT);
    }
    return cudaGetLastError();
}


template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }

// One CTA a row: the running and the partial output of a key tile joined by their LSE.
template <typename OutT>
__global__ void __launch_bounds__(128) tile_merge(const attn_lt_tile_merge_args a) {
    const int64_t e = blockIdx.x % a.batch, r = blockIdx.x / a.batch;
    const int64_t row = e * a.rows + r;
    const float la = a.acc_lse[row], lp = a.part_lse[row];
    const float m = fmaxf(la, lp);
    float wa = 0.f, wp = 0.f, lse = -INFINITY;
    if (m != -INFINITY) {
        wa = __expf(la - m);
        wp = __expf(lp - m);
        const float s = wa + wp;
        lse = m + __logf(s);
        wa /= s;
        wp /= s;
    }
    float* acc = a.acc_o + row * a.Dv;
    const float* part = a.part_o + row * a.Dv;
    if (a.last) {
        OutT* o = static_cast<OutT*>(a.o) + e * a.o_bs + r * a.o_ld;
        for (int64_t d = threadIdx.x; d < a.Dv; d += blockDim.x) o[d] = from_float<OutT>(wa * acc[d] + wp * part[d]);
        if (threadIdx.x == 0 && a.lse != nullptr) {
            const RowPlace at = row_place(a, e, r);
            a.lse[(at.b * a.Hq + at.h) * a.Sq + at.q] = lse;
        }
    } else {
        for (int64_t d = threadIdx.x; d < a.Dv; d += blockDim.x) acc[d] = wa * acc[d] + wp * part[d];
        if (threadIdx.x == 0) a.acc_lse[row] = lse;
    }
}

}  // namespace

extern "C" {

int attn_lt_abi_version(void) { return ATTN_LT_ABI_VERSION; }

const char* attn_lt_source_hash(void) { return ATTN_LT_SOURCE_HASH; }

const char* attn_lt_error_string(int err) {
    switch (err) {
        case ATTN_LT_ERR_ARGS: return "precondition failed: null arguments or a size that is not positive";
        case ATTN_LT_ERR_HEADS: return "precondition failed: Hq not a multiple of Hkv, or B / Hq beyond the grid";
        case ATTN_LT_ERR_HEAD_DIM: return "precondition failed: no kernel for this head dim";
        case ATTN_LT_ERR_LENGTH: return "precondition failed: a length beyond the kernel's index range";
        case ATTN_LT_ERR_ALIGNMENT: return "precondition failed: an address not aligned as the kernel needs";
        case ATTN_LT_ERR_STRIDES: return "precondition failed: a stride the kernel cannot take";
        case ATTN_LT_ERR_DTYPE: return "precondition failed: a dtype the kernel does not take";
        case ATTN_LT_ERR_MASK:
            return "precondition failed: a mask dtype without a mask, or a mask (dtype, alignment, strides) this kernel "
                   "does not take";
        case ATTN_LT_ERR_VARIANT: return "precondition failed: the forced kernel variant cannot run these arguments";
        case ATTN_LT_ERR_SCALE: return "precondition failed: scale not positive";
        case ATTN_LT_ERR_TENSOR_MAP: return "precondition failed: the driver refused a TMA tensor map for this layout";
        case ATTN_LT_ERR_LATENT:
            return "precondition failed: MLA decode (head dims 576/512) takes one query a head, and v the first 512 "
                   "columns of k (the same memory and strides)";
        case ATTN_LT_ERR_BATCH:
            return "precondition failed: a serving batch's metadata pointers, capacities, block size or split size";
        case ATTN_LT_ERR_WINDOW:
            return "precondition failed: a window edge below -1, a softcap negative or not finite, or an attention "
                   "variant (window, softcap, sinks) this kernel does not run";
        default: return cudaGetErrorString(static_cast<cudaError_t>(err));
    }
}

int64_t attn_lt_softmax_max_resident_cols(void) {
    // PIPE with an 8-CTA cluster (sm_90): 8 segments, each two slots of scores within the ring budget.
    return has_clusters() ? kMaxCluster * (pipe_ring_bytes() / 2 / 16 / 4 * 4 * 4) : kRowMaxCols;
}

int attn_lt_softmax(const attn_lt_softmax_args* a, void* stream) {
    if (a == nullptr || a->rows <= 0 || a->cols <= 0 || a->batch <= 0 || a->Sq <= 0 || a->Hkv <= 0 || a->g <= 0)
        return ATTN_LT_ERR_ARGS;
    if (a->ld_s % 4 != 0 || a->ld_p % 4 != 0 || a->ld_s < a->cols || a->ld_p < a->cols) return ATTN_LT_ERR_STRIDES;
    if (reinterpret_cast<uintptr_t>(a->scores) % 16 != 0 || reinterpret_cast<uintptr_t>(a->probs) % 8 != 0)
        return ATTN_LT_ERR_ALIGNMENT;
    if (a->mask_dtype != ATTN_LT_NONE && a->mask == nullptr) return ATTN_LT_ERR_MASK;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (a->out_dtype) {
        case ATTN_LT_BF16: return static_cast<int>(launch<__nv_bfloat16>(*a, s));
        case ATTN_LT_F16: return static_cast<int>(launch<__half>(*a, s));
        default: return ATTN_LT_ERR_DTYPE;
    }
}

int attn_lt_softmax_adds_mass(const attn_lt_softmax_args* a) {
    if (a == nullptr || a->cols <= 0) return 0;
    const bool clean = cudaPeekAtLastError() == cudaSuccess;
    int pc = 0;
    const int variant = resolve_variant(*a, &pc, true);
    if (clean) cudaGetLastError();  // pipe_cluster may ask the device; a failure there only means "no"
    return variant == ATTN_LT_SOFTMAX_PIPE && pipe_sums_mass(*a, pc) ? 1 : 0;
}

int attn_lt_tile_merge(const attn_lt_tile_merge_args* a, void* stream) {
    if (a == nullptr || a->acc_o == nullptr || a->acc_lse == nullptr || a->part_o == nullptr ||
        a->part_lse == nullptr || (a->last && a->o == nullptr) || a->rows <= 0 || a->batch <= 0 || a->Dv <= 0 ||
        a->Sq <= 0 || a->Hkv <= 0 || a->g <= 0)
        return ATTN_LT_ERR_ARGS;
    if (a->rows * a->batch > 0x7fffffffLL) return ATTN_LT_ERR_LENGTH;
    const unsigned grid = static_cast<unsigned>(a->rows * a->batch);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (a->out_dtype) {
        case ATTN_LT_BF16: tile_merge<__nv_bfloat16><<<grid, 128, 0, s>>>(*a); break;
        case ATTN_LT_F16: tile_merge<__half><<<grid, 128, 0, s>>>(*a); break;
        default: return ATTN_LT_ERR_DTYPE;
    }
    return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
