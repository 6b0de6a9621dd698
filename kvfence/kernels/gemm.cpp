// kvfence bf16 matmul: y[M][N] = x[M][K] . W[N][K]^T for the model's linear layers, on CPUs
// with AVX512-BF16 (vdpbf16ps: 16 lanes, each adding two bf16 products into an fp32 sum), and
// on CPUs with AVX2 + FMA (the second half of this file: the weights widened in registers).
//
// Why our own: this model's layers are narrow (K = 576 or 1536, N = 576 .. 3072) and decode
// runs them at M = 32 rows; oneDNN's bf16 kernels reach 270-340 GFLOP/s there on a 2-core
// Zen 4, where this one reaches ~400 (and ~430 vs 355-440 at M = 2048). Measured with
// kvfence bench's matmul-floor row and docs/performance.md. Of the tile shapes tried
// (rows x columns: 12x32, 8x48, 6x64, 8x32, 16x16), 8x48 was fastest at both sizes.
//
// The weights are packed once at load: panels of 48 output columns, each [K/2][48] pairs
// (W[n][2k], W[n][2k+1]) as one uint32, zero columns past N. A micro-tile keeps up to 8 rows
// x 48 columns of fp32 sums in 24 registers; per pair of k it loads the panel's three vectors
// and broadcasts each row's x pair. Sums are fp32 in k order, one rounding to bf16 at the end.
// Threads split the panels: each streams its share of the weights once per call. At decode's
// 32 rows a panel's first row tile waits on memory for its weights and the other three find
// them in cache; each tile therefore prefetches a share of the next panel, one cache line per
// k step (decode matmuls 24.0 -> 23.0 ms a step; two lines a step measured 26.4: more misses
// in flight stall the tile's own loads).
//
// Gated panels (the MLP's gate and up projections in one pass): 24 columns of gate, then the
// same 24 columns of up. The micro-tile's epilogue rounds both to bf16, as a stored product
// would be, and writes silu(gate) * up: the [rows, 2 * inter] product is never stored and
// read back (kvfence_gemm_swiglu, bit-identical to kvfence_gemm then kvfence_silu_mul).
//
// float32 output (the LM head, kvfence_gemm_f32): the same sums, stored without the rounding
// to bf16. Logits rounded to bf16 are multiples of 1/8 at this model's magnitudes: near-ties in
// float32 became exact ties (the lower id won) and every logprob was quantized (issue #16).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "scalar_math.h"
#include "simd_avx2.h"
#include "simd_bf16.h"

