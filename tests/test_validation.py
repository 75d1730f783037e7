"""Every bad input to ``attention``/``attention_backward`` raises the documented error,
with a message that names the argument, before any work is done."""

from __future__ import annotations

import numpy as np
import pytest

import cupyflash
from cupyflash import _cpu
from cupyflash.reference import flash_attention_v1, naive_attention

from _util import bfloat16, poisoned, random_qkv


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Validation must raise before the CPU path runs: make running it an error."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("the CPU path ran although the arguments are invalid")

    monkeypatch.setattr(_cpu, "forward", must_not_run)
    monkeypatch.setattr(_cpu, "backward", must_not_run)


@pytest.fixture
def qkv():
    return random_qkv(np.random.default_rng(0), (2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6), np.float32)


def _fake_array_type(module):
    """A class that validation classifies like an array of another library, without that library."""
    return type("FakeArray", (), {"__module__": module, "shape": (2, 3, 5, 4), "ndim": 4,
                                  "dtype": np.dtype(np.float32)})


# ---- TypeError: kinds of object ----------------------------------------------------


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("bad", [[1.0, 2.0], (1.0, 2.0), 3.0, np.float32(1.0), None, "q"],
                         ids=["list", "tuple", "float", "numpy_scalar", "none", "str"])
def test_non_arrays_are_type_errors_naming_the_argument(qkv, position, bad):
    args = list(qkv)
    args[position] = bad
    with pytest.raises(TypeError, match=f"`{'qkv'[position]}`"):
        cupyflash.attention(*args)


def test_a_list_error_suggests_numpy_asarray(qkv):
    with pytest.raises(TypeError, match=r"`q`.*list.*numpy\.asarray"):
        cupyflash.attention(qkv[0].tolist(), qkv[1], qkv[2])


@pytest.mark.parametrize("position", [0, 1, 2])
def test_numpy_cupy_mix_is_a_type_error(qkv, position):
    args = list(qkv)
    args[position] = _fake_array_type("cupy._core.core")()
    name = "qkv"[position]
    with pytest.raises(TypeError, match=f"{name}: cupy"):
        cupyflash.attention(*args)


def test_numpy_cuda_array_interface_mix_is_a_type_error(qkv):
    foreign = type("Foreign", (), {"__cuda_array_interface__": {}})()
    with pytest.raises(TypeError, match="v: cuda-foreign"):
        cupyflash.attention(qkv[0], qkv[1], foreign)


def test_numpy_backend_with_cupy_arrays_is_a_type_error():
    fake = _fake_array_type("cupy")
    with pytest.raises(TypeError, match="backend='numpy'"):
        cupyflash.attention(fake(), fake(), fake(), backend="numpy")


@pytest.mark.gpu
def test_real_numpy_cupy_mix_is_a_type_error(qkv):
    import cupy

    with pytest.raises(TypeError, match="k: cupy"):
        cupyflash.attention(qkv[0], cupy.asarray(qkv[1]), qkv[2])


def test_cuda_backend_with_numpy_arrays_is_a_type_error(qkv):
    with pytest.raises(TypeError, match="backend='cuda'"):
        cupyflash.attention(*qkv, backend="cuda")


# ---- TypeError: dtypes ------------------------------------------------------------


BAD_DTYPES = [np.int8, np.int32, np.int64, np.uint8, np.bool_, np.complex64, np.complex128, np.object_]
if np.dtype(np.longdouble).itemsize > 8:
    BAD_DTYPES.append(np.longdouble)


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=[np.dtype(d).name for d in BAD_DTYPES])
def test_unsupported_dtypes_are_type_errors(qkv, position, dtype):
    args = [x.astype(dtype) if i == position else x for i, x in enumerate(qkv)]
    name = "qkv"[position]
    with pytest.raises(TypeError, match=f"`{name}` must have dtype"):
        cupyflash.attention(*args)


@pytest.mark.parametrize("dtype", [np.int32, np.complex128, np.bool_])
def test_all_unsupported_dtypes_are_type_errors(qkv, dtype):
    with pytest.raises(TypeError, match="`q` must have dtype"):
        cupyflash.attention(*(x.astype(dtype) for x in qkv))


