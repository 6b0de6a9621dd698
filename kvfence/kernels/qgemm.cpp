// Native GGUF weights: y[M][N] = x[M][K] . W[N][K]^T with W kept in its GGUF blocks (Q4_0,
// Q4_1, Q8_0: 32 weights and fp16 scales per block), never dequantized, on CPUs with
// AVX512-VNNI (vpdpbusd: 16 int32 lanes, each adding four u8 x s8 products) and, in the second
// half of this file, on CPUs with AVX2 (vpmaddubsw + vpmaddwd: the same integer sums).
//
// Why: batch-1 decode reads every weight once per token, so its speed is the bytes read.
// Q4_1 is 0.625 bytes a weight and Q8_0 1.0625, against bf16's 2 (this model: 96 MB a token
// native, 269 MB bf16).
//
// Activations are quantized per row and per 32-block to int8 as llama.cpp's Q8_1 does:
// d = max|x| / 127, q = round(x / d), and the block's integer sum S = sum q. Per block then
//   Q4_1 (w = dw * u + mw, u the nibble 0..15):   dw * d * sum(u q) + mw * d * S
//   Q8_0 (w = dw * v, v int8, stored as u = v + 128): dw * d * (sum(u q) - 128 S)
// The nibbles (or the biased int8) are vpdpbusd's unsigned operand and the activations its
// signed one, broadcast from memory. Q4_0 (w = dw * (u - 8)) is Q4_1 with mw = -8 dw, packed so.
//
// Packed layout (made once at load from the GGUF's raw blocks, kvfence_qpack): a 64-byte
// header (magic, format, n, k, gated, size: every entry point checks the call against it), then
// panels of 32 output columns; per panel, per 32-block of k: the 32 columns' fp16 dw, then
// their fp16 mw (Q4 only), then the weights as four k-octets x two 16-column vectors, each 64
// bytes: byte 4j + b of octet t holds column j's k = 8t + b (Q8_0: one byte per weight, so
// eight k-quads of 64 bytes per vector instead). A micro-tile keeps R rows x 32 columns of
// int32 block sums and fp32 totals in registers, loads each weight vector once for its R rows
// and scales each block's sums into the totals. Gated panels (the MLP's gate and up) hold 16
// columns of gate, then the same 16 of up; the epilogue writes silu(gate) * up as gemm.cpp's.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd_avx2.h"
#include "simd_bf16.h"

