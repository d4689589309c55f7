/* A pool of the library's own threads for a decode token's CPU experts (built in front of each
   native kernel's source: cpu_kernel.py, cpu_mxfp4.py). Not OpenMP: a second OpenMP team in
   the process would take libgomp over the core count, and then it cuts every team's spinning
   short. pool_start posts a task and returns, pool_wait waits for it and returns its seconds;
   the caller works meanwhile (the pool is one thread smaller than its cores). A task is a
   function over item ranges in up to 4 phases: each thread claims chunks of a phase's items
   from its own equal share, then from the others' (a thread that the OS preempts, e.g. for the
   state-cache writer, holds up no one for the rest of its share), and they wait for each
   other between phases; a task may take fewer threads than the pool has (the caller leaves
   cores to other busy threads). Waits spin briefly (a host step is shorter than a sleep and
   wake-up), then sleep on a condition variable (how long they spin: agentrt_pool_spin, 20 ms
   by default). One task at a time
   (pool_start returns -2 otherwise, -1 where the threads cannot be made). */
#include <stdint.h>
#include <immintrin.h>
#include <pthread.h>
#include <time.h>

typedef void (*pool_fn)(const void* job, int phase, long lo, long hi);
#define POOL_PHASES 4
typedef struct {
    pool_fn fn; const void* job; int phases; long items[POOL_PHASES];
    int active;  /* threads that take part (the others sit this task out; set by pool_start) */
    unsigned generation;  /* which post this is (set by pool_start) */
} pool_task;

static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_cv = PTHREAD_COND_INITIALIZER;
static pool_task pool_posted;
static int pool_size = 0;
static unsigned pool_generation = 0;  /* atomic: one more per posted task */
static int pool_pending = 0;     /* atomic: pool threads yet to finish the posted task */
static unsigned pool_finished = 0;  /* atomic: the generation of the last task done */
static int pool_broken = 0;  /* the pool could not be made */
static unsigned pool_bar_count = 0, pool_bar_phase = 0;  /* atomic: the barrier between phases */
/* each thread's share of a phase's items: its next unclaimed item (atomic) and its end */
#define POOL_MAX 256
typedef struct { long next, end; char pad[48]; } pool_share;  /* (a cache line each) */
static pool_share pool_shares[POOL_PHASES][POOL_MAX];
static int pool_chunk = 16;  /* items per claim; 0: fixed equal shares (benchmarks compare) */
static double pool_started_at = 0.0, pool_seconds = 0.0;
static unsigned pool_made_at = 0;  /* the generation when the threads were made */
static double pool_spin_s = 0.02;  /* atomic: how long a wait spins before it sleeps */
/* atomic: odd while pool_posted is being written (a seqlock): a thread that sits a task out
   is not waited for, so the next task may be posted while it still reads the last one */
static unsigned pool_seq = 0;
/* atomic: the generation of a task cut short (agentrt_pool_cancel: a warm-up the next call
   would otherwise wait for); its threads claim no more of its items */
static unsigned pool_cancelled = 0;

static double pool_now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec;
}
static int pool_holds(unsigned* addr, unsigned value, int equal) {
    return (__atomic_load_n(addr, __ATOMIC_ACQUIRE) == value) == equal;
}
/* wait until (*addr == value) == equal: spin up to pool_spin_s, then sleep */
static void pool_await(unsigned* addr, unsigned value, int equal) {
    double t0 = pool_now(), spin;
    for (int i = 1; !pool_holds(addr, value, equal); i++) {
        _mm_pause();
        if ((i & 1023) != 0) continue;
        __atomic_load(&pool_spin_s, &spin, __ATOMIC_RELAXED);
        if (pool_now() - t0 > spin) {
            pthread_mutex_lock(&pool_mu);
            while (!pool_holds(addr, value, equal)) pthread_cond_wait(&pool_cv, &pool_mu);
            pthread_mutex_unlock(&pool_mu);
            return;
        }
    }
}
static void pool_publish(unsigned* addr, unsigned value) {
    __atomic_store_n(addr, value, __ATOMIC_RELEASE);
    pthread_mutex_lock(&pool_mu);
    pthread_cond_broadcast(&pool_cv);
    pthread_mutex_unlock(&pool_mu);
}
/* wait until `size` threads arrived (counted by barriers passed, not by a sense each thread
   keeps: a thread that sat a task out has passed none of its barriers) */
