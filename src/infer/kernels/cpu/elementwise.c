/* Per-layer elementwise steps on CPU, each one pass over its tokens in place of several torch ops: rotary
 * embedding of q, the KV append (K rotated on the way), RMSNorm with the residual add, and SiLU * mul.
 *
 * Built with paged_decode.c into one library (kernels/cpu_kernels.py). The arithmetic follows the PyTorch
 * twins step by step, in fp32 with one rounding to the tensor's type at the end (bf16: round to nearest even),
 * and with no fused multiply-add, so that they give the twins' bits, except SiLU * mul: its exp is
 * common.h's polynomial, not torch's (Sleef's), so a bf16 result may differ from torch's in the last bit.
 *
 * RMSNorm of bf16 rows and SiLU * mul have AVX-512 (16 lanes) and AVX2 (8 lanes) paths with the roundings of the
 * scalar code; rotary, the append and the row max are portable loops the compiler vectorizes for the build.
 *
 * Element types: bf16 (as uint16_t) or fp32; `is_bf16` picks. Rows are `stride` elements apart; a row's
 * heads are contiguous, `head_dim` elements each.
 */

#include "common.h"
#include "kernels.h"

#pragma GCC optimize("fp-contract=off")

static inline float to_f32(const void *base, int64_t i, int is_bf16) {
    if (is_bf16) {
        union {
            uint32_t u;
            float f;
        } v;
        v.u = (uint32_t)((const uint16_t *)base)[i] << 16;
        return v.f;
    }
    return ((const float *)base)[i];
}

