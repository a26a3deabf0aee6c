/* ckptfmt's native checks of a manifest's keys (ckptfmt/kernels/keys.py chooses them or Python's, which
 * give the same answers): counts and comparisons over strings msgpack has already decoded; nothing is
 * parsed here.
 *
 *   key_scan(keys, limit)  (index of the first item that is not a str, or -1; how many keys before it
 *                          are empty; index of the first key before it of more than limit bytes of UTF-8,
 *                          a lone surrogate counted as 3 as "surrogatepass" encodes it, or -1).
 *   first_repeat(keys)     index of the first key equal to an earlier one, -1 if none is, or -2 if
 *                          this check cannot tell cheaply (Python's set decides then), for a list of str.
 *
 * first_repeat hashes each key's bytes (a seeded 64-bit hash, a multiply and shift per 8 bytes), sorts
 * the hashes' top 32 bits with their indexes by three radix passes, and compares the keys of equal
 * tags. The passes stream through memory: a hash table of 100,000 keys (Python's set) spends most of its
 * time waiting on a random slot per key. Keys chosen to collide cost no more than they did before: a
 * run of more than 16 equal tags hands the decision to Python's set, whose SipHash is keyed per process.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The UTF-8 length of a str in bytes (a surrogate as 3, as "surrogatepass" encodes it). */
static Py_ssize_t utf8_length(PyObject *text) {
    Py_ssize_t length = PyUnicode_GET_LENGTH(text);
    if (PyUnicode_IS_ASCII(text))
        return length;
    int kind = PyUnicode_KIND(text);
    const void *data = PyUnicode_DATA(text);
    Py_ssize_t bytes = length;
    for (Py_ssize_t i = 0; i < length; i++) {
        Py_UCS4 c = PyUnicode_READ(kind, data, i);
        bytes += (c >= 0x80) + (c >= 0x800) + (c >= 0x10000);
    }
    return bytes;
}

static PyObject *key_scan(PyObject *self, PyObject *args) {
    PyObject *keys;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "O!n", &PyList_Type, &keys, &limit))
        return NULL;
    Py_ssize_t count = PyList_GET_SIZE(keys), empty = 0, over = -1, i = 0;
    for (; i < count; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyUnicode_CheckExact(key))
            break;
#if PY_VERSION_HEX < 0x030C0000
        if (PyUnicode_READY(key) < 0)
            return NULL;
#endif
        /* at most 4 bytes a character: only a long key is measured */
        Py_ssize_t length = PyUnicode_GET_LENGTH(key);
        empty += length == 0;
        if (over < 0 && length > limit / 4 && utf8_length(key) > limit)
            over = i;
    }
    return Py_BuildValue("nnn", i < count ? i : (Py_ssize_t)-1, empty, over);
}

/* ---- first_repeat: the keys' hashes sorted, then equal neighbours compared ---- */

#define DIGIT_BITS 11
#define DIGITS 3 /* the hash's top 32 bits, 11 + 11 + 10 */
#define LONGEST_RUN 16 /* keys of one hash tag compared pairwise; more, and Python's set decides */

static uint64_t seed;

/* A 64-bit hash of a str's canonical representation (PEP 393: equal strs have equal kind and bytes),
 * keyed by the process's seed. Not a defence by itself: a run of equal tags longer than LONGEST_RUN
 * hands the keys to Python's set, so colliding keys cost what they cost before. */
static uint64_t key_hash(PyObject *key) {
    const unsigned char *data = PyUnicode_DATA(key);
    size_t bytes = (size_t)PyUnicode_GET_LENGTH(key) * PyUnicode_KIND(key);
    const uint64_t k = 0x9E3779B97F4A7C15ull;
    uint64_t h = seed ^ (bytes * k), word;
    for (; bytes >= 8; bytes -= 8, data += 8) {
        memcpy(&word, data, 8);
        h = (h ^ word) * k;
        h ^= h >> 29;
    }
    word = 0;
    memcpy(&word, data, bytes);
    h = (h ^ word ^ (uint64_t)PyUnicode_KIND(key)) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    h *= 0x94D049BB133111EBull;
    return h ^ (h >> 32);
}

/* Sorts tag << 32 | index values by their tags, stably (LSD radix: equal tags keep their indexes' order),
 * between values and spare; returns the one the sorted values end in. */
