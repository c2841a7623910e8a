/* The float32 vector type the kernels share, by the widest vector unit the compiler targets
 * (`-march=native`): 16 lanes with AVX-512, 8 with AVX/AVX2, else 4, through GCC's vector extensions. */
#ifndef STEPSCOPE_VEC_H
#define STEPSCOPE_VEC_H

#include <stdint.h>

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif

typedef float vec __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float)), may_alias));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec vload(const float *p) { return *(const vec *)p; }
static inline void vstore(float *p, vec x) { *(vec *)p = x; }
static inline vec vsplat(float x) { return (vec){0} + x; }

/* Lane-wise `mask ? a : b` (C has no vector ?:); mask lanes are all ones or all zeros. */
static inline vec vselect(ivec mask, vec a, vec b) { return (vec)(((ivec)a & mask) | ((ivec)b & ~mask)); }

/* exp(x) lane by lane, within about 1 ulp of expf (Cephes' expf: exp(x) = 2^n exp(r), n the nearest
 * integer to x / ln 2, r = x - n ln 2 in two parts, exp(r) by its degree-7 polynomial); +inf above the
 * float range, 0 below it. libm's expf is scalar. */
static inline vec vexp(vec x) {
    const vec limit = vsplat(88.3762626647949f); /* expf overflows above, is below FLT_MIN under -limit */
    const ivec over = x > limit, under = x < -limit;
    x = vselect(over | under, (vec){0}, x);
    const vec magic = vsplat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const vec shifted = x * 1.44269504088896341f + magic;
    const vec n = shifted - magic;
    const vec r = x - n * 0.693359375f - n * -2.12194440e-4f;
    vec p = vsplat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const ivec bits = ((ivec)shifted - (ivec)magic + 127) << 23; /* 2^n */
    const vec y = p * (vec)bits;
    return vselect(over, vsplat(__builtin_inff()), vselect(under, (vec){0}, y));
}

#endif
