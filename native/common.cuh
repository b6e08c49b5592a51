// Helpers every kernel file of the library shares: constants, shared-memory addresses, exp2, cp.async, packing
// (device), and the launchers' per-device facts and shared-memory opt-in (host, asked of the runtime once).
// Included inside each file's anonymous namespace (internal linkage per translation unit), after attn_lt.h (the
// LSE merge takes attn_lt_flash_args), cuda_bf16.h, cuda_fp16.h, cuda_fp8.h, cuda_runtime.h, <atomic>, <cmath>,
// <mutex> and <vector>.
#ifndef ATTN_LT_COMMON_CUH
#define ATTN_LT_COMMON_CUH

#include <cstdint>
#include <type_traits>

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): scores go to the exp2 domain
constexpr float kLn2 = 0.6931471805599453f;    // ln(2): LSE back to the natural log

// Shared-memory address of a generic pointer into shared memory (what PTX shared-space operands take).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 2^x, the approximate hardware instruction (flush-to-zero).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Division by a divisor fixed for a kernel's run (divisors in [1, 2^31], numerators in [0, 2^31)): a multiply-high,
// an add and a shift (Granlund and Montgomery's round-up method) in place of an integer division's ~20 instructions.
// The magic number is computed on the host, and the kernel reads it from its parameters (the constant bank: no
// registers held). A divisor of 0 (an empty launch's) divides by 1.
struct FastDiv {
    uint32_t mul = 1, shift = 0;  // the default divides by 1
    FastDiv() = default;
    explicit FastDiv(uint32_t d) {
        if (d == 0) d = 1;
        while ((uint64_t(1) << shift) < d) ++shift;  // ceil(log2 d)
        mul = static_cast<uint32_t>(((uint64_t(1) << 32) * ((uint64_t(1) << shift) - d)) / d + 1);
    }
    __device__ __forceinline__ int div(int n) const {
        return static_cast<int>((__umulhi(static_cast<uint32_t>(n), mul) + static_cast<uint32_t>(n)) >> shift);
    }
};

// Four e4m3 values (the low byte first) as two fp16 pairs: lo from bytes 0 and 1, hi from bytes 2 and 3 (the low
// byte in the low half). sm_89 and later convert in hardware, reading each half of x in place.
__device__ __forceinline__ void f16x2x2_of_e4m3x4(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
        : "=r"(lo), "=r"(hi)
        : "r"(x));
#else
    const __half2_raw l = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x & 0xffffu), __NV_E4M3);
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(x >> 16), __NV_E4M3);
    lo = uint32_t(l.x) | (uint32_t(l.y) << 16);
    hi = uint32_t(h.x) | (uint32_t(h.y) << 16);
#endif
}

// FP8 caches' fp16 MMAs take q rounded to fp16 after dividing it by 2^e (exact), e the exponent this returns for
// q's largest magnitude amax: its largest element then lies below 2^14 (fp16 holds it with room), e 0 where it
// already does (inf: e 115).
__device__ __forceinline__ int f16_headroom_exp(float amax) {
    return amax > 16384.f ? ((__float_as_int(amax) >> 23) & 0xff) - 127 - 13 : 0;
}

// The lazy softmax reference of both fused kernels: a row keeps its reference m (P = exp2(s - m)) while a tile's max
// passes it by at most this (exp2 units; P then stays below 2^8, which fp16/bf16 P and the FP32 sums hold), so that
// O is rescaled only when a row's max moves further.
constexpr float kLazyRescale = 8.f;

// 16-byte asynchronous copy global -> shared (bypassing L1); `bytes` < 16 zero-fills the rest (0: all zeros).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int bytes = 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Wait until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Two floats rounded to one 32-bit pair of T (bf16 or fp16), `lo` in the low half: an MMA operand or two outputs.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
}

// Two adjacent keys of a mask row (p: the first, aligned to the pair) in the exp2 domain: 0 or -inf for a bool mask
// (true = attend), else the additive value times log2(e). M: the mask's element type (bool, __half,
// __nv_bfloat16, float).
template <typename M>
__device__ __forceinline__ float2 mask_pair_of(const unsigned char* p) {
    if constexpr (std::is_same<M, bool>::value) {
        return make_float2(p[0] ? 0.f : -INFINITY, p[1] ? 0.f : -INFINITY);
    } else {
        float2 x;
        if constexpr (std::is_same<M, __half>::value) x = __half22float2(*reinterpret_cast<const __half2*>(p));
        else if constexpr (std::is_same<M, __nv_bfloat16>::value)
            x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
        else x = *reinterpret_cast<const float2*>(p);
        return make_float2(x.x * kLog2e, x.y * kLog2e);
    }
}

