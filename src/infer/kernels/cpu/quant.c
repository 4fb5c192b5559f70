/* y = x W^T with W kept quantized (kernels/quant.py's q4 and q8 block formats): integer dot products per block of 32.
 *
 * Arithmetic (quant_matmul_reference in kernels/quant.py states it in PyTorch):
 *   - each row of x is quantized per block of 32 to int8: amax = max |x|, d = amax / 127 (fp32; d < FLT_MIN is taken
 *     as 0), q = rint(x * (1 / d)) (round half to even; 0 where d = 0), s = d * sum(q). |q| <= 127 without a clamp.
 *     A block holding a NaN or an infinity has d = NaN: its row's outputs are all NaN (see block_scale).
 *   - y[m][n] = sum over blocks b of (d_w * d_x) * dot(q_w, q_x) + m_w * s_x, d_w and m_w the block's fp16 scale and
 *     min (no min term for symmetric q8). The integer dots are exact; the scale products are fp32 products; the sum
 *     of the block terms is an fp32 sum (FMA where the ISA has it) whose order depends on the ISA, not on M, on the
 *     rows beside a row, or on the thread count. One rounding to bf16 (nearest even) at the end for bf16 y.
 *
 * Three builds, picked by the compiler's target macros (kernels/cpu_kernels.py builds the library per ISA):
 *   - AVX-512 VNNI (+BW, VL): q4 by 4 blocks (64 bytes of nibbles) a step, unpacked in registers and multiplied by
 *     the signed activations with vpdpbusd; q8 by 2 blocks a step, the activations stored as q + 128 (unsigned) and
 *     the accumulator started at -128 * sum(w), so that vpdpbusd's u8 x s8 gives the signed dot.
 *   - AVX2 + FMA + F16C: q4 by 2 blocks with vpmaddubsw (nibbles x signed activations); q8 by 1 block with the sign
 *     trick (|w| as u8 times x carrying w's sign: |w| <= 128, |x| <= 127, so a pair's sum fits int16).
 *   - anything else: plain C, one block at a time.
 * In the two SIMD builds a block's dot is spread over 4 (AVX-512 q4, AVX2 q4) or 8 int32 lanes; each lane is
 * converted to fp32 (exact: |lane| < 2^24) and FMA'd with its block's d_w * d_x into a vector accumulator, the min
 * terms go into a second accumulator 16 (8) blocks at a time, and one horizontal sum ends each output.
 *
 * The activations' layout inside the call is the build's (Acts below): q4 wants, for each step of G blocks (G = 4,
 * 2, 1 by build), the G low halves (elements 0-15 of each block: what the low nibbles multiply) and then the G high
 * halves, so that the nibbles of G blocks unpack with one AND and one shift; q8 keeps element order. The rows are
 * interleaved step by step in tiles of 8, and each d is stored spread over its block's lanes, so that the inner
 * loop reaches every row's data at constant offsets and a lane's scale is one multiply (q4 at M = 8, one core,
 * cached: 121 -> 130 GMAC/s; q8 93 -> 110).
 *
 * Loop order: threads take contiguous ranges of weight rows (torch's OpenMP threads). With M <= 8 rows of x each
 * weight row is read once, front to back, and dotted with every row of x (a decode step: the call streams W from
 * memory once, each row prefetched PREFETCH_BYTES ahead; x is quantized before the parallel region, which then
 * has no barrier). With M > 8 the threads quantize x together, then each thread's range goes in chunks of rows
 * that stay in cache, each chunk dotted with the rows of x 8 at a time. The per-output arithmetic is the same code
 * either way; outputs are written 16 columns of a row at a time.
 */

#include <float.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define QBLOCK 32           /* elements of a block */
#define TILE_ROWS 8         /* rows of x dotted with a weight row per pass */
#define CHUNK_BYTES 65536   /* weight bytes of a chunk of rows reused by every tile of x when M > TILE_ROWS */
#define OUT_RUN 16          /* outputs of a row written together */
#define PREFETCH_BYTES 8192 /* how far ahead in qs the rows are prefetched (whole rows, at least one) */

