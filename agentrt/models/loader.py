"""Streaming safetensors loader with a name map.

Reads a HF-format directory (config.json + *.safetensors, sharded or not), maps checkpoint names to
our parameters (stripping `model.` / `model.language_model.`, skipping vision and MTP tensors) and
copies each tensor straight into its destination, one tensor in memory at a time. Routed experts
are accepted fused (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`, with
`_bias` tensors where the architecture has them), MXFP4-packed (`_blocks` + `_scales`, dequantized
here into the model's dtype) or per expert (`experts.{e}.gate_proj.weight` ...) and land directly
in the `RoutedExperts` stacks; an architecture with its own fused layout converts it
(`expert_layout` in its model file).
Every mistake in the directory becomes a `ModelFormatError` naming the problem.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agentrt.errors import ModelFormatError, ModelNotFoundError
from agentrt.models import build_empty
from agentrt.models.config import ModelConfig
from agentrt.models.layers import CausalLM

_FUSED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?$")
_PACKED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)$")
_PER_EXPERT = re.compile(
    r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)
_SKIP_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_PART = {"gate_proj": 0, "up_proj": 1, "down_proj": 2}


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory (via the index when there is one)."""
    if not path.exists():
        raise ModelNotFoundError(f"model directory {path} does not exist")
    if not path.is_dir():
        raise ModelFormatError(f"{path} is not a directory")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelFormatError(f"malformed {index}: {exc}") from None
        bad = [n for n in names if not isinstance(n, str) or Path(n).name != n]
        if bad:
            raise ModelFormatError(f"malformed {index}: {bad[0]!r} is no file name beside it")
        files = [path / n for n in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"no *.safetensors weights in {path}")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelFormatError(
            f"weight files listed in the index are missing: {', '.join(missing[:3])}"
        )
    return files


@dataclass
class _Progress:
    """Which destinations have been filled, to report anything the checkpoint lacks."""

    params: set[str] = field(default_factory=set)
    experts: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [E, 3] bool
    biases: set[tuple[int, str]] = field(default_factory=set)
    packed: dict[tuple[int, str], dict[str, torch.Tensor]] = field(default_factory=dict)


