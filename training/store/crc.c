/* CRC-32C of payloads at two to five times google_crc32c's speed, the same value.

Loaded by training/store/crc.py (compiled on first use with the system C compiler, as the
codecs' loops are: training/store/clib.py); without it, or built for a CPU without SSE4.2,
the store runs google_crc32c.extend, which gives the same value (tests/test_native.py).

The value: CRC-32C (Castagnoli; reflected polynomial 0x82F63B78), the register inverted before
and after, so crc32c_extend(c, A) is google_crc32c.extend(c, A) and
crc32c_extend(crc32c_extend(c, A), B) = crc32c_extend(c, A + B).

Why faster: on buffers past a few hundred KiB google_crc32c runs at about the speed of one
chain of the SSE4.2 crc32 instruction, each step waiting for the last (3 cycles of latency, 1
of throughput): 8 bytes every 3 cycles, 5-7 GB/s (training/store/crc.py, MIN_BYTES).
Here three chains run at once over three adjacent stretches of `block` bytes (A, B, C), 24
bytes every 3 cycles, and are joined after each stretch. Inside, the register s is updated without the inversions
(the raw CRC), which is linear over GF(2): with |X| bytes of X,
    raw(s, X) = s x^(8|X|) mod P  xor  raw(0, X)
(s times x^8 per byte is what feeding a zero byte does; the data's part does not depend on s).
So with s_A = raw(s, A), s_B = raw(0, B), s_C = raw(0, C), each |X| = block bytes,
    raw(s, ABC) = ((s_A x^(8 block) xor s_B) x^(8 block)) xor s_C    (mod P),
the same register one chain over ABC leaves: the same bits, whatever the data. The product by
x^(8 block) mod P is a linear map of 32 bits, so a table of 4 x 256 words (its value on each
byte of the register) applies it in four look-ups; it is built once (crc32c_init, which the
loader calls once, under its lock) from zlib's multmodp and x2nmodp (crc32.c, with P the
Castagnoli polynomial). Two sizes of stretch: 8 KiB (a join, ~20 cycles, is under 1% of the
~3000 cycles of three such stretches; 4 to 32 KiB run within 5% of each other on 512 MiB, where
memory bandwidth bounds it) and 256 bytes for shorter buffers; what is left, under 768 bytes,
runs one chain.
*/

#include <stdint.h>
#include <string.h>
#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

#define POLY 0x82f63b78u /* x^32 + x^28 + ... reflected: bit 31 is x^0 */
#define LONG 8192        /* bytes a chain runs before the three are joined */
#define SHORT 256

static uint32_t byte_table[256];           /* raw CRC of one byte from register 0 */
static uint32_t long_shift[4][256];        /* s -> s x^(8 LONG) mod P, byte by byte of s */
static uint32_t short_shift[4][256];       /* s -> s x^(8 SHORT) mod P */
static volatile int ready = 0;

/* a(x) b(x) mod P (zlib's multmodp: bit 31 is the x^0 coefficient). */
static uint32_t multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = b & 1 ? (b >> 1) ^ POLY : b >> 1;
    }
    return p;
}

/* x^(n 2^k) mod P (zlib's x2nmodp: square-and-multiply over x^(2^j)). */
static uint32_t x2nmodp(int64_t n, unsigned k) {
    uint32_t p = 1u << 31, sq = 1u << 30; /* x^0, and x^1 squared k times below */
    for (unsigned j = 0; j < k; j++) sq = multmodp(sq, sq);
    while (n) {
        if (n & 1) p = multmodp(sq, p);
        n >>= 1;
        sq = multmodp(sq, sq);
    }
    return p;
}

static void shift_table(uint32_t op, uint32_t t[4][256]) {
    for (int k = 0; k < 4; k++)
        for (uint32_t b = 0; b < 256; b++) t[k][b] = multmodp(op, b << (8 * k));
}

/* The tables; idempotent (the same words written again). */
void crc32c_init(void) {
    if (ready) return;
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t s = b;
        for (int i = 0; i < 8; i++) s = s & 1 ? (s >> 1) ^ POLY : s >> 1;
        byte_table[b] = s;
    }
    shift_table(x2nmodp(LONG, 3), long_shift);
    shift_table(x2nmodp(SHORT, 3), short_shift);
    ready = 1;
}

static inline uint32_t shift(uint32_t t[4][256], uint32_t s) {
    return t[0][s & 255] ^ t[1][(s >> 8) & 255] ^ t[2][(s >> 16) & 255] ^ t[3][s >> 24];
}

/* The plain C register update, a byte at a time (any CPU; ~0.5 GB/s). */
static uint32_t raw_portable(uint32_t s, const uint8_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) s = (s >> 8) ^ byte_table[(s ^ p[i]) & 255];
    return s;
}

/* google_crc32c.extend(crc, buf[0, n)) in plain C (tests compare it; the store does not use it:
   google_crc32c is faster where there is no SSE4.2 build). */
uint32_t crc32c_extend_portable(uint32_t crc, const uint8_t *buf, int64_t n) {
    crc32c_init();
    return ~raw_portable(~crc, buf, n);
}

#if defined(__SSE4_2__)
static inline uint64_t word(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8); /* unaligned load */
    return v;
}

/* One chain: bytes up to an 8-byte boundary, then words, then bytes. */
static uint32_t raw_chain(uint32_t s, const uint8_t *p, int64_t n) {
    for (; n > 0 && ((uintptr_t)p & 7); n--) s = _mm_crc32_u8(s, *p++);
    uint64_t w = s;
    for (; n >= 8; n -= 8, p += 8) w = _mm_crc32_u64(w, word(p));
    s = (uint32_t)w;
    for (; n > 0; n--) s = _mm_crc32_u8(s, *p++);
    return s;
}

/* Three chains over stretches of `len` bytes (a multiple of 8) while 3 len bytes are left,
   joined with the table of x^(8 len); advances *p and *n. */
static uint32_t raw_three(uint32_t s, const uint8_t **pp, int64_t *nn, int64_t len,
                          uint32_t t[4][256]) {
    const uint8_t *p = *pp;
    int64_t n = *nn;
    for (; n >= 3 * len; n -= 3 * len, p += 3 * len) {
        uint64_t a = s, b = 0, c = 0;
        for (int64_t i = 0; i < len; i += 8) {
            a = _mm_crc32_u64(a, word(p + i));
            b = _mm_crc32_u64(b, word(p + len + i));
            c = _mm_crc32_u64(c, word(p + 2 * len + i));
        }
        s = shift(t, shift(t, (uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
    }
    *pp = p;
    *nn = n;
    return s;
}

static uint32_t raw_fast(uint32_t s, const uint8_t *p, int64_t n) {
    for (; n > 0 && ((uintptr_t)p & 7); n--) s = _mm_crc32_u8(s, *p++); /* 8-byte aligned */
    s = raw_three(s, &p, &n, LONG, long_shift);
    s = raw_three(s, &p, &n, SHORT, short_shift);
    return raw_chain(s, p, n);
}
#endif

/* google_crc32c.extend(crc, buf[0, n)): three chains where built with SSE4.2, else the plain
   C loop. */
uint32_t crc32c_extend(uint32_t crc, const uint8_t *buf, int64_t n) {
    crc32c_init();
#if defined(__SSE4_2__)
    return ~raw_fast(~crc, buf, n);
#else
    return ~raw_portable(~crc, buf, n);
#endif
}

/* 1 where crc32c_extend runs the crc32 instruction (built with SSE4.2), else 0. */
int crc32c_hardware(void) {
#if defined(__SSE4_2__)
    return 1;
#else
    return 0;
#endif
}
