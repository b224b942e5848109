/* Read-only views of a file's page cache that survive the file being cut short (deltafs.buffers.mapped_range).
 *
 * Reading a mapping past the end of its file raises SIGBUS, whose default action kills the process. A push reads
 * large chunks of the trainer's checkpoint through mappings, and a trainer may truncate a file while it is read
 * (rewriting a checkpoint in place). So every mapping made here is registered in a table, and a SIGBUS handler,
 * installed with the first mapping, looks the faulting address up: inside a registered mapping, it maps zero
 * pages over the rest of that mapping (so the access and every later one read zeros instead of faulting again)
 * and marks the mapping faulted; the caller checks `faulted` after it has used the bytes and reports the file as
 * cut short. A cut inside the range's last page faults nothing (the rest of that page reads as zeros): the caller
 * also compares the file's size with `end`. Any other SIGBUS goes to the handler that was installed before (Python's faulthandler, say) or to
 * the default action, exactly as without this module.
 *
 * Optional, like deltafs/codec/_native.c: where it was not built, deltafs reads those chunks with pread instead.
 * Linux only: the range is populated with MADV_POPULATE_READ (Linux 5.14) before it is handed out, so a range
 * the file no longer has is an error up front (EFAULT) rather than a fault on access.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__linux__)
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* Mappings alive at once: a push holds a few per chunk in flight (its base and itself); more than this and
 * map() answers None (the caller reads instead). */
#define SLOTS 4096

/* One registered mapping. A seqlock: the writer (under `lock`) makes `seq` odd, writes lo and hi, makes it even
 * again; the handler skips a slot whose seq is odd or changed while it read lo and hi (a slot in flux is never the
 * mapping that faulted: that one stays registered until its Range is freed, after its last access). */
typedef struct {
    atomic_uint seq;
    atomic_uintptr_t lo, hi; /* [lo, hi): the whole mapping, page-aligned; hi == 0: free */
    atomic_int faulted;
} Slot;

