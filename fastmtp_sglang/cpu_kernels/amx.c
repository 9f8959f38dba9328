/* Linear layers at the few rows of a decode step on AMX tiles, reading each weight once for
   all rows.

   y[m, n] = sum_k x[m, k] * W[n, k] (+ b[n]) in bf16, accumulated in fp32, for M rows. W is laid
   out once (fastmtp_sglang/cpu_kernels/amx.py) as [N/16][K/2][16][2], zero-padded to whole blocks
   of 16 output columns and whole tiles of 32 inputs, so that 16 consecutive pairs of one block
   are one 1 KB tile: 16 pairs of inputs x 16 columns, the B operand of TDPBF16PS. The rows'
   inputs are the A operand (up to 16 rows x 32 inputs), the C tile holds 16 rows x 16 fp32
   sums. A block's tiles are multiplied against every 16 rows before the next block is read, so
   the weights stream from memory once per call whatever M is, three blocks' chains at once
   (tile_pass, amx_products.h); each output is one chain of tile products in the same order for
   any M (a row's result does not depend on the other rows: a greedy request decodes the same
   tokens alone or in a batch).
   The sums get the bias in fp32 and are rounded to bf16 (nearest even) once.

   Blocks of columns are split across OpenMP threads; loader.py links the library against
   the libgomp PyTorch has already loaded, so no second thread pool competes for the cores.
   Tile configuration is per thread: each thread loads its own and releases it. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bf16.h"  /* bf2f, f2bf, bf16x16, exp16 */
#include "amx_products.h"  /* amx_config, tile_pass, argmax_row */

/* K must be a multiple of 32 (amx.py pads the rows' inputs with zeros), and the process
   must hold the permission to use tile data (fastmtp_amx_init). */

int fastmtp_amx_init(void) {
#ifdef FASTMTP_VECTOR
    return 0;  /* no tile data to ask for */
#else
    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): 0 when granted (idempotent) */
    return (int)syscall(SYS_arch_prctl, 0x1023, 18);
#endif
}

/* 1: built with AMX tiles; 0: the AVX-512 build (FASTMTP_VECTOR, amx_products.h) */
#ifdef FASTMTP_VECTOR
int fastmtp_has_tiles(void) { return 0; }
#else
int fastmtp_has_tiles(void) { return 1; }
#endif

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16" AMX_ATTR)))
void fastmtp_linear_bf16_amx(const uint16_t *x, const uint16_t *w, const float *bias, uint16_t *y,
                             int M, int N, int K, int threads) {
    const int nb = (N + 15) / 16, Kp = K / 2, kt = K / 32;
    #pragma omp parallel num_threads(threads)
    {
        int cur = 0;
        float tmp[CHAINS][256] __attribute__((aligned(64)));
        const int me = omp_get_thread_num(), nt = omp_get_num_threads();
        const int lo = (int)((long)nb * me / nt), hi = (int)((long)nb * (me + 1) / nt);
        for (int j = lo; j < hi; j += CHAINS) {
            const int g = hi - j < CHAINS ? hi - j : CHAINS;
            for (int m0 = 0; m0 < M; m0 += 16) {
                const int r = M - m0 < 16 ? M - m0 : 16;
                if (r != cur) { amx_config(r); cur = r; }
                tile_pass(x + (size_t)m0 * K, K, w + (size_t)j * Kp * 32, (size_t)Kp * 32, g, kt, r, tmp);
                for (int q = 0; q < g; q++) {
                    const int jj = j + q, ncols = N - jj * 16 < 16 ? N - jj * 16 : 16;
                    const __mmask16 mask = (__mmask16)((1u << ncols) - 1);
                    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + jj * 16) : _mm512_setzero_ps();
                    for (int m = 0; m < r; m++) {
                        __m256bh o = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(tmp[q] + m * 16), b));
                        _mm256_mask_storeu_epi16((void *)(y + (size_t)(m0 + m) * N + jj * 16), mask, (__m256i)o);
                    }
                }
            }
        }
        if (cur) TILE_RELEASE();
    }
}

int fastmtp_cpu_kernels_version(void) { return 3; }

