// kvfence CPU kernels: paged attention that reads the KV pool in place, and the fused
// element-wise steps around it (residual add + RMSNorm, RoPE + KV store, SiLU * up).
//
// Plain C++ with no torch headers, so it builds in about a second with the system
// compiler (kvfence/kernels/build.py); -O3 -march=native vectorizes the inner loops.
// Every entry point takes raw pointers from tensors the caller has checked (dtype,
// contiguity, shapes). Threads come from the OpenMP runtime torch already loaded.
//
// Pool layout (kvfence/kv/pool.py): cache[kv_head] is num_pages * page_size * head_dim
// elements. Inside a page elements sit in pairs along the attention's reductions: a K page is
// [head_dim/2][page_size][2] (dims d, d+1 of each position), a V page [page_size/2][head_dim][2]
// (positions j, j+1 of each dim); page sizes are even. k_at / v_at below are the one statement
// of it here. The scores of a query against a K page are head_dim/2 pair products over
// page_size lanes, and probabilities . V pair products over head_dim lanes: the bf16 kernels
// feed pages to vdpbf16ps as they lie.
//
// The attention reads exactly positions 0 .. kv_len-1 of each row's pages, through the page
// table it is given, and checks every page index against the pool size: a bad table is an
// error returned to the caller, never a read outside the pool.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#include "kernels.h"
#include "scalar_math.h"
#include "simd_vec.h"

namespace {
using namespace kvfence_scalar;

// Offsets inside a page (see the top of this file; kv/pool.py k_element is the same rule)
inline int64_t k_at(int64_t d, int64_t j, int64_t page_size) { return ((d >> 1) * page_size + j) * 2 + (d & 1); }
inline int64_t v_at(int64_t j, int64_t d, int64_t dim) { return ((j >> 1) * dim + d) * 2 + (j & 1); }

// The element-wise kernels' vectors, one type for both SIMD builds: simd_vec.h. The attention
// keeps a path per build (vdpbf16ps on pairs as the pages lie; AVX2 widens them in registers).
#if defined(KVFENCE_VEC)
using namespace kvfence_vec;
#endif
#if defined(__AVX512BF16__)
using namespace kvfence_simd;
#endif

// ---------------------------------------------------------------------------------------
// h += delta (if delta), out = w * normalize(h). Rounding as torch: the normalized value is
// rounded to T before the weight multiplies it.
template <typename T>
void add_rms_norm(T* h, const T* delta, const T* w, T* out, int64_t n, int64_t dim, float eps, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (n * dim >= (1 << 14))
    for (int64_t i = 0; i < n; ++i) {
        T* hr = h + i * dim;
#if defined(KVFENCE_VEC)
        if constexpr (std::is_same<T, bf16_t>::value) {
            if (dim % kLanes == 0) {
                T* o = out + i * dim;
                V acc = zero();
                for (int64_t d = 0; d < dim; d += kLanes) {
                    V v = load(hr + d);
                    if (delta) {
                        v = rnd(v + load(delta + i * dim + d));
                        store(hr + d, v);
                    }
                    acc = fma(v, v, acc);
                }
                const V r = splat(1.0f / std::sqrt(sum(acc) / float(dim) + eps));
                for (int64_t d = 0; d < dim; d += kLanes) store(o + d, load(w + d) * rnd(load(hr + d) * r));
                continue;
            }
        }
#endif
        float ss = 0.f;
        if (delta) {
            const T* dr = delta + i * dim;
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < dim; ++d) {
                const float v = rnd<T>(to_f(hr[d]) + to_f(dr[d]));
                hr[d] = from_f<T>(v);
                ss += v * v;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t d = 0; d < dim; ++d) {
                const float v = to_f(hr[d]);
                ss += v * v;
            }
        }
        const float r = 1.0f / std::sqrt(ss / float(dim) + eps);
        T* o = out + i * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) o[d] = from_f<T>(to_f(w[d]) * rnd<T>(to_f(hr[d]) * r));
    }
}

// ---------------------------------------------------------------------------------------
// The same with a float32 residual stream (bf16 models): h += delta without rounding h to bf16,
// out = w * normalize(h) in bf16 as above. Rounding the residual to bf16 after every layer's two
// additions cost fidelity: teacher-forced against float32, keeping it float32 moved top-1
// agreement 0.9839 -> 0.9878 and mean |dlogprob| 0.0182 -> 0.0146 (docs/performance.md).
void add_rms_norm_f32res(float* h, const bf16_t* delta, const bf16_t* w, bf16_t* out, int64_t n, int64_t dim,
                         float eps, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (n * dim >= (1 << 14))
    for (int64_t i = 0; i < n; ++i) {
        float* hr = h + i * dim;
        const bf16_t* dr = delta ? delta + i * dim : nullptr;
        bf16_t* o = out + i * dim;
#if defined(KVFENCE_VEC)
        if (dim % kLanes == 0) {
            V acc = zero();
            for (int64_t d = 0; d < dim; d += kLanes) {
                V v = load(hr + d);
                if (dr) {
                    v = v + load(dr + d);
                    store(hr + d, v);
                }
                acc = fma(v, v, acc);
            }
            const V r = splat(1.0f / std::sqrt(sum(acc) / float(dim) + eps));
            for (int64_t d = 0; d < dim; d += kLanes) store(o + d, load(w + d) * rnd(load(hr + d) * r));
            continue;
        }
#endif
        float ss = 0.f;
        for (int64_t d = 0; d < dim; ++d) {
            const float v = dr ? hr[d] + to_f(dr[d]) : hr[d];
            hr[d] = v;
            ss += v * v;
        }
        const float r = 1.0f / std::sqrt(ss / float(dim) + eps);
        for (int64_t d = 0; d < dim; ++d) o[d] = from_f<bf16_t>(to_f(w[d]) * rnd<bf16_t>(hr[d] * r));
    }
}

