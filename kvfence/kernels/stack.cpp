// The whole bf16 decoder stack in one call: per layer RMSNorm, qkv matmul, RoPE + KV store,
// paged attention, o matmul, residual + RMSNorm, gated matmul (SiLU), down matmul, residual.
//
// Why: a decode step runs ~240 small kernels; called one by one from Python each costs a
// wrapper, an allocation and a trip through the interpreter with the caches cold, ~4 ms of a
// ~44 ms step. This is the same sequence as LlamaModel._layers_fused (model/llama.py), through
// the same entry points, so its output is bit-identical to it (tests/unit/test_kernels.py).
// The index checks live where they did: kvfence_rope_store checks every slot and position,
// kvfence_paged_attention every page and row, before touching the pool; an error stops the
// stack and says which layer and which token or row.
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace {
constexpr int kBf16 = 1;  // the kernels' dtype code
}

extern "C" {

// The ctypes mirrors of these are in kvfence/kernels/__init__.py: keep the two in step.
struct KvStackLayer {          // one layer: norms [hidden], matmul weights packed (gemm.cpp)
    const bf16_t* attn_norm;
    const uint32_t* qkv;       // [(heads + 2 kv_heads) * head_dim, hidden]
    const uint32_t* o;         // [hidden, heads * head_dim]
    const bf16_t* ffn_norm;
    const uint32_t* gate_up;   // gated panels of gate and up [inter, hidden]
    const uint32_t* down;      // [hidden, inter]
};

struct KvStackShape {
    int64_t hidden, heads, kv_heads, head_dim, inter, num_layers;
    float eps, scale;
    int64_t page_size;
};

struct KvStackBatch {
    int64_t n;                                   // tokens in the flat batch
    const int64_t* positions;                    // [n]
    const int64_t* write_slots;                  // [n]
    const bf16_t* cos;                           // [num_positions, head_dim]
    const bf16_t* sin;
    int64_t num_positions;
    bf16_t* kv;                                  // [layers, 2, kv_heads, slots, head_dim]
    int64_t num_slots;
    const int64_t* pages;                        // [rows, max_pages]
    int64_t max_pages;
    const int64_t* q_start;                      // [rows] each
    const int64_t* q_len;
    const int64_t* kv_len;
    int64_t rows;
    const int64_t* logits_rows;                  // [num_logits] rows of the batch whose logits are wanted
    int64_t num_logits;
};

struct KvStackWork {           // scratch, each with room for n rows
    bf16_t* x;                 // [n, hidden] normed input of a matmul
    bf16_t* qkv;               // [n, (heads + 2 kv_heads) * head_dim]
    bf16_t* attn;              // [n, heads * head_dim]
    bf16_t* proj;              // [n, hidden]
    bf16_t* act;               // [n, inter]
    bf16_t* h_last;            // [num_logits, hidden] the last layer's logits rows
    bf16_t* attn_last;         // [num_logits, heads * head_dim]
};

// h [n, hidden]: the embeddings in, the residual stream after (rows past the last layer's KV
// write are not updated). out [num_logits, hidden]: the final-normed logits rows.
// Returns 0; else -1 with err = {1 (KV store), 2 (attention), 3 (a logits row outside the
// batch) or 4 (no bf16 matmul in this build), layer, the kernel's code or the row's index}.
int64_t kvfence_decoder_stack(const KvStackLayer* layers, const KvStackShape* s, const KvStackBatch* b,
                              const KvStackWork* w, bf16_t* h, const bf16_t* final_norm, bf16_t* out, int64_t* err,
                              int nt) {
    const int64_t hidden = s->hidden, q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t qkv_cols = q_size + 2 * kv_size, head_stride = b->num_slots * s->head_dim;
    const int heads = int(s->heads), kv_heads = int(s->kv_heads), dim = int(s->head_dim), ps = int(s->page_size);
    int64_t n = b->n;
    if (!kvfence_gemm_supported()) {
        err[0] = 4, err[1] = 0, err[2] = 0;
        return -1;
    }
    kvfence_add_rms_norm(kBf16, h, nullptr, layers[0].attn_norm, w->x, n, hidden, s->eps, nt);
    for (int64_t li = 0; li < s->num_layers; ++li) {
        const KvStackLayer& L = layers[li];
        bf16_t* k_cache = b->kv + li * 2 * kv_heads * head_stride;
        bf16_t* v_cache = k_cache + kv_heads * head_stride;
        kvfence_gemm(w->x, hidden, L.qkv, w->qkv, qkv_cols, n, qkv_cols, hidden, nt);
        int64_t rc = kvfence_rope_store(kBf16, w->qkv, n, qkv_cols, heads, kv_heads, dim, b->positions,
                                        b->num_positions, b->cos, b->sin, k_cache, v_cache, head_stride,
                                        b->write_slots, ps, nt);
        if (rc != 0) {
            err[0] = 1, err[1] = li, err[2] = rc;
            return -1;
        }
        rc = kvfence_paged_attention(kBf16, w->qkv, qkv_cols, k_cache, v_cache, head_stride, b->num_slots / ps,
                                     b->pages, b->max_pages, b->q_start, b->q_len, b->kv_len, b->rows, n, w->attn,
                                     q_size, heads, kv_heads, dim, ps, s->scale, nt);
        if (rc != 0) {
            err[0] = 2, err[1] = li, err[2] = rc;
            return -1;
        }
        bf16_t* res = h;
        const bf16_t* attn = w->attn;
        const bool last = li + 1 == s->num_layers;
        if (last) {  // past the last KV write, only the logits rows matter
            for (int64_t i = 0; i < b->num_logits; ++i)
                if (b->logits_rows[i] < 0 || b->logits_rows[i] >= n) {
                    err[0] = 3, err[1] = li, err[2] = i;
                    return -1;
                }
            for (int64_t i = 0; i < b->num_logits; ++i) {
                const int64_t r = b->logits_rows[i];
                std::memcpy(w->h_last + i * hidden, h + r * hidden, sizeof(bf16_t) * hidden);
                std::memcpy(w->attn_last + i * q_size, w->attn + r * q_size, sizeof(bf16_t) * q_size);
            }
            res = w->h_last, attn = w->attn_last, n = b->num_logits;
            if (n == 0) return 0;
        }
        kvfence_gemm(attn, q_size, L.o, w->proj, hidden, n, hidden, q_size, nt);
        kvfence_add_rms_norm(kBf16, res, w->proj, L.ffn_norm, w->x, n, hidden, s->eps, nt);
        kvfence_gemm_swiglu(w->x, hidden, L.gate_up, w->act, s->inter, n, s->inter, hidden, nt);
        kvfence_gemm(w->act, s->inter, L.down, w->proj, hidden, n, hidden, s->inter, nt);
        if (last)
            kvfence_add_rms_norm(kBf16, res, w->proj, final_norm, out, n, hidden, s->eps, nt);
        else
            kvfence_add_rms_norm(kBf16, res, w->proj, layers[li + 1].attn_norm, w->x, n, hidden, s->eps, nt);
    }
    return 0;
}

}  // extern "C"