/* ---------- the elementwise steps of a bf16 decoder layer ----------
   Each is one call where PyTorch makes 3-9 (3-5 us of dispatch each at the few rows of a
   decode step), with the roundings of transformers' bf16 Llama layer: every op's result is
   rounded to bf16 where PyTorch's would be. Single-threaded: a row is a few hundred values,
   taken sixteen at a time (AVX-512, a masked tail; one value at a time they cost ~1.7 us per
   row and call, ~8% of a verify forward of 10 tokens: docs/design.md section 6.9). */

static inline float rbf(float f) { return bf2f(f2bf(f)); }

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static inline __m512 round16(__m512 x) {  /* to bf16 and back (nearest even) */
    __m256bh b = _mm512_cvtneps_pbh(x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)b), 16));
}

/* up to 16 bf16 values (mask m) widened to fp32; zeros where m is off */
__attribute__((target("avx512f,avx512bw,avx512vl")))
static inline __m512 load16m(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* x rounded to bf16 (nearest even) and stored where m is on */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
static inline void store16m(uint16_t *p, __m512 x, __mmask16 m) {
    _mm256_mask_storeu_epi16((void *)p, m, (__m256i)_mm512_cvtneps_pbh(x));
}

static inline __mmask16 tail16(int left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* x[r] += d[r] (when d), then h[r] = w * bf16(x[r] * rsqrt(mean(x[r]^2) + eps)): the residual add
   and RMSNorm of Llama (statistics in fp32, summed in 16 lanes, the weight applied in bf16). */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void fastmtp_add_rms_bf16(uint16_t *x, const uint16_t *d, const uint16_t *w, uint16_t *h,
                          int N, int H, float eps) {
    for (int r = 0; r < N; r++) {
        uint16_t *xr = x + (size_t)r * H;
        __m512 ss = _mm512_setzero_ps();
        for (int i = 0; i < H; i += 16) {
            const __mmask16 m = tail16(H - i);
            __m512 v = load16m(xr + i, m);
            if (d) {
                v = round16(_mm512_add_ps(v, load16m(d + (size_t)r * H + i, m)));
                store16m(xr + i, v, m);
            }
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
        uint16_t *hr = h + (size_t)r * H;
        for (int i = 0; i < H; i += 16) {
            const __mmask16 m = tail16(H - i);
            const __m512 n = round16(_mm512_mul_ps(load16m(xr + i, m), inv));
            store16m(hr + i, _mm512_mul_ps(load16m(w + i, m), n), m);
        }
    }
}

/* Rotary embedding of the first `heads` heads of each row of qkv (q's then k's), in place:
   x * cos + rotate_half(x) * sin with cos, sin [N, D] (bf16, one row per token). Each product
   is rounded to bf16, then their sum: PyTorch's three bf16 ops, value for value. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
void fastmtp_rope_bf16(uint16_t *qkv, const uint16_t *cos, const uint16_t *sin, int N, int heads,
                       int D, int ld) {
    const int half = D / 2;
    for (int r = 0; r < N; r++) {
        const uint16_t *c = cos + (size_t)r * D, *s = sin + (size_t)r * D;
        for (int hh = 0; hh < heads; hh++) {
            uint16_t *x = qkv + (size_t)r * ld + (size_t)hh * D;
            for (int i = 0; i < half; i += 16) {  /* x[i] and x[i + half] rotate together */
                const __mmask16 m = tail16(half - i);
                const __m512 lo = load16m(x + i, m), hi = load16m(x + i + half, m);
                const __m512 a = _mm512_sub_ps(round16(_mm512_mul_ps(lo, load16m(c + i, m))),
                                               round16(_mm512_mul_ps(hi, load16m(s + i, m))));
                const __m512 b = _mm512_add_ps(round16(_mm512_mul_ps(hi, load16m(c + i + half, m))),
                                               round16(_mm512_mul_ps(lo, load16m(s + i + half, m))));
                store16m(x + i, a, m);
                store16m(x + i + half, b, m);
            }
        }
    }
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

