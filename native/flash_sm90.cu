// The fused short path on Hopper (sm_90a): FlashAttention-3 style forward with TMA, mbarriers and wgmma.
//
// A CTA of 3 warpgroups works on 128 query rows of one (batch, query head) at a time (an item; persistent CTAs
// take several, see below):
//   * warpgroup 0 is the producer: it gives registers back (setmaxnreg.dec 40, or 24) and one thread streams Q once
//     an item and the K and V tiles of kBlockN keys through a kStages-deep shared-memory ring with TMA
//     (cp.async.bulk.tensor), each tile completing on its own "full" mbarrier (expect-tx bytes); it re-fills a stage
//     once the consumers have arrived on its "empty" mbarrier.
//   * warpgroups 1 and 2 are consumers (setmaxnreg.inc 232, or 240), each owning 64 query rows. Per key tile:
//     S = Q K^T by wgmma (both operands from shared memory), scale and mask, online softmax in FP32 in the exp2
//     domain, P converted in registers to the A operand of O += P V (wgmma, V from shared memory, N-major).
//     Default pipeline (variant 0): the QK^T of tile i+1 and the PV of tile i are in flight while the softmax of
//     tile i+1 runs (FA3's intra-warpgroup overlap), and in 16 bits for DV <= 128 the two consumer warpgroups take
//     turns issuing their GEMMs through two named barriers (FA3's ping-pong), so one's softmax hides under the
//     other's GEMMs (kPingPong). Variant 1 runs the plain sequence (QK, wait, softmax, PV, wait), for tests and
//     benchmarks.
// Key tiles are visited from the last one down, so the tiles that need a mask (the key tail, the causal diagonal)
// come first; causal tiles wholly above the diagonal are never loaded. GQA reads kv head h / (Hq / Hkv) in place.
// Dense calls without a mask run persistent (persistent_grid says when): a grid of one CTA an SM takes the (query
// block, head, batch entry) items in rounds, the producer loading the next item's Q (an mbarrier handshake,
// empty_q) and tiles while the consumers finish this one; where O has its own staging tile (D 64, D 128 on 128-key
// tiles, FP8) an item's last PV and its epilogue run in the next item's first step. O is staged through sO, or the
// consumer's own (no longer needed) rows of the Q tile, and written by TMA stores from O's own tile at DV 128 (a
// box a slab of a warpgroup's 64 rows), else with 16-byte stores of the threads.
//
// Shared memory (one 1024-byte aligned block; every tile in 128-byte swizzle, the layout TMA writes and wgmma reads):
//   sQ           [D/64 slabs][kBlockM rows][64 elements]   (a slab: rows of 128 bytes, 8-row atoms of 1024 bytes,
//   sK[kStages]  [D/64 slabs][kBlockN rows][64 elements]    16-byte chunk c of row r stored at chunk c ^ (r % 8))
//   sV[kStages]  [D/64 slabs][kBlockN rows][64 elements]    (FP8: V transposed, [kBlockN/kVtKeys slabs][DV rows]
//                                                            [kVtKeys keys], in the 128- or 64-byte swizzle)
//   sM[kStages]  [boxes][kBlockM rows][mask row of 128 or 64 bytes]   (masked kernels only; see below)
//   sO           [DV/64 slabs][kBlockM rows][64 elements]   (Layout::kOwnO: no mask, where it fits)
//   mbarriers    full_q, full_k[kStages], full_v[kStages], empty_k[kStages], empty_v[kStages], empty_q
// The tensor maps view q/k/v as 5-D (64, S, D/64, H, B) with byte strides (row, 128, head, batch), so that one TMA
// box (64, rows, D/64, 1, 1) lands as the slab layout above; rows past S are zero-filled by TMA.
//
// Serving batches (attn_lt_flash_sm90_batch: varlen keys, the kernel's kVarlen mode, D = DV 64, 128 or 256, no
// mask, the default pipeline): the grid's block z is a request, whose lengths and first rows each CTA reads once
// (batch_request, native/batch.cuh); q/k/v are packed (total rows, H, D), their maps (64, total rows, D/64, H, 1)
// with the request's first row added to the row coordinate. Keys of a tile past the request's last key (another
// request's) are masked like the key tail of a dense call, query rows past its last row are computed and not
// written. With a block table (the kPaged mode) the keys are a paged cache: the K/V maps view a cache as
// (64, block_size, D/64, Hkv, num_blocks), the producer's warp looks each tile's blocks up (one tile ahead) and its
// lane 0 copies a tile as one box (block_size >= the tile) or one box a (block, 64-column slab); a block id out of
// range is replaced by block 0 and its keys hidden (paged_producer).
//
// Dense masks (bool, true = attend, or additive in q's dtype), read by TMA with the K tile of the same stage and
// completing on its barrier: the mask is a 4-D map (Sk, Sq, Hq, B) over its broadcast strides, a broadcast
// dimension having size 1 (coordinate 0); a box is (128 bytes of keys, 128 rows) — (64 bytes, 128 rows) for a bool
// mask of 64-key tiles — in the matching TMA swizzle, or one row when every query row reads the same mask row. Each
// consumer thread reads the mask of its own accumulator elements from shared memory (the swizzle spreads the eight
// rows a warp reads at once over every bank) and adds it in the exp2 domain; a stage is released once its softmax
// has read it. When the heads share the mask, the grid runs groups of heads side by side over the query blocks
// (head_group says how many), so that a mask block read from HBM serves the group's other heads from L2.
//
// Head dims: v's DV = D, or DV = 128 with D = 192 (MLA prefill: O and V tiles are DV wide, Q and K tiles D wide).
//
// Preconditions (checked by the launcher): sm_90 device; (D, DV) in {(64, 64), (128, 128), (256, 256), (192, 128),
// (576, 512)}, the last with Sq = 1, v = k's first 512 columns and the key range in `splits` parts (MLA decode,
// below); the decode variant (gqa_decode_sm90, below) with D = DV = 64 or 128, Sq <= 64, a mask only if the heads
// share it and its rows of positions are at most 16 (or one); fp16/bf16; q, k, v, o 16-byte aligned;
// batch/head/row strides positive multiples of 8 elements (16 bytes) below 2^39 for q, k, v (any stride of a
// dimension of size 1), and o's the same; Sq, Sk < 2^30; B, Hq <= 65535; a mask bool or of
// q's dtype, 16-byte aligned, its keys contiguous, its other strides 0 or multiples of 16 bytes; the plain variant
// and DV != D without a mask. Serving batches: see attn_lt_flash_sm90_batch.
#include "attn_lt.h"

#include <cuda.h>  // CUtensorMap and its enums only: the driver function is fetched at run time (no -lcuda)
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

namespace {

constexpr int kBlockM = 128;  // query rows a CTA: 2 consumer warpgroups x 64
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
#include "common.cuh"
#include "batch.cuh"
#include "sm90.cuh"

// Key tiles: kBlockN keys, in a kStages-deep ring. kWideN (0: none) is the tile of the default pipeline's dense calls
// without a mask or window from kWideFrom keys (kWideFromCausal with causal rows; wide_tiles), FA3's 192 at D 64 and
// 176 at D 128: a longer tile spreads its fixed costs (the row max and sum across a quad, O's rescale, the barriers)
// over more keys, while shorter rows lose more to the longer last tile and causal ones to the wider diagonal, and at
// D 128 O then has no staging tile of its own (it is staged in Q's, as at D 256), so that a persistent CTA's item
// cannot end in the next one's first step (H200, FA3 protocol, over the persistent kernel's 128-key tiles: D 64
// 0.98x at S 4k, 1.02-1.06x at S 8k-16k, causal 1.02x from S 8k; D 128 0.97x at S 2k, 1.00x at S 4k, 1.02-1.07x
// at S 8k-16k, causal 1.04-1.07x from S 8k). The plain pipeline keeps kBlockN.
// kFp8WideN (0: none): the FP8 prefill's wide key tiles (else 128 keys) in a kFp8WideStages-deep ring, from
// kFp8WideFrom keys without a window (kFp8WideFromCausal with causal rows). Its GEMMs take half the 16-bit time a
// key, so a tile's fixed costs weigh twice as much: 192 keys at D 128, three stages deep (FA3: 224), and 256 at D 64
// (FA3: 160). H200, FA3 protocol, over 128-key tiles: D 128 S 2k 1.03x, 4k 1.02-1.05x, 8k-16k 1.05-1.10x, causal
// 1.01x at 2k and 1.01-1.07x from 4k, S 512 0.94x and 1k 0.95x, causal 0.89x and 0.92x. D 64 with 192 keys: S 2k
// 1.05x, 4k 1.06x, 8k-16k 1.08-1.09x, causal 0.97x at 2k, 1.02x at 4k, 1.04-1.10x from 8k; 256 keys over 192: S 2k
// 1.04-1.05x, 4k 1.06x, 8k 1.05x, 16k 1.08-1.09x, causal 1.03-1.04x at 4k, 1.07x at 8k, 0.99x at 16k (on the grid).
template <int D>
struct Cfg;
template <>
struct Cfg<64> {
    static constexpr int kBlockN = 128, kStages = 4, kWideN = 192, kWideFrom = 8192, kWideFromCausal = 8192;
    static constexpr int kFp8WideN = 256, kFp8WideStages = 4, kFp8WideFrom = 2048, kFp8WideFromCausal = 4096;
};
template <>
struct Cfg<128> {
    static constexpr int kBlockN = 128, kStages = 2, kWideN = 176, kWideFrom = 4096, kWideFromCausal = 8192;
    static constexpr int kFp8WideN = 192, kFp8WideStages = 3, kFp8WideFrom = 2048, kFp8WideFromCausal = 2048;
};
template <>
struct Cfg<192> {  // MLA prefill: q/k head dim 192, v's 128 (the only DV built with D = 192; no mask)
    static constexpr int kBlockN = 128, kStages = 2, kWideN = 0, kFp8WideN = 0, kFp8WideStages = 0;
};
template <>
struct Cfg<256> {
    static constexpr int kBlockN = 64, kStages = 2, kWideN = 0, kFp8WideN = 0, kFp8WideStages = 0;
};

// The (q/k head dim, v head dim) pairs built: DV = D, MLA prefill's (192, 128), and MLA decode's (576, 512) (the
// kernel mla_decode_sm90 below).
constexpr bool head_dims_built(int64_t D, int64_t DV) {
    return (D == DV && (D == 64 || D == 128 || D == 256)) || (D == 192 && DV == 128) || (D == 576 && DV == 512);
}

// The mask a kernel is built for: none, bool (1 byte, true = attend), or additive in q's dtype (2 bytes).
enum MaskKind { kNoMask = 0, kBoolMask = 1, kAddMask = 2 };

// ES: bytes an element of q, k and v (2; 1: the FP8 prefill, 128-key tiles, V transposed: a stage's V tile is DV
// rows of the tile's keys, in slabs of kVtKeys keys). kWide: Cfg<D>::kWideN-key tiles (FP8: kFp8WideN), no mask.
template <int D, int DV, int MK, int ES = 2, bool kWide = false>
struct Layout {
    static constexpr int kWideN = ES == 1 ? Cfg<D>::kFp8WideN : Cfg<D>::kWideN;
    static_assert(!kWide || (kWideN > 0 && MK == kNoMask), "wide tiles: built per Cfg, no mask");
    static constexpr int kBlockN = kWide ? kWideN : ES == 1 ? 128 : Cfg<D>::kBlockN;
    // a mask tile a stage takes the room of the deeper ring at D = 64
    static constexpr int kStages = ES == 1 ? (kWide ? Cfg<D>::kFp8WideStages : D <= 128 ? 4 : 2)
                                           : MK == kNoMask ? Cfg<D>::kStages : D == 64 ? 3 : 2;
    static constexpr uint32_t kQBytes = kBlockM * D * ES, kKBytes = kBlockN * D * ES, kVBytes = kBlockN * DV * ES;
    static constexpr uint32_t kQSlab = kBlockM * 128, kKVSlab = kBlockN * 128;  // bytes of one 128-byte-wide slab
    // bytes a row of a Q or K slab: 128, or 64 (e4m3 at D 64: one slab in the 64-byte swizzle, smem_desc64)
    static constexpr uint32_t kRowBytes = D * ES < 128 ? D * ES : 128;
    // FP8: the transposed V tile's slabs, a TMA box each: DV rows of kVtKeys keys (128: the 128-byte swizzle; 64: the
    // 64-byte, smem_desc64), kVtSlab bytes apart
    static constexpr int kVtKeys = kBlockN % 128 == 0 ? 128 : 64;
    static constexpr uint32_t kVtSlab = DV * kVtKeys;
    static_assert(ES == 2 || (kBlockN % kVtKeys == 0 && kVtSlab % 1024 == 0), "whole transposed-V slabs");
    static_assert(kQSlab % 1024 == 0 && kKVSlab % 1024 == 0, "slabs of whole 8-row swizzle atoms");
    // mask tiles: bytes an element, a box row (128, or 64 for a bool tile of 64 keys), keys a box row, boxes a tile
    static constexpr uint32_t kMaskEs = MK == kBoolMask ? 1 : 2;
    static constexpr uint32_t kMaskPitch = kBlockN * kMaskEs < 128 ? kBlockN * kMaskEs : 128;
    static constexpr uint32_t kMaskCols = kMaskPitch / kMaskEs, kMaskBoxes = kBlockN / kMaskCols;
    static constexpr uint32_t kMaskBox = kBlockM * kMaskPitch, kMaskStage = MK == kNoMask ? 0 : kMaskBoxes * kMaskBox;
    static constexpr uint32_t kK = kQBytes, kV = kK + kStages * kKBytes, kM = kV + kStages * kVBytes;
    static constexpr uint32_t kBarCount = 2 + 4 * kStages;
    // O's own staging tile (kBlockM rows of DV 16-bit elements, Q's slab layout) where it fits beside the ring, so
    // that a persistent CTA loads its next Q while O is written; else O is staged in the Q tile
    static constexpr uint32_t kOBytes = kBlockM * DV * 2, kO = kM + kStages * kMaskStage;
    static constexpr bool kOwnO = MK == kNoMask && kO + kOBytes + 8 * kBarCount + 1024 <= 227 * 1024;
    static constexpr uint32_t kBars = kO + (kOwnO ? kOBytes : 0);
    static constexpr size_t kSmem = kBars + 8 * kBarCount + 1024;  // + slack to align the base to 1024 bytes
    static_assert(kSmem <= 227 * 1024, "shared memory over the sm_90 limit");
    static_assert(kMaskPitch == 128 || kMaskPitch == 64, "mask rows in 128- or 64-byte swizzle");
    static_assert(head_dims_built(D, DV) && DV <= D && D <= 256, "O is staged in the Q tile's rows");
    static_assert(ES == 2 || (MK == kNoMask && D == DV && kOwnO), "FP8: no mask, D = DV, O (16-bit) in its own tile");
};

// What every kernel here takes: the output, its strides and the call's shape (filled by base_params). The prefill
// kernel's Params keep this layout: its D 64 masked kernel ran 5-8 % slower on the H100 when two pointer fields
// (the decode kernels' partials) were added in front of the strides, with PTX that differed in parameter offsets only.
struct BaseParams {
    void* o;
    float* lse;  // FP32 (B, Hq, Sq) contiguous, or null (the decode kernels: one part)
    int64_t o_sb, o_sh, o_ss;
    int Sq, Sk, Hq, group;  // group = Hq / Hkv
    float sl2;              // softmax scale * log2(e)
    int causal;             // bottom-right aligned (the MLA decode kernel takes none)
};

// The decode kernels' key parts: `parts` of `tiles_per_part` key tiles each; with more than one, the partials
// [parts][B * Hq * Sq][Dv] FP32 and their LSEs [parts][B * Hq * Sq] (filled by part_params).
struct PartParams {
    float* o_part;
    float* lse_part;
    int parts, tiles_per_part;
};

// What the prefill kernel needs besides the tensor maps.
struct Params : BaseParams {
    int m_rows;        // mask rows a box: kBlockM, or 1 when every query row reads mask row 0
    int m_h, m_b;      // 1 where the mask has rows of its own per head / per batch entry, 0 where it is broadcast
    int m_blocks;      // query blocks of 128 rows
    int head_group;    // 0: grid (query blocks, Hq, B); else grid (Hq * query blocks, 1, B), head_group heads side
                       // by side over the query blocks, group after group (a mask shared by the heads)
    // The attention variants (set_variant): softcap on the raw scores (s -> cap_out * tanh(s * cap_in); cap_in 0:
    // none), the window's edges (window_of) and the sinks (FP32 (Hq,), or null).
    float cap_in, cap_out;
    Window win;
    const float* sinks;
    // The FP8 prefill's descale factors (FP32, kv head hk's at [hk * descale_sh]; null: 1).
    const float *q_descale, *k_descale, *v_descale;
    int64_t descale_sh;
    int items;  // a persistent kernel's work items: query blocks x Hq x B (0: a CTA an item)
    FastDiv by_units, by_heads;  // a persistent kernel's: by its units a (batch entry, head) (units_of), by Hq
};

// The prefill kernel's varlen mode (a serving batch, attn_lt_flash_sm90_batch): Params with Sq, Sk the capacities
// (the kernel takes each request's lengths from batch_request) and the batch's arguments.
struct BatchParams : Params {
    attn_lt_batch_args batch;
};
template <bool kVarlen>
using FwdParams = std::conditional_t<kVarlen, BatchParams, Params>;

// A persistent prefill kernel's work unit: one query block, or with causal rows two (query blocks i and
// m_blocks - 1 - i, whose key tiles sum alike); units_of: a (batch entry, head)'s units.
__host__ __device__ constexpr int blocks_per_unit(bool causal) { return causal ? 2 : 1; }
__host__ __device__ constexpr int units_of(int m_blocks, int per_unit) { return (m_blocks + per_unit - 1) / per_unit; }

// The prefill kernels built persistent (flash_sm90_fwd; the launcher then sizes the grid by persistent_grid): dense,
// without a mask; not the FP8 kernel at D 256, whose consumers need 240 registers (and a persistent producer 40).
template <int D, typename T, int MK, bool kVarlen>
constexpr bool persistent_kernel() {
    return !kVarlen && MK == kNoMask && !(sizeof(T) == 1 && D == 256);
}

// Whether a prefill kernel stages O in its own tile (Layout::kOwnO, for persistent kernels and the FP8 one; else in
// the Q tile).
template <int D, int DV, typename T, int MK, bool kVarlen, bool kWide>
constexpr bool own_o_tile() {
    return (persistent_kernel<D, T, MK, kVarlen>() || sizeof(T) == 1) && Layout<D, DV, MK, sizeof(T), kWide>::kOwnO;
}

// Whether a prefill kernel stores O by TMA (reading its map tmo): from O's own tile at DV 128, where the deferred
// epilogue's store then leaves the consumers at once. The threads store it elsewhere: varlen (inside the request's
// rows), O in the Q tile (D 128 on wide tiles, D 192 and 256: the next Q load waits for the store either way; at
// D 256 the store's registers also made the persistent consumers spill) and DV 64 (its builds ran D 64 slower on the
// H200).
template <int D, int DV, typename T, int MK, bool kVarlen, bool kWide>
constexpr bool tma_stores_o() {
    return !kVarlen && DV == 128 && own_o_tile<D, DV, T, MK, kVarlen, kWide>();
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// setmaxnreg targets: 128 * 24 + 256 * 240 = 128 * 40 + 256 * 232 = 384 * 168, the registers the CTA was launched
// with. A producer with work of its own takes 40, its consumers 232: a persistent prefill kernel's (24 spill its item
// loop), MLA decode's on an FP8 cache (the widening).
constexpr int kProducerRegs = 24, kConsumerRegs = 240;
template <bool kBusy>
constexpr int kBusyProducerRegs = kBusy ? 40 : kProducerRegs;
template <bool kBusy>
constexpr int kBusyConsumerRegs = kBusy ? 232 : kConsumerRegs;

// ---- the accumulator-fragment steps both kernels share (a thread holds rows rw and rw + 8 of an m64 fragment:
// d[4j + 0..1] of row rw, d[4j + 2..3] of row rw + 8) ------------------------------------------------------------

// One key tile's online softmax on S (N accumulators, scores times sc are in the exp2 domain): each row's reference m
// (its running max, unless lazy or fixed below) and this thread's part of the row sum l are updated, corr gets the
// factors that rescale what O holds, and S becomes P = exp2(S * sc - m * sc). A row with no visible key yet keeps m
// -inf and P 0 (no inf - inf).
// bias: added to every exponent (P and the sum come out times 2^bias; the FP8 prefill's 8). lazy: a row keeps its
// reference m while the tile's max exceeds it by at most `lazy` (exp2 domain; P then up to 2^lazy, corr 1), so O is
// rarely rescaled after the first tiles (0: m is always the running max). fixed: m is a fixed reference that bounds
// the scores (softcap's): P = exp2(S * sc - m * sc), no max, corr 1.
template <int N>
__device__ __forceinline__ void online_softmax(float (&sacc)[N], float (&m)[2], float (&l)[2], float sc,
                                               float (&corr)[2], float bias = 0.f, float lazy = 0.f,
                                               bool fixed = false) {
    float ref[2];
    if (fixed) {
        corr[0] = corr[1] = 1.f;
        ref[0] = m[0] * sc - bias;
        ref[1] = m[1] * sc - bias;
    } else {
        // each row's max in kChains independent chains, joined at the end (the exponentials wait on it: one chain
        // would put N / 4 dependent max instructions on the softmax's critical path)
        constexpr int kChains = N / 4 >= 4 ? 4 : N / 4;
        float mc[2][kChains];
#pragma unroll
        for (int c = 0; c < kChains; ++c) {
            mc[0][c] = fmaxf(sacc[4 * c], sacc[4 * c + 1]);
            mc[1][c] = fmaxf(sacc[4 * c + 2], sacc[4 * c + 3]);
        }
#pragma unroll
        for (int j = kChains; j < N / 4; ++j) {
            mc[0][j % kChains] = fmaxf(mc[0][j % kChains], fmaxf(sacc[4 * j], sacc[4 * j + 1]));
            mc[1][j % kChains] = fmaxf(mc[1][j % kChains], fmaxf(sacc[4 * j + 2], sacc[4 * j + 3]));
        }
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int c = 0; c < kChains; ++c) {
            mx[0] = fmaxf(mx[0], mc[0][c]);
            mx[1] = fmaxf(mx[1], mc[1][c]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));  // the 4 lanes of a row
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            // (false while m is -inf: +inf against a finite max, NaN against -inf)
            if (lazy > 0.f && (mx[r] - m[r]) * sc <= lazy) {
                corr[r] = 1.f;
                ref[r] = m[r] * sc - bias;
                continue;
            }
            corr[r] = m[r] == -INFINITY ? 0.f : ex2((m[r] - mx[r]) * sc);
            ref[r] = (mx[r] == -INFINITY ? 0.f : mx[r] * sc) - bias;
            m[r] = mx[r];
            l[r] *= corr[r];
        }
    }
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[4 * j + e] = ex2(fmaf(sacc[4 * j + e], sc, -ref[e >> 1]));
        l[0] += sacc[4 * j] + sacc[4 * j + 1];
        l[1] += sacc[4 * j + 2] + sacc[4 * j + 3];
    }
}

