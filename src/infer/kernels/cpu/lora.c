/* A LoRA decode step's delta for one linear layer in one call (worker/engine/lora.py's LoraLayer): for each row i of
 * the step whose slot s = slots[i] is >= 0, t = x_i @ a_t[s] ([width] ranks), then y_i += t @ b_t[s] (scale folded
 * into b_t); rows of slot -1 (the base model) are left alone. In place of the twin's gather, two batched matmuls and
 * scatter-add (each ~20 us of torch dispatch at a handful of FLOPs).
 *
 * Layout (worker/engine/lora.py): a_t [slots, in, width] and b_t [slots, width, out], each slot contiguous; width =
 * subs * rank, and b_t block-diagonal: ranks [k * rank, (k + 1) * rank) of sub-block k (q, k, v of a fused qkv)
 * reach only its output columns [sub_first[k], sub_first[k] + sub_cols[k]), so only those are read.
 *
 * Rows are taken by slot, NR at a time (their A and B read once for all of them; a group short of NR computes zero
 * rows in the empty places), TW ranks and TC output columns a pass in fp32 accumulators the compiler keeps in
 * registers.
 *
 * Roundings follow the twin (torch.bmm, then index_add_): fp32 sums; bf16 rounds t to bf16, the delta to bf16, then
 * y + delta to bf16 (only the order of the sums differs). Plain C loops over bf16 (uint16_t) or fp32 that the
 * compiler vectorizes for each build; `is_bf16` picks the type of x, y, a_t and b_t alike.
 */

#include "common.h"
#include "kernels.h"

#include <stdlib.h>

#define LORA_MAX_WIDTH 1024 /* kernels/cpu_kernels.py's LORA_MAX_WIDTH */
#define NR 4                /* rows of one slot a pass (shrink names its 4 accumulators) */
#define TW 16               /* ranks a shrink pass: one f32x16 */
#define TC 32               /* output columns an expand pass: two f32x16 */

static inline __attribute__((always_inline)) float elem(const void *base, int64_t i, const int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

static inline __attribute__((always_inline)) float round_to(float f, const int is_bf16) {
    return is_bf16 ? bf16_to_f32(f32_to_bf16(f)) : f;
}

/* 16 lanes of fp32 as a GCC vector: the accumulators stay in registers (zmm on AVX-512, ymm or xmm pairs below). */
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

/* Elements 0 .. 15 of a bf16 or fp32 row as fp32. */
static inline __attribute__((always_inline)) f32x16 load_16(const void *row, const int is_bf16) {
    f32x16 v;
    if (is_bf16) {
        u16x16 h;
        __builtin_memcpy(&h, row, sizeof h);
        v = (f32x16)(__builtin_convertvector(h, u32x16) << 16);
    } else {
        __builtin_memcpy(&v, row, sizeof v);
    }
    return v;
}

/* v rounded to bf16 (nearest even, NaN stays NaN, as f32_to_bf16), still as fp32 bits. */
static inline __attribute__((always_inline)) u32x16 bf16_bits(f32x16 v) {
    u32x16 u = (u32x16)v;
    u32x16 nan = (u32x16)((u & 0x7fffffffu) > 0x7f800000u);
    return (nan & (u | 0x400000u)) | (~nan & ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u));
}

/* y[0 .. 15] += delta, the delta rounded to the type first, then the sum. */
static inline __attribute__((always_inline)) void add_delta16(void *y, f32x16 delta, const int is_bf16) {
    if (is_bf16) {
        f32x16 sum = load_16(y, 1) + (f32x16)bf16_bits(delta);
        u16x16 h = __builtin_convertvector(bf16_bits(sum) >> 16, u16x16);
        __builtin_memcpy(y, &h, sizeof h);
    } else {
        f32x16 sum = load_16(y, 0) + delta;
        __builtin_memcpy(y, &sum, sizeof sum);
    }
}

/* t[r][j] = x[r] [in] @ a [in, width] for NR rows, rounded to the type. */
static inline __attribute__((always_inline)) void shrink(const void *const *x, const void *a,
                                                         float t[NR][LORA_MAX_WIDTH], int64_t in, int64_t width,
                                                         const int is_bf16) {
    const int64_t es = is_bf16 ? 2 : 4;
    int64_t j0 = 0;
    for (; j0 + TW <= width; j0 += TW) {
        f32x16 acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0};
        for (int64_t k = 0; k < in; k++) {
            f32x16 av = load_16((const char *)a + (k * width + j0) * es, is_bf16);
            acc0 += elem(x[0], k, is_bf16) * av;
            acc1 += elem(x[1], k, is_bf16) * av;
            acc2 += elem(x[2], k, is_bf16) * av;
            acc3 += elem(x[3], k, is_bf16) * av;
        }
        for (int j = 0; j < TW; j++) {
            t[0][j0 + j] = round_to(acc0[j], is_bf16);
            t[1][j0 + j] = round_to(acc1[j], is_bf16);
            t[2][j0 + j] = round_to(acc2[j], is_bf16);
            t[3][j0 + j] = round_to(acc3[j], is_bf16);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int64_t j = j0; j < width; j++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < in; k++) acc += elem(x[r], k, is_bf16) * elem(a, k * width + j, is_bf16);
            t[r][j] = round_to(acc, is_bf16);
        }
}

static inline __attribute__((always_inline)) void add_delta(void *y, int64_t c, float delta, const int is_bf16) {
    if (is_bf16) {
        uint16_t *p = (uint16_t *)y + c;
        *p = f32_to_bf16(bf16_to_f32(*p) + bf16_to_f32(f32_to_bf16(delta)));
    } else {
        ((float *)y)[c] += delta;
    }
}

