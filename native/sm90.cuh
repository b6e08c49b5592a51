// Hopper (sm_90a) building blocks of the kernels compiled for it (flash_sm90.cu, scores_sm90.cu): PTX wrappers for
// mbarriers, TMA, setmaxnreg, named barriers and wgmma, the ring advance; on the host the driver's tensor-map
// encoder, the strides TMA accepts (stride_ok), the slab-layout map of a 16-bit (B, H, S, D) tensor (make_map) and
// the device check. Included inside each file's anonymous namespace, after common.cuh.
#pragma once

// The byte offset of 16-byte chunk `chunk` of row `row` in a slab of 128-byte rows in the 128-byte swizzle (8-row
// atoms, the chunk stored at chunk ^ (row % 8)): the layout TMA writes and wgmma reads.
__host__ __device__ constexpr uint32_t swizzled(int row, int chunk) {
    return uint32_t(row * 128 + ((chunk ^ (row & 7)) << 4));
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// ---- PTX wrappers (sm_90a) ------------------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// A ring of N stages: step (s, ph) to the next stage; the barrier parity flips each time the ring wraps.
template <int N>
__device__ __forceinline__ void ring_next(int& s, uint32_t& ph) {
    if (++s == N) {
        s = 0;
        ph ^= 1;
    }
}

// The producer's arrival: also announces the bytes the TMA copies will complete on this barrier.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Wait until the phase of parity `parity` has completed (a fresh barrier counts its phase "1" as completed).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n.reg .pred p;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
            "selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// One TMA box of a 5-D tensor map into shared memory, completing (in bytes) on `bar`.
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3, int c4) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
        : "memory");
}

// One TMA box of a 4-D tensor map into shared memory, completing (in bytes) on `bar`.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1,
                                            int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
        : "memory");
}

// One TMA box from shared memory to a 3-D tensor map (rows and boxes outside the tensor are not written; along the
// first dimension whole 16-byte chunks are: the chunk holding the last element is written whole), in this
// thread's current bulk async-group; the writes the threads made to the box must be fenced first (fence_async_smem).
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(c0), "r"(c1), "r"(c2), "r"(src)
                 : "memory");
}
// The same to a 5-D tensor map.
__device__ __forceinline__ void tma_store_5d(const CUtensorMap* map, uint32_t src, int c0, int c1, int c2, int c3,
                                             int c4) {
    asm volatile("cp.async.bulk.tensor.5d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4, %5}], [%6];\n" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(src)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Wait until at most N of this thread's bulk async-groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Make this thread's generic-proxy writes to shared memory visible to the async proxy (TMA stores).
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// Named barriers among the consumer warpgroups (id 0 is __syncthreads').
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}


// Keep the compiler from moving reads or writes of registers that an in-flight wgmma owns across a wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(r[i][j])::"memory");
}

