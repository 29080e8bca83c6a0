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

/* One layer of vLLM's CPU KV layout with AMX, or for its "vec" ISA (tiles_amx.c,
 * tiles_vec.c), to or from a chunk's K and V rows. */
KVMESH_EXPORT int kvmesh_amx_tiles(void *layer, void *k_rows, void *v_rows,
                                   const int64_t *blocks, int64_t n_blocks, int64_t n_tokens,
                                   int64_t skip_blocks, int64_t heads, int64_t bs, int64_t hd,
                                   int64_t esize, int gather);
KVMESH_EXPORT int kvmesh_vec_tiles(void *layer, void *k_rows, void *v_rows,
                                   const int64_t *blocks, int64_t n_blocks, int64_t n_tokens,
                                   int64_t skip_blocks, int64_t heads, int64_t bs, int64_t hd,
                                   int64_t esize, int gather);

#endif
