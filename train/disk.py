"""Writes that leave nothing half-done, for every room that writes (data, checkpoints,
exports, records):

- `write_atomic`: a temporary file beside the target, fsync'ed, renamed over it; Ctrl-C or a
  crash leaves the old file or the new one, never a part of either.
- `out_of_space`: what a write that ran out of space says (a full disk, a quota, a file
  size limit): what was not written, that nothing of it is left, what to do.
- `drop_dead_writers`: what writers killed mid-write left beside their output (their pid gone).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def out_of_space(err: BaseException, what: str, where: Path, fix: str) -> OSError | None:
    """The error to raise for `err` when it is a write that ran out of space (`what` not
    written into `where`, its partial files removed by the caller; `fix`: what to do next),
    else None (raise `err` itself)."""
    code = err.errno if isinstance(err, OSError) else None
    if code is None:  # safetensors' Rust writer: "I/O error: ... (os error 28)"
        found = re.search(r"\(os error (\d+)\)", str(err))
        code = int(found.group(1)) if found else None
    if code not in OUT_OF_SPACE:
        return None
    return OSError(
        code,
        f"{what} not written: {where} ran out of space ({os.strerror(code)}); nothing of it "
        f"is left. {fix}",
    )


def drop_dead_writers(parent: Path, prefix: str) -> None:
    """Remove what killed writers left in `parent`: entries named `prefix` + a pid (+ "-..."),
    `prefix` naming this host, whose process is gone; a live process's is left alone."""
    for stale in parent.glob(f"{prefix}*"):
        pid = stale.name.removeprefix(prefix).split("-")[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(stale, ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` whole, or what it held before (Ctrl-C, a crash, a full disk)."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
