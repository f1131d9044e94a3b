/* Large copies into shared memory with streaming (non-temporal) stores: ckptd.client.arena_copy.
 *
 * Why: a save copies the state's large tensors into an arena in pieces of 1-16 MiB (one piece
 * per tensor or chunk, spread over threads). glibc's memcpy switches to non-temporal stores only
 * above a threshold derived from the cache size (tens of MiB), so every piece below it is
 * copied with ordinary stores: each destination line is first read into the cache (read for
 * ownership) and later written back, about 1.5x the memory traffic of the copy. Measured on a
 * 2-core EPYC VM: 1 GiB in 81 per-tensor pieces took 0.16-0.19 s by memcpy against 0.11-0.14 s
 * as one call; with streaming stores the pieces take the time of the one call. The arena is
 * not read again by this process, so bypassing the cache loses nothing.
 *
 * stream_copy(dst, src): dst a writable buffer, src a readable buffer, both contiguous and of
 * the same length. x86-64: 32-byte (AVX2, where the CPU has it) or 16-byte (SSE2) streaming
 * stores after a memcpy up to the first 64-byte boundary of dst, then an sfence, so the bytes
 * are visible to other processes when the call returns. Elsewhere: memcpy. The GIL is released
 * for the copy; no Python object is touched while it is.
 *
 * copy_many(dst, offsets, addresses, sizes, streaming): many small pieces (tensors below
 * arena_copy's SPLIT_BYTES) in one call, streaming or not. torch._foreach_copy_ did this before,
 * but each of its copies is an OpenMP parallel region: with thousands of tensors of a few
 * hundred KiB, the fork and join of every one cost more than the copy once the other cores are
 * busy (1,000 tensors of 128 KiB: 0.2-0.8 s on a loaded 2-core VM, against 0.03 s idle).
 *
 * copy_pieces(destinations, sources, sizes, threads): a restore from the daemon's memory
 * (ckptd.client.reader.fill.MemoryCopies): sizes[i] bytes from address sources[i] to address
 * destinations[i] for every i, the three given as buffers of native uint64 (numpy arrays made
 * once per load plan). The pieces are laid end to end and cut into `threads` shares of equal
 * bytes (a piece may be cut), each copied by memcpy on its own thread, the calling thread
 * taking the first, all with the GIL released: one call whatever the number of tensors
 * (thousands of ctypes.memmove calls cost about 1 us each, the whole budget of a restore
 * beyond the copy). Streaming stores (as stream_copy) when the pieces hold STREAM_PIECES_ABOVE
 * bytes or more, else memcpy, which leaves the bytes in the cache for the trainer to read next.
 * Above a few MiB the cache cannot keep them anyway, and memcpy's read for ownership of every
 * destination line costs more than it saves: on the 2-core test VM, 2 threads, pieces from
 * one buffer into as many tensors, median of 15, memcpy / streaming: 4 MiB in 100 pieces 0.29 /
 * 0.49 ms, 16 MiB in 400 1.09 / 1.11 ms, 64 MiB in 1,000 5.3 / 4.0 ms, 256 MiB in 4,000 (from
 * a tmpfs mapping, as a restore from the daemon's memory) 22.8 / 17.9 ms; with the trainer's
 * read of every tensor after the copy, 16-64 MiB are still 6-10% faster streamed.
 *
 * populate(buffer, offset, nbytes): fill this process's page tables for bytes [offset, offset +
 * nbytes) of a mapping (an arena a restarted trainer is about to load from: ckptd.client.
 * arena_warm), with the GIL released, so that a later copy through it runs at the speed of a
 * warm one. A fresh mapping of a tmpfs file takes one fault per 4 KiB page on first touch:
 * about 15 ms of one core per 256 MiB on the test VM, which a thread can pay while the trainer
 * builds its model. madvise(MADV_POPULATE_READ) (Linux >= 5.14), else a read of one byte per
 * page. The buffer (the mmap object) stays exported during the call, so it cannot be unmapped.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_STREAMING 1

/* Copies the bytes before dst's next 64-byte boundary; returns how many. */
static size_t align_head(char *dst, const char *src, size_t n) {
    size_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    return head;
}

static void copy_sse2(char *dst, const char *src, size_t n) {
    size_t head = align_head(dst, src, n);
    dst += head, src += head, n -= head;
    size_t lines = n / 64;
    for (size_t i = 0; i < lines; i++, src += 64, dst += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)src);
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)dst, a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
    }
    _mm_sfence();
    memcpy(dst, src, n - lines * 64);
}

__attribute__((target("avx2"))) static void copy_avx2(char *dst, const char *src, size_t n) {
    size_t head = align_head(dst, src, n);
    dst += head, src += head, n -= head;
    size_t lines = n / 64;
    for (size_t i = 0; i < lines; i++, src += 64, dst += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
    }
    _mm_sfence();
    memcpy(dst, src, n - lines * 64);
}
#else
#define HAVE_STREAMING 0
#endif

typedef void (*copy_fn)(char *, const char *, size_t);

static void copy_plain(char *dst, const char *src, size_t n) { memcpy(dst, src, n); }

