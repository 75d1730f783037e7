// tile_io.cuh -- moving tiles between global memory, shared memory and registers.
//
// Global tensors are addressed through a base pointer and a 64-bit row stride
// (the last axis is contiguous, every other stride arbitrary).  Tiles in
// shared memory hold the accumulator type (float or double): elements are
// converted once, on the way in, so the inner products that read them many
// times are plain FMAs.  Loads zero-fill whatever lies outside the valid
// rows/columns, so a partial tile computes like a full one.
#pragma once

#include "paged.cuh"
#include "ptx.cuh"

namespace cf {

// ---- element <-> accumulator conversions -----------------------------------------------------

// std::is_same, which NVRTC's default headers do not provide.
template <typename A, typename B> struct SameType { static constexpr bool value = false; };
template <typename A> struct SameType<A, A> { static constexpr bool value = true; };

__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }

template <typename T> struct FromAcc;
template <> struct FromAcc<__half> {
    __device__ static __half convert(float x) { return __float2half_rn(x); }
};
template <> struct FromAcc<__nv_bfloat16> {
    __device__ static __nv_bfloat16 convert(float x) { return __float2bfloat16_rn(x); }
};
template <> struct FromAcc<float> {
    __device__ static float convert(float x) { return x; }
};
template <> struct FromAcc<double> {
    __device__ static double convert(double x) { return x; }
};
// Round an accumulator value to the element type (round to nearest even).
template <typename T, typename Acc> __device__ __forceinline__ T from_acc(Acc x) {
    return FromAcc<T>::convert(x);
}

// ---- 16-byte vectors (one LDS.128 from shared memory) ----------------------------------------

template <typename Acc>
struct alignas(16) Vec16 {
    static constexpr int kSize = 16 / sizeof(Acc);
    Acc x[kSize];
};

template <typename Acc> __device__ __forceinline__ Vec16<Acc> load_vec16(const Acc* p) {
    return *reinterpret_cast<const Vec16<Acc>*>(p);
}

// ---- shared-memory tile layouts ----------------------------------------------------------------

// Row-major kCols-wide rows whose 16-byte chunks are permuted by XOR with
// (row % 8).  Threads that read the same chunk of 8 consecutive rows (as the
// SIMT inner products do) then hit 8 different 16-byte bank groups without
// any padding; chunks stay whole, so vector loads still work.
template <typename Acc, int kCols>
struct SwizzledRows {
    static constexpr int kRowElements = kCols;
    static constexpr int kVec = Vec16<Acc>::kSize;
    static_assert(kCols % (8 * kVec) == 0, "SwizzledRows: rows of at least 8 whole 16-byte chunks");

    // Element (r, c).
    __device__ static int offset(int r, int c) {
        return r * kCols + (((c / kVec) ^ (r & 7)) * kVec) + (c % kVec);
    }
    // First element of chunk q (elements q*kVec .. q*kVec + kVec - 1) of row r.
    __device__ static int chunk(int r, int q) { return r * kCols + ((q ^ (r & 7)) * kVec); }
};

// Plain row-major rows of a run-time width.
struct PlainRows {
    int cols;
    __device__ int offset(int r, int c) const { return r * cols + c; }
};

// ---- global -> shared -------------------------------------------------------------------------

// 16 bytes of elements of row r from column c on, converted to the
// accumulator type: whole 16-byte stores at layout.offset(r, c ..).
template <typename Acc, typename Layout, typename T>
__device__ __forceinline__ void store_converted(Acc* dst, const Layout& layout, int r, int c, const Vec16<T>& in) {
    constexpr int E = Vec16<T>::kSize, kVec = Vec16<Acc>::kSize;
#pragma unroll
    for (int v = 0; v < E / kVec; ++v) {
        Vec16<Acc> out;
#pragma unroll
        for (int e = 0; e < kVec; ++e) out.x[e] = to_acc(in.x[v * kVec + e]);
        *reinterpret_cast<Vec16<Acc>*>(dst + layout.offset(r, c + v * kVec)) = out;
    }
}

