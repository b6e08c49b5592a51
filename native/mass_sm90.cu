// The attention mass per key on Hopper (sm_90a): attn_lt_key_mass's pass for many summed rows, with TMA and wgmma.
//
// After the forward call gave each row's LSE, mass[b][h][j] = sum over the summed rows i of exp2(s(i, j) sc - lse(i)
// log2(e)) (attn_lt.h, attn_lt_key_mass). The roles of the forward kernel are transposed: the keys are the rows of
// the MMA (S^T = K Q^T), so that a key's sum over query rows is a row sum, kept in registers across the whole run.
// A CTA of 4 warpgroups owns 192 keys of one (batch, query head). One query head, not its kv head's group: under a
// causal mask the first key blocks hold the most rows, and CTAs of a whole group made them 4x longer than the
// average (H200, B1 H32/8 S16k D 128 causal, the call with the mass: 1.72x the plain call, 1.61x with a head a CTA).
//   * warpgroup 0 is the producer (setmaxnreg.dec): its warp 0 loads the K tile once, then streams the Q tiles
//     of N query rows of its head through a kStages-deep ring (lane 0's TMA copies)
//     with each tile row's -LSE log2(e) (the lanes' loads; -inf for a row past the summed ones or with no visible
//     key): every lane arrives on the stage's "full" mbarrier after its stores, lane 0 with the tile's expect-tx
//     bytes;
//   * warpgroups 1 to 3 (setmaxnreg.inc) each own 64 of the keys, held as wgmma A fragments in registers for the whole
//     run. Per Q tile: S^T (64 keys x N rows, FP32) = K Q^T by wgmma (B: the tile, K-major in shared memory), then P =
//     exp2(S^T sc - lse log2(e)) summed into the thread's two keys (in chains of independent adds). The exponentials
//     (the multi-function unit) bound the pass: three consumer warpgroups keep more warps ready to issue them than two
//     with double-buffered accumulators did (H200: 7-15 % faster), and at D 256 each still has the next tile's wgmma in
//     flight while this one is summed. After the last tile the four lanes of a key reduce by shuffle and one
//     writes: every (head, key) is written once, without atomics.
// Rows are visited from the first one that sees any of the CTA's keys (causal, window) to the last one summed;
// tiles where every row sees every key of the warpgroup take one FMA, one exp2 and one add a score, the others
// (the diagonal, the window's edges, softcap on every tile) decide per score. The grid runs the key blocks with
// the most rows (the first ones, under a causal mask) first. Every consumer thread arrives on a stage's "empty"
// mbarrier once it has read the stage's LSEs.
//
// Shared memory (one 1024-byte aligned block; tiles in the 128-byte swizzle of native/flash_sm90.cu):
//   sK          [D/64 slabs][192 keys][64 elements]
//   sQ[kStages] [D/64 slabs][N rows][64 elements]
//   sL[kStages] [N] FP32: -lse log2(e) of each tile row
//   mbarriers   full_k, full[kStages], empty[kStages]
//
// Preconditions (attn_lt_key_mass checks the arguments; attn_lt_key_mass_sm90 what this kernel adds): sm_90
// device; D 64, 128 or 256; fp16/bf16; no mask; q, k 16-byte aligned with strides TMA takes.
#include "attn_lt.h"

#include <cuda.h>  // CUtensorMap and its enums only: the driver function is fetched at run time (no -lcuda)
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

#include "common.cuh"
#include "sm90.cuh"

constexpr int kConsumers = 3;                    // consumer warpgroups, 64 keys each
constexpr int kThreads = 128 * (kConsumers + 1);  // and the producer warpgroup
constexpr int kKeys = 64 * kConsumers;            // keys a CTA

// setmaxnreg targets: 128 * 24 + 384 * 160 <= 64K, the registers the CTA is launched with (ptxas compiles the
// consumers' code for 160).
constexpr int kProducerRegs = 24, kConsumerRegs = 160;

