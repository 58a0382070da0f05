"""``BlendConfig`` and ``Selector``: the positions each layer runs, exactly."""

from __future__ import annotations

import pytest
import torch

from kvtier.blend import BlendConfig, Selector


def masks(
    total: int, computed: list[int], spans: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    c = torch.zeros(total, dtype=torch.bool)
    c[computed] = True
    candidates = torch.zeros(total, dtype=torch.bool)
    for start, end in spans:
        candidates[start:end] = True
    return c, candidates


def test_deviation_runs_everything_to_the_check_layer_then_keeps_the_most_deviating() -> None:
    # positions 0-9: an exact segment, 10-29 and 30-49: candidates, 50-54: the question
    computed, candidates = masks(55, list(range(50, 55)), [(10, 30), (30, 50)])
    config = BlendConfig(
        ratio=0.25, selection="deviation", check_layer=1, spread=1.0, filter_layers=2
    )
    selector = Selector(config, 8, computed, candidates, [(10, 30), (30, 50)])
    assert not selector.wants_attention
    assert selector.initial().tolist() == list(range(55))
    assert [selector.narrows_after(n) for n in range(8)] == [False, True, True, True] + [False] * 4
    # after the check layer: 0.25 x 2 = half of the 40 candidates, the 20 most deviating
    positions = torch.arange(55)
    deviation = torch.zeros(55)
    deviation[torch.arange(10, 50)] = torch.arange(40, dtype=torch.float)  # later = more
    keep = selector.after(1, positions, deviation)
    assert positions[keep].tolist() == list(range(30, 55))
    # one layer on: 0.25 x 1.5 = 15 of them, from the 20 kept
    positions = positions[keep]
    keep = selector.after(2, positions, deviation[positions])
    assert positions[keep].tolist() == list(range(35, 55))
    # the last filtering layer: 0.25 = 10 candidates
    positions = positions[keep]
    keep = selector.after(3, positions, deviation[positions])
    assert positions[keep].tolist() == list(range(40, 55))


def test_impact_ranks_by_deviation_times_the_attention_the_question_pays() -> None:
    computed, candidates = masks(55, list(range(50, 55)), [(10, 30), (30, 50)])
    config = BlendConfig(ratio=0.25, selection="impact", check_layer=1, spread=0.0, filter_layers=2)
    selector = Selector(config, 8, computed, candidates, [(10, 30), (30, 50)])
    assert selector.wants_attention
    positions = torch.arange(55)
    deviation = torch.zeros(55)
    deviation[10:50] = torch.arange(40, dtype=torch.float)  # later = more deviating
    attention = torch.full((55,), 0.001)
    attention[10:30] = 1.0  # the question reads the first segment, hardly the second
    # deviation alone would keep 40-49; times attention the first segment's top ten win
    keep = selector.after(1, positions, deviation, attention)
    assert positions[keep].tolist() == list(range(20, 30)) + list(range(50, 55))
    with pytest.raises(ValueError, match="attention"):
        selector.after(1, positions, deviation)
    # ratio 0 or 1 narrows nothing: no attention wanted
    for ratio in (0.0, 1.0):
        whole = Selector(
            BlendConfig(ratio=ratio, selection="impact"), 8, computed, candidates, [(10, 50)]
        )
        assert not whole.wants_attention


def test_static_recomputes_the_first_tokens_of_each_moved_segment_from_layer_zero() -> None:
    computed, candidates = masks(40, [38, 39], [(10, 20), (20, 38)])
    selector = Selector(BlendConfig(ratio=0.2, selection="static"), 4, computed, candidates,
                        [(10, 20), (20, 38)])  # fmt: skip
    assert selector.initial().tolist() == [10, 11, 20, 21, 22, 23, 38, 39]
    assert not any(selector.narrows_after(n) for n in range(4))


def test_question_recomputes_what_the_question_reads_most_from_layer_zero() -> None:
    computed, candidates = masks(55, list(range(50, 55)), [(10, 30), (30, 50)])
    config = BlendConfig(ratio=0.25, read_from=0.5)
    assert config.selection == "question"  # the default
    selector = Selector(config, 8, computed, candidates, [(10, 30), (30, 50)])
    assert selector.reads_question and not selector.wants_attention
    reader = selector.reader()  # the first pass: the question alone, read from layer 4
    assert reader.initial().tolist() == list(range(50, 55))
    assert [reader.reads_after(n) for n in range(8)] == [False] * 4 + [True] * 4
    assert not any(reader.narrows_after(n) for n in range(8))
    with pytest.raises(ValueError, match="read first"):
        selector.initial()
    # what the question reads, per read layer: mostly 12-16 in one layer, 40-43 in another
    read = [torch.full((55,), 0.01) for _ in range(4)]
    read[0][12:17] = 1.0
    read[3][40:44] = 0.9
    read[3][33] = 3.0  # one token read hard in one layer outranks a mean of 0.25 ...
    selector.read(read)
    # ... the mean over layers ranks: 33 (0.76), 12-16 (0.26), 40-43 (0.23); 0.25 x 40 = 10
    expected = [12, 13, 14, 15, 16, 33, 40, 41, 42, 43, *range(50, 55)]
    assert selector.initial().tolist() == expected
    assert not any(selector.narrows_after(n) for n in range(8))  # every layer, from layer 0
    for ratio in (0.0, 1.0):  # nothing to choose: no first pass
        whole = Selector(BlendConfig(ratio=ratio), 8, computed, candidates, [(10, 50)])
        assert not whole.reads_question


@pytest.mark.parametrize("selection", ["question", "impact", "deviation", "static"])
def test_ratio_zero_runs_only_the_computed_positions_and_one_runs_all(selection: str) -> None:
    computed, candidates = masks(30, [29], [(5, 29)])
    zero = Selector(BlendConfig(ratio=0.0, selection=selection), 4, computed, candidates, [(5, 29)])
    assert zero.initial().tolist() == [29]
    one = Selector(BlendConfig(ratio=1.0, selection=selection), 4, computed, candidates, [(5, 29)])
    expected = list(range(5, 30)) if selection == "static" else list(range(30))
    assert one.initial().tolist() == expected
    assert not any(one.narrows_after(n) or zero.narrows_after(n) for n in range(4))


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"ratio": 1.5}, "ratio"),
        ({"selection": "random"}, "selection"),
        ({"mask": "causal"}, "mask"),
        ({"check_layer": 0}, "layer 0"),
        ({"spread": -1.0}, "spread"),
        ({"read_from": 1.0}, "read_from"),
    ],
)
def test_bad_configs_name_the_field(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        BlendConfig(**kwargs)  # type: ignore[arg-type]