/* Chosen once at import from what the CPU supports (a pure function of the machine). */
static copy_fn chosen = copy_plain;
static const char *chosen_name = "memcpy";

static PyObject *stream_copy(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer dst = {0}, src = {0};
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src))
        return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "stream_copy: destination holds %zd bytes, source %zd; they must be equal",
                     dst.len, src.len);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    chosen((char *)dst.buf, (const char *)src.buf, (size_t)dst.len);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

/* Reads seq[i] of a sequence made by PySequence_Fast as a non-negative Py_ssize_t. */
static int read_sizes(PyObject *seq, Py_ssize_t n, Py_ssize_t *out, const char *what) {
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsSsize_t(items[i]);
        if (out[i] < 0) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "copy_many: %s[%zd] is negative", what, i);
            return -1;
        }
    }
    return 0;
}

static PyObject *copy_many(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer dst = {0};
    PyObject *offsets_arg, *addresses_arg, *sizes_arg;
    int streaming;
    if (!PyArg_ParseTuple(args, "w*OOOp", &dst, &offsets_arg, &addresses_arg, &sizes_arg, &streaming))
        return NULL;
    PyObject *result = NULL, *offsets = NULL, *addresses = NULL, *sizes = NULL;
    Py_ssize_t *values = NULL;
    offsets = PySequence_Fast(offsets_arg, "copy_many: offsets must be a sequence of ints");
    addresses = offsets ? PySequence_Fast(addresses_arg, "copy_many: addresses must be a sequence of ints") : NULL;
    sizes = addresses ? PySequence_Fast(sizes_arg, "copy_many: sizes must be a sequence of ints") : NULL;
    if (!sizes)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(offsets);
    if (PySequence_Fast_GET_SIZE(addresses) != n || PySequence_Fast_GET_SIZE(sizes) != n) {
        PyErr_SetString(PyExc_ValueError, "copy_many: offsets, addresses and sizes must be of the same length");
        goto done;
    }
    values = PyMem_Malloc(sizeof(Py_ssize_t) * 3 * (size_t)(n ? n : 1));
    if (!values) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t *at = values, *len = values + n;
    char **from = (char **)(values + 2 * n);
    if (read_sizes(offsets, n, at, "offsets") || read_sizes(sizes, n, len, "sizes"))
        goto done;
    PyObject **items = PySequence_Fast_ITEMS(addresses);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (len[i] > dst.len || at[i] > dst.len - len[i]) {
            PyErr_Format(PyExc_ValueError, "copy_many: bytes [%zd, %zd) are outside the destination of %zd bytes",
                         at[i], at[i] + len[i], dst.len);
            goto done;
        }
        from[i] = PyLong_AsVoidPtr(items[i]);
        if (!from[i] && PyErr_Occurred())
            goto done;
    }
    copy_fn fn = streaming ? chosen : copy_plain;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        fn((char *)dst.buf + at[i], from[i], (size_t)len[i]);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyMem_Free(values);
    Py_XDECREF(offsets);
    Py_XDECREF(addresses);
    Py_XDECREF(sizes);
    PyBuffer_Release(&dst);
    return result;
}

#define MAX_THREADS 64
#define MIN_SHARE_BYTES (1 << 20) /* below this per thread, a thread costs more than it saves */

#define STREAM_PIECES_ABOVE (16 << 20) /* bytes: copy_pieces streams from this total on */

struct share {
    copy_fn fn;
    const uint64_t *dst, *src, *len;
    Py_ssize_t n;
    uint64_t lo, hi; /* bytes [lo, hi) of the pieces laid end to end */
};

static void *copy_share(void *arg) {
    const struct share *s = arg;
    uint64_t at = 0; /* where piece i starts among the pieces laid end to end */
    for (Py_ssize_t i = 0; i < s->n && at < s->hi; i++) {
        uint64_t start = at, stop = at + s->len[i];
        at = stop;
        if (stop <= s->lo)
            continue;
        uint64_t from = (start < s->lo ? s->lo : start) - start, to = (stop > s->hi ? s->hi : stop) - start;
        s->fn((char *)(uintptr_t)s->dst[i] + from, (const char *)(uintptr_t)s->src[i] + from, (size_t)(to - from));
    }
    return NULL;
}

