/* Weight-only quantization at load (modeling/quantized.py's quantized_values) in one pass over
 * each row: a 16-bit checkpoint quantized as a stage reads it, round to nearest, symmetric.
 *
 * The same float32 arithmetic as quantized_values' PyTorch path, so the two give the same bits
 * (tests/test_native_kernels.py checks it): per group, scale = max |w| / top (IEEE division,
 * at least FLT_MIN); then each weight w / scale (IEEE division), INT8/INT4 rounded half to even
 * and clamped to the format's range, FP8 clamped to +-448 and converted to e4m3fn rounding half
 * to even (subnormals included), as torch's float8 conversion does. PyTorch's path takes about
 * six passes over a tile of rows; this one reads each weight twice (max, then quantize) from L1:
 * llama-150m's layers (one thread), INT8 11.3 -> 2.5 ms a third of them, INT4 12.2 -> 3.4.
 *
 * Compiled with woq_gemm.c into one library by modeling/native_kernels.py. */
#include <immintrin.h>
#include <stdint.h>
#include <float.h>

#define TARGET_Q __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

enum { QUANT_INT = 0, QUANT_FLOAT = 1 };
enum { SOURCE_BF16 = 0, SOURCE_F32 = 1 };

static inline TARGET_Q __m512 load16(const void *w, int64_t i, int source) {
    if (source == SOURCE_F32) return _mm512_loadu_ps((const float *)w + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 float32 (|v| <= 448) to e4m3fn's bytes, rounding half to even, as torch converts: below
 * 2^-6 a subnormal m x 2^-9 (m rounded half to even; 8 is the smallest normal's code), else 3
 * mantissa bits kept by rounding the 20 below (a carry moves into the exponent), the exponent
 * rebiased from 127 to 7. */
static inline TARGET_Q __m128i to_e4m3(__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
    const __m512i magnitude = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512 absolute = _mm512_castsi512_ps(magnitude);
    const __m512i subnormal = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(absolute, _mm512_set1_ps(512.0f)),
                                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(magnitude, 20), _mm512_set1_epi32(1));
    __m512i normal = _mm512_add_epi32(_mm512_add_epi32(magnitude, _mm512_set1_epi32(0x7FFFF)), odd);
    normal = _mm512_sub_epi32(_mm512_srli_epi32(normal, 20), _mm512_set1_epi32(120 << 3));
    const __mmask16 small = _mm512_cmp_ps_mask(absolute, _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ);
    const __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(small, normal, subnormal), sign);
    return _mm512_cvtepi32_epi8(code);
}

/* row r's groups; 0, or -2 for a group with an infinity or NaN */
static TARGET_Q int quantize_row(const void *w, int source, int64_t r, int64_t k, int64_t group, int kind,
                                 float top, float low, float high, void *q, float *scale) {
    const int64_t groups = k / group;
    int status = 0;
    for (int64_t c = 0; c < groups; c++) {
        const int64_t at = r * k + c * group;
        __m512 most = _mm512_setzero_ps();
        __mmask16 unordered = 0;
        for (int64_t i = 0; i < group; i += 16) {
            const __m512 x = load16(w, at + i, source);
            unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
            most = _mm512_max_ps(most, _mm512_abs_ps(x));
        }
        const float largest = _mm512_reduce_max_ps(most);
        if (unordered || !(largest <= FLT_MAX)) {
            status = -2;
            continue;
        }
        float s = largest / top;
        if (s < FLT_MIN) s = FLT_MIN;  /* clamp(min=tiny) */
        scale[r * groups + c] = s;
        const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(low), hi = _mm512_set1_ps(high);
        for (int64_t i = 0; i < group; i += 16) {
            __m512 v = _mm512_div_ps(load16(w, at + i, source), sv);
            if (kind == QUANT_INT) {
                v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
                _mm_storeu_si128((__m128i *)((int8_t *)q + at + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(v)));
            } else {
                _mm_storeu_si128((__m128i *)((uint8_t *)q + at + i), to_e4m3(_mm512_min_ps(_mm512_max_ps(v, lo), hi)));
            }
        }
    }
    return status;
}

/* w [n, k] (bfloat16 or float32) -> q [n, k] (int8, or e4m3fn bytes) and scale [n, k / group]
 * float32. bits: 8 or 4 (INT). Returns 0; -1 when group does not divide k or is not a multiple
 * of 16; -2 for a group with an infinity or NaN (PyTorch's path decides what those become). */
int imesh_quantize(const void *w, int source, int64_t n, int64_t k, int64_t group, int kind, int bits,
                   void *q, float *scale, int threads) {
    if (group <= 0 || k % group || group % 16) return -1;
    const float top = kind == QUANT_FLOAT ? 448.0f : (float)((1 << bits) - 1) / 2.0f;
    const float low = kind == QUANT_FLOAT ? -448.0f : (float)-(1 << (bits - 1));
    const float high = kind == QUANT_FLOAT ? 448.0f : (float)((1 << (bits - 1)) - 1);
    int status = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < n; r++) {
        if (quantize_row(w, source, r, k, group, kind, top, low, high, q, scale)) {
            #pragma omp atomic write
            status = -2;
        }
    }
    return status;
}