@pytest.mark.parametrize("dtypes", [
    (np.float32, np.float64, np.float32),
    (np.float16, np.float16, np.float32),
    (np.float64, np.float64, np.float16),
] + ([(np.float16, bfloat16, np.float16)] if bfloat16 is not None else []))
def test_differing_dtypes_are_type_errors(qkv, dtypes):
    args = [x.astype(d) for x, d in zip(qkv, dtypes)]
    q_name, k_name, v_name = (np.dtype(d).name for d in dtypes)
    with pytest.raises(TypeError, match=f"same dtype; got q: {q_name}, k: {k_name}, v: {v_name}"):
        cupyflash.attention(*args)


@pytest.mark.parametrize("name, value", [("causal", 1), ("causal", "yes"), ("enable_gqa", 1), ("enable_gqa", None)])
def test_non_bool_flags_are_type_errors(qkv, name, value):
    with pytest.raises(TypeError, match=f"`{name}`"):
        cupyflash.attention(*qkv, **{name: value})


@pytest.mark.parametrize("scale", ["0.5", 1j, True, [0.5]])
def test_non_real_scale_is_a_type_error(qkv, scale):
    with pytest.raises(TypeError, match="`scale`"):
        cupyflash.attention(*qkv, scale=scale)


# ---- ValueError: shapes -----------------------------------------------------------


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("shape", [(), (4,)], ids=["0d", "1d"])
def test_fewer_than_two_dims_is_a_value_error(qkv, position, shape):
    args = list(qkv)
    args[position] = np.ones(shape, np.float32)
    name = "qkv"[position]
    with pytest.raises(ValueError, match=f"`{name}` must have at least 2 dimensions"):
        cupyflash.attention(*args)


def test_head_dim_mismatch_between_q_and_k_is_a_value_error(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"`q` and `k`.*\(2, 3, 5, 4\).*\(2, 3, 7, 3\)"):
        cupyflash.attention(q, k[..., :3], v)


def test_key_length_mismatch_between_k_and_v_is_a_value_error(qkv):
    q, k, v = qkv
    with pytest.raises(ValueError, match=r"`k` and `v`.*\(2, 3, 7, 4\).*\(2, 3, 6, 6\)"):
        cupyflash.attention(q, k, v[..., :6, :])


def test_zero_head_dim_is_a_value_error():
    q = np.ones((2, 5, 0), np.float32)
    with pytest.raises(ValueError, match="head dim"):
        cupyflash.attention(q, q, np.ones((2, 5, 3), np.float32))


@pytest.mark.parametrize("shapes", [
    ((2, 5, 4), (3, 7, 4), (3, 7, 6)),
    ((2, 3, 5, 4), (2, 4, 7, 4), (2, 4, 7, 6)),
    ((2, 5, 4), (2, 7, 4), (3, 7, 6)),
])
def test_batch_dims_that_do_not_broadcast_are_value_errors(shapes):
    q, k, v = random_qkv(np.random.default_rng(1), *shapes, np.float32)
    with pytest.raises(ValueError, match=r"do not broadcast: q \(.*\), k \(.*\), v \(.*\)"):
        cupyflash.attention(q, k, v)


@pytest.mark.parametrize("shapes", [
    ((2, 6, 5, 4), (2, 4, 7, 4), (2, 4, 7, 4)),     # 6 % 4 != 0
    ((2, 2, 5, 4), (2, 4, 7, 4), (2, 4, 7, 4)),     # fewer query heads than kv heads
    ((2, 6, 5, 4), (2, 4, 7, 4), (2, 1, 7, 4)),     # v broadcasts, k does not divide
])
def test_gqa_head_counts_that_do_not_divide_are_value_errors(shapes):
    q, k, v = random_qkv(np.random.default_rng(2), *shapes, np.float32)
    with pytest.raises(ValueError, match="enable_gqa=True.*multiple"):
        cupyflash.attention(q, k, v, enable_gqa=True)


def test_gqa_with_mismatched_k_and_v_heads_is_a_value_error():
    q, k, v = random_qkv(np.random.default_rng(3), (2, 6, 5, 4), (2, 2, 7, 4), (2, 3, 7, 4), np.float32)
    with pytest.raises(ValueError, match="broadcast"):
        cupyflash.attention(q, k, v, enable_gqa=True)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_gqa_without_a_head_axis_is_a_value_error(position):
    arrays = list(random_qkv(np.random.default_rng(4), (2, 5, 4), (2, 7, 4), (2, 7, 6), np.float32))
    arrays[position] = arrays[position][0]
    with pytest.raises(ValueError, match=f"enable_gqa=True needs a head axis.*`{'qkv'[position]}`"):
        cupyflash.attention(*arrays, enable_gqa=True)


