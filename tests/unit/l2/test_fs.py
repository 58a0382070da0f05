"""The ``fs`` adapter: atomic publish, warm restart, capacity, I/O errors, options."""

from __future__ import annotations

import errno
import mmap
import os
import stat
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import ObjectKey
from kvtier.l2 import ADAPTER_TYPES, CompletionQueue, make_adapter
from kvtier.l2.base import Buffer
from kvtier.l2.format import encode_header
from kvtier.l2.fs import DIRECT_ALIGN, FSAdapter
from kvtier.l2.stored_value import encode_object
from tests.conftest import make_key
from tests.unit.l2.harness import Harness, payload

LAYOUT = "00112233445566778899aabbccddeeff"


class FSHarness(Harness):
    adapter: FSAdapter

    def files(self) -> list[Path]:
        return sorted(p for p in self.adapter.root.rglob("*") if p.is_file())

    def temp_files(self) -> list[Path]:
        return [p for p in self.files() if ".tmp-" in p.name]

    def status(self, name: str) -> Any:
        return self.adapter.status()[name]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "l2"


@pytest.fixture
def open_fs(root: Path) -> Iterator[Callable[..., FSHarness]]:
    """Build fs adapters on ``root`` (one at a time); all are closed at teardown."""
    made: list[FSHarness] = []

    def build(**options: Any) -> FSHarness:
        queue = CompletionQueue()
        adapter = make_adapter({"type": "fs", "path": str(root), **options}, queue.put)
        assert isinstance(adapter, FSAdapter)
        made.append(FSHarness(adapter, queue))
        return made[-1]

    yield build
    for harness in made:
        harness.adapter.close()
        harness.drain()


@pytest.fixture
def fs(open_fs: Callable[..., FSHarness]) -> FSHarness:
    return open_fs()


def _blank(*sizes: int) -> list[Buffer]:
    return [np.zeros(n, dtype=np.uint8) for n in sizes]


def _page_aligned(n: int, offset: int = 0) -> Buffer:
    """``n`` bytes starting ``offset`` bytes into fresh page-aligned memory."""
    memory = mmap.mmap(-1, n + offset + 1)
    return np.frombuffer(memory, dtype=np.uint8)[offset : offset + n]


def _file_size(key: ObjectKey, n: int, align: int = 64) -> int:
    return len(encode_header(key, "", np.zeros(n, np.uint8), align)) + n


# ------------------------------------------------------------ atomic publish


def test_store_publishes_whole_files_and_leaves_no_temp_files(fs: FSHarness) -> None:
    keys = [make_key(i, rank=i % 3) for i in range(10)]
    data = [payload(1000 + i, seed=i) for i in range(10)]
    stored = fs.store(keys, data, LAYOUT)
    assert stored.ok == (True,) * 10
    assert fs.temp_files() == []
    assert fs.files() == sorted(fs.adapter.path_of(k) for k in keys)
    assert stored.nbytes == sum(p.stat().st_size for p in fs.files())
    for key, original in zip(keys, data, strict=True):
        assert fs.adapter.path_of(key).read_bytes() == encode_object(key, LAYOUT, original)


def test_path_layout(fs: FSHarness) -> None:
    key = ObjectKey(bytes.fromhex("abcdef" + "00" * 29), "m", 1, 2, "s")
    assert fs.adapter.path_of(key) == fs.adapter.root / "ab" / "cd" / (key.to_str() + ".kv")


def _plant_temp(adapter: FSAdapter, key: ObjectKey, data: Buffer, n: int) -> Path:
    """A whole, valid copy left under a temp name, as a crash before the rename would."""
    final = adapter.path_of(key)
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.with_name(f"{final.name}.tmp-99999-{n}")
    temp.write_bytes(encode_object(key, "", data))
    return temp


