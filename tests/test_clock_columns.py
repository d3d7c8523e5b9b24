"""The session clock's bounded stores kept as columns (no Ray, no server): the recent tickets by
ordinal and the version history answer exactly what they were given, in every shape a record
has, and cost a small fixed number of bytes per version kept (a session's home shard holds
4,096 of each)."""

from __future__ import annotations

import tracemalloc

import pytest

from optserve.protos.status_records import RoundRecord
from optserve.server.domain.clock.clock_records import Ticket
from optserve.server.domain.clock.columns import Columns
from optserve.server.domain.clock.ticket_book import TicketBook
from optserve.server.domain.clock.version_history import VersionHistory, round_record


def _ticket(ordinal: int, version: int, client: str = "w/1", **kwargs) -> Ticket:
    return Ticket(ordinal, client, 1000 + ordinal, ordinal % 3, 0.5 if ordinal % 3 else 1.0, True, version, **kwargs)


def _bytes_per_item(build, count: int) -> float:
    """Bytes still allocated per item after ``build(count)``, the structure kept alive."""
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        kept = build(count)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert kept is not None
    return sum(stat.size_diff for stat in after.compare_to(before, "filename")) / count


def test_a_row_that_does_not_fit_its_fields_is_added_nowhere():
    columns = Columns("qdO")
    columns.append((1, 0.5, "a"))
    with pytest.raises(OverflowError):
        columns.append((2**63, 0.5, "b"))
    with pytest.raises(TypeError):
        columns.append((2, "x", "b"))
    assert len(columns) == 1 and list(columns.rows()) == [(1, 0.5, "a")]
    assert not columns.fits((2**64, 0.0, None)) and columns.fits((-5, 1e300, None))


def test_columns_drop_from_either_end_and_find_by_an_ascending_field():
    columns = Columns("qO")
    for i in range(1000):
        columns.append((10 * i, str(i)))
    columns.drop_first(600)  # past the compaction point: storage is given back, indexes stay
    columns.keep_first(300)
    assert len(columns) == 300 and columns.row(0) == (6000, "600") and columns.row(-1) == (8990, "899")
    assert columns.find(0, 6005) == 1 and columns.find(0, 6010) == 1 and columns.find(0, 6010, after=True) == 2
    assert columns.find(0, 10**9) == 300 and columns.value(1, 2) == "602"
    columns.replace(1, (6010, "x"))
    assert [row[1] for row in columns.rows(0)][:3] == ["600", "x", "602"]
    with pytest.raises(IndexError):
        columns.row(300)


def test_ticket_book_answers_each_kept_ordinal_with_the_ticket_booked():
    book = TicketBook(keep=8)
    tickets = [_ticket(o, o // 2 + 1, client=f"w{o % 3}/c", checkpoint=o % 4 == 0, hyperparams='{"":{"lr":0.1}}'
                       if o == 13 else "") for o in range(20)]
    for ticket in tickets:
        book.put(ticket)
    assert [t.ordinal for t in book] == list(range(12, 20))
    assert book.get(11) is None and book.get(20) is None
    assert [book.get(o) for o in range(12, 20)] == tickets[12:]
    replaced = Ticket(15, "w9/z", 7, 0, 1.0, False, 8)
    book.put(replaced)  # a ticket of a kept ordinal replaces it, in place
    assert book.get(15) == replaced and len(book) == 8
    gone = book.forget_deciding_after(8)
    assert [t.ordinal for t in gone] == [16, 17, 18, 19] and [t.ordinal for t in book] == [12, 13, 14, 15]
    book.restore([tickets[3], tickets[1], tickets[3]])
    assert list(book) == [tickets[1], tickets[3]]


