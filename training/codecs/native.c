/* The codecs' and the outer step's hot loops in C: one pass per cache-sized chunk instead of
about seven numpy passes.

Loaded by training/codecs/native.py (compiled on first use with the system C compiler; without one,
training/codecs/kernels.py and training/merge/outer.py keep their numpy code). Every result is
bit-identical to that numpy code, so to the reference (tests/test_codec_golden.py,
tests/test_native.py):
- only IEEE float32 add, subtract, multiply and divide, each rounded once: built with
  -ffp-contract=off (no fused multiply-add) and without -ffast-math; the float64 sums of
  squares (pw_sumsq) fuse r + v * v where the CPU can, the square of a float32 being exact
  in float64 (the add's rounding is the only one either way);
- rint (round half to even) as (v + 1.5 * 2^23) - 1.5 * 2^23 with v's sign kept (rint(-0.3)
  is -0.0), exact for |v| < 2^22 (here |v| <= levels (1 + 2 eps));
  the AVX2 loops use roundps to nearest even, which gives the same value and sign;
- floor as truncation corrected by one (|v| < 2^31 here).
Status 1: a non-finite input (the caller raises). Status 2 (quantized codecs): a block whose
levels / absmax overflows, which numpy clips: a quantized chunk is checked whole before
anything but its scales is written (its absmax pass), so the caller redoes it in numpy even
when `out` is `b`.
*/

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define MAGIC 12582912.0f /* 1.5 * 2^23 */

/* xb[0..len) = a (op b) from element i0 */
static void load(const float *a, const float *b, int op, int64_t i0, int64_t len, float *xb) {
    if (op > 0)
        for (int64_t i = 0; i < len; i++) xb[i] = a[i0 + i] + b[i0 + i];
    else if (op < 0)
        for (int64_t i = 0; i < len; i++) xb[i] = a[i0 + i] - b[i0 + i];
    else
        memcpy(xb, a + i0, (size_t)len * 4);
}

static inline uint32_t bits_of(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float v;
    memcpy(&v, &u, 4);
    return v;
}

static uint32_t absmax_bits(const float *xb, int64_t len) {
    uint32_t m = 0;
    for (int64_t i = 0; i < len; i++) {
        uint32_t u = bits_of(xb[i]) & 0x7FFFFFFFu;
        m = u > m ? u : m;
    }
    return m;
}

static inline float rint_even(float v) {
    float r = (v + MAGIC) - MAGIC;
    return float_of((bits_of(r) & 0x7FFFFFFFu) | (bits_of(v) & 0x80000000u));
}

static inline float floor_small(float v) {
    float t = (float)(int32_t)v;
    return t > v ? t - 1.0f : t;
}

/* The per-block loops: codes as floats into qb; out = x - deq (sink 0) or out += deq (sink 1).
   out never aliases x or qb (x is `a`'s block or the scratch copy of a (op b)). */
static void quant_block(int kind, const float *restrict x, int64_t len, float levels,
                        float absmax, float *restrict qb, float *restrict out, int sink) {
    float sc = absmax / levels;
    if (kind == 2) {
        float safe = sc > 0.0f ? sc : 1.0f;
        for (int64_t i = 0; i < len; i++) {
            float q = floor_small(x[i] / safe + 2.0f);
            qb[i] = q < 0.0f ? 0.0f : (q > 3.0f ? 3.0f : q);
        }
        if (sink)
            for (int64_t i = 0; i < len; i++) out[i] += (qb[i] - 1.5f) * sc;
        else
            for (int64_t i = 0; i < len; i++) out[i] = x[i] - (qb[i] - 1.5f) * sc;
        return;
    }
    float inv = absmax > 0.0f ? levels / absmax : 0.0f;
    for (int64_t i = 0; i < len; i++) qb[i] = rint_even(x[i] * inv);
    if (sink)
        for (int64_t i = 0; i < len; i++) out[i] += qb[i] * sc;
    else
        for (int64_t i = 0; i < len; i++) out[i] = x[i] - qb[i] * sc;
}

static void pack_block(int kind, const float *restrict qb, int64_t len, uint8_t *restrict d) {
    int64_t per = kind == 8 ? 1 : (kind == 4 ? 2 : 4), whole = len / per * per;
    if (kind == 8) {
        int8_t *d8 = (int8_t *)d;
        for (int64_t i = 0; i < len; i++) d8[i] = (int8_t)(int32_t)qb[i];
    } else if (kind == 4) {
        for (int64_t j = 0; j < whole / 2; j++)
            d[j] = (uint8_t)(((int32_t)qb[2 * j] + 8) | (((int32_t)qb[2 * j + 1] + 8) << 4));
    } else {
        for (int64_t j = 0; j < whole / 4; j++)
            d[j] = (uint8_t)((int32_t)qb[4 * j] | ((int32_t)qb[4 * j + 1] << 2) |
                             ((int32_t)qb[4 * j + 2] << 4) | ((int32_t)qb[4 * j + 3] << 6));
    }
    if (whole < len) { /* the tensor's last, partial byte */
        int32_t v = 0;
        for (int64_t j = 0; j < per; j++) {
            int32_t c = whole + j < len ? (int32_t)qb[whole + j] + (kind == 4 ? 8 : 0)
                                        : (kind == 4 ? 8 : 0);
            v |= c << (j * (kind == 4 ? 4 : 2));
        }
        d[whole / per] = (uint8_t)v;
    }
}

#if defined(__AVX2__)
/* encode_quantized for int8 and int4 with `block` a multiple of 8, in 8-wide vectors: x = a (op b)
   made on the fly in both passes (no scratch copy), the same operations in the same order as
   the scalar code (one rounding each; rint as roundps to nearest even, which keeps v's sign
   as rint_even does), so the same bits. A tensor's last, partial block goes the scalar way. */
static inline __m256 x8(const float *a, const float *b, int op, int64_t i) {
    __m256 va = _mm256_loadu_ps(a + i);
    if (op > 0) return _mm256_add_ps(va, _mm256_loadu_ps(b + i));
    if (op < 0) return _mm256_sub_ps(va, _mm256_loadu_ps(b + i));
    return va;
}

static uint32_t absmax8(const float *a, const float *b, int op, int64_t s, int64_t len) {
    const __m256i mag = _mm256_set1_epi32(0x7FFFFFFF);
    __m256i m = _mm256_setzero_si256();
    for (int64_t i = 0; i < len; i += 8)
        m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(x8(a, b, op, s + i)), mag));
    __m128i h = _mm_max_epu32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_max_epu32(h, _mm_shuffle_epi32(h, 0xB1));
    return (uint32_t)_mm_cvtsi128_si32(h);
}

