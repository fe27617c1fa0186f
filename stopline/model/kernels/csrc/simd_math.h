/* Vector math shared by the kernels. */
#ifndef STOPLINE_SIMD_MATH_H
#define STOPLINE_SIMD_MATH_H
#include <immintrin.h>

/* exp(x), ~1 ulp (Cephes' expf: x = n ln2 + r, a degree-7 polynomial for exp(r), scaled by
 * 2^n). Below -104 it gives exp(-104), which rounds to 0; above ~88.7, inf; NaN stays NaN. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x); /* max(c, NaN) is NaN: the 2nd operand */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* log(x) for finite x > 0, ~1 ulp (Cephes' logf: x = m 2^e with m in [sqrt(1/2), sqrt(2)),
 * a degree-8 polynomial for log(m)). */
static inline __m512 log_ps(__m512 x) {
    __m512 e = _mm512_getexp_ps(x);
    __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
    __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356237f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
    e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
    __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
    __m512 z = _mm512_mul_ps(f, f);
    __m512 y = _mm512_set1_ps(7.0376836292e-2f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.1514610310e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.1676998740e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.2420140846e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.4249322787e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.6668057665e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.0000714765e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-2.4999993993e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(3.3333331174e-1f));
    y = _mm512_mul_ps(_mm512_mul_ps(y, f), z);
    y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
    y = _mm512_fnmadd_ps(_mm512_set1_ps(0.5f), z, y);
    __m512 r = _mm512_add_ps(f, y);
    return _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), r);
}

#endif
