// The fused short path: FlashAttention-2 style forward with warp-level tensor-core MMA (mma.sync m16n8k16).
//
// A CTA of 4 warps owns 128 query rows (two m16 tiles a warp, so every K and V fragment feeds two MMAs) of one
// (batch, query head); Q fragments are re-read from shared memory at each k step.
// K and V tiles of 64 keys stream through a double-buffered, XOR-swizzled shared-memory ring by cp.async
// (zero-filled past Sk). Per tile: S = Q K^T (fp32), scale and mask, online softmax in the exp2 domain, P converted
// in registers to the A operand of O += P V (V read with ldmatrix.trans). GQA reads the kv head h / (Hq / Hkv)
// without copying; causal is bottom-right aligned and stops at the last key tile a block needs.
#include "attn_lt.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kMT = 2;                      // m16 row tiles a warp owns: each K/V fragment feeds kMT MMAs
constexpr int kBlockM = kWarps * 16 * kMT;  // 128 query rows a CTA
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

template <typename T>
__device__ __forceinline__ unsigned pack2(float lo, float hi);
template <>
__device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
template <>
__device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
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

template <int D, typename T>
__global__ void __launch_bounds__(kThreads, D == 64 ? 2 : 1) flash_fwd(const attn_lt_flash_args a) {
    extern __shared__ __align__(128) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);
    T* sK = sQ + kBlockM * D;      // [2][kBlockN * D]
    T* sV = sK + 2 * kBlockN * D;  // [2][kBlockN * D]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest (causal) blocks first
    const int64_t bh = blockIdx.y, b = bh / a.Hq, h = bh % a.Hq, hk = h / (a.Hq / a.Hkv);
    const int m0 = m_block * kBlockM;  // lengths are below 2^31 (checked on the host)
    const T* q = static_cast<const T*>(a.q) + b * a.q_sb + h * a.q_sh + int64_t(m0) * a.q_ss;
    const T* k = static_cast<const T*>(a.k) + b * a.k_sb + hk * a.k_sh;
    const T* v = static_cast<const T*>(a.v) + b * a.v_sb + hk * a.v_sh;
    const int Sq = static_cast<int>(a.Sq), Sk = static_cast<int>(a.Sk);
    const int m_valid = min(kBlockM, Sq - m0);
    const int shift = Sk - Sq;  // causal: key j visible to query i iff j <= i + shift
    int n_tiles = (Sk + kBlockN - 1) / kBlockN;
    if (a.causal) n_tiles = m0 + m_valid - 1 + shift < 0 ? 0 : min(n_tiles, (m0 + m_valid - 1 + shift) / kBlockN + 1);

    // Rows of this thread: for m tile t, row (warp * kMT + t) * 16 + lane / 4 and that + 8.
    int row[kMT][2];
#pragma unroll
    for (int t = 0; t < kMT; ++t) {
        row[t][0] = m0 + (warp * kMT + t) * 16 + lane / 4;
        row[t][1] = row[t][0] + 8;
    }

    load_tile<D>(sQ, q, a.q_ss, kBlockM, m_valid);
    if (n_tiles > 0) {
        load_tile<D>(sK, k, a.k_ss, kBlockN, min(kBlockN, Sk));
        load_tile<D>(sV, v, a.v_ss, kBlockN, min(kBlockN, Sk));
    }
    cp_async_commit();

    float o[kMT][D / 8][4];
    float m[kMT][2], l[kMT][2];