def test_leftover_temp_files_are_removed_at_restart(open_fs: Callable[..., FSHarness]) -> None:
    first = open_fs()
    kept, crashed = make_key(1), make_key(2)
    kept_data, crashed_data = payload(500, seed=1), payload(500, seed=2)
    assert first.store([kept], [kept_data]).ok == (True,)
    temps = [
        _plant_temp(first.adapter, crashed, crashed_data, 0),  # no final file
        _plant_temp(first.adapter, kept, payload(500, seed=3), 1),  # next to a final file
    ]
    first.adapter.close()

    fs = open_fs()
    assert not any(t.exists() for t in temps)
    assert fs.temp_files() == []
    assert fs.status("objects") == 1
    assert fs.status("used_bytes") == fs.adapter.path_of(kept).stat().st_size
    assert fs.lookup([kept, crashed]).ok == (True, False)
    out = _blank(500, 500)
    assert fs.load([kept, crashed], out).ok == (True, False)
    assert np.array_equal(out[0], kept_data)  # not the temp file's bytes
    assert fs.failures() == Counter({"not_found": 1})


def test_temp_file_of_a_running_adapter_is_not_loadable(fs: FSHarness) -> None:
    key = make_key(1)
    _plant_temp(fs.adapter, key, payload(100, seed=0), 0)
    assert fs.lookup([key]).ok == (False,)
    assert fs.load([key], _blank(100)).ok == (False,)
    assert fs.status("objects") == 0


# ------------------------------------------------------------ warm restart


def test_warm_restart_finds_and_loads_every_object(open_fs: Callable[..., FSHarness]) -> None:
    first = open_fs()
    keys = [make_key(i, rank=i % 2, group=i % 3, salt="t" if i % 4 else "") for i in range(12)]
    sizes = [1 + 997 * i for i in range(12)]
    data = [payload(n, seed=i) for i, n in enumerate(sizes)]
    stored = first.store(keys, data, LAYOUT)
    assert stored.ok == (True,) * 12
    used = first.status("used_bytes")
    assert used == stored.nbytes
    first.adapter.close()

    fs = open_fs()
    assert fs.status("objects") == 12
    assert fs.status("used_bytes") == used == sum(p.stat().st_size for p in fs.files())
    assert fs.lookup(keys).ok == (True,) * 12
    out = _blank(*sizes)
    loaded = fs.load(keys, out, LAYOUT)
    assert loaded.ok == (True,) * 12
    assert loaded.nbytes == sum(sizes)
    for got, original in zip(out, data, strict=True):
        assert got.tobytes() == original.tobytes()
    assert fs.failures() == Counter()


def test_restart_ignores_foreign_files(open_fs: Callable[..., FSHarness], root: Path) -> None:
    first = open_fs()
    key = make_key(1)
    assert first.store([key], [payload(100, seed=0)]).ok == (True,)
    first.adapter.close()
    misplaced = root / "ff" / "ff" / (key.to_str() + ".kv")  # a real name in the wrong place
    misplaced.parent.mkdir(parents=True)
    misplaced.write_bytes(b"x")
    (root / "00" / "00" / "notes.txt").write_bytes(b"hello")
    (root / "00" / "00" / "not-a-key.kv").write_bytes(b"hello")

    fs = open_fs()
    assert fs.status("objects") == 1
    assert fs.status("used_bytes") == fs.adapter.path_of(key).stat().st_size


# ------------------------------------------------------------ capacity


