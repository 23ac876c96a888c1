"""Rewrite the flag table in docs/commands.md from the config fields (the help text lives
there once; tests/unit/test_docs.py fails when the table is stale).

    .venv/bin/python scripts/regen_flag_table.py

The table is the run of `|` lines right after the marker line
`<!-- generated from ray_ddp/config.py; a test keeps it in sync -->`.
"""

import pathlib
import re
import sys

from ray_ddp.config.flags import render_flag_table

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "commands.md"
MARKER = re.compile(r"<!-- generated from ray_ddp/config\.py[^\n]*-->\n")


def table_span(text: str) -> tuple[int, int]:
    """Where the generated table lies in ``text``: from just after the marker line to the
    end of the `|` lines that follow it (an empty span if none follow yet)."""
    marker = MARKER.search(text)
    if marker is None:
        raise SystemExit(f"{PAGE}: no flag-table marker line (<!-- generated from ray_ddp/config.py ... -->)")
    start = end = marker.end()
    while end < len(text) and text.startswith("|", end):
        newline = text.find("\n", end)
        end = len(text) if newline == -1 else newline + 1
    return start, end


def main() -> int:
    text = PAGE.read_text()
    start, end = table_span(text)
    new = text[:start] + render_flag_table() + "\n" + text[end:]
    if new != text:
        PAGE.write_text(new)
        print(f"rewrote the flag table in {PAGE}")
    else:
        print(f"the flag table in {PAGE} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
