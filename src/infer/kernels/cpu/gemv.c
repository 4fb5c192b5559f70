/* y = x W^T for bf16 weights as the checkpoint stores them: 1-8 rows of x (a decode step at batch 1-8) stream the
 * weights once from memory, front to back; more rows (a prefill, a larger batch) go through tiles, each sum taken
 * as for one row.
 *
 * At batch 1 a decode step is a walk through every weight byte (SmolLM2-135M: 269 MB a token), so its speed is
 * the memory bandwidth its matmuls reach. oneDNN's bf16 path reached 13-21 GB/s on the per-layer matrices of
 * SmolLM2 (0.7-3.5 MB each) on the 2-core dev VM (2026-11-26), where a sum over a large tensor reads 29-32 GB/s.
 *
 * Layout: x [M, K] bf16; W [N, K] bf16 contiguous (the checkpoint's layout: no packing); y [M, N] bf16. Products by
 * pairs of bf16 (vdpbf16ps: exact products, fp32 sums), each output rounded once to bf16 (nearest even). The sums
 * run in another order than oneDNN's, so an output may differ from F.linear's in its last bit.
 *
 * Rows go one after another, each read front to back into two accumulators (even and odd chunks of 32), so
 * that each thread reads one contiguous region of W in address order: the hardware prefetcher streams it. An
 * earlier version read 8 rows at a time, chunk by chunk (one strided access per row, prefetched in software):
 * 21 GB/s over SmolLM2's 121 matrices of a token against 26 GB/s for this order (2-core dev VM, 2026-11-26;
 * one 269 MB matrix: 30 GB/s, where a sum over a large tensor reads 30-35). Threads take contiguous ranges of
 * rows (torch's OpenMP threads). With M rows of x, each weight row is read once and dotted with all of them,
 * each sum taken as for one row, so a row's output does not depend on the rows beside it. Per SmolLM2 token set
 * against oneDNN's packed path (same VM and day): 1.5-1.7x at M = 1-3, 1.0x at 4-6, 0.9x at 8 (from 4 this loop
 * no longer streams at the bandwidth). Past 8 rows, tiles of 2 rows of x by 4 weight rows (pair_tile). That path
 * needs AVX512-BF16 (with VL and DQ).
 *
 * AVX2 + FMA (Zen 3; also AVX-512 CPUs without BF16): no bf16 products, so the weights are widened to fp32 in
 * registers (vpmovzxwd, shift left 16: exact) and multiplied by fp32 x with fp32 FMAs, 16 weights a step into two
 * 8-lane accumulators per row of x; x is copied once per call into an fp32 buffer padded with zeros to 16, and the
 * weight row's last K % 16 elements into a zero-padded chunk, so every row's sum runs the same code for every M
 * (rows of x go 4 at a time over each weight row while it sits in L1). It takes any number of rows: past 8 (a
 * prefill), tiles of 3 rows of x by 2 weight rows, each sum taken as above, so an output has the same bits in a
 * prefill as in a decode. oneDNN packs no bf16 weight on such a CPU, and ATen's bf16 matmul, the alternative,
 * ran a SmolLM2 prefill 4x slower than fp32 there. The same core serves
 * `gemv_rows_bf16w_f32x`: bf16 weights, fp32 activations and fp32 outputs (an AVX2 machine computes fp32 natively;
 * the weights keep half the bytes). Built with AVX2 only, gemv_rows_bf16(x) is bf16(gemv_rows_bf16w_f32x(x)), bit
 * for bit. Without AVX2 or AVX512-BF16 (the generic build) both return -1 and the caller keeps oneDNN;
 * `gemv_paths` says which paths the build has.
 */

#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "kernels.h"

#define MAX_ROWS 8   /* rows of x a call takes (each weight row read once for all of them) */

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>

static inline __mmask32 chunk_mask(int64_t K, int64_t k) {
    return K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
}

/* Output columns [n0, n1) of M rows (M a constant where inlined): each weight row is read once, front to back,
 * and dotted with every row of x, each row's sum taken exactly as for M = 1 (so a row's output does not depend
 * on the rows beside it). */
