/*
 * ntcopy.h - what the native copy library's files share (see ntcopy.c).
 *
 * The library is three files: ntcopy.c (runs of bytes with streaming stores,
 * the CPU's instruction set, the batch entry point), tiles_amx.c and
 * tiles_vec.c (vLLM's two CPU KV layouts). They build into one shared
 * library, kvmesh/kernels/_ntcopy*.so.
 */
#ifndef KVMESH_NTCOPY_H
#define KVMESH_NTCOPY_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVMESH_X86 1
#endif

#define KVMESH_EXPORT __attribute__((visibility("default")))

/* One cache line. */
#define LINE 64

#ifdef KVMESH_X86
/* Software prefetch of the line at `p` into L2 (`_MM_HINT_T1`), not L1. The tile
 * kernels prefetch whole rows and blocks ahead, tens of KiB at a time: on a Zen 4
 * host (32 KiB of L1 per core) the same prefetches into L1 left every tile copy
 * slower, up to 1.6x (docs/kernels.md, "Gather and scatter"). */
#define KVMESH_PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)
#endif

/*
 * The source of the block a tile kernel copies next, prefetched a share at a
 * time while it copies the current one. A load reads chunks written long ago,
 * so every source line comes from memory; the kernels' own prefetches look a
 * few rows ahead inside a block and start each block cold, which left a copy
 * at half a memcpy's speed (docs/kernels.md, "Gather and scatter"). The next
 * block is the item's next one or, after its last, the first block of the
 * batch's next item. A scatter's source is the block's K rows and V rows of
 * the chunk (two runs), a gather's the block in the engine's layer (all heads,
 * K and V: one run).
 */
typedef struct {
    const char *at[2], *end[2];
    int64_t share[2]; /* bytes of each run per step */
} kvmesh_ahead;

/* Prefetches the next share of each run. */
static inline void kvmesh_ahead_step(kvmesh_ahead *a) {
#ifdef KVMESH_X86
    for (int r = 0; r < 2; r++) {
        const char *stop = a->end[r] - a->at[r] > a->share[r] ? a->at[r] + a->share[r] : a->end[r];
        for (; a->at[r] < stop; a->at[r] += LINE) KVMESH_PREFETCH(a->at[r]);
    }
#else
    (void)a;
#endif
}

/* Prefetches what is left of both runs. */
static inline void kvmesh_ahead_finish(kvmesh_ahead *a) {
    a->share[0] = a->end[0] - a->at[0];
    a->share[1] = a->end[1] - a->at[1];
    kvmesh_ahead_step(a);
}

/*
 * Aims `a` at the source of block j + 1 of an item (layer, k_rows, v_rows,
 * blocks, n_blocks, n_tokens, as the batch's rows give them), or at the first
 * block of `next_item` (a batch row, or NULL) after the item's last; `steps`
 * calls of kvmesh_ahead_step then cover it.
 */
static inline void kvmesh_ahead_set(kvmesh_ahead *a, const void *layer, const void *k_rows,
                                    const void *v_rows, const int64_t *blocks, int64_t j,
                                    int64_t n_blocks, int64_t n_tokens,
                                    const int64_t *next_item, int64_t heads, int64_t bs,
                                    int64_t hd, int64_t esize, int gather, int64_t steps) {
    a->at[0] = a->end[0] = a->at[1] = a->end[1] = NULL;
    a->share[0] = a->share[1] = 0;
    int64_t next = j + 1;
    if (next >= n_blocks) {
        if (next_item == NULL) return;
        layer = (const void *)(intptr_t)next_item[0];
        k_rows = (const void *)(intptr_t)next_item[1];
        v_rows = (const void *)(intptr_t)next_item[2];
        blocks = (const int64_t *)(intptr_t)next_item[3];
        n_blocks = next_item[4];
        n_tokens = next_item[5];
        next = 0;
        if (n_blocks <= 0) return;
    }
    int64_t count = n_tokens - next * bs < bs ? n_tokens - next * bs : bs;
    if (count <= 0 || steps <= 0) return;
    int64_t row_bytes = heads * hd * esize;
    if (gather) {
        a->at[0] = (const char *)layer + blocks[next] * heads * 2 * bs * hd * esize;
        a->end[0] = a->at[0] + heads * 2 * bs * hd * esize;
    } else {
        a->at[0] = (const char *)k_rows + next * bs * row_bytes;
        a->end[0] = a->at[0] + count * row_bytes;
        a->at[1] = (const char *)v_rows + next * bs * row_bytes;
        a->end[1] = a->at[1] + count * row_bytes;
    }
    for (int r = 0; r < 2; r++) {
        int64_t share = ((a->end[r] - a->at[r]) + steps - 1) / steps;
        a->share[r] = (share + LINE - 1) / LINE * LINE;
    }
}

/* One layer of vLLM's CPU KV layout with AMX, or for its "vec" ISA (tiles_amx.c,
 * tiles_vec.c), to or from a chunk's K and V rows; `next_item` is the batch's
 * next row (or NULL), whose first block's source is prefetched meanwhile. */
int kvmesh_amx_tiles(void *layer, void *k_rows, void *v_rows, const int64_t *blocks,
                     int64_t n_blocks, int64_t n_tokens, int64_t skip_blocks, int64_t heads,
                     int64_t bs, int64_t hd, int64_t esize, int gather,
                     const int64_t *next_item);
int kvmesh_vec_tiles(void *layer, void *k_rows, void *v_rows, const int64_t *blocks,
                     int64_t n_blocks, int64_t n_tokens, int64_t skip_blocks, int64_t heads,
                     int64_t bs, int64_t hd, int64_t esize, int gather,
                     const int64_t *next_item);

#endif
