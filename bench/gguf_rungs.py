"""Weight rungs for the lossy ladder: the default model's GGUF rewritten with its weights in another type.

The packaged GGUF is Q4_1. Its weights are read back as float32 and written again as F16 (the ladder's
reference: the same values, unquantized), or quantized to Q8_0, Q5_1 or Q4_0 with gguf-py's quantizers (the
reference quantizers llama.cpp's own `llama-quantize` uses for these types), or with seeded Gaussian noise
planted on every matrix (``noise`` times the matrix's standard deviation). Every key of the source is kept;
`general.file_type` says the new type. Vectors (norms, biases) stay float32, as `llama-quantize` leaves them.

    python bench/gguf_rungs.py OUT_DIR            # writes f16.gguf q8_0.gguf q5_1.gguf q4_0.gguf noise.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

TYPES = {"f16": (Q.F16, LlamaFileType.MOSTLY_F16), "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
         "q5_1": (Q.Q5_1, LlamaFileType.MOSTLY_Q5_1), "q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0)}
BLOCK = 32  # the row length every type above needs a multiple of


def rewrite(src: Path, dst: Path, kind: str, noise: float = 0.0, seed: int = 0) -> Path:
    """``src`` with its matrices as ``kind`` (a key of TYPES), after planting ``noise`` (relative) if any."""
    qtype, file_type = TYPES[kind]
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue  # the writer writes the header and the architecture itself
        kind_ = field.types[0]
        sub = field.types[-1] if kind_ == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind_, sub_type=sub)
    writer.add_file_type(int(file_type))
    rng = np.random.default_rng(seed)
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        if w.ndim < 2 or w.shape[-1] % BLOCK:
            writer.add_tensor(t.name, w)
            continue
        if noise:
            w = w + rng.normal(0.0, noise * float(w.std()), w.shape).astype(np.float32)
        writer.add_tensor(t.name, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def ladder(src: Path, into: Path, noise: float = 0.05) -> dict[str, Path]:
    """The weight rungs, written once into ``into``: f16 (the reference), q8_0, q5_1, q4_0, and f16 with noise."""
    into.mkdir(parents=True, exist_ok=True)
    out = {}
    for kind in TYPES:
        out[kind] = into / f"{kind}.gguf"
        if not out[kind].exists():
            rewrite(src, out[kind], kind)
    out["noise"] = into / f"noise-{noise:g}.gguf"
    if not out["noise"].exists():
        rewrite(src, out["noise"], "f16", noise=noise)
    return out


if __name__ == "__main__":
    from gatekeeper.setup.models import find_gguf

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder for the rewritten GGUFs")
    for name, path in ladder(find_gguf(), parser.parse_args().out_dir).items():
        print(name, path, f"{path.stat().st_size / 2**20:.0f} MiB")