#pragma unroll
    for (int t = 0; t < kMT; ++t) {
#pragma unroll
        for (int d = 0; d < D / 8; ++d) o[t][d][0] = o[t][d][1] = o[t][d][2] = o[t][d][3] = 0.f;
        m[t][0] = m[t][1] = -INFINITY;
        l[t][0] = l[t][1] = 0.f;
    }
    const float sl2 = a.scale * kLog2e;

    for (int it = 0; it < n_tiles; ++it) {
        const int buf = it & 1;
        cp_async_wait<0>();
        __syncthreads();  // tile it (and Q) is in; every warp is done with tile it - 1's buffer
        if (it + 1 < n_tiles) {  // prefetch tile it + 1 into the other buffer
            const int n1 = (it + 1) * kBlockN;
            const int valid = min(kBlockN, Sk - n1);
            load_tile<D>(sK + (buf ^ 1) * kBlockN * D, k + int64_t(n1) * a.k_ss, a.k_ss, kBlockN, valid);
            load_tile<D>(sV + (buf ^ 1) * kBlockN * D, v + int64_t(n1) * a.v_ss, a.v_ss, kBlockN, valid);
            cp_async_commit();
        }
        const T* tK = sK + buf * kBlockN * D;
        const T* tV = sV + buf * kBlockN * D;
        const int n0 = it * kBlockN;

        // S = Q K^T: kMT x (16 rows x 64 keys) a warp; Q fragments re-read from shared memory every k step.
        float s[kMT][kBlockN / 8][4];
#pragma unroll
        for (int t = 0; t < kMT; ++t)
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) s[t][j][0] = s[t][j][1] = s[t][j][2] = s[t][j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            unsigned qf[kMT][4];
#pragma unroll
            for (int t = 0; t < kMT; ++t)
                ldsm_x4(qf[t][0], qf[t][1], qf[t][2], qf[t][3],
                        sQ + swz<D>((warp * kMT + t) * 16 + (lane % 16), kk * 16 + (lane / 16) * 8));
#pragma unroll
            for (int j = 0; j < kBlockN / 8; j += 2) {
                unsigned b0, b1, b2, b3;
                ldsm_x4(b0, b1, b2, b3, tK + swz<D>(j * 8 + (lane % 8) + (lane / 16) * 8,
                                                   kk * 16 + ((lane / 8) % 2) * 8));
#pragma unroll
                for (int t = 0; t < kMT; ++t) {
                    mma<T>(s[t][j], qf[t], b0, b1);
                    mma<T>(s[t][j + 1], qf[t], b2, b3);
                }
            }
        }
        // Scale to the exp2 domain, mask the key tail and the causal triangle, online softmax.
        const bool need_mask = n0 + kBlockN > Sk || (a.causal && n0 + kBlockN - 1 > m0 + shift);
        unsigned pf[kMT][kBlockN / 16][4];
#pragma unroll
        for (int t = 0; t < kMT; ++t) {
            float mx[2] = {m[t][0], m[t][1]};
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = s[t][j][e] * sl2;
                    if (need_mask) {
                        const int key = n0 + j * 8 + (lane % 4) * 2 + (e & 1);
                        if (key >= Sk || (a.causal && key > row[t][e >> 1] + shift)) x = -INFINITY;
                    }
                    s[t][j][e] = x;
                }
                mx[0] = fmaxf(mx[0], fmaxf(s[t][j][0], s[t][j][1]));
                mx[1] = fmaxf(mx[1], fmaxf(s[t][j][2], s[t][j][3]));
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            }
            // An all-masked row keeps reference 0, so nothing becomes NaN.
            float ref[2], c[2];
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
            // P = exp2(S - m), straight into A fragments (two n8 tiles = one k16 step of P V).
#pragma unroll
            for (int j = 0; j < kBlockN / 8; ++j) {
                const float p0 = ex2(s[t][j][0] - ref[0]), p1 = ex2(s[t][j][1] - ref[0]);
                const float p2 = ex2(s[t][j][2] - ref[1]), p3 = ex2(s[t][j][3] - ref[1]);
                l[t][0] += p0 + p1;
                l[t][1] += p2 + p3;
                pf[t][j / 2][(j % 2) * 2 + 0] = pack2<T>(p0, p1);
                pf[t][j / 2][(j % 2) * 2 + 1] = pack2<T>(p2, p3);
            }
        }
        // O += P V: V as the B operand, transposed by ldmatrix; each fragment feeds kMT row tiles.
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
#pragma unroll
            for (int d = 0; d < D / 8; d += 2) {
                unsigned b0, b1, b2, b3;
                ldsm_x4_t(b0, b1, b2, b3, tV + swz<D>(kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8,
                                                     d * 8 + (lane / 16) * 8));
#pragma unroll
                for (int t = 0; t < kMT; ++t) {
                    mma<T>(o[t][d], pf[t][kk], b0, b1);
                    mma<T>(o[t][d + 1], pf[t][kk], b2, b3);
                }
            }
        }
    }
    // Row sums across the quad, normalise, store O and LSE.
    T* out = static_cast<T*>(a.o) + b * a.o_sb + h * a.o_sh;
    float* lse = a.lse + (b * a.Hq + h) * a.Sq;
    const int col = (lane % 4) * 2;
