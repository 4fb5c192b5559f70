/* Paged prefill attention on CPU: each sequence's chunk of new query tokens (the last n of its context of
 * `len` positions), causal, over K and V read where they sit in the pool through the block table. It serves
 * prefill chunks, prompts behind a cached prefix, and the length-1 rows of a mixed step alike.
 *
 * Built with paged_decode.c by kernels/cpu_kernels.py (cc -O3 -march=native -fopenmp), same layouts:
 * q [T, H, D] with token stride q_stride (elements) and contiguous heads; pool [Hkv, NB, bs, D] contiguous;
 * block_tables [B, *] int32 (row stride table_stride); seq_lens [B] int32, the context length after this step;
 * query_start_loc [B + 1] int32, sequence b's query tokens are rows query_start_loc[b] .. [b + 1] - 1 of q;
 * out [T, H, D] contiguous. Head h reads KV head h / (H / Hkv). Elements are bf16 (as uint16_t) or fp32.
 *
 * One task per (sequence, KV head, tile of query tokens): its rows are the tile's tokens times the G query
 * heads of that KV head, all of which read the same keys. Keys come 16 at a time: the tile's K rows are
 * converted to fp32 and transposed (kt[d][j]), so that the scores of R rows and 16 keys are R x 16 fp32
 * accumulators fed by one load of kt[d] and R broadcasts of q per d (a small GEMM the compiler keeps in
 * vector registers); in bf16 on a CPU with AVX512-BF16 the same by pairs of dims, unconverted; the V rows are converted to fp32 once and each row's output accumulates p * v. An
 * online softmax (running max m, sum l) in fp32 per row, as in the decode kernel; query token t at position
 * len - n + t sees keys 0 .. len - n + t. The output is acc / l in the pool's type. Every task's arithmetic
 * depends only on its own rows and keys, so a sequence's output does not change with the batch around it.
 */

#include <string.h>

#include "common.h"

#define PF_MAX_GROUP 16
#define PF_MAX_HEAD_DIM 256
#define PF_MAX_BLOCK 256
#define PF_KEYS 16           /* keys per tile */
#define PF_ROWS 64           /* rows (query tokens x group heads) per task, at most */
#define PF_RB 8              /* rows per score micro-tile */

static inline void pf_load(const char *row, int is_bf16, float *dst, int n) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)row;
#pragma omp simd
        for (int d = 0; d < n; d++) dst[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(dst, row, (size_t)n * sizeof(float));
    }
}

/* One tile of 16 keys for R rows (R a compile-time constant where inlined): scores s[r][j] = q[r] . kt[:, j]. */
static inline __attribute__((always_inline)) void pf_scores(const float (*q)[PF_MAX_HEAD_DIM],
                                                            const float (*kt)[PF_KEYS], int head_dim,
                                                            float (*s)[PF_KEYS], const int R) {
#if defined(__AVX512F__)
    __m512 acc[PF_RB];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int d = 0; d < head_dim; d++) {
        __m512 k = _mm512_load_ps(kt[d]);
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d]), k, acc[r]);
    }
    for (int r = 0; r < R; r++) _mm512_store_ps(s[r], acc[r]);
#else
    float acc[PF_RB][PF_KEYS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < PF_KEYS; j++) acc[r][j] = 0.0f;
    for (int d = 0; d < head_dim; d++)
        for (int r = 0; r < R; r++) {
            float qd = q[r][d];
#pragma omp simd
            for (int j = 0; j < PF_KEYS; j++) acc[r][j] += qd * kt[d][j];
        }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < PF_KEYS; j++) s[r][j] = acc[r][j];
#endif
}

#if defined(__AVX512BF16__)
#define PF_DP 1   /* bf16 scores by pairs of dims (vdpbf16ps): half the multiply-adds of the fp32 path */

/* As pf_scores for bf16 rows kept as pairs of dims (q[r][i] holds dims 2i, 2i + 1; kt[i][j] the same pair of
 * key j): each instruction adds both products of a pair to 16 fp32 scores. Then times `scale`. */
