"""Model zoo: one file per architecture (listed in `architectures.py`), built from `layers.py`;
`build_empty` makes an uninitialised model (no weight memory touched twice) on a device, ready
for the loader or the synthetic filler. This package never imports the engine, offload, state
cache or sessions.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from agentrt.errors import AgentrtError
from agentrt.models import layers, qwen3_5_moe
from agentrt.models.architectures import architecture
from agentrt.models.config import ModelConfig
from agentrt.models.fusion import fuse_rows
from agentrt.models.layers import CausalLM
from agentrt.models.moe import PLAIN, RoutedExperts, SwiGLU
from agentrt.models.rotary import Rotary

FP32_PARAMS = ("A_log", "dt_bias")  # kept in fp32 whatever the model dtype

# torch.nn.init's functions that module constructors call (what they write is never used here)
_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "zeros_",
    "ones_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
)
_INIT_LOCK = threading.Lock()


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_empty(
    cfg: ModelConfig,
    device: str | torch.device,
    dtype: torch.dtype,
    experts: RoutedExperts | None = None,
) -> CausalLM:
    """Allocate the model on `device` without initialising weights. Routed experts go to
    `experts` when given (e.g. views of a host expert store), else onto `device`."""
    builder = architecture(cfg.arch).build
    if experts is None:
        experts = RoutedExperts.empty(
            cfg.moe_layers,
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            device,
            dtype,
            bias=cfg.expert_bias,
            act=expert_activation(cfg),
        )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), _skipped_init():
            model = builder(cfg, experts)
    finally:
        torch.set_default_dtype(previous)
    # (`to_empty`, less its `empty_like` on meta tensors: a Python reference op loading 1 s of
    # torch's symbolic-shape machinery)
    try:
        model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and "alloc" not in str(exc):
            raise
        raise AgentrtError(
            f"not enough memory on {device} for the model's weights (vocab {cfg.vocab_size}, "
            f"hidden {cfg.hidden_size}, {cfg.num_layers} layers): {str(exc).splitlines()[0]}"
        ) from None
    if cfg.tie_word_embeddings:  # to_empty allocates separately: tie again
        model.lm_head.weight = model.embed_tokens.weight
    for name, param in model.named_parameters():
        if name.rsplit(".", 1)[-1] in FP32_PARAMS:
            param.data = param.data.float()
    _init_buffers(model, device)
    model.eval().requires_grad_(False)
    fuse_rows(model)  # (before any weight is loaded; the separate blocks go back at once)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return model


@contextmanager
def _skipped_init() -> Iterator[None]:
    """Module constructors' weight initialisation skipped (their weights are empty meta tensors
    here): on meta tensors the init functions run torch's Python reference ops, whose first use
    imports torch._dynamo, 2 s of every start on a CPU."""
    with _INIT_LOCK:
        saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(torch.nn.init, name, fn)


def expert_activation(cfg: ModelConfig) -> SwiGLU:
    """The routed experts' activation: gpt-oss's clamped SwiGLU, or the plain one."""
    return SwiGLU(cfg.swiglu_limit, cfg.swiglu_alpha) if cfg.swiglu_limit else PLAIN


def _init_buffers(model: CausalLM, device) -> None:
    for module in model.modules():
        if isinstance(module, Rotary):
            module.inv_freq = Rotary.of(model.config).inv_freq.to(device)


def set_linear_backend(model: CausalLM, backend: str) -> None:
    """Choose the kernel backend (`torch` or `fla`) of every linear-attention layer and every
    norm (`fla`: its Triton kernels for the delta rule, the causal conv and the norms)."""
    for module in model.modules():
        if isinstance(module, (qwen3_5_moe.GatedDeltaNet, layers.NormBase)):
            module.backend = backend
        if isinstance(module, layers.NormBase):
            module.clear_scale()


def copy_model(model: CausalLM, device: str | torch.device, dtype: torch.dtype) -> CausalLM:
    """An independent copy of `model` (weights and experts) on another device / dtype."""
    new = build_empty(model.config, device, dtype)
    source = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in new.named_parameters():
            param.copy_(source[name])
        for name in ("gate_up", "down", "gate_up_bias", "down_bias"):
            stacks = getattr(new.experts, name)
            for layer in stacks or {}:
                stacks[layer].copy_(getattr(model.experts, name)[layer])
    return new
