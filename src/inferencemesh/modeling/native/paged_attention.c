/* Attention of a few queries a session over its keys and values where they lie in a stage's KV pool
 * (modeling/kv_pool.py), float32, for every session of a pass in one call.
 *
 * Why: a decode step's attention reads each session's keys and values once, cold (the weights the
 * step streamed before have evicted them). Through PyTorch's sdpa, one call per session and layer,
 * llama-150m's shape at 250 positions took 127 us a session and layer in a batched step, about 12 GB/s
 * of the 27 GB/s one core reads here: a GEMM call per head for the scores and another for the values,
 * each a few microseconds of fixed cost, and the dispatch of the call itself. Here each (session, key
 * head) reads its keys once for all the queries that share them (grouped queries, a verify window's
 * positions) and its values once, block by block as the session's table names them, so a table need
 * not be consecutive and nothing is gathered.
 *
 * Layout. The pool layer is [2 (keys, values), kv_heads, slots, D]: block b of head h is B x D floats
 * at slot b B. Session s has count T queries at positions start .. start + T - 1, query t seeing
 * positions [0, start + t] (causal), or (start + t - window, start + t] under a sliding window (window > 0,
 * the layer's: Mistral's); its table lists the blocks of positions [0, start + T). Queries
 * are rows [row, row + T) of q, each heads x D floats (q_stride floats apart: a view of the layer's
 * fused projection); the frame's new keys and values, rows of k_new and v_new alike (kv_heads x D), are
 * written into their slots before it attends (one call a layer: no separate scatter); the output is
 * [rows, heads, D], contiguous.
 *
 * Arithmetic: the scores scaled as the queries are (q x scale, then the dot product over D summed in 16
 * lanes), the softmax in float32 with its maximum subtracted (exp to about 1 ulp, below), the values
 * weighted by the unnormalised probabilities and divided by their sum once. The order of the sums does
 * not depend on the batch or the thread count, so a session's answer is the same alone or in a batch. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TARGET __attribute__((target("avx512f,avx512dq")))

/* e^x for float32 x (finite, any sign): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to
 * r^7 (remainder under 6e-9 relative), times 2^n by scalef, which underflows to 0 for very negative x. */
TARGET static inline __m512 exp_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  /* ln2, split in two */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#define ALWAYS_INLINE __attribute__((always_inline)) inline

/* 16 vectors' sums as one vector, lane i the sum of v[i]'s lanes: halves folded pairwise four times
 * (15 adds and 30 permutes for 16 sums, where one horizontal sum each takes about 8 operations). */
