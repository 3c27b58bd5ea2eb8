/* Paged attention for the CPU, float32 or bfloat16: the cache writes and the decode
 * attention of the `native` backend (mpengine/executor/native_attention.py builds this file
 * on first use with the system's C compiler and calls it through ctypes).
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
 *
 * bfloat16 caches, queries and outputs (a model run in bfloat16) go through the same code:
 * each element is widened to float32 as it is loaded (a 16-bit shift), every product, sum
 * and the softmax stay in float32, and outputs are rounded to bfloat16 (to nearest even)
 * once, as torch's attention does for bfloat16 inputs. The element type is a constant of
 * each entry point, so the compiler makes one copy of the work item per type.
 */
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 64
#define MAX_DIM 256
#define MAX_BLOCK 128
#define NEG_BIG (-3.0e38f)

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    union {
        uint32_t i;
        float f;
    } u;
    u.i = (uint32_t)x << 16;
    return u.f;
}

/* Rounded to nearest even, as torch converts; NaN stays NaN (quiet). */
static inline bf16_t f32_to_bf16(float x) {
    union {
        float f;
        uint32_t i;
    } u;
    u.f = x;
    if ((u.i & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u.i >> 16) | 0x40);
    u.i += 0x7fffu + ((u.i >> 16) & 1u);
    return (bf16_t)(u.i >> 16);
}

/* Element i of an array of float32 (bf16 == 0) or bfloat16 values, as a float; the flag is
 * a constant wherever this is inlined, so no branch is left. */
