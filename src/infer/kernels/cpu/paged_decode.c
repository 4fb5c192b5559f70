/* Paged attention on CPU for rows that each see a prefix of a sequence's context: one query token per sequence
 * (a decode), or a few consecutive tokens of a prefill chunk (paged_prefill.c's tasks where it has no packed
 * path), over the block table, K and V read where they sit in the pool (no gather, no padding, nothing past a
 * row's length).
 *
 * Built by kernels/cpu_kernels.py on first use (cc -O3 -fopenmp, one build per ISA level) and called through ctypes.
 * Its OpenMP is the one torch already loaded (same soname), so it runs on torch's threads and follows
 * torch.set_num_threads.
 *
 * Layout (kernels/paged_attention.py): q [B, H, D] with row stride q_stride (elements); pool [Hkv, NB, bs, D]
 * contiguous; block_tables [B, *] int32 with row stride table_stride; seq_lens [B] int32 (>= 1); out [B, H, D]
 * contiguous. Head h reads KV head h / (H / Hkv). Elements are bf16 (as uint16_t) or fp32.
 *
 * One task per (sequence, KV head) and its rows: `tokens` consecutive query tokens, each with the G = H / Hkv
 * query heads of that KV head (row r: token r / G, head r % G), all reading the same K and V rows, converted to
 * fp32 once; token i sees positions 0 .. first_len + i - 1 (a decode: one token seeing the whole context), or with
 * a sliding window W > 0 only the last W of them, first_len + i - W .. first_len + i - 1 (clamped at 0).
 * Chunk by chunk of positions, an online softmax (running max m, sum l, accumulator acc) in fp32 per row, as
 * the Triton kernel does; the output is acc / l in the pool's type. As kernels/paged_attention.py's twins define
 * them: with a softcap c > 0 (Gemma 2) each scaled score s becomes c * tanh(s / c) before the softmax; with sinks
 * (GPT-OSS, one fp32 logit per query head) each row's softmax starts from its head's sink as a position with no
 * value (m = sink, l = 1), so that exp(sink - m) joins the denominator, m the max over the scores and the sink.
 *
 * Chunks of positions start at multiples of the chunk width (16, 8, or a block), from the chunk holding the task's
 * first seen position; a row takes part only in the chunks where it sees a position, masking the others in them.
 * Each row's arithmetic depends only on its own q, its length, the window and the keys, never on the other rows: a
 * sequence's output does not change with the batch around it, and a prefill row has the bits of the decode of
 * the same position (a stream resumed elsewhere from its delivered tokens goes on as it would have).
 *
 * Three ways through a task: 16 positions at a time in AVX-512 lanes (bf16 q.k by pairs with AVX512-BF16), 8 at a
 * time in AVX2 + FMA lanes (bf16 widened to fp32 in registers), or the portable loops block by block (head_dim no
 * multiple of the lanes, or the generic build).
 *
 * `attend` is written once and inlined into one function per (type, G, D) for a decode of the common head
 * shapes, where the compiler unrolls the loops over G and D and keeps q and the accumulators in registers, and
 * into one per (type, D) for prefill rows; other shapes run the same code with G and D known only at run time.
 */

#include <stdlib.h>

#include "common.h"
#include "kernels.h"

#define MAX_ROWS 16      /* rows per task: query heads per KV head, times tokens */
#define MAX_HEAD_DIM 256
#define MAX_BLOCK 256    /* tokens per KV block */

/* Row `i` of a bf16 (is_bf16) or fp32 array, as fp32. */
static inline void load_row(const void *base, int64_t i, int is_bf16, float *dst, int n) {
    if (is_bf16) {
        const uint16_t *src = (const uint16_t *)base + i * n;
#pragma omp simd
        for (int d = 0; d < n; d++) dst[d] = bf16_to_f32(src[d]);
    } else {
        const float *src = (const float *)base + i * n;
#pragma omp simd
        for (int d = 0; d < n; d++) dst[d] = src[d];
    }
}

static inline void store_row(const float *src, void *base, int64_t i, int is_bf16, int n) {
    if (is_bf16) {
        uint16_t *dst = (uint16_t *)base + i * n;
        for (int d = 0; d < n; d++) dst[d] = f32_to_bf16(src[d]);
    } else {
        float *dst = (float *)base + i * n;
        for (int d = 0; d < n; d++) dst[d] = src[d];
    }
}

/* The rows of one task (see the top): where row r's q and output are, and how many positions it sees. */
typedef struct {
    const char *q;            /* token 0, head 0 */
    int64_t q_token_bytes;    /* from one token's q to the next's */
    char *out;
    int64_t out_token_bytes;
    int first_len;            /* positions token 0 sees; token i sees first_len + i */
    int window;               /* > 0: each token sees only its last `window` positions; 0: all of them */
    float softcap;            /* > 0: scores s become softcap * tanh(s / softcap); 0: none */
    const float *sinks;       /* the group's heads' sink logits (row r: sinks[r % group]); NULL: none */
} Rows;

