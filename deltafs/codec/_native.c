/* The sparse codec's per-element loops, compiled: what numpy needs ~20 calls per stream for on small chunks.
 *
 * Optional: deltafs.codec uses this module when it was built (setup.py marks it optional) and its numpy code
 * otherwise; both produce and accept exactly the same bytes (tests/codec/test_native.py). The streams are those
 * of manifests/FORMAT.md ("sparse"): a unary stream of quotients (a one bit ends each, MSB first), a stream of
 * k-bit remainders (MSB first), a sign bit per change (MSB first), all zero-padded to whole bytes.
 *
 * Every function reads untrusted bytes (payloads from a store) and bounds every index by the buffer lengths
 * given; the GIL is released while they run (the gamma loops: on large inputs only, GIL_FROM). The cheap
 * whole-stream checks (sizes, padding, the range of k) stay in Python, before these are called.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* The gamma loops over fewer bytes than this keep the GIL: letting it go and taking it back costs about as much as
 * such a loop, and with other threads waiting for it the taking back can wait longer than the loop ran. */
#define GIL_FROM (16 << 10)
#define RELEASE_GIL_IF(big) PyThreadState *released_ = (big) ? PyEval_SaveThread() : NULL;
#define TAKE_GIL() if (released_) PyEval_RestoreThread(released_);
/* int64 buffers are read and written as int64_t: numpy's arrays are aligned, a hand-made view may not be. */
#define ALIGNED8(b) (((uintptr_t)(b).buf & 7u) == 0)

enum { OK = 0, WRONG_COUNT = 1, TRAILING_BYTES = 2, OUT_OF_RANGE = 3, SHORT_REMAINDER = 4 };

/* positions(unary, remainder, count, k, end, out) -> status
 *
 * Writes the count positions that the gaps lead to into out (int64, native order): position i is the sum of
 * gaps 0..i plus i, i.e. (zeros before the i-th one bit << k) + (remainders 0..i) + i. Status OK, or the first
 * problem found: WRONG_COUNT (more or fewer than count one bits), TRAILING_BYTES (bytes after the one that holds
 * the last one bit), OUT_OF_RANGE (a position >= end), SHORT_REMAINDER (the remainder stream ends early).
 * Requires count >= 1, 0 <= k <= 32 and 0 < end <= 2**62 (checked here too), so no sum can overflow: every
 * partial position is compared with end before it grows further.
 */
static int decode_positions(const uint8_t *unary, Py_ssize_t unary_len, const uint8_t *rem, Py_ssize_t rem_len,
                            int64_t count, int k, int64_t end, int64_t *out) {
    int64_t i = 0, zeros = 0, rsum = 0;
    uint64_t acc = 0;
    int nacc = 0;
    Py_ssize_t rp = 0;
    const uint64_t mask = k ? ((1ULL << k) - 1) : 0;
    const int64_t zeros_limit = end >> k; /* zeros << k must stay below end */
    Py_ssize_t last_byte = -1;
    /* The unary stream 8 bytes at a time, MSB first: w holds the word's unread bits at its top. */
    for (Py_ssize_t byte = 0; byte < unary_len; byte += 8) {
        const int nbytes = unary_len - byte >= 8 ? 8 : (int)(unary_len - byte);
        uint64_t w = 0;
        if (nbytes == 8) {
            memcpy(&w, unary + byte, 8);
            w = __builtin_bswap64(w); /* little-endian hosts only (the caller checks) */
        } else {
            for (int j = 0; j < nbytes; j++)
                w |= (uint64_t)unary[byte + j] << (56 - 8 * j);
        }
        int consumed = 0; /* bits of this word already read */
        while (w) {
            const int lead = __builtin_clzll(w);
            zeros += lead;
            consumed += lead + 1;
            w = (w << lead) << 1; /* two shifts: lead + 1 may be 64 */
            if (i >= count)
                return WRONG_COUNT;
            if (zeros > zeros_limit)
                return OUT_OF_RANGE;
            int64_t r = 0;
            if (k) {
                if (nacc < k) { /* nacc < k <= 32: 32 more bits fit the 64-bit accumulator */
                    if (rp + 4 <= rem_len) {
                        uint32_t v;
                        memcpy(&v, rem + rp, 4);
                        acc = (acc << 32) | __builtin_bswap32(v);
                        rp += 4;
                        nacc += 32;
                    } else {
                        while (nacc <= 56 && rp < rem_len) {
                            acc = (acc << 8) | rem[rp++];
                            nacc += 8;
                        }
                        if (nacc < k)
                            return SHORT_REMAINDER;
                    }
                }
                r = (int64_t)((acc >> (nacc - k)) & mask);
                nacc -= k;
            }
            rsum += r;
            /* zeros << k <= end <= 2**62, rsum <= the previous position < 2**62 plus r < 2**32, and i < 2**61
             * (one bit each): the sum fits a uint64, and a position >= end ends the decode. */
            uint64_t pos = ((uint64_t)zeros << k) + (uint64_t)rsum + (uint64_t)i;
            if (pos >= (uint64_t)end)
                return OUT_OF_RANGE;
            out[i++] = (int64_t)pos;
            last_byte = byte + (consumed - 1) / 8;
        }
        zeros += 8 * nbytes - consumed;
    }
    if (i != count)
        return WRONG_COUNT;
    if (last_byte != unary_len - 1)
        return TRAILING_BYTES;
    return OK;
}

static PyObject *positions(PyObject *self, PyObject *args) {
    Py_buffer unary, rem, out;
    long long count, end;
    int k;
    if (!PyArg_ParseTuple(args, "y*y*LiLw*", &unary, &rem, &count, &k, &end, &out))
        return NULL;
    int status = -1;
    if (count < 1 || k < 0 || k > 32 || end < 1 || end > (1LL << 62))
        PyErr_SetString(PyExc_ValueError, "positions: count, k or end out of the supported range");
    else if (out.len < (Py_ssize_t)(count * 8))
        PyErr_SetString(PyExc_ValueError, "positions: out is smaller than count int64 values");
    else {
        int64_t *dst = (int64_t *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        status = decode_positions((const uint8_t *)unary.buf, unary.len, (const uint8_t *)rem.buf, rem.len,
                                  (int64_t)count, k, (int64_t)end, dst);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&unary);
    PyBuffer_Release(&rem);
    PyBuffer_Release(&out);
    if (status < 0)
        return NULL;
    return PyLong_FromLong(status);
}

/* encode(gaps, k, unary_out, remainder_out) -> None
 *
 * The codec reaches this loop through group(); the Python function exposes it to the tests alone, which hold it
 * to numpy's streams.rice_encode at any k.
 *
 * gaps: int64 values >= 0 (native order). Writes the unary stream (gap >> k zero bits, then a one bit, per gap)
 * into unary_out and the low k bits of each gap into remainder_out, both MSB first and zero-padded; each must
 * be exactly as long as the streams are (the caller knows: sum of quotients plus count bits, count * k bits).
 */
static int encode_streams(const int64_t *gaps, Py_ssize_t count, int k, uint8_t *unary, Py_ssize_t unary_len,
                          uint8_t *rem, Py_ssize_t rem_len) {
    memset(unary, 0, (size_t)unary_len);
    uint64_t bit = 0; /* next bit of the unary stream */
    uint64_t acc = 0; /* remainder bits not yet written: the low nacc (< 32 between gaps) */
    int nacc = 0;
    Py_ssize_t rp = 0;
    const uint64_t mask = k ? ((1ULL << k) - 1) : 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t g = gaps[i];
        if (g < 0)
            return -1;
        bit += (uint64_t)g >> k;
        if ((bit >> 3) >= (uint64_t)unary_len)
            return -1;
        unary[bit >> 3] |= (uint8_t)(0x80u >> (bit & 7));
        bit++;
        if (k) {
            /* k <= 32 new bits on top of fewer than 32 kept: fits 64; whole 32-bit words out, MSB first. */
            acc = (acc << k) | ((uint64_t)g & mask);
            nacc += k;
            if (nacc >= 32) {
                nacc -= 32;
                if (rp + 4 > rem_len)
                    return -1;
                const uint32_t word = (uint32_t)(acc >> nacc);
                rem[rp] = (uint8_t)(word >> 24);
                rem[rp + 1] = (uint8_t)(word >> 16);
                rem[rp + 2] = (uint8_t)(word >> 8);
                rem[rp + 3] = (uint8_t)word;
                rp += 4;
            }
        }
    }
    while (nacc >= 8) {
        if (rp >= rem_len)
            return -1;
        nacc -= 8;
        rem[rp++] = (uint8_t)(acc >> nacc);
    }
    if (nacc) {
        if (rp >= rem_len)
            return -1;
        rem[rp++] = (uint8_t)(acc << (8 - nacc));
    }
    if ((Py_ssize_t)((bit + 7) >> 3) != unary_len || rp != rem_len)
        return -1;
    return 0;
}

static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer gaps, unary, rem;
    int k;
    if (!PyArg_ParseTuple(args, "y*iw*w*", &gaps, &k, &unary, &rem))
        return NULL;
    int status = -2;
    if (k < 0 || k > 32 || gaps.len % 8)
        PyErr_SetString(PyExc_ValueError, "encode: k out of range or gaps not int64");
    else {
        Py_BEGIN_ALLOW_THREADS
        status = encode_streams((const int64_t *)gaps.buf, gaps.len / 8, k, (uint8_t *)unary.buf, unary.len,
                                (uint8_t *)rem.buf, rem.len);
        Py_END_ALLOW_THREADS
        if (status)
            PyErr_SetString(PyExc_ValueError, "encode: a negative gap, or output buffers of the wrong size");
    }
    PyBuffer_Release(&gaps);
    PyBuffer_Release(&unary);
    PyBuffer_Release(&rem);
    if (status)
        return NULL;
    Py_RETURN_NONE;
}

/* signs(diff, width, signs_out, big_at_out, big_out) -> big
 *
 * As encode(): used by group(), exposed for the tests (against numpy's codecs._signs_and_big).
 *
 * The sign and magnitude streams of a sparse group, from its count = len(diff) / width wrapped differences
 * (width-byte little-endian integers): sign bit i (MSB first, zero padding) is the top bit of d_i; the magnitude
 * |d_i| is the smaller of d_i and -d_i (wrapped). The big changes, those whose magnitude is not 1, are listed:
 * their indexes into big_at_out (int64) and their magnitude less 2 into big_out (width bytes each, little-endian),
 * in ascending order. Returns how many are big. signs_out must hold (count + 7) / 8 bytes, the others count.
 */
#define SIGNS_LOOP(W, T)                                                                                         \
    static Py_ssize_t signs_##W(const uint8_t *diff, Py_ssize_t count, uint8_t *signs, int64_t *big_at,          \
                                uint8_t *big) {                                                                  \
        Py_ssize_t nbig = 0;                                                                                     \
        unsigned acc = 0;                                                                                        \
        for (Py_ssize_t i = 0; i < count; i++) {                                                                 \
            T d, m;                                                                                              \
            memcpy(&d, diff + i * W, W);                                                                         \
            const T neg = (T)(0 - d);                                                                            \
            acc = (acc << 1) | (unsigned)(d >> (8 * W - 1));                                                     \
            if ((i & 7) == 7)                                                                                    \
                signs[i >> 3] = (uint8_t)acc;                                                                    \
            m = d < neg ? d : neg;                                                                               \
            /* Written always, kept (counted) only when big: no branch to mispredict; nbig <= i < count. */      \
            const T v = (T)(m - 2);                                                                              \
            big_at[nbig] = i;                                                                                    \
            memcpy(big + nbig * W, &v, W);                                                                       \
            nbig += m != 1;                                                                                      \
        }                                                                                                        \
        if (count & 7)                                                                                           \
            signs[count >> 3] = (uint8_t)((acc << (8 - (count & 7))) & 0xFF);                                    \
        return nbig;                                                                                             \
    }
SIGNS_LOOP(1, uint8_t)
SIGNS_LOOP(2, uint16_t)
SIGNS_LOOP(4, uint32_t)
SIGNS_LOOP(8, uint64_t)

static PyObject *signs(PyObject *self, PyObject *args) {
    Py_buffer diff, sg, at, big;
    int width;
    if (!PyArg_ParseTuple(args, "y*iw*w*w*", &diff, &width, &sg, &at, &big))
        return NULL;
    Py_ssize_t nbig = -1;
    if ((width == 1 || width == 2 || width == 4 || width == 8) && diff.len % width == 0) {
        const Py_ssize_t count = diff.len / width;
        if (sg.len == (count + 7) / 8 && at.len == count * 8 && big.len == count * width) {
            const uint8_t *d = (const uint8_t *)diff.buf;
            uint8_t *s = (uint8_t *)sg.buf, *b = (uint8_t *)big.buf;
            int64_t *a = (int64_t *)at.buf;
            Py_BEGIN_ALLOW_THREADS
            switch (width) {
            case 1: nbig = signs_1(d, count, s, a, b); break;
            case 2: nbig = signs_2(d, count, s, a, b); break;
            case 4: nbig = signs_4(d, count, s, a, b); break;
            default: nbig = signs_8(d, count, s, a, b); break;
            }
            Py_END_ALLOW_THREADS
        }
    }
    if (nbig < 0)
        PyErr_SetString(PyExc_ValueError, "signs: width must be 1, 2, 4 or 8 and the buffers sized for the changes");
    PyBuffer_Release(&diff);
    PyBuffer_Release(&sg);
    PyBuffer_Release(&at);
    PyBuffer_Release(&big);
    if (nbig < 0)
        return NULL;
    return PyLong_FromSsize_t(nbig);
}

/* group(ranks, diff, width, space) -> (k, unary, remainder, signs, big, big_k, big_unary, big_remainder, planes)
 *
 * Every stream of one sparse class in one call, as bytes: what streams.rice_streams, codecs._signs_and_big and
 * streams.to_planes compute in about twenty numpy calls (a few dozen microseconds on a chunk of a few KiB, more than
 * the work). ranks: the count ascending int64 ranks of the changes within a class of space elements; diff: their
 * count wrapped differences (width bytes each, little-endian). The rank gaps (with the last one up to the sentinel
 * rank space) and the gaps between big changes are each Rice-coded with the k that codes them smallest, found by
 * the same walk as streams._walk_k from the same start (streams._first_k); planes holds the big changes'
 * magnitudes less 2 as width byte planes of big bytes each, lowest first. ValueError when the ranks are not
 * ascending or not below space.
 */
static int rice_start(Py_ssize_t count, uint64_t total) {
    /* streams._first_k: int(log2(mean * 0.69 + 1.0)) in 0..32, every step rounded as Python rounds it. */
    volatile double mean = count ? (double)total / (double)count : 0.0;
    volatile double scaled = mean * 0.69;
    const double k = log2(scaled + 1.0);
    return k < 0 ? 0 : k > 32 ? 32 : (int)k;
}

static uint64_t quotient_sum(const int64_t *gaps, Py_ssize_t count, int k) {
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        total += (uint64_t)gaps[i] >> k;
    return total;
}

