/* Paged prefill attention on CPU: each sequence's chunk of new query tokens (the last n of its context of
 * `len` positions), causal, over K and V read where they sit in the pool through the block table. It serves
 * prefill chunks, prompts behind a cached prefix, and the length-1 rows of a mixed step alike.
 *
 * Built with paged_decode.c by kernels/cpu_kernels.py (cc -O3 -fopenmp, per ISA level), same layouts:
 * q [T, H, D] with token stride q_stride (elements) and contiguous heads; pool [Hkv, NB, bs, D] contiguous;
 * block_tables [B, *] int32 (row stride table_stride); seq_lens [B] int32, the context length after this step;
 * query_start_loc [B + 1] int32, sequence b's query tokens are rows query_start_loc[b] .. [b + 1] - 1 of q;
 * out [T, H, D] contiguous. Head h reads KV head h / (H / Hkv). Elements are bf16 (as uint16_t) or fp32.
 *
 * One task per (sequence, KV head, tile of query tokens): its rows are the tile's tokens times the G query
 * heads of that KV head, all of which read the same keys. Two ways through the keys:
 * - bf16 on a CPU with AVX512-BF16 (the packed path, below): keys 32 at a time, packed once per call into the
 *   layouts that vdpbf16ps wants, and multiplied by pairs of bf16 without conversion, scores and P V alike.
 * - otherwise (fp32 pools, or bf16 without AVX512-BF16): paged_decode.c's `attend_rows`, the decode kernel's own
 *   arithmetic for a few tokens at once, so that each row has the bits the decode of its position would have
 *   (a stream resumed from its delivered tokens, prefilled here, goes on exactly as it would have).
 * Both keep an online softmax (running max m, sum l) in fp32 per row, as the decode kernel; query token t at
 * position len - n + t sees keys 0 .. len - n + t (with a sliding window W > 0: len - n + t - W + 1 .. len - n + t, and
 * every row takes the decode arithmetic, no packed path). Soft-capping (Gemma 2: a scaled score s becomes
 * c * tanh(s / c)) and attention sinks (GPT-OSS: each row's softmax starts from its head's sink logit as a
 * position with no value) as paged_decode.c computes them, on both paths. The output is acc / l in the pool's type. Every task's
 * arithmetic depends only on its own rows and keys, so a sequence's output does not change with the batch
 * around it.
 */

#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#define PF_MAX_GROUP 16
#define PF_MAX_HEAD_DIM 256
#define PF_MAX_BLOCK 256
#define PF_ROWS 64           /* rows (query tokens x group heads) per task of the packed path, at most */

#if defined(__AVX512BF16__)
/* ---- bf16 with AVX512-BF16: keys packed once, 32 at a time, and multiplied by pairs of bf16 (vdpbf16ps) ----
 *
 * A packed tile holds 32 keys of one KV head in the two layouts the products want, 32 * head_dim words:
 *   K part, head_dim / 2 rows of 32 words: word [i][j] is dims 2i, 2i + 1 of key j (a bf16 pair, low half first);
 *   V part, 16 rows of head_dim words: word [i][d] is dim d of keys 2i (low half) and 2i + 1 (high half).
 * Keys past the context are zeros. The scores of up to 6 query rows and 32 keys are 2 fp32 registers a row, fed
 * by two loads of a K row and a broadcast of each row's q pair; then each row's online-softmax step; the
 * probabilities are rounded to bf16 pairs (as transformers rounds them to the model's type before P V), and up
 * to 3 rows' output accumulates over the tile's 16 key pairs in registers, 64 dims at a time.
 * A sequence whose chunk spans several tasks has its tiles packed once, before the tasks (in paged_prefill,
 * within a budget); otherwise each task packs the tiles it reads itself. */

#define PK_KEYS 32

/* Row r of acc / l[r] to its output row: token t0 + r / group, head r % group of the task's group. */
static void pf_store(float (*acc)[PF_MAX_HEAD_DIM], const float *l, int rows, int t0, int group, char *out,
                     int64_t out_token_bytes, int head_dim, int is_bf16) {
    const int64_t row_bytes = (int64_t)head_dim * (is_bf16 ? 2 : 4);
    for (int r = 0; r < rows; r++) {
        int t = t0 + r / group, g = r % group;
        float inv = 1.0f / l[r];
        char *dst = out + t * out_token_bytes + (int64_t)g * row_bytes;
        if (is_bf16) {
            uint16_t *o = (uint16_t *)dst;
            for (int d = 0; d < head_dim; d++) o[d] = f32_to_bf16(acc[r][d] * inv);
        } else {
            float *o = (float *)dst;
            for (int d = 0; d < head_dim; d++) o[d] = acc[r][d] * inv;
        }
    }
}
#define PK_RS 6   /* rows per score micro-tile: 12 accumulators (the product's latency is 6 cycles) */
#define PK_RV 3   /* rows per value micro-tile: 3 x 4 accumulators of 16 dims */

