"""Every rendered table in the README and docs equals what its committed JSON renders to (`eval/_render.py`)."""

import os

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
