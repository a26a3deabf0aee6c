/* ckptfmt's native kernels (ckptfmt/kernels/__init__.py chooses them or the numpy fallback, which gives
 * identical results): arithmetic over buffers Python has already validated, nothing parsed here.
 *
 *   float_block(buffer, kind, table)  float elements (kind d: f64, f: f32, b: bf16, e: IEEE half; e, and
 *                                     t, 8-bit, through a table of every bit pattern's float64 value where
 *                                     the CPU has no conversion): their binary64 sum and sum of squares in
 *                                     the lanes' order (below), min, max (by <, so either zero of a tie),
 *                                     zeros, and how many zeros are -0.0.
 *   int_block(buffer, kind)           min, max and zeros of integer elements.
 *   split_planes(values, width, out)  byte j of every element rotated left by one bit -> plane j of out.
 *   join_planes(planes, width, out)   the inverse.
 *   vectors([name])                   the vector loops in use ("avx2" or "base"), or chooses them.
 *
 * The lanes' order, which numpy_kernels.py computes too: element i is added to lane i mod 64, each lane a
 * sequential binary64 sum from +0.0; the lanes are then folded in halves (lane k += lane k + h, for h = 32,
 * 16, ..., 1) and the sum is +0.0 + lane 0. Every lane is sequential, so the compiler may vectorize the
 * loop without reassociating a sum; numpy's add.reduce over the first axis of a (rows, 64) array adds row
 * after row. Built with -ffp-contract=off: a fused multiply-add would round x*x + r once, numpy twice.
 * A 1 MiB block takes 50-60 us in float64 or float32, 140-170 us in fp16 or bf16 (twice the elements)
 * with AVX2 on the 2-core EPYC VM of docs/performance.md.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 64
/* Rows of LANES elements taken at a time, summed and then scanned for extremes and zeros while they are
 * in the L1 cache (16 KiB of float32). */
#define ROWS 64

typedef struct {
    double sums[LANES], squares[LANES];
    double low, high;
    Py_ssize_t zeros, negative_zeros;
} Block;

/* A TYPE (a scalar or a vector) from element i on, elements of SIZE bytes (memcpy: no alignment needed). */
#define DEFINE_LOAD(NAME, TYPE, SIZE)                                                                     \
    static inline TYPE NAME(const unsigned char *data, Py_ssize_t i) {                                    \
        TYPE v;                                                                                           \
        memcpy(&v, data + (SIZE) * i, sizeof v);                                                          \
        return v;                                                                                         \
    }

/* ---- Scalar loops: the table kinds (a lookup per element) and the last partial row of every kind ---- */

/* Element i as float64 (the sums), as its own type (the extremes), and whether it is a zero or -0.0. */
static inline double f64_at(const unsigned char *data, const double *table, Py_ssize_t i) {
    double v;
    (void)table;
    memcpy(&v, data + 8 * i, 8);
    return v;
}
DEFINE_LOAD(f64_bits, uint64_t, 8)
static inline int f64_zero(const unsigned char *data, const double *table, Py_ssize_t i) {
    (void)table;
    return (f64_bits(data, i) << 1) == 0;
}
static inline int f64_negative_zero(const unsigned char *data, const double *table, Py_ssize_t i) {
    (void)table;
    return f64_bits(data, i) == UINT64_C(0x8000000000000000);
}

static inline float f32_value(const unsigned char *data, const double *table, Py_ssize_t i) {
    float v;
    (void)table;
    memcpy(&v, data + 4 * i, 4);
    return v;
}
static inline double f32_at(const unsigned char *data, const double *table, Py_ssize_t i) {
    return (double)f32_value(data, table, i);
}
DEFINE_LOAD(f32_bits, uint32_t, 4)
static inline int f32_zero(const unsigned char *data, const double *table, Py_ssize_t i) {
    (void)table;
    return (uint32_t)(f32_bits(data, i) << 1) == 0;
}
static inline int f32_negative_zero(const unsigned char *data, const double *table, Py_ssize_t i) {
    (void)table;
    return f32_bits(data, i) == UINT32_C(0x80000000);
}

