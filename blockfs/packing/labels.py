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
from collections.abc import Callable

import numpy as np

from ..core.index import KIND_DIR, KIND_FILE
from ..errors import PackError
from .entry_table import EntryTable

log = logging.getLogger(__name__)

NO_LABEL = -1
MAX_LABEL = 2**31 - 1  # labels are stored as int32


def assign_labels(table: EntryTable, spec: str) -> list[str] | None:
    """Set the label of each file of ``table`` from ``spec``; return the class names, if the labels have
    names.  One pass over the paths in chunks: no object per file.

    ``dirname`` follows torchvision's ImageFolder exactly: the classes are the directories directly
    under the root, indexed in sorted order; files outside them get -1.
    """
    is_file = table.kind == KIND_FILE
    if spec == "none":
        table.label[is_file] = NO_LABEL
        return None
    if spec == "dirname":
        tops = [table.paths[i] for i in np.flatnonzero(table.kind == KIND_DIR).tolist()]
        classes = sorted(os.fsdecode(p) for p in tops if p and b"/" not in p)
        index = {os.fsencode(c): i for i, c in enumerate(classes)}

        def label_of(path: bytes) -> int:
            top, sep, _ = path.partition(b"/")
            return index.get(top, NO_LABEL) if sep else NO_LABEL

        _set_labels(table, is_file, label_of)
        return classes
    return _labels_from_csv(table, is_file, spec)


def _set_labels(table: EntryTable, is_file: np.ndarray, label_of: Callable[[bytes], int]) -> None:
    """``label_of(path)`` for every file, chunk by chunk."""
    for start, chunk in table.paths.chunks():
        end = start + len(chunk)
        values = np.fromiter(map(label_of, chunk), dtype=np.int64, count=len(chunk))
        table.label[start:end] = np.where(is_file[start:end], values, table.label[start:end])


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
    for (line, _, label), value in zip(rows, values, strict=True):
        if not NO_LABEL <= value <= MAX_LABEL:
            raise PackError(
                f"labels file {csv_path!r}, line {line}: label {label.strip()} is out of range: labels are "
                f"integers from {NO_LABEL} (no label) to {MAX_LABEL}, or class names"
            )
    return values


def _labels_from_csv(table: EntryTable, is_file: np.ndarray, csv_path: str) -> list[str] | None:
    rows = _read_rows(csv_path)
    values = _integer_labels(csv_path, rows)
    classes = None
    if values is None:  # class names: numbered in sorted order
        classes = sorted({label for _, _, label in rows})
        number = {name: i for i, name in enumerate(classes)}
        values = [number[label] for _, _, label in rows]
    by_path = {os.fsencode(path.strip("/")): value for (_, path, _), value in zip(rows, values, strict=True)}
    found: set[bytes] = set()
    unlabelled = 0
    for start, chunk in table.paths.chunks():
        for k, path in enumerate(chunk):
            if not is_file[start + k]:
                continue
            value = by_path.get(path)
            if value is None:
                unlabelled += 1
                value = NO_LABEL
            else:
                found.add(path)
            table.label[start + k] = value
    stray = [(line, path.strip("/")) for line, path, _ in rows if os.fsencode(path.strip("/")) not in found]
    if stray:
        raise PackError(
            f"labels file {csv_path!r} names {len(stray)} paths that are not files in the source, "
            f"e.g. {stray[0][1]!r} on line {stray[0][0]}; paths must be relative to the source directory"
        )
    if unlabelled:
        log.warning("labels file %s gives no label to %d files; they get label -1", csv_path, unlabelled)
    return classes