// Shared-memory matrix descriptor, 128-byte swizzle: start address, leading byte offset (LBO; unused by K-major
// swizzled operands, the slab stride of an MN-major one), stride byte offset (SBO = 1024: the next 8-row atom),
// base offset 0 (every atom starts on a 1024-byte boundary; K-steps inside an atom add 32 bytes to the start).
// A tile's k-steps differ only in the start address, bits 0-13 of the low word in 16-byte units: at(offset) is the
// descriptor `offset` bytes on, one 32-bit add (the start stays below 2^18 bytes, shared memory being 228 KB);
// moved(offset) the same as a descriptor (a stage's tile from the first stage's).
// uniform() broadcasts the low word from lane 0, which lets the compiler keep a tile's descriptors in uniform
// registers (one uniform add a k-step) where the address derives from values it cannot prove warp-uniform (a
// warpgroup or stage index): take it once a tile, in every lane of the warp (where the wgmma that uses it runs).
struct SmemDesc {
    uint32_t lo, hi;
    __device__ __forceinline__ SmemDesc moved(uint32_t offset) const { return {lo + (offset >> 4), hi}; }
    __device__ __forceinline__ uint64_t at(uint32_t offset) const {
        const SmemDesc d = moved(offset);
        return (uint64_t(d.hi) << 32) | d.lo;
    }
    __device__ __forceinline__ SmemDesc uniform() const { return {__shfl_sync(0xffffffffu, lo, 0), hi}; }
};
// The offset of k-step kk (16 columns of 16 bits, or 32 of e4m3: 32 bytes) in a K-major tile of slabs `slab` bytes
// apart, `steps` k-steps a slab (4: rows of 128 bytes; 2: of 64): slab kk / steps, 32 bytes a step into its rows.
__device__ __forceinline__ constexpr uint32_t kstep_offset(int kk, uint32_t slab, int steps = 4) {
    return (kk / steps) * slab + (kk % steps) * 32;
}
__device__ __forceinline__ SmemDesc smem_desc(uint32_t addr, uint32_t lbo) {
    return {((addr & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16), (1024 >> 4) | (1u << 30)};
}
// The same for a tile of 64-byte rows in the 64-byte swizzle (8-row atoms of 512 bytes; the FP8 prefill's D 64).
__device__ __forceinline__ SmemDesc smem_desc64(uint32_t addr) {
    return {((addr & 0x3FFFF) >> 4) | ((16 >> 4) << 16), (512 >> 4) | (2u << 30)};
}

// wgmma operand lists. Accumulator fragment of m64nNk16 (f32), warp w of the warpgroup, lane l:
//   d[4j + 0..1] = D(16w + l/4,     8j + 2(l%4) + 0..1),  d[4j + 2..3] = D(16w + l/4 + 8, 8j + 2(l%4) + 0..1).
// A fragment from registers (k16), 4 x 32-bit, each two 16-bit values (low half = lower column):
//   a[0] = A(16w + l/4, 2(l%4) + 0..1), a[1] = A(16w + l/4 + 8, same), a[2] = A(16w + l/4, 8 + 2(l%4) + 0..1),
//   a[3] = A(16w + l/4 + 8, 8 + ...): the accumulator of columns 16k..16k+15 is the A fragment of k-step k.
#define WG_ACC8(d, b)                                                                                          \
    "+f"(d[(b) + 0]), "+f"(d[(b) + 1]), "+f"(d[(b) + 2]), "+f"(d[(b) + 3]), "+f"(d[(b) + 4]), "+f"(d[(b) + 5]), \
        "+f"(d[(b) + 6]), "+f"(d[(b) + 7])
#define WG_ACC32(d, b) WG_ACC8(d, b), WG_ACC8(d, (b) + 8), WG_ACC8(d, (b) + 16), WG_ACC8(d, (b) + 24)
#define WG_ACC64(d) WG_ACC32(d, 0), WG_ACC32(d, 32)
#define WG_ACC88(d) WG_ACC64(d), WG_ACC8(d, 64), WG_ACC8(d, 72), WG_ACC8(d, 80)
#define WG_ACC96(d) WG_ACC88(d), WG_ACC8(d, 88)
#define WG_ACC128(d) WG_ACC32(d, 0), WG_ACC32(d, 32), WG_ACC32(d, 64), WG_ACC32(d, 96)
#define WG_D32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WG_D64 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63"
#define WG_D88 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
    "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
    "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87"
#define WG_D96 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, " \
    "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, " \
    "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, " \
    "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, " \
    "%78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define WG_D128 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, " \
    "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, " \
    "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, " \
    "%92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, " \
    "%108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, " \
    "%123, %124, %125, %126, %127"

// D (m64 x N, f32) = [D if scale_d] + A (m64 x k16, shared, K-major) * B (k16 x N, shared, K-major).
#define WGMMA_SS(NN, TY, REGS, ACC, IA, IB, IS)                                                          \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS ", 0;\n"                                       \
                 "wgmma.mma_async.sync.aligned.m64n" #NN "k16.f32." TY "." TY " {" REGS "}, %" #IA ", %" #IB \
                 ", p, 1, 1, 0, 0;\n}\n"                                                                  \
                 : ACC                                                                                    \
                 : "l"(da), "l"(db), "r"(scale_d))
