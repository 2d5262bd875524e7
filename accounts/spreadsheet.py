"""CSV the console writes: a cell a spreadsheet would run as a formula is written as text.

A key named `=HYPERLINK(...)` must not become a live formula in whoever opens the export
(OWASP's CSV injection advice: a leading apostrophe for cells starting with = + - @, tab or CR).
"""
from __future__ import annotations

import csv
import io
from collections.abc import Iterable, Mapping, Sequence

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_cell(value: object) -> object:
    """A text cell that starts like a formula gets a leading apostrophe; numbers stay numbers."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def csv_text(fieldnames: Sequence[str], rows: Iterable[Mapping[str, object]]) -> str:
    """The whole CSV (a header, then one line per row; missing cells empty), every cell through csv_cell."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([csv_cell(name) for name in fieldnames])
    for row in rows:
        writer.writerow([csv_cell(row.get(name, "")) for name in fieldnames])
    return out.getvalue()