/* The quotient sums for k - 1, k and k + 1 (k in 1..31) in one pass over the gaps. */
static void quotient_sums3(const int64_t *gaps, Py_ssize_t count, int k, uint64_t out[3]) {
    uint64_t a = 0, b = 0, c = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        const uint64_t g = (uint64_t)gaps[i] >> (k - 1);
        a += g;
        b += g >> 1;
        c += g >> 2;
    }
    out[0] = a;
    out[1] = b;
    out[2] = c;
}

static int rice_walk(const int64_t *gaps, Py_ssize_t count, uint64_t total, uint64_t *qsum) {
    /* streams._walk_k: down from the start while the cost falls, then up. The start's neighbours' sums come from
     * the same pass as its own (the walk reads them first); sums further away, one pass each. */
    int k = rice_start(count, total);
    const int k0 = k;
    uint64_t near[3] = {0, 0, 0};
    const int have_near = k0 >= 1 && k0 <= 31;
    if (have_near)
        quotient_sums3(gaps, count, k0, near);
    uint64_t best = have_near ? near[1] : quotient_sum(gaps, count, k);
    uint64_t cost = (uint64_t)count * (uint64_t)(k + 1) + best;
    for (int step = -1; step <= 1; step += 2) {
        while (k + step >= 0 && k + step <= 32) {
            const int at = k + step;
            const uint64_t q = have_near && at >= k0 - 1 && at <= k0 + 1 ? near[at - k0 + 1]
                                                                        : quotient_sum(gaps, count, at);
            const uint64_t c = (uint64_t)count * (uint64_t)(at + 1) + q;
            if (c >= cost)
                break;
            k = at;
            cost = c;
            best = q;
        }
    }
    *qsum = best;
    return k;
}

/* The streams of one class from its count ascending ranks (below space) and their wrapped differences: group()'s
 * work, shared with changes_group(). The planes come back as one bytes object (group's tuple) or, with split,
 * one per plane after the count (changes_group's). ValueError when the ranks are not ascending or not below space.
 * Called with the GIL held; releases it around the loops. */
static PyObject *group_streams(const int64_t *r, Py_ssize_t count, const uint8_t *d, int width, Py_ssize_t space,
                               int split) {
    PyObject *result = NULL;
    PyObject *out[6] = {NULL, NULL, NULL, NULL, NULL, NULL}; /* unary, remainder, signs, big_unary, big_rem, planes */
    PyObject *planes[8] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    int64_t *gaps = NULL, *big_at = NULL;
    uint8_t *big = NULL;
    gaps = PyMem_RawMalloc((size_t)(count + 1) * 8);
    big_at = PyMem_RawMalloc((size_t)(count ? count : 1) * 8);
    big = PyMem_RawMalloc((size_t)(count ? count : 1) * (size_t)width);
    if (!gaps || !big_at || !big) {
        PyErr_NoMemory();
        goto done;
    }
    int ascending = 1, k = 0, big_k = 0;
    uint64_t qsum = 0, big_qsum = 0;
    Py_ssize_t nbig = 0;
    uint8_t *sg = NULL;
    Py_BEGIN_ALLOW_THREADS
    /* Ascending and below space: every rank and every gap non-negative, and the last rank below space; the sign
     * bits are gathered branch-free. The differences are taken as unsigned (hostile ranks wrap, they do not
     * overflow), and a wrapped one is negative as a gap or comes from a negative rank, so the verdict holds. */
    uint64_t negative = 0;
    if (count) {
        gaps[0] = r[0];
        negative |= (uint64_t)r[0];
    }
    for (Py_ssize_t i = 1; i < count; i++) {
        gaps[i] = (int64_t)((uint64_t)r[i] - (uint64_t)r[i - 1] - 1u);
        negative |= (uint64_t)r[i] | (uint64_t)gaps[i];
    }
    const int64_t prev = count ? r[count - 1] : -1;
    ascending = !(negative >> 63) && prev < (int64_t)space;
    gaps[count] = (int64_t)((uint64_t)space - 1u - (uint64_t)prev);
    if (ascending)
        k = rice_walk(gaps, count + 1, (uint64_t)(space - count), &qsum);
    Py_END_ALLOW_THREADS
    if (!ascending) {
        PyErr_SetString(PyExc_ValueError, "group: ranks must be ascending and below space");
        goto done;
    }
    out[2] = PyBytes_FromStringAndSize(NULL, (count + 7) / 8);
    if (!out[2])
        goto done;
    sg = (uint8_t *)PyBytes_AS_STRING(out[2]);
    Py_BEGIN_ALLOW_THREADS
    switch (width) {
    case 1: nbig = signs_1(d, count, sg, big_at, big); break;
    case 2: nbig = signs_2(d, count, sg, big_at, big); break;
    case 4: nbig = signs_4(d, count, sg, big_at, big); break;
    default: nbig = signs_8(d, count, sg, big_at, big); break;
    }
    if (nbig) {
        /* Gaps between big changes (no sentinel), in place: each index is read before it is overwritten. */
        int64_t last = -1;
        for (Py_ssize_t i = 0; i < nbig; i++) {
            const int64_t at = big_at[i];
            big_at[i] = at - last - 1;
            last = at;
        }
        big_k = rice_walk(big_at, nbig, (uint64_t)(last + 1 - nbig), &big_qsum);
    }
    Py_END_ALLOW_THREADS
    out[0] = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((qsum + (uint64_t)count + 1 + 7) / 8));
    out[1] = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(((uint64_t)(count + 1) * (uint64_t)k + 7) / 8));
    out[3] = PyBytes_FromStringAndSize(NULL, nbig ? (Py_ssize_t)((big_qsum + (uint64_t)nbig + 7) / 8) : 0);
    out[4] = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(((uint64_t)nbig * (uint64_t)big_k + 7) / 8));
    if (!out[0] || !out[1] || !out[3] || !out[4])
        goto done;
    uint8_t *pl[8] = {NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL};
    if (split) {
        for (int j = 0; j < width; j++) {
            planes[j] = PyBytes_FromStringAndSize(NULL, nbig);
            if (!planes[j])
                goto done;
            pl[j] = (uint8_t *)PyBytes_AS_STRING(planes[j]);
        }
    } else {
        out[5] = PyBytes_FromStringAndSize(NULL, nbig * width);
        if (!out[5])
            goto done;
        for (int j = 0; j < width; j++)
            pl[j] = (uint8_t *)PyBytes_AS_STRING(out[5]) + j * nbig;
    }
    int status = 0;
    uint8_t *u = (uint8_t *)PyBytes_AS_STRING(out[0]), *rm = (uint8_t *)PyBytes_AS_STRING(out[1]);
    uint8_t *bu = (uint8_t *)PyBytes_AS_STRING(out[3]), *br = (uint8_t *)PyBytes_AS_STRING(out[4]);
    Py_BEGIN_ALLOW_THREADS
    status = encode_streams(gaps, count + 1, k, u, PyBytes_GET_SIZE(out[0]), rm, PyBytes_GET_SIZE(out[1]));
    if (!status && nbig)
        status = encode_streams(big_at, nbig, big_k, bu, PyBytes_GET_SIZE(out[3]), br, PyBytes_GET_SIZE(out[4]));
    for (Py_ssize_t i = 0; i < nbig; i++)
        for (int j = 0; j < width; j++)
            pl[j][i] = big[i * width + j];
    Py_END_ALLOW_THREADS
    if (status) {
        PyErr_SetString(PyExc_RuntimeError, "group: stream sizes disagree (a bug)");
        goto done;
    }
    if (!split) {
        result = Py_BuildValue("(iOOOniOOO)", k, out[0], out[1], out[2], nbig, big_k, out[3], out[4], out[5]);
        goto done;
    }
    /* (count, k, unary, remainder, signs, big, big_k, big_unary, big_remainder, plane 0, ..., plane width - 1) */
    result = PyTuple_New(9 + width);
    if (!result)
        goto done;
    PyObject *items[9] = {PyLong_FromSsize_t(count), PyLong_FromLong(k), out[0], out[1], out[2],
                          PyLong_FromSsize_t(nbig), PyLong_FromLong(big_k), out[3], out[4]};
    for (int i = 0; i < 9; i++) {
        if (!items[i]) {
            Py_CLEAR(result);
            for (int m = 0; m < 9; m++)
                if (m != 2 && m != 3 && m != 4 && m != 7 && m != 8)
                    Py_XDECREF(items[m]);
            goto done;
        }
    }
    for (int i = 0; i < 9; i++) {
        if (i == 2 || i == 3 || i == 4 || i == 7 || i == 8)
            Py_INCREF(items[i]); /* out[] keeps its own reference, dropped below */
        PyTuple_SET_ITEM(result, i, items[i]);
    }
    for (int j = 0; j < width; j++) {
        PyTuple_SET_ITEM(result, 9 + j, planes[j]);
        planes[j] = NULL;
    }
done:
    for (int i = 0; i < 6; i++)
        Py_XDECREF(out[i]);
    for (int j = 0; j < 8; j++)
        Py_XDECREF(planes[j]);
    PyMem_RawFree(gaps);
    PyMem_RawFree(big_at);
    PyMem_RawFree(big);
    return result;
}

static PyObject *group(PyObject *self, PyObject *args) {
    Py_buffer ranks, diff;
    int width;
    Py_ssize_t space;
    if (!PyArg_ParseTuple(args, "y*y*in", &ranks, &diff, &width, &space))
        return NULL;
    PyObject *result = NULL;
    const Py_ssize_t count = ranks.len / 8;
    if (!(width == 1 || width == 2 || width == 4 || width == 8) || ranks.len % 8 || diff.len != count * width ||
        space < count)
        PyErr_SetString(PyExc_ValueError, "group: width must be 1, 2, 4 or 8, ranks int64 and diff one per rank");
    else
        result = group_streams((const int64_t *)ranks.buf, count, (const uint8_t *)diff.buf, width, space, 0);
    PyBuffer_Release(&ranks);
    PyBuffer_Release(&diff);
    return result;
}

/* *p += d on one width-byte little-endian integer, wrapping (little-endian hosts only). */
static inline void add_at(uint8_t *p, int width, uint64_t d) {
    switch (width) {
    case 1: *p = (uint8_t)(*p + (uint8_t)d); break;
    case 2: { uint16_t x; memcpy(&x, p, 2); x = (uint16_t)(x + (uint16_t)d); memcpy(p, &x, 2); break; }
    case 4: { uint32_t x; memcpy(&x, p, 4); x += (uint32_t)d; memcpy(p, &x, 4); break; }
    default: { uint64_t x; memcpy(&x, p, 8); x += d; memcpy(p, &x, 8); break; }
    }
}

/* apply(out, width, where, signs, big_at, big_values) -> status
 *
 * out[where[i]] += d_i for each of the count = len(where) changes, on width-byte little-endian integers,
 * wrapping: d_i is the magnitude (1, or big_values[j] + 2 for the j-th index listed in big_at) negated where
 * sign bit i is set. where: int64 element indexes, distinct; big_at: ascending int64 indexes into the changes;
 * big_values: len(big_at) width-byte little-endian values. Everything is checked before out is written:
 * status 1 if an index in where is outside out, 2 if big_at is not ascending within the changes, 3 if a buffer
 * is too short. Little-endian hosts only (the caller checks).
 */
static int apply_changes(uint8_t *out, Py_ssize_t n, int width, const int64_t *where, Py_ssize_t count,
                         const uint8_t *signs, Py_ssize_t signs_len, const int64_t *big_at, Py_ssize_t big,
                         const uint8_t *big_values) {
    if (signs_len < (count + 7) / 8)
        return 3;
    for (Py_ssize_t i = 0; i < count; i++)
        if (where[i] < 0 || where[i] >= n)
            return 1;
    for (Py_ssize_t j = 0; j < big; j++)
        if (big_at[j] < 0 || big_at[j] >= count || (j && big_at[j] <= big_at[j - 1]))
            return 2;
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t mag = 1;
        if (j < big && big_at[j] == i) {
            const uint8_t *q = big_values + j * width; /* little-endian */
            uint64_t v = 0;
            for (int m = width - 1; m >= 0; m--)
                v = (v << 8) | q[m];
            mag = v + 2;
            j++;
        }
        add_at(out + where[i] * width, width, ((signs[i >> 3] >> (7 - (i & 7))) & 1) ? (uint64_t)0 - mag : mag);
    }
    return 0;
}

static PyObject *apply(PyObject *self, PyObject *args) {
    Py_buffer out, where, signs, big_at, big_values;
    int width;
    if (!PyArg_ParseTuple(args, "w*iy*y*y*y*", &out, &width, &where, &signs, &big_at, &big_values))
        return NULL;
    int status = -1;
    if (width != 1 && width != 2 && width != 4 && width != 8)
        PyErr_SetString(PyExc_ValueError, "apply: width must be 1, 2, 4 or 8");
    else if (where.len % 8 || big_at.len % 8 || out.len % width || big_values.len < (big_at.len / 8) * width)
        status = 3;
    else {
        Py_BEGIN_ALLOW_THREADS
        status = apply_changes((uint8_t *)out.buf, out.len / width, width, (const int64_t *)where.buf, where.len / 8,
                               (const uint8_t *)signs.buf, signs.len, (const int64_t *)big_at.buf, big_at.len / 8,
                               (const uint8_t *)big_values.buf);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&where);
    PyBuffer_Release(&signs);
    PyBuffer_Release(&big_at);
    PyBuffer_Release(&big_values);
    if (status < 0)
        return NULL;
    return PyLong_FromLong(status);
}

/* ungroup(out, base, width, space, count, k, big, big_k, unary, remainder, signs, big_unary, big_remainder,
 *         planes) -> status
 *
 * A sparse chunk of one class (no split) decoded and applied in one call: what _decode_group and apply() do with
 * a dozen numpy calls in between. The streams are those of Group.stream_sizes; planes holds the width byte planes
 * of the large magnitudes one after the other (big bytes each). Everything is checked before out is written, as
 * the Python path checks it: the count + 1 rank gaps must end exactly at the sentinel rank space (positions(),
 * with the remainder stream's size and zero padding), the sign stream's padding must be zero, big <= count and the
 * big gaps must lead to big ascending indexes below count (or both big streams be empty). Any failure returns a
 * non-zero status with out untouched: the caller then decodes the same streams in Python, which says what is
 * wrong. base: None when out holds the base already (in place); otherwise a buffer of out's size, copied into out
 * a block at a time with the changes of each block added while it is in the cache (status 6, nothing done, when
 * the two overlap other than exactly). Little-endian hosts only.
 */
static int remainder_ok(Py_ssize_t rem_len, const uint8_t *rem, int64_t count, int k) {
    const int64_t bits = count * k;
    if (rem_len != (Py_ssize_t)((bits + 7) / 8))
        return 0;
    const int pad = (int)((8 - bits % 8) % 8);
    return !(pad && (rem[rem_len - 1] & ((1 << pad) - 1)));
}

#define UNGROUP_BLOCK (16 << 10)