// The current device's compute capability, SM count, shared memory an SM (bytes; CTAs also take reserved_smem
// each), the shared memory a block may opt in to (bytes) and peak DRAM bandwidth an SM (GB/s, from the memory clock
// and bus width); each of the last four 0 where the runtime does not say.
// A launcher asks on every call (a decode step's hot path), the runtime once per device.
struct DeviceInfo {
    int major, minor, sms, smem_per_sm, reserved_smem, smem_optin;  // smem_optin: a block's opt-in maximum
    double dram_gbps_per_sm;
};

inline cudaError_t current_device_info(const DeviceInfo** out) {
    constexpr int kMaxDevices = 64;
    static DeviceInfo info[kMaxDevices];
    static std::atomic<bool> known[kMaxDevices];
    static std::mutex lock;
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    if (dev < 0 || dev >= kMaxDevices) return cudaErrorInvalidDevice;
    if (!known[dev].load(std::memory_order_acquire)) {
        std::lock_guard<std::mutex> g(lock);
        if (!known[dev].load(std::memory_order_relaxed)) {
            DeviceInfo d{};
            err = cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev);
            if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, dev);
            if (err == cudaSuccess) err = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev);
            if (err != cudaSuccess) return err;
            // A runtime that does not say leaves these 0, and the failed query's error is not left for the caller's
            // next launch. The opt-in bounds the softmax's ring (which then takes the smallest opt-in of a supported
            // GPU); the others only tuning rules (which then keep their defaults).
            if (cudaDeviceGetAttribute(&d.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) {
                (void)cudaGetLastError();
                d.smem_optin = 0;
            }
            int khz = 0, bits = 0;  // double data rate: two transfers a clock
            if (cudaDeviceGetAttribute(&d.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) !=
                    cudaSuccess ||
                cudaDeviceGetAttribute(&d.reserved_smem, cudaDevAttrReservedSharedMemoryPerBlock, dev) !=
                    cudaSuccess ||
                cudaDeviceGetAttribute(&khz, cudaDevAttrMemoryClockRate, dev) != cudaSuccess ||
                cudaDeviceGetAttribute(&bits, cudaDevAttrGlobalMemoryBusWidth, dev) != cudaSuccess) {
                (void)cudaGetLastError();
                d.smem_per_sm = d.reserved_smem = 0;
            } else if (d.sms > 0) {
                d.dram_gbps_per_sm = 2.0 * khz * 1e3 * bits / 8 / 1e9 / d.sms;
            }
            info[dev] = d;
            known[dev].store(true, std::memory_order_release);
        }
    }
    *out = &info[dev];
    return cudaSuccess;
}

// Let `kernel` take `bytes` of dynamic shared memory on the current device: cudaFuncSetAttribute once per kernel,
// device and larger size, not on every launch. The opt-in only grows, so that a smaller configuration never lowers
// it under a larger one already launched.
inline cudaError_t opt_in_smem(const void* kernel, size_t bytes) {
    struct Known {
        const void* kernel;
        int dev;
        size_t bytes;
    };
    static std::mutex lock;
    static std::vector<Known> known;
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    std::lock_guard<std::mutex> g(lock);
    for (Known& k : known) {
        if (k.kernel != kernel || k.dev != dev) continue;
        if (k.bytes >= bytes) return cudaSuccess;
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
        if (err == cudaSuccess) k.bytes = bytes;
        return err;
    }
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    if (err == cudaSuccess) known.push_back({kernel, dev, bytes});
    return err;
}

// ---- the LSE merge of split partials (native/flash.cu's key splits, native/flash_sm90.cu's MLA decode, the decode
// blocks of a serving batch) ------------------------------------------------------------------------------------
// Partials: o_part [splits][rows][D] FP32, normalised; lse_part [splits][rows], natural log. Dense calls: rows are
// (b, h, position) of (B, Hq, Sq). Serving batches: rows are (b, kv head, decode-block row) of (B, Hkv, 16) (MLA:
// (b, query head) of (B, Hq)), and a request's part count follows from its keys.
#include "batch.cuh"

