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
 * 2^-120, subnormals included); the kernel's own factor (FP8_FLOAT_MUL) restores it.
 *
 * bfloat16 rows on a CPU with AVX512_BF16 take a second tile (tile_dot): weights widened to
 * bfloat16 (exact: INT8 and e4m3 values both fit its 8-bit significand), 32 of them multiplied
 * with 32 of x and summed in pairs into 16 float32 lanes by one vdpbf16ps, where the float32 tile
 * spends two FMAs. That halves the arithmetic, which is what bounds 5-16 rows (8 rows, llama-150m's
 * layers, one thread: 15 -> 5.6 ms INT8, 16 -> 6.2 ms FP8); at one row both draw the same
 * bandwidth. Within a tile, a row's sums are the same at every row count: a request decodes the
 * same alone or batched.
 *
 * Compiled at first use by modeling/native_kernels.py with the machine's C compiler. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
#define TARGET_DOT __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))
#define INLINE __attribute__((always_inline)) inline
#define PREFETCH_BYTES 8192
#define NB_MAX 4
#define MB_MAX 4
#define DOT_MB_MAX 8
#define FP8_FLOAT_MUL 0x1p120f  /* widen()'s FP8 values are the weights times 2^-120 */
#define FP8_DOT_MUL 0x1p-8f     /* widen_dot()'s are the weights times 2^8 */

enum { FORMAT_INT8 = 0, FORMAT_FP8 = 1 };
enum { DTYPE_BF16 = 0, DTYPE_F32 = 1 };

typedef struct {
    const float *x;        /* [M, K] float32 (the float32 tile) */
    const uint16_t *xb;    /* [M, K] bfloat16 (the bfloat16 tile) */
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

/* 32 weights from 32 bytes, as bfloat16 in order. INT8 through float32. FP8 by its bits: sign
 * and e4m3's exponent and mantissa moved into place with bit 14 set (exponent e + 128: the value
 * times 2^8); e4m3's subnormals (exponent 0: m x 2^-9) from a table. */
static INLINE TARGET_DOT __m512bh widen_dot(const uint8_t *p, int format) {
    if (format == FORMAT_INT8) {
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        return _mm512_cvtne2ps_pbh(hi, lo);
    }
    const __m512i v = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i subnormals = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                0, 0, 0x4060, 0x4040, 0x4020, 0x4000, 0x3FC0, 0x3F80, 0x3F00, 0);
    /* (v << 4) & 0x87F0 | 0x4000, then where the exponent is 0 the table's entry, then v's sign again */
    __m512i b = _mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 4), _mm512_set1_epi16((short)0x87F0),
                                          _mm512_set1_epi16(0x4000), 0xEA);
    b = _mm512_mask_permutexvar_epi16(b, _mm512_testn_epi16_mask(v, _mm512_set1_epi16(0x78)), v, subnormals);
    return (__m512bh)_mm512_ternarylogic_epi32(b, v, _mm512_set1_epi16((short)0x8000), 0xF8);
}

/* the scale of group c for the outputs whose scale row starts at `start` (rows_at's) */
static INLINE float scale_from(const Problem *p, int64_t start, int64_t c) {
    return read_value(p->scale, start + c, p->dtype) * p->scale_mul;
}

static INLINE float scale_at(const Problem *p, int64_t n, int64_t c) {
    return scale_from(p, n / p->row_div * p->groups, c);
}

/* At group c's end: its sums scaled into the totals (and cleared); with offsets, an asymmetric
 * format's offset[n, c] x the group's sum of x into bias. at[j]: output n0 + j's scale row and
 * offset row, from rows_at (once per tile: no division per group). */