static int ungroup_apply(uint8_t *out, const uint8_t *base, Py_ssize_t n, int width, const int64_t *where,
                         Py_ssize_t count, const uint8_t *signs, const int64_t *big_at, Py_ssize_t big,
                         const uint8_t *planes) {
    const Py_ssize_t total = n * width;
    Py_ssize_t copied = base ? 0 : total, i = 0, j = 0;
    while (i < count || copied < total) {
        if (copied < total) {
            const Py_ssize_t len = total - copied < UNGROUP_BLOCK ? total - copied : UNGROUP_BLOCK;
            memcpy(out + copied, base + copied, (size_t)len);
            copied += len;
        }
        const Py_ssize_t limit = copied / width; /* elements now in out (all of them in place) */
        for (; i < count && where[i] < limit; i++) {
            uint64_t mag = 1;
            if (j < big && big_at[j] == i) {
                uint64_t v = 0;
                for (int m = width - 1; m >= 0; m--)
                    v = (v << 8) | planes[(Py_ssize_t)m * big + j];
                mag = v + 2;
                j++;
            }
            add_at(out + where[i] * width, width,
                   ((signs[i >> 3] >> (7 - (i & 7))) & 1) ? (uint64_t)0 - mag : mag);
        }
        if (copied >= total && i < count)
            return 1; /* cannot happen: every position was checked below space = n */
    }
    return OK;
}

static PyObject *ungroup(PyObject *self, PyObject *args) {
    Py_buffer out, un, rem, sg, bun, brem, pl, base = {0};
    PyObject *base_obj;
    int width, k, big_k;
    long long space, count, big;
    if (!PyArg_ParseTuple(args, "w*OiLLiLiy*y*y*y*y*y*", &out, &base_obj, &width, &space, &count, &k, &big, &big_k,
                          &un, &rem, &sg, &bun, &brem, &pl))
        return NULL;
    int status = -1, have_base = 0;
    int64_t *where = NULL, *big_at = NULL;
    if (base_obj != Py_None) {
        if (PyObject_GetBuffer(base_obj, &base, PyBUF_SIMPLE) < 0)
            goto done;
        have_base = 1;
    }
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "ungroup: width must be 1, 2, 4 or 8");
        goto done;
    }
    if (out.len % width || space != out.len / width || (have_base && base.len != out.len)) {
        PyErr_SetString(PyExc_ValueError, "ungroup: out and base must hold space elements of width bytes");
        goto done;
    }
    if (have_base && base.buf == out.buf)
        have_base = 2; /* the same bytes through another object: in place */
    else if (have_base && (const uint8_t *)base.buf < (const uint8_t *)out.buf + out.len
             && (const uint8_t *)out.buf < (const uint8_t *)base.buf + base.len) {
        status = 6; /* overlapping otherwise: the Python path copies as numpy does */
        goto done;
    }
    status = 5; /* any stream of the wrong shape: the Python path names it */
    if (count < 1 || count > space || k < 0 || k > 32 || big < 0 || big > count || big_k < 0 || big_k > 32
        || space + 1 > (1LL << 62) || count + 1 >= ((1LL << 62) >> k) || big >= ((1LL << 62) >> big_k)
        || sg.len != (Py_ssize_t)((count + 7) / 8) || pl.len != (Py_ssize_t)(big * width))
        goto done;
    if (!remainder_ok(rem.len, (const uint8_t *)rem.buf, count + 1, k))
        goto done;
    if ((count % 8) && (((const uint8_t *)sg.buf)[sg.len - 1] & ((1 << (8 - count % 8)) - 1)))
        goto done;
    if (big ? !remainder_ok(brem.len, (const uint8_t *)brem.buf, big, big_k) : (bun.len || brem.len))
        goto done;
    where = PyMem_RawMalloc((size_t)(count + 1) * 8);
    big_at = PyMem_RawMalloc((size_t)(big ? big : 1) * 8);
    if (!where || !big_at) {
        PyErr_NoMemory();
        status = -1;
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    status = decode_positions((const uint8_t *)un.buf, un.len, (const uint8_t *)rem.buf, rem.len, count + 1, k,
                              space + 1, where);
    if (status == OK && where[count] != space)
        status = OUT_OF_RANGE;
    if (status == OK && big)
        status = decode_positions((const uint8_t *)bun.buf, bun.len, (const uint8_t *)brem.buf, brem.len, big,
                                  big_k, count, big_at);
    if (status == OK)
        status = ungroup_apply((uint8_t *)out.buf, have_base == 1 ? (const uint8_t *)base.buf : NULL, space, width,
                               where, count, (const uint8_t *)sg.buf, big_at, big, (const uint8_t *)pl.buf);
    Py_END_ALLOW_THREADS
done:
    PyMem_RawFree(where);
    PyMem_RawFree(big_at);
    if (have_base)
        PyBuffer_Release(&base);
    PyBuffer_Release(&out);
    PyBuffer_Release(&un);
    PyBuffer_Release(&rem);
    PyBuffer_Release(&sg);
    PyBuffer_Release(&bun);
    PyBuffer_Release(&brem);
    PyBuffer_Release(&pl);
    if (status < 0)
        return NULL;
    return PyLong_FromLong(status);
}

/* dense(planes, width, base, out) -> None
 *
 * The dense codec's inverse in one pass: element i's zigzag code t is read from the width byte planes (plane j
 * holds byte j of every element, little-endian), and out[i] = base[i] + ((t >> 1) ^ -(t & 1)), wrapping. All three
 * buffers hold n * width bytes; out may be base itself (each element is read before it is written), but must not
 * overlap it otherwise (the caller checks).
 */
/* One loop per width, so that the compiler sees fixed-size loads and stores (a memcpy of a variable width is a call
 * per element). */
#define DENSE_LOOP(T, W)                                                                                              \
    for (Py_ssize_t i = 0; i < n; i++) {                                                                              \
        T t = 0, b;                                                                                                   \
        for (int j = 0; j < (W); j++)                                                                                 \
            t |= (T)((T)planes[j * n + i] << (8 * j));                                                                \
        memcpy(&b, base + i * (W), (W)); /* little-endian host */                                                     \
        T v = (T)(b + (T)((t >> 1) ^ (T)((T)0 - (T)(t & 1))));                                                        \
        memcpy(out + i * (W), &v, (W));                                                                               \
    }

static void dense_apply(const uint8_t *planes, Py_ssize_t n, int width, const uint8_t *base, uint8_t *out) {
    switch (width) {
    case 1: DENSE_LOOP(uint8_t, 1) break;
    case 2: DENSE_LOOP(uint16_t, 2) break;
    case 4: DENSE_LOOP(uint32_t, 4) break;
    default: DENSE_LOOP(uint64_t, 8) break;
    }
}

static PyObject *dense(PyObject *self, PyObject *args) {
    Py_buffer planes, base, out;
    int width;
    if (!PyArg_ParseTuple(args, "y*iy*w*", &planes, &width, &base, &out))
        return NULL;
    int ok = (width == 1 || width == 2 || width == 4 || width == 8) && planes.len == out.len && base.len == out.len &&
             out.len % width == 0;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        dense_apply((const uint8_t *)planes.buf, out.len / width, width, (const uint8_t *)base.buf, (uint8_t *)out.buf);
        Py_END_ALLOW_THREADS
    } else
        PyErr_SetString(PyExc_ValueError, "dense: width must be 1, 2, 4 or 8 and all buffers n * width bytes");
    PyBuffer_Release(&planes);
    PyBuffer_Release(&base);
    PyBuffer_Release(&out);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* codes(new, base, width, planes_out) -> changed
 *
 * The dense codec's forward pass: d = new - base per width-byte little-endian element (wrapping), its zigzag code
 * (d << 1) ^ -(d >> (8 * width - 1)) split into width byte planes (plane j: byte j of every element) in
 * planes_out. Returns how many elements differ. All buffers hold n * width bytes.
 */
#define CODES_LOOP(T, W)                                                                                              \
    for (Py_ssize_t i = 0; i < n; i++) {                                                                              \
        T x, y;                                                                                                       \
        memcpy(&x, nb + i * (W), (W));                                                                                \
        memcpy(&y, bb + i * (W), (W));                                                                                \
        T d = (T)(x - y);                                                                                             \
        changed += d != 0;                                                                                            \
        T z = (T)((T)(d << 1) ^ (T)((T)0 - (T)(d >> (8 * (W) - 1))));                                                 \
        for (int j = 0; j < (W); j++)                                                                                 \
            planes[j * n + i] = (uint8_t)(z >> (8 * j));                                                              \
    }

static Py_ssize_t dense_codes(const uint8_t *nb, const uint8_t *bb, Py_ssize_t n, int width, uint8_t *planes) {
    Py_ssize_t changed = 0;
    switch (width) {
    case 1: CODES_LOOP(uint8_t, 1) break;
    case 2: CODES_LOOP(uint16_t, 2) break;
    case 4: CODES_LOOP(uint32_t, 4) break;
    default: CODES_LOOP(uint64_t, 8) break;
    }
    return changed;
}

static PyObject *codes(PyObject *self, PyObject *args) {
    Py_buffer nbuf, bbuf, planes;
    int width;
    if (!PyArg_ParseTuple(args, "y*y*iw*", &nbuf, &bbuf, &width, &planes))
        return NULL;
    Py_ssize_t changed = -1;
    if ((width == 1 || width == 2 || width == 4 || width == 8) && nbuf.len == bbuf.len && planes.len == nbuf.len &&
        nbuf.len % width == 0) {
        Py_BEGIN_ALLOW_THREADS
        changed = dense_codes((const uint8_t *)nbuf.buf, (const uint8_t *)bbuf.buf, nbuf.len / width, width,
                              (uint8_t *)planes.buf);
        Py_END_ALLOW_THREADS
    } else
        PyErr_SetString(PyExc_ValueError, "codes: width must be 1, 2, 4 or 8 and all buffers n * width bytes");
    PyBuffer_Release(&nbuf);
    PyBuffer_Release(&bbuf);
    PyBuffer_Release(&planes);
    if (changed < 0)
        return NULL;
    return PyLong_FromSsize_t(changed);
}

/* changes(new, base, width, idx_out, new_out, base_out) -> count
 *
 * The elements (width bytes each) where new and base differ, in ascending order: their indexes into idx_out
 * (int64) and their bytes into new_out and base_out, up to the capacity of idx_out (len / 8 entries; the value
 * buffers hold as many elements). Returns how many differ in all: when that is more than the capacity, the
 * outputs hold the first ones and the caller calls again with room for all.
 *
 * One loop per width, so every element copy is a single load and store and every index a shift (a memcpy of a
 * run-time width is a library call per element: the loop before this one spent most of its time there). A block
 * of CHANGES_BLOCK bytes is compared as a whole first, so unchanged data costs no branch per word; a changed
 * block is split into words, and each word's changed lanes are emitted lowest first.
 */
/* One bit per changed lane of the 8-byte XOR d, at the lane's lowest bit: the lane's bits ORed down into it. */
static inline uint64_t lanes_changed_1(uint64_t d) { d |= d >> 4; d |= d >> 2; d |= d >> 1; return d & 0x0101010101010101ULL; }
static inline uint64_t lanes_changed_2(uint64_t d) { d |= d >> 8; d |= d >> 4; d |= d >> 2; d |= d >> 1; return d & 0x0001000100010001ULL; }
static inline uint64_t lanes_changed_4(uint64_t d) { d |= d >> 16; d |= d >> 8; d |= d >> 4; d |= d >> 2; d |= d >> 1; return d & 0x0000000100000001ULL; }
static inline uint64_t lanes_changed_8(uint64_t d) { return d != 0; }

#define CHANGES_BLOCK 32 /* 16 and 64 measured alike on bf16 at 1.3% changed; 128 slower */
/* Record the changed element at byte offset at_ (its index and both values) while there is room; count it always. */
#define EMIT_CHANGE(W, at_)                                                                                      \
    do {                                                                                                         \
        const Py_ssize_t at = (at_);                                                                             \
        if (count < cap) {                                                                                       \
            idx[count] = at / W;                                                                                 \
            memcpy(nv + count * W, n + at, W);                                                                   \
            memcpy(bv + count * W, b + at, W);                                                                   \
        }                                                                                                        \
        count++;                                                                                                 \
    } while (0)
/* The last elements, fewer than a block: compared one by one. */
#define EMIT_TAIL(W)                                                                                             \
    for (; off + W <= bytes; off += W)                                                                           \
        if (memcmp(n + off, b + off, W))                                                                         \
            EMIT_CHANGE(W, off)
#define CHANGES_LOOP(W)                                                                                          \
    static Py_ssize_t find_changes_##W(const uint8_t *n, const uint8_t *b, Py_ssize_t bytes, int64_t *idx,      \
                                       uint8_t *nv, uint8_t *bv, Py_ssize_t cap) {                              \
        Py_ssize_t count = 0, off = 0;                                                                           \
        const Py_ssize_t blocks = bytes - bytes % CHANGES_BLOCK;                                                 \
        for (; off < blocks; off += CHANGES_BLOCK) {                                                             \
            uint64_t acc = 0;                                                                                    \
            for (int j = 0; j < CHANGES_BLOCK; j += 8) {                                                         \
                uint64_t x, y;                                                                                   \
                memcpy(&x, n + off + j, 8);                                                                      \
                memcpy(&y, b + off + j, 8);                                                                      \
                acc |= x ^ y;                                                                                    \
            }                                                                                                    \
            if (!acc)                                                                                            \
                continue;                                                                                        \
            for (int j = 0; j < CHANGES_BLOCK; j += 8) {                                                         \
                uint64_t x, y;                                                                                   \
                memcpy(&x, n + off + j, 8);                                                                      \
                memcpy(&y, b + off + j, 8);                                                                      \
                uint64_t m = lanes_changed_##W(x ^ y);                                                           \
                for (; m; m &= m - 1)                                                                            \
                    EMIT_CHANGE(W, off + j + (__builtin_ctzll(m) >> 3));                                         \
            }                                                                                                    \
        }                                                                                                        \
        EMIT_TAIL(W);                                                                                            \
        return count;                                                                                            \
    }
CHANGES_LOOP(1)
CHANGES_LOOP(2)
CHANGES_LOOP(4)
CHANGES_LOOP(8)

/* The same compare with AVX-512 on x86-64 hosts that have it (checked at run time): 64 bytes per compare, the
 * changed lanes' values packed together with a compress instead of one branch per changed element (the scalar
 * loop's cost at 1-5% changed is its mispredicted branches, ~15 ns per change). Same outputs as the scalar loops
 * (tests/codec/test_native.py compares them on every width, length and rate), including past the capacity:
 * what fits is written, the rest only counted. Widths 2, 4 and 8; width 1 (headers, blobs) stays scalar. */
/* Compilers that know the avx512vbmi2 target (GCC 8, clang 6 and later); older ones build the scalar loops only. */
#if defined(__x86_64__) && ((defined(__clang__) && __clang_major__ >= 6) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 8))
#include <immintrin.h>
#define HAVE_SIMD_CHANGES 1
#define SIMD_TARGET __attribute__((target("avx512f,avx512bw,avx512vbmi2")))

/* A block's changed lanes (bit l of m for lane l) through the scalar emit, lowest first: where the vector store
 * lacks room past count. */
#define EMIT_LANES(W, m_)                                                                                        \
    for (uint64_t mm = (m_); mm; mm &= mm - 1)                                                                   \
        EMIT_CHANGE(W, off + (Py_ssize_t)__builtin_ctzll(mm) * W)

