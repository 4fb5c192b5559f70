/* Every entry point of the CPU kernels' library, declared once. Each .c file of this folder includes it, so the
 * compiler checks every definition against its declaration; kernels/cpu_kernels.py reads the "exported" ones from
 * this file to declare their ctypes argument types (`declare`), so the Python side cannot drift from the C either.
 * Every exported function returns an int (a status: 0 done, else refused, as its Python wrapper reads it;
 * gemv_paths: a bit set). Parameter types are limited to what the binding reads: pointers (any), int64_t, int,
 * float. */

#ifndef INFER_CPU_KERNELS_H
#define INFER_CPU_KERNELS_H

#include <stdint.h>

/* ---- exported: called from Python ---- */

/* decode attention over the paged pool: one query row a sequence (paged_decode.c) */
int paged_decode(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool, const int32_t *block_tables,
                 int64_t table_stride, int64_t table_width, const int32_t *seq_lens, void *out, int num_seqs,
                 int num_heads, int num_kv_heads, int head_dim, int block_size, int64_t num_blocks, float scale,
                 int is_bf16, int window, float softcap, const float *sinks);

/* decode attention for runs of rows (a speculative verification's k + 1 rows a sequence) (paged_decode.c) */
int paged_decode_runs(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                      const int32_t *block_tables, int64_t table_stride, int64_t table_width, const int32_t *seq_lens,
                      const int32_t *runs, int num_runs, void *out, int num_rows, int num_heads, int num_kv_heads,
                      int head_dim, int block_size, int64_t num_blocks, float scale, int is_bf16, int window,
                      float softcap, const float *sinks);

/* causal prefill / mixed-step attention over the pool in place (paged_prefill.c) */
int paged_prefill(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool, const int32_t *block_tables,
                  int64_t table_stride, int64_t table_width, const int32_t *seq_lens, const int32_t *query_start_loc,
                  int64_t num_tokens, void *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                  int block_size, int64_t num_blocks, float scale, int is_bf16, const int32_t *decode_from, int window,
                  float softcap, const float *sinks);

/* rotary embedding of num_tokens rows of num_heads heads, in place (elementwise.c) */
int rotary_inplace(void *x, int64_t stride, int64_t num_tokens, int num_heads, int head_dim, const int64_t *positions,
                   const float *cos_sin, int64_t num_positions, int is_neox, int is_bf16);

/* K (rotated on the way) and V of num_tokens rows into their pool slots (elementwise.c) */
int append_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_pool, void *v_pool,
              int64_t num_slots, const int64_t *slots, int64_t pad_slot, int64_t num_tokens, int num_kv_heads,
              int head_dim, const int64_t *positions, const float *cos_sin, int64_t num_positions, int is_neox,
              int is_bf16);

/* RMSNorm of `rows` rows (with the residual added first where one is given) (elementwise.c) */
int rms_norm(const void *x, int64_t x_stride, void *residual, int64_t res_stride, const void *weight, void *out,
             int64_t out_stride, int64_t rows, int hidden, float eps, int is_bf16);

/* each fp32 row's largest value and its index (greedy sampling) (elementwise.c) */
int row_max(const float *x, int64_t rows, int64_t cols, int64_t stride, float *top, int64_t *index);

/* SiLU(x[:, :d]) * x[:, d:] of `rows` rows (elementwise.c) */
int silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int64_t rows, int64_t d, int is_bf16);

/* which GEMV paths this build has (cpu_kernels.GEMV_* bits) (gemv.c) */
int gemv_paths(void);

/* y = x W^T (+ bias) for 1-8 bf16 rows by a bf16 weight (gemv.c) */
int gemv_rows_bf16(const void *x, int64_t x_stride, const void *w, void *y, int64_t y_stride, int64_t M, int64_t N,
                   int64_t K, const void *bias);

/* y = x W^T for fp32 rows by a bf16 weight (widened in registers) (gemv.c) */
int gemv_rows_bf16w_f32x(const void *x, int64_t x_stride, const void *w, void *y, int64_t y_stride, int64_t M,
                         int64_t N, int64_t K);

/* y = x W^T by a weight kept in q4 / q8 blocks (int8 activations) (quant.c) */
int quant_matmul(const void *x, int64_t x_stride, const void *qs, const uint16_t *scales, const uint16_t *mins, int fmt,
                 void *y, int64_t y_stride, int64_t M, int64_t N, int64_t K, int is_bf16);

/* y += (x A^T) B^T for every row by its own adapter's slot (lora.c) */
int lora_rows(const void *x, int64_t x_stride, void *y, int64_t y_stride, const int32_t *slots, int64_t rows,
              const void *a_t, const void *b_t, int64_t num_slots, int64_t in, int64_t out, int64_t rank,
              const int64_t *sub_first, const int64_t *sub_cols, int64_t subs, int is_bf16);

/* a decode step of 1-8 sequences through a dense Llama's layers and final norm (decode_layers.c) */
int decode_layers(void *h, void *residual, const void *const *weights, const int32_t *formats, void *const *pools,
                  int64_t num_layers, int64_t rows, int64_t hidden, int num_heads, int num_kv_heads, int head_dim,
                  int64_t intermediate, float eps, float scale, const int64_t *positions, const int64_t *slots,
                  const int32_t *tables, int64_t table_stride, int64_t table_width, const int32_t *seq_lens,
                  int64_t num_blocks, int block_size, const float *cos_sin, int64_t num_positions, int is_neox,
                  void *scratch, int is_bf16, const int32_t *windows, const int32_t *runs, int num_runs);

/* ---- internal: called across files of this folder only ---- */

/* (paged_prefill.c from paged_decode.c) rows attend_rows takes at once for a head group */
int attend_max_tokens(int group);

/* (paged_prefill.c from paged_decode.c) the decode arithmetic for a few tokens of a chunk */
void attend_rows(const void *q, int64_t q_token_bytes, const void *k_pool, const void *v_pool, const int32_t *table,
                 int first_len, int tokens, void *out, int64_t out_token_bytes, int group, int head_dim, int block_size,
                 float scale, int is_bf16, int window, float softcap, const float *sinks);

#endif