// Scores of keys outside [lo0, lim0) (row rw) and [lo1, lim1) (row rw + 8) to -inf; k0: the key of this thread's
// first column (the tile's first key + 2 (lane % 4)).
template <int N>
__device__ __forceinline__ void hide_keys(float (&sacc)[N], int k0, int lo0, int lim0, int lo1, int lim1) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int key = k0 + 8 * j + e;
            sacc[4 * j + e] = key >= lo0 && key < lim0 ? sacc[4 * j + e] : -INFINITY;
            sacc[4 * j + 2 + e] = key >= lo1 && key < lim1 ? sacc[4 * j + 2 + e] : -INFINITY;
        }
}

// Rows rw and rw + 8 of an accumulator times c0 and c1.
template <int N>
__device__ __forceinline__ void scale_rows(float (&acc)[N], float c0, float c1) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
        acc[4 * j] *= c0;
        acc[4 * j + 1] *= c0;
        acc[4 * j + 2] *= c1;
        acc[4 * j + 3] *= c1;
    }
}

// P in FP32 to the A operand of P V: the accumulator of columns [16kk, 16kk + 16) is, register for register, the A
// fragment of k-step kk.
template <typename T, int N>
__device__ __forceinline__ void to_a_fragments(const float (&sacc)[N], uint32_t (&pf)[N / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 8; ++kk) {
        pf[kk][0] = pack2<T>(sacc[8 * kk + 0], sacc[8 * kk + 1]);  // row rw,     cols 2(l%4) + 0..1
        pf[kk][1] = pack2<T>(sacc[8 * kk + 2], sacc[8 * kk + 3]);  // row rw + 8, same columns
        pf[kk][2] = pack2<T>(sacc[8 * kk + 4], sacc[8 * kk + 5]);  // row rw,     cols 8 + 2(l%4) + 0..1
        pf[kk][3] = pack2<T>(sacc[8 * kk + 6], sacc[8 * kk + 7]);  // row rw + 8
    }
}

// P in FP32 to the e4m3 A operand of P V (k32 steps): the accumulator's eight columns of a row in a 32-key step
// (8j + 2(l%4) + 0..1, j = 0..3) packed in order, as the A fragment's columns 4(l%4) + 0..3 and 16 + 4(l%4) + 0..3.
// The keys of V's transposed tile are permuted to match (fp8_key_of), so no register moves between lanes.
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d) {
    uint16_t lo, hi;  // cvt.rn.satfinite.e4m3x2.f32 d, x, y: x to the upper byte, y to the lower
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(d), "f"(c));
    return uint32_t(lo) | (uint32_t(hi) << 16);
}
template <int N>
__device__ __forceinline__ void to_e4m3_fragments(const float (&sacc)[N], uint32_t (&pf)[N / 16][4]) {
#pragma unroll
    for (int kb = 0; kb < N / 16; ++kb) {
        const float* x = sacc + 16 * kb;
        pf[kb][0] = pack4_e4m3(x[0], x[1], x[4], x[5]);      // row rw
        pf[kb][1] = pack4_e4m3(x[2], x[3], x[6], x[7]);      // row rw + 8
        pf[kb][2] = pack4_e4m3(x[8], x[9], x[12], x[13]);    // row rw
        pf[kb][3] = pack4_e4m3(x[10], x[11], x[14], x[15]);  // row rw + 8
    }
}

// ---- the paged mode (attn_lt_flash_sm90_batch with a block table) ------------------------------------------------

__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

// log2 of a paged cache's block size (a power of two, checked on the host).
__device__ __forceinline__ int paged_log2_bs(const attn_lt_batch_args& a) {
    return __ffsll(static_cast<long long>(a.block_size)) - 1;
}

// Scores of the keys on the tile's bad pages to -inf: bit j of `bad` is the tile's keys [j bs, (j + 1) bs) (bs >= the
// tile: bit 0, the whole tile); c0 = 2 (lane % 4), the tile column of this thread's first element.
template <int N>
__device__ __forceinline__ void hide_pages(float (&sacc)[N], int c0, uint32_t bad, int log2_bs) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
            if ((bad >> ((c0 + 8 * j + e) >> log2_bs)) & 1u) {
                sacc[4 * j + e] = -INFINITY;
                sacc[4 * j + 2 + e] = -INFINITY;
            }
}