// Where a merged row goes: the output row, its LSE (or null), how many parts it has (0: zeros and LSE -inf), and the
// row's attention sink (natural log; -inf: none) that joins the denominator; out null: no row to write.
template <typename T>
struct MergeTarget {
    T* out;
    float* lse;
    int parts;
    float sink;
};
__device__ __forceinline__ float sink_of(const attn_lt_flash_args& a, int64_t head) {
    return a.sinks != nullptr ? a.sinks[head] : -INFINITY;
}

__host__ __device__ __forceinline__ const attn_lt_flash_args& flash_of(const attn_lt_flash_args& a) { return a; }
__host__ __device__ __forceinline__ const attn_lt_flash_args& flash_of(const attn_lt_batch_args& a) { return a.f; }

// ---- the attention variants (attn_lt_flash_args: window, softcap, sinks) -------------------------------------------

// The window's edges as the kernels apply them, relative to a row's bottom-right aligned diagonal (key i + Sk - Sq
// for query i): keys in [diag - left, diag + right] are visible; -1: unbounded. Causal is the right edge 0. Edges
// are capped at 2^30 (lengths stay below it: such a window holds every key), so that diag -/+ edge stays in int.
struct Window {
    int left, right;
};
__host__ __device__ __forceinline__ Window window_of(const attn_lt_flash_args& a) {
    constexpr int kCap = 1 << 30;
    return {a.window_left < kCap ? a.window_left : kCap, a.causal ? 0 : a.window_right < kCap ? a.window_right : kCap};
}
// Whether the launch arguments' variant fields are ones a kernel can take (edges >= -1, softcap >= 0 and finite).
__host__ __forceinline__ bool variant_ok(const attn_lt_flash_args& a) {
    return a.window_left >= -1 && a.window_right >= -1 && a.softcap >= 0.f && a.softcap < INFINITY &&
           reinterpret_cast<uintptr_t>(a.sinks) % 4 == 0;
}
// Whether any variant is asked for (the kernels that run none refuse these arguments).
__host__ __forceinline__ bool has_variant(const attn_lt_flash_args& a) {
    return a.window_left >= 0 || (!a.causal && a.window_right >= 0) || a.softcap > 0.f || a.sinks != nullptr;
}
// A row block's key tiles [lo, hi) of `tile` keys under the window, for query rows [p_first, p_last] (bottom-right
// aligned by shift = Sk - Sq); hi comes in as the count of key tiles and is cut by the last row's right edge, lo is
// set from the first row's left edge (lo <= hi).
__host__ __device__ __forceinline__ void window_tiles(Window w, int p_first, int p_last, int shift, int tile,
                                                      int& lo, int& hi) {
    if (w.right >= 0) {
        const int last = p_last + shift + w.right;
        hi = last < 0 ? 0 : min(hi, last / tile + 1);
    }
    lo = 0;
    if (w.left >= 0) {
        const int first = p_first + shift - w.left;
        lo = first <= 0 ? 0 : min(hi, first / tile);
    }
}

__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// A row's softmax finished with an attention sink: (1 / the denominator as it multiplies O, the LSE in natural log)
// from the running max m and sum l in the exp2 domain and the sink s2 (exp2 domain; -inf: none). No visible key:
// O 0 and the LSE the sink's (-inf without one).
__device__ __forceinline__ float2 finish_row(float m, float l, float s2) {
    if (s2 == -INFINITY) return l > 0.f ? make_float2(1.f / l, (m + log2f(l)) * kLn2) : make_float2(0.f, -INFINITY);
    if (!(l > 0.f)) return make_float2(0.f, s2 * kLn2);
    const float top = fmaxf(m, s2), a = ex2(m - top), t = fmaf(l, a, ex2(s2 - top));
    return make_float2(a / t, (top + log2f(t)) * kLn2);
}

