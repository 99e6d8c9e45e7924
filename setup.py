"""The optional compiled reader of store entries (decodefs/client/_ext/): pip builds it
where a C compiler and Python's headers are found (scripts/setup.sh installs both);
where it does not build, the install goes on and decodefs reads in pure Python
(client/batch.py). Everything else about the package is in pyproject.toml."""

from setuptools import Extension, setup

EXT = "decodefs/client/_ext"

setup(
    ext_modules=[
        Extension(
            "decodefs.client._batchread",
            sources=[
                f"{EXT}/batchread.c",
                f"{EXT}/rows_base.c",
                f"{EXT}/rows_avx2.c",
                f"{EXT}/rows_avx512.c",
            ],
            depends=[f"{EXT}/rows.h", f"{EXT}/rows.inc", f"{EXT}/xxhash.h"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        )
    ]
)