static inline int64_t pk_tile_words(int head_dim) { return (int64_t)PK_KEYS * head_dim; }

/* Pack keys k0 .. k0 + nk - 1 (nk <= 32) of one KV head (bf16 pools, already offset to the head) into tile. */
static void pk_pack(const uint16_t *k_pool, const uint16_t *v_pool, const int32_t *table, int block_size, int head_dim,
                    int k0, int nk, uint32_t *tile) {
    const int pairs = head_dim / 2;
    uint32_t *kt = tile, *vt = tile + (int64_t)pairs * PK_KEYS;
    const uint16_t *krow[PK_KEYS], *vrow[PK_KEYS];
    for (int j = 0; j < nk; j++) {
        int pos = k0 + j;
        int64_t row = (int64_t)table[pos / block_size] * block_size + pos % block_size;
        krow[j] = k_pool + row * head_dim;
        vrow[j] = v_pool + row * head_dim;
    }
    for (int j = 0; j < PK_KEYS; j++) {
        if (j < nk) {
            const uint32_t *words = (const uint32_t *)krow[j];
            for (int i = 0; i < pairs; i++) kt[i * PK_KEYS + j] = words[i];
        } else {
            for (int i = 0; i < pairs; i++) kt[i * PK_KEYS + j] = 0;
        }
    }
    for (int i = 0; i < PK_KEYS / 2; i++) {
        const int a = 2 * i, b = 2 * i + 1;
        for (int c = 0; c < head_dim; c += 16) {
            __m512i lo = a < nk ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vrow[a] + c)))
                                : _mm512_setzero_si512();
            __m512i hi = b < nk ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vrow[b] + c)))
                                : _mm512_setzero_si512();
            _mm512_store_si512((void *)(vt + (int64_t)i * head_dim + c),
                               _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

/* 2^x for x <= 0 lane-wise: 2^n * p(r), n = round(x), r = x - n in [-1/2, 1/2], p the degree-6 Taylor polynomial
 * of 2^r (relative error < 2e-7); lanes outside `valid`, and x <= -126, give 0. */
static inline __m512 exp2_16(__m512 x, __mmask16 valid) {
    __m512 c = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(c, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(c, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __mmask16 live = valid & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* Scores of R rows (q2: bf16 pairs) against a tile's 32 keys, unscaled, into s[r] (R a constant where inlined;
 * the callers below are not inlined, so the 2R accumulators keep their registers). */
static inline __attribute__((always_inline)) void pk_scores(const uint32_t (*q2)[PF_MAX_HEAD_DIM / 2],
                                                            const uint32_t *kt, int pairs, float (*s)[PK_KEYS],
                                                            const int R) {
    __m512 a[PK_RS][2];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int i = 0; i < pairs; i++) {
        __m512bh k0 = (__m512bh)_mm512_load_si512((const void *)(kt + i * PK_KEYS));
        __m512bh k1 = (__m512bh)_mm512_load_si512((const void *)(kt + i * PK_KEYS + 16));
        for (int r = 0; r < R; r++) {
            __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q2[r][i]);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], k0, qb);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], k1, qb);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_store_ps(s[r], a[r][0]);
        _mm512_store_ps(s[r] + 16, a[r][1]);
    }
}

/* pk_scores for R = 1 .. PK_RS rows, each R its own code (not inlined: the accumulators keep their registers). */
static __attribute__((noinline)) void pk_scores_rows(const uint32_t (*q2)[PF_MAX_HEAD_DIM / 2], const uint32_t *kt,
                                                     int pairs, float (*s)[PK_KEYS], int R) {
    switch (R) {
    case 6: pk_scores(q2, kt, pairs, s, 6); break;
    case 5: pk_scores(q2, kt, pairs, s, 5); break;
    case 4: pk_scores(q2, kt, pairs, s, 4); break;
    case 3: pk_scores(q2, kt, pairs, s, 3); break;
    case 2: pk_scores(q2, kt, pairs, s, 2); break;
    default: pk_scores(q2, kt, pairs, s, 1); break;
    }
}