static void pool_barrier(unsigned size) {
    unsigned phase = __atomic_load_n(&pool_bar_phase, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&pool_bar_count, 1, __ATOMIC_ACQ_REL) == size) {
        __atomic_store_n(&pool_bar_count, 0, __ATOMIC_RELAXED);
        pool_publish(&pool_bar_phase, phase + 1);  /* (no one moves on before all arrived) */
    } else {
        pool_await(&pool_bar_phase, phase, 0);
    }
}
/* the next range [lo, hi) of a phase's `total` items for thread t, or 0 when none is left:
   claims of pool_chunk items from its own share first (the same items of every task of a
   shape: what it read for the last one may still be in its core's caches), then from the other
   threads' shares (a thread that the OS preempts holds up no one for the rest of its share);
   *turn: which share it claims from (0: its own) */
static int pool_claim(int phase, long total, int t, int size, int* turn, long* lo, long* hi) {
    if (pool_chunk <= 0) {
        if ((*turn)++) return 0;
        *lo = total * t / size; *hi = total * (t + 1) / size;
        return 1;
    }
    for (; *turn < size; (*turn)++) {
        pool_share* share = &pool_shares[phase][(t + *turn) % size];
        *lo = __atomic_fetch_add(&share->next, pool_chunk, __ATOMIC_RELAXED);
        if (*lo < share->end) {
            *hi = *lo + pool_chunk < share->end ? *lo + pool_chunk : share->end;
            return 1;
        }
    }
    return 0;
}
/* the posted task as words, each copied atomically (the seqlock's data) */
typedef union { pool_task task; uint64_t words[sizeof(pool_task) / 8]; } pool_words;
_Static_assert(sizeof(pool_task) % 8 == 0, "pool_task must be whole words");
/* a consistent copy of the latest posted task: any word of a newer post read here makes the
   sequence number read after it differ (acquire loads, release stores) */