def test_capacity_evicts_oldest_and_keeps_recently_loaded(
    open_fs: Callable[..., FSHarness],
) -> None:
    n = 1000
    size = _file_size(make_key(0), n)
    cap = 3 * size + size // 2
    fs = open_fs(capacity_bytes=cap)
    keys = [make_key(i) for i in range(8)]
    data = [payload(n, seed=i) for i in range(8)]
    for i in range(3):
        assert fs.store([keys[i]], [data[i]]).ok == (True,)
    assert fs.status("used_bytes") == 3 * size
    assert fs.adapter.status().get("evictions", 0) == 0

    out = _blank(n)
    assert fs.load([keys[0]], out).ok == (True,)  # 0 is now the most recently used
    assert fs.store([keys[3]], [data[3]]).ok == (True,)
    assert fs.lookup(keys[:4]).ok == (True, False, True, True)
    assert not fs.adapter.path_of(keys[1]).exists()
    assert fs.status("evictions") == 1
    assert fs.status("used_bytes") == 3 * size

    for i in range(4, 8):
        assert fs.store([keys[i]], [data[i]]).ok == (True,)
        assert fs.status("used_bytes") <= cap
        assert fs.status("used_bytes") == sum(p.stat().st_size for p in fs.files())
    assert fs.lookup(keys).ok == (False,) * 5 + (True,) * 3
    assert fs.status("evictions") == 5
    assert fs.status("objects") == 3
    assert len(fs.files()) == 3
    out = _blank(n, n, n)
    assert fs.load(keys[5:], out).ok == (True,) * 3
    for got, original in zip(out, data[5:], strict=True):
        assert np.array_equal(got, original)


def test_capacity_within_one_batch(open_fs: Callable[..., FSHarness]) -> None:
    """A batch may be stored in parallel parts, so which two survive is not fixed."""
    n = 500
    size = _file_size(make_key(0), n)
    fs = open_fs(capacity_bytes=2 * size)
    keys = [make_key(i) for i in range(5)]
    data = [payload(n, seed=i) for i in range(5)]
    assert fs.store(keys, data).ok == (True,) * 5
    found = fs.lookup(keys).ok
    assert sum(found) == 2
    assert fs.status("used_bytes") == 2 * size
    assert fs.status("objects") == 2
    assert fs.status("evictions") == 3
    survivors = [i for i in range(5) if found[i]]
    assert fs.files() == sorted(fs.adapter.path_of(keys[i]) for i in survivors)
    out = _blank(n, n)
    assert fs.load([keys[i] for i in survivors], out).ok == (True, True)
    for got, i in zip(out, survivors, strict=True):
        assert np.array_equal(got, data[i])


def test_capacity_as_text(open_fs: Callable[..., FSHarness]) -> None:
    fs = open_fs(capacity_bytes="4KiB")
    assert fs.status("capacity_bytes") == 4096


# ------------------------------------------------------------ tenant caps


def _tenant(salt: str) -> str:
    return salt


def test_a_store_past_its_tenants_cap_evicts_that_tenants_own_files(
    open_fs: Callable[..., FSHarness],
) -> None:
    """Issue 41 #7: capacity 6, acme's cap 2; globex writes 3, then acme 6.
    acme's store evicts acme's own files as they land; globex loses none."""
    n = 1000
    size = _file_size(make_key(0, salt="globex"), n)
    fs = open_fs(capacity_bytes=6 * size)
    assert fs.adapter.set_owners(_tenant, {"acme": 2 * size})
    theirs = [make_key(i, salt="globex") for i in range(3)]
    mine = [make_key(i, salt="acme") for i in range(6)]
    assert fs.store(theirs, [payload(n, seed=i) for i in range(3)]).ok == (True,) * 3
    for i, key in enumerate(mine):  # one at a time: the order is known
        assert fs.store([key], [payload(n, seed=10 + i)]).ok == (True,)
        assert fs.lookup(theirs).ok == (True,) * 3
    assert fs.lookup(mine).ok == (False,) * 4 + (True,) * 2
    assert fs.status("quota_evictions") == 4
    assert fs.adapter.status().get("evictions", 0) == 0
    assert sorted(fs.files()) == sorted(fs.adapter.path_of(k) for k in [*theirs, *mine[4:]])


def test_a_loaded_file_is_its_tenants_most_recent(open_fs: Callable[..., FSHarness]) -> None:
    n = 1000
    size = _file_size(make_key(0, salt="acme"), n)
    fs = open_fs()
    fs.adapter.set_owners(_tenant, {"acme": 2 * size})
    mine = [make_key(i, salt="acme") for i in range(3)]
    fs.store(mine[:2], [payload(n, seed=0), payload(n, seed=1)])
    assert fs.load([mine[0]], _blank(n)).ok == (True,)
    fs.store([mine[2]], [payload(n, seed=2)])
    assert fs.lookup(mine).ok == (True, False, True)


