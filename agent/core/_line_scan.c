/* The lines of a byte buffer that hold one of a few fixed texts, found in one pass of C: what
 * agent/core/line_search.py does with a step of Python for each line found, for the readers of saved and followed
 * kernel logs and of job logs. The answers are line_search's exactly (tests/test_line_scan_native.py runs both on the
 * same buffers); where this module is not built, line_search's own code runs.
 *
 * Probes are line_search.probes_for's: (probe byte, its offset in each text, the texts). The probe byte is the
 * rarest byte of its texts, found with memchr (vectorised in every libc the agent runs on, x86_64 and aarch64), and
 * the texts compared where it is. Each probe keeps the position of its next hit; the lowest one is the next line
 * found, and a probe whose hit falls inside that line looks on from the line's end: every byte is looked at by each
 * probe once, and the lines come out in order, each once.
 *
 * With more than MULTI_PROBES probes (the job-log reader's 20), one vector pass looks for all the texts at once
 * instead (_multi_find.h: AVX2 on x86_64, NEON on aarch64); the lines found are the same.
 *
 * A text counts only where it lies wholly inside the region, in every route.
 *
 * Newlines are counted sixteen bytes a step (count_newlines).
 *
 * gather may be given a Repeats (_repeats.h): the found lines it knows are counted there and not handed on.
 */
#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE 1 /* memrchr, memmem; the value pyconfig.h gives it */
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    unsigned char byte;
    Py_ssize_t at;         /* offset of the probe byte in each text */
    Py_ssize_t ntexts;
    const char **texts;    /* borrowed from the probes' bytes objects, alive for the call */
    Py_ssize_t *lens;
    Py_ssize_t *text_at;   /* by_text: where each text is next found (-1: nowhere before the region's end; -2: not
                            * looked for yet); the positions only grow, so each text is searched for once a region */
    int by_text;           /* the probe byte turned out common: the texts themselves are searched for (memmem) */
    Py_ssize_t next;       /* position of the next line start found by this probe, or -1: none left */
    Py_ssize_t next_nl;    /* that line's newline */
} Probe;

#include "_multi_find.h"
#include "_repeats.h"

typedef struct {
    Probe *probes;
    Py_ssize_t n;
    Multi *multi;  /* one pass for all the texts, where it is used (multi_build) */
} Probes;

/* Compared byte by byte in blocks of 255 rows of 16 lanes, each lane's count a byte that cannot overflow: a loop
 * the compiler turns into vector compares and adds (SSE2 on x86_64, NEON on aarch64; 16 bytes a step, ~10x the
 * eight-bytes-a-word count this replaced), and exact in plain C wherever it does not. */
#define LANES 16
#define ROWS 255