# ---- ValueError: values -----------------------------------------------------------


@pytest.mark.parametrize("scale", [np.nan, np.inf, -np.inf, np.float32("nan"), float("inf")])
def test_non_finite_scale_is_a_value_error(qkv, scale):
    with pytest.raises(ValueError, match="`scale` must be finite"):
        cupyflash.attention(*qkv, scale=scale)


@pytest.mark.parametrize("window", [
    (1,), (1, 2, 3), 3, "ab", {1: 2}, (1.5, 2), (2, 1.0), (-2, 0), (0, -5), (True, 1), ("a", 1), (1, np.nan),
], ids=repr)
@pytest.mark.parametrize("causal", [False, True])
def test_malformed_window_is_a_value_error(qkv, window, causal):
    with pytest.raises(ValueError, match="`window`"):
        cupyflash.attention(*qkv, window=window, causal=causal)


@pytest.mark.parametrize("backend", ["torch", "NUMPY", "", None, 1, "cuda:0"])
def test_unknown_backend_is_a_value_error(qkv, backend):
    with pytest.raises(ValueError, match="`backend`"):
        cupyflash.attention(*qkv, backend=backend)


# ---- out= -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (2, 3, 6, 6), (3, 5, 6), (1, 3, 5, 6), (2, 3, 5, 6, 1)])
def test_out_of_the_wrong_shape_is_a_value_error(qkv, shape):
    out = poisoned(shape, np.float32)
    with pytest.raises(ValueError, match=r"`out` must have shape \(2, 3, 5, 6\)"):
        cupyflash.attention(*qkv, out=out)
    assert np.isnan(out).all()


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32] + ([bfloat16] if bfloat16 is not None else []))
def test_out_of_the_wrong_dtype_is_a_value_error(qkv, dtype):
    out = np.zeros((2, 3, 5, 6), dtype)
    with pytest.raises(ValueError, match="`out` must have dtype float32"):
        cupyflash.attention(*qkv, out=out)


def test_out_that_is_not_an_array_is_a_type_error(qkv):
    with pytest.raises(TypeError, match="`out`"):
        cupyflash.attention(*qkv, out=np.zeros((2, 3, 5, 6)).tolist())


def test_read_only_out_is_a_value_error(qkv):
    out = poisoned((2, 3, 5, 6), np.float32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="`out`.*read-only"):
        cupyflash.attention(*qkv, out=out)


def test_out_overlapping_an_input_is_a_value_error():
    q, k, v = random_qkv(np.random.default_rng(5), (2, 5, 4), (2, 5, 4), (2, 5, 4), np.float32)
    with pytest.raises(ValueError, match="`out` must not overlap"):
        cupyflash.attention(q, k, v, out=q)


def test_valid_arguments_with_an_invalid_one_leave_out_untouched(qkv):
    out = poisoned((2, 3, 5, 6), np.float32)
    for bad in (dict(window=(0, -3)), dict(scale=np.nan), dict(backend="nope"), dict(enable_gqa=2)):
        with pytest.raises((TypeError, ValueError)):
            cupyflash.attention(*qkv, out=out, **bad)
    assert np.isnan(out).all()


def test_lq_zero_is_not_an_error_and_does_no_work(qkv):
    q, k, v = qkv
    out, lse = cupyflash.attention(q[..., :0, :], k, v, return_lse=True)
    assert out.shape == (2, 3, 0, 6) and lse.shape == (2, 3, 0)


# ---- attention_backward ------------------------------------------------------------


@pytest.fixture
def bwd_args(qkv):
    q, k, v = qkv
    out, lse = naive_attention(q, k, v, return_lse=True)      # the CPU path must not run here
    out, lse = out.astype(np.float32), lse.astype(np.float32)
    return [np.ones_like(out), q, k, v, out, lse]


@pytest.mark.parametrize("position, name", [(0, "dout"), (4, "out")])
def test_backward_dout_and_out_of_the_wrong_shape_are_value_errors(bwd_args, position, name):
    bwd_args[position] = bwd_args[position][..., :4, :]
    with pytest.raises(ValueError, match=rf"`{name}` must have shape \(2, 3, 5, 6\)"):
        cupyflash.attention_backward(*bwd_args)