template <int N, typename T>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t da, uint64_t db, int scale_d) {
    constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
    static_assert(N == 64 || N == 128 || N == 176 || N == 192, "QK^T tile width");
    if constexpr (N == 64) {
        if constexpr (bf16) WGMMA_SS(64, "bf16", WG_D32, WG_ACC32(d, 0), 32, 33, 34);
        else WGMMA_SS(64, "f16", WG_D32, WG_ACC32(d, 0), 32, 33, 34);
    } else if constexpr (N == 176) {
        if constexpr (bf16) WGMMA_SS(176, "bf16", WG_D88, WG_ACC88(d), 88, 89, 90);
        else WGMMA_SS(176, "f16", WG_D88, WG_ACC88(d), 88, 89, 90);
    } else if constexpr (N == 192) {
        if constexpr (bf16) WGMMA_SS(192, "bf16", WG_D96, WG_ACC96(d), 96, 97, 98);
        else WGMMA_SS(192, "f16", WG_D96, WG_ACC96(d), 96, 97, 98);
    } else {
        if constexpr (bf16) WGMMA_SS(128, "bf16", WG_D64, WG_ACC64(d), 64, 65, 66);
        else WGMMA_SS(128, "f16", WG_D64, WG_ACC64(d), 64, 65, 66);
    }
}

// D (m64 x N, f32) = [D if scale_d] + A (m64 x k16, registers) * B (k16 x N, shared; imm-trans-b TB: 1 N-major,
// 0 K-major).
#define WGMMA_RS(NN, TY, TB, REGS, ACC, A0, A1, A2, A3, IB, IS)                                               \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS ", 0;\n"                                            \
                 "wgmma.mma_async.sync.aligned.m64n" #NN "k16.f32." TY "." TY " {" REGS "}, {%" #A0 ", %" #A1 \
                 ", %" #A2 ", %" #A3 "}, %" #IB ", p, 1, 1, " #TB ";\n}\n"                                     \
                 : ACC                                                                                         \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d))
// D = [D if scale_d] + A (registers) * B (N-major): P V.
template <int N, typename T>
__device__ __forceinline__ void wgmma_rs(float* d, const uint32_t* a, uint64_t db, int scale_d = 1) {
    constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
    static_assert(N == 64 || N == 128 || N == 256, "head dim");
    if constexpr (N == 64) {
        if constexpr (bf16) WGMMA_RS(64, "bf16", 1, WG_D32, WG_ACC32(d, 0), 32, 33, 34, 35, 36, 37);
        else WGMMA_RS(64, "f16", 1, WG_D32, WG_ACC32(d, 0), 32, 33, 34, 35, 36, 37);
    } else if constexpr (N == 128) {
        if constexpr (bf16) WGMMA_RS(128, "bf16", 1, WG_D64, WG_ACC64(d), 64, 65, 66, 67, 68, 69);
        else WGMMA_RS(128, "f16", 1, WG_D64, WG_ACC64(d), 64, 65, 66, 67, 68, 69);
    } else {
        if constexpr (bf16) WGMMA_RS(256, "bf16", 1, WG_D128, WG_ACC128(d), 128, 129, 130, 131, 132, 133);
        else WGMMA_RS(256, "f16", 1, WG_D128, WG_ACC128(d), 128, 129, 130, 131, 132, 133);
    }
}
// D = [D if scale_d] + A (registers) * B (K-major): K Q^T with the keys' fragments held in registers.
template <int N, typename T>
__device__ __forceinline__ void wgmma_rs_kmajor(float* d, const uint32_t* a, uint64_t db, int scale_d) {
    constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
    static_assert(N == 64 || N == 128, "query tile width");
    if constexpr (N == 64) {
        if constexpr (bf16) WGMMA_RS(64, "bf16", 0, WG_D32, WG_ACC32(d, 0), 32, 33, 34, 35, 36, 37);
        else WGMMA_RS(64, "f16", 0, WG_D32, WG_ACC32(d, 0), 32, 33, 34, 35, 36, 37);
    } else {
        if constexpr (bf16) WGMMA_RS(128, "bf16", 0, WG_D64, WG_ACC64(d), 64, 65, 66, 67, 68, 69);
        else WGMMA_RS(128, "f16", 0, WG_D64, WG_ACC64(d), 64, 65, 66, 67, 68, 69);
    }
}

