// The fused kernel for every GPU from sm_80 (FlashAttention-2 style, warp-level tensor-core MMA, mma.sync
// m16n8k16), and on Hopper the kernel for what the wgmma kernel does not run: decode and short query blocks (split
// over the keys), and dense masks.
//
// Rows. The query heads of one kv head are folded into the rows of one tile (GQA without copies, every K/V tile
// read once for the whole group): row r of kv head hk is query position r / g of query head hk * g + r % g. A CTA of
// 4 warps owns 64 * MT rows (MT m16 tiles a warp, so every K and V fragment feeds MT MMAs).
// Keys. K and V tiles of 64 keys stream through a 2- or 3-stage XOR-swizzled shared-memory ring by cp.async
// (zero-filled past Sk). Per tile: S = Q K^T (fp32), scale, mask (causal bottom-right, the key tail, a dense bool or
// additive mask: aligned masks are staged with the K/V tile (see mask_stage_rows), others read by strides),
// online softmax in the exp2 domain, P converted in registers to the A operand of O += P V (V read with
// ldmatrix.trans).
// FP8 KV caches (decode blocks only): K and V tiles stream in as e4m3 bytes and are converted to fp16 in registers
// on their way into the MMAs (see "FP8 K and V" below); q is staged as fp16 under a power-of-two scale.
// Split over the keys (flash-decoding). With splits > 1, grid.z cuts each row block's key tiles into `splits`
// ranges; each writes its normalised FP32 partial output and LSE, and merge_partials joins them by LSE (the same
// merge context parallelism uses), so a decode step with a few rows per kv head still fills every SM.
#include "attn_lt.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockN = 64;
#include "common.cuh"

__device__ __forceinline__ void ldsm_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3, const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_u32(p)));
}