def test_an_object_larger_than_its_tenants_cap_is_not_written(
    open_fs: Callable[..., FSHarness],
) -> None:
    fs = open_fs()
    fs.adapter.set_owners(_tenant, {"acme": 3000})
    small = make_key(1, salt="acme")
    assert fs.store([small], [payload(1000, seed=1)]).ok == (True,)
    big = make_key(2, salt="acme")
    assert fs.store([big], [payload(4000, seed=2)]).ok == (False,)
    assert fs.failures() == Counter({"over_quota": 1})
    assert fs.lookup([small, big]).ok == (True, False)  # the small one is not evicted for it
    assert fs.files() == [fs.adapter.path_of(small)]


def test_caps_set_after_a_restart_trim_each_tenant_to_its_own(
    open_fs: Callable[..., FSHarness],
) -> None:
    n = 1000
    size = _file_size(make_key(0, salt="acme"), n)
    first = open_fs()
    keys = [make_key(i, salt="acme" if i % 2 else "globex") for i in range(8)]
    for i, key in enumerate(keys):
        first.store([key], [payload(n, seed=i)])
        os.utime(first.adapter.path_of(key), (1_000_000 + i, 1_000_000 + i))  # restart order
    first.adapter.close()
    fs = open_fs()
    removed: list[ObjectKey] = []
    fs.adapter.on_removed = removed.extend
    fs.adapter.set_owners(_tenant, {"acme": 2 * size})
    assert removed == [keys[1], keys[3]]  # acme's two oldest; globex has no cap
    assert fs.lookup(keys).ok == (True, False, True, False, True, True, True, True)
    assert fs.status("quota_evictions") == 2


@st.composite
def _tenant_stores(draw: st.DrawFn) -> tuple[int, list[int], list[tuple[int, list[int]]]]:
    """A capacity, caps that fit in it together, and stores (tenant, payload sizes)."""
    capacity = draw(st.integers(8_000, 40_000), label="capacity")
    tenants = draw(st.integers(2, 4), label="tenants")
    caps: list[int] = []
    for left in range(tenants, 0, -1):
        caps.append(draw(st.integers(1, capacity - sum(caps) - (left - 1)), label="cap"))
    sizes = st.lists(st.integers(1, 6_000), min_size=1, max_size=6)
    stores = draw(
        st.lists(st.tuples(st.integers(0, tenants - 1), sizes), min_size=1, max_size=12),
        label="stores",
    )
    return capacity, caps, stores


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["fs", "mock"]), _tenant_stores())
def test_a_tenant_within_its_cap_never_loses_an_object_to_another_tenants_store(
    adapter_type: str, scenario: tuple[int, list[int], list[tuple[int, list[int]]]]
) -> None:
    """Issue 41, in every node-local L2: several tenants, random caps within
    the capacity, random store sizes and orders; whoever stores, a tenant
    within its cap keeps its objects."""
    capacity, caps, stores = scenario
    with tempfile.TemporaryDirectory() as root:
        queue = CompletionQueue()
        spec = {"type": adapter_type, "capacity_bytes": capacity}
        adapter = make_adapter({**spec, "path": root} if adapter_type == "fs" else spec, queue.put)
        fs = Harness(adapter, queue)
        try:
            adapter.set_owners(_tenant, {str(t): cap for t, cap in enumerate(caps)})
            serial = 0
            for tenant, sizes in stores:
                before = _by_tenant(adapter.held_sizes())
                keys = [make_key(serial + i, salt=str(tenant)) for i in range(len(sizes))]
                serial += len(sizes)
                fs.store(keys, [payload(n, seed=n) for n in sizes])
                after = _by_tenant(adapter.held_sizes())
                for other, (held, used) in before.items():
                    if other != str(tenant) and used <= caps[int(other)]:
                        assert held <= after.get(other, (set(), 0))[0], (tenant, other)
                for other, (_, used) in after.items():
                    assert used <= caps[int(other)], other
            assert adapter.status()["used_bytes"] <= capacity
            assert adapter.status().get("evictions", 0) == 0  # tenants within caps fit
        finally:
            adapter.close()