// The paged mode's producer, run by warp 0 of the producer warpgroup (n_tiles > 0): lane 0 streams Q once (rows
// q_row.., head h) and every K and V tile of request blockIdx.z's kv head hk through the ring, as the other modes'
// producer does; the lanes look the tile's blocks up, lane j the block of the tile's page j, one tile ahead of the
// copies. The K and V maps (make_paged_map) view a cache as 5-D (64, bs, D / 64, Hkv, num_blocks):
//   * bs >= BN: a tile lies in one block (tiles are BN-aligned): one box of (64, BN, D / 64) at row n0 % bs of it;
//   * bs < BN: a tile spans BN / bs blocks (pages): one box of (64, bs, 1) a (page, 64-column slab), landing at the
//     slab's offset + page * bs * 128 bytes. A slab's rows are 128 bytes in 8-row atoms of 1024 bytes whose 128-byte
//     swizzle TMA takes from the address bits 7-9 (the row % 8); bs >= 8 keeps every box 1024-byte aligned, so that
//     tile row page * bs + r lands swizzled as row r % 8 = (page * bs + r) % 8, the slab layout of one whole box.
// Either way a stage receives BN * D * 2 bytes of K and of V: its expect-tx counts are the other modes'.
// A page with no key of the request (past its last key) and a page whose block id is out of range read block 0's
// rows instead (nothing is left out, so the expect-tx counts hold); the first are hidden with the key tail, the
// second through the stage's bad word (bit j: page j), written before the stage's K arrival and read by the
// consumers before they release the stage, and reported (ATTN_LT_BATCH_BAD_BLOCK).
template <int D, int BN, int kStages>
__device__ __forceinline__ void paged_producer(const CUtensorMap* tmq, const CUtensorMap* tmk, const CUtensorMap* tmv,
                                               const attn_lt_batch_args& a, uint32_t sQ, uint32_t sK, uint32_t sV,
                                               uint32_t bars, int q_row, int h, int hk, int Sk, int top,
                                               int n_tiles) {
    using L = Layout<D, D, kNoMask>;
    const int lane = threadIdx.x, b = blockIdx.z;
    const int log2_bs = paged_log2_bs(a), bs = 1 << log2_bs;
    const int pages = bs < BN ? BN >> log2_bs : 1;  // pages a tile spans
    const uint32_t full_q = bars;
    auto full_k = [&](int s) { return bars + 8u * (1 + s); };
    auto full_v = [&](int s) { return bars + 8u * (1 + kStages + s); };
    auto empty_k = [&](int s) { return bars + 8u * (1 + 2 * kStages + s); };
    auto empty_v = [&](int s) { return bars + 8u * (1 + 3 * kStages + s); };
    // lane j's block of tile t (visited from tile top - 1 down, n_tiles of them): the table's id (as paged_block
    // reads it; checked against [0, num_blocks) only where it is used, so that the load stays in flight), 0 for a
    // page past the keys
    auto lookup = [&](int t) {
        int id = 0;
        if (t < n_tiles && lane < pages) {
            const int key = (top - 1 - t) * BN + (lane << log2_bs);
            if (key < Sk) id = __ldg(a.block_table + b * a.bt_stride + (key >> log2_bs));
        }
        return id;
    };
    // one K or V tile: the pages' boxes (blk: lane j's block, r0: the tile's row in its block when bs >= BN)
    auto copy_tile = [&](const CUtensorMap* map, uint32_t dst, uint32_t bar, int blk, int r0) {
        for (int j = 0; j < pages; ++j) {
            const int id = __shfl_sync(0xffffffffu, blk, j);
            if (lane == 0) {
                if (pages == 1) {
                    tma_load_5d(dst, map, bar, 0, r0, 0, hk, id);
                } else {
#pragma unroll
                    for (int x = 0; x < D / 64; ++x)
                        tma_load_5d(dst + x * L::kKVSlab + ((j * 128) << log2_bs), map, bar, 0, 0, x, hk, id);
                }
            }
        }
    };
    if (lane == 0) {
        prefetch_map(tmq);
        prefetch_map(tmk);
        prefetch_map(tmv);
        mbar_expect_tx(full_q, L::kQBytes);
        tma_load_5d(sQ, tmq, full_q, 0, q_row, 0, h, 0);
    }
    int next = lookup(0);
    int s = 0;
    uint32_t ph = 0;
    for (int i = 0; i < n_tiles; ++i) {
        const int r0 = ((top - 1 - i) * BN) & (bs - 1);
        const int id = next;
        next = lookup(i + 1);  // in flight during this tile's waits and copies
        mbar_wait(empty_k(s), ph ^ 1);
        const bool out = !paged_id_ok(a, id);
        const uint32_t bad = __ballot_sync(0xffffffffu, out);
        const int blk = out ? 0 : id;
        if (lane == 0) {
            if (bad) atomicOr(a.error, ATTN_LT_BATCH_BAD_BLOCK);
            st_shared_u32(bars + 8u * L::kBarCount + 4u * s, bad);  // before the arrival that releases it
            mbar_expect_tx(full_k(s), L::kKBytes);
        }
        copy_tile(tmk, sK + s * L::kKBytes, full_k(s), blk, r0);
        mbar_wait(empty_v(s), ph ^ 1);
        if (lane == 0) mbar_expect_tx(full_v(s), L::kVBytes);
        copy_tile(tmv, sV + s * L::kVBytes, full_v(s), blk, r0);
        ring_next<kStages>(s, ph);
    }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Grid: (ceil(Sq / 128), Hq, B), or (Hq * ceil(Sq / 128), 1, B) with head_group; block: 384 threads; dynamic shared
// memory Layout<D, DV, MK>::kSmem. tmm, the mask's map, is read only when MK != kNoMask; tmo, o's, only when
// tma_stores_o. D: q's and k's head dim, DV: v's and o's.
// kVarlen (no mask, head_group 0): block z is request b of a serving batch, Sq and Sk its lengths (batch_request;
// p.Sq the capacity that sized the grid), its query rows [q0, q0 + Sq) of the packed q and o and its key rows
// [k0, k0 + Sk) of the packed k and v, whose maps have batch extent 1 (coordinates offset by q0 and k0); lse is
// (Hq, total_q). A block past the request's rows, or of a request of at most decode_rows rows a kv head (those
// run on native/flash.cu's decode blocks), returns before any barrier. Rows of the tiles past the request's ends
// (other requests' rows) are masked (keys) or not written (queries).
// kPaged (with kVarlen): the keys are request b's in a paged cache (paged_producer), k0 = 0; the launch adds
// kPagedSmem bytes of shared memory (a word a stage past the barriers: the stage's bad pages).
template <int D, int DV, typename T, bool kOverlap, int MK, bool kVarlen = false, bool kPaged = false,
          bool kWide = false>
__global__ void __launch_bounds__(kThreads, 1)
    flash_sm90_fwd(const __grid_constant__ CUtensorMap tmq, const __grid_constant__ CUtensorMap tmk,
                   const __grid_constant__ CUtensorMap tmv, const __grid_constant__ CUtensorMap tmm,
                   const __grid_constant__ CUtensorMap tmo, const FwdParams<kVarlen> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr bool kFp8 = sizeof(T) == 1;  // the FP8 prefill (e4m3 q, k, transposed v; o bf16)
    using L = Layout<D, DV, MK, sizeof(T), kWide>;
    using To = std::conditional_t<kFp8, __nv_bfloat16, T>;  // o's element type
    constexpr bool kMasked = MK != kNoMask;
    using M = std::conditional_t<MK == kBoolMask, bool, T>;  // the mask's element type
    constexpr int BN = L::kBlockN, kStages = L::kStages;
    constexpr int kKP = kFp8 ? 32 : 16;  // keys a k-step of P V
    static_assert(!kFp8 || (!kVarlen && MK == kNoMask), "the FP8 prefill: dense, without a mask");
    // Ping-pong, the 16-bit kernel at DV <= 128 only: as FA3, the D = 256 tiles leave no room to take turns; the FP8
    // kernel's GEMMs take as long as a tile's softmax, and its warpgroups going free is faster (D 128: 1.03-1.07x; D 64
    // the same).
    constexpr bool kPingPong = kOverlap && DV <= 128 && !kFp8;
    static_assert(!kVarlen || (MK == kNoMask && D == DV), "the varlen mode is built without masks, DV = D only");
    static_assert(!kPaged || (kVarlen && kOverlap), "the paged mode is the varlen mode's, default pipeline only");
    // Dense calls without a mask run persistent (a CTA an SM, item after item: the next item's loads overlap this
    // one's last GEMMs and its O's stores); O is staged in its own tile where it fits (L::kOwnO; FP8: always).
    constexpr bool kPersistent = persistent_kernel<D, T, MK, kVarlen>();
    constexpr bool kOwnO = own_o_tile<D, DV, T, MK, kVarlen, kWide>();
    constexpr bool kStoreO = tma_stores_o<D, DV, T, MK, kVarlen, kWide>();
    static_assert(!kStoreO || L::kO % 1024 == 0, "TMA's 128-byte swizzle: O's tile on a 1024-byte boundary");
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sQ = base, sK = base + L::kK, sV = base + L::kV, sM = base + L::kM, sO = base + L::kO;
    const uint32_t bars = base + L::kBars, full_q = bars, empty_q = bars + 8u * (1 + 4 * kStages);
    auto full_k = [&](int s) { return bars + 8u * (1 + s); };
    auto full_v = [&](int s) { return bars + 8u * (1 + kStages + s); };
    auto empty_k = [&](int s) { return bars + 8u * (1 + 2 * kStages + s); };
    auto empty_v = [&](int s) { return bars + 8u * (1 + 3 * kStages + s); };

    // Query rows and keys (varlen: request blockIdx.z's), and where they start in q/o and k/v (varlen: packed rows)
    int Sq = p.Sq, Sk = p.Sk, m_blocks = p.m_blocks, q0 = 0, k0 = 0;
    if constexpr (kVarlen) {
        const BatchRequest r =
            batch_request(p.batch, blockIdx.z, blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0);
        Sq = r.nq;
        Sk = r.nk;
        q0 = r.q0;
        k0 = r.k0;
        m_blocks = (Sq + kBlockM - 1) / kBlockM;
        // (before any barrier)
        if (int(blockIdx.x) >= m_blocks || int64_t(Sq) * p.group <= p.batch.decode_rows) return;
    }
    const int shift = Sk - Sq;  // causal: key j visible to query i iff j <= i + shift
    const Window win = p.win;
    // A work item: one query block of one (batch entry, query head), its key tiles [lo, top) under the window
    // (causal: the right edge 0), visited from top - 1 down. A persistent CTA (p.items > 0) takes the units
    // blockIdx.x + r * gridDim.x, r = 0, 1, ..., of the items in order (query blocks fastest, then heads, then batch
    // entries: the blocks in flight share K and V in L2); a unit is one item, or with causal rows two whose sums of
    // key tiles are equal (within a tile on wide tiles: query blocks i and m_blocks - 1 - i), so that the CTAs end
    // together.
    // Without it (p.items 0: the grid variant, masks, varlen) a CTA runs its block's item.
    const bool persistent = kPersistent && p.items > 0;
    const int per_unit = persistent ? blocks_per_unit(p.causal) : 1;
    const int unit_blocks = units_of(m_blocks, per_unit);
    const int n_units = persistent ? p.items / m_blocks * unit_blocks : 1;
    struct Item {
        int h, b, m0, m_valid, lo, top;
    };
    // A persistent CTA decodes an item a round, by the host's FastDivs where a key tile's GEMMs are shortest (a Q row
    // of at most 128 bytes: D 64 in 16 bits, FP8; H200, FA3 protocol, S 512-1k: 1.00-1.05x), else by divisions (D 256;
    // D 128 in 16 bits, whose rows not causal from S 1k ran 0.93-1.00x with FastDivs).
    auto divmod = [](int n, int d, const FastDiv& fd, int& q, int& r) {
        if constexpr (D * sizeof(T) <= 128) {
            q = fd.div(n);
            r = n - q * d;
        } else {
            r = n % d;
            q = n / d;
        }
    };
    // item m (< per_unit) of unit u, false if it has none (the middle block of an odd count)
    auto item_at = [&](int u, int m, Item& it) {
        int qb;
        if (persistent) {
            int hb, i;
            divmod(u, unit_blocks, p.by_units, hb, i);
            qb = m == 0 ? i : m_blocks - 1 - i;
            if (m == 1 && qb <= i) return false;
            divmod(hb, p.Hq, p.by_heads, it.b, it.h);
        } else {
            qb = blockIdx.x;
            it.h = blockIdx.y;
            it.b = blockIdx.z;
            if (p.head_group) {  // block x of a group of hg heads: query block x / hg of head x % hg (the last smaller)
                const int span = p.head_group * m_blocks, g = blockIdx.x / span;
                const int hg = min(p.head_group, p.Hq - g * p.head_group);
                const int x = blockIdx.x - g * span;
                qb = x / hg;
                it.h = g * p.head_group + x % hg;
            }
        }
        it.m0 = (m_blocks - 1 - qb) * kBlockM;  // heaviest causal blocks first; lengths below 2^30 (host-checked)
        it.m_valid = min(kBlockM, Sq - it.m0);
        it.top = (Sk + BN - 1) / BN;
        it.lo = 0;
        window_tiles(win, it.m0, it.m0 + it.m_valid - 1, shift, BN, it.lo, it.top);
        return true;
    };
    // this CTA's r-th item: 1 (in it), 0 (none: skip it) or -1 (no more)
    auto item_of = [&](int r, Item& it) {
        const int u = persistent ? blockIdx.x + r / per_unit * gridDim.x : r;
        if (u >= n_units) return -1;
        return item_at(u, r % per_unit, it) ? 1 : 0;
    };

    if (threadIdx.x == 0) {
        mbar_init(full_q, 1);
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full_k(s), 1);  // the producer's expect-tx arrival; the bytes complete the phase
            mbar_init(full_v(s), 1);
            mbar_init(empty_k(s), 8);  // one arrival per consumer warp
            mbar_init(empty_v(s), 8);
        }
        mbar_init(empty_q, 8);  // persistent: one arrival per consumer warp once the item's Q (or O in it) is read
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        // ---- producer: one thread issues every TMA copy (paged: warp 0 looks the blocks up, its lane 0 copies) ---
        setmaxnreg_dec<kBusyProducerRegs<kPersistent>>();
        if constexpr (kPaged) {
            Item it;
            item_at(0, 0, it);
            if (threadIdx.x < 32 && it.top > it.lo)
                paged_producer<D, BN, kStages>(&tmq, &tmk, &tmv, p.batch, sQ, sK, sV, bars, q0 + it.m0, it.h,
                                               it.h / p.group, Sk, it.top, it.top - it.lo);
        } else if (threadIdx.x == 0) {
            prefetch_map(&tmq);
            prefetch_map(&tmk);
            prefetch_map(&tmv);
            if constexpr (kMasked) prefetch_map(&tmm);
            int s = 0;
            uint32_t ph = 0, qph = 0;
            for (int r = 0;; ++r) {
                Item it;
                const int got = item_of(r, it);
                if (got < 0) break;
                if (got == 0) continue;
                const int n_tiles = it.top - it.lo, m0 = it.m0, h = it.h, b = it.b, hk = h / p.group;
                if (!persistent && n_tiles == 0) continue;  // persistent: every item's Q (the consumers wait for it)
                // the mask box's row, head and batch coordinates (0 along a broadcast dimension)
                const int mr = p.m_rows == 1 ? 0 : m0, mh = p.m_h ? h : 0, mb = p.m_b ? b : 0;
                const uint32_t k_bytes = L::kKBytes + (kMasked ? L::kMaskBoxes * p.m_rows * L::kMaskPitch : 0);
                const int bz = kVarlen ? 0 : b;  // varlen: one batch entry of packed rows
                auto load_q = [&] {
                    if (persistent) {  // the consumers are done with the previous item's Q tile
                        mbar_wait(empty_q, qph ^ 1);
                        qph ^= 1;
                    }
                    mbar_expect_tx(full_q, L::kQBytes);
                    tma_load_5d(sQ, &tmq, full_q, 0, q0 + m0, 0, h, bz);
                };
                // O staged in the Q tile: the first K and V tiles go in while the previous item's O is written
                const bool q_after_first = persistent && !kOwnO && n_tiles > 0;
                if (!q_after_first) load_q();
                for (int i = 0; i < n_tiles; ++i) {
                    const int n0 = (it.top - 1 - i) * BN;  // key tiles from the last one down
                    mbar_wait(empty_k(s), ph ^ 1);          // the consumers released this stage's previous use
                    mbar_expect_tx(full_k(s), k_bytes);
                    tma_load_5d(sK + s * L::kKBytes, &tmk, full_k(s), 0, k0 + n0, 0, hk, bz);
                    if constexpr (kMasked)
#pragma unroll
                        for (int x = 0; x < int(L::kMaskBoxes); ++x)
                            tma_load_4d(sM + s * L::kMaskStage + x * L::kMaskBox, &tmm, full_k(s),
                                        n0 + x * L::kMaskCols, mr, mh, mb);
                    mbar_wait(empty_v(s), ph ^ 1);
                    mbar_expect_tx(full_v(s), L::kVBytes);
                    if constexpr (kFp8)  // the transposed V: (keys, DV, Hkv, B), a box a slab (DV rows of kVtKeys keys)
#pragma unroll
                        for (int x = 0; x < BN / L::kVtKeys; ++x)
                            tma_load_4d(sV + s * L::kVBytes + x * L::kVtSlab, &tmv, full_v(s), n0 + x * L::kVtKeys, 0,
                                        hk, b);
                    else
                        tma_load_5d(sV + s * L::kVBytes, &tmv, full_v(s), 0, k0 + n0, 0, hk, bz);
                    ring_next<kStages>(s, ph);
                    if (q_after_first && i == 0) load_q();
                }
            }
        }
    } else {
        // ---- consumers: warpgroup c owns tile rows [64c, 64c + 64) ----------------------------------------------
        setmaxnreg_inc<kBusyConsumerRegs<kPersistent>>();
        const int c = wg - 1;
        const int tid = threadIdx.x - 128 * wg;
        const int warp = tid / 32, lane = tid % 32;
        const int rw = 16 * warp + lane / 4;  // row (within the warpgroup's 64) of d[4j + 0..1]; d[4j + 2..3]: rw + 8
        constexpr float pb = kFp8 ? 8.f : 0.f;  // FP8: P is stored times 2^8 (e4m3 then keeps P down to 2^-17)
        const bool capped = p.cap_in > 0.f;
        // Softcapped scores are bounded: tanh(S cap_in) times sc = cap log2(e) lies in [-sc, sc]. In bf16 (P needs
        // FP32's exponent range: fp16's and e4m3's are too narrow) without a mask (which adds to the scores), the
        // softmax subtracts the fixed reference max(0, sc - kFixedTop) instead of the running max: P in
        // [2^kFixedFloor, 2^kFixedTop], no max, O never rescaled, when 2 sc <= kFixedTop - kFixedFloor (cap <= 56.8;
        // Gemma 2's 50, Grok's 30). The floor keeps P V's FP32 products normal for |V| down to 2^-26. m_fix: that
        // reference in units of the capped scores (m_r's), -inf for the running max. Built at DV 256, where it makes
        // softcap cost what the plain call does; at D 64 and 128 the two multi-function-unit ops a score set the pace
        // either way, and the branch costs the plain call there.
        constexpr float kFixedTop = 64.f, kFixedFloor = -100.f;
        constexpr bool kFixedOk = std::is_same_v<T, __nv_bfloat16> && !kMasked && DV == 256;
        const float cap_sc = p.sl2 * p.cap_out;
        const bool fixed_ref = kFixedOk && capped && 2.f * cap_sc <= kFixedTop - kFixedFloor;
        const float m_fix = fixed_ref ? fmaxf(0.f, cap_sc - kFixedTop) / cap_sc : -INFINITY;
        // This thread's mask rows in a stage (row 0 when all rows read one), as byte offsets and swizzle phases:
        // element (R, n) of box n / kMaskCols lies at R * pitch + ((n % kMaskCols) * es ^ swizzle(R)).
        const int mrow0 = p.m_rows == 1 ? 0 : 64 * c + rw, mrow1 = p.m_rows == 1 ? 0 : mrow0 + 8;
        const auto swz = [](int R) {
            return uint32_t(L::kMaskPitch == 128 ? (R & 7) << 4 : ((R >> 1) & 3) << 4);
        };
        const uint32_t mo0 = mrow0 * L::kMaskPitch, mo1 = mrow1 * L::kMaskPitch, mz0 = swz(mrow0), mz1 = swz(mrow1);
        const unsigned char* smem_m = smem_raw + (sM - smem_u32(smem_raw));  // generic pointer to sM

        // O accumulator, m64 x DV fragment. In 16 bits at DV 128 an item's O starts fresh (o_fresh) rather than
        // zeroed: its first P V writes O instead of adding to it, and finish zeroes an O no P V wrote (H200, FA3
        // protocol, D 128: S 512 1.01-1.02x, causal S 512-2k 1.01-1.04x, the other rows 0.96-1.02x; at DV 256 the
        // persistent consumers spilled, at DV 64 no gain).
        constexpr bool kFreshO = DV == 128 && !kFp8;
        float o[DV / 2];
        float sacc[BN / 2];      // S accumulator, m64 x BN fragment; after the softmax, P in FP32
        uint32_t pf[BN / kKP][4];  // P as the A operand of PV, one k-step each
        auto zero_o = [&]() {
#pragma unroll
            for (int i = 0; i < DV / 2; ++i) o[i] = 0.f;
        };
        if constexpr (kFreshO) zero_o();  // (the registers a first P V reads and ignores)
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) sacc[i] = 0.f;
#pragma unroll
        for (int i = 0; i < BN / kKP; ++i) pf[i][0] = pf[i][1] = pf[i][2] = pf[i][3] = 0u;
        float m_r[2], l_r[2];  // each row's softmax reference (online_softmax's m), this thread's columns' row sum

        // this warpgroup's 64 rows in every Q slab (8-row atoms, 1024-aligned; 512 in the 64-byte swizzle)
        const uint32_t q_wg = sQ + 64 * c * L::kRowBytes;
        // S = Q K^T: k-step kk reads 32 bytes (16 columns; FP8 32) of slab kk / 4, 32 bytes into its 128-byte rows
        // (FP8 at D 64: 64-byte rows, two k-steps, both in slab 0).
        const SmemDesc q_desc = L::kRowBytes == 64 ? smem_desc64(q_wg) : smem_desc(q_wg, 16);
        const SmemDesc k_desc = L::kRowBytes == 64 ? smem_desc64(sK) : smem_desc(sK, 16);
        const SmemDesc v_desc =
            !kFp8 ? smem_desc(sV, L::kKVSlab) : L::kVtKeys == 64 ? smem_desc64(sV) : smem_desc(sV, 16);
        auto issue_qk = [&](int s) {
            const SmemDesc qd = q_desc.uniform(), kd = k_desc.moved(s * L::kKBytes).uniform();
#pragma unroll
            for (int kk = 0; kk < D * int(sizeof(T)) / 32; ++kk) {
                const uint64_t da = qd.at(kstep_offset(kk, L::kQSlab)), db = kd.at(kstep_offset(kk, L::kKVSlab));
                if constexpr (kFp8) wgmma_ss_e4m3<BN>(sacc, da, db, kk > 0);
                else wgmma_ss<BN, T>(sacc, da, db, kk > 0);
            }
        };
        // O += P V: k-step kk reads keys [16kk, 16kk + 16) = two 8-row atoms (2048 bytes); the DV columns span the
        // DV / 64 slabs, LBO apart. FP8: the tile is V transposed (DV rows of the tile's keys, K-major): k-step kk
        // reads 32 bytes (keys) of every row of its slab. O's reset (kFreshO: see o above).
        bool o_fresh = false;
        auto reset_o = [&]() {
            if constexpr (kFreshO) o_fresh = true;
            else zero_o();
        };
        auto issue_pv = [&](int s) {
            const SmemDesc vd = v_desc.moved(s * L::kVBytes).uniform();
#pragma unroll
            for (int kk = 0; kk < BN / kKP; ++kk) {
                const int acc = kk > 0 || !o_fresh;
                if constexpr (kFp8)
                    wgmma_rs_e4m3<DV>(o, pf[kk], vd.at(kstep_offset(kk, L::kVtSlab, L::kVtKeys / 32)), acc);
                else wgmma_rs<DV, T>(o, pf[kk], vd.at(kk * 2048), acc);
            }
            o_fresh = false;
        };
        auto release = [&](uint32_t bar) {
            if (lane == 0) mbar_arrive(bar);
        };
        // O is rescaled only where a row's reference moved (corr is 1 otherwise). 16-bit at DV 256: the reference
        // moves only when a tile's max passes it by more than kLazyRescale (online_softmax's lazy), after the first
        // tiles rarely; at DV 64 and 128 the branch costs more than the rescales it saves, and the max is exact. FP8
        // (P in e4m3 times 2^8, no headroom): at DV <= 128 where the exact max moved; at DV 256 every tile (the
        // branch costs more there).
        constexpr float kLazy = !kFp8 && DV == 256 ? kLazyRescale : 0.f;
        constexpr bool kSkipRescale = kLazy > 0.f || (kFp8 && DV <= 128);
        auto rescale_o = [&](const float(&corr)[2]) {
            if (fixed_ref) return;
            if (!kSkipRescale || corr[0] != 1.f || corr[1] != 1.f) scale_rows(o, corr[0], corr[1]);
        };
        auto convert_p = [&]() {
            if constexpr (kFp8) to_e4m3_fragments(sacc, pf);
            else to_a_fragments<T>(sacc, pf);
        };
        // O += P V of the tile in stage st (phase ph_v) with no QK^T beside it, landed, and its V stage released
        auto pv_alone = [&](int st, uint32_t ph_v) {
            mbar_wait(full_v(st), ph_v);
            fence_regs(o);
            fence_regs(pf);
            wgmma_fence();
            issue_pv(st);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(o);
            fence_regs(pf);
            release(empty_v(st));
        };

        // An item's scales (FP8: S comes in units of q_descale x k_descale, O in units of v_descale): softcap's
        // (S becomes tanh(S * cap_in), and cap_out joins the exp2-domain scale), the exp2-domain scale sl2, the
        // softmax's sc (masked kernels keep the scores in the exp2 domain, scaled and mask added: 1) and O's dv.
        struct Scales {
            float cap_in, sl2, sc, dv;
        };
        auto scales_of = [&](const Item& it) {
            float qk = 1.f, dv = 1.f;
            if constexpr (kFp8) {
                const int64_t at = int64_t(it.h / p.group) * p.descale_sh;
                qk = (p.q_descale != nullptr ? p.q_descale[at] : 1.f) *
                     (p.k_descale != nullptr ? p.k_descale[at] : 1.f);
                dv = p.v_descale != nullptr ? p.v_descale[at] : 1.f;
            }
            const float sl2 = capped ? p.sl2 * p.cap_out : p.sl2 * qk;
            return Scales{p.cap_in * qk, sl2, kMasked ? 1.f : sl2, dv};
        };
        // ---- an item's epilogue: normalise O (row references m, this thread's sums l), stage it in this warpgroup's
        // rows of sO, or of sQ (every wgmma that read them has completed), then store the rows below Sq (kStoreO:
        // TMA, issued by the warpgroup's thread 0, whose bulk group is waited on before the tile is written again);
        // LSE (natural log) from the quad's lane 0.
        auto finish = [&](const Item& it, const Scales& x, float(&m)[2], float(&l)[2]) {
            if (o_fresh) zero_o();  // no key tile: O is zero
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
                l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
            }
            // the attention sink (exp2 domain) joins each row's denominator
            const float s2 = p.sinks != nullptr ? p.sinks[it.h] * kLog2e : -INFINITY;
            const float2 fin0 = finish_row(m[0] * x.sc - pb, l[0], s2);
            const float2 fin1 = finish_row(m[1] * x.sc - pb, l[1], s2);
            const float inv0 = fin0.x * x.dv, inv1 = fin1.x * x.dv;
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            // O is staged in its own tile (FP8: always, a 16-bit O being wider than the Q tile) or in the
            // warpgroup's rows of the Q tile
            if (persistent) {  // the previous item's O tile has been read (by TMA, by the warpgroup)
                if (kStoreO && tid == 0) bulk_wait_read<0>();
                bar_sync(3 + c, 128);
            }
            const uint32_t o_wg = kOwnO ? sO + 64 * c * 128 : q_wg;
            constexpr uint32_t kOSlab = L::kQSlab;  // bytes between O's 64-column slabs (128 rows of 128 bytes)
