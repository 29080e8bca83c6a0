/*
 * ntcopy.c - copy a batch of equal-length runs with non-temporal stores.
 *
 * Used by kernels/ops.py (loaded by kernels/native.py through ctypes) for the
 * CPU gather (paged cache -> chunk) and scatter (chunk -> paged cache). One
 * call copies n_runs runs of run_bytes bytes, run i from
 * src_base + src_offsets[i] to dst_base + dst_offsets[i].
 *
 * Why non-temporal (streaming) stores: a copy made of 32 KiB runs goes
 * through cached stores in memcpy (glibc streams only copies above ~3/4 of
 * the shared cache, ~19 MiB here). A cached store first reads the destination
 * line into the cache (read for ownership) and later writes it back, so each
 * copied byte costs three memory transfers instead of two, and such a copy
 * stops at about half of a large memcpy. Streaming stores send whole lines
 * straight to memory through the write-combining buffers. The destination is
 * not wanted in the cache anyway: a stored chunk is read much later (or by
 * another process), and a retrieved block is read next by the engine, long
 * after this copy has gone through the cache.
 *
 * Why several runs at once: one stream of loads from DRAM leaves the core
 * waiting on memory (the L2 streamer restarts at every 4 KiB page and cannot
 * guess the next run, a random block elsewhere). Copying NT_STREAMS runs
 * line by line in turn keeps that many independent streams in flight, the
 * same idea as glibc's 4-page interleaved large memcpy; measured here it takes
 * one thread from ~0.8 to ~1.0 of a one-thread 32 MiB memcpy.
 *
 * Each destination line is written completely by consecutive stores before
 * the next line is started (a compiler barrier keeps them together): a write-
 * combining buffer evicted while partly filled costs a partial write, and
 * interleaving partial lines across streams was measured 5x slower.
 *
 * Streaming stores need aligned destinations: the unaligned head of each run
 * (up to its first 64-byte line boundary) and its tail go through memcpy, as
 * do runs shorter than NT_MIN_RUN bytes. Loads are unaligned (any source
 * alignment works). The copy ends with an sfence: streaming stores are weakly
 * ordered, and whoever the caller hands the data to (another thread, another
 * process) must see every byte once the call has returned.
 *
 * No Python headers: a plain shared library builds with nothing but a C
 * compiler, and ctypes releases the GIL around the call.
 */

#include "ntcopy.h"

/* Bumped whenever the exported functions change; checked by the loader. */
#define KVMESH_NTCOPY_ABI 5

/* Runs shorter than this are copied with memcpy: too few whole lines to pay
 * for the head/tail handling. */
#define NT_MIN_RUN 256

/* Runs copied side by side (see "Why several runs at once"). */
#ifndef NT_STREAMS
#define NT_STREAMS 4
#endif

/* Lines copied from one run before moving to the next run of the group (2
 * measured ~5 % faster than 1 or 4, like glibc's 4-vector steps). */
#ifndef LINES_PER_STEP
#define LINES_PER_STEP 2
#endif

/* How far ahead of the loads each stream is prefetched, in bytes, into all
 * cache levels: a non-temporal prefetch (prefetchnta) was measured 3x slower,
 * it keeps the L2 streamer from following the run. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 512
#endif

enum { ISA_MEMCPY = 0, ISA_SSE2 = 1, ISA_AVX2 = 2 };

/* Keeps the compiler from moving stores of one line past those of the next. */
#define COMPILER_BARRIER() __asm__ __volatile__("" ::: "memory")

static inline const char *src_at(const void *base, int64_t off) {
    /* Integer arithmetic: a per-layer cache passes offsets from the lowest
     * layer's address, so base + off may point into another allocation. */
    return (const char *)((uintptr_t)base + (uintptr_t)off);
}

static inline char *dst_at(void *base, int64_t off) {
    return (char *)((uintptr_t)base + (uintptr_t)off);
}