def _by_tenant(held: list[tuple[ObjectKey, int]]) -> dict[str, tuple[set[ObjectKey], int]]:
    out: dict[str, tuple[set[ObjectKey], int]] = {}
    for key, size in held:
        keys, used = out.get(key.salt, (set(), 0))
        out[key.salt] = ({*keys, key}, used + size)
    return out


# ------------------------------------------------------------ I/O errors


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (errno.ENOSPC, "no_space"),
        (errno.EDQUOT, "no_space"),
        (errno.EACCES, "permission"),
        (errno.EIO, "os_error"),
    ],
)
@pytest.mark.parametrize("where", ["writev", "rename"])
def test_store_error_fails_only_that_key_and_leaves_nothing(
    fs: FSHarness, monkeypatch: pytest.MonkeyPatch, error: int, reason: str, where: str
) -> None:
    keys = [make_key(i) for i in range(3)]
    victim = keys[1].to_str()
    data = [payload(5000, seed=i) for i in range(3)]
    temps: list[str] = []
    real_writev, real_rename = os.writev, os.rename

    def writev(fd: int, buffers: Any) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if victim not in path:
            return real_writev(fd, buffers)
        temps.append(path)
        if len(temps) == 1:  # part of the header reaches the file first
            return real_writev(fd, [memoryview(buffers[0])[:16]])
        raise OSError(error, os.strerror(error))

    def rename(src: Any, dst: Any) -> None:
        if victim in str(dst):
            temps.append(str(src))
            raise OSError(error, os.strerror(error))
        real_rename(src, dst)

    if where == "writev":
        monkeypatch.setattr(os, "writev", writev)
    else:
        monkeypatch.setattr(os, "rename", rename)
    stored = fs.store(keys, data)
    monkeypatch.undo()

    assert stored.ok == (True, False, True)
    assert temps, "the injected failure did not happen"
    assert stored.nbytes == sum(fs.adapter.path_of(keys[i]).stat().st_size for i in (0, 2))
    assert fs.failures() == Counter({reason: 1})
    assert not fs.adapter.path_of(keys[1]).exists()
    assert not any(Path(t).exists() for t in temps)
    assert fs.temp_files() == []
    assert fs.lookup(keys).ok == (True, False, True)
    out = _blank(5000, 5000, 5000)
    assert fs.load(keys, out).ok == (True, False, True)
    assert np.array_equal(out[0], data[0])
    assert np.array_equal(out[2], data[2])
    assert fs.status("objects") == 2
    assert fs.status("used_bytes") == stored.nbytes


