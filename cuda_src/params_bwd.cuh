// params_bwd.cuh -- the one argument every backward kernel takes.
//
// The backward sees the forward problem exactly as the forward kernels did --
// q, k, v, out, lse, their strides, the sizes, the window, the scale and
// scale * log2(e) -- so BwdParams starts with a FwdParams (`fwd`, its ws_*
// pointers null and block_m / block_n 0) and the forward's helpers
// (WindowMask, HeadSlice, QueryBlock, TileIndex) take `params.fwd` unchanged.
// After it come dout and the backward's own buffers, each with 64-bit
// batch / head / row strides in elements (the last axis has unit stride).
// Every field is 8 bytes, so there is no padding; cupyflash/_params_bwd.py
// mirrors the struct (a NumPy structured dtype with align=True, `fwd` nested)
// and its tests compare every offset with the host compiler's offsetof.
//
// This header is plain C++ (host compilers include it to check the layout).
#pragma once

#include "params.cuh"

namespace cf {

struct BwdParams {
    // q (B, Hq, Lq, d), k (B, Hkv, Lk, d), v (B, Hkv, Lk, dv), out (B, Hq, Lq, dv)
    // of the element type T; lse (B, Hq, Lq) of the accumulator type, required.
    FwdParams fwd;

    // dout (B, Hq, Lq, dv), element type T.
    const void* dout;
    // Gradients, accumulator type (float; double for double inputs):
    // dq (B, Hq, Lq, d), dk (B, Hkv, Lk, d), dv (B, Hkv, Lk, dv).  dk and dv
    // hold the sum over each kv head's group of query heads.
    void* dq;
    void* dk;
    void* dv;
    // Workspace written by the preprocess kernel, read by the others:
    // delta = rowsum(dout * out) (B, Hq, Lq), accumulator type.
    void* delta;

    // Strides in elements (any value, 0 for broadcast axes of dout).
    int64_t dout_batch_stride, dout_head_stride, dout_row_stride;
    int64_t dq_batch_stride, dq_head_stride, dq_row_stride;
    int64_t dk_batch_stride, dk_head_stride, dk_row_stride;
    int64_t dv_batch_stride, dv_head_stride, dv_row_stride;
    int64_t delta_batch_stride, delta_head_stride, delta_row_stride;

    // The bias gradients (a module compiled with bias terms; null otherwise):
    // dbias[t], of the accumulator type, read and written as (B, Hq, Lq, Lk)
    // views like FwdParams::bias[t] (dbias_strides[t]; 0 along the axes bias t
    // is broadcast along, whose entries then receive the sum).
    void* dbias[4];
    int64_t dbias_strides[4][4];
    // bwd_wgmma's ordered dQ (kGradDQOrdered): one int per (batch, query head,
    // query block of the dK/dV launch), C order, zeroed by the caller; null otherwise.
    // Key block n adds its dQ share of a query block when the int holds the number of
    // the key block before it that added (0: none), then posts n + 1.
    int* dq_turns;
};

// The layout _params_bwd.py mirrors (tests compare every offset with the dtype's).
static_assert(sizeof(BwdParams) == sizeof(FwdParams) + 41 * 8,
              "BwdParams: every field is 8 bytes, no padding");
#if !defined(__CUDACC_RTC__)  // no __builtin_offsetof in NVRTC 13.0 (see params.cuh)
static_assert(__builtin_offsetof(BwdParams, dout) == sizeof(FwdParams), "BwdParams layout");
static_assert(__builtin_offsetof(BwdParams, dout_batch_stride) == sizeof(FwdParams) + 5 * 8,
              "BwdParams layout");
static_assert(__builtin_offsetof(BwdParams, delta_row_stride) == sizeof(FwdParams) + 19 * 8,
              "BwdParams layout");
#endif

}  // namespace cf
