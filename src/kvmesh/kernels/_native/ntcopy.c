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
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVMESH_X86 1
#endif

#define KVMESH_EXPORT __attribute__((visibility("default")))

/* Bumped whenever the exported functions change; checked by the loader. */
#define KVMESH_NTCOPY_ABI 4

/* Runs shorter than this are copied with memcpy: too few whole lines to pay
 * for the head/tail handling. */
#define NT_MIN_RUN 256

#define LINE 64

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
 * vLLM's CPU KV layout on x86 with AMX (KV_LAYOUT_KIND_VLLM_CPU_AMX), for one
 * layer: copy between its blocks and a chunk's K and V rows ([tokens][heads *
 * head_dim], token-major). Inside one (block, head) region of 2 * bs * hd
 * elements, K element (t, d) sits at (t / 16) * 16 * hd + (d / 2) * 32 +
 * (t % 16) * 2 + d % 2 and V element (t, d) at bs * hd + (d / 16) * 16 * bs +
 * (t / 2) * 32 + (d % 16) * 2 + t % 2. K moves in pairs of elements, V in
 * single elements: a transpose at that grain, which no run copy can do.
 *
 * Chunk block j (block id blocks[j]) holds tokens [j * bs, j * bs + count_j)
 * of the rows, count_j = min(bs, n_tokens - j * bs). gather != 0 copies blocks
 * to rows; gather == 0 copies rows to blocks, leaving blocks j < skip_blocks
 * alone. esize is the element size in bytes (1, 2, 4 or 8). The caller checks
 * every block id, the sizes, bs % 16 == 0 and hd % 16 == 0. Returns 0, or -1
 * for an element size it does not handle (nothing is copied).
 */