/* Row r's online softmax before any position: its sink as a position with no value (m = sink, l = 1), or nothing. */
static inline void start_row(const Rows *rows, int r, int group, float *m, float *l) {
    *m = rows->sinks ? rows->sinks[r % group] : -INFINITY;
    *l = rows->sinks ? 1.0f : 0.0f;
}

static inline const char *q_of(const Rows *rows, int r, int group, int64_t row_bytes) {
    return rows->q + (int64_t)(r / group) * rows->q_token_bytes + (int64_t)(r % group) * row_bytes;
}

static inline char *out_of(const Rows *rows, int r, int group, int64_t row_bytes) {
    return rows->out + (int64_t)(r / group) * rows->out_token_bytes + (int64_t)(r % group) * row_bytes;
}

/* The first row that sees position `start` (rows are in token order, so lengths never decrease with r). A decode
 * (`tokens` 1, a constant where inlined) sees every position up to its length: 0, known to the compiler, so that
 * the loops over its rows keep their constant trip counts (and q and the accumulators stay in registers). */
static inline int first_row_seeing(const Rows *rows, int start, const int tokens, int group) {
    if (tokens == 1) return 0;
    return start >= rows->first_len ? (start - rows->first_len + 1) * group : 0;
}

/* Of the `width` positions from `start` (all of them seen by the longest row), how many row r sees (<= 0: none). */
static inline int seen_by(const Rows *rows, int r, const int tokens, int group, int start, int width) {
    if (tokens == 1) return width;
    int n = rows->first_len + r / group - start;
    return n < width ? n : width;
}

/* The first position row r sees (0 without a window). */
static inline int row_low(const Rows *rows, int r, int group) {
    if (!rows->window) return 0;
    int low = rows->first_len + r / group - rows->window;
    return low > 0 ? low : 0;
}

/* The first position of the chunk (of `width` positions, chunks aligned to multiples of it) where row 0 starts
 * seeing: rows later in the task start no earlier. */
static inline int first_chunk(const Rows *rows, int width) { return row_low(rows, 0, 1) / width * width; }

/* How many rows (from row 0) see a position before `end`: the rows past them start later (windows only). */
static inline int rows_seeing_before(const Rows *rows, int end, const int tokens, int group, int nrows) {
    if (!rows->window || tokens == 1) return nrows;
    int t = end - rows->first_len + rows->window;   /* tokens t' < t have row_low < end */
    return t >= tokens ? nrows : t * group;
}

/* Of the positions from `start`, how many row r skips at the front of the chunk (its window starts later). */
static inline int skipped_by(const Rows *rows, int r, int group, int start) {
    int n = row_low(rows, r, group) - start;
    return n > 0 ? n : 0;
}

/* q . k in a fixed order, whatever the compiler vectorizes: 8 running sums over the dims, added pairwise, then the
 * dims past the last 8 (a vectorized reduction would sum in an order that depends on how each copy is compiled). */