def test_failed_restore_keeps_the_old_copy(
    open_fs: Callable[..., FSHarness], monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = open_fs(skip_present=False)  # rewrite the copy there
    key = make_key(1)
    old, new = payload(3000, seed=1), payload(3000, seed=2)
    assert fs.store([key], [old]).ok == (True,)
    used = fs.status("used_bytes")

    def no_space(fd: int, buffers: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "writev", no_space)
    assert fs.store([key], [new]).ok == (False,)
    monkeypatch.undo()
    assert fs.failures() == Counter({"no_space": 1})
    assert fs.temp_files() == []
    assert fs.status("used_bytes") == used
    out = _blank(3000)
    assert fs.load([key], out).ok == (True,)
    assert np.array_equal(out[0], old)


def test_store_error_creating_the_directory(fs: FSHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    key = make_key(1)
    real_mkdir = Path.mkdir

    def mkdir(self: Path, *args: Any, **kwargs: Any) -> None:
        if self.is_relative_to(fs.adapter.root):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert fs.store([key], [payload(10, seed=0)]).ok == (False,)
    monkeypatch.undo()
    assert fs.failures() == Counter({"permission": 1})
    assert fs.lookup([key]).ok == (False,)
    assert fs.files() == []


def test_file_deleted_behind_the_adapter_is_a_miss_and_forgotten(fs: FSHarness) -> None:
    keys = [make_key(0), make_key(1)]
    data = [payload(800, seed=0), payload(900, seed=1)]
    assert fs.store(keys, data).ok == (True, True)
    fs.adapter.path_of(keys[0]).unlink()
    assert fs.lookup(keys).ok == (True, True)  # the index does not watch the directory
    out = _blank(800, 900)
    assert fs.load(keys, out).ok == (False, True)
    assert np.array_equal(out[1], data[1])
    assert fs.failures() == Counter({"not_found": 1})
    assert fs.lookup(keys).ok == (False, True)
    assert fs.status("objects") == 1
    assert fs.status("used_bytes") == fs.adapter.path_of(keys[1]).stat().st_size


def test_corrupt_file_is_deleted(fs: FSHarness) -> None:
    key = make_key(1)
    assert fs.store([key], [payload(4000, seed=0)]).ok == (True,)
    path = fs.adapter.path_of(key)
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    assert fs.load([key], _blank(4000)).ok == (False,)
    assert not path.exists()
    assert fs.status("objects") == 0
    assert fs.status("used_bytes") == 0
    assert fs.failures() == Counter({"corrupt_checksum": 1})


# ------------------------------------------------------------ O_DIRECT


@pytest.fixture(params=["as_is", "refused"])
def direct_opens(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths opened with O_DIRECT; "refused" makes every such open fail like tmpfs."""
    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    seen: list[str] = []
    real_open = os.open

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            seen.append(str(path))
            if request.param == "refused":
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    return seen


def test_o_direct_round_trip(open_fs: Callable[..., FSHarness], direct_opens: list[str]) -> None:
    fs = open_fs(o_direct=True)
    aligned, odd, misplaced = make_key(1), make_key(2), make_key(3)
    n = 3 * DIRECT_ALIGN
    data = {
        aligned: _page_aligned(n),  # size and address aligned: O_DIRECT
        odd: _page_aligned(5000),  # size not a multiple of 4096: buffered
        misplaced: _page_aligned(n, offset=1),  # address not aligned: buffered
    }
    for i, buffer in enumerate(data.values()):
        buffer[:] = payload(buffer.nbytes, seed=i)
    assert data[aligned].ctypes.data % DIRECT_ALIGN == 0
    keys = list(data)
    stored = fs.store(keys, list(data.values()))
    assert stored.ok == (True, True, True)
    assert fs.temp_files() == []

    sizes = {k: fs.adapter.path_of(k).stat().st_size for k in keys}
    assert sizes == {
        aligned: DIRECT_ALIGN + n,  # header padded to 4096
        odd: _file_size(odd, 5000),
        misplaced: _file_size(misplaced, n),
    }
    assert stored.nbytes == sum(sizes.values())
    written_direct = {Path(p).name.split(".tmp-")[0] for p in direct_opens}
    assert written_direct == {aligned.to_str() + ".kv"}

    direct_opens.clear()
    out = {aligned: _page_aligned(n), odd: _page_aligned(5000), misplaced: _page_aligned(n, 1)}
    loaded = fs.load(keys, list(out.values()))
    assert loaded.ok == (True, True, True)
    for key in keys:
        assert out[key].tobytes() == data[key].tobytes()
    assert direct_opens == [str(fs.adapter.path_of(aligned))]

    # plain buffers can read what O_DIRECT wrote, and so can an adapter without it
    plain = _blank(n)
    assert fs.load([aligned], plain).ok == (True,)
    assert plain[0].tobytes() == data[aligned].tobytes()
    fs.adapter.close()
    buffered = open_fs()
    plain = _blank(n, 5000)
    assert buffered.load([aligned, odd], plain).ok == (True, True)
    assert plain[0].tobytes() == data[aligned].tobytes()
    assert plain[1].tobytes() == data[odd].tobytes()
    assert fs.failures() == Counter()


def test_o_direct_reads_buffered_copies(open_fs: Callable[..., FSHarness]) -> None:
    """An object written without O_DIRECT (64-byte header) loads into an aligned buffer."""
    plain = open_fs()
    key, data = make_key(1), payload(2 * DIRECT_ALIGN, seed=0)
    assert plain.store([key], [data]).ok == (True,)
    plain.adapter.close()
    fs = open_fs(o_direct=True)
    out = _page_aligned(2 * DIRECT_ALIGN)
    assert fs.load([key], [out]).ok == (True,)
    assert out.tobytes() == data.tobytes()


# ------------------------------------------------------------ fsync


def _spy_fsync(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    calls: Counter[str] = Counter()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        calls["dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"] += 1
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def test_fsync_round_trip_syncs_file_and_directory(
    open_fs: Callable[..., FSHarness], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _spy_fsync(monkeypatch)
    fs = open_fs(fsync=True)
    keys = [make_key(1), make_key(2)]
    data = [payload(4096, seed=1), payload(10, seed=2)]
    assert fs.store(keys, data).ok == (True, True)
    assert calls == Counter({"file": 2, "dir": 2})
    out = _blank(4096, 10)
    assert fs.load(keys, out).ok == (True, True)
    assert out[0].tobytes() == data[0].tobytes()
    assert out[1].tobytes() == data[1].tobytes()


def test_no_fsync_by_default(fs: FSHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy_fsync(monkeypatch)
    assert fs.store([make_key(1)], [payload(10, seed=0)]).ok == (True,)
    assert calls == Counter()


def test_failed_directory_fsync_leaves_nothing_visible(
    open_fs: Callable[..., FSHarness], monkeypatch: pytest.MonkeyPatch
) -> None:
    fs = open_fs(fsync=True)
    key = make_key(1)
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert fs.store([key], [payload(100, seed=0)]).ok == (False,)
    monkeypatch.undo()
    assert fs.failures() == Counter({"os_error": 1})
    assert fs.lookup([key]).ok == (False,)
    assert fs.load([key], _blank(100)).ok == (False,)
    assert not fs.adapter.path_of(key).exists()


# ------------------------------------------------------------ configuration


def test_unknown_option_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown option 'pth'"):
        make_adapter({"type": "fs", "path": str(tmp_path), "pth": 1}, CompletionQueue().put)


def test_missing_path_is_named() -> None:
    with pytest.raises(ValueError, match="'path'"):
        make_adapter({"type": "fs"}, CompletionQueue().put)
    with pytest.raises(ValueError, match="'path'"):
        make_adapter({"type": "fs", "path": ""}, CompletionQueue().put)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"capacity_bytes": -1}, "'capacity_bytes'"),
        ({"capacity_bytes": "lots"}, "'capacity_bytes'"),
        ({"fsync": "yes"}, "'fsync'"),
        ({"o_direct": 1}, "'o_direct'"),
        ({"io_threads": 0}, "'io_threads'"),
        ({"timeout_s": 0}, "'timeout_s'"),
    ],
)
def test_bad_option_values_are_named(tmp_path: Path, options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        make_adapter({"type": "fs", "path": str(tmp_path), **options}, CompletionQueue().put)


def test_unknown_type_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'nope'") as info:
        make_adapter({"type": "nope"}, CompletionQueue().put)
    for name in ADAPTER_TYPES:
        assert repr(name) in str(info.value)
    with pytest.raises(ValueError, match="'type'"):
        make_adapter({"path": "/x"}, CompletionQueue().put)


def test_spec_as_json(tmp_path: Path) -> None:
    spec = f'{{"type": "fs", "path": "{tmp_path}", "capacity_bytes": "1MiB", "name": "disk"}}'
    adapter = make_adapter(spec, CompletionQueue().put)
    try:
        assert isinstance(adapter, FSAdapter)
        assert adapter.status()["capacity_bytes"] == 1 << 20
        assert adapter.name == "disk"
    finally:
        adapter.close()
    with pytest.raises(ValueError, match="JSON"):
        make_adapter("{not json", CompletionQueue().put)