static void quant_pack8(int kind, const float *a, const float *b, int op, int64_t s, int64_t len,
                        float levels, float absmax, uint8_t *restrict d, float *out, int sink) {
    const __m256 sc = _mm256_set1_ps(absmax / levels);
    const __m256 inv = _mm256_set1_ps(absmax > 0.0f ? levels / absmax : 0.0f);
    /* int4: byte 0 and byte 8 of each 128-bit lane (c_even | c_odd << 4 of two 64-bit lanes);
       int8: byte 0 of each 32-bit lane */
    const __m256i pick = kind == 4
        ? _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                           0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1)
        : _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                           0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m256i eight = _mm256_set1_epi32(8);
    for (int64_t i = 0; i < len; i += 8) {
        __m256 x = x8(a, b, op, s + i);
        __m256 q = _mm256_round_ps(_mm256_mul_ps(x, inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m256 deq = _mm256_mul_ps(q, sc);
        float *o = out + s + i;
        _mm256_storeu_ps(o, sink ? _mm256_add_ps(_mm256_loadu_ps(o), deq) : _mm256_sub_ps(x, deq));
        __m256i c = _mm256_cvtps_epi32(q);
        if (kind == 4) {
            c = _mm256_add_epi32(c, eight);
            c = _mm256_or_si256(c, _mm256_srli_epi64(c, 28));
            __m256i t = _mm256_shuffle_epi8(c, pick);
            uint16_t lo = (uint16_t)_mm256_extract_epi16(t, 0), hi = (uint16_t)_mm256_extract_epi16(t, 8);
            memcpy(d + (s + i) / 2, &lo, 2);
            memcpy(d + (s + i) / 2 + 2, &hi, 2);
        } else {
            __m256i t = _mm256_shuffle_epi8(c, pick);
            uint32_t lo = (uint32_t)_mm256_extract_epi32(t, 0), hi = (uint32_t)_mm256_extract_epi32(t, 4);
            memcpy(d + s + i, &lo, 4);
            memcpy(d + s + i + 4, &hi, 4);
        }
    }
}
#endif

/* Quantize n elements x = a (op b) in blocks of `block` (kind 8: int8 codes; 4: two codes
   q + 8 per byte, low nibble first; 2: four codes 0..3 per byte). Writes codes to `data`,
   scales (absmax / levels) to `scales`, and per element either out = x - dequantized
   (sink 0: the error-feedback residual) or out += dequantized (sink 1); `out` may be `b`,
   never `a`. `block` must be a multiple of 4 (every block starts on a byte); n need not be a
   multiple of it (only the tensor's last block can end mid-byte: padded with the codes 8
   (int4) or 0 (int2)).
   Returns 3 if its scratch cannot be allocated (nothing written). */
int encode_quantized(int kind, float levels, int64_t n, int64_t block, const float *a,
                     const float *b, int op, uint8_t *data, float *scales, float *out,
                     int sink) {
    int64_t nb = (n + block - 1) / block;
    int64_t per = kind == 8 ? 1 : (kind == 4 ? 2 : 4);
    float *xb = malloc((size_t)block * 2 * sizeof(float));
    if (!xb) return 3;
    float *qb = xb + block;
#if defined(__AVX2__)
    const int vec = kind != 2 && block % 8 == 0; /* full blocks in vectors (quant_pack8) */
#endif
    for (int64_t k = 0; k < nb; k++) { /* absmax and scales first: nothing else written yet */
        int64_t s = k * block, len = s + block < n ? block : n - s;
        uint32_t m;
#if defined(__AVX2__)
        if (vec && len == block) {
            m = absmax8(a, b, op, s, len);
        } else
#endif
        {
            const float *x = a + s;
            if (op) {
                load(a, b, op, s, len, xb);
                x = xb;
            }
            m = absmax_bits(x, len);
        }
        float absmax = float_of(m);
        int overflow = kind != 2 && absmax > 0.0f &&
                       (bits_of(levels / absmax) & 0x7FFFFFFFu) >= 0x7F800000u;
        if (m >= 0x7F800000u || overflow) {
            free(xb);
            return m >= 0x7F800000u ? 1 : 2;
        }
        scales[k] = absmax; /* an output: a refused chunk's caller rewrites it */
    }
    for (int64_t k = 0; k < nb; k++) {
        int64_t s = k * block, len = s + block < n ? block : n - s;
        float absmax = scales[k];
        scales[k] = absmax / levels;
#if defined(__AVX2__)
        if (vec && len == block) {
            quant_pack8(kind, a, b, op, s, len, levels, absmax, data, out, sink);
            continue;
        }
#endif
        const float *x = a + s;
        if (op) {
            load(a, b, op, s, len, xb);
            x = xb;
        }
        quant_block(kind, x, len, levels, absmax, qb, out + s, sink);
        pack_block(kind, qb, len, data + s / per);
    }
    free(xb);
    return 0;
}

/* One stretch of encode_bf16: x never aliases out (x is `a` or the scratch copy of a (op b)). */
static uint32_t bf16_stretch(const float *restrict x, int64_t len, uint16_t *restrict d,
                             float *restrict out, int sink) {
    uint32_t bad = 0;
    if (sink) {
        for (int64_t i = 0; i < len; i++) {
            uint32_t u = bits_of(x[i]);
            uint32_t r = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
            bad |= (u & 0x7F800000u) == 0x7F800000u;
            d[i] = (uint16_t)r;
            out[i] += float_of(r << 16);
        }
    } else {
        for (int64_t i = 0; i < len; i++) {
            uint32_t u = bits_of(x[i]);
            uint32_t r = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
            bad |= (u & 0x7F800000u) == 0x7F800000u;
            d[i] = (uint16_t)r;
            out[i] = x[i] - float_of(r << 16);
        }
    }
    return bad;
}

/* bfloat16 bits of x = a (op b), round to nearest even, and out = x - widened (sink 0) or
   out += widened (sink 1). Status 1 if an input is not finite: then the outputs (and `out`,
   which may be `b`) are partly written, and the caller raises. */
int encode_bf16(int64_t n, const float *a, const float *b, int op, uint16_t *data, float *out,
                int sink) {
    enum { STEP = 1024 };
    float xb[STEP];
    uint32_t bad = 0;
    for (int64_t s = 0; s < n; s += STEP) {
        int64_t len = s + STEP < n ? STEP : n - s;
        const float *x = a + s;
        if (op) {
            load(a, b, op, s, len, xb);
            x = xb;
        }
        bad |= bf16_stretch(x, len, data + s, out + s, sink);
    }
    return bad ? 1 : 0;
}

/* Whether the codes of n elements from d hold an invalid one: int8 -128, int4 nibble 0 (the
   pad nibble of an odd count is not a code); int2 has none. */
static int bad_codes(int kind, const uint8_t *d, int64_t n) {
    if (kind == 2) return 0;
    uint32_t bad = 0;
    int64_t nbytes = kind == 8 ? n : n / 2, j = 0;
#if defined(__AVX2__)
    __m256i any = _mm256_setzero_si256();
    const __m256i zero = _mm256_setzero_si256(), low = _mm256_set1_epi8(0x0F);
    const __m256i min8 = _mm256_set1_epi8((char)0x80);
    for (; j + 32 <= nbytes; j += 32) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(d + j));
        if (kind == 8) {
            any = _mm256_or_si256(any, _mm256_cmpeq_epi8(b, min8));
        } else {
            __m256i lo = _mm256_and_si256(b, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
            any = _mm256_or_si256(any, _mm256_cmpeq_epi8(lo, zero));
            any = _mm256_or_si256(any, _mm256_cmpeq_epi8(hi, zero));
        }
    }
    bad |= (uint32_t)_mm256_movemask_epi8(any) != 0;
#endif
    if (kind == 8) {
        for (; j < nbytes; j++) bad |= d[j] == 0x80u;
    } else {
        for (; j < nbytes; j++) bad |= ((d[j] & 15u) == 0) | ((d[j] >> 4) == 0);
        if (n & 1) bad |= (d[n / 2] & 15u) == 0; /* the pad nibble is not a code */
    }
    return bad != 0;
}

/* Elements [s, e) of a quantized tensor (s a multiple of the block and of the codes per
   byte), each code x its block's scale, into out[0, e - s): written (accumulate 0) or added
   (accumulate 1: out += value, as numpy's out += decoded). Status 1 (nothing written) if a
   code is invalid and check is set: int8 -128, int4 nibble 0 (int2 has none). */
