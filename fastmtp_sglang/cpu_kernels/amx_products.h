/* The building blocks of amx.c's products (included by amx.c only): the tile configuration,
   the tile pass over three column blocks' chains, and the argmax's comparison and its one-row
   pass on AVX-512 dot products. Every function is static: amx.c exports the products. */
#ifndef FASTMTP_AMX_PRODUCTS_H
#define FASTMTP_AMX_PRODUCTS_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

/* Two builds of amx.c (cpu_kernels/amx.py picks one): with AMX tiles, and, with FASTMTP_VECTOR
   defined, for CPUs with AVX-512 bf16 but no AMX (AMD EPYC Zen 4 and later, Intel Cooper Lake):
   there tile_pass takes the same pairs on VDPBF16PS, the tile configuration and release are
   no-ops, and the verify's attention on tiles is not built (amx.py then leaves it to PyTorch). */
#ifdef FASTMTP_VECTOR
#define AMX_ATTR ""
#define TILE_RELEASE() ((void)0)
#else
#define AMX_ATTR ",amx-tile,amx-bf16"
#define TILE_RELEASE() _tile_release()
#endif

#ifdef FASTMTP_VECTOR
static inline void amx_config(int r) { (void)r; }
#else
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

__attribute__((target("amx-tile")))
static void amx_config(int r) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = 16; c.colsb[t] = 64; }  /* B 2, 6, 7: 16 pairs x 16 columns x 2 */
    c.rows[0] = c.rows[3] = c.rows[4] = (uint8_t)r;  /* C: r rows x 16 fp32 */
    c.rows[1] = (uint8_t)r;                          /* A: r rows x 32 bf16 */
    _tile_loadconfig(&c);
}
#endif

/* ---------- the table's pick at one row: AVX-512 dot products over the same tiles ----------
   A tile's row k is pair k of the inputs for its 16 columns, VDPBF16PS's layout: each column's
   sum is one fp32 chain over the pairs in order, four blocks of columns at a time to hide the
   chain's latency. Only the argmax at one row takes it (a greedy draft's pick from its
   vocabulary table): there it read the 16,384-row table 1-5% faster than tiles with three
   chains right after a target step and 10-18% faster with the table in the caches (a draft's
   later steps), while a step's 121 products at one row were level or 4-7% faster on the tiles
   (bench/probes/one_row_probe.py, bare calls, AMX Xeon, 2 threads; bench/results/tile_chains/).
   These sums round apart from the tiles' (rarely the last bit of a bf16 output, and no order
   of fp32 sums tried reproduces TDPBF16PS), so products stay on tiles for every row count; a
   draft's pick may differ from the argmax of linear()'s outputs on a near-tie, which verification
   makes harmless. */

#define ROW_BLOCKS 4

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static inline void row_blocks(const uint16_t *x, const uint16_t *wb, int g, int Kp, __m512 *acc) {
    /* acc[q] = the fp32 sums of block q (0 <= q < g <= ROW_BLOCKS) starting at wb */
    const size_t bs = (size_t)Kp * 32;
    for (int q = 0; q < ROW_BLOCKS; q++) acc[q] = _mm512_setzero_ps();
    if (g == ROW_BLOCKS) {
        for (int r = 0; r < Kp; r++) {
            uint32_t pr;
            memcpy(&pr, x + 2 * r, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pr);
            const uint16_t *wr = wb + (size_t)r * 32;
            acc[0] = _mm512_dpbf16_ps(acc[0], xb, (__m512bh)_mm512_loadu_si512(wr));
            acc[1] = _mm512_dpbf16_ps(acc[1], xb, (__m512bh)_mm512_loadu_si512(wr + bs));
            acc[2] = _mm512_dpbf16_ps(acc[2], xb, (__m512bh)_mm512_loadu_si512(wr + 2 * bs));
            acc[3] = _mm512_dpbf16_ps(acc[3], xb, (__m512bh)_mm512_loadu_si512(wr + 3 * bs));
        }
        return;
    }
    for (int q = 0; q < g; q++)
        for (int r = 0; r < Kp; r++) {
            uint32_t pr;
            memcpy(&pr, x + 2 * r, 4);
            acc[q] = _mm512_dpbf16_ps(acc[q], (__m512bh)_mm512_set1_epi32((int)pr),
                                      (__m512bh)_mm512_loadu_si512(wb + q * bs + (size_t)r * 32));
        }
}

