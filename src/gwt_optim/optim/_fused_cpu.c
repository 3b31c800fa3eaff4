/*
 * Fused CPU kernels of the GWT-AdamW step with the Haar wavelet.
 *
 * Built on first use by gwt_optim._toolchain with the system C compiler
 * (what torch.compile needs on CPU too) and called through ctypes
 * (gwt_optim.optim._native). For rows
 * of n entries cut into blocks of B = 2^level columns (the last block
 * zero-padded), with h = 2^(-level/2):
 *
 *   phase 1  A_k = h * sum(block_k), for every row first: a gradient with a
 *            NaN or an infinity leaves M and V untouched (returns NaN)
 *            M = lerp(M, A, 1 - beta1), V = beta2 V + (1 - beta2) A^2
 *            d_k = 1 / den_k, den = sqrt(V) + eps2   (d_k = 0 where den_k = 0)
 *            t_k = h (M_k - A_k) d_k
 *            returns sum_k (M_k d_k)^2, the limiter's squared norm
 *   phase 2  W = W * decay - step * coef * (G d_k + t_k) on block k
 *            or, with detail_clip c, with u_k = h M_k d_k:
 *            W = W * decay - step * coef * (u_k + clamp(G d_k + t_k - u_k, -c, c))
 *
 * which is the closed form of the inverse transform in functional._haar_delta
 * with q = coef d and c = coef t. d and t are an A-sized workspace the caller
 * passes between the phases, so phase 2 neither recomputes the block sums
 * nor a square root and a division per block. When the caller runs phase 2
 * of a parameter right after its phase 1, the gradient and the workspace
 * are still in cache and the step reads G, M and V once and W once.
 *
 * gwt_adamw_haar_steps_* runs whole steps of many parameters -- phase 1,
 * Fira's limiter and phase 2 -- in one call and one OpenMP region: each
 * thread takes one parameter at a time and runs its phase 2 interleaved with
 * the first pass of the next one's phase 1 (see DEFINE_STEPS), with one fork
 * and join per optimizer step instead of two per parameter, which matters
 * most when other processes compete for the cores. The limiter's norm s is
 * read and written in place, in the parameter's state.
 *
 * Everything is written as simple loops over contiguous arrays that GCC and
 * Clang vectorize at -O3 (with -fno-trapping-math, so that the selects
 * around the divisions are if-converted), plus AVX2 kernels for the float
 * blocks of 2 and 4 entries that compilers do not vectorize well. Each
 * kernel is instantiated for float and double, and specialized for block
 * sizes 2, 4, 8 and 16, so the block loops unroll; larger levels use a
 * generic block size. bf16 weights and gradients (with float moments) run on
 * the float kernels a row segment at a time.
 */
#include <stddef.h>
#include <stdint.h>
#include <tgmath.h> /* sqrt of a float stays a float */
#ifdef _OPENMP
#include <omp.h>
#define THREAD_NUM() omp_get_thread_num()
#else
#define THREAD_NUM() 0
#endif

typedef struct {
    double h;     /* 2^(-level/2) */
    double w1;    /* 1 - beta1, the lerp weight of M */
    double beta2;
    double eps2;  /* eps * sqrt(1 - beta2^t): torch AdamW's eps after bias correction */
    double scale; /* step * coef: lr * bias correction * alpha / r (phase 2) */
    double decay; /* 1 - lr * weight_decay (phase 2) */
    double clip;  /* detail_clip: clamp of the normalized details (phase 2); 0 = off */
} gwt_hyper;

/* One parameter's whole step for gwt_adamw_haar_steps_*. */
typedef struct {
    void *w;            /* (rows, n) parameter */
    const void *g;      /* (rows, n) gradient */
    void *m, *v;        /* (rows, ceil(n / 2^level)) moments */
    int64_t rows, n;
    int32_t level;
    int32_t first;      /* step 1: the limiter only records the norm (so it does at s = 0) */
    int32_t skipped;    /* out: the gradient was not finite, nothing was changed */
    double gamma;       /* the limiter's growth limit; 0 = no limiter */
    double limiter_eps; /* keeps norm / s finite at s = 0 */
    void *snorm;        /* the limiter's last norm s (0-d, the moments' type): read, then updated */
    gwt_hyper hyper;    /* hyper.scale is before the division by r */
} gwt_task;

/* Fira's norm-growth limiter, as functional.limiter_ratio: r, and s <- norm / r.
 * No norm recorded yet (a first step, or only skipped non-finite ones) starts
 * the limiter. */
static double limiter_ratio(const gwt_task *task, double norm_sq, double *s) {
    if (task->gamma <= 0) return 1.0;
    const double norm = sqrt(norm_sq);
    const int first = task->first || !(*s > 0);
    const double r = first ? 1.0 : fmax(norm / (*s + task->limiter_eps), task->gamma) / task->gamma;
    *s = norm / r;
    return r;
}

/* Blocks per chunk of the phase-1 block sums and the phase-2 expansion of
 * small blocks: the chunk's temporaries stay in L1. */
#define CHUNK 256

#define MIN(a, b) ((a) < (b) ? (a) : (b))

/* Hand-vectorized float kernels for small blocks on AVX2. Phase 1 (blocks of
 * 2, 4 and 8): the block sums are horizontal adds, which compilers do not find
 * on their own. Each returns how many leading full blocks it did (a multiple
 * of 8); the portable loop does the rest. NO_SIMD (NO_SIMD2 for phase 2) does
 * nothing. */