#pragma unroll
            for (int j = 0; j < DV / 8; ++j) {
                // Element (rw, 8j + 2(l%4)): slab j / 8, 16-byte chunk j % 8 swizzled by the row; rows rw and rw + 8
                // share the swizzle phase (rw % 8).
                const uint32_t addr = o_wg + (j / 8) * kOSlab + swizzled(rw, j % 8) + (lane % 4) * 4;
                st_shared_u32(addr, pack2<To>(o[4 * j] * inv0, o[4 * j + 1] * inv0));
                st_shared_u32(addr + 8 * 128, pack2<To>(o[4 * j + 2] * inv1, o[4 * j + 3] * inv1));
            }
            if constexpr (kStoreO) fence_async_smem();  // this thread's writes, visible to TMA
            bar_sync(3 + c, 128);                          // the warpgroup's O tile is in shared memory
            if constexpr (kStoreO) {
                if (tid == 0) {  // a box a 64-column slab; rows past Sq are not written
#pragma unroll
                    for (int j = 0; j < DV / 64; ++j)
                        tma_store_5d(&tmo, o_wg + j * kOSlab, 0, it.m0 + 64 * c, j, it.h, it.b);
                    bulk_commit();
                }
            } else {  // the rows past Sq (varlen: the request's; other requests' rows) are not written
                To* out = static_cast<To*>(p.o) + (kVarlen ? int64_t(q0) * p.o_ss : it.b * p.o_sb) + it.h * p.o_sh;
                constexpr int kChunks = DV / 8;  // 16-byte chunks a row
#pragma unroll 4
                for (int idx = tid; idx < 64 * kChunks; idx += 128) {
                    const int r = idx / kChunks, ch = idx % kChunks;
                    const int row = it.m0 + 64 * c + r;
                    if (row < Sq) {
                        const uint4 v = ld_shared_v4(o_wg + (ch / 8) * kOSlab + swizzled(r, ch % 8));
                        *reinterpret_cast<uint4*>(out + int64_t(row) * p.o_ss + ch * 8) = v;
                    }
                }
            }
            const int row0 = it.m0 + 64 * c + rw, row1 = row0 + 8;
            if (p.lse != nullptr && lane % 4 == 0) {
                float* lse = p.lse;
                if constexpr (kVarlen) lse += int64_t(it.h) * p.batch.total_q + q0;  // (Hq, total_q)
                else lse += (int64_t(it.b) * p.Hq + it.h) * p.Sq;
                if (row0 < Sq) lse[row0] = fin0.y;
                if (row1 < Sq) lse[row1] = fin1.y;
            }
            if (persistent && !kOwnO) {  // O's reads from the Q tile are done: the next Q may come in
                fence_async_smem();  // (the generic reads ordered before TMA's writes)
                __syncwarp();
                release(empty_q);
            }
        };

        int s = 0;  // the ring's stage and phase, and Q's phase, carried from item to item
        uint32_t ph = 0, qph = 0;
        // Persistent with O in its own tile, an item's last P V and its epilogue are deferred into the next item's
        // first step (issued with its first QK^T, landed and written while its softmax runs), as the P V of a tile
        // is within an item: `pending` such an item, with its scales, row references and sums, and its last stage.
        const bool defer = kOverlap && kOwnO && persistent;
        bool pending = false;
        Item prev{};
        Scales prev_x{};
        float m_prev[2] = {0.f, 0.f}, l_prev[2] = {0.f, 0.f};
        int s_prev = 0;
        uint32_t ph_prev = 0;
        auto finish_pending = [&]() {  // its last P V alone, then its epilogue (no item to share a step with)
            pv_alone(s_prev, ph_prev);
            finish(prev, prev_x, m_prev, l_prev);
            pending = false;
        };
        // Ping-pong (kPingPong): warpgroup c waits on barrier 1 + c before issuing a step's GEMMs and arrives on the
        // other's after. Warpgroup 0 goes first (its own arrival) and takes warpgroup 1's last arrival at the end, so
        // that both barriers end balanced whatever the steps.
        if (kPingPong && c == 0) bar_arrive(1, 256);
        for (int r = 0;; ++r) {
            Item it;
            const int got = item_of(r, it);
            if (got < 0) break;
            if (got == 0) continue;
            const int m0 = it.m0, m_valid = it.m_valid, top = it.top, n_tiles = it.top - it.lo;
            const int row0 = m0 + 64 * c + rw, row1 = row0 + 8;
            const Scales x = scales_of(it);
            if (pending && n_tiles == 0) finish_pending();
            if (!pending) reset_o();
            m_r[0] = m_r[1] = m_fix;
            l_r[0] = l_r[1] = 0.f;
            auto needs_mask = [&](int n0) {
                return n0 + BN > Sk || (win.right >= 0 && n0 + BN - 1 > m0 + shift + win.right) ||
                       (win.left >= 0 && n0 < m0 + m_valid - 1 + shift - win.left);
            };
            // keys [lo_r, lim_r) are visible to row r: the window's edges (causal: the diagonal) and the key tail
            const int lim0 = win.right >= 0 ? min(Sk, row0 + shift + win.right + 1) : Sk;
            const int lim1 = win.right >= 0 ? min(Sk, row1 + shift + win.right + 1) : Sk;
            const int lo0 = win.left >= 0 ? row0 + shift - win.left : 0;
            const int lo1 = win.left >= 0 ? row1 + shift - win.left : 0;
            // Add the user mask of stage st (masked kernels: every tile, scores then in the exp2 domain), mask the key
            // tail and the causal diagonal when `edge`, update the references and sums, leave P = exp2(S * sc - m * sc)
            // in sacc; corr: the factors that rescale what O holds.
            auto softmax = [&](int n0, bool edge, int st, float(&corr)[2]) {
                if (capped) {
#pragma unroll
                    for (int i = 0; i < BN / 2; ++i) sacc[i] = tanh_approx(sacc[i] * x.cap_in);
                }
                if constexpr (kMasked) {
                    const unsigned char* ms = smem_m + st * L::kMaskStage;
#pragma unroll
                    for (int j = 0; j < BN / 8; ++j) {
                        const uint32_t box = (8 * j / L::kMaskCols) * L::kMaskBox;
                        const uint32_t col = ((8 * j) % L::kMaskCols + 2 * (lane % 4)) * L::kMaskEs;
                        const float2 v0 = mask_pair_of<M>(ms + box + mo0 + (col ^ mz0));
                        const float2 v1 = mask_pair_of<M>(ms + box + mo1 + (col ^ mz1));
                        sacc[4 * j] = fmaf(sacc[4 * j], x.sl2, v0.x);
                        sacc[4 * j + 1] = fmaf(sacc[4 * j + 1], x.sl2, v0.y);
                        sacc[4 * j + 2] = fmaf(sacc[4 * j + 2], x.sl2, v1.x);
                        sacc[4 * j + 3] = fmaf(sacc[4 * j + 3], x.sl2, v1.y);
                    }
                }
                if (edge) hide_keys(sacc, n0 + 2 * (lane % 4), lo0, lim0, lo1, lim1);
                online_softmax(sacc, m_r, l_r, x.sc, corr, pb, kLazy, fixed_ref);
            };
            // The softmax of the tile in stage st; its K tile (and mask tile) is released as soon as nothing reads it:
            // before the softmax, or after it when the softmax reads the stage's mask tile.
            auto softmax_of_stage = [&](int n0, int st, float(&corr)[2]) {
                if constexpr (kPaged) {
                    // the stage's bad pages (paged_producer), read before the stage is released (lane 0's read is
                    // ordered before its arrival), then their keys hidden
                    uint32_t bad = 0;
                    if (lane == 0) bad = ld_shared_u32(bars + 8u * L::kBarCount + 4u * st);
                    bad = __shfl_sync(0xffffffffu, bad, 0);
                    release(empty_k(st));
                    if (bad) hide_pages(sacc, 2 * (lane % 4), bad, paged_log2_bs(p.batch));
                    softmax(n0, needs_mask(n0), st, corr);
                } else {
                    if constexpr (!kMasked) release(empty_k(st));
                    softmax(n0, needs_mask(n0), st, corr);
                    if constexpr (kMasked) release(empty_k(st));
                }
            };
            if (persistent || n_tiles > 0) {  // persistent: every item's Q was loaded (the producer's handshake)
                mbar_wait(full_q, qph);
                qph ^= 1;
            }
            // Q has been read by the item's last QK^T: with O in its own tile, the next item's Q may come in
            auto q_done = [&](bool last) {
                if (kOwnO && persistent && last) release(empty_q);
            };
            if (n_tiles > 0) {
                float corr[2];
                if constexpr (!kOverlap) {
                    // Plain: QK^T, wait, softmax, PV, wait — one tile at a time.
                    for (int i = 0; i < n_tiles; ++i) {
                        const int n0 = (top - 1 - i) * BN;
                        mbar_wait(full_k(s), ph);
                        wgmma_fence();
                        issue_qk(s);
                        wgmma_commit();
                        wgmma_wait<0>();
                        q_done(i == n_tiles - 1);
                        fence_regs(sacc);
                        softmax_of_stage(n0, s, corr);
                        rescale_o(corr);
                        convert_p();
                        pv_alone(s, ph);
                        ring_next<kStages>(s, ph);
                    }
                } else {
                    // Overlapped: step i issues QK^T of tile i and PV of tile i - 1 together (in the warpgroup's
                    // ping-pong turn), then runs the softmax of tile i while PV is still in flight; O is rescaled
                    // once PV has landed. The first tile's step takes the pending item's last PV (that item's O then
                    // written, and O zeroed), or runs QK^T alone. step: the tile in stage sk (its K landed; its first
                    // key n0, `last` the item's last tile) and the PV of the one in stage sv.
                    auto step = [&](int sk, int sv, uint32_t phv, int n0, bool last) {
                        mbar_wait(full_v(sv), phv);  // loaded before K: no branch between the two issues
                        if (kPingPong) bar_sync(1 + c, 256);
                        fence_regs(sacc);
                        fence_regs(o);
                        fence_regs(pf);
                        wgmma_fence();
                        issue_qk(sk);
                        wgmma_commit();
                        issue_pv(sv);
                        wgmma_commit();
                        if (kPingPong) bar_arrive(2 - c, 256);
                        wgmma_wait<1>();  // QK^T has landed
                        q_done(last);
                        fence_regs(sacc);
                        softmax_of_stage(n0, sk, corr);
                        wgmma_wait<0>();  // PV has landed
                        fence_regs(o);
                        fence_regs(pf);
                        release(empty_v(sv));
                    };
                    int n0 = (top - 1) * BN;
                    mbar_wait(full_k(s), ph);
                    if (pending) {
                        step(s, s_prev, ph_prev, n0, n_tiles == 1);
                        finish(prev, prev_x, m_prev, l_prev);
                        pending = false;
                        reset_o();
                    } else {
                        wgmma_fence();
                        issue_qk(s);
                        wgmma_commit();
                        wgmma_wait<0>();
                        q_done(n_tiles == 1);
                        fence_regs(sacc);
                        softmax_of_stage(n0, s, corr);  // O is still zero: nothing to rescale
                    }
                    convert_p();
                    for (int i = 1; i < n_tiles; ++i) {
                        const int sv = s;  // the stage of tile i - 1, whose V this step multiplies
                        const uint32_t phv = ph;
                        ring_next<kStages>(s, ph);
                        n0 -= BN;
                        mbar_wait(full_k(s), ph);
                        step(s, sv, phv, n0, i == n_tiles - 1);
                        rescale_o(corr);
                        convert_p();
                    }
                    if (defer) {  // the last PV and the epilogue go with the next item's first step
                        pending = true;
                        prev = it;
                        prev_x = x;
                        m_prev[0] = m_r[0];
                        m_prev[1] = m_r[1];
                        l_prev[0] = l_r[0];
                        l_prev[1] = l_r[1];
                        s_prev = s;
                        ph_prev = ph;
                    } else {
                        pv_alone(s, ph);
                    }
                    ring_next<kStages>(s, ph);  // the next item's first tile
                }
            }
            if (n_tiles == 0) q_done(true);
            if (!pending) finish(it, x, m_r, l_r);
        }
        if (pending) finish_pending();
        if (kPingPong && c == 0) bar_sync(1, 256);
        if (kStoreO && tid == 0) bulk_wait_read<0>();  // the last O tile read before the CTA's shared memory goes
    }
#else
    // Compiled for a target other than sm_90a (the Makefile never does): a stub that must not run. The launcher
    // checks the device, and attn_lt_flash_sm90_supported() tells the stub (a few registers) from the real kernel
    // (launched with 168 registers a thread for setmaxnreg to redistribute).
    __trap();
#endif
}

// ---- MLA decode: q/k head dim 576, v the first 512 columns of k (the latent cache), one query a head -------------
//
// DeepSeek-style decode reads one latent cache per kv head (usually one) for every query head. A CTA owns 64 query
// heads of one kv head (the rows of its tiles; Sq = 1) and one part of the key range (flash-decoding: the parts'
// normalised FP32 partials and LSEs are joined by merge_partials, as native/flash.cu's splits are). Its K tile of
// 64 keys x 576 columns (72 KB) is also its V tile: V's 512 columns are the first 8 of its 9 slabs. The O
// accumulator (64 x 512 FP32) is split by columns between the two consumer warpgroups:
//   * warpgroup 1 computes S = Q K^T (m64 n64, 36 k-steps, both operands in shared memory), the online softmax,
//     writes P (bf16/fp16) and each row's rescale factor to shared memory for warpgroup 2, then O[:, :256] += P V
//     with P from its registers;
//   * warpgroup 2 waits for P (mbarrier p_full), rescales, and O[:, 256:] += P V with P from shared memory; it
//     gives P back (mbarrier p_empty) once its GEMM has landed, so warpgroup 1's next QK^T and softmax overlap it.
//     (Each barrier completes one phase a tile, every thread of the warpgroup arriving: release and acquire order
//     the P and factor stores, as compute-sanitizer's racecheck can follow.)
// A K stage is released when both warpgroups' P V have landed. The producer warpgroup streams Q once and the K
// tiles of the CTA's key range through a 2-stage ring (TMA, one mbarrier a stage). Rows past the kv head's query
// heads are computed (the next kv head's queries, or TMA's zeros past the last head) and not written.
//
// Shared memory: sQ [9 slabs][64 rows][64] (72 KB), sK[2] [9 slabs][64 keys][64] (144 KB), sP [64 rows][64 keys]
// (8 KB), each row's rescale factor and final sum (512 B), mbarriers: 226 KB of the 227 KB a block may take.
//
// An FP8 latent cache (kF8: e4m3 elements, a descale factor a kv head) is read at half the bytes: TMA lands a K
// tile's e4m3 bytes in its stage, each slab's 64 columns dense in the second half of the slab, where the producer
// warpgroup's 128 threads widen them to the fp16 tile above (widen_e4m3_tile) before they release it to the
// consumers. The MMAs then run in fp16 with FP32 sums: Q is rounded to fp16 in place (stage_q_mla_f16, divided
// by a power of two that keeps it in fp16's range), the scale takes that power of two and k's factor, O v's factor.
constexpr int kMlaD = 576, kMlaDv = 512, kMlaRows = 64, kMlaKeys = 64, kMlaStages = 2;
constexpr int kMlaGroups = kMlaDv / 2 / 8;  // 8-column groups of a warpgroup's 256 columns of O

struct MlaLayout {
    static constexpr uint32_t kSlab = 64 * 128;  // 64 rows of 64 elements (128 bytes)
    static constexpr uint32_t kQBytes = (kMlaD / 64) * kSlab, kKBytes = (kMlaD / 64) * kSlab;
    static constexpr uint32_t kK = kQBytes, kP = kK + kMlaStages * kKBytes, kStat = kP + kSlab;
    static constexpr uint32_t kBars = kStat + 2 * kMlaRows * 4;  // rescale factors, then final sums
    static constexpr int kSlabs = kMlaD / 64;
    static constexpr uint32_t kBarCount = 3 + (2 + kSlabs) * kMlaStages;  // FP8: a slab's e4m3 bytes landed (raw_k)
    static constexpr uint32_t kBad = kBars + 8 * kBarCount;  // the paged mode: a bad word a stage
    static constexpr size_t kSmem = kBad + 4 * kMlaStages + 1024;
    static_assert(kSmem <= 227 * 1024, "shared memory over the sm_90 limit");
};

struct MlaParams : BaseParams, PartParams {  // Sq 1
    int row_blocks;
    const float* k_descale;  // an FP8 cache's factors (attn_lt_flash_args), read with kF8 only
    const float* v_descale;
    int64_t descale_sh;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// An e4m3 K tile as TMA lands it in a stage (make_e4m3_row_map): slab j's bytes, [64 keys][64 bytes] dense, in the
// second half of the slab's 8 KB, widened over the whole slab to the fp16 tile the wgmma reads (slab j [64 keys][64
// columns] in the 128-byte swizzle) by the 128 threads of the producer warpgroup (t: 0-127), each slab once
// landed(j) has returned. A thread reads 16-byte chunks t and t + 128 (chunk e: key e / 4, columns 16 (e % 4)..;
// a quarter-warp 128 contiguous bytes), the warpgroup syncs (keys 32-63's fp16 rows cover the e4m3 bytes), then the
// thread writes those chunks' 32 fp16 values (a quarter-warp's first stores: two keys, even chunks of one and odd
// of the other in the swizzle, disjoint banks).
constexpr int kMlaWidenBar = 4;  // the producer warpgroup's named barrier (the consumers take 1 and 3)
template <typename Landed>
__device__ __forceinline__ void widen_e4m3_tile(uint32_t stage, int t, Landed&& landed) {
    using L = MlaLayout;
#pragma unroll 1
    for (int j = 0; j < L::kSlabs; ++j) {
        landed(j);
        const uint32_t slab = stage + j * L::kSlab;
        uint4 x[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) x[u] = ld_shared_v4(slab + L::kSlab / 2 + 16 * (t + 128 * u));
        bar_sync(kMlaWidenBar, 128);
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int e = t + 128 * u, key = e / 4, c = e % 4, sw = key % 8;
            uint4 lo, hi;
            f16x2x2_of_e4m3x4(x[u].x, lo.x, lo.y);
            f16x2x2_of_e4m3x4(x[u].y, lo.z, lo.w);
            f16x2x2_of_e4m3x4(x[u].z, hi.x, hi.y);
            f16x2x2_of_e4m3x4(x[u].w, hi.z, hi.w);
            st_shared_v4(slab + key * 128 + (((2 * c) ^ sw) << 4), lo);
            st_shared_v4(slab + key * 128 + (((2 * c + 1) ^ sw) << 4), hi);
        }
    }
}