/* y[r] [cols] += t[r][first .. first + ranks) @ b [ranks, cols; rows `out` apart] for the first `live` rows, the
 * delta rounded to the type first. */
static inline __attribute__((always_inline)) void expand(float t[NR][LORA_MAX_WIDTH], int64_t first, const void *b,
                                                         void *const *y, int live, int64_t ranks, int64_t out,
                                                         int64_t cols, const int is_bf16) {
    const int64_t es = is_bf16 ? 2 : 4;
    int64_t c0 = 0;
    for (; c0 + TC <= cols; c0 += TC) {
        f32x16 acc[NR][2] = {{{0}}};
        for (int64_t j = 0; j < ranks; j++) {
            const char *row = (const char *)b + (j * out + c0) * es;
            f32x16 lo = load_16(row, is_bf16), hi = load_16(row + 16 * es, is_bf16);
            for (int r = 0; r < NR; r++) {
                float tj = t[r][first + j];
                acc[r][0] += tj * lo;
                acc[r][1] += tj * hi;
            }
        }
        for (int r = 0; r < live; r++) {
            add_delta16((char *)y[r] + c0 * es, acc[r][0], is_bf16);
            add_delta16((char *)y[r] + (c0 + 16) * es, acc[r][1], is_bf16);
        }
    }
    for (int r = 0; r < live; r++)
        for (int64_t c = c0; c < cols; c++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < ranks; j++) acc += t[r][first + j] * elem(b, j * out + c, is_bf16);
            add_delta(y[r], c, acc, is_bf16);
        }
}

/* One slot's `live` <= NR rows (x[r], y[r]; the places past `live` point at a zero row and are not written). */
static inline __attribute__((always_inline)) void lora_group(const void *const *x, void *const *y, int live,
                                                             const void *a, const void *b, int64_t in, int64_t out,
                                                             int64_t rank, const int64_t *sub_first,
                                                             const int64_t *sub_cols, int64_t subs, const int is_bf16) {
    float t[NR][LORA_MAX_WIDTH];
    const int64_t es = is_bf16 ? 2 : 4;
    shrink(x, a, t, in, subs * rank, is_bf16);
    for (int64_t k = 0; k < subs; k++) {
        void *ys[NR];
        for (int r = 0; r < NR; r++) ys[r] = (char *)y[r] + sub_first[k] * es;
        expand(t, k * rank, (const char *)b + (k * rank * out + sub_first[k]) * es, ys, live, rank, out, sub_cols[k],
               is_bf16);
    }
}

/* x [rows, in] (rows x_stride elements apart), y [rows, out] (y_stride apart) updated in place; slots [rows] int32
 * (negative: no adapter); a_t [num_slots, in, width], b_t [num_slots, width, out] contiguous; sub-blocks as above (width =
 * subs * rank). 0, or -1: width past LORA_MAX_WIDTH or sub-blocks that do not fit; -2: a slot outside the table;
 * -3: out of memory. */
int lora_rows(const void *x, int64_t x_stride, void *y, int64_t y_stride, const int32_t *slots, int64_t rows,
              const void *a_t, const void *b_t, int64_t num_slots, int64_t in, int64_t out, int64_t rank,
              const int64_t *sub_first, const int64_t *sub_cols, int64_t subs, int is_bf16) {
    const int64_t width = subs * rank, es = is_bf16 ? 2 : 4;
    if (rank < 1 || subs < 1 || width > LORA_MAX_WIDTH) return -1;
    for (int64_t k = 0; k < subs; k++)
        if (sub_first[k] < 0 || sub_cols[k] < 0 || sub_first[k] + sub_cols[k] > out) return -1;
    for (int64_t i = 0; i < rows; i++)
        if (slots[i] >= num_slots) return -2;
    /* the adapter rows by slot (stable), then groups of up to NR rows of one slot: group g is order[start[g] ..] */
    int64_t *order = malloc(sizeof(int64_t) * (2 * rows + 1));
    float *zeros = calloc(in, sizeof(float));
    if (order == NULL || zeros == NULL) {
        free(order);
        free(zeros);
        return -3;
    }
    int64_t *start = order + rows, used = 0, groups = 0;
    for (int64_t s = 0; s < num_slots; s++) {
        int64_t first = used;
        for (int64_t i = 0; i < rows; i++)
            if (slots[i] == s) {
                if ((used - first) % NR == 0) start[groups++] = used;
                order[used++] = i;
            }
    }
    start[groups] = used;
    /* two threads pay from a few rows of a small layer (fork and join are a few us) */
#pragma omp parallel for schedule(static) if (used * width * (in + out) > 65536)
    for (int64_t g = 0; g < groups; g++) {
        int live = (int)(start[g + 1] - start[g]);
        int64_t s = slots[order[start[g]]];
        if (live > NR) live = NR;
        const void *xs[NR];
        void *ys[NR];
        for (int r = 0; r < NR; r++) {
            int64_t i = order[start[g] + (r < live ? r : 0)];
            xs[r] = r < live ? (const char *)x + i * x_stride * es : (const void *)zeros;
            ys[r] = (char *)y + i * y_stride * es;
        }
        const char *a = (const char *)a_t + s * in * width * es;
        const char *b = (const char *)b_t + s * width * out * es;
        if (is_bf16) lora_group(xs, ys, live, a, b, in, out, rank, sub_first, sub_cols, subs, 1);
        else lora_group(xs, ys, live, a, b, in, out, rank, sub_first, sub_cols, subs, 0);
    }
    free(order);
    free(zeros);
    return 0;
}