static PyObject *copy_pieces(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer dst = {0}, src = {0}, len = {0};
    int threads;
    if (!PyArg_ParseTuple(args, "y*y*y*i", &dst, &src, &len, &threads))
        return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len || dst.len != len.len || dst.len % (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_Format(PyExc_ValueError, "copy_pieces: destinations, sources and sizes must be uint64 arrays of one length (%zd, %zd, %zd bytes)",
                     dst.len, src.len, len.len);
        goto done;
    }
    if (threads < 1) {
        PyErr_Format(PyExc_ValueError, "copy_pieces: threads=%d must be at least 1", threads);
        goto done;
    }
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    Py_ssize_t n = dst.len / (Py_ssize_t)sizeof(uint64_t);
    const uint64_t *sizes = len.buf;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (sizes[i] > (uint64_t)PY_SSIZE_T_MAX - total) {
            PyErr_SetString(PyExc_ValueError, "copy_pieces: the sizes add up to more than the address space");
            goto done;
        }
        total += sizes[i];
    }
    uint64_t most = total / MIN_SHARE_BYTES;
    if ((uint64_t)threads > most)
        threads = most ? (int)most : 1;
    copy_fn fn = total >= STREAM_PIECES_ABOVE ? chosen : copy_plain;
    struct share shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int k = 0; k < threads; k++)
        shares[k] = (struct share){fn, dst.buf, src.buf, sizes, n, total / (uint64_t)threads * (uint64_t)k,
                                   k + 1 == threads ? total : total / (uint64_t)threads * (uint64_t)(k + 1)};
    Py_BEGIN_ALLOW_THREADS
    for (int k = 1; k < threads; k++)
        started[k] = pthread_create(&ids[k], NULL, copy_share, &shares[k]) == 0;
    copy_share(&shares[0]);
    for (int k = 1; k < threads; k++) {
        if (started[k])
            pthread_join(ids[k], NULL);
        else
            copy_share(&shares[k]); /* no thread to be had: this one copies that share too */
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&len);
    return result;
}

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif

static PyObject *populate(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf = {0};
    Py_ssize_t offset, nbytes;
    if (!PyArg_ParseTuple(args, "y*nn", &buf, &offset, &nbytes))
        return NULL;
    PyObject *result = NULL;
    if (offset < 0 || nbytes < 0 || offset > buf.len || nbytes > buf.len - offset) {
        PyErr_Format(PyExc_ValueError, "populate: bytes [%zd, %zd + %zd) are not inside the buffer's %zd", offset, offset, nbytes, buf.len);
        goto done;
    }
    if (nbytes > 0) {
        Py_BEGIN_ALLOW_THREADS
        const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        const uintptr_t start = (uintptr_t)buf.buf + (uintptr_t)offset, end = start + (uintptr_t)nbytes;
        const uintptr_t first = start - start % page;
        if (madvise((void *)first, end - first, MADV_POPULATE_READ) != 0) {
            /* an older kernel (EINVAL): touch one byte per page instead */
            volatile const char *p = (volatile const char *)start;
            for (uintptr_t at = first; at < end; at += page)
                (void)p[(at > start ? at : start) - start];
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&buf);
    return result;
}

static PyMethodDef methods[] = {
    {"stream_copy", stream_copy, METH_VARARGS,
     "stream_copy(dst, src) -> None\n\n"
     "Copy the bytes of `src` into `dst` (a writable buffer of the same length) with streaming\n"
     "stores where the CPU has them (see KIND), releasing the GIL. The bytes are visible to other\n"
     "processes mapping dst when it returns."},
    {"copy_many", copy_many, METH_VARARGS,
     "copy_many(dst, offsets, addresses, sizes, streaming) -> None\n\n"
     "Copy sizes[i] bytes from process address addresses[i] to dst[offsets[i]:] for every i, in one\n"
     "call with the GIL released: streaming stores when `streaming` (as stream_copy), else memcpy.\n"
     "dst is a writable buffer; every range must lie inside it (ValueError otherwise). The sources\n"
     "are raw addresses (e.g. torch's data_ptr() of contiguous tensors): the caller guarantees that\n"
     "each is readable for its size and stays alive until the call returns."},
    {"copy_pieces", copy_pieces, METH_VARARGS,
     "copy_pieces(destinations, sources, sizes, threads) -> None\n\n"
     "Copy sizes[i] bytes from address sources[i] to address destinations[i] for every i; the three\n"
     "are buffers of native uint64 of one length (ValueError otherwise). The bytes are cut into\n"
     "`threads` (at least 1, at most 64) shares of equal size, fewer below 1 MiB a share, each copied on its\n"
     "own thread with the GIL released: by streaming stores when the sizes add up to STREAM_PIECES_ABOVE\n"
     "or more (the bytes are visible to other processes when it returns), else by memcpy. Raw addresses: the caller guarantees that every range is\n"
     "readable (source) or writable (destination), that no destination overlaps another range, and\n"
     "that all stay alive until the call returns."},
    {"populate", populate, METH_VARARGS,
     "populate(buffer, offset, nbytes) -> None\n\n"
     "Fill this process's page tables for bytes [offset, offset + nbytes) of `buffer` (a mapping:\n"
     "an mmap object), with the GIL released: madvise(MADV_POPULATE_READ), else a read of one byte\n"
     "per page. ValueError when the range is not inside the buffer. The values are not changed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_copy", "Large copies with streaming stores (ckptd.client.arena_copy).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__copy(void) {
#if HAVE_STREAMING
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        chosen = copy_avx2, chosen_name = "avx2 streaming stores";
    else
        chosen = copy_sse2, chosen_name = "sse2 streaming stores";
#endif
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddStringConstant(m, "KIND", chosen_name) || PyModule_AddIntConstant(m, "STREAM_PIECES_ABOVE", STREAM_PIECES_ABOVE))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