// The parts a dense call's keys run in: the plan's `splits` (which sized the grid and the partials' workspace for
// long keys) cut to what Sk keys fill at kMinSplitTiles tiles of 64 keys a part, at least one. The key length is
// data: one plan runs every step of a growing decode loop, each launch cut to its keys. The launchers apply it to
// the arguments (attn_lt_flash_args.splits) before launching, so the kernels and the merge read the cut count.
constexpr int64_t kMinSplitTiles = 4;
__host__ __device__ __forceinline__ int32_t dense_parts(int64_t Sk, int64_t splits) {
    const int64_t fill = (Sk + 63) / 64 / kMinSplitTiles;
    return static_cast<int32_t>(splits < fill ? (splits > 1 ? splits : 1) : (fill > 1 ? fill : 1));
}

__host__ __device__ __forceinline__ int64_t merge_rows(const attn_lt_flash_args& a) { return a.B * a.Hq * a.Sq; }
__host__ __device__ __forceinline__ int64_t merge_rows(const attn_lt_batch_args& a) {
    return a.f.B * a.f.Hkv * a.decode_rows;
}
// The decode blocks' rows a (request, kv head) of a batch's partials (attn_lt_batch_args::decode_rows, as the plan
// set them; batch_status checks them); a dense call has none.
__host__ __device__ __forceinline__ int decode_rows_of(const attn_lt_flash_args&) { return 0; }
__host__ __device__ __forceinline__ int decode_rows_of(const attn_lt_batch_args& a) { return a.decode_rows; }

template <typename T>
__device__ __forceinline__ MergeTarget<T> merge_target(const attn_lt_flash_args& a, int64_t row) {
    const int64_t pos = row % a.Sq, bh = row / a.Sq, h = bh % a.Hq, b = bh / a.Hq;
    return {static_cast<T*>(a.o) + b * a.o_sb + h * a.o_sh + pos * a.o_ss, a.lse ? a.lse + row : nullptr, a.splits,
            sink_of(a, h)};
}
// A batch row: decode-block row rr of kv head hk of request r (query row rr / g of head hk * g + rr % g), merged
// only for requests the decode blocks ran (at most decode_rows rows a kv head) in more than one part of
// split_keys keys (a request of one part wrote its rows itself).
template <typename T>
__device__ __forceinline__ MergeTarget<T> batch_row_target(const attn_lt_batch_args& a, const BatchRequest& r,
                                                           int64_t hk, int rr) {
    const int g = static_cast<int>(a.f.Hq / a.f.Hkv);
    const int parts = batch_parts(r.nk, a.split_keys);
    if (r.nq * g > a.decode_rows || rr >= r.nq * g || parts == 1) return {nullptr, nullptr, 0, -INFINITY};
    const int64_t head = hk * g + rr % g, q = r.q0 + rr / g;
    return {static_cast<T*>(a.f.o) + q * a.f.o_ss + head * a.f.o_sh,
            a.f.lse ? a.f.lse + head * a.total_q + q : nullptr, parts, sink_of(a.f, head)};
}
template <typename T>
__device__ __forceinline__ MergeTarget<T> merge_target(const attn_lt_batch_args& a, int64_t row) {
    const int64_t bk = row / a.decode_rows;
    const BatchRequest r = batch_request(a, static_cast<int>(bk / a.f.Hkv), false);
    return batch_row_target<T>(a, r, bk % a.f.Hkv, static_cast<int>(row % a.decode_rows));
}
// The MLA decode of a paged batch (native/flash_sm90.cu, at most one query row a request): rows are (b, query head)
// of (B, Hq); a request of one part wrote its output itself, one without a row has none (no row to merge).
struct MlaBatch {
    attn_lt_batch_args a;
};
__host__ __device__ __forceinline__ const attn_lt_flash_args& flash_of(const MlaBatch& m) { return m.a.f; }
__host__ __device__ __forceinline__ int64_t merge_rows(const MlaBatch& m) { return m.a.f.B * m.a.f.Hq; }
template <typename T>
__device__ __forceinline__ MergeTarget<T> merge_target(const MlaBatch& m, int64_t row) {
    const attn_lt_batch_args& a = m.a;
    const int64_t h = row % a.f.Hq, b = row / a.f.Hq;
    const BatchRequest r = batch_request(a, static_cast<int>(b), false);
    const int parts = batch_parts(r.nk, a.split_keys);
    if (parts <= 1 || r.nq == 0) return {nullptr, nullptr, 0, -INFINITY};
    return {static_cast<T*>(a.f.o) + r.q0 * a.f.o_ss + h * a.f.o_sh, a.f.lse ? a.f.lse + h * a.total_q + r.q0 : nullptr,
            parts, -INFINITY};
}
__device__ __forceinline__ float merged_lse(float mx, float wsum) {
    return wsum > 0.f ? mx + logf(wsum) : -INFINITY;
}