static inline void from_f32(void *base, int64_t i, float f, int is_bf16) {
    if (!is_bf16) {
        ((float *)base)[i] = f;
        return;
    }
    union {
        uint32_t u;
        float f;
    } v;
    v.f = f;
    uint16_t out = (v.u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((v.u >> 16) | 0x40u)
                                                     : (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
    ((uint16_t *)base)[i] = out;
}

/* Rotate one head (head_dim elements at src) into dst (may be src): neox halves or GPT-J pairs, with this
 * position's cos | sin row (head_dim / 2 each). Inlined with constant flags, so each variant's loop is
 * branch-free and vectorizes. */
static inline __attribute__((always_inline)) void rotate_head(const void *src, void *dst, const float *cos_sin,
                                                              int head_dim, const int is_neox, const int is_bf16) {
    int half = head_dim / 2;
    float r1[128], r2[128];   /* head_dim <= 256 (checked by the callers) */
#pragma omp simd
    for (int i = 0; i < half; i++) {
        int64_t a = is_neox ? i : 2 * i, b = is_neox ? i + half : 2 * i + 1;
        float x1 = to_f32(src, a, is_bf16), x2 = to_f32(src, b, is_bf16);
        float c = cos_sin[i], s = cos_sin[half + i];
        r1[i] = x1 * c - x2 * s;
        r2[i] = x2 * c + x1 * s;
    }
#pragma omp simd
    for (int i = 0; i < half; i++) {
        int64_t a = is_neox ? i : 2 * i, b = is_neox ? i + half : 2 * i + 1;
        from_f32(dst, a, r1[i], is_bf16);
        from_f32(dst, b, r2[i], is_bf16);
    }
}

static void rotate_any(const void *src, void *dst, const float *cos_sin, int head_dim, int is_neox, int is_bf16) {
    if (is_neox && is_bf16) rotate_head(src, dst, cos_sin, head_dim, 1, 1);
    else if (is_neox) rotate_head(src, dst, cos_sin, head_dim, 1, 0);
    else if (is_bf16) rotate_head(src, dst, cos_sin, head_dim, 0, 1);
    else rotate_head(src, dst, cos_sin, head_dim, 0, 0);
}

/* x [T, heads, D] rows `stride` elements apart, rotated in place at positions [T]. -1: head_dim odd or past
 * 256; -2: a position outside the cos/sin cache of `num_positions` rows. */
int rotary_inplace(void *x, int64_t stride, int64_t num_tokens, int num_heads, int head_dim, const int64_t *positions,
                   const float *cos_sin, int64_t num_positions, int is_neox, int is_bf16) {
    if (head_dim > 256 || head_dim % 2) return -1;
    for (int64_t t = 0; t < num_tokens; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -2;
    int elem = is_bf16 ? 2 : 4;
#pragma omp parallel for if (num_tokens * num_heads * head_dim > 32768)
    for (int64_t t = 0; t < num_tokens; t++) {
        const float *row = cos_sin + positions[t] * head_dim;
        for (int h = 0; h < num_heads; h++) {
            char *head = (char *)x + (t * stride + (int64_t)h * head_dim) * elem;
            rotate_any(head, head, row, head_dim, is_neox, is_bf16);
        }
    }
    return 0;
}

/* k, v [T, Hkv, D] (rows k_stride / v_stride elements apart) into the pools [Hkv, num_slots, D] at slots [T];
 * slot -1 is skipped, or written at pad_slot when pad_slot >= 0. With cos_sin, K is rotated at positions.
 * -1: head_dim odd or past 256; -2: a slot outside [-1, num_slots) or a position outside the cos/sin cache
 * (nothing written then). */
int append_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_pool, void *v_pool,
              int64_t num_slots, const int64_t *slots, int64_t pad_slot, int64_t num_tokens, int num_kv_heads,
              int head_dim, const int64_t *positions, const float *cos_sin, int64_t num_positions, int is_neox,
              int is_bf16) {
    if (head_dim > 256 || head_dim % 2) return -1;
    if (pad_slot >= num_slots) return -2;
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < -1 || slots[t] >= num_slots) return -2;
        if (cos_sin && (positions[t] < 0 || positions[t] >= num_positions)) return -2;
    }
    int elem = is_bf16 ? 2 : 4;
#pragma omp parallel for if (num_tokens * num_kv_heads * head_dim > 32768)
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slots[t] >= 0 ? slots[t] : pad_slot;
        if (slot < 0) continue;
        for (int h = 0; h < num_kv_heads; h++) {
            int64_t dst = ((int64_t)h * num_slots + slot) * head_dim;
            const char *k_head = (const char *)k + (t * k_stride + (int64_t)h * head_dim) * elem;
            const char *v_head = (const char *)v + (t * v_stride + (int64_t)h * head_dim) * elem;
            char *k_dst = (char *)k_pool + dst * elem, *v_dst = (char *)v_pool + dst * elem;
            if (cos_sin) {
                rotate_any(k_head, k_dst, cos_sin + positions[t] * head_dim, head_dim, is_neox, is_bf16);
            } else {
                for (int d = 0; d < head_dim * elem; d++) k_dst[d] = k_head[d];
            }
            for (int d = 0; d < head_dim * elem; d++) v_dst[d] = v_head[d];
        }
    }
    return 0;
}

#if defined(__AVX512F__)
/* 16 fp32 lanes rounded to bf16 (nearest even; NaN stays NaN): f32_to_bf16 lane-wise. */
static inline __m256i to_bf16_16(__m512 v) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(v);
#else
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    __mmask16 nan = _mm512_cmp_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                          _mm512_set1_epi32(0x7f800000), _MM_CMPINT_NLE);
    rounded = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

/* The same lanes rounded to bf16 values, kept as fp32. */
static inline __m512 round_bf16_16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_16(v)), 16));
}
#endif

/* One row of rms_norm below; inlined with constant flags, so each variant's loops are branch-free and
 * vectorize. */
static inline __attribute__((always_inline)) void rms_norm_row(const void *x, void *residual, const void *weight,
                                                               void *out, int hidden, float eps, const int has_residual,
                                                               const int is_bf16) {
    float s[16384];
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int d = 0; d < hidden; d++) {
        float v = to_f32(x, d, is_bf16);
        if (has_residual) {
            v += to_f32(residual, d, is_bf16);
            if (is_bf16) v = bf16_to_f32(f32_to_bf16(v));   /* the sum in the type, as torch's add */
            from_f32(residual, d, v, is_bf16);
        }
        s[d] = v;
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
#pragma omp simd
    for (int d = 0; d < hidden; d++) {
        float normed = s[d] * inv;
        if (is_bf16) normed = bf16_to_f32(f32_to_bf16(normed));   /* rounded to the type, as the twin */
        from_f32(out, d, normed * to_f32(weight, d, is_bf16), is_bf16);
    }
}

