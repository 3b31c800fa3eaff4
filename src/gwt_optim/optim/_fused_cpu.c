/*
 * Fused CPU kernels of the GWT-AdamW step with the Haar wavelet.
 *
 * Built on first use by gwt_optim.optim._fused with the system C compiler
 * (what torch.compile needs on CPU too) and called through ctypes. For rows
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
 * which is the closed form of the inverse transform in _base._haar_delta
 * with q = coef d and c = coef t. d and t are an A-sized workspace the caller
 * passes between the phases, so phase 2 neither recomputes the block sums
 * nor a square root and a division per block. When the caller runs phase 2
 * of a parameter right after its phase 1, the gradient and the workspace
 * are still in cache and the step reads G, M and V once and W once.
 *
 * gwt_adamw_haar_steps_* runs whole steps of many parameters -- phase 1,
 * Fira's limiter and phase 2 -- in one call and one OpenMP region, each
 * parameter on one thread when there are enough parameters to go around:
 * one fork and join per optimizer step instead of two per parameter, which
 * matters most when other processes compete for the cores.
 *
 * Everything is written as simple loops over contiguous arrays that GCC and
 * Clang vectorize at -O3 (with -fno-trapping-math, so that the selects
 * around the divisions are if-converted). Each kernel is instantiated for
 * float and double, and specialized for block sizes 2, 4, 8 and 16, so the
 * block loops unroll; larger levels use a generic block size.
 */
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
    int32_t first;      /* the limiter only records the norm (first step, or s = 0) */
    int32_t skipped;    /* out: the gradient was not finite, nothing was changed */
    double gamma;       /* the limiter's growth limit; 0 = no limiter */
    double limiter_eps; /* keeps norm / s finite at s = 0 */
    double s;           /* the limiter's last norm: read, then updated */
    gwt_hyper hyper;    /* hyper.scale is before the division by r */
} gwt_task;

/* Fira's norm-growth limiter, as _base.GWTOptimizer._limit: r, and s <- norm / r. */
static double limiter_ratio(gwt_task *task, double norm_sq) {
    if (task->gamma <= 0) return 1.0;
    const double norm = sqrt(norm_sq);
    const double r = task->first ? 1.0 : fmax(norm / (task->s + task->limiter_eps), task->gamma) / task->gamma;
    task->s = norm / r;
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
 * blocks are spread over the entries by lane permutations, with no
 * temporaries. Returns how many leading full blocks it did. */
static inline void phase2_avx2_vec(float *w, const float *g, __m256 q8, __m256 c8,
                                   __m256i lanes, __m256 decay) {
    const __m256 q = _mm256_permutevar8x32_ps(q8, lanes);
    const __m256 c = _mm256_permutevar8x32_ps(c8, lanes);
    const __m256 x = _mm256_fmadd_ps(_mm256_loadu_ps(g), q, c);
    _mm256_storeu_ps(w, _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(w), decay), x));
}

static int64_t phase2_avx2_2(float *restrict w, const float *restrict g, const float *restrict d,
                             const float *restrict t, int64_t full, float sc, float decay) {
    const __m256 scv = _mm256_set1_ps(sc), dec = _mm256_set1_ps(decay);
    const __m256i l0 = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
    const __m256i l1 = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
    int64_t k = 0;
    for (; k + 8 <= full; k += 8) {
        const __m256 q8 = _mm256_mul_ps(scv, _mm256_loadu_ps(d + k));
        const __m256 c8 = _mm256_mul_ps(scv, _mm256_loadu_ps(t + k));
        phase2_avx2_vec(w + 2 * k, g + 2 * k, q8, c8, l0, dec);
        phase2_avx2_vec(w + 2 * k + 8, g + 2 * k + 8, q8, c8, l1, dec);
    }
    return k;
}

