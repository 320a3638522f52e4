"""Write results/mutation/summary.json from mutmut's per-file results.

Run from the repository root after ``mutmut run`` (docs/mutation.md)::

    python results/mutation/summarize.py [--triaged docs/mutation.md]

It reads ``mutants/<file>.meta`` (the exit code mutmut recorded for each mutant of
each mutated file) and maps the codes with mutmut's own ``status_by_exit_code``,
so the counts are those ``mutmut results --all true`` lists. No date or timing
goes into the file. ``--triaged``: mutants named in that file (one per line,
``<module>.<mutant>``) are counted as triaged survivors (equivalent or not worth a
test, with the reason there); the kill rate is killed / (all - not checked).
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from collections import Counter
from pathlib import Path

from mutmut.stats import status_by_exit_code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triaged", default="docs/mutation.md")
    parser.add_argument("--out", default="results/mutation/summary.json")
    args = parser.parse_args()
    cfg = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["mutmut"]
    triaged_text = Path(args.triaged).read_text() if Path(args.triaged).is_file() else ""
    triaged = set(re.findall(r"`([\w.ǁ]+__mutmut_\d+)`", triaged_text))
    modules, total = {}, Counter()
    for path in cfg["only_mutate"]:
        meta = json.loads((Path("mutants") / (path + ".meta")).read_text())
        counts = Counter(status_by_exit_code[code] for code in meta["exit_code_by_key"].values())
        survivors = [k for k, code in meta["exit_code_by_key"].items() if status_by_exit_code[code] == "survived"]
        checked = sum(counts.values()) - counts.get("not checked", 0)
        row = dict(sorted(counts.items()))
        row["total"] = sum(counts.values())
        row["kill_rate"] = round(counts.get("killed", 0) / checked, 4) if checked else None
        row["survived_triaged"] = sum(1 for k in survivors if k in triaged)
        row["survived_untriaged"] = sorted(k for k in survivors if k not in triaged)
        modules[path] = row
        total.update(counts)
    checked = sum(total.values()) - total.get("not checked", 0)
    summary = {
        "tool": "mutmut",
        "command": "mutmut run --max-children 1",
        "test_selection": cfg["pytest_add_cli_args_test_selection"],
        "modules": modules,
        "total": dict(sorted(total.items()), total=sum(total.values()),
                      kill_rate=round(total.get("killed", 0) / checked, 4) if checked else None),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")
    for path, row in modules.items():
        print(f"{path}: {row['total']} mutants, killed {row.get('killed', 0)}, survived {row.get('survived', 0)}"
              f" ({row['survived_triaged']} triaged), timeout {row.get('timeout', 0)},"
              f" no tests {row.get('no tests', 0)}, kill rate {row['kill_rate']}")


if __name__ == "__main__":
    main()