template <int D>
struct MassLayout {
    static constexpr int N = D == 256 ? 64 : 128;  // query rows a Q tile (the wgmma's N)
    static constexpr int kStages = D == 256 ? 3 : 4;
    // Two accumulators a warpgroup (the next tile's wgmma in flight while this one is summed) where a consumer's
    // registers hold them with the key fragments (D 256: 2 x 32 + 64); else one, the other warpgroups'
    // exponentials covering its wgmma.
    static constexpr bool kDouble = D == 256;
    static constexpr uint32_t kKSlab = kKeys * 128, kQSlab = N * 128;  // bytes of one 64-column slab
    static constexpr uint32_t kKBytes = kKeys * D * 2, kQBytes = N * D * 2;
    static constexpr uint32_t kQ = kKBytes, kL = kQ + kStages * kQBytes, kBars = kL + kStages * N * 4;
    static constexpr uint32_t kBarCount = 1 + 2 * kStages;
    static constexpr size_t kSmem = kBars + 8 * kBarCount + 1024;  // + slack to align the base to 1024 bytes
    static_assert(kSmem <= 227 * 1024, "shared memory over the sm_90 limit");
};

struct MassParams {
    const float* lse;  // FP32 (B, Hq, Sq)
    float* mass;       // FP32 (B, Hq, Sk)
    int Sq, Sk, Hq, B, group;
    int q0;            // the first row summed
    float sc;          // scale * log2(e) (softcap: softcap * log2(e), applied to tanh(s * cap_in))
    float cap_in;      // scale / softcap, or 0 (no softcap)
    Window win;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ float2 ld_shared_f2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
    return v;
}

