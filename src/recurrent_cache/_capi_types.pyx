# cython: language_level=3
"""The object behind a C API context: ``Context`` (declared with the C API's other types in
``_capi_types.pxd``) owns one cache's ``CtxData``; ``_capi`` makes and frees them."""


cdef class Context:
    """The owner of one cache's ``CtxData``: keeps the cache and its memory core alive."""