#define NO_SIMD(g, a, full, h) 0
#define NO_SIMD2(w, g, d, t, full, sc, decay) 0
#define NO_SIMD3(w, g, m, d, t, full, hp) 0

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* The sums of 8 consecutive blocks of B floats, in block order. */
static inline __m256 block_sums_2(const float *g) {
    /* hadd gives blocks 0 1 4 5 | 2 3 6 7; swap the middle 64-bit lanes */
    __m256 s = _mm256_hadd_ps(_mm256_loadu_ps(g), _mm256_loadu_ps(g + 8));
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), 0xD8));
}

static inline __m256 block_sums_4(const float *g) {
    __m256 x = _mm256_hadd_ps(_mm256_loadu_ps(g), _mm256_loadu_ps(g + 8));
    __m256 y = _mm256_hadd_ps(_mm256_loadu_ps(g + 16), _mm256_loadu_ps(g + 24));
    /* blocks 0 2 4 6 | 1 3 5 7 */
    __m256 z = _mm256_hadd_ps(x, y);
    return _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline __m256 block_sums_8(const float *g) {
    __m256 s01 = _mm256_hadd_ps(_mm256_loadu_ps(g), _mm256_loadu_ps(g + 8));
    __m256 s23 = _mm256_hadd_ps(_mm256_loadu_ps(g + 16), _mm256_loadu_ps(g + 24));
    __m256 s45 = _mm256_hadd_ps(_mm256_loadu_ps(g + 32), _mm256_loadu_ps(g + 40));
    __m256 s67 = _mm256_hadd_ps(_mm256_loadu_ps(g + 48), _mm256_loadu_ps(g + 56));
    /* low halves of blocks 0-3 | high halves of blocks 0-3, same for 4-7 */
    __m256 t0 = _mm256_hadd_ps(s01, s23), t1 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

#define DEFINE_SUMS_AVX2(B)                                                         \
    static int64_t sums_avx2_##B(const float *restrict g, float *restrict a,       \
                                 int64_t full, float h) {                          \
        const __m256 hv = _mm256_set1_ps(h);                                       \
        int64_t k = 0;                                                             \
        for (; k + 8 <= full; k += 8)                                              \
            _mm256_storeu_ps(a + k, _mm256_mul_ps(block_sums_##B(g + k * (B)), hv)); \
        return k;                                                                  \
    }
DEFINE_SUMS_AVX2(2)
DEFINE_SUMS_AVX2(4)
DEFINE_SUMS_AVX2(8)

/* Phase 2 for float blocks of 2 and 4 on AVX2: the per-block factors of 8
 * blocks are spread over the entries with no temporaries. Returns how many
 * leading full blocks it did. A factor reaches the entries of vector j (of
 * B) by an in-lane permutation of a 128-bit broadcast load: blocks 0-3 in
 * both lanes for the first B/2 vectors, 4-7 for the rest. The cross-lane
 * permutation per factor and vector this replaces bounded the loop (one per
 * cycle, on one port): on LLaMA-60M's weights at 2 threads the clipped
 * step took 7% less time, the unclipped 3%, bit for bit the same. */
#define LANES(B, j)                                                                 \
    _mm256_setr_epi32(((8 * (j) + 0) / (B)) & 3, ((8 * (j) + 1) / (B)) & 3,         \
                      ((8 * (j) + 2) / (B)) & 3, ((8 * (j) + 3) / (B)) & 3,         \
                      ((8 * (j) + 4) / (B)) & 3, ((8 * (j) + 5) / (B)) & 3,         \
                      ((8 * (j) + 6) / (B)) & 3, ((8 * (j) + 7) / (B)) & 3)
#define HALF(p, B, j) _mm256_broadcast_ps((const __m128 *)((p) + ((j) >= (B) / 2 ? 4 : 0)))

#define DEFINE_PHASE2_AVX2(B)                                                       \
    static int64_t phase2_avx2_##B(float *restrict w, const float *restrict g,     \
                                   const float *restrict d, const float *restrict t, \
                                   int64_t full, float sc, float decay) {          \
        const __m256 scv = _mm256_set1_ps(sc), dec = _mm256_set1_ps(decay);        \
        int64_t k = 0;                                                             \
        for (; k + 8 <= full; k += 8)                                              \
            for (int j = 0; j < (B); ++j) {                                        \
                const __m256i lanes = LANES(B, j);                                 \
                const __m256 q = _mm256_permutevar_ps(                             \
                    _mm256_mul_ps(scv, HALF(d + k, B, j)), lanes);                 \
                const __m256 c = _mm256_permutevar_ps(                             \
                    _mm256_mul_ps(scv, HALF(t + k, B, j)), lanes);                 \
                float *wj = w + (B) * k + 8 * j;                                   \
                const __m256 x = _mm256_fmadd_ps(_mm256_loadu_ps(g + (B) * k + 8 * j), q, c); \
                _mm256_storeu_ps(wj, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(wj), dec), x)); \
            }                                                                      \
        return k;                                                                  \
    }
DEFINE_PHASE2_AVX2(2)
DEFINE_PHASE2_AVX2(4)
/* Clipped phase 2 for float blocks of 2 and 4 on AVX2, as phase2_avx2_*:
 * three per-block factors, d_k, shift_k = t_k - u_k and u_k = h M_k d_k. */
