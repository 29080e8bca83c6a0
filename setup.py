"""The native copy kernel, built with the package (everything else is in pyproject.toml).

``src/kvmesh/kernels/_native/*.c`` become ``kvmesh/kernels/_ntcopy*.so``, a
plain shared library that :mod:`kvmesh.kernels.native` opens with ctypes (it
defines no Python module; see that module for why). It is built portable
(no ``-march=native``): the copy routine for the CPU at hand is picked at run
time. ``optional=True``: on a host without a C compiler the install still
succeeds, and the storage node copies with NumPy after one warning.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvmesh.kernels._ntcopy",
            sources=[
                "src/kvmesh/kernels/_native/ntcopy.c",
                "src/kvmesh/kernels/_native/tiles_amx.c",
                "src/kvmesh/kernels/_native/tiles_vec.c",
            ],
            depends=["src/kvmesh/kernels/_native/ntcopy.h"],
            extra_compile_args=["-O3", "-std=gnu11", "-fvisibility=hidden"],
            optional=True,
        )
    ]
)
