"""Rows kept column by column: the clock's bounded stores without an object per row.

A session's clock keeps thousands of recent tickets and version records. As Python objects each
costs a few hundred bytes (an instance, its boxed ints and floats, a dict slot); as one row of
:class:`Columns` it costs the row's own fields: 8 bytes per number (``array`` storage) and one
reference per string (the strings themselves are shared: callers intern them).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from typing import Iterator, Sequence

_COMPACT_FROM = 256  # rows dropped from the front before their storage is first given back


class Columns:
    """Rows of fixed fields, appended at the end and dropped from either end.

    ``kinds``: one ``array`` typecode per field (``"q"``: int64, ``"d"``: float64, ``"B"``:
    0-255), or ``"O"`` for any object (kept by reference). Rows are tuples in field order;
    indexes count the rows kept, 0 the oldest.
    """

    def __init__(self, kinds: Sequence[str]):
        self._kinds = tuple(kinds)
        self._columns: list = [[] if kind == "O" else array(kind) for kind in self._kinds]
        self._start = 0  # rows dropped from the front whose storage is not given back yet

    def __len__(self) -> int:
        return len(self._columns[0]) - self._start

    def append(self, row: Sequence) -> None:
        """Adds ``row`` at the end; a value that does not fit its field raises (``OverflowError``,
        ``TypeError``) and adds nothing."""
        if len(row) != len(self._columns):
            raise ValueError(f"a row of {len(self._columns)} fields, got {len(row)}")
        done = 0
        try:
            for column, value in zip(self._columns, row):
                column.append(value)
                done += 1
        except BaseException:
            for column in self._columns[:done]:
                column.pop()
            raise

    def replace(self, index: int, row: Sequence) -> None:
        """Puts ``row`` in place of the row at ``index`` (0 <= index < len)."""
        self._check(row)
        for column, value in zip(self._columns, row):
            column[self._start + index] = value

    def fits(self, row: Sequence) -> bool:
        """Whether ``row`` can be stored (each value fits its field)."""
        try:
            self._check(row)
        except (ValueError, TypeError, OverflowError):
            return False
        return True

    def _check(self, row: Sequence) -> None:
        """Raises where ``row`` does not fit the fields (so that a row is stored whole or not at all)."""
        if len(row) != len(self._columns):
            raise ValueError(f"a row of {len(self._columns)} fields, got {len(row)}")
        for kind, value in zip(self._kinds, row):
            if kind != "O":
                array(kind, (value,))

    def row(self, index: int) -> tuple:
        """The row at ``index`` (negative: from the end)."""
        size = len(self)
        if not -size <= index < size:
            raise IndexError(f"row {index} of {size}")
        at = self._start + (index % size)
        return tuple(column[at] for column in self._columns)

    def rows(self, first: int = 0) -> Iterator[tuple]:
        """The rows from index ``first`` on, oldest first."""
        start = self._start + max(0, first)
        return zip(*(column[start:] for column in self._columns))

    def columns(self, first: int = 0) -> list:
        """Each field's values from row ``first`` on: copies (an ``array`` or a list per field),
        to be read without a lock."""
        start = self._start + max(0, first)
        return [column[start:] for column in self._columns]

    def value(self, field: int, index: int):
        """Field ``field`` of the row at ``index`` (0 <= index < len)."""
        return self._columns[field][self._start + index]

    def find(self, field: int, value, after: bool = False) -> int:
        """The index of the first row whose ``field`` is ``>= value`` (``after``: ``> value``), for a
        field whose values ascend row by row; ``len(self)`` when there is none."""
        search = bisect_right if after else bisect_left
        return search(self._columns[field], value, self._start) - self._start

    def drop_first(self, count: int) -> None:
        """Forgets the ``count`` oldest rows (their storage is given back once enough have gone)."""
        self._start += min(max(0, count), len(self))
        if self._start >= _COMPACT_FROM and 4 * self._start >= len(self):  # moves 4 rows per row dropped, at most
            for column in self._columns:
                del column[:self._start]
            self._start = 0

    def keep_first(self, count: int) -> None:
        """Forgets every row from index ``count`` on."""
        for column in self._columns:
            del column[self._start + max(0, count):]

    def clear(self) -> None:
        for column in self._columns:
            del column[:]
        self._start = 0
