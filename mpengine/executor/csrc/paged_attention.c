/* Paged attention for the CPU, float32: the cache writes and the decode attention of the
 * `native` backend (mpengine/executor/native_attention.py builds this file on first use
 * with the system's C compiler and calls it through ctypes).
 *
 * A layer's cache is [2, kv_heads, blocks, block_size, head_dim] (keys, then values),
 * addressed through element strides with a unit stride on head_dim, as are the queries,
 * keys, values and outputs ([tokens, heads, head_dim]).
 *
 * Decode attention reads each sequence's blocks in place through its block-table row
 * (no gather into a padded copy): one work item per (sequence, kv head) pair, whose query
 * heads share every key and value load, with a softmax kept online across blocks (running
 * maximum and sum, accumulator rescaled once per block). Work items are split across the
 * OpenMP threads that torch uses (libgomp is loaded by torch; this file links the same).
 * A work item is inlined into copies with a constant head_dim for the usual sizes, so the
 * compiler unrolls their loops; where head_dim and the block size are multiples of 16,
 * scores come 16 keys at a time (`scores16`).
 */
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 64
#define MAX_DIM 256
#define MAX_BLOCK 128
#define NEG_BIG (-3.0e38f)

/* exp(x) for x <= 0, vectorisable: x log2(e) split into an integer n and f in [-0.5, 0.5],
 * 2^f by a degree-6 polynomial (relative error ~2e-7), 2^n through the exponent bits.
 * Below -80 the result is 0: a denormal weight would send every product with it down the
 * CPU's slow path (the scores of a real model spread that far), for a term that cannot
 * change a float32 sum. */
static inline float exp_nonpos(float x) {
    const float zero = x < -80.0f ? 0.0f : 1.0f;
    x = x < -80.0f ? -80.0f : x;
    const float t = x * 1.44269504088896341f;
    const float n = (t + 12582912.0f) - 12582912.0f; /* round to nearest */
    const float f = t - n;
    float p = 1.535336188319500e-4f;
    p = p * f + 1.339887440266574e-3f;
    p = p * f + 9.618437357674640e-3f;
    p = p * f + 5.550332471162809e-2f;
    p = p * f + 2.402264791363012e-1f;
    p = p * f + 6.931472028550421e-1f;
    p = p * f + 1.0f;
    union {
        int32_t i;
        float f;
    } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return p * two_n.f * zero;
}

#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define HAVE_V16 1
#endif
#endif

#if HAVE_V16
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

/* Dot products of q with 16 keys: each key's 16-lane partial products, then the 16 vectors
 * summed lane-wise into one by a transposing tree (pairs of vectors halve their lanes four
 * times), instead of 16 horizontal reductions. out[j] = q . keys[j * stride]. */
static inline __attribute__((always_inline)) void scores16(const float *q, const float *keys,
                                                           int64_t stride, int64_t dim,
                                                           float *out) {
    v16 t[16];
    for (int j = 0; j < 16; j++) {
        const float *kj = keys + j * stride;
        v16 acc = *(const v16u *)q * *(const v16u *)kj;
        for (int64_t d = 16; d < dim; d += 16)
            acc += *(const v16u *)(q + d) * *(const v16u *)(kj + d);
        t[j] = acc;
    }
    v16 u[8], w[4], x[2];
    for (int i = 0; i < 8; i++)
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        x[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                       22, 23, 26, 27, 30, 31);
    const v16 r = __builtin_shufflevector(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22,
                                          24, 26, 28, 30) +
                  __builtin_shufflevector(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23,
                                          25, 27, 29, 31);
    *(v16u *)out = r;
}
#endif

/* Limits of the decode kernel's per-item scratch (checked by the caller). */
int64_t mpengine_max_group(void) { return MAX_GROUP; }
int64_t mpengine_max_head_dim(void) { return MAX_DIM; }
int64_t mpengine_max_block_size(void) { return MAX_BLOCK; }

/* Writes the keys and values of `num_tokens` tokens ([tokens, kv_heads, head_dim] through
 * strides) into cache rows `slots` (block * block_size + offset); a negative slot is
 * skipped. */
void mpengine_store_kv_f32(const float *key, int64_t k_tok, int64_t k_head, const float *value,
                           int64_t v_tok, int64_t v_head, const int64_t *slots, int64_t num_tokens,
                           float *cache, int64_t c_kv, int64_t c_head, int64_t c_block,
                           int64_t c_pos, int64_t num_kv_heads, int64_t head_dim,
                           int64_t block_size) {
    const size_t bytes = (size_t)head_dim * sizeof(float);
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        float *row = cache + (slot / block_size) * c_block + (slot % block_size) * c_pos;
        for (int64_t h = 0; h < num_kv_heads; h++) {
            memcpy(row + h * c_head, key + t * k_tok + h * k_head, bytes);
            memcpy(row + c_kv + h * c_head, value + t * v_tok + h * v_head, bytes);
        }
    }
}