static Slot slots[SLOTS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int installed = 0;
static struct sigaction previous;
static uintptr_t page_size = 4096;

static void slot_set(int i, uintptr_t lo, uintptr_t hi) {
    atomic_fetch_add_explicit(&slots[i].seq, 1, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&slots[i].lo, lo, memory_order_relaxed);
    atomic_store_explicit(&slots[i].hi, hi, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_fetch_add_explicit(&slots[i].seq, 1, memory_order_relaxed);
}

static void pass_on(int sig, siginfo_t *si, void *uc) {
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction != NULL) {
            previous.sa_sigaction(sig, si, uc);
            return;
        }
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    /* The default action: put it back and return; the access faults again and the process ends as it would have. */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    if (si == NULL || si->si_code <= 0)
        raise(sig); /* sent by a process (kill -BUS): no access to repeat */
}

static void on_sigbus(int sig, siginfo_t *si, void *uc) {
    int saved = errno;
    if (si != NULL && si->si_code > 0) { /* raised by the kernel for an access, not sent by kill() */
        uintptr_t at = (uintptr_t)si->si_addr;
        for (int i = 0; i < SLOTS; i++) {
            unsigned s1 = atomic_load_explicit(&slots[i].seq, memory_order_acquire);
            if (s1 & 1u)
                continue;
            uintptr_t lo = atomic_load_explicit(&slots[i].lo, memory_order_relaxed);
            uintptr_t hi = atomic_load_explicit(&slots[i].hi, memory_order_relaxed);
            atomic_thread_fence(memory_order_acquire);
            if (atomic_load_explicit(&slots[i].seq, memory_order_relaxed) != s1 || hi == 0 || at < lo || at >= hi)
                continue;
            uintptr_t page = at & ~(page_size - 1);
            void *p = mmap((void *)page, hi - page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            if (p != MAP_FAILED) {
                atomic_store_explicit(&slots[i].faulted, 1, memory_order_release);
                errno = saved;
                return;
            }
            break;
        }
    }
    errno = saved;
    pass_on(sig, si, uc);
}

/* Under `lock`. */
static int install_handler(void) {
    if (installed)
        return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0)
        return -1;
    installed = 1;
    return 0;
}

typedef struct {
    PyObject_HEAD
    char *addr;       /* the mapping (page-aligned) */
    size_t length;    /* its length */
    Py_ssize_t skip;  /* where the range starts in it */
    Py_ssize_t size;  /* the range's bytes */
    long long end;    /* the file offset where the range ends */
    int slot;
} Range;

static void Range_dealloc(Range *self) {
    /* Unregistered before it is unmapped: an address the kernel hands out again is never taken for this one. */
    pthread_mutex_lock(&lock);
    slot_set(self->slot, 0, 0);
    pthread_mutex_unlock(&lock);
    munmap(self->addr, self->length);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Range_getbuffer(Range *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->addr + self->skip, self->size, 1, flags);
}

static PyObject *Range_faulted(Range *self, void *closure) {
    (void)closure;
    return PyBool_FromLong(atomic_load_explicit(&slots[self->slot].faulted, memory_order_acquire));
}

static PyObject *Range_end(Range *self, void *closure) {
    (void)closure;
    return PyLong_FromLongLong(self->end);
}

static PyBufferProcs Range_as_buffer = {(getbufferproc)Range_getbuffer, NULL};

static PyGetSetDef Range_getset[] = {
    {"faulted", (getter)Range_faulted, NULL,
     "Whether an access found bytes the file no longer has (they read as zeros).", NULL},
    {"end", (getter)Range_end, NULL,
     "The file offset where the range ends: a file now shorter lost bytes of it, faulted or not (the part of its "
     "last page past a cut reads as zeros without a fault).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject RangeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "deltafs._mapped.Range",
    .tp_basicsize = sizeof(Range),
    .tp_dealloc = (destructor)Range_dealloc,
    .tp_as_buffer = &Range_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "size bytes of a file at an offset, mapped read-only and guarded against SIGBUS.",
    .tp_getset = Range_getset,
};

/* map(fd, size, offset, advice) -> Range | None
 *
 * advice: MADV_POPULATE_READ (22; an argument so that tests can pass one no kernel knows). OSError with the errno
 * of the mmap, or of the populate with the filename "MADV_POPULATE_READ" (EFAULT: the range lies past the end of
 * the file; EINVAL, ENOSYS, EPERM: the kernel cannot populate); None when every slot is taken. */
static PyObject *map_range(PyObject *module, PyObject *args) {
    (void)module;
    int fd;
    Py_ssize_t size;
    long long offset;
    int advice;
    if (!PyArg_ParseTuple(args, "inLi", &fd, &size, &offset, &advice))
        return NULL;
    if (size <= 0 || offset < 0) {
        PyErr_SetString(PyExc_ValueError, "size must be positive and offset non-negative");
        return NULL;
    }
    long long start = offset - offset % (long long)page_size;
    size_t length = (size_t)size + (size_t)(offset - start);
    uintptr_t span = (length + page_size - 1) & ~(page_size - 1);

    pthread_mutex_lock(&lock);
    int slot = -1;
    if (install_handler() == 0) {
        for (int i = 0; i < SLOTS; i++) {
            if (atomic_load_explicit(&slots[i].hi, memory_order_relaxed) == 0) {
                slot = i;
                break;
            }
        }
    }
    char *addr = MAP_FAILED;
    int err = 0;
    if (slot >= 0) {
        addr = mmap(NULL, length, PROT_READ, MAP_SHARED, fd, (off_t)start);
        if (addr == MAP_FAILED) {
            err = errno;
        } else {
            atomic_store_explicit(&slots[slot].faulted, 0, memory_order_relaxed);
            slot_set(slot, (uintptr_t)addr, (uintptr_t)addr + span);
        }
    }
    pthread_mutex_unlock(&lock);
    if (slot < 0)
        Py_RETURN_NONE;
    if (addr == MAP_FAILED) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    /* With the GIL held, as Python's mmap.madvise does: over pages in the page cache the populate takes ~70 us per
     * 4 MiB, and handing the GIL over for that costs the worker more (it waits for another thread to give it back)
     * than it frees; measured in whole pushes (docs/profile.md, round 17). */
    int rc = madvise(addr, length, advice);
    if (rc != 0)
        err = errno;
    Range *r = rc == 0 ? PyObject_New(Range, &RangeType) : NULL;
    if (r == NULL) {
        pthread_mutex_lock(&lock);
        slot_set(slot, 0, 0);
        pthread_mutex_unlock(&lock);
        munmap(addr, length);
        if (rc != 0) {
            errno = err;
            return PyErr_SetFromErrnoWithFilename(PyExc_OSError, "MADV_POPULATE_READ");
        }
        return NULL;
    }
    r->addr = addr;
    r->length = length;
    r->skip = (Py_ssize_t)(offset - start);
    r->size = size;
    r->end = offset + (long long)size;
    r->slot = slot;
    return (PyObject *)r;
}

static PyMethodDef methods[] = {
    {"map", map_range, METH_VARARGS, "map(fd, size, offset, advice) -> Range | None: a populated, guarded read-only view."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {PyModuleDef_HEAD_INIT, "deltafs._mapped", NULL, -1, methods};

/* A fork while another thread holds `lock` would leave the child's copy locked for good: hold it across fork(). */
static void before_fork(void) { pthread_mutex_lock(&lock); }
static void after_fork(void) { pthread_mutex_unlock(&lock); }

PyMODINIT_FUNC PyInit__mapped(void) {
    long ps = sysconf(_SC_PAGESIZE);
    if (ps > 0)
        page_size = (uintptr_t)ps;
    if (pthread_atfork(before_fork, after_fork, after_fork) != 0) {
        PyErr_SetString(PyExc_ImportError, "deltafs._mapped: pthread_atfork failed");
        return NULL;
    }
    if (PyType_Ready(&RangeType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RangeType);
    if (PyModule_AddObject(m, "Range", (PyObject *)&RangeType) < 0) {
        Py_DECREF(&RangeType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

#else /* not Linux: no module (setup.py builds it as optional; deltafs reads instead of mapping) */
#error "deltafs._mapped is Linux only"
#endif