int decode_quantized(int kind, const uint8_t *data, const float *scales, int64_t s, int64_t e,
                     int64_t block, float *restrict out, int accumulate, int check) {
    int64_t per = kind == 8 ? 1 : (kind == 4 ? 2 : 4);
    const uint8_t *d = data + s / per;
    int64_t n = e - s;
    if (check && bad_codes(kind, d, n)) return 1;
    enum { STEP = 256 }; /* a multiple of 4: every step starts on a byte */
    float v[STEP];
    int64_t i0 = 0;
#if defined(__AVX2__)
    /* whole blocks of int8 / int4 codes, 8 at a time: code -> float, x scale, then written or
       added (the same two roundings as below: no fused multiply-add) */
    if ((kind == 8 || kind == 4) && s % block == 0 && block % 32 == 0) {
        for (; i0 + block <= n; i0 += block) {
            __m256 sc = _mm256_set1_ps(scales[(s + i0) / block]);
            float *o = out + i0;
            for (int64_t i = 0; i < block; i += 32) {
                __m256i w[4];
                if (kind == 8) {
                    const int8_t *d8 = (const int8_t *)d + i0 + i;
                    for (int k = 0; k < 4; k++)
                        w[k] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(d8 + 8 * k)));
                } else {
                    __m128i b = _mm_loadu_si128((const __m128i *)(d + (i0 + i) / 2));
                    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
                    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
                    __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi);
                    __m256i eight = _mm256_set1_epi32(8);
                    w[0] = _mm256_sub_epi32(_mm256_cvtepu8_epi32(c0), eight);
                    w[1] = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(c0, 8)), eight);
                    w[2] = _mm256_sub_epi32(_mm256_cvtepu8_epi32(c1), eight);
                    w[3] = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(c1, 8)), eight);
                }
                for (int k = 0; k < 4; k++) {
                    __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(w[k]), sc);
                    float *ok = o + i + 8 * k;
                    if (accumulate) x = _mm256_add_ps(_mm256_loadu_ps(ok), x);
                    _mm256_storeu_ps(ok, x);
                }
            }
        }
    }
#endif
    for (; i0 < n; i0 += STEP) {
        int64_t len = i0 + STEP < n ? STEP : n - i0;
        if (kind == 8) {
            const int8_t *d8 = (const int8_t *)d + i0;
            for (int64_t i = 0; i < len; i++) v[i] = (float)d8[i];
        } else if (kind == 4) {
            const uint8_t *b = d + i0 / 2;
            for (int64_t j = 0; j < len / 2; j++) {
                v[2 * j] = (float)((int32_t)(b[j] & 15u) - 8);
                v[2 * j + 1] = (float)((int32_t)(b[j] >> 4) - 8);
            }
            if (len & 1) v[len - 1] = (float)((int32_t)(b[len / 2] & 15u) - 8);
        } else {
            const uint8_t *b = d + i0 / 4;
            for (int64_t j = 0; j < len / 4; j++)
                for (int k = 0; k < 4; k++)
                    v[4 * j + k] = (float)((b[j] >> (2 * k)) & 3u) - 1.5f;
            for (int64_t i = len / 4 * 4; i < len; i++)
                v[i] = (float)((b[i / 4] >> ((i & 3) * 2)) & 3u) - 1.5f;
        }
        /* the scale of element j (from s) is scales[(s + j) / block] */
        for (int64_t i = 0; i < len;) {
            int64_t j = i0 + i, b = (s + j) / block;
            int64_t end = (b + 1) * block - s - i0;
            end = end < len ? end : len;
            float sc = scales[b];
            if (accumulate)
                for (; i < end; i++) out[i0 + i] += v[i] * sc;
            else
                for (; i < end; i++) out[i0 + i] = v[i] * sc;
        }
    }
    return 0;
}

/* The outer step on n elements in place (training/merge/outer.outer_step_, whose numpy loop
   it replaces bit for bit: each operation rounded as there). g = g x factors[0] x ... (in
   turn; g itself is not written back); then mode 0: p -= lr g; mode 1 (SGD with momentum):
   m = m beta + g, p -= lr (g + beta m) with nesterov, else p -= lr m; mode 2 (Delayed
   Nesterov): d += g, g = g inv, and when flush m = m beta + inv d, d = 0, g += beta m; then
   p -= lr g. */
void outer_step(int64_t n, float *restrict p, float *restrict g, float *restrict m,
                float *restrict d, const float *factors, int nf, int mode, int nesterov,
                int flush, float lr, float beta, float inv) {
    enum { STEP = 1024 };
    float gb[STEP];
    for (int64_t s = 0; s < n; s += STEP) {
        int64_t len = s + STEP < n ? STEP : n - s;
        for (int64_t i = 0; i < len; i++) gb[i] = g[s + i];
        for (int f = 0; f < nf; f++) {
            float k = factors[f];
            for (int64_t i = 0; i < len; i++) gb[i] = gb[i] * k;
        }
        float *ps = p + s;
        if (mode == 0) {
            for (int64_t i = 0; i < len; i++) ps[i] = ps[i] - lr * gb[i];
        } else if (mode == 1) {
            float *ms = m + s;
            for (int64_t i = 0; i < len; i++) {
                float mi = ms[i] * beta;
                mi = mi + gb[i];
                ms[i] = mi;
                ps[i] = nesterov ? ps[i] - lr * (gb[i] + beta * mi) : ps[i] - lr * mi;
            }
        } else {
            float *ms = m + s, *ds = d + s;
            for (int64_t i = 0; i < len; i++) {
                float di = ds[i] + gb[i];
                float gi = gb[i] * inv;
                if (flush) {
                    float mi = ms[i] * beta;
                    mi = mi + inv * di;
                    ms[i] = mi;
                    di = 0.0f;
                    gi = gi + beta * mi;
                }
                ds[i] = di;
                ps[i] = ps[i] - lr * gi;
            }
        }
    }
}

/* The sum of squares of x[0, n) in float64, bit for bit numpy's
   np.add.reduce(np.square(x, dtype=np.float64)) on a contiguous array (numpy's pairwise_sum,
   numpy/_core/src/umath/loops_utils.h.src: below 8 elements one by one; up to 128 eight
   running sums added as ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the rest one
   by one; above, split at n / 2 rounded down to a multiple of 8), started from 0.0 as numpy's
   reduction does. Each square is exact (24 + 24 mantissa bits < 53; float32's exponents
   square within float64's normal range). tests/test_native.py holds it to numpy on every
   length up to 600, on chunk sizes and on several chunks. */

#if defined(__AVX2__)
/* A leaf (8 to 128 elements) with its eight running sums in two vectors of four doubles
   (r0..r3, r4..r7): lane j adds x[i + j]^2 in the order the scalar leaf's r[j] does, then the
   same combination and rest, so the same bits, in about half its time (in cache; at the
   memory's pace once not). r + v * v as one fused multiply-add where the CPU has it (one
   instruction fewer per 4 elements): the square is exact, so the add's is the only rounding
   either way. */
static inline __m256d sq_add4(__m256d r, __m256d v) {
#if defined(__FMA__)
    return _mm256_fmadd_pd(v, v, r);
#else
    return _mm256_add_pd(r, _mm256_mul_pd(v, v));
#endif
}

static double leaf_sumsq(const float *x, int64_t n) {
    __m256d v0 = _mm256_cvtps_pd(_mm_loadu_ps(x)), v1 = _mm256_cvtps_pd(_mm_loadu_ps(x + 4));
    __m256d r0 = _mm256_mul_pd(v0, v0), r1 = _mm256_mul_pd(v1, v1);
    int64_t i;
    for (i = 8; i < n - (n % 8); i += 8) {
        r0 = sq_add4(r0, _mm256_cvtps_pd(_mm_loadu_ps(x + i)));
        r1 = sq_add4(r1, _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4)));
    }
    double r[8], res;
    _mm256_storeu_pd(r, r0);
    _mm256_storeu_pd(r + 4, r1);
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) {
        double v = (double)x[i];
        res += v * v;
    }
    return res;
}
#else
/* A leaf (8 to 128 elements), one by one: the reference the vector leaf above keeps. */
static double leaf_sumsq(const float *x, int64_t n) {
    double r[8], res;
    for (int j = 0; j < 8; j++) {
        double v = (double)x[j];
        r[j] = v * v;
    }
    int64_t i;
    for (i = 8; i < n - (n % 8); i += 8)
        for (int j = 0; j < 8; j++) {
            double v = (double)x[i + j];
            r[j] += v * v;
        }
    res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) {
        double v = (double)x[i];
        res += v * v;
    }
    return res;
}
#endif

static double pw_sumsq(const float *x, int64_t n) {
    if (n < 8) {
        double res = 0.0;
        for (int64_t i = 0; i < n; i++) {
            double v = (double)x[i];
            res += v * v;
        }
        return res;
    }
    if (n <= 128) return leaf_sumsq(x, n);
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return pw_sumsq(x, n2) + pw_sumsq(x + n2, n - n2);
}