static int64_t phase2_avx2_4(float *restrict w, const float *restrict g, const float *restrict d,
                             const float *restrict t, int64_t full, float sc, float decay) {
    const __m256 scv = _mm256_set1_ps(sc), dec = _mm256_set1_ps(decay);
    const __m256i l0 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i l1 = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const __m256i l2 = _mm256_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5);
    const __m256i l3 = _mm256_setr_epi32(6, 6, 6, 6, 7, 7, 7, 7);
    int64_t k = 0;
    for (; k + 8 <= full; k += 8) {
        const __m256 q8 = _mm256_mul_ps(scv, _mm256_loadu_ps(d + k));
        const __m256 c8 = _mm256_mul_ps(scv, _mm256_loadu_ps(t + k));
        phase2_avx2_vec(w + 4 * k, g + 4 * k, q8, c8, l0, dec);
        phase2_avx2_vec(w + 4 * k + 8, g + 4 * k + 8, q8, c8, l1, dec);
        phase2_avx2_vec(w + 4 * k + 16, g + 4 * k + 16, q8, c8, l2, dec);
        phase2_avx2_vec(w + 4 * k + 24, g + 4 * k + 24, q8, c8, l3, dec);
    }
    return k;
}
#define SIMD_FLOAT_2 sums_avx2_2
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
#endif

/* Phase 1, first pass, on one row of nblocks blocks of B entries, the last
 * one `tail` entries long when tail > 0 (then it is counted in nblocks):
 * a_k = h * sum(block_k). Returns nonzero when the row holds a NaN or an
 * infinity, checked on the entries themselves (x * 0 is 0 only for finite x)
 * while the row is still in cache. */
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
        const int64_t n = full * (B) + tail;                                       \
        T z = 0;                                                                   \
        _Pragma("omp simd reduction(+:z)")                                         \
        for (int64_t i = 0; i < n; ++i) z += g[i] * (T)0;                          \
        return z != z;                                                             \
    }

/* Phase 1, second pass, on one row: the moments from the block sums, which t
 * holds on entry and t_k = h (M_k - A_k) d_k replaces. Returns the row's
 * sum of (M_k d_k)^2. */
#define DEFINE_UPDATE_ROW(T, NAME)                                                  \
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

/* Phase 2 with detail_clip, any block size: G d_k + t_k - u_k is the
 * normalized detail (G - mean_k) / den_k, clamped before the approximation
 * part u_k is added back. u_k needs M, so this one reads the moment too. */
#define DEFINE_PHASE2_CLIP_ROW(T, NAME)                                             \
    static void phase2_clip_row_##NAME(T *restrict w, const T *restrict g,         \
                                       const T *restrict m, const T *restrict d,   \
                                       const T *restrict t, int64_t nblocks,       \
                                       int64_t n, int64_t b, const gwt_hyper *hp) { \
        const T sc = (T)hp->scale, decay = (T)hp->decay, h = (T)hp->h;             \
        const T c = (T)hp->clip;                                                   \
        if (b >= 16) { /* the block is long enough to be the vector */             \
            for (int64_t k = 0; k < nblocks; ++k) {                                \
                const T dk = d[k], uk = h * m[k] * dk, shift = t[k] - uk;          \
                const int64_t j0 = k * b, j1 = MIN(j0 + b, n);                     \
                _Pragma("omp simd")                                                \
                for (int64_t j = j0; j < j1; ++j) {                                \
                    T x = g[j] * dk + shift;                                       \
                    x = x > c ? c : (x < -c ? -c : x);                             \
                    w[j] = w[j] * decay - sc * (uk + x);                           \
                }                                                                  \
            }                                                                      \
            return;                                                                \
        }                                                                          \
        /* small blocks: spread each chunk's per-block factors to entries first */ \
        T de[CHUNK * 8], se[CHUNK * 8], ue[CHUNK * 8];                             \
        const int64_t per = (CHUNK * 8) / b;                                       \
        for (int64_t k0 = 0; k0 < nblocks; k0 += per) {                           \
            const int64_t nk = MIN(per, nblocks - k0);                             \
            const int64_t ne = MIN(nk * b, n - k0 * b);                            \
            for (int64_t k = 0; k < nk; ++k) {                                     \
                const T dk = d[k0 + k], uk = h * m[k0 + k] * dk;                   \
                const T shift = t[k0 + k] - uk;                                    \
                for (int64_t j = 0; j < b; ++j) {                                  \
                    de[k * b + j] = dk;                                            \
                    se[k * b + j] = shift;                                         \
                    ue[k * b + j] = uk;                                            \
                }                                                                  \
            }                                                                      \
            T *wc = w + k0 * b;                                                    \
            const T *gc = g + k0 * b;                                              \
            _Pragma("omp simd")                                                    \
            for (int64_t i = 0; i < ne; ++i) {                                     \
                T x = gc[i] * de[i] + se[i];                                       \
                x = x > c ? c : (x < -c ? -c : x);                                 \
                wc[i] = wc[i] * decay - sc * (ue[i] + x);                          \
            }                                                                      \
        }                                                                          \
    }