__device__ __forceinline__ void st_shared_f32(uint32_t addr, float v) {
    asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(v) : "memory");
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// Grid: (key blocks x B x Hq) flattened, the key blocks slowest; block kThreads; shared memory MassLayout<D>::kSmem.
template <int D, typename T>
__global__ void __launch_bounds__(kThreads, 1)
    mass_sm90(const __grid_constant__ CUtensorMap tmq, const __grid_constant__ CUtensorMap tmk, const MassParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using L = MassLayout<D>;
    constexpr int N = L::N, kStages = L::kStages;
    extern __shared__ unsigned char smem_raw[];
    const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
    const uint32_t sK = base, sQ = base + L::kQ, sL = base + L::kL, bars = base + L::kBars;
    const uint32_t full_k = bars;
    auto full = [&](int s) { return bars + 8u * (1 + s); };
    auto empty = [&](int s) { return bars + 8u * (1 + kStages + s); };

    const int bh = static_cast<int>(blockIdx.x % unsigned(p.B * p.Hq));
    const int n0 = static_cast<int>(blockIdx.x / unsigned(p.B * p.Hq)) * kKeys;
    const int b = bh / p.Hq, h = bh % p.Hq, hk = h / p.group;
    const int shift = p.Sk - p.Sq;  // row i's diagonal key: i + shift
    const Window w = p.win;
    // the rows that see any key of [n0, n0 + kKeys) under the window: key j is seen by rows with
    // j - right <= i + shift <= j + left
    const int64_t last_key = min(n0 + kKeys, p.Sk) - 1;
    int64_t lo = p.q0, hi = p.Sq;
    if (w.right >= 0) lo = max(lo, int64_t(n0) - shift - w.right);
    if (w.left >= 0) hi = min(hi, last_key - shift + w.left + 1);
    const int r_lo = static_cast<int>(lo), r_hi = static_cast<int>(max(hi, lo));  // no tile when equal
    const int n_tiles = (r_hi - r_lo + N - 1) / N;  // Q tiles

    if (threadIdx.x == 0) {
        mbar_init(full_k, 1);
        for (int s = 0; s < kStages; ++s) {
            mbar_init(full(s), 32);  // each producer lane's arrival after its LSE stores (lane 0's expect-tx)
            mbar_init(empty(s), 128 * kConsumers);  // every consumer thread's arrival after its reads of the stage
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();

    const int wg = threadIdx.x / 128;
    if (wg == 0) {
        // ---- producer: warp 0 (lane 0 the TMA copies, every lane a share of the tile rows' LSEs) --------------
        setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x >= 32 || n_tiles == 0) return;
        const int lane = threadIdx.x;
        if (lane == 0) {
            prefetch_map(&tmq);
            prefetch_map(&tmk);
            mbar_expect_tx(full_k, L::kKBytes);
            tma_load_5d(sK, &tmk, full_k, 0, n0, 0, hk, b);
        }
        // lane l's rows of tile t: l, l + 32, ... (-inf past the summed rows and for a row that sees no key)
        constexpr int kPer = N / 32;
        const float* lse = p.lse + (int64_t(b) * p.Hq + h) * p.Sq;
        auto lse_of = [&](int rt, float (&v)[kPer]) {
#pragma unroll
            for (int i = 0; i < kPer; ++i) {
                const int r = rt + lane + 32 * i;
                const float x = r < r_hi ? __ldg(lse + r) : -INFINITY;
                v[i] = x == -INFINITY ? -INFINITY : -x * kLog2e;
            }
        };
        int rt = r_lo, s = 0;
        uint32_t ph = 0;
        float v[kPer];
        lse_of(rt, v);
        for (int t = 0; t < n_tiles; ++t) {
            const int trt = rt;
            float cur[kPer];
#pragma unroll
            for (int i = 0; i < kPer; ++i) cur[i] = v[i];
            rt += N;  // the next tile: its LSEs are in flight during this tile's wait
            if (t + 1 < n_tiles) lse_of(rt, v);
            mbar_wait(empty(s), ph ^ 1);  // the consumers released this stage's previous use
#pragma unroll
            for (int i = 0; i < kPer; ++i) st_shared_f32(sL + s * N * 4 + (lane + 32 * i) * 4, cur[i]);
            if (lane == 0) {
                mbar_expect_tx(full(s), L::kQBytes);
                tma_load_5d(sQ + s * L::kQBytes, &tmq, full(s), 0, trt, 0, h, b);
            } else {
                mbar_arrive(full(s));
            }
            ring_next<kStages>(s, ph);
        }
        return;
    }

    // ---- consumers: warpgroup c owns keys [n0 + 64c, n0 + 64c + 64) -------------------------------------------
    setmaxnreg_inc<kConsumerRegs>();
    const int c = wg - 1, tid = threadIdx.x - 128 * wg;
    const int warp = tid / 32, lane = tid % 32;
    const int kc0 = n0 + 64 * c;             // this warpgroup's first key
    const int rw = 16 * warp + lane / 4;    // this thread's keys: kc0 + rw and kc0 + rw + 8
    float* mass = p.mass + (int64_t(b) * p.Hq + h) * p.Sk;
    auto write = [&](float s0, float s1) {  // the sums of this thread's keys, reduced over the quad
        s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
        s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
        s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
        if (lane % 4 == 0) {
            if (kc0 + rw < p.Sk) mass[kc0 + rw] = s0;
            if (kc0 + rw + 8 < p.Sk) mass[kc0 + rw + 8] = s1;
        }
    };
    if (n_tiles == 0) {  // no summed row sees these keys
        write(0.f, 0.f);
        return;
    }

    // the warpgroup's 64 keys as A fragments: k-step kk reads 16 columns of slab kk / 4 (ldmatrix x4: rows
    // 16 warp + lane % 16, 8-column chunk 2 (kk % 4) + lane / 16)
    uint32_t kf[D / 16][4];
    mbar_wait(full_k, 0);
    {
        const int r = 64 * c + 16 * warp + lane % 16;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            ldsm_x4(kf[kk], sK + (kk / 4) * L::kKSlab + swizzled(r, 2 * (kk % 4) + lane / 16));
    }

    const float sc = p.sc, cap_in = p.cap_in;
    const bool capped = cap_in > 0.f;
    auto issue = [&](float (&acc)[N / 2], int s) {
        const SmemDesc qd = smem_desc(sQ + s * L::kQBytes, 16).uniform();
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            wgmma_rs_kmajor<N, T>(acc, kf[kk], qd.at(kstep_offset(kk, L::kQSlab)), kk > 0);
        wgmma_commit();
    };
    // this thread's sums (its columns) over the tiles for keys kc0 + rw ([0]) and + 8 ([1]), in 4 chains each (the
    // adds of one chain wait on each other)
    float sum[2][4] = {};
    int rt = r_lo;  // the first row of the tile being summed
    // Sum the tile at row rt of stage s from acc, release the stage, and write the sums after the last tile.
    auto consume = [&](const float (&acc)[N / 2], int s) {
        const uint32_t l_base = sL + s * N * 4 + 2 * (lane % 4) * 4;
        const int rows_end = min(rt + N, r_hi) - 1;  // the tile's last summed row
        // every summed row of the tile sees both of every thread's keys of this warpgroup (no softcap)
        const bool plain = !capped && (w.right < 0 || kc0 + 63 - (rt + shift) <= w.right) &&
                           (w.left < 0 || rows_end + shift - kc0 <= w.left);
        if (plain) {
#pragma unroll
            for (int j = 0; j < N / 8; ++j) {
                const float2 l = ld_shared_f2(l_base + j * 32);
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    sum[e >> 1][(e & 1) + 2 * (j & 1)] += ex2(fmaf(acc[4 * j + e], sc, (e & 1) ? l.y : l.x));
            }
        } else {
            const int k0 = kc0 + rw;
#pragma unroll
            for (int j = 0; j < N / 8; ++j) {
                const float2 l = ld_shared_f2(l_base + j * 32);
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + (e >> 1) * 8, diag = rt + 8 * j + 2 * (lane % 4) + (e & 1) + shift;
                    const bool seen = (w.right < 0 || key - diag <= w.right) && (w.left < 0 || diag - key <= w.left);
                    const float x = capped ? tanh_approx(acc[4 * j + e] * cap_in) : acc[4 * j + e];
                    sum[e >> 1][(e & 1) + 2 * (j & 1)] += seen ? ex2(fmaf(x, sc, (e & 1) ? l.y : l.x)) : 0.f;
                }
            }
        }
        mbar_arrive(empty(s));
        rt += N;
        if (rt >= r_hi)  // the last tile
            write((sum[0][0] + sum[0][1]) + (sum[0][2] + sum[0][3]), (sum[1][0] + sum[1][1]) + (sum[1][2] + sum[1][3]));
    };

    int s = 0;
    uint32_t ph = 0;
    if constexpr (!L::kDouble) {  // one accumulator: the other warpgroups' work covers this one's wgmma
        float acc[N / 2];
        for (int t = 0; t < n_tiles; ++t) {
            mbar_wait(full(s), ph);
            fence_regs(acc);
            issue(acc, s);
            wgmma_wait<0>();
            fence_regs(acc);
            consume(acc, s);
            ring_next<kStages>(s, ph);
        }
        return;
    }
    float acc0[N / 2], acc1[N / 2];
    auto next_stage = [&]() {
        const int cur = s;
        ring_next<kStages>(s, ph);
        mbar_wait(full(s), ph);
        return cur;
    };
    mbar_wait(full(s), ph);
    issue(acc0, s);
    // Tiles in pairs, tile t in acc0 and t + 1 in acc1; each tile's successor is issued before it is summed. The
    // loop body has no branch around a wgmma (ptxas then tracks which accumulators are in flight).
    int t = 0;
    for (; t + 2 < n_tiles; t += 2) {
        int st = next_stage();
        fence_regs(acc1);
        issue(acc1, s);
        wgmma_wait<1>();
        fence_regs(acc0);
        consume(acc0, st);
        st = next_stage();
        fence_regs(acc0);
        issue(acc0, s);
        wgmma_wait<1>();
        fence_regs(acc1);
        consume(acc1, st);
    }
    if (t + 1 < n_tiles) {  // two tiles left
        const int st = next_stage();
        fence_regs(acc1);
        issue(acc1, s);
        wgmma_wait<1>();
        fence_regs(acc0);
        consume(acc0, st);
        wgmma_wait<0>();
        fence_regs(acc1);
        consume(acc1, s);
    } else {
        wgmma_wait<0>();
        fence_regs(acc0);
        consume(acc0, s);
    }
#else
    __trap();  // compiled for a target other than sm_90a (the build never does); the launcher checks the device
#endif
}