// ---------------------------------------------------------------------------------------
// Rotate the q and k heads of each token's qkv row in place (rotate-half RoPE, the
// Hugging Face convention), then store its k and v into the pool slot the runner chose.
// Returns 0, or -(1 + i) for the first token whose slot lies outside the pool or whose
// position lies outside the RoPE tables: then nothing at all is written.
template <typename T>
int64_t rope_store(T* qkv, int64_t n, int64_t row_stride, int heads, int kv_heads, int dim,
                   const int64_t* positions, int64_t num_positions, const T* cos, const T* sin, T* k_cache,
                   T* v_cache, int64_t head_stride, const int64_t* slots, int page_size, int nt) {
    const int64_t num_slots = head_stride / dim;
    for (int64_t i = 0; i < n; ++i)
        if (slots[i] < 0 || slots[i] >= num_slots || positions[i] < 0 || positions[i] >= num_positions)
            return -(1 + i);
    const int half = dim / 2;
#pragma omp parallel for num_threads(nt) schedule(static) if (n >= 16)
    for (int64_t i = 0; i < n; ++i) {
        T* row = qkv + i * row_stride;
        const T* c = cos + positions[i] * dim;
        const T* s = sin + positions[i] * dim;
        for (int hh = 0; hh < heads + kv_heads; ++hh) {
            T* x = row + int64_t(hh) * dim;
#if defined(KVFENCE_VEC)
            if constexpr (std::is_same<T, bf16_t>::value) {
                if (half % kLanes == 0) {
                    for (int d = 0; d < half; d += kLanes) {
                        const V a = load(x + d), b = load(x + d + half);
                        const V lo = rnd(rnd(a * load(c + d)) - rnd(b * load(s + d)));
                        const V hi = rnd(rnd(b * load(c + d + half)) + rnd(a * load(s + d + half)));
                        store(x + d, lo);
                        store(x + d + half, hi);
                    }
                    continue;
                }
            }
#endif
#pragma omp simd
            for (int d = 0; d < half; ++d) {
                const float a = to_f(x[d]), b = to_f(x[d + half]);
                const float lo = rnd<T>(rnd<T>(a * to_f(c[d])) - rnd<T>(b * to_f(s[d])));
                const float hi = rnd<T>(rnd<T>(b * to_f(c[d + half])) + rnd<T>(a * to_f(s[d + half])));
                x[d] = from_f<T>(lo);
                x[d + half] = from_f<T>(hi);
            }
        }
        const int64_t page = slots[i] / page_size, j = slots[i] % page_size;
        for (int kh = 0; kh < kv_heads; ++kh) {
            const T* k = row + int64_t(heads + kh) * dim;
            const T* v = row + int64_t(heads + kv_heads + kh) * dim;
            T* kp = k_cache + kh * head_stride + page * page_size * dim;
            T* vp = v_cache + kh * head_stride + page * page_size * dim;
            for (int d = 0; d < dim; d += 2) {  // the pair (d, d+1) is adjacent in K
                kp[k_at(d, j, page_size)] = k[d];
                kp[k_at(d, j, page_size) + 1] = k[d + 1];
            }
            for (int d = 0; d < dim; ++d) vp[v_at(j, d, dim)] = v[d];
        }
    }
    return 0;
}

// ---------------------------------------------------------------------------------------
// out[i, :] = silu(gate) * up for gu[i] = [gate | up], with torch's bf16 roundings.
template <typename T>
void silu_mul(const T* gu, T* out, int64_t n, int64_t inter, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (n * inter >= (1 << 14))
    for (int64_t i = 0; i < n; ++i) {
        const T* g = gu + i * 2 * inter;
        const T* u = g + inter;
        T* o = out + i * inter;
        int64_t d0 = 0;  // vector lanes, then the scalar tail: the same bits either way (simd_vec.h)
#if defined(KVFENCE_VEC)
        if constexpr (std::is_same<T, bf16_t>::value)
            for (; d0 + kLanes <= inter; d0 += kLanes) store(o + d0, silu_mul(load(g + d0), load(u + d0)));
#endif
        for (int64_t d = d0; d < inter; ++d) {
            o[d] = from_f<T>(silu_mul_one<T>(to_f(g[d]), to_f(u[d])));
        }
    }
}

