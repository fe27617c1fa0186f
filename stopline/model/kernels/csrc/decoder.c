/* Every decoder layer of a step in one call, for steps whose linears all run on the
 * quantized kernel (up to quant_max_rows rows), or all on the fast mode's bf16 kernels (any
 * row count), with the C attention and glue.
 *
 * Why: each layer is nine kernel calls, and from Python each call cost 4-10 us of wrapper,
 * ctypes and tensor allocation: ~2 ms of a ~30 ms step at 11 rows and of a ~12 ms one at one
 * row (cProfile). Here the same kernels run in the same order on the same buffers, so every
 * row gets the bits the Python loop gives it (model/llama.py `_layers_native`).
 *
 * An abort that empties the step sets *interrupt; the loop checks it before each layer, as
 * the Python loop checks its event.
 *
 * A step with LoRA adapter rows (Step.lora_slot not null) adds each row's delta after each
 * of the four linears with lora.c, the kernel the Python loop calls too.
 *
 * Step.linear_s, where not null, gets the seconds the linears took added to it (bf16
 * conversion of their inputs included): `stopline bench floors` times the linears inside a
 * real step with it, weights and caches as the step leaves them. */
#include <stdint.h>
#include <time.h>

void stopline_q4_1_gemm(const float* x, const uint8_t* w, float* y, int M, int K, int N, int kc);
void stopline_q8_0_gemm(const float* x, const uint8_t* w, float* y, int M, int K, int N, int kc);
void stopline_rms_norm(const float* x, const float* w, float* y, int rows, int n, float eps);
void stopline_add_rms_norm(float* x, const float* res, const float* w, float* y, int rows, int n,
                           float eps);
void stopline_rope_store(const float* qkv, int n, int hq, int hk, int d, const int64_t* pos,
                         const float* cos, const float* sin, const int64_t* slots, float* kc,
                         float* vc, long nslots, float* q_out);
int stopline_paged_attention(const float* q, long ldq, const float* kc, const float* vc, float* out,
                             int rows, int heads, int kv_heads, int d, long slots, int bs,
                             const int32_t* nkeys, const int32_t* table_at, const int32_t* tables,
                             int max_keys, float scale);
void stopline_rope_store_q8(const float* qkv, int n, int hq, int hk, int d, const int64_t* pos,
                            const float* cos, const float* sin, const int64_t* slots, int8_t* kc,
                            int8_t* vc, float* ks, float* vs, long nslots, float* q_out);
int stopline_paged_attention_q8(const float* q, long ldq, const int8_t* kc, const int8_t* vc,
                                const float* ks, const float* vs, float* out, int rows, int heads,
                                int kv_heads, int d, long slots, int bs, const int32_t* nkeys,
                                const int32_t* table_at, const int32_t* tables, int max_keys,
                                float scale, int window);
void stopline_silu_mul(const float* gu, int n, int inter, float* out);
void stopline_bf16_gemm(const uint16_t* x, const uint16_t* w, float* y, int M, int K, int N);
void stopline_q4_1_bf16_gemm(const uint16_t* x, const uint8_t* w, float* y, int M, int K, int N);
void stopline_amx_bf16_gemm(const uint16_t* x, const uint16_t* w, float* y, int M, int K, int N);
void stopline_amx_q4_1_gemm(const uint16_t* x, const uint8_t* w, float* y, int M, int K, int N);
void stopline_quantize_rows(const float* x, int M, int K, int8_t* q, float* d, float* ds, int32_t* s);
void stopline_q4_1_i8_gemm(const int8_t* q, const float* d, const float* ds, const int32_t* s,
                           const uint8_t* w, float* y, int M, int K, int N);
void stopline_q8_0_i8_gemm(const int8_t* q, const float* d, const float* ds, const int32_t* s,
                           const uint8_t* w, float* y, int M, int K, int N);
void stopline_lora_rows(const float* x, long ldx, float* y, long ldy, int rows,
                        const int32_t* slot, const float* at, const float* bt,
                        const int32_t* parts, const float* scale, int R, int K, int N);

enum { QKV, O, GATE_UP, DOWN };
/* FAST: a BF16Weight; INT8_*: an Int8Weight's blocks (w), against int8 inputs. */
enum { Q4_1, Q8_0, FAST, INT8_Q4_1, INT8_Q8_0 };

