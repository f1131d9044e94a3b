"""The C extensions of ckptd (everything else is in pyproject.toml): the blockwise encoder
ckptd.common._codec, which the daemon's writer calls for every quantized tensor, and
ckptd.common._copy, the streaming-store copy a save uses for large tensors."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ckptd.common._codec",
            ["client/ckptd/common/_codec.c"],
            # no fused multiply-add: the linear codes round exactly as the float32 formula says;
            # -fno-trapping-math only lets branch-free selects vectorize (no value changes)
            extra_compile_args=["-O3", "-std=c11", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"],
        ),
        Extension("ckptd.common._copy", ["client/ckptd/common/_copy.c"], extra_compile_args=["-O2", "-std=gnu11"]),
    ]
)
