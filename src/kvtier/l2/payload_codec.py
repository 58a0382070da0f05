"""``PayloadCodec``: one L2 adapter's codec (``kvtier.l2.codecs``), the one it
writes with and every one it reads, and whether coding pays on its link."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

from kvtier.l2.codecs import CODECS_BY_IDENT, Codec, codec_named
from kvtier.l2.format import Corruption, CorruptObject, Payload
from kvtier.layout import KVLayout
from kvtier.read_or_recompute import coded_read_pays, ewma

log = logging.getLogger(__name__)


class PayloadCodec:
    """One adapter's codec: the one it writes with (``name``) and every one it
    reads. ``layouts`` maps layout digests to layouts (the storage manager's
    book of the layouts its engines registered).

    It switches itself off where it does not pay. Until whole loads have
    been measured both ways it goes by a model: from the adapter's load parts
    it learns the link's rate (stored bytes per second of transfer), the
    decode rate and the compression ratio, and takes a coded read (ratio /
    link + 1 / decode per byte, on one I/O thread) to be slower than a plain
    one (1 / link) when that sum says so — cautious, since the adapter's
    threads overlap one part's decode with others' transfers. Once loads of
    only coded and of only plain payloads have both been timed (``load_done``:
    delivered bytes per second of the whole load), those decide. While it
    does not pay it stores objects plain, coding one store in
    ``PROBE_EVERY`` to keep measuring. Each change of the verdict is logged
    with the rates behind it, naming the adapter (``where``)."""

    PROBE_EVERY = 64

    def __init__(self, name: str, layouts: Mapping[str, KVLayout], where: str = "") -> None:
        self.writer = codec_named(name)
        self.layouts = layouts
        self.where = where
        self._paid: bool | None = None  # the verdict last logged
        self._readers: dict[int, Codec] = {self.writer.ident: self.writer}
        self._part = threading.local()  # this thread's load part: decode seconds and bytes
        self._lock = threading.Lock()  # guards the fields below
        self._link: float | None = None
        self._decode: float | None = None
        self._ratio: float | None = None
        self._coded_loads: float | None = None  # delivered bytes/s of loads of coded payloads
        self._plain_loads: float | None = None  # ... and of plain ones
        self._encodes = 0
        self._plain_stores = 0  # objects stored plain because the codec did not pay

    def encode(self, layout: str, payload: Payload) -> tuple[int, Payload]:
        """(codec id, stored bytes) for a payload of layout digest ``layout``."""
        shape = self.layouts.get(layout)
        if self.writer.ident == 0 or not self.writer.applies(shape):
            return 0, payload
        with self._lock:
            self._encodes += 1
            skip = not self._pays() and self._encodes % self.PROBE_EVERY != 0
            self._plain_stores += skip
        if skip:
            return 0, payload
        stored = self.writer.encode(payload, shape)
        return (0, payload) if stored is None else (self.writer.ident, stored)

    def decode(self, ident: int, layout: str, stored: Payload, out: Payload) -> None:
        codec = self._readers.get(ident)
        if codec is None:
            cls = CODECS_BY_IDENT.get(ident)
            if cls is None:
                raise CorruptObject(Corruption.CODEC, f"unknown codec {ident}")
            try:
                codec = self._readers[ident] = codec_named(cls.name)
            except RuntimeError as exc:  # its library is not installed here
                raise CorruptObject(Corruption.CODEC, str(exc)) from None
        started = time.perf_counter()
        codec.decode(stored, self.layouts.get(layout), out)
        part = getattr(self._part, "totals", None)
        if part is not None:
            part[0] += time.perf_counter() - started
            part[1] += out.nbytes
            part[2] += stored.nbytes

    def start_part(self) -> None:
        """A load part starts on this thread (the adapter times it)."""
        self._part.totals = [0.0, 0, 0]  # decode seconds, decoded bytes, their stored bytes

    def end_part(self, seconds: float, loaded_bytes: int) -> int:
        """The part took ``seconds`` and delivered ``loaded_bytes``: learn from
        it; the bytes of it that were decoded."""
        decode_s, decoded, stored = self._part.totals
        self._part.totals = None
        self.learn_part(
            seconds - decode_s, loaded_bytes - decoded + stored, decode_s, decoded, stored
        )
        return int(decoded)

    def learn_part(
        self, transfer_s: float, transfer_bytes: int, decode_s: float, decoded: int, stored: int
    ) -> None:
        """One load part's transfer and decode (the model's inputs)."""
        with self._lock:
            if transfer_s > 0 and transfer_bytes > 0:
                self._link = ewma(self._link, transfer_bytes / transfer_s)
            if decoded and decode_s > 0:
                self._decode = ewma(self._decode, decoded / decode_s)
                self._ratio = ewma(self._ratio, stored / decoded)
        self._log_verdict()

    def load_done(self, seconds: float, loaded_bytes: int, decoded_bytes: int) -> None:
        """A whole load delivered ``loaded_bytes`` in ``seconds``, of which
        ``decoded_bytes`` came coded: a sample of coded or of plain loads
        (loads that mixed both teach nothing)."""
        if self.writer.ident == 0 or seconds <= 0 or loaded_bytes <= 0:
            return
        if 0 < decoded_bytes < loaded_bytes:
            return
        with self._lock:
            if decoded_bytes:
                self._coded_loads = ewma(self._coded_loads, loaded_bytes / seconds)
            else:
                self._plain_loads = ewma(self._plain_loads, loaded_bytes / seconds)
        self._log_verdict()

    def status(self) -> dict[str, float]:
        with self._lock:
            out = {"codec_plain_stores": float(self._plain_stores)}
            if self._link is not None:
                out["codec_link_bytes_per_s"] = self._link
            if self._decode is not None and self._ratio is not None:
                out["codec_decode_bytes_per_s"] = self._decode
                out["codec_ratio"] = 1 / self._ratio
                out["codec_pays"] = float(self._pays())
            for name, rate in (("coded", self._coded_loads), ("plain", self._plain_loads)):
                if rate is not None:
                    out[f"codec_{name}_load_bytes_per_s"] = rate
            return out

    def _pays(self) -> bool:
        if self._coded_loads is not None and self._plain_loads is not None:
            return self._coded_loads > self._plain_loads
        if self._link is None or self._decode is None or self._ratio is None:
            return True  # not measured yet: code, and learn
        return coded_read_pays(self._ratio, self._link, self._decode)

    def _log_verdict(self) -> None:
        """Log a change of the verdict, with what it rests on."""
        with self._lock:
            coded, plain = self._coded_loads, self._plain_loads
            link, decode, ratio = self._link, self._decode, self._ratio
            if coded is not None and plain is not None:
                why = f"loads deliver {coded / 1e9:.2f} GB/s coded, {plain / 1e9:.2f} GB/s plain"
            elif link is not None and decode is not None and ratio is not None:
                why = (
                    f"a coded read (ratio {1 / ratio:.2f}, decode {decode / 1e9:.2f} GB/s) "
                    f"against a plain one at {link / 1e9:.2f} GB/s"
                )
            else:
                return
            pays = self._pays()
            if self.writer.ident == 0 or pays == self._paid:
                return
            self._paid = pays
        verdict = "pays, coding stores" if pays else "does not pay, storing plain"
        log.info("L2 %s: codec %s %s: %s", self.where, self.writer.name, verdict, why)


__all__ = ["PayloadCodec"]