// A lane's share of the LSE merge of `count` parts of row `row`, part j being part_of(j) of the partials (its LSE at
// lse_part[part * rows + row], its row at o_part[(part * rows + row) * D]): acc (the lane's D / 32 columns) and wsum
// (the weights its lanes read) gain each part's weight exp(lse - mx) times its row. The weights are read a part a
// lane; kBatch parts' rows are loaded before any is added, so that their latencies overlap.
template <int D, typename PartOf>
__device__ __forceinline__ void add_parts(float (&acc)[D / 32], float& wsum, const attn_lt_flash_args& a, int64_t rows,
                                          int64_t row, int count, float mx, PartOf part_of) {
    constexpr int kPer = D / 32;
    constexpr int kBatch = kPer <= 4 ? 8 : kPer <= 8 ? 4 : 2;  // about 16 float2 loads a lane in flight
    const int lane = threadIdx.x % 32;
    for (int base = 0; base < count; base += 32) {
        const int m = min(32, count - base);  // lane j holds the weight of part base + j
        const float li = lane < m ? a.lse_part[part_of(base + lane) * rows + row] : -INFINITY;
        const float wl = li == -INFINITY ? 0.f : ex2((li - mx) * kLog2e);
        wsum += wl;
        for (int j0 = 0; j0 < m; j0 += kBatch) {
            float2 x[kBatch][kPer / 2];
            float w[kBatch];
#pragma unroll
            for (int u = 0; u < kBatch; ++u) {
                w[u] = __shfl_sync(0xffffffffu, wl, (j0 + u) & 31);
                if (j0 + u >= m) w[u] = 0.f;
                const float* op = a.o_part + (part_of(base + j0 + u) * rows + row) * D + lane * kPer;
#pragma unroll
                for (int c = 0; c < kPer / 2; ++c)
                    x[u][c] = w[u] != 0.f ? reinterpret_cast<const float2*>(op)[c] : make_float2(0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < kBatch; ++u)
#pragma unroll
                for (int c = 0; c < kPer / 2; ++c) {
                    acc[2 * c] = fmaf(w[u], x[u][c].x, acc[2 * c]);
                    acc[2 * c + 1] = fmaf(w[u], x[u][c].y, acc[2 * c + 1]);
                }
        }
    }
}

// A merged row, by a warp: its output acc / wsum (the sink's column, which has no value, joining the sum; 0 for a row
// without a visible key), lane l writing columns l * D / 32 on, and lane 0 its LSE.
template <int D, typename T>
__device__ __forceinline__ void write_merged_row(const MergeTarget<T>& target, const float (&acc)[D / 32], float wsum,
                                                 float mx, int lane) {
    constexpr int kPer = D / 32;
    if (target.sink != -INFINITY) wsum += ex2((target.sink - mx) * kLog2e);
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    T* out = target.out + lane * kPer;
#pragma unroll
    for (int c = 0; c < kPer; c += 2) *reinterpret_cast<unsigned*>(out + c) = pack2<T>(acc[c] * inv, acc[c + 1] * inv);
    if (lane == 0 && target.lse != nullptr) *target.lse = merged_lse(mx, wsum);
}

// Join a row's partials by their LSE: one CTA a row, its four warps taking every fourth split, D / 32 columns a
// lane. A partial with LSE -inf (no visible key in its range) weighs nothing; a row with no visible key at all gives
// 0 and LSE -inf. Latency, not bytes, bounds it (a decode step at batch 1 has a few dozen rows and up to 128
// splits): the LSEs are read one split a thread and reduced across the CTA, and each warp loads several of its
// splits' partial rows before adding any, so that a row's loads are in flight together, not one after another.
template <int D, typename T, typename A>
__global__ void __launch_bounds__(128) merge_partials(const A args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // launched early (see merge): wait for the partials
#endif
    constexpr int kPer = D / 32, kWarps = 4;
    __shared__ float s_part[kWarps];
    __shared__ float s_acc[kWarps - 1][D];
    const attn_lt_flash_args& a = flash_of(args);
    const int64_t rows = merge_rows(args);
    const int64_t row = blockIdx.x;
    const MergeTarget<T> target = merge_target<T>(args, row);
    if (target.out == nullptr) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int n = target.parts;
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < n; i += 32 * kWarps) mx = fmaxf(mx, a.lse_part[i * rows + row]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (lane == 0) s_part[warp] = mx;
    __syncthreads();
    mx = fmaxf(fmaxf(fmaxf(s_part[0], s_part[1]), fmaxf(s_part[2], s_part[3])), target.sink);
    __syncthreads();  // s_part is reused for the weights' sums
    float acc[kPer] = {};
    float wsum = 0.f;
    if (mx != -INFINITY) {  // the same for the whole CTA
        const int mine = warp < n ? (n - warp + kWarps - 1) / kWarps : 0;  // splits warp, warp + 4, ...
        add_parts<D>(acc, wsum, a, rows, row, mine, mx, [&](int j) { return int64_t(warp + kWarps * j); });
#pragma unroll
        for (int o = 16; o > 0; o /= 2) wsum += __shfl_xor_sync(0xffffffffu, wsum, o);
    }
    // warps 1-3 hand their sums to warp 0, which writes the row
    if (warp > 0) {
#pragma unroll
        for (int c = 0; c < kPer; ++c) s_acc[warp - 1][lane * kPer + c] = acc[c];
        if (lane == 0) s_part[warp] = wsum;
    }
    __syncthreads();
    if (warp > 0) return;
#pragma unroll
    for (int w = 0; w < kWarps - 1; ++w)
#pragma unroll
        for (int c = 0; c < kPer; ++c) acc[c] += s_acc[w][lane * kPer + c];
    wsum += s_part[1] + s_part[2] + s_part[3];
    write_merged_row<D>(target, acc, wsum, mx, lane);
}

// A serving batch's decode rows (native/flash.cu's decode blocks, at most decode_rows a kv head) from up to
// kRowMergeMaxParts parts (merge_partials takes more): a CTA a (request, kv head), a warp a row (rows warp, warp + 4,
// ... of the request's g * nq), so that the grid is one wave and the rows a request lacks cost nothing (a CTA a row
// would run 16 a kv head, most of them empty, in several waves of latency-bound CTAs). A request of one part wrote
// its rows itself; one without keys gets 0 and LSE -inf (the sink's with one).
constexpr int kRowMergeMaxParts = 32;
template <int D, typename T>
__global__ void __launch_bounds__(128) merge_batch_rows(const attn_lt_batch_args a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // launched early (see merge): wait for the partials
#endif
    constexpr int kPer = D / 32, kWarps = 4;
    const int64_t bk = blockIdx.x;
    const BatchRequest r = batch_request(a, static_cast<int>(bk / a.f.Hkv), false);
    const int n_rows = r.nq * static_cast<int>(a.f.Hq / a.f.Hkv);
    const int64_t rows = merge_rows(a);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int rr = warp; rr < n_rows; rr += kWarps) {
        const MergeTarget<T> target = batch_row_target<T>(a, r, bk % a.f.Hkv, rr);
        if (target.out == nullptr) return;  // the request's rows are merged by none or all of them
        const int64_t row = bk * a.decode_rows + rr;
        const int n = target.parts;
        float mx = target.sink;
        for (int i = lane; i < n; i += 32) mx = fmaxf(mx, a.f.lse_part[i * rows + row]);
#pragma unroll
        for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float acc[kPer] = {};
        float wsum = 0.f;
        if (mx != -INFINITY) {  // the same for the whole warp
            add_parts<D>(acc, wsum, a.f, rows, row, n, mx, [](int j) { return int64_t(j); });
#pragma unroll
            for (int o = 16; o > 0; o /= 2) wsum += __shfl_xor_sync(0xffffffffu, wsum, o);
        }
        write_merged_row<D>(target, acc, wsum, mx, lane);
    }
}