// Q's tile (9 slabs of [64 rows][64] T in the 128-byte swizzle at sQ) rounded in place to fp16 for an FP8 cache's
// fp16 MMAs, divided by 2^e (f16_headroom_exp of the largest element of rows [0, rows_valid)); returns 2^e. The 256
// threads of both consumer warpgroups call it (t: 0-255) once Q has landed; red: 8 floats of shared memory.
template <typename T>
__device__ __forceinline__ float stage_q_mla_f16(uint32_t sQ, int rows_valid, int t, float* red) {
    constexpr int kEach = MlaLayout::kQBytes / 16 / 256;  // 16-byte chunks a thread; chunk e: row (e % 512) / 8
    float amax = 0.f;
#pragma unroll 2
    for (int u = 0; u < kEach; ++u) {
        const int e = t + 256 * u;
        if ((e % 512) / 8 >= rows_valid) continue;
        const uint4 raw = ld_shared_v4(sQ + 16 * e);
        const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(static_cast<float>(x[j])));
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    if (t % 32 == 0) red[t / 32] = amax;
    bar_sync(3, 256);
#pragma unroll
    for (int w = 0; w < 8; ++w) amax = fmaxf(amax, red[w]);
    const int ex = f16_headroom_exp(amax);
    const float mul = __int_as_float((127 - ex) << 23);
#pragma unroll 2
    for (int u = 0; u < kEach; ++u) {
        const uint32_t addr = sQ + 16 * (t + 256 * u);
        const uint4 raw = ld_shared_v4(addr);
        const T* x = reinterpret_cast<const T*>(&raw);
        uint4 h;
        uint32_t* hw = &h.x;
#pragma unroll
        for (int j = 0; j < 4; ++j)
            hw[j] = pack2<__half>(static_cast<float>(x[2 * j]) * mul, static_cast<float>(x[2 * j + 1]) * mul);
        st_shared_v4(addr, h);
    }
    fence_async_smem();  // the fp16 Q visible to the wgmma proxy
    bar_sync(3, 256);
    return __int_as_float((127 + ex) << 23);
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The paged mode (a serving batch, attn_lt_flash_sm90_batch): p.Sk is the key capacity that sized the grid, each
// request's keys come from batch_request, its rows from its block table.
struct MlaPagedParams : MlaParams {
    attn_lt_batch_args batch;
};
template <bool kPaged>
using MlaFwdParams = std::conditional_t<kPaged, MlaPagedParams, MlaParams>;

// Grid: (row blocks x parts, Hkv, B); block: 384 threads; dynamic shared memory MlaLayout::kSmem.
// kPaged: block z is request z of a paged batch (one query row a request: row q0 of q and o, or none): its keys in parts of
// p.tiles_per_part tiles (the parts past the request's last key exit at once), each K tile one block's 64 rows
// (block size >= 64), looked up a tile ahead by the producer. A request of one part writes its output; one of more
// writes partials that merge_partials joins (MlaBatch). A block id outside the cache is read as block 0 and its keys
// hidden (the stage's bad word); the V rows of hidden keys (the request's tail in its last block, a bad block) are
// zeroed in shared memory before P V, so that whatever the cache holds there (unwritten slots) cannot reach O.
// kF8: the cache holds e4m3 elements (tmk a byte map, make_e4m3_row_map); see "An FP8 latent cache" above.
template <typename T, bool kPaged = false, bool kF8 = false>
__global__ void __launch_bounds__(kThreads, 1)
    mla_decode_sm90(const __grid_constant__ CUtensorMap tmq, const __grid_constant__ CUtensorMap tmk,
                    const MlaFwdParams<kPaged> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = MlaLayout;
    using TW = std::conditional_t<kF8, __half, T>;  // the MMAs' operands
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sQ = base, sK = base + L::kK, sP = base + L::kP, bars = base + L::kBars;
    float* corr_s = reinterpret_cast<float*>(smem_raw + (base + L::kStat - smem_u32(smem_raw)));
    float* sum_s = corr_s + kMlaRows;
    const uint32_t full_q = bars;
    auto full_k = [&](int s) { return bars + 8u * (1 + s); };
    auto empty_k = [&](int s) { return bars + 8u * (1 + kMlaStages + s); };
    const uint32_t p_full = bars + 8u * (1 + 2 * kMlaStages), p_empty = p_full + 8u;
    auto raw_k = [&](int s, int j) { return bars + 8u * (3 + 2 * kMlaStages + L::kSlabs * s + j); };  // FP8

    const int rb = blockIdx.x % p.row_blocks, part = blockIdx.x / p.row_blocks;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int rows_valid = min(kMlaRows, p.group - rb * kMlaRows);
    const int h0 = hk * p.group + rb * kMlaRows;  // the block's first query head
    int Sk = p.Sk, q_row = b, rows = 1;  // the keys; q's batch entry (paged: the request's row) and its rows (0 or 1)
    if constexpr (kPaged) {
        const BatchRequest r = batch_request(p.batch, b, threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0);
        Sk = r.nk;
        q_row = r.q0;
        rows = r.nq;
    }
    const int all_tiles = (Sk + kMlaKeys - 1) / kMlaKeys;
    // the request's parts (paged: batch_parts, tiles_per_part tiles each; 0 without keys); one part writes the output
    int req_parts = p.parts;
    if constexpr (kPaged) req_parts = batch_parts(Sk, p.batch.split_keys);
    const bool direct = kPaged ? req_parts <= 1 : p.parts == 1;
    if (kPaged && (part >= max(req_parts, 1) || rows == 0)) return;  // the whole CTA, before any barrier
    const int t0 = part * p.tiles_per_part;
    const int n_tiles = max(0, min(all_tiles, t0 + p.tiles_per_part) - t0);

    if (threadIdx.x == 0) {
        mbar_init(full_q, 1);
        for (int s = 0; s < kMlaStages; ++s) {
            mbar_init(full_k(s), kF8 ? 128 : 1);  // FP8: every producer thread, its part of the tile widened
            mbar_init(empty_k(s), 8);              // one arrival per consumer warp of both warpgroups
            for (int j = 0; kF8 && j < L::kSlabs; ++j) mbar_init(raw_k(s, j), 1);
        }
        mbar_init(p_full, 128);  // every thread of warpgroup 1 (P and factors written)
        mbar_init(p_empty, 128);  // every thread of warpgroup 2 (P read)
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    // The merge of the parts (a dependent grid, see merge in common.cuh) launches once every CTA got here, onto the
    // SMs this grid leaves idle and then the ones it frees; it waits in griddepcontrol.wait for this grid's writes.
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        setmaxnreg_dec<kBusyProducerRegs<kF8>>();
        // thread 0 loads Q once and a K tile a stage (FP8: a box a slab); with FP8 every thread then widens each
        // slab as it lands and arrives on full_k
        if (n_tiles == 0 || (!kF8 && threadIdx.x != 0)) return;
        const bool issuer = threadIdx.x == 0;
        auto load_k = [&](int s, int row, int blk) {  // K tile rows row.. of kv head hk, batch entry (block) blk
            const uint32_t dst = sK + s * L::kKBytes;
            if constexpr (kF8) {  // a slab a box and barrier, in the slab's second half, widened as it lands
#pragma unroll 1
                for (int j = 0; j < L::kSlabs; ++j) {
                    mbar_expect_tx(raw_k(s, j), L::kSlab / 2);
                    tma_load_4d(dst + j * L::kSlab + L::kSlab / 2, &tmk, raw_k(s, j), 64 * j, row, hk, blk);
                }
            } else {
                mbar_expect_tx(full_k(s), L::kKBytes);
                tma_load_5d(dst, &tmk, full_k(s), 0, row, 0, hk, blk);
            }
        };
        if (issuer) {
            prefetch_map(&tmq);
            prefetch_map(&tmk);
            mbar_expect_tx(full_q, L::kQBytes);
            tma_load_5d(sQ, &tmq, full_q, 0, h0, 0, 0, q_row);
        }
        int s = 0;
        uint32_t ph = 0;
        // tile i's key block (paged: block_table[b][key / bs], key = (t0 + i) * 64, looked up a tile ahead)
        int next = 0;
        const int32_t* table = nullptr;
        int log2_bs = 0;
        if constexpr (kPaged) {
            log2_bs = paged_log2_bs(p.batch);
            table = p.batch.block_table + b * p.batch.bt_stride;
        }
        auto lookup = [&](int i) {
            return kPaged && issuer && i < n_tiles ? __ldg(table + (((t0 + i) * kMlaKeys) >> log2_bs)) : 0;
        };
        next = lookup(0);
        for (int i = 0; i < n_tiles; ++i) {
            if (issuer) {
                if constexpr (kPaged) {  // rows key % bs.. of the block
                    const attn_lt_batch_args& a = p.batch;
                    const int id = next;
                    next = lookup(i + 1);  // in flight during this tile's wait and copy
                    const bool bad = !paged_id_ok(a, id);
                    mbar_wait(empty_k(s), ph ^ 1);
                    if (bad) atomicOr(a.error, ATTN_LT_BATCH_BAD_BLOCK);
                    st_shared_u32(base + L::kBad + 4u * s, bad ? 1u : 0u);  // before the arrival that releases it
                    load_k(s, ((t0 + i) * kMlaKeys) & ((1 << log2_bs) - 1), bad ? 0 : id);
                } else {
                    mbar_wait(empty_k(s), ph ^ 1);
                    load_k(s, (t0 + i) * kMlaKeys, b);
                }
            }
            if constexpr (kF8) {
                widen_e4m3_tile(sK + s * L::kKBytes, threadIdx.x, [&](int j) { mbar_wait(raw_k(s, j), ph); });
                fence_async_smem();  // the fp16 tile visible to the wgmma proxy
                mbar_arrive(full_k(s));
            }
            ring_next<kMlaStages>(s, ph);
        }
        return;
    }
    setmaxnreg_inc<kBusyConsumerRegs<kF8>>();
    const int c = wg - 1;
    const int tid = threadIdx.x - 128 * wg;
    const int warp = tid / 32, lane = tid % 32;
    const int rw = 16 * warp + lane / 4;  // rows rw (d[4j + 0..1]) and rw + 8 (d[4j + 2..3])
    float o[kMlaDv / 4];                   // this warpgroup's 256 columns of O, m64 x 256 fragment
#pragma unroll
    for (int i = 0; i < kMlaDv / 4; ++i) o[i] = 0.f;
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};
    auto release = [&](uint32_t bar) {
        if (lane == 0) mbar_arrive(bar);
    };
    float sl2 = p.sl2, vd = 1.f;  // the scores' scale (exp2 domain), O's factor
    if (n_tiles > 0) {
        if constexpr (kF8) {
            mbar_wait(full_q, 0);
            const int hd = hk * static_cast<int>(p.descale_sh);
            sl2 *= stage_q_mla_f16<T>(sQ, rows_valid, threadIdx.x - 128, sum_s) *
                   (p.k_descale != nullptr ? p.k_descale[hd] : 1.f);
            if (p.v_descale != nullptr) vd = p.v_descale[hd];
        }
        int s = 0;
        uint32_t ph = 0;
        if (c == 0) {
            float sacc[kMlaKeys / 2];
            uint32_t pf[kMlaKeys / 16][4];
#pragma unroll
            for (int i = 0; i < kMlaKeys / 2; ++i) sacc[i] = 0.f;
            mbar_wait(full_q, 0);
            for (int i = 0; i < n_tiles; ++i) {
                const int n0 = (t0 + i) * kMlaKeys;
                const uint32_t kb = sK + s * L::kKBytes;
                mbar_wait(full_k(s), ph);
                wgmma_fence();
                const SmemDesc qd = smem_desc(sQ, 16).uniform(), kd = smem_desc(kb, 16).uniform();
#pragma unroll
                for (int kk = 0; kk < kMlaD / 16; ++kk)
                    wgmma_ss<kMlaKeys, TW>(sacc, qd.at(kstep_offset(kk, L::kSlab)), kd.at(kstep_offset(kk, L::kSlab)),
                                          kk > 0);
                wgmma_commit();
                wgmma_wait<0>();
                fence_regs(sacc);
                const bool tail = n0 + kMlaKeys > Sk;
                bool bad = false;
                if constexpr (kPaged) bad = ld_shared_u32(base + L::kBad + 4u * s) != 0;
                if (bad) {
#pragma unroll
                    for (int j = 0; j < kMlaKeys / 2; ++j) sacc[j] = -INFINITY;
                } else if (tail) {  // the key tail (dense: TMA gave zeros past the last key)
                    hide_keys(sacc, n0 + 2 * (lane % 4), 0, Sk, 0, Sk);
                }
                if (kPaged && (bad || tail)) {  // the hidden keys' V rows to zeros: [first, 64) of slabs 0-7
                    const int first = bad ? 0 : Sk - n0;
                    bar_sync(1, 128);  // every warp's S wgmma has read the tile
                    for (int e = tid; e < (kMlaKeys - first) * (kMlaDv / 8); e += 128) {
                        const int row = first + e / (kMlaDv / 8), col = e % (kMlaDv / 8);  // 16-byte chunks
                        asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(
                                         kb + (col / 8) * L::kSlab + row * 128 + (col % 8) * 16),
                                     "r"(0u)
                                     : "memory");
                    }
                    fence_async_smem();
                    bar_sync(1, 128);  // zeros visible to this warpgroup's P V (warpgroup 2's: through p_full)
                }
                float corr[2];
                online_softmax(sacc, m_r, l_r, sl2, corr);
                to_a_fragments<TW>(sacc, pf);
                if (i > 0) mbar_wait(p_empty, (i - 1) & 1);  // warpgroup 2 has multiplied the previous P
                // P to shared memory in the 128-byte swizzle (the A operand of warpgroup 2's wgmma): element
                // (r, 8j + 2(l%4)) at r * 128 + ((j ^ r % 8) << 4) + (l%4) * 4; rows rw and rw + 8 share r % 8.
#pragma unroll
                for (int j = 0; j < kMlaKeys / 8; ++j) {
                    const uint32_t addr = sP + swizzled(rw, j) + (lane % 4) * 4;
                    st_shared_u32(addr, pf[j / 2][(j % 2) * 2]);
                    st_shared_u32(addr + 8 * 128, pf[j / 2][(j % 2) * 2 + 1]);
                }
                if (lane % 4 == 0) {
                    corr_s[rw] = corr[0];
                    corr_s[rw + 8] = corr[1];
                }
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // P visible to the wgmma proxy
                mbar_arrive(p_full);
                scale_rows(o, corr[0], corr[1]);
                fence_regs(o);
                fence_regs(pf);
                wgmma_fence();
                const SmemDesc vd = smem_desc(kb, L::kSlab).uniform();
#pragma unroll
                for (int kk = 0; kk < kMlaKeys / 16; ++kk) wgmma_rs<256, TW>(o, pf[kk], vd.at(kk * 2048));
                wgmma_commit();
                wgmma_wait<0>();
                fence_regs(o);
                fence_regs(pf);
                release(empty_k(s));
                ring_next<kMlaStages>(s, ph);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
                l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
            }
            mbar_wait(p_empty, (n_tiles - 1) & 1);  // warpgroup 2's last P V has landed
            if (lane % 4 == 0) {
                sum_s[rw] = l_r[0];
                sum_s[rw + 8] = l_r[1];
            }
            mbar_arrive(p_full);
        } else {
            for (int i = 0; i < n_tiles; ++i) {
                const uint32_t kb = sK + s * L::kKBytes;
                mbar_wait(full_k(s), ph);
                mbar_wait(p_full, i & 1);  // P and the factors of this tile are in shared memory
                scale_rows(o, corr_s[rw], corr_s[rw + 8]);
                fence_regs(o);
                wgmma_fence();
                const SmemDesc pd = smem_desc(sP, 16).uniform(), vd = smem_desc(kb + 4 * L::kSlab, L::kSlab).uniform();
#pragma unroll
                for (int kk = 0; kk < kMlaKeys / 16; ++kk) wgmma_ss_vt256<TW>(o, pd.at(kk * 32), vd.at(kk * 2048));
                wgmma_commit();
                wgmma_wait<0>();
                fence_regs(o);
                mbar_arrive(p_empty);
                release(empty_k(s));
                ring_next<kMlaStages>(s, ph);
            }
            mbar_wait(p_full, n_tiles & 1);
            l_r[0] = sum_s[rw];
            l_r[1] = sum_s[rw + 8];
        }
    }
    // ---- epilogue: this warpgroup's 256 columns of the rows below the kv head's last query head
    const float inv0 = l_r[0] > 0.f ? vd / l_r[0] : 0.f, inv1 = l_r[1] > 0.f ? vd / l_r[1] : 0.f;
    const int64_t rows_out = int64_t(gridDim.z) * p.Hq;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = rw + 8 * half;
        if (r >= rows_valid) continue;
        const float inv = half ? inv1 : inv0;
        const int64_t orow = int64_t(b) * p.Hq + h0 + r;
        if (direct) {
            T* out = static_cast<T*>(p.o) + q_row * p.o_sb + (h0 + r) * p.o_sh + 256 * c + 2 * (lane % 4);
#pragma unroll
            for (int j = 0; j < kMlaGroups; ++j)
                *reinterpret_cast<uint32_t*>(out + 8 * j) =
                    pack2<T>(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
        } else {
            float* op = p.o_part + (part * rows_out + orow) * kMlaDv + 256 * c + 2 * (lane % 4);
#pragma unroll
            for (int j = 0; j < kMlaGroups; ++j)
                *reinterpret_cast<float2*>(op + 8 * j) =
                    make_float2(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
        }
        if (c == 0 && lane % 4 == 0) {
            const float l = half ? l_r[1] : l_r[0], m = half ? m_r[1] : m_r[0];
            const float lse = l > 0.f ? (m * sl2 + log2f(l)) * kLn2 : -INFINITY;
            if (!direct) {
                p.lse_part[part * rows_out + orow] = lse;
            } else if (p.lse != nullptr) {
                if constexpr (kPaged) p.lse[(h0 + r) * p.batch.total_q + q_row] = lse;  // (Hq, total_q)
                else p.lse[orow] = lse;
            }
        }
    }
#else
    __trap();  // compiled for a target other than sm_90a: never launched (see flash_sm90_fwd)
#endif
}

// ---- decode with several query rows a kv head (GQA heads x query positions), head dims 64 and 128 ---------------
//
// native/flash.cu's decode blocks run at most 64 rows a kv head on mma.sync: with 64 rows (Sq 16 x 4 heads a kv
// head, say) each key costs 64 rows x D x 4 FLOP against its 4D bytes of K and V, and the mma.sync kernel reads the
// cache at 60-72 % (D 128) and 49 % (D 64) of the H200's copy rate. Here a CTA owns 64 rows — positions [0, sq_box) of g_box query heads
// of one kv head, sq_box the power of two >= Sq and g_box = 64 / sq_box — and one part of the key range
// (flash-decoding, the parts' partials joined by merge_partials as native/flash.cu's splits are):
//   * the producer warpgroup streams Q once (one TMA box over positions and heads, so the rows land as one 64-row
//     tile whatever q's head and row strides) and K and V tiles of 64 keys through a 6-stage ring;
//   * the two consumer warpgroups take the part's tiles in turn (even, odd), each with its own online softmax and
//     its own three stages of the ring (tile i in stage i % 6: an even ring, so that every phase of a stage's
//     barriers is waited by the one warpgroup that uses it — a wait tells phases apart by parity only):
//     S = Q K^T (wgmma, both operands in shared memory), softmax, O += P V (P from registers). One warpgroup's
//     softmax runs while the other's GEMMs do;
//   * at the end the second warpgroup hands its O, row max and row sum to the first through the (then idle) K ring,
//     and the first joins them by their maxima and writes the output (one part) or the part's FP32 partial and LSE.
// Rows past Sq (zeros from TMA), past the kv head's query heads (the next kv head's, or zeros) are computed and not
// written. Causal is bottom-right aligned: position i sees keys j <= i + Sk - Sq.
// A dense mask (bool or additive in q's dtype) that the block's heads share (broadcast over heads, or one head) is
// read by TMA with each K/V tile: its rows of the block's positions (at most kGqMaskRows; one when the positions
// share it too), 64 keys in the 128-byte (2-byte mask) or 64-byte (bool) swizzle, as the prefill kernel reads its
// mask tiles. Masked kernels keep the scores in the exp2 domain from the mask on (scale 1 in the softmax).
constexpr int kGqRows = 64, kGqKeys = 64, kGqStages = 6, kGqMaskRows = 16;
static_assert(kGqStages % 2 == 0, "each consumer warpgroup keeps its own stages");

template <int D, int MK>
struct GqLayout {
    static constexpr uint32_t kQSlab = kGqRows * 128, kKVSlab = kGqKeys * 128;  // bytes of one 64-column slab
    static constexpr uint32_t kQBytes = D / 64 * kQSlab, kKVBytes = D / 64 * kKVSlab;  // Q; a K (or V) tile
    static constexpr uint32_t kMaskEs = MK == kBoolMask ? 1 : 2, kMaskPitch = kGqKeys * kMaskEs;
    static constexpr uint32_t kMaskStage = MK == kNoMask ? 0 : kGqMaskRows * kMaskPitch;
    static constexpr uint32_t kK = kQBytes, kV = kK + kGqStages * kKVBytes, kM = kV + kGqStages * kKVBytes;
    static constexpr uint32_t kBars = kM + kGqStages * kMaskStage;
    static constexpr uint32_t kBarCount = 1 + 2 * kGqStages;
    static constexpr size_t kSmem = kBars + 8 * kBarCount + 1024;
    static_assert(kSmem <= 227 * 1024, "shared memory over the sm_90 limit");
    // the hand-over at the end: 64 FP32 of O and 4 statistics a thread of a warpgroup, in the K ring
    static_assert((D / 2 + 4) * 128 * 4 <= kGqStages * kKVBytes, "hand-over larger than the K ring");
};

struct GqParams : BaseParams, PartParams {
    int sq_box, g_box, row_blocks;
    int m_rows, m_b;  // mask rows a tile (the block's positions, or 1 when they share one); 1: a mask per batch entry
};