// Cooperative copy of a rows x cols tile by kThreads threads (all must call):
// dst[layout.offset(r, c)] = src[r * row_stride + c] for r < rows_valid and
// c < cols_valid, zero elsewhere.  Consecutive threads take consecutive
// columns, so a warp reads contiguous runs of each row.  src: a pointer, or
// the pages of a paged cache (paged.cuh's row_at).
template <int kThreads, typename Layout, typename Acc, class Src>
__device__ __forceinline__ void load_tile(Acc* dst, const Layout& layout, const Src& src,
                                          int64_t row_stride, int rows, int cols, int rows_valid,
                                          int cols_valid) {
    using T = RowElement<Src>;
    // Whole rows, 16-byte aligned in global and shared memory (the usual case):
    // one 16-byte load per chunk of E elements and 16-byte stores, instead of
    // an index division, a bounds test and a 64-bit address per element.  Rows
    // past rows_valid are zeroed.
    constexpr int E = 16 / static_cast<int>(sizeof(T));      // elements per 16-byte load
    constexpr int kVec = Vec16<Acc>::kSize;                  // elements per 16-byte store
    static_assert(E % kVec == 0, "a load converts to whole stores");
    if (cols_valid == cols && cols % E == 0 && reinterpret_cast<unsigned long long>(any_row(src)) % 16 == 0 &&
        (row_stride * static_cast<int64_t>(sizeof(T))) % 16 == 0 &&
        reinterpret_cast<unsigned long long>(dst) % 16 == 0 && layout.offset(1, 0) % kVec == 0) {
        const int chunks = cols / E;
        if constexpr (IsPaged<Src>::value) {
            // A paged cache: one row's lookup at a time (unrolled, the rows'
            // lookups and their hoisted invariants spilled fwd_simt's float16
            // d = 64: 52 bytes).
#pragma unroll 1
            for (int idx = static_cast<int>(threadIdx.x); idx < rows * chunks; idx += kThreads) {
                const int r = idx / chunks;
                const int c = (idx - r * chunks) * E;
                Vec16<T> in = {};
                if (r < rows_valid) in = *reinterpret_cast<const Vec16<T>*>(row_at(src, r, row_stride) + c);
                store_converted(dst, layout, r, c, in);
            }
        } else {
            for (int idx = static_cast<int>(threadIdx.x); idx < rows * chunks; idx += kThreads) {
                const int r = idx / chunks;
                const int c = (idx - r * chunks) * E;
                Vec16<T> in;
                if (r < rows_valid) {
                    in = *reinterpret_cast<const Vec16<T>*>(src + r * row_stride + c);
                } else {
#pragma unroll
                    for (int e = 0; e < E; ++e) in.x[e] = T(0.0f);
                }
#pragma unroll
                for (int v = 0; v < E / kVec; ++v) {
                    Vec16<Acc> out;
#pragma unroll
                    for (int e = 0; e < kVec; ++e) out.x[e] = to_acc(in.x[v * kVec + e]);
                    *reinterpret_cast<Vec16<Acc>*>(dst + layout.offset(r, c + v * kVec)) = out;
                }
            }
        }
        return;
    }
    for (int idx = static_cast<int>(threadIdx.x); idx < rows * cols; idx += kThreads) {
        const int r = idx / cols;
        const int c = idx - r * cols;
        Acc value = Acc(0);
        if (r < rows_valid && c < cols_valid) value = to_acc(row_at(src, r, row_stride)[c]);
        dst[layout.offset(r, c)] = value;
    }
}

// Asynchronous form of load_tile for T == Acc (float, double: nothing to
// convert, so the bytes may go straight to shared memory with cp.async while
// the CTA computes on another buffer).  Issues the copies only: the caller
// commits the group, waits for it and synchronises before anyone reads dst.
// Rows past rows_valid and columns past cols_valid are zero-filled by the
// copy itself (src-size below the copy size), so no thread stores zeros.
// (A paged cache's pages: the overload below.)
template <int kThreads, int kRows, int kCols, typename Layout, typename T>
__device__ __forceinline__ void cp_async_tile_rows(T* dst, const Layout& layout, const T* src,
                                                   int64_t row_stride, int rows_valid,
                                                   int cols_valid) {
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));   // elements per 16-byte chunk
    static_assert(kCols % kVec == 0, "rows of whole 16-byte chunks in shared memory");
    if (reinterpret_cast<unsigned long long>(src) % 16 == 0 &&
        (row_stride * static_cast<int64_t>(sizeof(T))) % 16 == 0) {
        // 16-byte chunks; a chunk that straddles cols_valid copies its valid part.
        // Every pass copies the same column chunk of rows kRowStep further on,
        // so the chunk's byte count and its 64-bit source address are worked
        // out once and then stepped (about 19 instructions per copy of a
        // partial tile, where recomputing them per pass took 30).
        constexpr int kChunks = kCols / kVec;
        static_assert(kThreads % kChunks == 0, "every thread copies one column chunk");
        constexpr int kRowStep = kThreads / kChunks;
        const int r0 = static_cast<int>(threadIdx.x) / kChunks;
        const int c = (static_cast<int>(threadIdx.x) % kChunks) * kVec;
        const int valid = cols_valid - c;
        const int col_bytes = valid <= 0 ? 0 : valid >= kVec ? 16 : valid * static_cast<int>(sizeof(T));
        const T* from = src + r0 * row_stride + c;
        const int64_t step = kRowStep * row_stride;
        // Every row valid and this thread's chunk whole (every block but a
        // sequence's last, at the bucket's head dim for every thread): fixed
        // 16-byte copies, no predicate and no zero-fill count, 4-5
        // instructions each.
        if (rows_valid >= kRows && col_bytes == 16) {
#pragma unroll
            for (int pass = 0; pass < (kRows + kRowStep - 1) / kRowStep; ++pass) {
                const int r = r0 + pass * kRowStep;
                if (kRows % kRowStep == 0 || r < kRows) cp_async_16(dst + layout.offset(r, c), from, 16);
                from += step;
            }
            return;
        }
#pragma unroll
        for (int pass = 0; pass < (kRows + kRowStep - 1) / kRowStep; ++pass) {
            const int r = r0 + pass * kRowStep;
            if (kRows % kRowStep == 0 || r < kRows) {
                const int bytes = r < rows_valid ? col_bytes : 0;
                // A zero-byte copy reads nothing; it still gets a valid, aligned address.
                cp_async_16(dst + layout.offset(r, c), bytes > 0 ? from : src, bytes);
            }
            from += step;
        }
        return;
    }
    // Rows not 16-byte aligned: one 4-byte copy per word (two per double).
    constexpr int kWordsPerElement = static_cast<int>(sizeof(T)) / 4;
    for (int idx = static_cast<int>(threadIdx.x); idx < kRows * kCols * kWordsPerElement; idx += kThreads) {
        const int e = idx / kWordsPerElement;
        const int word = idx - e * kWordsPerElement;
        const int r = e / kCols;
        const int c = e - r * kCols;
        const bool valid = r < rows_valid && c < cols_valid;
        const char* from = valid ? reinterpret_cast<const char*>(src + r * row_stride + c) + 4 * word
                                 : reinterpret_cast<const char*>(src);
        cp_async_4(reinterpret_cast<char*>(dst + layout.offset(r, c)) + 4 * word, from, valid ? 4 : 0);
    }
}