/* ---------- one draft step of a Llama-block head at one new token per row, in one call ----------
   What decode/lean_head.py's LeanHead runs as ~25 PyTorch calls and ~12 calls of the functions
   above (each a few microseconds of dispatch at one row), with the same functions and roundings:
   the embedding row, the two input norms, the fusion product(s), the block (norm, q/k/v product,
   rotary, the key and value written into the head's cache, attention over the row's keys at
   positions 0..pos, o product, residual, norm, gate/up product, silu * up, down product,
   residual) and the final norm. Attention: fp32 scores and softmax, one rounding of the output
   to bf16 (as decode_attention.c and PyTorch's CPU attention do).

   w (pointers): 0 embed [V, H], 1 enorm, 2 hnorm [H], 3 f0 tiles, 4 f0 bias, 5 f1 tiles, 6 f1
   bias (layout 0 only), 7 ln1, 8 qkv tiles, 9 qkv bias, 10 o tiles, 11 o bias, 12 ln2, 13 gate/up
   tiles, 14 gate/up bias, 15 down tiles, 16 down bias, 17 final norm; biases fp32 or NULL.
   dims: 0 H, 1 layout (0: e_proj(en) + h_proj(hn); 1: one product of [hn | en]; 2: of [en | hn]),
   2 query heads, 3 key/value heads, 4 head_dim, 5 intermediate size, 6 the embedding's rows (a
   token id outside them, or a negative position, returns -2 before anything is written). eps: enorm, hnorm, ln1,
   ln2, final. Every product's input width must be a multiple of 32 (LeanHead checks).
   Row j: token ids[j], input hidden[j] [H], position pos[j]; S rows per batch row (1: a draft
   step; more: a draft extend, rows b*S .. b*S+S-1 of batch row b, every key written before any
   row attends; S not dividing N returns -3); its cache rows kc/vc + (j/S)*cs_b, key head h at + h*cs_h, position t at + t*D;
   rotary rows cos/sin [>pos, D]. out [N, H]. */

__attribute__((target("avx512f")))
static void attend_one(const uint16_t *q, const uint16_t *kb, const uint16_t *vb, int n, int D,
                       float scale, float *s, uint16_t *out) {
    /* one query head [D] over n keys/values (rows of D), fp32; out rounded to bf16 once */
    float m = -INFINITY;
    for (int t = 0; t < n; t++) {
        __m512 d = _mm512_setzero_ps();
        for (int c = 0; c < D; c += 16)
            d = _mm512_fmadd_ps(bf16x16(q + c), bf16x16(kb + (size_t)t * D + c), d);
        s[t] = _mm512_reduce_add_ps(d) * scale;
        m = s[t] > m ? s[t] : m;
    }
    float l = 0.f;
    for (int t = 0; t < n; t++) { s[t] = expf(s[t] - m); l += s[t]; }
    __m512 acc[16];
    for (int c = 0; c < D / 16; c++) acc[c] = _mm512_setzero_ps();
    for (int t = 0; t < n; t++) {
        const __m512 p = _mm512_set1_ps(s[t]);
        for (int c = 0; c < D / 16; c++)
            acc[c] = _mm512_fmadd_ps(p, bf16x16(vb + (size_t)t * D + 16 * c), acc[c]);
    }
    const float inv = 1.0f / l;
    float tmp[16] __attribute__((aligned(64)));
    for (int c = 0; c < D / 16; c++) {
        _mm512_store_ps(tmp, _mm512_mul_ps(acc[c], _mm512_set1_ps(inv)));
        for (int i = 0; i < 16; i++) out[16 * c + i] = f2bf(tmp[i]);
    }
}