template <typename T>
__device__ __forceinline__ void mma(float* c, const unsigned* a, unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__half>(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Element offset of (row, col) in a tile of rows of D elements whose 16-byte chunks are XOR-swizzled by row % 8,
// so that ldmatrix's 8 rows of one chunk land in 8 different bank groups.
template <int D>
__device__ __forceinline__ int swz(int row, int col) {
    return row * D + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Copy `rows` rows of D elements (row r at src + r * stride) into a swizzled tile; rows >= valid are zero-filled.
template <int D, typename T>
__device__ __forceinline__ void load_tile(T* dst, const T* src, int64_t stride, int rows, int valid) {
    constexpr int kChunks = D / 8;
    for (int i = threadIdx.x; i < rows * kChunks; i += kThreads) {
        const int r = i / kChunks, c = (i % kChunks) * 8;
        const bool ok = r < valid;
        cp_async16(dst + swz<D>(r, c), src + (ok ? r * stride : 0) + c, ok ? 16 : 0);
    }
}

// load_tile of a whole key tile (kBlockN rows, no tail): a thread's chunks are rows r0, r0 + kRowStep, ... of one
// column, so the loop unrolls into one pointer step and one cp.async a chunk (a decode block is issue-bound on the
// H200 with the general loop's index arithmetic).
template <int D, typename T>
__device__ __forceinline__ void load_key_tile(T* dst, const T* src, int64_t stride) {
    constexpr int kChunks = D / 8, kRowStep = kThreads / kChunks, kPasses = kBlockN / kRowStep;
    static_assert(kThreads % kChunks == 0 && kBlockN % kRowStep == 0, "whole rows a pass");
    const int r0 = threadIdx.x / kChunks, c = (threadIdx.x % kChunks) * 8;
    const T* p = src + r0 * stride + c;
    const int64_t step = kRowStep * stride;
#pragma unroll
    for (int i = 0; i < kPasses; ++i, p += step) cp_async16(dst + swz<D>(r0 + i * kRowStep, c), p);
}

// What the kernel reads of a serving batch's arguments (placeholders for a dense call, where BT code is dead).
__device__ __forceinline__ int split_tiles(const attn_lt_flash_args&) { return 1; }
__device__ __forceinline__ int split_tiles(const attn_lt_batch_args& a) { return a.split_keys / kBlockN; }
__device__ __forceinline__ int64_t batch_total_q(const attn_lt_flash_args&) { return 0; }
__device__ __forceinline__ int64_t batch_total_q(const attn_lt_batch_args& a) { return a.total_q; }
__device__ __forceinline__ BatchRequest request_of(const attn_lt_flash_args& a, int, bool) {
    return {0, static_cast<int>(a.Sq), 0, static_cast<int>(a.Sk)};
}
__device__ __forceinline__ BatchRequest request_of(const attn_lt_batch_args& a, int b, bool report) {
    return batch_request(a, b, report);
}
// Whether key `key` (< the request's keys) of request b lies in a block whose id is out of range.
__device__ __forceinline__ bool key_block_bad(const attn_lt_flash_args&, int, int, int) { return false; }
__device__ __forceinline__ bool key_block_bad(const attn_lt_batch_args& a, int b, int key, int log2_bs) {
    return paged_block(a, b, key, log2_bs) < 0;
}

// Paged caches (serving batches). A thread copies rows r0, r0 + kRowStep, ... of one column of each key tile. The
// table entries of a tile are loaded when the tile before it is issued (paged_fetch: one entry a lane, nothing waits
// on it), so that their latency hides under a tile's work; paged_ids checks and distributes them when the tile is
// issued, and paged_copy issues its K and V rows.
template <int D, bool F8 = false>
struct PagedRows {
    static constexpr int kChunks = D / (F8 ? 16 : 8), kRowStep = kThreads / kChunks, kPasses = kBlockN / kRowStep;
    int raw;           // the table entry of block `lane` of the tile fetched (lanes past its blocks: none)
    int blk[kPasses];  // block ids of this thread's rows of the tile being issued; -1: out of range, -2: no row
};

// Lane L of each warp loads the table entry of block L of request b's tile [n0, n0 + valid) (valid >= 1; a tile spans
// at most 64 / 8 blocks).
template <int D, bool F8>
__device__ __forceinline__ void paged_fetch(PagedRows<D, F8>& p, const attn_lt_batch_args& a, int b, int n0, int valid,
                                            int log2_bs) {
    const int lane = threadIdx.x % 32, first = n0 >> log2_bs, blocks = ((n0 + valid - 1) >> log2_bs) - first + 1;
    p.raw = lane < blocks ? __ldg(a.block_table + b * a.bt_stride + first + lane) : 0;
}

// The block ids of this thread's rows of the tile [n0, n0 + valid) from the entries paged_fetch loaded, by shuffle.
// An id out of range is recorded (a.error, and *bad, this thread's flag, which the block joins at its next barrier:
// the softmax then hides the keys of such blocks) and its rows are not read.
template <int D, bool F8>
__device__ __forceinline__ void paged_ids(PagedRows<D, F8>& p, const attn_lt_batch_args& a, int n0, int valid,
                                          int log2_bs, int* bad) {
    using P = PagedRows<D, F8>;
    const int r0 = threadIdx.x / P::kChunks, lane = threadIdx.x % 32, first = n0 >> log2_bs;
    const int blocks = ((n0 + valid - 1) >> log2_bs) - first + 1;  // the lanes paged_fetch loaded an entry for
    const int id = lane >= blocks ? -2 : paged_id_ok(a, p.raw) ? p.raw : -1;
    if (id == -1) {
        *bad = 1;
        atomicOr(a.error, ATTN_LT_BATCH_BAD_BLOCK);
    }
#pragma unroll
    for (int i = 0; i < P::kPasses; ++i) {
        const int r = r0 + i * P::kRowStep;
        const int from = __shfl_sync(0xffffffffu, id, min(((n0 + r) >> log2_bs) - first, 31));
        p.blk[i] = r < valid ? from : -2;
    }
}

// The address of element row_col (its row in the block times the row stride, plus the column) of block blk (>= 0) of
// a paged cache at `base`: a paged cache's block stride, and a block's rows, are below 2^31 elements
// (batch_status), so that a row costs one 32 x 32-bit multiply-add into 64 bits.
template <typename T>
__device__ __forceinline__ const T* paged_at(const T* base, int blk, int64_t sb, int row_col) {
    return base + (static_cast<uint64_t>(static_cast<uint32_t>(blk)) * static_cast<uint32_t>(sb) +
                   static_cast<uint32_t>(row_col));
}

// The K and V rows of a key tile starting at key n0 from the block ids paged_ids fetched; rows without a block
// (past the keys, or out of range) are zero-filled.
template <int D, typename T>
__device__ __forceinline__ void paged_copy(T* dK, T* dV, const T* k, const T* v, const PagedRows<D>& p,
                                           const attn_lt_flash_args& a, int n0, int log2_bs) {
    using P = PagedRows<D>;
    const int r0 = threadIdx.x / P::kChunks, c = (threadIdx.x % P::kChunks) * 8;
    const int mask = (1 << log2_bs) - 1;
#pragma unroll
    for (int i = 0; i < P::kPasses; ++i) {
        const int r = r0 + i * P::kRowStep, j = (n0 + r) & mask;
        const bool ok = p.blk[i] >= 0;
        const int blk = ok ? p.blk[i] : 0;  // (nothing is read without ok: block 0 keeps the address in the cache)
        cp_async16(dK + swz<D>(r, c), paged_at(k, blk, a.k_sb, j * int(a.k_ss) + c), ok ? 16 : 0);
        cp_async16(dV + swz<D>(r, c), paged_at(v, blk, a.v_sb, j * int(a.v_ss) + c), ok ? 16 : 0);
    }
}

// ---- FP8 K and V (decode blocks) -----------------------------------------------------------------------------------
// A key tile of e4m3 bytes: rows of D bytes in 16-byte chunks. K goes straight from shared memory into MMA B
// fragments: for k step kk = 4 kq + i, thread (n = lane / 4, t = lane % 4) takes bytes 4 i .. 4 i + 3 of chunk
// 4 kq + t of key row n (one 16-byte load a row and kq), its pairs converted to fp16 (cvt e4m3x2). The dot product
// does not care which physical columns make up a k step as long as Q's A fragments take the same ones: Q is staged
// in that order (stage_q_f16). V goes through ldmatrix.trans on 8 keys x 16 bytes: a thread gets keys 2t, 2t+1 of
// byte columns 2c and 2c + 1 (c = lane / 4), a byte permute splits them into the B fragments of two n8 output
// tiles, "even" (physical column 2c of the chunk) and "odd" (2c + 1); the output tiles are thus interleaved, which
// the final store undoes (a thread's columns 16 u + 4 t .. + 3). Chunks are swizzled so that both reads are free of
// bank conflicts: K by the row's parity (a read phase takes two rows), V by row % 8 (D 64: row / 2 % 4).
template <int D>
__device__ __forceinline__ int swz8_k(int row, int chunk) {
    return row * D + ((D >= 128 ? chunk ^ ((row & 1) << 2) : chunk) << 4);
}
template <int D>
__device__ __forceinline__ int swz8_v(int row, int chunk) {
    return row * D + ((D >= 128 ? chunk ^ (row & 7) : chunk ^ ((row >> 1) & 3)) << 4);
}

// Rows [0, valid) of an e4m3 key tile (K row r at k + r * k_ss, V likewise) into the ring, rows past valid zeroed.
// A thread copies chunk c of rows r0, r0 + kRowStep, ...: kRowStep is a multiple of 8, so the rows share their
// swizzle and each pass is one pointer step (a whole tile: nothing else; a decode block is issue-bound).
template <int D>
__device__ __forceinline__ void load_tile8(uint8_t* dK, uint8_t* dV, const uint8_t* k, const uint8_t* v, int64_t k_ss,
                                           int64_t v_ss, int valid) {
    using P = PagedRows<D, true>;
    static_assert(P::kRowStep % 8 == 0, "one swizzle for a thread's rows");
    const int r0 = threadIdx.x / P::kChunks, c = threadIdx.x % P::kChunks;
    const int sk = swz8_k<D>(r0, c), sv = swz8_v<D>(r0, c);
    const uint8_t* pk = k + r0 * k_ss + c * 16;
    const uint8_t* pv = v + r0 * v_ss + c * 16;
    const int64_t step_k = P::kRowStep * k_ss, step_v = P::kRowStep * v_ss;
    if (valid == kBlockN) {
#pragma unroll
        for (int i = 0; i < P::kPasses; ++i, pk += step_k, pv += step_v) {
            cp_async16(dK + sk + i * P::kRowStep * D, pk);
            cp_async16(dV + sv + i * P::kRowStep * D, pv);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < P::kPasses; ++i, pk += step_k, pv += step_v) {
        const bool ok = r0 + i * P::kRowStep < valid;
        cp_async16(dK + sk + i * P::kRowStep * D, ok ? pk : k, ok ? 16 : 0);
        cp_async16(dV + sv + i * P::kRowStep * D, ok ? pv : v, ok ? 16 : 0);
    }
}

// paged_copy for e4m3 caches.
template <int D>
__device__ __forceinline__ void paged_copy8(uint8_t* dK, uint8_t* dV, const uint8_t* k, const uint8_t* v,
                                            const PagedRows<D, true>& p, const attn_lt_flash_args& a, int n0,
                                            int log2_bs) {
    using P = PagedRows<D, true>;
    const int r0 = threadIdx.x / P::kChunks, c = threadIdx.x % P::kChunks;
    const int mask = (1 << log2_bs) - 1;
    const int sk = swz8_k<D>(r0, c), sv = swz8_v<D>(r0, c);  // (load_tile8: one swizzle for the thread's rows)
    // blocks of at most kRowStep keys: every pass's row lies at the same place in its block
    const bool fixed_row = mask < P::kRowStep;
    const int j0 = (n0 + r0) & mask;
#pragma unroll
    for (int i = 0; i < P::kPasses; ++i) {
        const int j = fixed_row ? j0 : (j0 + i * P::kRowStep) & mask;
        const bool ok = p.blk[i] >= 0;
        const int blk = ok ? p.blk[i] : 0;  // (nothing is read without ok: block 0 keeps the address in the cache)
        cp_async16(dK + sk + i * P::kRowStep * D, paged_at(k, blk, a.k_sb, j * int(a.k_ss) + c * 16), ok ? 16 : 0);
        cp_async16(dV + sv + i * P::kRowStep * D, paged_at(v, blk, a.v_sb, j * int(a.v_ss) + c * 16), ok ? 16 : 0);
    }
}

// O += P V for one k16 step and one 16-byte chunk u of V: lo / hi are ldmatrix.trans's registers of keys 0-7 and
// 8-15 of the step; the even tile oe gets the chunk's even byte columns, the odd tile oo its odd ones.
__device__ __forceinline__ void mma_v8(float* oe, float* oo, const unsigned* p, unsigned lo, unsigned hi) {
    uint32_t le, lo_, he, ho;  // (keys 0-7, keys 8-15) x (even, odd columns)
    f16x2x2_of_e4m3x4(__byte_perm(lo, 0, 0x3120), le, lo_);
    f16x2x2_of_e4m3x4(__byte_perm(hi, 0, 0x3120), he, ho);
    mma<__half>(oe, p, le, he);
    mma<__half>(oo, p, lo_, ho);
}

// A decode block's 16 rows of Q (rows past m_valid zero) staged as fp16 in the order of the FP8 QK^T's A fragments:
// word ((kk * 8 + row % 8) * 4 + t) * 4 + 2 h + row / 8 holds the pair of physical columns
// 16 (4 (kk / 4) + t) + 4 (kk % 4) + 2 h and + 1 of `row`, so that a lane's fragment is one 16-byte load whose four
// registers are the MMA's A operand as they land. Q is divided by 2^e (f16_headroom_exp); returns 2^e, which the
// caller folds into the softmax scale. Every thread of the block calls it (a block-wide max).
template <int D, typename T>
__device__ __forceinline__ float stage_q_f16(uint32_t* sQw, const T* qb, int m0, int m_valid, int g, int64_t q_sh,
                                             int64_t q_ss, float* red) {
    constexpr int kChunks = D / 8, kEach = 16 * kChunks / kThreads;  // 8-element chunks a thread
    static_assert(kEach >= 1 && 16 * kChunks % kThreads == 0, "whole chunks a thread");
    float x[kEach][8];
    float amax = 0.f;
#pragma unroll
    for (int u = 0; u < kEach; ++u) {
        const int i = threadIdx.x + u * kThreads, r = i / kChunks, c = (i % kChunks) * 8, rr = m0 + r;
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (r < m_valid) raw = *reinterpret_cast<const uint4*>(qb + (rr % g) * q_sh + int64_t(rr / g) * q_ss + c);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            x[u][j] = static_cast<float>(e[j]);
            amax = fmaxf(amax, fabsf(x[u][j]));
        }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
    const int e = f16_headroom_exp(amax);
    const float mul = __int_as_float((127 - e) << 23);
#pragma unroll
    for (int u = 0; u < kEach; ++u) {
        const int i = threadIdx.x + u * kThreads, r = i / kChunks, c = (i % kChunks) * 8;
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            const int d = c + j, ch = d / 16, kk = 4 * (ch / 4) + (d % 16) / 4;
            sQw[((kk * 8 + r % 8) * 4 + ch % 4) * 4 + (d % 4) / 2 * 2 + r / 8] =
                pack2<__half>(x[u][j] * mul, x[u][j + 1] * mul);
        }
    }
    return __int_as_float((127 + e) << 23);
}

// The FP8 QK^T's A fragment of k step kk (rows lane / 4 and + 8) from the staged Q (stage_q_f16).
__device__ __forceinline__ void q_frag_f16(unsigned* qf, const uint32_t* sQw, int kk, int lane) {
    const uint4 f = *reinterpret_cast<const uint4*>(sQw + ((kk * 8 + lane / 4) * 4 + lane % 4) * 4);
    qf[0] = f.x, qf[1] = f.y, qf[2] = f.z, qf[3] = f.w;
}

// One element of the user mask in the exp2 domain: 0 or -inf for a bool mask (true = attend), else the additive
// value times log2(e).
__device__ __forceinline__ float mask_value(const void* mask, int dtype, int64_t idx) {
    switch (dtype) {
        case ATTN_LT_BOOL:
            return static_cast<const unsigned char*>(mask)[idx] ? 0.f : -INFINITY;
        case ATTN_LT_F16:
            return __half2float(static_cast<const __half*>(mask)[idx]) * kLog2e;
        case ATTN_LT_BF16:
            return __bfloat162float(static_cast<const __nv_bfloat16*>(mask)[idx]) * kLog2e;
        default:
            return static_cast<const float*>(mask)[idx] * kLog2e;
    }
}

// Two adjacent keys of a mask row staged in shared memory (p: the first), in the exp2 domain.
__device__ __forceinline__ float2 mask_pair(const unsigned char* p, int dtype) {
    switch (dtype) {
        case ATTN_LT_BOOL: return mask_pair_of<bool>(p);
        case ATTN_LT_F16: return mask_pair_of<__half>(p);
        case ATTN_LT_BF16: return mask_pair_of<__nv_bfloat16>(p);
        default: return mask_pair_of<float>(p);
    }
}

__host__ __device__ __forceinline__ int mask_elem_bytes(int dtype) {
    return dtype == ATTN_LT_BOOL ? 1 : dtype == ATTN_LT_F32 ? 4 : 2;
}

// A staged mask row: the tile's 64 keys plus 16 bytes, so that the 8 rows of an MMA fragment read different banks.
__host__ __device__ __forceinline__ int mask_pitch(int es) { return kBlockN * es + 16; }

// Whether the mask's rows can be copied in 16-byte chunks: key stride 1, every row start 16-byte aligned.
__host__ __device__ __forceinline__ bool mask_rows_aligned(const attn_lt_flash_args& a) {
    const int es = mask_elem_bytes(a.mask_dtype);
    return a.mask_dtype != ATTN_LT_NONE && a.m_sk == 1 &&
           (reinterpret_cast<uintptr_t>(a.mask) | uint64_t((a.m_sb | a.m_sh | a.m_sq) * es)) % 16 == 0;
}

// Mask rows a block stages in shared memory with each K/V tile (cp.async, same commit group), or 0 where it reads
// the mask by element strides; one rule for the launcher (which reserves [stages][rows][mask_pitch] bytes) and the
// kernel. Aligned masks only; decode blocks (W): their 16 rows, or their query positions when every head shares
// the mask (m_sh == 0); 64-row blocks (D <= 128, for shared memory): one row per query position when a group of 4
// or more heads shares the mask (at most 16 positions a block), else their 64 rows when an element takes at most
// 2 bytes (fp32 rows would leave no room for two CTAs an SM).
__host__ __device__ __forceinline__ int mask_stage_rows(const attn_lt_flash_args& a, bool W, int D) {
    if (!mask_rows_aligned(a)) return 0;
    if (W) return 16;
    if (D > 128) return 0;
    if (a.m_sh == 0 && a.Hq / a.Hkv >= 4) return 16;
    return mask_elem_bytes(a.mask_dtype) <= 2 ? 64 : 0;
}

// This thread's chunks of a staged mask tile: chunk u < U is chunk threadIdx.x + u * kThreads of the rows copied a
// tile (16-byte chunks, row by row); where it lands in the stage, its first key in the tile, its mask row's element
// offset (`ok` false past the block's last row: zeros) — the same for every tile, so computed once.
template <int U>
struct MaskChunks {
    int dst[U];  // byte offset in the stage, -1: no chunk
    int key[U];
    int64_t off[U];
    bool ok[U];
};

// Copy keys [n0, n0 + kBlockN) of the staged rows into `dst`; keys past Sk are zero-filled (the key tail is masked
// anyway).
template <int U>
__device__ __forceinline__ void load_mask_tile(unsigned char* dst, const unsigned char* mask, const MaskChunks<U>& m,
                                               int es, int n0, int Sk) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (m.dst[u] < 0) break;
        const int key = n0 + m.key[u];
        const int bytes = m.ok[u] ? max(0, min(16, (Sk - key) * es)) : 0;
        cp_async16(dst + m.dst[u], mask + (bytes ? (m.off[u] + key) * es : 0), bytes);
    }
}

// Stages of the K/V ring: three where two CTAs an SM still fit (one m16 tile a warp, D <= 128; a 64-row block
// staging its mask tiles has no room left for a third), so that a memory-bound block (decode) keeps two tiles in
// flight; else two.
// FP8 K/V (decode blocks): a stage holds half the bytes, so four (D 256: three) keep as many in flight.
template <int D, int MT, bool W, bool SM, bool F8 = false>
constexpr int stages() {
    if constexpr (F8) return D <= 128 ? 4 : 3;
    return MT == 1 && D <= 128 && (W || !SM) ? 3 : 2;
}

// W (decode, at most 16 rows a block): the four warps share the block's 16 rows and split each 64-key tile into four
// 16-key slices, each warp with its own online softmax; the warps' (max, sum, O) are joined through shared memory at
// the end. Without W a warp owns MT m16 row tiles and every key of a tile.
// SM: shared memory holds mask stages (the launcher reserves them where mask_stage_rows says so).
// BT: a serving batch (attn_lt_batch_args): the block's request and its lengths come from device memory. Its
// requests of at most decode_rows rows a kv head run on the decode grid, their keys in parts of split_keys
// (merged by LSE): W blocks those of at most 16 rows, group blocks (G, MT 1, without W; one CTA a request, kv head
// and part, reading each key tile once) the others: G 2 up to 32 rows, two warps on each 16 rows splitting every
// key tile as W's four do; G 1 up to 64, a warp an m16 tile. The row blocks (neither) run the longer requests, keys
// whole.
// F8 (W blocks only): k and v hold e4m3 (attn_lt_flash_args::kv_dtype), the MMAs run in fp16.
// Group blocks run at D <= 128 on a 16-bit cache; at D 256 (whose 64-row block spills) and on an FP8 cache W blocks
// take every request of the decode grid, a 16-row block for each 16.
template <int D, bool F8>
constexpr bool kGroupBlocks = D <= 128 && !F8;
// Rows of a block (W 16, G 2 32, else a warp's MT m16 tiles each), and the warps that share each m16 row tile,
// splitting each key tile between them.
template <int MT, bool W, int G>
constexpr int block_rows() { return W ? 16 : G == 2 ? 32 : kWarps * 16 * MT; }
template <bool W, int G>
constexpr int key_splits() { return W ? kWarps : G == 2 ? 2 : 1; }
template <bool BT>
using KernelArgs = std::conditional_t<BT, attn_lt_batch_args, attn_lt_flash_args>;
// Decode blocks that can store a step's scores (attn_lt_flash_args::scores): a dense call on an FP8 cache stores
// none (attn_lt_flash_fwd refuses them), so its blocks are built without the store path.
template <bool W, bool BT, bool F8>
constexpr bool kStoresScores = W && (BT || !F8);

// CTAs an SM the registers must leave room for: FP8 decode blocks (D <= 128) three, so that a memory-bound decode
// has twelve warps an SM to hide its latencies (their stages are half as large; four CTAs would spill at D 64);
// else two where one m16 tile a warp (or D 64), one otherwise.
template <int D, int MT, bool F8>
constexpr int flash_min_ctas() { return F8 && D <= 128 ? 3 : (D == 64 || MT == 1) ? 2 : 1; }

template <int D, typename T, int MT, bool W, bool SM, bool BT = false, bool F8 = false, int G = 0>
__global__ void __launch_bounds__(kThreads, flash_min_ctas<D, MT, F8>()) flash_fwd(const KernelArgs<BT> args) {
    static_assert(!BT || !SM, "serving batches take no dense mask");
    static_assert(G == 0 || (BT && !W && MT == 1 && kGroupBlocks<D, F8>), "group blocks: a batch's decode grid");
    static_assert(!F8 || (W && !SM), "FP8 K/V: decode blocks, masks read by strides");
    using KV = std::conditional_t<F8, uint8_t, T>;  // K/V elements in memory
    using C = std::conditional_t<F8, __half, T>;    // the MMAs' operands
    const attn_lt_flash_args& a = flash_of(args);
    static_assert(!W || MT == 1, "the warp-split mode has one m16 tile");
    static_assert(!SM || MT == 1, "masks run with one m16 tile a warp");
    constexpr int kBlockM = block_rows<MT, W, G>();
    constexpr int kKS = key_splits<W, G>();  // warps on each m16 row tile
    constexpr int kNW = kBlockN / kKS;       // keys of a tile a warp takes
    constexpr int kStages = stages<D, MT, W, SM, F8>();
    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + kBlockM * D;            // [kStages][kBlockN * D]
    T* sV = sK + kStages * kBlockN * D;  // [kStages][kBlockN * D]
    // FP8: Q as fp16 words (stage_q_f16) where sQ is, then the e4m3 K and V rings ([kStages][kBlockN * D] bytes each)
    uint32_t* sQw = reinterpret_cast<uint32_t*>(smem);
    uint8_t* sK8 = reinterpret_cast<uint8_t*>(sK);
    uint8_t* sV8 = sK8 + kStages * kBlockN * D;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest (causal) blocks first
    const int64_t bk = blockIdx.y, b = bk / a.Hkv, hk = bk % a.Hkv;
    const int g = static_cast<int>(a.Hq / a.Hkv);
    // The request of a serving batch (its lengths from device memory), or the dense call's shape.
    const BatchRequest req = request_of(args, static_cast<int>(b), blockIdx.x == 0 && hk == 0 && blockIdx.z == 0 &&
                                                                       threadIdx.x == 0);
    if constexpr (BT) {  // this kernel's requests (see BT above): rows a kv head in (lo, hi]; another's return
        const int rows = req.nq * g, dr = args.decode_rows;
        const int lo = G == 2 ? kBatchSmallRows : G == 1 ? 32 : dr;  // (W: none)
        const int hi = W ? (kGroupBlocks<D, F8> ? kBatchSmallRows : dr) : G == 2 ? min(32, dr) : G == 1 ? dr : INT_MAX;
        if ((!W && rows <= lo) || rows > hi) return;
    }
    const int Sq = req.nq, Sk = req.nk;
    const int64_t q_row0 = req.q0;  // serving batches: the request's first packed query row
    // (paged caches: rows addressed by paged_copy)
    const KV* k = static_cast<const KV*>(a.k) + (BT ? req.k0 * a.k_ss : b * a.k_sb) + hk * a.k_sh;  // paged: k0 = 0
    const KV* v = static_cast<const KV*>(a.v) + (BT ? req.k0 * a.v_ss : b * a.v_sb) + hk * a.v_sh;
    const int rows_all = g * Sq;  // below 2^31 (checked on the host)
    const int m0 = m_block * kBlockM;
    if (BT && m0 >= rows_all) return;  // past the request's rows (a request without rows writes nothing)
    const int m_valid = min(kBlockM, rows_all - m0);
    const int wr = G == 2 ? warp % 2 : warp;  // (without W) this warp's rows: m16 tiles wr * MT, ...; G 2: w, w + 2
    const int shift = Sk - Sq;  // causal: key j visible to query position i iff j <= i + shift
    const T* qb = static_cast<const T*>(a.q) + (BT ? q_row0 * a.q_ss : b * a.q_sb) + hk * g * a.q_sh;
    // Decode blocks of a one-row sequence store their rows' scores (attn_lt_flash_args::scores) here: head hk g + r
    // at s_out[r * s_sh + key].
    float* s_out = nullptr;
    if constexpr (kStoresScores<W, BT, F8>) {
        if (a.scores != nullptr && Sq == 1) {
            int64_t at = b * a.s_sb;
            if constexpr (BT) {
                if (args.cu_k != nullptr) at = req.k0;
            }
            s_out = a.scores + at + hk * g * a.s_sh;
        }
    }
    // whether every row's even keys start 8-byte aligned pairs (the score stores)
    const bool s_pairs = kStoresScores<W, BT, F8> && reinterpret_cast<uintptr_t>(s_out) % 8 == 0 && a.s_sh % 2 == 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // The merge of the splits (a dependent grid, see merge) launches once every CTA of this grid got here or
    // exited; it waits in griddepcontrol.wait until this grid has finished and its writes are visible.
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif

    // This block's key tiles [t_lo, n_tiles) under the window (causal: the right edge 0), then this split's share.
    const Window win = window_of(a);
    const int p_first = m0 / g, p_last = (m0 + m_valid - 1) / g;
    int n_tiles = (Sk + kBlockN - 1) / kBlockN, t_lo = 0;
    window_tiles(win, p_first, p_last, shift, kBlockN, t_lo, n_tiles);
    // Serving batches split by a fixed part size (the part count follows the request's keys, the grid the capacity).
    const bool fixed_parts = BT && gridDim.z > 1;
    const int per_split = fixed_parts ? split_tiles(args) : (n_tiles - t_lo + gridDim.z - 1) / gridDim.z;
    // A serving batch's parts run last part first: the parts only long requests have are scheduled before the
    // parts every request has, so that the grid ends on many CTAs of similar length, not on a long request's tail.
    const int part = fixed_parts ? static_cast<int>(gridDim.z - 1 - blockIdx.z) : static_cast<int>(blockIdx.z);
    const int start = fixed_parts ? part * per_split : min(n_tiles, t_lo + part * per_split);
    // A part past the request's keys returns: batch_parts(Sk, split_keys) parts exist (n_tiles is every key tile
    // here, the decode rows' window ending at the last key), and the merge reads only those.
    if (fixed_parts && start >= n_tiles) return;
    // (a fixed part before the window's first tile runs no tile: its partial is empty, which the merge weighs 0)
    const int t_end = min(n_tiles, start + per_split);
    const int t_begin = min(t_end, max(start, t_lo));
    // Paged caches: log2 of the block size; a block id out of range seen by this thread, and by any thread as of the
    // last barrier (joined there: the softmax then hides the keys of such blocks).
    int log2_bs = 0, bad_seen = 0, bad_any = 0;
    PagedRows<D, F8> pages;  // (paged caches) the table entries of the next tile to issue, then its rows' block ids
    if constexpr (BT) {
        if (args.block_table != nullptr) log2_bs = __ffsll(args.block_size) - 1;
        if (log2_bs > 0 && t_begin < t_end)
            paged_fetch(pages, args, static_cast<int>(b), t_begin * kBlockN, min(kBlockN, Sk - t_begin * kBlockN),
                        log2_bs);
    }

    // Rows of this thread: for m tile t, tile row (warp * MT + t) * 16 + lane / 4 and that + 8; their query
    // position, and (masks run with MT = 1 only) the mask's offset of that (b, h, position).
    constexpr bool kMaskable = MT == 1;
    const bool has_mask = kMaskable && a.mask_dtype != ATTN_LT_NONE;
    // Staged mask rows (mask_stage_rows): the block's query positions p0 .. p0 + n_pos - 1 (by_pos), else its rows.
    constexpr int kMU = W ? 2 : 4;  // 16-byte chunks of a mask tile a thread copies, at most
    const int mes = mask_elem_bytes(a.mask_dtype), mpitch = mask_pitch(mes);
    const int n_stage = SM ? mask_stage_rows(a, W, D) : 0;
    const bool staged = n_stage > 0;
    const bool by_pos = staged && (W ? a.m_sh == 0 : n_stage == 16);
    const int p0 = m0 / g, n_pos = (m0 + m_valid - 1) / g - p0 + 1;
    const int stage_bytes = n_stage * mpitch;
    // rows copied a tile: by position only the block's positions (nothing reads past them), else all staged rows
    // (rows past the block's last are zero-filled: they feed rows whose results are dropped)
    const int n_load = by_pos ? n_pos : n_stage;
    unsigned char* sM = reinterpret_cast<unsigned char*>(sV + kStages * kBlockN * D);  // [kStages][stage_bytes]
    const unsigned char* mask_bytes = static_cast<const unsigned char*>(a.mask);
    // The mask's element offset of folded row r: (b, query head hk * g + r % g, position r / g).
    auto mask_row = [&](int r) { return b * a.m_sb + (hk * g + r % g) * a.m_sh + int64_t(r / g) * a.m_sq; };
    MaskChunks<kMU> mch;  // staged: this thread's chunks of a mask tile
#pragma unroll
    for (int u = 0; u < kMU; ++u) {
        const int per_row = kBlockN * mes / 16;  // 16-byte chunks a row: 4, 8 or 16
        const int i = threadIdx.x + u * kThreads, row = i / per_row, c = i % per_row;
        mch.dst[u] = staged && i < n_load * per_row ? row * mpitch + c * 16 : -1;
        mch.key[u] = c * (16 / mes);
        mch.ok[u] = staged && row < (by_pos ? n_pos : m_valid);
        // by position: the heads share the mask (m_sh == 0), so the position's first folded row stands for it
        mch.off[u] = mch.ok[u] ? mask_row(by_pos ? (p0 + row) * g : m0 + row) : 0;
    }
    int pos[MT][2];
    int64_t moff[MT][2];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int r = min(m0 + (W ? 0 : (wr * MT + t) * 16) + lane / 4 + e * 8, rows_all - 1);  // rows past the end:
            pos[t][e] = r / g;                                                                // results unused
            if (kMaskable) moff[t][e] = mask_row(r);
        }

    if constexpr (!F8) {  // Q rows (folded heads), zero past the last row (FP8: staged after the prologue)
        constexpr int kChunks = D / 8;
        for (int i = threadIdx.x; i < kBlockM * kChunks; i += kThreads) {
            const int r = i / kChunks, c = (i % kChunks) * 8;
            const bool ok = r < m_valid;
            const int rr = ok ? m0 + r : 0;
            cp_async16(sQ + swz<D>(r, c), qb + (rr % g) * a.q_sh + int64_t(rr / g) * a.q_ss + c, ok ? 16 : 0);
        }
    }
    // Ring slot `slot` receives key tile `tile`: K, V and the staged mask rows, one commit group (an empty one past
    // the last tile, so that the wait counts stay the same).
    auto load_stage = [&](int slot, int tile) {
        if (tile < t_end) {
            const int n0 = tile * kBlockN, valid = min(kBlockN, Sk - n0);
            if constexpr (F8) {
                uint8_t* dK = sK8 + slot * kBlockN * D;
                uint8_t* dV = sV8 + slot * kBlockN * D;
                if (log2_bs > 0) {
                    if constexpr (BT) {
                        paged_ids(pages, args, n0, valid, log2_bs, &bad_seen);
                        paged_copy8<D>(dK, dV, k, v, pages, a, n0, log2_bs);
                        const int n1 = n0 + kBlockN;
                        if (tile + 1 < t_end) paged_fetch(pages, args, static_cast<int>(b), n1, min(kBlockN, Sk - n1), log2_bs);
                    }
                } else {
                    load_tile8<D>(dK, dV, k + int64_t(n0) * a.k_ss, v + int64_t(n0) * a.v_ss, a.k_ss, a.v_ss, valid);
                }
            } else if (log2_bs > 0) {  // (paged: BT only)
                if constexpr (BT) {
                    paged_ids(pages, args, n0, valid, log2_bs, &bad_seen);
                    paged_copy<D>(sK + slot * kBlockN * D, sV + slot * kBlockN * D, k, v, pages, a, n0, log2_bs);
                    const int n1 = n0 + kBlockN;
                    if (tile + 1 < t_end) paged_fetch(pages, args, static_cast<int>(b), n1, min(kBlockN, Sk - n1), log2_bs);
                }
            } else if (valid == kBlockN && (D <= 128 || W)) {  // (D 256 row blocks: the unrolled copy spills there)
                load_key_tile<D>(sK + slot * kBlockN * D, k + int64_t(n0) * a.k_ss, a.k_ss);
                load_key_tile<D>(sV + slot * kBlockN * D, v + int64_t(n0) * a.v_ss, a.v_ss);
            } else {
                load_tile<D>(sK + slot * kBlockN * D, k + int64_t(n0) * a.k_ss, a.k_ss, kBlockN, valid);
                load_tile<D>(sV + slot * kBlockN * D, v + int64_t(n0) * a.v_ss, a.v_ss, kBlockN, valid);
            }
            if (staged) load_mask_tile<kMU>(sM + slot * stage_bytes, mask_bytes, mch, mes, n0, Sk);
        }
        cp_async_commit();
    };
    // Prologue: tiles t_begin .. t_begin + kStages - 2 (the first group also holds Q, but FP8's).
#pragma unroll
    for (int st = 0; st < kStages - 1; ++st) load_stage(st, t_begin + st);
    // FP8: Q staged as fp16 while the first tiles are in flight (the factor 2^e it was scaled by joins the softmax
    // scale); the K/V descale factors.
    float q_mul = 1.f, k_desc = 1.f, v_desc = 1.f;
    if constexpr (F8) {
        __shared__ float s_qmax[kWarps];
        q_mul = stage_q_f16<D, T>(sQw, qb, m0, m_valid, g, a.q_sh, a.q_ss, s_qmax);
        if (a.k_descale != nullptr) k_desc = a.k_descale[hk * a.descale_sh];
        if (a.v_descale != nullptr) v_desc = a.v_descale[hk * a.descale_sh];
    }

    float o[MT][D / 8][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
        for (int d = 0; d < D / 8; ++d) o[t][d][0] = o[t][d][1] = o[t][d][2] = o[t][d][3] = 0.f;
        m[t][0] = m[t][1] = -INFINITY;
        l[t][0] = l[t][1] = 0.f;
    }
    // (FP8: the raw dot products carry Q's 2^-e and K's descale factor)
    const float qk_scale = a.scale * q_mul * k_desc;
    const float sl2 = qk_scale * kLog2e;
    // softcap: the scaled score s becomes cap * tanh(s / cap), here straight into the exp2 domain
    const bool capped = a.softcap > 0.f;
    const float cap_in = capped ? qk_scale / a.softcap : 0.f, cap_out = a.softcap * kLog2e;
    const int wrow = W ? 0 : wr * MT * 16;                  // this warp's first row in the block
    const int wkey = W ? warp * kNW : G == 2 ? warp / 2 * kNW : 0;  // and first key in a tile
    const bool warp_active = W || wrow < m_valid;

    // Decode blocks (W, D <= 128) keep their 16 rows of Q as A fragments in registers (read from shared memory
    // once, with the first tile), not again every tile.
    constexpr bool kQRegs = W && D <= 128;
    unsigned qr[kQRegs ? D / 16 : 1][4];
    for (int it = t_begin; it < t_end; ++it) {
        const int buf = (it - t_begin) % kStages;
        cp_async_wait<kStages - 2>();
        // tile it (and Q) is in; every warp is done with tile it - 1's buffer; tile it's block ids were checked
        if constexpr (BT) bad_any = __syncthreads_or(bad_seen);
        else __syncthreads();
        load_stage((buf + kStages - 1) % kStages, it + kStages - 1);  // into the slot tile it - 1 used
        if constexpr (kQRegs) {
            if (it == t_begin) {
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    if constexpr (F8) q_frag_f16(qr[kk], sQw, kk, lane);
                    else ldsm_x4(qr[kk][0], qr[kk][1], qr[kk][2], qr[kk][3],
                                 sQ + swz<D>(lane % 16, kk * 16 + (lane / 16) * 8));
                }
            }
        }
        if (!warp_active) continue;  // this warp's rows are all past the end (decode: a few rows a block)
        const T* tK = sK + buf * kBlockN * D;
        const T* tV = sV + buf * kBlockN * D;
        const int n0 = it * kBlockN;

        // The user mask of this tile (exp2 domain): from its staged copy (it came with the K/V tile), else element
        // by element, loaded before Q K^T so that the MMAs hide part of the latency.
        float mk[MT][kNW / 8][4];
        if (staged) {
            const unsigned char* tM = sM + buf * stage_bytes;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const unsigned char* mrow = tM + (by_pos ? pos[0][r] - p0 : wrow + lane / 4 + r * 8) * mpitch;
#pragma unroll
                for (int j = 0; j < kNW / 8; ++j) {
                    const float2 x = mask_pair(mrow + (wkey + j * 8 + (lane % 4) * 2) * mes, a.mask_dtype);
                    mk[0][j][2 * r] = x.x;
                    mk[0][j][2 * r + 1] = x.y;
                }
            }
        } else if (has_mask) {
#pragma unroll
            for (int t = 0; t < MT; ++t)
#pragma unroll
                for (int j = 0; j < kNW / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = n0 + wkey + j * 8 + (lane % 4) * 2 + (e & 1);
                        mk[t][j][e] = key < Sk ? mask_value(a.mask, a.mask_dtype, moff[t][e >> 1] + key * a.m_sk) : 0.f;
                    }
        }
        // S = Q K^T: MT x (16 rows x kNW keys) a warp; Q fragments re-read from shared memory every k step.
        float s[MT][kNW / 8][4];
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
            for (int j = 0; j < kNW / 8; ++j) s[t][j][0] = s[t][j][1] = s[t][j][2] = s[t][j][3] = 0.f;
        if constexpr (F8) {  // K from the e4m3 ring straight into B fragments (see "FP8 K and V")
            const uint8_t* tK8 = sK8 + buf * kBlockN * D;
#pragma unroll
            for (int kq = 0; kq < D / 64; ++kq) {
                uint4 w[kNW / 8];
#pragma unroll
                for (int j = 0; j < kNW / 8; ++j)
                    w[j] = *reinterpret_cast<const uint4*>(tK8 + swz8_k<D>(wkey + j * 8 + lane / 4, 4 * kq + lane % 4));
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    unsigned qf[4];
                    if constexpr (kQRegs) qf[0] = qr[4 * kq + i][0], qf[1] = qr[4 * kq + i][1],
                                          qf[2] = qr[4 * kq + i][2], qf[3] = qr[4 * kq + i][3];
                    else q_frag_f16(qf, sQw, 4 * kq + i, lane);
#pragma unroll
                    for (int j = 0; j < kNW / 8; ++j) {
                        uint32_t b0, b1;
                        f16x2x2_of_e4m3x4((&w[j].x)[i], b0, b1);
                        mma<__half>(s[0][j], qf, b0, b1);
                    }
                }
            }
        }
