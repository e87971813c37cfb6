"""The docs stay true: generated blocks match the code, the README stays a short front door that links every
page, every relative link resolves, and config comments say what a field does (history goes to
docs/measurements.md)."""
import re
from pathlib import Path

import pytest

from drafter.core import docs
from drafter.core.registry import ORDER

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


@pytest.mark.parametrize("rel,begin,end,make", [(rel, b, e, m) for rel, blocks in docs.BLOCKS.items()
                                                 for b, e, m in blocks], ids=lambda v: v if isinstance(v, str) else "")
def test_generated_block_is_current(rel, begin, end, make):
    assert docs.current_block(ROOT / rel, begin, end) == make().strip(), \
        f"{rel}: the block after {begin} is stale: run `.venv/bin/python -m drafter.core.docs --write`"


def test_check_mode_passes_on_the_repository():
    assert docs.stale() == []


def test_config_reference_lives_in_docs_configuration_not_the_readme():
    assert docs.BEGIN in (ROOT / "docs" / "configuration.md").read_text()
    assert docs.BEGIN not in README.read_text()
    assert "`train.draft_vocab_size`" in docs.current_block(ROOT / "docs" / "configuration.md", docs.BEGIN, docs.END)


def test_stage_table_lists_every_stage_in_pipeline_order():
    block = docs.current_block(README, docs.STAGES_BEGIN, docs.STAGES_END)
    names = re.findall(r"^\| \[`(\w+)`\]", block, re.M)
    assert names == list(ORDER)
    for line in block.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert len(cells) == 5 and all(cells), f"stage table row with an empty cell: {line}"


def test_stage_writes_come_from_the_docstrings_writes_paragraph():
    doc = """`x` stage: does x.

Inputs: ``a.json`` (never listed).
Writes: ``out.json`` (with ``key`` inside; (nested) parentheses), ``dir/`` and ``log.txt``.
Reports: ``metric``.
"""
    assert docs.stage_writes("x", doc) == ["out.json", "dir/", "log.txt"]
    assert docs.stage_writes("x", "Writes: ``a.md``. Reports: ``b``.") == ["a.md"]
    with pytest.raises(ValueError, match="no 'Writes:' paragraph"):
        docs.stage_writes("x", "Inputs: ``a``.\nReports: ``b``.")


def test_rewrite_replaces_only_the_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"head\n{docs.BEGIN}\nold\n{docs.END}\ntail\n")
    assert docs.rewrite(page, [(docs.BEGIN, docs.END, lambda: "new")])
    assert page.read_text() == f"head\n{docs.BEGIN}\nnew\n{docs.END}\ntail\n"
    assert not docs.rewrite(page, [(docs.BEGIN, docs.END, lambda: "new")])


def test_readme_states_the_two_commands_first():
    text = README.read_text()
    first = text.index("make demo")
    assert first < text.index("## ") or first < 2000
    assert "make test" in text[:3000]


def test_readme_is_a_short_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250): move detail to docs/"
    dated = [line for line in lines if DATE.search(line)]
    assert not dated, f"dated figures belong in docs/measurements.md, not the README: {dated[:3]}"


def test_every_docs_page_is_linked_from_the_readme():
    targets = {(ROOT / t.split("#")[0]).resolve() for t in LINK.findall(README.read_text())
               if not re.match(r"[a-z]+:", t) and not t.startswith("#")}
    assert {"how-it-works.md", "configuration.md", "measurements.md"} <= {p.name for p in PAGES}
    missing = [p.name for p in PAGES if p.resolve() not in targets]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links to nothing: {broken}"


def test_the_ui_screenshot_is_shown():
    assert any("ui-run-form.png" in p.read_text() for p in [README, *PAGES])


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_config_comments_say_what_a_field_does(config):
    """At most two comment lines in a row, none dated: a journal in a config fails here."""
    run, where = 0, []
    for n, line in enumerate(config.read_text().splitlines(), 1):
        run = run + 1 if line.lstrip().startswith("#") else 0
        if run > 2:
            where.append(f"{config.name}:{n}: more than 2 comment lines in a row")
        comment = line.partition(" #")[2] if not line.lstrip().startswith("#") else line
        if DATE.search(comment):
            where.append(f"{config.name}:{n}: a dated comment (history goes to docs/measurements.md)")
    assert not where, "\n".join(where)