#include <stdlib.h>

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
int fastmtp_head_step_bf16(const void *const *w, const long *dims, const float *eps,
                           const int64_t *ids, const uint16_t *hidden, const int64_t *pos, int N,
                           int S, uint16_t *kc, uint16_t *vc, long cs_b, long cs_h,
                           const uint16_t *cos, const uint16_t *sin, uint16_t *out, int threads) {
    const int H = (int)dims[0], layout = (int)dims[1], nh = (int)dims[2], nkv = (int)dims[3];
    const int D = (int)dims[4], I = (int)dims[5], G = nh / nkv;
    const int QKV = (nh + 2 * nkv) * D;
    const float *nobias = 0;
    #define W16(i) ((const uint16_t *)w[i])
    #define BIAS(i) (w[i] ? (const float *)w[i] : nobias)
    /* S inputs per batch row: input j is batch row j / S (its cache row). Every input's key
       and value are written before any input attends (keys [0, pos[j]]), as the module writes
       them all and then masks by position */
    long maxn = 0;
    if (S < 1 || N % S || threads < 1 || threads > 256) return -3;
    for (int j = 0; j < N; j++) {
        if (ids[j] < 0 || ids[j] >= dims[6] || pos[j] < 0) return -2;  /* nothing written */
        maxn = pos[j] + 1 > maxn ? pos[j] + 1 : maxn;
    }
    const long scn = (maxn + 15) & ~15L;  /* one thread's scores, 64-byte multiples */
    /* scratch: en|hn (cat) [N, 2H], x [N, H], t [N, H], f1 [N, H], qkv [N, QKV], att [N, nh D],
       o [N, H], gu [N, 2I], su [N, I], en and hn apart [N, H] each (layout 0), one row's inputs
       [2H], scores [scn] per thread */
    size_t need = (size_t)N * (2 * H + 4 * H + QKV + nh * D + 3 * I + 2 * H) * 2 + (size_t)2 * H * 2
                  + (size_t)threads * scn * 4 + 64;
    char *mem = malloc(need);
    if (!mem) return -1;
    uint16_t *cat = (uint16_t *)mem, *x = cat + (size_t)N * 2 * H, *t = x + (size_t)N * H;
    uint16_t *f1 = t + (size_t)N * H, *qkv = f1 + (size_t)N * H, *att = qkv + (size_t)N * QKV;
    uint16_t *o = att + (size_t)N * nh * D, *gu = o + (size_t)N * H, *su = gu + (size_t)N * 2 * I;
    uint16_t *en = su + (size_t)N * I, *hn = en + (size_t)N * H, *row = hn + (size_t)N * H;
    float *sc = (float *)(((uintptr_t)(row + 2 * H) + 63) & ~(uintptr_t)63);
    /* the input norms into the fusion's input: [en | hn] (layouts 0, 2) or [hn | en] (1) */
    uint16_t *erow = (layout == 1) ? cat + H : cat, *hrow = (layout == 1) ? cat : cat + H;
    for (int j = 0; j < N; j++) {
        memcpy(row, W16(0) + (size_t)ids[j] * H, (size_t)H * 2);
        memcpy(row + H, hidden + (size_t)j * H, (size_t)H * 2);
        fastmtp_add_rms_bf16(row, 0, W16(1), erow + (size_t)j * 2 * H, 1, H, eps[0]);
        fastmtp_add_rms_bf16(row + H, 0, W16(2), hrow + (size_t)j * 2 * H, 1, H, eps[1]);
    }
    if (layout == 0) {  /* x = e_proj(en) + h_proj(hn), each rounded to bf16, then their sum */
        for (int j = 0; j < N; j++) {
            memcpy(en + (size_t)j * H, cat + (size_t)j * 2 * H, (size_t)H * 2);
            memcpy(hn + (size_t)j * H, cat + (size_t)j * 2 * H + H, (size_t)H * 2);
        }
        fastmtp_linear_bf16_amx(en, W16(3), BIAS(4), x, N, H, H, threads);
        fastmtp_linear_bf16_amx(hn, W16(5), BIAS(6), f1, N, H, H, threads);
        for (size_t i = 0; i < (size_t)N * H; i++) x[i] = f2bf(bf2f(x[i]) + bf2f(f1[i]));
    } else {
        fastmtp_linear_bf16_amx(cat, W16(3), BIAS(4), x, N, H, 2 * H, threads);
    }
    fastmtp_add_rms_bf16(x, 0, W16(7), t, N, H, eps[2]);
    fastmtp_linear_bf16_amx(t, W16(8), BIAS(9), qkv, N, QKV, H, threads);
    const float scale = 1.0f / sqrtf((float)D);
    for (int j = 0; j < N; j++) {
        uint16_t *p = qkv + (size_t)j * QKV;
        fastmtp_rope_bf16(p, cos + (size_t)pos[j] * D, sin + (size_t)pos[j] * D, 1, nh + nkv, D, QKV);
        const size_t cb = (size_t)(j / S) * cs_b;
        for (int h = 0; h < nkv; h++) {
            memcpy(kc + cb + (size_t)h * cs_h + (size_t)pos[j] * D, p + (size_t)(nh + h) * D, (size_t)D * 2);
            memcpy(vc + cb + (size_t)h * cs_h + (size_t)pos[j] * D, p + (size_t)(nh + nkv + h) * D,
                   (size_t)D * 2);
        }
    }
    /* one query head of one input per task; a draft step of one row stays on this thread */
    #pragma omp parallel for num_threads(threads) schedule(static) if (N > 1)
    for (int x = 0; x < N * nh; x++) {
        const int j = x / nh, hq = x % nh, h = hq / G;
        const size_t cb = (size_t)(j / S) * cs_b;
        attend_one(qkv + (size_t)j * QKV + (size_t)hq * D, kc + cb + (size_t)h * cs_h,
                   vc + cb + (size_t)h * cs_h, (int)pos[j] + 1, D, scale,
                   sc + (size_t)omp_get_thread_num() * scn, att + (size_t)j * nh * D + (size_t)hq * D);
    }
    fastmtp_linear_bf16_amx(att, W16(10), BIAS(11), o, N, H, nh * D, threads);
    fastmtp_add_rms_bf16(x, o, W16(12), t, N, H, eps[3]);
    fastmtp_linear_bf16_amx(t, W16(13), BIAS(14), gu, N, 2 * I, H, threads);
    fastmtp_silu_mul_bf16(gu, su, N, I);
    fastmtp_linear_bf16_amx(su, W16(15), BIAS(16), o, N, H, I, threads);
    fastmtp_add_rms_bf16(x, o, W16(17), out, N, H, eps[4]);
    #undef W16
    #undef BIAS
    free(mem);
    return 0;
}