static inline __attribute__((always_inline)) void pf_scores_dp(const uint32_t (*q)[PF_MAX_HEAD_DIM / 2],
                                                               const uint32_t (*kt)[PF_KEYS], int pairs,
                                                               float (*s)[PF_KEYS], float scale, const int R) {
    __m512 acc[PF_RB];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int i = 0; i < pairs; i++) {
        __m512bh k = (__m512bh)_mm512_load_si512((const void *)kt[i]);
        for (int r = 0; r < R; r++)
            acc[r] = _mm512_dpbf16_ps(acc[r], k, (__m512bh)_mm512_set1_epi32((int)q[r][i]));
    }
    for (int r = 0; r < R; r++) _mm512_store_ps(s[r], _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
}

/* As pf_values with V by pairs of keys: vt[i][d] holds dims d of keys 2i and 2i + 1 (bf16), and each row's
 * probabilities are rounded to bf16 pairs (as transformers rounds them to the model's type before P V); each
 * instruction adds two keys' products to 16 dims. */
static inline __attribute__((always_inline)) void pf_values_dp(float (*acc)[PF_MAX_HEAD_DIM],
                                                               const float (*p)[PF_KEYS],
                                                               const uint32_t (*vt)[PF_MAX_HEAD_DIM], int key_pairs,
                                                               int head_dim, const int R) {
    uint32_t pp[4][PF_KEYS / 2] __attribute__((aligned(64)));
    for (int r = 0; r < R; r++)
        _mm256_store_si256((__m256i *)pp[r], (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(p[r])));
    for (int c = 0; c < head_dim; c += 16) {
        __m512 a[4];
        for (int r = 0; r < R; r++) a[r] = _mm512_load_ps(acc[r] + c);
        for (int i = 0; i < key_pairs; i++) {
            __m512bh v2 = (__m512bh)_mm512_load_si512((const void *)(vt[i] + c));
            for (int r = 0; r < R; r++) a[r] = _mm512_dpbf16_ps(a[r], v2, (__m512bh)_mm512_set1_epi32((int)pp[r][i]));
        }
        for (int r = 0; r < R; r++) _mm512_store_ps(acc[r] + c, a[r]);
    }
}
#else
#define PF_DP 0
#endif

/* Row r's online-softmax step over the first `seen` keys of the tile (1..16): its scores become probabilities
 * (0 past `seen`), m and l move on, and acc is rescaled to the new max. */
static inline void pf_softmax(float *s, int seen, float *m, float *l, float *acc, int head_dim) {
#if defined(__AVX512F__)
    __mmask16 visible = (__mmask16)(seen >= PF_KEYS ? 0xffffu : (1u << seen) - 1u);
    __m512 scores = _mm512_load_ps(s);
    float top = _mm512_mask_reduce_max_ps(visible, scores);
    top = top > *m ? top : *m;
    float rescale = *m == -INFINITY ? 0.0f : exp_nonpositive(*m - top);
    __m512 p = exp16(_mm512_sub_ps(scores, _mm512_set1_ps(top)), visible);
    *l = *l * rescale + _mm512_reduce_add_ps(p);
    _mm512_store_ps(s, p);
    if (rescale != 1.0f)
        for (int c = 0; c < head_dim / 16; c++)
            _mm512_store_ps(acc + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc + 16 * c), _mm512_set1_ps(rescale)));
#else
    float top = *m;
    for (int j = 0; j < seen; j++) top = s[j] > top ? s[j] : top;
    float rescale = *m == -INFINITY ? 0.0f : exp_nonpositive(*m - top);
    float sum = 0.0f;
    for (int j = 0; j < PF_KEYS; j++) {
        s[j] = j < seen ? exp_nonpositive(s[j] - top) : 0.0f;
        sum += s[j];
    }
    *l = *l * rescale + sum;
    if (rescale != 1.0f)
        for (int d = 0; d < head_dim; d++) acc[d] *= rescale;
#endif
    *m = top;
}

/* acc[r] += sum_j p[r][j] * v[j] for R rows (R a compile-time constant where inlined) over the tile's nk keys. */
static inline __attribute__((always_inline)) void pf_values(float (*acc)[PF_MAX_HEAD_DIM],
                                                            const float (*p)[PF_KEYS],
                                                            const float (*v)[PF_MAX_HEAD_DIM], int nk,
                                                            int head_dim, const int R) {
#if defined(__AVX512F__)
    for (int c = 0; c < head_dim; c += 16) {
        __m512 a[4];
        for (int r = 0; r < R; r++) a[r] = _mm512_load_ps(acc[r] + c);
        for (int j = 0; j < nk; j++) {
            __m512 vj = _mm512_load_ps(v[j] + c);
            for (int r = 0; r < R; r++) a[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][j]), vj, a[r]);
        }
        for (int r = 0; r < R; r++) _mm512_store_ps(acc[r] + c, a[r]);
    }
