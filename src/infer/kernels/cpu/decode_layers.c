/* A whole decode step of 1-8 sequences through a dense Llama-family model, in bf16 or fp32 rows: every decoder layer
 * and the final norm in one call, the same kernels in the same order as the eager layers call them one by one.
 * A sequence may bring several rows at consecutive positions (speculative verification: its last token and k
 * drafts, `runs`), each row computed as the decode at its position would be.
 *
 * At batch 1 the weights (SmolLM2-135M: 269 MB a token) are the floor, and the GEMV streams them near the
 * machine's read bandwidth; what was left was the Python around ~10 kernel calls a layer (module calls, argument
 * checks, ctypes conversions): 5 of the 13-15 ms a token took on the 2-core dev VM (2026-11-26). Here that is one
 * call a token. Each kernel is the library's own entry point (rms_norm, gemv_rows_bf16, rotary_inplace, append_kv,
 * paged_decode, silu_and_mul), so the bits are those of the eager path, layer for layer (which sends 1-8 rows to
 * the same GEMV).
 *
 * Per layer and row, as LlamaDecoderLayer.forward (residual stream carried between layers):
 *   layer 0: residual = h; n = rms(h)          later: residual = h + residual; n = rms(residual)
 *   qkv = n Wqkv^T; q rotated at the row's position; k (rotated) and v stored at its slot; a = attention(q, pool)
 *   h = a Wo^T; residual = h + residual; n = rms(residual); h = silu(n Wgate^T) * (n Wup^T) Wdown^T
 * then out = rms(h + residual) with the final norm's weight.
 *
 * weights: 18 pointers a layer (input norm, Wqkv [q + 2 kv, hidden], Wo [hidden, q], post-attention norm,
 * Wgate_up [2 I, hidden], Wdown [hidden, I], then the biases of the four linears or NULL: Qwen2 has the qkv one,
 * then each linear's block scales and mins for a quantized one, else NULL) and the final norm's weight last; a bias
 * is added as the eager linears add it: to the GEMV's fp32 sums before their one rounding (bf16 rows), to a quantized
 * product's output (bf16: rounded again, as `y.add_(bias)`). formats: 4 a layer, one per linear:
 * -1 its weight is dense bf16 (the GEMV: bf16 rows, or fp32 rows with bf16 weights), 0 / 1 quantized q4 / q8
 * (kernels/quant.py's layouts; quant_matmul). Norms, biases, pools and rows are all of the one type is_bf16 names.
 * pools: K and V of each layer ([Hkv, num_blocks, block_size, D] contiguous). scratch: rows x (hidden + (q + 2 kv)
 * + q + 3 I + hidden) elements. h [rows, hidden]: the embedding rows in, the final normed rows out; residual
 * [rows, hidden] scratch.
 * Row r: positions[r], slots[r], its block table at tables + r * table_stride (table_width entries), seq_lens[r].
 * runs [num_runs] (or NULL: every row a sequence of its own): the rows of each sequence, consecutive, in order;
 * the rows of one run are at consecutive positions (seq_lens going up by one), attend through the run's first
 * table and read its K and V once (paged_decode_runs). The linears take any number of rows (the GEMV reads each
 * weight row once for all of them, each row's sum taken alone), so every row has its decode's bits.
 * Returns 0, or the first failing kernel's code (-1 shapes past its limits, -2 a position, slot, length or table
 * entry out of range), as soon as one fails; each kernel checks its arguments before it writes anything.
 */

#include <stdint.h>
#include <string.h>

#include "common.h"
#include "kernels.h"

#define LAYER_POINTERS 18   /* a layer's entries in `weights` (see the top of this file) */

/* y [rows, N] (rows y_stride apart) += bias [N], in the rows' type (bf16: one rounding of the fp32 sum, as torch's
 * add_). */
static void add_bias(void *y, int64_t y_stride, const void *bias, int64_t rows, int64_t N, int is_bf16) {
    if (!bias) return;
    for (int64_t r = 0; r < rows; r++) {
        if (is_bf16) {
            uint16_t *row = (uint16_t *)y + r * y_stride;
            for (int64_t n = 0; n < N; n++)
                row[n] = f32_to_bf16(bf16_to_f32(row[n]) + bf16_to_f32(((const uint16_t *)bias)[n]));
        } else {
            float *row = (float *)y + r * y_stride;
            for (int64_t n = 0; n < N; n++) row[n] += ((const float *)bias)[n];
        }
    }
}

/* Linear `j` (0 qkv, 1 o, 2 gate_up, 3 down) of a layer: y [rows, N] = x [rows, K] W^T (+ bias), W as the layer's
 * weights give it: dense bf16 (format -1: the GEMV, bf16 rows or fp32 rows) or quantized (0 q4, 1 q8:
 * kernels/cpu/quant.c). x rows are K elements apart, y rows N. */
