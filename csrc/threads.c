/* A small persistent thread pool. bn_parallel_for(n, fn, ctx) runs fn over the units [0, n) in chunks that the
 * calling thread and the workers claim from one shared counter; one job at a time, whichever thread calls.
 *
 * Waiting policy. Decode calls the pool a few hundred times per token, microseconds apart, so waking sleeping
 * threads for every job would cost as much as the work; but the machine may be shared (other processes, more
 * threads than cores), and there a thread that spins takes a core from one that has work: on a loaded 2-core
 * machine a pool whose caller waited at a barrier for every worker ran 2 threads at a fifth of 1 thread's speed.
 * - The caller never waits for a worker that has not started: it claims every chunk nobody has claimed and then
 *   waits only for chunks in flight. A worker the scheduler has not run yet costs the job nothing.
 * - Workers spin on the counter for a bounded time after each job (WORKER_SPIN_NS), then sleep on a condition
 *   variable (OpenMP's passive wait after its spin count, ggml's poll-then-wait); with more threads than the
 *   CPUs this process may use, for a few microseconds only.
 * - The caller waiting for a chunk in flight spins briefly (CALLER_SPIN_NS), then sleeps until it ends.
 * - When the cores are contended the caller runs jobs alone for a while (SOLO_NS), then tries the workers again:
 *   contended means its own CPU time fell well short of the wall time while it never blocked (check_contention),
 *   or it waited longer for a preempted worker's chunk than its own share took (wait_done). Under the
 *   scheduler's fairness every runnable thread of ours shrinks the caller's share of a core, and a worker helps
 *   only while both happen to run.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/resource.h>
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
#define WORKER_SPIN_NS 200000 /* longer than the gaps between a decode step's calls and between tokens */
#define BUSY_SPIN_NS 2000     /* the workers' spin with more threads than the CPUs this process may use */
#define CALLER_SPIN_NS 50000  /* a running worker ends its chunk within this; a preempted one takes ms */
#define CHECK_JOBS 64         /* jobs between two looks at the caller's CPU time, */
#define CHECK_MIN_NS 1000000  /* at least this far apart */
#define CHECK_MAX_NS 50000000 /* a longer period says little: the caller was mostly elsewhere */
#define SOLO_NS 20000000      /* how long a contended caller runs jobs alone before it tries the workers again */
/* units of one job: the counter holds (job generation << 32) | next unclaimed unit */
#define JOB_UNITS ((int64_t)1 << 31)

static struct {
    int nthreads;          /* threads taking part, caller included */
    int started;           /* worker threads alive (nthreads - 1 once started) */
    long spin_ns;          /* workers' spin before sleeping */
    pthread_t tid[BN_MAX_THREADS];
    _Atomic uint64_t job;  /* (generation << 32) | first unit not yet claimed */
    _Atomic int64_t done;  /* units of the current job finished */
    _Atomic int sleepers;  /* workers asleep on work_cv */
    _Atomic int waiting;   /* the caller asleep on done_cv */
    _Atomic int stop;
    int64_t solo_until;    /* bn_now_ns() before which the caller runs every job alone */
    pthread_mutex_t mu, call;
    pthread_cond_t work_cv, done_cv;
    /* the current job: written by the caller before it publishes the job, read after a successful claim */
    _Atomic(bn_range_fn) fn;
    _Atomic(void *) ctx;
    _Atomic int64_t n, base, chunk;
    _Atomic int parts;
} P = {.mu = PTHREAD_MUTEX_INITIALIZER,
       .call = PTHREAD_MUTEX_INITIALIZER,
       .work_cv = PTHREAD_COND_INITIALIZER,
       .done_cv = PTHREAD_COND_INITIALIZER};

#define RELAXED memory_order_relaxed

int64_t bn_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline uint32_t gen_of(uint64_t job) { return (uint32_t)(job >> 32); }

/* A finished chunk: the last one of the job wakes a sleeping caller. seq_cst pairs with the caller's flag. */
static void finish(int64_t units, int64_t n) {
    if (atomic_fetch_add(&P.done, units) + units == n && atomic_load(&P.waiting)) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_signal(&P.done_cv);
        pthread_mutex_unlock(&P.mu);
    }
}

/* Claims and runs chunks of the job in `cur` (a value of P.job) until it has none left. Guided sizes: a grab
 * takes a quarter of its share of what is left, down to the job's chunk, so consecutive units stay together
 * (long weight streams) and the last grabs are small. A claim succeeds only while its job is current, and a
 * job stays current until all its units are done, so the job's fields read after the claim are its own. */