static inline __attribute__((always_inline)) void gemv_cols(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                                                            const uint16_t *bias, uint16_t *y, int64_t y_stride,
                                                            int64_t n0, int64_t n1, int64_t K, const int M) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *row = w + n * K;
        __m512 even[MAX_ROWS], odd[MAX_ROWS];
        for (int m = 0; m < M; m++) even[m] = odd[m] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(row + k), w1 = (__m512bh)_mm512_loadu_si512(row + k + 32);
            for (int m = 0; m < M; m++) {
                even[m] = _mm512_dpbf16_ps(even[m], (__m512bh)_mm512_loadu_si512(x + m * x_stride + k), w0);
                odd[m] = _mm512_dpbf16_ps(odd[m], (__m512bh)_mm512_loadu_si512(x + m * x_stride + k + 32), w1);
            }
        }
        for (; k < K; k += 32) {   /* the last 1-63 elements, 32 at a time */
            const __mmask32 live = chunk_mask(K, k);
            const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(live, row + k);
            for (int m = 0; m < M; m++)
                even[m] = _mm512_dpbf16_ps(even[m], (__m512bh)_mm512_maskz_loadu_epi16(live, x + m * x_stride + k), w0);
        }
        const float b = bias ? bf16_to_f32(bias[n]) : 0.0f;
        for (int m = 0; m < M; m++)
            y[m * y_stride + n] = f32_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m])) + b);
    }
}

/* ---- more rows than a GEMV takes (a prefill, a batch past 8, verification rows): tiles of P_ROWS x P_COLS ----
 * Each (row of x, weight row) sum is taken exactly as gemv_cols takes it (even and odd chunks of 32 over 64 a
 * step, the last 1-63 elements masked into the even chain, reduce(even + odd)), so an output has the same bits
 * whatever the number of rows: a row's output does not depend on the rows beside it, in a prefill, a batch or a
 * decode. The tile's weight rows stay in L1 while a block of P_BLOCK rows of x (from L2) passes over them. This
 * path reads the checkpoint's own layout, so a linear keeps one copy of its weight (no oneDNN-packed twin).
 * One core of the 2-core Zen 5 dev VM, 2026-12-01 (vdpbf16ps peak 233 GFLOP/s, one a cycle): 171-182 GFLOP/s on
 * SmolLM2's and a 1B Llama's projections at 64-512 rows, where oneDNN's packed path reaches 205-221 (0.78-0.85x);
 * without the reduction 191 (its dot products leave 16 lanes to add per output, a packed layout leaves none);
 * passes of 1024 columns were slower at K = 2048, of 4096 at K = 8192. */
#define P_ROWS 2    /* rows of x a tile */
#define P_COLS 4    /* weight rows a tile: 2 x 4 x 2 = 16 accumulators, 8 weight and 2 x vectors */
#define P_BLOCK 96  /* rows of x a pass over the thread's weight rows */
#define P_KC 2048   /* columns a pass of a tile (a multiple of 64) */

/* The sums of 8 accumulators (even + odd already added) in one vector, lane j = _mm512_reduce_add_ps(s[j]) bit for
 * bit: the same tree of additions (lane i + lane i + 8, then + 4, + 2, + 1), taken for 8 vectors at once. */
static inline __m256 reduce8(const __m512 *s) {
    __m512 t[4], u[2];
    for (int j = 0; j < 4; j++)   /* i + (i + 8): [s_2j's 8 | s_2j+1's 8] */
        t[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                             _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)));
    for (int j = 0; j < 2; j++)   /* i + (i + 4): quarter q holds output 4j + q's 4 */
        u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* i + (i + 2): quarter q = [out q: 2 | out 4 + q: 2] */
    const __m512 v = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]))));
    /* i + (i + 1): lane 4q = out q, lane 4q + 2 = out 4 + q */
    const __m512 f = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(order, f));
}

/* Tile sums over columns [k0, k1) of K: started at zero where k0 = 0, else from `carry` (the previous pass's
 * accumulators); handed on in `carry` where k1 < K, else finished (the last 1-63 columns, the reduction, the bias,
 * one rounding) into y. k0 and a k1 < K are multiples of 64, so the accumulators see the GEMV's chunks in its order
 * whatever the passes. */