static int linear(const void *const *w, const int32_t *formats, int j, const void *x, void *y, int64_t rows, int64_t N,
                  int64_t K, int is_bf16) {
    static const int weight_at[4] = {1, 2, 4, 5};
    const void *W = w[weight_at[j]];
    const void *bias = w[6 + j];
    if (formats[j] < 0 && is_bf16) return gemv_rows_bf16(x, K, W, y, N, rows, N, K, bias);   /* the bias fused */
    const int status = formats[j] < 0
                           ? gemv_rows_bf16w_f32x(x, K, W, y, N, rows, N, K)
                           : quant_matmul(x, K, W, (const uint16_t *)w[10 + 2 * j], (const uint16_t *)w[11 + 2 * j],
                                          formats[j], y, N, rows, N, K, is_bf16);
    if (status) return status;
    add_bias(y, N, bias, rows, N, is_bf16);
    return 0;
}

int decode_layers(void *h, void *residual, const void *const *weights, const int32_t *formats, void *const *pools,
                  int64_t num_layers, int64_t rows, int64_t hidden, int num_heads, int num_kv_heads, int head_dim,
                  int64_t intermediate, float eps, float scale, const int64_t *positions, const int64_t *slots,
                  const int32_t *tables, int64_t table_stride, int64_t table_width, const int32_t *seq_lens,
                  int64_t num_blocks, int block_size, const float *cos_sin, int64_t num_positions, int is_neox,
                  void *scratch, int is_bf16, const int32_t *windows, const int32_t *runs, int num_runs) {
    const int64_t q_size = (int64_t)num_heads * head_dim, kv_size = (int64_t)num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, inter2 = 2 * intermediate, elem = is_bf16 ? 2 : 4;
    char *normed = scratch, *qkv = normed + rows * hidden * elem, *attn = qkv + rows * qkv_size * elem;
    char *gate_up = attn + rows * q_size * elem, *act = gate_up + rows * inter2 * elem;
    char *out = act + rows * intermediate * elem;
    int status;
    for (int64_t i = 0; i < num_layers; i++) {
        const void *const *w = weights + LAYER_POINTERS * i;
        const int32_t *f = formats + 4 * i;
        void *k_pool = pools[2 * i], *v_pool = pools[2 * i + 1];
        if (i == 0) {
            memcpy(residual, h, (size_t)(rows * hidden * elem));
            status = rms_norm(h, hidden, 0, 0, w[0], normed, hidden, rows, (int)hidden, eps, is_bf16);
        } else {
            status = rms_norm(h, hidden, residual, hidden, w[0], normed, hidden, rows, (int)hidden, eps, is_bf16);
        }
        if (status) return status;
        if ((status = linear(w, f, 0, normed, qkv, rows, qkv_size, hidden, is_bf16))) return status;
        if ((status = rotary_inplace(qkv, qkv_size, rows, num_heads, head_dim, positions, cos_sin, num_positions,
                                     is_neox, is_bf16)))
            return status;
        if ((status = append_kv(qkv + q_size * elem, qkv_size, qkv + (q_size + kv_size) * elem, qkv_size, k_pool,
                                v_pool, num_blocks * block_size, slots, -1, rows, num_kv_heads, head_dim, positions,
                                cos_sin, num_positions, is_neox, is_bf16)))
            return status;
        if ((status = paged_decode_runs(qkv, qkv_size, k_pool, v_pool, tables, table_stride, table_width, seq_lens,
                                        runs, num_runs, attn, (int)rows, num_heads, num_kv_heads, head_dim, block_size,
                                        num_blocks, scale, is_bf16, windows ? windows[i] : 0, 0.0f, NULL)))
            return status;
        if ((status = linear(w, f, 1, attn, out, rows, hidden, q_size, is_bf16))) return status;
        if ((status = rms_norm(out, hidden, residual, hidden, w[3], normed, hidden, rows, (int)hidden, eps, is_bf16)))
            return status;
        if ((status = linear(w, f, 2, normed, gate_up, rows, inter2, hidden, is_bf16))) return status;
        if ((status = silu_and_mul(gate_up, inter2, act, intermediate, rows, intermediate, is_bf16))) return status;
        if ((status = linear(w, f, 3, act, h, rows, hidden, intermediate, is_bf16))) return status;
    }
    return rms_norm(h, hidden, residual, hidden, weights[LAYER_POINTERS * num_layers], h, hidden, rows, (int)hidden,
                    eps, is_bf16);
}