#pragma unroll
        for (int kk = 0; kk < (F8 ? 0 : D / 16); ++kk) {
            unsigned qf[MT][4];
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                if constexpr (kQRegs) {
                    qf[t][0] = qr[kk][0], qf[t][1] = qr[kk][1], qf[t][2] = qr[kk][2], qf[t][3] = qr[kk][3];
                } else {
                    ldsm_x4(qf[t][0], qf[t][1], qf[t][2], qf[t][3],
                            sQ + swz<D>(wrow + t * 16 + (lane % 16), kk * 16 + (lane / 16) * 8));
                }
            }
#pragma unroll
            for (int j = 0; j < kNW / 8; j += 2) {
                unsigned b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3, tK + swz<D>(wkey + j * 8 + (lane % 8) + (lane / 16) * 8,
                                                   kk * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    mma<T>(s[t][j], qf[t], b0, b1);
                    mma<T>(s[t][j + 1], qf[t], b2, b3);
                }
            }
        }
        // Scale to the exp2 domain (softcapped), add the user mask, mask the key tail and the window's edges (causal:
        // the triangle), online softmax.
        const bool bad_blocks = bad_any;  // (paged: some block id out of range)
        const bool need_mask = n0 + kBlockN > Sk || (win.right >= 0 && n0 + kBlockN - 1 > p_first + shift + win.right) ||
                               (win.left >= 0 && n0 < p_last + shift - win.left) || bad_blocks;
        // (the common tile, nothing to mask or cap: one multiply a score)
        const bool plain = !capped && !need_mask && !has_mask;
        unsigned pf[MT][kNW / 16][4];
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            float mx[2] = {m[t][0], m[t][1]};
            if (plain) {
#pragma unroll
                for (int j = 0; j < kNW / 8; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[t][j][e] *= sl2;
            }
#pragma unroll
            for (int j = 0; j < kNW / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    if (plain) break;
                    float x = capped ? cap_out * tanh_approx(s[t][j][e] * cap_in) : s[t][j][e] * sl2;
                    const int key = n0 + wkey + j * 8 + (lane % 4) * 2 + (e & 1);
                    const int diag = pos[t][e >> 1] + shift;
                    if (need_mask && (key >= Sk || (win.right >= 0 && key > diag + win.right) ||
                                      (win.left >= 0 && key < diag - win.left) ||
                                      (bad_blocks && key_block_bad(args, static_cast<int>(b), key, log2_bs))))
                        x = -INFINITY;
                    else if (has_mask) x += mk[t][j][e];
                    s[t][j][e] = x;
                }
                mx[0] = fmaxf(mx[0], fmaxf(s[t][j][0], s[t][j][1]));
                mx[1] = fmaxf(mx[1], fmaxf(s[t][j][2], s[t][j][3]));
            }
            if constexpr (kStoresScores<W, BT, F8>) {
                // the scores as the softmax takes them: a thread's rows lane / 4 and + 8 (those below g), keys
                // key and key + 1 of each n8 tile, a pair in one 8-byte store where the row allows it
                if (s_out != nullptr) {
#pragma unroll
                    for (int j = 0; j < kNW / 8; ++j) {
                        const int key = n0 + wkey + j * 8 + (lane % 4) * 2;
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const int row = lane / 4 + 8 * h;
                            if (row >= g || key >= Sk) continue;
                            float* dst = s_out + row * a.s_sh + key;
                            if (s_pairs && key + 1 < Sk) {
                                *reinterpret_cast<float2*>(dst) = make_float2(s[t][j][2 * h], s[t][j][2 * h + 1]);
                            } else {
                                dst[0] = s[t][j][2 * h];
                                if (key + 1 < Sk) dst[1] = s[t][j][2 * h + 1];
                            }
                        }
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            }
            // The reference m of a row moves to its new max only when a row of the warp passes its reference by
            // more than kLazyRescale, so that O is rescaled about once a block, not on most of its first tiles. D 256
            // moves every time (its registers are full). An all-masked row keeps reference 0, so nothing becomes NaN.
            float ref[2];
            if (D == 256 ||
                __any_sync(0xffffffffu, mx[0] > m[t][0] + kLazyRescale || mx[1] > m[t][1] + kLazyRescale)) {
                float c[2];
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    ref[r] = mx[r] == -INFINITY ? 0.f : mx[r];
                    c[r] = ex2((m[t][r] == -INFINITY ? ref[r] : m[t][r]) - ref[r]);
                    m[t][r] = mx[r];
                    l[t][r] *= c[r];
                }
#pragma unroll
                for (int d = 0; d < D / 8; ++d) {
                    o[t][d][0] *= c[0];
                    o[t][d][1] *= c[0];
                    o[t][d][2] *= c[1];
                    o[t][d][3] *= c[1];
                }
            } else {
#pragma unroll
                for (int r = 0; r < 2; ++r) ref[r] = m[t][r] == -INFINITY ? 0.f : m[t][r];
            }
            // P = exp2(S - m), straight into A fragments (two n8 tiles = one k16 step of P V).