/* Store one 64-byte block's c changed lanes (mask m of new x against base y) at idx, nv and bv, packed lowest
 * first, as int64 element indexes from first and as values; nothing past the c-th entry is written. */
SIMD_TARGET static inline void store_block_2(__m512i x, __m512i y, __mmask32 m, int c, int64_t *idx, uint8_t *nv,
                                             uint8_t *bv, int64_t first) {
    const __m512i iota = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13,
                                          12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __mmask32 low = (__mmask32)(c == 32 ? 0xFFFFFFFFu : (1u << c) - 1);
    uint16_t lanes[32];
    _mm512_mask_storeu_epi16(nv, low, _mm512_maskz_compress_epi16(m, x));
    _mm512_mask_storeu_epi16(bv, low, _mm512_maskz_compress_epi16(m, y));
    _mm512_storeu_si512(lanes, _mm512_maskz_compress_epi16(m, iota));
    const __m512i add = _mm512_set1_epi64(first);
    for (int j = 0; j < c; j += 8) {
        const __m512i v = _mm512_add_epi64(_mm512_cvtepu16_epi64(_mm_loadu_si128((const __m128i *)(lanes + j))), add);
        _mm512_mask_storeu_epi64(idx + j, (__mmask8)(c - j >= 8 ? 0xFF : (1u << (c - j)) - 1), v);
    }
}

SIMD_TARGET static inline void store_block_4(__m512i x, __m512i y, __mmask16 m, int c, int64_t *idx, uint8_t *nv,
                                             uint8_t *bv, int64_t first) {
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __mmask16 low = (__mmask16)((1u << c) - 1);
    _mm512_mask_storeu_epi32(nv, low, _mm512_maskz_compress_epi32(m, x));
    _mm512_mask_storeu_epi32(bv, low, _mm512_maskz_compress_epi32(m, y));
    const __m512i at = _mm512_maskz_compress_epi32(m, iota), add = _mm512_set1_epi64(first);
    _mm512_mask_storeu_epi64(idx, (__mmask8)(low & 0xFF),
                             _mm512_add_epi64(_mm512_cvtepu32_epi64(_mm512_castsi512_si256(at)), add));
    if (c > 8)
        _mm512_mask_storeu_epi64(idx + 8, (__mmask8)(low >> 8),
                                 _mm512_add_epi64(_mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(at, 1)), add));
}

SIMD_TARGET static inline void store_block_8(__m512i x, __m512i y, __mmask8 m, int c, int64_t *idx, uint8_t *nv,
                                             uint8_t *bv, int64_t first) {
    const __m512i iota = _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0);
    const __mmask8 low = (__mmask8)((1u << c) - 1);
    _mm512_mask_storeu_epi64(nv, low, _mm512_maskz_compress_epi64(m, x));
    _mm512_mask_storeu_epi64(bv, low, _mm512_maskz_compress_epi64(m, y));
    _mm512_mask_storeu_epi64(idx, low, _mm512_add_epi64(_mm512_maskz_compress_epi64(m, iota), _mm512_set1_epi64(first)));
}

/* The loop for width W: a 64-byte block with no change costs one compare and one branch; a block whose changes do
 * not all fit past count takes the scalar emit (what fits is written, the rest counted); the tail shorter than a
 * block is compared element by element. */
#define SIMD_CHANGES_LOOP(W, MASK, CMP)                                                                          \
    SIMD_TARGET static Py_ssize_t find_changes_##W##_simd(const uint8_t *n, const uint8_t *b, Py_ssize_t bytes,   \
                                                          int64_t *idx, uint8_t *nv, uint8_t *bv, Py_ssize_t cap) { \
        Py_ssize_t count = 0, off = 0;                                                                           \
        const Py_ssize_t blocks = bytes - bytes % 64;                                                            \
        for (; off < blocks; off += 64) {                                                                        \
            const __m512i x = _mm512_loadu_si512(n + off), y = _mm512_loadu_si512(b + off);                      \
            const MASK m = CMP(x, y);                                                                            \
            if (!m)                                                                                              \
                continue;                                                                                        \
            const int c = __builtin_popcount(m);                                                                 \
            if (count + c <= cap)                                                                                \
                store_block_##W(x, y, m, c, idx + count, nv + count * W, bv + count * W, off / W);               \
            else if (count < cap) {                                                                              \
                EMIT_LANES(W, m);                                                                                \
                continue;                                                                                        \
            }                                                                                                    \
            count += c;                                                                                          \
        }                                                                                                        \
        EMIT_TAIL(W);                                                                                            \
        return count;                                                                                            \
    }
SIMD_CHANGES_LOOP(2, __mmask32, _mm512_cmpneq_epu16_mask)
SIMD_CHANGES_LOOP(4, __mmask16, _mm512_cmpneq_epu32_mask)
SIMD_CHANGES_LOOP(8, __mmask8, _mm512_cmpneq_epu64_mask)

/* AVX2 hosts (x86-64 without AVX-512: AMD Zen 2 and 3, older Intel) have no compress instruction: the changed
 * lanes of each 16-byte half (width 2) or 32-byte vector (width 4) are moved to the front by a byte shuffle or a lane
 * permute from a table indexed by the lane mask, built at import. Each store writes a whole vector, so a block
 * needs room for all its lanes past count (else the scalar emit); entries past count are scratch, as the caller
 * keeps only the first count. No pext: it is microcoded, and slow, on AMD before Zen 3. */
#define AVX2_TARGET __attribute__((target("avx2,popcnt")))
static uint8_t SHUF16[256][16]; /* pshufb control: the set lanes of an 8-lane mask, 2 bytes each, to the front */
static uint8_t LANES8[256][8];   /* the set lanes of an 8-lane mask, lowest first (the rest 0) */
static uint32_t PERM32[256][8];  /* the same as 32-bit lane indexes for vpermd */

static void build_lane_tables(void) {
    for (int m = 0; m < 256; m++) {
        int k = 0;
        memset(SHUF16[m], 0x80, 16);
        for (int l = 0; l < 8; l++)
            if (m >> l & 1) {
                SHUF16[m][2 * k] = (uint8_t)(2 * l);
                SHUF16[m][2 * k + 1] = (uint8_t)(2 * l + 1);
                LANES8[m][k] = (uint8_t)l;
                PERM32[m][k] = (uint32_t)l;
                k++;
            }
        for (; k < 8; k++)
            LANES8[m][k] = 0, PERM32[m][k] = 0;
    }
}

/* Eight int64 indexes first + lanes[0..7] at out (a whole vector: room checked by the caller). */
AVX2_TARGET static inline void store_lanes8(int64_t *out, const uint8_t *lanes, int64_t first) {
    const __m256i l32 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)lanes));
    const __m256i add = _mm256_set1_epi64x(first);
    _mm256_storeu_si256((__m256i *)out, _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(l32)), add));
    _mm256_storeu_si256((__m256i *)(out + 4), _mm256_add_epi64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(l32, 1)), add));
}

/* The changed lanes of a 32-byte block of new x against base y, bit l for lane l. */
AVX2_TARGET static inline unsigned avx2_mask_2(__m256i x, __m256i y) {
    /* Each 16-bit compare result packed to one byte per lane: lanes 0-7 in bits 0-7, lanes 8-15 in 16-23. */
    const __m256i eq = _mm256_packs_epi16(_mm256_cmpeq_epi16(x, y), _mm256_setzero_si256());
    const unsigned m = ~(unsigned)_mm256_movemask_epi8(eq) & 0x00FF00FFu;
    return (m & 0xFF) | (m >> 8 & 0xFF00);
}

AVX2_TARGET static inline unsigned avx2_mask_4(__m256i x, __m256i y) {
    return ~(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(x, y))) & 0xFFu;
}

/* Store the block's changed lanes (mask m) at idx, nv and bv, packed lowest first, as whole vectors (room for all
 * the block's lanes); returns how many changed. */
AVX2_TARGET static inline int avx2_store_2(__m256i x, __m256i y, unsigned m, int64_t *idx, uint8_t *nv, uint8_t *bv,
                                           int64_t first) {
    const unsigned lo = m & 0xFF, hi = m >> 8;
    const int c = __builtin_popcount(lo);
    const __m128i s0 = _mm_loadu_si128((const __m128i *)SHUF16[lo]), s1 = _mm_loadu_si128((const __m128i *)SHUF16[hi]);
    _mm_storeu_si128((__m128i *)nv, _mm_shuffle_epi8(_mm256_castsi256_si128(x), s0));
    _mm_storeu_si128((__m128i *)bv, _mm_shuffle_epi8(_mm256_castsi256_si128(y), s0));
    store_lanes8(idx, LANES8[lo], first);
    _mm_storeu_si128((__m128i *)(nv + 2 * c), _mm_shuffle_epi8(_mm256_extracti128_si256(x, 1), s1));
    _mm_storeu_si128((__m128i *)(bv + 2 * c), _mm_shuffle_epi8(_mm256_extracti128_si256(y, 1), s1));
    store_lanes8(idx + c, LANES8[hi], first + 8);
    return c + __builtin_popcount(hi);
}

AVX2_TARGET static inline int avx2_store_4(__m256i x, __m256i y, unsigned m, int64_t *idx, uint8_t *nv, uint8_t *bv,
                                           int64_t first) {
    const __m256i perm = _mm256_loadu_si256((const __m256i *)PERM32[m]);
    _mm256_storeu_si256((__m256i *)nv, _mm256_permutevar8x32_epi32(x, perm));
    _mm256_storeu_si256((__m256i *)bv, _mm256_permutevar8x32_epi32(y, perm));
    store_lanes8(idx, LANES8[m], first);
    return __builtin_popcount(m);
}

/* The loop for width W: 32-byte blocks; one with no change costs one compare and one branch, one without room for
 * all its lanes past count takes the scalar emit; the tail shorter than a block is compared element by element. */
#define AVX2_CHANGES_LOOP(W)                                                                                     \
    AVX2_TARGET static Py_ssize_t find_changes_##W##_avx2(const uint8_t *n, const uint8_t *b, Py_ssize_t bytes,   \
                                                          int64_t *idx, uint8_t *nv, uint8_t *bv, Py_ssize_t cap) { \
        Py_ssize_t count = 0, off = 0;                                                                           \
        const Py_ssize_t blocks = bytes - bytes % 32;                                                            \
        for (; off < blocks; off += 32) {                                                                        \
            const __m256i x = _mm256_loadu_si256((const __m256i *)(n + off));                                   \
            const __m256i y = _mm256_loadu_si256((const __m256i *)(b + off));                                   \
            const unsigned m = avx2_mask_##W(x, y);                                                              \
            if (!m)                                                                                              \
                continue;                                                                                        \
            if (count + 32 / W <= cap) {                                                                         \
                count += avx2_store_##W(x, y, m, idx + count, nv + count * W, bv + count * W, off / W);          \
                continue;                                                                                        \
            }                                                                                                    \
            EMIT_LANES(W, m);                                                                                    \
        }                                                                                                        \
        EMIT_TAIL(W);                                                                                            \
        return count;                                                                                            \
    }
AVX2_CHANGES_LOOP(2)
AVX2_CHANGES_LOOP(4)

/* The best vector compare this CPU (and the OS, which must save the wider registers: libgcc checks XCR0) runs: 2 for
 * the AVX-512 loops, 1 for the AVX2 ones, 0 for none. */
static int simd_supported(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vbmi2"))
        return 2;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt") ? 1 : 0;
}
#else
static void build_lane_tables(void) {}
static int simd_supported(void) { return 0; }
#endif
static int simd_ok = -1; /* simd_supported(), asked once at import */

static Py_ssize_t find_changes(const uint8_t *n, const uint8_t *b, Py_ssize_t elements, int width, int64_t *idx,
                               uint8_t *nv, uint8_t *bv, Py_ssize_t cap, int simd) {
    const Py_ssize_t bytes = elements * width;
#ifdef HAVE_SIMD_CHANGES
    const int level = simd < simd_ok ? simd : simd_ok;
    if (level >= 2) {
        switch (width) {
        case 2: return find_changes_2_simd(n, b, bytes, idx, nv, bv, cap);
        case 4: return find_changes_4_simd(n, b, bytes, idx, nv, bv, cap);
        case 8: return find_changes_8_simd(n, b, bytes, idx, nv, bv, cap);
        default: break;
        }
    } else if (level == 1) {
        switch (width) {
        case 2: return find_changes_2_avx2(n, b, bytes, idx, nv, bv, cap);
        case 4: return find_changes_4_avx2(n, b, bytes, idx, nv, bv, cap);
        default: break;
        }
    }
#else
    (void)simd;
#endif
    switch (width) {
    case 1: return find_changes_1(n, b, bytes, idx, nv, bv, cap);
    case 2: return find_changes_2(n, b, bytes, idx, nv, bv, cap);
    case 4: return find_changes_4(n, b, bytes, idx, nv, bv, cap);
    default: return find_changes_8(n, b, bytes, idx, nv, bv, cap);
    }
}

/* The buffers changes() and changes_group() take: a width they compare, new and base alike, and outputs for the
 * same number of changes (idx_out 8-byte aligned). */
static inline int changes_buffers_ok(const Py_buffer *n, const Py_buffer *b, int width, const Py_buffer *idx,
                                     const Py_buffer *nv, const Py_buffer *bv) {
    return (width == 1 || width == 2 || width == 4 || width == 8) && n->len == b->len && n->len % width == 0 &&
           idx->len % 8 == 0 && ALIGNED8(*idx) && nv->len == (idx->len / 8) * width && bv->len == nv->len;
}

static PyObject *changes(PyObject *self, PyObject *args) {
    Py_buffer n, b, idx, nv, bv;
    int width, simd = 2;
    if (!PyArg_ParseTuple(args, "y*y*iw*w*w*|i", &n, &b, &width, &idx, &nv, &bv, &simd))
        return NULL;
    Py_ssize_t count = -1;
    if (changes_buffers_ok(&n, &b, width, &idx, &nv, &bv)) {
        Py_BEGIN_ALLOW_THREADS
        count = find_changes((const uint8_t *)n.buf, (const uint8_t *)b.buf, n.len / width, width, (int64_t *)idx.buf,
                             (uint8_t *)nv.buf, (uint8_t *)bv.buf, idx.len / 8, simd);
        Py_END_ALLOW_THREADS
    } else
        PyErr_SetString(PyExc_ValueError, "changes: width must be 1, 2, 4 or 8 and the buffers sized alike (idx_out 8-byte aligned)");
    PyBuffer_Release(&n);
    PyBuffer_Release(&b);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&nv);
    PyBuffer_Release(&bv);
    if (count < 0)
        return NULL;
    return PyLong_FromSsize_t(count);
}

/* changes_group(new, base, width, idx_out, new_out, base_out, simd, sparse_below) -> count or the sparse streams
 *
 * changes() and, where the changes fit the outputs and count / elements <= sparse_below (a double, compared as
 * Python compares count / elements with it), group() of them as one class of every element, in one call: the
 * tuple (count, k, unary, remainder, signs, big, big_k, big_unary, big_remainder, plane 0, ..., plane width - 1).
 * Otherwise (no changes, too many, or more than the outputs hold) the count, as changes() returns it, with what
 * fits written to the outputs. */