static const uint64_t *sort_by_tag(uint64_t *values, uint64_t *spare, Py_ssize_t count) {
    Py_ssize_t counts[DIGITS][1 << DIGIT_BITS] = {{0}};
    for (Py_ssize_t i = 0; i < count; i++)
        for (int d = 0; d < DIGITS; d++)
            counts[d][(values[i] >> (32 + DIGIT_BITS * d)) & ((1 << DIGIT_BITS) - 1)]++;
    for (int d = 0; d < DIGITS; d++) {
        Py_ssize_t at = 0;
        for (int b = 0; b < (1 << DIGIT_BITS); b++) {
            Py_ssize_t n = counts[d][b];
            counts[d][b] = at;
            at += n;
        }
        for (Py_ssize_t i = 0; i < count; i++)
            spare[counts[d][(values[i] >> (32 + DIGIT_BITS * d)) & ((1 << DIGIT_BITS) - 1)]++] = values[i];
        uint64_t *swap = values;
        values = spare;
        spare = swap;
    }
    return values;
}

/* The first repeat among a run of keys of one tag (indexes ascending), or -1; -2 if the run is too long. */
static Py_ssize_t repeat_in_run(PyObject *keys, const uint64_t *run, Py_ssize_t length) {
    if (length > LONGEST_RUN)
        return -2;
    for (Py_ssize_t j = 1; j < length; j++)
        for (Py_ssize_t i = 0; i < j; i++)
            if (PyUnicode_Compare(PyList_GET_ITEM(keys, (Py_ssize_t)(uint32_t)run[j]),
                                  PyList_GET_ITEM(keys, (Py_ssize_t)(uint32_t)run[i])) == 0)
                return (Py_ssize_t)(uint32_t)run[j];
    return -1;
}

static PyObject *first_repeat(PyObject *self, PyObject *keys) {
    if (!PyList_CheckExact(keys)) {
        PyErr_SetString(PyExc_TypeError, "first_repeat: a list of str");
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(keys), repeat = -1;
    if (count > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "first_repeat: over 2**32 keys");
        return NULL;
    }
    uint64_t *values = PyMem_Malloc(sizeof(uint64_t) * 2 * (size_t)(count ? count : 1));
    if (values == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *key = PyList_GET_ITEM(keys, i);
        if (!PyUnicode_CheckExact(key)) {
            PyErr_Format(PyExc_TypeError, "first_repeat: item %zd is not a str", i);
            PyMem_Free(values);
            return NULL;
        }
#if PY_VERSION_HEX < 0x030C0000
        if (PyUnicode_READY(key) < 0) {
            PyMem_Free(values);
            return NULL;
        }
#endif
        values[i] = (key_hash(key) & 0xFFFFFFFF00000000ull) | (uint64_t)i;
    }
    const uint64_t *sorted = sort_by_tag(values, values + count, count);
    for (Py_ssize_t start = 0, end; start < count; start = end) {
        for (end = start + 1; end < count && (sorted[end] >> 32) == (sorted[start] >> 32); end++)
            ;
        if (end - start == 1)
            continue;
        Py_ssize_t found = repeat_in_run(keys, sorted + start, end - start);
        if (found == -2) {
            repeat = -2;
            break;
        }
        if (found >= 0 && (repeat < 0 || found < repeat))
            repeat = found;
    }
    PyMem_Free(values);
    return PyLong_FromSsize_t(repeat);
}

static PyMethodDef methods[] = {
    {"key_scan", key_scan, METH_VARARGS, "first non-str index, empty keys, first index over the limit"},
    {"first_repeat", first_repeat, METH_O, "index of the first key equal to an earlier one, -1, or -2: undecided"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ckptfmt.kernels.c_keys", NULL, -1, methods};

PyMODINIT_FUNC PyInit_c_keys(void) {
    /* the seed from Python's own str hash, random per process unless PYTHONHASHSEED fixes it */
    PyObject *name = PyUnicode_FromString("ckptfmt.kernels.c_keys");
    if (name == NULL)
        return NULL;
    seed = (uint64_t)PyObject_Hash(name);
    Py_DECREF(name);
    return PyModule_Create(&module);
}
