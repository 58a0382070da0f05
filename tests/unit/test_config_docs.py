"""docs/configuration.md is what kvtier.commands.config_docs makes of the configuration model."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from kvtier.commands.config_docs import Section, _table, render
from kvtier.server.config import ServerConfig, default_l1_bytes, load_config

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
REGENERATE = "python -m kvtier.commands.config_docs > docs/configuration.md"


def test_the_committed_page_is_what_the_configuration_model_generates() -> None:
    assert PAGE.read_text() == render(), f"docs/configuration.md is stale: run {REGENERATE}"


def test_every_server_option_has_a_row_whose_variable_the_server_reads() -> None:
    page = render()
    defaults = ServerConfig()
    for section in ("", "l1", "store", "prefetch", "limits", "events", "purge"):
        config = getattr(defaults, section) if section else defaults
        for f in dataclasses.fields(config):
            if dataclasses.is_dataclass(getattr(config, f.name)):
                continue
            assert f"| `{f.name}` |" in page, (section, f.name)
    # A documented variable sets its option (here a section's, and a size without _BYTES).
    assert "`KVTIER_STORE_BATCH_OBJECTS`" in page and "`KVTIER_L1_SIZE`" in page
    config = load_config({}, environ={"KVTIER_STORE_BATCH_OBJECTS": "7", "KVTIER_L1_SIZE": "8MiB"})
    assert config.store.batch_objects == 7 and config.l1.size_bytes == 8 << 20


def test_a_default_computed_from_the_machine_is_described_not_printed() -> None:
    page = render()
    assert "A quarter of physical memory, at most 16 GiB, at least 256 MiB" in page
    assert str(default_l1_bytes()) not in page


@dataclass(frozen=True, slots=True)
class _Planted:
    # Comments above a field and after it on its line are its meaning.
    size_bytes: int = 2 << 20  # in bytes
    secret_word: str = ""


def test_a_field_its_default_and_its_comments_make_one_row() -> None:
    table = _table(Section("`[planted]`", _Planted, lambda key: f"`{key}`", "X_", "planted."))
    assert (
        "| `size_bytes` | `planted.size_bytes`, `X_PLANTED_SIZE` | 2 MiB | Comments above a "
        "field and after it on its line are its meaning. in bytes |"
    ) in table
    assert '| `secret_word` | `planted.secret_word`, `X_PLANTED_SECRET_WORD` | `""` |  |' in table


def test_the_page_names_no_path_of_this_machine() -> None:
    assert os.path.expanduser("~") + "/" not in render()
