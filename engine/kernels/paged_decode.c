/* Decode attention read straight from the paged KV cache (float32, CPU).
 *
 * The torch path gathers each sequence's blocks into a padded buffer and then runs SDPA over it: the
 * context is read, written and read again. This kernel reads every cached K/V row once, in place,
 * through the block table, with an online softmax (running max and sum), so a decode step's attention
 * costs one pass over the context and no padding. engine/kernels/__init__.py compiles it with the
 * system C compiler on first use and calls it through ctypes; the caller checks shapes and dtypes.
 *
 * Layouts (all contiguous except q, k, v and out, whose token rows have a stride):
 *   q, out        [T, H, D]      token row r at q + r * q_stride (out + r * out_stride)
 *   k, v, slots   [T, Hkv, D]    this step's new K/V, written to flat slot slots[t] first
 *   cache         [2, NB, BS, Hkv, D]   K then V
 *   block_tables  [S, W]         int64, row s is sequence s's blocks
 *   seq_lens      [S]            int64, context length including this step's token
 *   key_starts    [S] or NULL    int64, positions below it are left padding (static mode): read and masked,
 *                                as a padded batch reads them
 *   seqs, tokens  [B]            int64, decode i is sequence seqs[i] and token row tokens[i]
 * Query heads h * G .. h * G + G - 1 share KV head h (grouped-query attention, G = H / Hkv).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec.h"

#define SUMS 16 /* the scalar path's independent sums */
#define MAX_GROUP 32   /* query heads per KV head */
#define MAX_QUERIES 64 /* query heads one task attends: a KV head's group, or a whole decode's */
#define MAX_DIM 256
#define MAX_BLOCK 256