/* A step of the dot product loops: Q4_STEP (Q8_STEP) blocks, whose block dots lie in the LANES int32 lanes of one
 * vector, LANES / blocks lanes a block. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define QUANT_AVX512 1
#define Q4_STEP 4
#define Q8_STEP 2
#define LANES 16
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_AVX2 1
#define Q4_STEP 2
#define Q8_STEP 1
#define LANES 8
#else
#define Q4_STEP 1
#define Q8_STEP 1
#define LANES 1
#endif

#define ALWAYS_INLINE inline __attribute__((always_inline))

enum { FMT_Q4 = 0, FMT_Q8 = 1 };

/* The quantized activations of one call, in tiles of TILE_ROWS rows (the rows a weight row is dotted with at once)
 * so that within a tile each row's data for a step sits at a constant offset from one pointer:
 *   - int8 values: step g of row r of tile t at q + t * tile_bytes + (g * TILE_ROWS + r) * step_bytes, in the step's
 *     layout (q4: the low halves of its blocks, elements 0-15 of each, then the high halves; q8: element order, in
 *     the AVX-512 build q + 128 as u8 for vpdpbusd);
 *   - d spread over the lanes that hold the step's block dots: at lanes + t * tile_lanes + (g * TILE_ROWS + r) * LANES;
 *   - s per row: s + m * nb_pad.
 * A last partial step is zero-padded (its lanes too: they multiply zeros, and must not be NaN), s to a multiple of
 * 16 blocks. */
typedef struct {
    int8_t *q;
    float *lanes, *s;
    int64_t nb, nb_pad, step_blocks, steps, step_bytes, tile_bytes, tile_lanes;
    void *base;
} Acts;

/* The weight: qs [N, K / 2] (q4) or [N, K] (q8), scales and mins [N, nb] fp16 (mins NULL: symmetric q8). */
typedef struct {
    const uint8_t *qs;
    const uint16_t *scales, *mins;
    int fmt;
    int64_t nb, qs_row, ahead;   /* ahead: rows between the one being read and the one being prefetched */
} Weights;

static inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    union {
        uint32_t u;
        float f;
    } v;
    if (exp == 0x1f) {
        v.u = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        v.u = sign | ((exp + 112) << 23) | (mant << 13);
    } else {   /* zero or subnormal: mant * 2^-24, exact */
        v.f = (float)mant * 5.9604644775390625e-08f;
        v.u |= sign;
    }
    return v.f;
#endif
}

static inline float load_x(const void *row, int64_t i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

/* ---- activation quantization: one block of 32 -> 32 int8 in element order, d and s ---- */

/* d from the block's amax (the rule at the top of this file); *inverse = 1 / d, or 0. A block holding a NaN
 * (`has_nan`: the max above drops NaNs) or an infinity gets d = NaN and inverse 0: every output of its row is then NaN
 * (its q are unspecified, each multiplied by d), as x W^T's would be, so the engine's non-finite logits check sees a
 * spoiled row instead of a finite one made of zeros. */
static inline float block_scale(float amax, int has_nan, float *inverse) {
    if (has_nan || !(amax <= FLT_MAX)) {
        *inverse = 0.0f;
        return NAN;
    }
    float d = amax / 127.0f;
    if (!(d >= FLT_MIN)) d = 0.0f;
    *inverse = d != 0.0f ? 1.0f / d : 0.0f;
    return d;
}

#if defined(QUANT_AVX512)
static inline __m512 load16_x(const void *row, int64_t k, int is_bf16) {
    if (is_bf16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)row + k);
}