// Grid: (row blocks x parts, Hkv, B); block: 384 threads; dynamic shared memory GqLayout<D, MK>::kSmem. tmm, the
// mask's map, is read only when MK != kNoMask.
template <int D, typename T, int MK>
__global__ void __launch_bounds__(kThreads, 1)
    gqa_decode_sm90(const __grid_constant__ CUtensorMap tmq, const __grid_constant__ CUtensorMap tmk,
                    const __grid_constant__ CUtensorMap tmv, const __grid_constant__ CUtensorMap tmm,
                    const GqParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = GqLayout<D, MK>;
    constexpr bool kMasked = MK != kNoMask;
    using M = std::conditional_t<MK == kBoolMask, bool, T>;  // the mask's element type
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sQ = base, sK = base + L::kK, sV = base + L::kV, sM = base + L::kM, bars = base + L::kBars;
    const uint32_t full_q = bars;
    auto full_kv = [&](int s) { return bars + 8u * (1 + s); };
    auto empty_kv = [&](int s) { return bars + 8u * (1 + kGqStages + s); };

    const int rb = blockIdx.x % p.row_blocks, part = blockIdx.x / p.row_blocks;
    const int hk = blockIdx.y, b = blockIdx.z;
    const int g0 = rb * p.g_box;       // the block's first query head within the kv head's group
    const int h0 = hk * p.group + g0;  // and in q
    const int all_tiles = (p.Sk + kGqKeys - 1) / kGqKeys;
    const int t0 = part * p.tiles_per_part;
    const int n_tiles = max(0, min(all_tiles, t0 + p.tiles_per_part) - t0);

    if (threadIdx.x == 0) {
        mbar_init(full_q, 1);
        for (int s = 0; s < kGqStages; ++s) {
            mbar_init(full_kv(s), 1);   // the producer's expect-tx arrival; the K and V bytes complete the phase
            mbar_init(empty_kv(s), 4);  // one arrival per warp of the warpgroup that took the tile
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x == 0 && n_tiles > 0) {
            prefetch_map(&tmq);
            prefetch_map(&tmk);
            prefetch_map(&tmv);
            if constexpr (kMasked) prefetch_map(&tmm);
            mbar_expect_tx(full_q, L::kQBytes);
            tma_load_5d(sQ, &tmq, full_q, 0, 0, h0, 0, b);
            const uint32_t bytes = 2 * L::kKVBytes + (kMasked ? p.m_rows * L::kMaskPitch : 0);
            for (int i = 0; i < n_tiles; ++i) {
                const int s = i % kGqStages, n0 = (t0 + i) * kGqKeys;
                mbar_wait(empty_kv(s), ((i / kGqStages) & 1) ^ 1);
                mbar_expect_tx(full_kv(s), bytes);
                tma_load_5d(sK + s * L::kKVBytes, &tmk, full_kv(s), 0, n0, 0, hk, b);
                tma_load_5d(sV + s * L::kKVBytes, &tmv, full_kv(s), 0, n0, 0, hk, b);
                if constexpr (kMasked) tma_load_4d(sM + s * L::kMaskStage, &tmm, full_kv(s), n0, 0, 0, p.m_b ? b : 0);
            }
        }
        return;
    }
    setmaxnreg_inc<kConsumerRegs>();
    const int c = wg - 1;  // takes the part's tiles c, c + 2, ...
    const int tid = threadIdx.x - 128 * wg;
    const int warp = tid / 32, lane = tid % 32;
    const int rw = 16 * warp + lane / 4;  // rows rw (d[4j + 0..1]) and rw + 8 (d[4j + 2..3])
    const int pos0 = rw % p.sq_box, pos1 = (rw + 8) % p.sq_box;
    // keys at or past lim are hidden: the key tail, and with causal the keys after the row's position
    const int lim0 = p.causal ? min(p.Sk, p.Sk - p.Sq + pos0 + 1) : p.Sk;
    const int lim1 = p.causal ? min(p.Sk, p.Sk - p.Sq + pos1 + 1) : p.Sk;
    const int edge = p.causal ? p.Sk - p.Sq + 1 : p.Sk;  // tiles reaching past it need hide_keys
    // Masked: the scores go to the exp2 domain with the mask (sc = 1 from there on). This thread's mask rows (its
    // rows' positions, or row 0) as byte offsets in a stage and swizzle phases (as in flash_sm90_fwd)
    const float sc = kMasked ? 1.f : p.sl2;
    const int mr0 = p.m_rows == 1 ? 0 : pos0, mr1 = p.m_rows == 1 ? 0 : pos1;
    const auto swz = [](int R) { return uint32_t(L::kMaskPitch == 128 ? (R & 7) << 4 : ((R >> 1) & 3) << 4); };
    const uint32_t mo0 = mr0 * L::kMaskPitch, mo1 = mr1 * L::kMaskPitch, mz0 = swz(mr0), mz1 = swz(mr1);
    const unsigned char* smem_m = smem_raw + (sM - smem_u32(smem_raw));
    float o[D / 2];  // O, m64 x D fragment
    float sacc[kGqKeys / 2];  // S, m64 x 64; then P in FP32
    uint32_t pf[kGqKeys / 16][4];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};
    if (c < n_tiles) mbar_wait(full_q, 0);
    for (int i = c; i < n_tiles; i += 2) {
        const int s = i % kGqStages, n0 = (t0 + i) * kGqKeys;
        const uint32_t kb = sK + s * L::kKVBytes, vb = sV + s * L::kKVBytes;
        mbar_wait(full_kv(s), (i / kGqStages) & 1);
        wgmma_fence();
        const SmemDesc qd = smem_desc(sQ, 16).uniform(), kd = smem_desc(kb, 16).uniform();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_ss<kGqKeys, T>(sacc, qd.at(kstep_offset(kk, L::kQSlab)),
                                 kd.at(kstep_offset(kk, L::kKVSlab)), kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(sacc);
        if constexpr (kMasked) {
            const unsigned char* ms = smem_m + s * L::kMaskStage;
#pragma unroll
            for (int j = 0; j < kGqKeys / 8; ++j) {
                const uint32_t col = (8 * j + 2 * (lane % 4)) * L::kMaskEs;
                const float2 v0 = mask_pair_of<M>(ms + mo0 + (col ^ mz0));
                const float2 v1 = mask_pair_of<M>(ms + mo1 + (col ^ mz1));
                sacc[4 * j] = fmaf(sacc[4 * j], p.sl2, v0.x);
                sacc[4 * j + 1] = fmaf(sacc[4 * j + 1], p.sl2, v0.y);
                sacc[4 * j + 2] = fmaf(sacc[4 * j + 2], p.sl2, v1.x);
                sacc[4 * j + 3] = fmaf(sacc[4 * j + 3], p.sl2, v1.y);
            }
        }
        if (n0 + kGqKeys > edge) hide_keys(sacc, n0 + 2 * (lane % 4), 0, lim0, 0, lim1);
        float corr[2];
        online_softmax(sacc, m_r, l_r, sc, corr);
        to_a_fragments<T>(sacc, pf);
        scale_rows(o, corr[0], corr[1]);
        fence_regs(o);
        fence_regs(pf);
        wgmma_fence();
        const SmemDesc vd = smem_desc(vb, L::kKVSlab).uniform();
#pragma unroll
        for (int kk = 0; kk < kGqKeys / 16; ++kk) wgmma_rs<D, T>(o, pf[kk], vd.at(kk * 2048));
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(pf);
        if (lane == 0) mbar_arrive(empty_kv(s));
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 1);
        l_r[r] += __shfl_xor_sync(0xffffffffu, l_r[r], 2);
    }
    // ---- the hand-over: both warpgroups are done with the ring (every tile loaded was consumed), the second
    // writes its O and statistics there, thread for thread (the same fragment positions), the first joins them
    float* xo = reinterpret_cast<float*>(smem_raw + (sK - smem_u32(smem_raw)));
    float4* xs = reinterpret_cast<float4*>(xo + D / 2 * 128);
    bar_sync(1, 256);
    if (c == 1) {
#pragma unroll
        for (int i = 0; i < D / 2; ++i) xo[i * 128 + tid] = o[i];
        xs[tid] = make_float4(m_r[0], m_r[1], l_r[0], l_r[1]);
        bar_sync(2, 256);
        return;
    }
    bar_sync(2, 256);
    const float4 x = xs[tid];
    float f0[2], f1[2];
    {
        const float m1[2] = {x.x, x.y}, l1[2] = {x.z, x.w};
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float mm = fmaxf(m_r[r], m1[r]);
            f0[r] = m_r[r] == -INFINITY ? 0.f : ex2((m_r[r] - mm) * sc);
            f1[r] = m1[r] == -INFINITY ? 0.f : ex2((m1[r] - mm) * sc);
            l_r[r] = l_r[r] * f0[r] + l1[r] * f1[r];
            m_r[r] = mm;
        }
    }
#pragma unroll
    for (int i = 0; i < D / 2; ++i) {
        const int r = (i % 4) / 2;
        o[i] = o[i] * f0[r] + xo[i * 128 + tid] * f1[r];
    }
    // ---- epilogue: the rows of real positions of the kv head's query heads
    const float inv0 = l_r[0] > 0.f ? 1.f / l_r[0] : 0.f, inv1 = l_r[1] > 0.f ? 1.f / l_r[1] : 0.f;
    const int64_t rows_out = int64_t(gridDim.z) * p.Hq * p.Sq;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int r = rw + 8 * half, pos = half ? pos1 : pos0, g = g0 + r / p.sq_box;
        if (pos >= p.Sq || g >= p.group) continue;
        const int h = hk * p.group + g;
        const float inv = half ? inv1 : inv0;
        const int64_t orow = (int64_t(b) * p.Hq + h) * p.Sq + pos;
        if (p.parts == 1) {
            T* out = static_cast<T*>(p.o) + b * p.o_sb + h * p.o_sh + pos * p.o_ss + 2 * (lane % 4);
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
                *reinterpret_cast<uint32_t*>(out + 8 * j) =
                    pack2<T>(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
        } else {
            float* op = p.o_part + (part * rows_out + orow) * D + 2 * (lane % 4);
#pragma unroll
            for (int j = 0; j < D / 8; ++j)
                *reinterpret_cast<float2*>(op + 8 * j) =
                    make_float2(o[4 * j + 2 * half] * inv, o[4 * j + 2 * half + 1] * inv);
        }
        if (lane % 4 == 0) {
            const float l = l_r[half], m = m_r[half];
            const float lse = l > 0.f ? (m * sc + log2f(l)) * kLn2 : -INFINITY;
            if (p.parts > 1) p.lse_part[part * rows_out + orow] = lse;
            else if (p.lse != nullptr) p.lse[orow] = lse;
        }
    }
#else
    __trap();  // compiled for a target other than sm_90a: never launched (see flash_sm90_fwd)
#endif
}

// ---- host side ----------------------------------------------------------------------------------------------------

// The mask kind the kernel reads for these arguments: kNoMask without a mask; bool or q's dtype, 16-byte aligned,
// keys contiguous, the other strides 0 (broadcast) or multiples of 16 bytes below 2^40; else -1.
int mask_kind(const attn_lt_flash_args& a) {
    if (a.mask_dtype == ATTN_LT_NONE) return kNoMask;
    const int es = a.mask_dtype == ATTN_LT_BOOL ? 1 : a.mask_dtype == a.dtype ? 2 : 0;
    if (es == 0 || a.mask == nullptr || !aligned16(a.mask) || (a.Sk > 1 && a.m_sk != 1)) return -1;
    const auto ok = [es](int64_t size, int64_t stride) { return stride == 0 || stride_ok(size, stride, es); };
    if (!ok(a.B, a.m_sb) || !ok(a.Hq, a.m_sh) || !ok(a.Sq, a.m_sq)) return -1;
    return es == 1 ? kBoolMask : kAddMask;
}

// Heads that run side by side when they share the mask. The CTAs in flight (about one an SM) cover hg heads of
// SMs / hg query blocks: the mask is read from HBM Hq / hg times and each head's K and V (Sk * 4D bytes) about
// query blocks * hg / SMs times; the sum is least at hg = sqrt(es * SMs * 32 / D) (es: mask bytes an element),
// whatever the lengths: 8 at D = 128 with a 2-byte mask. Rounded to a power of two, at most Hq.
int head_group(const attn_lt_flash_args& a, uint32_t es) {
    const DeviceInfo* dev = nullptr;
    const int sms = current_device_info(&dev) == cudaSuccess ? dev->sms : 132;
    const double best = std::sqrt(double(es) * sms * 32.0 / double(a.D));
    int hg = 1;
    while (hg * 2 <= a.Hq && hg * 2 <= best * 1.41421356) hg *= 2;
    return hg;
}

// The mask (B, Hq, Sq, Sk) by its broadcast strides seen as 4-D (Sk, Sq, Hq, B), a broadcast dimension of size 1;
// one box is (cols keys, rows, 1, 1) of es-byte elements, in the swizzle of its cols * es bytes a row (128 or 64).
bool make_mask_map(CUtensorMap* map, const attn_lt_flash_args& a, uint32_t es, uint32_t cols, uint32_t rows) {
    const auto dim = [](int64_t size, int64_t stride) { return cuuint64_t(stride == 0 ? 1 : size); };
    const auto st = [es](int64_t size, int64_t stride) {
        return cuuint64_t(size == 1 || stride == 0 ? 16 : stride * int64_t(es));
    };
    const cuuint64_t dims[4] = {cuuint64_t(a.Sk), dim(a.Sq, a.m_sq), dim(a.Hq, a.m_sh), dim(a.B, a.m_sb)};
    const cuuint64_t strides[3] = {st(a.Sq, a.m_sq), st(a.Hq, a.m_sh), st(a.B, a.m_sb)};
    const cuuint32_t box[4] = {cols, rows, 1, 1};
    const cuuint32_t elem[4] = {1, 1, 1, 1};
    const CUtensorMapDataType dt = es == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16;
    const CUtensorMapSwizzle sw = cols * es == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B;
    return encode_tiled()(map, dt, 4, const_cast<void*>(a.mask), dims, strides, box, elem,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, sw, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

BaseParams base_params(const attn_lt_flash_args& a) {
    BaseParams p{};
    p.o = a.o;
    p.lse = a.lse;
    p.o_sb = a.o_sb;
    p.o_sh = a.o_sh;
    p.o_ss = a.o_ss;
    p.Sq = static_cast<int>(a.Sq);
    p.Sk = static_cast<int>(a.Sk);
    p.Hq = static_cast<int>(a.Hq);
    p.group = static_cast<int>(a.Hq / a.Hkv);
    p.sl2 = a.scale * kLog2e;
    p.causal = a.causal ? 1 : 0;
    return p;
}

// The prefill kernel's attention variants from the arguments (Params::cap_in ... sinks).
void set_variant(Params& p, const attn_lt_flash_args& a) {
    p.cap_in = a.softcap > 0.f ? a.scale / a.softcap : 0.f;
    p.cap_out = a.softcap / a.scale;
    p.win = window_of(a);
    p.sinks = a.sinks;
}

// The decode kernels' key parts: a.splits of them (1 when not split), each of tiles_per_part tiles of `keys`.
PartParams part_params(const attn_lt_flash_args& a, int keys) {
    PartParams p{};
    p.o_part = a.o_part;
    p.lse_part = a.lse_part;
    p.parts = a.splits > 1 ? static_cast<int>(a.splits) : 1;
    const int tiles = static_cast<int>((a.Sk + keys - 1) / keys);
    p.tiles_per_part = (tiles + p.parts - 1) / p.parts;
    return p;
}

// The grid of flash_sm90_fwd<D, T, MK>: for a kernel built persistent (persistent_kernel), one CTA an SM, at most
// one an item (p.items); else, and for the grid variant and causal calls of 128 query blocks and more, `grid` as
// given, a CTA an item (p.items 0). Those causal calls' items average 64 key tiles and more, whose prologues
// persistence no longer measurably hides, while its rounds of pairs end in whole units where the block scheduler
// fills the tail item by item (H200, FA3 protocol: S 16k causal 0.97-0.99x the grid's, S 8k causal 1.03-1.15x).
template <int D, typename T, int MK>
cudaError_t persistent_grid(Params& p, const attn_lt_flash_args& a, dim3& grid) {
    const int64_t items = int64_t(p.m_blocks) * a.Hq * a.B;
    if (!persistent_kernel<D, T, MK, false>() || a.variant == ATTN_LT_FLASH_SM90_GRID ||
        (a.causal && p.m_blocks >= 128) || items > 0x7fffffff)
        return cudaSuccess;
    const DeviceInfo* dev = nullptr;
    const cudaError_t err = current_device_info(&dev);
    if (err != cudaSuccess) return err;
    p.items = static_cast<int>(items);
    p.by_units = FastDiv(static_cast<uint32_t>(units_of(p.m_blocks, blocks_per_unit(a.causal))));
    p.by_heads = FastDiv(static_cast<uint32_t>(a.Hq));
    grid = dim3(static_cast<unsigned>(std::min<int64_t>(items, dev->sms)), 1u, 1u);
    return cudaSuccess;
}

// A prefill kernel's map of o (B, Hq, Sq, DV; 16-bit, dt) for its TMA stores, a box a 64-column slab of a
// warpgroup's 64 rows, where the kernel reads it (kRead: tma_stores_o); else `other` in its place (not encoded).
template <bool kRead>
bool make_o_map(CUtensorMap* map, CUtensorMapDataType dt, const attn_lt_flash_args& a, int64_t DV,
                const CUtensorMap& other) {
    if constexpr (!kRead) {
        *map = other;
        return true;
    }
    return make_map(map, dt, a.o, a.B, a.Hq, a.Sq, DV, a.o_sb, a.o_sh, a.o_ss, 64, 2, 1);
}

template <int D, int DV, typename T, bool kOverlap, int MK, bool kWide = false>
cudaError_t launch(const attn_lt_flash_args& a, cudaStream_t stream) {
    using L = Layout<D, DV, MK, 2, kWide>;
    constexpr CUtensorMapDataType dt = tma_dtype<T>();
    Params p{};
    static_cast<BaseParams&>(p) = base_params(a);
    set_variant(p, a);
    const int64_t m_blocks = (a.Sq + kBlockM - 1) / kBlockM;
    alignas(64) CUtensorMap mq, mk, mv, mm, mo;
    if (!make_map(&mq, dt, a.q, a.B, a.Hq, a.Sq, D, a.q_sb, a.q_sh, a.q_ss, kBlockM) ||
        !make_map(&mk, dt, a.k, a.B, a.Hkv, a.Sk, D, a.k_sb, a.k_sh, a.k_ss, L::kBlockN) ||
        !make_map(&mv, dt, a.v, a.B, a.Hkv, a.Sk, DV, a.v_sb, a.v_sh, a.v_ss, L::kBlockN) ||
        !make_o_map<tma_stores_o<D, DV, T, MK, false, kWide>()>(&mo, dt, a, DV, mq))
        return static_cast<cudaError_t>(ATTN_LT_ERR_TENSOR_MAP);
    if constexpr (MK != kNoMask) {
        p.m_rows = a.Sq == 1 || a.m_sq == 0 ? 1 : kBlockM;
        p.m_h = a.Hq > 1 && a.m_sh != 0;
        p.m_b = a.B > 1 && a.m_sb != 0;
        // heads sharing the mask run side by side, in groups (head_group)
        p.head_group = p.m_h || a.Hq == 1 || a.Hq * m_blocks > 0x7fffffff ? 0 : head_group(a, L::kMaskEs);
        if (!make_mask_map(&mm, a, L::kMaskEs, L::kMaskCols, static_cast<uint32_t>(p.m_rows)))
            return static_cast<cudaError_t>(ATTN_LT_ERR_TENSOR_MAP);
    } else {
        mm = mk;  // not read
    }
    const auto kernel = flash_sm90_fwd<D, DV, T, kOverlap, MK, false, false, kWide>;
    cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), L::kSmem);
    if (err != cudaSuccess) return err;
    p.m_blocks = static_cast<int>(m_blocks);
    const unsigned mbx = static_cast<unsigned>(m_blocks), hq = static_cast<unsigned>(a.Hq);
    dim3 grid(p.head_group ? mbx * hq : mbx, p.head_group ? 1u : hq, static_cast<unsigned>(a.B));
    err = persistent_grid<D, T, MK>(p, a, grid);
    if (err != cudaSuccess) return err;
    kernel<<<grid, kThreads, L::kSmem, stream>>>(mq, mk, mv, mm, mo, p);
    return cudaGetLastError();
}

