"""Every rendered table in the README and docs equals what its committed JSON renders to (`eval/_render.py`)."""

import json
import os
import re

import pytest

from kvjax.eval import _render

FILES = [p for p in _render.markdown_files() if os.path.exists(p)]
BLOCKS = [(os.path.relpath(path, _render.ROOT), module, json_path, text)
          for path in FILES for module, json_path, text in _render.blocks(open(path).read())]


def test_the_readme_has_rendered_blocks():
    assert any(path == "README.md" for path, *_ in BLOCKS)


@pytest.mark.parametrize("path, module, json_path, text", BLOCKS, ids=[f"{b[0]}:{b[2]}" for b in BLOCKS])
def test_block_equals_its_json_rendered(path, module, json_path, text):
    assert text == _render.rendered(module, json_path), (
        f"{path}: the block from {json_path} differs from its JSON; run `python -m eval._render`")


def test_a_changed_figure_is_caught(tmp_path):
    readme = tmp_path / "README.md"
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "x.json").write_text('{"value": 3}')
    import sys
    import types

    module = types.ModuleType("fake_render_program")
    module.render = lambda payload: f"value {payload['value']}"
    sys.modules["fake_render_program"] = module
    readme.write_text("<!-- render fake_render_program r/x.json -->\nvalue 4\n<!-- end render -->\n")
    (_, json_path, text), = _render.blocks(readme.read_text())
    assert text != _render.rendered("fake_render_program", json_path, str(tmp_path))
    assert _render.rewrite(str(readme), str(tmp_path))
    (_, json_path, text), = _render.blocks(readme.read_text())
    assert text == _render.rendered("fake_render_program", json_path, str(tmp_path)) == "value 3\n"


def _result_folders() -> set[str]:
    root = os.path.join(_render.ROOT, "results")
    return {os.path.relpath(folder, root) for folder, _, names in os.walk(root)
            if any(n.endswith(".json") for n in names)}


def test_every_results_folder_names_its_command():
    """results/README.md lists every folder holding a JSON (a row may name several, or a parent
    row cover its subfolders, e.g. `suite/run-a`)."""
    index = open(os.path.join(_render.ROOT, "results", "README.md")).read()
    named = set(re.findall(r"`([\w./-]+)`", index))
    missing = sorted(f for f in _result_folders()
                     if not any(f == n or f.startswith(n + "/") for n in named))
    assert not missing, f"results/README.md gives no command for: {missing}"


def test_committed_results_carry_no_absolute_machine_path():
    root = os.path.join(_render.ROOT, "results")
    pattern = re.compile(r'"(/(?:root|work|home|tmp|Users)/[^"]*)"')
    found = []
    for folder, _, names in os.walk(root):
        for name in names:
            if name.endswith((".json", ".jsonl", ".md")):
                with open(os.path.join(folder, name), errors="replace") as f:
                    found += [(os.path.relpath(os.path.join(folder, name), root), m) for m in pattern.findall(f.read())]
    assert not found, found[:5]


def test_every_written_result_records_the_load(tmp_path):
    from kvjax.eval.lib.report import write_outputs

    payload = {"rows": []}
    paths = write_outputs(str(tmp_path), "x", payload, "| a |\n|---|\n")
    recorded = json.load(open(paths["json"]))
    assert "cpu_load_before" in recorded and "cpu_load_after" in recorded
    assert recorded["others_cpu"]["cores"] >= 0 and recorded["others_cpu"]["wall_s"] >= 0  # other processes' CPU
    assert "Load average before/after" in open(paths["md"]).read()


_TIMING_KEY = re.compile(r'"\w*(tokens_per_s|gbps|_ms|step_s|ttft_s|itl_s|compile_s|warm_s|cold_s|prefill_s|run_s)"')


def test_every_table_with_timings_is_sorted_as_speed_or_not():
    """A rendered program whose JSON holds timings is in `_render.SPEED` (its table then says when it was not
    measured quiet) or in `_render.NOT_SPEED`: a new speed table cannot skip the note by being unlisted."""
    unsorted = sorted({module for _, module, json_path, _ in BLOCKS
                       if module not in _render.SPEED | _render.NOT_SPEED
                       and any(_TIMING_KEY.search(open(os.path.join(_render.ROOT, p)).read())
                               for p in json_path.split(","))})
    assert not unsorted, f"add these render programs to _render.SPEED or _render.NOT_SPEED: {unsorted}"


SPEED_BLOCKS = [b for b in BLOCKS if b[1] in _render.SPEED]


@pytest.mark.parametrize("path, module, json_path, text", SPEED_BLOCKS, ids=[f"{b[0]}:{b[2]}" for b in SPEED_BLOCKS])
def test_every_speed_table_was_measured_quiet(path, module, json_path, text):
    """Issue 49: every speed table in the README and docs comes from a run that recorded its load and ran with
    nothing else on the cores (`_render.load_note` empty); a table whose run was shared is re-run quiet, or
    shows no seconds (its render program then in NOT_SPEED)."""
    payloads = [json.load(open(os.path.join(_render.ROOT, p))) for p in json_path.split(",")]
    note = _render.load_note(payloads[0] if len(payloads) == 1 else payloads)
    assert not note, f"{path}: the speed table from {json_path} was not measured quiet: {note.strip()}"


@pytest.mark.parametrize("payload, note", [
    ({"cpu_load_before": [0.3, 1, 1]}, ""), ({"cpu_load_before": [12.9, 8, 6]}, "shared"), ({}, "no load"),
    # the CPU other processes took during the run decides where it was recorded, whatever the load at the start
    ({"cpu_load_before": [1.8, 2, 2], "others_cpu": {"cores": 0.02, "wall_s": 60}}, ""),
    ({"cpu_load_before": [0.3, 1, 1], "others_cpu": {"cores": 1.3, "wall_s": 60}}, "other work")])
def test_a_speed_table_not_measured_quiet_says_so(tmp_path, payload, note):
    import sys
    import types

    module = types.ModuleType("fake_speed_program")
    module.render = lambda payload: "| tok/s |\n|---|\n| 9 |"
    sys.modules["fake_speed_program"] = module
    (tmp_path / "x.json").write_text(json.dumps(payload))
    _render.SPEED.add("fake_speed_program")
    try:
        text = _render.rendered("fake_speed_program", "x.json", str(tmp_path))
    finally:
        _render.SPEED.discard("fake_speed_program")
    assert (note in text) if note else text == "| tok/s |\n|---|\n| 9 |\n"
