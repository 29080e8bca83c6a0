/*
 * tiles_vec.c - vLLM's CPU KV layout for its "vec" ISA (part of the native copy
 * library; see ntcopy.c and ntcopy.h).
 */
#include "ntcopy.h"

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
            kvmesh_ahead ahead;                                                            \
            kvmesh_ahead_set(&ahead, layer, k_rows, v_rows, blocks, j, n_blocks, n_tokens, \
                             next_item, heads, bs, hd, sizeof(T), gather,                  \
                             2 * heads * ((count + 31) / 32));                             \
            for (int64_t h = 0; h < heads; h++) {                                          \
                T *region = lay + (blocks[j] * heads + h) * 2 * bs * hd;                   \
                T *rows_k = (T *)k_rows + j * bs * row_len + h * hd;                       \
                T *rows_v = (T *)v_rows + j * bs * row_len + h * hd;                       \
                int64_t t0 = simd ? vec_k_u16((uint16_t *)region, (uint16_t *)rows_k,      \
                                              (const uint16_t *)rows_v, count, bs, hd,     \
                                              row_len, gather, &ahead)                     \
                                  : 0;                                                     \
                for (int64_t t = t0; t < count; t++)                                       \
                    for (int64_t d = 0; d < hd; d++) {                                     \
                        if (gather) rows_k[t * row_len + d] = region[d * bs + t];          \
                        else region[d * bs + t] = rows_k[t * row_len + d];                 \
                    }                                                                      \
                int64_t v0 = !simd   ? 0                                                   \
                             : gather ? vec_v_gather_stream_u16((uint16_t *)(region + bs * hd),    \
                                                                (uint16_t *)rows_v, count, hd,     \
                                                                row_len, &ahead)                   \
                                      : vec_v_scatter_stream_u16((uint16_t *)(region + bs * hd),   \
                                                                 (uint16_t *)rows_v, count, hd,    \
                                                                 row_len, &ahead);                 \
                for (int64_t t = v0; t < count; t++) {                                     \
                    T *v = region + bs * hd + t * hd;                                      \
                    if (gather) memcpy(rows_v + t * row_len, v, (size_t)hd * sizeof(T));   \
                    else memcpy(v, rows_v + t * row_len, (size_t)hd * sizeof(T));          \
                }                                                                          \
            }                                                                              \
            kvmesh_ahead_finish(&ahead);                                                   \
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
            KVMESH_PREFETCH((const char *)(rows + t * row_len) + off);
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
 * model's shape; docs/kernels.md, "Gather and scatter"). Each group also takes
 * a step of `ahead`, the next block's source (ntcopy.h). */
static int64_t vec_k_scatter_stream_u16(uint16_t *region, const uint16_t *rows,
                                        const uint16_t *v_rows, int64_t count, int64_t bs,
                                        int64_t hd, int64_t row_len, kvmesh_ahead *ahead) {
    if (bs % 32 || ((uintptr_t)region % 64)) return 0;
    int64_t whole = count - count % 32;
    int64_t share = 32 / (hd / 8) > 0 ? 32 / (hd / 8) : 1; /* rows prefetched per 8 dims */
    __m128i r[4][8];
    vec_prefetch_rows(rows, 0, 32, whole, hd, row_len);
    for (int64_t t0 = 0; t0 < whole; t0 += 32) {
        kvmesh_ahead_step(ahead);
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
    }
    return whole;
}

/* V rows of one (block, head) with streaming stores: token t's hd elements land
 * at region + bs * hd + t * hd, so the block's V is one aligned run of whole
 * lines. Needs that run 64-byte aligned and hd * 2 a multiple of 64; returns
 * the tokens done. */
static int64_t vec_v_scatter_stream_u16(uint16_t *vregion, const uint16_t *rows, int64_t count,
                                        int64_t hd, int64_t row_len, kvmesh_ahead *ahead) {
    if ((hd * 2) % 64 || ((uintptr_t)vregion % 64)) return 0;
    vec_prefetch_rows(rows, 0, VEC_V_AHEAD, count, hd, row_len);
    for (int64_t t = 0; t < count; t++) {
        if (t % 32 == 0) kvmesh_ahead_step(ahead);
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
                                       int64_t bs, int64_t hd, int64_t row_len,
                                       kvmesh_ahead *ahead) {
    if ((hd * 2) % 64 || (row_len * 2) % 64 || ((uintptr_t)rows % 64) || hd > 256) return 0;
    int64_t whole = count - count % 8;
    const uint16_t *vregion = region + bs * hd;
    __m128i buf[32][8];
    for (int64_t t0 = 0; t0 < whole; t0 += 8) {
        if (t0 % 32 == 0) kvmesh_ahead_step(ahead);
        /* A line of the transposed K holds 32 tokens of one dim: each group of 8
         * tokens prefetches a quarter of the dims' lines of the next 32 tokens,
         * and the V rows of its own 8 tokens, which the V copy reads next. */
        int64_t next = t0 - t0 % 32 + 32, quarter = (t0 % 32) / 8;
        if (next < whole)
            for (int64_t d = quarter * hd / 4; d < (quarter + 1) * hd / 4; d++)
                KVMESH_PREFETCH((const char *)(region + d * bs + next));
        for (int64_t off = 0; off < 8 * hd * 2; off += LINE)
            KVMESH_PREFETCH((const char *)(vregion + t0 * hd) + off);
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
                                       int64_t hd, int64_t row_len, kvmesh_ahead *ahead) {
    if ((hd * 2) % 64 || (row_len * 2) % 64 || ((uintptr_t)rows % 64)) return 0;
    for (int64_t t = 0; t < count; t++) {
        if (t % 32 == 0) kvmesh_ahead_step(ahead);
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
                         int64_t count, int64_t bs, int64_t hd, int64_t row_len, int gather,
                         kvmesh_ahead *ahead) {
    if (hd % 8) return 0;
    int64_t whole = count - count % 8;
    int64_t start =
        gather ? vec_k_gather_stream_u16(region, rows, whole, bs, hd, row_len, ahead)
               : vec_k_scatter_stream_u16(region, rows, v_rows, whole, bs, hd, row_len, ahead);
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
                         int64_t count, int64_t bs, int64_t hd, int64_t row_len, int gather,
                         kvmesh_ahead *ahead) {
    (void)region; (void)rows; (void)v_rows; (void)count; (void)bs; (void)hd; (void)row_len;
    (void)gather; (void)ahead;
    return 0;
}
static int64_t vec_v_scatter_stream_u16(uint16_t *vregion, const uint16_t *rows, int64_t count,
                                        int64_t hd, int64_t row_len, kvmesh_ahead *ahead) {
    (void)vregion; (void)rows; (void)count; (void)hd; (void)row_len; (void)ahead;
    return 0;
}
static int64_t vec_v_gather_stream_u16(const uint16_t *vregion, uint16_t *rows, int64_t count,
                                       int64_t hd, int64_t row_len, kvmesh_ahead *ahead) {
    (void)vregion; (void)rows; (void)count; (void)hd; (void)row_len; (void)ahead;
    return 0;
}
#define VEC_SIMD_OK 0
#endif

int kvmesh_vec_tiles(void *layer, void *k_rows, void *v_rows, const int64_t *blocks,
                     int64_t n_blocks, int64_t n_tokens, int64_t skip_blocks, int64_t heads,
                     int64_t bs, int64_t hd, int64_t esize, int gather,
                     const int64_t *next_item) {
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
