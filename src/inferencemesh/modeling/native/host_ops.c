/* Small per-token operations whose PyTorch dispatch costs more than their arithmetic: on a CPU a
 * decode row's RMSNorm (64-4096 numbers) takes 7 us through torch.rms_norm, most of it dispatch
 * and its composite ops, against about 1.5 us as one call here (ctypes included).
 *
 * rms_norm: y = weight x (x x 1 / sqrt(mean(x^2) + eps)) per row, float32, as transformers'
 * LlamaRMSNorm computes it in float32 (the mean summed in 16 lanes, then across them). A local
 * mesh and its pods compute it alike: the images carry this library (modeling/native_build.py). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define TARGET __attribute__((target("avx512f")))

TARGET int imesh_rms_norm_f32(const float *x, const float *weight, float *y, int64_t rows, int64_t n, float eps) {
    if (n <= 0 || n % 16) return -1;
    for (int64_t r = 0; r < rows; r++) {
        const float *in = x + r * n;
        float *out = y + r * n;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            __m512 v = _mm512_loadu_ps(in + i);
            squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 inverse = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)n + eps));
        for (int64_t i = 0; i < n; i += 16)
            _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_loadu_ps(weight + i),
                                                    _mm512_mul_ps(_mm512_loadu_ps(in + i), inverse)));
    }
    return 0;
}