static inline void quantize_block(const void *row, int64_t k, int is_bf16, int8_t out[QBLOCK], float *d, float *s) {
    const __m512 a = load16_x(row, k, is_bf16), b = load16_x(row, k + 16, is_bf16);
    float inverse;
    const int has_nan = (_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q)) != 0;
    *d = block_scale(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))), has_nan, &inverse);
    const __m512 inv = _mm512_set1_ps(inverse);
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    *s = *d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    _mm_storeu_si128((__m128i *)out, _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtsepi32_epi8(qb));
}
#elif defined(QUANT_AVX2)
static inline __m256 load8_x(const void *row, int64_t k, int is_bf16) {
    if (is_bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)row + k);
}

/* 16 int32 (two vectors of 8, each within int8) -> 16 int8 in order. */
static inline __m128i pack16(__m256i lo, __m256i hi) {
    const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
    return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

static inline void quantize_block(const void *row, int64_t k, int is_bf16, int8_t out[QBLOCK], float *d, float *s) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = load8_x(row, k + 8 * i, is_bf16);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    float inverse;
    *d = block_scale(hmax8(amax), _mm256_movemask_ps(nan) != 0, &inverse);
    const __m256 inv = _mm256_set1_ps(inverse);
    __m256i q[4], sum = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
        q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        sum = _mm256_add_epi32(sum, q[i]);
    }
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    *s = *d * (float)_mm_cvtsi128_si32(t);
    _mm_storeu_si128((__m128i *)out, pack16(q[0], q[1]));
    _mm_storeu_si128((__m128i *)(out + 16), pack16(q[2], q[3]));
}
#else
static inline void quantize_block(const void *row, int64_t k, int is_bf16, int8_t out[QBLOCK], float *d, float *s) {
    float v[QBLOCK], amax = 0.0f;
    int has_nan = 0;
    for (int i = 0; i < QBLOCK; i++) {
        v[i] = load_x(row, k + i, is_bf16);
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
        has_nan |= v[i] != v[i];
    }
    float inverse;
    *d = block_scale(amax, has_nan, &inverse);
    int sum = 0;
    for (int i = 0; i < QBLOCK; i++) {
        out[i] = (int8_t)lrintf(v[i] * inverse);
        sum += out[i];
    }
    *s = *d * (float)sum;
}
#endif

/* Row m of x into the call's activations (the layout above). */
static void quantize_row(const void *row, int is_bf16, int fmt, const Acts *a, int64_t m) {
    const int64_t tile = m / TILE_ROWS, r = m % TILE_ROWS, per_block = LANES / a->step_blocks;
    float *s = a->s + m * a->nb_pad;
    for (int64_t b = a->nb; b < a->nb_pad; b++) s[b] = 0.0f;
    for (int64_t g = 0; g < a->steps; g++) {
        int8_t *q = a->q + tile * a->tile_bytes + (g * TILE_ROWS + r) * a->step_bytes;
        float *lanes = a->lanes + tile * a->tile_lanes + (g * TILE_ROWS + r) * LANES;
        memset(q, 0, (size_t)a->step_bytes);
        for (int l = 0; l < LANES; l++) lanes[l] = 0.0f;
        for (int64_t j = 0; j < a->step_blocks && g * a->step_blocks + j < a->nb; j++) {
            const int64_t b = g * a->step_blocks + j;
            int8_t block[QBLOCK];
            float d;
            quantize_block(row, b * QBLOCK, is_bf16, block, &d, s + b);
            int8_t *low = q + j * QBLOCK, *high = low + 16;
            if (fmt == FMT_Q4) {
                low = q + j * 16;
                high = low + 16 * a->step_blocks;
            }
            memcpy(low, block, 16);
            memcpy(high, block + 16, 16);
#if defined(QUANT_AVX512)
            if (fmt == FMT_Q8)
                for (int i = 0; i < QBLOCK; i++) low[i] = (int8_t)((uint8_t)low[i] ^ 0x80u);
#endif
            for (int64_t l = j * per_block; l < (j + 1) * per_block; l++) lanes[l] = d;
        }
    }
}

