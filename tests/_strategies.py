"""Hypothesis strategies shared by the property tests and the fuzzers."""

from __future__ import annotations

from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


@st.composite
def batch_shapes(draw, *, max_dims: int, max_side: int, max_group: int):
    """``(q_batch, k_batch, v_batch, enable_gqa)``: the shapes of every axis before (L, d).

    Without GQA, three mutually broadcastable shapes of up to ``max_dims`` axes.  With
    GQA, broadcastable outer shapes of up to ``max_dims - 1`` axes and a head axis:
    ``group * Hkv`` query heads (group up to ``max_group``), k and v with Hkv heads or
    one (broadcast) each.
    """
    enable_gqa = draw(st.booleans())
    if not enable_gqa:
        batch = draw(hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=max_dims,
                                                       max_side=max_side))
        return (*batch.input_shapes, False)
    outer = draw(hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=max_dims - 1,
                                                   max_side=max_side))
    hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, max_group))
    k_heads, v_heads = draw(st.sampled_from([(hkv, hkv), (hkv, 1), (1, hkv), (1, 1)]))
    if (k_heads, v_heads) == (1, 1):
        hkv = 1
    return (outer.input_shapes[0] + (hkv * group,), outer.input_shapes[1] + (k_heads,),
            outer.input_shapes[2] + (v_heads,), True)