class WeightSink:
    """Routes checkpoint tensors to model parameters and expert stacks."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.cfg = model.config
        self.params = dict(model.named_parameters())
        self.done = _Progress()
        from agentrt.models.architectures import architecture

        self.layout = getattr(architecture(self.cfg.arch), "expert_layout", None)

    def target_name(self, name: str) -> str | None:
        """Checkpoint name -> our name, or None for tensors we deliberately ignore."""
        if name.startswith(self.cfg.weight_prefix):
            return name[len(self.cfg.weight_prefix) :]
        if name == "lm_head.weight":
            return None if self.cfg.tie_word_embeddings else name
        if name.startswith(_SKIP_PREFIXES):
            return None
        raise ModelFormatError(f"unexpected tensor {name!r} in checkpoint")

    def put(self, name: str, tensor: torch.Tensor) -> None:
        local = self.target_name(name)
        if local is None:
            return
        if m := _FUSED.match(local):
            self._put_fused(int(m[1]), m[2] + (m[3] or ""), tensor)
        elif m := _PACKED.match(local):
            self._put_packed(int(m[1]), m[2], m[3], tensor)
        elif m := _PER_EXPERT.match(local):
            self._put_expert(int(m[1]), int(m[2]), m[3], tensor)
        elif local in self.params:
            self._copy(local, self.params[local], tensor)
            self.done.params.add(local)
        else:
            raise ModelFormatError(
                f"checkpoint tensor {name!r} matches no parameter of {self.cfg.arch}"
            )

    def _copy(self, name: str, dest: torch.Tensor, src: torch.Tensor) -> None:
        if tuple(dest.shape) != tuple(src.shape):
            raise ModelFormatError(
                f"{name}: shape {tuple(src.shape)} in checkpoint, expected {tuple(dest.shape)}"
            )
        if not src.dtype.is_floating_point or src.dtype.itemsize < 2:  # (ints, complex, fp8)
            raise ModelFormatError(f"{name}: dtype {src.dtype} is not one agentrt loads")
        dest.data.copy_(src)

    def _expert_mask(self, layer: int) -> torch.Tensor:
        if layer not in self.model.experts.gate_up:
            raise ModelFormatError(f"checkpoint has experts for layer {layer}, which has none")
        return self.done.experts.setdefault(
            layer, torch.zeros(self.cfg.num_experts, 3, dtype=torch.bool)
        )

    def _put_packed(self, layer: int, kind: str, part: str, tensor: torch.Tensor) -> None:
        """Hold an MXFP4 `_blocks` / `_scales` tensor until its pair arrives, then dequantize."""
        from agentrt.models.mxfp4 import dequantize

        self._expert_mask(layer)  # (a layer without experts fails here)
        rank = 4 if part == "blocks" else 3  # [E, rows, groups(, 16)]
        if tensor.dtype != torch.uint8 or tensor.dim() != rank:
            raise ModelFormatError(
                f"layer {layer} experts.{kind}_{part}: {tensor.dim()}-d {tensor.dtype}, "
                f"expected {rank}-d uint8"
            )
        pair = self.done.packed.setdefault((layer, kind), {})
        pair[part] = tensor
        if len(pair) < 2:
            return
        del self.done.packed[(layer, kind)]
        if hasattr(self.model.experts, "put_mxfp4"):  # (experts that stay packed)
            self._put_still_packed(layer, kind, pair["blocks"], pair["scales"])
            return
        dest = self.model.experts.gate_up if kind == "gate_up_proj" else self.model.experts.down
        weights = dequantize(pair["blocks"], pair["scales"], dest[layer].dtype)
        self._put_fused(layer, kind, weights, packed=True)

    def _put_still_packed(self, layer: int, kind: str, blocks, scales) -> None:
        """An MXFP4 pair into experts that stay packed (`offload.packed_load.PackedSink`), rows
        in the architecture's order (its layout applies to codes and exponents alike)."""
        mask = self._expert_mask(layer)
        if self.layout is not None:
            blocks, scales = (self.layout(kind, t, True) for t in (blocks, scales))
        self.model.experts.put_mxfp4(layer, kind, blocks, scales)
        self._filled(layer, mask, (slice(None), [0, 1] if kind == "gate_up_proj" else [2]))

    def _filled(self, layer: int, mask: torch.Tensor, where) -> None:
        """Mark `where` of `layer`'s experts loaded; once all are, tell experts that take a
        finished layer (`PackedSink.layer_loaded`: it packs the layer and frees its stacks)."""
        mask[where] = True
        done = getattr(self.model.experts, "layer_loaded", None)
        if done is not None and bool(mask.all()):
            done(layer)

    def _put_fused(self, layer: int, kind: str, tensor: torch.Tensor, packed: bool = False) -> None:
        mask = self._expert_mask(layer)
        experts = self.model.experts
        stacks = {
            "gate_up_proj": experts.gate_up,
            "down_proj": experts.down,
            "gate_up_proj_bias": experts.gate_up_bias,
            "down_proj_bias": experts.down_bias,
        }[kind]
        if stacks is None:
            raise ModelFormatError(f"checkpoint has experts.{kind}; {self.cfg.arch} has none")
        dest = stacks[layer]
        if tensor.dim() != dest.dim():
            raise ModelFormatError(
                f"layer {layer} experts.{kind}: {tensor.dim()}-d in checkpoint, "
                f"expected {dest.dim()}-d"
            )
        if self.layout is not None:
            tensor = self.layout(kind, tensor, packed)
        elif (
            tensor.dim() == 3
            and tensor.shape[1:] == dest.shape[:0:-1]
            and tensor.shape != dest.shape
        ):
            tensor = tensor.transpose(1, 2)  # some exports store [E, in, out]
        if kind.endswith("_bias"):
            self._copy(f"layer {layer} experts.{kind}", dest, tensor)
            self.done.biases.add((layer, kind))
            return
        self._copy(f"layer {layer} experts.{kind}", dest, tensor)
        cols = [0, 1] if kind == "gate_up_proj" else [2]
        self._filled(layer, mask, (slice(None), cols))

    def _put_expert(self, layer: int, expert: int, part: str, tensor: torch.Tensor) -> None:
        mask = self._expert_mask(layer)
        if expert >= self.cfg.num_experts:
            raise ModelFormatError(f"expert index {expert} >= num_experts {self.cfg.num_experts}")
        inter = self.cfg.moe_intermediate_size
        if part == "down_proj":
            dest = self.model.experts.down[layer][expert]
        else:
            rows = slice(0, inter) if part == "gate_proj" else slice(inter, 2 * inter)
            dest = self.model.experts.gate_up[layer][expert, rows]
        self._copy(f"layer {layer} expert {expert} {part}", dest, tensor)
        self._filled(layer, mask, (expert, _PART[part]))

    def check_complete(self) -> None:
        missing = [n for n in self.params if n not in self.done.params]
        for layer in self.cfg.moe_layers:
            mask = self.done.experts.get(layer)
            if mask is None or not bool(mask.all()):
                missing.append(f"layers.{layer}.mlp.experts")
            if self.model.experts.gate_up_bias is not None:
                for kind in ("gate_up_proj_bias", "down_proj_bias"):
                    if (layer, kind) not in self.done.biases:
                        missing.append(f"layers.{layer}.mlp.experts.{kind}")
        for layer, kind in self.done.packed:
            missing.append(f"the MXFP4 pair of layers.{layer}.mlp.experts.{kind}")
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise ModelFormatError(f"checkpoint lacks {', '.join(missing[:3])}{more}")