static Py_ssize_t
count_newlines(const unsigned char *p, Py_ssize_t n)
{
    Py_ssize_t count = 0;
    while (n >= LANES) {
        Py_ssize_t rows = n / LANES < ROWS ? n / LANES : ROWS;
        unsigned char lanes[LANES] = {0};
        for (Py_ssize_t r = 0; r < rows; r++)
            for (int l = 0; l < LANES; l++)
                lanes[l] += p[LANES * r + l] == '\n';
        for (int l = 0; l < LANES; l++)
            count += lanes[l];
        p += LANES * rows;
        n -= LANES * rows;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        count += p[i] == '\n';
    return count;
}

/* The line that holds position `pos` of buf[start:stop]: its start, and its newline (-1: none before stop) in
 * *nl_out. */
static Py_ssize_t
line_at(const unsigned char *buf, Py_ssize_t start, Py_ssize_t pos, Py_ssize_t stop, Py_ssize_t *nl_out)
{
    const unsigned char *nl = memchr(buf + pos, '\n', (size_t)(stop - pos));
    const unsigned char *q = memrchr(buf + start, '\n', (size_t)(pos - start));
    *nl_out = nl ? nl - buf : -1;
    return q ? q - buf + 1 : start;
}

/* The first line start at or after `from` whose line holds one of the probe's texts, the text wholly before `stop`
 * (a region cut mid-line holds only what lies inside it); its newline (before `stop`, else -1) in *nl_out. -1 if
 * none. `start` is the region's first byte (a line starts there). */
#define MISSES_MAX 64

static Py_ssize_t
probe_next(Probe *pr, const unsigned char *buf, Py_ssize_t start, Py_ssize_t from, Py_ssize_t stop,
           Py_ssize_t *nl_out)
{
    Py_ssize_t i = from + pr->at, misses = 0;
    while (i < stop && !pr->by_text) {
        const unsigned char *hit = memchr(buf + i, pr->byte, (size_t)(stop - i));
        if (hit == NULL)
            return -1;
        i = hit - buf;
        Py_ssize_t t0 = i - pr->at;
        for (Py_ssize_t k = 0; k < pr->ntexts; k++) {
            if (t0 + pr->lens[k] <= stop && memcmp(buf + t0, pr->texts[k], (size_t)pr->lens[k]) == 0)
                return line_at(buf, start, i, stop, nl_out);  /* a text holds no newline: its line is the byte's */
        }
        /* A byte common in the text around (a lower-case letter in a job log) is a call for each few bytes: past
         * MISSES_MAX misses in a row the texts themselves are searched for, here and in the rest of the region. */
        if (++misses > MISSES_MAX)
            pr->by_text = 1;
        i++;
    }
    if (!pr->by_text)
        return -1;
    /* The earliest text at or after i - at (no hit before it held one), and its line. A text found past `from_text`
     * before is still the next one: only a text found before `from_text` (or never looked for) is searched again. */
    Py_ssize_t from_text = i - pr->at < from ? from : i - pr->at, best = -1;
    for (Py_ssize_t k = 0; k < pr->ntexts; k++) {
        Py_ssize_t t = pr->text_at[k];
        if (t != -1 && t < from_text) {
            const unsigned char *found = stop - from_text < pr->lens[k] ? NULL
                : memmem(buf + from_text, (size_t)(stop - from_text), pr->texts[k], (size_t)pr->lens[k]);
            t = found != NULL ? found - buf : -1;
            pr->text_at[k] = t;
        }
        if (t >= 0 && (best < 0 || t < best))
            best = t;
    }
    return best < 0 ? -1 : line_at(buf, start, best, stop, nl_out);
}

/* ---- Many texts in one pass (_multi_find.h) ---------------------------------------------------------------------
 * With more than MULTI_PROBES probes, a memchr pass each costs more than one pass that looks for all texts at once
 * (the job-log reader's 20 probes, nine of them bytes common in a job log: 0.35 s of a 157 MB log, against 0.02 s). */
#define MULTI_PROBES 4

static int multi_best;  /* the best route this CPU has (multi_init) */

static void
probes_free(Probes *ps)
{
    if (ps->probes) {
        for (Py_ssize_t i = 0; i < ps->n; i++) {
            PyMem_Free(ps->probes[i].texts);
            PyMem_Free(ps->probes[i].lens);
            PyMem_Free(ps->probes[i].text_at);
        }
        PyMem_Free(ps->probes);
    }
    ps->probes = NULL;
    multi_free(ps->multi);
    ps->multi = NULL;
}

static int probes_parse(PyObject *seq, Probes *ps);

/* Reads probes_for's list; 0 on success, -1 with an exception set. `multi`: 0 the probes' own passes, 1 the best
 * one-pass route there is, 2 the 16-byte route (tests); the one-pass filter is built for buf[start:stop], from what
 * its start holds, where there are more than MULTI_PROBES probes and no text is shorter than FP. */
static int
probes_read(PyObject *seq, Probes *ps, int multi, const unsigned char *buf, Py_ssize_t start, Py_ssize_t stop)
{
    int route = multi == 1 ? multi_best : multi == 2 ? MULTI_VEC16 : MULTI_NONE;
    if (multi == 2 && (!MULTI_HAVE_VEC16 || multi_best < MULTI_VEC16)) {
        PyErr_SetString(PyExc_ValueError, "this CPU or build has no 16-byte route");
        return -1;
    }
    if (probes_parse(seq, ps) < 0)
        return -1;
    if (route == MULTI_NONE || ps->n <= MULTI_PROBES || start >= stop)
        return 0;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < ps->n; i++)
        for (Py_ssize_t k = 0; k < ps->probes[i].ntexts; k++) {
            if (ps->probes[i].lens[k] < FP)
                return 0;
            n++;
        }
    const unsigned char **texts = PyMem_Calloc((size_t)n, sizeof(char *));
    Py_ssize_t *lens = PyMem_Calloc((size_t)n, sizeof(Py_ssize_t));
    if (texts != NULL && lens != NULL) {
        Py_ssize_t j = 0;
        for (Py_ssize_t i = 0; i < ps->n; i++)
            for (Py_ssize_t k = 0; k < ps->probes[i].ntexts; k++, j++) {
                texts[j] = (const unsigned char *)ps->probes[i].texts[k];
                lens[j] = ps->probes[i].lens[k];
            }
        ps->multi = multi_build(texts, lens, n, buf + start, stop - start, route);
    }
    PyMem_Free(texts);
    PyMem_Free(lens);
    if (ps->multi == NULL) {
        probes_free(ps);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static int
probes_parse(PyObject *seq, Probes *ps)
{
    ps->probes = NULL;
    ps->n = 0;
    ps->multi = NULL;
    PyObject *fast = PySequence_Fast(seq, "probes must be a sequence");
    if (fast == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    ps->probes = PyMem_Calloc(n ? (size_t)n : 1, sizeof(Probe));
    if (ps->probes == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        PyObject *byte, *texts;
        Py_ssize_t at;
        if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "SnO!", &byte, &at, &PyTuple_Type, &texts)) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "a probe is (bytes, int, tuple of bytes)");
            goto fail;
        }
        Probe *pr = &ps->probes[i];
        ps->n = i + 1;
        if (PyBytes_GET_SIZE(byte) != 1 || at < 0) {
            PyErr_SetString(PyExc_ValueError, "a probe's byte is one byte, at an offset of 0 or more");
            goto fail;
        }
        pr->byte = (unsigned char)PyBytes_AS_STRING(byte)[0];
        pr->at = at;
        pr->ntexts = PyTuple_GET_SIZE(texts);
        pr->texts = PyMem_Calloc(pr->ntexts ? (size_t)pr->ntexts : 1, sizeof(char *));
        pr->lens = PyMem_Calloc(pr->ntexts ? (size_t)pr->ntexts : 1, sizeof(Py_ssize_t));
        pr->text_at = PyMem_Calloc(pr->ntexts ? (size_t)pr->ntexts : 1, sizeof(Py_ssize_t));
        if (pr->texts == NULL || pr->lens == NULL || pr->text_at == NULL) {
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t k = 0; k < pr->ntexts; k++) {
            PyObject *text = PyTuple_GET_ITEM(texts, k);
            if (!PyBytes_Check(text) || PyBytes_GET_SIZE(text) <= at
                    || (unsigned char)PyBytes_AS_STRING(text)[at] != pr->byte
                    || memchr(PyBytes_AS_STRING(text), '\n', (size_t)PyBytes_GET_SIZE(text)) != NULL) {
                PyErr_SetString(PyExc_ValueError, "a probe's text holds its byte at its offset, and no newline");
                goto fail;
            }
            pr->texts[k] = PyBytes_AS_STRING(text);
            pr->lens[k] = PyBytes_GET_SIZE(text);
            pr->text_at[k] = -2;
        }
    }
    Py_DECREF(fast);  /* the texts stay alive: the caller's probes hold them */
    return 0;