static PyObject *changes_group(PyObject *self, PyObject *args) {
    Py_buffer n, b, idx, nv, bv;
    int width, simd = 2;
    double below;
    if (!PyArg_ParseTuple(args, "y*y*iw*w*w*id", &n, &b, &width, &idx, &nv, &bv, &simd, &below))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t count = -1, elements = 0, cap = 0;
    if (changes_buffers_ok(&n, &b, width, &idx, &nv, &bv)) {
        elements = n.len / width;
        cap = idx.len / 8;
        Py_BEGIN_ALLOW_THREADS
        count = find_changes((const uint8_t *)n.buf, (const uint8_t *)b.buf, elements, width, (int64_t *)idx.buf,
                             (uint8_t *)nv.buf, (uint8_t *)bv.buf, cap, simd);
        Py_END_ALLOW_THREADS
    } else
        PyErr_SetString(PyExc_ValueError, "changes_group: width must be 1, 2, 4 or 8 and the buffers sized alike (idx_out 8-byte aligned)");
    if (count < 0)
        goto done;
    if (count == 0 || count > cap || !((double)count / (double)elements <= below)) { /* NaN: not sparse */
        result = PyLong_FromSsize_t(count);
        goto done;
    }
    {
        /* The wrapped differences new - base, in place over new_out (the caller's scratch). */
        uint8_t *x = (uint8_t *)nv.buf;
        const uint8_t *y = (const uint8_t *)bv.buf;
        switch (width) {
#define SUB_LOOP(W, T)                                                                                           \
    case W:                                                                                                      \
        for (Py_ssize_t i = 0; i < count; i++) {                                                                 \
            T p, q;                                                                                              \
            memcpy(&p, x + i * W, W);                                                                            \
            memcpy(&q, y + i * W, W);                                                                            \
            p = (T)(p - q);                                                                                      \
            memcpy(x + i * W, &p, W);                                                                            \
        }                                                                                                        \
        break;
            SUB_LOOP(1, uint8_t)
            SUB_LOOP(2, uint16_t)
            SUB_LOOP(4, uint32_t)
            SUB_LOOP(8, uint64_t)
#undef SUB_LOOP
        }
        result = group_streams((const int64_t *)idx.buf, count, x, width, elements, 1);
    }
done:
    PyBuffer_Release(&n);
    PyBuffer_Release(&b);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&nv);
    PyBuffer_Release(&bv);
    return result;
}

/* The gamma codec (manifests/FORMAT.md, "gamma"): every element's zigzag difference z as its bit length L
 * (0 for z = 0), Rice-coded as the zigzag of L - center, and the L - 1 bits of z below its leading one.
 * Widths 1, 2 and 4 only (z < 2**32: its bit length and low bits fit the 64-bit accumulators below).
 */
static inline uint32_t zz_at(const uint8_t *nb, const uint8_t *bb, Py_ssize_t i, int width) {
    switch (width) {
    case 1: { uint8_t d = (uint8_t)(nb[i] - bb[i]); return (uint8_t)((uint8_t)(d << 1) ^ (uint8_t)(0 - (d >> 7))); }
    case 2: {
        uint16_t x, y;
        memcpy(&x, nb + 2 * i, 2);
        memcpy(&y, bb + 2 * i, 2);
        uint16_t d = (uint16_t)(x - y);
        return (uint16_t)((uint16_t)(d << 1) ^ (uint16_t)(0 - (d >> 15)));
    }
    default: {
        uint32_t x, y;
        memcpy(&x, nb + 4 * i, 4);
        memcpy(&y, bb + 4 * i, 4);
        uint32_t d = x - y;
        return (d << 1) ^ (0u - (d >> 31));
    }
    }
}

/* 0 for 0 without a branch: z's bit length is one less than that of 2z + 1 (never 0, so clz is defined). */
static inline int bit_length(uint32_t z) { return 63 - __builtin_clzll(((uint64_t)z << 1) | 1); }

static void plan_lengths(const int64_t *h, Py_ssize_t m, int64_t out[5]);

/* How many bytes a coder of the three bits below each leading one, by their frequencies per bit length, would save
 * against storing them as they are (gamma does): sum over lengths L >= 4 of 3 n_L - n_L H_L bits, H_L the empirical
 * entropy of those bits among the n_L elements of length L, less Miller-Madow's (K_L - 1) / (2 ln 2) bits for the
 * K_L values that occur (the empirical entropy of a few hundred draws reads low), over 8, and never below 0.
 * top[8 L + t] counts the elements of length L whose three bits are t, for L < m. deltafs.codec.gamma._skew is the
 * same sum in numpy (the same order of terms).
 */
#ifndef M_LN2
#define M_LN2 0.69314718055994530942
#endif
static double lowbits_skew(const int64_t *top, Py_ssize_t m) {
    double saved = 0;
    for (Py_ssize_t L = 4; L < m; L++) {
        const int64_t *row = top + 8 * L;
        int64_t n = 0;
        int kinds = 0;
        for (int t = 0; t < 8; t++) {
            n += row[t];
            kinds += row[t] > 0;
        }
        if (!n)
            continue;
        double bits = 3.0 * (double)n - (double)(kinds - 1) / (2.0 * M_LN2);
        for (int t = 0; t < 8; t++)
            if (row[t])
                bits += (double)row[t] * log2((double)row[t] / (double)n);
        saved += bits;
    }
    return saved > 0 ? saved / 8 : 0;
}

/* z's bit length without bsr (slow on AMD Zen 1/2: ~4 cycles): the exponent of 2z + 1 as a double (exact, below
 * 2**33), less one. On targets with a fast count-leading-zeros the original bit_length is as good. */
static inline int bit_length_fast(uint32_t z) {
#if defined(__x86_64__) && !defined(__LZCNT__)
    const double d = (double)(int64_t)(((uint64_t)z << 1) | 1);
    uint64_t b;
    memcpy(&b, &d, 8);
    return (int)(b >> 52) - 1023;
#else
    return bit_length(z);
#endif
}

/* The counts lengths() returns, of the n width-byte elements at nb against bb: h (8 * width + 1 entries) filled,
 * *repeats and *skew set, plan the layout of h; returns the changed count. */
static Py_ssize_t count_lengths(const uint8_t *nb, const uint8_t *bb, Py_ssize_t n, int width, int64_t *h,
                                Py_ssize_t *repeats_out, double *skew, int64_t plan[5]) {
    /* four tables, element i counted in table i % 4: back-to-back increments of one counter (a store-to-load
     * chain, ~5 cycles each) only every fourth element when one bin dominates */
    int64_t top4[4][33 * 8];
    memset(top4, 0, sizeof top4);
    Py_ssize_t repeats = 0, i = 0;
    uint32_t prev = 0;
    if (n > 0) {
        prev = zz_at(nb, bb, 0, width);
        const int L = bit_length_fast(prev);
        top4[0][8 * L + (L >= 4 ? (prev >> (L - 4)) & 7 : 0)]++;
        i = 1;
    }
    for (; i + 4 <= n; i += 4) {
        for (int t = 0; t < 4; t++) {
            const uint32_t z = zz_at(nb, bb, i + t, width);
            const int L = bit_length_fast(z);
            top4[(i + t) & 3][8 * L + ((z >> ((L - 4) & 31)) & 7 & (0u - (L >= 4)))]++;
            repeats += z == prev;
            prev = z;
        }
    }
    for (; i < n; i++) {
        const uint32_t z = zz_at(nb, bb, i, width);
        const int L = bit_length_fast(z);
        top4[i & 3][8 * L + (L >= 4 ? (z >> (L - 4)) & 7 : 0)]++;
        repeats += z == prev;
        prev = z;
    }
    int64_t top[33 * 8] = {0};
    for (int b = 0; b < 33 * 8; b++)
        top[b] = top4[0][b] + top4[1][b] + top4[2][b] + top4[3][b];
    for (int L = 0; L <= 8 * width; L++) {
        int64_t sum = 0;
        for (int t = 0; t < 8; t++)
            sum += top[8 * L + t];
        h[L] = sum;
    }
    *repeats_out = repeats;
    *skew = lowbits_skew(top, 8 * width + 1);
    plan_lengths(h, 8 * width + 1, plan);
    return n - (Py_ssize_t)h[0];
}

/* lengths(new, base, width, hist_out) -> (changed, repeats, skew, center, k, unary_bytes, remainder_bytes,
 *                                         mantissa_bytes)
 *
 * hist_out (int64, 8 * width + 1 entries): how many elements have each bit length of their zigzag difference.
 * repeats: how many elements have the same difference as the one before (a constant shift, or a few distinct
 * steps, which zstd on dense's byte planes codes far below their bit lengths); skew: lowbits_skew of the three bits
 * below the leading one, counted per bit length; then plan_lengths of hist.
 */
/* The buffers lengths() and counted() take: a gamma width, new and base alike, an int64 histogram of 8 * width + 1
 * lengths (8-byte aligned). */
static inline int lengths_buffers_ok(const Py_buffer *n, const Py_buffer *b, int width, const Py_buffer *hist) {
    return (width == 1 || width == 2 || width == 4) && n->len == b->len && n->len % width == 0 &&
           hist->len == (8 * width + 1) * 8 && ALIGNED8(*hist);
}

static PyObject *lengths(PyObject *self, PyObject *args) {
    Py_buffer nbuf, bbuf, hist;
    int width;
    if (!PyArg_ParseTuple(args, "y*y*iw*", &nbuf, &bbuf, &width, &hist))
        return NULL;
    Py_ssize_t changed = -1, repeats = 0;
    double skew = 0;
    int64_t o[5];
    if (lengths_buffers_ok(&nbuf, &bbuf, width, &hist)) {
        RELEASE_GIL_IF(nbuf.len >= GIL_FROM)
        changed = count_lengths(nbuf.buf, bbuf.buf, nbuf.len / width, width, hist.buf, &repeats, &skew, o);
        TAKE_GIL()
    } else
        PyErr_SetString(PyExc_ValueError, "lengths: width must be 1, 2 or 4 and the buffers sized alike (hist_out 8-byte aligned)");
    PyBuffer_Release(&nbuf);
    PyBuffer_Release(&bbuf);
    PyBuffer_Release(&hist);
    if (changed < 0)
        return NULL;
    return Py_BuildValue("nndLLLLL", changed, repeats, skew, (long long)o[0], (long long)o[1], (long long)o[2],
                         (long long)o[3], (long long)o[4]);
}

/* The gamma layout of the lengths counted in h[0 .. m - 1]: out = (center, k, unary bytes, remainder bytes, low-bits
 * bytes). The center (between the shortest and the longest length that occur: one outside codes no smaller than
 * that end) and Rice parameter (0 .. 8) code the lengths in the fewest bytes of unary plus remainder stream, ties to
 * the smallest center, then the smallest k. Parameters above the bit length of a center's largest code are not
 * tried: from there every code is a lone one bit and a larger k only adds remainder bits. The same answer as
 * deltafs.codec.gamma.layout's numpy search over every pair (the tests hold the two to it).
 */
static void plan_lengths(const int64_t *h, Py_ssize_t m, int64_t out[5]) {
    int64_t n = 0, low = 0, count[65];
    int len[65], used = 0;
    for (Py_ssize_t L = 0; L < m; L++) {
        n += h[L];
        low += L > 1 ? (L - 1) * h[L] : 0;
        if (h[L]) { /* only the lengths that occur */
            len[used] = (int)L;
            count[used++] = h[L];
        }
    }
    int64_t best = -1, best_unary = 0;
    int best_c = 0, best_k = 0;
    const int lo = used ? len[0] : 0, hi = used ? len[used - 1] : 0;
    for (int c = lo; c <= hi; c++) {
        const int64_t gmax = 2 * (int64_t)(hi - c) > 2 * (int64_t)(c - lo) - 1 ? 2 * (int64_t)(hi - c)
                                                                                : 2 * (int64_t)(c - lo) - 1;
        const int kmax = gmax > 0 ? (64 - __builtin_clzll((uint64_t)gmax) < 8 ? 64 - __builtin_clzll((uint64_t)gmax) : 8)
                                  : 0;
        for (int k = 0; k <= kmax; k++) {
            /* Every code takes at least its one bit, so no pair (c, k' >= k) costs less than this bound, which
             * grows with k: once it reaches the best cost, larger parameters cannot replace it (only a smaller
             * cost does). The same answer as the full search, in a fraction of the pairs. */
            if (best >= 0 && (n + 7) / 8 + (n * k + 7) / 8 >= best)
                break;
            int64_t bits = 0;
            for (int j = 0; j < used; j++) {
                const int64_t s = len[j] - c, g = s >= 0 ? 2 * s : -2 * s - 1;
                bits += ((g >> k) + 1) * count[j];
            }
            const int64_t cost = (bits + 7) / 8 + (n * k + 7) / 8;
            if (best < 0 || cost < best) {
                best = cost;
                best_c = c;
                best_k = k;
                best_unary = (bits + 7) / 8;
            }
        }
    }
    out[0] = best_c;
    out[1] = best_k;
    out[2] = best_unary;
    out[3] = (n * best_k + 7) / 8;
    out[4] = (low + 7) / 8;
}

/* plan(hist) -> (center, k, unary_bytes, remainder_bytes, mantissa_bytes): plan_lengths of hist (int64). */
static PyObject *gamma_plan(PyObject *self, PyObject *args) {
    Py_buffer hist;
    if (!PyArg_ParseTuple(args, "y*", &hist))
        return NULL;
    const Py_ssize_t m = hist.len / 8;
    if (hist.len % 8 || m < 1 || m > 65 || !ALIGNED8(hist)) {
        PyBuffer_Release(&hist);
        PyErr_SetString(PyExc_ValueError, "plan: hist must be 1 to 65 int64 counts, 8-byte aligned");
        return NULL;
    }
    int64_t o[5];
    plan_lengths(hist.buf, m, o);
    PyBuffer_Release(&hist);
    return Py_BuildValue("LLLLL", (long long)o[0], (long long)o[1], (long long)o[2], (long long)o[3],
                         (long long)o[4]);
}

/* gamma(new, base, width, center, k, unary_len, remainder_len, payload_out) -> None
 *
 * The gamma codec's three streams, one after the other, into payload_out, whose last 8 bytes are left for the
 * trailer: the unary stream of unary_len bytes, the remainder stream of remainder_len, the low bits in the rest
 * (the caller computed the sizes with plan(); ValueError if the streams come out another size).
 * 0 <= center <= 8 * width, 0 <= k <= 8.
 */
#define GAMMA_BLOCK 256 /* elements per block of gamma_streams: the block's codes stay in L1 */

/* An MSB-first writer whose accumulator holds the pending bits left-aligned (fewer than 8 between puts) and
 * stores 8 bytes on every put: only the whole bytes count, the rest is written over by the next store. */
typedef struct {
    uint8_t *buf;
    Py_ssize_t len, pos;
    uint64_t acc;
    unsigned nacc; /* < 8 between puts */
} gwriter;