TARGET static ALWAYS_INLINE __m512 sums_of_16(__m512 *v) {
    static const int32_t lo[4][16] = {
        {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
        {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
        {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
        {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
    static const int32_t shift[4] = {8, 4, 2, 1};
    for (int level = 0, n = 16; level < 4; level++, n /= 2) {
        const __m512i a = _mm512_loadu_si512(lo[level]);
        const __m512i b = _mm512_add_epi32(a, _mm512_set1_epi32(shift[level]));
        for (int i = 0; i < n / 2; i++)
            v[i] = _mm512_add_ps(_mm512_permutex2var_ps(v[2 * i], a, v[2 * i + 1]),
                                 _mm512_permutex2var_ps(v[2 * i], b, v[2 * i + 1]));
    }
    return v[0];
}

/* scores[r][p0 + j] for the n (<= 16) positions at rows k[j] (consecutive, dim floats apart) and
 * every row of queries. */
TARGET static ALWAYS_INLINE void score_rows(const float *queries, int64_t rows, const float *k, int64_t n,
                                             float *scores, int64_t stride, int64_t chunks) {
    for (int64_t r = 0; r < rows; r++) {
        const float *qr = queries + r * chunks * 16;
        __m512 sums[16];
        for (int64_t j = 0; j < 16; j++) {
            if (j >= n) {
                sums[j] = _mm512_setzero_ps();
                continue;
            }
            const float *kj = k + j * chunks * 16;
            __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qr), _mm512_loadu_ps(kj));
            for (int64_t c = 1; c < chunks; c++)
                sum = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), _mm512_loadu_ps(kj + 16 * c), sum);
            sums[j] = sum;
        }
        _mm512_mask_storeu_ps(scores + r * stride, (__mmask16)((1u << n) - 1), sums_of_16(sums));
    }
}

/* A row's softmax over its positions [from, seen), unnormalised (e^(s - max)), in place; the other
 * positions the values pass reads, [first, from) and [seen, stop), weigh 0. Returns 1 / the row's sum. */
TARGET static float softmax_row(float *scores, int64_t first, int64_t from, int64_t seen, int64_t stop) {
    float *row = scores + from;
    const int64_t n = seen - from;
    __m512 top = _mm512_set1_ps(-__builtin_inff());
    int64_t p = 0;
    for (; p + 16 <= n; p += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(row + p));
    const __mmask16 tail = (__mmask16)((1u << (n - p)) - 1);
    top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, tail, row + p));
    const __m512 most = _mm512_set1_ps(_mm512_reduce_max_ps(top));
    __m512 total = _mm512_setzero_ps();
    for (p = 0; p + 16 <= n; p += 16) {
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + p), most));
        _mm512_storeu_ps(row + p, e);
        total = _mm512_add_ps(total, e);
    }
    const __m512 e = _mm512_maskz_mov_ps(tail, exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, row + p), most)));
    _mm512_mask_storeu_ps(row + p, tail, e);
    total = _mm512_add_ps(total, e);
    for (p = first; p < from; p++) scores[p] = 0.0f;
    for (p = seen; p < stop; p++) scores[p] = 0.0f;
    return 1.0f / _mm512_reduce_add_ps(total);
}

/* out rows += probs x values for up to 16 / chunks rows at once (their sums in registers) over the n
 * value rows at v (consecutive). */
TARGET static ALWAYS_INLINE void weigh_values(const float *probs, int64_t stride, int64_t rows, const float *v,
                                              int64_t n, __m512 *acc, int64_t chunks) {
    for (int64_t j = 0; j < n; j++) {
        const float *vj = v + j * chunks * 16;
        for (int64_t c = 0; c < chunks; c++) {
            const __m512 x = _mm512_loadu_ps(vj + 16 * c);
            for (int64_t r = 0; r < rows; r++)
                acc[r * chunks + c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[r * stride + j]), x, acc[r * chunks + c]);
        }
    }
}

/* One (session, key head): rows r = g T + t for query head h G + g and query t. chunks: dim / 16, a
 * constant where attend_head is specialised, so the loops over it unroll and the sums stay in registers. */
TARGET static ALWAYS_INLINE void attend(const float *q, int64_t q_stride, const float *keys, const float *values,
                                        const int32_t *table, int64_t start, int64_t count, int64_t window,
                                        int64_t groups, int64_t head, int64_t heads, int64_t block, float scale,
                                        float *out, float *scratch, const int64_t chunks) {
    const int64_t dim = chunks * 16, rows = groups * count, stop = start + count;
    float *queries = scratch;             /* [rows, dim], scaled */
    float *scores = scratch + rows * dim; /* [rows, stop]: scores, then unnormalised probabilities */
    float inverse[rows];
    for (int64_t r = 0; r < rows; r++) {
        const float *src = q + (r % count) * q_stride + (head * groups + r / count) * dim;
        for (int64_t c = 0; c < chunks; c++)
            _mm512_storeu_ps(queries + r * dim + 16 * c,
                             _mm512_mul_ps(_mm512_loadu_ps(src + 16 * c), _mm512_set1_ps(scale)));
    }
    /* A sliding window (query at q sees (q - window, q]) skips the blocks before any query's first key. */
    const int64_t b0 = window > 0 && start - window + 1 > 0 ? (start - window + 1) / block : 0;
    for (int64_t b = b0; b * block < stop; b++) {
        const int64_t first = b * block, n = stop - first < block ? stop - first : block;
        const float *k = keys + (int64_t)table[b] * block * dim;
        for (int64_t j = 0; j < n; j += 16)
            score_rows(queries, rows, k + j * dim, n - j < 16 ? n - j : 16, scores + first + j, stop, chunks);
    }
    for (int64_t r = 0; r < rows; r++) {
        const int64_t position = start + r % count;
        const int64_t from = window > 0 && position - window + 1 > 0 ? position - window + 1 : 0;
        inverse[r] = softmax_row(scores + r * stop, b0 * block, from, position + 1, stop);
    }
    const int64_t at_once = 16 / chunks;
    for (int64_t r0 = 0; r0 < rows; r0 += at_once) {
        const int64_t n = rows - r0 < at_once ? rows - r0 : at_once;
        __m512 acc[16];
        for (int64_t i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = b0; b * block < stop; b++) {
            const int64_t first = b * block, m = stop - first < block ? stop - first : block;
            weigh_values(scores + r0 * stop + first, stop, n, values + (int64_t)table[b] * block * dim, m, acc, chunks);
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t r = r0 + i;
            float *dst = out + (r % count) * heads * dim + (head * groups + r / count) * dim;
            for (int64_t c = 0; c < chunks; c++)
                _mm512_storeu_ps(dst + 16 * c, _mm512_mul_ps(acc[i * chunks + c], _mm512_set1_ps(inverse[r])));
        }
    }
}