/* sums[k] = 0.0 + pw_sumsq of the k-th chunk of `step` elements of x[0, n) (the last one
   shorter): a norm's per-chunk terms, added in chunk order by the caller. */
void sumsq_chunks(const float *x, int64_t n, int64_t step, double *sums) {
    for (int64_t s = 0, k = 0; s < n; s += step, k++)
        sums[k] = pw_sumsq(x + s, s + step < n ? step : n - s);
}

/* outer_step chunk by chunk (element by element the same arithmetic: the same bits), and
   sums[k] = the pw_sumsq of the k-th chunk of `step` elements of the updated p: the new
   parameters' norm terms while they are in cache (the next merge's params norm, carried). */
void outer_step_sq(int64_t n, float *p, float *g, float *m, float *d, const float *factors,
                   int nf, int mode, int nesterov, int flush, float lr, float beta, float inv,
                   int64_t step, double *sums) {
    for (int64_t s = 0, k = 0; s < n; s += step, k++) {
        int64_t len = s + step < n ? step : n - s;
        outer_step(len, p + s, g + s, m ? m + s : m, d ? d + s : d, factors, nf, mode, nesterov,
                   flush, lr, beta, inv);
        sums[k] = pw_sumsq(p + s, len);
    }
}

/* One block of encode_quantized (x = a - b, sink 1 into b): the same checks, status and bits,
   without its scratch for an int8 / int4 block of a multiple of 8 (its vector loops). */
static int encode_block(int kind, float levels, int64_t len, int64_t block, const float *a,
                        float *b, uint8_t *data, float *scales) {
#if defined(__AVX2__)
    if (kind != 2 && len == block && block % 8 == 0) {
        uint32_t m = absmax8(a, b, -1, 0, len);
        float absmax = float_of(m);
        int overflow = absmax > 0.0f && (bits_of(levels / absmax) & 0x7FFFFFFFu) >= 0x7F800000u;
        if (m >= 0x7F800000u || overflow) return m >= 0x7F800000u ? 1 : 2;
        scales[0] = absmax / levels;
        quant_pack8(kind, a, b, -1, 0, len, levels, absmax, data, b, 1);
        return 0;
    }
#endif
    return encode_quantized(kind, levels, len, block, a, b, -1, data, scales, b, 1);
}

/* The merge's outer step with the broadcast update's encode fused in (training/merge/outer.py
   with a training/codecs/host.PendingStep): block by block, outer_step on the block and then
   encode_quantized of x = p - sh into `data` and `scales` with sink 1 into sh (the update's
   codes and the new shadow) while the block is in L1, so memory streams through one pass
   over params, momentum and shadow (instead of two) with the encode's arithmetic between;
   sums[k] = the pw_sumsq of chunk k's new params (`step` elements) once the chunk is done.
   Element by element the operations of outer_step_sq over the tensor and then of the
   chunked encode (training/codecs/kernels._quantize: block by block, whatever the chunks):
   the same bits. `data` and `scales` point at the codes and scales of this call's element 0
   (a chunk start). Returns n, or the element where an encode refused (status 1 non-finite,
   2 levels / absmax overflow, 3 no scratch; nothing but that block's scale written): that
   block's outer step is done and its encode not, later blocks untouched, and the sum of its
   chunk not taken; the caller finishes from there the way kernels._quantize does. */
#define PF_AHEAD 1024 /* elements: 4 KiB ahead per stream (of 1, 4 and 8 KiB the best here) */
int64_t outer_encode_sq(int64_t n, float *p, float *g, float *m, float *d, const float *factors,
                        int nf, int mode, int nesterov, int flush, float lr, float beta,
                        float inv, int64_t step, double *sums, int kind, float levels,
                        int64_t block, float *sh, uint8_t *data, float *scales) {
    int64_t per = kind == 8 ? 1 : (kind == 4 ? 2 : 4);
    for (int64_t s = 0, k = 0; s < n; s += step, k++) {
        int64_t end = s + step < n ? s + step : n;
        for (int64_t b = s; b < end; b += block) {
            int64_t len = b + block < end ? block : end - b;
            if (b + PF_AHEAD + block <= n) /* the streams a few blocks ahead, while this */
                for (int64_t i = 0; i < block; i += 16) { /* one computes (16 floats a line) */
                    __builtin_prefetch(p + b + PF_AHEAD + i, 1);
                    __builtin_prefetch(g + b + PF_AHEAD + i, 0);
                    __builtin_prefetch(sh + b + PF_AHEAD + i, 1);
                    if (m) __builtin_prefetch(m + b + PF_AHEAD + i, 1);
                }
            outer_step(len, p + b, g + b, m ? m + b : m, d ? d + b : d, factors, nf, mode,
                       nesterov, flush, lr, beta, inv);
            if (encode_block(kind, levels, len, block, p + b, sh + b, data + b / per,
                             scales + b / block) != 0)
                return b;
        }
        sums[k] = pw_sumsq(p + s, end - s);
    }
    return n;
}

/* numpy's pairwise sum of a float64 array (pw_sumsq's order, on values already squared). */
static double pw_sum(const double *a, int64_t n) {
    if (n < 8) {
        double res = 0.0;
        for (int64_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        double r[8], res;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        int64_t i;
        for (i = 8; i < n - (n % 8); i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return pw_sum(a, n2) + pw_sum(a + n2, n - n2);
}

/* The sum of the squares of the codes in `nbytes` whole bytes (int2: of 2 code - 3), in
   integer lanes the compiler vectorizes (a block's sum fits 32 bits: at most 16129 per int8
   code, 8 per block of 256). */
static int64_t block_sq(int kind, const uint8_t *restrict bd, int64_t nbytes) {
    int32_t q = 0;
#if defined(__AVX2__)
    /* 32 bytes at a time, in integers: the same exact sums (the order of integer adds does
       not matter) */
    int64_t j0 = 0;
    if (kind == 4 && nbytes >= 32) {
        /* (nibble - 8)^2 by table: 64, 49, ..., 0, ..., 49 (nibble 0 to 15) */
        const __m256i table = _mm256_setr_epi8(64, 49, 36, 25, 16, 9, 4, 1, 0, 1, 4, 9, 16,
                                               25, 36, 49, 64, 49, 36, 25, 16, 9, 4, 1, 0, 1,
                                               4, 9, 16, 25, 36, 49);
        const __m256i low = _mm256_set1_epi8(0x0F);
        __m256i acc = _mm256_setzero_si256();
        for (; j0 + 32 <= nbytes; j0 += 32) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(bd + j0));
            __m256i lo = _mm256_and_si256(b, low);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
            __m256i sq = _mm256_add_epi8(_mm256_shuffle_epi8(table, lo),
                                         _mm256_shuffle_epi8(table, hi)); /* <= 128 */
            acc = _mm256_add_epi64(acc, _mm256_sad_epu8(sq, _mm256_setzero_si256()));
        }
        int64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, acc);
        q = (int32_t)(lanes[0] + lanes[1] + lanes[2] + lanes[3]);
    } else if (kind == 8 && nbytes >= 32) {
        __m256i acc = _mm256_setzero_si256();
        for (; j0 + 32 <= nbytes; j0 += 32) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(bd + j0));
            __m256i x0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(b));
            __m256i x1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(x0, x0));
            acc = _mm256_add_epi32(acc, _mm256_madd_epi16(x1, x1));
        }
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, acc);
        for (int k = 0; k < 8; k++) q += lanes[k];
    }
    bd += j0;
    nbytes -= j0;