/* ---------- a product and the index of each row's largest output, without writing the outputs ----------
   What a greedy draft step needs from its vocabulary table: argmax_n bf16(x[m] . W[n]) for M <= 16
   rows, the first index on ties (as torch.max / argmax), a NaN output winning (as torch.max).
   From two rows the same tiles, sums and rounding as fastmtp_linear_bf16_amx (one row: the
   vector sums of argmax_row, amx_products.h, which may round a near-tie apart); each thread keeps the best of
   its contiguous share of blocks, and the shares are compared in order. map: NULL, or [N] ids
   written in place of the indices (a vocabulary table's token ids: one tensor op fewer a step). */

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16" AMX_ATTR)))
static void argmax_tiles(const uint16_t *x, const uint16_t *w, int M, int N, int K, int threads,
                         shares *sh) {
    const int nb = (N + 15) / 16, Kp = K / 2, kt = K / 32;
    #pragma omp parallel num_threads(threads)
    {
        float tmp[CHAINS][256] __attribute__((aligned(64)));
        const int me = omp_get_thread_num(), nt = omp_get_num_threads();
        if (me == 0) sh->used = nt;
        float *bv = sh->v[me];
        int64_t *bi = sh->i[me];
        for (int m = 0; m < M; m++) { bv[m] = -INFINITY; bi[m] = -1; }
        const int lo = (int)((long)nb * me / nt), hi = (int)((long)nb * (me + 1) / nt);
        if (lo < hi) amx_config(M);
        for (int j = lo; j < hi; j += CHAINS) {
            const int g = hi - j < CHAINS ? hi - j : CHAINS;
            tile_pass(x, K, w + (size_t)j * Kp * 32, (size_t)Kp * 32, g, kt, M, tmp);
            for (int q = 0; q < g; q++) {
                const int jj = j + q, ncols = N - jj * 16 < 16 ? N - jj * 16 : 16;
                for (int m = 0; m < M; m++)
                    for (int c = 0; c < ncols; c++)
                        keep(bf2f(f2bf(tmp[q][m * 16 + c])), (int64_t)jj * 16 + c, bv + m, bi + m);
            }
        }
        if (lo < hi) TILE_RELEASE();
    }
}

int fastmtp_linear_argmax_bf16_amx(const uint16_t *x, const uint16_t *w, int M, int N, int K,
                                   int64_t *out, int threads, const int64_t *map) {
    if (M < 1 || M > 16 || threads < 1 || threads > 256) return -1;
    shares sh;  /* 49 KB, as the two arrays it holds were */
    sh.used = threads;
    if (M == 1) argmax_row(x, w, N, K, threads, &sh);
    else argmax_tiles(x, w, M, N, K, threads, &sh);
    for (int m = 0; m < M; m++) {
        float v = -INFINITY;
        int64_t i = -1;
        for (int th = 0; th < sh.used; th++)
            if (sh.i[th][m] >= 0 && (i < 0 || better(sh.v[th][m], sh.i[th][m], v, i))) { v = sh.v[th][m]; i = sh.i[th][m]; }
        out[m] = map && i >= 0 ? map[i] : i;
    }
    return 0;
}