static pool_task pool_read_task(void) {
    pool_words* from = (pool_words*)&pool_posted;
    for (;;) {
        unsigned before = __atomic_load_n(&pool_seq, __ATOMIC_ACQUIRE);
        if (before & 1) { _mm_pause(); continue; }
        pool_words copy;
        for (size_t w = 0; w < sizeof(copy.words) / 8; w++)
            copy.words[w] = __atomic_load_n(&from->words[w], __ATOMIC_ACQUIRE);
        if (__atomic_load_n(&pool_seq, __ATOMIC_RELAXED) == before) return copy.task;
    }
}
static void pool_write_task(pool_task task) {
    pool_words* to = (pool_words*)&pool_posted;
    pool_words copy = {task};
    unsigned seq = __atomic_load_n(&pool_seq, __ATOMIC_RELAXED);
    __atomic_store_n(&pool_seq, seq + 1, __ATOMIC_RELAXED);
    for (size_t w = 0; w < sizeof(copy.words) / 8; w++)
        __atomic_store_n(&to->words[w], copy.words[w], __ATOMIC_RELEASE);
    __atomic_store_n(&pool_seq, seq + 2, __ATOMIC_RELEASE);
}
static void* pool_thread(void* arg) {
    int t = (int)(intptr_t)arg;
    unsigned seen = pool_made_at;  /* (the first task is the next generation) */
    for (;;) {
        pool_await(&pool_generation, seen, 0);
        pool_task task = pool_read_task();  /* (that generation's, or a later one's) */
        seen = task.generation;
        int size = task.active;
        /* sit out: not counted in pending nor at the barriers (a task this thread takes part
           in cannot be followed by another before the thread is done with it) */
        if (t >= size) continue;
        for (int phase = 0; phase < task.phases; phase++) {
            if (phase) pool_barrier(size);
            long lo, hi;
            int turn = 0;
            while (!pool_holds(&pool_cancelled, seen, 1)
                   && pool_claim(phase, task.items[phase], t, size, &turn, &lo, &hi))
                task.fn(task.job, phase, lo, hi);
        }
        if (__atomic_sub_fetch(&pool_pending, 1, __ATOMIC_ACQ_REL) == 0) {
            pool_seconds = pool_now() - pool_started_at;
            pool_publish(&pool_finished, seen);
        }
    }
    return NULL;
}
static void pool_forked_child(void) {  /* the pool does not survive a fork */
    pool_size = 0; pool_generation = 0; pool_pending = 0; pool_finished = 0;
    pool_bar_count = 0; pool_bar_phase = 0; pool_broken = 0; pool_seq = 0;
    pthread_mutex_init(&pool_mu, NULL); pthread_cond_init(&pool_cv, NULL);
}
static int pool_make(int threads) {
    static int registered = 0;
    if (!registered) { pthread_atfork(NULL, NULL, pool_forked_child); registered = 1; }
    pool_size = threads > 0 ? threads : 1;
    pool_made_at = pool_generation;
    for (int t = 0; t < pool_size; t++) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, pool_thread, (void*)(intptr_t)t) != 0) {
            pool_size = t;  /* the threads made so far wait for a task that never comes */
            return -1;
        }
        pthread_detach(thread);
    }
    return 0;
}
/* whether a task may be posted (none is running) */
static int pool_idle(void) { return pool_holds(&pool_finished, pool_generation, 1); }
/* post `task` (its job must stay unchanged until pool_wait); threads: the pool's size at its
   first task (later tasks keep it); active: how many of them take part in this one (1 to the
   pool's size: fewer leave cores to other busy threads of the process) */
static int pool_start(pool_task task, int threads, int active) {
    if (!pool_idle()) return -2;
    if (pool_broken || (pool_size == 0 && pool_make(threads) != 0)) { pool_broken = 1; return -1; }
    task.active = active < 1 ? 1 : (active > pool_size ? pool_size : active);
    if (task.active > POOL_MAX) task.active = POOL_MAX;
    task.generation = pool_generation + 1;
    pool_write_task(task);
    pool_started_at = pool_now();
    for (int phase = 0; phase < task.phases; phase++)  /* (pool_claim reads no others) */
        for (int t = 0; t < task.active; t++) {
            long total = task.items[phase];
            pool_shares[phase][t].end = total * (t + 1) / task.active;
            __atomic_store_n(&pool_shares[phase][t].next, total * t / task.active,
                             __ATOMIC_RELAXED);
        }
    __atomic_store_n(&pool_pending, task.active, __ATOMIC_RELAXED);
    pool_publish(&pool_generation, pool_generation + 1);
    return 0;
}
/* returns at once when no task is posted */
static double pool_wait(void) {
    pool_await(&pool_finished, pool_generation, 1);
    return pool_seconds;
}
/* exported (each library its own pool, called through its own handle): wait for the posted
   task and return its seconds; set the items per claim of later tasks (0: fixed shares) */
double agentrt_pool_wait(void) { return pool_wait(); }
void agentrt_pool_schedule(int chunk) { pool_chunk = chunk; }
/* cut the posted task short: its threads finish the items they hold and claim no more, and
   pool_wait returns once they have (only for a warm-up: a computation would be incomplete) */
void agentrt_pool_cancel(void) {
    __atomic_store_n(&pool_cancelled, __atomic_load_n(&pool_generation, __ATOMIC_ACQUIRE),
                     __ATOMIC_RELEASE);
}
/* how long waits spin before they sleep (seconds; 0 sends the spinning ones to sleep at their
   next check; waits already sleeping keep sleeping); returns the setting it replaces */
double agentrt_pool_spin(double seconds) {
    double before;
    __atomic_exchange(&pool_spin_s, &seconds, &before, __ATOMIC_RELAXED);
    return before;
}
