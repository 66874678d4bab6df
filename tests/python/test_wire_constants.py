"""The Python copy of the wire format (trainstream/_native/wire.py) against the C++ headers,
as the test-only extension reads them (trainstream_testing.wire): every value, in both
directions. The shipped trainstream._C carries no such test-only bindings."""
import trainstream._C as C
import trainstream_testing as T
from trainstream._native import wire as _wire


def _upper(module):
    return {n: getattr(module, n) for n in dir(module) if n.isupper()}


def test_every_python_wire_constant_equals_the_cpp_one():
    cpp = _upper(T.wire)
    py = _upper(_wire)
    assert py, "trainstream._native.wire defines no constants"
    for name, value in py.items():
        assert name in cpp, f"_wire.{name} has no C++ counterpart in trainstream_testing.wire"
        assert value == cpp[name], f"_wire.{name} = {value}, the C++ header says {cpp[name]}"


def test_every_cpp_constant_the_client_receives_is_known_to_python():
    # The daemon -> client opcodes and statuses must all be known where completions
    # are read; the client -> daemon opcodes are posted by _C itself.
    cpp = _upper(T.wire)
    outbound = {"OP_GRAD_READY", "OP_STEP_END", "OP_LOAD_STATE", "OP_EXPORT_STATE", "OP_SYNC",
                "OP_GRAD_REDUCED"}
    missing = sorted(set(cpp) - set(_upper(_wire)) - outbound)
    assert not missing, f"C++ wire constants with no Python copy: {missing}"


def test_dtype_numbers_never_change():
    # Note [DType numbers are the wire's]: state manifests written by one daemon are
    # read by the next, and trainstream.v1.DType (DTYPE_UNSPECIFIED = 0) carries the
    # same numbers, so these are pinned to literals, not only to each other.
    assert (T.wire.DTYPE_FLOAT32, T.wire.DTYPE_BFLOAT16, T.wire.DTYPE_FLOAT16) == (1, 2, 3)
    assert (_wire.DTYPE_FLOAT32, _wire.DTYPE_BFLOAT16, _wire.DTYPE_FLOAT16) == (1, 2, 3)


def test_the_shipped_extension_carries_no_test_only_bindings():
    # The wire constants as C++ sees them are for this test only (tests/python/ext); the
    # package reads its own copy, so _C, which users load, does not carry them.
    assert not hasattr(C, "wire"), "trainstream._C still exports the test-only wire module"
    assert T.wire.OP_PARAM_READY == _wire.OP_PARAM_READY