namespace {
constexpr int kBlock = 32;               // weights per GGUF block
constexpr int kPanel = 32;               // output columns per panel: two vectors of 16
constexpr int kMaxRows = 6;              // rows per micro-tile: 12 int32 sums + 12 fp32 totals
constexpr uint32_t kMagic = 0x5751564bu;  // "KVQW"
constexpr int64_t kHeader = 64;

// GGUF type ids (ggml_type) and their block sizes in bytes
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;

struct Header {
    uint32_t magic, format;  // format: kQ4_1 (Q4_0 is packed as Q4_1) or kQ8_0
    int64_t n, k, gated, size;
    char pad[kHeader - 40];
};
static_assert(sizeof(Header) == kHeader, "header is 64 bytes");

inline int64_t gguf_block_bytes(int type) {
    return type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ8_0 ? 34 : 0;
}
inline bool is_q4(int format) { return format == kQ4_1; }
constexpr int64_t kMaxDim = int64_t(1) << 24;   // rows or columns of one weight; 2^24 x 2^24 x 34 B < 2^63
// bytes of one panel-block: scales, mins (Q4), weights
inline int64_t panel_block_bytes(int format) {
    return is_q4(format) ? 2 * kPanel + 2 * kPanel + kPanel * kBlock / 2 : 2 * kPanel + kPanel * kBlock;
}
inline int64_t panels_of(int64_t n, bool gated) { return gated ? (n + 15) / 16 : (n + kPanel - 1) / kPanel; }
inline int64_t packed_bytes(int format, int64_t n, int64_t k, bool gated) {
    return kHeader + panels_of(n, gated) * (k / kBlock) * panel_block_bytes(format);
}

// fp16 <-> fp32 without F16C (packing runs once; the kernel converts with vcvtph2ps)
inline float half_to_float(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  // subnormal
            float f = std::ldexp(float(man), -24);
            std::memcpy(&bits, &f, 4);
            bits |= sign;
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (man << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline uint16_t float_to_half(float f) {  // round to nearest even; |f| here is a scale, in range
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000;
    const int32_t exp = int32_t((x >> 23) & 0xFF) - 127 + 15;
    uint32_t man = x & 0x7FFFFF;
    if (exp <= 0) {  // subnormal half (or zero)
        if (exp < -10) return uint16_t(sign);
        man |= 0x800000;
        const int shift = 14 - exp;
        uint32_t h = man >> shift;
        const uint32_t rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) ++h;
        return uint16_t(sign | h);
    }
    if (exp >= 31) return uint16_t(sign | 0x7C00);
    uint32_t h = (uint32_t(exp) << 10) | (man >> 13);
    const uint32_t rem = man & 0x1FFF;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;
    return uint16_t(sign | h);
}

inline uint16_t rd16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

// one GGUF block of row `row` -> (dw, mw, 32 unsigned weights); Q8_0's biased by 128
void unpack_block(int type, const uint8_t* blk, uint16_t* dw, uint16_t* mw, uint8_t* u) {
    *dw = rd16(blk);
    if (type == kQ8_0) {
        *mw = 0;
        for (int i = 0; i < kBlock; ++i) u[i] = uint8_t(int(int8_t(blk[2 + i])) + 128);
        return;
    }
    const uint8_t* qs = blk + (type == kQ4_1 ? 4 : 2);
    *mw = type == kQ4_1 ? rd16(blk + 2) : float_to_half(-8.0f * half_to_float(*dw));
    for (int i = 0; i < 16; ++i) u[i] = qs[i] & 0x0F, u[i + 16] = qs[i] >> 4;  // ggml's nibble order
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__F16C__)
#define KV_QGEMM 1
using namespace kvfence_simd;

// The activations of one call, quantized: q [m][k] int8, per row and block d (fp32), d * S
// (fp32, the Q4_1 min term) and 128 * S (int32, Q8_0's bias).
struct QuantRows {
    std::vector<int8_t> q;
    std::vector<float> d, ds;
    std::vector<int32_t> bias;
};

void quantize_rows(const bf16_t* x, int64_t ldx, int64_t m, int64_t k, QuantRows& out, int nt) {
    const int64_t nb = k / kBlock;
    out.q.resize(size_t(m * k));
    out.d.resize(size_t(m * nb));
    out.ds.resize(size_t(m * nb));
    out.bias.resize(size_t(m * nb));
#pragma omp parallel for num_threads(nt) schedule(static) if (m * k >= (1 << 16))
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const bf16_t* src = x + r * ldx + b * kBlock;
            const __m512 v0 = ld16(src), v1 = ld16(src + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            // a NaN would become INT_MIN here and max_ps may drop it from amax: the output would be
            // finite and wrong, and the poison scrub's NaN sentinel (I7) would go quiet. Keep it NaN.
            const bool unordered = (_mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q)) != 0;
            const float d = unordered ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
            const float inv = amax > 0.0f && !unordered ? 127.0f / amax : 0.0f;
            const __m512 s = _mm512_set1_ps(inv);
            // round to nearest even, as llama.cpp's roundf up to ties (a tie is rare in bf16 x 127/amax)
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, s)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, s));
            int8_t* dst = out.q.data() + r * k + b * kBlock;
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtsepi32_epi8(q1));
            const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            out.d[size_t(r * nb + b)] = d;
            out.ds[size_t(r * nb + b)] = d * float(sum);
            out.bias[size_t(r * nb + b)] = 128 * sum;
        }
    }
}

enum class Out { Plain, SwiGLU, F32 };