/* One row's online-softmax step over its scores s of a tile, in base 2: x = s * scale * log2(e) (soft-capped
 * first where softcap > 0: x = c * tanh(s * scale / c) * log2(e)), p = 2^(x - m) with m the running max of x. m,
 * the row's 16 partial sums of p (lsum) and its acc move on, and its probabilities go to pp (16 bf16 pairs).
 * `seen`: how many of the tile's keys the row sees (1 .. 32). */
static inline void pk_softmax(const float *s, int seen, float scale, float softcap, float *m, float *lsum, float *acc,
                              uint32_t *pp, int head_dim) {
    const __m512 minus_inf = _mm512_set1_ps(-INFINITY);
    const __mmask16 v0 = (__mmask16)(seen >= 16 ? 0xffffu : (1u << seen) - 1u);
    const __mmask16 v1 = (__mmask16)(seen >= 32 ? 0xffffu : seen > 16 ? (1u << (seen - 16)) - 1u : 0u);
    __m512 x0, x1;
    if (softcap) {
        const __m512 sc = _mm512_set1_ps(scale), log2e = _mm512_set1_ps(1.44269504088896341f);
        x0 = _mm512_mul_ps(softcap16(_mm512_mul_ps(_mm512_load_ps(s), sc), softcap), log2e);
        x1 = _mm512_mul_ps(softcap16(_mm512_mul_ps(_mm512_load_ps(s + 16), sc), softcap), log2e);
    } else {
        const __m512 sc = _mm512_set1_ps(scale * 1.44269504088896341f);
        x0 = _mm512_mul_ps(_mm512_load_ps(s), sc);
        x1 = _mm512_mul_ps(_mm512_load_ps(s + 16), sc);
    }
    float top = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_mask_mov_ps(minus_inf, v0, x0), _mm512_mask_mov_ps(minus_inf, v1, x1)));
    __m512 sum = _mm512_load_ps(lsum);
    if (top > *m) {   /* a new max: what was summed so far is scaled down to it */
        __m512 rescale = *m == -INFINITY ? _mm512_setzero_ps() : exp2_16(_mm512_set1_ps(*m - top), (__mmask16)0xffffu);
        sum = _mm512_mul_ps(sum, rescale);
        for (int c = 0; c < head_dim; c += 16)
            _mm512_store_ps(acc + c, _mm512_mul_ps(_mm512_load_ps(acc + c), rescale));
        *m = top;
    }
    const __m512 top16 = _mm512_set1_ps(*m);
    __m512 p0 = exp2_16(_mm512_sub_ps(x0, top16), v0), p1 = exp2_16(_mm512_sub_ps(x1, top16), v1);
    _mm512_store_ps(lsum, _mm512_add_ps(sum, _mm512_add_ps(p0, p1)));
    _mm256_store_si256((__m256i *)pp, (__m256i)_mm512_cvtneps_pbh(p0));
    _mm256_store_si256((__m256i *)(pp + 8), (__m256i)_mm512_cvtneps_pbh(p1));
}

/* acc[r][c .. c + 16W) += sum over the tile's key pairs of pp[r][i] * V pair i, for R rows (W, R constant). */
static inline __attribute__((always_inline)) void pk_values(float (*acc)[PF_MAX_HEAD_DIM],
                                                            const uint32_t (*pp)[PK_KEYS / 2], const uint32_t *vt,
                                                            int key_pairs, int head_dim, int c, const int R,
                                                            const int W) {
    __m512 a[PK_RV][4];
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++) a[r][w] = _mm512_load_ps(acc[r] + c + 16 * w);
    for (int i = 0; i < key_pairs; i++) {
        __m512bh v[4];
        for (int w = 0; w < W; w++)
            v[w] = (__m512bh)_mm512_load_si512((const void *)(vt + (int64_t)i * head_dim + c + 16 * w));
        for (int r = 0; r < R; r++) {
            __m512bh p = (__m512bh)_mm512_set1_epi32((int)pp[r][i]);
            for (int w = 0; w < W; w++) a[r][w] = _mm512_dpbf16_ps(a[r][w], v[w], p);
        }
    }
    for (int r = 0; r < R; r++)
        for (int w = 0; w < W; w++) _mm512_store_ps(acc[r] + c + 16 * w, a[r][w]);
}

