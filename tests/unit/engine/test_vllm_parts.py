"""The vLLM connector's parts that run without an engine: settings, salts, the step timer,
layer names, page copies (``PagedKV``) and a consumer's TAKE polling (``poll_take``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.engine.vllm import timing
from kvtier.engine.vllm.handoff import Consume, poll_take
from kvtier.engine.vllm.pages import PagedKV, layer_index
from kvtier.engine.vllm.settings import ConnectorSettings
from kvtier.layout import KVLayout
from kvtier.protocol import messages as p
from kvtier.protocol.client import PendingReply


def test_settings_read_kvtier_keys_and_ignore_others() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"kvtier.address": "tcp://10.0.0.1:7000", "kvtier.store": "none", "lmcache.x": 1}
    )
    assert settings.address == "tcp://10.0.0.1:7000"
    assert settings.store == "none"


def test_settings_precedence_extra_config_then_environment_then_file(tmp_path: Path) -> None:
    toml = tmp_path / "kvtier.toml"
    toml.write_text('[connector]\nsalt = "file"\nstore = "none"\nlookup_wait_s = 0.5\n')
    settings = ConnectorSettings.from_extra_config(
        {"kvtier.config_file": str(toml), "kvtier.salt": "flag"},
        environ={"KVTIER_SALT": "env", "KVTIER_STORE": "prompt"},
    )
    assert (settings.salt, settings.store, settings.lookup_wait_s) == ("flag", "prompt", 0.5)


def test_settings_file_errors_name_the_file_key(tmp_path: Path) -> None:
    toml = tmp_path / "kvtier.toml"
    toml.write_text("[connector]\nlookup_wait = 0.5\n")
    with pytest.raises(ValueError, match="lookup_wait"):
        ConnectorSettings.from_extra_config({"kvtier.config_file": str(toml)}, environ={})


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({"kvtier.adress": "x"}, "kvtier.adress"),
        ({"kvtier.salt_source": "header"}, "kvtier.salt_source"),
        ({"kvtier.store": "all"}, "kvtier.store"),
        ({"kvtier.request_timeout_s": 0}, "kvtier.request_timeout_s"),
    ],
)
def test_bad_settings_name_the_key(extra: dict[str, object], names: str) -> None:
    with pytest.raises(ValueError, match=names.replace(".", r"\.")):
        ConnectorSettings.from_extra_config(extra)


def test_request_salt_wins_unless_fixed() -> None:
    by_request = ConnectorSettings(salt="default")
    assert by_request.salt_for("tenant-a") == "tenant-a"
    assert by_request.salt_for("acme corp") == "acme corp"  # as given: the identity labels it
    assert by_request.salt_for(None) == "default"
    assert ConnectorSettings(salt="default", salt_source="fixed").salt_for("t") == "default"


def test_layer_index_reads_the_last_number() -> None:
    assert layer_index("model.layers.7.self_attn.attn") == 7
    assert layer_index("model.decoder.layers.12.attn") == 12
    with pytest.raises(ValueError, match="no layer index"):
        layer_index("lm_head")


def make_paged(blocks: int = 8, block_size: int = 4) -> tuple[PagedKV, list[torch.Tensor]]:
    """Two layers of [blocks, kv_heads 2, block_size, 2 * head_dim 8] float32."""
    layout = KVLayout(2, 2, 8, "float32", tokens_per_chunk=2 * block_size)
    tensors = [torch.randn(blocks, 2, block_size, 16) for _ in range(2)]
    caches = {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(tensors)}
    return PagedKV(caches, layout, block_size), tensors


def test_pages_round_trip_through_an_object() -> None:
    paged, tensors = make_paged()
    assert paged.blocks_per_chunk == 2 and paged.object_bytes == 2 * 2 * tensors[0][0].nbytes
    obj = np.zeros(paged.object_bytes, np.uint8)
    paged.copy_out([[5, 2]], obj)
    pages = torch.from_numpy(obj).view(torch.float32).view(2, 2, *tensors[0].shape[1:])
    for layer, tensor in enumerate(tensors):  # [layer][block in chunk][page], in order
        assert torch.equal(pages[layer, 0], tensor[5]) and torch.equal(pages[layer, 1], tensor[2])
    before = [t.clone() for t in tensors]
    paged.scatter(obj, [{1: 7}])  # only the chunk's second block, into block 7
    for layer, tensor in enumerate(tensors):
        assert torch.equal(tensor[7], before[layer][2])
        others = [b for b in range(8) if b != 7]
        assert torch.equal(tensor[others], before[layer][others])


def test_paged_kv_refuses_tensors_that_do_not_match_the_layout() -> None:
    layout = KVLayout(2, 2, 8, "float32", tokens_per_chunk=8)
    one_layer = {"model.layers.0.attn": torch.zeros(4, 2, 4, 16)}
    with pytest.raises(ValueError, match="registered 1 KV tensors"):
        PagedKV(one_layer, layout, 4)
    wrong_heads = {f"model.layers.{i}.attn": torch.zeros(4, 1, 4, 16) for i in range(2)}
    with pytest.raises(ValueError, match="pages of"):
        PagedKV(wrong_heads, layout, 4)


def test_shared_kv_layers_are_counted_once() -> None:
    layout = KVLayout(1, 2, 8, "float32", tokens_per_chunk=8)
    shared = torch.zeros(4, 2, 4, 16)
    paged = PagedKV({"model.layers.0.attn": shared, "model.layers.1.attn": shared}, layout, 4)
    assert len(paged.layers) == 1


def test_step_timer_logs_every_thousand_steps_or_every_thirty_seconds(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    monkeypatch.setattr(timing.time, "monotonic", lambda: now[0])
    timer = timing.StepTimer()
    caplog.set_level("INFO", logger=timing.__name__)
    logged = [timer.step() for _ in range(timing.LOG_EVERY_STEPS)]
    assert logged == [False] * (timing.LOG_EVERY_STEPS - 1) + [True]
    assert timer.total_steps == timing.LOG_EVERY_STEPS and timer.steps == []
    assert timer.step() is False  # a few steps, then quiet
    now[0] += timing.LOG_EVERY_S
    assert timer.step() is True  # ... but a summary every LOG_EVERY_S all the same
    summaries = [r.message for r in caplog.records if "connector time per step" in r.message]
    assert len(summaries) == 2 and "2 steps" in summaries[1]


class _ScriptedServer:
    """A client whose TAKEs get these replies in turn (None: given up on, no answer)."""

    def __init__(self, *replies: p.Reply | None) -> None:
        self.replies = list(replies)
        self.takes = 0
        self.boot_id: str | None = "boot-1"  # the server registered with, as the client knows it
        self.sent: list[p.HandoffTake] = []

    def handoff(self, message: p.Message) -> PendingReply:
        self.takes += 1
        assert isinstance(message, p.HandoffTake)
        self.sent.append(message)
        call = PendingReply(message, (), 0.0)
        call.reply = self.replies.pop(0)
        call.done.set()
        return call


def _consume() -> Consume:
    return Consume("h", 700, "recompute", deadline=10.0, consumer="")


@pytest.mark.parametrize(
    ("replies", "outcome"),
    [
        # a server quiet for a while, then answering: the take goes on, nothing settles early
        ((None, p.HandoffState("pending"), p.HandoffState("pending")), "not_offered"),
        ((None, None, None), "server_away"),  # away until the wait ends
        ((None, p.HandoffState("granted")), "granted"),  # back, and the offer was there
    ],
)
def test_an_unanswered_take_is_asked_again_until_the_wait_ends(
    replies: tuple[p.Reply | None, ...], outcome: str
) -> None:
    consume, server = _consume(), _ScriptedServer(*replies)
    for step, now in enumerate((1.0, 2.0, 3.0)):
        if consume.settled:
            break
        poll_take(consume, server, [], now)  # type: ignore[arg-type]
        assert consume.settled == (step == len(replies) - 1 and outcome == "granted")
    poll_take(consume, server, [], 11.0)  # past the deadline, no TAKE in flight
    assert (consume.outcome, server.takes) == (outcome, min(len(replies), 3))


def test_a_take_asks_for_a_find_once_its_client_knows_the_server_restarted() -> None:
    """The producer offered on server boot-1, which then restarted: a client
    learns the new boot id only when it next hears from the server, so the
    first take goes out as if nothing happened (the new server knows no such
    hand-off: pending); the next take asks the new server to find it."""
    consume = Consume("h", 700, "recompute", deadline=10.0, consumer="", producer_server="boot-1")
    server = _ScriptedServer(p.HandoffState("pending"), p.HandoffState("granted"))
    poll_take(consume, server, [], 1.0)  # type: ignore[arg-type]
    server.boot_id = "boot-2"  # the no_hello answer made the client register again
    poll_take(consume, server, [], 2.0)  # type: ignore[arg-type]
    assert [take.find for take in server.sent] == [False, True]
    assert consume.outcome == "granted"
