"""Build: pip install setuptools recurrent_cache && python setup.py build_ext --inplace"""

import recurrent_cache
from setuptools import Extension, setup

setup(
    name="hybrid_decode_c",
    ext_modules=[Extension("hybrid_decode_c", ["hybrid_decode_c.c"],
                           include_dirs=[recurrent_cache.get_include()], extra_compile_args=["-O2"])],
)
