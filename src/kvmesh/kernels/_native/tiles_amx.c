/*
 * tiles_amx.c - vLLM's CPU KV layout for its AMX ISA (part of the native copy
 * library; see ntcopy.c and ntcopy.h).
 */
#include "ntcopy.h"

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
    int64_t n_tokens, int64_t skip_blocks, int64_t heads, int64_t bs, int64_t hd, int gather,
    const int64_t *next_item) {
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
        kvmesh_ahead ahead;
        kvmesh_ahead_set(&ahead, lay, kr, vr, blocks, j, n_blocks, n_tokens, next_item, heads,
                         bs, hd, 2, gather, 2 * heads * ((count + 31) / 32));
        for (int64_t h = 0; h < heads; h++) {
            uint16_t *region = lay + (blocks[j] * heads + h) * 2 * bs * hd;
            uint16_t *vregion = region + bs * hd;
            uint16_t *rows_k = kr + j * bs * row_len + h * hd;
            uint16_t *rows_v = vr + j * bs * row_len + h * hd;
            for (int64_t t0 = 0; t0 < count; t0 += 16) {
                if (t0 % 32 == 0) kvmesh_ahead_step(&ahead);
                int64_t n = count - t0 < 16 ? count - t0 : 16;
                uint16_t *tile = region + (t0 / 16) * 16 * hd;
                if (n == 16 && gstream) {
                    /* The next tile's lines (16 tokens' K, contiguous) while this one is
                     * taken apart. */
                    if (t0 + 32 <= count)
                        for (int64_t off = 0; off < 16 * hd * 2; off += LINE)
                            KVMESH_PREFETCH((const char *)(tile + 16 * hd) + off);
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
                                KVMESH_PREFETCH((const char *)(rows_k + (t0 + i) * row_len) + off);
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
                if (t % 32 == 0) kvmesh_ahead_step(&ahead);
                /* V: a token pair's 16-dim tiles, taken apart into the two rows' whole runs. */
                uint16_t *r0 = rows_v + t * row_len, *r1 = r0 + row_len;
                __m256i w0[16], w1[16];
                if (t + 16 < count) /* each 16-dim tile's line of the pair 8 pairs on */
                    for (int64_t d0 = 0; d0 < hd; d0 += 16)
                        KVMESH_PREFETCH((const char *)(vregion + (d0 / 16) * 16 * bs + (t + 16) * 16));
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
                if (t % 32 == 0) kvmesh_ahead_step(&ahead);
                if (stream && t % 16 == 0 && t + 32 <= count)
                    for (int i = 16; i < 32; i++)
                        for (int64_t off = 0; off < hd * 2; off += 64)
                            KVMESH_PREFETCH((const char *)(rows_v + (t + i) * row_len) + off);
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
        kvmesh_ahead_finish(&ahead);
    }
    if (stream || gstream) _mm_sfence(); /* streaming stores are weakly ordered */
}

static int amx_tiles_simd(void *layer, void *k_rows, void *v_rows, const int64_t *blocks,
                          int64_t n_blocks, int64_t n_tokens, int64_t skip_blocks, int64_t heads,
                          int64_t bs, int64_t hd, int64_t esize, int gather,
                          const int64_t *next_item) {
    if (esize != 2 || !__builtin_cpu_supports("avx2")) return 0;
    amx_tiles_u16_avx2((uint16_t *)layer, (uint16_t *)k_rows, (uint16_t *)v_rows, blocks, n_blocks,
                       n_tokens, skip_blocks, heads, bs, hd, gather, next_item);
    return 1;
}
#else
static int amx_tiles_simd(void *layer, void *k_rows, void *v_rows, const int64_t *blocks,
                          int64_t n_blocks, int64_t n_tokens, int64_t skip_blocks, int64_t heads,
                          int64_t bs, int64_t hd, int64_t esize, int gather,
                          const int64_t *next_item) {
    (void)layer; (void)k_rows; (void)v_rows; (void)blocks; (void)n_blocks; (void)n_tokens;
    (void)skip_blocks; (void)heads; (void)bs; (void)hd; (void)esize; (void)gather;
    (void)next_item;
    return 0;
}
#endif

int kvmesh_amx_tiles(void *layer, void *k_rows, void *v_rows, const int64_t *blocks,
                     int64_t n_blocks, int64_t n_tokens, int64_t skip_blocks, int64_t heads,
                     int64_t bs, int64_t hd, int64_t esize, int gather,
                     const int64_t *next_item) {
    if (getenv("KVMESH_AMX_SCALAR") == NULL &&
        amx_tiles_simd(layer, k_rows, v_rows, blocks, n_blocks, n_tokens, skip_blocks, heads, bs,
                       hd, esize, gather, next_item))
        return 0;
    switch (esize) {
    case 1: AMX_TILE_COPY(uint8_t); return 0;
    case 2: AMX_TILE_COPY(uint16_t); return 0;
    case 4: AMX_TILE_COPY(uint32_t); return 0;
    case 8: AMX_TILE_COPY(uint64_t); return 0;
    default: return -1;
    }
}
