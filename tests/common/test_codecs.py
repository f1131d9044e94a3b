"""The codec registry (ckptd.common.codecs): every registered codec by table, refusals of unknown
names, the schemes built from it, a new codec added as one class, and the lazy native encoder."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar, Sequence

import pytest
import torch

from ckptd.common import codecs, quant, quant_options
from ckptd.common.boxes import Box, relative
from ckptd.common.blocks import QuantError
from ckptd.common.codecs import Codec, Linear, Log, Registry, Scheme, codec, codec_names

# name -> (bits, codes dtype, framed, default block): what the index and the writer rely on.
# Changing a row changes the on-disk format.
EXPECTED = {
    "lin-i8": (8, "I8", False, 256),
    "lin-i4": (4, "U8", True, 128),
    "log-u8": (8, "U8", False, 256),
    "log-u4": (4, "U8", True, 128),
}


def test_the_registry_holds_exactly_the_codecs_of_the_format() -> None:
    assert codec_names() == tuple(sorted(EXPECTED))
    for name, (bits, dtype, framed, block) in EXPECTED.items():
        c = codec(name)
        assert (c.name, c.bits, c.codes_dtype, c.framed, c.block) == (name, bits, dtype, framed, block)
        assert codec(name, 64).block == 64


def test_the_schemes_are_built_from_the_registry() -> None:
    assert quant_options.SCHEMES == ("O1", "O2")
    for scheme, (first, second) in {"O1": ("lin-i8", "log-u8"), "O2": ("lin-i4", "log-u4")}.items():
        got = [codecs.codec_for(scheme, f"optimizer/state/w/{f}", "optimizer", "F32", (64, 128)) for f in ("exp_avg", "exp_avg_sq")]
        assert got == [codec(first), codec(second)]
    with pytest.raises(QuantError, match="use 'O1' \\(int8\\), 'O2' \\(int4\\), 'none' \\(lossless\\) or None"):
        quant_options.check_scheme("O3")


@pytest.mark.parametrize("name", ["lin-i16", "", "cast", "residual-bf16", "LIN-I8"])
def test_unknown_codec_names_are_refused_naming_the_known_ones(name: str) -> None:
    with pytest.raises(ValueError, match="unknown codec .*lin-i4, lin-i8, log-u4, log-u8"):
        codec(name)
    with pytest.raises(QuantError, match="unknown codec"):
        codecs.codec(name, 128)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("block", [1, 0, 7, -2])
def test_bad_block_sizes_are_refused(name: str, block: int) -> None:
    with pytest.raises(QuantError, match="even number"):
        codec(name, block)


def test_a_scheme_must_name_registered_codecs_and_a_name_is_registered_once() -> None:
    with pytest.raises(QuantError, match="unknown codec 'lin-i2'"):
        Registry([codecs.LinearInt8], [Scheme("O9", "lin-i8", "lin-i2", "int2")])
    with pytest.raises(QuantError, match="twice"):
        codecs.builtin().with_codec(codecs.LogU8)
    with pytest.raises(QuantError, match="unknown scheme 'O9'"):
        codecs.codec_for("O9", "optimizer/state/w/exp_avg", "optimizer", "F32", (64, 128))


def bound_holds(c: Codec, box: Box, x: torch.Tensor, y: torch.Tensor) -> bool:
    """The error bound each family states (ckptd.common.codecs), per logical block of the last dim."""
    block, n = c.block, x.shape[-1]
    left = box.offsets[-1] % block
    right = (-(left + n)) % block

    def per_block(t: torch.Tensor, fill: float) -> torch.Tensor:
        return torch.nn.functional.pad(t.reshape(-1, n), (left, right), value=fill).view(-1, (left + n + right) // block, block)

    if isinstance(c, Linear):
        limit = per_block(x.abs(), 0).amax(-1, keepdim=True) / (2 * c.levels)
        return bool((per_block((y - x).abs(), 0) <= limit * (1 + 1e-5) + 1e-12).all())
    assert isinstance(c, Log), f"codec {c.name} has no stated bound in this test: state it"
    if not bool(((y == 0) == (x == 0)).all()):
        return False
    s = per_block(x.sqrt(), 0)
    lo = torch.where(s > 0, s, torch.inf).amin(-1, keepdim=True).log2()
    hi = s.amax(-1, keepdim=True).log2()
    limit = ((hi - lo) / (c.levels - 1)).expand_as(s)
    nz = per_block(x, 0) > 1e-37  # below float32 tiny the decoded value is clamped up
    err = (per_block(y, 1).log2() - per_block(x, 1).log2()).abs()
    return bool((err[nz] <= limit[nz] + 1e-4).all())


def sample(c: Codec, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(shape, generator=g) * 1e-3
    x.view(-1)[::97] *= 50
    if isinstance(c, Log):
        x = x.square()
        x.view(-1)[::13] = 0.0
    return x


@pytest.mark.parametrize("name", codec_names())
@pytest.mark.parametrize("box", [Box.full((7, 1000)), Box((2, 3, 100), (3, 5, 257)), Box((0, 1), (1, 4097))], ids=str)
def test_every_registered_codec_round_trips_within_its_bound(name: str, box: Box) -> None:
    c = codec(name, 64)
    x = sample(c, box.lengths)
    codes, scales = c.encode(x, box)
    assert tuple(codes.shape) == c.codes_shape(box.lengths) and tuple(scales.shape) == c.scales_shape(box)
    assert codes.shape[-1] == math.ceil(box.lengths[-1] * c.bits / 8)
    assert str(codes.dtype).split(".")[-1] == {"I8": "int8", "U8": "uint8"}[c.codes_dtype]
    y = c.decode(codes, scales, box, box)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert bound_holds(c, box, x, y)
    # the module functions are the codec's methods
    assert torch.equal(c.decode(*c.encode(x, box), box, box), y)


@dataclass(frozen=True)
class Float16:
    """A toy codec of another shape: the values as float16 codes, one empty scale per row; its
    own encode and decode, no kernel."""

    block: int
    name: ClassVar[str] = "toy-f16"
    default_block: ClassVar[int] = 2
    bits: ClassVar[int] = 16
    codes_dtype: ClassVar[str] = "F16"
    framed: ClassVar[bool] = False

    def codes_shape(self, lengths: Sequence[int]) -> tuple[int, ...]:
        return tuple(lengths)

    def scales_shape(self, box: Box) -> tuple[int, ...]:
        return (*box.lengths[:-1], 0)

    def encode(self, values: torch.Tensor, box: Box, scratch: quant.Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return values.to(torch.float16), torch.empty(self.scales_shape(box))

    def decode(self, codes: torch.Tensor, scales: torch.Tensor, region: Box, want: Box) -> torch.Tensor:
        return codes[relative(want, region)].to(torch.float32)


class LinearInt8Coarse(Linear):
    """A toy codec of an existing family: int8 codes of 63 levels, on the native kernel."""

    name = "lin-i8c"
    bits = 8
    levels = 63
    codes_dtype = "I8"
    framed = False
    default_block = 32


@pytest.mark.parametrize("cls", [Float16, LinearInt8Coarse], ids=lambda c: c.name)
def test_a_new_codec_class_is_usable_by_name_once_registered(cls: codecs.CodecClass) -> None:
    registry = codecs.builtin().with_codec(cls)
    assert cls.name in registry.codec_names() and cls.name not in codec_names()  # the built-in registry is untouched
    c = registry.codec(cls.name)
    assert c.block == cls.default_block and not c.framed
    box = Box((4, 0), (6, 100))
    x = torch.randn(box.lengths)
    codes, scales = c.encode(x, box)
    assert tuple(codes.shape) == c.codes_shape(box.lengths) and tuple(scales.shape) == c.scales_shape(box)
    want = Box((5, 10), (3, 50))
    y = c.decode(codes, scales, box, want)
    tolerance = 1e-3 if cls is Float16 else float(x.abs().max()) / (2 * 63) * 1.0001
    assert float((y - x[1:4, 10:60]).abs().max()) <= tolerance
    schemes = registry.with_scheme(Scheme("T1", cls.name, "log-u8", "toy"))
    assert codecs.codec_for("T1", "optimizer/state/w/exp_avg", "optimizer", "F32", (64, 128), schemes) == c


def test_a_client_that_only_decodes_never_loads_the_native_encoder() -> None:
    program = (
        "import sys, torch\n"
        "from ckptd.common import codecs\n"
        "from ckptd.common.boxes import Box\n"
        "c = codecs.codec('lin-i4', 128)\n"
        "box = Box.full((2, 300))\n"
        "c.decode(torch.zeros(c.codes_shape(box.lengths), dtype=torch.uint8), torch.ones(c.scales_shape(box)), box, box)\n"
        "assert 'ckptd.common._codec' not in sys.modules\n"
        "c.encode(torch.ones(2, 300), box)\n"
        "assert 'ckptd.common._codec' in sys.modules\n"
        "import ckptd.common.quant_options\n"
    )
    subprocess.run([sys.executable, "-c", program], check=True, timeout=120)


def test_the_registry_and_the_option_names_do_not_import_torch() -> None:
    program = "import sys\nimport ckptd.common.codecs, ckptd.common.quant_options\nckptd.common.codecs.codec('log-u4')\nassert 'torch' not in sys.modules, 'torch imported'\n"
    subprocess.run([sys.executable, "-c", program], check=True, timeout=120)
