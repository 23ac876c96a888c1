"""Rewrite the README's flag table from ray_ddp/config.py (the help text lives there once).

    .venv/bin/python scripts/regen_flag_table.py
"""

import pathlib
import re

from ray_ddp.config import render_flag_table

readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
text = readme.read_text()
marker = re.search(r"<!-- generated from ray_ddp/config\.py[^\n]*\n", text)
start = marker.end()
end = text.index("\n\n", start)
readme.write_text(text[:start] + render_flag_table() + text[end:])
