"""JSON read from files and peers, which may be damaged or hostile.

`json.loads` of text nested deeper than the interpreter's stack (`"[" * 100_000`, 200 KB)
raises RecursionError, which no caller expects: a planted index stopped the daemon at start
and turned every `ckptd` command on it into a traceback. `loads` raises it as the
json.JSONDecodeError (a ValueError) that every reader of such text already handles."""

from __future__ import annotations

import json
from typing import Any


def loads(text: str | bytes | bytearray, **options: Any) -> Any:
    """json.loads(text, **options); JSONDecodeError also for text nested too deep to parse."""
    try:
        return json.loads(text, **options)
    except RecursionError:
        raise json.JSONDecodeError("nested too deep to read (a damaged or planted file?)", "", 0) from None
