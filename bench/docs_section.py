"""Each benchmark owns one marked section of docs/BENCHMARKS.md and rewrites only that."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"
HEADER = "# Benchmarks\n\nNumbers written by the scripts in bench/; each owns its marked section.\n"


def write_section(name: str, text: str, docs: Path = DOCS) -> None:
    """Replace the text between `<!-- name:start -->` and `<!-- name:end -->`, appending the section if new."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start}\n{text}\n{end}"
    current = docs.read_text() if docs.exists() else HEADER
    if start in current and end in current:
        before, rest = current.split(start, 1)
        updated = before + section + rest.split(end, 1)[1]
    else:
        updated = current.rstrip("\n") + "\n\n" + section + "\n"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(updated)
