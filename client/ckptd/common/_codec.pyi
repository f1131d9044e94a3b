# Types of the C extension ckptd.common._codec (_codec.c): the one-pass blockwise encoder.
from typing import Any, TypeAlias

import numpy as np
from typing_extensions import Buffer

_Bytes: TypeAlias = Buffer | np.ndarray[Any, Any]  # any C-contiguous buffer (numpy arrays: views of torch tensors)

OK: int
NON_FINITE: int
NEGATIVE: int

def encode_blocks(
    is_log: bool, bits: int, levels: int, values: _Bytes, rows: int, nblocks: int, block: int, left: int, n: int, codes: _Bytes, scales: _Bytes, /
) -> int: ...
