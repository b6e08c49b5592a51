// The long path's Q@K^T on Hopper (sm_90a), FP32 scores: an alternative to cuBLASLt for the scores GEMM, run when
// the settings' qk="native" option (attn_lt/lt/scores.py). cuBLASLt stays the default: this kernel is faster alone
// but slower inside the long path's two lanes (docs/performance-log.md).
//
// The scores GEMM has k = D (64 or 128) and writes 4 bytes an output element, so its stores bound it, not its MMAs.
// Here one tile's stores overlap the next tile's loads and MMAs:
//   * a persistent grid (one CTA an SM) walks output tiles of 128 rows x 128 keys, key blocks fastest, CTA c taking
//     tiles c, c + G, c + 2G, ... (at any moment the CTAs write neighbouring tiles);
//   * one operand block stays in shared memory while a CTA's consecutive tiles share it (K when G is a multiple of
//     the key blocks, else Q), warpgroup 0 streaming the other through a ring with TMA;
//   * warpgroups 1 and 2 each multiply 64 of the tile's rows (wgmma, both operands from shared memory), give the
//     stage back, write alpha * S into one of their two store buffers in the 128-byte swizzle and hand it to TMA
//     stores (a bulk async-group); a buffer is written again once its stores have read it.
// Rows and keys past the ends are zero-filled by the loads; the stores write whole 16-byte chunks, so a row's last
// chunk gets zeros past its last key (the launcher requires s_ld >= cols rounded up to 4) and nothing beyond it.
//
// Layout (cuBLASLt's qk GEMM of attn_lt/lt/cublaslt.py, row-major here): for e in [0, batch),
//   S[e] (rows x cols, FP32, row stride s_ld, block stride s_bs) = alpha * Q[e] (rows x D) @ K[e] (cols x D)^T,
// Q's and K's rows strided by q_ld / k_ld, blocks by q_bs / k_bs, elements contiguous (all strides in elements).
//
// Shared memory (1024-byte aligned; every tile in the 128-byte swizzle):
//   sR        the resident block [D/64 slabs][128 rows][64 elements] (Q and K tiles have one layout)
//   ring      kStages blocks of the streamed operand, the same layout
//   sE        per consumer warpgroup, 2 store buffers of [4 boxes][64 rows][32 floats] (a box: rows of 128 bytes)
//   mbarriers r_full, r_empty, full[kStages], empty[kStages]
#include "attn_lt.h"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <vector>

