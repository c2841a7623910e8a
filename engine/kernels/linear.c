/* Float32 linear layers for the rows of a decode step (CPU), the weight in panels reordered once at load.
 *
 * y[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]). The weight is kept as panels of PANEL consecutive output
 * features, each panel [K, PANEL] contiguous (engine/packed.py reorders nn.Linear's [N, K] into
 * [N / PANEL, K, PANEL], the last panel padded with zeros). A task multiplies up to ROWS input rows by one
 * panel: per k, PANEL weights are loaded once (two vectors) and each row's x[r, k] is broadcast into them,
 * 2 * ROWS accumulators in registers (the register-blocked kernel of BLIS and oneDNN, without their
 * per-call packing of the weight). At one row a decode step is a stream over every weight, which here is
 * read once and in order, panel after panel; with more rows each panel comes from memory once and is
 * reused from cache for every group of rows.
 *
 * Every output is one FMA chain over k in order, whatever the row count and whichever rows share a step:
 * a request gets bit-identical activations at batch 1 and batch 32.
 *
 * Panels are handed out dynamically over torch's OpenMP threads, so a thread that the host deschedules for
 * a while holds up one chunk, not half the matrix. The vector width is the compiler's (`-march=native`):
 * 16 floats with AVX-512 (32 registers: 12 rows a task), 8 with AVX/AVX2 (16 registers: 6 rows), else 4.
 */
#include <stdint.h>
#include <string.h>

#include "vec.h"

#if LANES == 16
#define ROWS 12
#else
#define ROWS 6
#endif
#define PANEL (2 * LANES)
#define CHUNK_BYTES 65536 /* weights a thread takes at a time */

#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

int64_t linear_panel_width(void) { return PANEL; }

/* Ask for the panel row PREFETCH_BYTES ahead of `row` (a panel is read in order, one row of PANEL floats a k).
 * The hardware prefetcher alone left the stream at 8-16 rows well short of the memory's rate: the FMAs
 * between loads hide the stream from it (a 2-core AMD EPYC, `small`'s weights, 16 rows: 11.3 -> 6.5 ms).
 * Past a panel's end it reads the next panel's head, which is read next anyway; a prefetch never faults. */
static inline __attribute__((always_inline)) void prefetch_ahead(const float *row) {
    const char *ahead = (const char *)row + PREFETCH_BYTES;
    __builtin_prefetch(ahead);
#if PANEL * 4 > 64
    __builtin_prefetch(ahead + 64);
#endif
}

/* Write a [rows, PANEL] tile of accumulators to y (the first `cols` columns), adding the bias. */
static inline __attribute__((always_inline)) void store(const vec acc[][2], int rows, float *y, int64_t y_stride,
                                                        int64_t cols, const float *bias) {
    vec b0 = {0}, b1 = {0};
    float padded[PANEL] = {0};
    if (bias) {
        memcpy(padded, bias, (size_t)cols * sizeof(float));
        b0 = vload(padded);
        b1 = vload(padded + LANES);
    }
    for (int r = 0; r < rows; r++) {
        const vec lo = acc[r][0] + b0, hi = acc[r][1] + b1;
        float *out = y + r * y_stride;
        if (cols == PANEL) {
            *(vec *)out = lo;
            *(vec *)(out + LANES) = hi;
        } else {
            float tile[PANEL];
            *(vec *)tile = lo;
            *(vec *)(tile + LANES) = hi;
            memcpy(out, tile, (size_t)cols * sizeof(float));
        }
    }
}

/* `rows` (a constant after inlining) input rows times one panel. */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, const float *panel,
                                                       int64_t k, float *y, int64_t y_stride, int64_t cols,
                                                       const float *bias, const int rows) {
    vec acc[ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = (vec){0};
    for (int64_t i = 0; i < k; i++) {
        prefetch_ahead(panel + i * PANEL);
        const vec w0 = vload(panel + i * PANEL), w1 = vload(panel + i * PANEL + LANES);
        for (int r = 0; r < rows; r++) {
            const float xi = x[r * x_stride + i];
            acc[r][0] += xi * w0;
            acc[r][1] += xi * w1;
        }
    }
    store(acc, rows, y, y_stride, cols, bias);
}

/* One input row times two panels: four independent FMA chains, so the stream is not held up by the
 * latency of one chain. The same chain per output as `tile`. */
static void tile_1x2(const float *x, const float *panel, int64_t k, float *y, int64_t cols, const float *bias) {
    const float *next = panel + k * PANEL;
    vec acc[2][2] = {{{0}, {0}}, {{0}, {0}}};
    for (int64_t i = 0; i < k; i++) {
        prefetch_ahead(panel + i * PANEL);
        prefetch_ahead(next + i * PANEL);
        const float xi = x[i];
        acc[0][0] += xi * vload(panel + i * PANEL);
        acc[0][1] += xi * vload(panel + i * PANEL + LANES);
        acc[1][0] += xi * vload(next + i * PANEL);
        acc[1][1] += xi * vload(next + i * PANEL + LANES);
    }
    store(acc, 1, y, 0, PANEL, bias);
    store(acc + 1, 1, y + PANEL, 0, cols - PANEL, bias ? bias + PANEL : bias);
}

static void rows_times_panel(const float *x, int64_t rows, int64_t x_stride, const float *panel, int64_t k,
                             float *y, int64_t y_stride, int64_t cols, const float *bias) {
    for (int64_t r = 0; r < rows; r += ROWS) {
        const float *xr = x + r * x_stride;
        float *yr = y + r * y_stride;
        switch (rows - r < ROWS ? rows - r : ROWS) {
#define CASE(n) \
    case n: tile(xr, x_stride, panel, k, yr, y_stride, cols, bias, n); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6)
#if ROWS > 6
            CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#endif
#undef CASE
        }
    }
}

/* x [rows, k] (row r at x + r * x_stride), panels [ceil(n / PANEL), k, PANEL], bias [n] or NULL,
 * y [rows, n] (row r at y + r * y_stride). */
void linear_f32(const float *x, int64_t rows, int64_t x_stride, const float *panels, const float *bias, float *y,
                int64_t y_stride, int64_t n, int64_t k) {
    const int64_t num_panels = (n + PANEL - 1) / PANEL;
    const int64_t tasks = rows == 1 ? (num_panels + 1) / 2 : num_panels; /* one row: two panels a task */
    const int64_t per_task = rows == 1 ? 2 : 1;
    int64_t chunk = CHUNK_BYTES / (per_task * PANEL * k * (int64_t)sizeof(float));
    chunk = chunk < 1 ? 1 : chunk;
#pragma omp parallel for schedule(dynamic, chunk) if (tasks > 1)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t p = t * per_task, col = p * PANEL;
        const float *panel = panels + p * k * PANEL;
        const float *b = bias ? bias + col : NULL;
        if (rows == 1 && n - col > PANEL)
            tile_1x2(x, panel, k, y + col, n - col < 2 * PANEL ? n - col : 2 * PANEL, b);
        else
            rows_times_panel(x, rows, x_stride, panel, k, y + col, y_stride, n - col < PANEL ? n - col : PANEL, b);
    }
}