/* One layer's weights (packed blocks, see quant_gemm.c) and cache. */
typedef struct {
    const uint8_t* w[4];
    int32_t fmt[4];
    int32_t kc[4];
    const float* ln1;
    const float* ln2;
    float* k_cache;
    float* v_cache;
    /* fmt FAST (bf16_linear.py's BF16Weight): bf16 panels, Q4_1 blocks or null, the row count
     * up to which the blocks are read, and whether the AMX kernels take the weight. */
    const uint16_t* bf[4];
    const uint8_t* q4[4];
    int32_t q4_max[4];
    int32_t amx[4];
    /* LoRA slots of each linear (lora.c); lora_at null: no resident adapter touches it. */
    const float* lora_at[4];
    const float* lora_bt[4];
    const int32_t* lora_parts[4];
    int32_t lora_r[4];
    /* An int8 cache (k_cache, v_cache then hold int8 quants): its rows' scales; null: float32. */
    float* k_scale;
    float* v_scale;
} Layer;

/* What one step's layers share: sizes, the rows' positions and keys, scratch rows. */
typedef struct {
    int32_t rows, hidden, heads, kv_heads, d, inter, bs, max_keys;
    float eps, scale;
    int64_t slots;
    const int64_t* positions;
    const int64_t* write_slots;
    const float* cos;
    const float* sin;
    const int32_t* nkeys;
    const int32_t* table_at;
    const int32_t* tables;
    float* h;     /* [rows][hidden] normed input of a block */
    float* qkv;   /* [rows][(heads + 2 kv_heads) d] */
    float* q;     /* [rows][heads d] */
    float* attn;  /* [rows][heads d] */
    float* o;     /* [rows][hidden] */
    float* gu;    /* [rows][2 inter] */
    float* act;   /* [rows][inter] */
    float* res;   /* [rows][hidden] the MLP's output, added to x by the next layer's norm */
    const volatile int32_t* interrupt;
    uint16_t* xb; /* [rows][max K] a fast linear's input as bf16 */
    double* linear_s;
    int8_t* q8x;  /* [rows][max K] an int8 linear's input, quantized (int8_gemm.c) */
    float* q8d;   /* [rows][max K / 32] its groups' scales */
    float* q8ds;
    int32_t* q8s;
    const int32_t* lora_slot;  /* [rows] each row's adapter slot, -1: base; null: no adapter rows */
    const float* lora_scale;   /* [slots] */
} Step;

/* torch's float -> bf16 (round to nearest even; NaN stays NaN), the layer loop's
 * x.to(torch.bfloat16), so the fused loop gives the kernels the same inputs. On all threads
 * from 8192 elements (16 rows of SmolLM2's narrowest input), so the other thread does not
 * sleep through it between two GEMMs (layer_ops.c). */
