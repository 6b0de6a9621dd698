// Sixteen-lane bf16 helpers shared by cpu_kernels.cpp and gemm.cpp (AVX512-BF16 builds only).
#pragma once
#include "kernels.h"

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
inline __m512 exp16(__m512 x) {  // exp_approx, sixteen lanes
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// silu(gate) * up with torch's bf16 roundings: the activation is rounded before it multiplies
// up (the caller rounds the product when it stores it). x / (1 + e^-x) takes a refined
// reciprocal estimate: a division is the slowest instruction here, and one Newton step is
// exact to well below bf16's precision.
inline __m512 silu_mul16(__m512 gate, __m512 up) {
    const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate)));
    __m512 inv = _mm512_rcp14_ps(den);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.0f)));
    return _mm512_mul_ps(rnd16(_mm512_mul_ps(gate, inv)), up);
}
}  // namespace kvfence_simd
#endif
