/* agent/core/_multi_find.h alone, without Python: on buffers made of the given texts, their near misses (a byte
 * changed by one nibble, cut short) and random bytes, every route this CPU has finds the lines a plain search finds
 * (the lines that hold one of the texts wholly inside [from, stop)), with regions that start anywhere and end
 * mid-line, and that end their allocation (built with -fsanitize=address, a read past a region is an error). Run by tests/test_multi_find_native.py, natively and, built for aarch64, under qemu.
 *
 *     multi_find_check TEXTS_FILE SEED ROUNDS      (TEXTS_FILE: one text a line)
 * Prints the routes it ran and "ok", or the first difference; exit 0 when every route agrees. */
#define _GNU_SOURCE 1 /* memmem, memrchr, strndup */
#include <stdio.h>

#include "../../agent/core/_multi_find.h"

#define MAX_TEXTS 64
#define BUF_MAX 20000

static uint64_t rng;

static uint32_t
next(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

/* The line starts a plain search finds: each line of [start, stop) holding a text wholly inside it and the region. */
static int
plain(const unsigned char *buf, ssize_t start, ssize_t stop, unsigned char **texts, ssize_t *lens, int n,
      ssize_t *out)
{
    int found = 0;
    ssize_t ls = start;
    while (ls < stop) {
        const unsigned char *nl = memchr(buf + ls, '\n', (size_t)(stop - ls));
        ssize_t le = nl ? nl - buf : stop;
        for (int k = 0; k < n; k++) {
            if (le - ls >= lens[k] && memmem(buf + ls, (size_t)(le - ls), texts[k], (size_t)lens[k]) != NULL) {
                out[found++] = ls;
                break;
            }
        }
        ls = le + 1;
    }
    return found;
}

static int
routed(const Multi *m, const unsigned char *buf, ssize_t start, ssize_t stop, ssize_t *out)
{
    int found = 0;
    ssize_t from = start;
    while (from < stop) {
        ssize_t t0 = multi_find(m, buf, from, stop);
        if (t0 < 0)
            break;
        const unsigned char *q = t0 > start ? memrchr(buf + start, '\n', (size_t)(t0 - start)) : NULL;
        out[found++] = q ? q - buf + 1 : start;
        const unsigned char *nl = memchr(buf + t0, '\n', (size_t)(stop - t0));
        if (nl == NULL)
            break;
        from = nl - buf + 1;
    }
    return found;
}

int
main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s TEXTS_FILE SEED ROUNDS\n", argv[0]);
        return 2;
    }
    FILE *f = fopen(argv[1], "r");
    if (f == NULL) {
        perror(argv[1]);
        return 2;
    }
    unsigned char *texts[MAX_TEXTS];
    ssize_t lens[MAX_TEXTS];
    int n = 0;
    char line[512];
    while (n < MAX_TEXTS && fgets(line, sizeof line, f) != NULL) {
        size_t len = strcspn(line, "\n");
        if (len < FP)
            continue;
        texts[n] = (unsigned char *)strndup(line, len);
        lens[n++] = (ssize_t)len;
    }
    fclose(f);
    rng = strtoull(argv[2], NULL, 10) * 2654435761u + 1;
    long rounds = strtol(argv[3], NULL, 10);
    int best = multi_init();
    int routes[3], nroutes = 0;
    routes[nroutes++] = MULTI_NONE;
    if (best >= MULTI_VEC16 && MULTI_HAVE_VEC16)
        routes[nroutes++] = MULTI_VEC16;
    if (best >= MULTI_AVX2)
        routes[nroutes++] = MULTI_AVX2;
    printf("routes:");
    for (int r = 0; r < nroutes; r++)
        printf(" %s", routes[r] == MULTI_AVX2 ? "avx2" : routes[r] == MULTI_VEC16 ? "vec16" : "scalar");
    printf("\n");
    static unsigned char buf[BUF_MAX];
    static ssize_t want[BUF_MAX], got[BUF_MAX];
    const char *noise[] = {"\n", "\r\n", " ", "a", "e ", "  ", "NCCL INFO ", "\x00", "\xff", "[rank3]:", "0123"};
    for (long round = 0; round < rounds; round++) {
        ssize_t size = 0, target = (ssize_t)(next() % 4000);
        while (size < target && size < BUF_MAX - 600) {
            uint32_t pick = next() % 10;
            if (pick < 4) {  /* a text, whole */
                int k = (int)(next() % (uint32_t)n);
                memcpy(buf + size, texts[k], (size_t)lens[k]);
                size += lens[k];
            } else if (pick < 7) {  /* a near miss: a byte changed in one nibble, or the text cut short */
                int k = (int)(next() % (uint32_t)n);
                ssize_t len = lens[k] - (ssize_t)(next() % 2);
                memcpy(buf + size, texts[k], (size_t)len);
                buf[size + next() % (uint32_t)len] ^= (unsigned char)((next() % 2 ? 0x10 : 0x01) << (next() % 4));
                size += len;
            } else if (pick < 9) {
                const char *s = noise[next() % (sizeof noise / sizeof noise[0])];
                size_t len = s[0] ? strlen(s) : 1;
                memcpy(buf + size, s, len);
                size += (ssize_t)len;
            } else {
                buf[size++] = (unsigned char)next();
            }
        }
        ssize_t start = size ? (ssize_t)(next() % (uint32_t)(size / 4 + 1)) : 0;
        ssize_t stop = size - (next() % 3 == 0 ? (ssize_t)(next() % 40) : 0);
        if (stop < start)
            stop = start;
        /* the region ends the allocation: a read past `stop` is a read past it (seen under -fsanitize=address) */
        unsigned char *region = malloc(stop ? (size_t)stop : 1);
        if (region == NULL) {
            fprintf(stderr, "out of memory\n");
            return 2;
        }
        memcpy(region, buf, (size_t)stop);
        int nw = plain(region, start, stop, texts, lens, n, want);
        for (int r = 0; r < nroutes; r++) {
            Multi *m = multi_build((const unsigned char *const *)texts, lens, n, region + start, stop - start,
                                   routes[r]);
            if (m == NULL) {
                fprintf(stderr, "out of memory\n");
                return 2;
            }
            int ng = routed(m, region, start, stop, got);
            multi_free(m);
            if (ng != nw || memcmp(want, got, (size_t)nw * sizeof(ssize_t)) != 0) {
                printf("round %ld, route %d, region [%zd, %zd) of %zd bytes: %d lines found, %d wanted\n", round,
                       routes[r], start, stop, size, ng, nw);
                return 1;
            }
        }
        free(region);
    }
    for (int k = 0; k < n; k++)
        free(texts[k]);
    printf("ok %ld rounds\n", rounds);
    return 0;
}