def _records() -> list[RoundRecord]:
    """One record of each shape a history holds."""
    return [
        RoundRecord(1, ("a", "b"), (1.0, 0.5), ("c",), 0.25, "deadline", ("a/1", "b/2"), (4, 9), (0, 1)),
        RoundRecord(2, ("a",), (1.0,), (), 0.0, "push", ("a/1",), (5,), (0,)),
        RoundRecord(3, ("a", "b"), (1.0, 1.0), (), 0.1, "num_workers"),  # written before push ids were recorded
        RoundRecord(4, (), (), (), 0.3, "deadline"),  # an elastic round of no push
        RoundRecord(5, ("a",), (1.0,), (), 0.0, "push", ("a/1",), (2**70,), (0,)),  # a sequence past int64
        RoundRecord(6, ("a", "b"), (1.0,), (), 0.0, "odd", ("a/1",), (), ()),  # no shape the rows have
        RoundRecord(7, ("b",), (0.25,), (), 0.0, "push", ("b/2",), (10,), (3,)),
    ]


def test_history_gives_back_every_record_as_it_was_kept_in_each_shape():
    history = VersionHistory(keep=100)
    records = _records()
    for record in records:
        history.keep(record)
    assert history.since(0) == records and history.since(4) == records[4:] and history.latest == records[-1]
    restored = VersionHistory(keep=100)
    restored.restore(history.to_json())
    assert restored.since(0) == records
    history.forget_after(4)
    assert history.since(0) == records[:4]
    history.keep(records[6])
    assert history.since(3) == [records[3], records[6]]


def test_history_replaces_a_kept_version_in_place_or_in_order():
    history = VersionHistory(keep=5)
    records = _records()
    for record in records:
        history.keep(record)
    assert [r.version for r in history.since(0)] == [3, 4, 5, 6, 7]
    exact = RoundRecord(3, ("a", "b"), (1.0, 1.0), ("d",), 2.5, "members", ("a/1", "b/2"), (1, 2), (0, 0))
    history.keep(exact)  # as many pushes: rewritten in place
    wider = RoundRecord(7, ("b", "a", "c"), (1.0,) * 3, (), 1.0, "num_workers", ("b/2", "a/1", "c/3"), (10, 6, 1),
                        (0, 0, 0))
    history.keep(wider)  # more pushes than the one it replaces
    history.keep(RoundRecord(5, ("a",), (1.0,), (), 0.0, "push", ("a/1",), (6,), (0,)))  # an object replaced by rows
    assert history.since(0) == [exact, records[3], RoundRecord(5, ("a",), (1.0,), (), 0.0, "push", ("a/1",), (6,),
                                                               (0,)), records[5], wider]
    history.keep(records[1])  # an older version than all kept: filed in order, the oldest then forgotten
    assert [r.version for r in history.since(0)] == [3, 4, 5, 6, 7]


def test_history_keeps_its_bound_through_many_versions_of_varying_width():
    history = VersionHistory(keep=50)
    expected = []
    for version in range(1, 2000):
        width = version % 4
        tickets = [_ticket(version * 4 + i, version, client=f"w{i}/c") for i in range(width)]
        record = round_record(version, tickets, "num_workers", 0.01 * width)
        history.keep(record)
        expected.append(record)
    assert history.since(0) == expected[-50:] and history.since(1990) == expected[-9:]


def test_a_full_history_and_ticket_book_cost_a_small_fixed_size_per_version():
    count = 4096
    tickets = [_ticket(100_000 + i, 50_000 + i, client=f"w{i % 8}/abc") for i in range(count)]

    def history(n):
        kept = VersionHistory(keep=n)
        for i, ticket in enumerate(tickets[:n]):
            kept.keep(round_record(50_000 + i, [ticket], "push", 0.0))
        return kept

    def book(n):
        kept = TicketBook(keep=n)
        for ticket in tickets[:n]:
            kept.put(ticket)
        return kept

    records = _bytes_per_item(lambda n: [round_record(50_000 + i, [t], "push", 0.0) for i, t in enumerate(tickets)],
                              count)
    # the objects: about 380 B per record, 310 B per ticket (and a dict slot each, as kept before)
    assert _bytes_per_item(history, count) < records / 3 and _bytes_per_item(history, count) < 160
    assert _bytes_per_item(book, count) < 100