/* ---------- the tile pass: three column blocks' chains at once ----------
   One block's chain of TDPBF16PS waits on its own C tile; with few rows in the A tile that
   latency, not memory, set the pace. Three blocks' chains interleaved (C tiles 0, 3, 4; B tiles
   2, 6, 7; one A tile 1) read the demo target's 121 products of a step 6-20% faster at 1-16 rows
   and the 16,384-row table 4-22% faster right after a target step than one chain, but 6-10%
   slower when the table is in the caches (bench/probes/one_row_probe.py, AMX Xeon, 2 threads;
   bench/results/tile_chains/): a target step streams every weight from memory, so three. Each
   output is still one chain over its tiles in order: the bits of a one-chain pass at any row
   count. */

#define CHAINS 3

#ifdef FASTMTP_VECTOR
/* ---------- the same pass on AVX-512 dot products (no AMX) ----------
   Pair p of a block's tiles is the 64 bytes at p * 32: VDPBF16PS's layout, as row_blocks reads
   it. Up to VROWS rows at a time, each with its g blocks' accumulators, so a weight row is read
   once for those rows (8 rows x 3 blocks: 24 of the 32 vector registers). Each output is one
   fp32 chain over the pairs in order, whatever the other rows: a row's result does not depend
   on the rows beside it. */
#define VROWS 8

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), always_inline))
static inline void vec_rows(const uint16_t *x, int K, const uint16_t *wb, size_t bs, const int g,
                            int np, const int n, float *out0, float *out1, float *out2) {
    /* n rows (1..VROWS) x g blocks (1..3); always inlined with n and g constant (vec_pass's
       switch), so the accumulators stay in registers and the loops unroll */
    __m512 a0[VROWS], a1[VROWS], a2[VROWS];
    for (int m = 0; m < n; m++) a0[m] = a1[m] = a2[m] = _mm512_setzero_ps();
    for (int p = 0; p < np; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wb + (size_t)p * 32);
        const __m512bh w1 = g > 1 ? (__m512bh)_mm512_loadu_si512(wb + bs + (size_t)p * 32) : w0;
        const __m512bh w2 = g > 2 ? (__m512bh)_mm512_loadu_si512(wb + 2 * bs + (size_t)p * 32) : w0;
        for (int m = 0; m < n; m++) {
            uint32_t pr;
            memcpy(&pr, x + (size_t)m * K + 2 * p, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pr);
            a0[m] = _mm512_dpbf16_ps(a0[m], xb, w0);
            if (g > 1) a1[m] = _mm512_dpbf16_ps(a1[m], xb, w1);
            if (g > 2) a2[m] = _mm512_dpbf16_ps(a2[m], xb, w2);
        }
    }
    for (int m = 0; m < n; m++) {
        _mm512_store_ps(out0 + m * 16, a0[m]);
        if (g > 1) _mm512_store_ps(out1 + m * 16, a1[m]);
        if (g > 2) _mm512_store_ps(out2 + m * 16, a2[m]);
    }
}

