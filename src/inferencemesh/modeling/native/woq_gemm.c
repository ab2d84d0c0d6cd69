/* Weight-only quantized matrix products for a few rows on an AVX-512 CPU: y = x W^T, W held as
 * INT8 or FP8 (e4m3) with its scales, read once per call straight from the quantized bytes.
 *
 * A decode step streams every weight from memory once, so what counts is how fast the bytes are
 * consumed. PyTorch's _weight_int8pack_mm reads 4 rows of W side by side without prefetching:
 * each row is a short stream (K bytes) that the hardware prefetcher never ramps up on, and it
 * draws about half the bandwidth a bfloat16 GEMM does. Here the same arithmetic (each weight
 * widened to float32, one FMA per row of x, the per-channel scale after the sum, so its results
 * equal _weight_int8pack_mm's bit for bit) runs with software prefetches PREFETCH_BYTES ahead of
 * the tile being read.
 *
 * Scales: scale[r, c] applies to outputs [r * row_div, (r + 1) * row_div) and inputs
 * [c * group, (c + 1) * group). One column and no offset (per channel or per tensor): multiplied
 * once per output; otherwise each group's partial sum is multiplied as the group ends, and an
 * asymmetric format's offset (-zero x scale) adds offset[n, c] x sum(x over group c).
 * FP8 is widened by its bits (the byte sign-extended, shifted left 20, masked: its value times
 * 2^-120, subnormals included); scale_mul (2^120) restores it.
 *
 * Compiled at first use by modeling/native_kernels.py with the machine's C compiler. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define INLINE __attribute__((always_inline)) inline
#define PREFETCH_BYTES 8192
#define NB_MAX 4
#define MB_MAX 4

enum { FORMAT_INT8 = 0, FORMAT_FP8 = 1 };
enum { DTYPE_BF16 = 0, DTYPE_F32 = 1 };

typedef struct {
    const float *x;        /* [M, K] float32 */
    const float *xsum;     /* [M, groups]: sums of x over each group (offsets only) */
    const uint8_t *w;      /* [N, K] bytes */
    const void *scale;     /* [ceil(N / row_div), groups], bfloat16 or float32 */
    const void *offset;    /* [N, groups] or NULL */
    void *y;               /* [M, N] */
    int64_t M, N, K, group, groups, row_div;
    int format, dtype, per_output;
    float scale_mul;
} Problem;

static INLINE float bf16_to_f32(uint16_t b) { union { uint32_t u; float f; } v = { (uint32_t)b << 16 }; return v.f; }

static INLINE uint16_t f32_to_bf16(float f) {  /* round to nearest even, as torch does */
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7F800000u) == 0x7F800000u && (v.u & 0x7FFFFFu)) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

static INLINE float read_value(const void *p, int64_t i, int dtype) {
    return dtype == DTYPE_BF16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* 16 weights from 16 bytes, as float32 (FP8: times 2^-120) */
static INLINE TARGET __m512 widen(const uint8_t *p, int format) {
    __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p));
    if (format == FORMAT_INT8) return _mm512_cvtepi32_ps(v);
    v = _mm512_and_si512(_mm512_slli_epi32(v, 20), _mm512_set1_epi32((int)0x87F00000u));
    return _mm512_castsi512_ps(v);
}

static INLINE float scale_at(const Problem *p, int64_t n, int64_t c) {
    return read_value(p->scale, (n / p->row_div) * p->groups + c, p->dtype) * p->scale_mul;
}

/* outputs [n0, n0 + NB) for rows [m0, m0 + MB) */
static INLINE TARGET void tile(const Problem *p, int64_t n0, int64_t m0, const int NB, const int MB, const int format) {
    __m512 acc[NB_MAX][MB_MAX], total[NB_MAX][MB_MAX];
    const int64_t K = p->K;
    for (int j = 0; j < NB; j++) for (int i = 0; i < MB; i++) acc[j][i] = total[j][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512 lo[NB_MAX], hi[NB_MAX];
        for (int j = 0; j < NB; j++) {
            const uint8_t *w = p->w + (n0 + j) * K + k;
            _mm_prefetch((const char *)(w + PREFETCH_BYTES), _MM_HINT_T0);
            lo[j] = widen(w, format);
            hi[j] = widen(w + 16, format);
        }
        for (int i = 0; i < MB; i++) {
            const float *x = p->x + (m0 + i) * K + k;
            __m512 x0 = _mm512_loadu_ps(x), x1 = _mm512_loadu_ps(x + 16);
            for (int j = 0; j < NB; j++) acc[j][i] = _mm512_fmadd_ps(hi[j], x1, _mm512_fmadd_ps(lo[j], x0, acc[j][i]));
        }
        if (!p->per_output && ((k + 32) % p->group == 0 || k + 32 == K)) {
            const int64_t c = k / p->group;
            for (int j = 0; j < NB; j++) {
                __m512 s = _mm512_set1_ps(scale_at(p, n0 + j, c));
                for (int i = 0; i < MB; i++) {
                    total[j][i] = _mm512_fmadd_ps(acc[j][i], s, total[j][i]);
                    acc[j][i] = _mm512_setzero_ps();
                }
            }
        }
    }
    for (int j = 0; j < NB; j++) {
        const int64_t n = n0 + j;
        for (int i = 0; i < MB; i++) {
            const int64_t m = m0 + i;
            float v;
            if (p->per_output) {
                v = _mm512_reduce_add_ps(acc[j][i]) * scale_at(p, n, 0);
            } else {
                v = _mm512_reduce_add_ps(total[j][i]);
                if (p->offset)
                    for (int64_t c = 0; c < p->groups; c++)
                        v += read_value(p->offset, n * p->groups + c, p->dtype) * p->xsum[m * p->groups + c];
            }
            if (p->dtype == DTYPE_BF16) ((uint16_t *)p->y)[m * p->N + n] = f32_to_bf16(v);
            else ((float *)p->y)[m * p->N + n] = v;
        }
    }
}

