/* acb's CPU attention over the paged KV cache, read where it lies (no gather).

   Built on first use by acb/runner/attention/cpu_kernels.py with the system's C compiler
   (-O3 -march=native -fopenmp) and called through ctypes with the tensors' data pointers.

   One query token per entry: its batch row (which block-table row and context length it
   reads), its token index (where its query is and its output goes) and the number of keys it
   sees (a decode row: its whole context; a query inside a prefill chunk: the keys up to its
   own position; an image token whose image attends both ways: the keys up to its image's end).
   A sliding window or an attention chunk is measured from the query's own position: the
   entry's ``pos_of`` where given (an image token's keys may end past it), else its last key. Each (query token, KV head) is one task: the query heads of the KV head's
   group are scored against each key as it is read, so K and V are read once per group. The
   sums run over the keys in position order, the same for a token whatever else is in the batch
   or the step, so a row's result does not depend on its batch (no padding, no split that
   depends on the batch). Float32 only. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float acb_dot(const float *restrict a, const float *restrict b, int64_t d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
    return s;
}

/* exp(x) for x <= 0 (the softmax's x - max): range reduction by ln 2 and a degree-6 polynomial
   (the classic single-precision minimax coefficients), about 1 ulp; written so that the
   compiler vectorizes it (glibc's expf is one call per element unless -ffast-math). */
static inline float acb_exp(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* One (query token, KV head) task: its G query heads over keys [lo, n). D is a constant where
   the caller's branch makes it one (64, 128), so the loops over it unroll into registers. */
static inline __attribute__((always_inline)) void acb_task(
    const float *q0, int64_t q_head_stride, const float *k, const float *v, const int64_t *bt,
    int64_t lo, int64_t n, int64_t G, int64_t KVH, int64_t h, const int64_t D, int64_t P,
    float scale, float softcap, const float *sinks, float *o0, int64_t o_head_stride, float *w) {
    const int64_t m = n - lo;
    const int64_t row = KVH * D; /* between two slots of a page */
    float *mx = w + G * m;
    for (int64_t g = 0; g < G; ++g) mx[g] = -INFINITY;
    for (int64_t pg = lo / P; pg * P < n; ++pg) {
        const int64_t s0 = lo > pg * P ? lo - pg * P : 0;
        const int64_t s1 = n - pg * P < P ? n - pg * P : P;
        const float *kp = k + (bt[pg] * P * KVH + h) * D;
        for (int64_t s = s0; s < s1; ++s) {
            const float *kr = kp + s * row;
            const int64_t j = pg * P + s - lo;
            for (int64_t g = 0; g < G; ++g) {
                const float *qg = q0 + g * q_head_stride;
                float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                for (int64_t i = 0; i < D; ++i) acc += qg[i] * kr[i];
                acc *= scale;
                if (softcap > 0.0f) acc = tanhf(acc / softcap) * softcap;
                w[g * m + j] = acc;
                if (acc > mx[g]) mx[g] = acc;
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float top = mx[g];
        if (sinks != NULL && sinks[h * G + g] > top) top = sinks[h * G + g];
        float sum = 0.0f;
        float *wg = w + g * m;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < m; ++j) {
            const float e = acb_exp(wg[j] - top);
            wg[j] = e;
            sum += e;
        }
        if (sinks != NULL) sum += acb_exp(sinks[h * G + g] - top);
        const float inv = 1.0f / sum;
        float acc[D];
        for (int64_t i = 0; i < D; ++i) acc[i] = 0.0f;
        for (int64_t pg = lo / P; pg * P < n; ++pg) {
            const int64_t s0 = lo > pg * P ? lo - pg * P : 0;
            const int64_t s1 = n - pg * P < P ? n - pg * P : P;
            const float *vp = v + (bt[pg] * P * KVH + h) * D;
            for (int64_t s = s0; s < s1; ++s) {
                const float *vr = vp + s * row;
                const float p = wg[pg * P + s - lo] * inv;
#pragma omp simd
                for (int64_t i = 0; i < D; ++i) acc[i] += p * vr[i];
            }
        }
        float *o = o0 + g * o_head_stride;
        for (int64_t i = 0; i < D; ++i) o[i] = acc[i];
    }
}

int acb_paged_attention_f32(
    const float *q, int64_t q_tok_stride, int64_t q_head_stride, /* q[tok, head, :] */
    const float *k, const float *v,                              /* [blocks, P, KVH, D], contiguous */
    const int64_t *block_table, int64_t bt_stride,               /* [B, max_blocks] */
    const int64_t *row_of, const int64_t *tok_of, const int64_t *len_of, /* [R] each */
    const int64_t *pos_of,                                       /* [R], or NULL: len_of - 1 */
    int64_t R, int64_t H, int64_t KVH, int64_t D, int64_t P,
    float scale, float softcap, int64_t window, int64_t chunk,
    const float *sinks,                                          /* [H] or NULL */
    float *out, int64_t o_tok_stride, int64_t o_head_stride,     /* out[tok, head, :] */
    int nthreads) {
    const int64_t G = H / KVH;
    const int64_t tasks = R * KVH;
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t t = 0; t < tasks; ++t) {
        const int64_t r = t / KVH, h = t % KVH;
        const int64_t b = row_of[r], tok = tok_of[r], n = len_of[r];
        const int64_t pos = pos_of != NULL ? pos_of[r] : n - 1; /* the query's own position */
        int64_t lo = 0;
        if (window > 0 && pos + 1 - window > lo) lo = pos + 1 - window;
        if (chunk > 0 && pos / chunk * chunk > lo) lo = pos / chunk * chunk;
        float *o0 = out + tok * o_tok_stride + h * G * o_head_stride;
        if (n - lo <= 0) {
            for (int64_t g = 0; g < G; ++g) memset(o0 + g * o_head_stride, 0, sizeof(float) * D);
            continue;
        }
        float *w = (float *)malloc(sizeof(float) * (size_t)(G * (n - lo) + G));
        if (w == NULL) {
            failed = 1;
            continue;
        }
        const int64_t *bt = block_table + b * bt_stride;
        const float *q0 = q + tok * q_tok_stride + h * G * q_head_stride;
        if (D == 64)
            acb_task(q0, q_head_stride, k, v, bt, lo, n, G, KVH, h, 64, P, scale, softcap, sinks, o0, o_head_stride, w);
        else if (D == 128)
            acb_task(q0, q_head_stride, k, v, bt, lo, n, G, KVH, h, 128, P, scale, softcap, sinks, o0, o_head_stride, w);
        else
            acb_task(q0, q_head_stride, k, v, bt, lo, n, G, KVH, h, D, P, scale, softcap, sinks, o0, o_head_stride, w);
        free(w);
    }
    return failed ? -1 : 0;
}