template <int R, int Fmt, Out E>
inline void tile(const QuantRows& a, int64_t r0, int64_t k, const uint8_t* panel, void* y, int64_t ldy,
                 int64_t col0, const __mmask16* mask) {
    constexpr bool q4 = Fmt == kQ4_1;
    const int64_t nb = k / kBlock, pb = q4 ? 2 * kPanel * 2 + kPanel * kBlock / 2 : 2 * kPanel + kPanel * kBlock;
    __m512 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = panel + b * pb;
        const uint8_t* wq = blk + (q4 ? 4 * kPanel : 2 * kPanel);
        __m512i s[R][2];
        for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_si512();
        const int32_t* xq[R];
        for (int r = 0; r < R; ++r) xq[r] = reinterpret_cast<const int32_t*>(a.q.data() + (r0 + r) * k + b * kBlock);
        if constexpr (q4) {
            for (int t = 0; t < 4; ++t)
                for (int v = 0; v < 2; ++v) {
                    const __m512i raw = _mm512_loadu_si512(wq + (t * 2 + v) * 64);
                    const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                    for (int r = 0; r < R; ++r) {
                        s[r][v] = _mm512_dpbusd_epi32(s[r][v], lo, _mm512_set1_epi32(xq[r][2 * t]));
                        s[r][v] = _mm512_dpbusd_epi32(s[r][v], hi, _mm512_set1_epi32(xq[r][2 * t + 1]));
                    }
                }
        } else {
            for (int t = 0; t < 8; ++t)
                for (int v = 0; v < 2; ++v) {
                    const __m512i w = _mm512_loadu_si512(wq + (t * 2 + v) * 64);
                    for (int r = 0; r < R; ++r) s[r][v] = _mm512_dpbusd_epi32(s[r][v], w, _mm512_set1_epi32(xq[r][t]));
                }
        }
        for (int v = 0; v < 2; ++v) {
            const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * v)));
            if constexpr (q4) {
                const __m512 mw =
                    _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2 * kPanel + 32 * v)));
                for (int r = 0; r < R; ++r) {
                    const int64_t i = (r0 + r) * nb + b;
                    acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][v]), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[i])),
                                                acc[r][v]);
                    acc[r][v] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.ds[i]), acc[r][v]);
                }
            } else {
                for (int r = 0; r < R; ++r) {
                    const int64_t i = (r0 + r) * nb + b;
                    const __m512i sum = _mm512_sub_epi32(s[r][v], _mm512_set1_epi32(a.bias[i]));
                    acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dw, _mm512_set1_ps(a.d[i])),
                                                acc[r][v]);
                }
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        if constexpr (E == Out::F32) {
            float* out = static_cast<float*>(y) + (r0 + r) * ldy + col0;
            _mm512_mask_storeu_ps(out, mask[0], acc[r][0]);
            _mm512_mask_storeu_ps(out + 16, mask[1], acc[r][1]);
        } else if constexpr (E == Out::Plain) {
            bf16_t* out = static_cast<bf16_t*>(y) + (r0 + r) * ldy + col0;
            _mm256_mask_storeu_epi16(out, mask[0], bf16x16(acc[r][0]));
            _mm256_mask_storeu_epi16(out + 16, mask[1], bf16x16(acc[r][1]));
        } else {  // gate in vector 0, up in vector 1, each rounded to bf16 as a stored product
            bf16_t* out = static_cast<bf16_t*>(y) + (r0 + r) * ldy + col0;
            _mm256_mask_storeu_epi16(out, mask[0], bf16x16(silu_mul16(rnd16(acc[r][0]), rnd16(acc[r][1]))));
        }
    }
}

template <int Fmt, Out E>
inline void tile_rows(int rows, const QuantRows& a, int64_t r0, int64_t k, const uint8_t* panel, void* y,
                      int64_t ldy, int64_t col0, const __mmask16* mask) {
    switch (rows) {
#define KV_QTILE(n) \
    case n: tile<n, Fmt, E>(a, r0, k, panel, y, ldy, col0, mask); break;
        KV_QTILE(1) KV_QTILE(2) KV_QTILE(3) KV_QTILE(4) KV_QTILE(5) KV_QTILE(6)
#undef KV_QTILE
    }
}

inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); }

template <int Fmt, Out E>
void qgemm(const QuantRows& a, const uint8_t* body, void* y, int64_t ldy, int64_t m, int64_t n, int64_t k, int nt) {
    constexpr int cols = E == Out::SwiGLU ? 16 : kPanel;
    const int64_t panels = (n + cols - 1) / cols, pbytes = (k / kBlock) * panel_block_bytes(Fmt);
#pragma omp parallel for num_threads(nt) schedule(static) if (panels > 1 && m * n * k >= (1 << 17))
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t c0 = p * cols;
        __mmask16 mask[2] = {lanes(n - c0), E == Out::SwiGLU ? lanes(n - c0) : lanes(n - c0 - 16)};
        for (int64_t r = 0; r < m; r += kMaxRows) {
            const int rows = int(std::min<int64_t>(kMaxRows, m - r));
            tile_rows<Fmt, E>(rows, a, r, k, body + p * pbytes, y, ldy, c0, mask);
        }
    }
}

