/* The found lines of a saved kernel log made rows, and the runs of their texts, in C: the steps of Python for each
 * line that remained after the search (agent/core/_line_scan.c), where a log is dense in the lines the checks read
 * (a flood of XIDs). Each function has a Python twin with the same answers, the reference the tests compare it to:
 *
 * - dmesg_rows: agent/node/kernel_scan_lines.py _text_rows for a part in dmesg form (`[ secs.frac] message`), the
 *   rows DMESG_LINES and its loop make. A line is read here only where the pattern surely reads it so: a stamp of
 *   ASCII digits, no host's "kernel: " after it, no byte past ASCII where the pattern's \d or \S would decide. Any
 *   other line is handed back (deferred) for the pattern itself: the answers are the pattern's, always.
 * - text_runs: checks/xid_log.py's Counter and first/last dicts over a batch's messages, in one pass.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int
is_digit(unsigned char c)
{
    return c >= '0' && c <= '9';
}

/* White space as str.isspace and the pattern's \s take it, of the ASCII bytes. */
static int
is_space(unsigned char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

#define SECS_MAX 12 /* DMESG_LINES' \d{1,12} */
#define FRAC_MAX 9  /* and \d{1,9} */
static const char HOST_KERNEL[] = " kernel: ";

/* Where the message of dmesg line s[0:n] starts, the stamp "secs.frac" in s[*stamp_at : *stamp_at + *stamp_len];
 * -1 where DMESG_LINES may read the line otherwise (no stamp of ASCII digits, a host's "kernel: " after it) or where
 * a byte past ASCII would decide it. */
static Py_ssize_t
dmesg_message(const unsigned char *s, Py_ssize_t n, Py_ssize_t *stamp_at, Py_ssize_t *stamp_len)
{
    Py_ssize_t i = 1;
    if (n < 1 || s[0] != '[')
        return -1;
    while (i < n && s[i] == ' ')
        i++;
    Py_ssize_t secs = i;
    while (i < n && is_digit(s[i]))
        i++;
    if (i == secs || i - secs > SECS_MAX || i >= n || s[i] != '.')
        return -1;  /* past 12 digits the pattern has no stamp; a byte past ASCII may be a digit to it */
    Py_ssize_t frac = ++i;
    while (i < n && is_digit(s[i]))
        i++;
    if (i == frac || i - frac > FRAC_MAX || i >= n || s[i] != ']')
        return -1;
    *stamp_at = secs;
    *stamp_len = i - secs;
    i++;
    if (i < n && s[i] == ' ')
        i++;  /* ` ?+`: taken if there */
    /* (?!\S++ kernel: ): a word right here followed by " kernel: " is a journal's host, and the line no dmesg one */
    Py_ssize_t j = i;
    while (j < n && s[j] < 0x80 && !is_space(s[j]))
        j++;
    if (j < n && s[j] >= 0x80)
        return -1;  /* white space or not: the pattern's \S decides, not this */
    if (j > i && n - j >= (Py_ssize_t)(sizeof HOST_KERNEL - 1) && memcmp(s + j, HOST_KERNEL, sizeof HOST_KERNEL - 1) == 0)
        return -1;
    return i;
}

PyDoc_STRVAR(dmesg_rows_doc,
"dmesg_rows(text, numbers, same) -> (messages, stamps, ends, deferred)\n\n"
"The newline-joined dmesg lines `text` (utf-8; `numbers`: a list of one line number a line, checked for its\n"
"length only) read as kernel_scan_lines._text_rows reads a part in dmesg form: each line's message, the one object\n"
"`same` (a dict) holds for its text; the stamps \"secs.frac\" of the lines one after the other in the bytes\n"
"`stamps`, where each line's ends given by `ends` (native int64s, array('q')). A line the pattern may read otherwise\n"
"has None for its message and no stamp, and (its index, its bytes) in deferred.");

static PyObject *
dmesg_rows(PyObject *self, PyObject *args)
{
    Py_buffer view;
    PyObject *numbers, *same;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O!O!", &view, &PyList_Type, &numbers, &PyDict_Type, &same))
        return NULL;
    const unsigned char *s = view.buf;
    Py_ssize_t n = view.len, lines = 1;
    for (const unsigned char *p = s; (p = memchr(p, '\n', (size_t)(s + n - p))) != NULL; p++)
        lines++;
    PyObject *messages = NULL, *stamps = NULL, *ends = NULL, *deferred = NULL, *out = NULL;
    if (PyList_GET_SIZE(numbers) != lines) {
        PyErr_Format(PyExc_ValueError, "%zd numbers for %zd lines", PyList_GET_SIZE(numbers), lines);
        goto done;
    }
    messages = PyList_New(lines);
    /* a stamp is at most 12 + 1 + 9 characters: room for each, cut to size at the end */
    stamps = PyBytes_FromStringAndSize(NULL, lines * (SECS_MAX + 1 + FRAC_MAX));
    ends = PyBytes_FromStringAndSize(NULL, lines * (Py_ssize_t)sizeof(int64_t));
    deferred = PyList_New(0);
    if (messages == NULL || stamps == NULL || ends == NULL || deferred == NULL)
        goto done;
    char *w = PyBytes_AS_STRING(stamps);
    char *end_at = PyBytes_AS_STRING(ends);
    int64_t written = 0;
    Py_ssize_t at = 0;
    for (Py_ssize_t k = 0; k < lines; k++) {
        const unsigned char *nl = memchr(s + at, '\n', (size_t)(n - at));
        Py_ssize_t end = nl ? nl - s : n;
        const unsigned char *line = s + at;
        Py_ssize_t stamp_at = 0, stamp_len = 0;
        Py_ssize_t m = dmesg_message(line, end - at, &stamp_at, &stamp_len);
        PyObject *message;
        if (m < 0) {
            PyObject *pair = Py_BuildValue("(ny#)", k, (const char *)line, end - at);
            if (pair == NULL || PyList_Append(deferred, pair) < 0) {
                Py_XDECREF(pair);
                goto done;
            }
            Py_DECREF(pair);
            Py_INCREF(Py_None);
            message = Py_None;
        } else {
            PyObject *text = PyUnicode_DecodeUTF8((const char *)line + m, end - at - m, "replace");
            if (text == NULL)
                goto done;
            message = PyDict_SetDefault(same, text, text);  /* borrowed */
            Py_XINCREF(message);
            Py_DECREF(text);
            if (message == NULL)
                goto done;
            memcpy(w + written, line + stamp_at, (size_t)stamp_len);
            written += stamp_len;
        }
        memcpy(end_at + k * (Py_ssize_t)sizeof(int64_t), &written, sizeof written);
        PyList_SET_ITEM(messages, k, message);  /* steals */
        at = end + 1;
    }
    if (_PyBytes_Resize(&stamps, (Py_ssize_t)written) < 0)
        goto done;  /* stamps is NULL and freed */
    out = PyTuple_Pack(4, messages, stamps, ends, deferred);
done:
    Py_XDECREF(messages);
    Py_XDECREF(stamps);
    Py_XDECREF(ends);
    Py_XDECREF(deferred);
    PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(text_runs_doc,
"text_runs(texts) -> dict\n\n"
"Each item of the list `texts` (a str, or any hashable) -> (its count, its first index, its last index), in the\n"
"order each first appears.");

static PyObject *
text_runs(PyObject *self, PyObject *texts)
{
    (void)self;
    if (!PyList_Check(texts)) {
        PyErr_SetString(PyExc_TypeError, "text_runs takes a list");
        return NULL;
    }
    /* text -> its slot; the slots' counts and indices in C arrays: an int object only for each distinct text */
    PyObject *slots = PyDict_New(), *runs = NULL;
    Py_ssize_t *at = NULL, nslots = 0, cap = 0;
    if (slots == NULL)
        return NULL;
    /* The list is read by index each step: an item's __eq__ or __hash__ may change it (a str's never does). */
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(texts); i++) {
        PyObject *text = PyList_GET_ITEM(texts, i);
        Py_INCREF(text);
        PyObject *slot = PyDict_GetItemWithError(slots, text);  /* borrowed */
        Py_ssize_t k;
        if (slot != NULL) {
            k = PyLong_AsSsize_t(slot);
        } else if (PyErr_Occurred()) {
            Py_DECREF(text);
            goto done;
        } else {
            if (nslots == cap) {
                cap = cap ? 2 * cap : 64;
                Py_ssize_t *grown = PyMem_Realloc(at, (size_t)cap * 3 * sizeof(Py_ssize_t));
                if (grown == NULL) {
                    PyErr_NoMemory();
                    Py_DECREF(text);
                    goto done;
                }
                at = grown;
            }
            k = nslots++;
            PyObject *number = PyLong_FromSsize_t(k);
            if (number == NULL || PyDict_SetItem(slots, text, number) < 0) {
                Py_XDECREF(number);
                Py_DECREF(text);
                goto done;
            }
            Py_DECREF(number);
            at[3 * k] = 0;
            at[3 * k + 1] = i;
        }
        at[3 * k]++;
        at[3 * k + 2] = i;
        Py_DECREF(text);
    }
    runs = PyDict_New();
    if (runs == NULL)
        goto done;
    PyObject *text, *slot;
    Py_ssize_t pos = 0;
    while (PyDict_Next(slots, &pos, &text, &slot)) {  /* in the order of insertion: each text's first line */
        Py_ssize_t k = PyLong_AsSsize_t(slot);
        PyObject *run = Py_BuildValue("(nnn)", at[3 * k], at[3 * k + 1], at[3 * k + 2]);
        if (run == NULL || PyDict_SetItem(runs, text, run) < 0) {
            Py_XDECREF(run);
            Py_CLEAR(runs);
            goto done;
        }
        Py_DECREF(run);
    }
done:
    Py_DECREF(slots);
    PyMem_Free(at);
    return runs;
}

static PyMethodDef methods[] = {
    {"dmesg_rows", dmesg_rows, METH_VARARGS, dmesg_rows_doc},
    {"text_runs", text_runs, METH_O, text_runs_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_log_rows",
    "The found lines of a saved kernel log made rows, and the runs of their texts, in C.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__log_rows(void)
{
    return PyModule_Create(&module);
}