static inline __attribute__((always_inline)) void pair_tile(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                                                            int64_t K, int64_t k0, int64_t k1, __m512 *carry,
                                                            const uint16_t *bias, uint16_t *y, int64_t y_stride,
                                                            const int R, const int C) {
    __m512 even[P_ROWS][P_COLS], odd[P_ROWS][P_COLS];
    if (k0 == 0) {
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) even[r][c] = odd[r][c] = _mm512_setzero_ps();
    } else {
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) {
                even[r][c] = carry[(r * P_COLS + c) * 2];
                odd[r][c] = carry[(r * P_COLS + c) * 2 + 1];
            }
    }
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
        __m512bh w0[P_COLS], w1[P_COLS];
        for (int c = 0; c < C; c++) {
            w0[c] = (__m512bh)_mm512_loadu_si512(w + c * K + k);
            w1[c] = (__m512bh)_mm512_loadu_si512(w + c * K + k + 32);
        }
        for (int r = 0; r < R; r++) {
            const __m512bh x0 = (__m512bh)_mm512_loadu_si512(x + r * x_stride + k),
                           x1 = (__m512bh)_mm512_loadu_si512(x + r * x_stride + k + 32);
            for (int c = 0; c < C; c++) {
                even[r][c] = _mm512_dpbf16_ps(even[r][c], x0, w0[c]);
                odd[r][c] = _mm512_dpbf16_ps(odd[r][c], x1, w1[c]);
            }
        }
    }
    if (k1 < K) {   /* another pass goes on from here */
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) {
                carry[(r * P_COLS + c) * 2] = even[r][c];
                carry[(r * P_COLS + c) * 2 + 1] = odd[r][c];
            }
        return;
    }
    for (; k < K; k += 32) {   /* the last 1-63 elements, 32 at a time, as gemv_cols */
        const __mmask32 live = chunk_mask(K, k);
        __m512bh w0[P_COLS];
        for (int c = 0; c < C; c++) w0[c] = (__m512bh)_mm512_maskz_loadu_epi16(live, w + c * K + k);
        for (int r = 0; r < R; r++) {
            const __m512bh x0 = (__m512bh)_mm512_maskz_loadu_epi16(live, x + r * x_stride + k);
            for (int c = 0; c < C; c++) even[r][c] = _mm512_dpbf16_ps(even[r][c], x0, w0[c]);
        }
    }
    if (R == P_ROWS && C == P_COLS) {   /* a whole tile: 8 sums in one vector, rounded together */
        __m512 s[P_ROWS * P_COLS];
        for (int r = 0; r < P_ROWS; r++)
            for (int c = 0; c < P_COLS; c++) s[r * P_COLS + c] = _mm512_add_ps(even[r][c], odd[r][c]);
        __m256 sums = reduce8(s);
        if (bias) {
            const __m128 b = _mm_castsi128_ps(
                _mm_slli_epi32(_mm_cvtepu16_epi32(_mm_loadl_epi64((const __m128i *)bias)), 16));
            sums = _mm256_add_ps(sums, _mm256_set_m128(b, b));
        }
        const __m128i out = to_bf16_8(sums);
        _mm_storel_epi64((__m128i *)y, out);
        _mm_storel_epi64((__m128i *)(y + y_stride), _mm_unpackhi_epi64(out, out));
        return;
    }
    for (int c = 0; c < C; c++) {
        const float b = bias ? bf16_to_f32(bias[c]) : 0.0f;
        for (int r = 0; r < R; r++)
            y[r * y_stride + c] = f32_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(even[r][c], odd[r][c])) + b);
    }
}

#define PAIR_TILE(R, C) pair_tile(x, x_stride, w, K, k0, k1, carry, bias, y, y_stride, R, C)
static __attribute__((noinline)) void pair_tile_any(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t K,
                                                    int64_t k0, int64_t k1, __m512 *carry, const uint16_t *bias,
                                                    uint16_t *y, int64_t y_stride, int R, int C) {
    switch (R * 8 + C) {
    case 8 + 1: PAIR_TILE(1, 1); break;
    case 8 + 2: PAIR_TILE(1, 2); break;
    case 8 + 3: PAIR_TILE(1, 3); break;
    case 8 + 4: PAIR_TILE(1, 4); break;
    case 16 + 1: PAIR_TILE(2, 1); break;
    case 16 + 2: PAIR_TILE(2, 2); break;
    case 16 + 3: PAIR_TILE(2, 3); break;
    default: PAIR_TILE(2, 4); break;
    }
}
#undef PAIR_TILE

