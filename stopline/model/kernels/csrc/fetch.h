/* A packed record's bytes fetched ahead of the pass that reads it: shared by the exact kernel
 * (quant_gemm.c) and the AMX block kernels (amx_gemm.c), whose measurements say why.
 *
 * Panels lie one after another, but the hardware prefetcher stops at each 4 KiB page, and a
 * pass of few rows is bound by how fast the weights stream in (a step of a few rows reads
 * ~100 MB of them, SmolLM2). Each record is fetched 2 KiB ahead into L1 and, where the caller
 * asks, 12 KiB ahead into L2 as well, for passes with too little work to hide the memory's
 * latency behind. A prefetch past the end of the weights is harmless: prefetches do not
 * fault. Always inlined: a call gcc leaves out of line has no effect it can see, so it
 * deletes the call, prefetches and all. */
#ifndef STOPLINE_FETCH_H
#define STOPLINE_FETCH_H
#include <immintrin.h>
#include <stdint.h>

#define NEAR_BYTES 2048
#define FAR_BYTES 12288

static inline __attribute__((always_inline)) void fetch_record(const uint8_t* rec, int bytes, int far) {
    for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char*)(rec + NEAR_BYTES + o), _MM_HINT_T0);
    if (far)
        for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char*)(rec + FAR_BYTES + o), _MM_HINT_T1);
}

#endif
