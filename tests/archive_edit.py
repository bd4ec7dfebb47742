"""Edit a saved model's members and re-seal it as an attacker would (a consistent manifest), so
only GML's own checks stand between the edit and torch (tests of gml.archive / gml.program_check)."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gml import archive


def members(path: Path) -> tuple[str, dict[str, bytes]]:
    """The archive's top-level folder and its members by relative name."""
    with zipfile.ZipFile(path) as z:
        names = z.namelist()
        prefix = names[0].split("/", 1)[0] + "/"
        return prefix, {n[len(prefix) :]: z.read(n) for n in names}


def rewrite(src: Path, dst: Path, edit: Callable[[dict[str, bytes]], Any], *, reseal: bool = True) -> Path:
    """Copy ``src`` with ``edit(members)`` applied; ``reseal`` writes a manifest that matches (an attacker's)."""
    prefix, found = members(src)
    manifest = json.loads(found.pop(archive.MANIFEST))
    edit(found)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for name, data in found.items():
            z.writestr(prefix + name, data)
        if not reseal:
            z.writestr(prefix + archive.MANIFEST, json.dumps(manifest))
    if reseal:
        archive.seal(dst, {k: v for k, v in manifest.items() if k != "members"})
    return dst


def program(path: Path) -> dict[str, Any]:
    """The saved program (``models/model.json``) as JSON."""
    return json.loads(members(path)[1]["models/model.json"])


def with_program(src: Path, dst: Path, new_program: Any, **extra: bytes) -> Path:
    """``src`` with its ``model.json`` replaced by ``new_program`` (and ``extra`` members), re-sealed."""

    def edit(m: dict[str, bytes]) -> None:
        m["models/model.json"] = json.dumps(new_program).encode()
        m.update(extra)

    return rewrite(src, dst, edit)


def rewrite_header(src: Path, dst: Path, edit: Callable[[dict[str, Any]], Any]) -> Path:
    """Copy ``src`` with ``edit(header)`` applied to its manifest's header, re-sealed (an attacker's)."""
    prefix, found = members(src)
    header = {k: v for k, v in json.loads(found.pop(archive.MANIFEST)).items() if k != "members"}
    edit(header)
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for name, data in found.items():
            z.writestr(prefix + name, data)
    archive.seal(dst, header)
    return dst
