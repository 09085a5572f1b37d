"""A GGUF model de-quantized by transformers and saved as safetensors, in a child process:
`python -m rocketkv_cli.model.convert GGUF OUT_DIR`.

`resolve._converted_dir` runs it so that the parent, waiting on the child, keeps its spinner
turning (the GGUF loader holds the GIL for tens of seconds) and gives the float32 copy's memory
back when the child ends. The child writes only into OUT_DIR (a temporary directory that the
parent renames); it exits 1 with one line on stderr when the file cannot be loaded.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path


def convert(gguf: Path, out_dir: Path) -> None:
    """Load `gguf` (transformers' GGUF reader, float32) and save model and tokenizer in `out_dir`.

    Raises:
        ValueError: the file cannot be loaded as a model (transformers raises many types; the
            message is its first line).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:  # the GGUF loader draws its own tqdm bar: the parent's spinner and line say what runs
        with contextlib.redirect_stderr(io.StringIO()):
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001  (any failure of the reader is this file's)
        raise ValueError(f"{exc}".splitlines()[0] if str(exc) else type(exc).__name__) from exc
    model.hf_quantizer = None  # type: ignore[assignment]  # the de-quantized model refuses save_pretrained while it keeps these
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m rocketkv_cli.model.convert GGUF OUT_DIR", file=sys.stderr)
        return 2
    try:
        convert(Path(argv[0]), Path(argv[1]))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