static inline float dot(const float *a, const float *b, int64_t d) {
    /* independent lanes, so the compiler vectorizes without reordering a single sum */
    float acc[SUMS] = {0};
    int64_t i = 0;
    for (; i + SUMS <= d; i += SUMS)
        for (int j = 0; j < SUMS; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < SUMS; j++) s += acc[j];
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

static inline void axpy(float *y, float a, const float *x, int64_t d) {
    for (int64_t i = 0; i < d; i++) y[i] += a * x[i];
}

static inline void scale_row(float *y, float a, int64_t d) {
    for (int64_t i = 0; i < d; i++) y[i] *= a;
}

/* One decode's query heads of KV heads kv_head .. kv_head + kv_count - 1 over context positions
 * [begin, end), a block at a time: the scores of the block's keys, one rescale of the running sums if the
 * block raised a maximum, then the weighted values. K and V rows are read in cache order (token, then
 * head), each once. Leaves the unnormalised sums: acc [queries, dim], run_max and run_sum [queries]. */
static void attend_span_scalar(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                               int64_t key_start, int64_t begin, int64_t end, int64_t kv_head, int64_t kv_count,
                               int64_t group, int64_t num_kv_heads, int64_t dim, int64_t block_size, float scale,
                               float *acc, float *run_max, float *run_sum) {
    const int64_t queries = kv_count * group; /* query head qi reads KV head kv_head + qi / group */
    float scores[MAX_QUERIES][MAX_BLOCK];
    for (int64_t qi = 0; qi < queries; qi++) {
        memset(acc + qi * dim, 0, (size_t)dim * sizeof(float));
        run_max[qi] = -INFINITY;
        run_sum[qi] = 0.0f;
    }
    const int64_t row = num_kv_heads * dim; /* floats between consecutive tokens of a block */
    for (int64_t first = begin; first < end;) {
        const int64_t offset = first % block_size;
        const int64_t n = (end - first < block_size - offset) ? end - first : block_size - offset;
        const int64_t base = (table[first / block_size] * block_size + offset) * row + kv_head * dim;
        const float *k = k_cache + base, *v = v_cache + base;
        for (int64_t j = 0; j < n; j++)
            for (int64_t qi = 0; qi < queries; qi++) {
                const float s = dot(q + qi * dim, k + j * row + (qi / group) * dim, dim) * scale;
                scores[qi][j] = first + j < key_start ? -INFINITY : s; /* left padding: read, masked */
            }
        for (int64_t qi = 0; qi < queries; qi++) {
            float block_max = -INFINITY;
            for (int64_t j = 0; j < n; j++) block_max = scores[qi][j] > block_max ? scores[qi][j] : block_max;
            if (block_max > run_max[qi]) {
                const float shrink = expf(run_max[qi] - block_max); /* 0 before the first block */
                run_sum[qi] *= shrink;
                scale_row(acc + qi * dim, shrink, dim);
                run_max[qi] = block_max;
            }
            for (int64_t j = 0; j < n; j++) {
                /* a masked key weighs 0, also while every key so far is masked (max still -inf) */
                scores[qi][j] = scores[qi][j] == -INFINITY ? 0.0f : expf(scores[qi][j] - run_max[qi]);
                run_sum[qi] += scores[qi][j];
            }
        }
        for (int64_t j = 0; j < n; j++)
            for (int64_t qi = 0; qi < queries; qi++)
                axpy(acc + qi * dim, scores[qi][j], v + j * row + (qi / group) * dim, dim);
        first += n;
    }
}

/* The vector path: a chunk of up to LANES consecutive tokens of one block at a time. Each key row is read
 * once, in memory order, into LANES-lane partial products per query head; a transpose-and-add tree then sums
 * the lanes of all LANES keys at once (LANES - 1 two-source shuffles and adds, against a horizontal sum per key),
 * so a query head's chunk scores come out as one vector; the softmax weights are one vectorised exp over
 * it, and the values are accumulated with each weight broadcast. While a chunk's keys are scored, the next
 * chunk's K and V rows are prefetched through the block table: blocks of a long-running batch lie
 * scattered over the cache, where the hardware prefetcher stops at every block's end. Taken where the head
 * dim is a multiple of the vector width (-march=native: 16 floats with AVX-512, 8 with AVX, else 4). */
#define MAX_NV (MAX_DIM / LANES)

/* Shuffle masks of the transpose-and-add tree, level by level (segment sizes LANES/2 .. 1): output lane p
 * takes segment p / (2 s) of the first operand's low or high half, then of the second's. */
#if LANES == 16
static const ivec TREE_LO[4] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
    {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
    {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
#define TREE_LEVELS 4
static const ivec TREE_HALVES[4] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7},
    {4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11},
    {2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13},
    {1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}};
#elif LANES == 8
static const ivec TREE_LO[3] = {
    {0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 8, 9, 4, 5, 12, 13}, {0, 8, 2, 10, 4, 12, 6, 14}};
#define TREE_LEVELS 3
static const ivec TREE_HALVES[3] = {{4, 5, 6, 7, 0, 1, 2, 3}, {2, 3, 0, 1, 6, 7, 4, 5}, {1, 0, 3, 2, 5, 4, 7, 6}};
#else
static const ivec TREE_LO[2] = {{0, 1, 4, 5}, {0, 4, 2, 6}};
#define TREE_LEVELS 2
static const ivec TREE_HALVES[2] = {{2, 3, 0, 1}, {1, 0, 3, 2}};
#endif

/* lane j of the result = the sum of p[j]'s lanes; p is consumed. */
static inline __attribute__((always_inline)) vec sum_lanes_of_each(vec p[LANES]) {
    int m = LANES;
#pragma GCC unroll 4
    for (int level = 0; level < TREE_LEVELS; level++) {
        const int half = m / 2;
        const ivec lo = TREE_LO[level], hi = lo + half;
#pragma GCC unroll 8
        for (int i = 0; i < half; i++) p[i] = __builtin_shuffle(p[i], p[i + half], lo) + __builtin_shuffle(p[i], p[i + half], hi);
        m = half;
    }
    return p[0];
}

/* the largest and the sum of the lanes, by halving */
static inline float hmax(vec x) {
#pragma GCC unroll 4
    for (int level = 0; level < TREE_LEVELS; level++) {
        const vec y = __builtin_shuffle(x, TREE_HALVES[level]);
        x = vselect(y > x, y, x);
    }
    return x[0];
}

static inline float hsum(vec x) {
#pragma GCC unroll 4
    for (int level = 0; level < TREE_LEVELS; level++) x += __builtin_shuffle(x, TREE_HALVES[level]);
    return x[0];
}

/* the K row at k (its `floats` floats of this task's heads) and the V row `to_v` floats on, into L2 */
static inline void prefetch_rows(const float *k, int64_t to_v, int64_t floats) {
    for (int64_t l = 0; l < floats; l += 64 / (int64_t)sizeof(float)) {
        __builtin_prefetch(k + l, 0, 1);
        __builtin_prefetch(k + to_v + l, 0, 1);
    }
}

/* acc [nv vectors] += sum over the chunk's first n keys of w[j] * v row j */
static inline __attribute__((always_inline)) void chunk_values(float *acc, const float *w, const float *v,
                                                               int64_t row, int64_t n, const int nv) {
    vec a[MAX_NV];
    for (int c = 0; c < nv; c++) a[c] = vload(acc + c * LANES);
    for (int64_t j = 0; j < n; j++) {
        const float wj = w[j];
        for (int c = 0; c < nv; c++) a[c] += wj * vload(v + j * row + c * LANES);
    }
    for (int c = 0; c < nv; c++) vstore(acc + c * LANES, a[c]);
}

/* chunk_values for two query heads that read the same V rows: each V vector is loaded once for both, a
 * quarter of the head dim at a time (8 accumulators). Each output gets the same sums, in the same order. */
#define PAIR_NV 4
static inline __attribute__((always_inline)) void chunk_values_pair(float *acc0, float *acc1, const float *w0,
                                                                    const float *w1, const float *v, int64_t row,
                                                                    int64_t n, const int nv) {
    for (int c0 = 0; c0 < nv; c0 += PAIR_NV) {
        const int m = nv - c0 < PAIR_NV ? nv - c0 : PAIR_NV;
        vec a[PAIR_NV], b[PAIR_NV];
        for (int c = 0; c < m; c++) {
            a[c] = vload(acc0 + (c0 + c) * LANES);
            b[c] = vload(acc1 + (c0 + c) * LANES);
        }
        for (int64_t j = 0; j < n; j++) {
            const float x = w0[j], y = w1[j];
            for (int c = 0; c < m; c++) {
                const vec vj = vload(v + j * row + (c0 + c) * LANES);
                a[c] += x * vj;
                b[c] += y * vj;
            }
        }
        for (int c = 0; c < m; c++) {
            vstore(acc0 + (c0 + c) * LANES, a[c]);
            vstore(acc1 + (c0 + c) * LANES, b[c]);
        }
    }
}

static inline __attribute__((always_inline)) void attend_span_vec(
    const float *q, const float *k_cache, const float *v_cache, const int64_t *table, int64_t key_start,
    int64_t begin, int64_t end, int64_t kv_head, int64_t kv_count, int64_t group, int64_t num_kv_heads,
    int64_t dim, int64_t block_size, float scale, float *acc, float *run_max, float *run_sum, const int nv) {
    const int64_t queries = kv_count * group;
    float weights[MAX_QUERIES][LANES] __attribute__((aligned(64)));
    vec partial[MAX_QUERIES][LANES];
    ivec lane;
    for (int j = 0; j < LANES; j++) lane[j] = j;
    for (int64_t qi = 0; qi < queries; qi++) {
        memset(acc + qi * dim, 0, (size_t)dim * sizeof(float));
        run_max[qi] = -INFINITY;
        run_sum[qi] = 0.0f;
    }
    const int64_t row = num_kv_heads * dim, span_floats = kv_count * dim;
    for (int64_t first = begin; first < end;) {
        const int64_t offset = first % block_size;
        int64_t n = (end - first < block_size - offset) ? end - first : block_size - offset;
        n = n < LANES ? n : LANES;
        const int64_t base = (table[first / block_size] * block_size + offset) * row + kv_head * dim;
        const float *k = k_cache + base, *v = v_cache + base;
        /* lanes of real keys: within the chunk and at or after the left padding */
        const ivec valid = (lane < (int32_t)n) & (lane >= (int32_t)(key_start - first < -1 ? -1 : key_start - first));
        /* where the next chunk's rows lie (it may start a new block or cross into one) */
        const float *next[LANES];
        int64_t next_n = 0;
        for (int64_t pos = first + n; next_n < LANES && pos < end; pos++, next_n++)
            next[next_n] = k_cache + (table[pos / block_size] * block_size + pos % block_size) * row + kv_head * dim;
        /* the keys' partial products row by row, in memory order; meanwhile the next chunk's K and V rows
         * are prefetched (into L2: with scattered blocks the hardware prefetcher cannot know where the next
         * block lies, and a chunk's rows are read once) */
        for (int64_t j = 0; j < n; j++) {
            if (j < next_n) prefetch_rows(next[j], v_cache - k_cache, span_floats);
            const float *kr = k + j * row;
            for (int64_t h = 0, qi = 0; h < kv_count; h++) {
                vec kh[MAX_NV]; /* the head's K row, loaded once for every query head of its group */
                for (int c = 0; c < nv; c++) kh[c] = vload(kr + h * dim + c * LANES);
                for (int64_t gi = 0; gi < group; gi++, qi++) {
                    const float *qq = q + qi * dim;
                    vec p0 = (vec){0}, p1 = (vec){0}; /* two chains of adds */
                    int c = 0;
                    for (; c + 1 < nv; c += 2) {
                        p0 += vload(qq + c * LANES) * kh[c];
                        p1 += vload(qq + (c + 1) * LANES) * kh[c + 1];
                    }
                    if (c < nv) p0 += vload(qq + c * LANES) * kh[c];
                    partial[qi][j] = p0 + p1;
                }
            }
        }
        for (int64_t j = n; j < next_n; j++) prefetch_rows(next[j], v_cache - k_cache, span_floats);
        for (int64_t j = n; j < LANES; j++)
            for (int64_t qi = 0; qi < queries; qi++) partial[qi][j] = (vec){0};
        for (int64_t qi = 0; qi < queries; qi++) {
            vec s = sum_lanes_of_each(partial[qi]);
            s = vselect(valid, s * scale, vsplat(-INFINITY));
            const float chunk_max = hmax(s);
            if (chunk_max == -INFINITY) { /* every key masked: weighs nothing */
                vstore(weights[qi], (vec){0});
                continue;
            }
            if (chunk_max > run_max[qi]) {
                const float shrink = expf(run_max[qi] - chunk_max); /* 0 before the first chunk */
                run_sum[qi] *= shrink;
                scale_row(acc + qi * dim, shrink, dim);
                run_max[qi] = chunk_max;
            }
            const vec w = vselect(valid, vexp(s - run_max[qi]), (vec){0});
            run_sum[qi] += hsum(w);
            vstore(weights[qi], w);
        }
        for (int64_t qi = 0; qi < queries;) {
            const float *vh = v + (qi / group) * dim;
            if (qi + 1 < queries && (qi + 1) / group == qi / group) { /* two query heads of one KV head */
                chunk_values_pair(acc + qi * dim, acc + (qi + 1) * dim, weights[qi], weights[qi + 1], vh, row, n, nv);
                qi += 2;
            } else {
                chunk_values(acc + qi * dim, weights[qi], vh, row, n, nv);
                qi += 1;
            }
        }
        first += n;
    }
}

/* attend_span_scalar's contract, on the vector path where the head dim allows it */
static void attend_span(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
                        int64_t key_start, int64_t begin, int64_t end, int64_t kv_head, int64_t kv_count,
                        int64_t group, int64_t num_kv_heads, int64_t dim, int64_t block_size, float scale,
                        float *acc, float *run_max, float *run_sum) {
#define SPAN_ARGS q, k_cache, v_cache, table, key_start, begin, end, kv_head, kv_count, group, num_kv_heads, dim, \
                  block_size, scale, acc, run_max, run_sum
    switch (dim % LANES == 0 ? dim / LANES : 0) {
    case 2: attend_span_vec(SPAN_ARGS, 2); return;
    case 4: attend_span_vec(SPAN_ARGS, 4); return;
    case 8: attend_span_vec(SPAN_ARGS, 8); return;
    case 16: attend_span_vec(SPAN_ARGS, 16); return;
    default:
        if (dim % LANES == 0) attend_span_vec(SPAN_ARGS, (int)(dim / LANES));
        else attend_span_scalar(SPAN_ARGS);
    }
#undef SPAN_ARGS
}

/* out [queries, dim] = the weighted sum of `parts` partial spans (each acc, run_max, run_sum as
 * attend_span leaves them, `stride` floats apart), rescaled to their common maximum. */
static void merge_spans(const float *parts, int64_t num_parts, int64_t stride, int64_t queries, int64_t dim,
                        float *out) {
    for (int64_t qi = 0; qi < queries; qi++) {
        float top = -INFINITY;
        for (int64_t c = 0; c < num_parts; c++) {
            const float m = parts[c * stride + queries * dim + qi];
            top = m > top ? m : top;
        }
        float total = 0.0f;
        float *y = out + qi * dim;
        memset(y, 0, (size_t)dim * sizeof(float));
        for (int64_t c = 0; c < num_parts; c++) {
            const float *part = parts + c * stride;
            const float m = part[queries * dim + qi];
            if (m == -INFINITY) continue; /* an empty or fully masked span */
            const float w = expf(m - top);
            total += part[queries * dim + queries + qi] * w;
            axpy(y, w, part + qi * dim, dim);
        }
        scale_row(y, total > 0.0f ? 1.0f / total : 0.0f, dim);
    }
}

/* Writes the step's new K/V (token t's rows k + t * k_stride, v + t * v_stride, [Hkv, D] each) into their
 * slots, then attends the decodes. Returns 0; -1, before touching anything, when the head layout is
 * beyond the kernel's fixed scratch; -2 when the span scratch cannot be allocated. */
int paged_decode_f32(const float *q, int64_t q_stride, float *out, int64_t out_stride, float *cache,
                     int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t dim,
                     int64_t num_heads, const int64_t *block_tables, int64_t table_stride,
                     const int64_t *seq_lens, const int64_t *key_starts, const int64_t *seqs,
                     const int64_t *tokens, int64_t num_decodes, float scale, const float *k,
                     int64_t k_stride, const float *v, int64_t v_stride, const int64_t *slots,
                     int64_t num_tokens) {
    const int64_t group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || dim > MAX_DIM || block_size > MAX_BLOCK || group * num_kv_heads != num_heads)
        return -1;
    float *k_cache = cache;
    float *v_cache = cache + num_blocks * block_size * num_kv_heads * dim;
    const size_t row_bytes = (size_t)(num_kv_heads * dim) * sizeof(float);
    for (int64_t t = 0; t < num_tokens; t++) {
        memcpy(k_cache + slots[t] * num_kv_heads * dim, k + t * k_stride, row_bytes);
        memcpy(v_cache + slots[t] * num_kv_heads * dim, v + t * v_stride, row_bytes);
    }
    /* With a query-head count the scratch takes, every task covers all of a decode's KV heads, reading its
     * blocks front to back. With too few decodes to keep every thread busy, each decode's context is
     * also split into spans of whole blocks, one task each, merged after (flash-decoding): batch 1 still
     * uses every thread and reads each block in order. Otherwise, a task per (decode, KV head). */
    if (num_decodes == 0) return 0;
    const int64_t threads = omp_get_max_threads();
    const int64_t queries = num_heads;
    if (num_heads <= MAX_QUERIES && num_decodes < 2 * threads) {
        const int64_t spans = (2 * threads + num_decodes - 1) / num_decodes;
        const int64_t stride = queries * (dim + 2); /* one span's acc, run_max and run_sum */
        float *parts = malloc((size_t)(num_decodes * spans * stride) * sizeof(float));
        if (!parts) return -2;
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t t = 0; t < num_decodes * spans; t++) {
            const int64_t i = t / spans, c = t % spans, s = seqs[i];
            const int64_t blocks = (seq_lens[s] + block_size - 1) / block_size;
            const int64_t begin = blocks * c / spans * block_size;
            int64_t end = blocks * (c + 1) / spans * block_size;
            end = end < seq_lens[s] ? end : seq_lens[s];
            float *part = parts + t * stride;
            attend_span(q + tokens[i] * q_stride, k_cache, v_cache, block_tables + s * table_stride,
                        key_starts ? key_starts[s] : 0, begin, end, 0, num_kv_heads, group, num_kv_heads, dim,
                        block_size, scale, part, part + queries * dim, part + queries * dim + queries);
        }
        for (int64_t i = 0; i < num_decodes; i++)
            merge_spans(parts + i * spans * stride, spans, stride, queries, dim, out + tokens[i] * out_stride);
        free(parts);
        return 0;
    }
    const int64_t per_task = num_heads <= MAX_QUERIES ? num_kv_heads : 1;
    const int64_t tasks = num_decodes * (num_kv_heads / per_task);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t i = t / (num_kv_heads / per_task), h = (t % (num_kv_heads / per_task)) * per_task;
        const int64_t s = seqs[i];
        float part[MAX_QUERIES * (MAX_DIM + 2)];
        const int64_t queries_here = per_task * group;
        attend_span(q + tokens[i] * q_stride + h * group * dim, k_cache, v_cache, block_tables + s * table_stride,
                    key_starts ? key_starts[s] : 0, 0, seq_lens[s], h, per_task, group, num_kv_heads, dim,
                    block_size, scale, part, part + queries_here * dim, part + queries_here * dim + queries_here);
        merge_spans(part, 1, 0, queries_here, dim, out + tokens[i] * out_stride + h * group * dim);
    }
    return 0;
}