/* One work item: decode i's query heads g * group ... (g + 1) * group - 1 against kv head g.
 * Inlined into copies with a constant `dim` for the common head sizes, where the compiler
 * unrolls the head_dim loops into a few vector operations (specialising the query heads
 * per kv head too gained under 7 % more, for a build four times as long). */
static inline __attribute__((always_inline)) void decode_item(
    const float *query, int64_t q_tok, int64_t q_head, int64_t row, const float *cache,
    int64_t c_kv, int64_t c_head, int64_t c_block, int64_t c_pos, const int32_t *table,
    int64_t ctx, int64_t g, const int64_t group, const int64_t dim, int64_t bs, float scale,
    float *out, int64_t o_tok, int64_t o_head) {
    /* Scratch sized by the model, not by the limits: OpenMP threads' stacks may be small
     * (OMP_STACKSIZE). */
    float qs[group][dim], acc[group][dim], p[group][bs], m[group], l[group];
    for (int64_t h = 0; h < group; h++) {
        const float *q = query + row * q_tok + (g * group + h) * q_head;
        for (int64_t d = 0; d < dim; d++) {
            qs[h][d] = q[d] * scale;
            acc[h][d] = 0.0f;
        }
        m[h] = NEG_BIG;
        l[h] = 0.0f;
    }
    const float *keys = cache + g * c_head, *values = cache + c_kv + g * c_head;
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t block = table[start / bs];
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        const float *k = keys + block * c_block, *v = values + block * c_block;
        if (start + bs < ctx) { /* the next block's keys and values, while this one runs */
            const int64_t next = table[start / bs + 1];
            const char *nk = (const char *)(keys + next * c_block);
            const char *nv = (const char *)(values + next * c_block);
            const int64_t rest = ctx - start - bs, bytes = (rest < bs ? rest : bs) * c_pos * 4;
            for (int64_t b = 0; b < bytes; b += 64) {
                __builtin_prefetch(nk + b);
                __builtin_prefetch(nv + b);
            }
        }
        int64_t j = 0;
#if HAVE_V16
        /* 16 keys at a time; past the context, still inside the block's memory (its scores
         * are not used, and each lane sums its own key only). */
        if (dim % 16 == 0 && bs % 16 == 0)
            for (; j < n; j += 16)
                for (int64_t h = 0; h < group; h++)
                    scores16(qs[h], k + j * c_pos, c_pos, dim, &p[h][j]);
#endif
        for (; j < n; j++) {
            const float *kj = k + j * c_pos;
            for (int64_t h = 0; h < group; h++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; d++) dot += qs[h][d] * kj[d];
                p[h][j] = dot;
            }
        }
        for (int64_t h = 0; h < group; h++) {
            float mx = m[h];
#pragma omp simd reduction(max : mx)
            for (int64_t j = 0; j < n; j++) mx = p[h][j] > mx ? p[h][j] : mx;
            const float rescale = exp_nonpos(m[h] - mx);
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                p[h][j] = exp_nonpos(p[h][j] - mx);
                sum += p[h][j];
            }
            l[h] = l[h] * rescale + sum;
            m[h] = mx;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) acc[h][d] *= rescale;
        }
        for (int64_t j = 0; j < n; j++) {
            const float *vj = v + j * c_pos;
            for (int64_t h = 0; h < group; h++) {
                const float w = p[h][j];
                float *a = acc[h];
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) a[d] += w * vj[d];
            }
        }
    }
    for (int64_t h = 0; h < group; h++) {
        float *o = out + row * o_tok + (g * group + h) * o_head;
        const float inv = 1.0f / l[h];
        for (int64_t d = 0; d < dim; d++) o[d] = acc[h][d] * inv;
    }
}

#define ITEM(DIM)                                                                             \
    decode_item(query, q_tok, q_head, row, cache, c_kv, c_head, c_block, c_pos, table, ctx, g, \
                group, DIM, bs, scale, out, o_tok, o_head)

/* Attention of `num_seqs` decodes (one query each). Decode i reads query row rows[i]
 * (rows == NULL: row i), attends to its first context[i] keys, found through
 * block_table[i * bt_stride + position / block_size], and writes output row rows[i]. */
void mpengine_decode_attention_f32(const float *query, int64_t q_tok, int64_t q_head,
                                   const int64_t *rows, const float *cache, int64_t c_kv,
                                   int64_t c_head, int64_t c_block, int64_t c_pos,
                                   const int32_t *block_table, int64_t bt_stride,
                                   const int64_t *context, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                   float scale, float *out, int64_t o_tok, int64_t o_head,
                                   int num_threads) {
    const int64_t group = num_heads / num_kv_heads, dim = head_dim, bs = block_size;
    const int64_t items = num_seqs * num_kv_heads;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t item = 0; item < items; item++) {
        const int64_t i = item / num_kv_heads, g = item % num_kv_heads;
        const int64_t row = rows ? rows[i] : i, ctx = context[i];
        const int32_t *table = block_table + i * bt_stride;
        switch (dim) {
        case 32: ITEM(32); break;
        case 64: ITEM(64); break;
        case 128: ITEM(128); break;
        default: ITEM(dim); break;
        }
    }
}