#define DEFINE_PHASE2_CLIP_AVX2(B)                                                  \
    static int64_t phase2_clip_avx2_##B(float *restrict w, const float *restrict g, \
                                        const float *restrict m, const float *restrict d, \
                                        const float *restrict t, int64_t full,     \
                                        const gwt_hyper *hp) {                     \
        const __m256 scv = _mm256_set1_ps((float)hp->scale);                       \
        const __m256 dec = _mm256_set1_ps((float)hp->decay);                       \
        const __m256 hv = _mm256_set1_ps((float)hp->h);                            \
        const __m256 cv = _mm256_set1_ps((float)hp->clip);                         \
        const __m256 negc = _mm256_sub_ps(_mm256_setzero_ps(), cv);                \
        int64_t k = 0;                                                             \
        for (; k + 8 <= full; k += 8)                                              \
            for (int j = 0; j < (B); ++j) {                                        \
                const __m256i lanes = LANES(B, j);                                 \
                const __m256 d4 = HALF(d + k, B, j);                               \
                const __m256 u4 = _mm256_mul_ps(_mm256_mul_ps(hv, HALF(m + k, B, j)), d4); \
                const __m256 s4 = _mm256_sub_ps(HALF(t + k, B, j), u4);            \
                const __m256 dd = _mm256_permutevar_ps(d4, lanes);                 \
                const __m256 ss = _mm256_permutevar_ps(s4, lanes);                 \
                const __m256 uu = _mm256_permutevar_ps(u4, lanes);                 \
                float *wj = w + (B) * k + 8 * j;                                   \
                __m256 x = _mm256_fmadd_ps(_mm256_loadu_ps(g + (B) * k + 8 * j), dd, ss); \
                x = _mm256_min_ps(_mm256_max_ps(x, negc), cv);                     \
                _mm256_storeu_ps(wj, _mm256_fnmadd_ps(scv, _mm256_add_ps(uu, x),   \
                                                      _mm256_mul_ps(_mm256_loadu_ps(wj), dec))); \
            }                                                                      \
        return k;                                                                  \
    }
DEFINE_PHASE2_CLIP_AVX2(2)
DEFINE_PHASE2_CLIP_AVX2(4)
#define SIMD_FLOAT_2 sums_avx2_2
#define SIMD3_FLOAT_2 phase2_clip_avx2_2
#define SIMD3_FLOAT_4 phase2_clip_avx2_4
#define SIMD_FLOAT_4 sums_avx2_4
#define SIMD_FLOAT_8 sums_avx2_8
#define SIMD2_FLOAT_2 phase2_avx2_2
#define SIMD2_FLOAT_4 phase2_avx2_4
#else
#define SIMD_FLOAT_2 NO_SIMD
#define SIMD_FLOAT_4 NO_SIMD
#define SIMD_FLOAT_8 NO_SIMD
#define SIMD2_FLOAT_2 NO_SIMD2
#define SIMD2_FLOAT_4 NO_SIMD2
#define SIMD3_FLOAT_2 NO_SIMD3
#define SIMD3_FLOAT_4 NO_SIMD3
#endif

/* Whether any of n entries is a NaN or an infinity: the largest magnitude
 * as an unsigned integer reaches the exponent's all-ones pattern. Integer max
 * has a one-cycle latency, so this runs at load throughput where a floating
 * point test (sum of x * 0) waits on its adds' latency. */
typedef uint32_t __attribute__((may_alias)) bits32;
typedef uint64_t __attribute__((may_alias)) bits64;

#define DEFINE_NONFINITE(T, NAME, BITS, MAGNITUDE, INF)                             \
    static int nonfinite_##NAME(const T *g, int64_t n) {                           \
        const BITS *b = (const BITS *)g;                                           \
        BITS top = 0;                                                              \
        _Pragma("omp simd reduction(max:top)")                                     \
        for (int64_t i = 0; i < n; ++i) {                                          \
            const BITS a = b[i] & (MAGNITUDE);                                     \
            top = a > top ? a : top;                                               \
        }                                                                          \
        return top >= (INF);                                                       \
    }
DEFINE_NONFINITE(float, float, bits32, 0x7fffffffu, 0x7f800000u)
DEFINE_NONFINITE(double, double, bits64, 0x7fffffffffffffffull, 0x7ff0000000000000ull)

#define NONFINITE(g, n) _Generic((g), const float *: nonfinite_float, const double *: nonfinite_double)((g), (n))

/* Phase 1, first pass, on one row of nblocks blocks of B entries, the last
 * one `tail` entries long when tail > 0 (then it is counted in nblocks):
 * a_k = h * sum(block_k). Returns nonzero when the row holds a NaN or an
 * infinity, checked on the entries themselves while the row is still in
 * cache. */
#define DEFINE_SUMS_ROW(T, NAME, B, BARG, SIMD)                                     \
    static int sums_row_##NAME(const T *restrict g, T *restrict a,                 \
                               int64_t nblocks, int64_t tail, int64_t BARG, T h) { \
        const int64_t full = tail ? nblocks - 1 : nblocks;                         \
        int64_t k = SIMD(g, a, full, h);                                           \
        for (; k < full; ++k) {                                                    \
            T s = 0;                                                               \
            for (int64_t j = 0; j < (B); ++j) s += g[k * (B) + j];                 \
            a[k] = s * h;                                                          \
        }                                                                          \
        if (tail) { /* the zero-padded last block */                               \
            T s = 0;                                                               \
            for (int64_t j = 0; j < tail; ++j) s += g[full * (B) + j];             \
            a[full] = s * h;                                                       \
        }                                                                          \
        return NONFINITE(g, full * (B) + tail);                                    \
    }