/* Weight rows [n0, n1) against all M rows of x: P_BLOCK rows of x at a time, each tile of weight rows over them in
 * passes of P_KC columns (its slice of the weights stays in L1, the block's slice of x in L2), the accumulators
 * carried from pass to pass. */
static void pair_tiles(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                       int64_t y_stride, int64_t n0, int64_t n1, int64_t K, int64_t M) {
    __m512 carry[(P_BLOCK + P_ROWS - 1) / P_ROWS][P_ROWS * P_COLS * 2];
    for (int64_t m0 = 0; m0 < M; m0 += P_BLOCK) {
        const int64_t m1 = M - m0 < P_BLOCK ? M : m0 + P_BLOCK;
        for (int64_t n = n0; n < n1; n += P_COLS) {
            const int C = n1 - n < P_COLS ? (int)(n1 - n) : P_COLS;
            for (int64_t k0 = 0; k0 < K; k0 += P_KC) {
                const int64_t k1 = K - k0 <= P_KC ? K : k0 + P_KC;
                for (int64_t m = m0; m < m1; m += P_ROWS)
                    pair_tile_any(x + m * x_stride, x_stride, w + n * K, K, k0, k1, carry[(m - m0) / P_ROWS],
                                  bias ? bias + n : NULL, y + m * y_stride + n, y_stride,
                                  m1 - m < P_ROWS ? (int)(m1 - m) : P_ROWS, C);
            }
        }
    }
}

static void gemv_cols_any(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *y,
                          int64_t y_stride, int64_t n0, int64_t n1, int64_t K, int M) {
    switch (M) {
    case 1: gemv_cols(x, x_stride, w, bias, y, y_stride, n0, n1, K, 1); break;
    case 2: gemv_cols(x, x_stride, w, bias, y, y_stride, n0, n1, K, 2); break;
    case 3: gemv_cols(x, x_stride, w, bias, y, y_stride, n0, n1, K, 3); break;
    case 4: gemv_cols(x, x_stride, w, bias, y, y_stride, n0, n1, K, 4); break;
    case 5: gemv_cols(x, x_stride, w, bias, y, y_stride, n0, n1, K, 5); break;
    case 6: gemv_cols(x, x_stride, w, bias, y, y_stride, n0, n1, K, 6); break;
    case 7: gemv_cols(x, x_stride, w, bias, y, y_stride, n0, n1, K, 7); break;
    default: gemv_cols(x, x_stride, w, bias, y, y_stride, n0, n1, K, 8); break;
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_FP32_CORE 1
#define F_ROWS 4   /* rows of x per pass over a weight row: 8 accumulators */

/* 8 bf16 at p widened to fp32 (exact). */
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* One step of dot_rows: 16 weights (two widened vectors) into R rows' accumulators, x at column k. */
static inline __attribute__((always_inline)) void dot_step(__m256 w0, __m256 w1, const float *x, int64_t K16, int64_t k,
                                                           __m256 *lo, __m256 *hi, const int R) {
    for (int r = 0; r < R; r++) {
        lo[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * K16 + k), lo[r]);
        hi[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * K16 + k + 8), hi[r]);
    }
}

/* Sums of one weight row (K bf16) against R rows of the padded fp32 x (rows K16 apart, zero past K), R a
 * constant where inlined: 16 weights a step into two accumulators a row; the last K % 16 weights through a
 * zero-padded chunk. Each row's arithmetic is the same whatever R. */
