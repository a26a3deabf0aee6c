/* ckptfmt's native kernels (ckptfmt/kernels/__init__.py chooses them or the numpy fallback, which gives
 * identical results): arithmetic over buffers Python has already validated, nothing parsed here.
 *
 *   float_block(buffer, kind, table)  one pass over float elements (kind d: f64, f: f32, b: bf16; e: 16-bit
 *                                     and t: 8-bit through a table of every bit pattern's float64 value):
 *                                     their binary64 sum and sum of squares in numpy 2's order
 *                                     (np.add.reduce of the float64 values: 0.0 plus their pairwise sum,
 *                                     blocks of at most 128 summed with 8 accumulators), min, max (by <,
 *                                     so either zero of a tie), zeros, and how many zeros are -0.0.
 *   int_block(buffer, kind)           min, max and zeros of integer elements.
 *   split_planes(values, width, out)  byte j of every element rotated left by one bit -> plane j of out.
 *   join_planes(planes, width, out)   the inverse.
 *
 * Built with -ffp-contract=off: a fused multiply-add would round x*x + r once, numpy rounds twice.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PW_BLOCKSIZE 128

/* What the leaves of the pairwise sum see besides the sums: extremes, zeros, negative zeros. */
typedef struct {
    double low, high;
    Py_ssize_t zeros, negative_zeros;
} Seen;

static inline double load_f64(const unsigned char *data, const double *table, Py_ssize_t i) {
    double v;
    (void)table;
    memcpy(&v, data + 8 * i, 8);
    return v;
}

static inline double load_f32(const unsigned char *data, const double *table, Py_ssize_t i) {
    float v;
    (void)table;
    memcpy(&v, data + 4 * i, 4);
    return (double)v;
}

static inline double load_bf16(const unsigned char *data, const double *table, Py_ssize_t i) {
    uint16_t h;
    uint32_t bits;
    float v;
    (void)table;
    memcpy(&h, data + 2 * i, 2);
    bits = (uint32_t)h << 16;
    memcpy(&v, &bits, 4);
    return (double)v;
}

/* fp16 and the 8-bit floats through a table of every bit pattern's value (65536 or 256 float64). */
static inline double load_table16(const unsigned char *data, const double *table, Py_ssize_t i) {
    uint16_t h;
    memcpy(&h, data + 2 * i, 2);
    return table[h];
}

static inline double load_table8(const unsigned char *data, const double *table, Py_ssize_t i) {
    return table[data[i]];
}

/* numpy's pairwise_sum (loops_utils.h.src), of the elements and of their squares at once, seeing every
 * element once in the leaves: lanes j = 0..7 are numpy's 8 accumulators, each with its own extremes and
 * zero counts so that the leaf loop has no branch. */
/* Elements [first, last) added one at a time to s and q, as numpy's pairwise_sum does outside its
 * 8-accumulator blocks. */
#define SCALAR_LOOP(LOAD, first, last)                                                                    \
    for (Py_ssize_t k = (first); k < (last); k++) {                                                       \
        double x = LOAD(data, table, start + k);                                                          \
        s += x;                                                                                           \
        q += x * x;                                                                                       \
        seen->low = x < seen->low ? x : seen->low;                                                        \
        seen->high = x > seen->high ? x : seen->high;                                                     \
        seen->zeros += x == 0.0;                                                                          \
        seen->negative_zeros += (x == 0.0) & (signbit(x) != 0);                                           \
    }

#define DEFINE_PAIRWISE(NAME, LOAD)                                                                       \
    static void NAME(const unsigned char *data, const double *table, Py_ssize_t start, Py_ssize_t n,      \
                     Seen *seen, double *sum, double *squares) {                                          \
        if (n < 8) {                                                                                      \
            double s = 0.0, q = 0.0;                                                                      \
            SCALAR_LOOP(LOAD, 0, n);                                                                      \
            *sum = s;                                                                                     \
            *squares = q;                                                                                 \
        } else if (n <= PW_BLOCKSIZE) {                                                                   \
            double r[8], p[8], lo[8], hi[8];                                                              \
            Py_ssize_t zc[8], nz[8], i;                                                                   \
            for (int j = 0; j < 8; j++) {                                                                 \
                double x = LOAD(data, table, start + j);                                                  \
                r[j] = x;                                                                                 \
                p[j] = x * x;                                                                             \
                lo[j] = x;                                                                                \
                hi[j] = x;                                                                                \
                zc[j] = x == 0.0;                                                                         \
                nz[j] = (x == 0.0) & (signbit(x) != 0);                                                   \
            }                                                                                             \
            for (i = 8; i < n - (n % 8); i += 8) {                                                        \
                for (int j = 0; j < 8; j++) {                                                             \
                    double x = LOAD(data, table, start + i + j);                                          \
                    r[j] += x;                                                                            \
                    p[j] += x * x;                                                                        \
                    lo[j] = x < lo[j] ? x : lo[j];                                                        \
                    hi[j] = x > hi[j] ? x : hi[j];                                                        \
                    zc[j] += x == 0.0;                                                                    \
                    nz[j] += (x == 0.0) & (signbit(x) != 0);                                              \
                }                                                                                         \
            }                                                                                             \
            double s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));                 \
            double q = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));                 \
            for (int j = 0; j < 8; j++) {                                                                 \
                seen->low = lo[j] < seen->low ? lo[j] : seen->low;                                        \
                seen->high = hi[j] > seen->high ? hi[j] : seen->high;                                     \
                seen->zeros += zc[j];                                                                     \
                seen->negative_zeros += nz[j];                                                            \
            }                                                                                             \
            SCALAR_LOOP(LOAD, i, n);                                                                      \
            *sum = s;                                                                                     \
            *squares = q;                                                                                 \
        } else {                                                                                          \
            Py_ssize_t n2 = n / 2;                                                                        \
            double s1, q1, s2, q2;                                                                        \
            n2 -= n2 % 8;                                                                                 \
            NAME(data, table, start, n2, seen, &s1, &q1);                                                 \
            NAME(data, table, start + n2, n - n2, seen, &s2, &q2);                                        \
            *sum = s1 + s2;                                                                               \
            *squares = q1 + q2;                                                                           \
        }                                                                                                 \
    }

