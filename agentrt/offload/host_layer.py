"""`HostLayer`: a whole decoder layer kept in host memory and run on the CPU, the `--offload layer`
baseline (what Ollama does with the layers that do not fit the GPU: attention, norms and every
expert of those layers on the CPU). Eagerly it moves the hidden rows to the host and back; inside
a captured CUDA-graph decode step it cuts the capture (`engine.cuda_graph.Pieces`) and runs the
layer as the host step between two graph pieces, through pinned buffers."""

from __future__ import annotations

import torch
from torch import nn

from agentrt.models import set_linear_backend


class HostLayer(nn.Module):
    on_host = True  # the engine keeps this layer's cache in host memory

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner.to("cpu")
        set_linear_backend(self.inner, "torch")  # Triton kernels do not run on the CPU
        self.recorder = None  # set by engine.cuda_graph while a decode step is captured
        self._io: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cache, start, captures) -> torch.Tensor:
        if x.device.type == "cuda" and x.shape[0] == 1:
            if self._io is None:  # pinned buffers exist before any capture needs them
                pinned = [torch.empty(x.shape, dtype=x.dtype, pin_memory=True) for _ in "xy"]
                self._io = (pinned[0], pinned[1], torch.empty_like(x))
            if self.recorder is not None:
                return self._captured(x, cache)
        host_start = start.cpu() if isinstance(start, torch.Tensor) else start
        return self.inner(x.to("cpu"), cache, host_start, captures).to(x.device)

    def _captured(self, x: torch.Tensor, cache) -> torch.Tensor:
        x_h, y_h, y_d = self._io
        x_h.copy_(x, non_blocking=True)
        self.recorder.cut(lambda pos: self._host_step(cache, pos))
        y_d.copy_(y_h, non_blocking=True)
        return y_d.clone()

    def _host_step(self, cache, pos: int) -> None:
        x_h, y_h, _ = self._io
        with torch.inference_mode():
            y_h.copy_(self.inner(x_h, cache, pos, ()))