fail:
    Py_DECREF(fast);
    probes_free(ps);
    return -1;
}

/* The found lines of buf[start:stop] in order, each as (line start, its newline): calls `each` for every one;
 * returns -1 if `each` failed. The texts are compared only where they fit inside the region. */
typedef int (*each_line)(void *ctx, Py_ssize_t ls, Py_ssize_t le);

static int
scan(const unsigned char *buf, Py_ssize_t size, Py_ssize_t start, Py_ssize_t stop, Probes *ps, each_line each,
     void *ctx)
{
    if (start < 0)
        start = 0;
    if (stop > size)
        stop = size;
    if (start >= stop)
        return 0;
    if (ps->multi != NULL) {
        for (Py_ssize_t from = start; from < stop;) {
            Py_ssize_t t0 = multi_find(ps->multi, buf, from, stop), nl;
            if (t0 < 0)
                return 0;
            Py_ssize_t ls = line_at(buf, start, t0, stop, &nl);
            if (each(ctx, ls, nl) < 0)
                return -1;
            if (nl < 0)
                return 0;
            from = nl + 1;
        }
        return 0;
    }
    for (Py_ssize_t i = 0; i < ps->n; i++) {
        Probe *pr = &ps->probes[i];
        pr->next = pr->ntexts ? probe_next(pr, buf, start, start, stop, &pr->next_nl) : -1;
    }
    for (;;) {
        Py_ssize_t best = -1, nl = -1;
        for (Py_ssize_t i = 0; i < ps->n; i++) {
            Probe *pr = &ps->probes[i];
            if (pr->next >= 0 && (best < 0 || pr->next < best)) {
                best = pr->next;
                nl = pr->next_nl;
            }
        }
        if (best < 0)
            return 0;
        if (each(ctx, best, nl) < 0)
            return -1;
        if (nl < 0)
            return 0;  /* the region's last line had no newline: nothing after it */
        for (Py_ssize_t i = 0; i < ps->n; i++) {
            Probe *pr = &ps->probes[i];
            if (pr->next >= 0 && pr->next <= nl)
                pr->next = probe_next(pr, buf, start, nl + 1, stop, &pr->next_nl);
        }
    }
}