static INLINE TARGET void end_group(const Problem *p, int64_t m0, int64_t c, const int NB, const int MB,
                                    const int64_t at[NB_MAX][2], __m512 acc[NB_MAX][DOT_MB_MAX],
                                    __m512 total[NB_MAX][DOT_MB_MAX], float bias[NB_MAX][DOT_MB_MAX], int offsets) {
    for (int j = 0; j < NB; j++) {
        __m512 s = _mm512_set1_ps(scale_from(p, at[j][0], c));
        for (int i = 0; i < MB; i++) {
            total[j][i] = _mm512_fmadd_ps(acc[j][i], s, total[j][i]);
            acc[j][i] = _mm512_setzero_ps();
        }
        if (offsets && p->offset) {
            const float o = read_value(p->offset, at[j][1] + c, p->dtype);
            for (int i = 0; i < MB; i++) bias[j][i] += o * p->xsum[(m0 + i) * p->groups + c];
        }
    }
}

/* where outputs n0 .. n0 + NB - 1's scales and offsets start */
static INLINE void rows_at(const Problem *p, int64_t n0, const int NB, int64_t at[NB_MAX][2]) {
    for (int j = 0; j < NB; j++) {
        at[j][0] = (n0 + j) / p->row_div * p->groups;
        at[j][1] = (n0 + j) * p->groups;
    }
}

/* y[m, n] from its sum (group totals plus offsets, or one sum times the per-output scale) */
static INLINE void store(const Problem *p, int64_t n, int64_t m, float sum) {
    const float v = p->per_output ? sum * scale_at(p, n, 0) : sum;
    if (p->dtype == DTYPE_BF16) ((uint16_t *)p->y)[m * p->N + n] = f32_to_bf16(v);
    else ((float *)p->y)[m * p->N + n] = v;
}

/* A tile's sums per (output, row): the running sum, the scaled group totals, the offsets' part;
 * and where each output's scales and offsets are. Kept in registers (the tiles inline it all). */
typedef struct {
    __m512 acc[NB_MAX][DOT_MB_MAX], total[NB_MAX][DOT_MB_MAX];
    float bias[NB_MAX][DOT_MB_MAX];
    int64_t at[NB_MAX][2];
} Sums;

static INLINE TARGET void tile_start(const Problem *p, int64_t n0, const int NB, const int MB, Sums *t) {
    for (int j = 0; j < NB; j++)
        for (int i = 0; i < MB; i++) {
            t->acc[j][i] = t->total[j][i] = _mm512_setzero_ps();
            t->bias[j][i] = 0.f;
        }
    rows_at(p, n0, NB, t->at);
}

/* each output from its one sum (times the per-output scale), or its group totals plus offsets */
static INLINE TARGET void tile_finish(const Problem *p, int64_t n0, int64_t m0, const int NB, const int MB,
                                      const int grouped, Sums *t) {
    for (int j = 0; j < NB; j++)
        for (int i = 0; i < MB; i++)
            store(p, n0 + j, m0 + i, grouped ? _mm512_reduce_add_ps(t->total[j][i]) + t->bias[j][i]
                                             : _mm512_reduce_add_ps(t->acc[j][i]));
}

/* outputs [n0, n0 + NB) for rows [m0, m0 + MB) */
static INLINE TARGET void tile(const Problem *p, int64_t n0, int64_t m0, const int NB, const int MB, const int format) {
    Sums t;
    tile_start(p, n0, NB, MB, &t);
    const int64_t K = p->K;
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
            for (int j = 0; j < NB; j++) t.acc[j][i] = _mm512_fmadd_ps(hi[j], x1, _mm512_fmadd_ps(lo[j], x0, t.acc[j][i]));
        }
        if (!p->per_output && ((k + 32) % p->group == 0 || k + 32 == K))
            end_group(p, m0, k / p->group, NB, MB, t.at, t.acc, t.total, t.bias, 1);
    }
    tile_finish(p, n0, m0, NB, MB, !p->per_output, &t);
}

/* The bfloat16 tile: outputs [n0, n0 + NB) for rows [m0, m0 + MB), 32 weights a step; GROUPED
 * (a compile-time switch, so per-output tiles keep no group totals) scales each group's sums. */