#pragma unroll
            for (int j = 0; j < kNW / 8; ++j) {
                const float p0 = ex2(s[t][j][0] - ref[0]), p1 = ex2(s[t][j][1] - ref[0]);
                const float p2 = ex2(s[t][j][2] - ref[1]), p3 = ex2(s[t][j][3] - ref[1]);
                l[t][0] += p0 + p1;
                l[t][1] += p2 + p3;
                pf[t][j / 2][(j % 2) * 2 + 0] = pack2<C>(p0, p1);
                pf[t][j / 2][(j % 2) * 2 + 1] = pack2<C>(p2, p3);
            }
        }
        // O += P V: V as the B operand, transposed by ldmatrix; each fragment feeds MT row tiles.
        if constexpr (F8) {  // (tiles 2u and 2u + 1: chunk u's even and odd columns, see "FP8 K and V")
            const uint8_t* tV8 = sV8 + buf * kBlockN * D;
#pragma unroll
            for (int kk = 0; kk < kNW / 16; ++kk) {
                const int key = wkey + kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
#pragma unroll
                for (int u = 0; u < D / 16; u += 2) {
                    unsigned x0, x1, x2, x3;
                    ldsm_x4_t(x0, x1, x2, x3, tV8 + swz8_v<D>(key, u + lane / 16));
                    mma_v8(o[0][2 * u], o[0][2 * u + 1], pf[0][kk], x0, x1);
                    mma_v8(o[0][2 * u + 2], o[0][2 * u + 3], pf[0][kk], x2, x3);
                }
            }
        }
#pragma unroll
        for (int kk = 0; kk < (F8 ? 0 : kNW / 16); ++kk) {
#pragma unroll
            for (int d = 0; d < D / 8; d += 2) {
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, tV + swz<D>(wkey + kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8,
                                                     d * 8 + (lane / 16) * 8));
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    mma<T>(o[t][d], pf[t][kk], b0, b1);
                    mma<T>(o[t][d + 1], pf[t][kk], b2, b3);
                }
            }
        }
    }
    // more than one part (batch_parts(Sk, split_keys) > 1, without its division); a serving batch's request of one
    // part writes its rows itself
    const bool split = fixed_parts ? Sk > split_tiles(args) * kBlockN : gridDim.z > 1;
    const int64_t rows_out = merge_rows(args);
    if constexpr (kKS > 1) {
        // Join the online softmaxes of the kKS warps on each 16 rows (W: the four warps, one row tile): every warp
        // puts its row max, row sum and unnormalised O in shared memory (over the K/V ring, now idle); then kTpr
        // threads finish each row of the block, thread t row t / kTpr from column (t % kTpr) * D / kTpr on.
        cp_async_wait<0>();
        __syncthreads();
        float* red_o = reinterpret_cast<float*>(sK);  // [4 warps][16 rows][D]
        float* red_m = red_o + kWarps * 16 * D;       // [4][16]
        float* red_l = red_m + kWarps * 16;           // [4][16]
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[0][r] += __shfl_xor_sync(0xffffffffu, l[0][r], 1);
            l[0][r] += __shfl_xor_sync(0xffffffffu, l[0][r], 2);
            const int row = lane / 4 + r * 8;
            if (lane % 4 == 0) {
                red_m[warp * 16 + row] = m[0][r];
                red_l[warp * 16 + row] = l[0][r];
            }
            if constexpr (F8) {  // the interleaved tiles back in column order
#pragma unroll
                for (int u = 0; u < D / 16; ++u)
                    *reinterpret_cast<float4*>(red_o + (warp * 16 + row) * D + u * 16 + (lane % 4) * 4) =
                        make_float4(o[0][2 * u][2 * r], o[0][2 * u + 1][2 * r], o[0][2 * u][2 * r + 1],
                                    o[0][2 * u + 1][2 * r + 1]);
            } else {
#pragma unroll
                for (int d = 0; d < D / 8; ++d)
                    *reinterpret_cast<float2*>(red_o + (warp * 16 + row) * D + d * 8 + (lane % 4) * 2) =
                        make_float2(o[0][d][2 * r], o[0][d][2 * r + 1]);
            }
        }
        __syncthreads();
        constexpr int kTpr = kThreads / kBlockM, kCols = D / kTpr;
        const int row = threadIdx.x / kTpr, c0 = (threadIdx.x % kTpr) * kCols;
        const int rr = m0 + row;
        if (rr >= rows_all) return;
        // the row's slots in the warps that hold it: warp row / 16 + i * (kWarps / kKS), its row row % 16
        int slot[kKS];
#pragma unroll
        for (int i = 0; i < kKS; ++i) slot[i] = W ? i * 16 + row : (row / 16 + i * (kWarps / kKS)) * 16 + row % 16;
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < kKS; ++i) mx = fmaxf(mx, red_m[slot[i]]);
        float wt[kKS], lsum = 0.f;
#pragma unroll
        for (int i = 0; i < kKS; ++i) {
            const float mw = red_m[slot[i]];
            wt[i] = mw == -INFINITY ? 0.f : ex2(mw - mx);
            lsum += wt[i] * red_l[slot[i]];
        }
        const int64_t head = hk * g + rr % g, p = rr / g;
        // the attention sink joins the denominator here, or (split) in the merge
        const float2 fin = finish_row(mx, lsum, split ? -INFINITY : sink_of(a, head) * kLog2e);
        const float inv = fin.x * v_desc, lse = fin.y;
        // the partials' row, and the LSE's: (b, h, position) of (B, Hq, Sq), or for a serving batch
        // (b, kv head, block row) of (B, Hkv, decode_rows) and (h, packed row) of (Hq, total_q)
        const int64_t orow = BT ? bk * decode_rows_of(args) + rr : (b * a.Hq + head) * a.Sq + p;
        const int64_t lrow = BT ? head * batch_total_q(args) + q_row0 + p : orow;
        float* op = split ? a.o_part + (part * rows_out + orow) * D + c0 : nullptr;
        T* out = static_cast<T*>(a.o) + (BT ? (q_row0 + p) * a.o_ss : b * a.o_sb + p * a.o_ss) + head * a.o_sh + c0;
