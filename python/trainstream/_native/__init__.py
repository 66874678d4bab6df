"""The compiled halves of the package and what the Python side shares with them.

* ``C()``: the torch extension ``trainstream._C`` (data plane, kernels; no gRPC);
* ``control()``: ``trainstream._control`` (the gRPC client library; no torch);
* ``wire``: the shared-memory wire constants (pinned to the C++ headers by
  tests/python/test_wire_constants.py);
* ``pinning``: registering host memory with CUDA; ``streams``: the copy streams;
* ``daemon``: finding the daemon, or starting one for this user;
* ``runtime_check``: the installed package's torch and system-library checks.

Both extensions load on first use, never at ``import trainstream`` (docs/design.md,
"Why gRPC and libtorch never share a shared object": each loads on its own, and a
process that only asks the daemon for its status needs neither torch's extension nor
CUDA). The built modules stay at ``trainstream._C`` and ``trainstream._control``.
"""


def C():
    """``trainstream._C``, imported on first use."""
    try:
        from .. import _C  # noqa: PLC0415 (it loads libtorch's extension and CUDA)
    except ImportError as e:
        from .runtime_check import import_error  # noqa: PLC0415
        raise import_error(e, "_C") from e
    return _C


def control():
    """``trainstream._control``, imported on first use. A missing system library
    (gRPC, protobuf, abseil) is named with the package that ships it."""
    try:
        from .. import _control  # noqa: PLC0415 (it loads gRPC)
    except ImportError as e:
        from .runtime_check import import_error  # noqa: PLC0415
        raise import_error(e, "_control") from e
    return _control