/* v < 2**n, n + nacc <= 63 (so n <= 56), buf + pos + 8 within the writable memory. */
static inline void gw_put_fast(gwriter *w, uint64_t v, unsigned n) {
    const uint64_t a = w->acc | (v << ((64 - n - w->nacc) & 63)); /* n + nacc = 0 only with v = 0: shift 0 */
    const unsigned c = w->nacc + n;
    const uint64_t be = __builtin_bswap64(a);
    memcpy(w->buf + w->pos, &be, 8);
    w->pos += c >> 3;
    w->acc = a << (c & 56);
    w->nacc = c & 7;
}

/* The same bits, byte by byte, never past len (bytes beyond are counted, not written). n <= 56. */
static inline void gw_put_safe(gwriter *w, uint64_t v, unsigned n) {
    w->acc |= v << ((64 - n - w->nacc) & 63);
    w->nacc += n;
    while (w->nacc >= 8) {
        if (w->pos >= 0 && w->pos < w->len)
            w->buf[w->pos] = (uint8_t)(w->acc >> 56);
        w->pos++;
        w->acc <<= 8;
        w->nacc -= 8;
    }
}
static inline void gw_zeros_one_safe(gwriter *w, uint32_t q) { /* q zeros then a one */
    while (q > 48) {
        gw_put_safe(w, 0, 48);
        q -= 48;
    }
    gw_put_safe(w, 1, q + 1);
}
static inline void gw_flush(gwriter *w) {
    if (w->nacc) {
        if (w->pos >= 0 && w->pos < w->len)
            w->buf[w->pos] = (uint8_t)(w->acc >> 56);
        w->pos++;
        w->acc = 0;
        w->nacc = 0;
    }
}

/* Block codes: low[i] the number of low bits, mval[i] those bits, q[i] the unary zeros, rem[i] the remainder. */
static inline void gcodes_scalar(const uint8_t *nb, const uint8_t *bb, Py_ssize_t i0, int cnt, int width, int center,
                                 int k, uint32_t *low, uint32_t *mval, uint32_t *q, uint32_t *rem) {
    const uint32_t kmask = (1u << k) - 1;
    for (int j = 0; j < cnt; j++) {
        const uint32_t z = zz_at(nb, bb, i0 + j, width);
        const int L = bit_length(z), s = L - center, lo = L - (L > 0);
        const uint32_t g = ((uint32_t)s << 1) ^ (uint32_t)(s >> 31);
        low[j] = (uint32_t)lo;
        mval[j] = z & ((1u << lo) - 1);
        q[j] = g >> k;
        rem[j] = g & kmask;
    }
}

#if defined(__SSE2__)
static inline void gcodes_sse2_w4(const uint8_t *nb, const uint8_t *bb, Py_ssize_t i0, int cnt, int center, int k,
                                  uint32_t *low, uint32_t *mval, uint32_t *q, uint32_t *rem) {
    const __m128i c125 = _mm_set1_epi32(125), cen = _mm_set1_epi32(center), one = _mm_set1_epi32(1),
                  kmask = _mm_set1_epi32((1 << k) - 1);
    const __m128i kk = _mm_cvtsi32_si128(k);
    int j = 0;
    for (; j + 4 <= cnt; j += 4) {
        const __m128i x = _mm_sub_epi32(_mm_loadu_si128((const __m128i *)(nb + 4 * (i0 + j))),
                                        _mm_loadu_si128((const __m128i *)(bb + 4 * (i0 + j))));
        const __m128i z = _mm_xor_si128(_mm_slli_epi32(x, 1), _mm_srai_epi32(x, 31));
        /* t: z's leading one moved down one place, the bit below it cleared (no rounding up to the next power of
         * two), below 2**31: its float's exponent is exactly L - 2 for z >= 2; t = 0 for z = 0 or 1. */
        const __m128i t = _mm_srli_epi32(_mm_andnot_si128(_mm_srli_epi32(z, 1), z), 1);
        const __m128i fb = _mm_castps_si128(_mm_cvtepi32_ps(t));
        const __m128i e = _mm_srli_epi32(fb, 23);
        const __m128i small = _mm_cmpeq_epi32(t, _mm_setzero_si128()); /* z < 2: L = z */
        const __m128i L = _mm_or_si128(_mm_and_si128(small, z), _mm_andnot_si128(small, _mm_sub_epi32(e, c125)));
        /* 2**(L-2) from the exponent alone, doubled: the leading one of z (for z >= 2) */
        const __m128i p = _mm_cvttps_epi32(_mm_castsi128_ps(_mm_slli_epi32(e, 23)));
        const __m128i mv = _mm_andnot_si128(small, _mm_sub_epi32(z, _mm_add_epi32(p, p)));
        const __m128i lo = _mm_sub_epi32(L, _mm_andnot_si128(_mm_cmpeq_epi32(L, _mm_setzero_si128()), one));
        const __m128i s = _mm_sub_epi32(L, cen);
        const __m128i g = _mm_xor_si128(_mm_slli_epi32(s, 1), _mm_srai_epi32(s, 31));
        _mm_storeu_si128((__m128i *)(low + j), lo);
        _mm_storeu_si128((__m128i *)(mval + j), mv);
        _mm_storeu_si128((__m128i *)(q + j), _mm_srl_epi32(g, kk));
        _mm_storeu_si128((__m128i *)(rem + j), _mm_and_si128(g, kmask));
    }
    if (j < cnt)
        gcodes_scalar(nb, bb, i0 + j, cnt - j, 4, center, k, low + j, mval + j, q + j, rem + j);
}
#endif

/* Whether a block of cnt codes of lens[j] + extra bits each fits w's room with 16 bytes to spare: the fast paths'
 * 8-byte stores then stay inside the stream. */
static inline int gw_block_fits(const gwriter *w, const uint32_t *lens, int cnt, uint32_t extra) {
    uint64_t bits = 0;
    for (int j = 0; j < cnt; j++)
        bits += lens[j] + extra;
    return w->pos + (Py_ssize_t)(bits >> 3) + 16 <= w->len;
}

/* The three streams of the n width-byte elements at nb against bb into o (un_len + rem_len + man_len bytes);
 * 1 if they came out exactly those sizes. Per block of GAMMA_BLOCK elements: the codes first (four elements at a
 * time with SSE2 for width 4), then each stream in its own loop, without a branch on the data where the block's
 * bits fit the stream's room (a byte-at-a-time path, never past a stream's end, otherwise): 3.8 against 7.1-8.0 ns
 * per element on F32 steps (docs/profile.md, round 29). */
static int gamma_streams(const uint8_t *nb, const uint8_t *bb, Py_ssize_t n, int width, int center, int k,
                         uint8_t *o, Py_ssize_t un_len, Py_ssize_t rem_len, Py_ssize_t man_len) {
    gwriter u = {o, un_len, 0, 0, 0}, r = {o + un_len, rem_len, 0, 0, 0}, m = {o + un_len + rem_len, man_len, 0, 0, 0};
    uint32_t low[GAMMA_BLOCK], mval[GAMMA_BLOCK], q[GAMMA_BLOCK], rem[GAMMA_BLOCK];
    for (Py_ssize_t i0 = 0; i0 < n; i0 += GAMMA_BLOCK) {
        const int cnt = n - i0 < GAMMA_BLOCK ? (int)(n - i0) : GAMMA_BLOCK;
#if defined(__SSE2__)
        if (width == 4)
            gcodes_sse2_w4(nb, bb, i0, cnt, center, k, low, mval, q, rem);
        else
#endif
            gcodes_scalar(nb, bb, i0, cnt, width, center, k, low, mval, q, rem);
        /* The unary stream, two codes per store where they fit, on a copy of the writer (kept in registers). */
        if (gw_block_fits(&u, q, cnt, 1)) {
            gwriter w = u;
            int j = 0;
            for (; j + 2 <= cnt; j += 2) {
                const uint32_t a = q[j], b = q[j + 1], nn = a + b + 2;
                if (__builtin_expect(nn <= 56, 1))
                    gw_put_fast(&w, (2ull << b) | 1u, nn);
                else {
                    gw_zeros_one_safe(&w, a);
                    gw_zeros_one_safe(&w, b);
                }
            }
            for (; j < cnt; j++)
                gw_zeros_one_safe(&w, q[j]);
            u = w;
        } else
            for (int j = 0; j < cnt; j++)
                gw_zeros_one_safe(&u, q[j]);
        /* The low bits, two elements per store where they fit. */
        if (gw_block_fits(&m, low, cnt, 0)) {
            gwriter w = m;
            int j = 0;
            for (; j + 2 <= cnt; j += 2) {
                const uint32_t a = low[j], b = low[j + 1], nn = a + b;
                if (__builtin_expect(nn <= 56, 1))
                    gw_put_fast(&w, ((uint64_t)mval[j] << b) | mval[j + 1], nn);
                else {
                    gw_put_fast(&w, mval[j], a);
                    gw_put_fast(&w, mval[j + 1], b);
                }
            }
            for (; j < cnt; j++)
                gw_put_fast(&w, mval[j], low[j]);
            m = w;
        } else
            for (int j = 0; j < cnt; j++)
                gw_put_safe(&m, mval[j], low[j]);
        /* remainder stream: k bits each; blocks of 8 elements are k whole bytes */
        if (k) {
            int j = 0;
            if (r.nacc == 0 && r.pos + (Py_ssize_t)((cnt * k) >> 3) + 8 <= r.len) {
                for (; j + 8 <= cnt; j += 8) {
                    uint64_t w = 0;
                    for (int t = 0; t < 8; t++)
                        w = (w << k) | rem[j + t];
                    const uint64_t be = __builtin_bswap64(w << (64 - 8 * k));
                    memcpy(r.buf + r.pos, &be, 8);
                    r.pos += k;
                }
            }
            for (; j < cnt; j++)
                gw_put_safe(&r, rem[j], (unsigned)k);
        }
    }
    gw_flush(&u);
    gw_flush(&r);
    gw_flush(&m);
    return u.pos == un_len && r.pos == rem_len && m.pos == man_len;
}

static PyObject *gamma_encode(PyObject *self, PyObject *args) {
    Py_buffer nbuf, bbuf, out;
    Py_ssize_t un_len, rem_len;
    int width, center, k;
    if (!PyArg_ParseTuple(args, "y*y*iiinnw*", &nbuf, &bbuf, &width, &center, &k, &un_len, &rem_len, &out))
        return NULL;
    int ok = (width == 1 || width == 2 || width == 4) && nbuf.len == bbuf.len && nbuf.len % width == 0 &&
             center >= 0 && center <= 8 * width && k >= 0 && k <= 8 && un_len >= 0 && rem_len >= 0 &&
             out.len >= 8 && un_len <= out.len - 8 && rem_len <= out.len - 8 - un_len;
    if (ok) {
        RELEASE_GIL_IF(nbuf.len >= GIL_FROM)
        ok = gamma_streams(nbuf.buf, bbuf.buf, nbuf.len / width, width, center, k, out.buf, un_len, rem_len,
                           out.len - 8 - un_len - rem_len);
        TAKE_GIL()
        if (!ok)
            PyErr_SetString(PyExc_ValueError, "gamma: the streams do not have the sizes given");
    } else
        PyErr_SetString(PyExc_ValueError, "gamma: width must be 1, 2 or 4, center and k in range, buffers alike");
    PyBuffer_Release(&nbuf);
    PyBuffer_Release(&bbuf);
    PyBuffer_Release(&out);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
}

/* counted(new, base, width, hist_out, changed_from, payload_within, repeats_below, skew_below, written_from,
 *         digest) -> (*lengths(new, base, width, hist_out), payload or None)
 *
 * lengths(), and in the same call the whole gamma payload (the streams, then the trailer: digest(body) as 8
 * little-endian bytes, digest being xxhash.xxh3_64_intdigest) when changed > 0, the payload's bytes <=
 * payload_within * the chunk's bytes, and either the counts pass deltafs.codec's test for writing gamma without
 * trying another codec (changed >= changed_from * elements, repeats < repeats_below * elements, skew <
 * skew_below * the payload's bytes) or written_from * elements <= changed < changed_from * elements (a candidate
 * the caller tries others against); else None. Comparisons in double precision, as Python compares an int with a
 * float: exact at these sizes (a NaN share passes nothing).
 */
static PyObject *gamma_counted(PyObject *self, PyObject *args) {
    Py_buffer nbuf, bbuf, hist;
    int width;
    double changed_from, payload_within, repeats_below, skew_below, written_from;
    PyObject *digest;
    if (!PyArg_ParseTuple(args, "y*y*iw*dddddO", &nbuf, &bbuf, &width, &hist, &changed_from, &payload_within,
                          &repeats_below, &skew_below, &written_from, &digest))
        return NULL;
    PyObject *result = NULL, *payload = NULL;
    if (!lengths_buffers_ok(&nbuf, &bbuf, width, &hist)) {
        PyErr_SetString(PyExc_ValueError, "counted: width must be 1, 2 or 4 and the buffers sized alike (hist_out 8-byte aligned)");
        goto done;
    }
    const Py_ssize_t n = nbuf.len / width;
    Py_ssize_t changed, repeats;
    double skew;
    int64_t o[5];
    {
        RELEASE_GIL_IF(nbuf.len >= GIL_FROM)
        changed = count_lengths(nbuf.buf, bbuf.buf, n, width, hist.buf, &repeats, &skew, o);
        TAKE_GIL()
    }
    const int64_t size = o[2] + o[3] + o[4] + 8;
    const int alone = (double)changed >= changed_from * (double)n && (double)repeats < repeats_below * (double)n &&
                      skew < skew_below * (double)size;
    const int candidate = (double)changed >= written_from * (double)n && (double)changed < changed_from * (double)n;
    if (changed > 0 && (alone || candidate) && (double)size <= payload_within * (double)nbuf.len) {
        payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
        if (!payload)
            goto done;
        uint8_t *p = (uint8_t *)PyBytes_AS_STRING(payload);
        int ok;
        {
            RELEASE_GIL_IF(nbuf.len >= GIL_FROM)
            ok = gamma_streams(nbuf.buf, bbuf.buf, n, width, (int)o[0], (int)o[1], p, o[2], o[3], o[4]);
            TAKE_GIL()
        }
        if (!ok) {
            PyErr_SetString(PyExc_ValueError, "counted: the streams do not have the sizes planned");
            goto done;
        }
        /* The trailer, from the same hash function as every other payload's (deltafs.codec.streams.seal). */
        /* A view that holds a reference to the payload: a digest that keeps it cannot outlive the bytes. */
        PyObject *whole = PyMemoryView_FromObject(payload);
        if (!whole)
            goto done;
        PyObject *body = PySequence_GetSlice(whole, 0, (Py_ssize_t)size - 8);
        Py_DECREF(whole);
        if (!body)
            goto done;
        PyObject *h = PyObject_CallOneArg(digest, body);
        Py_DECREF(body);
        if (!h)
            goto done;
        const unsigned long long v = PyLong_AsUnsignedLongLong(h);
        Py_DECREF(h);
        if (v == (unsigned long long)-1 && PyErr_Occurred())
            goto done;
        for (int j = 0; j < 8; j++)
            p[size - 8 + j] = (uint8_t)(v >> (8 * j));
    } else {
        payload = Py_None;
        Py_INCREF(payload);
    }
    result = Py_BuildValue("nndLLLLLO", changed, repeats, skew, (long long)o[0], (long long)o[1], (long long)o[2],
                           (long long)o[3], (long long)o[4], payload);
done:
    Py_XDECREF(payload);
    PyBuffer_Release(&nbuf);
    PyBuffer_Release(&bbuf);
    PyBuffer_Release(&hist);
    return result;
}

