"""The README's configuration reference is generated from the config models and must be current."""
from pathlib import Path

from drafter.core.docs import BEGIN, END, reference

ROOT = Path(__file__).resolve().parents[1]


def test_readme_config_reference_is_current():
    text = (ROOT / "README.md").read_text()
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert block == reference().strip(), "README config reference is stale: run `.venv/bin/python -m drafter.core.docs --write`"


def test_readme_states_the_two_commands_first():
    text = (ROOT / "README.md").read_text()
    first = text.index("make demo")
    assert first < text.index("## ") or first < 2000
    assert "make test" in text[:3000]