namespace {
using namespace kvfence_scalar;
constexpr int kVecs = 3;             // fp32 vectors of 16 columns per panel
constexpr int kPanel = 16 * kVecs;   // output columns per panel
constexpr int kRows = 8;             // rows per micro-tile: 24 accumulators, 3 weight vectors, 1 broadcast
constexpr int kGated = kPanel / 2;   // output columns of a gated panel

// What a micro-tile writes: its sums rounded to bf16, silu(gate) * up of a gated panel, or its
// float32 sums.
enum class Out { Plain, SwiGLU, F32 };

template <Out E>
using OutT = typename std::conditional<E == Out::F32, float, bf16_t>::type;

// Column p * kPanel + j of the packed weight: row `col` of [n][k] weight for plain panels;
// for gated panels gate row p * kGated + j (j < kGated), else up row p * kGated + j - kGated.
template <typename RowOf>
void pack_panels(int64_t panels, int64_t k, uint32_t* packed, RowOf row_of) {
    const int64_t k2 = k / 2;
    for (int64_t p = 0; p < panels; ++p)
        for (int j = 0; j < kPanel; ++j) {
            const bf16_t* row = row_of(p, j);  // nullptr past the last column: zeros
            for (int64_t i = 0; i < k2; ++i)
                packed[(p * k2 + i) * kPanel + j] = row ? reinterpret_cast<const uint32_t*>(row)[i] : 0u;
        }
}

#if defined(__AVX512BF16__)
using namespace kvfence_simd;

template <int R, Out E>
inline void tile(const bf16_t* x, int64_t ldx, const uint32_t* w, int64_t k2, OutT<E>* y, int64_t ldy,
                 const __mmask16* mask, const char* prefetch, int64_t prefetch_lines) {
    __m512 c[R][kVecs];
    const uint32_t* xr[R];
    for (int r = 0; r < R; ++r) {
        for (int v = 0; v < kVecs; ++v) c[r][v] = _mm512_setzero_ps();
        xr[r] = reinterpret_cast<const uint32_t*>(x + r * ldx);
    }
    for (int64_t k = 0; k < k2; ++k) {
        if (k < prefetch_lines) _mm_prefetch(prefetch + k * 64, _MM_HINT_T0);
        __m512bh wv[kVecs];
        for (int v = 0; v < kVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + k * kPanel + 16 * v);
        for (int r = 0; r < R; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(int(xr[r][k]));
            for (int v = 0; v < kVecs; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], a, wv[v]);
        }
    }
    // masked stores: the last panel may be narrower than kPanel (or kGated) columns
    if constexpr (E == Out::Plain) {
        for (int r = 0; r < R; ++r)
            for (int v = 0; v < kVecs; ++v) _mm256_mask_storeu_epi16(y + r * ldy + 16 * v, mask[v], bf16x16(c[r][v]));
    } else if constexpr (E == Out::F32) {
        for (int r = 0; r < R; ++r)
            for (int v = 0; v < kVecs; ++v) _mm512_mask_storeu_ps(y + r * ldy + 16 * v, mask[v], c[r][v]);
    } else {
        // c[r][0] = gate 0-15, c[r][1] = gate 16-23 | up 0-7, c[r][2] = up 8-23
        const __m512i up_lo_idx = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23);
        for (int r = 0; r < R; ++r) {
            const __m512 mid = rnd16(c[r][1]), up_rest = rnd16(c[r][2]);
            const __m512 up_lo = _mm512_permutex2var_ps(mid, up_lo_idx, up_rest);
            const __m512 up_hi = _mm512_shuffle_f32x4(up_rest, up_rest, 0xEE);  // up 16-23 into lanes 0-7
            _mm256_mask_storeu_epi16(y + r * ldy, mask[0], bf16x16(silu_mul16(rnd16(c[r][0]), up_lo)));
            _mm256_mask_storeu_epi16(y + r * ldy + 16, mask[1], bf16x16(silu_mul16(mid, up_hi)));
        }
    }
}

template <Out E>
inline void tile_rows(int rows, const bf16_t* x, int64_t ldx, const uint32_t* w, int64_t k2, OutT<E>* y,
                      int64_t ldy, const __mmask16* mask, const char* prefetch, int64_t prefetch_lines) {
    switch (rows) {
#define KV_TILE(n) \
    case n: tile<n, E>(x, ldx, w, k2, y, ldy, mask, prefetch, prefetch_lines); break;
        KV_TILE(1) KV_TILE(2) KV_TILE(3) KV_TILE(4) KV_TILE(5) KV_TILE(6) KV_TILE(7) KV_TILE(8)
#undef KV_TILE
    }
}

inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); }

