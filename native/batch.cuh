// Serving batches (attn_lt_batch_args): the one reading of a request's device metadata every batch kernel uses, and
// the block lookup of a paged cache. Included by common.cuh (inside a kernel file's anonymous namespace).
#ifndef ATTN_LT_BATCH_CUH
#define ATTN_LT_BATCH_CUH

// Rows a kv head (query rows x Hq / Hkv) of one decode block, and of a batch whose requests' one row each needs
// no more (the scores the decode blocks store).
constexpr int kBatchSmallRows = 16;
// The most rows a kv head decode blocks run, a 16-row block for each 16, all reading the same key tiles: an FP8 KV
// cache's dense calls (attn_lt/fused.py's MAX_DECODE_ROWS; more are converted first) and any batch's
// attn_lt_batch_args::decode_rows.
constexpr int kMaxDecodeRows = 64;

// A request as the kernels run it: query rows [q0, q0 + nq) of the packed q and o (nq 0: nothing to write), and
// its visible keys (nk; varlen: rows [k0, k0 + nk) of k and v).
struct BatchRequest {
    int q0, nq, k0, nk;
};

// Request b, its metadata checked (attn_lt_batch_args says what each failure means). `report`: OR the failures
// into a.error (one thread of one CTA a request does, so that a bad request costs one atomic, not thousands).
__device__ __forceinline__ BatchRequest batch_request(const attn_lt_batch_args& a, int b, bool report) {
    BatchRequest r{b, 1, 0, 0};
    int err = 0;
    if (a.cu_q != nullptr) {
        const int q0 = __ldg(a.cu_q + b), q1 = __ldg(a.cu_q + b + 1);
        if (q0 < 0 || q1 < q0 || q1 > a.total_q) err |= ATTN_LT_BATCH_BAD_Q;
        else if (q1 - q0 > a.f.Sq) err |= ATTN_LT_BATCH_Q_CAPACITY;
        r.q0 = q0;
        r.nq = err ? 0 : q1 - q0;
    }
    if (a.cu_k != nullptr) {
        const int k0 = __ldg(a.cu_k + b), k1 = __ldg(a.cu_k + b + 1);
        if (k0 < 0 || k1 < k0 || k1 > a.total_k) err |= ATTN_LT_BATCH_BAD_K;
        else if (k1 - k0 > a.f.Sk) err |= ATTN_LT_BATCH_K_CAPACITY;
        else r.k0 = k0, r.nk = k1 - k0;
    } else {
        const int n = __ldg(a.seqlens_k + b);
        if (n < 0) err |= ATTN_LT_BATCH_BAD_K;
        else if (n > a.f.Sk || n > a.max_blocks * a.block_size) err |= ATTN_LT_BATCH_K_CAPACITY;
        else r.nk = n;
    }
    if (report && err) atomicOr(a.error, err);
    return r;
}

// The parts a request of `keys` keys runs in when the keys are cut in parts of split_keys (0: one part): ceil(keys /
// split_keys), none without keys; with keys = f.Sk, the capacity's parts that size the grid and the partials. Exact
// without overflow for any non-negative keys and split_keys of I (the kernels' int, the host's int64_t).
template <typename I>
__host__ __device__ __forceinline__ I batch_parts(I keys, I split_keys) {
    return keys <= 0 ? 0 : split_keys > 0 ? (keys - 1) / split_keys + 1 : 1;
}

// Whether a block id read from the table names a block of the cache: [0, num_blocks).
__device__ __forceinline__ bool paged_id_ok(const attn_lt_batch_args& a, int id) { return id >= 0 && id < a.num_blocks; }

// The block of a paged cache that holds key j of request b, or -1 when the table's id is out of range (log2_bs: log2
// of the block size; key j is row j % block_size of that block).
__device__ __forceinline__ int paged_block(const attn_lt_batch_args& a, int b, int j, int log2_bs) {
    const int id = __ldg(a.block_table + b * a.bt_stride + (j >> log2_bs));
    return paged_id_ok(a, id) ? id : -1;
}

#endif