// Wide rows from few splits (MLA decode: 512 columns, 2-8 parts over 4096 rows at B 32): merge_partials above
// gives each split a warp and joins the warps through shared memory, which leaves this case latency-bound (ncu,
// H100, B32 H128 two parts: 22 µs, a seventh of an 8k-key call, at 23 % of the DRAM rate). Here a CTA of D / 4
// threads takes a row, each thread four columns of every split: the LSEs and the 16-byte partial loads of all the
// splits issued at once (one round trip), then weighed; no shared memory and no barrier.
constexpr int kWideMergeMaxSplits = 8;
template <int D, typename T, typename A>
__global__ void __launch_bounds__(D / 4) merge_partials_wide(const A args) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");  // launched early (see merge): wait for the partials
#endif
    constexpr int N = kWideMergeMaxSplits;
    const attn_lt_flash_args& a = flash_of(args);
    const int64_t rows = merge_rows(args);
    const int64_t row = blockIdx.x;
    const MergeTarget<T> target = merge_target<T>(args, row);
    if (target.out == nullptr) return;
    const int n = target.parts;
    float l[N];
    float4 x[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {  // a part without a key wrote zeros and LSE -inf: read, then weighed 0
        l[i] = i < n ? a.lse_part[i * rows + row] : -INFINITY;
        x[i] = i < n ? reinterpret_cast<const float4*>(a.o_part + (i * rows + row) * D)[threadIdx.x]
                     : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float mx = target.sink;
#pragma unroll
    for (int i = 0; i < N; ++i) mx = fmaxf(mx, l[i]);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    float wsum = target.sink == -INFINITY ? 0.f : ex2((target.sink - mx) * kLog2e);
    if (mx != -INFINITY) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
            if (l[i] == -INFINITY) continue;
            const float w = ex2((l[i] - mx) * kLog2e);
            acc.x = fmaf(w, x[i].x, acc.x);
            acc.y = fmaf(w, x[i].y, acc.y);
            acc.z = fmaf(w, x[i].z, acc.z);
            acc.w = fmaf(w, x[i].w, acc.w);
            wsum += w;
        }
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    T* out = target.out + 4 * threadIdx.x;
    *reinterpret_cast<uint2*>(out) = make_uint2(pack2<T>(acc.x * inv, acc.y * inv), pack2<T>(acc.z * inv, acc.w * inv));
    if (threadIdx.x == 0 && target.lse != nullptr) *target.lse = merged_lse(mx, wsum);
}