#if defined(__AVX512F__)
/* rms_norm_row for bf16 rows, 16 lanes at a time with the same roundings (the sum of squares in 16 partial sums,
 * another order again). */
static inline __attribute__((always_inline)) void rms_norm_row_bf16(const uint16_t *x, uint16_t *residual,
                                                                    const uint16_t *weight, uint16_t *out, int hidden,
                                                                    float eps, const int has_residual) {
    float s[16384] __attribute__((aligned(64)));
    __m512 squares = _mm512_setzero_ps();
    int d = 0;
    for (; d + 16 <= hidden; d += 16) {
        __m512 v = load16(x + d, 0, 1);
        if (has_residual) {
            __m256i sum = to_bf16_16(_mm512_add_ps(v, load16(residual + d, 0, 1)));   /* torch's add, rounded */
            _mm256_storeu_si256((__m256i *)(residual + d), sum);
            v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(sum), 16));
        }
        _mm512_store_ps(s + d, v);
        squares = _mm512_add_ps(squares, _mm512_mul_ps(v, v));
    }
    float sum = _mm512_reduce_add_ps(squares);
    for (int e = d; e < hidden; e++) {
        float v = bf16_to_f32(x[e]);
        if (has_residual) {
            v = bf16_to_f32(f32_to_bf16(v + bf16_to_f32(residual[e])));
            residual[e] = f32_to_bf16(v);
        }
        s[e] = v;
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    const __m512 inv16 = _mm512_set1_ps(inv);
    for (d = 0; d + 16 <= hidden; d += 16) {
        __m512 normed = round_bf16_16(_mm512_mul_ps(_mm512_load_ps(s + d), inv16));
        _mm256_storeu_si256((__m256i *)(out + d), to_bf16_16(_mm512_mul_ps(normed, load16(weight + d, 0, 1))));
    }
    for (; d < hidden; d++) out[d] = f32_to_bf16(bf16_to_f32(f32_to_bf16(s[d] * inv)) * bf16_to_f32(weight[d]));
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define RMS_AVX2 1
/* rms_norm_row for bf16 rows in 8 AVX2 lanes, the same roundings as the AVX-512 row (the sum of squares in 8
 * partial sums: another order again, so the output may differ from the twin's in a last bit; the residual sum
 * is the twin's, bit for bit). */
static inline __attribute__((always_inline)) void rms_norm_row_bf16(const uint16_t *x, uint16_t *residual,
                                                                    const uint16_t *weight, uint16_t *out, int hidden,
                                                                    float eps, const int has_residual) {
    float s[16384] __attribute__((aligned(32)));
    __m256 squares = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= hidden; d += 8) {
        __m256 v = load8(x + d, 0, 1);
        if (has_residual) {
            v = round_bf16_8(_mm256_add_ps(v, load8(residual + d, 0, 1)));   /* torch's add, rounded */
            _mm_storeu_si128((__m128i *)(residual + d), to_bf16_8(v));
        }
        _mm256_store_ps(s + d, v);
        squares = _mm256_add_ps(squares, _mm256_mul_ps(v, v));
    }
    float sum = hsum8(squares);
    for (int e = d; e < hidden; e++) {
        float v = bf16_to_f32(x[e]);
        if (has_residual) {
            v = bf16_to_f32(f32_to_bf16(v + bf16_to_f32(residual[e])));
            residual[e] = f32_to_bf16(v);
        }
        s[e] = v;
        sum += v * v;
    }
    const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
    const __m256 inv8 = _mm256_set1_ps(inv);
    for (d = 0; d + 8 <= hidden; d += 8) {
        __m256 normed = round_bf16_8(_mm256_mul_ps(_mm256_load_ps(s + d), inv8));
        _mm_storeu_si128((__m128i *)(out + d), to_bf16_8(_mm256_mul_ps(normed, load8(weight + d, 0, 1))));
    }
    for (; d < hidden; d++) out[d] = f32_to_bf16(bf16_to_f32(f32_to_bf16(s[d] * inv)) * bf16_to_f32(weight[d]));
}
#endif