namespace {

constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
#include "common.cuh"
#include "sm90.cuh"

constexpr int kTileM = 128, kTileN = 128;  // a tile: 128 rows (64 a consumer warpgroup) x 128 keys
constexpr int kEpiBuffers = 2;             // store buffers a consumer warpgroup: one filling, one draining

template <int D>
struct ScoresLayout {
    static constexpr uint32_t kQBytes = kTileM * D * 2, kKBytes = kTileN * D * 2;
    static constexpr uint32_t kSlabQ = kTileM * 128, kSlabK = kTileN * 128;  // bytes of one 64-element slab
    static constexpr uint32_t kBoxBytes = 64 * 128;                          // 64 rows x 32 floats
    static constexpr uint32_t kEpiBytes = 4 * kBoxBytes;                     // a warpgroup's 64 x 128 floats
    static constexpr int kStages = D == 64 ? 4 : 2;
    static constexpr uint32_t kK = kQBytes, kEpi = kK + kStages * kKBytes;
    static constexpr uint32_t kBars = kEpi + 2 * kEpiBuffers * kEpiBytes;
    static constexpr uint32_t kBarCount = 2 + 2 * kStages;  // r_full, r_empty, full[kStages], empty[kStages]
    static constexpr size_t kSmem = kBars + 8 * kBarCount + 1024;  // + slack to align the base to 1024 bytes
    static_assert(kSmem <= 227 * 1024, "shared memory over the sm_90 limit");
};

struct ScoresParams {
    int tiles_n, tiles_m, tiles;  // key blocks, row blocks (a score block), all tiles
    int k_resident;               // 1: each CTA keeps one K block (grid a multiple of tiles_n); 0: one Q block
    float alpha;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int kProducerRegs = 40, kConsumerRegs = 232;  // 128 * 40 + 256 * 232 = 384 * 168

// Tile t (key block fastest, then row block, then score block): its score block e, first row m0 and first key n0,
// and the number of the block of the operand a CTA keeps (rid: K's e * tiles_n + key block, or Q's t / tiles_n).
struct Tile {
    int e, m0, n0, rid;
};
__device__ __forceinline__ Tile tile_at(const ScoresParams& p, int t) {
    const int qb = t / p.tiles_n, nb = t - qb * p.tiles_n, e = qb / p.tiles_m;
    return Tile{e, (qb - e * p.tiles_m) * kTileM, nb * kTileN, p.k_resident ? e * p.tiles_n + nb : qb};
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Grid: G CTAs; CTA c runs tiles c, c + G, c + 2G, ..., so that at any moment the CTAs write neighbouring tiles
// (the DRAM sees long runs of each score row). One operand block stays in shared memory while consecutive tiles of
// the CTA share it, the other streams through the ring: with G a multiple of tiles_n every tile of a CTA has the
// same key block (K stays, Q streams: k_resident); with G <= tiles_n consecutive tiles are mostly in one row block
// (Q stays, K streams). Q and K tiles have the same layout (128 rows x D), so the two roles share the buffers.
template <int D, typename T>
__global__ void __launch_bounds__(kThreads, 1)
    scores_sm90(const __grid_constant__ CUtensorMap tmq, const __grid_constant__ CUtensorMap tmk,
                const __grid_constant__ CUtensorMap tms, const ScoresParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = ScoresLayout<D>;
    constexpr int kStages = L::kStages;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sR = base, bars = base + L::kBars;  // the resident block
    const uint32_t r_full = bars, r_empty = bars + 8;
    auto full = [&](int s) { return bars + 8u * (2 + s); };
    auto empty = [&](int s) { return bars + 8u * (2 + kStages + s); };
    auto stage = [&](int s) { return base + L::kK + s * L::kKBytes; };
    const bool k_res = p.k_resident != 0;

    if (threadIdx.x == 0) {
        mbar_init(r_full, 1);
        mbar_init(r_empty, 8);  // one arrival per consumer warp
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), 1);   // the producer's expect-tx arrival; the bytes complete the phase
            mbar_init(empty(s), 8);  // one arrival per consumer warp
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x == 0) {
            prefetch_map(&tmq);
            prefetch_map(&tmk);
            const CUtensorMap* res_map = k_res ? &tmk : &tmq;
            const CUtensorMap* ring_map = k_res ? &tmq : &tmk;
            int s = 0, r_now = -1;
            uint32_t ph = 0, rph = 0;
            for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
                const Tile x = tile_at(p, t);
                const int r_row = k_res ? x.n0 : x.m0, s_row = k_res ? x.m0 : x.n0;
                if (x.rid != r_now) {  // a new resident block, once the consumers are done with the last one
                    mbar_wait(r_empty, rph ^ 1);
                    mbar_expect_tx(r_full, L::kQBytes);
                    tma_load_5d(sR, res_map, r_full, 0, r_row, 0, 0, x.e);
                    rph ^= 1;
                    r_now = x.rid;
                }
                mbar_wait(empty(s), ph ^ 1);  // the consumers released this stage's previous tile
                mbar_expect_tx(full(s), L::kKBytes);
                tma_load_5d(stage(s), ring_map, full(s), 0, s_row, 0, 0, x.e);
                ring_next<kStages>(s, ph);
            }
        }
    } else {
        setmaxnreg_inc<kConsumerRegs>();
        const int c = wg - 1;
        const int tid = threadIdx.x - 128 * wg;
        const int warp = tid / 32, lane = tid % 32;
        const int rw = 16 * warp + lane / 4;  // row of d[4j + 0..1] within the warpgroup's 64; d[4j + 2..3]: rw + 8
        // This thread's bytes in a box: column 8j + 2(lane % 4) of the tile lies in box j / 4, 16-byte chunk
        // 2(j % 4) + (lane % 4) / 2, at 8 (lane % 2) bytes into the chunk; chunk q of row r is stored at q ^ (r % 8).
        const uint32_t epi0 = base + L::kEpi + c * kEpiBuffers * L::kEpiBytes;
        const uint32_t row_a = rw * 128 + 8 * (lane & 1), row_b = row_a + 8 * 128;
        const int sw = rw & 7;  // rw + 8 has the same swizzle phase
        const int half = (lane & 3) >> 1;
        const float alpha = p.alpha;
        if (tid == 0) prefetch_map(&tms);
        const uint32_t wg_rows = 64 * c * 128;  // this warpgroup's 64 Q rows in every slab (8 atoms, 1024-aligned)
        float acc[kTileN / 2];
        int s = 0, r_now = -1, buf = 0;
        uint32_t ph = 0, rph = 0;
        for (int t = blockIdx.x; t < p.tiles; t += gridDim.x) {
            const Tile x = tile_at(p, t);
            if (x.rid != r_now) {
                if (r_now >= 0 && lane == 0) mbar_arrive(r_empty);  // the last block's MMAs have all completed
                mbar_wait(r_full, rph);
                rph ^= 1;
                r_now = x.rid;
            }
            mbar_wait(full(s), ph);
            const uint32_t q_wg = (k_res ? stage(s) : sR) + wg_rows, k_base = k_res ? sR : stage(s);
            const SmemDesc qd = smem_desc(q_wg, 16).uniform(), kd = smem_desc(k_base, 16).uniform();
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk)
                wgmma_ss<kTileN, T>(acc, qd.at(kstep_offset(kk, L::kSlabQ)),
                                    kd.at(kstep_offset(kk, L::kSlabK)), kk > 0);
            wgmma_commit();
            wgmma_wait<0>();
            fence_regs(acc);
            if (lane == 0) mbar_arrive(empty(s));
            ring_next<kStages>(s, ph);
            // this buffer is free once the stores issued from it kEpiBuffers tiles ago have read it
            const uint32_t epi = epi0 + buf * L::kEpiBytes;
            if (tid == 0) bulk_wait_read<kEpiBuffers - 1>();
            bar_sync(1 + c, 128);
#pragma unroll
            for (int j = 0; j < kTileN / 8; ++j) {
                const uint32_t off = epi + (j / 4) * L::kBoxBytes + (((2 * (j % 4) + half) ^ sw) << 4);
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(off + row_a), "f"(acc[4 * j] * alpha),
                             "f"(acc[4 * j + 1] * alpha)
                             : "memory");
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(off + row_b), "f"(acc[4 * j + 2] * alpha),
                             "f"(acc[4 * j + 3] * alpha)
                             : "memory");
            }
            fence_async_smem();
            bar_sync(1 + c, 128);
            if (tid == 0) {
#pragma unroll
                for (int b = 0; b < 4; ++b)
                    tma_store_3d(&tms, epi + b * L::kBoxBytes, x.n0 + 32 * b, x.m0 + 64 * c, x.e);
                bulk_commit();
            }
            buf = buf + 1 == kEpiBuffers ? 0 : buf + 1;
        }
        if (tid == 0) bulk_wait_read<0>();  // the buffers outlive their last stores' reads
    }