/* Phase 1, second pass, on one row: the moments from the block sums, which t
 * holds on entry and t_k = h (M_k - A_k) d_k replaces. Returns the row's
 * sum of (M_k d_k)^2. Never inlined: the vectorized sum's order is the
 * compiler's choice in each copy, and the batched steps and the per-parameter
 * entry points must sum a row the same way (step() and step_param agree to
 * the bit). */
#define DEFINE_UPDATE_ROW(T, NAME)                                                  \
    __attribute__((noinline))                                                      \
    static double update_row_##NAME(T *restrict m, T *restrict v, T *restrict d,   \
                                    T *restrict t, int64_t nb,                     \
                                    const gwt_hyper *hp) {                         \
        const T h = (T)hp->h, w1 = (T)hp->w1, w1c = (T)(1.0 - hp->w1);             \
        const T b2 = (T)hp->beta2, w2 = (T)(1.0 - hp->beta2), eps2 = (T)hp->eps2;  \
        /* torch's lerp switches formula at weight 0.5; so does this */            \
        const int lerp_low = hp->w1 < 0.5;                                         \
        T acc = 0;                                                                 \
        _Pragma("omp simd reduction(+:acc)")                                       \
        for (int64_t k = 0; k < nb; ++k) {                                         \
            const T ak = t[k];                                                     \
            const T mk = lerp_low ? m[k] + w1 * (ak - m[k])                        \
                                  : ak - (ak - m[k]) * w1c;                        \
            const T vk = v[k] * b2 + w2 * ak * ak;                                 \
            m[k] = mk;                                                             \
            v[k] = vk;                                                             \
            const T den = sqrt(vk) + eps2;                                         \
            T inv = (T)1 / (den > 0 ? den : (T)1);                                 \
            inv = den > 0 ? inv : (T)0;                                            \
            d[k] = inv;                                                            \
            t[k] = h * (mk - ak) * inv;                                            \
            acc += (mk * inv) * (mk * inv);                                        \
        }                                                                          \
        return (double)acc;                                                        \
    }

/* Phase 2 for blocks of at least 8 entries: the block is the vector. */
#define DEFINE_PHASE2_ROW_WIDE(T, NAME, B, BARG)                                    \
    static void phase2_row_##NAME(T *restrict w, const T *restrict g,              \
                                  const T *restrict d, const T *restrict t,        \
                                  int64_t nblocks, int64_t tail, int64_t BARG,     \
                                  const gwt_hyper *hp) {                           \
        const T sc = (T)hp->scale, decay = (T)hp->decay;                           \
        const int64_t full = tail ? nblocks - 1 : nblocks;                         \
        for (int64_t k = 0; k < full; ++k) {                                       \
            const T q = sc * d[k], c = sc * t[k];                                  \
            T *wk = w + k * (B);                                                   \
            const T *gk = g + k * (B);                                             \
            for (int64_t j = 0; j < (B); ++j) wk[j] = wk[j] * decay - (gk[j] * q + c); \
        }                                                                          \
        if (tail) {                                                                \
            const T q = sc * d[full], c = sc * t[full];                            \
            T *wk = w + full * (B);                                                \
            const T *gk = g + full * (B);                                          \
            for (int64_t j = 0; j < tail; ++j) wk[j] = wk[j] * decay - (gk[j] * q + c); \
        }                                                                          \
    }

/* Phase 2 for blocks of 2 and 4 entries: a vector spans several blocks, so
 * each chunk's per-block factors are first spread to per-entry ones. */
#define DEFINE_PHASE2_ROW_NARROW(T, NAME, B, SIMD)                                  \
    static void phase2_row_##NAME(T *restrict w, const T *restrict g,              \
                                  const T *restrict d, const T *restrict t,        \
                                  int64_t nblocks, int64_t tail, int64_t unused,   \
                                  const gwt_hyper *hp) {                           \
        (void)unused;                                                              \
        const T sc = (T)hp->scale, decay = (T)hp->decay;                           \
        const int64_t n = tail ? (nblocks - 1) * (B) + tail : nblocks * (B);       \
        const int64_t start = SIMD(w, g, d, t, tail ? nblocks - 1 : nblocks, sc, decay); \
        T qe[CHUNK * (B)], ce[CHUNK * (B)];                                        \
        for (int64_t k0 = start; k0 < nblocks; k0 += CHUNK) {                      \
            const int64_t nk = MIN(CHUNK, nblocks - k0);                           \
            const int64_t ne = MIN(nk * (B), n - k0 * (B));                        \
            for (int64_t k = 0; k < nk; ++k)                                       \
                for (int64_t j = 0; j < (B); ++j) {                                \
                    qe[k * (B) + j] = sc * d[k0 + k];                              \
                    ce[k * (B) + j] = sc * t[k0 + k];                              \
                }                                                                  \
            T *wc = w + k0 * (B);                                                  \
            const T *gc = g + k0 * (B);                                            \
            for (int64_t i = 0; i < ne; ++i)                                       \
                wc[i] = wc[i] * decay - (gc[i] * qe[i] + ce[i]);                   \
        }                                                                          \
    }

/* Phase 2 with detail_clip: G d_k + t_k - u_k is the normalized detail
 * (G - mean_k) / den_k, clamped before the approximation part u_k = h M_k d_k
 * is added back. u_k needs M, so this one reads the (2^-l sized) moment too.
 * Blocks of 8 or more entries are the vector; smaller ones take the SIMD
 * kernel where there is one, and spread each chunk's per-block factors to
 * entries first for the rest. */
