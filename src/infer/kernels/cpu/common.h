/* What the CPU kernels share: bf16 <-> fp32, and exp(x) for x <= 0 (a score minus the running max of an
 * online softmax), scalar and, where the build has AVX-512, 16 lanes at a time, and where it has AVX2 + FMA, 8.
 * Included by the .c files of this folder (kernels/cpu_kernels.py builds them into one library per ISA level:
 * avx512 is -march=native, so it has the AVX2 helpers too; avx2 is x86-64-v3; generic has neither). */

#ifndef INFER_CPU_COMMON_H
#define INFER_CPU_COMMON_H

#include <math.h>
#include <stdint.h>

static inline float bf16_to_f32(uint16_t x) {
    union {
        uint32_t u;
        float f;
    } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even; NaN stays NaN */
    union {
        uint32_t u;
        float f;
    } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* exp(x) for x <= 0 (a score minus the running max), vectorizable: 2^n * p(r), n = round(x / ln 2),
 * r = x - n ln 2 in [-ln2/2, ln2/2], p the degree-6 Taylor polynomial (relative error < 3e-7); x <= -87: 0. */
static inline float exp_nonpositive(float x) {
    float c = x < -87.0f ? -87.0f : x;
    float n = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   /* round to nearest: 1.5 * 2^23 */
    float r = c - n * 0.693145751953125f - n * 1.428606765330187e-06f;
    float p =
        1.0f
        + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f + r * (8.3333338e-3f + r * 1.3888889e-3f)))));
    union {
        uint32_t u;
        float f;
    } two_n;
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

/* tanh(x) lane-wise, for Gemma 2's soft-capped scores: t = -e / (2 + e) with e = expm1(-2|x|) (as exp16, 2^n * p(r),
 * written as 2^n (p(r) - 1) + (2^n - 1) so that small |x| lose nothing to cancellation), x's sign put back; within a
 * few ulp of tanhf. |x| >= 43.5 gives +-1. */
static inline __m512 tanh16(__m512 x) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    __m512 y = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign));   /* -|x| */
    y = _mm512_max_ps(_mm512_add_ps(y, y), _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), y);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.3888889e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333338e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666668e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 one = _mm512_set1_ps(1.0f), two_n = _mm512_scalef_ps(one, n);
    __m512 e = _mm512_fmadd_ps(two_n, _mm512_mul_ps(p, r), _mm512_sub_ps(two_n, one));   /* expm1(y) */
    __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_setzero_ps(), e), _mm512_add_ps(e, _mm512_set1_ps(2.0f)));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), _mm512_and_si512(_mm512_castps_si512(x), sign)));
}

/* Gemma 2's soft-capping of 16 scores: cap * tanh(s / cap). */
static inline __m512 softcap16(__m512 s, float cap) {
    return _mm512_mul_ps(tanh16(_mm512_div_ps(s, _mm512_set1_ps(cap))), _mm512_set1_ps(cap));
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* Elements 8c .. 8c + 7 of a bf16 (is_bf16) or fp32 row, as fp32 (bf16 widened exactly: vpmovzxwd, shift). */
static inline __m256 load8(const void *row, int c, const int is_bf16) {
    if (is_bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + 8 * c));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)row + 8 * c);
}

/* All-ones in lanes 0 .. n - 1 (n in 0..8), zeros above: the lanes of a chunk that hold data. */
static inline __m256 lanes_below(int n) {
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* The sum of v's 8 lanes, in a fixed order. */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The max of v's 8 lanes (no NaN expected). */
static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* exp(x) for x <= 0 lane-wise, as exp16 (and exp_nonpositive): 2^n * p(r), 2^n built in the exponent bits;
 * lanes outside `valid` (an all-ones / zero lane mask) and x <= -87 (NaN too) are 0. */
static inline __m256 exp8(__m256 x, __m256 valid) {
    __m256 c = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));   /* NaN -> -87 (the second operand) */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), c);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.3888889e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333338e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1666668e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666667e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256 two_n = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    __m256 live = _mm256_and_ps(valid, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));
    return _mm256_and_ps(live, _mm256_mul_ps(p, two_n));
}

/* tanh(x) lane-wise, as tanh16 (2^n built in the exponent bits: n >= -126 here). */
static inline __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 y = _mm256_or_ps(x, sign);   /* -|x| */
    y = _mm256_max_ps(_mm256_add_ps(y, y), _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(y, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), y);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
    __m256 p = _mm256_set1_ps(1.3888889e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333338e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1666668e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666667e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 two_n = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
    __m256 e = _mm256_fmadd_ps(two_n, _mm256_mul_ps(p, r), _mm256_sub_ps(two_n, one));   /* expm1(y) */
    __m256 t = _mm256_div_ps(_mm256_sub_ps(_mm256_setzero_ps(), e), _mm256_add_ps(e, _mm256_set1_ps(2.0f)));
    return _mm256_or_ps(t, _mm256_and_ps(x, sign));
}

/* Gemma 2's soft-capping of 8 scores: cap * tanh(s / cap). */
static inline __m256 softcap8(__m256 s, float cap) {
    return _mm256_mul_ps(tanh8(_mm256_div_ps(s, _mm256_set1_ps(cap))), _mm256_set1_ps(cap));
}

/* 8 fp32 lanes rounded to bf16 (nearest even; NaN stays NaN, quieted), as f32_to_bf16 lane-wise: the 32-bit
 * patterns with the low half cleared. */
static inline __m256i round_bf16_bits8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    rounded = _mm256_blendv_epi8(rounded, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_and_si256(rounded, _mm256_set1_epi32((int)0xffff0000u));
}

/* The same lanes as 8 bf16 (for a store). */
static inline __m128i to_bf16_8(__m256 v) {
    __m256i bits = _mm256_srli_epi32(round_bf16_bits8(v), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

/* The same lanes rounded to bf16 values, kept as fp32. */
static inline __m256 round_bf16_8(__m256 v) { return _mm256_castsi256_ps(round_bf16_bits8(v)); }

#endif

#endif
