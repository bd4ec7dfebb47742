"""Files GML writes: one check that an output path can be written (run before the work, not after
it) and one way to write a file so that a failure leaves nothing behind.

Every option that names an output file (``gml optimize/quantize --out``, ``gml inspect --svg``,
``gml bench --json/--md/--png``) and :func:`gml.io.save` go through :func:`check_writable`;
:func:`write_atomically` writes to a temporary file next to the target and renames it over the
target only once it is complete, so a full disk or a crash mid-write never leaves a partial file
(the rename is atomic on POSIX file systems).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from gml.errors import GMLError


def check_writable(path: str | os.PathLike[str] | None, option: str = "the output path") -> Path | None:
    """``path`` as a :class:`Path` once it is known that a file can be written there; ``None`` for
    ``None`` (the option was not given). Raises :class:`GMLError` naming ``option`` for an empty
    name, a directory, a missing directory, a special file (``/dev/null``, ``/dev/full``, a FIFO) and
    a directory where no file can be created (``/proc``, ``/sys``, read-only or no permission): the
    last is probed by creating (and removing) an empty temporary file there."""
    if path is None:
        return None
    text = os.fspath(path)
    if not text.strip():
        raise GMLError(f"{option} '{text}' names no file.", hint="give a file name, e.g. model.pt2.")
    p = Path(text)
    try:
        st = p.stat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise GMLError(f"{option} '{text}' cannot be written: {e.strerror}.", hint="choose another place.") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise GMLError(
            f"{option} '{text}' is a directory; it names the file to write.",
            hint=f"give a file name, e.g. {os.path.join(text, 'model.pt2')}.",
        )
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise GMLError(
            f"{option} '{text}' is not a regular file (a device, FIFO or socket); GML writes a file there by "
            "replacing it, which it does not do to special files.",
            hint="give the name of a regular file.",
        )
    parent = p.absolute().parent
    if not parent.is_dir():
        raise GMLError(
            f"{option} '{text}': the directory '{parent}' does not exist.", hint=f"create it: mkdir -p {parent}"
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".gml-probe-", dir=parent)
    except OSError as e:
        raise GMLError(
            f"{option} '{text}': no file can be created in '{parent}' ({e.strerror}).", hint="choose another place."
        ) from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return p


def _no_space(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def write_atomically(path: str | os.PathLike[str], write: Callable[[Path], None], what: str = "file") -> Path:
    """Call ``write(tmp)`` to fill a temporary file next to ``path``, then rename it to ``path``.
    Any exception removes the temporary file (nothing partial is left, an existing ``path`` is
    untouched); an ``OSError`` (disk full, quota, permission) becomes a :class:`GMLError`."""
    p = check_writable(path)
    assert p is not None
    # the same suffix as the target: writers that pick a format from it (matplotlib) see the real one
    fd, tmp_name = tempfile.mkstemp(prefix=f".{p.stem}-tmp-", suffix=p.suffix, dir=p.absolute().parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        reason = "the disk is full" if _no_space(e) else (e.strerror or str(e))
        raise GMLError(
            f"Could not write the {what} '{p}': {reason}; nothing was written.",
            hint="free some space or choose another place." if _no_space(e) else "choose another place.",
        ) from e
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return p


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (os.umask sets it, for a
    moment, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