/* ---------- attention of a verify's few new tokens per row, on tiles ----------
   The pending token, its drafts and their leaves: S queries a row, each with its own row of the
   mask over the T slots (its tree). PyTorch's CPU attention took ~45-60 us a layer for the 7
   queries of a K=2 + leaves verify at one row (3 key/value heads of 3 query heads, ~400 slots),
   most of it the products.

   Per row b and key/value head h, the G * S queries sharing h (query head h*G + g at token s:
   query i = g * S + s) go in chunks of at most 16 (the A tile's rows). 1. Scores: 16 slots at a
   time, each B tile built from the keys by a gather of each pair of bf16 dims over the 16 slots
   (the VNNI layout TDPBF16PS reads), one tile product per 32 dims, the C tile stored as the
   chunk's 16 scores. 2. Per query over its whole row: scale, mask, softmax in fp32 (no
   rescaling: the row is at hand), the weights rounded to bf16 (as PyTorch's CPU flash attention
   does before its second product), their sum kept in fp32. 3. Values: per 16 dims, the weights
   of 32 slots (A) against those slots' values interleaved in pairs (B), accumulated in the C
   tile over all slots, then divided by the sum and rounded to bf16 once.

   q: bf16, strides qs_b, qs_h, qs_s (elements) for row, query head, token; the last dimension
   contiguous. k, v: [B, H, T, D] views, strides ks_* / vs_* for row, head, slot, the last
   dimension contiguous. valid: [B, S, T] bytes (nonzero = token s sees slot t). out:
   [B, S, H * G, D] contiguous bf16. D a multiple of 32, at most 256; 16 * ks_t * 2 below 2^31.
   A token that sees no slot gets zeros. Returns -1 without scratch memory, -3 for shapes it does
   not take (nothing written), else 0. */
