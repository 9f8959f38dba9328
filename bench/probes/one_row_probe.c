/* bench/probes/one_row_probe.py's kernels: the tile product with one column block's chain at a
   time (amx.c before 2026-12-06) or three blocks' chains at once (amx.c now), with
   or without software prefetch, the vector path at 2-8 rows, and a check of which summation
   order reproduces TDPBF16PS. A probe, not a product: nothing of fastmtp_sglang calls it. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "../../fastmtp_sglang/cpu_kernels/bf16.h"

typedef struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;

__attribute__((target("amx-tile")))
static void cfg(int r) {  /* C tiles 0, 3, 4 and A tile 1 of r rows; B tiles 2, 6, 7 of 16 */
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }
    c.rows[0] = c.rows[1] = c.rows[3] = c.rows[4] = (uint8_t)r;
    _tile_loadconfig(&c);
}

int probe_init(void) { return (int)syscall(SYS_arch_prctl, 0x1023, 18); }

static inline int better(float v, int64_t i, float bv, int64_t bi) {
    if (isnan(v)) return !isnan(bv) || i < bi;
    if (isnan(bv)) return 0;
    return v > bv || (v == bv && i < bi);
}

/* argmax of one row's bf16 products on tiles: G (1-3) column blocks' chains at once, software
   prefetch pd bytes ahead (0: none); G = 1, pd = 0 is amx.c's tile path as it ran at one row */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
int probe_tiles_argmax(const uint16_t *x, const uint16_t *w, int N, int K, int64_t *out, int threads,
                       int G, long pd) {
    int nb = (N + 15) / 16, Kp = K / 2, kt = K / 32, used = threads;
    float bestv[64];
    int64_t besti[64];
    if (threads > 64 || G < 1 || G > 3) return -1;
    #pragma omp parallel num_threads(threads)
    {
        float tmp[3][256] __attribute__((aligned(64)));
        int me = omp_get_thread_num(), nt = omp_get_num_threads();
        if (me == 0) used = nt;
        float bv = -INFINITY;
        int64_t bi = -1;
        int lo = (int)((long)nb * me / nt), hi = (int)((long)nb * (me + 1) / nt);
        if (lo < hi) cfg(1);
        for (int j = lo; j < hi; j += G) {
            int g = hi - j < G ? hi - j : G;
            const uint16_t *wb = w + (size_t)j * Kp * 32;
            _tile_zero(0); _tile_zero(3); _tile_zero(4);
            for (int t = 0; t < kt; t++) {
                _tile_loadd(1, x + t * 32, K * 2);
                if (pd)
                    for (int q = 0; q < g; q++)
                        for (int l = 0; l < 1024; l += 64)
                            _mm_prefetch((const char *)(wb + (size_t)q * Kp * 32 + (size_t)t * 512) + pd + l, _MM_HINT_T0);
                _tile_loadd(2, wb + (size_t)t * 512, 64);
                _tile_dpbf16ps(0, 1, 2);
                if (g > 1) { _tile_loadd(6, wb + (size_t)Kp * 32 + (size_t)t * 512, 64); _tile_dpbf16ps(3, 1, 6); }
                if (g > 2) { _tile_loadd(7, wb + (size_t)2 * Kp * 32 + (size_t)t * 512, 64); _tile_dpbf16ps(4, 1, 7); }
            }
            _tile_stored(0, tmp[0], 64); _tile_stored(3, tmp[1], 64); _tile_stored(4, tmp[2], 64);
            for (int q = 0; q < g; q++) {
                int jj = j + q, ncols = N - jj * 16 < 16 ? N - jj * 16 : 16;
                for (int c = 0; c < ncols; c++) {
                    float v = bf2f(f2bf(tmp[q][c]));
                    if (better(v, (int64_t)jj * 16 + c, bv, bi)) { bv = v; bi = (int64_t)jj * 16 + c; }
                }
            }
        }
        if (lo < hi) _tile_release();
        bestv[me] = bv; besti[me] = bi;
    }
    float v = -INFINITY;
    int64_t i = -1;
    for (int th = 0; th < used; th++)
        if (besti[th] >= 0 && (i < 0 || better(bestv[th], besti[th], v, i))) { v = bestv[th]; i = besti[th]; }
    out[0] = i;
    return 0;
}