static inline __attribute__((always_inline)) void dot_rows(const uint16_t *row, const float *x, int64_t K, int64_t K16,
                                                           float *sums, const int R) {
    __m256 lo[F_ROWS], hi[F_ROWS];
    for (int r = 0; r < R; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    const int64_t body = K / 16 * 16;
    for (int64_t k = 0; k < body; k += 16) dot_step(widen8(row + k), widen8(row + k + 8), x, K16, k, lo, hi, R);
    if (body < K) {
        uint16_t tail[16] = {0};
        for (int64_t k = body; k < K; k++) tail[k - body] = row[k];
        dot_step(widen8(tail), widen8(tail + 8), x, K16, body, lo, hi, R);
    }
    for (int r = 0; r < R; r++) sums[r] = hsum8(_mm256_add_ps(lo[r], hi[r]));
}

static void dot_rows_any(const uint16_t *row, const float *x, int64_t K, int64_t K16, float *sums, int R) {
    switch (R) {
    case 1: dot_rows(row, x, K, K16, sums, 1); break;
    case 2: dot_rows(row, x, K, K16, sums, 2); break;
    case 3: dot_rows(row, x, K, K16, sums, 3); break;
    default: dot_rows(row, x, K, K16, sums, 4); break;
    }
}

/* Output columns [n0, n1) of M rows: each weight row read once from memory, the rows of x F_ROWS at a time
 * over it (from L1 after the first pass). */
static void fp32_cols(const float *x, int64_t K, const uint16_t *w, const uint16_t *bias, void *y, int64_t y_stride,
                      int64_t n0, int64_t n1, int M, int y_bf16) {
    const int64_t K16 = (K + 15) / 16 * 16;
    float sums[MAX_ROWS];
    for (int64_t n = n0; n < n1; n++) {
        for (int m = 0; m < M; m += F_ROWS)
            dot_rows_any(w + n * K, x + m * K16, K, K16, sums + m, M - m < F_ROWS ? M - m : F_ROWS);
        const float b = bias ? bf16_to_f32(bias[n]) : 0.0f;
        for (int m = 0; m < M; m++) {
            if (y_bf16) ((uint16_t *)y)[m * y_stride + n] = f32_to_bf16(sums[m] + b);
            else ((float *)y)[m * y_stride + n] = sums[m];
        }
    }
}

/* ---- more rows than a GEMV takes (a prefill on AVX2): the same sums, tiles of T_ROWS x T_COLS ----
 * Each (row, weight row) sum is taken exactly as dot_rows takes it (two chains over 16 weights a step, the tail
 * through a zero-padded chunk, hsum8(lo + hi)), so an output has the same bits as in a GEMV of 1-8 rows: a row's
 * output does not depend on how many rows came with it. The tile's weight rows stay in L1 while the block's rows
 * of x (fp32, from L2) pass over them. */
#define T_ROWS 3     /* rows of x a tile */
#define T_COLS 2     /* weight rows a tile: 3 x 2 x 2 = 12 accumulators and 4 widened weight vectors */
#define M_BLOCK 96   /* rows of x widened to fp32 at a time */

/* The sums of R rows of x (fp32, K16 apart, zeros past K) against C weight rows (bf16, K apart), widened in
 * registers 16 at a time, the last K % 16 through a zero-padded chunk. (Widening each pair of weight rows once
 * into an fp32 buffer for the whole block of x measured 10% slower.) */
static inline __attribute__((always_inline)) void dot_tile(const uint16_t *w, int64_t K, const float *x, int64_t K16,
                                                           float *sums, const int R, const int C) {
    __m256 lo[T_ROWS][T_COLS], hi[T_ROWS][T_COLS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
    const int64_t body = K / 16 * 16;
    uint16_t tail[T_COLS][16] = {{0}};
    for (int c = 0; c < C; c++)
        for (int64_t k = body; k < K; k++) tail[c][k - body] = w[c * K + k];
    for (int64_t k = 0; k < K; k += 16) {
        __m256 w0[T_COLS], w1[T_COLS];
        for (int c = 0; c < C; c++) {
            const uint16_t *chunk = k < body ? w + c * K + k : tail[c];
            w0[c] = widen8(chunk);
            w1[c] = widen8(chunk + 8);
        }
        for (int r = 0; r < R; r++) {
            const __m256 x0 = _mm256_loadu_ps(x + r * K16 + k), x1 = _mm256_loadu_ps(x + r * K16 + k + 8);
            for (int c = 0; c < C; c++) {
                lo[r][c] = _mm256_fmadd_ps(w0[c], x0, lo[r][c]);
                hi[r][c] = _mm256_fmadd_ps(w1[c], x1, hi[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) sums[r * T_COLS + c] = hsum8(_mm256_add_ps(lo[r][c], hi[r][c]));
}

static void dot_tile_any(const uint16_t *w, int64_t K, const float *x, int64_t K16, float *sums, int R, int C) {
    switch (R * 4 + C) {
    case 4 + 1: dot_tile(w, K, x, K16, sums, 1, 1); break;
    case 4 + 2: dot_tile(w, K, x, K16, sums, 1, 2); break;
    case 8 + 1: dot_tile(w, K, x, K16, sums, 2, 1); break;
    case 8 + 2: dot_tile(w, K, x, K16, sums, 2, 2); break;
    case 12 + 1: dot_tile(w, K, x, K16, sums, 3, 1); break;
    default: dot_tile(w, K, x, K16, sums, 3, 2); break;
    }
}

/* Rows [0, M) of the block xf (fp32, K16 apart) times weight rows [n0, n1), into y (rows y_stride apart). */
static void tile_cols(const float *xf, int M, int64_t K, int64_t K16, const uint16_t *w, const uint16_t *bias, void *y,
                      int64_t y_stride, int64_t n0, int64_t n1, int y_bf16) {
    float sums[T_ROWS * T_COLS];
    for (int64_t n = n0; n < n1; n += T_COLS) {
        const int C = n1 - n < T_COLS ? (int)(n1 - n) : T_COLS;
        for (int m = 0; m < M; m += T_ROWS) {
            const int R = M - m < T_ROWS ? M - m : T_ROWS;
            dot_tile_any(w + n * K, K, xf + m * K16, K16, sums, R, C);
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C; c++) {
                    const int64_t at = (m + r) * y_stride + n + c;
                    if (y_bf16)
                        ((uint16_t *)y)[at] = f32_to_bf16(sums[r * T_COLS + c]
                                                          + (bias ? bf16_to_f32(bias[n + c]) : 0.0f));
                    else ((float *)y)[at] = sums[r * T_COLS + c];
                }
        }
    }
}

/* Any M >= 1: x widened M_BLOCK rows at a time, each block's tiles over contiguous ranges of weight rows per
 * thread. -3: no memory. */
static int tiled_core(const void *x, int64_t x_stride, int x_bf16, const uint16_t *w, const uint16_t *bias, void *y,
                      int64_t y_stride, int y_bf16, int64_t M, int64_t N, int64_t K) {
    const int64_t K16 = (K + 15) / 16 * 16, rows = M < M_BLOCK ? M : M_BLOCK;
    float *xf = (float *)aligned_alloc(64, (size_t)(rows * K16 * 4 + 63) / 64 * 64);
    if (!xf) return -3;
    for (int64_t m0 = 0; m0 < M; m0 += M_BLOCK) {
        const int block = (int)(M - m0 < M_BLOCK ? M - m0 : M_BLOCK);
#pragma omp parallel
        {
#pragma omp for
            for (int m = 0; m < block; m++) {
                for (int64_t k = 0; k < K; k++)
                    xf[m * K16 + k] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[(m0 + m) * x_stride + k])
                                             : ((const float *)x)[(m0 + m) * x_stride + k];
                for (int64_t k = K; k < K16; k++) xf[m * K16 + k] = 0.0f;
            }
            const int threads = omp_get_num_threads(), me = omp_get_thread_num();
            /* even weight-row boundaries, so that tiles of T_COLS line up across blocks */
            const int64_t n0 = N * me / threads / T_COLS * T_COLS,
                          n1 = me + 1 == threads ? N : N * (me + 1) / threads / T_COLS * T_COLS;
            char *y_block = (char *)y + m0 * y_stride * (y_bf16 ? 2 : 4);
            tile_cols(xf, block, K, K16, w, bias, y_block, y_stride, n0, n1, y_bf16);
        }
    }
    free(xf);
    return 0;
}

/* The fp32 core: x [M, K] (bf16 when x_bf16, else fp32; rows x_stride apart) copied into a zero-padded fp32
 * buffer, then threads take contiguous ranges of weight rows; more than MAX_ROWS rows go through the tiles, with
 * the same sums. -1: M < 1 or K < 1; -3: no memory. */
static int fp32_core(const void *x, int64_t x_stride, int x_bf16, const uint16_t *w, const uint16_t *bias, void *y,
                     int64_t y_stride, int y_bf16, int64_t M, int64_t N, int64_t K) {
    if (M < 1 || K < 1) return -1;
    if (M > MAX_ROWS) return tiled_core(x, x_stride, x_bf16, w, bias, y, y_stride, y_bf16, M, N, K);
    const int64_t K16 = (K + 15) / 16 * 16;
    float *xf = (float *)aligned_alloc(64, (size_t)(M * K16 * 4 + 63) / 64 * 64);
    if (!xf) return -3;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t k = 0; k < K; k++)
            xf[m * K16 + k] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[m * x_stride + k])
                                     : ((const float *)x)[m * x_stride + k];
        for (int64_t k = K; k < K16; k++) xf[m * K16 + k] = 0.0f;
    }
#pragma omp parallel if (N * K > 65536)
    {
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        fp32_cols(xf, K, w, bias, y, y_stride, N * me / threads, N * (me + 1) / threads, (int)M, y_bf16);
    }
    free(xf);
    return 0;
}
#endif

/* Which paths this build has: bit 0 gemv_rows_bf16 by bf16 pairs (AVX512-BF16), bit 1 gemv_rows_bf16 on the fp32
 * core (AVX2 + FMA), bit 2 gemv_rows_bf16w_f32x (the fp32 core). 0: neither entry point works (generic build). */
int gemv_paths(void) {
    int paths = 0;
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
    paths |= 1;
#elif defined(HAVE_FP32_CORE)
    paths |= 2;
#endif
#if defined(HAVE_FP32_CORE)
    paths |= 4;
#endif
    return paths;
}

/* y [M, N] = x [M, K] W^T (+ bias [N] bf16, or NULL) for M >= 1 rows of x (rows x_stride elements apart; y's y_stride
 * apart), in bf16 (see the top of this file); the bias is added to the fp32 sum, which is rounded once, as a fused
 * linear (oneDNN's, ATen's) does: a bias added to the rounded product would round twice. Past MAX_ROWS rows the
 * AVX512-BF16 path takes tiles (pair_tiles), each sum as for one row. -1: a build without the bf16 GEMV
 * (gemv_paths), or M < 1. */
int gemv_rows_bf16(const void *x, int64_t x_stride, const void *w, void *y, int64_t y_stride, int64_t M, int64_t N,
                   int64_t K, const void *bias) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
    if (M < 1) return -1;
#pragma omp parallel if (N * K > 65536)
    {
        /* contiguous ranges of weight rows, one per thread: each thread streams one region of W */
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t n0 = N * me / threads, n1 = N * (me + 1) / threads;
        if (M <= MAX_ROWS) {
            gemv_cols_any((const uint16_t *)x, x_stride, (const uint16_t *)w, (const uint16_t *)bias, (uint16_t *)y,
                          y_stride, n0, n1, K, (int)M);
        } else {   /* tiles: the same sums (pair_tile); thread boundaries on whole tiles of weight rows */
            pair_tiles((const uint16_t *)x, x_stride, (const uint16_t *)w, (const uint16_t *)bias, (uint16_t *)y,
                       y_stride, n0 / P_COLS * P_COLS, me + 1 == threads ? N : n1 / P_COLS * P_COLS, K, M);
        }
    }
    return 0;
#elif defined(HAVE_FP32_CORE)
    return fp32_core(x, x_stride, 1, (const uint16_t *)w, (const uint16_t *)bias, y, y_stride, 1, M, N, K);
#else
    (void)bias;
    (void)x;
    (void)x_stride;
    (void)w;
    (void)y;
    (void)y_stride;
    (void)M;
    (void)N;
    (void)K;
    return -1;
#endif
}

/* y [M, N] fp32 = x [M, K] fp32 W^T with W [N, K] bf16, for any M >= 1 (strides as gemv_rows_bf16): the fp32
 * core, each output the fp32 sum unrounded. -1: no fp32 core in this build (gemv_paths), or M < 1;
 * -3: no memory for x's padded copy. */
int gemv_rows_bf16w_f32x(const void *x, int64_t x_stride, const void *w, void *y, int64_t y_stride, int64_t M,
                         int64_t N, int64_t K) {
#if defined(HAVE_FP32_CORE)
    return fp32_core(x, x_stride, 0, (const uint16_t *)w, NULL, y, y_stride, 0, M, N, K);
#else
    (void)x;
    (void)x_stride;
    (void)w;
    (void)y;
    (void)y_stride;
    (void)M;
    (void)N;
    (void)K;
    return -1;
#endif
}