#else
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nk; j++) {
            float pj = p[r][j];
#pragma omp simd
            for (int d = 0; d < head_dim; d++) acc[r][d] += pj * v[j][d];
        }
#endif
}

static void prefill_task(const char *q, int64_t token_bytes, const char *k_pool, const char *v_pool,
                         const int32_t *table, int len, int n, int t0, int t1, char *out, int64_t out_token_bytes,
                         int group, int head_dim, int block_size, float scale, int is_bf16) {
    const int elem = is_bf16 ? 2 : 4;
    const int64_t row_bytes = (int64_t)head_dim * elem;
    const int rows = (t1 - t0) * group;
    float qf[PF_ROWS][PF_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float acc[PF_ROWS][PF_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float kt[PF_MAX_HEAD_DIM][PF_KEYS] __attribute__((aligned(64)));
    float vf[PF_KEYS][PF_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float s[PF_ROWS][PF_KEYS] __attribute__((aligned(64)));
    float krow[PF_MAX_HEAD_DIM], m[PF_ROWS], l[PF_ROWS];
    int last[PF_ROWS];   /* the last key position row r sees */
    const int dp = PF_DP && is_bf16, pairs = head_dim / 2;
    uint32_t q2[dp ? PF_ROWS : 1][PF_MAX_HEAD_DIM / 2] __attribute__((aligned(64)));
    uint32_t kt2[dp ? PF_MAX_HEAD_DIM / 2 : 1][PF_KEYS] __attribute__((aligned(64)));
    uint32_t vt2[dp ? PF_KEYS / 2 : 1][dp ? PF_MAX_HEAD_DIM : 1] __attribute__((aligned(64)));
    for (int r = 0; r < rows; r++) {
        int t = t0 + r / group, g = r % group;
        const char *src = q + t * token_bytes + (int64_t)g * row_bytes;
        if (dp) {
            memcpy(q2[r], src, (size_t)row_bytes);
        } else {
            pf_load(src, is_bf16, qf[r], head_dim);
            for (int d = 0; d < head_dim; d++) qf[r][d] *= scale;
        }
        for (int d = 0; d < head_dim; d++) acc[r][d] = 0.0f;
        m[r] = -INFINITY;
        l[r] = 0.0f;
        last[r] = len - n + t;
    }
    const int end = len - n + t1;   /* keys 0 .. end - 1 are seen by some row */
    for (int k0 = 0; k0 < end; k0 += PF_KEYS) {
        int nk = end - k0 < PF_KEYS ? end - k0 : PF_KEYS;
        for (int j = 0; j < PF_KEYS; j++) {
            if (j < nk) {
                int pos = k0 + j;
                int64_t row = (int64_t)table[pos / block_size] * block_size + pos % block_size;
                if (dp) {
                    const uint32_t *words = (const uint32_t *)(k_pool + row * row_bytes);
                    for (int i = 0; i < pairs; i++) kt2[i][j] = words[i];
                    const uint16_t *v = (const uint16_t *)(v_pool + row * row_bytes);
                    const int shift = (j & 1) * 16;
                    for (int d = 0; d < head_dim; d++)
                        vt2[j / 2][d] = (vt2[j / 2][d] & (0xffff0000u >> shift)) | ((uint32_t)v[d] << shift);
                } else {
                    pf_load(k_pool + row * row_bytes, is_bf16, krow, head_dim);
                    for (int d = 0; d < head_dim; d++) kt[d][j] = krow[d];
                    pf_load(v_pool + row * row_bytes, is_bf16, vf[j], head_dim);
                }
            } else if (dp) {
                for (int i = 0; i < pairs; i++) kt2[i][j] = 0;
                const uint32_t keep = (j & 1) ? 0x0000ffffu : 0xffff0000u;
                for (int d = 0; d < head_dim; d++) vt2[j / 2][d] &= keep;
            } else {
                for (int d = 0; d < head_dim; d++) kt[d][j] = 0.0f;
            }
        }
        /* rows before `first` see none of the tile's keys (causal: the tile starts past their position) */
        int first = 0;
        while (first < rows && last[first] < k0) first++;
        int r = first;
        if (dp) {
#if PF_DP
            for (; r + PF_RB <= rows; r += PF_RB) pf_scores_dp(q2 + r, kt2, pairs, s + r, scale, PF_RB);
            for (; r < rows; r++) pf_scores_dp(q2 + r, kt2, pairs, s + r, scale, 1);
#endif
        } else {
            for (; r + PF_RB <= rows; r += PF_RB) pf_scores(qf + r, kt, head_dim, s + r, PF_RB);
            for (; r < rows; r++) pf_scores(qf + r, kt, head_dim, s + r, 1);
        }
        for (r = first; r < rows; r++) {
            int seen = last[r] - k0 + 1;
            pf_softmax(s[r], seen < nk ? seen : nk, &m[r], &l[r], acc[r], head_dim);
        }
        r = first;
        if (dp) {
#if PF_DP
            const int key_pairs = (nk + 1) / 2;
            for (; r + 4 <= rows; r += 4) pf_values_dp(acc + r, s + r, vt2, key_pairs, head_dim, 4);
            for (; r < rows; r++) pf_values_dp(acc + r, s + r, vt2, key_pairs, head_dim, 1);
#endif
        } else {
            for (; r + 4 <= rows; r += 4) pf_values(acc + r, s + r, vf, nk, head_dim, 4);
            for (; r < rows; r++) pf_values(acc + r, s + r, vf, nk, head_dim, 1);
        }
    }
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

/* The entry point: 0 on success; -1 for shapes past the limits above or a head_dim that is no multiple of 16
 * (the caller checks them first); -2 for a
 * chunk longer than its context, a context past its block table, a table entry outside the pool, or query
 * offsets that are not increasing within [0, num_tokens] (nothing is computed then). */
int paged_prefill(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                  const int32_t *block_tables, int64_t table_stride, int64_t table_width, const int32_t *seq_lens,
                  const int32_t *query_start_loc, int64_t num_tokens, void *out, int num_seqs, int num_heads,
                  int num_kv_heads, int head_dim, int block_size, int64_t num_blocks, float scale, int is_bf16) {
    int group = num_heads / num_kv_heads;
    if (group < 1 || group > PF_MAX_GROUP || group * num_kv_heads != num_heads || head_dim > PF_MAX_HEAD_DIM
            || head_dim % 16 || block_size > PF_MAX_BLOCK || block_size < 1)
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
    const int tile = PF_ROWS / group;   /* query tokens per task */
    const int64_t head_stride = num_blocks * block_size * (int64_t)head_dim * elem;
    /* tasks: (sequence, KV head, tile); each sequence's tiles counted up front */
    int64_t tasks = 0;
    for (int b = 0; b < num_seqs; b++) {
        int n = query_start_loc[b + 1] - query_start_loc[b];
        tasks += (int64_t)((n + tile - 1) / tile) * num_kv_heads;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; i++) {
        /* find task i: sequences in order, then KV heads, then tiles (last tiles first would balance better,
         * but the dynamic schedule already hands out the long causal tiles as threads free up) */
        int64_t rest = i;
        int b = 0, n = 0, tiles = 0;
        for (; b < num_seqs; b++) {
            n = query_start_loc[b + 1] - query_start_loc[b];
            tiles = (n + tile - 1) / tile;
            if (rest < (int64_t)tiles * num_kv_heads) break;
            rest -= (int64_t)tiles * num_kv_heads;
        }
        int h = (int)(rest / tiles), t0 = (int)(rest % tiles) * tile;
        int t1 = t0 + tile < n ? t0 + tile : n;
        int64_t first = query_start_loc[b];
        prefill_task((const char *)q + (first * q_stride + (int64_t)h * group * head_dim) * elem,
                     q_stride * elem, (const char *)k_pool + h * head_stride, (const char *)v_pool + h * head_stride,
                     block_tables + b * table_stride, seq_lens[b], n, t0, t1,
                     (char *)out + ((first * num_heads + (int64_t)h * group) * head_dim) * elem,
                     (int64_t)num_heads * head_dim * elem, group, head_dim, block_size, scale, is_bf16);
    }
    return 0;
}