thread_local QuantRows tls_rows;  // grows to the largest call's activations and stays

#elif defined(KVFENCE_AVX2) && defined(__F16C__)
// AVX2 (no VNNI): the same packed panels, the same int8 activations and the same integer block
// sums, formed with vpmaddubsw (u8 x s8 pairs into int16) and vpmaddwd (int16 pairs into int32)
// instead of vpdpbusd. The block sums are exact integers and the fp32 steps after them are
// those of the AVX-512 path, lane for lane, so both paths give the same bits.
//   Q4: a nibble x an int8 is at most 15 x 127, a vpmaddubsw lane two of them; one block adds
//       eight such lanes per column (4 k-octets x low and high nibbles): <= 30,480, no int16
//       overflow, so a block takes one vpmaddwd per vector.
//   Q8_0: the stored u = v + 128 reaches 255 and two u x q products would saturate int16, so
//       it multiplies |v| by q carrying v's sign (vpsignb): a lane is at most 2 x 128 x 127.
//       That is sum(v q) directly, which equals the VNNI path's sum(u q) - 128 S.
#define KV_QGEMM 2
using namespace kvfence_avx2;

struct QuantRows {
    std::vector<int8_t> q;
    std::vector<float> d, ds;
};

inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t hsum8i(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

void quantize_rows(const bf16_t* x, int64_t ldx, int64_t m, int64_t k, QuantRows& out, int nt) {
    const int64_t nb = k / kBlock;
    out.q.resize(size_t(m * k));
    out.d.resize(size_t(m * nb));
    out.ds.resize(size_t(m * nb));
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the packs' 128-bit interleave
#pragma omp parallel for num_threads(nt) schedule(static) if (m * k >= (1 << 16))
    for (int64_t r = 0; r < m; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const bf16_t* src = x + r * ldx + b * kBlock;
            __m256 v[4];
            __m256 amax8 = _mm256_setzero_ps(), unord = _mm256_setzero_ps();
            for (int i = 0; i < 4; ++i) {
                v[i] = ld8(src + 8 * i);
                amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[i], abs_mask));
                unord = _mm256_or_ps(unord, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
            }
            const float amax = hmax8(amax8);
            const bool unordered = _mm256_movemask_ps(unord) != 0;  // kept NaN, as the VNNI path (I7)
            const float d = unordered ? std::numeric_limits<float>::quiet_NaN() : amax / 127.0f;
            const float inv = amax > 0.0f && !unordered ? 127.0f / amax : 0.0f;
            const __m256 s = _mm256_set1_ps(inv);
            __m256i q[4];
            for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], s));  // nearest even
            const __m256i w16 = _mm256_packs_epi32(q[0], q[1]), x16 = _mm256_packs_epi32(q[2], q[3]);
            const __m256i b8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, x16), order);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.data() + r * k + b * kBlock), b8);
            const int32_t sum = hsum8i(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
            out.d[size_t(r * nb + b)] = d;
            out.ds[size_t(r * nb + b)] = d * float(sum);
        }
    }
}

enum class Out { Plain, SwiGLU, F32 };
constexpr int kTileRows = 3;  // rows per tile of 16 columns: 6 int sums + 6 fp32 totals in registers