#define AMX_TILE_COPY(T)                                                                   \
    do {                                                                                   \
        T *lay = (T *)layer;                                                               \
        T *kr = (T *)k_rows;                                                               \
        T *vr = (T *)v_rows;                                                               \
        int64_t row_len = heads * hd;                                                      \
        for (int64_t j = 0; j < n_blocks; j++) {                                           \
            int64_t count = n_tokens - j * bs < bs ? n_tokens - j * bs : bs;               \
            if (count <= 0 || (!gather && j < skip_blocks)) continue;                      \
            for (int64_t h = 0; h < heads; h++) {                                          \
                T *region = lay + (blocks[j] * heads + h) * 2 * bs * hd;                   \
                T *vregion = region + bs * hd;                                             \
                T *rows_k = kr + j * bs * row_len + h * hd;                                \
                T *rows_v = vr + j * bs * row_len + h * hd;                                \
                /* K: per 16-token tile and dim pair, 32 contiguous elements (16 pairs). */ \
                for (int64_t t0 = 0; t0 < count; t0 += 16) {                               \
                    int64_t n = count - t0 < 16 ? count - t0 : 16;                         \
                    T *tile = region + (t0 / 16) * 16 * hd;                                \
                    for (int64_t dp = 0; dp < hd / 2; dp++) {                              \
                        T *pairs = tile + dp * 32;                                         \
                        for (int64_t i = 0; i < n; i++) {                                  \
                            T *row = rows_k + (t0 + i) * row_len + 2 * dp;                 \
                            if (gather) {                                                  \
                                row[0] = pairs[2 * i];                                     \
                                row[1] = pairs[2 * i + 1];                                 \
                            } else {                                                       \
                                pairs[2 * i] = row[0];                                     \
                                pairs[2 * i + 1] = row[1];                                 \
                            }                                                              \
                        }                                                                  \
                    }                                                                      \
                }                                                                          \
                /* V: per token pair and 16-dim tile, 32 contiguous elements. */          \
                for (int64_t t = 0; t < count; t += 2) {                                   \
                    T *r0 = rows_v + t * row_len;                                          \
                    T *r1 = t + 1 < count ? r0 + row_len : NULL;                           \
                    for (int64_t d0 = 0; d0 < hd; d0 += 16) {                              \
                        T *tile = vregion + (d0 / 16) * 16 * bs + (t / 2) * 32;            \
                        for (int64_t i = 0; i < 16; i++) {                                 \
                            if (gather) {                                                  \
                                r0[d0 + i] = tile[2 * i];                                  \
                                if (r1) r1[d0 + i] = tile[2 * i + 1];                      \
                            } else {                                                       \
                                tile[2 * i] = r0[d0 + i];                                  \
                                if (r1) tile[2 * i + 1] = r1[d0 + i];                      \
                            }                                                              \
                        }                                                                  \
                    }                                                                      \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    } while (0)

#if defined(KVMESH_X86) && defined(__GNUC__)
/*
 * The same copy for 2-byte elements (bf16, fp16) with AVX2, chosen at run
 * time: the scalar loops move 2 or 4 bytes per step. K: a tile of 16 tokens
 * is, in 4-byte units (one dim pair), the transpose of the 16 rows' units,
 * done as 8x8 transposes of 32-bit lanes. V: a token pair's 16-dim tile is
 * the two rows' 16 elements interleaved (unpack and lane permute; shuffles
 * to take it apart). Tiles with fewer than 16 tokens, and a last odd token,
 * go element by element as above. Returns 1 when it copied, 0 when the CPU
 * has no AVX2 (nothing was copied). Measured on one thread, 31 chunks of 256
 * bf16 tokens (15.5 MiB): scatter 6.4 vs 7.9 ms, gather 6.0 vs 8.3 ms (median
 * of five alternating rounds each). KVMESH_AMX_SCALAR=1 in the environment
 * makes kvmesh_amx_tiles take the scalar loops, to compare the two in one run.
 *
 * A scatter into a 32-byte aligned layer writes every whole tile line with
 * streaming stores (the reasons are the run copy's, at the top of this file)
 * and prefetches the source rows of the tile after next; a gather into
 * aligned chunk rows streams each token's head run whole. SmolLM2's shape, 31
 * chunks (174 MiB), one thread: scatter 4.2 -> 5.8 GB/s, gather 3.7 -> 5.7;
 * two threads: 6.8 -> 8.1 and 6.0 -> 8.3; a same-run memcpy: 7.3 GB/s.
 */
__attribute__((target("avx2"))) static void amx_transpose8(__m256i r[8]) {
    __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    __m256i t4 = _mm256_unpacklo_epi32(r[4], r[5]), t5 = _mm256_unpackhi_epi32(r[4], r[5]);
    __m256i t6 = _mm256_unpacklo_epi32(r[6], r[7]), t7 = _mm256_unpackhi_epi32(r[6], r[7]);
    __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
    __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
    r[0] = _mm256_permute2x128_si256(u0, u4, 0x20);
    r[1] = _mm256_permute2x128_si256(u1, u5, 0x20);
    r[2] = _mm256_permute2x128_si256(u2, u6, 0x20);
    r[3] = _mm256_permute2x128_si256(u3, u7, 0x20);
    r[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
    r[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
    r[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
    r[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

/* Copy an 8x8 block of 4-byte units: dst[c * dst_stride + r] = src[r * src_stride + c]. */
__attribute__((target("avx2"))) static void amx_block8(uint32_t *dst, int64_t dst_stride,
                                                       const uint32_t *src, int64_t src_stride) {
    __m256i r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(src + i * src_stride));
    amx_transpose8(r);
    for (int i = 0; i < 8; i++) _mm256_storeu_si256((__m256i *)(dst + i * dst_stride), r[i]);
}

__attribute__((target("avx2"))) static void amx_tiles_u16_avx2(
    uint16_t *lay, uint16_t *kr, uint16_t *vr, const int64_t *blocks, int64_t n_blocks,
    int64_t n_tokens, int64_t skip_blocks, int64_t heads, int64_t bs, int64_t hd, int gather) {
    const __m256i odd_even = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                              0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    int64_t row_len = heads * hd;
    /* Scatter writes whole 64-byte lines of vLLM's cache with streaming stores
     * when the layer is 32-byte aligned (always, for vLLM's page-aligned
     * tensors): no read for ownership of lines the copy overwrites whole. */
    const int stream = !gather && ((uintptr_t)lay % 32) == 0;
    /* A gather streams whole lines of the chunk's rows the same way, a token's
     * head (hd elements) at a time, when every such run is whole lines. */
    const int gstream = gather && ((uintptr_t)kr % 64) == 0 && ((uintptr_t)vr % 64) == 0 &&
                        (row_len * 2) % 64 == 0 && (hd * 2) % 64 == 0 && hd <= 256;
    for (int64_t j = 0; j < n_blocks; j++) {
        int64_t count = n_tokens - j * bs < bs ? n_tokens - j * bs : bs;
        if (count <= 0 || (!gather && j < skip_blocks)) continue;
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *region = lay + (blocks[j] * heads + h) * 2 * bs * hd;
            uint16_t *vregion = region + bs * hd;
            uint16_t *rows_k = kr + j * bs * row_len + h * hd;
            uint16_t *rows_v = vr + j * bs * row_len + h * hd;
            for (int64_t t0 = 0; t0 < count; t0 += 16) {
                int64_t n = count - t0 < 16 ? count - t0 : 16;
                uint16_t *tile = region + (t0 / 16) * 16 * hd;
                if (n == 16 && gstream) {
                    /* The next tile's lines (16 tokens' K, contiguous) while this one is
                     * taken apart. */
                    if (t0 + 32 <= count)
                        for (int64_t off = 0; off < 16 * hd * 2; off += LINE)
                            _mm_prefetch((const char *)(tile + 16 * hd) + off, _MM_HINT_T0);
                    uint32_t *t32 = (uint32_t *)tile;
                    uint32_t *r32 = (uint32_t *)(rows_k + t0 * row_len);
                    int64_t dst_stride = row_len / 2, groups = hd / 16;
                    for (int64_t half = 0; half < 16; half += 8) {
                        __m256i buf[16][8]; /* [unit group][token]: 8 tokens' whole runs */
                        for (int64_t g = 0; g < groups; g++) {
                            __m256i r[8];
                            for (int i = 0; i < 8; i++)
                                r[i] = _mm256_loadu_si256(
                                    (const __m256i *)(t32 + (8 * g + i) * 16 + half));
                            amx_transpose8(r);
                            for (int k = 0; k < 8; k++) buf[g][k] = r[k];
                        }
                        for (int k = 0; k < 8; k++) {
                            uint32_t *row = r32 + (half + k) * dst_stride;
                            for (int64_t g = 0; g < groups; g++)
                                _mm256_stream_si256((__m256i *)(row + 8 * g), buf[g][k]);
                        }
                    }
                    continue;
                }
                if (n == 16 && stream) {
                    /* Two 8x8 transposes (tokens 0-7, 8-15) give each tile row (one
                     * dim pair, 16 tokens) whole: one line, two streaming stores. */
                    uint32_t *t32 = (uint32_t *)tile;
                    const uint32_t *r32 = (const uint32_t *)(rows_k + t0 * row_len);
                    int64_t src_stride = row_len / 2;
                    if (t0 + 32 <= count)
                        for (int i = 16; i < 32; i++)
                            for (int64_t off = 0; off < hd * 2; off += 64)
                                _mm_prefetch((const char *)(rows_k + (t0 + i) * row_len) + off,
                                             _MM_HINT_T0);
                    for (int64_t dp = 0; dp < hd / 2; dp += 8) {
                        __m256i a[8], b[8];
                        for (int i = 0; i < 8; i++) {
                            a[i] = _mm256_loadu_si256((const __m256i *)(r32 + i * src_stride + dp));
                            b[i] = _mm256_loadu_si256(
                                (const __m256i *)(r32 + (8 + i) * src_stride + dp));
                        }
                        amx_transpose8(a);
                        amx_transpose8(b);
                        for (int k = 0; k < 8; k++) {
                            _mm256_stream_si256((__m256i *)(t32 + (dp + k) * 16), a[k]);
                            _mm256_stream_si256((__m256i *)(t32 + (dp + k) * 16 + 8), b[k]);
                        }
                    }
                    continue;
                }
                if (n == 16) {
                    /* tile as [hd/2][16] units, rows as [16][hd/2] units (stride row_len/2) */
                    uint32_t *t32 = (uint32_t *)tile;
                    uint32_t *r32 = (uint32_t *)(rows_k + t0 * row_len);
                    for (int64_t dp = 0; dp < hd / 2; dp += 8)
                        for (int64_t i = 0; i < 16; i += 8) {
                            if (gather)
                                amx_block8(r32 + i * (row_len / 2) + dp, row_len / 2,
                                           t32 + dp * 16 + i, 16);
                            else
                                amx_block8(t32 + dp * 16 + i, 16,
                                           r32 + i * (row_len / 2) + dp, row_len / 2);
                        }
                    continue;
                }
                for (int64_t dp = 0; dp < hd / 2; dp++) {
                    uint16_t *pairs = tile + dp * 32;
                    for (int64_t i = 0; i < n; i++) {
                        uint16_t *row = rows_k + (t0 + i) * row_len + 2 * dp;
                        if (gather) { row[0] = pairs[2 * i]; row[1] = pairs[2 * i + 1]; }
                        else { pairs[2 * i] = row[0]; pairs[2 * i + 1] = row[1]; }
                    }
                }
            }
            for (int64_t t = 0; gstream && t + 1 < count; t += 2) {
                /* V: a token pair's 16-dim tiles, taken apart into the two rows' whole runs. */
                uint16_t *r0 = rows_v + t * row_len, *r1 = r0 + row_len;
                __m256i w0[16], w1[16];
                if (t + 16 < count) /* each 16-dim tile's line of the pair 8 pairs on */
                    for (int64_t d0 = 0; d0 < hd; d0 += 16)
                        _mm_prefetch((const char *)(vregion + (d0 / 16) * 16 * bs + (t + 16) * 16),
                                     _MM_HINT_T0);
                for (int64_t d0 = 0; d0 < hd; d0 += 16) {
                    uint16_t *tile = vregion + (d0 / 16) * 16 * bs + (t / 2) * 32;
                    __m256i o0 = _mm256_loadu_si256((const __m256i *)tile);
                    __m256i o1 = _mm256_loadu_si256((const __m256i *)(tile + 16));
                    __m256i lo = _mm256_shuffle_epi8(_mm256_permute2x128_si256(o0, o1, 0x20), odd_even);
                    __m256i hi = _mm256_shuffle_epi8(_mm256_permute2x128_si256(o0, o1, 0x31), odd_even);
                    w0[d0 / 16] = _mm256_unpacklo_epi64(lo, hi);
                    w1[d0 / 16] = _mm256_unpackhi_epi64(lo, hi);
                }
                for (int64_t g = 0; g < hd / 16; g++)
                    _mm256_stream_si256((__m256i *)(r0 + 16 * g), w0[g]);
                for (int64_t g = 0; g < hd / 16; g++)
                    _mm256_stream_si256((__m256i *)(r1 + 16 * g), w1[g]);
            }
            for (int64_t t = gstream ? count - count % 2 : 0; t < count; t += 2) {
                if (stream && t % 16 == 0 && t + 32 <= count)
                    for (int i = 16; i < 32; i++)
                        for (int64_t off = 0; off < hd * 2; off += 64)
                            _mm_prefetch((const char *)(rows_v + (t + i) * row_len) + off,
                                         _MM_HINT_T0);
                uint16_t *r0 = rows_v + t * row_len;
                uint16_t *r1 = t + 1 < count ? r0 + row_len : NULL;
                for (int64_t d0 = 0; d0 < hd; d0 += 16) {
                    uint16_t *tile = vregion + (d0 / 16) * 16 * bs + (t / 2) * 32;
                    if (r1 == NULL) {
                        for (int64_t i = 0; i < 16; i++) {
                            if (gather) r0[d0 + i] = tile[2 * i];
                            else tile[2 * i] = r0[d0 + i];
                        }
                        continue;
                    }
                    if (gather) {
                        __m256i o0 = _mm256_loadu_si256((const __m256i *)tile);
                        __m256i o1 = _mm256_loadu_si256((const __m256i *)(tile + 16));
                        __m256i lo = _mm256_shuffle_epi8(_mm256_permute2x128_si256(o0, o1, 0x20), odd_even);
                        __m256i hi = _mm256_shuffle_epi8(_mm256_permute2x128_si256(o0, o1, 0x31), odd_even);
                        _mm256_storeu_si256((__m256i *)(r0 + d0), _mm256_unpacklo_epi64(lo, hi));
                        _mm256_storeu_si256((__m256i *)(r1 + d0), _mm256_unpackhi_epi64(lo, hi));
                    } else {
                        __m256i a = _mm256_loadu_si256((const __m256i *)(r0 + d0));
                        __m256i b = _mm256_loadu_si256((const __m256i *)(r1 + d0));
                        __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
                        __m256i w0 = _mm256_permute2x128_si256(lo, hi, 0x20);
                        __m256i w1 = _mm256_permute2x128_si256(lo, hi, 0x31);
                        if (stream) { /* the pair's 16 dims: one whole line */
                            _mm256_stream_si256((__m256i *)tile, w0);
                            _mm256_stream_si256((__m256i *)(tile + 16), w1);
                        } else {
                            _mm256_storeu_si256((__m256i *)tile, w0);
                            _mm256_storeu_si256((__m256i *)(tile + 16), w1);
                        }
                    }
                }
            }
        }
    }
    if (stream || gstream) _mm_sfence(); /* streaming stores are weakly ordered */
}

static int amx_tiles_simd(void *layer, void *k_rows, void *v_rows, const int64_t *blocks,
                          int64_t n_blocks, int64_t n_tokens, int64_t skip_blocks, int64_t heads,
                          int64_t bs, int64_t hd, int64_t esize, int gather) {
    if (esize != 2 || !__builtin_cpu_supports("avx2")) return 0;
    amx_tiles_u16_avx2((uint16_t *)layer, (uint16_t *)k_rows, (uint16_t *)v_rows, blocks, n_blocks,
                       n_tokens, skip_blocks, heads, bs, hd, gather);
    return 1;
}
#else
static int amx_tiles_simd(void *layer, void *k_rows, void *v_rows, const int64_t *blocks,
                          int64_t n_blocks, int64_t n_tokens, int64_t skip_blocks, int64_t heads,
                          int64_t bs, int64_t hd, int64_t esize, int gather) {
    (void)layer; (void)k_rows; (void)v_rows; (void)blocks; (void)n_blocks; (void)n_tokens;
    (void)skip_blocks; (void)heads; (void)bs; (void)hd; (void)esize; (void)gather;
    return 0;
}
#endif

KVMESH_EXPORT int kvmesh_amx_tiles(void *layer, void *k_rows, void *v_rows,
                                   const int64_t *blocks, int64_t n_blocks, int64_t n_tokens,
                                   int64_t skip_blocks, int64_t heads, int64_t bs, int64_t hd,
                                   int64_t esize, int gather) {
    if (getenv("KVMESH_AMX_SCALAR") == NULL &&
        amx_tiles_simd(layer, k_rows, v_rows, blocks, n_blocks, n_tokens, skip_blocks, heads, bs,
                       hd, esize, gather))
        return 0;
    switch (esize) {
    case 1: AMX_TILE_COPY(uint8_t); return 0;
    case 2: AMX_TILE_COPY(uint16_t); return 0;
    case 4: AMX_TILE_COPY(uint32_t); return 0;
    case 8: AMX_TILE_COPY(uint64_t); return 0;
    default: return -1;
    }
}

/*
 * kvmesh_vec_tiles - one layer of vLLM's CPU KV layout for its "vec" ISA
 * (KV_LAYOUT_KIND_VLLM_CPU) to or from a chunk's K and V rows.
 *
 * Inside one (block, head) region of 2 * bs * hd elements, K is transposed
 * (element (t, d) at d * bs + t) and V is row-major after it (at bs * hd +
 * t * hd + d). A chunk row is one token: heads * hd elements, head h at h * hd.
 * V is therefore one run of hd elements per token; K is a transpose, done in
 * 8x8 squares of 2-byte elements with SSE2 (every x86-64 CPU has it) and
 * element by element for other sizes and for a tail of fewer than 8 tokens.
 * Arguments as for kvmesh_amx_tiles (blocks j < skip_blocks are not written
 * by a scatter). Returns 0, or -1 for an element size it does not handle.
 * KVMESH_AMX_SCALAR (also read here) makes it take the element loops.
 */
#define VEC_TILE_COPY(T)                                                                   \
    do {                                                                                   \
        T *lay = (T *)layer;                                                               \
        int64_t row_len = heads * hd;                                                      \
        for (int64_t j = 0; j < n_blocks; j++) {                                           \
            int64_t count = n_tokens - j * bs < bs ? n_tokens - j * bs : bs;               \
            if (count <= 0 || (!gather && j < skip_blocks)) continue;                      \
            for (int64_t h = 0; h < heads; h++) {                                          \
                T *region = lay + (blocks[j] * heads + h) * 2 * bs * hd;                   \
                T *rows_k = (T *)k_rows + j * bs * row_len + h * hd;                       \
                T *rows_v = (T *)v_rows + j * bs * row_len + h * hd;                       \
                int64_t t0 = simd ? vec_k_u16((uint16_t *)region, (uint16_t *)rows_k,      \
                                              (const uint16_t *)rows_v, count, bs, hd,     \
                                              row_len, gather)                             \
                                  : 0;                                                     \
                for (int64_t t = t0; t < count; t++)                                       \
                    for (int64_t d = 0; d < hd; d++) {                                     \
                        if (gather) rows_k[t * row_len + d] = region[d * bs + t];          \
                        else region[d * bs + t] = rows_k[t * row_len + d];                 \
                    }                                                                      \
                int64_t v0 = !simd   ? 0                                                   \
                             : gather ? vec_v_gather_stream_u16((uint16_t *)(region + bs * hd),    \
                                                                (uint16_t *)rows_v, count, hd,     \
                                                                row_len)                           \
                                      : vec_v_scatter_stream_u16((uint16_t *)(region + bs * hd),   \
                                                                 (uint16_t *)rows_v, count, hd,    \
                                                                 row_len);                         \
                for (int64_t t = v0; t < count; t++) {                                     \
                    T *v = region + bs * hd + t * hd;                                      \
                    if (gather) memcpy(rows_v + t * row_len, v, (size_t)hd * sizeof(T));   \
                    else memcpy(v, rows_v + t * row_len, (size_t)hd * sizeof(T));          \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    } while (0)

#ifdef KVMESH_X86
/* Transpose 8 rows of 8 2-byte elements in place: r[i][j] becomes r[j][i]. */
static inline void vec_transpose8x8_u16(__m128i r[8]) {
    __m128i a0 = _mm_unpacklo_epi16(r[0], r[1]), a1 = _mm_unpackhi_epi16(r[0], r[1]);
    __m128i a2 = _mm_unpacklo_epi16(r[2], r[3]), a3 = _mm_unpackhi_epi16(r[2], r[3]);
    __m128i a4 = _mm_unpacklo_epi16(r[4], r[5]), a5 = _mm_unpackhi_epi16(r[4], r[5]);
    __m128i a6 = _mm_unpacklo_epi16(r[6], r[7]), a7 = _mm_unpackhi_epi16(r[6], r[7]);
    __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
    __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
    __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
    __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
    r[0] = _mm_unpacklo_epi64(b0, b4); r[1] = _mm_unpackhi_epi64(b0, b4);
    r[2] = _mm_unpacklo_epi64(b1, b5); r[3] = _mm_unpackhi_epi64(b1, b5);
    r[4] = _mm_unpacklo_epi64(b2, b6); r[5] = _mm_unpackhi_epi64(b2, b6);
    r[6] = _mm_unpacklo_epi64(b3, b7); r[7] = _mm_unpackhi_epi64(b3, b7);
}

/* Prefetches the hd elements of rows [first, first + n) of a chunk's plane (every
 * line of each token's head run), for rows before `end` only. */
static inline void vec_prefetch_rows(const uint16_t *rows, int64_t first, int64_t n,
                                     int64_t end, int64_t hd, int64_t row_len) {
    for (int64_t t = first; t < first + n && t < end; t++)
        for (int64_t off = 0; off < hd * 2; off += LINE)
            _mm_prefetch((const char *)(rows + t * row_len) + off, _MM_HINT_T0);
}

/* Rows of V prefetched ahead of the one a scatter copies. */
#ifndef VEC_V_AHEAD
#define VEC_V_AHEAD 8
#endif

/* Scatter of K for whole groups of 32 tokens with streaming stores: four 8x8
 * transposes give each of 8 dims 32 tokens, one whole line of the transposed
 * region. Needs a 64-byte aligned region and bs a multiple of 32; returns the
 * tokens done. While a group is transposed, the next group's rows are
 * prefetched, a share per 8 dims: the group reads 32 rows a row_len apart,
 * one line of each at a time, and without it each load waited on memory
 * (7 GB/s from memory on one thread against 17 GB/s with it, the tiny test
 * model's shape; docs/kernels.md, "Gather and scatter"). */
static int64_t vec_k_scatter_stream_u16(uint16_t *region, const uint16_t *rows,
                                        const uint16_t *v_rows, int64_t count, int64_t bs,
                                        int64_t hd, int64_t row_len) {
    if (bs % 32 || ((uintptr_t)region % 64)) return 0;
    int64_t whole = count - count % 32;
    int64_t share = 32 / (hd / 8) > 0 ? 32 / (hd / 8) : 1; /* rows prefetched per 8 dims */
    __m128i r[4][8];
    vec_prefetch_rows(rows, 0, 32, whole, hd, row_len);
    for (int64_t t0 = 0; t0 < whole; t0 += 32)
        for (int64_t d0 = 0; d0 < hd; d0 += 8) {
            vec_prefetch_rows(rows, t0 + 32 + d0 / 8 * share, share, whole, hd, row_len);
            vec_prefetch_rows(v_rows, t0 + d0 / 8 * share, share, whole, hd, row_len);
            for (int q = 0; q < 4; q++) {
                for (int i = 0; i < 8; i++)
                    r[q][i] = _mm_loadu_si128(
                        (const __m128i *)(rows + (t0 + 8 * q + i) * row_len + d0));
                vec_transpose8x8_u16(r[q]);
            }
            for (int i = 0; i < 8; i++) {
                __m128i *line = (__m128i *)(region + (d0 + i) * bs + t0);
                for (int q = 0; q < 4; q++) _mm_stream_si128(line + q, r[q][i]);
            }
        }
    return whole;
}

/* V rows of one (block, head) with streaming stores: token t's hd elements land
 * at region + bs * hd + t * hd, so the block's V is one aligned run of whole
 * lines. Needs that run 64-byte aligned and hd * 2 a multiple of 64; returns
 * the tokens done. */
static int64_t vec_v_scatter_stream_u16(uint16_t *vregion, const uint16_t *rows, int64_t count,
                                        int64_t hd, int64_t row_len) {
    if ((hd * 2) % 64 || ((uintptr_t)vregion % 64)) return 0;
    vec_prefetch_rows(rows, 0, VEC_V_AHEAD, count, hd, row_len);
    for (int64_t t = 0; t < count; t++) {
        vec_prefetch_rows(rows, t + VEC_V_AHEAD, 1, count, hd, row_len);
        const __m128i *src = (const __m128i *)(rows + t * row_len);
        __m128i *dst = (__m128i *)(vregion + t * hd);
        for (int64_t i = 0; i < hd / 8; i++) _mm_stream_si128(dst + i, _mm_loadu_si128(src + i));
    }
    return count;
}

/* Gather of K for whole groups of 8 tokens with streaming stores: hd / 8
 * transposes give each token its head's hd elements, whole lines of its chunk
 * row. Needs the rows' runs whole aligned lines (hd * 2 and row_len * 2
 * multiples of 64, rows 64-byte aligned) and hd <= 256; returns the tokens done. */
static int64_t vec_k_gather_stream_u16(const uint16_t *region, uint16_t *rows, int64_t count,
                                       int64_t bs, int64_t hd, int64_t row_len) {
    if ((hd * 2) % 64 || (row_len * 2) % 64 || ((uintptr_t)rows % 64) || hd > 256) return 0;
    int64_t whole = count - count % 8;
    const uint16_t *vregion = region + bs * hd;
    __m128i buf[32][8];
    for (int64_t t0 = 0; t0 < whole; t0 += 8) {
        /* A line of the transposed K holds 32 tokens of one dim: each group of 8
         * tokens prefetches a quarter of the dims' lines of the next 32 tokens,
         * and the V rows of its own 8 tokens, which the V copy reads next. */
        int64_t next = t0 - t0 % 32 + 32, quarter = (t0 % 32) / 8;
        if (next < whole)
            for (int64_t d = quarter * hd / 4; d < (quarter + 1) * hd / 4; d++)
                _mm_prefetch((const char *)(region + d * bs + next), _MM_HINT_T0);
        for (int64_t off = 0; off < 8 * hd * 2; off += LINE)
            _mm_prefetch((const char *)(vregion + t0 * hd) + off, _MM_HINT_T0);
        for (int64_t d0 = 0; d0 < hd; d0 += 8) {
            __m128i r[8];
            for (int i = 0; i < 8; i++)
                r[i] = _mm_loadu_si128((const __m128i *)(region + (d0 + i) * bs + t0));
            vec_transpose8x8_u16(r);
            for (int k = 0; k < 8; k++) buf[d0 / 8][k] = r[k];
        }
        for (int k = 0; k < 8; k++) {
            __m128i *line = (__m128i *)(rows + (t0 + k) * row_len);
            for (int64_t g = 0; g < hd / 8; g++) _mm_stream_si128(line + g, buf[g][k]);
        }
    }
    return whole;
}

/* Gather of V with streaming stores (each token's hd elements: whole aligned lines of
 * its chunk row, under the same conditions as the K gather); returns the tokens done. */
static int64_t vec_v_gather_stream_u16(const uint16_t *vregion, uint16_t *rows, int64_t count,
                                       int64_t hd, int64_t row_len) {
    if ((hd * 2) % 64 || (row_len * 2) % 64 || ((uintptr_t)rows % 64)) return 0;
    for (int64_t t = 0; t < count; t++) {
        const __m128i *src = (const __m128i *)(vregion + t * hd);
        __m128i *dst = (__m128i *)(rows + t * row_len);
        for (int64_t i = 0; i < hd / 8; i++) _mm_stream_si128(dst + i, _mm_loadu_si128(src + i));
    }
    return count;
}

/* K of one (block, head), 2-byte elements, whole groups of 8 tokens; returns the
 * first token left for the element loop. Needs hd a multiple of 8. A scatter
 * into an aligned region takes the streaming path for whole groups of 32 (and
 * prefetches the V rows `v_rows` the V copy reads next), a gather into aligned
 * rows one for every group. */
static int64_t vec_k_u16(uint16_t *region, uint16_t *rows, const uint16_t *v_rows,
                         int64_t count, int64_t bs, int64_t hd, int64_t row_len, int gather) {
    if (hd % 8) return 0;
    int64_t whole = count - count % 8;
    int64_t start =
        gather ? vec_k_gather_stream_u16(region, rows, whole, bs, hd, row_len)
               : vec_k_scatter_stream_u16(region, rows, v_rows, whole, bs, hd, row_len);
    __m128i r[8];
    for (int64_t t0 = start; t0 < whole; t0 += 8)
        for (int64_t d0 = 0; d0 < hd; d0 += 8) {
            if (gather) {
                for (int i = 0; i < 8; i++)
                    r[i] = _mm_loadu_si128((const __m128i *)(region + (d0 + i) * bs + t0));
                vec_transpose8x8_u16(r);
                for (int i = 0; i < 8; i++)
                    _mm_storeu_si128((__m128i *)(rows + (t0 + i) * row_len + d0), r[i]);
            } else {
                for (int i = 0; i < 8; i++)
                    r[i] = _mm_loadu_si128((const __m128i *)(rows + (t0 + i) * row_len + d0));
                vec_transpose8x8_u16(r);
                for (int i = 0; i < 8; i++)
                    _mm_storeu_si128((__m128i *)(region + (d0 + i) * bs + t0), r[i]);
            }
        }
    return whole;
}
#define VEC_SIMD_OK 1
#else
static int64_t vec_k_u16(uint16_t *region, uint16_t *rows, const uint16_t *v_rows,
                         int64_t count, int64_t bs, int64_t hd, int64_t row_len, int gather) {
    (void)region; (void)rows; (void)v_rows; (void)count; (void)bs; (void)hd; (void)row_len;
    (void)gather;
    return 0;
}
static int64_t vec_v_scatter_stream_u16(uint16_t *vregion, const uint16_t *rows, int64_t count,
                                        int64_t hd, int64_t row_len) {
    (void)vregion; (void)rows; (void)count; (void)hd; (void)row_len;
    return 0;
}
static int64_t vec_v_gather_stream_u16(const uint16_t *vregion, uint16_t *rows, int64_t count,
                                       int64_t hd, int64_t row_len) {
    (void)vregion; (void)rows; (void)count; (void)hd; (void)row_len;
    return 0;
}
#define VEC_SIMD_OK 0
#endif

KVMESH_EXPORT int kvmesh_vec_tiles(void *layer, void *k_rows, void *v_rows,
                                   const int64_t *blocks, int64_t n_blocks, int64_t n_tokens,
                                   int64_t skip_blocks, int64_t heads, int64_t bs, int64_t hd,
                                   int64_t esize, int gather) {
    int simd = VEC_SIMD_OK && esize == 2 && getenv("KVMESH_AMX_SCALAR") == NULL;
    switch (esize) {
    case 1: simd = 0; VEC_TILE_COPY(uint8_t); return 0;
    case 2:
        VEC_TILE_COPY(uint16_t);
#ifdef KVMESH_X86
        if (simd) _mm_sfence(); /* the streaming stores above are weakly ordered */
#endif
        return 0;
    case 4: simd = 0; VEC_TILE_COPY(uint32_t); return 0;
    case 8: simd = 0; VEC_TILE_COPY(uint64_t); return 0;
    default: return -1;
    }
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
        int rc = layout == 0
                     ? kvmesh_amx_tiles(lay, k, v, blocks, it[4], it[5], it[6], heads, bs, hd,
                                        esize, gather)
                     : kvmesh_vec_tiles(lay, k, v, blocks, it[4], it[5], it[6], heads, bs, hd,
                                        esize, gather);
        if (rc != 0) return rc;
    }
    return 0;
}