#endif
    if (kind == 8) {
        const int8_t *b8 = (const int8_t *)bd;
        for (int64_t j = 0; j < nbytes; j++) q += (int32_t)b8[j] * (int32_t)b8[j];
    } else if (kind == 4) {
        for (int64_t j = 0; j < nbytes; j++) {
            int32_t lo = (int32_t)(bd[j] & 15u) - 8, hi = (int32_t)(bd[j] >> 4) - 8;
            q += lo * lo + hi * hi;
        }
    } else {
        for (int64_t j = 0; j < nbytes; j++) {
            int32_t c0 = 2 * (int32_t)(bd[j] & 3u) - 3, c1 = 2 * (int32_t)((bd[j] >> 2) & 3u) - 3;
            int32_t c2 = 2 * (int32_t)((bd[j] >> 4) & 3u) - 3, c3 = 2 * (int32_t)(bd[j] >> 6) - 3;
            q += c0 * c0 + c1 * c1 + c2 * c2 + c3 * c3;
        }
    }
    return q;
}

/* The square of the code of element i of the codes from d (d on a byte; int2: of
   2 code - 3). */
static inline int32_t code_sq(int kind, const uint8_t *d, int64_t i) {
    int32_t v;
    if (kind == 8) v = (int8_t)d[i];
    else if (kind == 4) v = (int32_t)((d[i / 2] >> (4 * (i % 2))) & 15u) - 8;
    else v = 2 * (int32_t)((d[i / 4] >> (2 * (i % 4))) & 3u) - 3;
    return v * v;
}

/* The term of a block of codes_sumsq: its Q (the sum of its codes' squares) x its scale
   squared in float64, +inf when scale x levels is not a finite float32 and the scale not NaN. */
static inline double block_term(int kind, int64_t q, float sc, float levels) {
    double sc2 = (double)sc * (double)sc;
    double qd = kind == 2 ? (double)q * 0.25 : (double)q;
    if (!isfinite(sc * levels) && !isnan(sc)) /* sc x levels overflows, or sc is inf */
        return INFINITY;
    return sc2 * qd;
}

#if defined(__AVX2__)
/* codes_sumsq's chunk in one pass over its codes, for whole blocks of a multiple of 32 bytes:
   the codes squared into int32 lanes of partial sums (exact: integer adds, in any order), a
   block's vectors added, 8 blocks' lanes reduced together into their 8 Q. The pass assumes
   valid codes (int8 in [-127, 127], int4 nibbles not 0) and says whether it saw another:
   then codes_sumsq stops (check) or sums the chunk again block by block, exact for any
   code. Then the terms 4 at a time with the scalar block_term's operations (the same
   bits). */
#define INLINE static inline __attribute__((always_inline))
/* (nibble - 8)^2 (int4, nibble 0 to 15: 49 at most but for nibble 0's 64); int2: (2 c - 3)^2
   of the nibble's two codes c (18 at most) */
#define SQ4 64, 49, 36, 25, 16, 9, 4, 1, 0, 1, 4, 9, 16, 25, 36, 49
#define SQ2 18, 10, 10, 18, 10, 2, 2, 10, 10, 2, 2, 10, 18, 10, 10, 18

/* int4, int2: the squares of the codes of 32 bytes, a byte's two nibbles' looked up and added
   (98 at most for valid int4 codes, 36 for int2), into `sum`; `flag` ORs the looked-up
   squares: its bit 6 is set by nibble 0's 64 alone. */
INLINE void nib256(int kind, __m256i b, __m256i *sum, __m256i *flag) {
    const __m256i tab = kind == 4 ? _mm256_setr_epi8(SQ4, SQ4) : _mm256_setr_epi8(SQ2, SQ2);
    const __m256i m = _mm256_set1_epi8(0x0F);
    __m256i sl = _mm256_shuffle_epi8(tab, _mm256_and_si256(b, m));
    __m256i sh = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(b, 4), m));
    if (kind == 4) *flag = _mm256_or_si256(*flag, _mm256_or_si256(sl, sh));
    *sum = _mm256_add_epi8(*sum, _mm256_add_epi8(sl, sh));
}

/* The squares of the codes of a block's bb bytes from p (bb a multiple of 32) as 8 int32
   lanes of partial sums. int4, int2: two vectors' bytes added (196 at most for valid codes)
   before summing 8 bytes at a time into 64-bit lanes (their upper halves 0). int8: widened
   to 16 bits, squared and paired; `flag` the least code (-128: invalid). */
INLINE __m256i block256(int kind, const uint8_t *p, int64_t bb, __m256i *flag) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t j = 0; j < bb; j += 64) {
        __m256i b = _mm256_loadu_si256((const __m256i *)(p + j));
        __m256i c = j + 32 < bb ? _mm256_loadu_si256((const __m256i *)(p + j + 32))
                                : _mm256_setzero_si256();
        if (kind == 8) {
            *flag = _mm256_min_epi8(*flag, _mm256_min_epi8(b, c));
            __m256i x0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(b));
            __m256i x1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(b, 1));
            __m256i x2 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(c));
            __m256i x3 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(c, 1));
            acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(x0, x0),
                                                         _mm256_madd_epi16(x1, x1)));
            acc = _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(x2, x2),
                                                         _mm256_madd_epi16(x3, x3)));
        } else {
            __m256i sum = _mm256_setzero_si256();
            nib256(kind, b, &sum, flag);
            if (j + 32 < bb) nib256(kind, c, &sum, flag);
            acc = _mm256_add_epi32(acc, _mm256_sad_epu8(sum, _mm256_setzero_si256()));
        }
    }
    return acc;
}

#if defined(__AVX512BW__)
/* nib256 on 64 bytes. With VBMI the nibbles are looked up by vpermb, which reads an index's
   low 6 bits (the table 4 times over: no mask needed). */
INLINE void nib512(int kind, __m512i b, __m512i *sum, __m512i *flag) {
    const __m512i tab = _mm512_broadcast_i32x4(kind == 4 ? _mm_setr_epi8(SQ4)
                                                         : _mm_setr_epi8(SQ2));
#if defined(__AVX512VBMI__)
    __m512i sl = _mm512_permutexvar_epi8(b, tab);
    __m512i sh = _mm512_permutexvar_epi8(_mm512_srli_epi16(b, 4), tab);
#else
    const __m512i m = _mm512_set1_epi8(0x0F);
    __m512i sl = _mm512_shuffle_epi8(tab, _mm512_and_si512(b, m));
    __m512i sh = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(b, 4), m));
#endif
    if (kind == 4) *flag = _mm512_ternarylogic_epi32(*flag, sl, sh, 0xFE); /* a | b | c */
    *sum = _mm512_add_epi8(*sum, _mm512_add_epi8(sl, sh));
}

/* block256 in 64-byte vectors (bb a multiple of 64): 16 lanes. int8 with VNNI: |code| x
   |code| (unsigned x signed, exact but for -128) summed 4 at a time by vpdpbusd. */
INLINE __m512i block512(int kind, const uint8_t *p, int64_t bb, __m512i *flag) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t j = 0; j < bb; j += 128) {
        __m512i b = _mm512_loadu_si512((const void *)(p + j));
        __m512i c = j + 64 < bb ? _mm512_loadu_si512((const void *)(p + j + 64))
                                : _mm512_setzero_si512();
        if (kind == 8) {
            *flag = _mm512_min_epi8(*flag, _mm512_min_epi8(b, c));
#if defined(__AVX512VNNI__)
            __m512i ab = _mm512_abs_epi8(b), ac = _mm512_abs_epi8(c);
            acc = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, ab, ab), ac, ac);
#else
            __m512i x0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(b));
            __m512i x1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(b, 1));
            __m512i x2 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(c));
            __m512i x3 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(c, 1));
            acc = _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(x0, x0),
                                                         _mm512_madd_epi16(x1, x1)));
            acc = _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(x2, x2),
                                                         _mm512_madd_epi16(x3, x3)));
#endif
        } else {
            __m512i sum = _mm512_setzero_si512();
            nib512(kind, b, &sum, flag);
            if (j + 64 < bb) nib512(kind, c, &sum, flag);
            acc = _mm512_add_epi32(acc, _mm512_sad_epu8(sum, _mm512_setzero_si512()));
        }
    }
    return acc;
}
#endif

/* terms[0, 4) = block_term of 4 blocks' Q q and scales sc[0, 4): the same float32 product
   for the overflow test (|sc x levels| = inf: an overflow or an infinite sc, never a NaN sc)
   and the same float64 products, so the same bits. */