// An e4m3 (B, H, S, D) tensor (a paged cache: B blocks of S rows) seen as 4-D (D, S, H, B) with byte strides (row,
// head, batch): one box of (64, rows, 1, 1) at column c lands as [rows][64 bytes] dense, columns c..c + 63 of each
// row: mla_decode_sm90's FP8 slabs (widen_e4m3_tile). A dimension of size 1 gets a nominal legal stride.
bool make_e4m3_row_map(CUtensorMap* map, const void* ptr, int64_t B, int64_t H, int64_t S, int64_t D, int64_t sb,
                       int64_t sh, int64_t ss, uint32_t rows) {
    const auto st = [](int64_t size, int64_t stride) { return cuuint64_t(size == 1 ? 16 : stride); };
    const cuuint64_t dims[4] = {cuuint64_t(D), cuuint64_t(S), cuuint64_t(H), cuuint64_t(B)};
    const cuuint64_t strides[3] = {st(S, ss), st(H, sh), st(B, sb)};
    const cuuint32_t box[4] = {64, rows, 1, 1};
    const cuuint32_t elem[4] = {1, 1, 1, 1};
    return encode_tiled()(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(ptr), dims, strides, box, elem,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// An FP8 latent cache's descale factors (attn_lt_flash_args) into MLA decode's parameters.
void set_descale(MlaParams& p, const attn_lt_flash_args& a) {
    p.k_descale = a.k_descale;
    p.v_descale = a.v_descale;
    p.descale_sh = a.descale_sh;
}

// The bytes of a k or v element: 1 for an FP8 cache (kv_dtype), else 2 (q's dtype).
int64_t kv_bytes(const attn_lt_flash_args& a) { return a.kv_dtype == ATTN_LT_E4M3 ? 1 : 2; }

// Whether FP8 cache arguments are ones MLA decode reads (D 576, e4m3; descale factors one a kv head or one for all,
// 4-byte aligned); k's strides are checked with the others, as bytes.
bool mla_e4m3_ok(const attn_lt_flash_args& a) {
    return a.kv_dtype == ATTN_LT_E4M3 && a.D == kMlaD && (a.descale_sh == 0 || a.descale_sh == 1) &&
           (reinterpret_cast<uintptr_t>(a.k_descale) | reinterpret_cast<uintptr_t>(a.v_descale)) % 4 == 0;
}

// MLA decode (mla_decode_sm90, then merge_partials when the keys are split into parts). q (B, Hq, 1, 576) is read
// with the heads as the rows of its tile; v is k's first 512 columns (checked by the caller).
template <typename T>
cudaError_t launch_mla(const attn_lt_flash_args& a, cudaStream_t stream) {
    using L = MlaLayout;
    constexpr CUtensorMapDataType dt = tma_dtype<T>();
    const bool f8 = a.kv_dtype == ATTN_LT_E4M3;
    alignas(64) CUtensorMap mq, mk;
    if (!make_map(&mq, dt, a.q, a.B, 1, a.Hq, kMlaD, a.q_sb, 0, a.q_sh, kMlaRows) ||
        !(f8 ? make_e4m3_row_map(&mk, a.k, a.B, a.Hkv, a.Sk, kMlaD, a.k_sb, a.k_sh, a.k_ss, kMlaKeys)
             : make_map(&mk, dt, a.k, a.B, a.Hkv, a.Sk, kMlaD, a.k_sb, a.k_sh, a.k_ss, kMlaKeys)))
        return static_cast<cudaError_t>(ATTN_LT_ERR_TENSOR_MAP);
    const auto kernel = f8 ? mla_decode_sm90<T, false, true> : mla_decode_sm90<T>;
    cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), L::kSmem);
    if (err != cudaSuccess) return err;
    MlaParams p{};
    static_cast<BaseParams&>(p) = base_params(a);
    static_cast<PartParams&>(p) = part_params(a, kMlaKeys);
    set_descale(p, a);
    p.row_blocks = (p.group + kMlaRows - 1) / kMlaRows;
    const dim3 grid(static_cast<unsigned>(p.row_blocks * p.parts), static_cast<unsigned>(a.Hkv),
                    static_cast<unsigned>(a.B));
    kernel<<<grid, kThreads, L::kSmem, stream>>>(mq, mk, p);
    err = cudaGetLastError();
    if (err != cudaSuccess || p.parts == 1) return err;
    return merge<kMlaDv, T>(a, stream);
}

// q (B, Hq, Sq, D) seen as 5-D (64, Sq, Hq, D / 64, B) with byte strides (row, head, 128, batch): one box of
// (64, sq_box, g_box, D / 64, 1) lands as gqa_decode_sm90's Q tile, slab by slab, row g * sq_box + i holding position
// i of head g (positions past Sq and heads past Hq zero-filled), whatever q's head and row strides.
bool make_rows_map(CUtensorMap* map, CUtensorMapDataType dt, const attn_lt_flash_args& a, uint32_t sq_box,
                   uint32_t g_box) {
    const auto st = [](int64_t size, int64_t stride) { return cuuint64_t(size == 1 ? 16 : stride * 2); };
    const cuuint64_t dims[5] = {64, cuuint64_t(a.Sq), cuuint64_t(a.Hq), cuuint64_t(a.D / 64), cuuint64_t(a.B)};
    const cuuint64_t strides[4] = {st(a.Sq, a.q_ss), st(a.Hq, a.q_sh), 128, st(a.B, a.q_sb)};
    const cuuint32_t box[5] = {64, sq_box, g_box, cuuint32_t(a.D / 64), 1};
    const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
    return encode_tiled()(map, dt, 5, const_cast<void*>(a.q), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Decode with several rows a kv head (gqa_decode_sm90, then merge_partials when the keys are split into parts):
// head dim D (64 or 128), Sq <= 64, a mask its heads share (checked by the caller).
template <int D, typename T, int MK>
cudaError_t launch_gqa_decode(const attn_lt_flash_args& a, cudaStream_t stream) {
    using L = GqLayout<D, MK>;
    constexpr CUtensorMapDataType dt = tma_dtype<T>();
    GqParams p{};
    static_cast<BaseParams&>(p) = base_params(a);
    p.sq_box = 1;
    while (p.sq_box < a.Sq) p.sq_box *= 2;
    p.g_box = kGqRows / p.sq_box;
    alignas(64) CUtensorMap mq, mk, mv, mm;
    if (!make_rows_map(&mq, dt, a, static_cast<uint32_t>(p.sq_box), static_cast<uint32_t>(p.g_box)) ||
        !make_map(&mk, dt, a.k, a.B, a.Hkv, a.Sk, D, a.k_sb, a.k_sh, a.k_ss, kGqKeys) ||
        !make_map(&mv, dt, a.v, a.B, a.Hkv, a.Sk, D, a.v_sb, a.v_sh, a.v_ss, kGqKeys))
        return static_cast<cudaError_t>(ATTN_LT_ERR_TENSOR_MAP);
    if constexpr (MK != kNoMask) {  // the block's positions (at most kGqMaskRows, checked), or one shared row
        p.m_rows = a.Sq == 1 || a.m_sq == 0 ? 1 : p.sq_box;
        p.m_b = a.B > 1 && a.m_sb != 0;
        if (!make_mask_map(&mm, a, L::kMaskEs, kGqKeys, static_cast<uint32_t>(p.m_rows)))
            return static_cast<cudaError_t>(ATTN_LT_ERR_TENSOR_MAP);
    } else {
        mm = mk;  // not read
    }
    const auto kernel = gqa_decode_sm90<D, T, MK>;
    cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), L::kSmem);
    if (err != cudaSuccess) return err;
    static_cast<PartParams&>(p) = part_params(a, kGqKeys);
    p.row_blocks = (p.group + p.g_box - 1) / p.g_box;
    const dim3 grid(static_cast<unsigned>(p.row_blocks * p.parts), static_cast<unsigned>(a.Hkv),
                    static_cast<unsigned>(a.B));
    kernel<<<grid, kThreads, L::kSmem, stream>>>(mq, mk, mv, mm, p);
    err = cudaGetLastError();
    if (err != cudaSuccess || p.parts == 1) return err;
    return merge<D, T>(a, stream);
}

template <int D, typename T>
cudaError_t launch_gqa_decode_masked(const attn_lt_flash_args& a, int mk, cudaStream_t stream) {
    return mk == kBoolMask  ? launch_gqa_decode<D, T, kBoolMask>(a, stream)
           : mk == kAddMask ? launch_gqa_decode<D, T, kAddMask>(a, stream)
                            : launch_gqa_decode<D, T, kNoMask>(a, stream);
}

// ---- the FP8 prefill: e4m3 q, k, v (descale factors a kv head), o bf16 ------------------------------------------
//
// e4m3 wgmma takes both operands K-major, so P V needs V with the keys contiguous: transpose_v_e4m3 writes V
// transposed into the workspace first (a copy of V's bytes, a few percent of the call at 4k keys), its keys permuted
// within each 32 (fp8_key_of) so that P's accumulator registers, packed in order, are the A fragments of P V
// (to_e4m3_fragments). Then the prefill kernel runs with T = e4m3: 128-key tiles (wide_tiles: Cfg<D>::kFp8WideN),
// QK^T and PV in k32 steps, P times 2^8 in e4m3, O staged in its own tile and written in bf16.

// The key at position n (0..31) of a 32-key step of the transposed V: the accumulator holds, in the order the A
// fragment reads positions 4t + 0..3 and 16 + 4t + 0..3 (t = lane % 4), keys 2t + {0, 1, 8, 9} and 16 + 2t + ...
__host__ __device__ constexpr int fp8_key_of(int n) { return (n & 16) + ((n & 2) << 2) + ((n & 12) >> 1) + (n & 1); }

// vt (B, Hkv, DV, Skp) = v (B, Hkv, Sk, DV) transposed (Skp: Sk rounded up to 128; keys past Sk 0), each 32 keys in
// fp8_key_of's order. Grid (Skp / 128, Hkv, B), 256 threads: 128 keys of one head through shared memory (rows
// padded by 4 bytes), read and written in 16-byte chunks.
template <int DV>
__global__ void __launch_bounds__(256) transpose_v_e4m3(const uint8_t* __restrict__ v, uint8_t* __restrict__ vt,
                                                        int Sk, int Skp, int Hkv, int64_t sb, int64_t sh,
                                                        int64_t ss) {
    __shared__ uint32_t tile[128 * (DV / 4 + 1)];
    constexpr int kChunks = DV / 16, kPitch = DV / 4 + 1;  // 16-byte chunks a key row; words a shared row
    const int n0 = blockIdx.x * 128, h = blockIdx.y, b = blockIdx.z;
    const uint8_t* src = v + b * sb + h * sh;
    for (int i = threadIdx.x; i < 128 * kChunks; i += 256) {
        const int r = i / kChunks, c = i % kChunks;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (n0 + r < Sk) x = *reinterpret_cast<const uint4*>(src + int64_t(n0 + r) * ss + 16 * c);
        uint32_t* row = tile + r * kPitch + 4 * c;
        row[0] = x.x;
        row[1] = x.y;
        row[2] = x.z;
        row[3] = x.w;
    }
    __syncthreads();
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(tile);
    uint8_t* dst = vt + (int64_t(b) * Hkv + h) * DV * Skp + n0;
    for (int i = threadIdx.x; i < DV * 8; i += 256) {  // DV rows of 128 keys, 8 chunks of 16 each
        const int d = i / 8, c = i % 8;
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            uint32_t x = 0;
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                const int n = 16 * c + 4 * q + t;
                x |= uint32_t(bytes[((n & ~31) + fp8_key_of(n & 31)) * kPitch * 4 + d]) << (8 * t);
            }
            w[q] = x;
        }
        *reinterpret_cast<uint4*>(dst + int64_t(d) * Skp + 16 * c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// The transposed V (B, Hkv, DV, Skp) bytes as 4-D (Skp, DV, Hkv, B): a box of (keys = 128 or 64, DV rows) is a slab
// of a stage's V tile (rows of 128 bytes in the 128-byte swizzle, or of 64 in the 64-byte; Layout::kVtKeys).
bool make_vt_map(CUtensorMap* map, const void* vt, int64_t B, int64_t Hkv, int64_t DV, int64_t Skp, uint32_t keys) {
    const cuuint64_t dims[4] = {cuuint64_t(Skp), cuuint64_t(DV), cuuint64_t(Hkv), cuuint64_t(B)};
    const cuuint64_t strides[3] = {cuuint64_t(Skp), cuuint64_t(DV * Skp), cuuint64_t(Hkv * DV * Skp)};
    const cuuint32_t box[4] = {keys, cuuint32_t(DV), 1, 1};
    const cuuint32_t elem[4] = {1, 1, 1, 1};
    return encode_tiled()(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 4, const_cast<void*>(vt), dims, strides, box, elem,
                          CU_TENSOR_MAP_INTERLEAVE_NONE,
                          keys == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The FP8 prefill (checked by attn_lt_flash_sm90_fwd): V transposed into a.o_part, then the kernel.
template <int D, bool kWide>
cudaError_t launch_fp8(const attn_lt_flash_args& a, cudaStream_t stream) {
    using T = __nv_fp8_e4m3;
    using L = Layout<D, D, kNoMask, 1, kWide>;
    const int64_t skp = (a.Sk + 127) / 128 * 128;
    uint8_t* vt = reinterpret_cast<uint8_t*>(a.o_part);
    transpose_v_e4m3<D><<<dim3(static_cast<unsigned>(skp / 128), static_cast<unsigned>(a.Hkv),
                               static_cast<unsigned>(a.B)),
                          256, 0, stream>>>(static_cast<const uint8_t*>(a.v), vt, static_cast<int>(a.Sk),
                                            static_cast<int>(skp), static_cast<int>(a.Hkv), a.v_sb, a.v_sh, a.v_ss);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    Params p{};
    static_cast<BaseParams&>(p) = base_params(a);
    set_variant(p, a);
    p.q_descale = a.q_descale;
    p.k_descale = a.k_descale;
    p.v_descale = a.v_descale;
    p.descale_sh = a.descale_sh;
    const int64_t m_blocks = (a.Sq + kBlockM - 1) / kBlockM;
    p.m_blocks = static_cast<int>(m_blocks);
    constexpr CUtensorMapDataType dt = tma_dtype<T>();
    alignas(64) CUtensorMap mq, mk, mv, mo;
    if (!make_map(&mq, dt, a.q, a.B, a.Hq, a.Sq, D, a.q_sb, a.q_sh, a.q_ss, kBlockM, 1) ||
        !make_map(&mk, dt, a.k, a.B, a.Hkv, a.Sk, D, a.k_sb, a.k_sh, a.k_ss, L::kBlockN, 1) ||
        !make_vt_map(&mv, vt, a.B, a.Hkv, D, skp, L::kVtKeys) ||
        !make_o_map<tma_stores_o<D, D, T, kNoMask, false, kWide>()>(&mo, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, a, D, mq))
        return static_cast<cudaError_t>(ATTN_LT_ERR_TENSOR_MAP);
    const auto kernel = flash_sm90_fwd<D, D, T, true, kNoMask, false, false, kWide>;
    err = opt_in_smem(reinterpret_cast<const void*>(kernel), L::kSmem);
    if (err != cudaSuccess) return err;
    dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(a.Hq), static_cast<unsigned>(a.B));
    err = persistent_grid<D, T, kNoMask>(p, a, grid);
    if (err != cudaSuccess) return err;
    kernel<<<grid, kThreads, L::kSmem, stream>>>(mq, mk, mv, mk, mo, p);
    return cudaGetLastError();
}

// Whether the default pipeline runs a call without a mask on Cfg<D>::kWideN-key tiles (FP8: kFp8WideN; see Cfg).
template <int D, bool kFp8 = false>
bool wide_tiles(const attn_lt_flash_args& a) {
    if (a.window_left >= 0 || a.window_right >= 0) return false;
    if constexpr (kFp8) return a.Sk >= (a.causal ? Cfg<D>::kFp8WideFromCausal : Cfg<D>::kFp8WideFrom);
    else return a.Sk >= (a.causal ? Cfg<D>::kWideFromCausal : Cfg<D>::kWideFrom);
}

// The FP8 prefill on D's key tiles (wide_tiles).
template <int D>
cudaError_t launch_fp8_tiles(const attn_lt_flash_args& a, cudaStream_t stream) {
    if constexpr (Cfg<D>::kFp8WideN > 0)
        if (wide_tiles<D, true>(a)) return launch_fp8<D, true>(a, stream);
    return launch_fp8<D, false>(a, stream);
}

// The plain pipeline is built without masks, and D != DV without masks (mask_kind, the head dims and the variant are
// checked before).
template <int D, int DV, typename T>
cudaError_t launch_variant(const attn_lt_flash_args& a, int mk, cudaStream_t stream) {
    if (a.variant == ATTN_LT_FLASH_SM90_PLAIN) return launch<D, DV, T, false, kNoMask>(a, stream);
    if constexpr (D == DV) {
        if (mk == kBoolMask) return launch<D, DV, T, true, kBoolMask>(a, stream);
        if (mk == kAddMask) return launch<D, DV, T, true, kAddMask>(a, stream);
        if constexpr (Cfg<D>::kWideN > 0)
            if (wide_tiles<D>(a)) return launch<D, DV, T, true, kNoMask, true>(a, stream);
    }
    return launch<D, DV, T, true, kNoMask>(a, stream);
}

// A paged cache (num_blocks, bs, H, D) seen as 5-D (64, bs, D / 64, H, num_blocks) with byte strides (row, 128,
// head, block); a box is (64, rows, slabs, 1, 1): a whole tile of `rows` keys of one block (slabs = D / 64), or one
// slab of a block's bs rows (rows = bs, slabs = 1). The blocks need not be contiguous (any block stride TMA takes).
bool make_paged_map(CUtensorMap* map, CUtensorMapDataType dt, const void* ptr, int64_t num_blocks, int64_t bs,
                    int64_t H, int64_t D, int64_t sb, int64_t sh, int64_t ss, uint32_t rows, uint32_t slabs) {
    const auto st = [](int64_t size, int64_t stride) { return cuuint64_t(size == 1 ? 16 : stride * 2); };
    const cuuint64_t dims[5] = {64, cuuint64_t(bs), cuuint64_t(D / 64), cuuint64_t(H), cuuint64_t(num_blocks)};
    const cuuint64_t strides[4] = {st(bs, ss), 128, st(H, sh), st(num_blocks, sb)};
    const cuuint32_t box[5] = {64, rows, slabs, 1, 1};
    const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
    return encode_tiled()(map, dt, 5, const_cast<void*>(ptr), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The paged mode's shared memory beyond the Layout: a bad word a stage (flash_sm90_fwd's kPaged).
constexpr size_t kPagedSmem = 16;

// The varlen mode of the prefill kernel (the default pipeline, no mask, DV = D): the packed q (total_q rows), k and
// v (total_k rows) seen as one batch entry, grid (query blocks of the capacity f.Sq, Hq, B); with a block table, the
// paged mode (k and v the caches, make_paged_map). Preconditions checked by attn_lt_flash_sm90_batch.
template <int D, typename T>
cudaError_t launch_batch(const attn_lt_batch_args& ba, cudaStream_t stream) {
    using L = Layout<D, D, kNoMask>;
    static_assert(L::kStages * 4 <= kPagedSmem, "a bad word a stage");
    constexpr CUtensorMapDataType dt = tma_dtype<T>();
    const attn_lt_flash_args& a = ba.f;
    const bool paged = ba.block_table != nullptr;
    BatchParams p{};
    static_cast<BaseParams&>(p) = base_params(a);
    set_variant(p, a);
    p.batch = ba;
    const int64_t m_blocks = (a.Sq + kBlockM - 1) / kBlockM;
    p.m_blocks = static_cast<int>(m_blocks);
    alignas(64) CUtensorMap mq, mk, mv;
    bool maps = make_map(&mq, dt, a.q, 1, a.Hq, ba.total_q, D, 0, a.q_sh, a.q_ss, kBlockM);
    if (paged) {  // a tile of one block, or a box a (block, slab) when a tile spans blocks
        const int64_t bs = ba.block_size, nb = ba.num_blocks;
        const uint32_t rows = bs < L::kBlockN ? uint32_t(bs) : uint32_t(L::kBlockN);
        const uint32_t slabs = bs < L::kBlockN ? 1u : uint32_t(D / 64);
        maps = maps && make_paged_map(&mk, dt, a.k, nb, bs, a.Hkv, D, a.k_sb, a.k_sh, a.k_ss, rows, slabs) &&
               make_paged_map(&mv, dt, a.v, nb, bs, a.Hkv, D, a.v_sb, a.v_sh, a.v_ss, rows, slabs);
    } else {
        maps = maps && make_map(&mk, dt, a.k, 1, a.Hkv, ba.total_k, D, 0, a.k_sh, a.k_ss, L::kBlockN) &&
               make_map(&mv, dt, a.v, 1, a.Hkv, ba.total_k, D, 0, a.v_sh, a.v_ss, L::kBlockN);
    }
    if (!maps) return static_cast<cudaError_t>(ATTN_LT_ERR_TENSOR_MAP);
    const auto kernel = paged ? flash_sm90_fwd<D, D, T, true, kNoMask, true, true>
                              : flash_sm90_fwd<D, D, T, true, kNoMask, true>;
    const size_t smem = L::kSmem + (paged ? kPagedSmem : 0);
    const cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), smem);
    if (err != cudaSuccess) return err;
    const dim3 grid(static_cast<unsigned>(m_blocks), static_cast<unsigned>(a.Hq), static_cast<unsigned>(a.B));
    kernel<<<grid, kThreads, smem, stream>>>(mq, mk, mv, mk, mk, p);  // the mask's and o's maps are not read
    return cudaGetLastError();
}

// MLA decode of a paged batch (mla_decode_sm90's paged mode, then merge_partials for the requests of several
// parts): q (total_q, Hq, 576), request b's row b or cu_q[b] (at most one); the latent cache (num_blocks, bs, Hkv,
// 576), bs >= 64, v = k.
// Preconditions checked by attn_lt_flash_sm90_batch.
template <typename T>
cudaError_t launch_mla_batch(const attn_lt_batch_args& ba, cudaStream_t stream) {
    using L = MlaLayout;
    constexpr CUtensorMapDataType dt = tma_dtype<T>();
    const attn_lt_flash_args& a = ba.f;
    const bool f8 = a.kv_dtype == ATTN_LT_E4M3;
    alignas(64) CUtensorMap mq, mk;
    if (!make_map(&mq, dt, a.q, ba.total_q, 1, a.Hq, kMlaD, a.q_ss, 0, a.q_sh, kMlaRows) ||
        !(f8 ? make_e4m3_row_map(&mk, a.k, ba.num_blocks, a.Hkv, ba.block_size, kMlaD, a.k_sb, a.k_sh, a.k_ss,
                                  kMlaKeys)
             : make_paged_map(&mk, dt, a.k, ba.num_blocks, ba.block_size, a.Hkv, kMlaD, a.k_sb, a.k_sh, a.k_ss,
                              kMlaKeys, kMlaD / 64)))
        return static_cast<cudaError_t>(ATTN_LT_ERR_TENSOR_MAP);
    const auto kernel = f8 ? mla_decode_sm90<T, true, true> : mla_decode_sm90<T, true>;
    cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), L::kSmem);
    if (err != cudaSuccess) return err;
    MlaPagedParams p{};
    static_cast<BaseParams&>(p) = base_params(a);
    set_descale(p, a);
    p.o_sb = a.o_ss;  // request b's output row q0
    p.o_part = a.o_part;
    p.lse_part = a.lse_part;
    const int64_t tiles = (a.Sk + kMlaKeys - 1) / kMlaKeys;
    p.tiles_per_part = static_cast<int>(ba.split_keys > 0 ? ba.split_keys / kMlaKeys : tiles);
    p.parts = static_cast<int>(batch_parts<int64_t>(a.Sk, ba.split_keys));
    p.row_blocks = (p.group + kMlaRows - 1) / kMlaRows;
    p.batch = ba;
    const dim3 grid(static_cast<unsigned>(p.row_blocks * p.parts), static_cast<unsigned>(a.Hkv),
                    static_cast<unsigned>(a.B));
    kernel<<<grid, kThreads, L::kSmem, stream>>>(mq, mk, p);
    err = cudaGetLastError();
    if (err != cudaSuccess || p.parts == 1) return err;
    return merge<kMlaDv, T>(MlaBatch{ba}, stream);
}