DEFINE_PAIRWISE(pairwise_f64, load_f64)
DEFINE_PAIRWISE(pairwise_f32, load_f32)
DEFINE_PAIRWISE(pairwise_bf16, load_bf16)
DEFINE_PAIRWISE(pairwise_table16, load_table16)
DEFINE_PAIRWISE(pairwise_table8, load_table8)

static int item_size(int kind) {
    switch (kind) {
    case 'd': return 8;
    case 'f': return 4;
    case 'e': case 'b': return 2;
    case 't': return 1;
    default: return 0;
    }
}

static PyObject *float_block(PyObject *self, PyObject *args) {
    Py_buffer view, table = {0};
    int kind;
    PyObject *table_object;
    if (!PyArg_ParseTuple(args, "y*CO", &view, &kind, &table_object))
        return NULL;
    int size = item_size(kind);
    PyObject *result = NULL;
    if (size == 0) {
        PyErr_Format(PyExc_ValueError, "unknown float kind %c", kind);
        goto done;
    }
    if (kind == 'e' || kind == 't') {
        Py_ssize_t entries = kind == 'e' ? 65536 : 256;
        if (PyObject_GetBuffer(table_object, &table, PyBUF_SIMPLE) < 0)
            goto done;
        if (table.len != entries * (Py_ssize_t)sizeof(double)) {
            PyErr_Format(PyExc_ValueError, "float kind %c needs a table of %zd float64 values", kind, entries);
            goto done;
        }
    }
    if (view.len % size || view.len == 0) {
        PyErr_SetString(PyExc_ValueError, "a block of whole elements, at least one, is needed");
        goto done;
    }
    Py_ssize_t n = view.len / size;
    Seen seen = {INFINITY, -INFINITY, 0, 0};
    double sum = 0.0, squares = 0.0;
    const unsigned char *data = view.buf;
    const double *values = table.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (kind) {
    case 'd': pairwise_f64(data, values, 0, n, &seen, &sum, &squares); break;
    case 'f': pairwise_f32(data, values, 0, n, &seen, &sum, &squares); break;
    case 'b': pairwise_bf16(data, values, 0, n, &seen, &sum, &squares); break;
    case 'e': pairwise_table16(data, values, 0, n, &seen, &sum, &squares); break;
    default: pairwise_table8(data, values, 0, n, &seen, &sum, &squares); break;
    }
    sum = 0.0 + sum; /* numpy's reduce starts from the identity: a sum of -0.0s is +0.0 */
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(dddd" "nn)", sum, squares, seen.low, seen.high, seen.zeros, seen.negative_zeros);
done:
    PyBuffer_Release(&view);
    if (table.obj != NULL)
        PyBuffer_Release(&table);
    return result;
}

#define INT_SCAN(type, count)                                   \
    do {                                                        \
        const type *values = (const type *)view.buf;            \
        type lo = values[0], hi = values[0];                    \
        for (Py_ssize_t i = 0; i < (count); i++) {              \
            type v = values[i];                                 \
            if (v < lo) lo = v;                                 \
            if (v > hi) hi = v;                                 \
            zeros += (v == 0);                                  \
        }                                                       \
        low = (long long)lo;                                    \
        high = (long long)hi;                                   \
    } while (0)