// The most parts a merged row can have (the wide merge takes up to kWideMergeMaxSplits).
__host__ __forceinline__ int64_t max_parts(const attn_lt_flash_args& a) { return a.splits; }
__host__ __forceinline__ int64_t max_parts(const attn_lt_batch_args& a) {
    return batch_parts<int64_t>(a.f.Sk, a.split_keys);
}
__host__ __forceinline__ int64_t max_parts(const MlaBatch& m) {
    return batch_parts<int64_t>(m.a.f.Sk, m.a.split_keys);
}

// Join the splits. From sm_90 as a programmatic dependent launch: its launch overlaps the split kernel's last
// blocks (a decode step is a few tens of microseconds, of which a dependent launch's latency is several).
template <int D, typename T, typename A>
cudaError_t merge(const A& args, cudaStream_t stream) {
    const DeviceInfo* dev = nullptr;
    const cudaError_t err = current_device_info(&dev);
    if (err != cudaSuccess) return err;
    const attn_lt_flash_args& a = flash_of(args);
    const int64_t out_rows = merge_rows(args);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(out_rows));  // one CTA a row
    cfg.blockDim = dim3(128);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = dev->major >= 9 ? 1 : 0;
    if constexpr (std::is_same_v<A, attn_lt_batch_args>) {
        if (max_parts(args) <= kRowMergeMaxParts) {  // a CTA a (request, kv head)
            cfg.gridDim = dim3(static_cast<unsigned>(a.B * a.Hkv));
            return cudaLaunchKernelEx(&cfg, merge_batch_rows<D, T>, args);
        }
    }
    if constexpr (D >= 512) {  // 16-byte partial rows (o_part 16-byte aligned) and 8-byte output quads
        if (max_parts(args) <= kWideMergeMaxSplits && reinterpret_cast<uintptr_t>(a.o_part) % 16 == 0 &&
            reinterpret_cast<uintptr_t>(a.o) % 8 == 0 && (a.o_sb | a.o_sh | a.o_ss) % 4 == 0) {
            cfg.blockDim = dim3(D / 4);
            return cudaLaunchKernelEx(&cfg, merge_partials_wide<D, T, A>, args);
        }
    }
    return cudaLaunchKernelEx(&cfg, merge_partials<D, T, A>, args);
}

#endif