DEFINE_LOAD(u16_at, uint16_t, 2)
static inline float bf16_value(const unsigned char *data, const double *table, Py_ssize_t i) {
    uint32_t bits = (uint32_t)u16_at(data, i) << 16;
    float v;
    (void)table;
    memcpy(&v, &bits, 4);
    return v;
}
static inline double bf16_at(const unsigned char *data, const double *table, Py_ssize_t i) {
    return (double)bf16_value(data, table, i);
}
static inline int bf16_zero(const unsigned char *data, const double *table, Py_ssize_t i) {
    (void)table;
    return (u16_at(data, i) & 0x7fff) == 0;
}
static inline int bf16_negative_zero(const unsigned char *data, const double *table, Py_ssize_t i) {
    (void)table;
    return u16_at(data, i) == 0x8000;
}

/* fp16 and the 8-bit floats through a table of every bit pattern's value (65536 or 256 float64). */
static inline double table16_at(const unsigned char *data, const double *table, Py_ssize_t i) {
    return table[u16_at(data, i)];
}
static inline double table8_at(const unsigned char *data, const double *table, Py_ssize_t i) {
    return table[data[i]];
}
static inline int table16_zero(const unsigned char *data, const double *table, Py_ssize_t i) {
    return table16_at(data, table, i) == 0.0;
}
static inline int table16_negative_zero(const unsigned char *data, const double *table, Py_ssize_t i) {
    double v = table16_at(data, table, i);
    return (v == 0.0) & (signbit(v) != 0);
}
static inline int table8_zero(const unsigned char *data, const double *table, Py_ssize_t i) {
    return table8_at(data, table, i) == 0.0;
}
static inline int table8_negative_zero(const unsigned char *data, const double *table, Py_ssize_t i) {
    double v = table8_at(data, table, i);
    return (v == 0.0) & (signbit(v) != 0);
}

/* Rows [first, first + rows) of LANES elements added to the lanes one element at a time. */
#define DEFINE_SCALAR_SUMS(NAME, AT)                                                                      \
    static void NAME(const unsigned char *data, const double *table, Py_ssize_t first, Py_ssize_t rows,  \
                     Block *block) {                                                                      \
        for (Py_ssize_t r = first; r < first + rows; r++) {                                               \
            for (int k = 0; k < LANES; k++) {                                                             \
                double x = AT(data, table, r * LANES + k);                                                \
                block->sums[k] += x;                                                                      \
                block->squares[k] += x * x;                                                               \
            }                                                                                             \
        }                                                                                                 \
    }

/* Elements [start, start + n), n >= 1: extremes by < and > (either zero of a tie) and zero counts. */
#define DEFINE_SCALAR_EXTREMES(NAME, TYPE, VALUE, ZERO, NEGATIVE_ZERO)                                    \
    static void NAME(const unsigned char *data, const double *table, Py_ssize_t start, Py_ssize_t n,      \
                     Block *block) {                                                                      \
        TYPE lo = VALUE(data, table, start), hi = lo;                                                     \
        for (Py_ssize_t i = start; i < start + n; i++) {                                                  \
            TYPE x = VALUE(data, table, i);                                                               \
            lo = x < lo ? x : lo;                                                                         \
            hi = x > hi ? x : hi;                                                                         \
            block->zeros += ZERO(data, table, i);                                                         \
            block->negative_zeros += NEGATIVE_ZERO(data, table, i);                                       \
        }                                                                                                 \
        block->low = (double)lo < block->low ? (double)lo : block->low;                                   \
        block->high = (double)hi > block->high ? (double)hi : block->high;                                \
    }

/* The last partial row, elements [whole, n): the same lanes and extremes, one element at a time. */
#define DEFINE_TAIL(NAME, AT, EXTREMES)                                                                   \
    static void NAME(const unsigned char *data, const double *table, Py_ssize_t whole, Py_ssize_t n,      \
                     Block *block) {                                                                      \
        for (Py_ssize_t i = whole; i < n; i++) {                                                          \
            double x = AT(data, table, i);                                                                \
            block->sums[i - whole] += x;                                                                  \
            block->squares[i - whole] += x * x;                                                           \
        }                                                                                                 \
        if (n > whole)                                                                                    \
            EXTREMES(data, table, whole, n - whole, block);                                               \
    }