template <int D, typename T>
cudaError_t launch(const attn_lt_mass_args& m, cudaStream_t stream) {
    using L = MassLayout<D>;
    const attn_lt_flash_args& a = m.f;
    constexpr CUtensorMapDataType dt = tma_dtype<T>();
    alignas(64) CUtensorMap mq, mk;
    if (!make_map(&mq, dt, a.q, a.B, a.Hq, a.Sq, D, a.q_sb, a.q_sh, a.q_ss, L::N) ||
        !make_map(&mk, dt, a.k, a.B, a.Hkv, a.Sk, D, a.k_sb, a.k_sh, a.k_ss, kKeys))
        return static_cast<cudaError_t>(ATTN_LT_ERR_TENSOR_MAP);
    MassParams p{};
    p.lse = a.lse;
    p.mass = m.mass;
    p.Sq = static_cast<int>(a.Sq);
    p.Sk = static_cast<int>(a.Sk);
    p.Hq = static_cast<int>(a.Hq);
    p.B = static_cast<int>(a.B);
    p.group = static_cast<int>(a.Hq / a.Hkv);
    p.q0 = static_cast<int>(m.q0);
    p.cap_in = a.softcap > 0.f ? a.scale / a.softcap : 0.f;
    p.sc = (a.softcap > 0.f ? a.softcap : a.scale) * kLog2e;
    p.win = window_of(a);
    const auto kernel = mass_sm90<D, T>;
    const cudaError_t err = opt_in_smem(reinterpret_cast<const void*>(kernel), L::kSmem);
    if (err != cudaSuccess) return err;
    const int64_t blocks = (a.Sk + kKeys - 1) / kKeys * a.B * a.Hq;
    kernel<<<dim3(static_cast<unsigned>(blocks)), kThreads, L::kSmem, stream>>>(mq, mk, p);
    return cudaGetLastError();
}

}  // namespace