static int acts_alloc(Acts *a, int64_t M, int64_t nb, int fmt) {
    a->nb = nb;
    a->nb_pad = (nb + 15) / 16 * 16;
    a->step_blocks = fmt == FMT_Q4 ? Q4_STEP : Q8_STEP;
    a->steps = (nb + a->step_blocks - 1) / a->step_blocks;
    a->step_bytes = a->step_blocks * QBLOCK;
    a->tile_bytes = a->steps * TILE_ROWS * a->step_bytes;
    a->tile_lanes = a->steps * TILE_ROWS * LANES;
    const int64_t tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
    const size_t q_bytes = (size_t)(tiles * a->tile_bytes + 63) / 64 * 64;
    const size_t lane_bytes = (size_t)(tiles * a->tile_lanes) * sizeof(float);
    if (posix_memalign(&a->base, 64, q_bytes + lane_bytes + (size_t)(M * a->nb_pad) * sizeof(float)) != 0) return -1;
    a->q = (int8_t *)a->base;
    a->lanes = (float *)((char *)a->base + q_bytes);
    a->s = a->lanes + tiles * a->tile_lanes;
    return 0;
}

/* Rows [m0, m1) of x (rows x_stride elements apart) into a. */
static void quantize_rows(const void *x, int64_t x_stride, int is_bf16, int fmt, const Acts *a, int64_t m0,
                          int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
        quantize_row((const char *)x + m * x_stride * (is_bf16 ? 2 : 4), is_bf16, fmt, a, m);
}

/* Tile m0 / TILE_ROWS of the activations: its values and lanes (m0 a multiple of TILE_ROWS). */
static inline const int8_t *tile_q(const Acts *a, int64_t m0) { return a->q + m0 / TILE_ROWS * a->tile_bytes; }
static inline const float *tile_lanes(const Acts *a, int64_t m0) { return a->lanes + m0 / TILE_ROWS * a->tile_lanes; }

/* ---- dot products: sums[0 .. M) for weight row n and rows m0 .. m0 + M of the activations (M <= TILE_ROWS, a
 * constant where inlined) ---- */

#if defined(QUANT_AVX512)
static ALWAYS_INLINE void q4_blocks(const Acts *a, int64_t m0, const int M, const Weights *w, int64_t n,
                                    __m512 acc[TILE_ROWS]) {
    const __m512i nibble = _mm512_set1_epi8(0x0f);
    const __m512i lane_block = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const uint8_t *row = w->qs + n * w->qs_row;
    const uint16_t *scales = w->scales + n * w->nb;
    const int8_t *xq = tile_q(a, m0);
    const float *xd = tile_lanes(a, m0);
    for (int64_t b = 0; b < w->nb; b += 4, xq += TILE_ROWS * 128, xd += TILE_ROWS * 16) {
        const int r = w->nb - b >= 4 ? 4 : (int)(w->nb - b);
        __m512i v;
        __m128 dw;
        if (r == 4) {
            v = _mm512_loadu_si512(row + 16 * b);
            dw = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(scales + b)));
        } else {
            v = _mm512_maskz_loadu_epi8(((__mmask64)1 << (16 * r)) - 1, row + 16 * b);
            dw = _mm_cvtph_ps(_mm_maskz_loadu_epi16((__mmask8)((1u << r) - 1), scales + b));
        }
        const __m512i low = _mm512_and_si512(v, nibble), high = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        const __m512 dw_lanes = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(dw));
        for (int m = 0; m < M; m++) {
            __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_loadu_si512(xq + 128 * m));
            dot = _mm512_dpbusd_epi32(dot, high, _mm512_loadu_si512(xq + 128 * m + 64));
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw_lanes, _mm512_loadu_ps(xd + 16 * m)),
                                     acc[m]);
        }
    }
}

