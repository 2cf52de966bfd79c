"""The label of every file to pack: from its class directory, from a CSV of ``path,label``, or none.

Separate from the packer because labels are user input with their own rules and errors, and because
they must be settled *before* anything is written to DEST: a bad CSV is refused with its file and line
while DEST is untouched, instead of partway through a pack that leaves an unfinished DEST behind.
Labels are stored as ``int32`` in blocks and in the index, so the range is checked here, once.
"""

from __future__ import annotations

import csv
import logging
import os

from ..core.index import KIND_DIR
from ..errors import PackError
from .sources import SourceEntry

log = logging.getLogger(__name__)

NO_LABEL = -1
MAX_LABEL = 2**31 - 1  # labels are stored as int32


def assign_labels(files: list[SourceEntry], spec: str, root_entries: list[SourceEntry]) -> list[str] | None:
    """Set ``label`` on each file from ``spec``; return the class names, if the labels have names.

    ``dirname`` follows torchvision's ImageFolder exactly: the classes are the directories directly
    under the root, indexed in sorted order; files outside them get -1.
    """
    if spec == "none":
        for f in files:
            f.label = NO_LABEL
        return None
    if spec == "dirname":
        classes = sorted(os.fsdecode(e.path) for e in root_entries if e.kind == KIND_DIR and b"/" not in e.path and e.path)
        index = {os.fsencode(c): i for i, c in enumerate(classes)}
        for f in files:
            top, sep, _ = f.path.partition(b"/")
            f.label = index.get(top, NO_LABEL) if sep else NO_LABEL
        return classes
    return _labels_from_csv(files, spec)


def _read_rows(csv_path: str) -> list[tuple[int, str, str]]:
    """(line number, path, label) of every non-empty row, the header (``path,label``) left out."""
    rows: list[tuple[int, str, str]] = []
    try:
        with open(csv_path, newline="", encoding="utf-8", errors="surrogateescape") as f:
            reader = csv.reader(f)
            for row in reader:
                if not row:
                    continue
                if not rows and row[:2] == ["path", "label"]:
                    continue
                if len(row) != 2:
                    raise PackError(
                        f"labels file {csv_path!r}, line {reader.line_num}: each row must be 'path,label'; got {row!r}"
                    )
                rows.append((reader.line_num, row[0], row[1]))
    except OSError as e:
        raise PackError(f"cannot read labels file {csv_path!r}: {e.strerror}") from e
    except csv.Error as e:
        raise PackError(f"labels file {csv_path!r}: not a CSV file ({e})") from e
    return rows


def _integer_labels(csv_path: str, rows: list[tuple[int, str, str]]) -> list[int] | None:
    """Each row's label as an integer, range-checked; None if any label is not an integer (class names)."""
    try:
        values = [int(label) for _, _, label in rows]
    except ValueError:
        return None
    for (line, _, label), value in zip(rows, values):
        if not NO_LABEL <= value <= MAX_LABEL:
            raise PackError(
                f"labels file {csv_path!r}, line {line}: label {label.strip()} is out of range: labels are "
                f"integers from {NO_LABEL} (no label) to {MAX_LABEL}, or class names"
            )
    return values


def _labels_from_csv(files: list[SourceEntry], csv_path: str) -> list[str] | None:
    rows = _read_rows(csv_path)
    values = _integer_labels(csv_path, rows)
    classes = None
    if values is None:  # class names: numbered in sorted order
        classes = sorted({label for _, _, label in rows})
        number = {name: i for i, name in enumerate(classes)}
        values = [number[label] for _, _, label in rows]
    by_path = {os.fsencode(path.strip("/")): value for (_, path, _), value in zip(rows, values)}
    known = {f.path for f in files}
    stray = [(line, path.strip("/")) for line, path, _ in rows if os.fsencode(path.strip("/")) not in known]
    if stray:
        raise PackError(
            f"labels file {csv_path!r} names {len(stray)} paths that are not files in the source, "
            f"e.g. {stray[0][1]!r} on line {stray[0][0]}; paths must be relative to the source directory"
        )
    unlabelled = 0
    for f in files:
        f.label = by_path.get(f.path, NO_LABEL)
        unlabelled += f.path not in by_path
    if unlabelled:
        log.warning("labels file %s gives no label to %d files; they get label -1", csv_path, unlabelled)
    return classes