/* pk_values over all head_dim dims for R = 1 .. PK_RV rows, each R its own code. */
static __attribute__((noinline)) void pk_values_rows(float (*acc)[PF_MAX_HEAD_DIM], const uint32_t (*pp)[PK_KEYS / 2],
                                                     const uint32_t *vt, int key_pairs, int head_dim, int R) {
    int c = 0;
    for (; c + 64 <= head_dim; c += 64) {
        switch (R) {
        case 3: pk_values(acc, pp, vt, key_pairs, head_dim, c, 3, 4); break;
        case 2: pk_values(acc, pp, vt, key_pairs, head_dim, c, 2, 4); break;
        default: pk_values(acc, pp, vt, key_pairs, head_dim, c, 1, 4); break;
        }
    }
    for (; c < head_dim; c += 16) {
        switch (R) {
        case 3: pk_values(acc, pp, vt, key_pairs, head_dim, c, 3, 1); break;
        case 2: pk_values(acc, pp, vt, key_pairs, head_dim, c, 2, 1); break;
        default: pk_values(acc, pp, vt, key_pairs, head_dim, c, 1, 1); break;
        }
    }
}

/* One task of the packed path: rows t0 .. t1 - 1 of a sequence's chunk times the group's heads. `tiles` holds
 * the head's packed tiles when the sequence was packed up front, else NULL (the task packs each tile itself).
 * `sinks`: the group's heads' sink logits, or NULL; each row starts from its sink (m = sink in base 2, l = 1). */