static void copy_runs_memcpy(const void *src_base, void *dst_base, const int64_t *src_offsets,
                             const int64_t *dst_offsets, int64_t n_runs, size_t run_bytes) {
    for (int64_t i = 0; i < n_runs; i++) {
        memcpy(dst_at(dst_base, dst_offsets[i]), src_at(src_base, src_offsets[i]), run_bytes);
    }
}

#ifdef KVMESH_X86

__attribute__((target("sse2"))) static inline void line_sse2(char *dst, const char *src) {
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
    COMPILER_BARRIER();
}

__attribute__((target("avx2"))) static inline void line_avx2(char *dst, const char *src) {
    __m256i a = _mm256_loadu_si256((const __m256i *)src);
    __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
    _mm256_stream_si256((__m256i *)dst, a);
    _mm256_stream_si256((__m256i *)(dst + 32), b);
    COMPILER_BARRIER();
}

/*
 * Copy `count` (<= NT_STREAMS) runs of n >= NT_MIN_RUN bytes: each run's
 * head up to a line boundary of its destination with memcpy, then the whole
 * lines all runs have in common interleaved line by line, then the rest of
 * each run on its own (its remaining whole lines streamed, the tail memcpy).
 * One body per instruction set: the target attribute lets the AVX2 one be
 * compiled without -mavx2 and chosen at run time.
 */
