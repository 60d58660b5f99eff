"""Build: pip install setuptools cython recurrent_cache && python setup.py build_ext --inplace"""

import recurrent_cache
from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    name="continuous_batching",
    ext_modules=cythonize(
        [Extension("continuous_batching", ["continuous_batching.pyx"],
                   include_dirs=[recurrent_cache.get_include()],   # recurrent_cache/capi.h
                   extra_compile_args=["-O2"])],
        include_path=[recurrent_cache.get_include()]),             # recurrent_cache/capi.pxd
)