static INLINE TARGET_DOT void tile_dot(const Problem *p, int64_t n0, int64_t m0, const int NB, const int MB,
                                       const int format, const int GROUPED) {
    Sums t;
    tile_start(p, n0, NB, MB, &t);
    const int64_t K = p->K;
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh w[NB_MAX];
        for (int j = 0; j < NB; j++) {
            const uint8_t *row = p->w + (n0 + j) * K + k;
            _mm_prefetch((const char *)(row + PREFETCH_BYTES), _MM_HINT_T0);
            w[j] = widen_dot(row, format);
        }
        for (int i = 0; i < MB; i++) {
            const __m512bh x = (__m512bh)_mm512_loadu_si512(p->xb + (m0 + i) * K + k);
            for (int j = 0; j < NB; j++) t.acc[j][i] = _mm512_dpbf16_ps(t.acc[j][i], w[j], x);
        }
        if (GROUPED && ((k + 32) % p->group == 0 || k + 32 == K))
            end_group(p, m0, k / p->group, NB, MB, t.at, t.acc, t.total, t.bias, 1);
    }
    tile_finish(p, n0, m0, NB, MB, GROUPED, &t);
}

/* One specialisation per (outputs, rows, format): constant bounds keep the accumulators in registers. */
#define TILE(NB, MB, F) static TARGET void tile_##NB##_##MB##_##F(const Problem *p, int64_t n0, int64_t m0) { tile(p, n0, m0, NB, MB, F); }
#define DOT(NB, MB, F, G) static TARGET_DOT void dot_##NB##_##MB##_##F##_##G(const Problem *p, int64_t n0, int64_t m0) { tile_dot(p, n0, m0, NB, MB, F, G); }
TILE(4, 1, 0) TILE(4, 2, 0) TILE(2, 1, 0) TILE(2, 2, 0) TILE(2, 3, 0) TILE(2, 4, 0) TILE(1, 1, 0) TILE(1, 2, 0) TILE(1, 3, 0) TILE(1, 4, 0)
TILE(4, 1, 1) TILE(4, 2, 1) TILE(2, 1, 1) TILE(2, 2, 1) TILE(2, 3, 1) TILE(2, 4, 1) TILE(1, 1, 1) TILE(1, 2, 1) TILE(1, 3, 1) TILE(1, 4, 1)
DOT(4, 1, 0, 0) DOT(4, 2, 0, 0) DOT(4, 3, 0, 0) DOT(4, 4, 0, 0) DOT(3, 1, 0, 0) DOT(3, 2, 0, 0) DOT(3, 3, 0, 0) DOT(3, 4, 0, 0) DOT(3, 5, 0, 0) DOT(3, 6, 0, 0) DOT(3, 7, 0, 0) DOT(3, 8, 0, 0) DOT(1, 1, 0, 0) DOT(1, 2, 0, 0) DOT(1, 3, 0, 0) DOT(1, 4, 0, 0) DOT(1, 5, 0, 0) DOT(1, 6, 0, 0) DOT(1, 7, 0, 0) DOT(1, 8, 0, 0)
DOT(4, 1, 1, 0) DOT(4, 2, 1, 0) DOT(4, 3, 1, 0) DOT(4, 4, 1, 0) DOT(3, 1, 1, 0) DOT(3, 2, 1, 0) DOT(3, 3, 1, 0) DOT(3, 4, 1, 0) DOT(3, 5, 1, 0) DOT(3, 6, 1, 0) DOT(3, 7, 1, 0) DOT(3, 8, 1, 0) DOT(1, 1, 1, 0) DOT(1, 2, 1, 0) DOT(1, 3, 1, 0) DOT(1, 4, 1, 0) DOT(1, 5, 1, 0) DOT(1, 6, 1, 0) DOT(1, 7, 1, 0) DOT(1, 8, 1, 0)
DOT(4, 1, 0, 1) DOT(4, 2, 0, 1) DOT(2, 1, 0, 1) DOT(2, 2, 0, 1) DOT(2, 3, 0, 1) DOT(2, 4, 0, 1) DOT(1, 1, 0, 1) DOT(1, 2, 0, 1) DOT(1, 3, 0, 1) DOT(1, 4, 0, 1)
DOT(4, 1, 1, 1) DOT(4, 2, 1, 1) DOT(2, 1, 1, 1) DOT(2, 2, 1, 1) DOT(2, 3, 1, 1) DOT(2, 4, 1, 1) DOT(1, 1, 1, 1) DOT(1, 2, 1, 1) DOT(1, 3, 1, 1) DOT(1, 4, 1, 1)
typedef void (*tile_fn)(const Problem *, int64_t, int64_t);
enum { KIND_FLOAT = 0, KIND_DOT = 1, KIND_DOT_GROUPED = 2 };
/* [kind][format][outputs][rows] */
static const tile_fn TILES[3][2][NB_MAX + 1][DOT_MB_MAX + 1] = {
    {{[4][1] = tile_4_1_0, [4][2] = tile_4_2_0, [2][1] = tile_2_1_0, [2][2] = tile_2_2_0, [2][3] = tile_2_3_0, [2][4] = tile_2_4_0, [1][1] = tile_1_1_0, [1][2] = tile_1_2_0, [1][3] = tile_1_3_0, [1][4] = tile_1_4_0},
     {[4][1] = tile_4_1_1, [4][2] = tile_4_2_1, [2][1] = tile_2_1_1, [2][2] = tile_2_2_1, [2][3] = tile_2_3_1, [2][4] = tile_2_4_1, [1][1] = tile_1_1_1, [1][2] = tile_1_2_1, [1][3] = tile_1_3_1, [1][4] = tile_1_4_1}},
    {{[4][1] = dot_4_1_0_0, [4][2] = dot_4_2_0_0, [4][3] = dot_4_3_0_0, [4][4] = dot_4_4_0_0, [3][1] = dot_3_1_0_0, [3][2] = dot_3_2_0_0, [3][3] = dot_3_3_0_0, [3][4] = dot_3_4_0_0, [3][5] = dot_3_5_0_0, [3][6] = dot_3_6_0_0, [3][7] = dot_3_7_0_0, [3][8] = dot_3_8_0_0, [1][1] = dot_1_1_0_0, [1][2] = dot_1_2_0_0, [1][3] = dot_1_3_0_0, [1][4] = dot_1_4_0_0, [1][5] = dot_1_5_0_0, [1][6] = dot_1_6_0_0, [1][7] = dot_1_7_0_0, [1][8] = dot_1_8_0_0},
     {[4][1] = dot_4_1_1_0, [4][2] = dot_4_2_1_0, [4][3] = dot_4_3_1_0, [4][4] = dot_4_4_1_0, [3][1] = dot_3_1_1_0, [3][2] = dot_3_2_1_0, [3][3] = dot_3_3_1_0, [3][4] = dot_3_4_1_0, [3][5] = dot_3_5_1_0, [3][6] = dot_3_6_1_0, [3][7] = dot_3_7_1_0, [3][8] = dot_3_8_1_0, [1][1] = dot_1_1_1_0, [1][2] = dot_1_2_1_0, [1][3] = dot_1_3_1_0, [1][4] = dot_1_4_1_0, [1][5] = dot_1_5_1_0, [1][6] = dot_1_6_1_0, [1][7] = dot_1_7_1_0, [1][8] = dot_1_8_1_0}},
    {{[4][1] = dot_4_1_0_1, [4][2] = dot_4_2_0_1, [2][1] = dot_2_1_0_1, [2][2] = dot_2_2_0_1, [2][3] = dot_2_3_0_1, [2][4] = dot_2_4_0_1, [1][1] = dot_1_1_0_1, [1][2] = dot_1_2_0_1, [1][3] = dot_1_3_0_1, [1][4] = dot_1_4_0_1},
     {[4][1] = dot_4_1_1_1, [4][2] = dot_4_2_1_1, [2][1] = dot_2_1_1_1, [2][2] = dot_2_2_1_1, [2][3] = dot_2_3_1_1, [2][4] = dot_2_4_1_1, [1][1] = dot_1_1_1_1, [1][2] = dot_1_2_1_1, [1][3] = dot_1_3_1_1, [1][4] = dot_1_4_1_1}}};
