/* Attention of one new token per row over a bf16 key/value cache (a decode step), reading each
   cached key and value once.

   For every row b and key/value head h, the G query heads that share h (grouped-query attention)
   are scored against the row's valid slots t: s[g, t] = scale * q[g] . k[t] (fp32 sums), then
   out[g] = sum_t softmax(s[g])_t v[t], rounded to bf16 (nearest even) once. Keys are taken in
   blocks of 64 with the running maximum of each query (the online softmax of flash attention), so
   one pass over the cache does it. PyTorch's CPU scaled_dot_product_attention at one query per
   row spent ~4x the time it takes to read the cache once (fastmtp_sglang/cpu_kernels/decode_attention.py).

   Rows x heads are split across OpenMP threads (the library is linked against the libgomp
   PyTorch loaded). Needs AVX-512F. */

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"  /* bf2f, f2bf, bf16x16, exp16 */

#define BLK 64

int fastmtp_cpu_attention_version(void) { return 1; }

/* q, out: [B, H, G, D] contiguous bf16. k, v: bf16 with strides (elements) ks_* / vs_* for
   row, head and slot (the last dimension contiguous). valid: [B, T] bytes (nonzero = attend) or
   NULL (every slot). D a multiple of 16, at most 256; G at most 16. A row with no valid slot
   gets zeros. */
__attribute__((target("avx512f")))
void fastmtp_decode_attn_bf16(const uint16_t *q, const uint16_t *k, const uint16_t *v,
                              const uint8_t *valid, uint16_t *out, int B, int H, int G, int T,
                              int D, long ks_b, long ks_h, long ks_t, long vs_b, long vs_h,
                              long vs_t, float scale, int threads) {
    const int C = D / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int bh = 0; bh < B * H; bh++) {
        const int b = bh / H, h = bh % H;
        __m512 qv[16][16];          /* [g][chunk], scaled */
        __m512 acc[16][16];
        float m[16], l[16];
        float s[16][BLK] __attribute__((aligned(64)));
        const uint16_t *qb = q + ((size_t)bh * G) * D;
        for (int g = 0; g < G; g++) {
            for (int c = 0; c < C; c++) {
                qv[g][c] = _mm512_mul_ps(bf16x16(qb + (size_t)g * D + 16 * c), _mm512_set1_ps(scale));
                acc[g][c] = _mm512_setzero_ps();
            }
            m[g] = -INFINITY;
            l[g] = 0.f;
        }
        const uint16_t *kb = k + b * ks_b + h * ks_h, *vb = v + b * vs_b + h * vs_h;
        const uint8_t *ok = valid ? valid + (size_t)b * T : 0;
        for (int t0 = 0; t0 < T; t0 += BLK) {
            const int n = T - t0 < BLK ? T - t0 : BLK;
            int any = 0;
            for (int j = 0; j < n; j++) {
                if (ok && !ok[t0 + j]) {
                    for (int g = 0; g < G; g++) s[g][j] = -INFINITY;
                    continue;
                }
                any = 1;
                const uint16_t *kt = kb + (size_t)(t0 + j) * ks_t;
                __m512 kc[16];
                for (int c = 0; c < C; c++) kc[c] = bf16x16(kt + 16 * c);
                for (int g = 0; g < G; g++) {
                    __m512 d = _mm512_mul_ps(qv[g][0], kc[0]);
                    for (int c = 1; c < C; c++) d = _mm512_fmadd_ps(qv[g][c], kc[c], d);
                    s[g][j] = _mm512_reduce_add_ps(d);
                }
            }
            if (!any) continue;
            for (int j = n; j < BLK; j++)
                for (int g = 0; g < G; g++) s[g][j] = -INFINITY;
            for (int g = 0; g < G; g++) {
                float bm = -INFINITY;
                for (int j = 0; j < n; j++) bm = s[g][j] > bm ? s[g][j] : bm;
                const float nm = bm > m[g] ? bm : m[g];
                const float corr = m[g] == -INFINITY ? 0.f : expf(m[g] - nm);
                if (corr != 1.f) {
                    const __m512 cv = _mm512_set1_ps(corr);
                    for (int c = 0; c < C; c++) acc[g][c] = _mm512_mul_ps(acc[g][c], cv);
                    l[g] *= corr;
                }
                m[g] = nm;
                const __m512 mv = _mm512_set1_ps(nm);
                __m512 sum = _mm512_setzero_ps();
                for (int j = 0; j < BLK; j += 16) {   /* p = exp(s - m); exp(-inf) = 0 */
                    __m512 x = _mm512_load_ps(&s[g][j]);
                    __mmask16 fin = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                    __m512 p = _mm512_maskz_mov_ps(fin, exp16(_mm512_sub_ps(x, mv)));
                    _mm512_store_ps(&s[g][j], p);
                    sum = _mm512_add_ps(sum, p);
                }
                l[g] += _mm512_reduce_add_ps(sum);
            }
            for (int j = 0; j < n; j++) {
                if (ok && !ok[t0 + j]) continue;
                const uint16_t *vt = vb + (size_t)(t0 + j) * vs_t;
                __m512 vc[16];
                for (int c = 0; c < C; c++) vc[c] = bf16x16(vt + 16 * c);
                for (int g = 0; g < G; g++) {
                    const __m512 p = _mm512_set1_ps(s[g][j]);
                    for (int c = 0; c < C; c++) acc[g][c] = _mm512_fmadd_ps(p, vc[c], acc[g][c]);
                }
            }
        }
        uint16_t *ob = out + ((size_t)bh * G) * D;
        for (int g = 0; g < G; g++) {
            const float inv = l[g] > 0.f ? 1.0f / l[g] : 0.f;
            float tmp[16] __attribute__((aligned(64)));
            for (int c = 0; c < C; c++) {
                _mm512_store_ps(tmp, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv)));
                for (int i = 0; i < 16; i++) ob[(size_t)g * D + 16 * c + i] = f2bf(tmp[i]);
            }
        }
    }
}
