"""``trainstream.base``: the import path docs/base-cache.md documented before the package
had sub-packages; the module is ``trainstream.frozen.shared_base`` (a frozen base shared
through the daemon)."""
from .frozen.shared_base import FORMATS, SharedBase, load_base  # noqa: F401
from .frozen.shared_base import __all__  # noqa: F401