static ALWAYS_INLINE void q8_blocks(const Acts *a, int64_t m0, const int M, const Weights *w, int64_t n,
                                    __m512 acc[TILE_ROWS]) {
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    const __m512i lane_block = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const int8_t *row = (const int8_t *)w->qs + n * w->qs_row;
    const uint16_t *scales = w->scales + n * w->nb;
    const int8_t *xq = tile_q(a, m0);
    const float *xd = tile_lanes(a, m0);
    for (int64_t b = 0; b < w->nb; b += 2, xq += TILE_ROWS * 64, xd += TILE_ROWS * 16) {
        __m512i v;
        __m128 dw;
        if (w->nb - b >= 2) {
            uint32_t pair;
            memcpy(&pair, scales + b, sizeof pair);
            v = _mm512_loadu_si512(row + QBLOCK * b);
            dw = _mm_cvtph_ps(_mm_cvtsi32_si128((int)pair));
        } else {
            v = _mm512_maskz_loadu_epi8(0xffffffffull, row + QBLOCK * b);
            dw = _mm_cvtph_ps(_mm_cvtsi32_si128(scales[b]));
        }
        /* (q + 128) . w - 128 * sum(w) = q . w: start each lane at -128 * (its 4 weights' sum) */
        const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(),
                                               _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, v));
        const __m512 dw_lanes = _mm512_permutexvar_ps(lane_block, _mm512_castps128_ps512(dw));
        for (int m = 0; m < M; m++) {
            const __m512i dot = _mm512_dpbusd_epi32(start, _mm512_loadu_si512(xq + 64 * m), v);
            acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw_lanes, _mm512_loadu_ps(xd + 16 * m)),
                                     acc[m]);
        }
    }
}

static ALWAYS_INLINE void dot_row(const Acts *a, int64_t m0, const int M, const Weights *w, int64_t n,
                                  float sums[TILE_ROWS]) {
    __m512 acc[TILE_ROWS], min_acc[TILE_ROWS];
    for (int m = 0; m < M; m++) acc[m] = min_acc[m] = _mm512_setzero_ps();
    if (w->fmt == FMT_Q4) q4_blocks(a, m0, M, w, n, acc);
    else q8_blocks(a, m0, M, w, n, acc);
    if (w->mins) {
        const uint16_t *mins = w->mins + n * w->nb;
        for (int64_t b = 0; b < w->nb; b += 16) {
            const __mmask16 live = w->nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (w->nb - b)) - 1);
            const __m512 mw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mins + b));
            for (int m = 0; m < M; m++)
                min_acc[m] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(a->s + (m0 + m) * a->nb_pad + b), min_acc[m]);
        }
    }
    for (int m = 0; m < M; m++) sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], min_acc[m]));
}

#elif defined(QUANT_AVX2)

static ALWAYS_INLINE void q4_blocks(const Acts *a, int64_t m0, const int M, const Weights *w, int64_t n,
                                    __m256 acc[TILE_ROWS]) {
    const __m256i nibble = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256i lane_block = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
    const uint8_t *row = w->qs + n * w->qs_row;
    const uint16_t *scales = w->scales + n * w->nb;
    const int8_t *xq = tile_q(a, m0);
    const float *xd = tile_lanes(a, m0);
    for (int64_t b = 0; b < w->nb; b += 2, xq += TILE_ROWS * 64, xd += TILE_ROWS * 8) {
        __m256i v;
        __m128 dw;
        if (w->nb - b >= 2) {
            uint32_t pair;
            memcpy(&pair, scales + b, sizeof pair);
            v = _mm256_loadu_si256((const __m256i *)(row + 16 * b));
            dw = _mm_cvtph_ps(_mm_cvtsi32_si128((int)pair));
        } else {
            v = _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128((const __m128i *)(row + 16 * b)), 0);
            dw = _mm_cvtph_ps(_mm_cvtsi32_si128(scales[b]));
        }
        const __m256i low = _mm256_and_si256(v, nibble), high = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        const __m256 dw_lanes = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dw), lane_block);
        for (int m = 0; m < M; m++) {
            const int8_t *x = xq + 64 * m;
            const __m256i pairs = _mm256_add_epi16(
                _mm256_maddubs_epi16(low, _mm256_loadu_si256((const __m256i *)x)),
                _mm256_maddubs_epi16(high, _mm256_loadu_si256((const __m256i *)(x + 32))));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)),
                                     _mm256_mul_ps(dw_lanes, _mm256_loadu_ps(xd + 8 * m)), acc[m]);
        }
    }
}