/* One specialisation per (outputs, rows, format): constant bounds keep the accumulators in registers. */
#define TILE(NB, MB, F) static TARGET void tile_##NB##_##MB##_##F(const Problem *p, int64_t n0, int64_t m0) { tile(p, n0, m0, NB, MB, F); }
#define TILES(F) TILE(4, 1, F) TILE(4, 2, F) TILE(2, 3, F) TILE(2, 4, F) TILE(1, 1, F) TILE(1, 2, F) TILE(1, 3, F) TILE(1, 4, F)
TILES(0)
TILES(1)
typedef void (*tile_fn)(const Problem *, int64_t, int64_t);
static const tile_fn WIDE[2][MB_MAX + 1] = {{0, tile_4_1_0, tile_4_2_0, tile_2_3_0, tile_2_4_0},
                                            {0, tile_4_1_1, tile_4_2_1, tile_2_3_1, tile_2_4_1}};
static const tile_fn NARROW[2][MB_MAX + 1] = {{0, tile_1_1_0, tile_1_2_0, tile_1_3_0, tile_1_4_0},
                                              {0, tile_1_1_1, tile_1_2_1, tile_1_3_1, tile_1_4_1}};
/* outputs a wide tile takes at each row count: 8-16 accumulators (and as many group totals), the
 * rest of the 32 registers for weights and x. More rows go 4 at a time: wider tiles (one output,
 * 8 rows) measured slower, each weight row too short a loop for its reductions. */
static const int WIDE_OUTPUTS[MB_MAX + 1] = {0, 4, 4, 2, 2};

int imesh_woq_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}

/* y [M, N] = x [M, K] W^T. Returns 0, or -1 for shapes it does not take (K or group not a
 * multiple of 32), -2 when out of memory. x and y: bfloat16 (dtype 0) or float32 (1), as are
 * scale and offset. */
int imesh_woq_gemm(const void *x, const void *w, int format, const void *scale, const void *offset, float scale_mul,
                   void *y, int64_t M, int64_t N, int64_t K, int64_t group, int64_t row_div, int dtype, int threads) {
    if (K <= 0 || K % 32 || group <= 0 || (group < K && group % 32) || row_div <= 0) return -1;
    const int64_t groups = (K + group - 1) / group;
    float *work = malloc(sizeof(float) * (size_t)(M * K + M * groups));
    if (!work) return -2;
    float *xsum = work + M * K;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t c = 0; c < groups; c++) xsum[m * groups + c] = 0.f;
        for (int64_t k = 0; k < K; k++) {
            float v = read_value(x, m * K + k, dtype);
            work[m * K + k] = v;
            xsum[m * groups + k / group] += v;
        }
    }
    Problem p = {work, xsum, (const uint8_t *)w, scale, offset, y, M, N, K, group, groups, row_div, format, dtype,
                 groups == 1 && !offset, scale_mul};
    const int f = format == FORMAT_FP8;
    for (int64_t m0 = 0; m0 < M; m0 += MB_MAX) {
        const int mb = (int)(M - m0 < MB_MAX ? M - m0 : MB_MAX), nb = WIDE_OUTPUTS[mb];
        const int64_t tiles = N / nb;
        const tile_fn wide = WIDE[f][mb], narrow = NARROW[f][mb];
        #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N * K >= 65536)
        for (int64_t t = 0; t < tiles; t++) wide(&p, t * nb, m0);
        for (int64_t n = tiles * nb; n < N; n++) narrow(&p, n, m0);
    }
    free(work);
    return 0;
}
