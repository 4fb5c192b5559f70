/* y = x W^T for 1-8 rows x (a decode step at batch 1-8): bf16 weights streamed once from memory, front to back.
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
 * no longer streams at the bandwidth); the linears send it up to 8 rows (GEMV_MAX_ROWS in cpu_kernels.py).
 * Needs AVX512-BF16 (with VL and DQ); elsewhere the function returns -1 and the caller keeps oneDNN.
 */

#include <omp.h>

#include "common.h"

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
                                                            uint16_t *y, int64_t y_stride, int64_t n0, int64_t n1,
                                                            int64_t K, const int M) {
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
        for (int m = 0; m < M; m++)
            y[m * y_stride + n] = f32_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(even[m], odd[m])));
    }
}

static void gemv_cols_any(const uint16_t *x, int64_t x_stride, const uint16_t *w, uint16_t *y, int64_t y_stride,
                          int64_t n0, int64_t n1, int64_t K, int M) {
    switch (M) {
    case 1: gemv_cols(x, x_stride, w, y, y_stride, n0, n1, K, 1); break;
    case 2: gemv_cols(x, x_stride, w, y, y_stride, n0, n1, K, 2); break;
    case 3: gemv_cols(x, x_stride, w, y, y_stride, n0, n1, K, 3); break;
    case 4: gemv_cols(x, x_stride, w, y, y_stride, n0, n1, K, 4); break;
    case 5: gemv_cols(x, x_stride, w, y, y_stride, n0, n1, K, 5); break;
    case 6: gemv_cols(x, x_stride, w, y, y_stride, n0, n1, K, 6); break;
    case 7: gemv_cols(x, x_stride, w, y, y_stride, n0, n1, K, 7); break;
    default: gemv_cols(x, x_stride, w, y, y_stride, n0, n1, K, 8); break;
    }
}
#endif

/* y [M, N] = x [M, K] W^T for M in 1..MAX_ROWS rows of x (rows x_stride elements apart; y's y_stride apart), in
 * bf16 (see the top of this file). -1: not built with AVX512-BF16, or M outside 1..MAX_ROWS. */
int gemv_rows_bf16(const void *x, int64_t x_stride, const void *w, void *y, int64_t y_stride, int64_t M, int64_t N,
                   int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
    if (M < 1 || M > MAX_ROWS) return -1;
#pragma omp parallel if (N * K > 65536)
    {
        /* contiguous ranges of weight rows, one per thread: each thread streams one region of W */
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        gemv_cols_any((const uint16_t *)x, x_stride, (const uint16_t *)w, (uint16_t *)y, y_stride, N * me / threads,
                      N * (me + 1) / threads, K, (int)M);
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)w; (void)y; (void)y_stride; (void)M; (void)N; (void)K;
    return -1;
#endif
}
