"""Publishing a folder in one step, so no reader ever sees half of it."""

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def publish_folder(target: Path, prefix: str) -> Iterator[Path]:
    """A scratch folder beside `target` to fill; when the block succeeds it becomes `target` in
    one rename. If another process published `target` first, theirs stays: these folders are
    named by their content, so both are the same. If the block fails, nothing appears."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        yield staging
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