static inline float dot_fixed(const float *a, const float *b, int n) {
    float part[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int d = 0;
    for (; d + 8 <= n; d += 8)
        for (int j = 0; j < 8; j++) part[j] += a[d + j] * b[d + j];
    float sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
    for (; d < n; d++) sum += a[d] * b[d];
    return sum;
}

/* The portable task: block by block, scalar softmax sums in position order. */
static inline __attribute__((always_inline)) void attend_portable(const Rows *rows, const void *k_pool,
                                                                  const void *v_pool, const int32_t *table,
                                                                  const int tokens, const int group, const int head_dim,
                                                                  int block_size, float scale, const int is_bf16) {
    const int nrows = tokens * group, len = rows->first_len + tokens - 1;
    const int64_t row_bytes = (int64_t)head_dim * (is_bf16 ? 2 : 4);
    float qf[MAX_ROWS][MAX_HEAD_DIM], acc[MAX_ROWS][MAX_HEAD_DIM];
    float s[MAX_ROWS][MAX_BLOCK], m[MAX_ROWS], l[MAX_ROWS], row[MAX_HEAD_DIM];
    for (int r = 0; r < nrows; r++) {
        load_row(q_of(rows, r, group, row_bytes), 0, is_bf16, qf[r], head_dim);
        for (int d = 0; d < head_dim; d++) {
            qf[r][d] *= scale;
            acc[r][d] = 0.0f;
        }
        start_row(rows, r, group, &m[r], &l[r]);
    }
    for (int start = first_chunk(rows, block_size); start < len; start += block_size) {
        int n = len - start < block_size ? len - start : block_size;
        int lo = first_row_seeing(rows, start, tokens, group);
        int hi = rows_seeing_before(rows, start + n, tokens, group, nrows);
        int64_t first = (int64_t)table[start / block_size] * block_size;   /* the block's first row */
        for (int t = 0; t < n; t++) {
            load_row(k_pool, first + t, is_bf16, row, head_dim);
            for (int r = lo; r < hi; r++) {
                s[r][t] = dot_fixed(qf[r], row, head_dim);
            }
        }
        for (int r = lo; r < hi; r++) {
            int nr = seen_by(rows, r, tokens, group, start, n), skip = skipped_by(rows, r, group, start);
            if (rows->softcap)
                for (int t = skip; t < nr; t++) s[r][t] = rows->softcap * tanhf(s[r][t] / rows->softcap);
            float top = m[r];
            for (int t = skip; t < nr; t++) top = s[r][t] > top ? s[r][t] : top;
            float rescale = m[r] == -INFINITY ? 0.0f : exp_nonpositive(m[r] - top);
            for (int t = skip; t < nr; t++) s[r][t] = exp_nonpositive(s[r][t] - top);
            float sum = 0.0f;
            for (int t = skip; t < nr; t++) sum += s[r][t];
            l[r] = l[r] * rescale + sum;
            m[r] = top;
            for (int d = 0; d < head_dim; d++) acc[r][d] *= rescale;
        }
        for (int t = 0; t < n; t++) {
            load_row(v_pool, first + t, is_bf16, row, head_dim);
            for (int r = lo; r < hi; r++) {
                if (t >= seen_by(rows, r, tokens, group, start, n) || t < skipped_by(rows, r, group, start)) continue;
                float p = s[r][t];
#pragma omp simd
                for (int d = 0; d < head_dim; d++) acc[r][d] += p * row[d];
            }
        }
    }
    for (int r = 0; r < nrows; r++) {
        float inv = 1.0f / l[r];
        for (int d = 0; d < head_dim; d++) acc[r][d] *= inv;
        store_row(acc[r], out_of(rows, r, group, row_bytes), 0, is_bf16, head_dim);
    }
}

/* The K and V rows of the next `width` positions after the chunk that ends at `block`, `offset`, fetched while this
 * chunk computes: blocks sit anywhere in the pool, so the hardware prefetcher sees only short runs. */
static inline void prefetch_next(const void *k_pool, const void *v_pool, const int32_t *table, int block, int offset,
                                 int from, int len, int width, int block_size, int64_t row_bytes) {
    for (int t = 0; t < width && from + t < len; t++) {
        const int64_t ahead = ((int64_t)table[block] * block_size + offset) * row_bytes;
        for (int64_t byte = 0; byte < row_bytes; byte += 64) {
            __builtin_prefetch((const char *)k_pool + ahead + byte, 0, 3);
            __builtin_prefetch((const char *)v_pool + ahead + byte, 0, 3);
        }
        if (++offset == block_size) {
            offset = 0;
            block++;
        }
    }
}

/* The byte offsets of the next n positions in a KV head's pool; block, offset move past them. */
static inline void next_rows(int64_t *offsets, int n, const int32_t *table, int *block, int *offset, int block_size,
                             int64_t row_bytes) {
    for (int t = 0; t < n; t++) {
        offsets[t] = ((int64_t)table[*block] * block_size + *offset) * row_bytes;
        if (++*offset == block_size) {
            *offset = 0;
            ++*block;
        }
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The AVX-512 task: 16 positions at a time. Each position's q.k is a 16-lane partial sum (D / 16 FMAs);
 * `lane_sums` turns the 16 partials of 16 positions into one vector of their 16 scores (a transpose-add tree,
 * ~3 instructions a score instead of a full horizontal sum each; each output lane sums one input vector, so a
 * row's scores do not depend on the lanes of positions it does not see). Positions are found through the block
 * table one by one, so any block size works. */

/* out[t] = the sum of v[t]'s 16 lanes. */
static inline __m512 lane_sums(const __m512 *v) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)   /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i], v[2i+1] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)   /* per 128-bit lane L: the lane-L sums of v[4i .. 4i+3] */
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    __m512 u01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x44),
                               _mm512_shuffle_f32x4(quads[0], quads[1], 0xEE));
    __m512 u23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x44),
                               _mm512_shuffle_f32x4(quads[2], quads[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}

static inline __attribute__((always_inline)) void attend_avx512(const Rows *rows, const void *k_pool,
                                                                const void *v_pool, const int32_t *table,
                                                                const int tokens, const int group, const int head_dim,
                                                                int block_size, float scale, const int is_bf16) {
    const int nv = head_dim / 16;   /* vectors per row */
    const int nrows = tokens * group, len = rows->first_len + tokens - 1;
    const int64_t row_bytes = (int64_t)head_dim * (is_bf16 ? 2 : 4);
    __m512 qv[MAX_ROWS][MAX_HEAD_DIM / 16], acc[MAX_ROWS][MAX_HEAD_DIM / 16];
    __m512 partial[MAX_ROWS][16];
    float m[MAX_ROWS], l[MAX_ROWS];
    int64_t offsets[16];   /* byte offsets of the chunk's rows in a KV head's pool */
#if defined(__AVX512BF16__)
    /* bf16 rows whose dims come in whole 32s: q . k by pairs of dims (vdpbf16ps) on the raw bf16, the scale
     * applied to the scores; no conversion of K and half the multiply-adds */
    const int dp = is_bf16 && head_dim % 32 == 0;
    __m512i q2[MAX_ROWS][MAX_HEAD_DIM / 32];
#else
    const int dp = 0;
#endif
    for (int r = 0; r < nrows; r++) {
        const char *q_row = q_of(rows, r, group, row_bytes);
        for (int c = 0; c < nv; c++) {
            if (!dp) qv[r][c] = _mm512_mul_ps(load16(q_row, c, is_bf16), _mm512_set1_ps(scale));
            acc[r][c] = _mm512_setzero_ps();
        }
#if defined(__AVX512BF16__)
        if (dp)
            for (int c = 0; c < head_dim / 32; c++) q2[r][c] = _mm512_loadu_si512((const void *)(q_row + 64 * c));
#endif
        start_row(rows, r, group, &m[r], &l[r]);
    }
    const int from = first_chunk(rows, 16);
    int block = from / block_size,
        offset = from % block_size;   /* where the next position lives: table[block], row `offset` of it */
    for (int start = from; start < len; start += 16) {
        const int n = len - start < 16 ? len - start : 16, lo = first_row_seeing(rows, start, tokens, group);
        const int hi = rows_seeing_before(rows, start + n, tokens, group, nrows);
        next_rows(offsets, n, table, &block, &offset, block_size, row_bytes);
        prefetch_next(k_pool, v_pool, table, block, offset, start + 16, len, 16, block_size, row_bytes);
        for (int t = 0; t < 16; t++) {
            if (t >= n) {
                for (int r = lo; r < hi; r++) partial[r][t] = _mm512_setzero_ps();
                continue;
            }
            const char *row = (const char *)k_pool + offsets[t];
#if defined(__AVX512BF16__)
            if (dp) {
                __m512i k2[MAX_HEAD_DIM / 32];
                for (int c = 0; c < head_dim / 32; c++) k2[c] = _mm512_loadu_si512((const void *)(row + 64 * c));
                for (int r = lo; r < hi; r++) {
                    __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)k2[0], (__m512bh)q2[r][0]);
                    for (int c = 1; c < head_dim / 32; c++)
                        sum = _mm512_dpbf16_ps(sum, (__m512bh)k2[c], (__m512bh)q2[r][c]);
                    partial[r][t] = sum;
                }
                continue;
            }
#endif
            __m512 k[MAX_HEAD_DIM / 16];
            for (int c = 0; c < nv; c++) k[c] = load16(row, c, is_bf16);
            for (int r = lo; r < hi; r++) {
                __m512 sum = _mm512_mul_ps(qv[r][0], k[0]);
                for (int c = 1; c < nv; c++) sum = _mm512_fmadd_ps(qv[r][c], k[c], sum);
                partial[r][t] = sum;
            }
        }
        float probs[MAX_ROWS][16];
        for (int r = lo; r < hi; r++) {
            const int seen = seen_by(rows, r, tokens, group, start, n), skip = skipped_by(rows, r, group, start);
            const __mmask16 valid = (__mmask16)(((1u << seen) - 1u) & ~((1u << skip) - 1u));
            __m512 scores = lane_sums(partial[r]);
            if (dp) scores = _mm512_mul_ps(scores, _mm512_set1_ps(scale));
            if (rows->softcap) scores = softcap16(scores, rows->softcap);
            float top = _mm512_mask_reduce_max_ps(valid, scores);
            top = top > m[r] ? top : m[r];
            float rescale = m[r] == -INFINITY ? 0.0f : exp_nonpositive(m[r] - top);
            __m512 p = exp16(_mm512_sub_ps(scores, _mm512_set1_ps(top)), valid);
            l[r] = l[r] * rescale + _mm512_reduce_add_ps(p);
            m[r] = top;
            _mm512_storeu_ps(probs[r], p);
            for (int c = 0; c < nv; c++) acc[r][c] = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(rescale));
        }
        for (int t = 0; t < n; t++) {
            const char *row = (const char *)v_pool + offsets[t];
            __m512 v[MAX_HEAD_DIM / 16];
            for (int c = 0; c < nv; c++) v[c] = load16(row, c, is_bf16);
            for (int r = lo; r < hi; r++) {
                if (t >= seen_by(rows, r, tokens, group, start, n) || t < skipped_by(rows, r, group, start)) continue;
                __m512 p = _mm512_set1_ps(probs[r][t]);
                for (int c = 0; c < nv; c++) acc[r][c] = _mm512_fmadd_ps(p, v[c], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < nrows; r++) {
        float row[MAX_HEAD_DIM];
        __m512 inv = _mm512_set1_ps(1.0f / l[r]);
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(row + 16 * c, _mm512_mul_ps(acc[r][c], inv));
        store_row(row, out_of(rows, r, group, row_bytes), 0, is_bf16, head_dim);
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define ATTEND_AVX2 1

/* out[t] = the sum of v[t]'s 8 lanes (a transpose-add tree, as lane_sums in 16 lanes). */
static inline __m256 lane_sums8(const __m256 *v) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);   /* per 128-bit half: sums of v0..3, v4..7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The AVX2 task (FMA; bf16 rows widened to fp32 in registers): as the AVX-512 one, 8 positions at a time, each
 * position's q.k an 8-lane partial sum (D / 8 FMAs) and `lane_sums8` turning 8 of them into 8 scores. */
static inline __attribute__((always_inline)) void attend_avx2(const Rows *rows, const void *k_pool, const void *v_pool,
                                                              const int32_t *table, const int tokens, const int group,
                                                              const int head_dim, int block_size, float scale,
                                                              const int is_bf16) {
    const int nv = head_dim / 8;   /* vectors per row */
    const int nrows = tokens * group, len = rows->first_len + tokens - 1;
    const int64_t row_bytes = (int64_t)head_dim * (is_bf16 ? 2 : 4);
    __m256 qv[MAX_ROWS][MAX_HEAD_DIM / 8], acc[MAX_ROWS][MAX_HEAD_DIM / 8];
    __m256 partial[MAX_ROWS][8];
    float m[MAX_ROWS], l[MAX_ROWS];
    int64_t offsets[8];   /* byte offsets of the chunk's rows in a KV head's pool */
    for (int r = 0; r < nrows; r++) {
        const char *q_row = q_of(rows, r, group, row_bytes);
        for (int c = 0; c < nv; c++) {
            qv[r][c] = _mm256_mul_ps(load8(q_row, c, is_bf16), _mm256_set1_ps(scale));
            acc[r][c] = _mm256_setzero_ps();
        }
        start_row(rows, r, group, &m[r], &l[r]);
    }
    const int from = first_chunk(rows, 8);
    int block = from / block_size,
        offset = from % block_size;   /* where the next position lives: table[block], row `offset` of it */
    for (int start = from; start < len; start += 8) {
        const int n = len - start < 8 ? len - start : 8, lo = first_row_seeing(rows, start, tokens, group);
        const int hi = rows_seeing_before(rows, start + n, tokens, group, nrows);
        next_rows(offsets, n, table, &block, &offset, block_size, row_bytes);
        prefetch_next(k_pool, v_pool, table, block, offset, start + 8, len, 8, block_size, row_bytes);
        for (int t = 0; t < 8; t++) {
            if (t >= n) {
                for (int r = lo; r < hi; r++) partial[r][t] = _mm256_setzero_ps();
                continue;
            }
            const char *row = (const char *)k_pool + offsets[t];
            __m256 k[MAX_HEAD_DIM / 8];
            for (int c = 0; c < nv; c++) k[c] = load8(row, c, is_bf16);
            for (int r = lo; r < hi; r++) {
                __m256 sum = _mm256_mul_ps(qv[r][0], k[0]);
                for (int c = 1; c < nv; c++) sum = _mm256_fmadd_ps(qv[r][c], k[c], sum);
                partial[r][t] = sum;
            }
        }
        float probs[MAX_ROWS][8];
        for (int r = lo; r < hi; r++) {
            const __m256 valid = _mm256_andnot_ps(lanes_below(skipped_by(rows, r, group, start)),
                                                  lanes_below(seen_by(rows, r, tokens, group, start, n)));
            __m256 scores = lane_sums8(partial[r]);
            if (rows->softcap) scores = softcap8(scores, rows->softcap);
            float top = hmax8(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scores, valid));
            top = top > m[r] ? top : m[r];
            float rescale = m[r] == -INFINITY ? 0.0f : exp_nonpositive(m[r] - top);
            __m256 p = exp8(_mm256_sub_ps(scores, _mm256_set1_ps(top)), valid);
            l[r] = l[r] * rescale + hsum8(p);
            m[r] = top;
            _mm256_storeu_ps(probs[r], p);
            for (int c = 0; c < nv; c++) acc[r][c] = _mm256_mul_ps(acc[r][c], _mm256_set1_ps(rescale));
        }
        for (int t = 0; t < n; t++) {
            const char *row = (const char *)v_pool + offsets[t];
            __m256 v[MAX_HEAD_DIM / 8];
            for (int c = 0; c < nv; c++) v[c] = load8(row, c, is_bf16);
            for (int r = lo; r < hi; r++) {
                if (t >= seen_by(rows, r, tokens, group, start, n) || t < skipped_by(rows, r, group, start)) continue;
                __m256 p = _mm256_set1_ps(probs[r][t]);
                for (int c = 0; c < nv; c++) acc[r][c] = _mm256_fmadd_ps(p, v[c], acc[r][c]);
            }
        }
    }
    for (int r = 0; r < nrows; r++) {
        float row[MAX_HEAD_DIM];
        __m256 inv = _mm256_set1_ps(1.0f / l[r]);
        for (int c = 0; c < nv; c++) _mm256_storeu_ps(row + 8 * c, _mm256_mul_ps(acc[r][c], inv));
        store_row(row, out_of(rows, r, group, row_bytes), 0, is_bf16, head_dim);
    }
}
#endif

/* The AVX-512 task where the machine has it and rows are whole vectors, else the AVX2 one, the portable one otherwise. */
static inline __attribute__((always_inline)) void attend(const Rows *rows, const void *k_pool, const void *v_pool,
                                                         const int32_t *table, const int tokens, const int group,
                                                         const int head_dim, int block_size, float scale,
                                                         const int is_bf16) {
#if defined(__AVX512F__)
    if (head_dim % 16 == 0) {
        attend_avx512(rows, k_pool, v_pool, table, tokens, group, head_dim, block_size, scale, is_bf16);
        return;
    }
#elif defined(ATTEND_AVX2)
    if (head_dim % 8 == 0) {
        attend_avx2(rows, k_pool, v_pool, table, tokens, group, head_dim, block_size, scale, is_bf16);
        return;
    }
#endif
    attend_portable(rows, k_pool, v_pool, table, tokens, group, head_dim, block_size, scale, is_bf16);
}

typedef void (*task_fn)(const Rows *, const void *, const void *, const int32_t *, int, int, int, int, float);

/* One task function per (type, T, G, D): TASK(bf16, 1, 1, 3, 64) is task_bf16_1_3_64 (a decode of 3 heads a KV
 * head, head_dim 64); T, G or D are known only at run time where 0. Laid out by hand: clang-format reads a macro
 * that defines functions as one long expression. */
/* clang-format off */
#define TASK(NAME, IS_BF16, T, G, D)                                                                            \
    static void task_##NAME##_##T##_##G##_##D(const Rows *rows, const void *k, const void *v,                  \
                                              const int32_t *table, int tokens, int group, int head_dim,      \
                                              int block_size, float scale) {                                   \
        attend(rows, k, v, table, T ? T : tokens, G ? G : group, D ? D : head_dim, block_size, scale, IS_BF16); \
    }