#pragma unroll
        for (int c = 0; c < kCols; c += 2) {
            float x0 = 0.f, x1 = 0.f;
#pragma unroll
            for (int i = 0; i < kKS; ++i) {
                const float2 ow = *reinterpret_cast<const float2*>(red_o + slot[i] * D + c0 + c);
                x0 += wt[i] * ow.x;
                x1 += wt[i] * ow.y;
            }
            if (split) *reinterpret_cast<float2*>(op + c) = make_float2(x0 * inv, x1 * inv);
            else *reinterpret_cast<unsigned*>(out + c) = pack2<T>(x0 * inv, x1 * inv);
        }
        if (threadIdx.x % kTpr == 0) {
            if (split) a.lse_part[part * rows_out + orow] = lse;
            else if (a.lse != nullptr) a.lse[lrow] = lse;
        }
        return;
    }
    // Row sums across the quad, normalise, store O and LSE (or this split's FP32 partial and its LSE).
    const int col = (lane % 4) * 2;
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[t][r] += __shfl_xor_sync(0xffffffffu, l[t][r], 1);
            l[t][r] += __shfl_xor_sync(0xffffffffu, l[t][r], 2);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int rr = m0 + (warp * MT + t) * 16 + lane / 4 + r * 8;
            if (rr >= rows_all) continue;
            const int64_t head = hk * g + rr % g;
            const float2 fin = finish_row(m[t][r], l[t][r], split ? -INFINITY : sink_of(a, head) * kLog2e);
            const float inv = fin.x, lse = fin.y;
            // (b, h, position) in (B, Hq, Sq); a serving batch's LSE: (h, packed row) in (Hq, total_q)
            const int64_t row =
                BT ? head * batch_total_q(args) + q_row0 + pos[t][r] : (b * a.Hq + head) * a.Sq + pos[t][r];
            if (split) {  // (a serving batch's group blocks: the partials' row as the decode blocks')
                const int64_t orow = G == 1 ? bk * decode_rows_of(args) + rr : row;
                float* op = a.o_part + (part * rows_out + orow) * D + col;
#pragma unroll
                for (int d = 0; d < D / 8; ++d)
                    *reinterpret_cast<float2*>(op + d * 8) = make_float2(o[t][d][2 * r] * inv, o[t][d][2 * r + 1] * inv);
                if (lane % 4 == 0) a.lse_part[part * rows_out + orow] = lse;
            } else {
                T* out = static_cast<T*>(a.o) + (BT ? q_row0 * a.o_ss : b * a.o_sb) + head * a.o_sh +
                         int64_t(pos[t][r]) * a.o_ss;
#pragma unroll
                for (int d = 0; d < D / 8; ++d)
                    *reinterpret_cast<unsigned*>(out + d * 8 + col) = pack2<T>(o[t][d][2 * r] * inv, o[t][d][2 * r + 1] * inv);
                if (lane % 4 == 0 && a.lse != nullptr) a.lse[row] = lse;
            }
        }
    }
}

// Launch flash_fwd on `grid`: shared memory for Q, the K/V ring and the mask stages (mask_stage_rows), opted in.
template <int D, typename T, int MT, bool W, bool SM, bool BT, bool F8 = false, int G = 0>
cudaError_t launch_kernel(const KernelArgs<BT>& args, dim3 grid, cudaStream_t stream) {
    constexpr int kBlockM = block_rows<MT, W, G>();
    constexpr int kStages = stages<D, MT, W, SM, F8>();
    const attn_lt_flash_args& a = flash_of(args);
    const size_t mask = SM ? size_t(kStages) * mask_stage_rows(a, W, D) * mask_pitch(mask_elem_bytes(a.mask_dtype)) : 0;
    const size_t smem = size_t(kBlockM) * D * sizeof(T) + size_t(2 * kStages * kBlockN) * D * (F8 ? 1 : sizeof(T)) + mask;
    const auto kernel = flash_fwd<D, T, MT, W, SM, BT, F8, G>;
    const cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), smem);
    if (err != cudaSuccess) return err;
    kernel<<<grid, kThreads, smem, stream>>>(args);
    return cudaGetLastError();
}

template <int D, typename T, int MT, bool W = false, bool SM = false, bool F8 = false>
cudaError_t launch(const attn_lt_flash_args& a, cudaStream_t stream) {
    constexpr int kBlockM = block_rows<MT, W, 0>();
    const int64_t rows = a.Sq * (a.Hq / a.Hkv);
    const dim3 grid(static_cast<unsigned>((rows + kBlockM - 1) / kBlockM), static_cast<unsigned>(a.B * a.Hkv),
                    static_cast<unsigned>(a.splits));
    const cudaError_t err = launch_kernel<D, T, MT, W, SM, false, F8>(a, grid, stream);
    if (err != cudaSuccess || a.splits == 1) return err;
    return merge<D, T>(a, stream);
}

// The tiling (attn_lt/fused.py's fused_launch mirrors it): at most 16 rows a kv head (decode), 16-row blocks whose
// warps split the keys; else one m16 tile a warp (64 rows a CTA, 2 CTAs an SM) for row counts up to 64, dense
// masks, and D = 256 (whose shared memory allows no more); else two (128 rows), each K/V fragment feeding two MMAs.
// Masked blocks reserve mask stages where they stage the mask (mask_stage_rows). FP8 K/V: decode blocks, one for
// each 16 rows (the caller checked the rows: kMaxDecodeRows), their masks read by strides.
template <int D, typename T>
cudaError_t launch_dim(const attn_lt_flash_args& a, cudaStream_t stream) {
    const int64_t rows = a.Sq * (a.Hq / a.Hkv);
    const bool masked = a.mask_dtype != ATTN_LT_NONE;
    if (a.kv_dtype == ATTN_LT_E4M3) return launch<D, T, 1, true, false, true>(a, stream);
    if (rows <= 16) {
        if (masked && mask_stage_rows(a, true, D)) return launch<D, T, 1, true, true>(a, stream);
        return launch<D, T, 1, true>(a, stream);
    }
    if constexpr (D == 256) {
        return launch<D, T, 1>(a, stream);
    } else {
        if (masked && mask_stage_rows(a, false, D)) return launch<D, T, 1, false, true>(a, stream);
        const bool one = masked || rows <= 64;
        return one ? launch<D, T, 1>(a, stream) : launch<D, T, 2>(a, stream);
    }
}

template <typename T>
cudaError_t launch_type(const attn_lt_flash_args& a, cudaStream_t stream) {
    if (a.D == 64) return launch_dim<64, T>(a, stream);
    if (a.D == 128) return launch_dim<128, T>(a, stream);
    return launch_dim<256, T>(a, stream);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ---- serving batches ---------------------------------------------------------------------------------------------

// The row blocks (requests of more than decode_rows rows a kv head; the tiling of launch_dim), then the
// decode grid's blocks (flash_fwd's BT: W, and G 2 and G 1 for requests past 16 and 32 rows) and their merge. Each grid is sized for
// the capacity; blocks of requests that do not need them return at once.
template <int D, typename T>
int launch_batch(const attn_lt_batch_args& a, cudaStream_t stream) {
    const int64_t g = a.f.Hq / a.f.Hkv, rows = g * a.f.Sq;
    const unsigned bk = static_cast<unsigned>(a.f.B * a.f.Hkv);
    const bool f8 = a.f.kv_dtype == ATTN_LT_E4M3;  // (decode blocks only: the caller checked the rows)
    if (rows > a.decode_rows) {
        if (a.f.variant == ATTN_LT_BATCH_SM90) {
            const int err = attn_lt_flash_sm90_batch(&a, stream);
            if (err != 0) return err;
        } else {
            const dim3 rows64(unsigned((rows + 63) / 64), bk), rows128(unsigned((rows + 127) / 128), bk);
            cudaError_t err;
            if constexpr (D == 256) err = launch_kernel<D, T, 1, false, false, true>(a, rows64, stream);
            else if (rows <= 64) err = launch_kernel<D, T, 1, false, false, true>(a, rows64, stream);
            else err = launch_kernel<D, T, 2, false, false, true>(a, rows128, stream);
            if (err != cudaSuccess) return err;
        }
    }
    if (g > a.decode_rows) return 0;
    const unsigned parts = static_cast<unsigned>(batch_parts<int64_t>(a.f.Sk, a.split_keys));
    const dim3 blocks16(unsigned(a.decode_rows / 16), bk, parts);
    cudaError_t err = cudaSuccess;
    if (f8) {
        err = launch_kernel<D, T, 1, true, false, true, true>(a, blocks16, stream);
    } else if constexpr (!kGroupBlocks<D, false>) {
        err = launch_kernel<D, T, 1, true, false, true>(a, blocks16, stream);
    } else {
        const dim3 one(1, bk, parts);
        if (g <= kBatchSmallRows) err = launch_kernel<D, T, 1, true, false, true>(a, one, stream);
        if (err == cudaSuccess && a.decode_rows > kBatchSmallRows && g <= 32)
            err = launch_kernel<D, T, 1, false, false, true, false, 2>(a, one, stream);
        if (err == cudaSuccess && a.decode_rows > 32)
            err = launch_kernel<D, T, 1, false, false, true, false, 1>(a, one, stream);
    }
    if (err == cudaSuccess && parts > 1) err = merge<D, T>(a, stream);
    return static_cast<int>(err);
}

// ---- the attention mass per key (attn_lt_key_mass) ----------------------------------------------------------------
// Column sums of P = exp2(s * scale * log2(e) - lse * log2(e)) over the query rows, after the forward call gave each
// row's LSE: the roles of the forward kernel transposed. A CTA owns kMassKeys keys of one kv head, held for the
// whole run as MMA A fragments (warp w: m16 tiles of keys), and streams the query rows of the group's heads through
// a shared-memory ring (with their LSEs, by cp.async) as the B operand: S^T = K Q^T, n8 tiles of 8 query rows.
// Columns: each of the g heads' rows [r0, r1) (those that see any of the CTA's keys) padded to P columns, 2, 4 or a
// multiple of 8, so that a thread's column pair (2 (lane % 4), +1) belongs to one head and an n8 tile holds whole
// heads (P <= 8) or a head's tiles follow each other (P >= 8). A thread sums its keys' P over its columns; when a
// head's last tile is done, the lanes of the head reduce by shuffle and one writes: every (head, key) is written
// once, by one thread, without atomics.
// The tiling, measured on the H100 (B1 H32 S16k): at D 64 two m16 key tiles a warp and a 3-stage ring (3.3x the
// plain call with the mass of every row, against 4.0x with one tile and two stages); at D 128 and 256 one tile and
// two stages, which keep two CTAs an SM at D 256 (5.1x against 8.2x) and four at D 128 (the registers).
constexpr int kMassCols = 64;  // query rows (MMA columns) a stage
// Summed rows a head from which attn_lt_key_mass takes the Hopper pass (native/mass_sm90.cu: query tiles of one
// head, 128 rows at D 64 and 128); fewer rows, packed over the group's heads here, take this kernel.
constexpr int64_t kMassSm90Rows = 128;
template <int D>
__host__ __device__ constexpr int mass_mt() { return D == 64 ? 2 : 1; }  // m16 key tiles a warp
template <int D>
__host__ __device__ constexpr int mass_stages() { return D == 64 ? 3 : 2; }  // stages in the ring
template <int D>
constexpr int mass_min_ctas() { return D == 128 ? 4 : D == 64 ? 3 : 1; }  // CTAs an SM the registers leave room for
template <int D>
__host__ __device__ constexpr int mass_keys() { return 16 * mass_mt<D>() * kWarps; }
template <int D>
__host__ __device__ constexpr size_t mass_smem() {
    return size_t(mass_keys<D>() + mass_stages<D>() * kMassCols) * D * 2 + mass_stages<D>() * kMassCols * sizeof(float);
}

// 4-byte asynchronous copy global -> shared; `bytes` 0 zero-fills.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes)
                 : "memory");
}

// Column c of a CTA's columns as (head, row offset): `c / P` and `c % P`, stepped on by `step` columns at a time
// without a division (P is 2, 4 or a multiple of 8).
struct MassColumn {
    int head, rem;
    __device__ __forceinline__ MassColumn(int c, int P) : head(c / P), rem(c - (c / P) * P) {}
    __device__ __forceinline__ void advance(int step, int P) {
        rem += step;
        while (rem >= P) rem -= P, ++head;
    }
};

// A score of the mass kernel's general case in the exp2 domain: softcap (cap_in > 0), then -inf for a key the row
// does not see (the key tail, the window), then the mask's element m (mask not null). Out of line: the common
// case (every key seen, no mask, no softcap) takes one FMA a score.
__device__ __noinline__ float mass_logit(float x, float sc, float cap_in, float cap_out, int key, int r, int Sk,
                                         int shift, Window w, const void* mask, int mask_dtype, int64_t m) {
    if (cap_in > 0.f) x = cap_out * tanh_approx(x * cap_in);
    x *= sc;
    if (key >= Sk || (w.right >= 0 && key > r + shift + w.right) || (w.left >= 0 && key < r + shift - w.left))
        return -INFINITY;
    return mask != nullptr ? x + mask_value(mask, mask_dtype, m) : x;
}