#endif
}

// ---- host side ----------------------------------------------------------------------------------------------------

// The scores (batch, rows, cols) FP32 as 3-D (cols, rows, batch): one box of (32, 64, 1) is a store's 64 rows of
// 128 bytes.
bool make_scores_map(CUtensorMap* map, float* ptr, int64_t batch, int64_t rows, int64_t cols, int64_t ld,
                     int64_t bs) {
    const cuuint64_t dims[3] = {cuuint64_t(cols), cuuint64_t(rows), cuuint64_t(batch)};
    const cuuint64_t strides[2] = {cuuint64_t(rows == 1 ? 16 : ld * 4), cuuint64_t(batch == 1 ? 16 : bs * 4)};
    const cuuint32_t box[3] = {32, 64, 1};
    const cuuint32_t elem[3] = {1, 1, 1};
    return encode_tiled()(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 3, ptr, dims, strides, box, elem,
                          CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                          CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int D, typename T>
cudaError_t launch_scores(const attn_lt_scores_args& a, cudaStream_t stream) {
    using L = ScoresLayout<D>;
    constexpr CUtensorMapDataType dt = tma_dtype<T>();
    alignas(64) CUtensorMap mq, mk, ms;
    // Q and K (batch, rows, D) as make_map's (B, H, S, D) with one head: a box is a 128-row tile's slabs
    if (!make_map(&mq, dt, a.q, a.batch, 1, a.rows, D, a.q_bs, 0, a.q_ld, kTileM) ||
        !make_map(&mk, dt, a.k, a.batch, 1, a.cols, D, a.k_bs, 0, a.k_ld, kTileN) ||
        !make_scores_map(&ms, a.s, a.batch, a.rows, a.cols, a.s_ld, a.s_bs))
        return static_cast<cudaError_t>(ATTN_LT_ERR_TENSOR_MAP);
    const auto kernel = scores_sm90<D, T>;
    cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), L::kSmem);
    if (err != cudaSuccess) return err;
    const DeviceInfo* dev = nullptr;
    err = current_device_info(&dev);
    if (err != cudaSuccess) return err;
    ScoresParams p{};
    p.tiles_n = static_cast<int>((a.cols + kTileN - 1) / kTileN);
    p.tiles_m = static_cast<int>((a.rows + kTileM - 1) / kTileM);
    p.tiles = static_cast<int>(int64_t(p.tiles_n) * p.tiles_m * a.batch);
    p.alpha = a.alpha;
    // A grid that is a multiple of the key blocks keeps K (one key block a CTA; at least half the SMs); with more
    // key blocks than SMs every SM runs, each keeping Q across the key blocks of a row block.
    int grid = dev->sms;
    if (p.tiles_n <= dev->sms) {
        grid = p.tiles_n * (dev->sms / p.tiles_n);
        p.k_resident = 1;
    }
    if (grid > p.tiles) grid = p.tiles;  // still a multiple of tiles_n when K is kept: tiles = tiles_n x row blocks
    kernel<<<grid, kThreads, L::kSmem, stream>>>(mq, mk, ms, p);
    return cudaGetLastError();
}

}  // namespace