static void to_bf16(const float* x, uint16_t* out, long n) {
    const uint32_t* u = (const uint32_t*)x;
    #pragma omp parallel for if (n >= 8192) schedule(static)
    for (long i = 0; i < n; i++) {
        uint32_t b = u[i];
        out[i] = (b & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0
                                                 : (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    }
}

/* The kernel BF16Weight.__call__ picks for M rows: Q4_1 blocks up to q4_max rows (32 on AMX),
 * else the bf16 panels; AMX or AVX512-BF16 as the weight was built. K even, N a multiple of
 * 32 (DecoderLoop.supports). */
static void fast_gemm(const Layer* l, int which, const Step* s, const float* x, float* y, int M,
                      int K, int N) {
    to_bf16(x, s->xb, (long)M * K);
    int blocks = l->q4[which] && M <= l->q4_max[which] && (M <= 32 || !l->amx[which]);
    if (l->amx[which] && blocks)
        stopline_amx_q4_1_gemm(s->xb, l->q4[which], y, M, K, N);
    else if (l->amx[which])
        stopline_amx_bf16_gemm(s->xb, l->bf[which], y, M, K, N);
    else if (blocks)
        stopline_q4_1_bf16_gemm(s->xb, l->q4[which], y, M, K, N);
    else
        stopline_bf16_gemm(s->xb, l->bf[which], y, M, K, N);
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void gemm(const Layer* l, int which, const Step* s, const float* x, float* y, int M, int K,
                 int N) {
    double t0 = s->linear_s ? seconds() : 0.0;
    switch (l->fmt[which]) {
    case FAST:
        fast_gemm(l, which, s, x, y, M, K, N);
        break;
    case INT8_Q4_1:
    case INT8_Q8_0:
        stopline_quantize_rows(x, M, K, s->q8x, s->q8d, s->q8ds, s->q8s);
        (l->fmt[which] == INT8_Q4_1 ? stopline_q4_1_i8_gemm : stopline_q8_0_i8_gemm)(
            s->q8x, s->q8d, s->q8ds, s->q8s, l->w[which], y, M, K, N);
        break;
    case Q4_1:
        stopline_q4_1_gemm(x, l->w[which], y, M, K, N, l->kc[which]);
        break;
    default:
        stopline_q8_0_gemm(x, l->w[which], y, M, K, N, l->kc[which]);
    }
    if (s->linear_s) *s->linear_s += seconds() - t0;
    /* The adapter rows' deltas, after the base linear, as the Python loop adds them. */
    if (s->lora_slot && l->lora_at[which])
        stopline_lora_rows(x, K, y, N, M, s->lora_slot, l->lora_at[which], l->lora_bt[which],
                           l->lora_parts[which], s->lora_scale, l->lora_r[which], K, N);
}

/* Built with -DSTOPLINE_PROFILE (bench/onerow_profile.py), the loop adds each section's
 * seconds to prof[] and stopline_decoder_profile hands them out and zeroes them: where a
 * step's time goes, measured inside the C call. Off in the engine's build. */
enum { P_NORM, P_QKV, P_ROPE, P_ATTN, P_O, P_GATE_UP, P_SILU, P_DOWN, P_N };
#ifdef STOPLINE_PROFILE
static double prof[P_N];
#define MARK(t) double t = seconds()
#define SECTION(i, t) (prof[i] += seconds() - (t), t = seconds())
void stopline_decoder_profile(double* out) {
    for (int i = 0; i < P_N; i++) out[i] = prof[i], prof[i] = 0.0;
}
#else
#define MARK(t) (void)0
#define SECTION(i, t) (void)0
#endif

/* x: [rows][hidden], the residual stream, updated in place. Returns 0 when every layer ran,
 * 1 when *interrupt stopped it (*ran: layers completed), 2 when the attention could not get
 * its scratch memory. */
int stopline_decoder_layers(const Layer* layers, int n_layers, const Step* s, float* x, int* ran) {
    int n = s->rows, hd = s->heads * s->d;
    int qkv_width = (s->heads + 2 * s->kv_heads) * s->d;
    *ran = 0;
    if (n_layers < 1) return 0;
    for (int li = 0; li < n_layers; li++) {
        *ran = li;
        if (*s->interrupt) return 1;
        const Layer* l = layers + li;
        MARK(t);
        if (li == 0)
            stopline_rms_norm(x, l->ln1, s->h, n, s->hidden, s->eps);
        else
            stopline_add_rms_norm(x, s->res, l->ln1, s->h, n, s->hidden, s->eps);
        SECTION(P_NORM, t);
        gemm(l, QKV, s, s->h, s->qkv, n, s->hidden, qkv_width);
        SECTION(P_QKV, t);
        int failed;
        if (l->k_scale) { /* the int8 cache: the same calls' int8 forms, as the Python loop makes */
            stopline_rope_store_q8(s->qkv, n, s->heads, s->kv_heads, s->d, s->positions, s->cos, s->sin,
                                   s->write_slots, (int8_t*)l->k_cache, (int8_t*)l->v_cache, l->k_scale,
                                   l->v_scale, s->slots, s->q);
            SECTION(P_ROPE, t);
            failed = stopline_paged_attention_q8(s->q, hd, (const int8_t*)l->k_cache,
                                                 (const int8_t*)l->v_cache, l->k_scale, l->v_scale,
                                                 s->attn, n, s->heads, s->kv_heads, s->d, s->slots, s->bs,
                                                 s->nkeys, s->table_at, s->tables, s->max_keys, s->scale, 0);
        } else {
            stopline_rope_store(s->qkv, n, s->heads, s->kv_heads, s->d, s->positions, s->cos, s->sin,
                                s->write_slots, l->k_cache, l->v_cache, s->slots, s->q);
            SECTION(P_ROPE, t);
            failed = stopline_paged_attention(s->q, hd, l->k_cache, l->v_cache, s->attn, n, s->heads,
                                              s->kv_heads, s->d, s->slots, s->bs, s->nkeys, s->table_at,
                                              s->tables, s->max_keys, s->scale);
        }
        if (failed) return 2;
        SECTION(P_ATTN, t);
        gemm(l, O, s, s->attn, s->o, n, hd, s->hidden);
        SECTION(P_O, t);
        stopline_add_rms_norm(x, s->o, l->ln2, s->h, n, s->hidden, s->eps);
        SECTION(P_NORM, t);
        gemm(l, GATE_UP, s, s->h, s->gu, n, s->hidden, 2 * s->inter);
        SECTION(P_GATE_UP, t);
        stopline_silu_mul(s->gu, n, s->inter, s->act);
        SECTION(P_SILU, t);
        gemm(l, DOWN, s, s->act, s->res, n, s->inter, s->hidden);
        SECTION(P_DOWN, t);
    }
    *ran = n_layers;
    long total = (long)n * s->hidden;
    for (long i = 0; i < total; i++) x[i] = x[i] + s->res[i];  /* torch's x.add_(res) */
    return 0;
}