#ifdef FASTMTP_VECTOR
/* the AVX-512 build has no tiles: amx.py leaves a verify's attention to PyTorch there */
int fastmtp_multi_attn_amx(const uint16_t *q, long qs_b, long qs_h, long qs_s,
                           const uint16_t *k, const uint16_t *v, const uint8_t *valid,
                           uint16_t *out, int B, int H, int G, int S, int T, int D,
                           long ks_b, long ks_h, long ks_t, long vs_b, long vs_h, long vs_t,
                           float scale, int threads) {
    return -3;
}
#else
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
int fastmtp_multi_attn_amx(const uint16_t *q, long qs_b, long qs_h, long qs_s,
                           const uint16_t *k, const uint16_t *v, const uint8_t *valid,
                           uint16_t *out, int B, int H, int G, int S, int T, int D,
                           long ks_b, long ks_h, long ks_t, long vs_b, long vs_h, long vs_t,
                           float scale, int threads) {
    if (D % 32 || D > 256 || threads < 1 || threads > 256 || T < 1 || S < 1 || G < 1) return -3;
    const int Q = G * S, NH = H * G, KT = D / 32;
    const int nch = (Q + 15) / 16, per = (Q + nch - 1) / nch;
    const long T32 = ((long)T + 31) & ~31L;
    const size_t each = (size_t)16 * T32 * 4 + (size_t)16 * T32 * 2;  /* scores, weights */
    char *mem = aligned_alloc(64, (size_t)threads * each + 64);
    if (!mem) return -1;
    const __m512i slots = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32((int)(ks_t * 2)));
    const __m512i pairs = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                           39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    #pragma omp parallel num_threads(threads)
    {
        float *sc = (float *)(mem + (size_t)omp_get_thread_num() * each);
        uint16_t *pb = (uint16_t *)(sc + (size_t)16 * T32);
        uint16_t qa[16 * 256] __attribute__((aligned(64)));
        uint32_t bt[16 * 16] __attribute__((aligned(64)));
        float ct[16 * 16] __attribute__((aligned(64)));
        float l[16];
        int hq[16], tok[16], cur = 0;
        const uint8_t *ok[16];
        #pragma omp for schedule(static)
        for (int task = 0; task < B * H * nch; task++) {
            const int b = task / (H * nch), h = (task / nch) % H, i0 = (task % nch) * per;
            const int nq = Q - i0 < per ? Q - i0 : per;
            if (!cur) { amx_config(16); cur = 16; }  /* 16 rows whatever nq: one configuration */
            memset(qa + (size_t)nq * D, 0, (size_t)(16 - nq) * D * 2);
            for (int i = 0; i < nq; i++) {
                const int qi = i0 + i, g = qi / S, s = qi % S;
                hq[i] = h * G + g;
                tok[i] = s;
                memcpy(qa + (size_t)i * D, q + b * qs_b + hq[i] * qs_h + s * qs_s, (size_t)D * 2);
                ok[i] = valid + ((size_t)b * S + s) * T;
            }
            const uint16_t *kb = k + b * ks_b + h * ks_h, *vb = v + b * vs_b + h * vs_h;
            /* 1. scores [nq][T32] (0 past T: masked below) */
            for (long t0 = 0; t0 < T32; t0 += 16) {
                const long n = T - t0 < 0 ? 0 : (T - t0 < 16 ? T - t0 : 16);
                _tile_zero(0);
                if (n > 0) {
                    const __mmask16 in = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
                    const char *base = (const char *)(kb + t0 * ks_t);
                    for (int kk = 0; kk < KT; kk++) {
                        for (int dp = 0; dp < 16; dp++)
                            _mm512_store_si512((void *)(bt + dp * 16),
                                               _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), in, slots,
                                                                           base + (size_t)(32 * kk + 2 * dp) * 2, 1));
                        _tile_loadd(1, qa + 32 * kk, D * 2);
                        _tile_loadd(2, bt, 64);
                        _tile_dpbf16ps(0, 1, 2);
                    }
                }
                _tile_stored(0, sc + t0, T32 * 4);
            }
            /* 2. each query's softmax over its row; weights to bf16 */
            for (int i = 0; i < nq; i++) {
                float *r = sc + (size_t)i * T32;
                __m512 mx = ninf;
                for (long t = 0; t < T32; t += 16) {
                    __mmask16 bits = 0;
                    if (t + 16 <= T) {
                        __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(ok[i] + t)));
                        bits = _mm512_test_epi32_mask(x, x);
                    } else {
                        for (long j = t; j < T; j++) bits |= (__mmask16)((ok[i][j] != 0) << (j - t));
                    }
                    __m512 x = _mm512_mask_mul_ps(ninf, bits, _mm512_load_ps(r + t), _mm512_set1_ps(scale));
                    _mm512_store_ps(r + t, x);
                    mx = _mm512_max_ps(mx, x);
                }
                const float m = _mm512_reduce_max_ps(mx);
                __m512 sum = _mm512_setzero_ps();
                const __m512 mv = _mm512_set1_ps(m == -INFINITY ? 0.f : m);
                for (long t = 0; t < T32; t += 16) {
                    __m512 x = _mm512_load_ps(r + t);
                    __mmask16 fin = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
                    __m512 e = _mm512_maskz_mov_ps(fin, exp16(_mm512_sub_ps(x, mv)));
                    sum = _mm512_add_ps(sum, e);
                    _mm256_store_si256((__m256i *)(pb + (size_t)i * T32 + t), (__m256i)_mm512_cvtneps_pbh(e));
                }
                l[i] = _mm512_reduce_add_ps(sum);
            }
            /* 3. values: 16 dims at a time, 32 slots a tile product */
            for (int c = 0; c < D / 16; c++) {
                _tile_zero(0);
                for (long t0 = 0; t0 < T32; t0 += 32) {
                    for (int kp = 0; kp < 16; kp++) {
                        const long a = t0 + 2 * kp;
                        __m256i va = a < T ? _mm256_loadu_si256((const __m256i *)(vb + a * vs_t + 16 * c)) : _mm256_setzero_si256();
                        __m256i vn = a + 1 < T ? _mm256_loadu_si256((const __m256i *)(vb + (a + 1) * vs_t + 16 * c)) : _mm256_setzero_si256();
                        _mm512_store_si512((void *)(bt + kp * 16),
                                           _mm512_permutex2var_epi16(_mm512_castsi256_si512(va), pairs, _mm512_castsi256_si512(vn)));
                    }
                    _tile_loadd(1, pb + t0, T32 * 2);
                    _tile_loadd(2, bt, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, ct, 64);
                for (int i = 0; i < nq; i++) {
                    const float inv = l[i] > 0.f ? 1.0f / l[i] : 0.f;
                    __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(ct + i * 16), _mm512_set1_ps(inv)));
                    _mm256_storeu_si256((__m256i *)(out + (((size_t)b * S + tok[i]) * NH + hq[i]) * D + 16 * c), (__m256i)o);
                }
            }
        }
        if (cur) _tile_release();
    }
    free(mem);
    return 0;
}
#endif
