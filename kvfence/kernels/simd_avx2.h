// Eight-lane bf16 helpers for CPUs with AVX2 + FMA but no AVX512-BF16 (the attention, gemm.cpp,
// qgemm.cpp, and simd_vec.h's vectors). Each one takes the same steps as its scalar twin in
// scalar_math.h and its sixteen-lane twin in simd_bf16.h (the same rounding, NaN kept; exp and
// SiLU with separate multiplies and adds, as the scalar code compiles without contraction), so
// a vector lane and a scalar tail agree bit for bit, on either build.
#pragma once
#include "scalar_math.h"

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVFENCE_AVX2 1

namespace kvfence_avx2 {

inline __m256 ld8(const bf16_t* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// Eight uint32 holding bf16 pairs (first in the low half, as the matmul's panels and the KV
// pool's pages lie) as fp32: the first of each pair (one shift), the second (one AND)
inline __m256 pair_lo(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 pair_hi(__m256i pairs) {
    return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xFFFF0000u))));
}

// from_f<bf16_t> on eight lanes, as 32-bit lanes holding the bf16 in their low half
inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

inline void st8(bf16_t* p, __m256 v) {
    const __m256i b = bf16_bits8(v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// rnd<bf16_t>: v rounded through bf16, back as fp32
inline __m256 rnd8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }

// exp_approx: max/min operands ordered so a NaN comes through as std::max/min pass it
inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
    x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                                   _mm256_mul_ps(n, _mm256_set1_ps(1.42860682030941723212e-6f)));
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    for (const float c : {1.0f / 720.0f, 1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// silu_mul_one<bf16_t>: rnd(gate / (1 + exp(-gate))) * up
inline __m256 silu_mul8(__m256 gate, __m256 up) {
    const __m256 neg = _mm256_xor_ps(gate, _mm256_set1_ps(-0.0f));
    const __m256 act = _mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(neg)));
    return _mm256_mul_ps(rnd8(act), up);
}

}  // namespace kvfence_avx2
#endif