// FP8 (e4m3) wgmma, k32 a step: both operands K-major (e4m3 takes no transpose). A from registers (4 x 32-bit of
// four bytes each, lowest byte the lowest column): a[0] = A(16w + l/4, 4(l%4) + 0..3), a[1] = A(16w + l/4 + 8,
// same), a[2] = A(16w + l/4, 16 + 4(l%4) + 0..3), a[3] = A(16w + l/4 + 8, 16 + ...).
#define WGMMA_SS_E4M3(NN, REGS, ACC, IA, IB, IS)                                                              \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS ", 0;\n"                                          \
                 "wgmma.mma_async.sync.aligned.m64n" #NN "k32.f32.e4m3.e4m3 {" REGS "}, %" #IA ", %" #IB      \
                 ", p, 1, 1;\n}\n"                                                                           \
                 : ACC                                                                                        \
                 : "l"(da), "l"(db), "r"(scale_d))
#define WGMMA_RS_E4M3(NN, REGS, ACC, A0, A1, A2, A3, IB, IS)                                                \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #IS ", 0;\n"                                          \
                 "wgmma.mma_async.sync.aligned.m64n" #NN "k32.f32.e4m3.e4m3 {" REGS "}, {%" #A0 ", %" #A1   \
                 ", %" #A2 ", %" #A3 "}, %" #IB ", p, 1, 1;\n}\n"                                           \
                 : ACC                                                                                      \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d))
// D (m64 x N) = [D if scale_d] + A (m64 x k32, shared) * B (k32 x N, shared): Q K^T in FP8.
template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(float* d, uint64_t da, uint64_t db, int scale_d) {
    static_assert(N == 128 || N == 192 || N == 256, "the FP8 key tile");
    if constexpr (N == 256) WGMMA_SS_E4M3(256, WG_D128, WG_ACC128(d), 128, 129, 130);
    else if constexpr (N == 192) WGMMA_SS_E4M3(192, WG_D96, WG_ACC96(d), 96, 97, 98);
    else WGMMA_SS_E4M3(128, WG_D64, WG_ACC64(d), 64, 65, 66);
}
// D (m64 x N) = [D if scale_d] + A (m64 x k32, registers) * B (k32 x N, shared, K-major): P V in FP8 (V
// transposed).
template <int N>
__device__ __forceinline__ void wgmma_rs_e4m3(float* d, const uint32_t* a, uint64_t db, int scale_d = 1) {
    static_assert(N == 64 || N == 128 || N == 256, "the FP8 head dims");
    if constexpr (N == 64) WGMMA_RS_E4M3(64, WG_D32, WG_ACC32(d, 0), 32, 33, 34, 35, 36, 37);
    else if constexpr (N == 128) WGMMA_RS_E4M3(128, WG_D64, WG_ACC64(d), 64, 65, 66, 67, 68, 69);
    else WGMMA_RS_E4M3(256, WG_D128, WG_ACC128(d), 128, 129, 130, 131, 132, 133);
}

