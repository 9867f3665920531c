/* Lines known by their shape, for the job-log reader (agent/jobs/joblog.py), counted inside the C search
 * (agent/core/_line_scan.c) with no step of Python. Plain C with no Python in it.
 *
 * A job log's lines of interest come in floods: one watchdog or NET/IB warning a collective, from every rank, for as
 * long as the job hangs. The reader keeps a flood's first lines and its last; a line whose every event belongs to a
 * flood already past its first lines adds nothing but, perhaps, that flood's last line. The reader registers such a
 * line here (rep_add) with the digit runs its floods' keys were read from (rank, pid, host, peer, process group); a
 * later line of the same shape whose significant runs hold the same digits is then counted here (rep_count), and
 * only the last of them kept, for the reader to read at the end.
 *
 * A line's shape: its bytes with each digit read as '9' (but the 0 of "0x", a pattern's literal), so two lines of
 * one shape differ only in the values of digit runs of the same lengths. The job-log patterns and the texts the parse
 * looks for read digits only as digits (\d, [0-9a-f]: none holds a digit but the 0 of "0x", or a range that splits
 * them; tests/test_job_repeats.py checks them for it), so lines of one shape take the same way through the parse and
 * give events of the same kinds, whose keys differ only where the runs they were read from do.
 *
 * A line's significant runs are those whose number equals one of its key's numbers or of the runs of its names: a
 * superset of the runs the key was read from, since a rank of 12 in a line stamped 12:05 makes the hour's run one too.
 * A superset only splits one flood's lines between entries, never joins two floods. A shape's significant runs are
 * those of every line registered with it (the intersection, a superset still): the hour that matched one line's
 * rank matches few others. An entry made under runs the shape has since dropped is found no more (its lines are
 * registered again under the fewer runs), and keeps what it counted. */
#ifndef GPUWARDEN_REPEATS_H
#define GPUWARDEN_REPEATS_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define REP_RUNS 64  /* digit runs a registered line may hold (one bit each in a shape's `significant`) */

typedef struct {
    uint64_t hash;          /* of the shape; 0: an empty slot */
    unsigned char *masked;  /* the shape */
    size_t len;
    uint64_t significant;   /* bit k: the line's k-th digit run is significant */
} RepShape;

typedef struct {
    uint64_t hash;          /* of the shape and its significant runs' digits; 0: an empty slot */
    size_t shape;
    uint64_t significant;   /* the shape's significant runs when it was made */
    long long ident;        /* the reader's number for what the registered line meant */
    unsigned char *digits;  /* the significant runs' digits, each run followed by ',' */
    size_t dlen;
    long long count;        /* lines counted */
    long long last;         /* the number of the last of them */
    unsigned char *line;    /* that line (the shape's length) */
} RepEntry;

typedef struct {
    RepShape *shapes;       /* open addressing, `slots` of them, at most `max` used */
    RepEntry *entries;
    size_t slots, max, nshapes, nentries, max_line;
    unsigned char *shape;   /* the shape of the line being looked up (max_line bytes): made once, hashed, compared */
} Repeats;

typedef struct {
    int n;
    size_t at[REP_RUNS], len[REP_RUNS];
} RepRuns;

static inline unsigned char
rep_mask(const unsigned char *p, size_t i, size_t n)
{
    unsigned char c = p[i];
    if (c < '0' || c > '9')
        return c;
    return c == '0' && i + 1 < n && (p[i + 1] == 'x' || p[i + 1] == 'X') ? '0' : '9';
}

static inline uint64_t
rep_mix(uint64_t h, unsigned char c)
{
    return (h ^ c) * 0x100000001b3ULL;  /* FNV-1a */
}

/* The shape eight bytes a step (a found line is 100-300 bytes, and a byte a step was a multiply's latency each: most
 * of the search's time on a log of repeats). Bytes as 8 lanes of a word, each lane's test exact: no carry crosses a
 * lane. */
#define REP_ONES 0x0101010101010101ULL
#define REP_HIGHS 0x8080808080808080ULL

