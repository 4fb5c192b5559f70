/* y = x W^T for one row x (a decode step at batch 1): bf16 weights streamed once from memory, front to back.
 *
 * At batch 1 a decode step is a walk through every weight byte (SmolLM2-135M: 269 MB a token), so its speed is
 * the memory bandwidth its matmuls reach. oneDNN's bf16 path reached 13-21 GB/s on the per-layer matrices of
 * SmolLM2 (0.7-3.5 MB each) on the 2-core dev VM (2026-11-26), where a sum over a large tensor reads 29-32 GB/s.
 *
 * Layout: x [K] bf16; W [N, K] bf16 contiguous (the checkpoint's layout: no packing); y [N] bf16. Products by
 * pairs of bf16 (vdpbf16ps: exact products, fp32 sums), each output rounded once to bf16 (nearest even). The sums
 * run in another order than oneDNN's, so an output may differ from F.linear's in its last bit.
 *
 * Rows go one after another, each read front to back into two accumulators (even and odd chunks of 32), so
 * that each thread reads one contiguous region of W in address order: the hardware prefetcher streams it. An
 * earlier version read 8 rows at a time, chunk by chunk (one strided access per row, prefetched in software):
 * 21 GB/s over SmolLM2's 121 matrices of a token against 26 GB/s for this order (2-core dev VM, 2026-11-26;
 * one 269 MB matrix: 30 GB/s, where a sum over a large tensor reads 30-35). Threads take contiguous ranges of
 * rows (torch's OpenMP threads).
 * Needs AVX512-BF16 (with VL and DQ); elsewhere the function returns -1 and the caller keeps oneDNN.
 */

#include <omp.h>

#include "common.h"

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>

static inline __mmask32 chunk_mask(int64_t K, int64_t k) {
    return K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
}

/* Output rows [n0, n1). */
static void gemv_rows(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t n0, int64_t n1, int64_t K) {
    for (int64_t n = n0; n < n1; n++) {
        const uint16_t *row = w + n * K;
        __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            even = _mm512_dpbf16_ps(even, (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(row + k));
            odd = _mm512_dpbf16_ps(odd, (__m512bh)_mm512_loadu_si512(x + k + 32),
                                   (__m512bh)_mm512_loadu_si512(row + k + 32));
        }
        for (; k < K; k += 32) {   /* the last 1-63 elements, 32 at a time */
            const __mmask32 live = chunk_mask(K, k);
            even = _mm512_dpbf16_ps(even, (__m512bh)_mm512_maskz_loadu_epi16(live, x + k),
                                    (__m512bh)_mm512_maskz_loadu_epi16(live, row + k));
        }
        y[n] = f32_to_bf16(_mm512_reduce_add_ps(_mm512_add_ps(even, odd)));
    }
}
#endif

/* y [N] = W [N, K] x [K] in bf16 (see the top of this file). -1: not built with AVX512-BF16. */
int gemv_bf16(const void *x, const void *w, void *y, int64_t N, int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#pragma omp parallel if (N * K > 65536)
    {
        /* contiguous ranges of rows, one per thread: each thread streams one region of W */
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        gemv_rows((const uint16_t *)x, (const uint16_t *)w, (uint16_t *)y, N * me / threads, N * (me + 1) / threads,
                  K);
    }
    return 0;
#else
    (void)x; (void)w; (void)y; (void)N; (void)K;
    return -1;
#endif
}