// Whether the mass of a sequence of Sq rows comes from the scores its forward call's decode blocks stored
// (attn_lt_flash_args::scores: one-row sequences on decode blocks), by mass_from_scores, not key_mass_kernel.
__device__ __forceinline__ bool from_stored_scores(int64_t from_scores, int Sq, int g) {
    return from_scores && Sq == 1 && g <= kBatchSmallRows;
}

// The mass kernel's arguments: a dense call's (attn_lt_mass_args) or a serving batch's (BT).
template <bool BT>
using MassKernelArgs = std::conditional_t<BT, attn_lt_batch_mass_args, attn_lt_mass_args>;
__host__ __device__ __forceinline__ const attn_lt_flash_args& flash_of(const attn_lt_mass_args& a) { return a.f; }
__host__ __device__ __forceinline__ const attn_lt_flash_args& flash_of(const attn_lt_batch_mass_args& a) {
    return a.b.f;
}

// Grid (key blocks of mass_keys, Hkv, B): a CTA sums its keys' mass over the summed query rows of the g heads of
// its kv head. Serving batches (BT): B and the key blocks are the capacity's; each CTA reads its request's lengths.
template <int D, typename T, bool BT>
__global__ void __launch_bounds__(kThreads, mass_min_ctas<D>()) key_mass_kernel(const MassKernelArgs<BT> a) {
    constexpr int MT = mass_mt<D>(), kKeys = mass_keys<D>(), KK = D / 16, kChunks = D / 8;
    constexpr int kMassStages = mass_stages<D>();
    constexpr int kColStep = kThreads / kChunks;  // a thread's Q chunks: one column every kColStep
    extern __shared__ __align__(128) unsigned char smem[];
    T* sK = reinterpret_cast<T*>(smem);
    T* sQ = sK + kKeys * D;
    float* sL = reinterpret_cast<float*>(sQ + kMassStages * kMassCols * D);
    const attn_lt_flash_args& f = flash_of(a);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n0 = blockIdx.x * kKeys, hk = blockIdx.y, b = blockIdx.z;
    const int g = static_cast<int>(f.Hq / f.Hkv);
    const int64_t head0 = int64_t(hk) * g;
    // The rows and keys of this CTA's sequence; q, lse and mass at its head0, their head strides (lse_hs, mass_hs),
    // the keys its mass row holds (n_out >= Sk: a paged batch's row is the capacity's), the first row summed (first),
    // the K rows (paged: log2_bs > 0, rows looked up in the table).
    int Sq, Sk, n_out, first, log2_bs = 0;
    int64_t lse_hs, mass_hs;
    const T* q;
    const T* k = static_cast<const T*>(f.k) + hk * f.k_sh;
    const float* lse;
    float* mass;
    if constexpr (BT) {
        const attn_lt_batch_args& ba = a.b;
        const BatchRequest req = batch_request(ba, b, false);
        const bool paged = ba.block_table != nullptr;
        Sq = req.nq, Sk = req.nk;
        n_out = paged ? static_cast<int>(f.Sk) : Sk;
        first = Sq > a.window ? static_cast<int>(Sq - a.window) : 0;
        lse_hs = ba.total_q;
        mass_hs = paged ? f.Sk : ba.total_k;
        q = static_cast<const T*>(f.q) + int64_t(req.q0) * f.q_ss + head0 * f.q_sh;
        lse = f.lse + head0 * ba.total_q + req.q0;
        mass = a.mass + (paged ? (int64_t(b) * f.Hq + head0) * f.Sk : head0 * ba.total_k + req.k0);
        if (paged) log2_bs = __ffsll(ba.block_size) - 1;
        else k += int64_t(req.k0) * f.k_ss;
    } else {
        Sq = static_cast<int>(f.Sq), Sk = static_cast<int>(f.Sk), n_out = Sk;
        first = static_cast<int>(a.q0);
        lse_hs = Sq, mass_hs = Sk;
        q = static_cast<const T*>(f.q) + b * f.q_sb + head0 * f.q_sh;
        lse = f.lse + (int64_t(b) * f.Hq + head0) * Sq;
        mass = a.mass + (int64_t(b) * f.Hq + head0) * Sk;
        k += b * f.k_sb;
    }
    const int shift = Sk - Sq;
    const Window w = window_of(f);
    if (from_stored_scores(a.from_scores, Sq, g)) return;  // mass_from_scores's
    // the query rows that see any key of this CTA: key j is visible to rows [j - shift - right, j - shift + left]
    int r0 = first, r1 = Sq;
    if (w.right >= 0) r0 = max(r0, n0 - shift - w.right);
    if (w.left >= 0) r1 = min(r1, n0 + kKeys - 1 - shift + w.left + 1);
    const int R = n0 < Sk ? max(r1 - r0, 0) : 0;
    const int P = R <= 2 ? 2 : R <= 4 ? 4 : (R + 7) / 8 * 8;
    const int C = R > 0 ? g * P : 0, stages = (C + kMassCols - 1) / kMassCols;
    // keys [n0, n0 + kKeys) that no row sees, or past the sequence within its mass row: zeros
    for (int i = threadIdx.x; i < g * kKeys; i += kThreads) {
        const int j = n0 + i % kKeys;
        if (j < n_out && (stages == 0 || j >= Sk)) mass[int64_t(i / kKeys) * mass_hs + j] = 0.f;
    }
    if (stages == 0) return;
    // stage s: its columns' Q rows (zeros for padding) and LSEs (natural log, raw; read below)
    auto load_stage = [&](int s) {
        T* dq = sQ + (s % kMassStages) * kMassCols * D;
        const int ch = (threadIdx.x % kChunks) * 8, cc0 = threadIdx.x / kChunks;
        MassColumn col(s * kMassCols + cc0, P);
#pragma unroll
        for (int cc = cc0; cc < kMassCols; cc += kColStep, col.advance(kColStep, P)) {
            const int row = r0 + col.rem;
            const bool ok = col.head < g && row < r1;
            cp_async16(dq + swz<D>(cc, ch), q + (ok ? col.head * f.q_sh + int64_t(row) * f.q_ss : 0) + ch, ok ? 16 : 0);
        }
        if (threadIdx.x < kMassCols) {
            const MassColumn c(s * kMassCols + threadIdx.x, P);
            const bool ok = c.head < g && r0 + c.rem < r1;
            cp_async4(sL + (s % kMassStages) * kMassCols + threadIdx.x,
                      ok ? lse + int64_t(c.head) * lse_hs + r0 + c.rem : lse, ok ? 4 : 0);
        }
    };
    if constexpr (BT) {
        if (log2_bs > 0) {  // a paged cache: each row from its block; a block id out of range reads zeros
            for (int i = threadIdx.x; i < kKeys * kChunks; i += kThreads) {
                const int r = i / kChunks, c = (i % kChunks) * 8, key = n0 + r;
                const int blk = key < Sk ? paged_block(a.b, b, key, log2_bs) : -1;
                const int64_t at = blk >= 0 ? int64_t(blk) * f.k_sb + (key & ((1 << log2_bs) - 1)) * f.k_ss : 0;
                cp_async16(sK + swz<D>(r, c), k + at + c, blk >= 0 ? 16 : 0);
            }
        }
    }
    if (log2_bs == 0) load_tile<D>(sK, k + int64_t(n0) * f.k_ss, f.k_ss, kKeys, min(kKeys, Sk - n0));
#pragma unroll
    for (int s = 0; s < kMassStages - 1; ++s) {  // the K tile travels with stage 0
        if (s < stages) load_stage(s);
        cp_async_commit();
    }

    const float sc = f.scale * kLog2e;
    const bool capped = f.softcap > 0.f;
    const float cap_in = capped ? f.scale / f.softcap : 0.f, cap_out = f.softcap / f.scale;
    const bool masked = !BT && f.mask_dtype != ATTN_LT_NONE;
    const int seg = min(P, 8) / 2;  // lanes of a quad that hold one head's columns of a tile
    const int kw = n0 + warp * 16 * MT;  // this warp's first key
    // this thread's keys kw + 16 t + lane / 4 (+ 8): the first and the last
    const int klo = kw + lane / 4, khi = kw + 16 * (MT - 1) + lane / 4 + 8;
    unsigned kf[MT][KK][4];
    float acc[MT][2] = {};
    for (int s = 0; s < stages; ++s) {
        if (s + kMassStages - 1 < stages) load_stage(s + kMassStages - 1);
        cp_async_commit();
        cp_async_wait<kMassStages - 1>();
        __syncthreads();
        if (s == 0) {
#pragma unroll
            for (int t = 0; t < MT; ++t)
#pragma unroll
                for (int kk = 0; kk < KK; ++kk)
                    ldsm_x4(kf[t][kk][0], kf[t][kk][1], kf[t][kk][2], kf[t][kk][3],
                            sK + swz<D>(warp * 16 * MT + t * 16 + (lane % 16), kk * 16 + (lane / 16) * 8));
        }
        const T* tq = sQ + (s % kMassStages) * kMassCols * D;
        const float* tl = sL + (s % kMassStages) * kMassCols;
        // the stage's n8 tiles that hold any column (a decode step's few columns fill one)
        const int tiles = min(kMassCols, C - s * kMassCols + 7) / 8;
        float c[MT][kMassCols / 8][4] = {};  // every tile of the stage at once: 2 MT 8 independent MMA chains
#pragma unroll
        for (int kk = 0; kk < KK; ++kk)
#pragma unroll
            for (int j = 0; j < kMassCols / 8; j += 2) {
                if (j >= tiles) break;
                unsigned b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3, tq + swz<D>(j * 8 + (lane % 8) + (lane / 16) * 8, kk * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    mma<T>(c[t][j], kf[t][kk], b0, b1);
                    mma<T>(c[t][j + 1], kf[t][kk], b2, b3);
                }
            }
        MassColumn col(s * kMassCols + 2 * (lane % 4), P);  // this thread's column pair in tile 0 (one head)
#pragma unroll
        for (int j = 0; j < kMassCols / 8; ++j, col.advance(8, P)) {
            if (j >= tiles) break;
            const int cc = j * 8 + 2 * (lane % 4), row = r0 + col.rem, head = col.head;
            // the pair's rows row and row + 1, as exp2-domain LSEs; +inf (P 0): padding, or a row with no key
            float l[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float v = tl[cc + e];
                l[e] = head < g && row + e < r1 && v != -INFINITY ? v * kLog2e : INFINITY;
            }
            // every score of the tile seen by both rows, without a mask or softcap: P = exp2(s sc - l) alone
            const bool plain = !masked && !capped && khi < Sk && (w.right < 0 || khi <= row + shift + w.right) &&
                               (w.left < 0 || klo >= row + 1 + shift - w.left);
            if (plain) {
#pragma unroll
                for (int t = 0; t < MT; ++t)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[t][e >> 1] += ex2(fmaf(c[t][j][e], sc, -l[e & 1]));
            } else {
#pragma unroll
                for (int t = 0; t < MT; ++t)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = kw + 16 * t + lane / 4 + (e >> 1) * 8, r = row + (e & 1);
                        const bool read = masked && head < g && r < r1 && key < Sk;
                        const int64_t m = read ? b * f.m_sb + (head0 + head) * f.m_sh + int64_t(r) * f.m_sq +
                                                     int64_t(key) * f.m_sk
                                               : 0;
                        acc[t][e >> 1] += ex2(mass_logit(c[t][j][e], sc, cap_in, cap_out, key, r, Sk, shift, w,
                                                         read ? f.mask : nullptr, f.mask_dtype, m) -
                                              l[e & 1]);
                    }
            }
            MassColumn next = col;
            next.advance(8, P);
            if (next.head != head) {  // the head's last tile (every tile when P <= 8): the same for the whole warp
#pragma unroll
                for (int t = 0; t < MT; ++t)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        float v = acc[t][e];
                        if (seg >= 2) v += __shfl_xor_sync(0xffffffffu, v, 1);
                        if (seg >= 4) v += __shfl_xor_sync(0xffffffffu, v, 2);
                        const int key = kw + 16 * t + lane / 4 + e * 8;
                        if ((lane % 4) % seg == 0 && head < g && key < Sk) {
                            if constexpr (BT) {  // the keys of a block id out of range: none (the forward hid them)
                                if (log2_bs > 0 && key_block_bad(a.b, b, key, log2_bs)) v = 0.f;
                            }
                            mass[int64_t(head) * mass_hs + key] = v;
                        }
                        acc[t][e] = 0.f;
                    }
            }
        }
        __syncthreads();  // every warp is done with this stage before a later load overwrites it
    }
}

// Keys of one head a CTA of mass_from_scores turns into the mass.
constexpr int kFixKeys = 2048, kFixThreads = 256;