template <typename T>
cudaError_t launch_batch_dim(const attn_lt_batch_args& ba, cudaStream_t stream) {
    if (ba.f.D == kMlaD) return launch_mla_batch<T>(ba, stream);
    if (ba.f.D == 64) return launch_batch<64, T>(ba, stream);
    if (ba.f.D == 128) return launch_batch<128, T>(ba, stream);
    return launch_batch<256, T>(ba, stream);
}

template <typename T>
cudaError_t launch_dim(const attn_lt_flash_args& a, int mk, cudaStream_t stream) {
    if (a.variant == ATTN_LT_FLASH_SM90_DECODE)
        return a.D == 64 ? launch_gqa_decode_masked<64, T>(a, mk, stream)
                         : launch_gqa_decode_masked<128, T>(a, mk, stream);
    if (a.D == 576) return launch_mla<T>(a, stream);
    if (a.D == 64) return launch_variant<64, 64, T>(a, mk, stream);
    if (a.D == 128) return launch_variant<128, 128, T>(a, mk, stream);
    if (a.D == 192) return launch_variant<192, 128, T>(a, mk, stream);
    return launch_variant<256, 256, T>(a, mk, stream);
}

// The FP8 prefill's rules beyond attn_lt_flash_sm90_fwd's common ones (attn_lt.h), then its launch.
int fp8_prefill(const attn_lt_flash_args& a, cudaStream_t stream) {
    const int64_t dv = a.Dv == 0 ? a.D : a.Dv;
    if (a.kv_dtype != ATTN_LT_E4M3 || (a.D != 64 && a.D != 128 && a.D != 256) || dv != a.D) return ATTN_LT_ERR_DTYPE;
    if (a.mask_dtype != ATTN_LT_NONE) return ATTN_LT_ERR_MASK;
    if ((a.variant != ATTN_LT_FLASH_SM90_DEFAULT && a.variant != ATTN_LT_FLASH_SM90_GRID) || a.splits > 1)
        return ATTN_LT_ERR_VARIANT;
    if (!variant_ok(a)) return ATTN_LT_ERR_WINDOW;
    if (a.o_part == nullptr || a.descale_sh < 0 || a.descale_sh > 1) return ATTN_LT_ERR_ARGS;
    if (!aligned16(a.o_part)) return ATTN_LT_ERR_ALIGNMENT;
    if (!stride_ok(a.B, a.q_sb, 1) || !stride_ok(a.Hq, a.q_sh, 1) || !stride_ok(a.Sq, a.q_ss, 1) ||
        !stride_ok(a.B, a.k_sb, 1) || !stride_ok(a.Hkv, a.k_sh, 1) || !stride_ok(a.Sk, a.k_ss, 1) ||
        !stride_ok(a.B, a.v_sb, 1) || !stride_ok(a.Hkv, a.v_sh, 1) || !stride_ok(a.Sk, a.v_ss, 1) ||
        !stride_ok(a.B, a.o_sb) || !stride_ok(a.Hq, a.o_sh) || !stride_ok(a.Sq, a.o_ss))
        return ATTN_LT_ERR_STRIDES;
    cudaError_t err = check_device();
    if (err != cudaSuccess) return static_cast<int>(err);
    if (encode_tiled() == nullptr) return static_cast<int>(cudaErrorNotSupported);
    return static_cast<int>(a.D == 64    ? launch_fp8_tiles<64>(a, stream)
                            : a.D == 128 ? launch_fp8_tiles<128>(a, stream)
                                         : launch_fp8_tiles<256>(a, stream));
}

}  // namespace

extern "C" int attn_lt_flash_sm90_supported(void) {
    if (check_device() != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    cudaFuncAttributes attr;
    if (cudaFuncGetAttributes(&attr, flash_sm90_fwd<128, 128, __nv_bfloat16, true, kNoMask>) != cudaSuccess) {
        cudaGetLastError();  // no sm_90a image in this binary
        return 0;
    }
    return attr.numRegs >= 128 && encode_tiled() != nullptr ? 1 : 0;  // not the stub
}

extern "C" int attn_lt_flash_sm90_fwd(const attn_lt_flash_args* a, void* stream) {
    if (a == nullptr || a->B <= 0 || a->Hq <= 0 || a->Hkv <= 0 || a->Sq <= 0 || a->Sk <= 0 || a->o == nullptr)
        return ATTN_LT_ERR_ARGS;
    if (a->Hq % a->Hkv || a->B > 65535 || a->Hq > 65535) return ATTN_LT_ERR_HEADS;
    const int64_t dv = a->Dv == 0 ? a->D : a->Dv;
    if (!head_dims_built(a->D, dv)) return ATTN_LT_ERR_HEAD_DIM;
    if (a->Sq >= (1LL << 30) || a->Sk >= (1LL << 30)) return ATTN_LT_ERR_LENGTH;
    if (!(a->scale > 0.f)) return ATTN_LT_ERR_SCALE;
    if (!aligned16(a->q) || !aligned16(a->k) || !aligned16(a->v) || !aligned16(a->o)) return ATTN_LT_ERR_ALIGNMENT;
    if (a->dtype == ATTN_LT_E4M3) return fp8_prefill(*a, static_cast<cudaStream_t>(stream));
    if ((a->dtype != ATTN_LT_F16 && a->dtype != ATTN_LT_BF16) || (a->kv_dtype != ATTN_LT_NONE && !mla_e4m3_ok(*a)))
        return ATTN_LT_ERR_DTYPE;
    const int64_t kes = kv_bytes(*a);
    const bool decode = a->variant == ATTN_LT_FLASH_SM90_DECODE;
    if (a->variant != ATTN_LT_FLASH_SM90_DEFAULT && a->variant != ATTN_LT_FLASH_SM90_PLAIN &&
        a->variant != ATTN_LT_FLASH_SM90_GRID && !decode)
        return ATTN_LT_ERR_VARIANT;
    if (!variant_ok(*a) || (has_variant(*a) && (decode || a->D == 576))) return ATTN_LT_ERR_WINDOW;
    const int mk = mask_kind(*a);
    if (mk < 0) return ATTN_LT_ERR_MASK;
    if (mk != kNoMask && a->variant == ATTN_LT_FLASH_SM90_PLAIN) return ATTN_LT_ERR_VARIANT;
    if (mk != kNoMask && dv != a->D) return ATTN_LT_ERR_MASK;  // no masked kernel with DV != D
    if (decode && ((a->D != 64 && a->D != 128) || dv != a->D || a->Sq > kGqRows)) return ATTN_LT_ERR_VARIANT;
    // the decode kernel's mask: shared by the heads, and at most kGqMaskRows rows of positions a tile
    if (decode && mk != kNoMask && ((a->Hq > 1 && a->m_sh != 0) || (a->Sq > kGqMaskRows && a->m_sq != 0)))
        return ATTN_LT_ERR_VARIANT;
    if (a->D == 576 &&  // MLA decode: one query a head, v = k[..., :512] (the same memory)
        (a->Sq != 1 || a->v != a->k || a->v_sb != a->k_sb || a->v_sh != a->k_sh || a->v_ss != a->k_ss))
        return ATTN_LT_ERR_LATENT;
    if (a->D == 576 && a->variant != ATTN_LT_FLASH_SM90_DEFAULT) return ATTN_LT_ERR_VARIANT;
    if (a->D == 576 || decode) {  // the keys split in parts
        if (a->splits < 0 || a->splits > 4096) return ATTN_LT_ERR_LENGTH;
        if (a->splits > 1 && (a->o_part == nullptr || a->lse_part == nullptr)) return ATTN_LT_ERR_ARGS;
        if (a->splits > 1 && (reinterpret_cast<uintptr_t>(a->o_part) % 8 ||
                              reinterpret_cast<uintptr_t>(a->lse_part) % 4))
            return ATTN_LT_ERR_ALIGNMENT;  // float2 partials
    } else if (a->splits > 1) {
        return ATTN_LT_ERR_VARIANT;
    }
    if (!stride_ok(a->B, a->q_sb) || !stride_ok(a->Hq, a->q_sh) || !stride_ok(a->Sq, a->q_ss) ||
        !stride_ok(a->B, a->k_sb, kes) || !stride_ok(a->Hkv, a->k_sh, kes) || !stride_ok(a->Sk, a->k_ss, kes) ||
        !stride_ok(a->B, a->v_sb, kes) || !stride_ok(a->Hkv, a->v_sh, kes) || !stride_ok(a->Sk, a->v_ss, kes) ||
        !stride_ok(a->B, a->o_sb) || !stride_ok(a->Hq, a->o_sh) || !stride_ok(a->Sq, a->o_ss))
        return ATTN_LT_ERR_STRIDES;
    cudaError_t err = check_device();
    if (err != cudaSuccess) return static_cast<int>(err);
    if (encode_tiled() == nullptr) return static_cast<int>(cudaErrorNotSupported);
    attn_lt_flash_args c = *a;
    c.splits = dense_parts(a->Sk, a->splits);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return static_cast<int>(c.dtype == ATTN_LT_BF16 ? launch_dim<__nv_bfloat16>(c, mk, s)
                                                    : launch_dim<__half>(c, mk, s));
}

// The row blocks of a varlen or paged batch, or a whole MLA decode batch (attn_lt.h: attn_lt_batch_args).
// Preconditions, beyond the device
// metadata the kernel checks itself: varlen keys (cu_k set, no block table) or a paged cache (block_table and
// seqlens_k set, cu_k null), and an error word, int32 metadata 4-byte aligned; cu_q null only with total_q >= B
// (request b's row b); B, Hq, Hkv, the capacities f.Sq, f.Sk and total_q positive (and total_k, varlen), B and
// Hq <= 65535, Hq a multiple of Hkv, the capacities below 2^30 and the totals below 2^31; paged: block_size a power
// of two in [8, 2^20], num_blocks in [1, 2^31), max_blocks >= 1, bt_stride >= max_blocks, B * bt_stride < 2^31
// (else ATTN_LT_ERR_BATCH); D = Dv 64, 128 or 256, or MLA decode (D 576, Dv 512: v = k, the same address and
// strides, else ATTN_LT_ERR_LATENT; paged, block_size >= 64, f.Sq 1, split_keys a multiple of 64 with row blocks x
// parts <= 65535, the partials [parts][B][Hq][512] then their LSEs in the workspace, else ATTN_LT_ERR_BATCH); no mask;
// fp16/bf16, the latent cache also e4m3 (kv_dtype, attn_lt.h); scale positive; q, k, v, o 16-byte aligned, their
// head and row strides (and the caches' block strides) positive multiples of 16 bytes below 2^39 elements (any for
// a dimension of size 1); the blocks of a cache need not be contiguous. f.variant, f.splits and the batch strides of
// q and o are not read.
extern "C" int attn_lt_flash_sm90_batch(const attn_lt_batch_args* args, void* stream) {
    if (args == nullptr) return ATTN_LT_ERR_ARGS;
    const attn_lt_flash_args& a = args->f;
    const bool paged = args->block_table != nullptr;
    if (a.B <= 0 || a.Hq <= 0 || a.Hkv <= 0 || a.Sq <= 0 || a.Sk <= 0 || args->total_q <= 0 ||
        (!paged && args->total_k <= 0) || a.q == nullptr || a.k == nullptr || a.v == nullptr || a.o == nullptr)
        return ATTN_LT_ERR_ARGS;
    if (paged == (args->cu_k != nullptr) || (paged && args->seqlens_k == nullptr) || args->error == nullptr ||
        (args->cu_q == nullptr && args->total_q < a.B))
        return ATTN_LT_ERR_BATCH;
    if (paged && (args->block_size < 8 || args->block_size > (1 << 20) ||
                  (args->block_size & (args->block_size - 1)) || args->num_blocks <= 0 ||
                  args->num_blocks >= (1LL << 31) || args->max_blocks <= 0 || args->bt_stride < args->max_blocks ||
                  a.B * args->bt_stride >= (1LL << 31)))
        return ATTN_LT_ERR_BATCH;
    if (reinterpret_cast<uintptr_t>(args->cu_k) % 4 || reinterpret_cast<uintptr_t>(args->cu_q) % 4 ||
        reinterpret_cast<uintptr_t>(args->error) % 4 || reinterpret_cast<uintptr_t>(args->block_table) % 4 ||
        reinterpret_cast<uintptr_t>(args->seqlens_k) % 4)
        return ATTN_LT_ERR_ALIGNMENT;
    if (a.Hq % a.Hkv || a.B > 65535 || a.Hq > 65535) return ATTN_LT_ERR_HEADS;
    const bool latent = a.D == kMlaD;
    if (latent ? a.Dv != kMlaDv : (a.D != 64 && a.D != 128 && a.D != 256) || (a.Dv != 0 && a.Dv != a.D))
        return ATTN_LT_ERR_HEAD_DIM;
    if (a.Sq >= (1LL << 30) || a.Sk >= (1LL << 30) || args->total_q >= (1LL << 31) ||
        (!paged && args->total_k >= (1LL << 31)))
        return ATTN_LT_ERR_LENGTH;
    if (!variant_ok(a) || (latent && has_variant(a))) return ATTN_LT_ERR_WINDOW;
    if (latent) {  // MLA decode: a paged latent cache, v = k[..., :512] (the same memory), one query row a request
        if (a.v != a.k || a.v_sb != a.k_sb || a.v_sh != a.k_sh || a.v_ss != a.k_ss) return ATTN_LT_ERR_LATENT;
        if (!paged || args->block_size < kMlaKeys || a.Sq != 1 || args->split_keys < 0 || args->split_keys % kMlaKeys)
            return ATTN_LT_ERR_BATCH;
        const int64_t parts = batch_parts<int64_t>(a.Sk, args->split_keys);
        const int64_t row_blocks = (a.Hq / a.Hkv + kMlaRows - 1) / kMlaRows;
        if (row_blocks * parts > 65535) return ATTN_LT_ERR_BATCH;
        if (parts > 1) {  // the partials inside the workspace: outputs [parts][B * Hq][512], then their LSEs
            const int64_t rows = parts * a.B * a.Hq;
            if (a.o_part == nullptr || a.lse_part == nullptr ||
                reinterpret_cast<const char*>(a.lse_part) != reinterpret_cast<const char*>(a.o_part) + rows * kMlaDv * 4 ||
                args->workspace_bytes < rows * (kMlaDv + 1) * 4 || reinterpret_cast<uintptr_t>(a.o_part) % 8)
                return ATTN_LT_ERR_BATCH;
        }
    }
    if (!(a.scale > 0.f)) return ATTN_LT_ERR_SCALE;
    if (!aligned16(a.q) || !aligned16(a.k) || !aligned16(a.v) || !aligned16(a.o)) return ATTN_LT_ERR_ALIGNMENT;
    if ((a.dtype != ATTN_LT_F16 && a.dtype != ATTN_LT_BF16) || (a.kv_dtype != ATTN_LT_NONE && !mla_e4m3_ok(a)))
        return ATTN_LT_ERR_DTYPE;
    if (a.mask_dtype != ATTN_LT_NONE) return ATTN_LT_ERR_MASK;
    const int64_t tq = args->total_q, tk = args->total_k, bs = args->block_size, nb = args->num_blocks;
    const int64_t kes = kv_bytes(a);
    if (!stride_ok(a.Hq, a.q_sh) || !stride_ok(tq, a.q_ss) || !stride_ok(a.Hkv, a.k_sh, kes) ||
        !stride_ok(a.Hkv, a.v_sh, kes) || !stride_ok(a.Hq, a.o_sh) || !stride_ok(tq, a.o_ss))
        return ATTN_LT_ERR_STRIDES;
    if (paged ? !stride_ok(bs, a.k_ss, kes) || !stride_ok(bs, a.v_ss, kes) || !stride_ok(nb, a.k_sb, kes) ||
                    !stride_ok(nb, a.v_sb, kes)
              : !stride_ok(tk, a.k_ss, kes) || !stride_ok(tk, a.v_ss, kes))
        return ATTN_LT_ERR_STRIDES;
    cudaError_t err = check_device();
    if (err != cudaSuccess) return static_cast<int>(err);
    if (encode_tiled() == nullptr) return static_cast<int>(cudaErrorNotSupported);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    return static_cast<int>(a.dtype == ATTN_LT_BF16 ? launch_batch_dim<__nv_bfloat16>(*args, s)
                                                    : launch_batch_dim<__half>(*args, s));
}