#define DEFINE_PHASE2_CLIP_ROW(T, NAME, B, BARG, SIMD)                              \
    static void phase2_clip_row_##NAME(T *restrict w, const T *restrict g,         \
                                       const T *restrict m, const T *restrict d,   \
                                       const T *restrict t, int64_t nblocks,       \
                                       int64_t n, int64_t BARG, const gwt_hyper *hp) { \
        const T sc = (T)hp->scale, decay = (T)hp->decay, h = (T)hp->h;             \
        const T c = (T)hp->clip;                                                   \
        int64_t k = SIMD(w, g, m, d, t, n / (B), hp);                              \
        if ((B) >= 8) {                                                            \
            for (; k < nblocks; ++k) {                                             \
                const T dk = d[k], uk = h * m[k] * dk, shift = t[k] - uk;          \
                const int64_t j0 = k * (B), j1 = MIN(j0 + (B), n);                 \
                _Pragma("omp simd")                                                \
                for (int64_t j = j0; j < j1; ++j) {                                \
                    T x = g[j] * dk + shift;                                       \
                    x = x > c ? c : (x < -c ? -c : x);                             \
                    w[j] = w[j] * decay - sc * (uk + x);                           \
                }                                                                  \
            }                                                                      \
            return;                                                                \
        }                                                                          \
        T de[CHUNK * 8], se[CHUNK * 8], ue[CHUNK * 8];                             \
        const int64_t per = (CHUNK * 8) / (B);                                     \
        for (int64_t k0 = k; k0 < nblocks; k0 += per) {                           \
            const int64_t nk = MIN(per, nblocks - k0);                             \
            const int64_t ne = MIN(nk * (B), n - k0 * (B));                        \
            for (int64_t kk = 0; kk < nk; ++kk) {                                  \
                const T dk = d[k0 + kk], uk = h * m[k0 + kk] * dk;                 \
                const T shift = t[k0 + kk] - uk;                                   \
                for (int64_t j = 0; j < (B); ++j) {                                \
                    de[kk * (B) + j] = dk;                                         \
                    se[kk * (B) + j] = shift;                                      \
                    ue[kk * (B) + j] = uk;                                         \
                }                                                                  \
            }                                                                      \
            T *wc = w + k0 * (B);                                                  \
            const T *gc = g + k0 * (B);                                            \
            _Pragma("omp simd")                                                    \
            for (int64_t i = 0; i < ne; ++i) {                                     \
                T x = gc[i] * de[i] + se[i];                                       \
                x = x > c ? c : (x < -c ? -c : x);                                 \
                wc[i] = wc[i] * decay - sc * (ue[i] + x);                          \
            }                                                                      \
        }                                                                          \
    }