/* Rows a pass takes, and the outputs a tile takes when a pass has more than FEW_ROWS (else 4):
 * 8-24 accumulators (and as many group totals), the rest of the 32 registers for weights and x.
 * The float32 tile: more rows go 4 at a time (one output, 8 rows, measured slower: each weight
 * row too short a loop for its reductions). The bfloat16 tile: 8 rows a pass per output (3
 * outputs, 24 accumulators), 4 with group totals. */
static const int PASS_ROWS[3] = {MB_MAX, DOT_MB_MAX, MB_MAX};
static const int FEW_ROWS[3] = {2, 4, 2};
static const int MANY_ROWS_OUTPUTS[3] = {2, 3, 2};

int imesh_woq_available(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}

/* whether bfloat16 rows can take the bfloat16 tiles (vdpbf16ps) */
int imesh_woq_dot_available(void) {
    __builtin_cpu_init();
    return imesh_woq_available() && __builtin_cpu_supports("avx512bf16");
}

/* y [M, N] = x [M, K] W^T. Returns 0, or -1 for what it does not take (K or group not a multiple
 * of 32; dot without bfloat16 rows or AVX512_BF16), -2 when out of memory. x and y: bfloat16
 * (dtype 0) or float32 (1), as are scale and offset. dot: the bfloat16 tiles. */