// y [m][n] for plain panels, [m][n] activations (n = inter) for gated ones
template <Out E>
void gemm(const bf16_t* x, int64_t ldx, const uint32_t* packed, OutT<E>* y, int64_t ldy, int64_t m, int64_t n,
          int64_t k, int nt) {
    constexpr int cols = E == Out::SwiGLU ? kGated : kPanel;  // output columns per panel
    const int64_t k2 = k / 2, panels = (n + cols - 1) / cols;
    const int64_t tiles = (m + kRows - 1) / kRows, panel_lines = k2 * kPanel * 4 / 64;
    const int64_t share = std::min(k2, (panel_lines + tiles - 1) / tiles);  // lines of the next panel per tile
#pragma omp parallel for num_threads(nt) schedule(static) if (panels > 1 && m * n * k >= (1 << 18))
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t n0 = p * cols;
        __mmask16 mask[kVecs];
        for (int v = 0; v < kVecs; ++v) mask[v] = lanes(n - n0 - 16 * v);
        if constexpr (E == Out::SwiGLU) mask[1] &= 0xFF;  // 24 columns: 16 + 8
        const uint32_t* w = packed + p * k2 * kPanel;
        const char* next = reinterpret_cast<const char*>(w + k2 * kPanel);
        for (int64_t r = 0, t = 0; r < m; r += kRows, ++t) {
            const int rows = int(m - r < kRows ? m - r : kRows);
            const int64_t from = std::min(panel_lines, t * share);
            const int64_t lines = p + 1 < panels ? std::min(share, panel_lines - from) : 0;
            tile_rows<E>(rows, x + r * ldx, ldx, w, k2, y + r * ldy + n0, ldy, mask, next + from * 64, lines);
        }
    }
}
#elif defined(KVFENCE_AVX2)
using namespace kvfence_avx2;
// AVX2 + FMA (Zen 2/3, Intel before AVX-512): no bf16 dot instruction, but a bf16 is the top
// half of an fp32, so a packed pair gives both weights as fp32 with one shift (W[n][2k], the
// low half) and one AND (W[n][2k+1]). The rows of x are widened to fp32 once per call, so each
// row's pair is two broadcast loads. Sums are fp32 over exact products, one rounding at the
// end: the same sums as vdpbf16ps up to fp32 addition order.
//
// The packed layout is the AVX-512 one (48-column panels), so packing, sizes and the decoder
// stack do not depend on the CPU. A micro-tile of up to kRows2 rows walks the panel's columns
// in passes (tile2) into an fp32 buffer of the panel's 48 columns; the epilogue (rounding,
// SiLU of gated panels) reads that buffer.
constexpr int kRows2 = 3;

// x [m][k] bf16 (row stride ldx) widened to fp32 [m][k], for broadcast loads
inline void widen_rows(const bf16_t* x, int64_t ldx, int64_t m, int64_t k, float* xf) {
    for (int64_t r = 0; r < m; ++r) {
        const bf16_t* src = x + r * ldx;
        float* dst = xf + r * k;
        int64_t i = 0;
        for (; i + 8 <= k; i += 8) _mm256_storeu_ps(dst + i, ld8(src + i));
        for (; i < k; ++i) dst[i] = to_f(src[i]);
    }
}

// buf [R][kPanel] = the R rows of xf (fp32, k apart) times the panel w, all 48 columns, in
// passes of V vectors of 8 columns. FMA takes 4 cycles and two issue each cycle, so a tile
// keeps 12 independent sums in flight: each output's sum is split into its even-k and odd-k
// halves, added at the end. Every tile shape (R x V: 3 x 2, 2 x 2, 1 x 6) sums in this same
// order, so a row's result does not depend on how many rows shared its tile (batch-invariant,
// as the AVX-512 path). Per pass and k: V weight loads, their shift (even) then AND (odd),
// and two broadcasts per row.
template <int R, int V>
inline void tile2(const float* xf, int64_t k, const uint32_t* w, int64_t k2, float* buf) {
    static_assert(2 * kVecs % V == 0, "a pass covers whole vectors of the panel");
    for (int g = 0; g < 2 * kVecs; g += V) {
        __m256 c[2][R][V];
        for (int s = 0; s < 2; ++s)
            for (int r = 0; r < R; ++r)
                for (int v = 0; v < V; ++v) c[s][r][v] = _mm256_setzero_ps();
        const uint32_t* wg = w + 8 * g;
        for (int64_t i = 0; i < k2; ++i) {
            const __m256i* wi = reinterpret_cast<const __m256i*>(wg + i * kPanel);
            if constexpr (R == 1) {  // 12 sums in 12 registers: widen each weight vector just before its FMA
                const __m256 xe = _mm256_broadcast_ss(xf + 2 * i), xo = _mm256_broadcast_ss(xf + 2 * i + 1);
                for (int v = 0; v < V; ++v) c[0][0][v] = _mm256_fmadd_ps(pair_lo(_mm256_loadu_si256(wi + v)), xe, c[0][0][v]);
                for (int v = 0; v < V; ++v) c[1][0][v] = _mm256_fmadd_ps(pair_hi(_mm256_loadu_si256(wi + v)), xo, c[1][0][v]);
            } else {  // each widened weight vector serves every row
                __m256i raw[V];
                __m256 wv[V];
                for (int v = 0; v < V; ++v) {
                    raw[v] = _mm256_loadu_si256(wi + v);
                    wv[v] = pair_lo(raw[v]);
                }
                for (int r = 0; r < R; ++r) {
                    const __m256 xe = _mm256_broadcast_ss(xf + r * k + 2 * i);
                    for (int v = 0; v < V; ++v) c[0][r][v] = _mm256_fmadd_ps(wv[v], xe, c[0][r][v]);
                }
                for (int v = 0; v < V; ++v) wv[v] = pair_hi(raw[v]);
                for (int r = 0; r < R; ++r) {
                    const __m256 xo = _mm256_broadcast_ss(xf + r * k + 2 * i + 1);
                    for (int v = 0; v < V; ++v) c[1][r][v] = _mm256_fmadd_ps(wv[v], xo, c[1][r][v]);
                }
            }
        }
        for (int r = 0; r < R; ++r)
            for (int v = 0; v < V; ++v)
                _mm256_storeu_ps(buf + r * kPanel + 8 * (g + v), _mm256_add_ps(c[0][r][v], c[1][r][v]));
    }
}

