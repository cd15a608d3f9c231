"""The files of a graphopt.save archive: its members, and the files graphopt adds beside torch.export's program.

An archive torch.export.save writes is a zip whose members all lie under one top folder. `graphopt.saving` adds files
of its own under further folders of it (an engine's files; a language model's generation programs,
`graphopt.generation_archive`), each listed in graphopt.json with its SHA-256 (`checksums`). `add` appends them;
`extract` takes them out again at load, refusing an archive whose folder holds other files than those listed or a file
that fails its checksum: a file graphopt.save did not write reaches no loader.
"""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

from graphopt.errors import LoadError

FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a plain file name: no folders, nothing hidden


def members(source: Path, shown: Path | None = None) -> dict[str, str]:
    """The archive's member names by their path inside it (without the archive's top folder); checks every zip checksum.
    ``shown``: how messages name the archive (default ``source``)."""
    shown = shown or source
    try:
        with zipfile.ZipFile(source) as archive:
            damaged = archive.testzip()
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise LoadError(f"{shown} is not a complete .pt2 archive ({error}): the file is truncated or not one graphopt.save wrote. Save the module again.") from error
    except Exception as error:  # zlib and struct errors of a damaged member
        raise LoadError(f"{shown} is damaged ({type(error).__name__}: {error}): save the module again") from error
    if damaged is not None:
        raise LoadError(f"{shown} is damaged: {damaged} fails its checksum. Save the module again.")
    return {name.partition("/")[2]: name for name in names}


def checksums(folder: Path) -> dict[str, str] | None:
    """Each file in ``folder`` by name: its SHA-256, in hex; None where ``folder`` holds anything but plain files of plain names."""
    paths = sorted(folder.iterdir())
    if not all(path.is_file() and FILE_NAME.fullmatch(path.name) for path in paths):
        return None
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in paths}


def add(staged: Path, folder: str, files: Path, names: list[str]) -> None:
    """Append the files ``names`` of the folder ``files`` to the archive torch.export.save wrote at ``staged``, in ``folder``
    under its top folder."""
    with zipfile.ZipFile(staged, "a", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        top = archive.namelist()[0].partition("/")[0]
        for name in names:
            archive.write(files / name, f"{top}/{folder}/{name}")


def extract(source: Path, inner: dict[str, str], folder: str, listed: dict[str, str], into: Path, owner: str) -> None:
    """Write the files of the archive's ``folder`` into the folder ``into``: exactly those ``listed`` (name: SHA-256),
    each checked against its checksum, else `LoadError` naming ``owner`` ("the engine"). ``inner``: `members` of ``source``."""
    stored = sorted(name.removeprefix(f"{folder}/") for name in inner if name.startswith(f"{folder}/"))
    if sorted(listed) != stored or not all(FILE_NAME.fullmatch(name) for name in stored):
        raise LoadError(f"{source}: {owner}'s files in the archive ({stored}) are not those graphopt.save listed: the file was changed. Save the module again.")
    with zipfile.ZipFile(source) as archive:
        for name, digest in listed.items():
            data = archive.read(inner[f"{folder}/{name}"])
            if hashlib.sha256(data).hexdigest() != digest:
                raise LoadError(f"{source}: {owner}'s file {name} does not match its checksum: the file was changed. Save the module again.")
            (into / name).write_bytes(data)
