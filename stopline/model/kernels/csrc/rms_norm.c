/* RMS norm, one row at a time: y = (x * (1 / sqrt(mean(x^2) + eps))) * w.
 *
 * Why here: torch's fused rms_norm is about eight ops on the CPU (18 us for a few rows, 1 ms
 * for 512), and a step runs 61 of them. A row's sum of squares runs in one fixed order (16
 * lanes over the row, then the lanes added in a fixed tree), so its bits never depend on
 * the other rows or on the threads. All threads from 16 rows: a serial pass in the fused
 * decoder lets the other thread fall asleep (layer_ops.c says why and what it measured). */
#include <immintrin.h>
#include <math.h>

static inline void norm_row(const float* xr, const float* w, float* yr, int n, float eps) {
    __m512 acc = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= n; k += 16) {
        __m512 v = _mm512_loadu_ps(xr + k);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    float s = _mm512_reduce_add_ps(acc);
    for (; k < n; k++) s += xr[k] * xr[k];
    float inv = 1.0f / sqrtf(s / (float)n + eps);
    __m512 vi = _mm512_set1_ps(inv);
    for (k = 0; k + 16 <= n; k += 16)
        _mm512_storeu_ps(yr + k, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + k), vi),
                                                _mm512_loadu_ps(w + k)));
    for (; k < n; k++) yr[k] = (xr[k] * inv) * w[k];
}

void stopline_rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps) {
    #pragma omp parallel for if (rows >= 16) schedule(static)
    for (int r = 0; r < rows; r++) norm_row(x + (long)r * n, w, y + (long)r * n, n, eps);
}

/* The residual add and the next norm in one pass: x += res, then y = rms_norm(x). The add is
 * the same IEEE add torch does, so x gets the same bits as `x + res`. */
void stopline_add_rms_norm(float* x, const float* res, const float* w, float* y, int rows, int n,
                           float eps) {
    #pragma omp parallel for if (rows >= 16) schedule(static)
    for (int r = 0; r < rows; r++) {
        float* xr = x + (long)r * n;
        const float* rr = res + (long)r * n;
        for (int k = 0; k < n; k++) xr[k] = xr[k] + rr[k];
        norm_row(xr, w, y + (long)r * n, n, eps);
    }
}
