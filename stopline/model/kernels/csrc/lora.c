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
 * decoder (decoder.c) and the Python layer loop call this same function. Rows run in parallel
 * (each on one thread), which changes no bit. Built with -ffp-contract=off: every a*b + c is two
 * roundings, as in the float32 reference the tests compute. */
#include <stdint.h>

enum { TILE = 64, PARTS = 3 };

/* x [rows][ldx], y [rows][ldy] (updated in place), slot [rows] (-1: base), at [slots][K][R],
 * bt [slots][R][N], parts [slots][PARTS][3]: per part (rank end, first column, end column),
 * parts in rank order, an unused part repeating the rank end with no columns; the last rank
 * end is the slot's rank for this linear (0: its adapter leaves the linear alone). */
void stopline_lora_rows(const float* x, long ldx, float* y, long ldy, int rows,
                        const int32_t* slot, const float* at, const float* bt,
                        const int32_t* parts, const float* scale, int R, int K, int N) {
    #pragma omp parallel for if (rows > 1) schedule(static)
    for (int i = 0; i < rows; i++) {
        int s = slot[i];
        if (s < 0) continue;
        const int32_t* p = parts + (long)s * PARTS * 3;
        int rank = p[(PARTS - 1) * 3];
        if (rank <= 0) continue;
        const float* a = at + (long)s * K * R;
        const float* b = bt + (long)s * R * N;
        const float* xi = x + (long)i * ldx;
        float* yi = y + (long)i * ldy;
        float sc = scale[s];
        float u[rank];
        for (int j = 0; j < rank; j++) u[j] = 0.0f;
        for (int k = 0; k < K; k++) {
            float xk = xi[k];
            const float* ak = a + (long)k * R;
            for (int j = 0; j < rank; j++) u[j] = u[j] + xk * ak[j];
        }
        int j0 = 0;
        for (int q = 0; q < PARTS; q++) {
            int j1 = p[q * 3], lo = p[q * 3 + 1], hi = p[q * 3 + 2];
            if (j1 > j0) {
                for (int n0 = lo; n0 < hi; n0 += TILE) {
                    int w = hi - n0 < TILE ? hi - n0 : TILE;
                    float acc[TILE];
                    for (int t = 0; t < w; t++) acc[t] = 0.0f;
                    for (int j = j0; j < j1; j++) {
                        float uj = u[j];
                        const float* bj = b + (long)j * N + n0;
                        for (int t = 0; t < w; t++) acc[t] = acc[t] + uj * bj[t];
                    }
                    for (int t = 0; t < w; t++) yi[n0 + t] = yi[n0 + t] + sc * acc[t];
                }
            }
            j0 = j1;
        }
    }
}
