/* LoRA deltas for a step's rows, each row under its own adapter slot (model/lora.py `Slots`).
 *
 * For a row i with slot s >= 0 whose adapter touches this linear (rank > 0):
 *
 *   u[j] = x[0]*At[s,0,j] + x[1]*At[s,1,j] + ...        k = 0, 1, ..., K-1 in that order
 *   y[n] = y[n] + scale[s] * (u[j0]*Bt[s,j0,n] + u[j0+1]*Bt[s,j0+1,n] + ... )
 *
 * where j0 .. j1 are the ranks of the part (q, k, v of qkv; gate, up of gate_up) whose output
 * columns hold n: the other parts' B rows are zero there, and adding their zero products would
 * change no bit (a sum started at +0 never becomes -0), so they are skipped.
 *
 * Each sum runs in one fixed order, vectorized across outputs only (the j of u, the n of y;
 * A is stored transposed, [K][R], so a k's ranks are contiguous): a row's bits depend on its
 * own input and slot, never on the row count or its neighbours (batch invariance), and the C
 * decoder (decoder.c) and the Python layer loop call this same function. Four rows' sums run
 * side by side, and big steps spread groups of rows over threads; neither changes a bit. The
 * intrinsics multiply and add separately (no FMA), and the file is built with
 * -ffp-contract=off: every a*b + c is two roundings, as in the float32 reference the tests
 * compute. */
#include <immintrin.h>
#include <stdint.h>

enum { TILE = 128, PARTS = 3 };

/* u[j] = x[0]*a[0][j] + x[1]*a[1][j] + ... for j < rank (a: [K][R]), for rank > 64. */
static void low_rank_u(const float* x, const float* a, int K, int R, int rank, float* u) {
    for (int j = 0; j < rank; j++) u[j] = 0.0f;
    for (int k = 0; k < K; k++) {
        float xk = x[k];
        const float* ak = a + (long)k * R;
        for (int j = 0; j < rank; j++) u[j] = u[j] + xk * ak[j];
    }
}

/* The same sums for G rows of ranks <= 64 at once (rank 0: no row), each row's in four
 * registers, each k one multiply and one add per lane: the rows' chains run side by side and
 * nothing goes through memory. A row's sums are its own whatever shares the group. Lanes
 * past a rank read zeros and are never stored. */
enum { G = 4 };
static void low_rank_u_rows(const float* const x[G], const float* const a[G], const int rank[G],
                            int K, int R, float u[G][64]) {
    __mmask16 m[G][4];
    __m512 acc[G][4];
    for (int r = 0; r < G; r++)
        for (int v = 0; v < 4; v++) {
            int left = rank[r] - 16 * v;
            m[r][v] = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
            acc[r][v] = _mm512_setzero_ps();
        }
    for (int k = 0; k < K; k++) {
        for (int r = 0; r < G; r++) {
            if (!m[r][0]) continue;
            __m512 xk = _mm512_set1_ps(x[r][k]);
            const float* ak = a[r] + (long)k * R;
            for (int v = 0; v < 4; v++)
                if (m[r][v])
                    acc[r][v] = _mm512_add_ps(acc[r][v],
                                              _mm512_mul_ps(xk, _mm512_maskz_loadu_ps(m[r][v], ak + 16 * v)));
        }
    }
    for (int r = 0; r < G; r++)
        for (int v = 0; v < 4; v++) _mm512_mask_storeu_ps(u[r] + 16 * v, m[r][v], acc[r][v]);
}

/* y[n] += sc * (u[j0]*b[j0][n] + ... + u[j1-1]*b[j1-1][n]) for n in [lo, hi) (b: [R][N]):
 * eight registers of outputs at a time, the ranks added one after another. */
static void low_rank_y(const float* u, const float* b, long N, int j0, int j1, int lo, int hi,
                       float sc, float* y) {
    __m512 scv = _mm512_set1_ps(sc);
    for (int n0 = lo; n0 < hi; n0 += TILE) {
        int w = hi - n0 < TILE ? hi - n0 : TILE;
        __mmask16 m[8];
        for (int v = 0; v < 8; v++) {
            int left = w - 16 * v;
            m[v] = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1u) : 0;
        }
        __m512 acc[8];
        for (int v = 0; v < 8; v++) acc[v] = _mm512_setzero_ps();
        for (int j = j0; j < j1; j++) {
            __m512 uj = _mm512_set1_ps(u[j]);
            const float* bj = b + (long)j * N + n0;
            for (int v = 0; v < 8; v++)
                acc[v] = _mm512_add_ps(acc[v], _mm512_mul_ps(uj, _mm512_maskz_loadu_ps(m[v], bj + 16 * v)));
        }
        for (int v = 0; v < 8; v++) {
            float* yv = y + n0 + 16 * v;
            __m512 out = _mm512_add_ps(_mm512_maskz_loadu_ps(m[v], yv), _mm512_mul_ps(scv, acc[v]));
            _mm512_mask_storeu_ps(yv, m[v], out);
        }
    }
}

/* x [rows][ldx], y [rows][ldy] (updated in place), slot [rows] (-1: base), at [slots][K][R],
 * bt [slots][R][N], parts [slots][PARTS][3]: per part (rank end, first column, end column),
 * parts in rank order, an unused part repeating the rank end with no columns; the last rank
 * end is the slot's rank for this linear (0: its adapter leaves the linear alone). Rows go
 * to threads only for big steps (prefill): a decode's few rows take tens of microseconds,
 * less than waking the other thread on a busy host costs. */
void stopline_lora_rows(const float* x, long ldx, float* y, long ldy, int rows,
                        const int32_t* slot, const float* at, const float* bt,
                        const int32_t* parts, const float* scale, int R, int K, int N) {
    int groups = (rows + G - 1) / G;
    #pragma omp parallel for if ((long)rows * R * (K + N) >= (1L << 22)) schedule(static)
    for (int g = 0; g < groups; g++) {
        const float* xs[G];
        const float* as[G];
        int ranks[G];
        float u[G][64];
        for (int r = 0; r < G; r++) {
            int i = g * G + r, s = i < rows ? slot[i] : -1;
            int rank = s >= 0 ? parts[((long)s * PARTS + PARTS - 1) * 3] : 0;
            xs[r] = x + (long)(i < rows ? i : 0) * ldx;
            as[r] = at + (long)(s >= 0 ? s : 0) * K * R;
            ranks[r] = rank <= 64 ? rank : 0;  /* wider ranks: one at a time below */
        }
        low_rank_u_rows(xs, as, ranks, K, R, u);
        for (int r = 0; r < G && g * G + r < rows; r++) {
            int i = g * G + r, s = slot[i];
            if (s < 0) continue;
            const int32_t* p = parts + (long)s * PARTS * 3;
            int rank = p[(PARTS - 1) * 3];
            if (rank <= 0) continue;
            float wide[rank > 64 ? rank : 1];
            const float* ur = u[r];
            if (rank > 64) {
                low_rank_u(xs[r], as[r], K, R, rank, wide);
                ur = wide;
            }
            int j0 = 0;
            for (int q = 0; q < PARTS; q++) {
                int j1 = p[q * 3];
                if (j1 > j0)
                    low_rank_y(ur, bt + (long)s * R * N, N, j0, j1, p[q * 3 + 1], p[q * 3 + 2], scale[s],
                               y + (long)i * ldy);
                j0 = j1;
            }
        }
    }
}