// the epilogue: `cols` live output columns of a panel's buffer into y
template <Out E>
inline void store_tile(int rows, const float* buf, OutT<E>* y, int64_t ldy, int64_t cols) {
    for (int r = 0; r < rows; ++r) {
        const float* b = buf + r * kPanel;
        OutT<E>* yr = y + r * ldy;
        if constexpr (E == Out::F32) {
            std::memcpy(yr, b, sizeof(float) * cols);
        } else if constexpr (E == Out::Plain) {
            int64_t j = 0;
            for (; j + 8 <= cols; j += 8) st8(yr + j, _mm256_loadu_ps(b + j));
            for (; j < cols; ++j) yr[j] = from_f<bf16_t>(b[j]);
        } else {  // gate in columns 0 .. kGated - 1, up in kGated .., each rounded as a stored product;
                  // 8-column steps from the panel's start, as kvfence_silu_mul's from the row's
            int64_t j = 0;
            for (; j + 8 <= cols; j += 8)
                st8(yr + j, silu_mul8(rnd8(_mm256_loadu_ps(b + j)), rnd8(_mm256_loadu_ps(b + kGated + j))));
            for (; j < cols; ++j)
                yr[j] = from_f<bf16_t>(silu_mul_one<bf16_t>(rnd<bf16_t>(b[j]), rnd<bf16_t>(b[kGated + j])));
        }
    }
}

thread_local std::vector<float> tl_xf;  // the caller's widened x, shared by its OpenMP threads

template <Out E>
void gemm(const bf16_t* x, int64_t ldx, const uint32_t* packed, OutT<E>* y, int64_t ldy, int64_t m, int64_t n,
          int64_t k, int nt) {
    constexpr int cols = E == Out::SwiGLU ? kGated : kPanel;
    const int64_t k2 = k / 2, panels = (n + cols - 1) / cols;
    if (tl_xf.size() < size_t(m * k)) tl_xf.resize(size_t(m * k));
    float* xf = tl_xf.data();
    widen_rows(x, ldx, m, k, xf);
#pragma omp parallel for num_threads(nt) schedule(static) if (panels > 1 && m * n * k >= (1 << 18))
    for (int64_t p = 0; p < panels; ++p) {
        alignas(32) float buf[kRows2 * kPanel];
        const int64_t n0 = p * cols, live = std::min<int64_t>(cols, n - n0);
        const uint32_t* w = packed + p * k2 * kPanel;
        for (int64_t r = 0; r < m; r += kRows2) {
            const int rows = int(m - r < kRows2 ? m - r : kRows2);
            switch (rows) {
                case 1: tile2<1, 6>(xf + r * k, k, w, k2, buf); break;
                case 2: tile2<2, 2>(xf + r * k, k, w, k2, buf); break;
                default: tile2<3, 2>(xf + r * k, k, w, k2, buf); break;
            }
            store_tile<E>(rows, buf, y + r * ldy + n0, ldy, live);
        }
    }
}
#endif