#define TASKS(NAME, IS_BF16)                                                                                   \
    TASK(NAME, IS_BF16, 1, 0, 0)                                                                               \
    TASK(NAME, IS_BF16, 1, 1, 64) TASK(NAME, IS_BF16, 1, 2, 64) TASK(NAME, IS_BF16, 1, 3, 64)                  \
    TASK(NAME, IS_BF16, 1, 4, 64) TASK(NAME, IS_BF16, 1, 5, 64) TASK(NAME, IS_BF16, 1, 6, 64)                  \
    TASK(NAME, IS_BF16, 1, 7, 64) TASK(NAME, IS_BF16, 1, 8, 64)                                                \
    TASK(NAME, IS_BF16, 1, 1, 128) TASK(NAME, IS_BF16, 1, 2, 128) TASK(NAME, IS_BF16, 1, 3, 128)               \
    TASK(NAME, IS_BF16, 1, 4, 128) TASK(NAME, IS_BF16, 1, 5, 128) TASK(NAME, IS_BF16, 1, 6, 128)               \
    TASK(NAME, IS_BF16, 1, 7, 128) TASK(NAME, IS_BF16, 1, 8, 128)                                              \
    TASK(NAME, IS_BF16, 0, 0, 0) TASK(NAME, IS_BF16, 0, 0, 64) TASK(NAME, IS_BF16, 0, 0, 128)                  \
    static task_fn pick_##NAME(int tokens_known, int group, int head_dim) {                                    \
        static const task_fn d64[9] = {0, task_##NAME##_1_1_64, task_##NAME##_1_2_64, task_##NAME##_1_3_64,   \
                                       task_##NAME##_1_4_64, task_##NAME##_1_5_64, task_##NAME##_1_6_64,      \
                                       task_##NAME##_1_7_64, task_##NAME##_1_8_64};                           \
        static const task_fn d128[9] = {0, task_##NAME##_1_1_128, task_##NAME##_1_2_128,                      \
                                        task_##NAME##_1_3_128, task_##NAME##_1_4_128, task_##NAME##_1_5_128,  \
                                        task_##NAME##_1_6_128, task_##NAME##_1_7_128, task_##NAME##_1_8_128}; \
        if (!tokens_known)                                                                                     \
            return head_dim == 64 ? task_##NAME##_0_0_64                                                       \
                 : head_dim == 128 ? task_##NAME##_0_0_128 : task_##NAME##_0_0_0;                              \
        if (group <= 8 && head_dim == 64) return d64[group];                                                   \
        if (group <= 8 && head_dim == 128) return d128[group];                                                 \
        return task_##NAME##_1_0_0;                                                                            \
    }
/* clang-format on */

TASKS(bf16, 1)
TASKS(f32, 0)

/* The checks every entry point makes: a layout in the limits above, 0; else -1. */
static int shapes_fit(int group, int head_dim, int block_size) {
    return group < 1 || group > MAX_ROWS || head_dim > MAX_HEAD_DIM || head_dim < 1 || block_size > MAX_BLOCK
                   || block_size < 1
               ? -1
               : 0;
}

/* Decodes (`window` > 0: each sees its last `window` positions; 0: all; `softcap` > 0: scores soft-capped, 0: not;
 * `sinks` [num_heads] fp32 or NULL: see the top): 0 on success; -1 for shapes past the limits above or a negative
 * window or softcap (the caller checks them first), -2 for a length < 1 or past the table, or a table entry outside
 * the pool (nothing is computed then). Elements are bf16 or fp32 by is_bf16. */
int paged_decode(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool, const int32_t *block_tables,
                 int64_t table_stride, int64_t table_width, const int32_t *seq_lens, void *out, int num_seqs,
                 int num_heads, int num_kv_heads, int head_dim, int block_size, int64_t num_blocks, float scale,
                 int is_bf16, int window, float softcap, const float *sinks) {
    int group = num_heads / num_kv_heads, elem = is_bf16 ? 2 : 4;
    if (window < 0 || !(softcap >= 0.0f)) return -1;
    if (shapes_fit(group, head_dim, block_size)) return -1;
    for (int64_t b = 0; b < num_seqs; b++) {   /* nothing read outside the pool or the table */
        int64_t len = seq_lens[b], used = (len + block_size - 1) / block_size;
        if (len < 1 || used > table_width) return -2;
        for (int64_t j = 0; j < used; j++) {
            int32_t block = block_tables[b * table_stride + j];
            if (block < 0 || block >= num_blocks) return -2;
        }
    }
    task_fn task = is_bf16 ? pick_bf16(1, group, head_dim) : pick_f32(1, group, head_dim);
    int64_t head_stride = num_blocks * block_size * head_dim * elem;   /* bytes between KV heads in the pool */
    int64_t tasks = (int64_t)num_seqs * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; i++) {
        int64_t b = i / num_kv_heads, h = i % num_kv_heads;
        Rows rows = {(const char *)q + (b * q_stride + h * group * head_dim) * elem,
                     0,
                     (char *)out + (b * num_heads + h * group) * head_dim * elem,
                     0,
                     seq_lens[b],
                     window,
                     softcap,
                     sinks ? sinks + h * group : NULL};
        task(&rows, (const char *)k_pool + h * head_stride, (const char *)v_pool + h * head_stride,
             block_tables + b * table_stride, 1, group, head_dim, block_size, scale);
    }
    return 0;
}

