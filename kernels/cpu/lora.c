/* A LoRA decode step's delta for one linear layer in one call (worker/lora.py's LoraLayer): for each row i of the
 * step whose slot s = slots[i] is >= 0, t = x_i @ a_t[s] ([width] ranks), then y_i += t @ b_t[s] (scale folded into
 * b_t); rows of slot -1 (the base model) are left alone. In place of the twin's gather, two batched matmuls and
 * scatter-add (each ~20 us of torch dispatch at a handful of FLOPs).
 *
 * Layout (worker/lora.py): a_t [slots, in, width] and b_t [slots, width, out], each slot contiguous; width = subs *
 * rank, and b_t block-diagonal: ranks [k * rank, (k + 1) * rank) of sub-block k (q, k, v of a fused qkv) reach only
 * its output columns [sub_first[k], sub_first[k] + sub_cols[k]), so only those are read. Ranks whose t is exactly 0
 * (zero-padded ranks of an adapter of smaller rank) are skipped.
 *
 * Roundings follow the twin (torch.bmm, then index_add_): fp32 sums; bf16 rounds t to bf16, the delta to bf16, then
 * y + delta to bf16 (only the order of the sums differs). Plain C loops over bf16 (uint16_t) or fp32 that the
 * compiler vectorizes for each build; `is_bf16` picks the type of x, y, a_t and b_t alike.
 */

#include "common.h"

#define LORA_MAX_WIDTH 1024 /* kernels/cpu_kernels.py's LORA_MAX_WIDTH */
#define LORA_COLS 512       /* output columns summed per pass (a stack buffer) */

static inline __attribute__((always_inline)) float elem(const void *base, int64_t i, const int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* t [width] = x [in] @ a [in, width], rounded to the type. */
static inline __attribute__((always_inline)) void shrink(const void *x, const void *a, float *t, int64_t in,
                                                         int64_t width, const int is_bf16) {
    for (int64_t j = 0; j < width; j++) t[j] = 0.0f;
    for (int64_t k = 0; k < in; k++) {
        float xk = elem(x, k, is_bf16);
        if (xk == 0.0f) continue;
        const char *row = (const char *)a + k * width * (is_bf16 ? 2 : 4);
#pragma omp simd
        for (int64_t j = 0; j < width; j++) t[j] += xk * elem(row, j, is_bf16);
    }
    if (is_bf16)
        for (int64_t j = 0; j < width; j++) t[j] = bf16_to_f32(f32_to_bf16(t[j]));
}

/* y [cols] += (t [ranks] @ b [ranks, cols of rows `out` apart]), the delta rounded to the type first. */
static inline __attribute__((always_inline)) void expand(const float *t, const void *b, void *y, int64_t ranks,
                                                         int64_t out, int64_t cols, const int is_bf16) {
    float acc[LORA_COLS];
    for (int64_t c0 = 0; c0 < cols; c0 += LORA_COLS) {
        int64_t n = cols - c0 < LORA_COLS ? cols - c0 : LORA_COLS;
        for (int64_t c = 0; c < n; c++) acc[c] = 0.0f;
        for (int64_t j = 0; j < ranks; j++) {
            float tj = t[j];
            if (tj == 0.0f) continue;
            const char *row = (const char *)b + (j * out + c0) * (is_bf16 ? 2 : 4);
#pragma omp simd
            for (int64_t c = 0; c < n; c++) acc[c] += tj * elem(row, c, is_bf16);
        }
        if (is_bf16) {
            uint16_t *yr = (uint16_t *)y + c0;
            for (int64_t c = 0; c < n; c++) yr[c] = f32_to_bf16(bf16_to_f32(yr[c]) + bf16_to_f32(f32_to_bf16(acc[c])));
        } else {
            float *yr = (float *)y + c0;
            for (int64_t c = 0; c < n; c++) yr[c] += acc[c];
        }
    }
}

static inline __attribute__((always_inline)) void lora_row(const void *x, void *y, const void *a, const void *b,
                                                           int64_t in, int64_t width, int64_t out, int64_t rank,
                                                           const int64_t *sub_first, const int64_t *sub_cols,
                                                           int64_t subs, const int is_bf16) {
    float t[LORA_MAX_WIDTH];
    shrink(x, a, t, in, width, is_bf16);
    const int elem_size = is_bf16 ? 2 : 4;
    for (int64_t k = 0; k < subs; k++)
        expand(t + k * rank, (const char *)b + (k * rank * out + sub_first[k]) * elem_size,
               (char *)y + sub_first[k] * elem_size, rank, out, sub_cols[k], is_bf16);
}

/* x [rows, in] (rows x_stride elements apart), y [rows, out] (y_stride apart) updated in place; slots [rows] int32
 * (-1: no adapter); a_t [num_slots, in, width], b_t [num_slots, width, out] contiguous; sub-blocks as above (width =
 * subs * rank). 0, or -1: width past LORA_MAX_WIDTH or sub-blocks that do not fit; -2: a slot outside the table. */
int lora_rows(const void *x, int64_t x_stride, void *y, int64_t y_stride, const int32_t *slots, int64_t rows,
              const void *a_t, const void *b_t, int64_t num_slots, int64_t in, int64_t out, int64_t rank,
              const int64_t *sub_first, const int64_t *sub_cols, int64_t subs, int is_bf16) {
    int64_t width = subs * rank;
    if (rank < 1 || subs < 1 || width > LORA_MAX_WIDTH) return -1;
    for (int64_t k = 0; k < subs; k++)
        if (sub_first[k] < 0 || sub_cols[k] < 0 || sub_first[k] + sub_cols[k] > out) return -1;
    int64_t used = 0;
    for (int64_t i = 0; i < rows; i++) {
        if (slots[i] >= num_slots) return -2;
        used += slots[i] >= 0;
    }
    const int64_t elem_size = is_bf16 ? 2 : 4;
    /* two threads pay from a few rows of a small layer (fork and join are a few us) */
#pragma omp parallel for schedule(static) if (used * width * (in + out) > 65536)
    for (int64_t i = 0; i < rows; i++) {
        int64_t s = slots[i];
        if (s < 0) continue;
        const char *xr = (const char *)x + i * x_stride * elem_size;
        char *yr = (char *)y + i * y_stride * elem_size;
        const char *a = (const char *)a_t + s * in * width * elem_size;
        const char *b = (const char *)b_t + s * width * out * elem_size;
        if (is_bf16) lora_row(xr, yr, a, b, in, width, out, rank, sub_first, sub_cols, subs, 1);
        else lora_row(xr, yr, a, b, in, width, out, rank, sub_first, sub_cols, subs, 0);
    }
    return 0;
}
