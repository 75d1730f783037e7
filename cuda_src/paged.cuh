// paged.cuh -- keys and values read from a paged KV cache (CF_PAGED_KV).
//
// A paged cache holds K as (num_pages, Hkv, page_size, d) (V likewise) and a
// (B, max_pages) int32 block table says where each sequence's keys live:
// key j of batch entry b is slot j % page_size of page table[b][j / page_size].
// Any page size; pages in any order, shared between sequences.  A module
// compiled with CF_PAGED_KV (always with CF_SEQ_LENGTHS=1: the table's kv
// lengths say how many keys each sequence has) reads them in place, with one
// table lookup per copied row -- never a gathered copy of the cache.
//
// The one seam: HeadSlice's k and v are KeyRows<T> -- a plain pointer
// without paging, a PagedRows<T> with it -- and the forward's tile loaders
// (tile_io.cuh, mma_tile.cuh, tf32_tile.cuh) form each row's address with
// row_at / at_key.  For a pointer those are the arithmetic the loaders always
// did, so a module without CF_PAGED_KV compiles as before.  Only the forward
// kernels take a paged cache (the backward of a cache is nobody's gradient).
#pragma once

#include "params.cuh"
#include "sequence.cuh"

#ifndef CF_PAGED_KV
#define CF_PAGED_KV 0
#endif

namespace cf {

constexpr bool kPagedKV = CF_PAGED_KV != 0;
static_assert(!kPagedKV || CF_SEQ_LENGTHS == 1, "a paged cache is read with per-sequence lengths, padded");

// One kv head's keys (or values) of one sequence in a paged cache, from key
// `first` on: key j of the view lies at
//     base + table[pages + (first + j) / page_size] * page_stride
//          + ((first + j) % page_size) * row_stride.
// Keys, page sizes, the elements of one page (its stride) and of the table are
// below 2^31 (the host checks): 32-bit division and offsets, and one
// 32 x 32 -> 64-bit product per row.  Near the register limit each register
// counts: the table is the launch's pointer (a constant-bank operand) and the
// sequence's row a 32-bit offset -- a pointer to the row, or 64-bit strides,
// held two registers more through the main loop and spilled fwd_mma's
// float16 d = 128 on sm_90.
template <typename T>
struct PagedRows {
    const T* base;          // the kv head's first element in page 0
    const int32_t* table;   // the launch's block table
    int32_t pages;          // the sequence's row of it: its first element
    int32_t page_stride;    // elements from one page to the next
    int32_t page_size;
    int32_t first;          // the view's first key (at_key)

    __device__ __forceinline__ const T* row(int64_t j, int64_t row_stride) const {
        const unsigned key = static_cast<unsigned>(first + static_cast<int32_t>(j));
        const unsigned size = static_cast<unsigned>(page_size);
        const unsigned page = key / size;
        const int32_t slot = static_cast<int32_t>(key - page * size);
        return base + (static_cast<int64_t>(table[pages + static_cast<int32_t>(page)]) * page_stride +
                       slot * static_cast<int32_t>(row_stride));
    }
};

// What a tile loader reads rows from (Src): a pointer, or a PagedRows.
template <class Src> struct IsPaged { static constexpr bool value = false; };
template <typename T> struct IsPaged<PagedRows<T>> { static constexpr bool value = true; };
template <class Src> struct RowSource;
template <typename T> struct RowSource<T*> { using Element = T; };
template <typename T> struct RowSource<const T*> { using Element = T; };
template <typename T> struct RowSource<PagedRows<T>> { using Element = T; };
template <class Src> using RowElement = typename RowSource<Src>::Element;

#if CF_PAGED_KV
template <typename T> using KeyRows = PagedRows<T>;
#else
template <typename T> using KeyRows = const T*;
#endif

// Row r of the rows at src (row_stride elements apart in a dense tensor).
template <typename T>
__device__ __forceinline__ const T* row_at(const T* src, int64_t r, int64_t row_stride) {
    return src + r * row_stride;
}
template <typename T>
__device__ __forceinline__ const T* row_at(const PagedRows<T>& src, int64_t r, int64_t row_stride) {
    return src.row(r, row_stride);
}

// The rows at src from row n0 on.
template <typename T>
__device__ __forceinline__ const T* at_key(const T* src, int64_t n0, int64_t row_stride) {
    return src + n0 * row_stride;
}
template <typename T>
__device__ __forceinline__ PagedRows<T> at_key(PagedRows<T> src, int64_t n0, int64_t) {
    src.first += static_cast<int32_t>(n0);
    return src;
}

// A valid, 16-byte aligned address inside the tensor (a zero-byte copy's
// source, the loaders' alignment tests): the view's start, page 0 of a cache.
template <typename T> __device__ __forceinline__ const T* any_row(const T* src) { return src; }
template <typename T> __device__ __forceinline__ const T* any_row(const PagedRows<T>& src) { return src.base; }

// A kv head's keys (or values) of batch entry `batch` in a paged cache: `head`
// its elements in page 0, `batch_stride` (the tensor's: a page's) elements
// from one page to the next, through the sequence's row of the block table.
// (HeadSlice spells the dense pointer inline, as it always did: through a
// helper, NVVM scheduled 30 backward dQ kernels differently.)
template <typename T>
__device__ __forceinline__ PagedRows<T> paged_rows(const FwdParams& p, const T* head, int64_t batch,
                                                   int64_t batch_stride) {
    return PagedRows<T>{head, p.block_table, static_cast<int32_t>(batch * p.table_stride),
                        static_cast<int32_t>(batch_stride), static_cast<int32_t>(p.page_size), 0};
}

}  // namespace cf