// Rows r0 .. r0 + R of the panel's 8-column vectors y0 .. y0 + NY (vector y: the 16-column
// vector y / 2 of the packing, its half y % 2) into res[r][8 y ..], fp32 totals.
template <int R, int NY, int Fmt>
inline void tile(const QuantRows& a, int64_t r0, int64_t k, const uint8_t* panel, int y0, float (*res)[kPanel]) {
    constexpr bool q4 = Fmt == kQ4_1;
    const int64_t nb = k / kBlock, pb = panel_block_bytes(Fmt);
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), bias = _mm256_set1_epi8(char(0x80));
    __m256 acc[R][NY];
    for (int r = 0; r < R; ++r)
        for (int y = 0; y < NY; ++y) acc[r][y] = _mm256_setzero_ps();
    auto at = [](const uint8_t* base, int chunk, int y) {  // 32 bytes: vector y of k-chunk `chunk`
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (chunk * 2 + y / 2) * 64 + 32 * (y % 2)));
    };
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = panel + b * pb;
        const uint8_t* wq = blk + (q4 ? 4 * kPanel : 2 * kPanel);
        const int32_t* xq[R];
        for (int r = 0; r < R; ++r) xq[r] = reinterpret_cast<const int32_t*>(a.q.data() + (r0 + r) * k + b * kBlock);
        __m256i s[R][NY];
        for (int r = 0; r < R; ++r)
            for (int y = 0; y < NY; ++y) s[r][y] = _mm256_setzero_si256();
        if constexpr (q4) {
            for (int t = 0; t < 4; ++t)
                for (int y = 0; y < NY; ++y) {
                    const __m256i raw = at(wq, t, y0 + y);
                    const __m256i lo = _mm256_and_si256(raw, low), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    for (int r = 0; r < R; ++r) {
                        s[r][y] = _mm256_add_epi16(s[r][y], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xq[r][2 * t])));
                        s[r][y] = _mm256_add_epi16(s[r][y], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xq[r][2 * t + 1])));
                    }
                }
            for (int r = 0; r < R; ++r)
                for (int y = 0; y < NY; ++y) s[r][y] = _mm256_madd_epi16(s[r][y], ones);
        } else {
            for (int t = 0; t < 8; ++t)
                for (int y = 0; y < NY; ++y) {
                    const __m256i v = _mm256_xor_si256(at(wq, t, y0 + y), bias);  // u - 128 as int8
                    const __m256i mag = _mm256_abs_epi8(v);
                    for (int r = 0; r < R; ++r) {
                        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xq[r][t]), v);
                        s[r][y] = _mm256_add_epi32(s[r][y], _mm256_madd_epi16(_mm256_maddubs_epi16(mag, xs), ones));
                    }
                }
        }
        for (int y = 0; y < NY; ++y) {
            const int col = 8 * (y0 + y);
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 * col)));
            __m256 mw = _mm256_setzero_ps();  // Q4's mins, for the min term mw * d * S
            if constexpr (q4)
                mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 * kPanel + 2 * col)));
            for (int r = 0; r < R; ++r) {
                const int64_t i = (r0 + r) * nb + b;
                acc[r][y] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][y]), _mm256_mul_ps(dw, _mm256_set1_ps(a.d[i])),
                                            acc[r][y]);
                if constexpr (q4) acc[r][y] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a.ds[i]), acc[r][y]);
            }
        }
    }
    for (int r = 0; r < R; ++r)
        for (int y = 0; y < NY; ++y) _mm256_storeu_ps(res[r] + 8 * (y0 + y), acc[r][y]);
}

// res's rows into y: `valid` columns from col0 (gated: gate in res[..][0, 16), up in [16, 32))
template <Out E>
inline void store_rows(float (*res)[kPanel], int rows, void* y, int64_t ldy, int64_t r0, int64_t col0, int valid) {
    for (int r = 0; r < rows; ++r) {
        if constexpr (E == Out::F32) {
            std::memcpy(static_cast<float*>(y) + (r0 + r) * ldy + col0, res[r], size_t(valid) * sizeof(float));
        } else {
            bf16_t tmp[kPanel];
            if constexpr (E == Out::Plain) {
                for (int v = 0; v < kPanel; v += 8) st8(tmp + v, _mm256_loadu_ps(res[r] + v));
            } else {  // each of gate and up rounded to bf16 as a stored product, as gemm.cpp's epilogue
                for (int v = 0; v < 16; v += 8)
                    st8(tmp + v, silu_mul8(rnd8(_mm256_loadu_ps(res[r] + v)), rnd8(_mm256_loadu_ps(res[r] + 16 + v))));
            }
            std::memcpy(static_cast<bf16_t*>(y) + (r0 + r) * ldy + col0, tmp, size_t(valid) * sizeof(bf16_t));
        }
    }
}