int imesh_woq_gemm(const void *x, const void *w, int format, const void *scale, const void *offset, void *y,
                   int64_t M, int64_t N, int64_t K, int64_t group, int64_t row_div, int dtype, int dot, int threads) {
    if (K <= 0 || K % 32 || group <= 0 || (group < K && group % 32) || row_div <= 0) return -1;
    if (dot && (dtype != DTYPE_BF16 || !imesh_woq_dot_available())) return -1;
    const int64_t groups = (K + group - 1) / group;
    /* the float32 tile reads x as float32; offsets read its sums over each group */
    float *work = malloc(sizeof(float) * (size_t)((dot ? 0 : M * K) + M * groups));
    if (!work) return -2;
    float *xsum = work + (dot ? 0 : M * K);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t c = 0; c < groups; c++) xsum[m * groups + c] = 0.f;
        for (int64_t k = 0; k < K; k++) {
            float v = read_value(x, m * K + k, dtype);
            if (!dot) work[m * K + k] = v;
            xsum[m * groups + k / group] += v;
        }
    }
    const int f = format == FORMAT_FP8, per_output = groups == 1 && !offset;
    const float mul = !f ? 1.f : dot ? FP8_DOT_MUL : FP8_FLOAT_MUL;
    Problem p = {work, (const uint16_t *)x, xsum, (const uint8_t *)w, scale, offset, y, M, N, K, group, groups, row_div,
                 format, dtype, per_output, mul};
    /* Each tile of outputs takes every pass of rows in turn, so its weights are read from memory
     * once and from cache after: a pass widens them again, which costs less than reading. */
    const int kind = !dot ? KIND_FLOAT : per_output ? KIND_DOT : KIND_DOT_GROUPED, step = PASS_ROWS[kind];
    const int nb = M > FEW_ROWS[kind] ? MANY_ROWS_OUTPUTS[kind] : NB_MAX, last = (int)(M % step);
    const tile_fn wide = TILES[kind][f][nb][step], wide_last = TILES[kind][f][nb][last];
    const tile_fn narrow = TILES[kind][f][1][step], narrow_last = TILES[kind][f][1][last];
    const int64_t tiles = N / nb, full = M / step;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && N * K >= 65536)
    for (int64_t t = 0; t < tiles; t++) {
        for (int64_t pass = 0; pass < full; pass++) wide(&p, t * nb, pass * step);
        if (last) wide_last(&p, t * nb, full * step);
    }
    for (int64_t n = tiles * nb; n < N; n++) {
        for (int64_t pass = 0; pass < full; pass++) narrow(&p, n, pass * step);
        if (last) narrow_last(&p, n, full * step);
    }
    free(work);
    return 0;
}