static int
append_span(void *ctx, Py_ssize_t ls, Py_ssize_t le)
{
    PyObject *pair = Py_BuildValue("(nn)", ls, le);
    if (pair == NULL)
        return -1;
    int rc = PyList_Append((PyObject *)ctx, pair);
    Py_DECREF(pair);
    return rc;
}

PyDoc_STRVAR(lines_holding_doc,
"lines_holding(buf, start, stop, probes, multi=1) -> list of (start, end)\n\n"
"line_search.lines_holding's answer: each line of buf[start:stop] that holds one of the probes' texts, in order;\n"
"end is the offset of the line's newline. multi: 1 the one pass for all the texts where it is used (more than\n"
"four probes), 0 the probes' own passes, 2 the one pass on its 16-byte route (the same lines; for the tests).");

static PyObject *
lines_holding(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t start, stop;
    PyObject *probes;
    int multi = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnO|i", &view, &start, &stop, &probes, &multi))
        return NULL;
    Probes ps;
    if (probes_read(probes, &ps, multi, view.buf, start < 0 ? 0 : start, stop > view.len ? view.len : stop) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out != NULL && scan(view.buf, view.len, start, stop, &ps, append_span, out) < 0)
        Py_CLEAR(out);
    probes_free(&ps);
    PyBuffer_Release(&view);
    return out;
}

typedef struct {
    const unsigned char *buf;
    Py_ssize_t at;        /* newlines are counted up to here */
    Py_ssize_t lines;     /* newlines before `at` (with the caller's base) */
    /* the found lines handed on, CR of a CRLF end taken off: (start, length, number, found lines before it) each,
     * made Python objects at the end */
    Py_ssize_t *spans;
    Py_ssize_t nspans, cap;
    Py_ssize_t bytes;
    Repeats *repeats;     /* the lines it knows are counted there, not handed on; or NULL */
    Py_ssize_t found;     /* lines found, those counted in `repeats` with them */
} Gather;

#define SPAN 4

/* No Python object is touched here: the scan runs with the GIL released (the process's other threads, the daemon's,
 * run meanwhile). */
static int
gather_span(void *ctx, Py_ssize_t ls, Py_ssize_t le)
{
    Gather *g = ctx;
    g->lines += count_newlines(g->buf + g->at, ls - g->at);
    g->at = ls;
    Py_ssize_t end = le;
    if (end > ls && g->buf[end - 1] == '\r')
        end--;
    g->found++;
    if (g->repeats != NULL && rep_count(g->repeats, g->buf + ls, (size_t)(end - ls), g->lines + 1))
        return 0;
    if (g->nspans == g->cap) {
        Py_ssize_t cap = g->cap ? 2 * g->cap : 256;
        Py_ssize_t *spans = PyMem_RawRealloc(g->spans, (size_t)cap * SPAN * sizeof(Py_ssize_t));
        if (spans == NULL)
            return -1;
        g->spans = spans;
        g->cap = cap;
    }
    Py_ssize_t *span = g->spans + SPAN * g->nspans;
    span[0] = ls;
    span[1] = end - ls;
    span[2] = g->lines + 1;
    span[3] = g->found - 1;
    g->nspans++;
    g->bytes += end - ls;
    return 0;
}

/* ---- Lines known by their shape (_repeats.h), for gather --------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    Repeats *table;
    int busy;  /* a gather is counting into it, with the GIL released: it is not changed meanwhile */
} RepeatsObject;

