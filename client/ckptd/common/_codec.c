/* The blockwise encoder of ckptd.common.quant in one pass over the values (docs/architecture.md §8).
 *
 * quant.encode arranges a piece's rows as whole logical blocks of float32 (rows, nb, block) and
 * calls encode_blocks, which writes each row's codes (columns [left, left + n) of the blocked
 * row) and each block's scales. The math is the one quant's module docstring states; doing it
 * here, block by block while the block is in L1, replaces about a dozen passes of torch kernels
 * over every chunk (the save's CPU time is the limit on a node with few cores).
 *
 * Linear codecs: q = round(x * (Q / absmax)) in float32, exactly as the torch expression
 * x * inv + 1.5 * 2^23 rounds it (half to even): compiled with -ffp-contract=off, so no fused
 * multiply-add changes a rounding.
 * Log codecs: log2 is a polynomial (below) accurate to about one float32 ulp (fused multiply-adds
 * there are wanted: exact for every build, as fmaf is); the block's
 * bounds use the same function as its elements, so the largest value takes code Q and the
 * smallest non-zero code 1. Codes are clamped to 1..Q: a non-zero value never takes code 0.
 *
 * No Python objects are touched while the GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
/* one build, the widest vectors the CPU has, chosen once when the module loads (AVX-512 also
 * narrows 32-bit lanes to code bytes in one instruction: 2.7x the AVX2 speed in a microbenchmark) */
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

enum { OK = 0, NON_FINITE = 1, NEGATIVE = 2 };

static const float ROUND = 12582912.0f; /* 1.5 * 2^23: t + ROUND has round(t) in its low bits */
static const uint32_t ABS = 0x7fffffffu;
static const uint32_t INF_BITS = 0x7f800000u;

static inline uint32_t bits_of(float x) { uint32_t b; memcpy(&b, &x, 4); return b; }
static inline float float_of(uint32_t b) { float x; memcpy(&x, &b, 4); return x; }

/* log2(v) for finite v > 0 (subnormals included): v = m * 2^e with m in [sqrt(1/2), sqrt(2)),
 * log2(m) = x * p(x) with x = m - 1 and p a degree-7 polynomial fitted for the least largest
 * error on that range (4.9e-8 before rounding; about one float32 ulp of the result with it),
 * evaluated with fused multiply-adds. Branch-free, so loops calling it vectorize. */
static inline float log2_positive(float v) {
    uint32_t b = bits_of(v);
    int subnormal = b < 0x00800000u;
    float scaled = v * 8388608.0f; /* 2^23; computed in every lane, so no branch */
    b = bits_of(subnormal ? scaled : v);
    int e = (int)(b >> 23) - 127 - (subnormal ? 23 : 0);
    float m = float_of((b & 0x007fffffu) | 0x3f800000u); /* [1, 2) */
    int above = m > 1.41421356f;
    float half = m * 0.5f;
    m = above ? half : m;
    e += above;
    float x = m - 1.0f;
    float p = -0.14574437f;
    p = fmaf(p, x, 0.23689033f);
    p = fmaf(p, x, -0.25006905f);
    p = fmaf(p, x, 0.28670746f);
    p = fmaf(p, x, -0.36008722f);
    p = fmaf(p, x, 0.48093945f);
    p = fmaf(p, x, -0.72135717f);
    p = fmaf(p, x, 1.4426948f);
    return fmaf(x, p, (float)e);
}

/* One row of nb blocks at src into the row's codes at codes (one int32 lane each: loops that
 * narrow floats to bytes vectorize poorly) and the row's scales. Returns OK, NON_FINITE or
 * NEGATIVE (log codecs only). */
VECTOR_CLONES
static int encode_row(int is_log, int bits, int levels, const float *src, Py_ssize_t nb, Py_ssize_t block,
                      uint32_t *codes, float *scales) {
    const float round_at = ROUND + (bits == 4 && !is_log ? 8.0f : 0.0f); /* signed int4 codes are q + 8 */
    for (Py_ssize_t j = 0; j < nb; j++) {
        const float *x = src + j * block;
        uint32_t *out = codes + j * block;
        if (!is_log) {
            uint32_t top = 0;
            for (Py_ssize_t i = 0; i < block; i++) {
                uint32_t a = bits_of(x[i]) & ABS;
                top = a > top ? a : top;
            }
            if (top >= INF_BITS) return NON_FINITE;
            float absmax = float_of(top);
            /* as torch computes levels / absmax: the reciprocal, then the product (two roundings) */
            float inv = absmax > 0.0f ? (1.0f / absmax) * (float)levels : 0.0f;
            scales[j] = absmax;
            if (bits_of(inv) == INF_BITS) {
                /* a tiny absmax (below levels / FLT_MAX): levels / absmax overflows, so divide first */
                for (Py_ssize_t i = 0; i < block; i++) {
                    float t = x[i] / absmax;
                    t = t * (float)levels;
                    out[i] = bits_of(t + round_at) & 0xffu;
                }
            } else {
                for (Py_ssize_t i = 0; i < block; i++) {
                    float t = x[i] * inv;
                    out[i] = bits_of(t + round_at) & 0xffu;
                }
            }
            continue;
        }
        uint32_t top = 0, any = 0, least = ABS;
        for (Py_ssize_t i = 0; i < block; i++) {
            uint32_t b = bits_of(x[i]);
            uint32_t positive = b >> 31 ? 0 : b;
            top = positive > top ? positive : top;
            any = b > any ? b : any;                     /* > 0x80000000: a negative value (or -NaN) */
            uint32_t key = (b - 1u) & ABS;               /* 0 and -0 become the largest; order kept */
            least = key < least ? key : least;
        }
        if (any > 0x80000000u) return (any & ABS) > INF_BITS ? NON_FINITE : NEGATIVE;
        if (top >= INF_BITS) return NON_FINITE;
        float lo = 0.0f, hi = 0.0f;
        if (least != ABS) { /* else the block is all zeros */
            lo = log2_positive(float_of(least + 1u)) * 0.5f;
            hi = log2_positive(float_of(top)) * 0.5f;
        }
        float span = hi - lo;
        float inv = span > 0.0f ? (1.0f / span) * (float)(levels - 1) : 1.0f;
        float twice_lo = lo * 2.0f, half_inv = inv * 0.5f, most = (float)(levels - 1);
        scales[2 * j] = lo;
        scales[2 * j + 1] = hi;
        for (Py_ssize_t i = 0; i < block; i++) {
            float v = x[i];
            int zero = (bits_of(v) & ABS) == 0;
            /* log2(sqrt v) - lo in code steps; zero lanes compute log2(1) and are discarded */
            float t = (log2_positive(zero ? 1.0f : v) - twice_lo) * half_inv;
            t = t < 0.0f ? 0.0f : (t > most ? most : t);
            uint32_t code = (bits_of(t + ROUND) & 0xffu) + 1u;
            out[i] = zero ? 0u : code;
        }
    }
    return OK;
}