// ---------------------------------------------------------------------------------------
// Paged attention for a flat batch of rows (sequences). Row r has q_len[r] new tokens at
// flat positions q_start[r] ..; query i of the row sees keys 0 .. kv_len[r] - q_len[r] + i.
// Work is split into (row, kv head, block of query positions) tasks.
//
// PS and DIM are compile-time for the common shape (page 16, head_dim 64) so the
// accumulators live in registers; 0 means "given at run time" (the slower general path).
constexpr int kQueryBlock = 32;  // query positions per task: K/V pages repacked once for all of them
constexpr int kQueryTile = 4;    // queries scored together: independent FMA chains
constexpr int kMaxPage = 64;
constexpr int kMaxDim = 256;

struct Task {
    int64_t row;
    int kv_head;
    int64_t first;  // first query position of the block, within the row
    int64_t count;
};

thread_local std::vector<float> tl_buf;

inline void prefetch_page(const void* p, int64_t bytes) {
    const char* c = static_cast<const char*>(p);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}

// bf16 pages of the common shape on CPUs with AVX512-BF16 use vdpbf16ps: one instruction
// multiplies 16 pairs of bf16 and adds them into 16 fp32 lanes, half the work of converting
// to fp32 and multiply-adding. Pairs run along the reduction: (d, d+1) for scores, (j, j+1)
// for probabilities . v. Products are exact in fp32 and summed in fp32, as the fp32 path;
// what changes is that q (already bf16) and the probabilities are taken at bf16 precision,
// as the torch path does.
#if defined(__AVX512BF16__)
template <typename T, int PS, int DIM>
constexpr bool kDotPath = std::is_same<T, bf16_t>::value && PS == 16 && DIM == 64;

template <int U>  // U queries at once: U independent chains of 32 multiply-adds
inline void score_tile(const int32_t* kpair, const float* qf, float* scores, int64_t width) {
    const uint32_t* qp = reinterpret_cast<const uint32_t*>(qf);  // the pairs; qf[u * 64 + 32] is the scale
    __m512 acc[U];
    for (int u = 0; u < U; ++u) acc[u] = _mm512_setzero_ps();
    for (int i = 0; i < 32; ++i) {
        const __m512bh k = (__m512bh)_mm512_loadu_si512(kpair + 16 * i);
        for (int u = 0; u < U; ++u)
            acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_set1_epi32(int(qp[u * 64 + i])), k);
    }
    for (int u = 0; u < U; ++u)
        _mm512_storeu_ps(scores + u * width, _mm512_mul_ps(acc[u], _mm512_set1_ps(qf[u * 64 + 32])));
}

// qf holds, per query, 32 uint32 pairs (q[2i], q[2i+1]) as raw bf16 bits, then the scale.
// kp: a K page as it lies, [32 dim pairs][16 positions] of uint32.
inline void dot_scores_page(const bf16_t* kp, const float* qf, int64_t nq_pad, float* scores, int64_t width) {
    const int32_t* kpair = reinterpret_cast<const int32_t*>(kp);
    int64_t q0 = 0;
    for (; q0 + 8 <= nq_pad; q0 += 8)  // prefill blocks: eight chains keep the multiply-add unit busy
        score_tile<8>(kpair, qf + q0 * 64, scores + q0 * width, width);
    for (; q0 < nq_pad; q0 += kQueryTile) score_tile<kQueryTile>(kpair, qf + q0 * 64, scores + q0 * width, width);
}

// acc[u] = probabilities . v for U queries at once over keys 0 .. keys-1, all in registers:
// 4U independent multiply-add chains sharing each loaded V vector. V pages are read as they
// lie: [8 position pairs][64 dims] of uint32. Where keys is odd, the last pair's second
// position is past the row's keys (stale, or NaN from a poison scrub): it is masked to zero
// in the register, so it cannot reach the sum even with probability 0. probs16: per query,
// its probabilities rounded to bf16 (width apart; a key past what it sees has probability 0).
template <int U>
inline void pv_rows(const bf16_t* vbase, const int64_t* table, int64_t page_elems, int64_t keys, bool prefetch,
                    const bf16_t* probs16, int64_t width, float* acc) {
    __m512 o[U][4];
    const uint32_t* pr[U];
    for (int u = 0; u < U; ++u) {
        pr[u] = reinterpret_cast<const uint32_t*>(probs16 + u * width);
        for (int c = 0; c < 4; ++c) o[u][c] = _mm512_setzero_ps();
    }
    const __m512i low_half = _mm512_set1_epi32(0xFFFF);
    for (int64_t pg = 0; pg * 16 < keys; ++pg) {
        if (prefetch && (pg + 1) * 16 < keys)
            prefetch_page(vbase + table[pg + 1] * page_elems, page_elems * sizeof(bf16_t));
        const int32_t* vp = reinterpret_cast<const int32_t*>(vbase + table[pg] * page_elems);
        const int64_t in_page = std::min<int64_t>(16, keys - pg * 16);
        for (int64_t jj = 0; 2 * jj < in_page; ++jj) {
            const bool alone = 2 * jj + 1 == in_page;
            __m512bh v[4];
            for (int c = 0; c < 4; ++c) {
                const __m512i raw = _mm512_loadu_si512(vp + jj * 64 + c * 16);
                v[c] = (__m512bh)(alone ? _mm512_and_si512(raw, low_half) : raw);
            }
            for (int u = 0; u < U; ++u) {
                const __m512bh p = (__m512bh)_mm512_set1_epi32(int(pr[u][pg * 8 + jj]));
                for (int c = 0; c < 4; ++c) o[u][c] = _mm512_dpbf16_ps(o[u][c], p, v[c]);
            }
        }
    }
    for (int u = 0; u < U; ++u)
        for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + u * 64 + c * 16, o[u][c]);
}