/* RMSNorm of rows [rows, hidden] (x rows x_stride elements apart; out rows out_stride apart, out may be x),
 * optionally after the residual add: with `residual` (rows res_stride apart) s = x + residual rounded to the
 * type is stored into residual and normed instead of x. As the twin (kernels/rmsnorm.py): the statistics and
 * s / rms(s) in fp32, rounded to the type, then times the weight (same type) with one more rounding. The sum
 * of squares is taken in another order than torch's, so a result may differ from the twin's in the last bit.
 * -1: hidden outside 1..16384. */
int rms_norm(const void *x, int64_t x_stride, void *residual, int64_t res_stride, const void *weight, void *out,
             int64_t out_stride, int64_t rows, int hidden, float eps, int is_bf16) {
    if (hidden > 16384 || hidden < 1) return -1;
    const int elem = is_bf16 ? 2 : 4;
#pragma omp parallel for if (rows * hidden > 65536)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_stride * elem;
        char *rr = residual ? (char *)residual + r * res_stride * elem : 0;
        char *orow = (char *)out + r * out_stride * elem;
#if defined(__AVX512F__) || defined(RMS_AVX2)
        if (residual && is_bf16)
            rms_norm_row_bf16((const uint16_t *)xr, (uint16_t *)rr, weight, (uint16_t *)orow, hidden, eps, 1);
        else if (is_bf16) rms_norm_row_bf16((const uint16_t *)xr, 0, weight, (uint16_t *)orow, hidden, eps, 0);
#else
        if (residual && is_bf16) rms_norm_row(xr, rr, weight, orow, hidden, eps, 1, 1);
        else if (is_bf16) rms_norm_row(xr, rr, weight, orow, hidden, eps, 0, 1);
#endif
        else if (residual) rms_norm_row(xr, rr, weight, orow, hidden, eps, 1, 0);
        else rms_norm_row(xr, rr, weight, orow, hidden, eps, 0, 0);
    }
    return 0;
}

/* First index of `top` in row[0 .. cols): 64 elements a block compared at once, then the block scanned. */
static int64_t first_index_of(const float *row, int64_t cols, float top) {
    int64_t start = 0;
    for (; start + 64 <= cols; start += 64) {
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int i = 0; i < 64; i++) hit |= row[start + i] == top;
        if (hit) break;
    }
    for (int64_t i = start; i < cols; i++)
        if (row[i] == top) return i;
    return 0;   /* not reached: top is an element of the row */
}

/* Each row's maximum and the index of its first occurrence, as torch.max(x, dim=-1) on fp32 rows (cols >= 1,
 * rows `stride` elements apart): a row holding a NaN has maximum NaN at its first NaN. Two passes: the max of
 * the row (vectorized, NaNs counted on the side), then the first element equal to it. torch's CPU max with
 * indices walks each row element by element; this is ~10x faster on a 49152-token vocabulary. */
int row_max(const float *x, int64_t rows, int64_t cols, int64_t stride, float *top, int64_t *index) {
    if (cols < 1) return -1;
#pragma omp parallel for if (rows * cols > 262144)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        float best = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
        for (int64_t i = 0; i < cols; i++) {
            best = row[i] > best ? row[i] : best;
            nan |= row[i] != row[i];
        }
        if (nan) {
            int64_t i = 0;
            while (row[i] == row[i]) i++;
            top[r] = row[i];
            index[r] = i;
        } else {
            top[r] = best;
            index[r] = first_index_of(row, cols, best);
        }
    }
    return 0;
}

