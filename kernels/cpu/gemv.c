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
 * Output rows go in blocks of 8: the 8 weight rows are read chunk by chunk (32 elements, one cache line each)
 * into 8 accumulators, the rows two blocks ahead are prefetched meanwhile, and the 8 sums are reduced together
 * and stored as one 16-byte write. Threads take contiguous ranges of rows (torch's OpenMP threads).
 * Needs AVX512-BF16 (with VL and DQ); elsewhere the function returns -1 and the caller keeps oneDNN.
 */

#include <omp.h>

#include "common.h"

#define BLOCK 8          /* output rows reduced and stored together */
#define AHEAD 2          /* blocks prefetched ahead */

#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include <immintrin.h>

/* Lane r of the result: the sum of the 16 lanes of a[r], r < 8. */
static inline __m256 sum8(const __m512 *a) {
    __m256 b[BLOCK];
    for (int r = 0; r < BLOCK; r++) b[r] = _mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1));
    __m256 s01 = _mm256_hadd_ps(b[0], b[1]), s23 = _mm256_hadd_ps(b[2], b[3]);
    __m256 s45 = _mm256_hadd_ps(b[4], b[5]), s67 = _mm256_hadd_ps(b[6], b[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

static inline __mmask32 chunk_mask(int64_t K, int64_t k) {
    return K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1);
}

/* Output rows [n0, n1). */
static void gemv_rows(const uint16_t *x, const uint16_t *w, uint16_t *y, int64_t n0, int64_t n1, int64_t K) {
    int64_t n = n0;
    for (; n + BLOCK <= n1; n += BLOCK) {
        __m512 acc[BLOCK];
        for (int r = 0; r < BLOCK; r++) acc[r] = _mm512_setzero_ps();
        const uint16_t *rows = w + n * K, *later = rows + AHEAD * BLOCK * K;
        for (int64_t k = 0; k < K; k += 32) {
            const __mmask32 live = chunk_mask(K, k);
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(live, x + k);
            for (int r = 0; r < BLOCK; r++) _mm_prefetch((const char *)(later + r * K + k), _MM_HINT_T0);
            for (int r = 0; r < BLOCK; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_maskz_loadu_epi16(live, rows + r * K + k));
        }
        _mm_storeu_si128((__m128i *)(y + n), (__m128i)_mm256_cvtneps_pbh(sum8(acc)));
    }
    for (; n < n1; n++) {   /* the rows after the last whole block */
        __m512 acc = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32) {
            const __mmask32 live = chunk_mask(K, k);
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi16(live, x + k),
                                   (__m512bh)_mm512_maskz_loadu_epi16(live, w + n * K + k));
        }
        y[n] = f32_to_bf16(_mm512_reduce_add_ps(acc));
    }
}
#endif

/* y [N] = W [N, K] x [K] in bf16 (see the top of this file). -1: not built with AVX512-BF16. */
int gemv_bf16(const void *x, const void *w, void *y, int64_t N, int64_t K) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
    const int64_t blocks = (N + BLOCK - 1) / BLOCK;
#pragma omp parallel if (N * K > 65536)
    {
        /* contiguous ranges of whole blocks, one per thread: each thread streams one region of W */
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t b0 = blocks * me / threads, b1 = blocks * (me + 1) / threads;
        const int64_t n0 = b0 * BLOCK, n1 = b1 * BLOCK < N ? b1 * BLOCK : N;
        gemv_rows((const uint16_t *)x, (const uint16_t *)w, (uint16_t *)y, n0, n1, K);
    }
    return 0;
#else
    (void)x; (void)w; (void)y; (void)N; (void)K;
    return -1;
#endif
}
