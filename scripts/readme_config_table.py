"""Rewrite the configuration table in README.md from probe_mtp.ProbeConfig (run after changing a knob)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from probe_mtp.config import config_table

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCK = re.compile(r"(<!-- config-table -->\n).*?(<!-- /config-table -->)", re.S)


def main() -> int:
    text = README.read_text(encoding="utf-8")
    if not BLOCK.search(text):
        print("README.md has no <!-- config-table --> block", file=sys.stderr)
        return 1
    README.write_text(BLOCK.sub(lambda m: m.group(1) + config_table() + "\n" + m.group(2), text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
