"""docs/configuration.md is what the settings models and the command-line parsers generate, and every
`KAI_ISOLATOR_*` name the other pages mention is one of its variables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kai_isolator.services import config_docs

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "configuration.md"
_NAME = re.compile(r"\bKAI_ISOLATOR_[A-Z0-9_]*")


def test_the_committed_page_is_what_the_code_generates() -> None:
    assert PAGE.read_text() == config_docs.render(), (
        f"docs/configuration.md is out of date with the settings models or the CLI's flags; "
        f"regenerate it with `{config_docs.REGENERATE}` and commit it")


def test_the_page_lists_every_settings_field_and_every_flag() -> None:
    page = PAGE.read_text()
    for cls in config_docs.settings_classes():
        for field in cls.model_fields:
            assert f"`{config_docs.env_name(cls, field)}`" in page
    for parser, _ in config_docs.commands():
        for sub in [parser, *config_docs.subcommands(parser)]:
            assert f"### `{sub.prog}`" in page
            for action in config_docs.options(sub):
                assert config_docs.cell(config_docs.flag_text(action)) in page, (sub.prog, action.option_strings)


def test_check_reports_a_stale_page_and_writing_fixes_it(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    page.write_text(PAGE.read_text().replace("`KAI_ISOLATOR_ON_BREACH`", "`KAI_ISOLATOR_ON_BREACH_OLD`"))
    out: list[str] = []
    assert config_docs.main(["--check", str(page)], out.append) == 1
    assert out == [f"out of date: {page}; regenerate it with `{config_docs.REGENERATE}`"]
    assert config_docs.main([str(page)], out.append) == 0
    assert config_docs.main(["--check", str(page)], out.append) == 0
    assert page.read_text() == PAGE.read_text()


def test_a_variable_read_in_the_code_but_not_described_stops_the_generator(tmp_path: Path) -> None:
    code = tmp_path / "services"
    code.mkdir()
    (code / "thing.py").write_text('import os\nA = os.environ.get("KAI_ISOLATOR_UNDESCRIBED")\nos.environ["WRITTEN_ONLY"] = "1"\n'
                                   + "\n".join(f'B{i} = os.environ.get("{name}")' for i, name in enumerate(config_docs.OTHER_ENV)))
    with pytest.raises(config_docs.ConfigDocsError, match="read but not described: KAI_ISOLATOR_UNDESCRIBED$"):
        config_docs.other_env_section([code], tmp_path)
    (code / "thing.py").write_text('import os\nA = os.getenv("PATH")\n')
    with pytest.raises(config_docs.ConfigDocsError, match="described but no longer read: .*NO_COLOR"):
        config_docs.other_env_section([code], tmp_path)


def test_every_variable_the_docs_mention_exists() -> None:
    known = config_docs.variable_names()
    pages = [REPO / "README.md", REPO / "deploy" / "README.md", REPO / "hami-core" / "README.md",
             *(p for p in (REPO / "docs").rglob("*.md") if "node_modules" not in p.parts)]
    unknown = {}
    for page in pages:
        for name in set(_NAME.findall(page.read_text())):
            real = any(k.startswith(name) for k in known) if name.endswith("_") else name in known
            if not real:
                unknown.setdefault(page.relative_to(REPO).as_posix(), []).append(name)
    assert not unknown, f"names no setting has (a renamed or removed variable?): {unknown}"