// The same from a paged cache's pages (paged.cuh): each row's address from its
// page, looked up only for rows inside the sequence.  (An overload, not a branch
// of the one above: through a shared body NVVM scheduled the dense kernels'
// copies differently.)
template <int kThreads, int kRows, int kCols, typename Layout, typename T>
__device__ __forceinline__ void cp_async_tile_rows(T* dst, const Layout& layout, const PagedRows<T>& src,
                                                   int64_t row_stride, int rows_valid, int cols_valid) {
    constexpr int kVec = 16 / static_cast<int>(sizeof(T));
    static_assert(kCols % kVec == 0, "rows of whole 16-byte chunks in shared memory");
    if (reinterpret_cast<unsigned long long>(src.base) % 16 == 0 &&
        (row_stride * static_cast<int64_t>(sizeof(T))) % 16 == 0) {   // the host aligns every page alike
        constexpr int kChunks = kCols / kVec;
        static_assert(kThreads % kChunks == 0, "every thread copies one column chunk");
        constexpr int kRowStep = kThreads / kChunks;
        const int r0 = static_cast<int>(threadIdx.x) / kChunks;
        const int c = (static_cast<int>(threadIdx.x) % kChunks) * kVec;
        const int valid = cols_valid - c;
        const int col_bytes = valid <= 0 ? 0 : valid >= kVec ? 16 : valid * static_cast<int>(sizeof(T));
#pragma unroll
        for (int pass = 0; pass < (kRows + kRowStep - 1) / kRowStep; ++pass) {
            const int r = r0 + pass * kRowStep;
            if (kRows % kRowStep == 0 || r < kRows) {
                const int bytes = r < rows_valid ? col_bytes : 0;
                cp_async_16(dst + layout.offset(r, c), bytes > 0 ? src.row(r, row_stride) + c : src.base, bytes);
            }
        }
        return;
    }
    constexpr int kWordsPerElement = static_cast<int>(sizeof(T)) / 4;
    for (int idx = static_cast<int>(threadIdx.x); idx < kRows * kCols * kWordsPerElement; idx += kThreads) {
        const int e = idx / kWordsPerElement;
        const int word = idx - e * kWordsPerElement;
        const int r = e / kCols;
        const int c = e - r * kCols;
        const bool valid = r < rows_valid && c < cols_valid;
        const char* from = valid ? reinterpret_cast<const char*>(src.row(r, row_stride) + c) + 4 * word
                                 : reinterpret_cast<const char*>(src.base);
        cp_async_4(reinterpret_cast<char*>(dst + layout.offset(r, c)) + 4 * word, from, valid ? 4 : 0);
    }
}

// ---- registers -> global ----------------------------------------------------------------------

// dst[e] = vals[e] rounded to T, for the first n_valid of N consecutive elements.
template <int N, typename T, typename Acc>
__device__ __forceinline__ void store_run(T* dst, const Acc (&vals)[N], int n_valid) {
#pragma unroll
    for (int e = 0; e < N; ++e)
        if (e < n_valid) dst[e] = from_acc<T>(vals[e]);
}

}  // namespace cf
