// Sixteen-lane bf16 helpers shared by cpu_kernels.cpp, gemm.cpp, qgemm.cpp and simd_vec.h
// (AVX512-BF16 builds only).
#pragma once
#include "scalar_math.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace kvfence_simd {

// Sixteen bf16 lanes at a time with the CPU's own conversion (vcvtneps2bf16: round to
// nearest even, NaN kept): a portable bit-twiddling rounding costs ~6 instructions
// a lane, which made the element-wise kernels instruction-bound.
inline __m512 ld16(const bf16_t* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m256i bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
inline void st16(bf16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16x16(v)); }
inline __m512 rnd16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16(v)), 16));
}
// exp_approx on sixteen lanes, step for step (separate multiplies and adds, as the scalar code
// compiles without contraction; max/min operands ordered so a NaN comes through as std::max/min
// pass it): a lane gives the bits of the scalar code and of simd_avx2.h's exp8.
inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
    x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f)));
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
        p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// silu_mul_one<bf16_t>: rnd(gate / (1 + exp(-gate))) * up, with torch's bf16 rounding of the
// activation before it multiplies up (the caller rounds the product when it stores it). A true
// division, not a refined reciprocal estimate: AVX2 has no 14-bit estimate to match, and the
// same bits on every build let the gated matmul's epilogue split a row anywhere.
inline __m512 silu_mul16(__m512 gate, __m512 up) {
    const __m512 neg = _mm512_xor_ps(gate, _mm512_set1_ps(-0.0f));
    const __m512 act = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(neg)));
    return _mm512_mul_ps(rnd16(act), up);
}
}  // namespace kvfence_simd
#endif