/* A whole block: ROWS rows at a time summed then scanned, then the last partial row. */
#define DEFINE_BLOCK(NAME, SUMS, ROW_EXTREMES, TAIL)                                                      \
    static void NAME(const unsigned char *data, const double *table, Py_ssize_t n, Block *block) {       \
        Py_ssize_t rows = n / LANES;                                                                      \
        for (Py_ssize_t r = 0; r < rows; r += ROWS) {                                                     \
            Py_ssize_t take = rows - r < ROWS ? rows - r : ROWS;                                          \
            SUMS(data, table, r, take, block);                                                            \
            ROW_EXTREMES(data, table, r * LANES, take * LANES, block);                                    \
        }                                                                                                 \
        TAIL(data, table, rows * LANES, n, block);                                                        \
    }

#define DEFINE_SCALAR_KIND(KIND)                                                                          \
    DEFINE_SCALAR_SUMS(KIND##_sums, KIND##_at)                                                            \
    DEFINE_SCALAR_EXTREMES(KIND##_extremes, double, KIND##_at, KIND##_zero, KIND##_negative_zero)         \
    DEFINE_TAIL(KIND##_tail, KIND##_at, KIND##_extremes)                                                  \
    DEFINE_BLOCK(KIND##_block, KIND##_sums, KIND##_extremes, KIND##_tail)

DEFINE_SCALAR_KIND(table16)
DEFINE_SCALAR_KIND(table8)
DEFINE_SCALAR_EXTREMES(f64_extremes, double, f64_at, f64_zero, f64_negative_zero)
DEFINE_SCALAR_EXTREMES(f32_extremes, float, f32_value, f32_zero, f32_negative_zero)
DEFINE_SCALAR_EXTREMES(bf16_extremes, float, bf16_value, bf16_zero, bf16_negative_zero)
DEFINE_TAIL(f64_tail, f64_at, f64_extremes)
DEFINE_TAIL(f32_tail, f32_at, f32_extremes)
DEFINE_TAIL(bf16_tail, bf16_at, bf16_extremes)

/* ---- Vector loops over whole rows: f64, f32 and bf16 ----
 *
 * GCC and clang vector extensions, instantiated for VB-byte vectors: 16 (SSE2, NEON: any 64-bit CPU) and,
 * on x86-64 with GCC, 32 under the avx2 target, chosen at import by what the CPU supports. A vector of
 * 32 bytes compiled for SSE2 alone is lowered element by element, hence one instantiation per width. Loads
 * go through memcpy, so nothing needs to be aligned; a comparison gives -1 where it holds. */
#define DEFINE_VECTOR_TYPES(SFX, VB)                                                                      \
    typedef double vd_##SFX __attribute__((vector_size(VB)));           /* W = VB / 8 doubles */          \
    typedef float vfw_##SFX __attribute__((vector_size(VB / 2)));       /* W floats */                    \
    typedef uint16_t vhw_##SFX __attribute__((vector_size(VB / 4)));    /* W 16-bit */                    \
    typedef uint32_t vuw_##SFX __attribute__((vector_size(VB / 2)));    /* W 32-bit */                    \
    typedef float vf_##SFX __attribute__((vector_size(VB)));            /* VB / 4 floats */               \
    typedef uint32_t vu_##SFX __attribute__((vector_size(VB)));                                           \
    typedef int32_t vi_##SFX __attribute__((vector_size(VB)));                                            \
    typedef uint16_t vh_##SFX __attribute__((vector_size(VB / 2)));     /* VB / 4 16-bit */               \
    typedef uint64_t vul_##SFX __attribute__((vector_size(VB)));                                          \
    typedef int64_t vl_##SFX __attribute__((vector_size(VB)));

#define DEFINE_VECTOR_KERNELS(SFX, WIDEN, LESSER_F, GREATER_F, LESSER_D, GREATER_D)                       \
    /* W elements from i on, as float64 (the sums); a vector of them as the bits the extremes compare. */ \
    DEFINE_LOAD(f64_doubles_##SFX, vd_##SFX, 8)                                                           \
    DEFINE_LOAD(f32_floats_##SFX, vfw_##SFX, 4)                                                           \
    static inline vd_##SFX f32_doubles_##SFX(const unsigned char *data, Py_ssize_t i) {                   \
        return WIDEN(f32_floats_##SFX(data, i), vd_##SFX);                                                \
    }                                                                                                     \
    DEFINE_LOAD(f64_bits_##SFX, vul_##SFX, 8)                                                             \
    DEFINE_LOAD(f32_bits_##SFX, vu_##SFX, 4)                                                              \
    DEFINE_LOAD(bf16_halves_##SFX, vh_##SFX, 2)                                                           \
    static inline vu_##SFX bf16_bits_##SFX(const unsigned char *data, Py_ssize_t i) {                     \
        /* as float32: the same value, zero and sign */                                                   \
        return __builtin_convertvector(bf16_halves_##SFX(data, i), vu_##SFX) << 16;                       \
    }                                                                                                     \
    DEFINE_VECTOR_SUMS(f64_sums_##SFX, vd_##SFX, f64_doubles_##SFX)                                       \
    DEFINE_VECTOR_SUMS(f32_sums_##SFX, vd_##SFX, f32_doubles_##SFX)                                       \
    DEFINE_VECTOR_SUMS(bf16_sums_##SFX, vd_##SFX, bf16_doubles_##SFX)                                     \
    DEFINE_VECTOR_EXTREMES(f64_row_extremes_##SFX, vul_##SFX, vd_##SFX, vl_##SFX, f64_bits_##SFX,        \
                           LESSER_D, GREATER_D)                                                           \
    DEFINE_VECTOR_EXTREMES(f32_row_extremes_##SFX, vu_##SFX, vf_##SFX, vi_##SFX, f32_bits_##SFX,         \
                           LESSER_F, GREATER_F)                                                           \
    DEFINE_VECTOR_EXTREMES(bf16_row_extremes_##SFX, vu_##SFX, vf_##SFX, vi_##SFX, bf16_bits_##SFX,       \
                           LESSER_F, GREATER_F)                                                           \
    DEFINE_BLOCK(f64_block_##SFX, f64_sums_##SFX, f64_row_extremes_##SFX, f64_tail)                       \
    DEFINE_BLOCK(f32_block_##SFX, f32_sums_##SFX, f32_row_extremes_##SFX, f32_tail)                       \
    DEFINE_BLOCK(bf16_block_##SFX, bf16_sums_##SFX, bf16_row_extremes_##SFX, bf16_tail)

/* Rows [first, first + rows) added to the lanes, four vectors of W lanes at a time, their sums and squares
 * held in eight registers (named variables: an array of them would live in memory). */
#define DEFINE_VECTOR_SUMS(NAME, D, DOUBLES)                                                              \
    static inline void NAME(const unsigned char *data, const double *table, Py_ssize_t first,            \
                            Py_ssize_t rows, Block *block) {                                              \
        const int w = (int)(sizeof(D) / sizeof(double));                                                 \
        (void)table;                                                                                      \
        for (int g = 0; g < LANES; g += 4 * w) {                                                          \
            D s0, s1, s2, s3, q0, q1, q2, q3;                                                             \
            memcpy(&s0, block->sums + g, sizeof(D));                                                      \
            memcpy(&s1, block->sums + g + w, sizeof(D));                                                  \
            memcpy(&s2, block->sums + g + 2 * w, sizeof(D));                                              \
            memcpy(&s3, block->sums + g + 3 * w, sizeof(D));                                              \
            memcpy(&q0, block->squares + g, sizeof(D));                                                   \
            memcpy(&q1, block->squares + g + w, sizeof(D));                                               \
            memcpy(&q2, block->squares + g + 2 * w, sizeof(D));                                           \
            memcpy(&q3, block->squares + g + 3 * w, sizeof(D));                                           \
            for (Py_ssize_t r = first; r < first + rows; r++) {                                           \
                Py_ssize_t i = r * LANES + g;                                                             \
                D x0 = DOUBLES(data, i), x1 = DOUBLES(data, i + w);                                       \
                D x2 = DOUBLES(data, i + 2 * w), x3 = DOUBLES(data, i + 3 * w);                           \
                s0 += x0;                                                                                 \
                s1 += x1;                                                                                 \
                s2 += x2;                                                                                 \
                s3 += x3;                                                                                 \
                q0 += x0 * x0;                                                                            \
                q1 += x1 * x1;                                                                            \
                q2 += x2 * x2;                                                                            \
                q3 += x3 * x3;                                                                            \
            }                                                                                             \
            memcpy(block->sums + g, &s0, sizeof(D));                                                      \
            memcpy(block->sums + g + w, &s1, sizeof(D));                                                  \
            memcpy(block->sums + g + 2 * w, &s2, sizeof(D));                                              \
            memcpy(block->sums + g + 3 * w, &s3, sizeof(D));                                              \
            memcpy(block->squares + g, &q0, sizeof(D));                                                   \
            memcpy(block->squares + g + w, &q1, sizeof(D));                                               \
            memcpy(block->squares + g + 2 * w, &q2, sizeof(D));                                           \
            memcpy(block->squares + g + 3 * w, &q3, sizeof(D));                                           \
        }                                                                                                 \
    }

/* Elements [start, start + n) of whole rows, two vectors at a time: extremes by LESSER and GREATER,
 * zeros where the bits but the sign's are 0, negative zeros where only the sign's is set. BITS is the
 * elements' bits, VALUE their float type, MASK a comparison's. */
#define DEFINE_VECTOR_EXTREMES(NAME, BITS, VALUE, MASK, LOAD_BITS, LESSER, GREATER)                       \
    static inline void NAME(const unsigned char *data, const double *table, Py_ssize_t start,            \
                            Py_ssize_t n, Block *block) {                                                 \
        const int w = (int)(sizeof(BITS) / sizeof(((BITS){0})[0]));                                       \
        const BITS sign = ~((BITS){0} + (~(BITS){0} >> 1)), magnitude = ~sign;                            \
        VALUE lo0 = (VALUE)LOAD_BITS(data, start), hi0 = lo0, lo1 = lo0, hi1 = lo0;                       \
        MASK zeros0 = {0}, zeros1 = {0}, negative0 = {0}, negative1 = {0};                                \
        (void)table;                                                                                      \
        for (Py_ssize_t i = start; i < start + n; i += 2 * w) {                                           \
            BITS b0 = LOAD_BITS(data, i), b1 = LOAD_BITS(data, i + w);                                    \
            VALUE x0 = (VALUE)b0, x1 = (VALUE)b1;                                                         \
            lo0 = LESSER(VALUE, MASK, x0, lo0);                                                           \
            lo1 = LESSER(VALUE, MASK, x1, lo1);                                                           \
            hi0 = GREATER(VALUE, MASK, x0, hi0);                                                          \
            hi1 = GREATER(VALUE, MASK, x1, hi1);                                                          \
            zeros0 -= (MASK)((b0 & magnitude) == 0);                                                      \
            zeros1 -= (MASK)((b1 & magnitude) == 0);                                                      \
            negative0 -= (MASK)(b0 == sign);                                                              \
            negative1 -= (MASK)(b1 == sign);                                                              \
        }                                                                                                 \
        for (int k = 0; k < w; k++) {                                                                     \
            double lo = lo0[k] < lo1[k] ? lo0[k] : lo1[k], hi = hi0[k] > hi1[k] ? hi0[k] : hi1[k];        \
            block->low = lo < block->low ? lo : block->low;                                               \
            block->high = hi > block->high ? hi : block->high;                                            \
            block->zeros += zeros0[k] + zeros1[k];                                                        \
            block->negative_zeros += negative0[k] + negative1[k];                                         \
        }                                                                                                 \
    }

/* x < y ? x : y and x > y ? x : y, element by element (a NaN x keeps y, as the scalar loop's does). */
#define BLEND_LESSER(VALUE, MASK, x, y) ((VALUE)(((MASK)(x) & (MASK)((x) < (y))) | ((MASK)(y) & ~(MASK)((x) < (y)))))
#define BLEND_GREATER(VALUE, MASK, x, y) ((VALUE)(((MASK)(x) & (MASK)((x) > (y))) | ((MASK)(y) & ~(MASK)((x) > (y)))))

#define CONVERT(v, TYPE) __builtin_convertvector(v, TYPE)

DEFINE_VECTOR_TYPES(base, 16)
/* bf16 elements as float64: their bits are a float32's upper half. */
static inline vd_base bf16_doubles_base(const unsigned char *data, Py_ssize_t i) {
    vhw_base h;
    memcpy(&h, data + 2 * i, sizeof h);
    vuw_base bits = __builtin_convertvector(h, vuw_base) << 16;
    return __builtin_convertvector((vfw_base)bits, vd_base);
}
DEFINE_VECTOR_KERNELS(base, CONVERT, BLEND_LESSER, BLEND_GREATER, BLEND_LESSER, BLEND_GREATER)

/* GCC 12 or later: "f16c" in __builtin_cpu_supports, and the builtins below as used; older compilers build
 * the 16-byte vectors alone. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12 && defined(__x86_64__)
#define HAVE_AVX2_KERNELS 1
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi" /* 32-byte vectors passed between inlined functions only */
#pragma GCC push_options
#pragma GCC target("avx2,f16c")
/* vminps(x, y) is x < y ? x : y exactly, vmaxps(x, y) x > y ? x : y: one instruction for a blend's three. */
#define AVX2_LESSER_F(VALUE, MASK, x, y) __builtin_ia32_minps256(x, y)
#define AVX2_GREATER_F(VALUE, MASK, x, y) __builtin_ia32_maxps256(x, y)
#define AVX2_LESSER_D(VALUE, MASK, x, y) __builtin_ia32_minpd256(x, y)
#define AVX2_GREATER_D(VALUE, MASK, x, y) __builtin_ia32_maxpd256(x, y)
/* GCC 12 converts 4 floats to 4 doubles in two halves and a merge; vcvtps2pd does it in one. */
#define AVX2_WIDEN(v, TYPE) __builtin_ia32_cvtps2pd256(v)
DEFINE_VECTOR_TYPES(avx2, 32)
typedef short vhalf_avx2 __attribute__((vector_size(16)));
typedef long long vquad_avx2 __attribute__((vector_size(16)));
/* Four bf16 loaded as one integer (a partial vector stored then loaded whole stalls the loop), each put
 * in the upper half of a float32 by interleaving with zeros. */
static inline vd_avx2 bf16_doubles_avx2(const unsigned char *data, Py_ssize_t i) {
    uint64_t four;
    memcpy(&four, data + 2 * i, 8);
    vquad_avx2 h = {(long long)four, 0};
    vhalf_avx2 floats = __builtin_ia32_punpcklwd128((vhalf_avx2){0}, (vhalf_avx2)h);
    return __builtin_ia32_cvtps2pd256((vfw_avx2)floats);
}
DEFINE_VECTOR_KERNELS(avx2, AVX2_WIDEN, AVX2_LESSER_F, AVX2_GREATER_F, AVX2_LESSER_D, AVX2_GREATER_D)

/* fp16 by the CPU's conversion (F16C, which every AVX2 CPU has): exact, as the table's values are. */
static inline vd_avx2 fp16_doubles_avx2(const unsigned char *data, Py_ssize_t i) {
    uint64_t four; /* as bf16's */
    memcpy(&four, data + 2 * i, 8);
    vquad_avx2 h = {(long long)four, 0};
    return __builtin_ia32_cvtps2pd256(__builtin_ia32_vcvtph2ps((vhalf_avx2)h));
}
static inline vu_avx2 fp16_bits_avx2(const unsigned char *data, Py_ssize_t i) {
    vhalf_avx2 h;
    memcpy(&h, data + 2 * i, 16);
    return (vu_avx2)__builtin_ia32_vcvtph2ps256(h); /* as float32: the same value, zero and sign */
}
DEFINE_VECTOR_SUMS(fp16_sums_avx2, vd_avx2, fp16_doubles_avx2)
DEFINE_VECTOR_EXTREMES(fp16_row_extremes_avx2, vu_avx2, vf_avx2, vi_avx2, fp16_bits_avx2, AVX2_LESSER_F,
                       AVX2_GREATER_F)
DEFINE_BLOCK(fp16_block_avx2, fp16_sums_avx2, fp16_row_extremes_avx2, table16_tail)
#pragma GCC pop_options
#pragma GCC diagnostic pop
#else
#define HAVE_AVX2_KERNELS 0
#endif

/* Whether the CPU runs the avx2 instantiation (AVX2 and F16C): set at import. */
static int use_avx2 = 0;

/* The lanes folded in halves, then +0.0 + lane 0 (a sum of -0.0s is +0.0, as numpy's reductions give). */
static double folded(double *lanes) {
    for (int h = LANES / 2; h >= 1; h /= 2)
        for (int k = 0; k < h; k++)
            lanes[k] = lanes[k] + lanes[k + h];
    return 0.0 + lanes[0];
}

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
    Block block = {{0.0}, {0.0}, INFINITY, -INFINITY, 0, 0};
    double sum, squares;
    const unsigned char *data = view.buf;
    const double *values = table.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (kind) {
    case 'd': (use_avx2 ? f64_block_avx2 : f64_block_base)(data, values, n, &block); break;
    case 'f': (use_avx2 ? f32_block_avx2 : f32_block_base)(data, values, n, &block); break;
    case 'b': (use_avx2 ? bf16_block_avx2 : bf16_block_base)(data, values, n, &block); break;
    case 'e': (use_avx2 ? fp16_block_avx2 : table16_block)(data, values, n, &block); break;
    default: table8_block(data, values, n, &block); break;
    }
    sum = folded(block.sums);
    squares = folded(block.squares);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(dddd" "nn)", sum, squares, block.low, block.high, block.zeros,
                           block.negative_zeros);
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

/* vectors() -> the vector loops in use, "avx2" or "base"; vectors(name) chooses them (the tests run both). */
static PyObject *vectors(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|s", &name))
        return NULL;
    if (name != NULL) {
        int avx2 = strcmp(name, "avx2") == 0;
        if (!avx2 && strcmp(name, "base") != 0) {
            PyErr_Format(PyExc_ValueError, "vectors: \"base\" or \"avx2\", not \"%s\"", name);
            return NULL;
        }
#if HAVE_AVX2_KERNELS
        if (avx2 && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))) {
#else
        if (avx2) {
#endif
            PyErr_SetString(PyExc_ValueError, "vectors: this build or CPU has no avx2 kernels");
            return NULL;
        }
        use_avx2 = avx2;
    }
    return PyUnicode_FromString(use_avx2 ? "avx2" : "base");
}

static PyMethodDef methods[] = {
    {"vectors", vectors, METH_VARARGS, "the vector loops in use, or chosen"},
    {"float_block", float_block, METH_VARARGS, "sum, squares, min, max, zeros, negative zeros"},
    {"int_block", int_block, METH_VARARGS, "min, max, zeros"},
    {"split_planes", split_planes, METH_VARARGS, "planes of rotated elements"},
    {"join_planes", join_planes, METH_VARARGS, "elements from their planes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "ckptfmt.kernels.c_kernels", NULL, -1, methods};

PyMODINIT_FUNC PyInit_c_kernels(void) {
#if HAVE_AVX2_KERNELS
    __builtin_cpu_init();
    use_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#endif
    return PyModule_Create(&module);
}