#define DEFINE_ROWS(T, NAME, SIMD2, SIMD4, SIMD8, P2SIMD2, P2SIMD4, P3SIMD2, P3SIMD4)                 \
    DEFINE_SUMS_ROW(T, NAME##_2, 2, unused, SIMD2)                                 \
    DEFINE_SUMS_ROW(T, NAME##_4, 4, unused, SIMD4)                                 \
    DEFINE_SUMS_ROW(T, NAME##_8, 8, unused, SIMD8)                                 \
    DEFINE_SUMS_ROW(T, NAME##_16, 16, unused, NO_SIMD)                             \
    DEFINE_SUMS_ROW(T, NAME##_any, b, b, NO_SIMD)                                  \
    DEFINE_UPDATE_ROW(T, NAME)                                                     \
    DEFINE_PHASE2_ROW_NARROW(T, NAME##_2, 2, P2SIMD2)                              \
    DEFINE_PHASE2_ROW_NARROW(T, NAME##_4, 4, P2SIMD4)                              \
    DEFINE_PHASE2_ROW_NARROW(T, NAME##_8, 8, NO_SIMD2)                             \
    DEFINE_PHASE2_ROW_NARROW(T, NAME##_16, 16, NO_SIMD2)                           \
    DEFINE_PHASE2_ROW_WIDE(T, NAME##_any, b, b)                                    \
    DEFINE_PHASE2_CLIP_ROW(T, NAME##_2, 2, unused, P3SIMD2)                        \
    DEFINE_PHASE2_CLIP_ROW(T, NAME##_4, 4, unused, P3SIMD4)                        \
    DEFINE_PHASE2_CLIP_ROW(T, NAME##_8, 8, unused, NO_SIMD3)                       \
    DEFINE_PHASE2_CLIP_ROW(T, NAME##_16, 16, unused, NO_SIMD3)                     \
    DEFINE_PHASE2_CLIP_ROW(T, NAME##_any, b, b, NO_SIMD3)

/* Row ranges [r0, r1) of one parameter: the block sums (phase 1, first pass;
 * nonzero for a non-finite gradient), the moments (phase 1, second pass; the
 * rows' sum of (M_k d_k)^2) and phase 2 (clipped when m is given). g and w
 * are contiguous (rows, n); m, v, d and t contiguous (rows, ceil(n / b)).
 * The parallel entry points and the batched steps are made of these. */
#define DEFINE_ROW_RANGES(T, NAME, SIMD2, SIMD4, SIMD8, P2SIMD2, P2SIMD4, P3SIMD2, P3SIMD4) \
    DEFINE_ROWS(T, NAME, SIMD2, SIMD4, SIMD8, P2SIMD2, P2SIMD4, P3SIMD2, P3SIMD4)  \
    static int sums_rows_##NAME(const T *g, T *t, int64_t r0, int64_t r1,          \
                                int64_t n, int64_t b, T h) {                       \
        int (*sums)(const T *restrict, T *restrict, int64_t, int64_t, int64_t, T) = \
            b == 2 ? sums_row_##NAME##_2 : b == 4 ? sums_row_##NAME##_4            \
            : b == 8 ? sums_row_##NAME##_8 : b == 16 ? sums_row_##NAME##_16        \
            : sums_row_##NAME##_any;                                               \
        const int64_t nb = (n + b - 1) / b, tail = n % b;                          \
        int bad = 0;                                                               \
        for (int64_t r = r0; r < r1; ++r) bad |= sums(g + r * n, t + r * nb, nb, tail, b, h); \
        return bad;                                                                \
    }                                                                              \
    static double update_rows_##NAME(T *m, T *v, T *d, T *t, int64_t r0, int64_t r1, \
                                     int64_t nb, const gwt_hyper *hp) {            \
        double total = 0;                                                          \
        for (int64_t r = r0; r < r1; ++r)                                          \
            total += update_row_##NAME(m + r * nb, v + r * nb, d + r * nb, t + r * nb, nb, hp); \
        return total;                                                              \
    }                                                                              \
    static void phase2_rows_##NAME(T *w, const T *g, const T *m, const T *d,       \
                                   const T *t, int64_t r0, int64_t r1, int64_t n,  \
                                   int64_t b, const gwt_hyper *hp) {               \
        const int64_t nb = (n + b - 1) / b, tail = n % b;                          \
        if (m) {                                                                   \
            void (*row)(T *restrict, const T *restrict, const T *restrict,         \
                        const T *restrict, const T *restrict, int64_t, int64_t,    \
                        int64_t, const gwt_hyper *) =                              \
                b == 2 ? phase2_clip_row_##NAME##_2 : b == 4 ? phase2_clip_row_##NAME##_4 \
                : b == 8 ? phase2_clip_row_##NAME##_8 : b == 16 ? phase2_clip_row_##NAME##_16 \
                : phase2_clip_row_##NAME##_any;                                    \
            for (int64_t r = r0; r < r1; ++r)                                      \
                row(w + r * n, g + r * n, m + r * nb, d + r * nb, t + r * nb, nb, n, b, hp); \
            return;                                                                \
        }                                                                          \
        void (*row)(T *restrict, const T *restrict, const T *restrict,             \
                    const T *restrict, int64_t, int64_t, int64_t,                  \
                    const gwt_hyper *) =                                           \
            b == 2 ? phase2_row_##NAME##_2 : b == 4 ? phase2_row_##NAME##_4        \
            : b == 8 ? phase2_row_##NAME##_8 : b == 16 ? phase2_row_##NAME##_16    \
            : phase2_row_##NAME##_any;                                             \
        for (int64_t r = r0; r < r1; ++r)                                          \
            row(w + r * n, g + r * n, d + r * nb, t + r * nb, nb, tail, b, hp);    \
    }

DEFINE_ROW_RANGES(float, float32, SIMD_FLOAT_2, SIMD_FLOAT_4, SIMD_FLOAT_8, SIMD2_FLOAT_2, SIMD2_FLOAT_4,
                  SIMD3_FLOAT_2, SIMD3_FLOAT_4)
DEFINE_ROW_RANGES(double, float64, NO_SIMD, NO_SIMD, NO_SIMD, NO_SIMD2, NO_SIMD2, NO_SIMD3, NO_SIMD3)

/* bf16 weights and gradients with float moments, on the float kernels: each
 * row is converted to float a segment of whole blocks at a time (in L1), and
 * the new weights are rounded to nearest even, as torch's .to(bfloat16)
 * does (a NaN becomes 0x7fc0, as there). A segment is SEG entries, which
 * bounds the block size: levels above BF16_MAX_LEVEL take the eager path
 * (the caller checks, with gwt_bf16_max_level). */
#define SEG 2048
#define BF16_MAX_LEVEL 11
typedef uint16_t bf16;

int gwt_bf16_max_level(void) { return BF16_MAX_LEVEL; }

static inline void bf16_to_float(const bf16 *restrict x, float *restrict y, int64_t n) {
    bits32 *yb = (bits32 *)y;
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) yb[i] = (uint32_t)x[i] << 16;
}

static inline void float_to_bf16(const float *restrict x, bf16 *restrict y, int64_t n) {
    const bits32 *xb = (const bits32 *)x;
    _Pragma("omp simd")
    for (int64_t i = 0; i < n; ++i) {
        const uint32_t u = xb[i];
        const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        y[i] = (bf16)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
    }
}

static int sums_rows_bfloat16(const bf16 *g, float *t, int64_t r0, int64_t r1, int64_t n,
                              int64_t b, float h) {
    const int64_t nb = (n + b - 1) / b;
    float buf[SEG];
    int bad = 0;
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t j0 = 0; j0 < n; j0 += SEG) {
            const int64_t len = MIN(SEG, n - j0);
            bf16_to_float(g + r * n + j0, buf, len);
            bad |= sums_rows_float32(buf, t + r * nb + j0 / b, 0, 1, len, b, h);
        }
    return bad;
}

static double update_rows_bfloat16(float *m, float *v, float *d, float *t, int64_t r0, int64_t r1,
                                   int64_t nb, const gwt_hyper *hp) {
    return update_rows_float32(m, v, d, t, r0, r1, nb, hp);
}

static void phase2_rows_bfloat16(bf16 *w, const bf16 *g, const float *m, const float *d,
                                 const float *t, int64_t r0, int64_t r1, int64_t n, int64_t b,
                                 const gwt_hyper *hp) {
    const int64_t nb = (n + b - 1) / b;
    float wb[SEG], gb[SEG];
    for (int64_t r = r0; r < r1; ++r)
        for (int64_t j0 = 0; j0 < n; j0 += SEG) {
            const int64_t len = MIN(SEG, n - j0), k0 = r * nb + j0 / b;
            bf16_to_float(g + r * n + j0, gb, len);
            bf16_to_float(w + r * n + j0, wb, len);
            phase2_rows_float32(wb, gb, m ? m + k0 : NULL, d + k0, t + k0, 0, 1, len, b, hp);
            float_to_bf16(wb, w + r * n + j0, len);
        }
}

/* The exported phases of one parameter, rows split across nthreads OpenMP
 * threads (the runtime torch already loaded). WT is the weight and gradient
 * type, T the moments' (and the limiter's s). */
#define DEFINE_ENTRY_POINTS(WT, T, NAME)                                            \
    /* Sets *bad, and changes nothing, when the gradient is not finite: the    \
     * block sums of every row come first, the moments after. */               \
    static double phase1_##NAME(const WT *g, T *m, T *v, T *d, T *t,              \
                                int64_t rows, int64_t n, int level,               \
                                const gwt_hyper *hp, int nthreads, int *bad_out) { \
        const int64_t b = (int64_t)1 << level, nb = (n + b - 1) / b;               \
        const T h = (T)hp->h;                                                      \
        int bad = 0;                                                               \
        double total = 0;                                                          \
        _Pragma("omp parallel num_threads(nthreads)")                              \
        {                                                                          \
            _Pragma("omp for schedule(static) reduction(|:bad)")                   \
            for (int64_t r = 0; r < rows; ++r)                                     \
                bad |= sums_rows_##NAME(g, t, r, r + 1, n, b, h);                  \
            /* every thread must see the reduced flag before branching on it */   \
            _Pragma("omp barrier")                                                 \
            if (!bad) {                                                            \
                _Pragma("omp for schedule(static) reduction(+:total)")             \
                for (int64_t r = 0; r < rows; ++r)                                 \
                    total += update_rows_##NAME(m, v, d, t, r, r + 1, nb, hp);     \
            }                                                                      \
        }                                                                          \
        *bad_out = bad;                                                            \
        return total;                                                              \
    }                                                                              \
    /* Returns NaN, and changes nothing, when the gradient is not finite. */     \
    double gwt_adamw_haar_phase1_##NAME(const WT *g, T *m, T *v, T *d, T *t,       \
                                        int64_t rows, int64_t n, int level,        \
                                        const gwt_hyper *hp, int nthreads) {       \
        int bad;                                                                   \
        const double total = phase1_##NAME(g, m, v, d, t, rows, n, level, hp,      \
                                           nthreads, &bad);                        \
        return bad ? NAN : total;                                                  \
    }                                                                              \
    static void phase2_##NAME(WT *w, const WT *g, const T *m, const T *d,          \
                              const T *t, int64_t rows, int64_t n, int level,      \
                              const gwt_hyper *hp, int nthreads) {                 \
        const int64_t b = (int64_t)1 << level;                                     \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")         \
        for (int64_t r = 0; r < rows; ++r)                                         \
            phase2_rows_##NAME(w, g, m, d, t, r, r + 1, n, b, hp);                 \
    }                                                                              \
    void gwt_adamw_haar_phase2_##NAME(WT *w, const WT *g, const T *d, const T *t,  \
                                      int64_t rows, int64_t n, int level,          \
                                      const gwt_hyper *hp, int nthreads) {         \
        phase2_##NAME(w, g, NULL, d, t, rows, n, level, hp, nthreads);             \
    }                                                                              \
    void gwt_adamw_haar_phase2_clip_##NAME(WT *w, const WT *g, const T *m,         \
                                           const T *d, const T *t, int64_t rows,   \
                                           int64_t n, int level,                   \
                                           const gwt_hyper *hp, int nthreads) {    \
        phase2_##NAME(w, g, m, d, t, rows, n, level, hp, nthreads);                \
    }

/* Whole steps of ntasks parameters (the caller sorts them largest first).
 * workspace holds `stride` entries per slot: 2 * rows * ceil(n / 2^level) of
 * the largest parameter.
 *
 * pipelined != 0: each thread takes parameters one at a time (dynamic
 * schedule, 2 workspace slots per thread) and runs phase 2 of its current
 * parameter interleaved, a few rows at a time, with the block sums of the
 * next one, so that one core keeps W, the current G (mostly from cache) and
 * the next G in flight at once: a core of the 2-core EPYC this was tuned on
 * reads one stream at 22 GB/s and three at 39. Interleaving about a row of
 * each at a time (PIPE_CHUNK) measured best there: on LLaMA-60M's weights
 * the batch takes 19% less time than the phases one after the other at one
 * thread, 11% at two (16 KB steps: 2%; on small weights the gain is also
 * from running no OpenMP region per parameter). Otherwise one parameter
 * after the other on all threads, split
 * by rows (1 slot). Both orders compute the same values; only the limiter's
 * norm of a parameter split over threads is summed in another order. */
#define PIPE_CHUNK 1024 /* entries of both parameters per interleaving step: about a row of each */

#define DEFINE_STEPS(WT, T, NAME)                                                   \
    /* The limiter, then the scale phase 2 uses; false when skipped. */         \
    static int finish_phase1_##NAME(gwt_task *task, double norm_sq, int bad,       \
                                    gwt_hyper *hp) {                               \
        task->skipped = bad;                                                       \
        if (bad) return 0; /* the weight, moments and s stay as they were */       \
        *hp = task->hyper;                                                         \
        T *sp = (T *)task->snorm;                                                  \
        double s = sp ? (double)*sp : 0.0;                                         \
        hp->scale /= limiter_ratio(task, norm_sq, &s);                             \
        if (sp) *sp = (T)s;                                                        \
        return 1;                                                                  \
    }                                                                              \
    static void run_task_##NAME(gwt_task *task, T *ws, int nthreads) {             \
        const int64_t nb = (task->n + ((int64_t)1 << task->level) - 1) >> task->level; \
        T *d = ws, *t = ws + task->rows * nb;                                      \
        int bad;                                                                   \
        const double norm_sq = phase1_##NAME(                                      \
            (const WT *)task->g, (T *)task->m, (T *)task->v, d, t, task->rows,     \
            task->n, task->level, &task->hyper, nthreads, &bad);                   \
        gwt_hyper hp;                                                              \
        if (!finish_phase1_##NAME(task, norm_sq, bad, &hp)) return;                \
        phase2_##NAME((WT *)task->w, (const WT *)task->g,                          \
                      hp.clip > 0 ? (const T *)task->m : NULL, d, t, task->rows,   \
                      task->n, task->level, &hp, nthreads);                        \
    }                                                                              \
    static void run_pipeline_##NAME(gwt_task *tasks, int ntasks, int *next, T *ws, \
                                    int64_t stride) {                              \
        gwt_task *cur = NULL;                                                      \
        gwt_hyper hp_cur;                                                          \
        int slot = 0;                                                              \
        for (;;) {                                                                 \
            int i;                                                                 \
            _Pragma("omp atomic capture")                                          \
            i = (*next)++;                                                         \
            gwt_task *nxt = i < ntasks ? &tasks[i] : NULL;                         \
            if (!cur && !nxt) return;                                              \
            T *ws_nxt = ws + (slot ^ 1) * stride;                                  \
            int64_t rc = 0, bc = 1, nbc = 0, rn = 0, bn = 1, nbn = 0;              \
            if (cur) {                                                             \
                bc = (int64_t)1 << cur->level;                                     \
                rc = cur->rows, nbc = (cur->n + bc - 1) / bc;                      \
            }                                                                      \
            if (nxt) {                                                             \
                bn = (int64_t)1 << nxt->level;                                     \
                rn = nxt->rows, nbn = (nxt->n + bn - 1) / bn;                      \
            }                                                                      \
            const T *dc = ws + slot * stride, *tc = dc + rc * nbc;                 \
            T *dn = ws_nxt, *tn = ws_nxt + rn * nbn;                               \
            const T *mc = cur && hp_cur.clip > 0 ? (const T *)cur->m : NULL;       \
            const int64_t work = (cur ? rc * cur->n : 0) + (nxt ? rn * nxt->n : 0); \
            const int64_t steps = work / PIPE_CHUNK > 0 ? work / PIPE_CHUNK : 1;   \
            int bad = 0;                                                           \
            for (int64_t s = 0; s < steps; ++s) {                                  \
                if (cur)                                                           \
                    phase2_rows_##NAME((WT *)cur->w, (const WT *)cur->g, mc, dc, tc, \
                                       rc * s / steps, rc * (s + 1) / steps,       \
                                       cur->n, bc, &hp_cur);                       \
                if (nxt)                                                           \
                    bad |= sums_rows_##NAME((const WT *)nxt->g, tn, rn * s / steps, \
                                            rn * (s + 1) / steps, nxt->n, bn,      \
                                            (T)nxt->hyper.h);                      \
            }                                                                      \
            cur = NULL;                                                            \
            if (nxt) {                                                             \
                const double norm_sq = bad ? 0.0                                   \
                    : update_rows_##NAME((T *)nxt->m, (T *)nxt->v, dn, tn, 0, rn,  \
                                         nbn, &nxt->hyper);                        \
                if (finish_phase1_##NAME(nxt, norm_sq, bad, &hp_cur)) {            \
                    cur = nxt;                                                     \
                    slot ^= 1;                                                     \
                }                                                                  \
            }                                                                      \
        }                                                                          \
    }                                                                              \
    void gwt_adamw_haar_steps_##NAME(gwt_task *tasks, int ntasks, T *workspace,    \
                                     int64_t stride, int nthreads, int pipelined,  \
                                     int64_t min_per_thread) {                     \
        if (pipelined) {                                                           \
            int next = 0;                                                          \
            _Pragma("omp parallel num_threads(nthreads)")                          \
            run_pipeline_##NAME(tasks, ntasks, &next,                              \
                                workspace + 2 * THREAD_NUM() * stride, stride);    \
            return;                                                                \
        }                                                                          \
        for (int i = 0; i < ntasks; ++i) {                                         \
            const int64_t work = tasks[i].rows * tasks[i].n / min_per_thread;      \
            int nt = work < nthreads ? (int)work : nthreads;                       \
            nt = tasks[i].rows < nt ? (int)tasks[i].rows : nt;                     \
            run_task_##NAME(&tasks[i], workspace, nt > 1 ? nt : 1);                \
        }                                                                          \
    }

DEFINE_ENTRY_POINTS(float, float, float32)
DEFINE_ENTRY_POINTS(double, double, float64)
DEFINE_ENTRY_POINTS(bf16, float, bfloat16)
DEFINE_STEPS(float, float, float32)
DEFINE_STEPS(double, double, float64)
DEFINE_STEPS(bf16, float, bfloat16)