inline void dot_pv(const bf16_t* vbase, const int64_t* table, int64_t page_elems, int64_t keys,
                   const bf16_t* probs16, int64_t width, int64_t nq, float* acc) {
    int64_t q = 0;
    for (; q + 4 <= nq; q += 4)  // the first pass over the pages fetches them ahead; later ones find them cached
        pv_rows<4>(vbase, table, page_elems, keys, q == 0, probs16 + q * width, width, acc + q * 64);
    switch (nq - q) {
        case 3: pv_rows<3>(vbase, table, page_elems, keys, q == 0, probs16 + q * width, width, acc + q * 64); break;
        case 2: pv_rows<2>(vbase, table, page_elems, keys, q == 0, probs16 + q * width, width, acc + q * 64); break;
        case 1: pv_rows<1>(vbase, table, page_elems, keys, q == 0, probs16 + q * width, width, acc + q * 64); break;
    }
}

// the probabilities at bf16, sixteen at a time (width is a whole number of 16-key pages)
inline void round_probs(const float* scores, int64_t n, bf16_t* out) {
    for (int64_t k = 0; k < n; k += 16) st16(out + k, _mm512_loadu_ps(scores + k));
}
#else
template <typename T, int PS, int DIM>
constexpr bool kDotPath = false;
inline void dot_scores_page(const bf16_t*, const float*, int64_t, float*, int64_t) {}
inline void dot_pv(const bf16_t*, const int64_t*, int64_t, int64_t, const bf16_t*, int64_t, int64_t, float*) {}
inline void round_probs(const float*, int64_t, bf16_t*) {}
#endif

// bf16 pages of the common shape on CPUs with AVX2 + FMA but no AVX512-BF16 (Zen 2/3, older
// Intel): a pair of bf16 in a uint32 is two fp32 after one shift (the first, low half) and one
// AND (the second), so pages are widened in registers as they lie; the generic path widened
// them element by element through k_at/v_at first (8.7 ms against ~1 ms a decode layer of 32
// rows x 320 keys). q is fp32 (pre-scaled) and the probabilities stay fp32: nothing is rounded
// to bf16 on the way, unlike vdpbf16ps.
#if defined(KVFENCE_AVX2)
using namespace kvfence_avx2;
template <typename T, int PS, int DIM>
constexpr bool kWidePath = std::is_same<T, bf16_t>::value && PS == 16 && DIM == 64;

// scores[u][0..16) for U queries against one K page ([32 dim pairs][16 positions] of uint32);
// qf: per query 64 fp32 (pre-scaled), 64 apart
template <int U>
inline void wide_score_tile(const uint32_t* kpair, const float* qf, float* scores, int64_t width) {
    __m256 acc[U][2];
    for (int u = 0; u < U; ++u) acc[u][0] = acc[u][1] = _mm256_setzero_ps();
    for (int i = 0; i < 32; ++i) {
        const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kpair + 16 * i));
        const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kpair + 16 * i + 8));
        const __m256 e0 = pair_lo(r0), e1 = pair_lo(r1), o0 = pair_hi(r0), o1 = pair_hi(r1);
        for (int u = 0; u < U; ++u) {
            const __m256 qe = _mm256_broadcast_ss(qf + u * 64 + 2 * i);
            const __m256 qo = _mm256_broadcast_ss(qf + u * 64 + 2 * i + 1);
            acc[u][0] = _mm256_fmadd_ps(o0, qo, _mm256_fmadd_ps(e0, qe, acc[u][0]));
            acc[u][1] = _mm256_fmadd_ps(o1, qo, _mm256_fmadd_ps(e1, qe, acc[u][1]));
        }
    }
    for (int u = 0; u < U; ++u) {
        _mm256_storeu_ps(scores + u * width, acc[u][0]);
        _mm256_storeu_ps(scores + u * width + 8, acc[u][1]);
    }
}

inline void wide_scores_page(const bf16_t* kp, const float* qf, int64_t nq_pad, float* scores, int64_t width) {
    const uint32_t* kpair = reinterpret_cast<const uint32_t*>(kp);
    for (int64_t q0 = 0; q0 < nq_pad; q0 += kQueryTile)
        wide_score_tile<kQueryTile>(kpair, qf + q0 * 64, scores + q0 * width, width);
}

