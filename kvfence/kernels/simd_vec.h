// One vector type for the element-wise kernels (add + RMSNorm, RoPE, SiLU * up in
// cpu_kernels.cpp), so each is written once for both SIMD builds: `V`, sixteen fp32 lanes, held
// in one register on AVX512-BF16 builds and in two on AVX2 + FMA builds.
//
// Sixteen lanes on both, with the same steps per lane (the lane helpers of simd_bf16.h and
// simd_avx2.h follow scalar_math.h step for step) and the same reduction tree, make an AVX2
// machine and an AVX-512 machine compute the same bits in these kernels, and a vector lane the
// same bits as the scalar tail. tests/unit/test_kernel_isas.py loads both builds on an AVX-512
// machine and compares them.
#pragma once
#include "simd_avx2.h"
#include "simd_bf16.h"

#if defined(__AVX512BF16__) || defined(KVFENCE_AVX2)
#define KVFENCE_VEC 1

namespace kvfence_vec {

constexpr int kLanes = 16;

// lanes 0-3 + 4-7 of an eight-lane sum, then pairs: the tree both builds end their sums with
inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

#if defined(__AVX512BF16__)
struct V {
    __m512 v;
};
inline V splat(float x) { return {_mm512_set1_ps(x)}; }
inline V load(const bf16_t* p) { return {kvfence_simd::ld16(p)}; }
inline V load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(bf16_t* p, V a) { kvfence_simd::st16(p, a.v); }
inline void store(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline V operator+(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V operator-(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V operator*(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V rnd(V a) { return {kvfence_simd::rnd16(a.v)}; }
inline V silu_mul(V gate, V up) { return {kvfence_simd::silu_mul16(gate.v, up.v)}; }
inline float sum(V a) {
    return hsum8(_mm256_add_ps(_mm512_castps512_ps256(a.v),
                               _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1))));
}
#else
struct V {
    __m256 lo, hi;  // lanes 0-7, 8-15
};
inline V splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V load(const bf16_t* p) { return {kvfence_avx2::ld8(p), kvfence_avx2::ld8(p + 8)}; }
inline V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(bf16_t* p, V a) { kvfence_avx2::st8(p, a.lo), kvfence_avx2::st8(p + 8, a.hi); }
inline void store(float* p, V a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline V operator+(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V operator-(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V operator*(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V fma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V rnd(V a) { return {kvfence_avx2::rnd8(a.lo), kvfence_avx2::rnd8(a.hi)}; }
inline V silu_mul(V gate, V up) {
    return {kvfence_avx2::silu_mul8(gate.lo, up.lo), kvfence_avx2::silu_mul8(gate.hi, up.hi)};
}
inline float sum(V a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
#endif

inline V zero() { return splat(0.0f); }

}  // namespace kvfence_vec
#endif
