/* Many fixed texts looked for in one pass of a byte buffer: a vector filter of each text's rarest-looking three bytes
 * ("Teddy"), for agent/core/_line_scan.c. Plain C with no Python in it, so that tests/native/multi_find_check.c can
 * run it alone, natively and on aarch64 under qemu.
 *
 * Each text is given a window of FP bytes, the one made of the rarest-looking bytes (byte_costs) that a sample of the
 * buffer does not hold, and each window one of BUCKETS bits. A buffer position is a candidate for a bucket where each
 * of its FP bytes has a low and a high nibble that bucket's windows have at that place: two table lookups per place
 * of 16 or 32 bytes a step (a byte shuffle: AVX2's vpshufb on x86_64, NEON's tbl on aarch64, SSSE3's pshufb on an
 * x86_64 without AVX2), a superset of the windows. Each candidate is then checked exactly (a table of bytes per place)
 * and its bucket's texts compared. A text counts where it starts at or after `from` and ends before `stop`.
 *
 * Routes: MULTI_AVX2 (32 bytes a step, x86_64 with AVX2), MULTI_VEC16 (16 bytes a step, GCC's vector extensions:
 * aarch64, or x86_64 with SSSE3), MULTI_NONE (no filter: the caller's own search runs). */
#ifndef GPUWARDEN_MULTI_FIND_H
#define GPUWARDEN_MULTI_FIND_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define MULTI_HAVE_AVX2 1
#else
#define MULTI_HAVE_AVX2 0
#endif
/* __builtin_shuffle with a variable mask is GCC's; clang builds go without this route. */
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__aarch64__))
#define MULTI_HAVE_VEC16 1
#else
#define MULTI_HAVE_VEC16 0
#endif

enum { MULTI_NONE = 0, MULTI_VEC16 = 1, MULTI_AVX2 = 2 };

#define FP 3
#define BUCKETS 8

typedef struct {
    const unsigned char *text;
    ssize_t len;
    ssize_t w;  /* its window's offset */
} MultiText;

typedef struct {
    unsigned char lo[FP][16], hi[FP][16];  /* bucket bits by a byte's low and high nibble, at each place */
    unsigned char exact[FP][256];          /* bucket bits by byte, at each place */
    MultiText *texts;                      /* by bucket: texts[first[b]:first[b + 1]] */
    ssize_t first[BUCKETS + 1];
    int route;
} Multi;

static double byte_costs[256];

/* How common a byte is in a log, roughly (a probability weight): the text of log lines is lower-case words, digits
 * and spaces; upper case is rarer, but NCCL's "NCCL INFO" is on every line of a log at NCCL_DEBUG=INFO. */
static double
byte_cost_of(unsigned char c)
{
    if (c == ' ' || (c >= '0' && c <= '9') || (c && strchr("etaoinsrhldcum", c) != NULL))
        return 10.0;
    if ((c >= 'a' && c <= 'z') || (c && strchr(".:/|-_,=[]NCLIFO", c) != NULL))
        return 6.0;
    if (c >= 'A' && c <= 'Z')
        return 2.0;
    return 1.0;
}

/* The best route this CPU has (the byte costs are set up with it: call once, before any other). */
static int
multi_init(void)
{
    for (int c = 0; c < 256; c++)
        byte_costs[c] = byte_cost_of((unsigned char)c);
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        return MULTI_AVX2;
    if (MULTI_HAVE_VEC16 && __builtin_cpu_supports("ssse3"))
        return MULTI_VEC16;
    return MULTI_NONE;
#elif MULTI_HAVE_VEC16
    return MULTI_VEC16;  /* NEON is part of every aarch64 */
#else
    return MULTI_NONE;
#endif
}

/* Which three-byte windows the buffer's first MULTI_SAMPLE bytes hold, as bits of a hash: a window seen there is
 * common in the rest (a log is much the same all through: NCCL_DEBUG=INFO's "NCCL INFO" on every line), and another
 * window of the text is taken. */
#define MULTI_SAMPLE 4096
#define SEEN_BITS 16

typedef struct {
    uint64_t bits[(1u << SEEN_BITS) / 64];
} Seen;

static inline uint32_t
window_hash(const unsigned char *p)
{
    uint32_t key = (uint32_t)p[0] << 16 | (uint32_t)p[1] << 8 | p[2];
    return (key * 2654435761u) >> (32 - SEEN_BITS);
}

static void
seen_read(Seen *s, const unsigned char *p, ssize_t n)
{
    if (n > MULTI_SAMPLE)
        n = MULTI_SAMPLE;
    memset(s->bits, 0, sizeof s->bits);
    for (ssize_t i = 0; i + FP <= n; i++) {
        uint32_t h = window_hash(p + i);
        s->bits[h / 64] |= (uint64_t)1 << (h % 64);
    }
}

