/* Paged decode attention on CPU: one query token per sequence over its block table, K and V read where they
 * sit in the pool (no gather, no padding, nothing past a sequence's length).
 *
 * Built by kernels/cpu_kernels.py on first use (cc -O3 -fopenmp, one build per ISA level) and called through ctypes.
 * Its OpenMP is the one torch already loaded (same soname), so it runs on torch's threads and follows
 * torch.set_num_threads.
 *
 * Layout (kernels/paged_attention.py): q [B, H, D] with row stride q_stride (elements); pool [Hkv, NB, bs, D]
 * contiguous; block_tables [B, *] int32 with row stride table_stride; seq_lens [B] int32 (>= 1); out [B, H, D]
 * contiguous. Head h reads KV head h / (H / Hkv). Elements are bf16 (as uint16_t) or fp32.
 *
 * One task per (sequence, KV head): its G = H / Hkv query heads share each K and V row, converted to fp32
 * once. Block by block, an online softmax (running max m, sum l, accumulator acc) in fp32, as the Triton
 * kernel does; the output is acc / l in the pool's type. Each task's arithmetic depends only on its own
 * sequence, so a sequence's output does not change with the batch around it.
 *
 * Three ways through a task: 16 positions at a time in AVX-512 lanes (bf16 q.k by pairs with AVX512-BF16), 8 at a
 * time in AVX2 + FMA lanes (bf16 widened to fp32 in registers), or the portable loops (head_dim no multiple of
 * the lanes, or the generic build).
 *
 * `decode_task` is written once and inlined into one function per (type, G, D) for the common head shapes,
 * where the compiler unrolls the loops over G and D and keeps q and the accumulators in registers; other
 * shapes run the same code with G and D known only at run time.
 */

#include "common.h"

#define MAX_GROUP 16     /* query heads per KV head */
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