// acc[q][0..64) = probabilities . v over keys 0 .. keys-1, one query at a time with its 64
// dims in 8 registers. V pages are [8 position pairs][64 dims] of uint32. Where keys is odd,
// the last pair's second position is past the row's keys (stale, or NaN from a poison
// scrub): its half is never widened, so it cannot reach the sum.
inline void wide_pv(const bf16_t* vbase, const int64_t* table, int64_t page_elems, int64_t keys,
                    const float* probs, int64_t width, int64_t nq, float* acc) {
    for (int64_t q = 0; q < nq; ++q) {
        const float* pr = probs + q * width;
        __m256 o[8];
        for (int c = 0; c < 8; ++c) o[c] = _mm256_setzero_ps();
        for (int64_t pg = 0; pg * 16 < keys; ++pg) {
            if (q == 0 && (pg + 1) * 16 < keys)
                prefetch_page(vbase + table[pg + 1] * page_elems, page_elems * sizeof(bf16_t));
            const uint32_t* vp = reinterpret_cast<const uint32_t*>(vbase + table[pg] * page_elems);
            const int64_t in_page = std::min<int64_t>(16, keys - pg * 16);
            for (int64_t jj = 0; 2 * jj < in_page; ++jj) {
                const __m256 pe = _mm256_set1_ps(pr[pg * 16 + 2 * jj]);
                if (2 * jj + 1 == in_page) {
                    for (int c = 0; c < 8; ++c) {
                        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp + jj * 64 + 8 * c));
                        o[c] = _mm256_fmadd_ps(pair_lo(raw), pe, o[c]);
                    }
                } else {
                    const __m256 po = _mm256_set1_ps(pr[pg * 16 + 2 * jj + 1]);
                    for (int c = 0; c < 8; ++c) {
                        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp + jj * 64 + 8 * c));
                        o[c] = _mm256_fmadd_ps(pair_hi(raw), po, _mm256_fmadd_ps(pair_lo(raw), pe, o[c]));
                    }
                }
            }
        }
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + q * 64 + 8 * c, o[c]);
    }
}
#else
template <typename T, int PS, int DIM>
constexpr bool kWidePath = false;
inline void wide_scores_page(const bf16_t*, const float*, int64_t, float*, int64_t) {}
inline void wide_pv(const bf16_t*, const int64_t*, int64_t, int64_t, const float*, int64_t, int64_t, float*) {}
#endif

// s[0 .. visible) becomes its softmax, s[visible .. width) zeros
inline void softmax_row(float* s, int64_t visible, int64_t width) {
#if defined(__AVX512BF16__)
    // sixteen lanes at a time: a scalar max does not vectorize without -ffast-math, and in a
    // prefill this row work is as large as the dot products
    __m512 vmx = _mm512_set1_ps(-INFINITY);
    int64_t k = 0;
    for (; k + 16 <= visible; k += 16) vmx = _mm512_max_ps(vmx, _mm512_loadu_ps(s + k));
    const __mmask16 tail = __mmask16((1u << (visible - k)) - 1);
    vmx = _mm512_mask_max_ps(vmx, tail, vmx, _mm512_maskz_loadu_ps(tail, s + k));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmx));
    __m512 vsum = _mm512_setzero_ps();
    for (k = 0; k + 16 <= visible; k += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + k), mx));
        _mm512_storeu_ps(s + k, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    if (tail) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + k), mx));
        _mm512_mask_storeu_ps(s + k, tail, e);
        vsum = _mm512_mask_add_ps(vsum, tail, vsum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (k = 0; k + 16 <= visible; k += 16) _mm512_storeu_ps(s + k, _mm512_mul_ps(_mm512_loadu_ps(s + k), inv));
    if (tail) _mm512_mask_storeu_ps(s + k, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + k), inv));
#elif defined(KVFENCE_AVX2)
    // eight lanes at a time, as above; the tail (fewer than 8 keys) scalar
    int64_t k = 0;
    __m256 vmx = _mm256_set1_ps(-INFINITY);
    for (; k + 8 <= visible; k += 8) vmx = _mm256_max_ps(vmx, _mm256_loadu_ps(s + k));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, vmx);
    float mx = lanes[0];
    for (int i = 1; i < 8; ++i) mx = std::max(mx, lanes[i]);
    for (int64_t j = k; j < visible; ++j) mx = std::max(mx, s[j]);
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (k = 0; k + 8 <= visible; k += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + k), vm));
        _mm256_storeu_ps(s + k, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_store_ps(lanes, vsum);
    float sum = 0.f;
    for (int i = 0; i < 8; ++i) sum += lanes[i];
    for (int64_t j = k; j < visible; ++j) {
        s[j] = exp_approx(s[j] - mx);
        sum += s[j];
    }
    const float inv = 1.0f / sum;
    const __m256 vinv = _mm256_set1_ps(inv);
    for (k = 0; k + 8 <= visible; k += 8) _mm256_storeu_ps(s + k, _mm256_mul_ps(_mm256_loadu_ps(s + k), vinv));
    for (int64_t j = k; j < visible; ++j) s[j] *= inv;
#else
    float mx = -INFINITY;
    for (int64_t k = 0; k < visible; ++k) mx = std::max(mx, s[k]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t k = 0; k < visible; ++k) {
        const float e = exp_approx(s[k] - mx);
        s[k] = e;
        sum += e;
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t k = 0; k < visible; ++k) s[k] *= inv;
#endif
    std::fill(s + visible, s + width, 0.f);
}