static inline void terms4(int kind, __m128i q, const float *sc, float levels, double *terms) {
    const __m128 s = _mm_loadu_ps(sc);
    const __m128 mag = _mm_castsi128_ps(_mm_set1_epi32(0x7FFFFFFF));
    __m256d sd = _mm256_cvtps_pd(s), qd = _mm256_cvtepi32_pd(q);
    if (kind == 2) qd = _mm256_mul_pd(qd, _mm256_set1_pd(0.25));
    __m256d v = _mm256_mul_pd(_mm256_mul_pd(sd, sd), qd);
    __m128 over = _mm_cmpeq_ps(_mm_and_ps(_mm_mul_ps(s, _mm_set1_ps(levels)), mag),
                               _mm_set1_ps(INFINITY));
    __m256d m = _mm256_castsi256_pd(_mm256_cvtepi32_epi64(_mm_castps_si128(over)));
    _mm256_storeu_pd(terms, _mm256_blendv_pd(v, _mm256_set1_pd(INFINITY), m));
}

/* The 8 sums of 8 blocks' lanes a[0..8), in order. */
static inline __m256i sum8(const __m256i a[8]) {
    __m256i h01 = _mm256_hadd_epi32(a[0], a[1]), h23 = _mm256_hadd_epi32(a[2], a[3]);
    __m256i h45 = _mm256_hadd_epi32(a[4], a[5]), h67 = _mm256_hadd_epi32(a[6], a[7]);
    /* blocks 0-3 (h0) and 4-7 (h1): their lanes 0-3 summed in the low 128 bits, 4-7 high */
    __m256i h0 = _mm256_hadd_epi32(h01, h23), h1 = _mm256_hadd_epi32(h45, h67);
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20),
                            _mm256_permute2x128_si256(h0, h1, 0x31));
}

struct sq_flags { /* the running flags of the codes seen: block256's, block512's */
    __m256i f;
#if defined(__AVX512BW__)
    __m512i f5;
#endif
};

/* The terms of blocks g to g + 8 (those before nb) of bb bytes from d into terms[g..], from
   their Q and their scales sc[g..] (none read past sc[nb - 1]). */
INLINE void group8(int kind, int wide, const uint8_t *d, int64_t nb, int64_t bb, int64_t g,
                   const float *sc, float levels, double *terms, struct sq_flags *fl) {
    (void)wide; /* 0 without AVX-512 */
    __m256i a[8];
    for (int i = 0; i < 8; i++) {
        const uint8_t *p = d + (g + i) * bb;
        if (g + i >= nb) {
            a[i] = _mm256_setzero_si256();
            continue;
        }
#if defined(__AVX512BW__)
        if (wide) {
            __m512i acc = block512(kind, p, bb, &fl->f5);
            a[i] = _mm256_add_epi32(_mm512_castsi512_si256(acc),
                                    _mm512_extracti64x4_epi64(acc, 1));
            continue;
        }
#endif
        a[i] = block256(kind, p, bb, &fl->f);
    }
    __m256i q = sum8(a);
    if (g + 8 <= nb) {
        terms4(kind, _mm256_castsi256_si128(q), sc + g, levels, terms + g);
        terms4(kind, _mm256_extracti128_si256(q, 1), sc + g + 4, levels, terms + g + 4);
        return;
    }
    int32_t qs[8];
    _mm256_storeu_si256((__m256i *)qs, q);
    for (int64_t i = 0; g + i < nb; i++) terms[g + i] = block_term(kind, qs[i], sc[g + i], levels);
}

/* terms[0, nb) of nb whole blocks of bb bytes from d (bb a multiple of 32; of 64 with `wide`:
   AVX-512's vectors) and their scales sc[0, nb), 8 blocks' as their Q come out, groups of
   the first and the second half in turn (two streams of codes for the prefetchers); exact
   when the codes are valid; returns whether one is not. */
INLINE int blocks_terms_as(int kind, int wide, const uint8_t *d, int64_t nb, int64_t bb,
                           const float *sc, float levels, double *terms) {
    struct sq_flags fl;
    fl.f = _mm256_set1_epi8(kind == 8 ? 127 : 0);
#if defined(__AVX512BW__)
    fl.f5 = _mm512_set1_epi8(kind == 8 ? 127 : 0);
#endif
    int64_t groups = (nb + 7) / 8, half = groups / 2;
    for (int64_t j = 0; j < half; j++) {
        group8(kind, wide, d, nb, bb, 8 * j, sc, levels, terms, &fl);
        group8(kind, wide, d, nb, bb, 8 * (j + half), sc, levels, terms, &fl);
    }
    if (groups % 2) group8(kind, wide, d, nb, bb, 8 * (groups - 1), sc, levels, terms, &fl);
    __m256i flag = fl.f;
#if defined(__AVX512BW__)
    if (wide) {
        __m256i lo = _mm512_castsi512_si256(fl.f5), hi = _mm512_extracti64x4_epi64(fl.f5, 1);
        flag = kind == 8 ? _mm256_min_epi8(lo, hi) : _mm256_or_si256(lo, hi);
    }
#endif
    if (kind == 8)
        return _mm256_movemask_epi8(_mm256_cmpeq_epi8(flag, _mm256_set1_epi8((char)0x80))) != 0;
    if (kind == 4) /* bit 6 to the sign bit */
        return _mm256_movemask_epi8(_mm256_slli_epi16(flag, 1)) != 0;
    return 0;
}

/* blocks_terms_as with the kind (and the common block sizes) fixed, for the compiler. */
static int blocks_terms(int kind, const uint8_t *d, int64_t nb, int64_t bb, const float *sc,
                        float levels, double *terms) {
#define BT(k, w, b) blocks_terms_as(k, w, d, nb, b, sc, levels, terms)
#if defined(__AVX512BW__)
    if (bb % 64 == 0) {
        if (kind == 4) return bb == 128 ? BT(4, 1, 128) : BT(4, 1, bb);
        if (kind == 8) return bb == 256 ? BT(8, 1, 256) : BT(8, 1, bb);
        return bb == 64 ? BT(2, 1, 64) : BT(2, 1, bb);
    }
#endif
    if (kind == 4) return bb == 128 ? BT(4, 0, 128) : BT(4, 0, bb);
    if (kind == 8) return bb == 256 ? BT(8, 0, 256) : BT(8, 0, bb);
    return bb == 64 ? BT(2, 0, 64) : BT(2, 0, bb);
#undef BT
}
#endif

/* The squared norm of a quantized tensor's values from its codes, never decoded
   (training/codecs/host.py `codes_sq`, whose numpy code gives the same bits): per block b,
   Q_b = the sum of its codes' squares, an exact integer (int2: of (2 code - 3)^2, so
   Q_b / 4); its term t_b = (scale_b x scale_b) x Q_b in float64 (the square exact, one
   rounding); a block whose scale x levels is not a finite float32 (a value that cannot
   decode) gives +inf, a NaN scale NaN. sums[k] = numpy's pairwise sum of the terms of the
   blocks of chunk k (`step` elements). Returns the chunks done: fewer when a chunk has an
   invalid code (check set: int8 -128, int4 nibble 0, the pad nibble not judged). */