static ALWAYS_INLINE void q8_blocks(const Acts *a, int64_t m0, const int M, const Weights *w, int64_t n,
                                    __m256 acc[TILE_ROWS]) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int8_t *row = (const int8_t *)w->qs + n * w->qs_row;
    const uint16_t *scales = w->scales + n * w->nb;
    const int8_t *xq = tile_q(a, m0);
    const float *xd = tile_lanes(a, m0);
    for (int64_t b = 0; b < w->nb; b++, xq += TILE_ROWS * 32, xd += TILE_ROWS * 8) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(row + QBLOCK * b));
        const __m256i magnitude = _mm256_abs_epi8(v);   /* -128 -> 128 as u8 */
        const __m256 dw = _mm256_set1_ps(_cvtsh_ss(scales[b]));
        for (int m = 0; m < M; m++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + 32 * m));
            const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(x, v));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones)),
                                     _mm256_mul_ps(dw, _mm256_loadu_ps(xd + 8 * m)), acc[m]);
        }
    }
}

static ALWAYS_INLINE void dot_row(const Acts *a, int64_t m0, const int M, const Weights *w, int64_t n,
                                  float sums[TILE_ROWS]) {
    __m256 acc[TILE_ROWS], min_acc[TILE_ROWS];
    for (int m = 0; m < M; m++) acc[m] = min_acc[m] = _mm256_setzero_ps();
    if (w->fmt == FMT_Q4) q4_blocks(a, m0, M, w, n, acc);
    else q8_blocks(a, m0, M, w, n, acc);
    if (w->mins) {
        const uint16_t *mins = w->mins + n * w->nb;
        for (int64_t b = 0; b < w->nb; b += 8) {
            __m128i h;
            if (w->nb - b >= 8) {
                h = _mm_loadu_si128((const __m128i *)(mins + b));
            } else {   /* the last 1-7 blocks */
                uint16_t part[8] = {0};
                for (int i = 0; b + i < w->nb; i++) part[i] = mins[b + i];
                h = _mm_loadu_si128((const __m128i *)part);
            }
            const __m256 mw = _mm256_cvtph_ps(h);
            for (int m = 0; m < M; m++)
                min_acc[m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a->s + (m0 + m) * a->nb_pad + b), min_acc[m]);
        }
    }
    for (int m = 0; m < M; m++) sums[m] = hsum8(_mm256_add_ps(acc[m], min_acc[m]));
}

#else
static ALWAYS_INLINE void dot_row(const Acts *a, int64_t m0, const int M, const Weights *w, int64_t n,
                                  float sums[TILE_ROWS]) {
    float acc[TILE_ROWS] = {0}, min_acc[TILE_ROWS] = {0};
    const uint16_t *scales = w->scales + n * w->nb, *mins = w->mins ? w->mins + n * w->nb : NULL;
    const int8_t *xq = tile_q(a, m0);
    const float *xd = tile_lanes(a, m0);
    for (int64_t b = 0; b < w->nb; b++, xq += TILE_ROWS * QBLOCK, xd += TILE_ROWS) {
        const float dw = f16_to_f32(scales[b]);
        for (int m = 0; m < M; m++) {
            const int8_t *x = xq + QBLOCK * m;
            int32_t dot = 0;
            if (w->fmt == FMT_Q4) {
                const uint8_t *q = w->qs + n * w->qs_row + 16 * b;
                for (int j = 0; j < 16; j++) dot += (int32_t)(q[j] & 15) * x[j] + (int32_t)(q[j] >> 4) * x[16 + j];
            } else {
                const int8_t *q = (const int8_t *)w->qs + n * w->qs_row + QBLOCK * b;
                for (int j = 0; j < QBLOCK; j++) dot += (int32_t)q[j] * x[j];
            }
            acc[m] += (dw * xd[m]) * (float)dot;
            if (mins) min_acc[m] += f16_to_f32(mins[b]) * a->s[(m0 + m) * a->nb_pad + b];
        }
    }
    for (int m = 0; m < M; m++) sums[m] = acc[m] + min_acc[m];
}
#endif

