/* What the CPU kernels share: bf16 <-> fp32, and exp(x) for x <= 0 (a score minus the running max of an
 * online softmax), scalar and, where the machine has AVX-512, 16 lanes at a time. Included by the .c files of
 * this folder (kernels/cpu_kernels.py builds them into one library). */

#ifndef INFER_CPU_COMMON_H
#define INFER_CPU_COMMON_H

#include <math.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even; NaN stays NaN */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* exp(x) for x <= 0 (a score minus the running max), vectorizable: 2^n * p(r), n = round(x / ln 2),
 * r = x - n ln 2 in [-ln2/2, ln2/2], p the degree-6 Taylor polynomial (relative error < 3e-7); x <= -87: 0. */
static inline float exp_nonpositive(float x) {
    float c = x < -87.0f ? -87.0f : x;
    float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   /* round to nearest: 1.5 * 2^23 */
    float r = c - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f + r * (8.3333338e-3f
              + r * 1.3888889e-3f)))));
    union { uint32_t u; float f; } two_n;
    two_n.u = (uint32_t)((int32_t)n + 127) << 23;
    return x <= -87.0f ? 0.0f : p * two_n.f;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* Elements 16c .. 16c + 15 of a bf16 (is_bf16) or fp32 row, as fp32. */
static inline __m512 load16(const void *row, int c, const int is_bf16) {
    if (is_bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + 16 * c));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + 16 * c);
}

/* exp(x) for x <= 0 lane-wise, as exp_nonpositive; lanes outside `valid` are 0. */
static inline __m512 exp16(__m512 x, __mmask16 valid) {
    __m512 c = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), c);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.3888889e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333338e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666668e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __mmask16 live = valid & _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

#endif

#endif