int64_t codes_sumsq(int kind, const uint8_t *data, const float *scales, int64_t s, int64_t e,
                    int64_t block, int64_t step, int check, double *sums) {
    int64_t per = kind == 8 ? 1 : (kind == 4 ? 2 : 4);
    float levels = kind == 8 ? 127.0f : (kind == 4 ? 7.0f : 1.5f);
    int64_t nb = (step + block - 1) / block;
    double stack_terms[1024];
    double *terms = nb <= 1024 ? stack_terms : (double *)malloc((size_t)nb * sizeof(double));
    if (!terms) return -1;
    int64_t k = 0;
    for (int64_t c = s; c < e; c += step, k++) {
        int64_t ce = c + step < e ? c + step : e;
        int64_t n = ce - c;
        const uint8_t *d = data + c / per;
        int64_t t = 0;
        int vec = 0;
#if defined(__AVX2__)
        /* whole blocks of a multiple of 32 bytes in one vector pass (their sums far from
           int32's end); the rest, a tensor's last partial block, below */
        vec = block % per == 0 && (block / per) % 32 == 0 && block <= 65536;
        if (vec) {
            int64_t whole = n / block;
            int bad = blocks_terms(kind, d, whole, block / per, scales + c / block, levels, terms);
            if (check && (bad || bad_codes(kind, d + whole * (block / per), n - whole * block)))
                break;
            t = bad ? 0 : whole; /* bad: the chunk block by block below, exact for any code */
        }
#endif
        if (!vec && check && bad_codes(kind, d, n)) break;
        for (int64_t b0 = t * block; b0 < n; b0 += block, t++) {
            int64_t len = b0 + block < n ? block : n - b0;
            int64_t q = 0, i = 0;
            if (block % per == 0) { /* the block's whole bytes */
                q = block_sq(kind, d + b0 / per, len / per);
                i = len / per * per;
            }
            /* code by code: a block that does not start on a byte (int4, int2), the tensor's
               last byte (part padding) */
            for (; i < len; i++) q += code_sq(kind, d, b0 + i);
            terms[t] = block_term(kind, q, scales[(c + b0) / block], levels);
        }
        sums[k] = pw_sum(terms, t);
    }
    if (terms != stack_terms) free(terms);
    return k;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
/* fold_blocks' group: 128 elements from element e (in a block whose scale for vote v is
   sc[v]) at o[0, 128), in 16-wide vectors, 8 of them held in registers while every vote is
   decoded and added in vote order. int4 codes are not widened and converted but looked up:
   the block's 16 values (c - 8) x scale, each rounded once as decoding rounds it, in one
   vector, each element's nibble picked by vpmultishiftqb (from its 8 bytes broadcast, bits
   4j.. of the qword into lane j's low bits, which alone vpermps reads): about half the
   instructions. int8: widened, converted, multiplied. */
enum { FOLD_GROUP = 128 };

static inline void decode128(int kind, const uint8_t *data, int64_t e, float sc, __m512 x[8]) {
    if (kind == 4) {
        const __m512 t = _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2,
                                                      3, 4, 5, 6, 7),
                                       _mm512_set1_ps(sc));
        /* lane 2q: byte q's low nibble (bits 8q..), lane 2q + 1: its high one (8q + 4..) */
        const __m512i pick = _mm512_set_epi64(
            0x0000003C00000038, 0x0000003400000030, 0x0000002C00000028, 0x0000002400000020,
            0x0000001C00000018, 0x0000001400000010, 0x0000000C00000008, 0x0000000400000000);
        const uint8_t *d = data + e / 2;
        for (int g = 0; g < 8; g++) {
            int64_t q;
            memcpy(&q, d + 8 * g, 8);
            __m512i idx = _mm512_multishift_epi64_epi8(pick, _mm512_set1_epi64(q));
            x[g] = _mm512_permutexvar_ps(idx, t);
        }
    } else {
        const __m512 s = _mm512_set1_ps(sc);
        const int8_t *d8 = (const int8_t *)data + e;
        for (int g = 0; g < 8; g++) {
            __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(d8 + 16 * g)));
            x[g] = _mm512_mul_ps(_mm512_cvtepi32_ps(w), s);
        }
    }
}

static void fold_group(int k, const int *kinds, const uint8_t *const *data, const float *sc,
                       int64_t e, float *o, int init) {
    __m512 a[8], x[8];
    decode128(kinds[0], data[0], e, sc[0], x);
    for (int g = 0; g < 8; g++)
        a[g] = init ? x[g] : _mm512_add_ps(_mm512_loadu_ps(o + 16 * g), x[g]);
    for (int v = 1; v < k; v++) {
        decode128(kinds[v], data[v], e, sc[v], x);
        for (int g = 0; g < 8; g++) a[g] = _mm512_add_ps(a[g], x[g]);
    }
    for (int g = 0; g < 8; g++) _mm512_storeu_ps(o + 16 * g, a[g]);
}
#elif defined(__AVX2__)
/* The same with 8-wide vectors, 32 elements (4 of them) at a time; the codes widened,
   converted (exact) and multiplied (one rounding), as decode_quantized's vector loop does. */
enum { FOLD_GROUP = 32 };

static inline void decode32(int kind, const uint8_t *data, int64_t e, float sc, __m256 x[4]) {
    __m256i w[4];
    if (kind == 8) {
        const int8_t *d8 = (const int8_t *)data + e;
        for (int g = 0; g < 4; g++)
            w[g] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(d8 + 8 * g)));
    } else {
        __m128i b = _mm_loadu_si128((const __m128i *)(data + e / 2));
        __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
        /* the codes in element order as bytes, nibble - 8 (-8..7), then sign-extended */
        __m128i c0 = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), _mm_set1_epi8(8));
        __m128i c1 = _mm_sub_epi8(_mm_unpackhi_epi8(lo, hi), _mm_set1_epi8(8));
        w[0] = _mm256_cvtepi8_epi32(c0);
        w[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(c0, 8));
        w[2] = _mm256_cvtepi8_epi32(c1);
        w[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(c1, 8));
    }
    __m256 s = _mm256_set1_ps(sc);
    for (int g = 0; g < 4; g++) x[g] = _mm256_mul_ps(_mm256_cvtepi32_ps(w[g]), s);
}

static void fold_group(int k, const int *kinds, const uint8_t *const *data, const float *sc,
                       int64_t e, float *o, int init) {
    __m256 a[4], x[4];
    decode32(kinds[0], data[0], e, sc[0], x);
    for (int g = 0; g < 4; g++)
        a[g] = init ? x[g] : _mm256_add_ps(_mm256_loadu_ps(o + 8 * g), x[g]);
    for (int v = 1; v < k; v++) {
        decode32(kinds[v], data[v], e, sc[v], x);
        for (int g = 0; g < 4; g++) a[g] = _mm256_add_ps(a[g], x[g]);
    }
    for (int g = 0; g < 4; g++) _mm256_storeu_ps(o + 8 * g, a[g]);
}
#endif

#if defined(__AVX2__)
enum { FOLD_AHEAD = 1024 }; /* elements: what is prefetched and folded ahead */

/* fold_votes on whole blocks [c, c + n) (c a multiple of the block, the block of FOLD_GROUP)
   when every vote is int8 or int4: group by group (fold_group), every vote decoded and added
   into the group in vote order while it is in registers, acc read (when not init) and written
   once instead of once per vote. Element by element the same operations in the same order
   (vote 0 written or added, then votes 1..k-1 added; each decoded value code x scale, rounded
   once): the same bits. Each group's acc and codes FOLD_AHEAD elements on are prefetched (k + 1
   streams: the hardware alone keeps fewer of them in flight, about 15% slower). The votes'
   scales of a block are gathered once (at most 64 votes at a time). */
static void fold_blocks(int k, const int *kinds, const uint8_t *const *data,
                        const float *const *scales, int64_t c, int64_t n, int64_t block,
                        float *o, int init) {
    enum { MAX_VOTES = 64 };
    if (k > MAX_VOTES) { /* the first 64 votes, then the rest added (in order: the same bits) */
        fold_blocks(MAX_VOTES, kinds, data, scales, c, n, block, o, init);
        fold_blocks(k - MAX_VOTES, kinds + MAX_VOTES, data + MAX_VOTES, scales + MAX_VOTES, c,
                    n, block, o, 0);
        return;
    }
    float sc[MAX_VOTES];
    for (int64_t b0 = 0; b0 < n; b0 += block) {
        int64_t blk = (c + b0) / block;
        for (int v = 0; v < k; v++) sc[v] = scales[v][blk];
        for (int64_t i = b0; i < b0 + block; i += FOLD_GROUP) {
            /* hints (past the end they do nothing): acc's and the codes' lines FOLD_AHEAD on */
            for (int g = 0; g < FOLD_GROUP; g += 16)
                _mm_prefetch((const char *)(o + i + FOLD_AHEAD + g), _MM_HINT_T0);
            for (int v = 0; v < k; v++) {
                int half = kinds[v] == 4; /* int4: two codes a byte */
                const char *d = (const char *)data[v] + ((c + i + FOLD_AHEAD) >> half);
                for (int g = 0; g < FOLD_GROUP >> half; g += 64) _mm_prefetch(d + g, _MM_HINT_T0);
            }
            fold_group(k, kinds, data, sc, c + i, o + i, init);
        }
    }
}