/* A reader of an MSB-first stream that peeks 64 bits at any bit position: bytes past the end read as zeros, and
 * callers check at the end that no code reached past it (fr_end_ok). */
typedef struct {
    const uint8_t *buf;
    Py_ssize_t len;
    uint64_t bit; /* bits consumed */
} fastreader;

/* The 64 bits from r->bit on; while the stream lasts, at least the top 57 are its own. */
static inline uint64_t fr_peek(const fastreader *r) {
    const Py_ssize_t at = (Py_ssize_t)(r->bit >> 3);
    uint64_t w;
    if (__builtin_expect(at + 8 <= r->len, 1)) {
        memcpy(&w, r->buf + at, 8);
        w = __builtin_bswap64(w); /* little-endian hosts only (the caller checks) */
    } else {
        w = 0;
        for (int j = 0; j < 8; j++)
            w = (w << 8) | (at + j < r->len ? r->buf[at + j] : 0u);
    }
    return w << (r->bit & 7);
}

/* The stream ends exactly here: no whole byte left, nothing read past its end, and the padding bits are zero. */
static inline int fr_end_ok(const fastreader *r) {
    const uint64_t end = 8 * (uint64_t)r->len;
    if (r->bit > end || end - r->bit >= 8)
        return 0;
    const int pad = (int)(end - r->bit);
    return pad == 0 || (r->buf[r->len - 1] & ((1u << pad) - 1u)) == 0;
}

/* The n differences the three streams hold, into diff, checking them whole. Status as in decode_positions; it
 * accepts exactly the payloads the bit-by-bit reader before it did (a fuzz test of the two, 280,000 payloads valid
 * and damaged, found no difference), without a branch on the data but the rare unary code longer than 56 bits: 6.6
 * against 12 ns per element on F32 steps. */
static int gamma_pass(const uint8_t *un, Py_ssize_t un_len, const uint8_t *rem, Py_ssize_t rem_len,
                      const uint8_t *man, Py_ssize_t man_len, int width, int center, int k, Py_ssize_t n,
                      uint32_t *diff) {
    fastreader u = {un, un_len, 0}, r = {rem, rem_len, 0}, m = {man, man_len, 0};
    const uint32_t gmax = 2u * (uint32_t)(8 * width) + 1u; /* the largest zigzag of L - center that can be valid */
    const uint64_t uend = 8 * (uint64_t)un_len;
    const int top = 8 * width;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t w = fr_peek(&u);
        uint32_t q; /* the zeros before the next one bit */
        if (__builtin_expect(w != 0 && __builtin_clzll(w) < 57, 1)) {
            q = (uint32_t)__builtin_clzll(w);
            u.bit += q + 1;
        } else { /* a run of zeros longer than one peek sees, or the stream's end */
            q = 0;
            for (;;) {
                if (u.bit >= uend)
                    return WRONG_COUNT;
                w = fr_peek(&u);
                const int avail = (int)(uend - u.bit < 57 ? uend - u.bit : 57);
                if (w && __builtin_clzll(w) < avail) {
                    const int c = __builtin_clzll(w);
                    q += (uint32_t)c;
                    u.bit += (uint64_t)c + 1;
                    break;
                }
                q += (uint32_t)avail;
                u.bit += (uint64_t)avail;
                if (q > gmax)
                    return OUT_OF_RANGE;
            }
        }
        if (__builtin_expect(q > gmax, 0))
            return OUT_OF_RANGE;
        const uint32_t g = (q << k) | (uint32_t)((fr_peek(&r) >> 1) >> (63 - k)); /* k = 0 reads nothing */
        r.bit += (uint64_t)k;
        const int L = center + (int)((g >> 1) ^ (0u - (g & 1))); /* zigzag back: 0, 1, 2, 3 ... -> 0, -1, 1, -2 ... */
        if (__builtin_expect(L < 0 || L > top, 0))
            return OUT_OF_RANGE;
        const int low = L - (L > 0);
        const uint32_t z = (uint32_t)((1ULL << L) >> 1) | (uint32_t)((fr_peek(&m) >> 1) >> (63 - low));
        m.bit += (uint64_t)low;
        diff[i] = (z >> 1) ^ (0u - (z & 1));
    }
    if (!fr_end_ok(&u) || !fr_end_ok(&r) || !fr_end_ok(&m))
        return TRAILING_BYTES;
    return OK;
}

/* ungamma(body, unary_len, width, center, k, base, out) -> status
 *
 * body: the payload without its trailer, the three streams one after the other (the unary stream's length is
 * the record's; the remainder stream's follows from the element count). Checks them whole (every code in range,
 * no byte missing or left over, zero padding), then writes base + the decoded differences into out, which may
 * be base itself or overlap it otherwise: nothing is written unless all is well. A nonzero status leaves the
 * message to numpy's decode.
 */
static PyObject *gamma_decode(PyObject *self, PyObject *args) {
    Py_buffer body, base, out;
    Py_ssize_t unary_len;
    int width, center, k;
    if (!PyArg_ParseTuple(args, "y*niiiy*w*", &body, &unary_len, &width, &center, &k, &base, &out))
        return NULL;
    int status = -1;
    if ((width == 1 || width == 2 || width == 4) && base.len == out.len && out.len % width == 0 && center >= 0 &&
        center <= 8 * width && k >= 0 && k <= 8 && unary_len >= 0) {
        const Py_ssize_t n = out.len / width;
        const Py_ssize_t rem_len = (Py_ssize_t)(((uint64_t)n * (uint64_t)k + 7) / 8);
        if (unary_len > body.len || rem_len > body.len - unary_len) {
            status = SHORT_REMAINDER;
            goto done;
        }
        const uint8_t *un = body.buf, *rem = un + unary_len, *man = rem + rem_len;
        const Py_ssize_t man_len = body.len - unary_len - rem_len;
        uint32_t *diff = PyMem_RawMalloc(n ? (size_t)n * 4 : 1);
        const uint8_t *b = base.buf;
        uint8_t *o = out.buf;
        if (!diff)
            PyErr_NoMemory();
        else {
        RELEASE_GIL_IF(out.len >= GIL_FROM)
        status = gamma_pass(un, unary_len, rem, rem_len, man, man_len, width, center, k, n, diff);
        if (status == OK) { /* only now is out written: it may be the base */
            /* out[i] from base[i] alone, as memmove copies: from the end where out overlaps base from above, so
             * no element of base is read after it was written (exactly the base, or apart: either order). */
            const int backward = (uintptr_t)o > (uintptr_t)b && (uintptr_t)o < (uintptr_t)b + (uintptr_t)out.len;
            for (Py_ssize_t j = 0; j < n; j++) {
                const Py_ssize_t i = backward ? n - 1 - j : j;
                switch (width) {
                case 1: o[i] = (uint8_t)(b[i] + diff[i]); break;
                case 2: { uint16_t x; memcpy(&x, b + 2 * i, 2); x = (uint16_t)(x + diff[i]); memcpy(o + 2 * i, &x, 2); break; }
                default: { uint32_t x; memcpy(&x, b + 4 * i, 4); x += diff[i]; memcpy(o + 4 * i, &x, 4); break; }
                }
            }
        }
        TAKE_GIL()
        PyMem_RawFree(diff);
        }
    } else
        PyErr_SetString(PyExc_ValueError, "ungamma: width must be 1, 2 or 4, center and k in range, buffers alike");
done:
    PyBuffer_Release(&body);
    PyBuffer_Release(&base);
    PyBuffer_Release(&out);
    if (status < 0)
        return NULL;
    return PyLong_FromLong(status);
}

/* The sparse codec's class split (manifests/FORMAT.md, "sparse" with split > 0): element i of a chunk is in the
 * low class when its base value's magnitude (all bits but the top one, the sign of a float) is below split. The
 * classes are kept as bits, 64 elements to a word (bit j of word i: element 64 i + j), with the count of low
 * elements before each word; deltafs/codec/bitmap.py is the numpy form of the same words and counts.
 */
/* Set bits of x. Builds for the baseline x86-64 have no popcount instruction, and __builtin_popcountll then calls a
 * table lookup in libgcc; this is a dozen register operations. */
static inline int popcount64(uint64_t x) {
    x = x - ((x >> 1) & 0x5555555555555555ull);
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
    return (int)((x * 0x0101010101010101ull) >> 56);
}

static inline uint64_t magnitude_at(const uint8_t *b, Py_ssize_t i, int width) {
    switch (width) {
    case 1: return b[i] & 0x7Fu;
    case 2: { uint16_t v; memcpy(&v, b + 2 * i, 2); return v & 0x7FFFu; }
    case 4: { uint32_t v; memcpy(&v, b + 4 * i, 4); return v & 0x7FFFFFFFu; }
    default: { uint64_t v; memcpy(&v, b + 8 * i, 8); return v & 0x7FFFFFFFFFFFFFFFull; }
    }
}

/* The class bits of the m <= 64 elements from first. split must be at most the largest magnitude of the width. */
static uint64_t class_word(const uint8_t *b, Py_ssize_t first, int m, int width, uint64_t split) {
#if defined(__SSE2__)
    if (m == 64 && width <= 4) {
        /* Magnitudes and split fit the signed lanes, so a signed compare is exact; packing saturates -1 and 0. */
        const uint8_t *p = b + first * width;
        uint64_t w = 0;
        if (width == 1) {
            const __m128i mk = _mm_set1_epi8(0x7F), sp = _mm_set1_epi8((char)split);
            for (int q = 0; q < 4; q++) {
                const __m128i v = _mm_and_si128(_mm_loadu_si128((const __m128i *)(p + 16 * q)), mk);
                w |= (uint64_t)(uint32_t)_mm_movemask_epi8(_mm_cmplt_epi8(v, sp)) << (16 * q);
            }
        } else if (width == 2) {
            const __m128i mk = _mm_set1_epi16(0x7FFF), sp = _mm_set1_epi16((short)split);
            for (int q = 0; q < 4; q++) {
                const __m128i a = _mm_cmplt_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)(p + 32 * q)), mk), sp);
                const __m128i c = _mm_cmplt_epi16(_mm_and_si128(_mm_loadu_si128((const __m128i *)(p + 32 * q + 16)), mk), sp);
                w |= (uint64_t)(uint32_t)_mm_movemask_epi8(_mm_packs_epi16(a, c)) << (16 * q);
            }
        } else {
            const __m128i mk = _mm_set1_epi32(0x7FFFFFFF), sp = _mm_set1_epi32((int)split);
            for (int q = 0; q < 4; q++) {
                __m128i v[4];
                for (int r = 0; r < 4; r++)
                    v[r] = _mm_cmplt_epi32(_mm_and_si128(_mm_loadu_si128((const __m128i *)(p + 64 * q + 16 * r)), mk), sp);
                const __m128i lanes = _mm_packs_epi16(_mm_packs_epi32(v[0], v[1]), _mm_packs_epi32(v[2], v[3]));
                w |= (uint64_t)(uint32_t)_mm_movemask_epi8(lanes) << (16 * q);
            }
        }
        return w;
    }
#endif
    uint64_t w = 0;
    for (int j = 0; j < m; j++)
        w |= (uint64_t)(magnitude_at(b, first + j, width) < split) << j;
    return w;
}

static int split_fits(int width, unsigned long long split) {
    return (width == 1 || width == 2 || width == 4 || width == 8) && split <= (1ULL << (8 * width - 1)) - 1;
}

/* classes(base, width, split, words_out, before_out) -> low elements
 *
 * words_out: ceil(n / 64) uint64 class words of the base's n elements (padding bits past n clear); before_out: one
 * int64 more, before_out[i] = low elements in words 0..i-1.
 */
static PyObject *classes(PyObject *self, PyObject *args) {
    Py_buffer b, words, before;
    int width;
    unsigned long long split;
    if (!PyArg_ParseTuple(args, "y*iKw*w*", &b, &width, &split, &words, &before))
        return NULL;
    int64_t ones = -1;
    const Py_ssize_t n = split_fits(width, split) ? b.len / width : 0, nw = (n + 63) / 64;
    if (split_fits(width, split) && b.len % width == 0 && words.len == nw * 8 && before.len == (nw + 1) * 8) {
        const uint8_t *base = (const uint8_t *)b.buf;
        uint64_t *w = (uint64_t *)words.buf;
        int64_t *bf = (int64_t *)before.buf;
        Py_BEGIN_ALLOW_THREADS
        bf[0] = 0;
        for (Py_ssize_t i = 0; i < nw; i++) {
            const int m = n - 64 * i >= 64 ? 64 : (int)(n - 64 * i);
            w[i] = class_word(base, 64 * i, m, width, split);
            bf[i + 1] = bf[i] + popcount64(w[i]);
        }
        ones = bf[nw];
        Py_END_ALLOW_THREADS
    } else
        PyErr_SetString(PyExc_ValueError, "classes: width 1, 2, 4 or 8, split within its magnitudes, buffers sized alike");
    PyBuffer_Release(&b);
    PyBuffer_Release(&words);
    PyBuffer_Release(&before);
    if (ones < 0)
        return NULL;
    return PyLong_FromLongLong(ones);
}

/* partition(words, before, n, idx, diff, width, low_ranks, low_diff, high_ranks, high_diff) -> low changes
 *
 * For each change (element index idx[j] < n, its width-byte difference diff[j]), its rank within its class: the
 * low class's changes go to low_ranks and low_diff, the others to high_ranks and high_diff, each in idx's order.
 * Every output holds room for all the changes. ValueError for an index outside 0..n-1.
 */