static inline uint64_t
rep_load(const unsigned char *p)
{
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline uint64_t
rep_eq(uint64_t w, unsigned char c)  /* the high bit of each lane that holds c */
{
    uint64_t t = w ^ (REP_ONES * c);
    return ~(((t & ~REP_HIGHS) + ~REP_HIGHS) | t) & REP_HIGHS;
}

static inline uint64_t
rep_digit_lanes(uint64_t w)  /* the high bit of each lane that holds '0'..'9' */
{
    uint64_t t = w ^ (REP_ONES * '0');
    return ~((((t & ~REP_HIGHS) + REP_ONES * 0x76) & REP_HIGHS) | t) & REP_HIGHS;
}

/* The shape of p[i:i+8] as a word (rep_mask of each byte); p[i+8] is read too, so i + 9 <= n. */
static inline uint64_t
rep_masked_word(const unsigned char *p, size_t i)
{
    uint64_t w = rep_load(p + i), d = rep_digit_lanes(w);
    if (d) {
        uint64_t next = rep_load(p + i + 1);
        d &= ~(rep_eq(w, '0') & (rep_eq(next, 'x') | rep_eq(next, 'X')));
        uint64_t lanes = (d >> 7) * 0xFF;
        w = (w & ~lanes) | (lanes & (REP_ONES * '9'));
    }
    return w;
}

/* The shape of p[0:n] into out[0:n], and its hash. */
static uint64_t
rep_shape(const unsigned char *p, size_t n, unsigned char *out)
{
    uint64_t h = 0xcbf29ce484222325ULL ^ n;
    size_t i = 0;
    for (; i + 9 <= n; i += 8) {
        uint64_t w = rep_masked_word(p, i);
        memcpy(out + i, &w, 8);
        h = (h ^ w) * 0x9e3779b97f4a7c15ULL;
        h ^= h >> 29;
    }
    for (; i < n; i++)
        h = rep_mix(h, out[i] = rep_mask(p, i, n));
    return h ? h : 1;
}

/* The digit runs of p[0:n]; -1 where there are more than REP_RUNS. */
static int
rep_runs(const unsigned char *p, size_t n, RepRuns *runs)
{
    runs->n = 0;
    for (size_t i = 0; i < n; i++) {
        while (i + 8 <= n && rep_digit_lanes(rep_load(p + i)) == 0)
            i += 8;  /* most of a line holds no digit */
        if (i >= n)
            break;
        if (p[i] < '0' || p[i] > '9')
            continue;
        if (runs->n == REP_RUNS)
            return -1;
        size_t s = i;
        while (i + 1 < n && p[i + 1] >= '0' && p[i + 1] <= '9')
            i++;
        runs->at[runs->n] = s;
        runs->len[runs->n++] = i + 1 - s;
    }
    return 0;
}

static uint64_t
rep_digits_hash(uint64_t shape_hash, const unsigned char *p, const RepRuns *runs, uint64_t significant)
{
    uint64_t h = shape_hash;
    for (int k = 0; k < runs->n; k++) {
        if (!(significant >> k & 1))
            continue;
        for (size_t i = 0; i < runs->len[k]; i++)
            h = rep_mix(h, p[runs->at[k] + i]);
        h = rep_mix(h, ',');
    }
    return h ? h : 1;
}

/* The slot of the shape masked[0:n] (rep_shape's), or -1. */
static long
rep_find_shape(const Repeats *r, uint64_t hash, const unsigned char *masked, size_t n)
{
    for (size_t s = hash & (r->slots - 1);; s = (s + 1) & (r->slots - 1)) {
        const RepShape *sh = &r->shapes[s];
        if (sh->hash == 0)
            return -1;
        if (sh->hash == hash && sh->len == n && memcmp(sh->masked, masked, n) == 0)
            return (long)s;
    }
}

/* Whether the significant runs of p hold the entry's digits. */
static int
rep_same_digits(const RepEntry *e, const unsigned char *p, const RepRuns *runs, uint64_t significant)
{
    size_t at = 0;
    for (int k = 0; k < runs->n; k++) {
        if (!(significant >> k & 1))
            continue;
        size_t len = runs->len[k];
        if (at + len + 1 > e->dlen || memcmp(e->digits + at, p + runs->at[k], len) != 0 || e->digits[at + len] != ',')
            return 0;
        at += len + 1;
    }
    return at == e->dlen;
}

/* The entry slot of (shape, the line's significant digits): found (*found = 1) or the empty slot it would take. */
static size_t
rep_entry_slot(const Repeats *r, size_t shape, uint64_t hash, const unsigned char *p, const RepRuns *runs,
               int *found)
{
    uint64_t significant = r->shapes[shape].significant;
    for (size_t s = hash & (r->slots - 1);; s = (s + 1) & (r->slots - 1)) {
        const RepEntry *e = &r->entries[s];
        if (e->hash == 0) {
            *found = 0;
            return s;
        }
        if (e->hash == hash && e->shape == shape && e->significant == significant
                && rep_same_digits(e, p, runs, significant)) {
            *found = 1;
            return s;
        }
    }
}

static Repeats *
rep_new(size_t max, size_t max_line)
{
    Repeats *r = calloc(1, sizeof(Repeats));
    if (r == NULL)
        return NULL;
    r->slots = 16;
    while (r->slots < 2 * max)
        r->slots *= 2;
    r->max = max;
    r->max_line = max_line;
    r->shapes = calloc(r->slots, sizeof(RepShape));
    r->entries = calloc(r->slots, sizeof(RepEntry));
    r->shape = malloc(max_line ? max_line : 1);
    if (r->shapes == NULL || r->entries == NULL || r->shape == NULL) {
        free(r->shapes);
        free(r->entries);
        free(r->shape);
        free(r);
        return NULL;
    }
    return r;
}

static void
rep_free(Repeats *r)
{
    if (r == NULL)
        return;
    for (size_t s = 0; s < r->slots; s++) {
        free(r->shapes[s].masked);
        free(r->entries[s].digits);
        free(r->entries[s].line);
    }
    free(r->shapes);
    free(r->entries);
    free(r->shape);
    free(r);
}

/* A line of p[0:n] counted under the number `number` where its shape and significant digits are registered: 1, else
 * 0 (the reader reads it). */
static int
rep_count(Repeats *r, const unsigned char *p, size_t n, long long number)
{
    uint64_t hash;
    RepRuns runs;
    if (r->nentries == 0 || n > r->max_line)
        return 0;
    hash = rep_shape(p, n, r->shape);
    long shape = rep_find_shape(r, hash, r->shape, n);
    if (shape < 0 || rep_runs(p, n, &runs) < 0)
        return 0;
    int found;
    size_t s = rep_entry_slot(r, (size_t)shape, rep_digits_hash(hash, p, &runs, r->shapes[shape].significant), p,
                              &runs, &found);
    if (!found)
        return 0;
    RepEntry *e = &r->entries[s];
    e->count++;
    e->last = number;
    memcpy(e->line, p, n);
    return 1;
}

/* Registers the line p[0:n] under `ident`, its shape's significant runs narrowed to `significant` (those of a new
 * shape): 1 registered, 0 not (there already, too long, too many runs, the table full), -1 out of memory. */
static int
rep_add(Repeats *r, const unsigned char *p, size_t n, uint64_t significant, long long ident)
{
    uint64_t hash;
    RepRuns runs;
    if (n > r->max_line || r->nentries >= r->max || rep_runs(p, n, &runs) < 0)
        return 0;
    hash = rep_shape(p, n, r->shape);
    long shape = rep_find_shape(r, hash, r->shape, n);
    if (shape < 0) {
        size_t s = hash & (r->slots - 1);
        while (r->shapes[s].hash != 0)
            s = (s + 1) & (r->slots - 1);
        unsigned char *masked = malloc(n ? n : 1);
        if (masked == NULL)
            return -1;
        memcpy(masked, r->shape, n);
        RepShape *sh = &r->shapes[s];
        sh->masked = masked;
        sh->len = n;
        sh->significant = runs.n < REP_RUNS ? significant & ((1ULL << runs.n) - 1) : significant;
        sh->hash = hash;
        r->nshapes++;
        shape = (long)s;
    } else {
        r->shapes[shape].significant &= significant;
    }
    uint64_t ehash = rep_digits_hash(hash, p, &runs, r->shapes[shape].significant);
    int found;
    size_t s = rep_entry_slot(r, (size_t)shape, ehash, p, &runs, &found);
    if (found)
        return 0;
    RepEntry *e = &r->entries[s];
    size_t dlen = 0;
    for (int k = 0; k < runs.n; k++)
        if (r->shapes[shape].significant >> k & 1)
            dlen += runs.len[k] + 1;
    e->digits = malloc(dlen ? dlen : 1);
    e->line = malloc(n ? n : 1);
    if (e->digits == NULL || e->line == NULL) {
        free(e->digits);
        free(e->line);
        e->digits = e->line = NULL;
        return -1;
    }
    size_t at = 0;
    for (int k = 0; k < runs.n; k++)
        if (r->shapes[shape].significant >> k & 1) {
            memcpy(e->digits + at, p + runs.at[k], runs.len[k]);
            e->digits[at + runs.len[k]] = ',';
            at += runs.len[k] + 1;
        }
    e->dlen = dlen;
    e->shape = (size_t)shape;
    e->significant = r->shapes[shape].significant;
    e->ident = ident;
    e->count = 0;
    e->last = -1;
    e->hash = ehash;
    r->nentries++;
    return 1;
}

#endif
