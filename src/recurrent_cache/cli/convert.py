"""``python -m recurrent_cache convert HF_DIR OUT.gguf``: a Hugging Face Mamba / Mamba-2 checkpoint as GGUF.

The file has llama.cpp's keys, tensor names and tokenizer, so the same model —
and its state files — can be taken to llama.cpp.  A bad directory or option
is one line on stderr (``convert: ...``) and exit status 2 (the package's
other errors become that line in ``cli.main``).
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import ModelError
from ..models import convert_hf_to_gguf
from .options import USER_ERROR, OneLineParser, text

__all__ = ["EXAMPLES", "main", "parse_args"]

DESCRIPTION = ("Write a Hugging Face Mamba / Mamba-2 checkpoint directory as a GGUF file with llama.cpp's\n"
               "keys, tensor names and tokenizer, so that llama.cpp can run the model and read its states.")

EXAMPLES = """\
examples:
  python -m recurrent_cache convert ./mamba-130m-hf mamba-130m.gguf
  python -m recurrent_cache convert ./mamba2-checkpoint out.gguf --outtype f16
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options, checked: a bad value exits with one line."""
    parser = OneLineParser(prog="python -m recurrent_cache convert", description=DESCRIPTION,
                           epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir", metavar="HF_DIR", type=text("HF_DIR"),
                        help="a directory written by transformers' save_pretrained")
    parser.add_argument("out", metavar="OUT.gguf", type=text("OUT.gguf"), help="the GGUF file to write")
    parser.add_argument("--outtype", choices=["f32", "f16"], default="f32",
                        help="f16: 2-D weights in f16, as llama.cpp's converter --outtype f16 (default f32)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Convert the checkpoint directory the arguments name; the exit status."""
    options = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        model = convert_hf_to_gguf(options.hf_dir, options.out, file_type=options.outtype)
    except (ModelError, ImportError, OSError) as exc:
        print(f"convert: {exc}", file=sys.stderr)
        return USER_ERROR
    print(f"wrote {options.out} ({os.path.getsize(options.out):,} bytes): {model.hparams.describe()}")
    return 0
