"""Build: pip install setuptools pybind11 recurrent_cache && python setup.py build_ext --inplace"""

import recurrent_cache
from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    name="continuous_batching_cpp",
    ext_modules=[Pybind11Extension("continuous_batching_cpp", ["continuous_batching_cpp.cpp"],
                                   include_dirs=[recurrent_cache.get_include()], cxx_std=17)],
)
