"""Tables in the README and docs rendered from committed results, never typed.

A rendered block in a Markdown file is

    <!-- render eval.bench_decode eval/results/decode/bench_decode.json -->
    ...the text `render(payload)` of that program gives for that JSON...
    <!-- end render -->

(`eval._tables:dispatch` names a function other than `render`; `a.json,b.json` hands it a list.)
`python -m eval._render` rewrites every block from its JSON; `tests/test_rendered.py` fails when a block
differs from what its JSON renders to.
"""

from __future__ import annotations

import glob
import importlib
import json
import os
import re
import sys

BLOCK = re.compile(r"(<!-- render (\S+) (\S+) -->\n)(.*?)(<!-- end render -->)", re.S)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def markdown_files(root: str = ROOT) -> list[str]:
    return [os.path.join(root, "README.md"), *sorted(glob.glob(os.path.join(root, "docs", "*.md")))]


def rendered(module: str, json_path: str, root: str = ROOT) -> str:
    """The text program `module` (e.g. `eval.bench_decode`, or `eval._tables:dispatch` for a function other
    than `render`) renders for the committed JSON `json_path` (several, comma-separated: a list of them)."""
    module, _, function = module.partition(":")
    program = importlib.import_module("kvjax." + module if module.startswith("eval.") else module)
    payloads = []
    for path in json_path.split(","):
        with open(os.path.join(root, path)) as f:
            payloads.append(json.load(f))
    payload = payloads[0] if len(payloads) == 1 else payloads
    return getattr(program, function or "render")(payload).strip() + "\n"


def blocks(text: str) -> list[tuple[str, str, str]]:
    """(module, json path, current text) of each rendered block of a Markdown text."""
    return [(m.group(2), m.group(3), m.group(4)) for m in BLOCK.finditer(text)]


def rewrite(path: str, root: str = ROOT) -> bool:
    """Re-render every block of the Markdown file `path`; True when it changed."""
    with open(path) as f:
        text = f.read()
    new = BLOCK.sub(lambda m: m.group(1) + rendered(m.group(2), m.group(3), root) + m.group(5), text)
    if new != text:
        with open(path, "w") as f:
            f.write(new)
    return new != text


def main(argv=None) -> int:
    changed = [p for p in markdown_files() if os.path.exists(p) and rewrite(p)]
    print("\n".join(f"re-rendered {os.path.relpath(p, ROOT)}" for p in changed) or "every block is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