// The mass of the one-row sequences whose forward stored their scores (from_stored_scores): P = exp2(s - lse
// log2(e)) in place, 0 for keys outside the row's window and past the sequence (within its mass row). Grid (keys of
// the capacity / kFixKeys, Hq, B); no shared memory, coalesced, so that it runs at the copy rate.
template <bool BT>
__global__ void __launch_bounds__(kFixThreads) mass_from_scores(const MassKernelArgs<BT> a) {
    const attn_lt_flash_args& f = flash_of(a);
    const int h = blockIdx.y, b = blockIdx.z, g = static_cast<int>(f.Hq / f.Hkv);
    int Sk, n_out;
    const float* lse;
    float* mass;
    if constexpr (BT) {
        const attn_lt_batch_args& ba = a.b;
        const BatchRequest req = batch_request(ba, b, false);
        if (!from_stored_scores(a.from_scores, req.nq, g)) return;  // key_mass_kernel's
        const bool paged = ba.block_table != nullptr;
        Sk = req.nk, n_out = paged ? static_cast<int>(f.Sk) : Sk;
        lse = f.lse + int64_t(h) * ba.total_q + req.q0;
        mass = a.mass + (paged ? (int64_t(b) * f.Hq + h) * f.Sk : int64_t(h) * ba.total_k + req.k0);
    } else {
        Sk = n_out = static_cast<int>(f.Sk);
        lse = f.lse + int64_t(b) * f.Hq + h;  // Sq = 1
        mass = a.mass + (int64_t(b) * f.Hq + h) * Sk;
    }
    const Window w = window_of(f);
    const int shift = Sk - 1, lo = w.left >= 0 ? max(0, shift - w.left) : 0;
    const int hi = min(Sk, w.right >= 0 ? shift + w.right + 1 : Sk);  // the row sees keys [lo, hi)
    const float l = *lse;
    const float l2 = l * kLog2e;
    constexpr int kEach = kFixKeys / kFixThreads;
    const int j0 = blockIdx.x * kFixKeys + threadIdx.x;
    float s[kEach];  // every load in flight before the first store
#pragma unroll
    for (int e = 0; e < kEach; ++e) {
        const int j = j0 + e * kFixThreads;
        s[e] = j >= lo && j < hi && l != -INFINITY ? mass[j] : -INFINITY;
    }
#pragma unroll
    for (int e = 0; e < kEach; ++e) {
        const int j = j0 + e * kFixThreads;
        if (j < n_out) mass[j] = s[e] == -INFINITY ? 0.f : ex2(s[e] - l2);
    }
}

template <int D, typename T, bool BT>
cudaError_t launch_mass(const MassKernelArgs<BT>& a, cudaStream_t stream) {
    constexpr int kKeys = mass_keys<D>();
    const auto kernel = key_mass_kernel<D, T, BT>;
    const cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), mass_smem<D>());
    if (err != cudaSuccess) return err;
    const attn_lt_flash_args& f = flash_of(a);
    const dim3 grid(static_cast<unsigned>((f.Sk + kKeys - 1) / kKeys), static_cast<unsigned>(f.Hkv),
                    static_cast<unsigned>(f.B));
    kernel<<<grid, kThreads, mass_smem<D>(), stream>>>(a);
    return cudaGetLastError();
}

// launch_mass for the arguments' dtype and head dim (checked by the caller: fp16 or bf16, D 64, 128 or 256), after
// mass_from_scores where the forward stored scores (a dense call: for all of it).
template <bool BT>
int launch_mass_of(const MassKernelArgs<BT>& a, cudaStream_t s) {
    const attn_lt_flash_args& f = flash_of(a);
    if (a.from_scores) {
        const dim3 grid(static_cast<unsigned>((f.Sk + kFixKeys - 1) / kFixKeys), static_cast<unsigned>(f.Hq),
                        static_cast<unsigned>(f.B));
        mass_from_scores<BT><<<grid, kFixThreads, 0, s>>>(a);
        const cudaError_t err = cudaGetLastError();
        // a batch whose requests have one row each (and at most 16 a kv head) needs no more
        if (err != cudaSuccess || !BT || (f.Sq == 1 && f.Hq / f.Hkv <= kBatchSmallRows)) return static_cast<int>(err);
    }
    const bool bf = f.dtype == ATTN_LT_BF16;
    switch (f.D) {
        case 64: return bf ? launch_mass<64, __nv_bfloat16, BT>(a, s) : launch_mass<64, __half, BT>(a, s);
        case 128: return bf ? launch_mass<128, __nv_bfloat16, BT>(a, s) : launch_mass<128, __half, BT>(a, s);
        default: return bf ? launch_mass<256, __nv_bfloat16, BT>(a, s) : launch_mass<256, __half, BT>(a, s);
    }
}

// Whether FP8 K/V arguments are ones the decode blocks read: e4m3, k's and v's strides whole 16-byte chunks, the
// descale factors 4-byte aligned with a head stride of 0 or 1.
bool fp8_ok(const attn_lt_flash_args& a) {
    return a.kv_dtype == ATTN_LT_E4M3 && (a.k_ss | a.k_sh | a.k_sb | a.v_ss | a.v_sh | a.v_sb) % 16 == 0 &&
           (a.descale_sh == 0 || a.descale_sh == 1) &&
           (reinterpret_cast<uintptr_t>(a.k_descale) | reinterpret_cast<uintptr_t>(a.v_descale)) % 4 == 0;
}

// Whether an FP8 cache's rows a kv head (query rows x Hq / Hkv; a batch: at capacity) are ones the decode blocks run
// (at most `rows`: a dense call's kMaxDecodeRows, a batch's decode_rows); a 16-bit cache: always.
bool fp8_rows_ok(const attn_lt_flash_args& a, int64_t rows) {
    return a.kv_dtype == ATTN_LT_NONE || a.Sq * (a.Hq / a.Hkv) <= rows;
}

// What the dense and batch forward and mass launchers check alike (0: it holds): the shape, q and k (addresses,
// strides but q's batch stride, which batches do not use), scale, variant, mask and dtype.
int qk_status(const attn_lt_flash_args& a) {
    if (a.B <= 0 || a.Hq <= 0 || a.Hkv <= 0 || a.Sq <= 0 || a.Sk <= 0 || a.q == nullptr || a.k == nullptr)
        return ATTN_LT_ERR_ARGS;
    if (a.Hq % a.Hkv) return ATTN_LT_ERR_HEADS;
    if (a.D != 64 && a.D != 128 && a.D != 256) return ATTN_LT_ERR_HEAD_DIM;
    if (a.Sq >= (1LL << 30) || a.Sk >= (1LL << 30) || a.Sq * (a.Hq / a.Hkv) >= (1LL << 30)) return ATTN_LT_ERR_LENGTH;
    if (!(a.scale > 0.f)) return ATTN_LT_ERR_SCALE;
    if (!variant_ok(a)) return ATTN_LT_ERR_WINDOW;
    if (!aligned16(a.q) || !aligned16(a.k)) return ATTN_LT_ERR_ALIGNMENT;
    if ((a.q_ss | a.k_ss | a.q_sh | a.k_sb | a.k_sh) % 8 != 0) return ATTN_LT_ERR_STRIDES;
    if (a.mask_dtype != ATTN_LT_NONE && a.mask == nullptr) return ATTN_LT_ERR_MASK;
    if (a.mask_dtype < ATTN_LT_NONE || a.mask_dtype > ATTN_LT_BOOL) return ATTN_LT_ERR_MASK;
    if (a.dtype != ATTN_LT_BF16 && a.dtype != ATTN_LT_F16) return ATTN_LT_ERR_DTYPE;
    if (a.kv_dtype != ATTN_LT_NONE && !fp8_ok(a)) return ATTN_LT_ERR_DTYPE;
    return 0;
}


// What attn_lt_batch_fwd and attn_lt_batch_key_mass check alike (0: it holds): qk_status's, no mask, and the
// metadata's pointers and layout.
int batch_status(const attn_lt_batch_args& a) {
    const attn_lt_flash_args& f = a.f;
    if (a.error == nullptr || a.total_q <= 0 || a.total_k < 0) return ATTN_LT_ERR_ARGS;
    if (const int status = qk_status(f)) return status;
    if (f.Hq > 65535 || f.B * f.Hkv > 65535) return ATTN_LT_ERR_HEADS;
    if (f.Dv != 0 && f.Dv != f.D) return ATTN_LT_ERR_HEAD_DIM;
    if (a.total_q >= (1LL << 31) || a.total_k >= (1LL << 31)) return ATTN_LT_ERR_LENGTH;
    if (f.mask_dtype != ATTN_LT_NONE || f.mask != nullptr) return ATTN_LT_ERR_MASK;
    const bool paged = a.block_table != nullptr;
    if (paged == (a.cu_k != nullptr) || (paged && a.seqlens_k == nullptr)) return ATTN_LT_ERR_BATCH;
    if (a.cu_q == nullptr && a.total_q < f.B) return ATTN_LT_ERR_BATCH;  // one query row a request
    for (const void* p : {static_cast<const void*>(a.cu_q), static_cast<const void*>(a.cu_k),
                          static_cast<const void*>(a.seqlens_k), static_cast<const void*>(a.block_table),
                          static_cast<const void*>(a.error)})
        if (reinterpret_cast<uintptr_t>(p) % 4) return ATTN_LT_ERR_ALIGNMENT;
    if (paged && (a.block_size < 8 || a.block_size > (1 << 20) || (a.block_size & (a.block_size - 1)) ||
                  a.num_blocks <= 0 || a.num_blocks >= (1LL << 31) || a.max_blocks <= 0 ||
                  a.bt_stride < a.max_blocks || f.B * a.bt_stride >= (1LL << 31)))
        return ATTN_LT_ERR_BATCH;
    // paged_at: a block's stride and its rows below 2^31 elements
    if (paged && (f.k_sb >= (1LL << 31) || f.v_sb >= (1LL << 31) || a.block_size * (f.k_ss + f.v_ss) >= (1LL << 31)))
        return ATTN_LT_ERR_STRIDES;
    // MLA decode (D 576) has no decode rows; the others 16 to kMaxDecodeRows, a multiple of 16
    if (f.D != 576 && (a.decode_rows < kBatchSmallRows || a.decode_rows > kMaxDecodeRows || a.decode_rows % 16))
        return ATTN_LT_ERR_BATCH;
    return 0;
}

// ---- an FP8 KV cache converted for the 16-bit kernels (attn_lt_batch_convert_kv, attn_lt_flash_convert_kv) ----

// 16 e4m3 elements (one 16-byte chunk) times factor f, in FP32, rounded once to T: two 16-byte chunks at dst.
template <typename T>
__device__ __forceinline__ void convert_chunk(uint4 x, float f, T* dst) {
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
    uint32_t o[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint32_t lo, hi;
        f16x2x2_of_e4m3x4(w[i], lo, hi);  // (exact: e4m3 values are fp16 values)
        const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
        const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hi));
        o[2 * i] = pack2<T>(a.x * f, a.y * f);
        o[2 * i + 1] = pack2<T>(b.x * f, b.y * f);
    }
    uint4* d = reinterpret_cast<uint4*>(dst);
    d[0] = make_uint4(o[0], o[1], o[2], o[3]);
    d[1] = make_uint4(o[4], o[5], o[6], o[7]);
}

__device__ __forceinline__ float descale_of(const float* d, int64_t sh, int h) { return d ? __ldg(d + h * sh) : 1.f; }

// Paged: block (j, b, kv) converts request b's table entry j of K (kv 0) or V (kv 1) to place 1 + b max_blocks + j,
// and the K block writes table_out; j = max_blocks (b = 0): place 0, the zero block. 128 threads, 16-byte chunks.
template <typename T>
__global__ void __launch_bounds__(128) convert_paged_e4m3(attn_lt_convert_args c) {
    const attn_lt_batch_args& a = c.b;
    const attn_lt_flash_args& f = a.f;
    const int j = blockIdx.x, b = blockIdx.y, kv = blockIdx.z;
    const int64_t row_chunks = f.Hkv * f.D / 16, chunks = a.block_size * row_chunks;
    T* out = static_cast<T*>(kv ? c.v_out : c.k_out);
    if (j == a.max_blocks) {
        if (b != 0) return;
        for (int64_t i = threadIdx.x; i < 2 * chunks; i += blockDim.x)
            reinterpret_cast<uint4*>(out)[i] = make_uint4(0u, 0u, 0u, 0u);
        return;
    }
    const BatchRequest r = batch_request(a, b, false);  // (the batch call reports what is wrong)
    const int64_t used = (int64_t(r.nk) + a.block_size - 1) / a.block_size;
    int64_t place = 0;  // past the request's keys: the zero block, never read for them
    int id = 0;
    if (j < used) {
        id = __ldg(a.block_table + b * a.bt_stride + j);
        place = paged_id_ok(a, id) ? 1 + int64_t(b) * a.max_blocks + j : -1;
    }
    if (kv == 0 && threadIdx.x == 0) c.table_out[int64_t(b) * a.max_blocks + j] = static_cast<int32_t>(place);
    if (place <= 0) return;
    const uint8_t* src = static_cast<const uint8_t*>(kv ? f.v : f.k) + id * (kv ? f.v_sb : f.k_sb);
    const int64_t ss = kv ? f.v_ss : f.k_ss, sh = kv ? f.v_sh : f.k_sh;
    const float* d = kv ? f.v_descale : f.k_descale;
    T* dst = out + place * a.block_size * f.Hkv * f.D;
    for (int64_t i = threadIdx.x; i < chunks; i += blockDim.x) {
        const int64_t t = i / row_chunks, hc = i % row_chunks;
        const int h = static_cast<int>(hc / (f.D / 16));
        const int64_t c16 = hc % (f.D / 16);
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(src + t * ss + h * sh + 16 * c16));
        convert_chunk<T>(x, descale_of(d, f.descale_sh, h), dst + i * 16);
    }
}

// Rows of 16-byte chunks of e4m3 K and V (blockIdx.y: 0 K, 1 V) converted into contiguous outputs, grid-stride:
// chunk i of row (i0, i1, i2) of three dims (n1, n2 the sizes of the inner two), each at its byte strides, its head
// the row's index along head_axis (1 or 2). Packed keys: (1, total_k, Hkv); a dense cache: (B, Hkv, Sk).
struct RowsConvert {
    const uint8_t* src[2];
    void* dst[2];
    const float* descale[2];
    int64_t s0[2], s1[2], s2[2];
    int64_t n1, n2, chunks, descale_sh;
    int32_t D, head_axis;
};

