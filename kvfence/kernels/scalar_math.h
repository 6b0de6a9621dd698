// Scalar bf16 conversions and exp shared by cpu_kernels.cpp and gemm.cpp: one copy, so the
// gated matmul's epilogue rounds and activates exactly as kvfence_silu_mul does (the two are
// held bit for bit to each other by tests/unit/test_kernels.py).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace kvfence_scalar {

inline float to_f(float x) { return x; }
inline float to_f(bf16_t x) {
    uint32_t u = uint32_t(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

template <typename T> inline T from_f(float f);
template <> inline float from_f<float>(float f) { return f; }
template <> inline bf16_t from_f<bf16_t>(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t((u >> 16) | 0x40u);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                        // nearest, ties to even
    return bf16_t(u >> 16);
}

// Round through T: reproduces the intermediate roundings torch makes in bf16 (identity in fp32).
template <typename T> inline float rnd(float f) { return to_f(from_f<T>(f)); }

// exp(x) for x <= 0 (softmax after subtracting the max) and for SiLU; ~2 ulp, vectorizable.
inline float exp_approx(float x) {
    x = std::max(x, -87.0f);
    x = std::min(x, 88.0f);
    const float n = std::nearbyint(x * 1.44269504088896341f);
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t e = int32_t(n) + 127;
    uint32_t bits = uint32_t(e) << 23;
    float scale;
    std::memcpy(&scale, &bits, 4);
    return p * scale;
}

// silu(gate) * up with torch's roundings in T, before the product's own rounding to T
template <typename T> inline float silu_mul_one(float gate, float up) {
    return rnd<T>(gate / (1.0f + exp_approx(-gate))) * up;
}

}  // namespace kvfence_scalar
