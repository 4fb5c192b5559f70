/* A whole decode step of 1-8 sequences through a dense Llama-family model in bf16: every decoder layer and the
 * final norm in one call, the same kernels in the same order as the eager layers call them one by one.
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
 * weights: 10 pointers a layer (input norm, Wqkv [q + 2 kv, hidden], Wo [hidden, q], post-attention norm,
 * Wgate_up [2 I, hidden], Wdown [hidden, I], then the biases of the four linears or NULL: Qwen2 has the qkv one)
 * and the final norm's weight last; a bias is added to the product's bf16 output and rounded again, as
 * `y.add_(bias)`; pools: K and V of each layer
 * ([Hkv, num_blocks, block_size, D] contiguous). scratch: bf16, rows x (hidden + (q + 2 kv) + q + 3 I + hidden)
 * elements. h [rows, hidden]: the embedding rows in, the final normed rows out; residual [rows, hidden] scratch.
 * Row r: positions[r], slots[r], its block table at tables + r * table_stride (table_width entries), seq_lens[r].
 * Returns 0, or the first failing kernel's code (-1 shapes past its limits, -2 a position, slot, length or table
 * entry out of range), as soon as one fails; each kernel checks its arguments before it writes anything.
 */

#include <stdint.h>

#include "common.h"

int rms_norm(const void *x, int64_t x_stride, void *residual, int64_t res_stride, const void *weight, void *out,
             int64_t out_stride, int64_t rows, int hidden, float eps, int is_bf16);
int gemv_rows_bf16(const void *x, int64_t x_stride, const void *w, void *y, int64_t y_stride, int64_t M, int64_t N,
                   int64_t K);
int rotary_inplace(void *x, int64_t stride, int64_t num_tokens, int num_heads, int head_dim,
                   const int64_t *positions, const float *cos_sin, int64_t num_positions, int is_neox, int is_bf16);
int append_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_pool, void *v_pool,
              int64_t num_slots, const int64_t *slots, int64_t pad_slot, int64_t num_tokens, int num_kv_heads,
              int head_dim, const int64_t *positions, const float *cos_sin, int64_t num_positions, int is_neox,
              int is_bf16);
int paged_decode(const void *q, int64_t q_stride, const void *k_pool, const void *v_pool,
                 const int32_t *block_tables, int64_t table_stride, int64_t table_width, const int32_t *seq_lens,
                 void *out, int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size,
                 int64_t num_blocks, float scale, int is_bf16);
int silu_and_mul(const void *x, int64_t x_stride, void *out, int64_t out_stride, int64_t rows, int64_t d,
                 int is_bf16);

/* y [rows, N] (rows y_stride apart) += bias [N], in bf16 (one rounding of the fp32 sum, as torch's add_). */
static void add_bias(uint16_t *y, int64_t y_stride, const uint16_t *bias, int64_t rows, int64_t N) {
    if (!bias) return;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t n = 0; n < N; n++)
            y[r * y_stride + n] = f32_to_bf16(bf16_to_f32(y[r * y_stride + n]) + bf16_to_f32(bias[n]));
}

int decode_layers_bf16(uint16_t *h, uint16_t *residual, const void *const *weights, void *const *pools,
                       int64_t num_layers, int64_t rows, int64_t hidden, int num_heads, int num_kv_heads, int head_dim,
                       int64_t intermediate, float eps, float scale, const int64_t *positions, const int64_t *slots,
                       const int32_t *tables, int64_t table_stride, int64_t table_width, const int32_t *seq_lens,
                       int64_t num_blocks, int block_size, const float *cos_sin, int64_t num_positions, int is_neox,
                       uint16_t *scratch) {
    const int64_t q_size = (int64_t)num_heads * head_dim, kv_size = (int64_t)num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, inter2 = 2 * intermediate;
    uint16_t *normed = scratch, *qkv = normed + rows * hidden, *attn = qkv + rows * qkv_size;
    uint16_t *gate_up = attn + rows * q_size, *act = gate_up + rows * inter2, *out = act + rows * intermediate;
    int status;
    for (int64_t i = 0; i < num_layers; i++) {
        const void *const *w = weights + 10 * i;
        void *k_pool = pools[2 * i], *v_pool = pools[2 * i + 1];
        if (i == 0) {
            for (int64_t d = 0; d < rows * hidden; d++) residual[d] = h[d];
            status = rms_norm(h, hidden, 0, 0, w[0], normed, hidden, rows, (int)hidden, eps, 1);
        } else {
            status = rms_norm(h, hidden, residual, hidden, w[0], normed, hidden, rows, (int)hidden, eps, 1);
        }
        if (status) return status;
        if ((status = gemv_rows_bf16(normed, hidden, w[1], qkv, qkv_size, rows, qkv_size, hidden))) return status;
        add_bias(qkv, qkv_size, w[6], rows, qkv_size);
        if ((status = rotary_inplace(qkv, qkv_size, rows, num_heads, head_dim, positions, cos_sin, num_positions,
                                     is_neox, 1)))
            return status;
        if ((status = append_kv(qkv + q_size, qkv_size, qkv + q_size + kv_size, qkv_size, k_pool, v_pool,
                                num_blocks * block_size, slots, -1, rows, num_kv_heads, head_dim, positions, cos_sin,
                                num_positions, is_neox, 1)))
            return status;
        if ((status = paged_decode(qkv, qkv_size, k_pool, v_pool, tables, table_stride, table_width, seq_lens, attn,
                                   (int)rows, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, 1)))
            return status;
        if ((status = gemv_rows_bf16(attn, q_size, w[2], out, hidden, rows, hidden, q_size))) return status;
        add_bias(out, hidden, w[7], rows, hidden);
        if ((status = rms_norm(out, hidden, residual, hidden, w[3], normed, hidden, rows, (int)hidden, eps, 1)))
            return status;
        if ((status = gemv_rows_bf16(normed, hidden, w[4], gate_up, inter2, rows, inter2, hidden))) return status;
        add_bias(gate_up, inter2, w[8], rows, inter2);
        if ((status = silu_and_mul(gate_up, inter2, act, intermediate, rows, intermediate, 1))) return status;
        if ((status = gemv_rows_bf16(act, intermediate, w[5], h, hidden, rows, hidden, intermediate))) return status;
        add_bias(h, hidden, w[9], rows, hidden);
    }
    return rms_norm(h, hidden, residual, hidden, weights[10 * num_layers], h, hidden, rows, (int)hidden, eps, 1);
}