/* A chunk's fold done as its sum of squares reads it: fold_blocks on [c, c + whole) from
   `done` on, called before each leaf of pw_sumsq's tree with the leaf's end, so a leaf reads
   what was folded a moment before (in L1), and the adds of the sums overlap the fold's loads
   instead of a second pass over the chunk after it. */
struct fold_chunk {
    int k, init;
    const int *kinds;
    const uint8_t *const *data;
    const float *const *scales;
    int64_t c, block, whole, done;
    float *o;
};

static void fold_to(struct fold_chunk *f, int64_t end) {
    if (end <= f->done || f->done >= f->whole) return;
    int64_t to = (end + FOLD_AHEAD + f->block - 1) / f->block * f->block;
    to = to < f->whole ? to : f->whole;
    fold_blocks(f->k, f->kinds, f->data, f->scales, f->c + f->done, to - f->done, f->block,
                f->o + f->done, f->init);
    f->done = to;
}

/* pw_sumsq of o[at, at + n) (the same tree, the same adds in the same order), each leaf
   folded first */
static double pw_sumsq_fold(struct fold_chunk *f, int64_t at, int64_t n) {
    if (n <= 128) {
        fold_to(f, at + n);
        return pw_sumsq(f->o + at, n);
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    double left = pw_sumsq_fold(f, at, n2);
    return left + pw_sumsq_fold(f, at + n2, n - n2);
}
#endif

/* k votes folded into one accumulator chunk by chunk: for each chunk of `step` elements of
   [s, e), vote 0 decoded into acc (written when `init`, else added), then votes 1..k-1 added,
   each with its own codes and (coefficient-folded) scales; then, when sums is not NULL,
   sums[chunk] = the pw_sumsq of the chunk of acc. Element by element the same operations in
   the same order as folding the votes one after another over the whole tensor (the same
   bits), with the accumulator's chunk in cache for all k instead of k passes over memory.
   With AVX2, when every vote is int8 or int4 and the block a multiple of FOLD_GROUP, a
   chunk's whole blocks go group by group (fold_blocks: the group in registers for all k),
   their sums read as they are folded (pw_sumsq_fold); else vote by vote (decode_quantized)
   over the chunk, then its sum. acc points at element s. Codes are not checked (the norm
   pass did). */
void fold_votes(int k, const int *kinds, const uint8_t *const *data, const float *const *scales,
                int64_t s, int64_t e, int64_t block, int64_t step, float *acc, int init,
                double *sums) {
#if defined(__AVX2__)
    int fused = k > 0 && block % FOLD_GROUP == 0;
    for (int v = 0; v < k; v++) fused &= kinds[v] == 8 || kinds[v] == 4;
#endif
    for (int64_t c = s, j = 0; c < e; c += step, j++) {
        int64_t ce = c + step < e ? c + step : e;
        float *o = acc + (c - s);
#if defined(__AVX2__)
        if (fused && c % block == 0) {
            /* the tensor's last, partial block first, vote by vote (its elements are folded
               apart from the others either way), then the whole blocks */
            struct fold_chunk f = {k, init, kinds, data, scales, c, block,
                                   (ce - c) / block * block, 0, o};
            if (f.whole < ce - c)
                for (int v = 0; v < k; v++)
                    decode_quantized(kinds[v], data[v], scales[v], c + f.whole, ce, block,
                                     o + f.whole, !(init && v == 0), 0);
            if (sums) /* its last leaf ends at the chunk's end: every block folded */
                sums[j] = pw_sumsq_fold(&f, 0, ce - c);
            else
                fold_to(&f, f.whole);
            continue;
        }
#endif
        for (int v = 0; v < k; v++)
            decode_quantized(kinds[v], data[v], scales[v], c, ce, block, o, !(init && v == 0), 0);
        if (sums) sums[j] = pw_sumsq(o, ce - c);
    }
}

/* fold_votes of [s, e) chunk by chunk into one chunk-sized `scratch` (init: vote 0 written),
   for sums[j] only: the pw_sumsq of each chunk of the accumulator fold_votes would write, the
   same bits, without writing it (fold_outer_encode_sq recomputes it where it is used). */
void fold_sums(int k, const int *kinds, const uint8_t *const *data, const float *const *scales,
               int64_t s, int64_t e, int64_t block, int64_t step, float *scratch,
               double *sums) {
    for (int64_t c = s, j = 0; c < e; c += step, j++) {
        int64_t ce = c + step < e ? c + step : e;
        fold_votes(k, kinds, data, scales, c, ce, block, step, scratch, 1, sums + j);
    }
}

/* The votes folded, the outer step and the broadcast update's encode in one pass
   (training/merge/outer.py with a training/codecs/kernels.Folded delta): stretch by stretch of
   FUSE_SUB elements, the k votes folded into a stretch-sized g in L1 exactly as fold_votes
   folds them into the accumulator (vote 0 written, the others added in order), then block by
   block outer_step with g and, when `kind` is not 0, encode_block (outer_encode_sq's encode);
   sums[j] = the pw_sumsq of chunk j's new params (`step` elements). The accumulator's values
   are recomputed where they are used instead of written to memory and read back: the same
   bits as fold_votes and then outer_encode_sq (or outer_step_sq: `kind` 0), with one pass over
   the fragment's arrays and no fragment-sized accumulator. `s0`: this call's first element in
   the tensor (a chunk start; the votes' codes and scales are the tensor's); p, m, d, sh, data
   and scales point at element s0. Returns n, or the element of a block whose encode refused
   (as outer_encode_sq: its outer step done, later blocks untouched, its chunk's sum not
   taken). */
#define FUSE_SUB 4096 /* elements: g is 16 KiB, within L1 */
int64_t fold_outer_encode_sq(int64_t n, int64_t s0, int k, const int *kinds,
                             const uint8_t *const *vdata, const float *const *vscales,
                             int64_t vblock, float *p, float *m, float *d, const float *factors,
                             int nf, int mode, int nesterov, int flush, float lr, float beta,
                             float inv, int64_t step, double *sums, int kind, float levels,
                             int64_t block, float *sh, uint8_t *data, float *scales) {
    float g[FUSE_SUB];
    int64_t per = kind == 8 ? 1 : (kind == 4 ? 2 : 4);
    for (int64_t s = 0, j = 0; s < n; s += step, j++) {
        int64_t end = s + step < n ? s + step : n;
        for (int64_t t = s; t < end; t += FUSE_SUB) {
            int64_t te = t + FUSE_SUB < end ? t + FUSE_SUB : end;
            fold_votes(k, kinds, vdata, vscales, s0 + t, s0 + te, vblock, FUSE_SUB, g, 1, NULL);
            for (int64_t b = t; b < te; b += block) {
                int64_t len = b + block < te ? block : te - b;
                if (b + PF_AHEAD + block <= n)
                    for (int64_t i = 0; i < block; i += 16) {
                        __builtin_prefetch(p + b + PF_AHEAD + i, 1);
                        if (kind) __builtin_prefetch(sh + b + PF_AHEAD + i, 1);
                        if (m) __builtin_prefetch(m + b + PF_AHEAD + i, 1);
                    }
                outer_step(len, p + b, g + (b - t), m ? m + b : m, d ? d + b : d, factors, nf,
                           mode, nesterov, flush, lr, beta, inv);
                if (kind && encode_block(kind, levels, len, block, p + b, sh + b,
                                         data + b / per, scales + b / block) != 0)
                    return b;
            }
        }
        sums[j] = pw_sumsq(p + s, end - s);
    }
    return n;
}