#define VEC_G(N) \
    switch (g) { \
    case 1: vec_rows(x, K, wb, bs, 1, np, N, o0, o1, o2); break; \
    case 2: vec_rows(x, K, wb, bs, 2, np, N, o0, o1, o2); break; \
    default: vec_rows(x, K, wb, bs, 3, np, N, o0, o1, o2); }

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void vec_pass(const uint16_t *x, int K, const uint16_t *wb, size_t bs, int g, int np, int n,
                     float *o0, float *o1, float *o2) {
    switch (n) {
    case 1: VEC_G(1) break;
    case 2: VEC_G(2) break;
    case 3: VEC_G(3) break;
    case 4: VEC_G(4) break;
    case 5: VEC_G(5) break;
    case 6: VEC_G(6) break;
    case 7: VEC_G(7) break;
    default: VEC_G(8)
    }
}
#undef VEC_G

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static inline void tile_pass(const uint16_t *x, int K, const uint16_t *wb, size_t bs, int g, int kt,
                             int r, float (*tmp)[256]) {
    /* tmp[q] = r rows x 16 fp32 sums of block q (0 <= q < g <= CHAINS) starting at wb, stride bs;
       the rows in groups of at most VROWS, of even sizes (9 rows: 5 + 4, not 8 + 1: a group
       of one row waits on its chains' latency for a whole pass over the weights) */
    const int groups = (r + VROWS - 1) / VROWS;
    for (int m0 = 0, left = r, gi = groups; left > 0; gi--) {
        const int n = (left + gi - 1) / gi;
        vec_pass(x + (size_t)m0 * K, K, wb, bs, g, kt * 16, n, tmp[0] + m0 * 16, tmp[1] + m0 * 16,
                 tmp[2] + m0 * 16);
        m0 += n;
        left -= n;
    }
}
#else
__attribute__((target("amx-tile,amx-bf16")))
static inline void tile_pass(const uint16_t *x, int K, const uint16_t *wb, size_t bs, int g, int kt,
                             int r, float (*tmp)[256]) {
    /* tmp[q] = r rows x 16 fp32 sums of block q (0 <= q < g <= CHAINS) starting at wb, stride bs
       (r: the rows the tile configuration holds, amx_config) */
    (void)r;
    _tile_zero(0); _tile_zero(3); _tile_zero(4);
    for (int t = 0; t < kt; t++) {
        _tile_loadd(1, x + t * 32, K * 2);
        _tile_loadd(2, wb + (size_t)t * 512, 64);
        _tile_dpbf16ps(0, 1, 2);
        if (g > 1) { _tile_loadd(6, wb + bs + (size_t)t * 512, 64); _tile_dpbf16ps(3, 1, 6); }
        if (g > 2) { _tile_loadd(7, wb + 2 * bs + (size_t)t * 512, 64); _tile_dpbf16ps(4, 1, 7); }
    }
    _tile_stored(0, tmp[0], 64);
    if (g > 1) _tile_stored(3, tmp[1], 64);
    if (g > 2) _tile_stored(4, tmp[2], 64);
}
#endif

/* ---------- the argmax's pieces (fastmtp_linear_argmax_bf16_amx) ---------- */

static inline int better(float v, int64_t i, float bv, int64_t bi) {
    if (isnan(v)) return !isnan(bv) || i < bi;
    if (isnan(bv)) return 0;
    return v > bv || (v == bv && i < bi);
}

/* each thread's best of its contiguous share of blocks: bestv/besti [thread][row] */
typedef struct { float v[256][16]; int64_t i[256][16]; int used; } shares;

static inline void keep(float v, int64_t i, float *bv, int64_t *bi) {
    if (better(v, i, *bv, *bi)) { *bv = v; *bi = i; }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static void argmax_row(const uint16_t *x, const uint16_t *w, int N, int K, int threads, shares *sh) {
    /* one row: row_blocks' sums, four column blocks at a time */
    const int nb = (N + 15) / 16, Kp = K / 2;
    #pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num(), nt = omp_get_num_threads();
        if (me == 0) sh->used = nt;
        const int lo = (int)((long)nb * me / nt), hi = (int)((long)nb * (me + 1) / nt);
        float tmp[16] __attribute__((aligned(64)));
        __m512 acc[ROW_BLOCKS];
        float bv = -INFINITY;
        int64_t bi = -1;
        for (int j = lo; j < hi; j += ROW_BLOCKS) {
            const int g = hi - j < ROW_BLOCKS ? hi - j : ROW_BLOCKS;
            row_blocks(x, w + (size_t)j * Kp * 32, g, Kp, acc);
            for (int q = 0; q < g; q++) {
                _mm512_store_ps(tmp, acc[q]);
                const int jj = j + q, ncols = N - jj * 16 < 16 ? N - jj * 16 : 16;
                for (int c = 0; c < ncols; c++) keep(bf2f(f2bf(tmp[c])), (int64_t)jj * 16 + c, &bv, &bi);
            }
        }
        sh->v[me][0] = bv;
        sh->i[me][0] = bi;
    }
}

#endif
