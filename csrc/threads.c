/* A small persistent thread pool: the calling thread runs part 0, workers run parts 1..n-1.
 *
 * Decode calls a kernel a few hundred times per token, each taking tens to hundreds of microseconds, so
 * waking threads through a condition variable every time would cost as much as the work. Workers spin for
 * a short while (BITNETLM_SPIN_US, default 300 us) waiting for the next job, then sleep on a condition
 * variable so an idle process does not burn CPU.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "bn_internal.h"

#if defined(BN_X86)
#include <immintrin.h>
#define BN_PAUSE() _mm_pause()
#elif defined(__aarch64__)
#define BN_PAUSE() __asm__ __volatile__("yield")
#else
#define BN_PAUSE() ((void)0)
#endif

#define BN_MAX_THREADS 256

static struct {
    int nthreads;                 /* threads taking part, caller included */
    int started;                  /* worker threads alive (nthreads - 1 once started) */
    pthread_t tid[BN_MAX_THREADS];
    _Atomic unsigned long gen;    /* job generation: bumped to publish a job */
    _Atomic int done;             /* workers finished with the current job */
    _Atomic int sleepers;
    _Atomic int stop;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* the current job */
    bn_range_fn fn;
    void *ctx;
    int64_t n;
    int parts;
    int64_t chunk;                /* units per grab */
    _Atomic int64_t next;         /* first unit not yet taken */
    long spin_ns;
} P = {.nthreads = 0, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

int64_t bn_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Threads take chunks of units from a shared counter until none are left: on a shared or noisy machine a
 * static half each leaves the faster thread waiting at the barrier (measured on the 2-vCPU VM). Chunks are
 * consecutive units, so each thread still streams long runs of contiguous weights. Guided sizes: a grab takes
 * a quarter of its share of what is left, down to P.chunk, so the last grabs are small and the thread that
 * finishes first waits for a small chunk, not an eighth of the job (perf, 2B4T int8-head decode: the idle
 * worker's spin fell from 13% to 1.8% of samples). */
static void run_part(int part) {
    if (part >= P.parts) return;
    int64_t lo = atomic_load_explicit(&P.next, memory_order_relaxed);
    for (;;) {
        if (lo >= P.n) return;
        int64_t size = (P.n - lo) / (4 * (int64_t)P.parts);
        if (size < P.chunk) size = P.chunk;
        int64_t hi = lo + size < P.n ? lo + size : P.n;
        if (!atomic_compare_exchange_weak_explicit(&P.next, &lo, hi, memory_order_relaxed, memory_order_relaxed))
            continue; /* lo now holds the current counter */
        P.fn(P.ctx, lo, hi);
        lo = atomic_load_explicit(&P.next, memory_order_relaxed);
    }
}

static unsigned long start_gen[BN_MAX_THREADS];

static void *worker(void *arg) {
    int id = (int)(intptr_t)arg;
    /* the generation before this thread was created: a job published while it starts is not missed */
    unsigned long seen = start_gen[id];
    for (;;) {
        int64_t t0 = bn_now_ns();
        unsigned spins = 0;
        while (atomic_load_explicit(&P.gen, memory_order_acquire) == seen) {
            BN_PAUSE();
            if ((++spins & 255) == 0 && bn_now_ns() - t0 > P.spin_ns) {
                pthread_mutex_lock(&P.mu);
                atomic_fetch_add(&P.sleepers, 1);
                while (atomic_load(&P.gen) == seen) pthread_cond_wait(&P.cv, &P.mu);
                atomic_fetch_sub(&P.sleepers, 1);
                pthread_mutex_unlock(&P.mu);
                break;
            }
        }
        seen = atomic_load_explicit(&P.gen, memory_order_acquire);
        if (atomic_load(&P.stop)) return NULL;
        run_part(id);
        atomic_fetch_add_explicit(&P.done, 1, memory_order_release);
    }
}

static int default_threads(void) {
    const char *e = getenv("BITNETLM_NUM_THREADS");
    if (e && atoi(e) > 0) return atoi(e);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static void stop_workers(void) {
    if (P.started == 0) return;
    atomic_store(&P.stop, 1);
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add(&P.gen, 1);
    pthread_cond_broadcast(&P.cv);
    pthread_mutex_unlock(&P.mu);
    for (int i = 1; i <= P.started; i++) pthread_join(P.tid[i], NULL);
    P.started = 0;
    atomic_store(&P.stop, 0);
}

static void after_fork_child(void) {
    /* threads do not survive fork(): forget them, the next job starts new ones */
    P.started = 0;
    pthread_mutex_init(&P.mu, NULL);
    pthread_cond_init(&P.cv, NULL);
    atomic_store(&P.stop, 0);
    atomic_store(&P.sleepers, 0);
}

static void ensure_started(void) {
    static int once = 0;
    if (!once) {
        once = 1;
        pthread_atfork(NULL, NULL, after_fork_child);
        const char *e = getenv("BITNETLM_SPIN_US");
        P.spin_ns = (e ? atol(e) : 300) * 1000L;
        if (P.nthreads <= 0) P.nthreads = default_threads();
    }
    while (P.started < P.nthreads - 1) {
        int id = P.started + 1;
        start_gen[id] = atomic_load(&P.gen);
        if (pthread_create(&P.tid[id], NULL, worker, (void *)(intptr_t)id) != 0) {
            P.nthreads = P.started + 1; /* could not start more: run with what we have */
            break;
        }
        P.started++;
    }
}

int bn_pool_set_threads(int n) {
    if (n <= 0) n = default_threads();
    if (n > BN_MAX_THREADS) n = BN_MAX_THREADS;
    if (n != P.nthreads) {
        stop_workers();
        P.nthreads = n;
    }
    return P.nthreads;
}

int bn_pool_threads(void) {
    if (P.nthreads <= 0) P.nthreads = default_threads();
    return P.nthreads;
}

void bn_parallel_for(int64_t n, bn_range_fn fn, void *ctx) {
    if (n <= 0) return;
    int nt = bn_pool_threads();
    if (nt <= 1 || n == 1) {
        fn(ctx, 0, n);
        return;
    }
    ensure_started();
    nt = P.nthreads;
    P.fn = fn;
    P.ctx = ctx;
    P.n = n;
    P.parts = n < nt ? (int)n : nt;
    P.chunk = n / (64 * (int64_t)P.parts) > 0 ? n / (64 * (int64_t)P.parts) : 1; /* smallest grab */
    atomic_store(&P.next, 0);
    atomic_store(&P.done, 0);
    atomic_fetch_add(&P.gen, 1); /* seq_cst: pairs with the sleepers check below (no lost wake-up) */
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
    run_part(0);
    /* wait for the workers; yield now and then in case the machine is oversubscribed */
    unsigned spins = 0;
    while (atomic_load_explicit(&P.done, memory_order_acquire) < P.started) {
        BN_PAUSE();
        if ((++spins & 1023) == 0) sched_yield();
    }
}