#define DEFINE_COPY_GROUP(NAME, TARGET, COPY_LINE)                                          \
    __attribute__((target(TARGET))) static void NAME(char *const *dst, const char *const *src, \
                                                     int count, size_t n) {                \
        size_t start[NT_STREAMS];                                                          \
        size_t common = n;                                                                 \
        for (int p = 0; p < count; p++) {                                                  \
            size_t head = (size_t)(-(uintptr_t)dst[p]) & (LINE - 1);                       \
            memcpy(dst[p], src[p], head);                                                  \
            start[p] = head;                                                               \
            size_t lines = (n - head) & ~(size_t)(LINE - 1);                               \
            common = lines < common ? lines : common;                                      \
        }                                                                                  \
        common -= common % (LINE * LINES_PER_STEP);                                        \
        for (size_t i = 0; i < common; i += LINE * LINES_PER_STEP) {                       \
            for (int p = 0; p < count; p++) {                                              \
                for (int l = 0; l < LINES_PER_STEP; l++) {                                 \
                    const char *s = src[p] + start[p] + i + l * LINE;                      \
                    _mm_prefetch(s + PREFETCH_AHEAD, _MM_HINT_T0);                         \
                    COPY_LINE(dst[p] + start[p] + i + l * LINE, s);                        \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        for (int p = 0; p < count; p++) {                                                  \
            size_t off = start[p] + common;                                                \
            size_t end = off + ((n - off) & ~(size_t)(LINE - 1));                          \
            for (; off < end; off += LINE) {                                               \
                COPY_LINE(dst[p] + off, src[p] + off);                                     \
            }                                                                              \
            memcpy(dst[p] + off, src[p] + off, n - off);                                   \
        }                                                                                  \
    }

DEFINE_COPY_GROUP(copy_group_sse2, "sse2", line_sse2)
DEFINE_COPY_GROUP(copy_group_avx2, "avx2", line_avx2)

static int detect_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) {
        return ISA_AVX2;
    }
    if (__builtin_cpu_supports("sse2")) {
        return ISA_SSE2;
    }
    return ISA_MEMCPY;
}

#else /* not x86: no streaming-store path; a memcpy loop, still without the GIL */

static int detect_isa(void) { return ISA_MEMCPY; }

#endif

static int best_isa_cached = -1;

static int best_isa(void) {
    /* A benign race: every thread computes the same value. */
    int isa = __atomic_load_n(&best_isa_cached, __ATOMIC_RELAXED);
    if (isa < 0) {
        isa = detect_isa();
        __atomic_store_n(&best_isa_cached, isa, __ATOMIC_RELAXED);
    }
    return isa;
}

/* The best copy path this CPU supports: 2 AVX2, 1 SSE2, 0 memcpy only. */
KVMESH_EXPORT int kvmesh_ntcopy_best_isa(void) { return best_isa(); }

/* The ABI version of this library (KVMESH_NTCOPY_ABI). */
KVMESH_EXPORT int kvmesh_ntcopy_abi(void) { return KVMESH_NTCOPY_ABI; }

/*
 * Copy n_runs runs of run_bytes bytes: run i from src_base + src_offsets[i]
 * to dst_base + dst_offsets[i]. No destination may overlap a source or
 * another destination. isa: -1 for the best path the CPU supports, or
 * ISA_MEMCPY / ISA_SSE2 / ISA_AVX2 to ask for one (lowered to what the CPU
 * supports; the tests use it to cover every path). Returns the path used
 * (ISA_MEMCPY for runs below NT_MIN_RUN), or -1 when n_runs or run_bytes is
 * negative (nothing is copied).
 */
KVMESH_EXPORT int kvmesh_copy_runs(const void *src_base, void *dst_base,
                                   const int64_t *src_offsets, const int64_t *dst_offsets,
                                   int64_t n_runs, int64_t run_bytes, int isa) {
    if (n_runs < 0 || run_bytes < 0) {
        return -1;
    }
    int best = best_isa();
    if (isa < 0 || isa > best) {
        isa = best;
    }
    size_t n = (size_t)run_bytes;
    if (isa == ISA_MEMCPY || n < NT_MIN_RUN) {
        copy_runs_memcpy(src_base, dst_base, src_offsets, dst_offsets, n_runs, n);
        return ISA_MEMCPY;
    }
#ifdef KVMESH_X86
    for (int64_t i = 0; i < n_runs; i += NT_STREAMS) {
        int count = n_runs - i < NT_STREAMS ? (int)(n_runs - i) : NT_STREAMS;
        char *dst[NT_STREAMS];
        const char *src[NT_STREAMS];
        for (int p = 0; p < count; p++) {
            dst[p] = dst_at(dst_base, dst_offsets[i + p]);
            src[p] = src_at(src_base, src_offsets[i + p]);
        }
        if (isa == ISA_AVX2) {
            copy_group_avx2(dst, src, count, n);
        } else {
            copy_group_sse2(dst, src, count, n);
        }
    }
    _mm_sfence();
#endif
    return isa;
}

/*
 * Many (chunk, layer) copies of one vLLM CPU layout in one call: item i is
 * items[7 * i .. 7 * i + 6] = (layer, k_rows, v_rows, blocks, n_blocks,
 * n_tokens, skip_blocks), the first four as addresses, each as for
 * kvmesh_amx_tiles (layout 0) or kvmesh_vec_tiles (layout 1). A copy thread
 * makes one call for its whole share: a call per item released and took back
 * the GIL each time, and two threads handing it to each other per 128 KiB
 * item ran slower than one. Returns 0, or the first item's error (-1).
 */
KVMESH_EXPORT int kvmesh_tiles_batch(int layout, const int64_t *items, int64_t n_items,
                                     int64_t heads, int64_t bs, int64_t hd, int64_t esize,
                                     int gather) {
    if (n_items < 0 || (layout != 0 && layout != 1)) return -1;
    for (int64_t i = 0; i < n_items; i++) {
        const int64_t *it = items + 7 * i;
        void *lay = (void *)(intptr_t)it[0], *k = (void *)(intptr_t)it[1];
        void *v = (void *)(intptr_t)it[2];
        const int64_t *blocks = (const int64_t *)(intptr_t)it[3];
        const int64_t *next = i + 1 < n_items ? it + 7 : NULL;
        int rc = layout == 0
                     ? kvmesh_amx_tiles(lay, k, v, blocks, it[4], it[5], it[6], heads, bs, hd,
                                        esize, gather, next)
                     : kvmesh_vec_tiles(lay, k, v, blocks, it[4], it[5], it[6], heads, bs, hd,
                                        esize, gather, next);
        if (rc != 0) return rc;
    }
    return 0;
}