static inline __attribute__((always_inline)) float load(const void *p, int64_t i, const int bf16) {
    return bf16 ? bf16_to_f32(((const bf16_t *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) int64_t elem_size(const int bf16) {
    return bf16 ? (int64_t)sizeof(bf16_t) : (int64_t)sizeof(float);
}

/* The address of element i of such an array. */
static inline __attribute__((always_inline)) const void *at(const void *p, int64_t i,
                                                           const int bf16) {
    return (const char *)p + i * elem_size(bf16);
}

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
#if __has_builtin(__builtin_shufflevector) && __has_builtin(__builtin_convertvector)
#define HAVE_V16 1
#endif
#endif

#if HAVE_V16
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16u __attribute__((vector_size(32), aligned(2), may_alias));

/* 16 consecutive elements from p (float32 or bfloat16) as float32 lanes. */
static inline __attribute__((always_inline)) v16 load16(const void *p, const int bf16) {
    if (!bf16) return *(const v16u *)p;
    const u32x16 wide = __builtin_convertvector(*(const u16x16u *)p, u32x16) << 16;
    v16 out;
    __builtin_memcpy(&out, &wide, sizeof(out));
    return out;
}

/* Dot products of q with 16 keys: each key's 16-lane partial products, then the 16 vectors
 * summed lane-wise into one by a transposing tree (pairs of vectors halve their lanes four
 * times), instead of 16 horizontal reductions. out[j] = q . keys[j * stride]. */
static inline __attribute__((always_inline)) void scores16(const float *q, const void *keys,
                                                           int64_t stride, int64_t dim,
                                                           float *out, const int bf16) {
    v16 t[16];
    for (int j = 0; j < 16; j++) {
        const void *kj = at(keys, j * stride, bf16);
        v16 acc = *(const v16u *)q * load16(kj, bf16);
        for (int64_t d = 16; d < dim; d += 16)
            acc += *(const v16u *)(q + d) * load16(at(kj, d, bf16), bf16);
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

/* 16 rows of bfloat16 (`stride` elements apart) widened into dst[16][dim] (float32), so that
 * a group's query heads read each key and value converted once, not once per head. */
static inline __attribute__((always_inline)) void widen16(const void *src, int64_t stride,
                                                          int64_t dim, float *dst) {
    for (int r = 0; r < 16; r++)
        for (int64_t d = 0; d < dim; d += 16)
            *(v16u *)(dst + r * dim + d) = load16(at(src, r * stride + d, 1), 1);
}
#endif

/* Limits of the decode kernel's per-item scratch (checked by the caller). */
int64_t mpengine_max_group(void) { return MAX_GROUP; }
int64_t mpengine_max_head_dim(void) { return MAX_DIM; }
int64_t mpengine_max_block_size(void) { return MAX_BLOCK; }

/* Writes the keys and values of `num_tokens` tokens ([tokens, kv_heads, head_dim] through
 * strides, the cache's element type) into cache rows `slots` (block * block_size + offset);
 * a negative slot is skipped. */
static inline __attribute__((always_inline)) void store_kv(
    const void *key, int64_t k_tok, int64_t k_head, const void *value, int64_t v_tok,
    int64_t v_head, const int64_t *slots, int64_t num_tokens, void *cache, int64_t c_kv,
    int64_t c_head, int64_t c_block, int64_t c_pos, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, const int bf16) {
    const size_t bytes = (size_t)(head_dim * elem_size(bf16));
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        void *row = (void *)at(cache, (slot / block_size) * c_block + (slot % block_size) * c_pos,
                               bf16);
        for (int64_t h = 0; h < num_kv_heads; h++) {
            memcpy((void *)at(row, h * c_head, bf16), at(key, t * k_tok + h * k_head, bf16),
                   bytes);
            memcpy((void *)at(row, c_kv + h * c_head, bf16),
                   at(value, t * v_tok + h * v_head, bf16), bytes);
        }
    }
}

#define STORE_KV_ENTRY(NAME, BF16)                                                            \
    void NAME(const void *key, int64_t k_tok, int64_t k_head, const void *value, int64_t v_tok, \
              int64_t v_head, const int64_t *slots, int64_t num_tokens, void *cache,          \
              int64_t c_kv, int64_t c_head, int64_t c_block, int64_t c_pos,                  \
              int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {                  \
        store_kv(key, k_tok, k_head, value, v_tok, v_head, slots, num_tokens, cache, c_kv,    \
                 c_head, c_block, c_pos, num_kv_heads, head_dim, block_size, BF16);           \
    }
STORE_KV_ENTRY(mpengine_store_kv_f32, 0)
STORE_KV_ENTRY(mpengine_store_kv_bf16, 1)

/* One work item: decode i's query heads g * group ... (g + 1) * group - 1 against kv head g.
 * Inlined into copies with a constant `dim` for the common head sizes, where the compiler
 * unrolls the head_dim loops into a few vector operations (specialising the query heads
 * per kv head too gained under 7 % more, for a build four times as long), and with a
 * constant element type (`bf16`). */
static inline __attribute__((always_inline)) void decode_item(
    const void *query, int64_t q_tok, int64_t q_head, int64_t row, const void *cache,
    int64_t c_kv, int64_t c_head, int64_t c_block, int64_t c_pos, const int32_t *table,
    int64_t ctx, int64_t g, const int64_t group, const int64_t dim, int64_t bs, float scale,
    void *out, int64_t o_tok, int64_t o_head, const int bf16) {
    /* Scratch sized by the model, not by the limits: OpenMP threads' stacks may be small
     * (OMP_STACKSIZE). */
    float qs[group][dim], acc[group][dim], p[group][bs], m[group], l[group], wide[16][dim];
    for (int64_t h = 0; h < group; h++) {
        const void *q = at(query, row * q_tok + (g * group + h) * q_head, bf16);
        for (int64_t d = 0; d < dim; d++) {
            qs[h][d] = load(q, d, bf16) * scale;
            acc[h][d] = 0.0f;
        }
        m[h] = NEG_BIG;
        l[h] = 0.0f;
    }
    const void *keys = at(cache, g * c_head, bf16), *values = at(cache, c_kv + g * c_head, bf16);
    for (int64_t start = 0; start < ctx; start += bs) {
        const int64_t block = table[start / bs];
        const int64_t n = ctx - start < bs ? ctx - start : bs;
        const void *k = at(keys, block * c_block, bf16), *v = at(values, block * c_block, bf16);
        if (start + bs < ctx) { /* the next block's keys and values, while this one runs */
            const int64_t next = table[start / bs + 1];
            const char *nk = (const char *)at(keys, next * c_block, bf16);
            const char *nv = (const char *)at(values, next * c_block, bf16);
            const int64_t rest = ctx - start - bs;
            const int64_t bytes = (rest < bs ? rest : bs) * c_pos * elem_size(bf16);
            for (int64_t b = 0; b < bytes; b += 64) {
                __builtin_prefetch(nk + b);
                __builtin_prefetch(nv + b);
            }
        }
        int64_t j = 0;
#if HAVE_V16
        /* 16 keys at a time; past the context, still inside the block's memory (its scores
         * are not used, and each lane sums its own key only). bfloat16 keys are widened
         * once for all the group's heads. */
        if (dim % 16 == 0 && bs % 16 == 0)
            for (; j < n; j += 16) {
                const void *kj = at(k, j * c_pos, bf16);
                if (bf16) {
                    widen16(kj, c_pos, dim, &wide[0][0]);
                    for (int64_t h = 0; h < group; h++)
                        scores16(qs[h], &wide[0][0], dim, dim, &p[h][j], 0);
                } else {
                    for (int64_t h = 0; h < group; h++)
                        scores16(qs[h], kj, c_pos, dim, &p[h][j], 0);
                }
            }
#endif
        for (; j < n; j++) {
            const void *kj = at(k, j * c_pos, bf16);
            for (int64_t h = 0; h < group; h++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < dim; d++) dot += qs[h][d] * load(kj, d, bf16);
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
        j = 0;
#if HAVE_V16
        if (bf16 && dim % 16 == 0 && bs % 16 == 0) /* values widened once, as keys */
            for (; j + 16 <= n; j += 16) {
                widen16(at(v, j * c_pos, bf16), c_pos, dim, &wide[0][0]);
                for (int64_t r = 0; r < 16; r++)
                    for (int64_t h = 0; h < group; h++) {
                        const float w = p[h][j + r];
                        float *a = acc[h];
#pragma omp simd
                        for (int64_t d = 0; d < dim; d++) a[d] += w * wide[r][d];
                    }
            }
#endif
        for (; j < n; j++) {
            const void *vj = at(v, j * c_pos, bf16);
            for (int64_t h = 0; h < group; h++) {
                const float w = p[h][j];
                float *a = acc[h];
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) a[d] += w * load(vj, d, bf16);
            }
        }
    }
    for (int64_t h = 0; h < group; h++) {
        const int64_t o = row * o_tok + (g * group + h) * o_head;
        const float inv = 1.0f / l[h];
        for (int64_t d = 0; d < dim; d++) {
            if (bf16)
                ((bf16_t *)out)[o + d] = f32_to_bf16(acc[h][d] * inv);
            else
                ((float *)out)[o + d] = acc[h][d] * inv;
        }
    }
}

#define ITEM(DIM)                                                                             \
    decode_item(query, q_tok, q_head, row, cache, c_kv, c_head, c_block, c_pos, table, ctx, g, \
                group, DIM, bs, scale, out, o_tok, o_head, bf16)

/* Attention of `num_seqs` decodes (one query each). Decode i reads query row rows[i]
 * (rows == NULL: row i), attends to its first context[i] keys, found through
 * block_table[i * bt_stride + position / block_size], and writes output row rows[i].
 * Queries, cache and output share one element type. */
static inline __attribute__((always_inline)) void decode_attention(
    const void *query, int64_t q_tok, int64_t q_head, const int64_t *rows, const void *cache,
    int64_t c_kv, int64_t c_head, int64_t c_block, int64_t c_pos, const int32_t *block_table,
    int64_t bt_stride, const int64_t *context, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, void *out,
    int64_t o_tok, int64_t o_head, int num_threads, const int bf16) {
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

#define DECODE_ENTRY(NAME, BF16)                                                              \
    void NAME(const void *query, int64_t q_tok, int64_t q_head, const int64_t *rows,          \
              const void *cache, int64_t c_kv, int64_t c_head, int64_t c_block, int64_t c_pos, \
              const int32_t *block_table, int64_t bt_stride, const int64_t *context,          \
              int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,    \
              int64_t block_size, float scale, void *out, int64_t o_tok, int64_t o_head,      \
              int num_threads) {                                                              \
        decode_attention(query, q_tok, q_head, rows, cache, c_kv, c_head, c_block, c_pos,     \
                         block_table, bt_stride, context, num_seqs, num_heads, num_kv_heads,  \
                         head_dim, block_size, scale, out, o_tok, o_head, num_threads, BF16); \
    }
DECODE_ENTRY(mpengine_decode_attention_f32, 0)
DECODE_ENTRY(mpengine_decode_attention_bf16, 1)
