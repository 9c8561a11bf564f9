"""The common ending of every bench script: the table, its headline, the run time, the JSON."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Callable


def finish(show_table: Callable[[], None], headline: list[str], elapsed_s: float, json_path: Path,
           result: dict) -> None:
    """Show the table, print ``headline``, write ``result`` (plus run facts) to ``json_path``."""
    show_table()
    print()
    for line in headline:
        print(line)
    print(f"total benchmark time: {elapsed_s:.1f} s")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    result = dict(result, python=platform.python_version(), machine=platform.machine(),
                  total_s=elapsed_s, headline=headline)
    json_path.write_text(json.dumps(result, indent=1))
    print(f"wrote {json_path}")