template <typename T, int PS, int DIM>
void attend_task(const Task& t, const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                 int64_t head_stride, const int64_t* table, const int64_t* q_start, const int64_t* q_len,
                 const int64_t* kv_len, T* out, int64_t out_stride, int heads, int kv_heads, int dim_rt,
                 int page_size_rt, float scale) {
    const int ps = PS ? PS : page_size_rt;
    const int dim = DIM ? DIM : dim_rt;
    const int group = heads / kv_heads;
    const int64_t nq = t.count * group;                        // queries in this task
    const int64_t ctx = kv_len[t.row] - q_len[t.row];          // keys before the row's first query
    const int64_t last_visible = ctx + t.first + t.count;      // keys the block's last query sees
    const int64_t npages = (last_visible + ps - 1) / ps;
    const int64_t width = npages * ps;
    const int64_t nq_pad = (nq + kQueryTile - 1) / kQueryTile * kQueryTile;
    const size_t need = size_t(nq_pad) * (width + 2 * dim) + size_t(ps) * dim + size_t(nq) * width / 2 + 16;
    if (tl_buf.size() < need) tl_buf.resize(need);
    float* scores = tl_buf.data();                  // [nq_pad][width]
    float* qf = scores + nq_pad * width;            // [nq_pad][dim], pre-scaled; padding rows zero
    float* acc = qf + nq_pad * dim;                 // [nq_pad][dim]
    float* kf = acc + nq_pad * dim;                 // one page in fp32: K [dim][ps] or V [ps][dim] (general path)
    bf16_t* probs16 = reinterpret_cast<bf16_t*>(kf + ps * dim);  // [nq][width] (dot path)

    for (int64_t p = 0; p < t.count; ++p) {
        const T* qrow = q + (q_start[t.row] + t.first + p) * q_stride;
        for (int g = 0; g < group; ++g) {
            const T* qh = qrow + int64_t(t.kv_head * group + g) * dim;
            float* dst = qf + (p * group + g) * dim;
            if constexpr (kDotPath<T, PS, DIM>) {  // bf16 pairs (q[2i], q[2i+1]), then the scale
                uint32_t* pairs = reinterpret_cast<uint32_t*>(dst);
                for (int i = 0; i < DIM / 2; ++i) pairs[i] = uint32_t(qh[2 * i]) | (uint32_t(qh[2 * i + 1]) << 16);
                dst[DIM / 2] = scale;
            } else {
#pragma omp simd
                for (int d = 0; d < dim; ++d) dst[d] = to_f(qh[d]) * scale;
            }
        }
    }
    std::fill(qf + nq * dim, qf + nq_pad * dim, 0.f);

    const T* kbase = k_cache + t.kv_head * head_stride;
    const T* vbase = v_cache + t.kv_head * head_stride;
    const int64_t page_elems = int64_t(ps) * dim;

    // scores = q . k for every key of every page the block can see. K lanes of the last page
    // past the row's keys are computed with the page and dropped below: they never reach a
    // softmax, so an unwritten slot (stale or NaN) cannot leak into the output.
    if constexpr (kDotPath<T, PS, DIM> || kWidePath<T, PS, DIM>) {
        for (int64_t pg = 0; pg < npages; ++pg) {
            // a row's pages lie anywhere in the pool: fetch the next one while this one computes
            if (pg + 1 < npages) prefetch_page(kbase + table[pg + 1] * page_elems, page_elems * sizeof(T));
            else prefetch_page(vbase + table[0] * page_elems, page_elems * sizeof(T));
            if constexpr (kDotPath<T, PS, DIM>)
                dot_scores_page(kbase + table[pg] * page_elems, qf, nq_pad, scores + pg * ps, width);
            else
                wide_scores_page(kbase + table[pg] * page_elems, qf, nq_pad, scores + pg * ps, width);
        }
    } else {
        for (int64_t pg = 0; pg < npages; ++pg) {
            const T* kp = kbase + table[pg] * page_elems;
            for (int d = 0; d < dim; ++d)
                for (int j = 0; j < ps; ++j) kf[d * ps + j] = to_f(kp[k_at(d, j, ps)]);
            for (int64_t q0 = 0; q0 < nq_pad; q0 += kQueryTile) {
                float sc[kQueryTile][PS ? PS : kMaxPage] = {};
                const float* qv = qf + q0 * dim;
                for (int d = 0; d < dim; ++d) {
                    const float* kr = kf + int64_t(d) * ps;
                    for (int u = 0; u < kQueryTile; ++u) {
                        const float qd = qv[u * dim + d];
    #pragma omp simd
                        for (int j = 0; j < ps; ++j) sc[u][j] += qd * kr[j];
                    }
                }
                for (int u = 0; u < kQueryTile; ++u)
                    std::memcpy(scores + (q0 + u) * width + pg * ps, sc[u], sizeof(float) * ps);
            }
        }
    }

    // softmax per query over the keys it may see; the rest of the row becomes 0
    for (int64_t qi = 0; qi < nq; ++qi)
        softmax_row(scores + qi * width, ctx + t.first + qi / group + 1, width);

    // acc = probabilities . v, over the row's keys only
    if constexpr (kDotPath<T, PS, DIM>) {
        round_probs(scores, nq * width, probs16);  // rows are width apart in both
        dot_pv(vbase, table, page_elems, last_visible, probs16, width, nq, acc);
    } else if constexpr (kWidePath<T, PS, DIM>) {
        wide_pv(vbase, table, page_elems, last_visible, scores, width, nq, acc);
    } else {
        std::fill(acc, acc + nq * dim, 0.f);
        for (int64_t pg = 0; pg < npages; ++pg) {
            const T* vp = vbase + table[pg] * page_elems;
            const int64_t keys = std::min<int64_t>(ps, last_visible - pg * ps);
            for (int64_t j = 0; j < keys; ++j)  // only the row's keys: a slot past them is never read
                for (int d = 0; d < dim; ++d) kf[j * dim + d] = to_f(vp[v_at(j, d, dim)]);
            for (int64_t qi = 0; qi < nq; ++qi) {
                const float* pr = scores + qi * width + pg * ps;
                float a[DIM ? DIM : kMaxDim];
                std::memcpy(a, acc + qi * dim, sizeof(float) * dim);
                for (int64_t j = 0; j < keys; ++j) {
                    const float w = pr[j];
                    const float* vr = kf + j * dim;
    #pragma omp simd
                    for (int d = 0; d < dim; ++d) a[d] += w * vr[d];
                }
                std::memcpy(acc + qi * dim, a, sizeof(float) * dim);
            }
        }
    }

    for (int64_t p = 0; p < t.count; ++p) {
        T* orow = out + (q_start[t.row] + t.first + p) * out_stride;
        for (int g = 0; g < group; ++g) {
            T* oh = orow + int64_t(t.kv_head * group + g) * dim;
            const float* a = acc + (p * group + g) * dim;
#pragma omp simd
            for (int d = 0; d < dim; ++d) oh[d] = from_f<T>(a[d]);
        }
    }
}

