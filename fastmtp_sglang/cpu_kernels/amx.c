/* Linear layers at the few rows of a decode step on AMX tiles, reading each weight once for
   all rows.

   y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n]) in bf16, accumulated in fp32, for M rows. W is laid
   out once (fastmtp_sglang/cpu_kernels/amx.py) as [N/16][K/2][16][2], zero-padded to whole blocks
   of 16 output columns and whole tiles of 32 inputs, so that 16 consecutive pairs of one block
   are one 1 KB tile: 16 pairs of inputs x 16 columns, the B operand of TDPBF16PS. The rows'
   inputs are the A operand (up to 16 rows x 32 inputs), the C tile holds 16 rows x 16 fp32
   sums. A block's tiles are multiplied against every 16 rows before the next block is read, so
   the weights stream from memory once per call whatever M is; each output is one chain of tile
   products in the same order for any M (a row's result does not depend on the other rows).
   The sums get the bias in fp32 and are rounded to bf16 (nearest even) once.

   Blocks of columns are split across OpenMP threads; loader.py links the library against
   the libgomp PyTorch has already loaded, so no second thread pool competes for the cores.
   Tile configuration is per thread: each thread loads its own and releases it. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16.h"  /* bf2f, f2bf, bf16x16, exp16 */

/* K must be a multiple of 32 (amx.py pads the rows' inputs with zeros), and the process
   must hold the permission to use tile data (fastmtp_amx_init). */

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
    c.rows[0] = r;  c.colsb[0] = 64;  /* C: r rows x 16 fp32 */
    c.rows[1] = r;  c.colsb[1] = 64;  /* A: r rows x 32 bf16 */
    c.rows[2] = 16; c.colsb[2] = 64;  /* B: 16 pairs x 16 columns x 2 */
    _tile_loadconfig(&c);
}

int fastmtp_amx_init(void) {
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): 0 when granted (idempotent) */
    return (int)syscall(SYS_arch_prctl, 0x1023, 18);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
void fastmtp_linear_bf16_amx(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                             int M, int N, int K, int threads) {
    int nb = (N + 15) / 16, Kp = K / 2, kt = K / 32;
    #pragma omp parallel num_threads(threads)
    {
        int cur = 0;
        float tmp[16 * 16] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int j = 0; j < nb; j++) {
            const uint16_t *wb = w + (size_t)j * Kp * 32;
            int ncols = N - j * 16 < 16 ? N - j * 16 : 16;
            __mmask16 mask = (__mmask16)((1u << ncols) - 1);
            __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * 16) : _mm512_setzero_ps();
            for (int m0 = 0; m0 < M; m0 += 16) {
                int r = M - m0 < 16 ? M - m0 : 16;
                if (r != cur) { amx_config(r); cur = r; }
                _tile_zero(0);
                for (int t = 0; t < kt; t++) {
                    _tile_loadd(1, x + (size_t)m0 * K + t * 32, K * 2);
                    _tile_loadd(2, wb + (size_t)t * 512, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, tmp, 64);
                for (int m = 0; m < r; m++) {
                    __m256bh o = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(tmp + m * 16), b));
                    _mm256_mask_storeu_epi16((void *)(y + (size_t)(m0 + m) * N + j * 16), mask, (__m256i)o);
                }
            }
        }
        if (cur) _tile_release();
    }
}

int fastmtp_cpu_kernels_version(void) { return 3; }

/* ---------- the elementwise steps of a bf16 decoder layer ----------
   Each is one call where PyTorch makes 3-9 (3-5 us of dispatch each at the few rows of a
   decode step), with the roundings of transformers' bf16 Llama layer: every op's result is
   rounded to bf16 where PyTorch's would be. Single-threaded: a row is a few hundred values. */

static inline float rbf(float f) { return bf2f(f2bf(f)); }

/* x[r] += d[r] (when d), then h[r] = w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)): the residual add
   and RMSNorm of Llama (statistics in fp32, the weight applied in bf16). */
void fastmtp_add_rms_bf16(uint16_t *x, const uint16_t *d, const uint16_t *w, uint16_t *h,
                          int N, int H, float eps) {
    for (int r = 0; r < N; r++) {
        uint16_t *xr = x + (size_t)r * H;
        if (d) {
            const uint16_t *dr = d + (size_t)r * H;
            for (int i = 0; i < H; i++) xr[i] = f2bf(bf2f(xr[i]) + bf2f(dr[i]));
        }
        float ss = 0.f;
        for (int i = 0; i < H; i++) { float v = bf2f(xr[i]); ss += v * v; }
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        uint16_t *hr = h + (size_t)r * H;
        for (int i = 0; i < H; i++) hr[i] = f2bf(bf2f(w[i]) * rbf(bf2f(xr[i]) * inv));
    }
}

/* Rotary embedding of the first `heads` heads of each row of qkv (q's then k's), in place:
   x * cos + rotate_half(x) * sin with cos, sin [N, D] (bf16, one row per token). */
void fastmtp_rope_bf16(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, int N, int heads,
                       int D, int ld) {
    int half = D / 2;
    float tmp[512];
    for (int r = 0; r < N; r++) {
        const uint16_t *c = cos + (size_t)r * D, *s = sin + (size_t)r * D;
        for (int hh = 0; hh < heads; hh++) {
            uint16_t *x = qkv + (size_t)r * ld + (size_t)hh * D;
            for (int i = 0; i < D; i++) tmp[i] = bf2f(x[i]);
            for (int i = 0; i < D; i++) {
                float rot = i < half ? -tmp[i + half] : tmp[i - half];
                x[i] = f2bf(rbf(tmp[i] * bf2f(c[i])) + rbf(rot * bf2f(s[i])));
            }
        }
    }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static inline __m512 round16(__m512 x) {  /* to bf16 and back (nearest even) */
    __m256bh b = _mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)b), 16));
}

/* out[r, i] = bf16(silu(g[r, i])) * u[r, i] with g, u the two halves of each row of gu [N, 2I]. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void fastmtp_silu_mul_bf16(const uint16_t *gu, uint16_t *out, int N, int I) {
    for (int r = 0; r < N; r++) {
        const uint16_t *g = gu + (size_t)r * 2 * I, *u = g + I;
        uint16_t *o = out + (size_t)r * I;
        int i = 0;
        for (; i + 16 <= I; i += 16) {
            __m512 v = bf16x16(g + i);
            __m512 s = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
            __m512 y = _mm512_mul_ps(round16(s), bf16x16(u + i));
            _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(y));
        }
        for (; i < I; i++) {
            float v = bf2f(g[i]);
            o[i] = f2bf(rbf(v / (1.0f + expf(-v))) * bf2f(u[i]));
        }
    }
}