// D (m64 x 256, f32) += A (m64 x k16, shared, K-major) * B (k16 x 256, shared, N-major: imm-trans-b = 1).
template <typename T>
__device__ __forceinline__ void wgmma_ss_vt256(float* d, uint64_t da, uint64_t db) {
#define WGMMA_SS_VT(TY)                                                                                     \
    asm volatile("wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " {" WG_D128 "}, %128, %129, 1, 1, 1, " \
                 "0, 1;\n"                                                                                  \
                 : WG_ACC128(d)                                                                             \
                 : "l"(da), "l"(db))
    if constexpr (std::is_same<T, __nv_bfloat16>::value) WGMMA_SS_VT("bf16");
    else WGMMA_SS_VT("f16");
#undef WGMMA_SS_VT
}

__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr)
                 : "memory");
    return v;
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// ---- host side ----------------------------------------------------------------------------------------------------

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver the runtime already loaded (no link against libcuda); null if unavailable.
EncodeTiled encode_tiled() {
    static const EncodeTiled fn = []() -> EncodeTiled {
        void* f = nullptr;
        cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
                cudaSuccess ||
            found != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            return nullptr;
        }
        return reinterpret_cast<EncodeTiled>(f);
    }();
    return fn;
}

// A stride TMA accepts for elements of `esize` (1, 2 or 4) bytes: that of a dimension of size 1 (never used), or a
// positive multiple of 16 bytes below 2^40 bytes (checked in elements: no overflow).
bool stride_ok(int64_t size, int64_t stride, int64_t esize = 2) {
    return size == 1 || (stride > 0 && stride % (16 / esize) == 0 && stride < (int64_t(1) << 40) / esize);
}

// A (B, H, S, D) tensor of es-byte elements (2, or 1: e4m3) seen as 5-D (c, S, D / c, H, B), c = 128 / es the
// elements of 128 bytes, with byte strides (row, 128, head, batch): one box of (c, rows, D / c, 1, 1) is the slab
// layout (128-byte slabs, 128-byte swizzle) of a tile of `rows` rows. Rows of 64 bytes (e4m3, D 64) are one slab
// in the 64-byte swizzle (c = D). A dimension of size 1 gets a nominal legal stride. box_slabs (0: all D / c): the
// slabs a box spans (1: a box is one slab of `rows` rows, O's stores).
bool make_map(CUtensorMap* map, CUtensorMapDataType dt, const void* ptr, int64_t B, int64_t H, int64_t S, int64_t D,
              int64_t sb, int64_t sh, int64_t ss, uint32_t rows, int64_t es = 2, uint32_t box_slabs = 0) {
    const auto st = [es](int64_t size, int64_t stride) { return cuuint64_t(size == 1 ? 16 : stride * es); };
    const uint32_t c = static_cast<uint32_t>(std::min<int64_t>(128 / es, D));  // 64-byte rows: one 64-byte swizzle
    const cuuint64_t dims[5] = {c, cuuint64_t(S), cuuint64_t(D / c), cuuint64_t(H), cuuint64_t(B)};
    const cuuint64_t strides[4] = {st(S, ss), 128, st(H, sh), st(B, sb)};
    const cuuint32_t box[5] = {c, rows, box_slabs ? box_slabs : cuuint32_t(D / c), 1, 1};
    const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
    return encode_tiled()(map, dt, 5, const_cast<void*>(ptr), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
                          c * es == 128 ? CU_TENSOR_MAP_SWIZZLE_128B : CU_TENSOR_MAP_SWIZZLE_64B,
                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Current device is compute capability 9.0: cudaSuccess, cudaErrorNotSupported, or the runtime's error.
cudaError_t check_device() {
    const DeviceInfo* dev = nullptr;
    const cudaError_t err = current_device_info(&dev);
    if (err != cudaSuccess) return err;
    return dev->major == 9 && dev->minor == 0 ? cudaSuccess : cudaErrorNotSupported;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The TMA element type of fp16 / bf16 (and e4m3, as bytes).
template <typename T>
constexpr CUtensorMapDataType tma_dtype() {
    return sizeof(T) == 1                               ? CU_TENSOR_MAP_DATA_TYPE_UINT8
           : std::is_same<T, __nv_bfloat16>::value ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                   : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}