def check_headers(files: list[Path]) -> None:
    """Parse every file's safetensors header (cheap) so corrupt files fail before loading starts."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                handle.keys()
        except (SafetensorError, OSError) as exc:
            raise ModelFormatError(f"cannot read {file.name}: {exc}") from None


def file_identity(path: Path, whole_below: int = 64 << 20, windows: int = 64) -> str:
    """Identity of a weight file: a hash of all of it when small, else of its size, first and
    last MiB and `windows` 64 KiB samples spread over it (cheap for 60 GB checkpoints; a change
    confined to unsampled bytes of a large file would go unnoticed)."""
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    h.update(str(size).encode())
    with path.open("rb") as f:
        if size <= whole_below:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
            return h.hexdigest()
        spans = [(0, 1 << 20), (size - (1 << 20), 1 << 20)]
        spans += [(size * i // (windows + 1), 1 << 16) for i in range(1, windows + 1)]
        for offset, length in spans:
            f.seek(offset)
            h.update(f.read(length))
    return h.hexdigest()


def weights_identity(path: Path) -> list[tuple[str, str]]:
    """(file name, content sample digest) of every weight file: enough to tell checkpoints apart."""
    return [(f.name, file_identity(f)) for f in checkpoint_files(path)]


def read_tensors(files: list[Path]):
    """Yield (name, tensor) from each file, one tensor at a time."""
    from safetensors import SafetensorError, safe_open

    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelFormatError(f"cannot read {file.name}: {exc}") from None


def load_model(
    path: str | Path,
    device: str | torch.device,
    dtype: torch.dtype,
    cfg: ModelConfig | None = None,
    experts=None,
):
    """Load a HF-format model directory onto `device` in `dtype` (routed experts into `experts`,
    e.g. a host store, when given: they never pass through the device)."""
    path = Path(path)
    files = checkpoint_files(path)
    cfg = cfg or ModelConfig.from_hf(path)
    model = build_empty(cfg, device, dtype, experts)
    sink = WeightSink(model)
    for name, tensor in read_tensors(files):
        sink.put(name, tensor)
    sink.check_complete()
    return model
