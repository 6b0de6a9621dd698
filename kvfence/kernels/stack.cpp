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
//
// With native weights (a layer's `native` set) the four matmuls are qgemm.cpp's over GGUF
// blocks instead, each given its packed size: qgemm checks the call's shape against the
// packing's header and refuses a mismatch, which stops the stack (error kind 5).
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace {
constexpr int kBf16 = 1;  // the kernels' dtype code
}

extern "C" {

// The ctypes mirrors of these are in kvfence/kernels/__init__.py: keep the two in step.
struct KvStackLayer {          // one layer: norms [hidden], matmul weights packed (gemm.cpp or qgemm.cpp)
    const bf16_t* attn_norm;
    const void* qkv;           // [(heads + 2 kv_heads) * head_dim, hidden]
    const void* o;             // [hidden, heads * head_dim]
    const bf16_t* ffn_norm;
    const void* gate_up;       // gated panels of gate and up [inter, hidden]
    const void* down;          // [hidden, inter]
    int64_t native;            // 1: the four are qgemm.cpp packings of these many bytes
    int64_t qkv_bytes, o_bytes, gate_up_bytes, down_bytes;
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
    float* h_last;             // [num_logits, hidden] the last layer's logits rows (residual)
    bf16_t* attn_last;         // [num_logits, heads * head_dim]
};

// y = x . W^T (swiglu: silu(x . gate^T) * (x . up^T)) through the layer's kind of weights;
// 0, or the native matmul's refusal
static int matmul(const KvStackLayer& L, const void* w, int64_t bytes, bool swiglu, const bf16_t* x, int64_t ldx, bf16_t* y,
           int64_t ldy, int64_t m, int64_t n, int64_t k, int nt) {
    const uint8_t* q = static_cast<const uint8_t*>(w);
    const uint32_t* p = static_cast<const uint32_t*>(w);
    if (L.native)
        return swiglu ? kvfence_qgemm_swiglu(x, ldx, q, bytes, y, ldy, m, n, k, nt)
                      : kvfence_qgemm(x, ldx, q, bytes, y, ldy, m, n, k, nt);
    return swiglu ? kvfence_gemm_swiglu(x, ldx, p, y, ldy, m, n, k, nt) : kvfence_gemm(x, ldx, p, y, ldy, m, n, k, nt);
}

// h [n, hidden]: the embeddings in, the residual stream after, float32 (rows past the last
// layer's KV write are not updated; kvfence_add_rms_norm_f32res says why float32). out [num_logits, hidden]: the final-normed logits rows.
// Returns 0; else -1 with err = {1 (KV store), 2 (attention), 3 (a logits row outside the
// batch), 4 (no bf16 or native matmul in this build) or 5 (a native matmul refused its
// weight's shape: which one, 0-3, in place of the code), layer, the kernel's code or the row's index}.
int64_t kvfence_decoder_stack(const KvStackLayer* layers, const KvStackShape* s, const KvStackBatch* b,
                              const KvStackWork* w, float* h, const bf16_t* final_norm, bf16_t* out, int64_t* err,
                              int nt) {
    const int64_t hidden = s->hidden, q_size = s->heads * s->head_dim, kv_size = s->kv_heads * s->head_dim;
    const int64_t qkv_cols = q_size + 2 * kv_size, head_stride = b->num_slots * s->head_dim;
    const int heads = int(s->heads), kv_heads = int(s->kv_heads), dim = int(s->head_dim), ps = int(s->page_size);
    int64_t n = b->n;
    if (s->num_layers > 0 && !(layers[0].native ? kvfence_qgemm_supported() : kvfence_gemm_supported())) {
        err[0] = 4, err[1] = 0, err[2] = 0;
        return -1;
    }
    kvfence_add_rms_norm_f32res(h, nullptr, layers[0].attn_norm, w->x, n, hidden, s->eps, nt);
    for (int64_t li = 0; li < s->num_layers; ++li) {
        const KvStackLayer& L = layers[li];
        bf16_t* k_cache = b->kv + li * 2 * kv_heads * head_stride;
        bf16_t* v_cache = k_cache + kv_heads * head_stride;
        if (matmul(L, L.qkv, L.qkv_bytes, false, w->x, hidden, w->qkv, qkv_cols, n, qkv_cols, hidden, nt)) {
            err[0] = 5, err[1] = li, err[2] = 0;
            return -1;
        }
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
        float* res = h;
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
                std::memcpy(w->h_last + i * hidden, h + r * hidden, sizeof(float) * hidden);
                std::memcpy(w->attn_last + i * q_size, w->attn + r * q_size, sizeof(bf16_t) * q_size);
            }
            res = w->h_last, attn = w->attn_last, n = b->num_logits;
            if (n == 0) return 0;
        }
        if (matmul(L, L.o, L.o_bytes, false, attn, q_size, w->proj, hidden, n, hidden, q_size, nt)) {
            err[0] = 5, err[1] = li, err[2] = 1;
            return -1;
        }
        kvfence_add_rms_norm_f32res(res, w->proj, L.ffn_norm, w->x, n, hidden, s->eps, nt);
        if (matmul(L, L.gate_up, L.gate_up_bytes, true, w->x, hidden, w->act, s->inter, n, s->inter, hidden, nt)) {
            err[0] = 5, err[1] = li, err[2] = 2;
            return -1;
        }
        if (matmul(L, L.down, L.down_bytes, false, w->act, s->inter, w->proj, hidden, n, hidden, s->inter, nt)) {
            err[0] = 5, err[1] = li, err[2] = 3;
            return -1;
        }
        if (last)
            kvfence_add_rms_norm_f32res(res, w->proj, final_norm, out, n, hidden, s->eps, nt);
        else
            kvfence_add_rms_norm_f32res(res, w->proj, layers[li + 1].attn_norm, w->x, n, hidden, s->eps, nt);
    }
    return 0;
}

}  // extern "C"