static void run_chunks(uint64_t cur) {
    for (;;) {
        int64_t lo = (int64_t)(cur & 0xffffffffu), n = atomic_load_explicit(&P.n, RELAXED);
        if (lo >= n) return; /* claimed out, or `n` already belongs to a newer job (then the claim fails) */
        int64_t size = (n - lo) / (4 * (int64_t)atomic_load_explicit(&P.parts, RELAXED));
        int64_t chunk = atomic_load_explicit(&P.chunk, RELAXED);
        int64_t hi = lo + (size > chunk ? size : chunk);
        if (hi > n) hi = n;
        uint64_t want = (cur & ~(uint64_t)0xffffffffu) | (uint64_t)hi;
        if (!atomic_compare_exchange_weak_explicit(&P.job, &cur, want, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* cur now holds the counter's value: the same job further on, or a newer one */
        int64_t base = atomic_load_explicit(&P.base, RELAXED);
        atomic_load_explicit(&P.fn, RELAXED)(atomic_load_explicit(&P.ctx, RELAXED), base + lo, base + hi);
        finish(hi - lo, n);
        cur = atomic_load_explicit(&P.job, memory_order_acquire);
    }
}

/* The next value of P.job whose generation is not `seen`: spin for `budget` ns, then sleep. */
static uint64_t wait_for_job(uint32_t seen, int64_t budget) {
    int64_t t0 = bn_now_ns();
    for (unsigned spins = 1;; spins++) {
        uint64_t cur = atomic_load_explicit(&P.job, memory_order_acquire);
        if (gen_of(cur) != seen) return cur;
        BN_PAUSE();
        if ((spins & 63) == 0 && bn_now_ns() - t0 > budget) break;
    }
    uint64_t cur;
    pthread_mutex_lock(&P.mu);
    atomic_fetch_add(&P.sleepers, 1); /* seq_cst: pairs with the caller's publish (no lost wake-up) */
    while (gen_of(cur = atomic_load(&P.job)) == seen) pthread_cond_wait(&P.work_cv, &P.mu);
    atomic_fetch_sub(&P.sleepers, 1);
    pthread_mutex_unlock(&P.mu);
    return cur;
}

static unsigned start_gen[BN_MAX_THREADS];

static void *worker(void *arg) {
    /* the generation before this thread was created: a job published while it starts is not missed */
    uint32_t seen = start_gen[(intptr_t)arg];
    for (;;) {
        uint64_t cur = wait_for_job(seen, P.spin_ns);
        seen = gen_of(cur);
        if (atomic_load(&P.stop)) return NULL;
        run_chunks(cur);
    }
}

/* Every CHECK_JOBS jobs (and at least CHECK_MIN_NS apart) the caller looks at how much of the time since its
 * last look it was given a CPU. Well below all of it while it never blocked, other threads want its core: the
 * machine is shared, or a worker woke up on the caller's core. Waking workers then slows the caller more than
 * they help, so for the next SOLO_NS the caller runs every job alone; then the pool tries again. */
static void check_contention(void) {
#ifdef RUSAGE_THREAD
    static int64_t wall0, cpu0;
    static long blocked0;
    static pthread_t who;
    static unsigned jobs;
    if (++jobs % CHECK_JOBS != 0) return;
    int64_t now = bn_now_ns();
    if (now - wall0 < CHECK_MIN_NS) return;
    struct rusage ru;
    if (getrusage(RUSAGE_THREAD, &ru) != 0) return;
    int64_t cpu = (ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000000LL +
                  (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) * 1000LL;
    /* a period in which the caller blocked (a lock, I/O, idle between calls) or that another thread began says
     * nothing about the cores */
    if (pthread_equal(who, pthread_self()) && ru.ru_nvcsw == blocked0 && now - wall0 < CHECK_MAX_NS &&
        4 * (cpu - cpu0) < 3 * (now - wall0))
        P.solo_until = now + SOLO_NS;
    who = pthread_self(), wall0 = now, cpu0 = cpu, blocked0 = ru.ru_nvcsw;
#endif
}

/* The caller, after its own chunks (which took work_ns): wait for the chunks in flight, spinning, then asleep. A
 * wait longer than the caller's own share of the work means a worker was preempted holding a chunk: the job
 * would have ended sooner on the caller alone, which it then does for SOLO_NS. */
static void wait_done(int64_t n, int64_t work_ns) {
    int64_t t0 = 0;
    for (unsigned spins = 1; atomic_load_explicit(&P.done, memory_order_acquire) < n; spins++) {
        BN_PAUSE();
        if ((spins & 63) != 0) continue;
        int64_t now = bn_now_ns();
        if (t0 == 0) t0 = now;
        if (now - t0 < CALLER_SPIN_NS) continue;
        pthread_mutex_lock(&P.mu);
        atomic_store(&P.waiting, 1); /* seq_cst: pairs with finish() */
        while (atomic_load(&P.done) < n) pthread_cond_wait(&P.done_cv, &P.mu);
        atomic_store(&P.waiting, 0);
        pthread_mutex_unlock(&P.mu);
        int64_t end = bn_now_ns();
        if (end - t0 > work_ns) P.solo_until = end + SOLO_NS;
        return;
    }
}

/* Publishes a job of n units (n <= JOB_UNITS) starting at unit `base`, takes part in it, waits for its end. */
static void run_job(int64_t base, int64_t n, int parts, bn_range_fn fn, void *ctx) {
    atomic_store_explicit(&P.fn, fn, RELAXED);
    atomic_store_explicit(&P.ctx, ctx, RELAXED);
    atomic_store_explicit(&P.base, base, RELAXED);
    atomic_store_explicit(&P.n, n, RELAXED);
    atomic_store_explicit(&P.parts, parts, RELAXED);
    int64_t chunk = n / (64 * (int64_t)parts); /* smallest grab */
    atomic_store_explicit(&P.chunk, chunk > 0 ? chunk : 1, RELAXED);
    atomic_store_explicit(&P.done, 0, RELAXED);
    uint64_t cur = (uint64_t)(gen_of(atomic_load_explicit(&P.job, RELAXED)) + 1) << 32;
    atomic_store(&P.job, cur); /* seq_cst: releases the fields above; pairs with the sleepers count */
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.work_cv);
        pthread_mutex_unlock(&P.mu);
    }
    int64_t t0 = bn_now_ns();
    run_chunks(cur);
    wait_done(n, bn_now_ns() - t0);
}

/* CPUs this process may run on */
static int usable_cpus(void) {
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static int default_threads(void) {
    const char *e = getenv("BITNETLM_NUM_THREADS");
    if (e && atoi(e) > 0) return atoi(e);
    return usable_cpus();
}

static void stop_workers(void) {
    if (P.started == 0) return;
    atomic_store(&P.stop, 1);
    pthread_mutex_lock(&P.mu);
    atomic_store_explicit(&P.n, 0, RELAXED);
    atomic_store(&P.job, (uint64_t)(gen_of(atomic_load(&P.job)) + 1) << 32);
    pthread_cond_broadcast(&P.work_cv);
    pthread_mutex_unlock(&P.mu);
    for (int i = 1; i <= P.started; i++) pthread_join(P.tid[i], NULL);
    P.started = 0;
    atomic_store(&P.stop, 0);
}

static void after_fork_child(void) {
    /* threads do not survive fork(): forget them, the next job starts new ones */
    P.started = 0;
    pthread_mutex_init(&P.mu, NULL);
    pthread_mutex_init(&P.call, NULL);
    pthread_cond_init(&P.work_cv, NULL);
    pthread_cond_init(&P.done_cv, NULL);
    atomic_store(&P.stop, 0);
    atomic_store(&P.sleepers, 0);
    atomic_store(&P.waiting, 0);
}

static void ensure_started(void) {
    static int once = 0;
    if (!once) {
        once = 1;
        pthread_atfork(NULL, NULL, after_fork_child);
        if (P.nthreads <= 0) P.nthreads = default_threads();
    }
    if (P.started == P.nthreads - 1) return;
    P.spin_ns = P.nthreads > usable_cpus() ? BUSY_SPIN_NS : WORKER_SPIN_NS;
    while (P.started < P.nthreads - 1) {
        int id = P.started + 1;
        start_gen[id] = gen_of(atomic_load(&P.job));
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
    pthread_mutex_lock(&P.call);
    if (n != P.nthreads) {
        stop_workers();
        P.nthreads = n;
    }
    pthread_mutex_unlock(&P.call);
    return n;
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
    pthread_mutex_lock(&P.call); /* one job at a time, whichever thread calls */
    ensure_started();
    nt = P.nthreads;
    if (P.solo_until > 0 && bn_now_ns() < P.solo_until) nt = 1;
    for (int64_t base = 0; base < n; base += JOB_UNITS) {
        int64_t len = n - base < JOB_UNITS ? n - base : JOB_UNITS;
        if (nt <= 1) fn(ctx, base, base + len);
        else run_job(base, len, len < nt ? (int)len : nt, fn, ctx);
    }
    check_contention();
    pthread_mutex_unlock(&P.call);
}