template <typename T>
__global__ void __launch_bounds__(256) convert_rows_e4m3(const RowsConvert c) {
    const int kv = blockIdx.y;
    const int64_t per_row = c.D / 16;
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < c.chunks; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t row = i / per_row, i2 = row % c.n2, i1 = (row / c.n2) % c.n1, i0 = row / c.n2 / c.n1;
        const uint4 x = __ldg(reinterpret_cast<const uint4*>(c.src[kv] + i0 * c.s0[kv] + i1 * c.s1[kv] +
                                                              i2 * c.s2[kv] + 16 * (i % per_row)));
        const int h = static_cast<int>(c.head_axis == 1 ? i1 : i2);
        convert_chunk<T>(x, descale_of(c.descale[kv], c.descale_sh, h), static_cast<T*>(c.dst[kv]) + i * 16);
    }
}

// a's k and v (e4m3, its descale factors) as rows (n0, n1, n2) at byte strides k_st / v_st into k_out, v_out.
template <typename T>
cudaError_t launch_rows(const attn_lt_flash_args& a, void* k_out, void* v_out, int64_t n0, int64_t n1, int64_t n2,
                        const int64_t (&k_st)[3], const int64_t (&v_st)[3], int head_axis, cudaStream_t s) {
    RowsConvert c{};
    c.src[0] = static_cast<const uint8_t*>(a.k);
    c.src[1] = static_cast<const uint8_t*>(a.v);
    c.dst[0] = k_out;
    c.dst[1] = v_out;
    c.descale[0] = a.k_descale;
    c.descale[1] = a.v_descale;
    for (int kv = 0; kv < 2; ++kv) {
        const int64_t(&st)[3] = kv ? v_st : k_st;
        c.s0[kv] = st[0], c.s1[kv] = st[1], c.s2[kv] = st[2];
    }
    c.n1 = n1, c.n2 = n2, c.chunks = n0 * n1 * n2 * (a.D / 16), c.descale_sh = a.descale_sh;
    c.D = static_cast<int32_t>(a.D), c.head_axis = head_axis;
    if (c.chunks == 0) return cudaSuccess;
    int dev = 0, sms = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (err != cudaSuccess) return err;
    convert_rows_e4m3<T><<<dim3(static_cast<unsigned>(std::min<int64_t>((c.chunks + 255) / 256, 8LL * sms)), 2), 256,
                           0, s>>>(c);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_convert(const attn_lt_convert_args& c, cudaStream_t s) {
    const attn_lt_flash_args& f = c.b.f;
    if (c.b.block_table != nullptr) {
        convert_paged_e4m3<T><<<dim3(static_cast<unsigned>(c.b.max_blocks + 1), static_cast<unsigned>(f.B), 2),
                                128, 0, s>>>(c);
        return cudaGetLastError();
    }
    const int64_t k_st[3] = {0, f.k_ss, f.k_sh}, v_st[3] = {0, f.v_ss, f.v_sh};
    return launch_rows<T>(f, c.k_out, c.v_out, 1, c.b.total_k, f.Hkv, k_st, v_st, 2, s);
}

}  // namespace

extern "C" int attn_lt_batch_fwd(const attn_lt_batch_args* a, void* stream) {
    if (a == nullptr || a->error == nullptr) return ATTN_LT_ERR_ARGS;
    if (!variant_ok(a->f)) return ATTN_LT_ERR_WINDOW;
    if (a->f.D == 576) return attn_lt_flash_sm90_batch(a, stream);  // MLA decode: the Hopper kernel only
    if (const int status = batch_status(*a)) return status;
    const attn_lt_flash_args& f = a->f;
    if (!fp8_rows_ok(f, a->decode_rows)) return ATTN_LT_ERR_DTYPE;
    if (f.v == nullptr || f.o == nullptr) return ATTN_LT_ERR_ARGS;
    if (!aligned16(f.v) || !aligned16(f.o)) return ATTN_LT_ERR_ALIGNMENT;
    if ((f.v_ss | f.v_sh | f.v_sb) % 8 != 0 || (f.o_ss | f.o_sh) % 2 != 0) return ATTN_LT_ERR_STRIDES;
    if (a->split_keys < 0 || a->split_keys % kBlockN) return ATTN_LT_ERR_BATCH;
    const int64_t parts = batch_parts<int64_t>(f.Sk, a->split_keys);
    if (parts > 65535) return ATTN_LT_ERR_BATCH;
    if (parts > 1 && (f.o_part == nullptr || f.lse_part == nullptr)) return ATTN_LT_ERR_ARGS;
    if (parts > 1) {  // the partials inside the workspace: outputs, then their LSEs
        const int64_t rows = parts * f.B * f.Hkv * a->decode_rows;
        if (static_cast<const char*>(static_cast<void*>(f.lse_part)) !=
                static_cast<const char*>(static_cast<void*>(f.o_part)) + rows * f.D * 4 ||
            a->workspace_bytes < rows * (f.D + 1) * 4)
            return ATTN_LT_ERR_BATCH;
    }
    if (parts > 1 && (reinterpret_cast<uintptr_t>(f.o_part) % 8 || reinterpret_cast<uintptr_t>(f.lse_part) % 4))
        return ATTN_LT_ERR_ALIGNMENT;
    if (f.variant != ATTN_LT_BATCH_SM80 && f.variant != ATTN_LT_BATCH_SM90) return ATTN_LT_ERR_VARIANT;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool bf = f.dtype == ATTN_LT_BF16;
    switch (f.D) {
        case 64: return bf ? launch_batch<64, __nv_bfloat16>(*a, s) : launch_batch<64, __half>(*a, s);
        case 128: return bf ? launch_batch<128, __nv_bfloat16>(*a, s) : launch_batch<128, __half>(*a, s);
        default: return bf ? launch_batch<256, __nv_bfloat16>(*a, s) : launch_batch<256, __half>(*a, s);
    }
}

extern "C" int attn_lt_flash_fwd(const attn_lt_flash_args* a, void* stream) {
    if (a == nullptr || a->o == nullptr || a->v == nullptr) return ATTN_LT_ERR_ARGS;
    if (const int status = qk_status(*a)) return status;
    if (!fp8_rows_ok(*a, kMaxDecodeRows)) return ATTN_LT_ERR_DTYPE;
    if (a->kv_dtype != ATTN_LT_NONE && a->scores != nullptr) return ATTN_LT_ERR_DTYPE;  // FP8: only batches store them
    if (a->B * a->Hkv > 65535) return ATTN_LT_ERR_HEADS;  // the grid's y
    if (a->Dv != 0 && a->Dv != a->D) return ATTN_LT_ERR_HEAD_DIM;
    if (a->q_sb % 8 != 0) return ATTN_LT_ERR_STRIDES;
    if (!aligned16(a->v) || !aligned16(a->o)) return ATTN_LT_ERR_ALIGNMENT;
    if ((a->v_ss | a->v_sb | a->v_sh) % 8 != 0 || (a->o_ss | a->o_sb | a->o_sh) % 2 != 0) return ATTN_LT_ERR_STRIDES;
    if (a->splits < 0 || a->splits > 65535 || (a->splits > 1 && (a->o_part == nullptr || a->lse_part == nullptr)))
        return ATTN_LT_ERR_VARIANT;
    if (a->splits > 1 && (reinterpret_cast<uintptr_t>(a->o_part) % 8 ||
                          reinterpret_cast<uintptr_t>(a->lse_part) % 4))
        return ATTN_LT_ERR_ALIGNMENT;  // float2 partials
    attn_lt_flash_args c = *a;
    c.splits = dense_parts(a->Sk, a->splits);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (c.dtype == ATTN_LT_BF16) return static_cast<int>(launch_type<__nv_bfloat16>(c, s));
    return static_cast<int>(launch_type<__half>(c, s));
}

extern "C" int attn_lt_key_mass(const attn_lt_mass_args* m, void* stream) {
    if (m == nullptr || m->mass == nullptr) return ATTN_LT_ERR_ARGS;
    const attn_lt_flash_args* a = &m->f;
    if (a->lse == nullptr || m->q0 < 0 || m->q0 >= a->Sq || m->from_scores < 0 || m->from_scores > 1)
        return ATTN_LT_ERR_ARGS;
    if (const int status = qk_status(*a)) return status;
    // scores are stored by decode blocks only: one row, at most 16 rows a kv head
    if (m->from_scores && !(a->Sq == 1 && a->Hq / a->Hkv <= kBatchSmallRows)) return ATTN_LT_ERR_ARGS;
    // FP8 K/V: key_mass_kernel reads K, and a dense call on an FP8 cache stores no scores (a batch's do)
    if (a->kv_dtype != ATTN_LT_NONE) return ATTN_LT_ERR_DTYPE;
    if (a->B > 65535 || a->Hkv > 65535 || a->Hq > 65535) return ATTN_LT_ERR_HEADS;  // the grids' (B, Hkv or Hq)
    if (a->q_sb % 8 != 0) return ATTN_LT_ERR_STRIDES;
    if ((a->Sq + 8) * (a->Hq / a->Hkv) >= (1LL << 30)) return ATTN_LT_ERR_LENGTH;
    if (reinterpret_cast<uintptr_t>(a->lse) % 4 || reinterpret_cast<uintptr_t>(m->mass) % 4) return ATTN_LT_ERR_ALIGNMENT;
    if ((a->mask_dtype != ATTN_LT_NONE) != (a->mask != nullptr)) return ATTN_LT_ERR_MASK;
    if (a->Sq - m->q0 >= kMassSm90Rows) {  // the Hopper pass where it runs these arguments
        const int err = attn_lt_key_mass_sm90(m, stream);
        if (err != static_cast<int>(cudaErrorNotSupported)) return err;
    }
    return launch_mass_of<false>(*m, static_cast<cudaStream_t>(stream));
}

extern "C" int attn_lt_batch_key_mass(const attn_lt_batch_mass_args* m, void* stream) {
    if (m == nullptr || m->mass == nullptr || m->b.f.lse == nullptr || m->window < 1 || m->from_scores < 0 ||
        m->from_scores > 1)
        return ATTN_LT_ERR_ARGS;
    if (!variant_ok(m->b.f)) return ATTN_LT_ERR_WINDOW;
    if (const int status = batch_status(m->b)) return status;
    const attn_lt_flash_args& f = m->b.f;  // FP8 K/V: one-row requests on decode blocks, from their stored scores
    if (f.kv_dtype != ATTN_LT_NONE && !(m->from_scores && f.Sq == 1 && f.Hq / f.Hkv <= kBatchSmallRows))
        return ATTN_LT_ERR_DTYPE;
    if (reinterpret_cast<uintptr_t>(m->b.f.lse) % 4 || reinterpret_cast<uintptr_t>(m->mass) % 4)
        return ATTN_LT_ERR_ALIGNMENT;
    return launch_mass_of<true>(*m, static_cast<cudaStream_t>(stream));
}

extern "C" int attn_lt_batch_convert_kv(const attn_lt_convert_args* c, void* stream) {
    if (c == nullptr || c->b.error == nullptr || c->k_out == nullptr || c->v_out == nullptr) return ATTN_LT_ERR_ARGS;
    if (const int status = batch_status(c->b)) return status;
    const attn_lt_batch_args& a = c->b;
    const attn_lt_flash_args& f = a.f;
    if (f.kv_dtype != ATTN_LT_E4M3 || (f.D != 64 && f.D != 128 && f.D != 256) || (f.Dv != 0 && f.Dv != f.D))
        return ATTN_LT_ERR_DTYPE;
    if (f.v == nullptr) return ATTN_LT_ERR_ARGS;
    if (!aligned16(f.v) || !aligned16(c->k_out) || !aligned16(c->v_out)) return ATTN_LT_ERR_ALIGNMENT;
    if (a.block_table != nullptr) {
        if (c->table_out == nullptr) return ATTN_LT_ERR_ARGS;
        if (reinterpret_cast<uintptr_t>(c->table_out) % 4) return ATTN_LT_ERR_ALIGNMENT;
        // places 1 .. B max_blocks are int32 table entries; the grid's x and y
        if (f.B * a.max_blocks >= (1LL << 31) - 1 || f.B > 65535) return ATTN_LT_ERR_BATCH;
    }
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (f.dtype == ATTN_LT_BF16) return static_cast<int>(launch_convert<__nv_bfloat16>(*c, s));
    return static_cast<int>(launch_convert<__half>(*c, s));
}

extern "C" int attn_lt_flash_convert_kv(const attn_lt_flash_args* a, void* k_out, void* v_out, void* stream) {
    if (a == nullptr || a->k == nullptr || a->v == nullptr || k_out == nullptr || v_out == nullptr)
        return ATTN_LT_ERR_ARGS;
    if (a->kv_dtype != ATTN_LT_E4M3 || !fp8_ok(*a) || (a->D != 64 && a->D != 128 && a->D != 256) ||
        (a->Dv != 0 && a->Dv != a->D) || (a->dtype != ATTN_LT_BF16 && a->dtype != ATTN_LT_F16))
        return ATTN_LT_ERR_DTYPE;
    if (a->B < 0 || a->Hkv < 0 || a->Sk < 0) return ATTN_LT_ERR_ARGS;
    if (!aligned16(a->k) || !aligned16(a->v) || !aligned16(k_out) || !aligned16(v_out)) return ATTN_LT_ERR_ALIGNMENT;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const int64_t k_st[3] = {a->k_sb, a->k_sh, a->k_ss}, v_st[3] = {a->v_sb, a->v_sh, a->v_ss};
    if (a->dtype == ATTN_LT_BF16)
        return static_cast<int>(launch_rows<__nv_bfloat16>(*a, k_out, v_out, a->B, a->Hkv, a->Sk, k_st, v_st, 1, s));
    return static_cast<int>(launch_rows<__half>(*a, k_out, v_out, a->B, a->Hkv, a->Sk, k_st, v_st, 1, s));
}
