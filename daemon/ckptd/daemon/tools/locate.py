"""A step named the way `ckptd ls` shows it, opened for the operator tools: a step directory
(a path) or a step in an object store (s3://BUCKET/PREFIX/JOB/step-NNNNNNNN)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from ckptd.daemon.remote.bucket_step import open_bucket_step
from ckptd.daemon.remote.location import SCHEME
from ckptd.daemon.storage import StepReader, step_at


def open_step_reader(location: str | os.PathLike[str], environ: Mapping[str, str] = os.environ) -> StepReader:
    """The StepReader of the step at `location`: an s3:// URL is read from the bucket with the
    credentials of `environ` (as `ckptd serve --remote`; remote.bucket_step.BucketStepError
    when it cannot be opened), anything else is a step directory. Nothing is read yet but the
    bucket's listing of the step."""
    text = os.fspath(location)
    if text.startswith(SCHEME):
        return open_bucket_step(text, environ)
    return step_at(Path(text))
