/* tierckpt._hostcopy: copy many host memory ranges with streaming (non-temporal) stores, split over threads.
 *
 * Why: a regular store to a cache line that is not cached first reads that line from memory (read for ownership),
 * so copying N bytes into cold memory moves 3N bytes. A snapshot's staging copy is far larger than any cache and
 * nothing on this core reads it soon (the writers hand it to the disk), so stores that bypass the cache move 2N.
 * glibc only streams copies larger than about 3/4 of the shared cache (hundreds of MiB on big hosts: more than
 * most tensors), and torch's copy_ never does.
 *
 * Contract (checked by tests/snapshot/test_hostcopy.py): copy(dst, src, lengths, threads, streaming) copies lengths[i] bytes
 * from address src[i] to address dst[i] for every i; the three arguments are buffers of uint64 of equal length.
 * The total is split into `threads` byte ranges of equal size, each copied by one thread (the caller's thread
 * runs the first). Ranges must not overlap. Returns only when every byte is copied and, for streaming stores,
 * fenced (sfence), so any thread that synchronises with the caller afterwards sees them. The GIL is released
 * while copying. Nothing here reads Python objects after the GIL is released.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HOSTCOPY_X86 1
#else
#define HOSTCOPY_X86 0
#endif

/* Below this many bytes a range is copied with memcpy (streaming a few lines gains nothing). */
#define STREAM_MIN 16384
/* At most this many threads, whatever the caller asks (memory bandwidth is spent long before). */
#define MAX_THREADS 64
/* A thread gets at least this many bytes: below it, starting a thread costs more than it saves. */
#define MIN_BYTES_PER_THREAD (4u << 20)

#if HOSTCOPY_X86
static int have_avx2 = 0;

static void stream_sse2(char *d, const char *s, size_t blocks) {
    for (size_t i = 0; i < blocks; i++, s += 64, d += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
}

__attribute__((target("avx2"))) static void stream_avx2(char *d, const char *s, size_t blocks) {
    for (size_t i = 0; i < blocks; i++, s += 64, d += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
        _mm256_stream_si256((__m256i *)d, a);
        _mm256_stream_si256((__m256i *)(d + 32), b);
    }
}
#endif

/* Copy n bytes; with streaming stores for the 64-byte-aligned middle of the destination when asked and large. */
static void copy_one(char *d, const char *s, size_t n, int streaming) {
#if HOSTCOPY_X86
    if (streaming && n >= STREAM_MIN) {
        size_t head = (64 - ((uintptr_t)d & 63)) & 63;
        memcpy(d, s, head);
        d += head;
        s += head;
        n -= head;
        size_t blocks = n >> 6;
        if (have_avx2)
            stream_avx2(d, s, blocks);
        else
            stream_sse2(d, s, blocks);
        d += blocks << 6;
        s += blocks << 6;
        memcpy(d, s, n & 63);
        return;
    }
#endif
    (void)streaming;
    memcpy(d, s, n);
}

typedef struct {
    const uint64_t *dst, *src, *len;
    Py_ssize_t count;
    uint64_t lo, hi; /* this job's bytes, as offsets into the concatenation of all ranges */
    int streaming;
} job_t;

static void *run_job(void *arg) {
    job_t *j = (job_t *)arg;
    uint64_t pos = 0;
    for (Py_ssize_t i = 0; i < j->count && pos < j->hi; i++) {
        uint64_t a = pos, b = pos + j->len[i];
        pos = b;
        if (b <= j->lo)
            continue;
        uint64_t from = a > j->lo ? a : j->lo, to = b < j->hi ? b : j->hi;
        if (to > from)
            copy_one((char *)(uintptr_t)(j->dst[i] + (from - a)),
                     (const char *)(uintptr_t)(j->src[i] + (from - a)), (size_t)(to - from), j->streaming);
    }
#if HOSTCOPY_X86
    if (j->streaming)
        _mm_sfence(); /* streaming stores are weakly ordered: make them visible before this job reports done */
#endif
    return NULL;
}

static int get_u64(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || view->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D buffer of 8-byte integers", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *hostcopy_copy(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dst_obj, *src_obj, *len_obj;
    int threads = 1, streaming = 1;
    if (!PyArg_ParseTuple(args, "OOO|ip", &dst_obj, &src_obj, &len_obj, &threads, &streaming))
        return NULL;
    Py_buffer dv, sv, lv;
    if (get_u64(dst_obj, &dv, "dst") < 0)
        return NULL;
    if (get_u64(src_obj, &sv, "src") < 0) {
        PyBuffer_Release(&dv);
        return NULL;
    }
    if (get_u64(len_obj, &lv, "lengths") < 0) {
        PyBuffer_Release(&dv);
        PyBuffer_Release(&sv);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t count = dv.shape[0];
    if (sv.shape[0] != count || lv.shape[0] != count) {
        PyErr_SetString(PyExc_ValueError, "dst, src and lengths must have the same length");
        goto done;
    }
    const uint64_t *lens = (const uint64_t *)lv.buf;
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        total += lens[i];
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    uint64_t most = total / MIN_BYTES_PER_THREAD;
    if ((uint64_t)threads > most)
        threads = most > 0 ? (int)most : 1;
    job_t jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS];
    /* equal shares, cut on 4 KiB boundaries of the concatenation */
    uint64_t share = ((total + (uint64_t)threads - 1) / (uint64_t)threads + 4095) & ~(uint64_t)4095;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        uint64_t lo = share * (uint64_t)t, hi = lo + share;
        jobs[t] = (job_t){(const uint64_t *)dv.buf, (const uint64_t *)sv.buf, lens, count,
                          lo < total ? lo : total, hi < total ? hi : total, streaming};
        started[t] = 0;
    }
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&tids[t], NULL, run_job, &jobs[t]) == 0;
    run_job(&jobs[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            run_job(&jobs[t]); /* no thread could be started: copy its share here */
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&dv);
    PyBuffer_Release(&sv);
    PyBuffer_Release(&lv);
    return result;
}

static PyObject *hostcopy_streaming(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(HOSTCOPY_X86);
}

static PyMethodDef methods[] = {
    {"copy", hostcopy_copy, METH_VARARGS,
     "copy(dst, src, lengths, threads=1, streaming=True): copy lengths[i] bytes from address src[i] to dst[i]."},
    {"streaming", hostcopy_streaming, METH_NOARGS, "Whether this build has streaming (non-temporal) stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hostcopy", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__hostcopy(void) {
#if HOSTCOPY_X86
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
    return PyModule_Create(&module);
}