#define DEFINE_ROWS(T, NAME, SIMD2, SIMD4, SIMD8, P2SIMD2, P2SIMD4)                 \
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
    DEFINE_PHASE2_CLIP_ROW(T, NAME)

/* The exported entry points. g and w are contiguous (rows, n); m, v, d and t
 * contiguous (rows, ceil(n / 2^level)). Rows are split across nthreads
 * OpenMP threads (the OpenMP runtime torch already loaded). */
#define DEFINE_ENTRY_POINTS(T, NAME, SIMD2, SIMD4, SIMD8, P2SIMD2, P2SIMD4)         \
    DEFINE_ROWS(T, NAME, SIMD2, SIMD4, SIMD8, P2SIMD2, P2SIMD4)                    \
    /* Sets *bad, and changes nothing, when the gradient is not finite: the    \
     * block sums of every row come first, the moments after. */               \
    static double phase1_##NAME(const T *g, T *m, T *v, T *d, T *t,               \
                                int64_t rows, int64_t n, int level,               \
                                const gwt_hyper *hp, int nthreads, int *bad_out) { \
        const int64_t b = (int64_t)1 << level, nb = (n + b - 1) / b, tail = n % b; \
        int (*sums)(const T *restrict, T *restrict, int64_t, int64_t, int64_t, T) = \
            b == 2 ? sums_row_##NAME##_2 : b == 4 ? sums_row_##NAME##_4            \
            : b == 8 ? sums_row_##NAME##_8 : b == 16 ? sums_row_##NAME##_16        \
            : sums_row_##NAME##_any;                                               \
        const T h = (T)hp->h;                                                      \
        int bad = 0;                                                               \
        double total = 0;                                                          \
        _Pragma("omp parallel num_threads(nthreads)")                              \
        {                                                                          \
            _Pragma("omp for schedule(static) reduction(|:bad)")                   \
            for (int64_t r = 0; r < rows; ++r)                                     \
                bad |= sums(g + r * n, t + r * nb, nb, tail, b, h);                \
            /* every thread must see the reduced flag before branching on it */   \
            _Pragma("omp barrier")                                                 \
            if (!bad) {                                                            \
                _Pragma("omp for schedule(static) reduction(+:total)")             \
                for (int64_t r = 0; r < rows; ++r)                                 \
                    total += update_row_##NAME(m + r * nb, v + r * nb, d + r * nb, \
                                               t + r * nb, nb, hp);                \
            }                                                                      \
        }                                                                          \
        *bad_out = bad;                                                            \
        return total;                                                              \
    }                                                                              \
    /* Returns NaN, and changes nothing, when the gradient is not finite. */     \
    double gwt_adamw_haar_phase1_##NAME(const T *g, T *m, T *v, T *d, T *t,        \
                                        int64_t rows, int64_t n, int level,        \
                                        const gwt_hyper *hp, int nthreads) {       \
        int bad;                                                                   \
        const double total = phase1_##NAME(g, m, v, d, t, rows, n, level, hp,      \
                                           nthreads, &bad);                        \
        return bad ? NAN : total;                                                  \
    }                                                                              \
    void gwt_adamw_haar_phase2_##NAME(T *w, const T *g, const T *d, const T *t,    \
                                      int64_t rows, int64_t n, int level,          \
                                      const gwt_hyper *hp, int nthreads) {         \
        const int64_t b = (int64_t)1 << level, nb = (n + b - 1) / b, tail = n % b; \
        void (*row)(T *restrict, const T *restrict, const T *restrict,             \
                    const T *restrict, int64_t, int64_t, int64_t,                  \
                    const gwt_hyper *) =                                           \
            b == 2 ? phase2_row_##NAME##_2 : b == 4 ? phase2_row_##NAME##_4        \
            : b == 8 ? phase2_row_##NAME##_8 : b == 16 ? phase2_row_##NAME##_16    \
            : phase2_row_##NAME##_any;                                             \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")         \
        for (int64_t r = 0; r < rows; ++r)                                         \
            row(w + r * n, g + r * n, d + r * nb, t + r * nb, nb, tail, b, hp);    \
    }                                                                              \
    void gwt_adamw_haar_phase2_clip_##NAME(T *w, const T *g, const T *m,           \
                                           const T *d, const T *t, int64_t rows,   \
                                           int64_t n, int level,                   \
                                           const gwt_hyper *hp, int nthreads) {    \
        const int64_t b = (int64_t)1 << level, nb = (n + b - 1) / b;               \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")         \
        for (int64_t r = 0; r < rows; ++r)                                         \
            phase2_clip_row_##NAME(w + r * n, g + r * n, m + r * nb, d + r * nb,   \
                                   t + r * nb, nb, n, b, hp);                      \
    }

/* Whole steps of ntasks parameters. workspace holds 2 * rows * ceil(n / 2^level)
 * entries per thread, `stride` apart. across != 0 runs each parameter on one
 * thread (dynamic schedule; the caller sorts them largest first), otherwise
 * one parameter after the other on all threads, split by rows. */
#define DEFINE_STEPS(T, NAME)                                                       \
    static void run_task_##NAME(gwt_task *task, T *ws, int nthreads) {             \
        const int64_t b = (int64_t)1 << task->level;                               \
        const int64_t nb = (task->n + b - 1) / b;                                  \
        T *d = ws, *t = ws + task->rows * nb;                                      \
        int bad;                                                                   \
        const double norm_sq = phase1_##NAME(                                      \
            (const T *)task->g, (T *)task->m, (T *)task->v, d, t, task->rows,      \
            task->n, task->level, &task->hyper, nthreads, &bad);                   \
        task->skipped = bad;                                                       \
        if (bad) return; /* the weight, moments and s stay as they were */         \
        gwt_hyper hp = task->hyper;                                                \
        hp.scale /= limiter_ratio(task, norm_sq);                                  \
        if (hp.clip > 0)                                                           \
            gwt_adamw_haar_phase2_clip_##NAME((T *)task->w, (const T *)task->g,    \
                                              (const T *)task->m, d, t,            \
                                              task->rows, task->n, task->level,    \
                                              &hp, nthreads);                      \
        else                                                                       \
            gwt_adamw_haar_phase2_##NAME((T *)task->w, (const T *)task->g, d, t,   \
                                         task->rows, task->n, task->level, &hp,    \
                                         nthreads);                                \
    }                                                                              \
    void gwt_adamw_haar_steps_##NAME(gwt_task *tasks, int ntasks, T *workspace,    \
                                     int64_t stride, int nthreads, int across,     \
                                     int64_t min_per_thread) {                     \
        if (across) {                                                              \
            _Pragma("omp parallel for num_threads(nthreads) schedule(dynamic, 1)") \
            for (int i = 0; i < ntasks; ++i)                                       \
                run_task_##NAME(&tasks[i], workspace + THREAD_NUM() * stride, 1);  \
            return;                                                                \
        }                                                                          \
        for (int i = 0; i < ntasks; ++i) {                                         \
            const int64_t work = tasks[i].rows * tasks[i].n / min_per_thread;      \
            int nt = work < nthreads ? (int)work : nthreads;                       \
            nt = tasks[i].rows < nt ? (int)tasks[i].rows : nt;                     \
            run_task_##NAME(&tasks[i], workspace, nt > 1 ? nt : 1);                \
        }                                                                          \
    }

DEFINE_ENTRY_POINTS(float, float32, SIMD_FLOAT_2, SIMD_FLOAT_4, SIMD_FLOAT_8, SIMD2_FLOAT_2, SIMD2_FLOAT_4)
DEFINE_ENTRY_POINTS(double, float64, NO_SIMD, NO_SIMD, NO_SIMD, NO_SIMD2, NO_SIMD2)
DEFINE_STEPS(float, float32)
DEFINE_STEPS(double, float64)