static void packed_task(const char *q, int64_t token_bytes, const uint16_t *k_pool, const uint16_t *v_pool,
                        const int32_t *table, const uint32_t *tiles, int len, int n, int t0, int t1, char *out,
                        int64_t out_token_bytes, int group, int head_dim, int block_size, float scale, float softcap,
                        const float *sinks) {
    const int64_t row_bytes = (int64_t)head_dim * 2;
    const int rows = (t1 - t0) * group, pairs = head_dim / 2;
    uint32_t q2[PF_ROWS][PF_MAX_HEAD_DIM / 2] __attribute__((aligned(64)));
    float acc[PF_ROWS][PF_MAX_HEAD_DIM] __attribute__((aligned(64)));
    uint32_t pp[PF_ROWS][PK_KEYS / 2] __attribute__((aligned(64)));
    float s[PF_ROWS][PK_KEYS] __attribute__((aligned(64)));
    uint32_t own[PK_KEYS * PF_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float lsum[PF_ROWS][16] __attribute__((aligned(64)));
    float m[PF_ROWS], l[PF_ROWS];
    int last[PF_ROWS];
    for (int r = 0; r < rows; r++) {
        int t = t0 + r / group, g = r % group;
        for (int j = 0; j < 16; j++) lsum[r][j] = 0.0f;
        memcpy(q2[r], q + t * token_bytes + (int64_t)g * row_bytes, (size_t)row_bytes);
        for (int d = 0; d < head_dim; d++) acc[r][d] = 0.0f;
        m[r] = sinks ? sinks[g] * 1.44269504088896341f : -INFINITY;
        if (sinks) lsum[r][0] = 1.0f;
        l[r] = 0.0f;
        last[r] = len - n + t;
    }
    const int end = len - n + t1;
    for (int k0 = 0; k0 < end; k0 += PK_KEYS) {
        int nk = end - k0 < PK_KEYS ? end - k0 : PK_KEYS;
        const uint32_t *tile = own;
        if (tiles) tile = tiles + (int64_t)(k0 / PK_KEYS) * pk_tile_words(head_dim);
        else pk_pack(k_pool, v_pool, table, block_size, head_dim, k0, nk, own);
        int first = 0;
        while (first < rows && last[first] < k0) first++;
        for (int r = first; r < rows; r += PK_RS)
            pk_scores_rows(q2 + r, tile, pairs, s + r, rows - r < PK_RS ? rows - r : PK_RS);
        for (int r = first; r < rows; r++) {
            int seen = last[r] - k0 + 1;
            pk_softmax(s[r], seen < nk ? seen : nk, scale, softcap, &m[r], lsum[r], acc[r], pp[r], head_dim);
        }
        const uint32_t *vt = tile + (int64_t)pairs * PK_KEYS;
        const int key_pairs = (nk + 1) / 2;
        for (int r = first; r < rows; r += PK_RV)
            pk_values_rows(acc + r, pp + r, vt, key_pairs, head_dim, rows - r < PK_RV ? rows - r : PK_RV);
    }
    for (int r = 0; r < rows; r++) l[r] = _mm512_reduce_add_ps(_mm512_load_ps(lsum[r]));
    pf_store(acc, l, rows, t0, group, out, out_token_bytes, head_dim, 1);
}
#endif

/* The entry point. `decode_from` (NULL: none) gives, per sequence, the first position whose row is computed with
 * the decode kernel's arithmetic on the packed path too: the engine passes each sequence's prompt length, so that
 * a prompt's rows have the bits its first prefill gave them and a generated token's row the bits its decode step
 * gave it, whenever they are computed again (a failover's resumed stream, a recompute after preemption).
 * `softcap` > 0 soft-caps the scores (0: not); `sinks` [num_heads] fp32 (NULL: none) joins each softmax's
 * denominator. 0 on success; -1 for shapes past the limits above, a head_dim that is no multiple of 16, or a
 * negative window or softcap (the caller checks them first); -2 for a chunk longer than its context, a context past its block table, a
 * table entry outside the pool, or query offsets that are not increasing within [0, num_tokens]; -3 when the
 * packed tiles could not be allocated (nothing is computed after -1, -2 or -3). */
int paged_prefill(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool, const int32_t *block_tables,
                  int64_t table_stride, int64_t table_width, const int32_t *seq_lens, const int32_t *query_start_loc,
                  int64_t num_tokens, void *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                  int block_size, int64_t num_blocks, float scale, int is_bf16, const int32_t *decode_from, int window,
                  float softcap, const float *sinks) {
    int group = num_heads / num_kv_heads;
    if (window < 0 || !(softcap >= 0.0f) || group < 1 || group > PF_MAX_GROUP || group * num_kv_heads != num_heads
        || head_dim > PF_MAX_HEAD_DIM || head_dim % 16 || block_size > PF_MAX_BLOCK || block_size < 1)
        return -1;
    for (int64_t b = 0; b < num_seqs; b++) {   /* nothing read or written outside q, out, the pool or the table */
        int64_t start = query_start_loc[b], stop = query_start_loc[b + 1], len = seq_lens[b];
        int64_t used = (len + block_size - 1) / block_size;
        if (start < 0 || stop < start || stop > num_tokens || stop - start > len || used > table_width) return -2;
        if (stop > start && len < 1) return -2;
        for (int64_t j = 0; j < used; j++) {
            int32_t block = block_tables[b * table_stride + j];
            if (block < 0 || block >= num_blocks) return -2;
        }
    }
    const int elem = is_bf16 ? 2 : 4;
#if defined(__AVX512BF16__)
    const int packing = is_bf16 && !window;   /* windowed layers: every row with the decode arithmetic */
#else
    const int packing = 0;
#endif
    const int tile = packing ? PF_ROWS / group : attend_max_tokens(group);   /* query tokens per task */
    const int64_t head_stride = num_blocks * block_size * (int64_t)head_dim * elem;
    /* tasks: (sequence, KV head, tile); each sequence's tiles counted up front */
    int64_t tasks = 0;
    for (int b = 0; b < num_seqs; b++) {
        int n = query_start_loc[b + 1] - query_start_loc[b];
        tasks += (int64_t)((n + tile - 1) / tile) * num_kv_heads;
    }
#if defined(__AVX512BF16__)
    /* The packed path: a sequence whose chunk spans two tasks or more per head has its key tiles packed once,
     * here, into `packed` (at most PK_BUDGET bytes; sequences past it are packed by their tasks).
     * first_tile[b]: sequence b's first tile in packed, per head, or -1 when its tasks pack their own. */
    enum { PK_BUDGET = 32 << 20 };
    const int64_t tile_words = pk_tile_words(head_dim);
    int64_t *first_tile = NULL, total_tiles = 0;
    uint32_t *packed = NULL;
    if (packing) {
        first_tile = (int64_t *)malloc((size_t)(num_seqs > 0 ? num_seqs : 1) * sizeof(int64_t));
        if (!first_tile) return -3;
        for (int b = 0; b < num_seqs; b++) {
            int n = query_start_loc[b + 1] - query_start_loc[b];
            int64_t key_tiles = (seq_lens[b] + PK_KEYS - 1) / PK_KEYS;
            first_tile[b] = -1;
            if (n > tile && (total_tiles + key_tiles) * num_kv_heads * tile_words * 4 <= PK_BUDGET) {
                first_tile[b] = total_tiles;
                total_tiles += key_tiles;
            }
        }
        if (total_tiles) {
            packed = (uint32_t *)aligned_alloc(64, (size_t)(total_tiles * num_kv_heads * tile_words * 4));
            if (!packed) {
                free(first_tile);
                return -3;
            }
        }
#pragma omp parallel for schedule(dynamic, 4) if (total_tiles * num_kv_heads > 1)
        for (int64_t i = 0; i < total_tiles * num_kv_heads; i++) {
            /* packed tile i: head i / total_tiles, the sequence that owns tile i % total_tiles */
            int h = (int)(i / total_tiles);
            int64_t g = i % total_tiles;
            int b = 0;
            while (first_tile[b] < 0 || g >= first_tile[b] + (seq_lens[b] + PK_KEYS - 1) / PK_KEYS) b++;
            int k0 = (int)(g - first_tile[b]) * PK_KEYS;
            int nk = seq_lens[b] - k0 < PK_KEYS ? seq_lens[b] - k0 : PK_KEYS;
            pk_pack((const uint16_t *)((const char *)k_pool + h * head_stride),
                    (const uint16_t *)((const char *)v_pool + h * head_stride), block_tables + b * table_stride,
                    block_size, head_dim, k0, nk, packed + (h * total_tiles + g) * tile_words);
        }
    }
#endif
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; i++) {
        /* find task i: sequences in order, then KV heads, then tiles from the last (the longest, causal) to the
         * first, so the dynamic schedule hands out the short ones while the long ones finish */
        int64_t rest = i;
        int b = 0, n = 0, tiles = 0;
        for (; b < num_seqs; b++) {
            n = query_start_loc[b + 1] - query_start_loc[b];
            tiles = (n + tile - 1) / tile;
            if (rest < (int64_t)tiles * num_kv_heads) break;
            rest -= (int64_t)tiles * num_kv_heads;
        }
        int h = (int)(rest / tiles), t0 = (tiles - 1 - (int)(rest % tiles)) * tile;
        int t1 = t0 + tile < n ? t0 + tile : n;
        int64_t first = query_start_loc[b];
        const char *qh = (const char *)q + (first * q_stride + (int64_t)h * group * head_dim) * elem;
        char *oh = (char *)out + ((first * num_heads + (int64_t)h * group) * head_dim) * elem;
        const int64_t out_token_bytes = (int64_t)num_heads * head_dim * elem;
        int split = t0;   /* tokens t0 .. split - 1 take the packed path, split .. t1 - 1 the decode arithmetic */
#if defined(__AVX512BF16__)
        if (packing) {
            split = t1;
            if (decode_from) {
                int64_t first_decoded = (int64_t)decode_from[b] - (seq_lens[b] - n);   /* as a token of the chunk */
                split = first_decoded < t0 ? t0 : first_decoded < t1 ? (int)first_decoded : t1;
            }
            if (split > t0) {
                const uint32_t *tiles_of = first_tile[b] < 0 ? NULL
                                                             : packed + (h * total_tiles + first_tile[b]) * tile_words;
                packed_task(qh, q_stride * elem, (const uint16_t *)((const char *)k_pool + h * head_stride),
                            (const uint16_t *)((const char *)v_pool + h * head_stride), block_tables + b * table_stride,
                            tiles_of, seq_lens[b], n, t0, split, oh, out_token_bytes, group, head_dim, block_size,
                            scale, softcap, sinks ? sinks + h * group : NULL);
            }
        }
#endif
        for (int t = split; t < t1; t += attend_max_tokens(group)) {
            const int stop = t + attend_max_tokens(group) < t1 ? t + attend_max_tokens(group) : t1;
            attend_rows(qh + t * q_stride * elem, q_stride * elem, (const char *)k_pool + h * head_stride,
                        (const char *)v_pool + h * head_stride, block_tables + b * table_stride,
                        seq_lens[b] - n + t + 1, stop - t, oh + t * out_token_bytes, out_token_bytes, group, head_dim,
                        block_size, scale, is_bf16, window, softcap, sinks ? sinks + h * group : NULL);
        }
    }
#if defined(__AVX512BF16__)
    free(packed);
    free(first_tile);
#endif
    return 0;
}