/* Decode rows in runs (a speculative verification: a request's last token and its k drafts,
 * worker/speculative/verification.py): run i is runs[i] consecutive rows of one sequence at consecutive positions, its
 * first row at r0 (the lengths of the runs before it summed), seeing seq_lens[r0] positions, row r0 + t seeing
 * seq_lens[r0] + t (the K and V of all of them already in the pool), all through row r0's block table. Each (run, KV
 * head) reads K and V once for up to MAX_ROWS / G of its tokens (a longer run in pieces), where paged_decode reads them
 * once per row; each row's arithmetic is its decode's (`attend` computes a row from its own q, length and window only),
 * so the bits are paged_decode's for the same rows (tests/kernels/test_cpu_kernels.py). runs NULL: each row a run of
 * one (paged_decode). Returns as paged_decode; -2 also for runs that do not add up to num_rows or lengths that do not
 * go up by one within a run; -3 no memory. */
int paged_decode_runs(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                      const int32_t *block_tables, int64_t table_stride, int64_t table_width, const int32_t *seq_lens,
                      const int32_t *runs, int num_runs, void *out, int num_rows, int num_heads, int num_kv_heads,
                      int head_dim, int block_size, int64_t num_blocks, float scale, int is_bf16, int window,
                      float softcap, const float *sinks) {
    if (!runs)
        return paged_decode(q, q_stride, k_pool, v_pool, block_tables, table_stride, table_width, seq_lens, out,
                            num_rows, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, is_bf16, window,
                            softcap, sinks);
    int group = num_heads / num_kv_heads, elem = is_bf16 ? 2 : 4;
    if (window < 0 || !(softcap >= 0.0f) || shapes_fit(group, head_dim, block_size) || num_runs < 1) return -1;
    const int piece = MAX_ROWS / group;   /* tokens of a run one task takes */
    int64_t pieces = 0, row = 0;
    for (int i = 0; i < num_runs; row += runs[i++]) {   /* nothing read outside the pool or the table */
        if (runs[i] < 1 || row + runs[i] > num_rows || seq_lens[row] < 1) return -2;
        for (int t = 1; t < runs[i]; t++)
            if (seq_lens[row + t] != seq_lens[row] + t) return -2;
        int64_t len = (int64_t)seq_lens[row] + runs[i] - 1, used = (len + block_size - 1) / block_size;
        if (used > table_width) return -2;
        for (int64_t j = 0; j < used; j++) {
            int32_t block = block_tables[row * table_stride + j];
            if (block < 0 || block >= num_blocks) return -2;
        }
        pieces += (runs[i] + piece - 1) / piece;
    }
    if (row != num_rows) return -2;
    int32_t *plan = (int32_t *)malloc((size_t)pieces * 3 * sizeof(int32_t)); /* a piece: first row, rows, run's row */
    if (!plan) return -3;
    int64_t p = 0;
    row = 0;
    for (int i = 0; i < num_runs; row += runs[i++])
        for (int t = 0; t < runs[i]; t += piece, p++) {
            plan[3 * p] = (int32_t)(row + t);
            plan[3 * p + 1] = runs[i] - t < piece ? runs[i] - t : piece;
            plan[3 * p + 2] = (int32_t)row;
        }
    int64_t head_stride = num_blocks * block_size * head_dim * elem; /* bytes between KV heads in the pool */
    task_fn one = is_bf16 ? pick_bf16(1, group, head_dim) : pick_f32(1, group, head_dim);
    task_fn many = is_bf16 ? pick_bf16(0, group, head_dim) : pick_f32(0, group, head_dim);
    int64_t tasks = pieces * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; i++) {
        int64_t pc = i / num_kv_heads, h = i % num_kv_heads, r = plan[3 * pc];
        int tokens = plan[3 * pc + 1];
        Rows rows = {(const char *)q + (r * q_stride + h * group * head_dim) * elem,
                     q_stride * elem,
                     (char *)out + (r * num_heads + h * group) * head_dim * elem,
                     (int64_t)num_heads * head_dim * elem,
                     seq_lens[r],
                     window,
                     softcap,
                     sinks ? sinks + h * group : NULL};
        (tokens == 1 ? one : many)(
            &rows, (const char *)k_pool + h * head_stride, (const char *)v_pool + h * head_stride,
            block_tables + (int64_t)plan[3 * pc + 2] * table_stride, tokens, group, head_dim, block_size, scale);
    }
    free(plan);
    return 0;
}

/* Prefill rows (paged_prefill.c's tasks without a packed path): tokens t0 .. t1 - 1 of a chunk whose first token
 * sees first_len positions, times the group's heads of one KV head (t1 - t0 <= attend_max_tokens(group)); q, out
 * at token t0, head 0 of that group; k_pool, v_pool that KV head's pool; sinks that group's (or NULL); the caller
 * has checked the shapes and the table. */
int attend_max_tokens(int group) { return MAX_ROWS / group; }

void attend_rows(const void *q, int64_t q_token_bytes, const void *k_pool, const void *v_pool, const int32_t *table,
                 int first_len, int tokens, void *out, int64_t out_token_bytes, int group, int head_dim, int block_size,
                 float scale, int is_bf16, int window, float softcap, const float *sinks) {
    Rows rows = {(const char *)q, q_token_bytes, (char *)out, out_token_bytes, first_len, window, softcap, sinks};
    task_fn task = is_bf16 ? pick_bf16(0, group, head_dim) : pick_f32(0, group, head_dim);
    task(&rows, k_pool, v_pool, table, tokens, group, head_dim, block_size, scale);
}
