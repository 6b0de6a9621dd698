// The C entry points of kvfence's CPU kernels, one declaration each: cpu_kernels.cpp, gemm.cpp
// and qgemm.cpp define them, stack.cpp calls them, and build.py's ctypes signatures mirror them.
// Every source includes this file, so a definition that drifts from it fails to compile.
#pragma once
#include <cstdint>

typedef uint16_t bf16_t;

extern "C" {
// cpu_kernels.cpp (dtype codes: 0 = float32, 1 = bfloat16)
int kvfence_kernels_version();
void kvfence_argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t* out, int nt);
int64_t kvfence_apply_token_mask(float* x, int64_t x_rows, int64_t cols, const int64_t* rows, int64_t n,
                                 const uint32_t* mask, int64_t words, int nt);
void kvfence_add_rms_norm(int dtype, void* h, const void* delta, const void* w, void* out, int64_t n, int64_t dim,
                          float eps, int nt);
void kvfence_add_rms_norm_f32res(float* h, const bf16_t* delta, const bf16_t* w, bf16_t* out, int64_t n,
                                  int64_t dim, float eps, int nt);
int64_t kvfence_rope_store(int dtype, void* qkv, int64_t n, int64_t row_stride, int heads, int kv_heads, int dim,
                           const int64_t* positions, int64_t num_positions, const void* cos, const void* sin,
                           void* k_cache, void* v_cache, int64_t head_stride, const int64_t* slots, int page_size,
                           int nt);
void kvfence_silu_mul(int dtype, const void* gu, void* out, int64_t n, int64_t inter, int nt);
int64_t kvfence_paged_attention(int dtype, const void* q, int64_t q_stride, const void* k_cache,
                                const void* v_cache, int64_t head_stride, int64_t num_pages, const int64_t* pages,
                                int64_t max_pages, const int64_t* q_start, const int64_t* q_len,
                                const int64_t* kv_len, int64_t rows, int64_t n_tokens, void* out,
                                int64_t out_stride, int heads, int kv_heads, int dim, int page_size, float scale,
                                int nt);

// gemm.cpp
int kvfence_gemm_supported();
int64_t kvfence_gemm_packed_size(int64_t n, int64_t k);
void kvfence_gemm_pack(const bf16_t* weight, int64_t n, int64_t k, uint32_t* packed);
int64_t kvfence_gemm_gated_packed_size(int64_t inter, int64_t k);
void kvfence_gemm_pack_gated(const bf16_t* gate, const bf16_t* up, int64_t inter, int64_t k, uint32_t* packed);
int kvfence_gemm(const bf16_t* x, int64_t ldx, const uint32_t* packed, bf16_t* y, int64_t ldy, int64_t m, int64_t n,
                 int64_t k, int nt);
int kvfence_gemm_f32(const bf16_t* x, int64_t ldx, const uint32_t* packed, float* y, int64_t ldy, int64_t m,
                     int64_t n, int64_t k, int nt);
int kvfence_gemm_swiglu(const bf16_t* x, int64_t ldx, const uint32_t* packed, bf16_t* y, int64_t ldy, int64_t m,
                        int64_t inter, int64_t k, int nt);

// qgemm.cpp (native GGUF weights; type: the GGUF's ggml type id, 2 = Q4_0, 3 = Q4_1, 8 = Q8_0)
int kvfence_qgemm_supported();
int64_t kvfence_qpack_size(int type, int64_t n, int64_t k, int gated);
int kvfence_qpack(int type, const uint8_t* src, const uint8_t* up, int64_t src_bytes, int64_t n, int64_t k,
                  uint8_t* out, int64_t out_bytes);
int kvfence_qgemm(const bf16_t* x, int64_t ldx, const uint8_t* packed, int64_t bytes, bf16_t* y, int64_t ldy,
                  int64_t m, int64_t n, int64_t k, int nt);
int kvfence_qgemm_f32(const bf16_t* x, int64_t ldx, const uint8_t* packed, int64_t bytes, float* y, int64_t ldy,
                      int64_t m, int64_t n, int64_t k, int nt);
int kvfence_qgemm_swiglu(const bf16_t* x, int64_t ldx, const uint8_t* packed, int64_t bytes, bf16_t* y,
                         int64_t ldy, int64_t m, int64_t inter, int64_t k, int nt);
}
