// kvfence bf16 matmul: y[M][N] = x[M][K] . W[N][K]^T for the model's linear layers, on CPUs
// with AVX512-BF16 (vdpbf16ps: 16 lanes, each adding two bf16 products into an fp32 sum).
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
// Threads split the panels: each streams its share of the weights once per call.
#include <cstdint>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

typedef uint16_t bf16_t;

namespace {
constexpr int kVecs = 3;             // fp32 vectors of 16 columns per panel
constexpr int kPanel = 16 * kVecs;   // output columns per panel
constexpr int kRows = 8;             // rows per micro-tile: 24 accumulators, 3 weight vectors, 1 broadcast

#if defined(__AVX512BF16__)
template <int R>
inline void tile(const bf16_t* x, int64_t ldx, const uint32_t* w, int64_t k2, bf16_t* y, int64_t ldy,
                 const __mmask16* mask) {
    __m512 c[R][kVecs];
    const uint32_t* xr[R];
    for (int r = 0; r < R; ++r) {
        for (int v = 0; v < kVecs; ++v) c[r][v] = _mm512_setzero_ps();
        xr[r] = reinterpret_cast<const uint32_t*>(x + r * ldx);
    }
    for (int64_t k = 0; k < k2; ++k) {
        __m512bh wv[kVecs];
        for (int v = 0; v < kVecs; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + k * kPanel + 16 * v);
        for (int r = 0; r < R; ++r) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32(int(xr[r][k]));
            for (int v = 0; v < kVecs; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], a, wv[v]);
        }
    }
    for (int r = 0; r < R; ++r)  // masked: the last panel may be narrower than kPanel columns
        for (int v = 0; v < kVecs; ++v)
            _mm256_mask_storeu_epi16(y + r * ldy + 16 * v, mask[v], (__m256i)_mm512_cvtneps_pbh(c[r][v]));
}

inline void tile_rows(int rows, const bf16_t* x, int64_t ldx, const uint32_t* w, int64_t k2, bf16_t* y,
                      int64_t ldy, const __mmask16* mask) {
    switch (rows) {
#define KV_TILE(n) \
    case n: tile<n>(x, ldx, w, k2, y, ldy, mask); break;
        KV_TILE(1) KV_TILE(2) KV_TILE(3) KV_TILE(4) KV_TILE(5) KV_TILE(6) KV_TILE(7) KV_TILE(8)
#undef KV_TILE
    }
}

inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1); }
#endif
}  // namespace

extern "C" {

int kvfence_gemm_supported() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

// uint32 elements the packed form of an [n][k] weight takes (k even)
int64_t kvfence_gemm_packed_size(int64_t n, int64_t k) { return (n + kPanel - 1) / kPanel * kPanel * (k / 2); }

void kvfence_gemm_pack(const bf16_t* weight, int64_t n, int64_t k, uint32_t* packed) {
    const int64_t k2 = k / 2, panels = (n + kPanel - 1) / kPanel;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t i = 0; i < k2; ++i)
            for (int j = 0; j < kPanel; ++j) {
                const int64_t col = p * kPanel + j;
                packed[(p * k2 + i) * kPanel + j] =
                    col < n ? reinterpret_cast<const uint32_t*>(weight + col * k)[i] : 0u;
            }
}

// x [m][k] with row stride ldx, y [m][n] with row stride ldy; k even; returns 0, or -1 where
// this build has no AVX512-BF16 path (the caller checked kvfence_gemm_supported first)
int kvfence_gemm(const bf16_t* x, int64_t ldx, const uint32_t* packed, bf16_t* y, int64_t ldy, int64_t m, int64_t n,
                 int64_t k, int nt) {
#if defined(__AVX512BF16__)
    const int64_t k2 = k / 2, panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for num_threads(nt) schedule(static) if (panels > 1 && m * n * k >= (1 << 18))
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t n0 = p * kPanel;
        __mmask16 mask[kVecs];
        for (int v = 0; v < kVecs; ++v) mask[v] = lanes(n - n0 - 16 * v);
        const uint32_t* w = packed + p * k2 * kPanel;
        for (int64_t r = 0; r < m; r += kRows) {
            const int rows = int(m - r < kRows ? m - r : kRows);
            tile_rows(rows, x + r * ldx, ldx, w, k2, y + r * ldy + n0, ldy, mask);
        }
    }
    return 0;
#else
    (void)x, (void)ldx, (void)packed, (void)y, (void)ldy, (void)m, (void)n, (void)k, (void)nt;
    return -1;
#endif
}

}  // extern "C"
