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

#define LANES 16
#define MAX_GROUP 32   /* query heads per KV head */
#define MAX_QUERIES 64 /* query heads one task attends: a KV head's group, or a whole decode's */
#define MAX_DIM 256
#define MAX_BLOCK 256

static inline float dot(const float *a, const float *b, int64_t d) {
    /* independent lanes, so the compiler vectorizes without reordering a single sum */
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
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
static void attend_span(const float *q, const float *k_cache, const float *v_cache, const int64_t *table,
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
