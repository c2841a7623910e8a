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

/* One decode's query heads of KV heads kv_head .. kv_head + kv_count - 1 over its context, a block at a
 * time: the scores of the block's keys, one rescale of the running sums if the block raised a maximum,
 * then the weighted values. K and V rows are read in cache order (token, then head), each once. */
static void attend(const float *q, float *out, const float *k_cache, const float *v_cache,
                   const int64_t *table, int64_t key_start, int64_t len, int64_t kv_head, int64_t kv_count,
                   int64_t group, int64_t num_kv_heads, int64_t dim, int64_t block_size, float scale) {
    const int64_t queries = kv_count * group; /* query head qi reads KV head kv_head + qi / group */
    float acc[MAX_QUERIES][MAX_DIM];
    float scores[MAX_QUERIES][MAX_BLOCK];
    float run_max[MAX_QUERIES], run_sum[MAX_QUERIES];
    for (int64_t qi = 0; qi < queries; qi++) {
        memset(acc[qi], 0, (size_t)dim * sizeof(float));
        run_max[qi] = -INFINITY;
        run_sum[qi] = 0.0f;
    }
    const int64_t row = num_kv_heads * dim; /* floats between consecutive tokens of a block */
    for (int64_t first = 0; first < len;) {
        const int64_t offset = first % block_size;
        const int64_t n = (len - first < block_size - offset) ? len - first : block_size - offset;
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
                scale_row(acc[qi], shrink, dim);
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
                axpy(acc[qi], scores[qi][j], v + j * row + (qi / group) * dim, dim);
        first += n;
    }
    for (int64_t qi = 0; qi < queries; qi++) {
        const float inv = run_sum[qi] > 0.0f ? 1.0f / run_sum[qi] : 0.0f;
        for (int64_t i = 0; i < dim; i++) out[qi * dim + i] = acc[qi][i] * inv;
    }
}

/* Writes the step's new K/V (token t's rows k + t * k_stride, v + t * v_stride, [Hkv, D] each) into their
 * slots, then attends the decodes. Returns 0, or -1, before touching anything, when the head layout is
 * beyond the kernel's fixed scratch. */
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
    /* A task per decode (its blocks read front to back) when there are enough to share out, else a task
     * per (decode, KV head) so that a small batch still uses every thread. */
    const int whole = num_heads <= MAX_QUERIES && num_decodes >= 2 * (int64_t)omp_get_max_threads();
    const int64_t per_task = whole ? num_kv_heads : 1;
    const int64_t tasks = num_decodes * (num_kv_heads / per_task);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t i = t / (num_kv_heads / per_task), h = (t % (num_kv_heads / per_task)) * per_task;
        const int64_t s = seqs[i], r = tokens[i];
        const int64_t key_start = key_starts ? key_starts[s] : 0;
        attend(q + r * q_stride + h * group * dim, out + r * out_stride + h * group * dim, k_cache, v_cache,
               block_tables + s * table_stride, key_start, seq_lens[s], h, per_task, group, num_kv_heads, dim,
               block_size, scale);
    }
    return 0;
}