/* silu(g) * u for one element (the portable path; the AVX-512 and AVX2 paths compute the same lane-wise). */
static inline float silu_mul_one(float g, float u, const int is_bf16) {
    float e = exp_nonpositive(-fabsf(g));                       /* exp(-|g|), in (0, 1] */
    float s = g >= 0.0f ? g / (1.0f + e) : g * e / (1.0f + e);  /* g * sigmoid(g), never overflowing */
    if (is_bf16) s = bf16_to_f32(f32_to_bf16(s));               /* F.silu's output, in the type */
    return s * u;                                               /* .mul_(up); the caller rounds */
}

#if defined(__AVX512F__)
/* 16 lanes of silu_mul_one. exp16 zeroes what is at or below -87, as exp_nonpositive does. */
static inline __m512 silu_mul16(__m512 g, __m512 u, const int is_bf16) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)), (__mmask16)0xffff);
    __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 s = _mm512_div_ps(_mm512_mask_mul_ps(g, neg, g, e), _mm512_add_ps(one, e));
    if (is_bf16) s = round_bf16_16(s);
    return _mm512_mul_ps(s, u);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define SILU_AVX2 1
/* 8 lanes of silu_mul_one (exp8 zeroes what is at or below -87, and NaN, as exp_nonpositive does). */
static inline __m256 silu_mul8(__m256 g, __m256 u, const int is_bf16) {
    const __m256 one = _mm256_set1_ps(1.0f), all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    __m256 minus_abs = _mm256_or_ps(g, _mm256_set1_ps(-0.0f));   /* -|g| */
    __m256 e = exp8(minus_abs, all);
    __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    __m256 s = _mm256_div_ps(_mm256_blendv_ps(g, _mm256_mul_ps(g, e), neg), _mm256_add_ps(one, e));
    if (is_bf16) s = round_bf16_8(s);
    return _mm256_mul_ps(s, u);
}
#endif

/* One row of silu_and_mul below, inlined with a constant flag. */
static inline __attribute__((always_inline)) void silu_and_mul_row(const void *gate, const void *up, void *out,
                                                                   int64_t d, const int is_bf16) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= d; i += 16) {
        __m512 p = silu_mul16(load16((const char *)gate + i * (is_bf16 ? 2 : 4), 0, is_bf16),
                              load16((const char *)up + i * (is_bf16 ? 2 : 4), 0, is_bf16), is_bf16);
        if (is_bf16) {
            _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), to_bf16_16(p));
        } else {
            _mm512_storeu_ps((float *)out + i, p);
        }
    }
#elif defined(SILU_AVX2)
    for (; i + 8 <= d; i += 8) {
        __m256 p = silu_mul8(load8((const char *)gate + i * (is_bf16 ? 2 : 4), 0, is_bf16),
                             load8((const char *)up + i * (is_bf16 ? 2 : 4), 0, is_bf16), is_bf16);
        if (is_bf16) {
            _mm_storeu_si128((__m128i *)((uint16_t *)out + i), to_bf16_8(p));
        } else {
            _mm256_storeu_ps((float *)out + i, p);
        }
    }
#endif
    for (; i < d; i++)
        from_f32(out, i, silu_mul_one(to_f32(gate, i, is_bf16), to_f32(up, i, is_bf16), is_bf16), is_bf16);
}

/* silu(gate) * up over rows of x = [gate | up] (d elements each, x rows x_stride elements apart) into out [rows,
 * d] (rows out_stride apart), as F.silu(gate).mul_(up): silu in fp32, rounded to the type, times up in fp32,
 * rounded again. NaN and infinities as torch: silu(NaN) = NaN, silu(inf) = inf, silu(-inf) = NaN; a gate below
 * -87 gives 0 (exp_nonpositive's floor), where torch gives a magnitude under 1e-35. */
int silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int64_t rows, int64_t d, int is_bf16) {
    const int elem = is_bf16 ? 2 : 4;
#pragma omp parallel for if (rows * d > 32768)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)x + r * x_stride * elem;
        char *orow = (char *)out + r * out_stride * elem;
        if (is_bf16) silu_and_mul_row(gate, gate + d * elem, orow, d, 1);
        else silu_and_mul_row(gate, gate + d * elem, orow, d, 0);
    }
    return 0;
}