static inline int
seen_holds(const Seen *s, const unsigned char *window)
{
    uint32_t h = window_hash(window);
    return (int)(s->bits[h / 64] >> (h % 64) & 1);
}

/* The likelihood that a random position matches a nibble filter that lets through, at each place k, the bytes whose
 * low nibble is in lo[k] and high nibble in hi[k] (bit masks): the product over the places of their summed cost. */
static double
filter_cost(const uint16_t lo[FP], const uint16_t hi[FP])
{
    double cost = 1.0;
    for (int k = 0; k < FP; k++) {
        double sum = 0.0;
        for (uint32_t h = hi[k]; h; h &= h - 1)
            for (uint32_t l = lo[k]; l; l &= l - 1)
                sum += byte_costs[16 * __builtin_ctz(h) + __builtin_ctz(l)];
        cost *= sum / 256.0;
    }
    return cost;
}

static void
multi_free(Multi *m)
{
    if (m != NULL)
        free(m->texts);
    free(m);
}

/* The filter for n texts (none shorter than FP: the caller checks), chosen with what sample[:sample_len] holds, to
 * run on `route`; NULL on a failed allocation. The texts are borrowed: alive as long as the filter is. */
static Multi *
multi_build(const unsigned char *const *texts, const ssize_t *lens, ssize_t n, const unsigned char *sample,
            ssize_t sample_len, int route)
{
    Multi *m = calloc(1, sizeof(Multi));
    MultiText *all = calloc(n ? (size_t)n : 1, sizeof(MultiText));  /* in the order given; m->texts by bucket */
    int *bucket = calloc(n ? (size_t)n : 1, sizeof(int));
    Seen *seen = malloc(sizeof(Seen));
    if (m != NULL)
        m->texts = calloc(n ? (size_t)n : 1, sizeof(MultiText));
    if (m == NULL || m->texts == NULL || all == NULL || bucket == NULL || seen == NULL) {
        multi_free(m);
        free(all);
        free(bucket);
        free(seen);
        return NULL;
    }
    m->route = route;
    seen_read(seen, sample, sample_len);
    for (ssize_t j = 0; j < n; j++) {
        MultiText *t = &all[j];
        t->text = texts[j];
        t->len = lens[j];
        double best = 0.0;
        for (ssize_t w = 0; w + FP <= t->len; w++) {
            double c = 1.0;
            for (int q = 0; q < FP; q++)
                c *= byte_costs[t->text[w + q]];
            if (seen_holds(seen, t->text + w))
                c *= 1e4;
            if (w == 0 || c < best) {
                best = c;
                t->w = w;
            }
        }
    }
    free(seen);
    /* Each text to the bucket its window widens least (an empty bucket first, while there is one). */
    uint16_t lo[BUCKETS][FP] = {{0}}, hi[BUCKETS][FP] = {{0}};
    int used = 0;
    for (ssize_t j = 0; j < n; j++) {
        const MultiText *t = &all[j];
        int pick = 0;
        if (used < BUCKETS) {
            pick = used++;
        } else {
            double least = 0.0;
            for (int b = 0; b < BUCKETS; b++) {
                uint16_t lo2[FP], hi2[FP];
                for (int k = 0; k < FP; k++) {
                    lo2[k] = (uint16_t)(lo[b][k] | 1u << (t->text[t->w + k] & 15));
                    hi2[k] = (uint16_t)(hi[b][k] | 1u << (t->text[t->w + k] >> 4));
                }
                double grow = filter_cost(lo2, hi2) - filter_cost(lo[b], hi[b]);
                if (b == 0 || grow < least) {
                    least = grow;
                    pick = b;
                }
            }
        }
        bucket[j] = pick;
        for (int k = 0; k < FP; k++) {
            unsigned char c = t->text[t->w + k];
            lo[pick][k] |= (uint16_t)(1u << (c & 15));
            hi[pick][k] |= (uint16_t)(1u << (c >> 4));
            m->lo[k][c & 15] |= (unsigned char)(1u << pick);
            m->hi[k][c >> 4] |= (unsigned char)(1u << pick);
            m->exact[k][c] |= (unsigned char)(1u << pick);
        }
    }
    ssize_t w = 0;
    for (int b = 0; b < BUCKETS; b++) {
        m->first[b] = w;
        for (ssize_t j = 0; j < n; j++)
            if (bucket[j] == b)
                m->texts[w++] = all[j];
    }
    m->first[BUCKETS] = w;
    free(all);
    free(bucket);
    return m;
}