/* y = x W^T for M <= 16 rows on tiles (no bias), G (1-3) column blocks' chains at once: G = 1
   as amx.c ran it before 2026-12-06, G = 3 as it runs now */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
void probe_tiles_linear(const uint16_t *x, const uint16_t *w, uint16_t *y, int M, int N, int K,
                        int threads, int G) {
    int nb = (N + 15) / 16, Kp = K / 2, kt = K / 32;
    #pragma omp parallel num_threads(threads)
    {
        float tmp[3][256] __attribute__((aligned(64)));
        int me = omp_get_thread_num(), nt = omp_get_num_threads();
        int lo = (int)((long)nb * me / nt), hi = (int)((long)nb * (me + 1) / nt);
        if (lo < hi) cfg(M);
        for (int j = lo; j < hi; j += G) {
            int g = hi - j < G ? hi - j : G;
            const uint16_t *wb = w + (size_t)j * Kp * 32;
            _tile_zero(0); _tile_zero(3); _tile_zero(4);
            for (int t = 0; t < kt; t++) {
                _tile_loadd(1, x + t * 32, K * 2);
                _tile_loadd(2, wb + (size_t)t * 512, 64);
                _tile_dpbf16ps(0, 1, 2);
                if (g > 1) { _tile_loadd(6, wb + (size_t)Kp * 32 + (size_t)t * 512, 64); _tile_dpbf16ps(3, 1, 6); }
                if (g > 2) { _tile_loadd(7, wb + (size_t)2 * Kp * 32 + (size_t)t * 512, 64); _tile_dpbf16ps(4, 1, 7); }
            }
            _tile_stored(0, tmp[0], 64); _tile_stored(3, tmp[1], 64); _tile_stored(4, tmp[2], 64);
            for (int q = 0; q < g; q++) {
                int jj = j + q, ncols = N - jj * 16 < 16 ? N - jj * 16 : 16;
                for (int m = 0; m < M; m++) {
                    __m256bh o = _mm512_cvtneps_pbh(_mm512_load_ps(tmp[q] + m * 16));
                    _mm256_mask_storeu_epi16((void *)(y + (size_t)m * N + jj * 16), (__mmask16)((1u << ncols) - 1), (__m256i)o);
                }
            }
        }
        if (lo < hi) _tile_release();
    }
}

