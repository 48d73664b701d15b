"""A tiny random Hugging Face Llama checkpoint on local disk, for demos and tests (no network).

`python -m flashflex_cli.hf.tiny OUT_DIR [--model llama-tiny] [--seed 0] [--safetensors-only]` writes
config.json and model.safetensors: with transformers' LlamaForCausalLM(config).save_pretrained when
transformers is installed (a dev/test dependency), else with safetensors and a config dictionary (normal(0,
0.02) matrices, unit norms), so it needs only flashflex's own dependencies.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from ..errors import FlashflexError
from ..fileio import atomic_write_text, check_writable_dir, dumps_json
from ..model.hf_config import resolve_model
from ..model.spec import ModelSpec
from .config import hf_config
from .files import WEIGHTS
from .names import to_hf

MAX_POSITIONS = 2048


def write_with_safetensors(out: Path, spec: ModelSpec, seed: int, dtype: torch.dtype = torch.float32) -> None:
    """config.json and model.safetensors of a random `spec` model, with safetensors only."""
    from safetensors.torch import save_file

    from ..semantics.parameters import model_params

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for info in model_params(spec):
        if info.name.endswith("norm"):
            value = torch.ones(info.shape)
        else:
            value = torch.randn(info.shape, generator=generator) * 0.02
        tensors[to_hf(info.name)] = value.to(dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    atomic_write_text(out / "config.json", dumps_json(hf_config(spec, name, MAX_POSITIONS)))


def write_with_transformers(out: Path, spec: ModelSpec, seed: int) -> None:
    """The same with transformers' model class of the family (its own random initialisation), fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = hf_config(spec, "fp32", MAX_POSITIONS)
    for key in ("architectures", "torch_dtype"):
        config.pop(key, None)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config))
    model.save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashflex_cli.hf.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--model", default="llama-tiny", help="preset name or config.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--safetensors-only", action="store_true", help="do not use transformers")
    args = parser.parse_args(argv)
    try:
        out = check_writable_dir(args.out, "OUT_DIR")
        spec = resolve_model(args.model)
        use_transformers = not args.safetensors_only
        if use_transformers:
            try:
                import transformers  # noqa: F401
            except ImportError:
                use_transformers = False
        (write_with_transformers if use_transformers else write_with_safetensors)(out, spec, args.seed)
    except FlashflexError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"wrote a random {spec.name} checkpoint to {os.fspath(out)} "
          f"({'transformers' if use_transformers else 'safetensors only'})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