/* Bytes [p, p + len) into the cache ahead of use. Streaming q4 from memory on one core of the 2-core dev VM
 * (2026-11-26), three streams (nibbles, scales, mins) with rows of 360 bytes, the hardware prefetcher alone gave
 * ~13 GB/s, and 20 with each row asked for PREFETCH_BYTES ahead (q8: 22 -> 26). Prefetches never fault, so the
 * rows past the end cost nothing. */
static inline void prefetch_span(const void *p, int64_t len) {
    const char *c = (const char *)p;
    for (int64_t off = 0; off < len; off += 64) __builtin_prefetch(c + off, 0, 3);
    __builtin_prefetch(c + len - 1, 0, 3);
}

static inline void prefetch_row(const Weights *w, int64_t n) {
    prefetch_span(w->qs + n * w->qs_row, w->qs_row);
    prefetch_span(w->scales + n * w->nb, 2 * w->nb);
    if (w->mins) prefetch_span(w->mins + n * w->nb, 2 * w->nb);
}

/* Outputs [n0, n1) of rows m0 .. m0 + M (M a constant where inlined); `stream`: W comes from memory (prefetch it),
 * not from a chunk in cache (where the prefetches of rows past the chunk cost a prefill 10-30%). */
static ALWAYS_INLINE void tile_cols(const Acts *a, int64_t m0, const int M, const Weights *w, void *y, int64_t y_stride,
                                    int is_bf16, int64_t n0, int64_t n1, int stream) {
    for (int64_t r0 = n0; r0 < n1; r0 += OUT_RUN) {
        const int64_t r1 = r0 + OUT_RUN < n1 ? r0 + OUT_RUN : n1;
        float sums[OUT_RUN][TILE_ROWS];
        for (int64_t n = r0; n < r1; n++) {
            if (stream) prefetch_row(w, n + w->ahead);
            dot_row(a, m0, M, w, n, sums[n - r0]);
        }
        for (int m = 0; m < M; m++) {   /* each row's run of outputs written together */
            if (is_bf16) {
                uint16_t *out = (uint16_t *)y + (m0 + m) * y_stride;
                for (int64_t n = r0; n < r1; n++) out[n] = f32_to_bf16(sums[n - r0][m]);
            } else {
                float *out = (float *)y + (m0 + m) * y_stride;
                for (int64_t n = r0; n < r1; n++) out[n] = sums[n - r0][m];
            }
        }
    }
}

static void tile_cols_any(const Acts *a, int64_t m0, int M, const Weights *w, void *y, int64_t y_stride, int is_bf16,
                          int64_t n0, int64_t n1, int stream) {
    switch (M) {
    case 1: tile_cols(a, m0, 1, w, y, y_stride, is_bf16, n0, n1, stream); break;
    case 2: tile_cols(a, m0, 2, w, y, y_stride, is_bf16, n0, n1, stream); break;
    case 3: tile_cols(a, m0, 3, w, y, y_stride, is_bf16, n0, n1, stream); break;
    case 4: tile_cols(a, m0, 4, w, y, y_stride, is_bf16, n0, n1, stream); break;
    case 5: tile_cols(a, m0, 5, w, y, y_stride, is_bf16, n0, n1, stream); break;
    case 6: tile_cols(a, m0, 6, w, y, y_stride, is_bf16, n0, n1, stream); break;
    case 7: tile_cols(a, m0, 7, w, y, y_stride, is_bf16, n0, n1, stream); break;
    default: tile_cols(a, m0, 8, w, y, y_stride, is_bf16, n0, n1, stream); break;
    }
}