// Returns 0; -(1 + row) for the first row whose table or lengths are out of range; -1e9 for
// a page size or head dim beyond the general path's bounds. Nothing is read on an error.
template <typename T>
int64_t paged_attention(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, int64_t head_stride,
                        int64_t num_pages, const int64_t* pages, int64_t max_pages, const int64_t* q_start,
                        const int64_t* q_len, const int64_t* kv_len, int64_t rows, int64_t n_tokens, T* out,
                        int64_t out_stride, int heads, int kv_heads, int dim, int page_size, float scale, int nt) {
    if (page_size < 1 || page_size > kMaxPage || dim < 1 || dim > kMaxDim || heads % kv_heads != 0)
        return -1000000000;
    std::vector<Task> tasks;
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t need = (kv_len[r] + page_size - 1) / page_size;
        if (q_len[r] < 1 || kv_len[r] < q_len[r] || need > max_pages) return -(1 + r);
        if (q_start[r] < 0 || q_start[r] + q_len[r] > n_tokens) return -(1 + r);  // its queries and outputs
        for (int64_t pg = 0; pg < need; ++pg) {
            const int64_t p = pages[r * max_pages + pg];
            if (p < 0 || p >= num_pages) return -(1 + r);
        }
        for (int kh = 0; kh < kv_heads; ++kh)
            for (int64_t f = 0; f < q_len[r]; f += kQueryBlock)
                tasks.push_back({r, kh, f, std::min<int64_t>(kQueryBlock, q_len[r] - f)});
    }
    const int64_t ntasks = int64_t(tasks.size());
    const bool fast = page_size == 16 && dim == 64;
#pragma omp parallel for num_threads(nt) schedule(dynamic, 1) if (ntasks > 1)
    for (int64_t i = 0; i < ntasks; ++i) {
        const Task& t = tasks[i];
        const int64_t* table = pages + t.row * max_pages;
        if (fast)
            attend_task<T, 16, 64>(t, q, q_stride, k_cache, v_cache, head_stride, table, q_start, q_len, kv_len,
                                   out, out_stride, heads, kv_heads, dim, page_size, scale);
        else
            attend_task<T, 0, 0>(t, q, q_stride, k_cache, v_cache, head_stride, table, q_start, q_len, kv_len,
                                 out, out_stride, heads, kv_heads, dim, page_size, scale);
    }
    return 0;
}

