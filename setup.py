"""The one compiled part, optional: without a C compiler tierckpt installs and falls back to torch's copy_."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierckpt.host._hostcopy",
            sources=["tierckpt/host/_hostcopy.c"],
            extra_compile_args=["-O2", "-std=c11"],
            optional=True,
        )
    ]
)
