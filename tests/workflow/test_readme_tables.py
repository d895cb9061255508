"""scripts/readme_tables.py: a regenerated table replaces its README block (table and notes line) and
nothing else; a README without the title is left as it was."""
import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "readme_tables", Path(__file__).resolve().parents[2] / "scripts" / "readme_tables.py")
readme_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_tables)

NEW = ["### Main table (x)", "", "| a | b |", "|---|---|", "| 1 | 3 |", "| 2 | 4 |", "", "Accuracy: new notes."]


def test_replaces_table_and_notes_only():
    readme = ["intro", "### Main table (x)", "", "| a | b |", "|---|---|", "| 1 | 2 |", "",
              "Accuracy: old notes.", "", "Reading: stays."]
    assert readme_tables.paste(readme, NEW)
    assert readme == ["intro", *NEW, "", "Reading: stays."]


def test_missing_title_leaves_readme():
    readme = ["intro", "### Other", "| a |"]
    assert not readme_tables.paste(readme, NEW)
    assert readme == ["intro", "### Other", "| a |"]