extern "C" int attn_lt_scores_sm90_supported(int64_t D) {
    if (D != 64 && D != 128) return 0;
    return attn_lt_flash_sm90_supported();
}

extern "C" int attn_lt_scores_sm90(const attn_lt_scores_args* a, void* stream) {
    if (a == nullptr || a->q == nullptr || a->k == nullptr || a->s == nullptr) return ATTN_LT_ERR_ARGS;
    if (a->rows <= 0 || a->cols <= 0 || a->batch <= 0) return ATTN_LT_ERR_ARGS;
    if (a->D != 64 && a->D != 128) return ATTN_LT_ERR_HEAD_DIM;
    if (a->dtype != ATTN_LT_F16 && a->dtype != ATTN_LT_BF16) return ATTN_LT_ERR_DTYPE;
    // tile numbers t and t + grid stay below 2^31 (the kernel's int tile loop)
    constexpr int64_t kMaxTiles = (int64_t(1) << 31) - (int64_t(1) << 20);
    if (a->rows >= (int64_t(1) << 31) || a->cols >= (int64_t(1) << 31) || a->batch >= (int64_t(1) << 31) ||
        ((a->rows + kTileM - 1) / kTileM) * ((a->cols + kTileN - 1) / kTileN) > kMaxTiles / a->batch)
        return ATTN_LT_ERR_LENGTH;
    if (!aligned16(a->q) || !aligned16(a->k) || !aligned16(a->s)) return ATTN_LT_ERR_ALIGNMENT;
    // TMA: row and block strides multiples of 16 bytes below 2^40 bytes
    if (!stride_ok(a->rows, a->q_ld) || !stride_ok(a->batch, a->q_bs) || !stride_ok(a->cols, a->k_ld) ||
        !stride_ok(a->batch, a->k_bs) || !stride_ok(a->rows, a->s_ld, 4) || !stride_ok(a->batch, a->s_bs, 4) ||
        a->s_ld < (a->cols + 3) / 4 * 4)  // the stores write a row's last 16-byte chunk whole
        return ATTN_LT_ERR_STRIDES;
    cudaError_t err = check_device();
    if (err != cudaSuccess) return static_cast<int>(err);
    if (encode_tiled() == nullptr) return static_cast<int>(cudaErrorNotSupported);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (a->D == 64)
        err = a->dtype == ATTN_LT_BF16 ? launch_scores<64, __nv_bfloat16>(*a, s) : launch_scores<64, __half>(*a, s);
    else
        err = a->dtype == ATTN_LT_BF16 ? launch_scores<128, __nv_bfloat16>(*a, s) : launch_scores<128, __half>(*a, s);
    return static_cast<int>(err);
}