template <int Fmt, Out E>
void qgemm(const QuantRows& a, const uint8_t* body, void* y, int64_t ldy, int64_t m, int64_t n, int64_t k, int nt) {
    constexpr int cols = E == Out::SwiGLU ? 16 : kPanel;
    const int64_t panels = (n + cols - 1) / cols, pbytes = (k / kBlock) * panel_block_bytes(Fmt);
#pragma omp parallel for num_threads(nt) schedule(static) if (panels > 1 && m * n * k >= (1 << 17))
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t c0 = p * cols;
        const int valid = int(std::min<int64_t>(cols, n - c0));
        const uint8_t* panel = body + p * pbytes;
        alignas(32) float res[kTileRows][kPanel];
        if (m == 1) {  // decode at batch 1: the whole panel in one pass, each x broadcast serving 4 vectors
            tile<1, 4, Fmt>(a, 0, k, panel, 0, res);
            store_rows<E>(res, 1, y, ldy, 0, c0, valid);
            continue;
        }
        for (int64_t r = 0; r < m; r += kTileRows) {
            const int rows = int(std::min<int64_t>(kTileRows, m - r));
            for (int y0 = 0; y0 < 4; y0 += 2) {
                if (rows == 3) tile<3, 2, Fmt>(a, r, k, panel, y0, res);
                else if (rows == 2) tile<2, 2, Fmt>(a, r, k, panel, y0, res);
                else tile<1, 2, Fmt>(a, r, k, panel, y0, res);
            }
            store_rows<E>(res, rows, y, ldy, r, c0, valid);
        }
    }
}

thread_local QuantRows tls_rows;  // grows to the largest call's activations and stays
#endif

// 0 when packed is a well-formed packing of [n][k] (gated or not); else -1
int check(const uint8_t* packed, int64_t bytes, int64_t n, int64_t k, bool gated) {
    if (packed == nullptr || bytes < kHeader || n <= 0 || k <= 0 || n > kMaxDim || k > kMaxDim || k % kBlock)
        return -1;
    Header h;
    std::memcpy(&h, packed, sizeof h);
    if (h.magic != kMagic || (h.format != kQ4_1 && h.format != kQ8_0) || h.n != n || h.k != k
        || h.gated != (gated ? 1 : 0) || h.size != bytes || bytes != packed_bytes(int(h.format), n, k, gated))
        return -1;
    return 0;
}

// out_kind: 0 bf16 y, 1 float32 y, 2 silu(gate) * up as bf16 (gated packing)
int run(int out_kind, const bf16_t* x, int64_t ldx, const uint8_t* packed, int64_t bytes, void* y, int64_t ldy,
        int64_t m, int64_t n, int64_t k, int nt) {
    if (out_kind < 0 || out_kind > 2) return -1;
    nt = std::max(1, nt);   // OpenMP's num_threads needs at least one
    if (check(packed, bytes, n, k, out_kind == 2) != 0 || m < 0 || ldx < k || ldy < n
        || (m > 0 && (x == nullptr || y == nullptr)))
        return -1;
#if defined(KV_QGEMM)
    if (m == 0) return 0;
    Header h;
    std::memcpy(&h, packed, sizeof h);
    QuantRows& a = tls_rows;
    quantize_rows(x, ldx, m, k, a, nt);
    const uint8_t* body = packed + kHeader;
    if (h.format == kQ4_1) {
        if (out_kind == 0) qgemm<kQ4_1, Out::Plain>(a, body, y, ldy, m, n, k, nt);
        else if (out_kind == 1) qgemm<kQ4_1, Out::F32>(a, body, y, ldy, m, n, k, nt);
        else qgemm<kQ4_1, Out::SwiGLU>(a, body, y, ldy, m, n, k, nt);
    } else {
        if (out_kind == 0) qgemm<kQ8_0, Out::Plain>(a, body, y, ldy, m, n, k, nt);
        else if (out_kind == 1) qgemm<kQ8_0, Out::F32>(a, body, y, ldy, m, n, k, nt);
        else qgemm<kQ8_0, Out::SwiGLU>(a, body, y, ldy, m, n, k, nt);
    }
    return 0;
#else
    (void)nt;
    return -2;
#endif
}
}  // namespace

