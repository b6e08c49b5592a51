/* attn_lt native library: the C ABI that attn_lt/native.py loads with ctypes.
 *
 * Every launcher returns 0, a cudaError_t, or an attn_lt_status (a failed precondition) as int, after checking
 * the launch; it never synchronizes.
 * Bump ATTN_LT_ABI_VERSION whenever a struct or signature below changes (native.py checks it).
 */
#ifndef ATTN_LT_H
#define ATTN_LT_H
#include <stdint.h>

#define ATTN_LT_ABI_VERSION 23

#ifdef __cplusplus
extern "C" {
#endif

/* Statuses beyond cudaError_t's range: a precondition a launcher checks before any GPU work failed (nothing was
 * launched). attn_lt_error_string names the check. */
enum attn_lt_status {
    ATTN_LT_ERR_ARGS = 10001,       /* null arguments, or a size that is not positive */
    ATTN_LT_ERR_HEADS = 10002,      /* Hq not a multiple of Hkv, or B / Hq beyond the grid's range */
    ATTN_LT_ERR_HEAD_DIM = 10003,   /* a head dim the kernel has no instantiation for */
    ATTN_LT_ERR_LENGTH = 10004,     /* a length or row count beyond the kernel's index range */
    ATTN_LT_ERR_ALIGNMENT = 10005,  /* an address not aligned as the kernel's vector loads need */
    ATTN_LT_ERR_STRIDES = 10006,    /* a stride the kernel cannot take (row strides, multiples of 8 or 4) */
    ATTN_LT_ERR_DTYPE = 10007,      /* a dtype code the kernel does not take */
    ATTN_LT_ERR_MASK = 10008,       /* a mask dtype without a mask pointer, or one the kernel does not take */
    ATTN_LT_ERR_VARIANT = 10009,    /* a forced kernel variant that cannot run these arguments */
    ATTN_LT_ERR_SCALE = 10010,      /* scale not positive */
    ATTN_LT_ERR_TENSOR_MAP = 10011, /* the driver refused a TMA tensor map for this layout */
    ATTN_LT_ERR_LATENT = 10012,     /* MLA decode (head dims 576/512): not one query a head, or v not k's memory */
    ATTN_LT_ERR_BATCH = 10013,      /* a serving batch's metadata pointers, capacities or block size */
    ATTN_LT_ERR_WINDOW = 10014      /* a window edge below -1, a softcap that is negative or not finite, or an
                                       attention variant (window, softcap, sinks) the kernel does not run */
};

enum attn_lt_dtype {
    ATTN_LT_NONE = 0, ATTN_LT_F16 = 1, ATTN_LT_BF16 = 2, ATTN_LT_F32 = 3, ATTN_LT_BOOL = 4,
    ATTN_LT_E4M3 = 5 /* float8 e4m3 (FP8 KV caches: attn_lt_flash_args::kv_dtype) */
};

/* One chunk of the long path: `batch` score blocks of `rows` x `cols` FP32 scores (already scaled).
 * Row r of block e is query position (row0 + r) % Sq of query head (hkv*g + gi0 + (row0 + r) / Sq), where
 * E = e0 + e, b = E / Hkv, hkv = E % Hkv. Key column j is key index k0 + j (a key tile starts at k0; the mask
 * pointer is the mask's start, the kernel adds k0).
 * P (out_dtype) is written row by row; it may alias the scores (P row r at the byte address of score row r).
 * lse is FP32 (B, Hq, Sq) contiguous, or with lse_local FP32 [batch][rows] (a key tile's partial LSE). The mask
 * (optional) is indexed with element strides over (B, Hq, Sq, Sk), 0 for broadcast dimensions. mass (optional):
 * FP32 (B, Hq, Sk) contiguous, the attention mass per key, at key k0 + j. Without mass_add, the P of each head's row
 * of query position Sq - 1 is written there (the mass where it is the sum of one row: decode, or a window of one
 * row). With mass_add, the P of every row of query position >= mass_q0 is added there (FP32 atomics after each CTA
 * has summed its rows of one head); only the PIPE kernel does this (attn_lt_softmax_adds_mass says whether a launch
 * would run it; other launches with mass_add are refused with ATTN_LT_ERR_VARIANT). */
typedef struct attn_lt_softmax_args {
    const float* scores;
    void* probs;
    float* lse;
    const void* mask;
    float* mass;
    int64_t rows, cols, batch;
    int64_t ld_s, bs_s;   /* score row stride and block stride, in floats (ld_s % 4 == 0, 16-byte aligned) */
    int64_t ld_p, bs_p;   /* P row stride and block stride, in elements (ld_p % 4 == 0) */
    int64_t row0, gi0, e0;
    int64_t Sq, Sk, g, Hkv, Hq;
    int64_t m_sb, m_sh, m_sq, m_sk;
    int64_t k0;           /* the first column's key index */
    int64_t mass_q0;      /* with mass_add: the first query position whose P is added into mass */
    int32_t causal;       /* bottom-right aligned: key j visible to query i iff j <= i + Sk - Sq */
    int32_t out_dtype;    /* ATTN_LT_F16 or ATTN_LT_BF16 */
    int32_t mask_dtype;   /* ATTN_LT_NONE, ATTN_LT_BOOL (true = attend) or F16/BF16/F32 (added to scores) */
    int32_t variant;      /* ATTN_LT_SOFTMAX_AUTO, or a kernel forced for tests and benchmarks */
    int32_t lse_local;    /* 1: lse is [batch][rows] */
    int32_t mass_add;     /* 0: write the mass of the row Sq - 1; 1: add the rows from mass_q0 on */
} attn_lt_softmax_args;

/* The LSE merge of a key-tiled chunk of the long path: `batch` blocks of `rows` rows (rows mapped to (b, head,
 * position) as in attn_lt_softmax_args). acc (running) and part (this tile) are FP32 outputs [batch][rows][Dv],
 * normalised over their own keys, with their LSE [batch][rows]. Without `last`, acc becomes their merge; with it,
 * the merge is written to o (out_dtype, row stride o_ld and block stride o_bs in elements) and lse (FP32 (B, Hq,
 * Sq) contiguous, may be null). Rows whose keys were all masked (both LSE -inf) get 0 and -inf. */
typedef struct attn_lt_tile_merge_args {
    float* acc_o;
    float* acc_lse;
    const float* part_o;
    const float* part_lse;
    void* o;
    float* lse;
    int64_t rows, batch, Dv, o_ld, o_bs;
    int64_t row0, gi0, e0, Sq, g, Hkv, Hq;
    int32_t out_dtype;    /* ATTN_LT_F16 or ATTN_LT_BF16 */
    int32_t last;
} attn_lt_tile_merge_args;

enum attn_lt_softmax_variant {
    ATTN_LT_SOFTMAX_AUTO = 0,
    ATTN_LT_SOFTMAX_ROW = 1,      /* one CTA a row, the row in registers (up to 32768 columns) */
    ATTN_LT_SOFTMAX_TWO_PASS = 2, /* any length: online max/sum pass, then a re-reading pass */
    ATTN_LT_SOFTMAX_PIPE = 3,     /* persistent CTAs (clusters of 2-8 on sm_90) fed by a cp.async shared-memory
                                     ring: up to 28160 columns a CTA, 225280 a cluster */
    ATTN_LT_SOFTMAX_PIPE_REGS = 4 /* persistent CTAs, the row in registers, the next in one shared slot: up to
                                     16384 columns, no dense mask, no attention mass */
};

/* The fused path: q (B, Hq, Sq, D), k (B, Hkv, Sk, D) and v (B, Hkv, Sk, Dv) with element strides (batch, head,
 * row; the last dimension contiguous), o (B, Hq, Sq, Dv) and lse FP32 (B, Hq, Sq) contiguous (lse may be null).
 * attn_lt_flash_fwd (native/flash.cu, mma.sync, sm_80 and later): D 64, 128 or 256; rows and bases 16-byte aligned;
 * an optional dense mask (mask_dtype ATTN_LT_BOOL, true = attend, or F16/BF16/F32, added to the scaled scores)
 * indexed with element strides over (B, Hq, Sq, Sk), 0 for broadcast dimensions; `splits` > 1 cuts the key range
 * into up to that many parts (flash-decoding; as many as Sk fills at 256 keys a part, so that one set of arguments
 * serves every key length), each writing FP32 partials o_part [splits][B][Hq][Sq][Dv] (8-byte aligned) and lse_part
 * [splits][B][Hq][Sq] that a merge kernel joins into o and lse. Causal is bottom-right aligned. */
typedef struct attn_lt_flash_args {
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    const void* mask;
    float* o_part;
    float* lse_part;
    int64_t B, Hq, Hkv, Sq, Sk, D;
    int64_t q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss;
    int64_t m_sb, m_sh, m_sq, m_sk;
    float scale;
    int32_t causal;
    int32_t dtype;      /* ATTN_LT_F16 or ATTN_LT_BF16 */
    int32_t variant;    /* attn_lt_flash_sm90_fwd: an attn_lt_flash_sm90_variant; attn_lt_flash_fwd ignores it */
    int32_t mask_dtype; /* ATTN_LT_NONE unless a mask is given (attn_lt_flash_sm90_fwd: bool or dtype only) */
    int32_t splits;     /* the most parts of the key range (those Sk fills at 256 keys a part run); 0 or 1: one
                           (attn_lt_flash_sm90_fwd: MLA decode and the decode variant only) */
    int32_t Dv;         /* v's and o's head dim; 0: D (attn_lt_flash_fwd: D only; attn_lt_flash_sm90_fwd: also 128
                           with D = 192, and 512 with D = 576, without a mask) */
    /* The attention variants (attn_lt_flash_fwd, the sm90 prefill kernel and the batch kernels; not MLA decode or
     * the sm90 decode variant): */
    const float* sinks;   /* FP32 (Hq,), or null: one logit per query head that joins every row's softmax
                             denominator (softmax over [scores, sink], the sink's column dropped; the LSE includes it) */
    float softcap;        /* > 0: each scaled score s becomes softcap * tanh(s / softcap), before masks; 0: none */
    int32_t window_left;  /* >= 0: query i (bottom-right aligned: position i + Sk - Sq) sees no key before
                             i + Sk - Sq - window_left; -1: unbounded */
    int32_t window_right; /* >= 0: nor a key after i + Sk - Sq + window_right; -1: unbounded (causal: 0) */
    /* attn_lt_flash_fwd's (16-bit K/V; with an FP8 cache it refuses them) and attn_lt_batch_fwd's decode blocks (at
     * most 16 rows a kv head), for a sequence of one query row (Sq = 1; a batch: a request of one row), when not
     * null: each head's scaled score of every key its row's tiles visit, in the exp2 domain (log2(e) x the scaled
     * score after softcap, plus the mask; -inf for a key the row does not see), FP32 at scores[b * s_sb + h * s_sh +
     * j] (a packed-keys batch: cu_k[b] + h * s_sh + j). Keys of tiles outside the row's window are not written.
     * attn_lt_key_mass / attn_lt_batch_key_mass turn them into the mass per key in place (from_scores). */
    float* scores;
    int64_t s_sb, s_sh;
    /* FP8 KV caches (attn_lt_flash_fwd's and attn_lt_batch_fwd's decode blocks: at most 64 rows a kv head, a
     * batch's at capacity, a 16-row block for each 16; D 64, 128 or 256; and MLA decode's latent cache, D 576, in
     * attn_lt_flash_sm90_fwd and attn_lt_flash_sm90_batch; every other kernel refuses them with
     * ATTN_LT_ERR_DTYPE): with kv_dtype ATTN_LT_E4M3, k and v hold float8 e4m3
     * elements (their strides multiples of 16 elements, 16-byte aligned) and the value of an element of kv head hk
     * is the element times k_descale[hk * descale_sh] (v_descale likewise; a null pointer: 1). q, o and the math
     * stay in `dtype` (q rounded to fp16 under a power-of-two scale, the MMAs in fp16, FP32 sums). */
    const float* k_descale;
    const float* v_descale;
    int64_t descale_sh;   /* 1: one factor a kv head, (Hkv,) contiguous; 0: one factor for all heads */
    int32_t kv_dtype;     /* ATTN_LT_NONE: k and v in `dtype`; ATTN_LT_E4M3 */
    int32_t pad_kv_;
    /* The FP8 prefill (attn_lt_flash_sm90_fwd only): dtype ATTN_LT_E4M3 and kv_dtype ATTN_LT_E4M3, q, k and v float8
     * e4m3 (their strides multiples of 16 elements), D = Dv 64, 128 or 256, no mask, the default variant, splits <= 1;
     * q's values are its elements times q_descale[hk * descale_sh] (hk: the row's kv head; null: 1), k's and v's as
     * above; o is bf16. o_part is the workspace: B * Hkv * Dv * ceil(Sk / 128) * 128 bytes, 16-byte aligned (V
     * transposed). */
    const float* q_descale;
} attn_lt_flash_args;

enum attn_lt_flash_sm90_variant {
    ATTN_LT_FLASH_SM90_DEFAULT = 0, /* QK^T of the next tile and PV overlapped with the softmax, warpgroup ping-pong */
    ATTN_LT_FLASH_SM90_PLAIN = 1,   /* one tile at a time (QK^T, wait, softmax, PV, wait), for tests and benchmarks */
    ATTN_LT_FLASH_SM90_DECODE = 2,  /* decode blocks: 64 rows of query positions x query heads of one kv head, the
                                       keys in `splits` parts (o_part, lse_part); D = Dv = 64 or 128, Sq <= 64,
                                       a mask its heads share (see attn_lt_flash_sm90_fwd) */
    ATTN_LT_FLASH_SM90_GRID = 3     /* the default pipeline with a CTA for each (query block, head) instead of the
                                       persistent CTAs that calls without a mask run, for tests and benchmarks */
};

/* Serving batches: B requests whose lengths (and KV pages) the kernels read from device memory, so that one launch
 * configuration, planned for a capacity, serves any lengths within it (and one captured CUDA graph every step).
 *
 * f carries the tensors and the call's shape: q (total_q rows, Hq, D) with row stride q_ss and head stride q_sh,
 * o (total_q, Hq, Dv) likewise (o_ss, o_sh), lse FP32 (Hq, total_q) contiguous or null; q_sb and o_sb unused.
 * f.B is the number of requests, f.Sq the most query rows a request may have (capacity), f.Sk the most keys.
 * Keys, varlen (cu_k set): k (total_k rows, Hkv, D) with k_ss, k_sh (v likewise); request b owns rows
 * [cu_k[b], cu_k[b+1]). Keys, paged (block_table set): k_cache (num_blocks, block_size, Hkv, D): block n's row r
 * at n * k_sb + r * k_ss (v likewise; k_sb, v_sb and block_size x (k_ss + v_ss) below 2^31, else
 * ATTN_LT_ERR_STRIDES); request b's key j lies in block block_table[b * bt_stride + j / block_size].
 * Queries: request b owns q rows [cu_q[b], cu_q[b+1]), or row b alone when cu_q is null. Causal is bottom-right
 * within each request. D = Dv = 64, 128 or 256; fp16/bf16; no dense mask. MLA decode (Hopper only): D 576 with
 * Dv 512, a paged latent cache read as K and V (v = k: the same address and strides, V its first 512 columns),
 * block_size >= 64, at most one query row a request (f.Sq 1); the keys in parts of split_keys (a multiple of 64;
 * 0: one part), o_part [parts][B][Hq][512] FP32 then lse_part [parts][B][Hq] in the workspace, a request of one part
 * written directly; the V rows of keys it does not attend (past its length in its last block, a bad block) are
 * zeroed in shared memory, so unwritten cache slots may hold anything.
 *
 * Device metadata is never trusted (attn_lt_batch_error bits are OR-ed into *error, which must be a device int32):
 * a request whose query range is not inside [0, total_q] or longer than f.Sq writes nothing; a request whose key
 * range is not inside the keys (varlen: [0, total_k]; paged: its table row) or longer than f.Sk has no keys (its
 * rows get zeros and LSE -inf); a key in a block whose id is outside [0, num_blocks) is not attended, and not read
 * (MLA decode reads block 0 in its place).
 * Query rows no request owns are left as they were.
 *
 * Requests whose rows a kv head (query rows x Hq / Hkv) are at most R = decode_rows (16, 32, 48 or 64) run on
 * native/flash.cu's decode grid (16-row decode blocks; past 16 rows a group block a kv head, or at D 256 and on an
 * FP8 cache a 16-row block for each 16), their keys cut in parts of split_keys keys (a multiple of 64; 0: one
 * part), the parts' partials o_part [parts][B][Hkv][R][Dv] FP32 and lse_part [parts][B][Hkv][R] joined by LSE
 * (parts = ceil(f.Sk / split_keys)); an FP8 cache runs on that grid only, so its f.Sq x Hq / Hkv must be at most
 * R. With more than one part, o_part is a workspace of workspace_bytes and lse_part must follow the outputs in it
 * (checked). The other requests run on row blocks (64 or 128 rows), whole, by native/flash.cu's kernel or, with
 * f.variant ATTN_LT_BATCH_SM90 (Hopper), by native/flash_sm90.cu's. Decode blocks zero-fill key rows past a
 * request's length; the Hopper row blocks read them by TMA (the rest of the request's last block, or the next
 * request's packed rows) and mask their scores, so those rows must hold finite values (a cache allocated with
 * zeros). */
enum attn_lt_batch_error {
    ATTN_LT_BATCH_BAD_Q = 1,          /* cu_seqlens_q decreasing, negative or past total_q */
    ATTN_LT_BATCH_Q_CAPACITY = 2,     /* a request's query rows more than max_seqlen_q */
    ATTN_LT_BATCH_BAD_K = 4,          /* cu_seqlens_k decreasing, negative or past total_k; or seqlens_k negative */
    ATTN_LT_BATCH_K_CAPACITY = 8,     /* a request's keys more than max_seqlen_k, or past its block table row */
    ATTN_LT_BATCH_BAD_BLOCK = 16      /* a block id outside [0, num_blocks) */
};
enum attn_lt_batch_variant { ATTN_LT_BATCH_SM80 = 0, ATTN_LT_BATCH_SM90 = 1 };

typedef struct attn_lt_batch_args {
    attn_lt_flash_args f;
    const int32_t* cu_q;        /* (B + 1,), or null: one query row a request */
    const int32_t* cu_k;        /* varlen: (B + 1,) */
    const int32_t* seqlens_k;   /* paged: (B,) */
    const int32_t* block_table; /* paged: (B, max_blocks), row stride bt_stride */
    int32_t* error;
    int64_t total_q, total_k;   /* rows of q and o; of k and v (varlen) */
    int64_t bt_stride, max_blocks, num_blocks, block_size; /* block_size a power of two */
    int32_t split_keys;
    int32_t decode_rows;        /* rows a kv head the decode blocks take (above); MLA decode: not read */
    int64_t workspace_bytes;    /* bytes at o_part (with more than one part) */
} attn_lt_batch_args;

/* The attention mass per key of a finished fused call (native/flash.cu, sm_80 and later; on an sm_90 device with 128
 * summed rows a head or more and no mask, native/mass_sm90.cu's pass): mass[b][h][j] (FP32 (B, Hq, Sk) contiguous,
 * every element written) = the sum over query rows i in [q0, Sq) of head h of P = exp(s(i, j) - lse(i)), s the scaled
 * score after softcap and mask, and P 0 for keys the row does not see (causal, window, bool mask, the key tail). f
 * carries the forward call's arguments: q, k, their strides, the mask, scale, causal, window, softcap, dtype, and
 * f.lse, that call's LSE (FP32 (B, Hq, Sq) contiguous; it includes the sinks, so P is the share of the row's
 * denominator). A row whose LSE is -inf adds nothing. D 64, 128 or 256; q and k as attn_lt_flash_fwd takes them, in
 * 16 bits (FP8 K/V: ATTN_LT_ERR_DTYPE; attn_lt_batch_key_mass takes a batch's); f.v, f.o, the partials and f.splits
 * are not read. */
typedef struct attn_lt_mass_args {
    attn_lt_flash_args f;
    float* mass;
    int64_t q0;           /* the first query row summed, 0 <= q0 < Sq */
    int64_t from_scores;  /* 1 (Sq = 1 only): the forward call's decode blocks stored the row's scores in mass
                             (attn_lt_flash_args::scores, s_sb = Hq Sk, s_sh = Sk): P from them, in place */
} attn_lt_mass_args;
int attn_lt_key_mass(const attn_lt_mass_args* args, void* stream);
/* native/mass_sm90.cu: attn_lt_key_mass's Hopper pass, for arguments attn_lt_key_mass has checked. It returns
 * cudaErrorNotSupported, having done nothing, where it does not run them (no sm_90 device or sm_90a image, a mask,
 * FP8 K/V, from_scores, strides TMA refuses); attn_lt_key_mass then runs its own kernel. */
int attn_lt_key_mass_sm90(const attn_lt_mass_args* args, void* stream);

/* The attention mass per key of a finished serving batch (attn_lt_batch_fwd with b.f.lse set, FP32 (Hq, total_q)):
 * for each request and query head, the sum over its last `window` query rows (all of them when it has fewer) of
 * exp(s - lse), as attn_lt_key_mass defines it (no mask: batches take none). mass, FP32: packed keys (b.cu_k)
 * (Hq, total_k), request b's key j at column cu_k[b] + j (columns no request owns are not written); a paged cache
 * (B, Hq, b.f.Sk), request b's key j at [b][h][j], zeros past its length and for keys of a block id out of range,
 * every element written except the rows of a request without query rows when b.f.Sq is 1. The metadata is read
 * as attn_lt_batch_fwd reads it (a bad request: zeros, or not written as above; reported by the forward call, not
 * again). D 64, 128 or 256; b.f.v, b.f.o and the workspace are not read. */
typedef struct attn_lt_batch_mass_args {
    attn_lt_batch_args b;
    float* mass;
    int64_t window;      /* >= 1 */
    int64_t from_scores; /* 1: the batch call stored the scores of its one-row requests on decode blocks in mass
                            (attn_lt_flash_args::scores, laid out as mass): their P from them, in place */
} attn_lt_batch_mass_args;
int attn_lt_batch_key_mass(const attn_lt_batch_mass_args* args, void* stream);

/* An FP8 KV cache converted for the 16-bit kernels (native/flash.cu), for the prefill rows the decode blocks cannot
 * take: b holds the batch call's arguments with its FP8 cache (b.f.kv_dtype ATTN_LT_E4M3, f.k, f.v, their strides
 * and descale factors as attn_lt_batch_fwd takes them; D = Dv = 64, 128 or 256). Each element becomes its value
 * (element x factor in FP32, rounded once to b.f.dtype) in k_out and v_out (16-byte aligned, contiguous). Packed
 * keys: all total_k rows, (total_k, Hkv, D). A paged cache: (1 + B x max_blocks, block_size, Hkv, D), block 0
 * zeros; and table_out, int32 (B, max_blocks) contiguous: for request b's block j within its keys (the metadata
 * read as attn_lt_batch_fwd reads it; a bad request has none), the place 1 + b x max_blocks + j that holds its
 * conversion, or -1 where the table's id lies outside [0, num_blocks) (the batch call then skips and reports it);
 * past its keys 0 (never read for them). The converted cache then runs as a 16-bit batch (num_blocks 1 + B x
 * max_blocks, bt_stride max_blocks). Nothing is reported here. */
typedef struct attn_lt_convert_args {
    attn_lt_batch_args b;
    void* k_out;
    void* v_out;
    int32_t* table_out;
} attn_lt_convert_args;
int attn_lt_batch_convert_kv(const attn_lt_convert_args* args, void* stream);

/* A dense call's FP8 KV cache converted for the 16-bit kernels (native/flash.cu), for what the decode blocks do not
 * run (more than 64 query rows a kv head, the mass per key): a's k and v, e4m3 (B, Hkv, Sk, D) at their strides,
 * with the descale factors as attn_lt_flash_fwd takes them (D = Dv = 64, 128 or 256; a.dtype fp16 or bf16), each
 * element times its factor in FP32, rounded once to a.dtype, into k_out and v_out: contiguous (B, Hkv, Sk, D),
 * 16-byte aligned. Nothing else of a is read. */
int attn_lt_flash_convert_kv(const attn_lt_flash_args* args, void* k_out, void* v_out, void* stream);

/* native/flash.cu: every request of the batch (the decode blocks, their merge, and the row blocks, the latter by
 * attn_lt_flash_sm90_batch with f.variant ATTN_LT_BATCH_SM90; MLA decode, D 576, by attn_lt_flash_sm90_batch). */
int attn_lt_batch_fwd(const attn_lt_batch_args* args, void* stream);
/* native/flash_sm90.cu: the row blocks of a batch (requests of more than 16 rows a kv head) on the Hopper prefill
 * kernel, packed or paged keys, grid (ceil(f.Sq / 128), Hq, B); or a whole MLA decode batch (D 576, above).
 * cudaErrorNotSupported off sm_90. */
int attn_lt_flash_sm90_batch(const attn_lt_batch_args* args, void* stream);

int attn_lt_abi_version(void);
int attn_lt_flash_fwd(const attn_lt_flash_args* args, void* stream);
/* The fused short path on Hopper (native/flash_sm90.cu: TMA, mbarrier ring, wgmma, producer/consumer warpgroups), same
 * arguments: D is 64, 128 or 256 (Dv = D), or 192 with Dv = 128; q, k, v, o 16-byte aligned; strides (batch, head,
 * row) of q, k, v, o positive multiples of 8 elements below 2^40 bytes (any for a dimension of size 1); lse may be
 * null; a mask bool or of q's dtype (read by TMA), 16-byte aligned, keys contiguous, its other strides 0 or multiples
 * of 16 bytes below 2^40, with the default variant only. MLA decode: D 576 with Dv 512, Sq = 1, v = k (the same
 * address and strides: v is k's first 512 columns), no mask, the default variant, the keys in `splits` parts (o_part,
 * lse_part as above) — ATTN_LT_ERR_LATENT otherwise; k may be an FP8 latent cache (kv_dtype above, its strides
 * multiples of 16 bytes). The decode variant: D = Dv = 64 or 128, Sq <= 64, the keys in
 * `splits` parts, a mask only if the heads share it (head stride 0, or Hq = 1) and it has at most 16 rows of positions
 * (or a row stride of 0) — ATTN_LT_ERR_VARIANT otherwise. cudaErrorNotSupported unless the current device is compute
 * capability 9.0; an attn_lt_status when a precondition fails. */
int attn_lt_flash_sm90_fwd(const attn_lt_flash_args* args, void* stream);
/* 1 when the current device is compute capability 9.0 and this library holds the sm_90a kernel, else 0. */
int attn_lt_flash_sm90_supported(void);
/* The long path's Q@K^T on Hopper (native/scores_sm90.cu: persistent TMA/wgmma kernel whose TMA stores of one tile
 * overlap the next tile's loads and MMAs). For e in [0, batch):
 *   s[e] (rows x cols, FP32, row stride s_ld, block stride s_bs) = alpha * q[e] (rows x D) @ k[e] (cols x D)^T,
 * q's and k's rows strided by q_ld / k_ld and blocks by q_bs / k_bs (elements; the last dimension contiguous).
 * D 64 or 128; fp16/bf16; q, k, s 16-byte aligned; strides of q and k multiples of 8 elements, of s multiples of 4,
 * all below 2^40 bytes (any for a dimension of size 1); s_ld >= cols rounded up to 4 (each row's last 16-byte chunk
 * is written whole: zeros past the last key), so s must hold (batch - 1) * s_bs + (rows - 1) * s_ld + that many
 * floats; rows, cols, batch < 2^31 and fewer than 2^31 - 2^20 tiles of 128 x 128. cudaErrorNotSupported unless the
 * current device is compute capability 9.0; an attn_lt_status when a precondition fails. */
typedef struct attn_lt_scores_args {
    const void* q;
    const void* k;
    float* s;
    int64_t rows, cols, batch, D;
    int64_t q_ld, q_bs, k_ld, k_bs, s_ld, s_bs;
    float alpha;
    int32_t dtype; /* ATTN_LT_F16 or ATTN_LT_BF16 */
} attn_lt_scores_args;

int attn_lt_scores_sm90(const attn_lt_scores_args* args, void* stream);
/* 1 when attn_lt_scores_sm90 can run head dim D on the current device (compute capability 9.0, sm_90a built). */
int attn_lt_scores_sm90_supported(int64_t D);
const char* attn_lt_source_hash(void);
const char* attn_lt_error_string(int err);
/* Largest row length read once (PIPE with an 8-CTA cluster on sm_90, ROW elsewhere) on the current device;
 * longer rows take two passes. */
int64_t attn_lt_softmax_max_resident_cols(void);
int attn_lt_softmax(const attn_lt_softmax_args* args, void* stream);
/* 1 when attn_lt_softmax would add these arguments' P into their mass (mass_add) on the current device: the PIPE
 * kernel runs them; else 0 (the caller sums P itself). Asked before the mass is set: it answers for a launch with
 * the mass set, which AUTO never gives to PIPE_REGS. */
int attn_lt_softmax_adds_mass(const attn_lt_softmax_args* args);
int attn_lt_tile_merge(const attn_lt_tile_merge_args* args, void* stream);

#ifdef __cplusplus
}
#endif
#endif