static void
repeats_dealloc(RepeatsObject *self)
{
    rep_free(self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
repeats_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Py_ssize_t max, max_line;
    static char *kwlist[] = {"max_lines", "max_line", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "nn", kwlist, &max, &max_line))
        return NULL;
    if (max < 0 || max > (1 << 20) || max_line < 0) {
        PyErr_SetString(PyExc_ValueError, "max_lines is 0 to 2**20, max_line 0 or more");
        return NULL;
    }
    RepeatsObject *self = (RepeatsObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->table = rep_new((size_t)max, (size_t)max_line);
    if (self->table == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

PyDoc_STRVAR(repeats_add_doc,
"add(line, significant, ident) -> bool\n\n"
"Registers `line` (bytes, no newline) under `ident`: later found lines of its shape whose significant digit runs\n"
"hold its digits are counted, not handed on. significant: bit k for the line's k-th run of digits, used where its\n"
"shape is new (a shape keeps its first). False where it was not registered: there already, longer than max_line,\n"
"more than 64 runs of digits, or max_lines registered.");

static PyObject *
repeats_add(RepeatsObject *self, PyObject *args)
{
    Py_buffer line;
    unsigned long long significant;
    long long ident;
    if (!PyArg_ParseTuple(args, "y*KL", &line, &significant, &ident))
        return NULL;
    if (self->busy) {
        PyBuffer_Release(&line);
        PyErr_SetString(PyExc_RuntimeError, "a gather is counting into this Repeats");
        return NULL;
    }
    int rc = rep_add(self->table, line.buf, (size_t)line.len, significant, ident);
    PyBuffer_Release(&line);
    if (rc < 0)
        return PyErr_NoMemory();
    return PyBool_FromLong(rc);
}

PyDoc_STRVAR(repeats_hits_doc,
"hits() -> list of (ident, count, number, line)\n\n"
"Each registered line whose shape counted lines: how many, and the number and bytes of the last.");

static PyObject *
repeats_hits(RepeatsObject *self, PyObject *unused)
{
    (void)unused;
    PyObject *out = PyList_New(0);
    for (size_t s = 0; out != NULL && s < self->table->slots; s++) {
        RepEntry *e = &self->table->entries[s];
        if (e->hash == 0 || e->count == 0)
            continue;
        PyObject *hit = Py_BuildValue("(LLLy#)", e->ident, e->count, e->last, (const char *)e->line,
                                      (Py_ssize_t)self->table->shapes[e->shape].len);
        if (hit == NULL || PyList_Append(out, hit) < 0)
            Py_CLEAR(out);
        Py_XDECREF(hit);
    }
    return out;
}

static PyObject *
repeats_len(RepeatsObject *self, PyObject *unused)
{
    (void)unused;
    return PyLong_FromSize_t(self->table->nentries);
}

static PyMethodDef repeats_methods[] = {
    {"add", (PyCFunction)repeats_add, METH_VARARGS, repeats_add_doc},
    {"hits", (PyCFunction)repeats_hits, METH_NOARGS, repeats_hits_doc},
    {"registered", (PyCFunction)repeats_len, METH_NOARGS, "registered() -> the lines registered"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RepeatsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuwarden.agent.core._line_scan.Repeats",
    .tp_basicsize = sizeof(RepeatsObject),
    .tp_dealloc = (destructor)repeats_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("Repeats(max_lines, max_line): lines known by their shape, counted by gather (_repeats.h)."),
    .tp_methods = repeats_methods,
    .tp_new = repeats_new,
};

PyDoc_STRVAR(gather_doc,
"gather(buf, start, stop, probes, base, multi=1, repeats=None) -> (joined, numbers, newlines)\n\n"
"The found lines of buf[start:stop] (complete lines: stop just past a newline) joined by newlines, the CR of a\n"
"CRLF end taken off each; the line number of each (base + the newlines before it + 1); the newlines in the\n"
"region. multi: as for lines_holding. The search runs with the GIL released.\n"
"With repeats (a Repeats): the found lines it knows are counted there, not joined, and the answer is\n"
"(joined, numbers, newlines, befores, found): befores the found lines before each line joined, found all of them.");

static PyObject *
gather(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t start, stop, base;
    PyObject *probes, *repeats = Py_None;
    int multi = 1;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnOn|iO", &view, &start, &stop, &probes, &base, &multi, &repeats))
        return NULL;
    if (repeats != Py_None && !PyObject_TypeCheck(repeats, &RepeatsType)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "repeats is a Repeats or None");
        return NULL;
    }
    RepeatsObject *rep = repeats == Py_None ? NULL : (RepeatsObject *)repeats;
    if (start < 0 || stop > view.len || start > stop) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "start and stop lie inside the buffer, start first");
        return NULL;
    }
    if (rep != NULL && rep->busy) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_RuntimeError, "a gather is counting into this Repeats");
        return NULL;
    }
    Probes ps;
    if (probes_read(probes, &ps, multi, view.buf, start, stop) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    Gather g = {view.buf, start, base, NULL, 0, 0, 0, rep != NULL ? rep->table : NULL, 0};
    PyObject *joined = NULL, *numbers = NULL, *befores = NULL, *out = NULL;
    int rc;
    Py_ssize_t newlines;
    if (rep != NULL)
        rep->busy = 1;  /* held by `repeats`, which the caller holds for the call */
    /* The buffer cannot be resized or freed while it is exported (view); the probes' texts are held by `probes`. */
    Py_BEGIN_ALLOW_THREADS
    rc = scan(view.buf, view.len, start, stop, &ps, gather_span, &g);
    newlines = g.lines - base + count_newlines((const unsigned char *)view.buf + g.at, stop - g.at);
    Py_END_ALLOW_THREADS
    if (rep != NULL)
        rep->busy = 0;
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t size = g.bytes + (g.nspans ? g.nspans - 1 : 0);
    joined = PyBytes_FromStringAndSize(NULL, size);
    numbers = PyList_New(g.nspans);
    befores = rep != NULL ? PyList_New(g.nspans) : NULL;
    if (joined == NULL || numbers == NULL || (rep != NULL && befores == NULL))
        goto done;
    char *w = PyBytes_AS_STRING(joined);
    for (Py_ssize_t i = 0; i < g.nspans; i++) {
        const Py_ssize_t *span = g.spans + SPAN * i;
        if (i)
            *w++ = '\n';
        memcpy(w, (const char *)view.buf + span[0], (size_t)span[1]);
        w += span[1];
        PyObject *number = PyLong_FromSsize_t(span[2]);
        if (number == NULL)
            goto done;
        PyList_SET_ITEM(numbers, i, number);
        if (befores != NULL) {
            PyObject *before = PyLong_FromSsize_t(span[3]);
            if (before == NULL)
                goto done;
            PyList_SET_ITEM(befores, i, before);
        }
    }
    if (rep != NULL) {
        out = Py_BuildValue("(NNnNn)", joined, numbers, newlines, befores, g.found);
        befores = NULL;
    } else {
        out = Py_BuildValue("(NNn)", joined, numbers, newlines);
    }
    joined = numbers = NULL;
done:
    Py_XDECREF(joined);
    Py_XDECREF(numbers);
    Py_XDECREF(befores);
    PyMem_RawFree(g.spans);
    probes_free(&ps);
    PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(count_doc, "count_newlines(buf, start, stop) -> the newlines in buf[start:stop]");

static PyObject *
count(PyObject *self, PyObject *args)
{
    Py_buffer view;
    Py_ssize_t start, stop;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nn", &view, &start, &stop))
        return NULL;
    if (start < 0)
        start = 0;
    if (stop > view.len)
        stop = view.len;
    Py_ssize_t n = start < stop ? count_newlines((const unsigned char *)view.buf + start, stop - start) : 0;
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"lines_holding", lines_holding, METH_VARARGS, lines_holding_doc},
    {"gather", gather, METH_VARARGS, gather_doc},
    {"count_newlines", count, METH_VARARGS, count_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_line_scan",
    "line_search's search in C: the lines of a buffer that hold one of a few texts, found in one pass.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__line_scan(void)
{
    multi_best = multi_init();
    if (PyType_Ready(&RepeatsType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    static const char *names[] = {"none", "vec16", "avx2"};
    if (m != NULL && PyModule_AddStringConstant(m, "MULTI_ROUTE", names[multi_best]) < 0)
        Py_CLEAR(m);
    if (m != NULL) {
        Py_INCREF(&RepeatsType);
        if (PyModule_AddObject(m, "Repeats", (PyObject *)&RepeatsType) < 0) {
            Py_DECREF(&RepeatsType);
            Py_CLEAR(m);
        }
    }
    return m;
}