/* y = x W^T for M rows (2, 4 or 8) on vector units: G column blocks a pass, one chain each */
#define VEC_ROWS(MR, G)                                                                           \
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))                                   \
void probe_vector_linear##MR(const uint16_t *x, const uint16_t *w, uint16_t *y, int N, int K,      \
                             int threads) {                                                       \
    int nb = (N + 15) / 16, Kp = K / 2;                                                            \
    _Pragma("omp parallel num_threads(threads)")                                                   \
    {                                                                                              \
        int me = omp_get_thread_num(), nt = omp_get_num_threads();                                 \
        int lo = (int)((long)nb * me / nt), hi = (int)((long)nb * (me + 1) / nt);                  \
        for (int j = lo; j < hi; j += G) {                                                         \
            int g = hi - j < G ? hi - j : G;                                                       \
            __m512 acc[G][MR];                                                                     \
            for (int q = 0; q < G; q++) for (int m = 0; m < MR; m++) acc[q][m] = _mm512_setzero_ps(); \
            for (int q = 0; q < g; q++) {                                                          \
                const uint16_t *wb = w + (size_t)(j + q) * Kp * 32;                                \
                for (int r = 0; r < Kp; r++) {                                                     \
                    __m512bh wv = (__m512bh)_mm512_loadu_si512(wb + (size_t)r * 32);               \
                    for (int m = 0; m < MR; m++) {                                                 \
                        uint32_t pr;                                                               \
                        memcpy(&pr, x + (size_t)m * K + 2 * r, 4);                                 \
                        acc[q][m] = _mm512_dpbf16_ps(acc[q][m], (__m512bh)_mm512_set1_epi32((int)pr), wv); \
                    }                                                                              \
                }                                                                                  \
            }                                                                                      \
            for (int q = 0; q < g; q++) {                                                          \
                int jj = j + q, ncols = N - jj * 16 < 16 ? N - jj * 16 : 16;                        \
                for (int m = 0; m < MR; m++) {                                                     \
                    __m256bh o = _mm512_cvtneps_pbh(acc[q][m]);                                    \
                    _mm256_mask_storeu_epi16((void *)(y + (size_t)m * N + jj * 16),                 \
                                             (__mmask16)((1u << ncols) - 1), (__m256i)o);          \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}
VEC_ROWS(2, 4)
VEC_ROWS(4, 3)
VEC_ROWS(8, 2)

/* Which order of fp32 sums reproduces TDPBF16PS over 18 tiles (576 inputs) of random bf16, for
   `trials` x 16 outputs: counts of outputs differing bit-wise from the tiles' for [0] FMA even
   then odd input of each pair, [1] odd then even, [2] each tile's 32 products summed exactly and
   rounded once into the sum, [3] each tile summed exactly and rounded, then added, [4] each pair
   summed exactly with the sum in one rounding, [5] VDPBF16PS. */
static uint16_t rnd_bf16(unsigned *s) {
    *s = *s * 1103515245u + 12345u;
    float f = ((float)((*s >> 8) & 0xffff) / 65536.0f - 0.5f) * (((*s >> 24) & 3) == 0 ? 100.f : 1.f);
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
void probe_rounding(int trials, long *bad) {
    static uint16_t a[576], b[18][16][16][2];
    unsigned s = 12345u;
    cfg(1);
    for (int q = 0; q < 6; q++) bad[q] = 0;
    for (int trial = 0; trial < trials; trial++) {
        for (int i = 0; i < 576; i++) a[i] = rnd_bf16(&s);
        for (int t = 0; t < 18; t++) for (int k = 0; k < 16; k++) for (int n = 0; n < 16; n++) {
            b[t][k][n][0] = rnd_bf16(&s); b[t][k][n][1] = rnd_bf16(&s);
        }
        float amx[256] __attribute__((aligned(64))), av[16];
        _tile_zero(0);
        for (int t = 0; t < 18; t++) { _tile_loadd(1, a + t * 32, 64); _tile_loadd(2, &b[t][0][0][0], 64); _tile_dpbf16ps(0, 1, 2); }
        _tile_stored(0, amx, 64);
        __m512 acc = _mm512_setzero_ps();
        for (int t = 0; t < 18; t++) for (int k = 0; k < 16; k++) {
            uint32_t pr;
            memcpy(&pr, a + t * 32 + 2 * k, 4);
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)pr), (__m512bh)_mm512_loadu_si512(&b[t][k][0][0]));
        }
        _mm512_storeu_ps(av, acc);
        for (int n = 0; n < 16; n++) {
            float e[5] = {0, 0, 0, 0, 0};
            for (int t = 0; t < 18; t++) {
                double tile = 0;
                for (int k = 0; k < 16; k++) {
                    float x0 = bf2f(a[t * 32 + 2 * k]), x1 = bf2f(a[t * 32 + 2 * k + 1]);
                    float w0 = bf2f(b[t][k][n][0]), w1 = bf2f(b[t][k][n][1]);
                    e[0] = fmaf(x1, w1, fmaf(x0, w0, e[0]));
                    e[1] = fmaf(x0, w0, fmaf(x1, w1, e[1]));
                    e[4] = (float)((double)e[4] + (double)x0 * w0 + (double)x1 * w1);
                    tile += (double)x0 * w0 + (double)x1 * w1;
                }
                e[2] = (float)((double)e[2] + tile);
                e[3] = e[3] + (float)tile;
            }
            uint32_t u, v;
            memcpy(&u, &amx[n], 4);
            for (int q = 0; q < 5; q++) { memcpy(&v, &e[q], 4); bad[q] += u != v; }
            memcpy(&v, &av[n], 4);
            bad[5] += u != v;
        }
    }
    _tile_release();
}
