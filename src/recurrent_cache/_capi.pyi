"""Stub of the compiled C API module: its Python side is the capsule and the versions."""

from typing import Any

_C_API: Any          # PyCapsule "recurrent_cache._capi._C_API" holding the rc_capi table
ABI_VERSION: int
API_VERSION: int