TARGET static void attend_head(const float *q, int64_t q_stride, const float *keys, const float *values,
                               const int32_t *table, int64_t start, int64_t count, int64_t window, int64_t groups,
                               int64_t head, int64_t heads, int64_t dim, int64_t block, float scale, float *out,
                               float *scratch) {
    switch (dim) {  /* the common widths specialised; others (multiples of 16 up to 256) generic */
    case 64:
        attend(q, q_stride, keys, values, table, start, count, window, groups, head, heads, block, scale, out,
               scratch, 4);
        break;
    case 128:
        attend(q, q_stride, keys, values, table, start, count, window, groups, head, heads, block, scale, out,
               scratch, 8);
        break;
    default:
        attend(q, q_stride, keys, values, table, start, count, window, groups, head, heads, block, scale, out,
               scratch, dim / 16);
    }
}

/* sessions x 4 int64 in `frames`: (offset of its table in `tables`, start, count, its first row of q
 * and out). Returns 0, or -1 for what the kernel does not take (dim not a multiple of 16, heads not a
 * multiple of kv_heads), -2 when scratch memory cannot be had. */
TARGET int imesh_paged_attention_f32(const float *q, int64_t q_stride, const float *k_new, int64_t k_stride,
                                     const float *v_new, int64_t v_stride, float *layer, int64_t slots,
                                     const int32_t *tables, const int64_t *frames, int64_t sessions, int64_t heads,
                                     int64_t kv_heads, int64_t dim, int64_t block, float scale, int64_t window,
                                     float *out, int threads) {
    if (dim <= 0 || dim % 16 || dim > 256 || kv_heads <= 0 || heads % kv_heads || block <= 0) return -1;
    const int64_t groups = heads / kv_heads, items = sessions * kv_heads, plane = slots * dim;
    int failed = 0;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && items > 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t *frame = frames + 4 * (item / kv_heads);
        const int64_t head = item % kv_heads, start = frame[1], count = frame[2], row = frame[3];
        const int32_t *table = tables + frame[0];
        float *keys = layer + head * plane, *values = layer + (kv_heads + head) * plane;
        /* the frame's own keys and values into their slots first: its blocks are its own, never shared */
        for (int64_t t = 0; t < count; t++) {
            const int64_t slot = (int64_t)table[(start + t) / block] * block + (start + t) % block;
            memcpy(keys + slot * dim, k_new + (row + t) * k_stride + head * dim, sizeof(float) * dim);
            memcpy(values + slot * dim, v_new + (row + t) * v_stride + head * dim, sizeof(float) * dim);
        }
        float *scratch = malloc(sizeof(float) * groups * count * (dim + start + count));
        if (!scratch) {
            failed = 1;
            continue;
        }
        attend_head(q + row * q_stride, q_stride, keys, values, table, start, count, window, groups, head, heads,
                    dim, block, scale, out + row * heads * dim, scratch);
        free(scratch);
    }
    return failed ? -2 : 0;
}
