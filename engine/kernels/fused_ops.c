/* The small float32 ops between a decoder layer's matmuls, fused (CPU).
 *
 * At batch 1 a `small` step is 33 matmuls streaming the weights plus about 200 small torch ops, and the
 * small ops cost more than their arithmetic: torch's rms_norm took 13 us on its own and about 80 us right
 * after a matmul (measured here, 2 threads). These do the same math in one call each: with the attention
 * call (paged_decode.c), a layer makes five native calls between its matmuls: rotary on q and k, attention,
 * residual add + RMSNorm (twice), SiLU(gate) * up. Rows are split over torch's OpenMP threads only when
 * there are enough of them.
 */
#include <math.h>
#include <stdint.h>

#include "vec.h"

#define PARALLEL_ROWS 64

/* residual += delta (when delta is given), then out = residual * rsqrt(mean(residual^2) + eps) * weight.
 * residual, delta, out [rows, dim] contiguous; weight [dim]. */
void add_rms_norm_f32(float *residual, const float *delta, const float *weight, float *out, int64_t rows,
                      int64_t dim, float eps) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        float *x = residual + r * dim;
        if (delta) {
            const float *d = delta + r * dim;
            for (int64_t i = 0; i < dim; i++) x[i] += d[i];
        }
        double sum = 0.0; /* torch accumulates a float32 mean in higher precision too */
        for (int64_t i = 0; i < dim; i++) sum += (double)x[i] * x[i];
        const float inv = 1.0f / sqrtf((float)(sum / dim) + eps);
        float *y = out + r * dim;
        for (int64_t i = 0; i < dim; i++) y[i] = (x[i] * inv) * weight[i];
    }
}

/* out[r, i] = silu(gate_up[r, i]) * gate_up[r, inter + i]; gate_up [rows, 2 * inter], out [rows, inter]. The
 * exp is vectorised (vexp): with libm's scalar expf, SiLU at a prefill chunk of 2048 rows took about twice
 * torch's time. */
void silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *y = out + r * inter;
        int64_t i = 0;
        for (; i + LANES <= inter; i += LANES) {
            const vec gv = *(const vec *)(g + i);
            *(vec *)(y + i) = gv / (1.0f + vexp(-gv)) * *(const vec *)(u + i);
        }
        for (; i < inter; i++) y[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotary embedding in place on the first `heads` heads of each row of x (row r at x + r * stride,
 * heads of `dim` floats back to back): x = x * cos + rotate_half(x) * sin, rotate_half(a, b) = (-b, a),
 * with cos and sin rows [max_positions, dim] picked by positions[r] (Hugging Face's convention). */
void rotary_f32(float *x, int64_t rows, int64_t stride, int64_t heads, int64_t dim, const float *cos_table,
                const float *sin_table, const int64_t *positions) {
    const int64_t half = dim / 2;
#pragma omp parallel for if (rows >= PARALLEL_ROWS)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_table + positions[r] * dim, *s = sin_table + positions[r] * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + r * stride + h * dim, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                const float a0 = a[i], b0 = b[i];
                a[i] = a0 * c[i] - b0 * s[i];
                b[i] = b0 * c[half + i] + a0 * s[half + i];
            }
        }
    }
}