/* Columns [left, left + n) of a row's code lanes as stored: a byte each, or two per byte. */
VECTOR_CLONES
static void store_row(int bits, const uint32_t *lanes, Py_ssize_t left, Py_ssize_t n, uint8_t *out) {
    const uint32_t *c = lanes + left;
    if (bits == 8) {
        for (Py_ssize_t i = 0; i < n; i++) out[i] = (uint8_t)c[i];
        return;
    }
    Py_ssize_t pairs = n / 2;
    for (Py_ssize_t i = 0; i < pairs; i++) out[i] = (uint8_t)((c[2 * i] & 0x0fu) | (c[2 * i + 1] << 4));
    if (n % 2) out[pairs] = (uint8_t)(c[n - 1] & 0x0fu);
}

static int need(Py_buffer *view, Py_ssize_t bytes, const char *what) {
    if (view->len < bytes) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, needs %zd", what, view->len, bytes);
        return 0;
    }
    return 1;
}

static PyObject *encode_blocks(PyObject *self, PyObject *args) {
    (void)self;
    int is_log, bits, levels;
    Py_ssize_t rows, nb, block, left, n;
    Py_buffer src = {0}, codes = {0}, scales = {0};
    if (!PyArg_ParseTuple(args, "piiy*nnnnnw*w*", &is_log, &bits, &levels, &src, &rows, &nb, &block, &left, &n,
                          &codes, &scales))
        return NULL;
    PyObject *result = NULL;
    uint32_t *row_codes = NULL;
    Py_ssize_t row_bytes = bits == 4 ? (n + 1) / 2 : n;
    Py_ssize_t width = is_log ? 2 : 1;
    if ((bits != 4 && bits != 8) || levels < 2 || rows < 0 || nb < 1 || block < 2 || left < 0 || n < 1 ||
        left + n > nb * block) {
        PyErr_Format(PyExc_ValueError, "bad arguments: bits %d, levels %d, rows %zd, %zd blocks of %zd, columns [%zd, %zd)",
                     bits, levels, rows, nb, block, left, left + n);
        goto done;
    }
    if (!need(&src, rows * nb * block * 4, "values") || !need(&codes, rows * row_bytes, "codes") ||
        !need(&scales, rows * nb * width * 4, "scales"))
        goto done;
    row_codes = malloc((size_t)(nb * block) * sizeof *row_codes);
    if (!row_codes) {
        PyErr_NoMemory();
        goto done;
    }
    int status = OK;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t r = 0; r < rows && status == OK; r++) {
        status = encode_row(is_log, bits, levels, (const float *)src.buf + r * nb * block, nb, block, row_codes,
                            (float *)scales.buf + r * nb * width);
        store_row(bits, row_codes, left, n, (uint8_t *)codes.buf + r * row_bytes);
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromLong(status);
done:
    free(row_codes);
    PyBuffer_Release(&src);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scales);
    return result;
}

static PyMethodDef methods[] = {
    {"encode_blocks", encode_blocks, METH_VARARGS,
     "encode_blocks(is_log, bits, levels, values, rows, nblocks, block, left, n, codes, scales) -> status\n\n"
     "Code `rows` rows of `nblocks` float32 blocks of `block` values (C order) into `codes` (per row:\n"
     "columns [left, left + n), one byte each, or two per byte for 4 bits) and `scales` (float32,\n"
     "per block: absmax, or log2 of the smallest and largest non-zero sqrt(v)). Returns OK, or\n"
     "NON_FINITE or NEGATIVE (log codecs), after which the outputs are partial."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codec", "The one-pass blockwise encoder of ckptd.common.quant.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__codec(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "OK", OK) || PyModule_AddIntConstant(m, "NON_FINITE", NON_FINITE) ||
              PyModule_AddIntConstant(m, "NEGATIVE", NEGATIVE))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
