/* Greedy decoding's argmax over the vocabulary, for chosen rows of the logits.
 *
 * Why: torch's CPU argmax over 49,152 logits took ~60 us a row here, plus a copy of the rows
 * (index_select); this reads them in place at memory speed. Same answer as torch.argmax: the
 * first index of the maximum, or of the first NaN if the row has one. */
#include <immintrin.h>
#include <stdint.h>

/* One pass: each lane keeps its largest value and where it first saw it (only a strictly
 * larger value moves it); then the largest lane value and the smallest index holding it. */
static int64_t argmax_row(const float* x, int n) {
    __m512 mx = _mm512_set1_ps(-__builtin_inff());
    __m512i at = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = 0;
    int j = 0;
    for (; j + 16 <= n; j += 16, idx = _mm512_add_epi32(idx, step)) {
        __m512 v = _mm512_loadu_ps(x + j);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        __mmask16 gt = _mm512_cmp_ps_mask(v, mx, _CMP_GT_OQ);
        mx = _mm512_mask_mov_ps(mx, gt, v);
        at = _mm512_mask_mov_epi32(at, gt, idx);
    }
    float m = _mm512_reduce_max_ps(mx);
    int64_t best = n; /* no lane holds anything when n < 16: the tail below decides */
    if (j > 0) {
        __mmask16 top = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(m), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(top, at);
    }
    for (int k = j; k < n; k++) {
        if (x[k] != x[k]) nan = 1;
        else if (best == n || x[k] > m) { m = x[k]; best = k; }
    }
    if (nan)
        for (int k = 0; k < n; k++)
            if (x[k] != x[k]) return k;
    return best;
}

void stopline_row_argmax(const float* x, long ld, const int64_t* rows, int nrows, int n, int64_t* out) {
    #pragma omp parallel for if (nrows >= 16) schedule(static)
    for (int i = 0; i < nrows; i++) out[i] = argmax_row(x + rows[i] * ld, n);
}

/* Whether a row can be sampled from: 1 when its maximum is finite, 0 when it holds a NaN or
 * +inf, or nothing above -inf (the engine's bad-row check, EngineCore._bad_rows). torch's
 * amax over one row of 49,152 took ~80 us here alone and ~200 us inside a one-stream step;
 * this takes ~10 us alone. */
static int row_ok(const float* x, int n) {
    __m512 mx = _mm512_set1_ps(-__builtin_inff());
    __mmask16 nan = 0;
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_loadu_ps(x + j);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        mx = _mm512_max_ps(mx, v);
    }
    float m = j ? _mm512_reduce_max_ps(mx) : -__builtin_inff();
    for (int k = j; k < n; k++) {
        if (x[k] != x[k]) nan = 1;
        else if (x[k] > m) m = x[k];
    }
    return !nan && m > -__builtin_inff() && m < __builtin_inff();
}

void stopline_rows_ok(const float* x, long ld, int nrows, int n, uint8_t* out) {
    #pragma omp parallel for if (nrows >= 16) schedule(static)
    for (int i = 0; i < nrows; i++) out[i] = (uint8_t)row_ok(x + i * ld, n);
}