static inline __attribute__((always_inline)) void decode_task(
        const void *q, const void *k_pool, const void *v_pool, const int32_t *table, int len, void *out,
        const int group, const int head_dim, int block_size, float scale, const int is_bf16) {
    float qf[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
    float s[MAX_GROUP][MAX_BLOCK], m[MAX_GROUP], l[MAX_GROUP], row[MAX_HEAD_DIM];
    for (int g = 0; g < group; g++) {
        load_row(q, g, is_bf16, qf[g], head_dim);
        for (int d = 0; d < head_dim; d++) { qf[g][d] *= scale; acc[g][d] = 0.0f; }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    for (int start = 0; start < len; start += block_size) {
        int n = len - start < block_size ? len - start : block_size;
        int64_t first = (int64_t)table[start / block_size] * block_size;   /* the block's first row */
        for (int t = 0; t < n; t++) {
            load_row(k_pool, first + t, is_bf16, row, head_dim);
            for (int g = 0; g < group; g++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < head_dim; d++) dot += qf[g][d] * row[d];
                s[g][t] = dot;
            }
        }
        for (int g = 0; g < group; g++) {
            float top = m[g];
            for (int t = 0; t < n; t++) top = s[g][t] > top ? s[g][t] : top;
            float rescale = m[g] == -INFINITY ? 0.0f : exp_nonpositive(m[g] - top);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < n; t++) {
                s[g][t] = exp_nonpositive(s[g][t] - top);
                sum += s[g][t];
            }
            l[g] = l[g] * rescale + sum;
            m[g] = top;
            for (int d = 0; d < head_dim; d++) acc[g][d] *= rescale;
        }
        for (int t = 0; t < n; t++) {
            load_row(v_pool, first + t, is_bf16, row, head_dim);
            for (int g = 0; g < group; g++) {
                float p = s[g][t];
#pragma omp simd
                for (int d = 0; d < head_dim; d++) acc[g][d] += p * row[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float inv = 1.0f / l[g];
        for (int d = 0; d < head_dim; d++) acc[g][d] *= inv;
        store_row(acc[g], out, g, is_bf16, head_dim);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* The AVX-512 task: 16 positions at a time. Each position's q.k is a 16-lane partial sum (D / 16 FMAs);
 * `lane_sums` turns the 16 partials of 16 positions into one vector of their 16 scores (a transpose-add tree,
 * ~3 instructions a score instead of a full horizontal sum each). Positions are found through the block
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

static inline __attribute__((always_inline)) void decode_task_avx512(
        const void *q, const void *k_pool, const void *v_pool, const int32_t *table, int len, void *out,
        const int group, const int head_dim, int block_size, float scale, const int is_bf16) {
    const int nv = head_dim / 16;   /* vectors per row */
    const int elem = is_bf16 ? 2 : 4;
    __m512 qv[MAX_GROUP][MAX_HEAD_DIM / 16], acc[MAX_GROUP][MAX_HEAD_DIM / 16];
    __m512 partial[MAX_GROUP][16];
    float m[MAX_GROUP], l[MAX_GROUP];
    int64_t rows[16];   /* byte offsets of the chunk's rows in a KV head's pool */
#if defined(__AVX512BF16__)
    /* bf16 rows whose dims come in whole 32s: q . k by pairs of dims (vdpbf16ps) on the raw bf16, the scale
     * applied to the scores; no conversion of K and half the multiply-adds */
    const int dp = is_bf16 && head_dim % 32 == 0;
    __m512i q2[MAX_GROUP][MAX_HEAD_DIM / 32];
#else
    const int dp = 0;
#endif
    for (int g = 0; g < group; g++) {
        const char *q_row = (const char *)q + (int64_t)g * head_dim * elem;
        for (int c = 0; c < nv; c++) {
            if (!dp) qv[g][c] = _mm512_mul_ps(load16(q_row, c, is_bf16), _mm512_set1_ps(scale));
            acc[g][c] = _mm512_setzero_ps();
        }
#if defined(__AVX512BF16__)
        if (dp)
            for (int c = 0; c < head_dim / 32; c++) q2[g][c] = _mm512_loadu_si512((const void *)(q_row + 64 * c));
#endif
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const int64_t row_bytes = (int64_t)head_dim * elem;
    int block = 0, offset = 0;   /* where the next position lives: table[block], row `offset` of it */
    for (int start = 0; start < len; start += 16) {
        int n = len - start < 16 ? len - start : 16;
        __mmask16 valid = (__mmask16)((1u << n) - 1u);
        for (int t = 0; t < n; t++) {
            rows[t] = ((int64_t)table[block] * block_size + offset) * row_bytes;
            if (++offset == block_size) {
                offset = 0;
                block++;
            }
        }
        /* the next chunk's K and V rows, fetched while this one computes: blocks sit anywhere in the pool,
         * so the hardware prefetcher sees only short runs */
        for (int t = 0, next_block = block, next_offset = offset; t < 16 && start + 16 + t < len; t++) {
            const int64_t ahead = ((int64_t)table[next_block] * block_size + next_offset) * row_bytes;
            for (int64_t byte = 0; byte < row_bytes; byte += 64) {
                _mm_prefetch((const char *)k_pool + ahead + byte, _MM_HINT_T0);
                _mm_prefetch((const char *)v_pool + ahead + byte, _MM_HINT_T0);
            }
            if (++next_offset == block_size) {
                next_offset = 0;
                next_block++;
            }
        }
        for (int t = 0; t < 16; t++) {
            if (t >= n) {
                for (int g = 0; g < group; g++) partial[g][t] = _mm512_setzero_ps();
                continue;
            }
            const char *row = (const char *)k_pool + rows[t];
#if defined(__AVX512BF16__)
            if (dp) {
                __m512i k2[MAX_HEAD_DIM / 32];
                for (int c = 0; c < head_dim / 32; c++) k2[c] = _mm512_loadu_si512((const void *)(row + 64 * c));
                for (int g = 0; g < group; g++) {
                    __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)k2[0], (__m512bh)q2[g][0]);
                    for (int c = 1; c < head_dim / 32; c++)
                        sum = _mm512_dpbf16_ps(sum, (__m512bh)k2[c], (__m512bh)q2[g][c]);
                    partial[g][t] = sum;
                }
                continue;
            }
#endif
            __m512 k[MAX_HEAD_DIM / 16];
            for (int c = 0; c < nv; c++) k[c] = load16(row, c, is_bf16);
            for (int g = 0; g < group; g++) {
                __m512 sum = _mm512_mul_ps(qv[g][0], k[0]);
                for (int c = 1; c < nv; c++) sum = _mm512_fmadd_ps(qv[g][c], k[c], sum);
                partial[g][t] = sum;
            }
        }
        float probs[MAX_GROUP][16];
        for (int g = 0; g < group; g++) {
            __m512 scores = lane_sums(partial[g]);
            if (dp) scores = _mm512_mul_ps(scores, _mm512_set1_ps(scale));
            float top = _mm512_mask_reduce_max_ps(valid, scores);
            top = top > m[g] ? top : m[g];
            float rescale = m[g] == -INFINITY ? 0.0f : exp_nonpositive(m[g] - top);
            __m512 p = exp16(_mm512_sub_ps(scores, _mm512_set1_ps(top)), valid);
            l[g] = l[g] * rescale + _mm512_reduce_add_ps(p);
            m[g] = top;
            _mm512_storeu_ps(probs[g], p);
            for (int c = 0; c < nv; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(rescale));
        }
        for (int t = 0; t < n; t++) {
            const char *row = (const char *)v_pool + rows[t];
            __m512 v[MAX_HEAD_DIM / 16];
            for (int c = 0; c < nv; c++) v[c] = load16(row, c, is_bf16);
            for (int g = 0; g < group; g++) {
                __m512 p = _mm512_set1_ps(probs[g][t]);
                for (int c = 0; c < nv; c++) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float row[MAX_HEAD_DIM];
        __m512 inv = _mm512_set1_ps(1.0f / l[g]);
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(row + 16 * c, _mm512_mul_ps(acc[g][c], inv));
        store_row(row, out, g, is_bf16, head_dim);
    }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define DECODE_AVX2 1

/* out[t] = the sum of v[t]'s 8 lanes (a transpose-add tree, as lane_sums in 16 lanes). */
static inline __m256 lane_sums8(const __m256 *v) {
    __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);   /* per 128-bit half: sums of v0..3, v4..7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The AVX2 task (FMA; bf16 rows widened to fp32 in registers): as the AVX-512 one, 8 positions at a time, each
 * position's q.k an 8-lane partial sum (D / 8 FMAs) and `lane_sums8` turning 8 of them into 8 scores. */
static inline __attribute__((always_inline)) void decode_task_avx2(
        const void *q, const void *k_pool, const void *v_pool, const int32_t *table, int len, void *out,
        const int group, const int head_dim, int block_size, float scale, const int is_bf16) {
    const int nv = head_dim / 8;   /* vectors per row */
    const int elem = is_bf16 ? 2 : 4;
    __m256 qv[MAX_GROUP][MAX_HEAD_DIM / 8], acc[MAX_GROUP][MAX_HEAD_DIM / 8];
    __m256 partial[MAX_GROUP][8];
    float m[MAX_GROUP], l[MAX_GROUP];
    int64_t rows[8];   /* byte offsets of the chunk's rows in a KV head's pool */
    for (int g = 0; g < group; g++) {
        const char *q_row = (const char *)q + (int64_t)g * head_dim * elem;
        for (int c = 0; c < nv; c++) {
            qv[g][c] = _mm256_mul_ps(load8(q_row, c, is_bf16), _mm256_set1_ps(scale));
            acc[g][c] = _mm256_setzero_ps();
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    const int64_t row_bytes = (int64_t)head_dim * elem;
    int block = 0, offset = 0;   /* where the next position lives: table[block], row `offset` of it */
    for (int start = 0; start < len; start += 8) {
        int n = len - start < 8 ? len - start : 8;
        const __m256 valid = lanes_below(n);
        for (int t = 0; t < n; t++) {
            rows[t] = ((int64_t)table[block] * block_size + offset) * row_bytes;
            if (++offset == block_size) {
                offset = 0;
                block++;
            }
        }
        /* the next chunk's K and V rows, fetched while this one computes (blocks sit anywhere in the pool) */
        for (int t = 0, next_block = block, next_offset = offset; t < 8 && start + 8 + t < len; t++) {
            const int64_t ahead = ((int64_t)table[next_block] * block_size + next_offset) * row_bytes;
            for (int64_t byte = 0; byte < row_bytes; byte += 64) {
                _mm_prefetch((const char *)k_pool + ahead + byte, _MM_HINT_T0);
                _mm_prefetch((const char *)v_pool + ahead + byte, _MM_HINT_T0);
            }
            if (++next_offset == block_size) {
                next_offset = 0;
                next_block++;
            }
        }
        for (int t = 0; t < 8; t++) {
            if (t >= n) {
                for (int g = 0; g < group; g++) partial[g][t] = _mm256_setzero_ps();
                continue;
            }
            const char *row = (const char *)k_pool + rows[t];
            __m256 k[MAX_HEAD_DIM / 8];
            for (int c = 0; c < nv; c++) k[c] = load8(row, c, is_bf16);
            for (int g = 0; g < group; g++) {
                __m256 sum = _mm256_mul_ps(qv[g][0], k[0]);
                for (int c = 1; c < nv; c++) sum = _mm256_fmadd_ps(qv[g][c], k[c], sum);
                partial[g][t] = sum;
            }
        }
        float probs[MAX_GROUP][8];
        for (int g = 0; g < group; g++) {
            __m256 scores = lane_sums8(partial[g]);
            float top = hmax8(_mm256_blendv_ps(_mm256_set1_ps(-INFINITY), scores, valid));
            top = top > m[g] ? top : m[g];
            float rescale = m[g] == -INFINITY ? 0.0f : exp_nonpositive(m[g] - top);
            __m256 p = exp8(_mm256_sub_ps(scores, _mm256_set1_ps(top)), valid);
            l[g] = l[g] * rescale + hsum8(p);
            m[g] = top;
            _mm256_storeu_ps(probs[g], p);
            for (int c = 0; c < nv; c++) acc[g][c] = _mm256_mul_ps(acc[g][c], _mm256_set1_ps(rescale));
        }
        for (int t = 0; t < n; t++) {
            const char *row = (const char *)v_pool + rows[t];
            __m256 v[MAX_HEAD_DIM / 8];
            for (int c = 0; c < nv; c++) v[c] = load8(row, c, is_bf16);
            for (int g = 0; g < group; g++) {
                __m256 p = _mm256_set1_ps(probs[g][t]);
                for (int c = 0; c < nv; c++) acc[g][c] = _mm256_fmadd_ps(p, v[c], acc[g][c]);
            }
        }
    }
    for (int g = 0; g < group; g++) {
        float row[MAX_HEAD_DIM];
        __m256 inv = _mm256_set1_ps(1.0f / l[g]);
        for (int c = 0; c < nv; c++) _mm256_storeu_ps(row + 8 * c, _mm256_mul_ps(acc[g][c], inv));
        store_row(row, out, g, is_bf16, head_dim);
    }
}
#endif

/* The AVX-512 task where the machine has it and rows are whole vectors, else the AVX2 one, the portable one otherwise. */
static inline __attribute__((always_inline)) void decode_any(
        const void *q, const void *k_pool, const void *v_pool, const int32_t *table, int len, void *out,
        const int group, const int head_dim, int block_size, float scale, const int is_bf16) {
#if defined(__AVX512F__)
    if (head_dim % 16 == 0) {
        decode_task_avx512(q, k_pool, v_pool, table, len, out, group, head_dim, block_size, scale, is_bf16);
        return;
    }
#elif defined(DECODE_AVX2)
    if (head_dim % 8 == 0) {
        decode_task_avx2(q, k_pool, v_pool, table, len, out, group, head_dim, block_size, scale, is_bf16);
        return;
    }
#endif
    decode_task(q, k_pool, v_pool, table, len, out, group, head_dim, block_size, scale, is_bf16);
}

typedef void (*task_fn)(const void *, const void *, const void *, const int32_t *, int, void *, int, int, int,
                        float);

/* One task function per (type, G, D): TASK(bf16, 1, 3, 64) is task_bf16_3_64, run-time G and D when 0. */
#define TASK(NAME, IS_BF16, G, D)                                                                              \
    static void task_##NAME##_##G##_##D(const void *q, const void *k, const void *v, const int32_t *table,    \
                                        int len, void *out, int group, int head_dim, int block_size,          \
                                        float scale) {                                                         \
        decode_any(q, k, v, table, len, out, G ? G : group, D ? D : head_dim, block_size, scale, IS_BF16);     \
    }
#define TASKS(NAME, IS_BF16)                                                                                   \
    TASK(NAME, IS_BF16, 0, 0)                                                                                  \
    TASK(NAME, IS_BF16, 1, 64) TASK(NAME, IS_BF16, 2, 64) TASK(NAME, IS_BF16, 3, 64) TASK(NAME, IS_BF16, 4, 64) \
    TASK(NAME, IS_BF16, 5, 64) TASK(NAME, IS_BF16, 6, 64) TASK(NAME, IS_BF16, 7, 64) TASK(NAME, IS_BF16, 8, 64) \
    TASK(NAME, IS_BF16, 1, 128) TASK(NAME, IS_BF16, 2, 128) TASK(NAME, IS_BF16, 3, 128)                       \
    TASK(NAME, IS_BF16, 4, 128) TASK(NAME, IS_BF16, 5, 128) TASK(NAME, IS_BF16, 6, 128)                       \
    TASK(NAME, IS_BF16, 7, 128) TASK(NAME, IS_BF16, 8, 128)                                                    \
    static task_fn pick_##NAME(int group, int head_dim) {                                                      \
        static const task_fn d64[9] = {0, task_##NAME##_1_64, task_##NAME##_2_64, task_##NAME##_3_64,         \
                                       task_##NAME##_4_64, task_##NAME##_5_64, task_##NAME##_6_64,            \
                                       task_##NAME##_7_64, task_##NAME##_8_64};                               \
        static const task_fn d128[9] = {0, task_##NAME##_1_128, task_##NAME##_2_128, task_##NAME##_3_128,     \
                                        task_##NAME##_4_128, task_##NAME##_5_128, task_##NAME##_6_128,        \
                                        task_##NAME##_7_128, task_##NAME##_8_128};                            \
        if (group <= 8 && head_dim == 64) return d64[group];                                                   \
        if (group <= 8 && head_dim == 128) return d128[group];                                                 \
        return task_##NAME##_0_0;                                                                              \
    }

TASKS(bf16, 1)
TASKS(f32, 0)

static int run(task_fn task, const char *q, int64_t q_stride, const char *k_pool, const char *v_pool,
               const int32_t *block_tables, int64_t table_stride, int64_t table_width, const int32_t *seq_lens,
               char *out, int num_seqs,
               int num_heads, int num_kv_heads, int head_dim, int block_size, int64_t num_blocks, float scale,
               int elem) {
    int group = num_heads / num_kv_heads;
    if (group < 1 || group > MAX_GROUP || head_dim > MAX_HEAD_DIM || block_size > MAX_BLOCK) return -1;
    for (int64_t b = 0; b < num_seqs; b++) {   /* nothing read outside the pool or the table */
        int64_t len = seq_lens[b], used = (len + block_size - 1) / block_size;
        if (len < 1 || used > table_width) return -2;
        for (int64_t j = 0; j < used; j++) {
            int32_t block = block_tables[b * table_stride + j];
            if (block < 0 || block >= num_blocks) return -2;
        }
    }
    int64_t head_stride = num_blocks * block_size * head_dim * elem;   /* bytes between KV heads in the pool */
    int64_t tasks = (int64_t)num_seqs * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < tasks; i++) {
        int64_t b = i / num_kv_heads, h = i % num_kv_heads;
        task(q + (b * q_stride + h * group * head_dim) * elem, k_pool + h * head_stride, v_pool + h * head_stride,
             block_tables + b * table_stride, seq_lens[b], out + (b * num_heads + h * group) * head_dim * elem,
             group, head_dim, block_size, scale);
    }
    return 0;
}

/* The entry point (bf16 or fp32 by is_bf16): 0 on success; -1 for shapes past the limits above (the caller checks
 * them first), -2 for a length < 1 or past the table, or a table entry outside the pool (nothing is computed then). */
int paged_decode(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                 const int32_t *block_tables, int64_t table_stride, int64_t table_width, const int32_t *seq_lens,
                 void *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                 int64_t num_blocks, float scale, int is_bf16) {
    int group = num_heads / num_kv_heads;
    task_fn task = is_bf16 ? pick_bf16(group, head_dim) : pick_f32(group, head_dim);
    return run(task, q, q_stride, k_pool, v_pool, block_tables, table_stride, table_width, seq_lens, out, num_seqs,
               num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, is_bf16 ? 2 : 4);
}