extern "C" int attn_lt_key_mass_sm90(const attn_lt_mass_args* m, void* stream) {
    const attn_lt_flash_args& a = m->f;
    if (a.mask_dtype != ATTN_LT_NONE || m->from_scores || a.kv_dtype != ATTN_LT_NONE)
        return static_cast<int>(cudaErrorNotSupported);
    if (!stride_ok(a.B, a.q_sb) || !stride_ok(a.Hq, a.q_sh) || !stride_ok(a.Sq, a.q_ss) ||
        !stride_ok(a.B, a.k_sb) || !stride_ok(a.Hkv, a.k_sh) || !stride_ok(a.Sk, a.k_ss) ||
        (a.Sk + kKeys - 1) / kKeys * a.B * a.Hq >= (int64_t(1) << 31))
        return static_cast<int>(cudaErrorNotSupported);
    // an sm_90 device and the driver's TMA encoder, as attn_lt_flash_sm90_fwd checks them on every call
    if (check_device() != cudaSuccess || encode_tiled() == nullptr) {
        cudaGetLastError();
        return static_cast<int>(cudaErrorNotSupported);
    }
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    const bool bf = a.dtype == ATTN_LT_BF16;
    cudaError_t err;
    switch (a.D) {
        case 64: err = bf ? launch<64, __nv_bfloat16>(*m, s) : launch<64, __half>(*m, s); break;
        case 128: err = bf ? launch<128, __nv_bfloat16>(*m, s) : launch<128, __half>(*m, s); break;
        default: err = bf ? launch<256, __nv_bfloat16>(*m, s) : launch<256, __half>(*m, s); break;
    }
    return static_cast<int>(err);
}
