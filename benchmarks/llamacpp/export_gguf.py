"""Write a synthetic agentrt model as a GGUF file for llama.cpp, straight from the seeded
generator behind `agentrt model make` / `synthetic:NAME`, one tensor at a time: nothing is written
twice, so a 65 GB model fits in /dev/shm. With `--device cpu` (the default) the values are those of
a written checkpoint (CPU integer draws); with `--device cuda` they are drawn as an in-memory build
on that GPU draws them (`synthetic:NAME` under `--device cuda`), so llama.cpp and agentrt run the
same weights on that machine, and a 65 GB model is generated in seconds instead of CPU-minutes.

llama.cpp's own converter does the naming, the per-architecture tensor changes and the metadata
(vocabulary included): the tool loads it from a llama.cpp source tree (`--llama-cpp DIR`, with
its `conversion/` package and `gguf-py/`) and feeds it lazy tensors, each generated when the
writer reaches it. The converter's file reader (`ModelBase.index_tensors`) is swapped for the
generator while it runs, so each architecture's own indexing still applies. The config.json and
tokenizer files the converter reads go into a scratch directory.

    python benchmarks/llamacpp/export_gguf.py --llama-cpp DIR --model synthetic:qwen3.5-35b-a3b \
        --tokenizer .tok/qwen3 -o /dev/shm/q35.gguf [--outtype bf16|f32] [--seed 0] [--device cuda]
        [--split-max-size 40G]

With `--split-max-size` the converter writes shards (`q35-00001-of-0000N.gguf`, ...; llama.cpp
loads them from the first), which can then live on different file systems: e.g. all but the
last on a disk and symlinked back, so that `--no-mmap` (weights copied into pinned host
buffers) fits beside them in host memory.

Prints a JSON line: the output files, their size, the tensors written, the seconds taken.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from agentrt.models import FP32_PARAMS, torch_dtype
from agentrt.models.architectures import architecture
from agentrt.models.config import ModelConfig
from agentrt.models.synthetic import (
    EXPERT_STACKS,
    INIT_STD,
    build_empty_meta,
    checkpoint_tensor,
    hf_config,
    init_value,
    mark_mxfp4,
    named_tensors,
    resolve_size,
    router_skew,
)
from agentrt.offload.config import parse_bytes
from agentrt.offload.mxfp4_rows import RowLayout, read_part, synthetic_rows
from agentrt.session.options import EXPERT_FORMATS, packed_experts

OUTTYPES = {"bf16": "MOSTLY_BF16", "f32": "ALL_F32", "f16": "MOSTLY_F16"}


def _converter(llama_cpp: Path):
    """llama.cpp's converter modules, from its source tree."""
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    sys.path.insert(0, str(llama_cpp))
    import gguf  # noqa: PLC0415 - from the tree just put on the path
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class  # noqa: PLC0415
    from conversion.base import LazyTorchTensor  # noqa: PLC0415

    return gguf, ModelBase, ModelType, get_model_architecture, get_model_class, LazyTorchTensor


