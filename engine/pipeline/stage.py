"""What one pipeline rank holds, and how its backward splits into input and weight gradients.

Layers are cut into S = pp * v equal stages; stage s holds layers [s L / S, (s + 1) L / S), the first
stage also the embedding and the last also the final norm, the head and the loss:

    tokens -> [embed L0 L1] -> [L2 L3] -> ... -> [L(L-2) L(L-1) head] -> loss       (S stages)

Rank r holds the v chunks (stages) r, p + r, 2p + r, ... (core/schedules, round-robin as in
Narayanan et al. 2021 section 2.2). `StageModel` puts those units in one ModuleList, so the plans that
come after the stage cut (context and expert parallel) and the data-parallel sharder apply to it as to a
whole model, and it maps its parameter names back to the full model's, so verification compares them with
the reference by name. Tensor parallel comes before the cut (it needs the embedding and the head).

`WeightGradSplit` is ZB-H1's backward split (Qi et al. 2023, section 2): every module that owns
parameters (Linear, RMSNorm, Embedding) is a matmul-like op y = f(x, W), whose backward is two
independent products, dL/dx (needed by the previous stage now) and dL/dW (needed only by the optimizer).

    BI:  autograd.grad(stage output, [stage input, y_1 .. y_k], retain_graph=True)
         -> dL/dx to send, and dL/dy_j of every parameter module j, kept. Autograd skips every edge that
         does not lead to a requested input, so no weight gradient is computed here.
    BW:  for each j: autograd.backward(y_j, dL/dy_j, inputs=W_j)
         -> dW_j only: the path from y_j to W_j is one node (e.g. MmBackward -> AccumulateGrad), so
         nothing of the input chain is recomputed; gradients accumulate into .grad (and fire the post-
         accumulate hooks the dp strategy syncs from), in the same micro-batch order as a fused backward.
         With flat ZeRO/FSDP buffers W_j is a view: its gradient is added into the buffer by hand, and
         the sharder is told (`Strategy.weight_grads_ready`).

torch.distributed.pipelining does the same split at a coarser grain (stage_backward_input captures
the gradients of the intermediate tensors that feed parameters, stage_backward_weight then calls
autograd.grad from them to the parameters); here the intermediate tensors are simply the outputs of
the parameter-owning modules, captured by forward hooks, so the model code stays unchanged.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from engine.model import LanguageModel


class StageModel(nn.Module):
    """The units of one pipeline rank's chunks, in chunk order, with the full model's names."""

    def __init__(self, full: LanguageModel, chunks: list[list[int]]):
        super().__init__()
        self.config = full.config
        self.global_units = [u for chunk in chunks for u in chunk]
        self.units = nn.ModuleList(full.units[u] for u in self.global_units)
        self.unit_names = [full.unit_names[u] for u in self.global_units]
        self.chunk_units: list[list[int]] = []  # local unit indices of each chunk
        start = 0
        for chunk in chunks:
            self.chunk_units.append(list(range(start, start + len(chunk))))
            start += len(chunk)

    def global_name(self, local_name: str) -> str:
        """`units.<local>.rest` -> `units.<global>.rest`."""
        _, local, rest = local_name.split(".", 2)
        return f"units.{self.global_units[int(local)]}.{rest}"


class WeightGradSplit:
    """Forward hooks on every parameter-owning module record (output, its parameters) while `record`
    is active; `backward_input` and `backward_weight` are ZB-H1's BI and BW (module docstring)."""

    def __init__(self, model: nn.Module):
        self._captured: list | None = None
        for module in model.modules():
            if any(True for _ in module.parameters(recurse=False)):
                module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        if self._captured is not None and torch.is_grad_enabled():
            self._captured.append((output, list(module.parameters(recurse=False))))

    @contextmanager
    def record(self):
        """Collect the parameter modules' outputs of one forward; yields the list being filled."""
        self._captured = captured = []
        try:
            yield captured
        finally:
            self._captured = None

    @staticmethod
    def backward_input(output, grad, stage_input, captured: list):
        """BI: (dL/d stage_input or None, the weight work left for BW)."""
        wanted = [stage_input] if stage_input is not None else []
        wanted += [y for y, _ in captured]
        grads = torch.autograd.grad(output, wanted, grad_outputs=grad, retain_graph=True, allow_unused=True)
        input_grad = grads[0] if stage_input is not None else None
        output_grads = grads[1:] if stage_input is not None else grads
        work = [(y, params, dy) for (y, params), dy in zip(captured, output_grads, strict=True)
                if dy is not None]
        return input_grad, work

    @staticmethod
    def backward_weight(work: list) -> list[torch.Tensor]:
        """BW: each module's weight gradient from its saved output gradient, accumulated into .grad.
        Under ZeRO/FSDP a module's weights are views of a flat buffer (engine/flat.py): their gradients
        are computed as such (the path from y_j to a view is still one node) and added into the buffer's
        .grad at the view's offset, which is where a fused backward's autograd would put them. Returns
        those buffers, whose gradient hooks autograd did not fire."""
        buffers: dict[int, torch.Tensor] = {}
        for y, params, dy in work:
            if all(p.is_leaf for p in params):
                torch.autograd.backward(y, dy, inputs=params)
                continue
            for p, g in zip(params, torch.autograd.grad(y, params, dy, allow_unused=True), strict=True):
                if g is None:
                    continue
                base = p._base
                if base.grad is None:
                    base.grad = torch.zeros_like(base)
                offset = p.storage_offset() - base.storage_offset()
                base.grad.view(-1)[offset: offset + p.numel()].add_(g.reshape(-1))
                buffers[id(base)] = base
        return list(buffers.values())