/* Weight rows [n0, n1) for all M rows of x: one pass over the rows when M <= TILE_ROWS, else chunks of rows that
 * stay in cache, each dotted with every tile of TILE_ROWS rows of x. */
static void multiply_range(const Acts *a, int64_t M, const Weights *w, void *y, int64_t y_stride, int is_bf16,
                           int64_t n0, int64_t n1) {
    if (M <= TILE_ROWS) {
        tile_cols_any(a, 0, (int)M, w, y, y_stride, is_bf16, n0, n1, 1);
        return;
    }
    const int64_t row_bytes = w->qs_row + 2 * w->nb * (w->mins ? 2 : 1);
    const int64_t chunk = CHUNK_BYTES / row_bytes > 8 ? CHUNK_BYTES / row_bytes : 8;
    for (int64_t c0 = n0; c0 < n1; c0 += chunk) {
        const int64_t c1 = c0 + chunk < n1 ? c0 + chunk : n1;
        for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS)
            tile_cols_any(a, m0, (int)(M - m0 < TILE_ROWS ? M - m0 : TILE_ROWS), w, y, y_stride, is_bf16, c0, c1, 0);
    }
}

/* y [M, N] (rows y_stride elements apart) = x [M, K] (rows x_stride apart) . W^T, W [N, K] quantized.
 * fmt 0 = q4, 1 = q8; mins may be NULL for q8. x and y are bf16 (is_bf16 = 1) or fp32 (0).
 * Returns 0; -1 when K % 32 != 0 or M < 1 or a NULL that must not be (also K < 32, N < 0, an unknown fmt, and
 * rows that overlap: M > 1 with x_stride < K or y_stride < N); -2 when the activations' buffer cannot be had.
 * Opens its own OpenMP region: call it from serial code (inside another region it runs on one thread). */
int quant_matmul(const void *x, int64_t x_stride, const void *qs, const uint16_t *scales, const uint16_t *mins, int fmt,
                 void *y, int64_t y_stride, int64_t M, int64_t N, int64_t K, int is_bf16) {
    if (!x || !qs || !scales || !y || (fmt != FMT_Q4 && fmt != FMT_Q8) || (fmt == FMT_Q4 && !mins) || M < 1 || N < 0
        || K < QBLOCK || K % QBLOCK != 0 || (M > 1 && (x_stride < K || y_stride < N)))
        return -1;
    if (N == 0) return 0;
    const int64_t nb = K / QBLOCK;
    Acts a;
    if (acts_alloc(&a, M, nb, fmt) != 0) return -2;
    const int64_t qs_row = fmt == FMT_Q4 ? K / 2 : K;
    const Weights w = {
        (const uint8_t *)qs, scales, mins, fmt, nb, qs_row, PREFETCH_BYTES / qs_row > 1 ? PREFETCH_BYTES / qs_row : 1};
    /* A decode step's few rows are quantized here, so that the parallel region has no barrier inside (one fork
     * and one join a call, as gemv.c); a prefill's many rows by all threads, then a barrier. */
    const int serial = M <= TILE_ROWS;
    if (serial) quantize_rows(x, x_stride, is_bf16, fmt, &a, 0, M);
#pragma omp parallel if (M * N * K >= 131072)
    {
        if (!serial) {
            const int threads = omp_get_num_threads(), me = omp_get_thread_num();
            quantize_rows(x, x_stride, is_bf16, fmt, &a, M * me / threads, M * (me + 1) / threads);
#pragma omp barrier
        }
        /* contiguous ranges of weight rows, one per thread: each thread streams one region of W */
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        multiply_range(&a, M, &w, y, y_stride, is_bf16, N * me / threads, N * (me + 1) / threads);
    }
    free(a.base);
    return 0;
}