/* A candidate window at q: the start of the first text of its buckets found there, or -1. */
static inline ssize_t
multi_check(const Multi *m, const unsigned char *buf, ssize_t from, ssize_t stop, ssize_t q)
{
    unsigned bits = m->exact[0][buf[q]] & m->exact[1][buf[q + 1]] & m->exact[2][buf[q + 2]];
    while (bits) {
        int b = __builtin_ctz(bits);
        bits &= bits - 1;
        for (ssize_t i = m->first[b]; i < m->first[b + 1]; i++) {
            const MultiText *t = &m->texts[i];
            ssize_t t0 = q - t->w;
            if (t0 >= from && t0 + t->len <= stop && memcmp(buf + t0, t->text, (size_t)t->len) == 0)
                return t0;
        }
    }
    return -1;
}

/* The windows from q on, one at a time (a buffer's last bytes, past the last whole vector step). */
static ssize_t
multi_tail(const Multi *m, const unsigned char *buf, ssize_t from, ssize_t stop, ssize_t q)
{
    for (; q + FP <= stop; q++) {
        ssize_t t0 = multi_check(m, buf, from, stop, q);
        if (t0 >= 0)
            return t0;
    }
    return -1;
}

#if MULTI_HAVE_AVX2
__attribute__((target("avx2")))
static ssize_t
multi_find_avx2(const Multi *m, const unsigned char *buf, ssize_t from, ssize_t stop)
{
    ssize_t q = from;
    const __m256i low = _mm256_set1_epi8(0x0f), zero = _mm256_setzero_si256();
    __m256i lo[FP], hi[FP];
    for (int k = 0; k < FP; k++) {
        lo[k] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)m->lo[k]));
        hi[k] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)m->hi[k]));
    }
    while (q + 32 + FP - 1 <= stop) {
        __m256i hit = _mm256_set1_epi8(-1);
        for (int k = 0; k < FP; k++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(buf + q + k));
            __m256i vl = _mm256_and_si256(v, low), vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            hit = _mm256_and_si256(hit, _mm256_and_si256(_mm256_shuffle_epi8(lo[k], vl),
                                                         _mm256_shuffle_epi8(hi[k], vh)));
        }
        unsigned mask = ~(unsigned)_mm256_movemask_epi8(_mm256_cmpeq_epi8(hit, zero));
        while (mask) {
            ssize_t t0 = multi_check(m, buf, from, stop, q + __builtin_ctz(mask));
            if (t0 >= 0)
                return t0;
            mask &= mask - 1;
        }
        q += 32;
    }
    return multi_tail(m, buf, from, stop, q);
}
#endif

#if MULTI_HAVE_VEC16
typedef unsigned char v16u8 __attribute__((vector_size(16)));

#if defined(__x86_64__)
__attribute__((target("ssse3")))
#endif
static ssize_t
multi_find_vec16(const Multi *m, const unsigned char *buf, ssize_t from, ssize_t stop)
{
    ssize_t q = from;
    v16u8 lo[FP], hi[FP];
    for (int k = 0; k < FP; k++) {
        memcpy(&lo[k], m->lo[k], 16);
        memcpy(&hi[k], m->hi[k], 16);
    }
    while (q + 16 + FP - 1 <= stop) {
        v16u8 hit = lo[0] | (unsigned char)0xff;  /* all ones */
        for (int k = 0; k < FP; k++) {
            v16u8 v;
            memcpy(&v, buf + q + k, 16);
            /* indices below 16: __builtin_shuffle is vpshufb/pshufb or tbl, exact */
            hit &= __builtin_shuffle(lo[k], v & (unsigned char)15) & __builtin_shuffle(hi[k], v >> 4);
        }
        uint64_t half[2];
        memcpy(half, &hit, 16);
        if (half[0] | half[1]) {
            for (int j = 0; j < 16; j++) {
                if (hit[j]) {
                    ssize_t t0 = multi_check(m, buf, from, stop, q + j);
                    if (t0 >= 0)
                        return t0;
                }
            }
        }
        q += 16;
    }
    return multi_tail(m, buf, from, stop, q);
}
#endif

/* The start of the first text at or after `from` that ends before `stop`, or -1. */
static ssize_t
multi_find(const Multi *m, const unsigned char *buf, ssize_t from, ssize_t stop)
{
#if MULTI_HAVE_AVX2
    if (m->route == MULTI_AVX2)
        return multi_find_avx2(m, buf, from, stop);
#endif
#if MULTI_HAVE_VEC16
    if (m->route == MULTI_VEC16)
        return multi_find_vec16(m, buf, from, stop);
#endif
    return multi_tail(m, buf, from, stop, from);
}

#endif