// index of the largest value of x[0..n), the first on ties; a NaN counts as the largest (the
// first NaN wins), as torch.argmax
inline int64_t argmax_row(const float* x, int64_t n) {
#if defined(__AVX512BF16__)
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_at = _mm512_set1_epi32(0), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nan = 0;
    int64_t k = 0;
    if (n < (int64_t(1) << 31)) {
        for (; k + 16 <= n; k += 16) {
            const __m512 v = _mm512_loadu_ps(x + k);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: a lane keeps its first
            best = _mm512_mask_mov_ps(best, gt, v);
            best_at = _mm512_mask_mov_epi32(best_at, gt, at);
            at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
        }
    }
    int64_t idx = -1;
    float mx = -INFINITY;
    if (!nan && k > 0) {
        mx = _mm512_reduce_max_ps(best);
        const __mmask16 hit = _mm512_cmp_ps_mask(best, _mm512_set1_ps(mx), _CMP_EQ_OQ);
        idx = _mm512_mask_reduce_min_epi32(hit, best_at);  // the earliest among lanes holding the max
    } else if (nan) {
        k = 0;
    }
    for (; k < n; ++k) {
        if (std::isnan(x[k])) return k;
        if (idx < 0 || x[k] > mx) { mx = x[k]; idx = k; }
    }
    return idx;
#else
    int64_t idx = 0;
    for (int64_t k = 0; k < n; ++k) {
        if (std::isnan(x[k])) return k;
        if (x[k] > x[idx]) idx = k;
    }
    return idx;
#endif
}

}  // namespace

// dtype codes: 0 = float32, 1 = bfloat16
#define KV_DISPATCH(dtype, CALL)                       \
    do {                                               \
        if ((dtype) == 0) { typedef float T; CALL; }   \
        else { typedef bf16_t T; CALL; }               \
    } while (0)

extern "C" {

int kvfence_kernels_version() { return 1; }

void kvfence_argmax_rows(const float* x, int64_t rows, int64_t cols, int64_t* out, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static) if (rows > 1 && rows * cols >= (1 << 16))
    for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * cols, cols);
}

int64_t kvfence_apply_token_mask(float* x, int64_t x_rows, int64_t cols, const int64_t* rows, int64_t n,
                                 const uint32_t* mask, int64_t words, int nt) {
    // every row index is checked before anything is written
    for (int64_t r = 0; r < n; ++r)
        if (rows[r] < 0 || rows[r] >= x_rows) return -1;
    const int64_t covered = cols < words * 32 ? cols : words * 32;
    const float ninf = -std::numeric_limits<float>::infinity();
#pragma omp parallel for num_threads(nt) schedule(static) if (n > 1 && n * cols >= (1 << 16))
    for (int64_t r = 0; r < n; ++r) {
        float* row = x + rows[r] * cols;
        const uint32_t* m = mask + r * words;
        for (int64_t w = 0; w * 32 < covered; ++w) {
            const uint32_t bits = m[w];
            const int64_t base = w * 32, end = base + 32 < covered ? base + 32 : covered;
            if (bits == 0xFFFFFFFFu && end - base == 32) continue;   // a word of allowed tokens: nothing to write
            for (int64_t c = base; c < end; ++c)
                if (!((bits >> (c - base)) & 1u)) row[c] = ninf;
        }
        for (int64_t c = covered; c < cols; ++c) row[c] = ninf;     // past the grammar's vocabulary
    }
    return 0;
}

void kvfence_add_rms_norm_f32res(float* h, const bf16_t* delta, const bf16_t* w, bf16_t* out, int64_t n,
                                  int64_t dim, float eps, int nt) {
    add_rms_norm_f32res(h, delta, w, out, n, dim, eps, nt);
}

void kvfence_add_rms_norm(int dtype, void* h, const void* delta, const void* w, void* out, int64_t n, int64_t dim,
                          float eps, int nt) {
    KV_DISPATCH(dtype, add_rms_norm<T>((T*)h, (const T*)delta, (const T*)w, (T*)out, n, dim, eps, nt));
}

int64_t kvfence_rope_store(int dtype, void* qkv, int64_t n, int64_t row_stride, int heads, int kv_heads, int dim,
                           const int64_t* positions, int64_t num_positions, const void* cos, const void* sin,
                           void* k_cache, void* v_cache, int64_t head_stride, const int64_t* slots, int page_size,
                           int nt) {
    int64_t rc = 0;
    KV_DISPATCH(dtype, rc = rope_store<T>((T*)qkv, n, row_stride, heads, kv_heads, dim, positions, num_positions,
                                          (const T*)cos, (const T*)sin, (T*)k_cache, (T*)v_cache, head_stride,
                                          slots, page_size, nt));
    return rc;
}

void kvfence_silu_mul(int dtype, const void* gu, void* out, int64_t n, int64_t inter, int nt) {
    KV_DISPATCH(dtype, silu_mul<T>((const T*)gu, (T*)out, n, inter, nt));
}

int64_t kvfence_paged_attention(int dtype, const void* q, int64_t q_stride, const void* k_cache,
                                const void* v_cache, int64_t head_stride, int64_t num_pages, const int64_t* pages,
                                int64_t max_pages, const int64_t* q_start, const int64_t* q_len,
                                const int64_t* kv_len, int64_t rows, int64_t n_tokens, void* out,
                                int64_t out_stride, int heads, int kv_heads, int dim, int page_size, float scale,
                                int nt) {
    int64_t rc = 0;
    KV_DISPATCH(dtype, rc = paged_attention<T>((const T*)q, q_stride, (const T*)k_cache, (const T*)v_cache,
                                               head_stride, num_pages, pages, max_pages, q_start, q_len, kv_len,
                                               rows, n_tokens, (T*)out, out_stride, heads, kv_heads, dim, page_size,
                                               scale, nt));
    return rc;
}

}  // extern "C"