#pragma unroll
    for (int t = 0; t < kMT; ++t) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            l[t][r] += __shfl_xor_sync(0xffffffffu, l[t][r], 1);
            l[t][r] += __shfl_xor_sync(0xffffffffu, l[t][r], 2);
        }
        const float inv0 = l[t][0] > 0.f ? 1.f / l[t][0] : 0.f, inv1 = l[t][1] > 0.f ? 1.f / l[t][1] : 0.f;
#pragma unroll
        for (int d = 0; d < D / 8; ++d) {
            if (row[t][0] < Sq)
                *reinterpret_cast<unsigned*>(out + int64_t(row[t][0]) * a.o_ss + d * 8 + col) =
                    pack2<T>(o[t][d][0] * inv0, o[t][d][1] * inv0);
            if (row[t][1] < Sq)
                *reinterpret_cast<unsigned*>(out + int64_t(row[t][1]) * a.o_ss + d * 8 + col) =
                    pack2<T>(o[t][d][2] * inv1, o[t][d][3] * inv1);
        }
        if (lane % 4 == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r)
                if (row[t][r] < Sq) lse[row[t][r]] = l[t][r] > 0.f ? (m[t][r] + log2f(l[t][r])) * kLn2 : -INFINITY;
        }
    }
}

template <int D, typename T>
cudaError_t launch(const attn_lt_flash_args& a, cudaStream_t stream) {
    const size_t smem = size_t(kBlockM + 4 * kBlockN) * D * sizeof(T);
    cudaError_t err = cudaFuncSetAttribute(flash_fwd<D, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) return err;
    const dim3 grid(static_cast<unsigned>((a.Sq + kBlockM - 1) / kBlockM), static_cast<unsigned>(a.B * a.Hq));
    flash_fwd<D, T><<<grid, kThreads, smem, stream>>>(a);
    return cudaGetLastError();
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

extern "C" int attn_lt_flash_fwd(const attn_lt_flash_args* a, void* stream) {
    if (a == nullptr || a->B <= 0 || a->Hq <= 0 || a->Hkv <= 0 || a->Sq <= 0 || a->Sk <= 0) return ATTN_LT_ERR_ARGS;
    if (a->Hq % a->Hkv || a->B * a->Hq > 65535) return ATTN_LT_ERR_HEADS;
    if (a->D != 64 && a->D != 128) return ATTN_LT_ERR_HEAD_DIM;
    if (a->Sq >= (1LL << 30) || a->Sk >= (1LL << 30)) return ATTN_LT_ERR_LENGTH;
    if (!aligned16(a->q) || !aligned16(a->k) || !aligned16(a->v) || !aligned16(a->o)) return ATTN_LT_ERR_ALIGNMENT;
    if ((a->q_ss | a->k_ss | a->v_ss | a->o_ss) % 8 != 0 ||
        (a->q_sb | a->q_sh | a->k_sb | a->k_sh | a->v_sb | a->v_sh | a->o_sb | a->o_sh) % 8 != 0)
        return ATTN_LT_ERR_STRIDES;
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    if (a->dtype == ATTN_LT_BF16)
        return static_cast<int>(a->D == 64 ? launch<64, __nv_bfloat16>(*a, s) : launch<128, __nv_bfloat16>(*a, s));
    if (a->dtype == ATTN_LT_F16)
        return static_cast<int>(a->D == 64 ? launch<64, __half>(*a, s) : launch<128, __half>(*a, s));
    return ATTN_LT_ERR_DTYPE;
}