// 0, or -1 where this build has neither path
template <Out E>
int run(const bf16_t* x, int64_t ldx, const uint32_t* packed, OutT<E>* y, int64_t ldy, int64_t m, int64_t n,
        int64_t k, int nt) {
#if defined(__AVX512BF16__) || defined(KVFENCE_AVX2)
    gemm<E>(x, ldx, packed, y, ldy, m, n, k, nt);
    return 0;
#else
    (void)x, (void)ldx, (void)packed, (void)y, (void)ldy, (void)m, (void)n, (void)k, (void)nt;
    return -1;
#endif
}
}  // namespace

extern "C" {

// 2: AVX512-BF16, 1: AVX2 + FMA, 0: neither (the model keeps torch's matmul)
int kvfence_gemm_supported() {
#if defined(__AVX512BF16__)
    return 2;
#elif defined(KVFENCE_AVX2)
    return 1;
#else
    return 0;
#endif
}

// uint32 elements the packed form of an [n][k] weight takes (k even)
int64_t kvfence_gemm_packed_size(int64_t n, int64_t k) { return (n + kPanel - 1) / kPanel * kPanel * (k / 2); }

void kvfence_gemm_pack(const bf16_t* weight, int64_t n, int64_t k, uint32_t* packed) {
    pack_panels((n + kPanel - 1) / kPanel, k, packed, [&](int64_t p, int j) -> const bf16_t* {
        const int64_t col = p * kPanel + j;
        return col < n ? weight + col * k : nullptr;
    });
}

// the gated form of gate and up, each [inter][k]
int64_t kvfence_gemm_gated_packed_size(int64_t inter, int64_t k) {
    return (inter + kGated - 1) / kGated * kPanel * (k / 2);
}

void kvfence_gemm_pack_gated(const bf16_t* gate, const bf16_t* up, int64_t inter, int64_t k, uint32_t* packed) {
    pack_panels((inter + kGated - 1) / kGated, k, packed, [&](int64_t p, int j) -> const bf16_t* {
        const int64_t col = p * kGated + j % kGated;
        return col < inter ? (j < kGated ? gate : up) + col * k : nullptr;
    });
}

// x [m][k] with row stride ldx, y [m][n] with row stride ldy; k even; returns 0, or -1 where
// this build has neither path (the caller checked kvfence_gemm_supported first)
int kvfence_gemm(const bf16_t* x, int64_t ldx, const uint32_t* packed, bf16_t* y, int64_t ldy, int64_t m, int64_t n,
                 int64_t k, int nt) {
    return run<Out::Plain>(x, ldx, packed, y, ldy, m, n, k, nt);
}

// as kvfence_gemm, y float32: the sums unrounded
int kvfence_gemm_f32(const bf16_t* x, int64_t ldx, const uint32_t* packed, float* y, int64_t ldy, int64_t m,
                     int64_t n, int64_t k, int nt) {
    return run<Out::F32>(x, ldx, packed, y, ldy, m, n, k, nt);
}

// y [m][inter] = silu(x . gate^T) * (x . up^T) through gated panels; as kvfence_gemm otherwise
int kvfence_gemm_swiglu(const bf16_t* x, int64_t ldx, const uint32_t* packed, bf16_t* y, int64_t ldy, int64_t m,
                        int64_t inter, int64_t k, int nt) {
    return run<Out::SwiGLU>(x, ldx, packed, y, ldy, m, inter, k, nt);
}

}  // extern "C"