@pytest.mark.parametrize("position, name", [(0, "dout"), (4, "out")])
def test_backward_dout_and_out_of_the_wrong_dtype_are_type_errors(bwd_args, position, name):
    bwd_args[position] = bwd_args[position].astype(np.float64)
    with pytest.raises(TypeError, match=f"`{name}` must have dtype float32"):
        cupyflash.attention_backward(*bwd_args)


def test_backward_lse_of_the_wrong_shape_is_a_value_error(bwd_args):
    bwd_args[5] = bwd_args[5][..., None]
    with pytest.raises(ValueError, match=r"`lse` must have shape \(2, 3, 5\)"):
        cupyflash.attention_backward(*bwd_args)


@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.complex64])
def test_backward_lse_of_the_wrong_dtype_is_a_type_error(bwd_args, dtype):
    bwd_args[5] = bwd_args[5].astype(dtype)
    with pytest.raises(TypeError, match="`lse` must have dtype"):
        cupyflash.attention_backward(*bwd_args)


@pytest.mark.parametrize("position, name", [(0, "dout"), (1, "q"), (4, "out"), (5, "lse")])
def test_backward_non_arrays_are_type_errors(bwd_args, position, name):
    bwd_args[position] = bwd_args[position].tolist()
    with pytest.raises(TypeError, match=f"`{name}`"):
        cupyflash.attention_backward(*bwd_args)


def test_backward_kind_mix_is_a_type_error(bwd_args):
    bwd_args[0] = _fake_array_type("cupy")()
    with pytest.raises(TypeError, match="dout: cupy"):
        cupyflash.attention_backward(*bwd_args)


@pytest.mark.parametrize("kw, error, match", [
    (dict(window=(1, -4)), ValueError, "`window`"),
    (dict(scale=np.inf), ValueError, "`scale`"),
    (dict(backend="jax"), ValueError, "`backend`"),
    (dict(causal=0), TypeError, "`causal`"),
    (dict(enable_gqa=True), ValueError, "enable_gqa=True"),
])
def test_backward_checks_the_forward_options(bwd_args, kw, error, match):
    if kw.get("enable_gqa"):
        bwd_args[2] = bwd_args[2][:, :2]              # 3 query heads, 2 kv heads
        bwd_args[3] = bwd_args[3][:, :2]
    with pytest.raises(error, match=match):
        cupyflash.attention_backward(*bwd_args, **kw)


def test_backward_checks_q_k_v_like_the_forward(bwd_args):
    args = list(bwd_args)
    args[2] = args[2][..., :3]
    with pytest.raises(ValueError, match="`q` and `k`"):
        cupyflash.attention_backward(*args)
    args = list(bwd_args)
    args[3] = args[3].astype(np.float64)
    with pytest.raises(TypeError, match="same dtype"):
        cupyflash.attention_backward(*args)


# ---- flash_attention_v1 ------------------------------------------------------------


@pytest.mark.parametrize("sram_size", [64.0, "64", True, None])
def test_algorithm1_non_integer_sram_size_is_a_type_error(qkv, sram_size):
    with pytest.raises(TypeError, match="`sram_size`"):
        flash_attention_v1(*qkv, sram_size=sram_size)


def test_algorithm1_too_small_sram_size_is_a_value_error(qkv):
    with pytest.raises(ValueError, match="`sram_size`"):
        flash_attention_v1(*qkv, sram_size=4 * 4 - 1)


# ---- ndarray subclasses and byte order ------------------------------------------------


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")
@pytest.mark.parametrize("wrap", [np.asmatrix, np.ma.masked_array], ids=["matrix", "masked"])
def test_ndarray_subclasses_are_type_errors(wrap):
    # np.matrix changes what @ means; a MaskedArray's mask would be silently ignored.
    x = np.ones((4, 3), dtype=np.float32)
    with pytest.raises(TypeError, match="`k`.*subclass"):
        cupyflash.attention(x, wrap(x), x)


def test_mixed_byte_orders_show_in_the_dtype_message(qkv):
    q, k, v = qkv
    swapped = k.astype(k.dtype.newbyteorder())
    with pytest.raises(TypeError, match=r"k: float32 \(>f4\)"):
        cupyflash.attention(q, swapped, v)


def test_a_cuda_array_that_refuses_its_interface_is_a_type_error(qkv):
    # torch raises RuntimeError (not AttributeError) for tensors that require grad
    class Refusing:
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("Can't get __cuda_array_interface__ on Variable that requires grad")

    with pytest.raises(TypeError, match=r"`v`.*detach"):
        cupyflash.attention(qkv[0], qkv[1], Refusing())