extern "C" {

// 1: AVX512-VNNI, 2: AVX2, 0: none
int kvfence_qgemm_supported() {
#if defined(KV_QGEMM)
    return KV_QGEMM;
#else
    return 0;
#endif
}

// bytes the packed form of an [n][k] weight of GGUF type `type` takes (gated: gate and up, each
// [n][k]); -1 for a type or shape it does not take
int64_t kvfence_qpack_size(int type, int64_t n, int64_t k, int gated) {
    // dimensions past kMaxDim are refused so that no size product below can overflow int64
    if (gguf_block_bytes(type) == 0 || n <= 0 || k <= 0 || n > kMaxDim || k > kMaxDim || k % kBlock) return -1;
    return packed_bytes(type == kQ8_0 ? kQ8_0 : kQ4_1, n, k, gated != 0);
}

// GGUF blocks of [n][k] (row-major, n * k / 32 blocks, `src_bytes` of them) into `out`
// (`out_bytes`, as kvfence_qpack_size); up: the up projection's blocks for gated panels, else
// null. Returns 0, or -1 when a size does not match (nothing is written then).
int kvfence_qpack(int type, const uint8_t* src, const uint8_t* up, int64_t src_bytes, int64_t n, int64_t k,
                  uint8_t* out, int64_t out_bytes) {
    const bool gated = up != nullptr;
    const int64_t bb = gguf_block_bytes(type), nb = k / kBlock;
    if (bb == 0 || src == nullptr || out == nullptr || kvfence_qpack_size(type, n, k, gated) != out_bytes
        || src_bytes != n * nb * bb)
        return -1;
    const int format = type == kQ8_0 ? kQ8_0 : kQ4_1;
    const int64_t pb = panel_block_bytes(format), panels = panels_of(n, gated);
    Header h{};
    h.magic = kMagic, h.format = uint32_t(format), h.n = n, h.k = k, h.gated = gated ? 1 : 0, h.size = out_bytes;
    std::memcpy(out, &h, sizeof h);
    uint8_t* body = out + kHeader;
    std::memset(body, 0, size_t(out_bytes - kHeader));  // columns past n: zero weights and scales
    const bool q4 = format == kQ4_1;
    uint16_t dw, mw;
    uint8_t u[kBlock];
    for (int64_t p = 0; p < panels; ++p)
        for (int j = 0; j < kPanel; ++j) {
            // plain: column p * 32 + j; gated: gate (j < 16) or up column p * 16 + j % 16
            const int64_t col = gated ? p * 16 + j % 16 : p * kPanel + j;
            if (col >= n) continue;
            const uint8_t* row = (gated && j >= 16 ? up : src) + col * nb * bb;
            const int v = j / 16, lane = j % 16;
            for (int64_t b = 0; b < nb; ++b) {
                unpack_block(type, row + b * bb, &dw, &mw, u);
                uint8_t* blk = body + (p * nb + b) * pb;
                std::memcpy(blk + 2 * j, &dw, 2);
                uint8_t* wq = blk + 2 * kPanel;
                if (q4) {
                    std::memcpy(blk + 2 * kPanel + 2 * j, &mw, 2);
                    wq += 2 * kPanel;
                    for (int t = 0; t < 4; ++t)
                        for (int i = 0; i < 4; ++i)
                            wq[(t * 2 + v) * 64 + 4 * lane + i] = uint8_t(u[8 * t + i] | (u[8 * t + 4 + i] << 4));
                } else {
                    for (int t = 0; t < 8; ++t)
                        for (int i = 0; i < 4; ++i) wq[(t * 2 + v) * 64 + 4 * lane + i] = u[4 * t + i];
                }
            }
        }
    return 0;
}

// x [m][k] bf16 (row stride ldx) times the packed [n][k] weight (`bytes` long) transposed, into
// y [m][n] (row stride ldy), bf16. Returns 0; -1 when the call does not match the packed
// weight's header (n, k, size, kind) or a stride is short; -2 where this build has no native path.
int kvfence_qgemm(const bf16_t* x, int64_t ldx, const uint8_t* packed, int64_t bytes, bf16_t* y, int64_t ldy,
                  int64_t m, int64_t n, int64_t k, int nt) {
    return run(0, x, ldx, packed, bytes, y, ldy, m, n, k, nt);
}

// as kvfence_qgemm, y float32 (the LM head's logits)
int kvfence_qgemm_f32(const bf16_t* x, int64_t ldx, const uint8_t* packed, int64_t bytes, float* y, int64_t ldy,
                      int64_t m, int64_t n, int64_t k, int nt) {
    return run(1, x, ldx, packed, bytes, y, ldy, m, n, k, nt);
}

// y [m][inter] = silu(x . gate^T) * (x . up^T) through gated panels; as kvfence_qgemm otherwise
int kvfence_qgemm_swiglu(const bf16_t* x, int64_t ldx, const uint8_t* packed, int64_t bytes, bf16_t* y,
                         int64_t ldy, int64_t m, int64_t inter, int64_t k, int nt) {
    return run(2, x, ldx, packed, bytes, y, ldy, m, inter, k, nt);
}

}  // extern "C"