def _fast_bf16(gguf):
    """`gguf.quants.quantize` with BF16 done by torch in one multi-threaded cast (round to
    nearest even, as ggml's fp32 -> bf16) instead of numpy over groups of 16 rows, which writes
    about 0.2 GB/s; every other type goes to the original."""
    import numpy as np  # noqa: PLC0415 - numpy comes with the converter

    original = gguf.quants.quantize

    def to_bytes(array: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
        return t.to(torch.bfloat16).view(torch.uint8).numpy()

    lazy = gguf.LazyNumpyTensor._wrap_fn(
        to_bytes, meta_noop=(np.uint8, lambda shape: (*shape[:-1], shape[-1] * 2))
    )

    def quantize(data, qtype):
        if qtype == gguf.GGMLQuantizationType.BF16 and isinstance(data, gguf.LazyNumpyTensor):
            return lazy(data)
        if qtype == gguf.GGMLQuantizationType.BF16:
            return to_bytes(data)
        return original(data, qtype)

    return original, quantize


def _model_dir(raw: dict, tokenizer: Path, out: Path) -> Path:
    """config.json `raw` and the tokenizer's files, where the converter reads them."""
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    for file in tokenizer.iterdir():
        if file.is_file():
            shutil.copy(file, out / file.name)
    return out


def _lazy_tensors(
    raw: dict, size: str, seed: int, lazy_cls, device: str = "cpu", packed: bool = False
) -> dict:
    """Checkpoint name -> a lazy tensor that draws its values (on `device`) when it is written.
    `packed` (gpt-oss): the routed experts as MXFP4 `_blocks` / `_scales` pairs, drawn as a
    packed expert store draws them (`synthetic_rows`)."""
    cfg = ModelConfig.from_hf(raw)
    target = torch_dtype(cfg.torch_dtype)  # (as `write_checkpoint` stores them)
    zero_centered = architecture(cfg.arch).ZERO_CENTERED_NORMS
    skew = router_skew(size)
    pairs = _PackedPairs(cfg, seed, device) if packed else None
    out = {}
    for name, meta in named_tensors(build_empty_meta(cfg)):
        if pairs is not None and name.endswith(EXPERT_STACKS):
            for suffix in ("_blocks", "_scales"):
                shape, draw = pairs.tensor(name, suffix)
                meta_t = lazy_cls.meta_with_dtype_and_shape(torch.uint8, shape)
                out[name + suffix] = lambda m=meta_t, d=draw: lazy_cls(meta=m, args=(), func=d)
            continue
        shape = tuple(checkpoint_tensor(cfg, name, meta).shape)

        dtype = torch.float32 if name.rsplit(".", 1)[-1] in FP32_PARAMS else target

        def draw(name=name, shape=tuple(meta.shape), dtype=dtype) -> torch.Tensor:
            if device == "cpu":  # fp32 draws then the cast, as `write_checkpoint`
                t = torch.empty(shape, dtype=torch.float32)
                init_value(name, t, seed, zero_centered, skew)
                return checkpoint_tensor(cfg, name, t.to(dtype)).contiguous()
            t = torch.empty(shape, dtype=dtype, device=device)  # as `build_in_memory`
            init_value(name, t, seed, zero_centered, skew)
            return checkpoint_tensor(cfg, name, t).cpu().contiguous()

        meta_t = lazy_cls.meta_with_dtype_and_shape(dtype, shape)
        out[name] = lambda m=meta_t, d=draw: lazy_cls(meta=m, args=(), func=lambda: d())
    return out


class _PackedPairs:
    """The MXFP4 `_blocks` / `_scales` of a synthetic model's routed experts, each layer's
    packed rows drawn once (the layer last drawn is kept for its other tensors), then cut into
    the checkpoint's layout (gate and up rows interleaved, as gpt-oss saves them)."""

    def __init__(self, cfg: ModelConfig, seed: int, device: str) -> None:
        self.cfg, self.seed, self.device = cfg, seed, device
        self.layout = RowLayout(cfg.hidden_size, cfg.moe_intermediate_size)
        self.last: tuple[int, torch.Tensor] | None = None

    def rows(self, layer: int) -> torch.Tensor:
        if self.last is None or self.last[0] != layer:
            self.last = None  # (one layer's rows held at a time)
            rows = synthetic_rows(
                self.layout, self.cfg.num_experts, layer, self.seed, INIT_STD, self.device
            )
            self.last = (layer, rows)
        return self.last[1]

    def tensor(self, name: str, suffix: str):
        """(shape, draw) of `name + suffix` (`name` an expert stack of the model)."""
        kind = name.rsplit(".", 1)[-1]  # gate_up_proj or down_proj
        part = self.layout.gate_up if kind == "gate_up_proj" else self.layout.down
        shape = (self.cfg.num_experts, part.rows, part.groups)
        if suffix == "_blocks":
            shape = (*shape, 16)
        layer = int(name.split(".layers.")[1].split(".")[0])
        convert = architecture(self.cfg.arch).checkpoint_layout

        def draw() -> torch.Tensor:
            codes, scales = read_part(self.rows(layer), part)
            pair = convert(kind, codes if suffix == "_blocks" else scales, packed=True)
            return pair.cpu().contiguous()

        return shape, draw


def export(
    llama_cpp: Path,
    size: str,
    tokenizer: Path,
    out: Path,
    outtype: str = "bf16",
    seed: int = 0,
    overrides: dict | None = None,
    device: str = "cpu",
    split_max_size: int = 0,
    packed: bool = False,
) -> dict:
    """Write `size` (config.json fields `overrides` changed, e.g. the vocabulary's size to
    match a tokenizer) to `out`; returns the report. `packed` (gpt-oss): the routed experts in
    MXFP4, as agentrt's packed expert store draws them (`--expert-format mxfp4`)."""
    gguf, base, model_type, get_arch, get_class, lazy_cls = _converter(llama_cpp)
    started = time.perf_counter()
    raw = hf_config(size) | (overrides or {})
    if packed:
        mark_mxfp4(raw)  # (the converter's MXFP4 path)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = _model_dir(raw, tokenizer, Path(scratch))
        cls = get_class(get_arch(raw, model_type.TEXT), mmproj=False)
        tensors = _lazy_tensors(raw, size, seed, lazy_cls, device, packed)

        def from_generator(self, remote_hf_model_id=None):  # in place of reading files
            indexed = {}
            for name, gen in tensors.items():
                if item := self.filter_tensors((name, gen)):
                    indexed[item[0]] = item[1]
            return indexed

        ftype = getattr(gguf.LlamaFileType, OUTTYPES[outtype])
        if getattr(cls, "supports_mtp_export", False):
            cls.no_mtp = True  # (synthetic models have no multi-token-prediction layers)
        reader, base.index_tensors = base.index_tensors, from_generator
        original, gguf.quants.quantize = _fast_bf16(gguf)
        try:
            with torch.inference_mode():
                cls(model_dir, ftype, out, split_max_size=split_max_size).write()
        finally:
            base.index_tensors = reader
            gguf.quants.quantize = original
    files = [out] if out.is_file() else sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
    return {
        "gguf": str(files[0]),
        "files": [str(f) for f in files],
        "bytes": sum(f.stat().st_size for f in files),
        "tensors": len(tensors),
        "model": f"synthetic:{size}",
        "seed": seed,
        "device": device,
        "experts": "mxfp4" if packed else outtype,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp source tree")
    parser.add_argument("--model", required=True, help="synthetic:NAME")
    parser.add_argument("--tokenizer", type=Path, required=True, help="HF tokenizer directory")
    parser.add_argument("-o", "--out", type=Path, required=True)
    parser.add_argument("--outtype", choices=sorted(OUTTYPES), default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vocab-size", type=int, default=None, help="override the size's vocabulary size"
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where values are drawn: cpu (as a written checkpoint) or cuda (as `synthetic:NAME`"
        " built on that GPU)",
    )
    parser.add_argument(
        "--split-max-size",
        type=parse_bytes,
        default=0,
        help="largest shard, e.g. 40G (default: one file)",
    )
    parser.add_argument(
        "--expert-format",
        choices=EXPERT_FORMATS,
        default="auto",
        help="routed experts in --outtype (model) or MXFP4 as agentrt's packed store draws them"
        " (gpt-oss only); auto: mxfp4 for gpt-oss sizes, as `bench --expert-format auto`",
    )
    args = parser.parse_args()
    if not args.model.startswith("synthetic:"):
        parser.error("--model must be synthetic:NAME")
    size = resolve_size(args.model[len("synthetic:") :])
    overrides = {"vocab_size": args.vocab_size} if args.vocab_size else None
    packed = packed_experts(args.expert_format, args.model)
    report = export(
        args.llama_cpp,
        size,
        args.tokenizer,
        args.out,
        args.outtype,
        args.seed,
        overrides,
        args.device,
        args.split_max_size,
        packed,
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