static PyObject *partition(PyObject *self, PyObject *args) {
    Py_buffer words, before, idx, diff, lr, ld, hr, hd;
    Py_ssize_t n;
    int width;
    if (!PyArg_ParseTuple(args, "y*y*ny*y*iw*w*w*w*", &words, &before, &n, &idx, &diff, &width, &lr, &ld, &hr, &hd))
        return NULL;
    const Py_ssize_t c = idx.len / 8, nw = (n + 63) / 64;
    Py_ssize_t low = -1;
    int bad_index = 0;
    if ((width == 1 || width == 2 || width == 4 || width == 8) && n >= 0 && words.len == nw * 8 &&
        before.len == (nw + 1) * 8 && idx.len % 8 == 0 && diff.len == c * width && lr.len >= c * 8 &&
        hr.len >= c * 8 && ld.len >= c * width && hd.len >= c * width) {
        const uint64_t *w = (const uint64_t *)words.buf;
        const int64_t *bf = (const int64_t *)before.buf, *ix = (const int64_t *)idx.buf;
        const uint8_t *d = (const uint8_t *)diff.buf;
        int64_t *lrank = (int64_t *)lr.buf, *hrank = (int64_t *)hr.buf;
        uint8_t *ldiff = (uint8_t *)ld.buf, *hdiff = (uint8_t *)hd.buf;
        Py_ssize_t nl = 0, nh = 0;
        Py_BEGIN_ALLOW_THREADS
        /* One loop per width, so the copies of the differences are fixed-size moves, not calls. */
#define PARTITION_LOOP(W)                                                                                        \
        for (Py_ssize_t j = 0; j < c; j++) {                                                                     \
            const int64_t i = ix[j];                                                                             \
            if (i < 0 || i >= n) {                                                                               \
                bad_index = 1;                                                                                   \
                break;                                                                                           \
            }                                                                                                    \
            const uint64_t x = w[i >> 6];                                                                        \
            const int bit = (int)(i & 63), is_low = (int)(x >> bit & 1);                                         \
            const int64_t ones_before = bf[i >> 6] + popcount64(x & ((1ULL << bit) - 1));                       \
            /* Both sides written, one kept: the classes interleave at random, so a branch would mispredict.   \
             * nl + nh = j < c, so both slots are inside their arrays. */                                       \
            lrank[nl] = ones_before;                                                                             \
            hrank[nh] = i - ones_before;                                                                         \
            memcpy(ldiff + nl * W, d + j * W, W);                                                                \
            memcpy(hdiff + nh * W, d + j * W, W);                                                                \
            nl += is_low;                                                                                        \
            nh += !is_low;                                                                                       \
        }
        switch (width) {
        case 1: PARTITION_LOOP(1) break;
        case 2: PARTITION_LOOP(2) break;
        case 4: PARTITION_LOOP(4) break;
        default: PARTITION_LOOP(8) break;
        }
#undef PARTITION_LOOP
        low = nl;
        Py_END_ALLOW_THREADS
    } else
        PyErr_SetString(PyExc_ValueError, "partition: buffers sized unlike the classes and changes they hold");
    PyBuffer_Release(&words);
    PyBuffer_Release(&before);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&diff);
    PyBuffer_Release(&lr);
    PyBuffer_Release(&ld);
    PyBuffer_Release(&hr);
    PyBuffer_Release(&hd);
    if (bad_index) {
        PyErr_SetString(PyExc_ValueError, "partition: a change index outside the chunk");
        return NULL;
    }
    if (low < 0)
        return NULL;
    return PyLong_FromSsize_t(low);
}

/* SELECT8[b][k]: position of the k-th (0-based) set bit of byte b (8 where b has fewer). */
static uint8_t SELECT8[256][8];

static void build_select_table(void) {
    for (int b = 0; b < 256; b++) {
        int k = 0;
        for (int j = 0; j < 8; j++)
            SELECT8[b][j] = 8;
        for (int j = 0; j < 8; j++)
            if (b >> j & 1)
                SELECT8[b][k++] = (uint8_t)j;
    }
}

/* Position (0..63) of the k-th (0-based) set bit of x; x has more than k set bits. Broadword, without branches
 * (the ranks' words are random): the bytes' running popcounts in one multiply, the byte that holds the bit from
 * how many of them are <= k, then a table. */
static inline int select_in_word(uint64_t x, int k) {
    const uint64_t ones = 0x0101010101010101ull, high = 0x8080808080808080ull;
    uint64_t s = x - ((x >> 1) & 0x5555555555555555ull);
    s = (s & 0x3333333333333333ull) + ((s >> 2) & 0x3333333333333333ull);
    s = (s + (s >> 4)) & 0x0F0F0F0F0F0F0F0Full;
    const uint64_t cum = s * ones; /* byte i: set bits in bytes 0..i (at most 64, so no carries) */
    /* Byte i of (k | 0x80) - cum_i keeps its high bit exactly where cum_i <= k (k <= 63: no borrows). */
    const uint64_t le = ((((uint64_t)k * ones) | high) - cum) & high;
    const int byte = (int)(((le >> 7) * ones) >> 56); /* bytes wholly before the bit: 0..7 */
    const int prev = (int)(((cum << 8) >> (8 * byte)) & 0xFF);
    return 8 * byte + SELECT8[(x >> (8 * byte)) & 0xFF][(k - prev) & 7];
}

/* select(words, before, n, ranks, bit, out) -> status
 *
 * out[j]: the element index of the ranks[j]-th (0-based) element of class bit (1 low, 0 high) among the n
 * elements, ranks in any order. OUT_OF_RANGE when a rank is not below the class's size (nothing is promised
 * about out then).
 */
static PyObject *select_ranks(PyObject *self, PyObject *args) {
    Py_buffer words, before, ranks, out;
    Py_ssize_t n;
    int bit;
    if (!PyArg_ParseTuple(args, "y*y*ny*iw*", &words, &before, &n, &ranks, &bit, &out))
        return NULL;
    const Py_ssize_t nw = n >= 0 ? (n + 63) / 64 : 0, c = ranks.len / 8;
    int status = -1;
    if (n >= 0 && words.len == nw * 8 && before.len == (nw + 1) * 8 && ranks.len % 8 == 0 && out.len == ranks.len) {
        const uint64_t *w = (const uint64_t *)words.buf;
        const int64_t *bf = (const int64_t *)before.buf, *rk = (const int64_t *)ranks.buf;
        int64_t *o = (int64_t *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        /* Class elements in words 0..i-1; padding bits past n are clear, so for the high class the last word's
         * count runs past the class's size, which ranks below that size never reach. */
#define IN_CLASS_BEFORE(i) (bit ? bf[i] : 64 * (int64_t)(i) - bf[i])
        const int64_t size = bit ? bf[nw] : (int64_t)n - bf[nw];
        /* Every rank in range, and whether they ascend (a decoder's always do). */
        int ascending = 1;
        status = OK;
        for (Py_ssize_t j = 0; j < c; j++) {
            if (rk[j] < 0 || rk[j] >= size) {
                status = OUT_OF_RANGE;
                break;
            }
            ascending &= j == 0 || rk[j] >= rk[j - 1];
        }
        if (status == OK && ascending) {
            /* The word of each rank, as a merge of the ranks with the words' counts in one loop without branches
             * (each step places the rank or passes the word; ~2.5 words per change on the trained set's bf16).
             * A walk from the previous rank's word mispredicted its exits and took 1.2x as long; a binary search
             * per rank 1.8-2.6x. at + 1 <= nw throughout: the class's count before word nw is at least its size. */
            Py_ssize_t at = 0, j = 0;
            while (j < c) {
                const int take = rk[j] < IN_CLASS_BEFORE(at + 1);
                o[j] = at;
                j += take;
                at += !take;
            }
        } else if (status == OK) {
            for (Py_ssize_t j = 0; j < c; j++) { /* the last word whose count before it is <= the rank */
                Py_ssize_t lo = 0, hi = nw;
                while (hi - lo > 1) {
                    const Py_ssize_t mid = lo + (hi - lo) / 2;
                    if (IN_CLASS_BEFORE(mid) <= rk[j])
                        lo = mid;
                    else
                        hi = mid;
                }
                o[j] = lo;
            }
        }
        /* Within each word: independent from rank to rank, so these overlap. */
        for (Py_ssize_t j = 0; status == OK && j < c; j++) {
            const Py_ssize_t at = (Py_ssize_t)o[j];
            const uint64_t x = bit ? w[at] : ~w[at];
            o[j] = 64 * (int64_t)at + select_in_word(x, (int)(rk[j] - IN_CLASS_BEFORE(at)));
        }
#undef IN_CLASS_BEFORE
        Py_END_ALLOW_THREADS
    } else
        PyErr_SetString(PyExc_ValueError, "select: buffers sized unlike the classes and ranks they hold");
    PyBuffer_Release(&words);
    PyBuffer_Release(&before);
    PyBuffer_Release(&ranks);
    PyBuffer_Release(&out);
    if (status < 0)
        return NULL;
    return PyLong_FromLong(status);
}

/* n H2(c / n) bits, as f(n) - f(c) - f(n - c) with f(v) = v log2 v (0 below 1), in exactly the operations and order
 * of deltafs.codec.codecs._split_cost (Python floats and libm's log2 there), so both choose the same split. */
static inline double xlog2x(double v) { return v * log2(v > 1.0 ? v : 1.0); }

/* choose_split(base, width, stride, idx, idx_stride, shift, gain) -> split
 *
 * Histograms of magnitude >> shift over every stride-th element of the base and over the base values at every
 * idx_stride-th index of idx; for each boundary after a bin that holds a sample, the estimated bits of coding the
 * changes' positions in two classes (below it and the rest) against one; the first boundary that costs least,
 * as a magnitude (boundary << shift), or 0 when it does not cost at most gain times one class. Widths 1, 2, 4.
 * ValueError for an index outside the chunk.
 */
static PyObject *choose_split(PyObject *self, PyObject *args) {
    Py_buffer b, idx;
    int width, shift;
    Py_ssize_t stride, istride;
    double gain;
    if (!PyArg_ParseTuple(args, "y*iny*nid", &b, &width, &stride, &idx, &istride, &shift, &gain))
        return NULL;
    int ok = 0, bad_index = 0;
    long long split = 0;
    if ((width == 1 || width == 2 || width == 4) && shift >= 0 && shift < 8 * width && 8 * width - 1 - shift <= 16 &&
        stride > 0 && istride > 0 && b.len % width == 0 && idx.len % 8 == 0 && b.len > 0 && idx.len > 0) {
        const uint8_t *base = (const uint8_t *)b.buf;
        const int64_t *ix = (const int64_t *)idx.buf;
        const Py_ssize_t n = b.len / width, c = idx.len / 8, bins = (Py_ssize_t)1 << (8 * width - 1 - shift);
        int64_t *hist = calloc(2 * bins, sizeof(int64_t));
        if (!hist)
            return PyErr_NoMemory();
        Py_BEGIN_ALLOW_THREADS
        int64_t *hb = hist, *hc = hist + bins, sb = 0, sc = 0;
        for (Py_ssize_t i = 0; i < n; i += stride, sb++)
            hb[magnitude_at(base, i, width) >> shift]++;
        for (Py_ssize_t j = 0; j < c; j += istride, sc++) {
            if (ix[j] < 0 || ix[j] >= n) {
                bad_index = 1;
                break;
            }
            hc[magnitude_at(base, ix[j], width) >> shift]++;
        }
        if (!bad_index) {
            const double dn = (double)n, dc = (double)c, scale_n = dn / (double)sb, scale_c = dc / (double)sc;
            double best = INFINITY;
            int64_t cb = 0, cc = 0;
            for (Py_ssize_t k = 0; k < bins - 1; k++) {
                cb += hb[k];
                cc += hc[k];
                if (!hb[k] && !hc[k])
                    continue; /* the same classes as the boundary before: never the first that costs least */
                const double nh = (double)cb * scale_n, ch = (double)cc * scale_c;
                const double ah = nh - ch, nl = dn - nh, cl = dc - ch, al = nl - cl;
                if (ah < -0.5 || al < -0.5)
                    continue; /* the samples disagree: more changes than elements on one side */
                double cost = xlog2x(nh) - xlog2x(ch);
                cost -= xlog2x(ah);
                cost += xlog2x(nl);
                cost -= xlog2x(cl);
                cost -= xlog2x(al);
                if (cost < best) {
                    best = cost;
                    split = (long long)(k + 1) << shift;
                }
            }
            double whole = xlog2x(dn) - xlog2x(dc);
            whole -= xlog2x(dn - dc);
            if (!(best <= gain * whole))
                split = 0;
        }
        Py_END_ALLOW_THREADS
        free(hist);
        ok = !bad_index;
    } else
        PyErr_SetString(PyExc_ValueError, "choose_split: width 1, 2 or 4, strides > 0, at most 2**16 bins, a base and changes");
    PyBuffer_Release(&b);
    PyBuffer_Release(&idx);
    if (bad_index)
        PyErr_SetString(PyExc_ValueError, "choose_split: a change index outside the chunk");
    if (!ok)
        return NULL;
    return PyLong_FromLongLong(split);
}

static PyObject *simd(PyObject *self, PyObject *unused) { return PyLong_FromLong(simd_ok); }

static PyMethodDef methods[] = {
    {"positions", positions, METH_VARARGS, "positions(unary, remainder, count, k, end, out) -> status"},
    {"encode", encode, METH_VARARGS, "encode(gaps, k, unary_out, remainder_out) -> None"},
    {"apply", apply, METH_VARARGS, "apply(out, width, where, signs, big_at, big_values) -> status"},
    {"dense", dense, METH_VARARGS, "dense(planes, width, base, out) -> None"},
    {"ungroup", ungroup, METH_VARARGS,
     "ungroup(out, base, width, space, count, k, big, big_k, unary, remainder, signs, big_unary, big_remainder, "
     "planes) -> status"},
    {"codes", codes, METH_VARARGS, "codes(new, base, width, planes_out) -> changed"},
    {"changes", changes, METH_VARARGS,
     "changes(new, base, width, idx_out, new_out, base_out, simd=2) -> count (simd: the most vector level to use)"},
    {"simd", simd, METH_NOARGS, "simd() -> the vector compare changes() uses here: 2 AVX-512, 1 AVX2, 0 none"},
    {"signs", signs, METH_VARARGS, "signs(diff, width, signs_out, big_at_out, big_out) -> big"},
    {"lengths", lengths, METH_VARARGS, "lengths(new, base, width, hist_out) -> (changed, repeats, skew, *plan(hist_out))"},
    {"counted", gamma_counted, METH_VARARGS,
     "counted(new, base, width, hist_out, changed_from, payload_within, repeats_below, skew_below, written_from, "
     "digest) -> "
     "(*lengths(...), payload or None)"},
    {"plan", gamma_plan, METH_VARARGS, "plan(hist) -> (center, k, unary_bytes, remainder_bytes, mantissa_bytes)"},
    {"gamma", gamma_encode, METH_VARARGS, "gamma(new, base, width, center, k, unary_len, remainder_len, payload_out)"},
    {"ungamma", gamma_decode, METH_VARARGS, "ungamma(body, unary_len, width, center, k, base, out) -> status"},
    {"classes", classes, METH_VARARGS, "classes(base, width, split, words_out, before_out) -> low elements"},
    {"partition", partition, METH_VARARGS,
     "partition(words, before, n, idx, diff, width, low_ranks, low_diff, high_ranks, high_diff) -> low changes"},
    {"select", select_ranks, METH_VARARGS, "select(words, before, n, ranks, bit, out) -> status"},
    {"choose_split", choose_split, METH_VARARGS,
     "choose_split(base, width, stride, idx, idx_stride, shift, gain) -> split"},
    {"changes_group", changes_group, METH_VARARGS,
     "changes_group(new, base, width, idx_out, new_out, base_out, simd, sparse_below) -> count or (count, k, unary, "
     "remainder, signs, big, big_k, big_unary, big_remainder, *planes)"},
    {"group", group, METH_VARARGS,
     "group(ranks, diff, width, space) -> (k, unary, remainder, signs, big, big_k, big_unary, big_remainder, planes)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "The sparse codec's per-element loops, compiled.", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    build_lane_tables();
    build_select_table();
    simd_ok = simd_supported();
    return PyModule_Create(&module);
}
