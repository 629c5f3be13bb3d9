"""Tables in the README and docs rendered from committed results, never typed.

A rendered block in a Markdown file is

    <!-- render eval.bench_decode results/decode/bench_decode.json -->
    ...the text `render(payload)` of that program gives for that JSON...
    <!-- end render -->

(`eval.lib.tables:dispatch` names a function other than `render`; `a.json,b.json` hands it a list.)
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
    """The text program `module` (e.g. `eval.bench_decode`, or `eval.lib.tables:dispatch` for a function other
    than `render`) renders for the committed JSON `json_path` (several, comma-separated: a list of them)."""
    module, _, function = module.partition(":")
    program = importlib.import_module("kvjax." + module if module.startswith("eval.") else module)
    payloads = []
    for path in json_path.split(","):
        with open(os.path.join(root, path)) as f:
            payloads.append(json.load(f))
    payload = payloads[0] if len(payloads) == 1 else payloads
    text = getattr(program, function or "render")(payload).strip() + "\n"
    if (module + (":" + function if function else "")) in SPEED:
        note = load_note(payload)
        text += "\n" + note if note else ""
    return text


# Render programs whose tables show speed (seconds, tokens/s, bytes/s). Under a speed table measured with the
# machine shared (a 1-minute load above QUIET_LOAD when the run started) or with no load recorded, `rendered`
# adds a line that says so; tests/test_rendered.py fails on a program whose JSON holds timings and that is in
# neither set. Accuracy tables that only record their own run's seconds are in NOT_SPEED.
QUIET_LOAD = 1.5
QUIET_OTHERS = 0.1  # cores other processes may take on average during a quiet run (`others_cpu`)
SPEED = {
    "eval.demo", "eval.bench_decode", "eval.bench_decode:render_model", "eval.lib.tables:suite_times",
    "eval.lib.tables:cacheclip",
    "eval.lib.tables:compile_times",
    "eval.lib.tables:attention", "eval.lib.tables:attention_stages", "eval.bench_locret_labels",
    "eval.lib.tables:policies", "eval.lib.tables:policies_by_page_dtype", "eval.lib.tables:selection_speed",
    "eval.lib.tables:byte_bound", "eval.compare:device_against_host", "eval.bench_jenga_engine:render_speed",
    "eval.lib.tables:serving_load", "eval.bench_load:interleave_table", "eval.lib.tables:dispatch",
    "eval.bench_saved_state", "eval.bench_tests",
}
NOT_SPEED = {  # their JSON records seconds the table does not show, or shows a wall time that is no speed claim
    "eval.sweep:headline_table", "eval.sweep:selection_headline", "eval.lib.tables:aux_recall",
    "eval.bench_serving:markdown_table", "eval.lib.tables:jenga_waste",  # a replayed trace: steps, not seconds
    "eval.lib.tables:locret_quality", "eval.sweep:accuracy_table", "eval.lib.tables:locret_kvzip_training",
    "eval.lib.tables:locret_memory", "eval.perplexity:perplexity_table", "eval.quest_adaptive:table",
    "eval.sweep:accuracy_table_with_load", "eval.lib.selection_aim", "eval.bench_tests:ci_runs",
    # accuracy, memory and step counts only: runs whose seconds were taken on shared cores render without them
    "eval.lib.tables:cacheclip_by_ratio", "eval.lib.tables:cacheclip_at_20", "eval.lib.tables:cacheclip_accuracy",
    "eval.lib.tables:retired_engine", "eval.bench_locret_labels:render_memory",
    "eval.bench_jenga_engine", "eval.bench_load:soak_table",  # rows held and pages: counts, no seconds shown
}


def start_load(payload) -> float | None:
    """The 1-minute load average a run recorded at its start; for several runs the highest, and None when any
    recorded none."""
    loads = []
    for run in payload if isinstance(payload, list) else [payload]:
        found = [run[key][0] for key in ("cpu_load_before", "load_before", "load_start")
                 if isinstance(run.get(key), list) and run[key]]
        for key in ("before", "start"):  # bench_decode's {"before", "after"}, the suite's {"start", "end"}
            if isinstance(run.get("load"), dict) and run["load"].get(key):
                found.insert(0, run["load"][key][0])
        if not found:
            return None
        loads.append(found[0])
    return max(loads)


def others_cores(payload) -> float | None:
    """The most cores other processes took on average during the run (`others_cpu`, eval/lib/report.py), over
    several runs the highest; None when any run did not record it."""
    cores = [(run.get("others_cpu") or {}).get("cores") for run in (payload if isinstance(payload, list) else [payload])]
    return None if None in cores else max(cores)


def load_note(payload) -> str:
    """The line under a speed table that was not measured quiet ('' for a quiet one). Where the run recorded
    the CPU time other processes took while it ran, that decides (at most QUIET_OTHERS cores on average):
    it sees the whole run, where the 1-minute load at the start still carries a finished program's tail."""
    others = others_cores(payload)
    if others is not None:
        if others <= QUIET_OTHERS:
            return ""
        return (f"*Measured with other work on the cores ({others:g} cores on average besides this run, above "
                f"{QUIET_OTHERS:g}): its speed figures are not a quiet measurement.*\n")
    load = start_load(payload)
    if load is None:
        return "*This run recorded no load: its speed figures may come from a shared machine.*\n"
    if load > QUIET_LOAD:
        return (f"*Measured with the machine shared (1-minute load {load:g} at the start, above {QUIET_LOAD:g}): "
                "its speed figures are not a quiet measurement.*\n")
    return ""


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