static PyObject *int_block(PyObject *self, PyObject *args) {
    Py_buffer view;
    int kind;
    if (!PyArg_ParseTuple(args, "y*C", &view, &kind))
        return NULL;
    int size = kind == 'q' ? 8 : kind == 'i' ? 4 : kind == 'h' ? 2 : (kind == 'b' || kind == 'B') ? 1 : 0;
    if (size == 0 || view.len % size || view.len == 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "int_block takes kind q, i, h, b or B and at least one whole element");
        return NULL;
    }
    Py_ssize_t n = view.len / size, zeros = 0;
    long long low = 0, high = 0;
    Py_BEGIN_ALLOW_THREADS
    switch (kind) {
    case 'q': INT_SCAN(int64_t, n); break;
    case 'i': INT_SCAN(int32_t, n); break;
    case 'h': INT_SCAN(int16_t, n); break;
    case 'b': INT_SCAN(int8_t, n); break;
    default: INT_SCAN(uint8_t, n); break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(LLn)", low, high, zeros);
}

static PyObject *split_planes(PyObject *self, PyObject *args) {
    Py_buffer values, out;
    int width;
    if (!PyArg_ParseTuple(args, "y*iw*", &values, &width, &out))
        return NULL;
    PyObject *result = NULL;
    if (!(width == 2 || width == 4 || width == 8) || values.len % width || out.len != values.len) {
        PyErr_SetString(PyExc_ValueError, "split_planes: width 2, 4 or 8, whole elements, out as large as values");
        goto done;
    }
    Py_ssize_t count = values.len / width;
    const unsigned char *src = values.buf;
    unsigned char *dst = out.buf;
    Py_BEGIN_ALLOW_THREADS
    if (width == 2) {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint16_t v;
            memcpy(&v, src + 2 * i, 2);
            v = (uint16_t)((v << 1) | (v >> 15));
            dst[i] = (unsigned char)v;
            dst[count + i] = (unsigned char)(v >> 8);
        }
    } else if (width == 4) {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t v;
            memcpy(&v, src + 4 * i, 4);
            v = (v << 1) | (v >> 31);
            for (int j = 0; j < 4; j++)
                dst[j * count + i] = (unsigned char)(v >> (8 * j));
        }
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint64_t v;
            memcpy(&v, src + 8 * i, 8);
            v = (v << 1) | (v >> 63);
            for (int j = 0; j < 8; j++)
                dst[j * count + i] = (unsigned char)(v >> (8 * j));
        }
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *join_planes(PyObject *self, PyObject *args) {
    PyObject *sequence;
    Py_buffer out;
    int width;
    if (!PyArg_ParseTuple(args, "Oiw*", &sequence, &width, &out))
        return NULL;
    Py_buffer planes[8];
    int taken = 0;
    PyObject *result = NULL;
    Py_ssize_t count = width > 0 ? out.len / width : 0;
    if (!(width == 2 || width == 4 || width == 8) || out.len % width || !PySequence_Check(sequence)
        || PySequence_Size(sequence) != width) {
        PyErr_SetString(PyExc_ValueError, "join_planes: width 2, 4 or 8 planes, out of whole elements");
        goto done;
    }
    for (; taken < width; taken++) {
        PyObject *item = PySequence_GetItem(sequence, taken);
        if (item == NULL)
            goto done;
        int failed = PyObject_GetBuffer(item, &planes[taken], PyBUF_SIMPLE);
        Py_DECREF(item);
        if (failed < 0)
            goto done;
        if (planes[taken].len != count) {
            PyBuffer_Release(&planes[taken]);
            PyErr_SetString(PyExc_ValueError, "join_planes: every plane holds one byte per element");
            goto done;
        }
    }
    unsigned char *dst = out.buf;
    const unsigned char *p[8] = {0};
    for (int j = 0; j < width; j++)
        p[j] = planes[j].buf;
    Py_BEGIN_ALLOW_THREADS
    if (width == 2) { /* each width its own loop: the compiler unrolls and vectorizes a fixed one */
        for (Py_ssize_t i = 0; i < count; i++) {
            uint16_t w = (uint16_t)(p[0][i] | (p[1][i] << 8));
            w = (uint16_t)((w >> 1) | (w << 15));
            memcpy(dst + 2 * i, &w, 2);
        }
    } else if (width == 4) {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t w = (uint32_t)p[0][i] | ((uint32_t)p[1][i] << 8) | ((uint32_t)p[2][i] << 16)
                         | ((uint32_t)p[3][i] << 24);
            w = (w >> 1) | (w << 31);
            memcpy(dst + 4 * i, &w, 4);
        }
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint64_t w = 0;
            for (int j = 0; j < 8; j++)
                w |= (uint64_t)p[j][i] << (8 * j);
            w = (w >> 1) | (w << 63);
            memcpy(dst + 8 * i, &w, 8);
        }
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    for (int j = 0; j < taken; j++)
        PyBuffer_Release(&planes[j]);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"float_block", float_block, METH_VARARGS, "sum, squares, min, max, zeros, negative zeros"},
    {"int_block", int_block, METH_VARARGS, "min, max, zeros"},
    {"split_planes", split_planes, METH_VARARGS, "planes of rotated elements"},
    {"join_planes", join_planes, METH_VARARGS, "elements from their planes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ckptfmt.kernels.c_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit_c_kernels(void) { return PyModule_Create(&module); }
