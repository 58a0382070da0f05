"""L1 proves an object's layout before it serves it: every read names the
layout it expects per object group, and an object written under another is
WRONG_LAYOUT, as if absent (the finding: L1 served one layout's bytes to a
reader of another as a hit, where the fs tier, checking its header, missed)."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.keys import ObjectKey
from kvtier.l1 import L1Manager, L1Result, WriterTag
from tests.conftest import NF, S, make_key
from tests.ledger import assert_clean

A, B = WriterTag("a"), WriterTag("b")
PAGE = 4096
FP16, BF16 = "digest-fp16", "digest-bf16"
WL = L1Result.WRONG_LAYOUT
MakeL1 = Callable[..., L1Manager]


def put(l1: L1Manager, keys: list[ObjectKey], layout: str, tag: WriterTag = A) -> None:
    placements = l1.reserve_write(keys, [PAGE] * len(keys), tag, layout=layout)
    assert [p.result for p in placements] == [S] * len(keys)
    assert l1.finish_write(keys, tag) == [S] * len(keys)


def test_a_reader_of_another_layout_gets_wrong_layout_and_no_lock(make_l1: MakeL1) -> None:
    l1 = make_l1()
    k = [make_key(i) for i in range(3)]
    put(l1, k[:2], FP16)
    put(l1, k[2:], "")  # written without a layout
    reads = l1.reserve_read(k, layouts={0: BF16})
    assert [r.result for r in reads] == [WL, WL, WL]
    assert [r.result for r in l1.reserve_read(k)] == [WL, WL, S]  # names none: "" only
    assert [r.result for r in l1.reserve_read(k[:2], layouts={0: FP16})] == [S, S]
    assert l1.status()["wrong_layout"] == 5
    assert l1.finish_read(k) == [S, S, S]
    assert_clean(l1)


def test_the_expected_layout_is_per_object_group(make_l1: MakeL1) -> None:
    l1 = make_l1()
    full, window = make_key(1, group=0), make_key(1, group=1)
    put(l1, [full], FP16)
    put(l1, [window], BF16)
    reads = l1.reserve_read([full, window], layouts={0: FP16, 1: BF16})
    assert [r.result for r in reads] == [S, S]
    swapped = l1.reserve_read([full, window], layouts={0: BF16, 1: FP16})
    assert [r.result for r in swapped] == [WL, WL]
    assert l1.finish_read([full, window]) == [S, S]
    assert_clean(l1)


def test_a_writer_of_another_layout_is_refused_and_the_first_keeps_the_key(
    make_l1: MakeL1,
) -> None:
    l1 = make_l1()
    k = make_key(0)
    put(l1, [k], FP16)
    assert [p.result for p in l1.reserve_write([k], [PAGE], B, layout=BF16)] == [WL]
    assert [p.result for p in l1.reserve_write([k], [PAGE], B, layout=FP16)] == [
        L1Result.NOT_WRITABLE
    ]
    assert l1.resident_objects() == [(k, FP16)]
    assert_clean(l1)


def test_a_copy_published_after_another_layout_won_is_discarded_unlocked(
    make_l1: MakeL1,
) -> None:
    """Two writers of one key under two layouts, staged at once: the first to
    publish keeps it; the other's publish is WRONG_LAYOUT, its copy freed and
    no read lock taken on the winner."""
    l1 = make_l1()
    k = make_key(0)
    assert l1.reserve_write([k], [PAGE], A, layout=FP16)[0].result is S
    assert l1.reserve_write([k], [PAGE], B, layout=BF16)[0].result is S
    assert l1.finish_write([k], A) == [S]
    (late,) = l1.finish_write_and_reserve_read([k], B)
    assert late.result is WL
    assert l1.status()["locked_objects"] == 0
    assert l1.reserve_write([make_key(1)], [PAGE], B, layout=BF16)[0].result is S
    assert l1.finish_write([make_key(1)], B) == [S]
    (same,) = l1.reserve_read([k], layouts={0: FP16})
    assert same.result is S
    assert l1.finish_read([k]) == [S]
    assert_clean(l1)


def test_reserve_read_all_counts_another_layout_as_missing(make_l1: MakeL1) -> None:
    l1 = make_l1()
    k = [make_key(i) for i in range(3)]
    put(l1, k, FP16)
    assert l1.reserve_read_all(k, layouts={0: BF16}) == ([], 3)
    placements, missing = l1.reserve_read_all(k, layouts={0: FP16})
    assert missing == 0 and [p.result for p in placements] == [S, S, S]
    assert l1.finish_read(k) == [S, S, S]
    assert [r.result for r in l1.reserve_read([make_key(9)], layouts={0: FP16})] == [NF]
    assert_clean(l1)
