"""A Mamba-2 block (Dao & Gu 2024, "Transformers are SSMs", arXiv 2405.21060), small and readable.

    u[B, T, D] -> z, x, B, C, dt  (five input projections; the paper fuses them into one in_proj)
    x, B, C    -> causal depthwise conv of width w, then SiLU                          (sec. 7.1)
    dt         -> softplus(dt + dt_bias);  a_t = exp(dt_t A), A = -exp(A_log) < 0, one per head
    per head:    h_t = a_t h_{t-1} + dt_t x_t B_t^T        h [P, N]: P channels x N state   (eq. 1-2)
                 y_t = h_t C_t + D x_t
    y          -> gated RMSNorm, norm(y * silu(z)) over each group's channels -> out_proj -> [B, T, D]

Heads: the inner width E*D splits into H heads of P channels; B and C are shared by a group of H/G heads
(G = ssm_groups, "ngroups"), which is what lets tensor parallel split the block by heads with whole
groups per rank (sec. 8). A layer of a Mamba-2 model is RMSNorm -> this mixer -> residual, no MLP
(engine/model.py's MambaBlock).

The scan is the chunked SSD algorithm (sec. 6): the sequence is cut into chunks of Q positions; inside a
chunk the output is a masked matmul (a small attention-like Q x Q block per head); between chunks only
the H x P x N state is carried, so the work is linear in the sequence. `sequential_scan` is the
recurrence itself, one position at a time: the definition the chunked form is tested against.

One hook lets a strategy drive the unchanged module: `mix(x, B, C, dt) -> y` (conv and scan, the only
part that mixes positions); context parallel replaces it (engine/ssm_cp.py) using the pieces below.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


def causal_conv(x, weight, bias, halo=None):
    """x[B, T, C] -> SiLU(depthwise causal conv)[B, T, C]; weight[C, w], bias[C]. `halo`[B, w-1, C] holds the
    inputs of the w-1 positions before x (from the previous slice of the sequence); None: zeros."""
    w = weight.shape[1]
    if halo is None:
        halo = x.new_zeros(x.shape[0], w - 1, x.shape[2])
    padded = torch.cat((halo, x), dim=1).transpose(1, 2)  # [B, C, w - 1 + T]
    return F.silu(F.conv1d(padded, weight[:, None, :], bias, groups=x.shape[2]).transpose(1, 2))


def ssd_scan(x, log_a, b, c, chunk: int):
    """The chunked SSD scan from a zero state. x[B, T, H, P] (already times dt), log_a[B, T, H] (dt * A),
    b and c [B, T, H, N]. Returns y[B, T, H, P] (without the D skip) and the final state h[B, H, P, N]."""
    bs, t, nh, p = x.shape
    n, k = b.shape[-1], t // chunk
    x, log_a = x.reshape(bs, k, chunk, nh, p), log_a.reshape(bs, k, chunk, nh)
    b, c = b.reshape(bs, k, chunk, nh, n), c.reshape(bs, k, chunk, nh, n)
    cum = log_a.cumsum(dim=2)  # log of a_1 ... a_t from the chunk's start
    # Inside a chunk: y_t = sum_{s <= t} (C_t . B_s) exp(cum_t - cum_s) x_s (the masked "attention" block).
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    gap = (cum[:, :, :, None, :] - cum[:, :, None, :, :]).masked_fill(~causal[:, :, None], -math.inf)
    scores = torch.einsum("bkthn,bkshn->bktsh", c, b) * gap.exp()
    y = torch.einsum("bktsh,bkshp->bkthp", scores, x)
    # Each chunk's own state at its end, from zero: sum_s exp(cum_end - cum_s) x_s B_s^T.
    to_end = (cum[:, :, -1:, :] - cum).exp()
    states = torch.einsum("bksh,bkshp,bkshn->bkhpn", to_end, x, b)
    # Between chunks, only the state is carried: h_k = a(chunk k) h_{k-1} + states_k.
    chunk_decay = cum[:, :, -1].exp()  # [B, k, H]
    h = x.new_zeros(bs, nh, p, n)
    entering = []
    for i in range(k):
        entering.append(h)
        h = chunk_decay[:, i, :, None, None] * h + states[:, i]
    y = y + torch.einsum("bkthn,bkhpn,bkth->bkthp", c, torch.stack(entering, dim=1), cum.exp())
    return y.reshape(bs, t, nh, p), h


def state_output(log_a, c, h0):
    """What a state h0[B, H, P, N] entering a slice adds to its outputs: y_t = exp(log_a_1 + ... + log_a_t)
    h0 C_t, y[B, T, H, P]. The state reaches the slice's end as slice_decay(log_a) h0."""
    return torch.einsum("bthn,bhpn,bth->bthp", c, h0, log_a.cumsum(dim=1).exp())


def slice_decay(log_a):
    """exp(sum_t log_a_t) [B, H]: how much of a state entering a slice is left at its end."""
    return log_a.sum(dim=1).exp()


def sequential_scan(x, log_a, b, c, h0=None):
    """The recurrence one position at a time (eq. 1-2): the definition `ssd_scan` must match."""
    bs, t, nh, p = x.shape
    h = x.new_zeros(bs, nh, p, b.shape[-1]) if h0 is None else h0
    ys = []
    for i in range(t):
        h = log_a[:, i, :, None, None].exp() * h + x[:, i, :, :, None] * b[:, i, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, c[:, i]))
    return torch.stack(ys, dim=1), h


class CausalConv(nn.Module):
    """Depthwise causal conv parameters: weight[C, w], bias[C] (the scan inputs x, B, C have one each). Zero
    until `init_mamba_` draws them: never the allocator's leftover bytes, whose denormals had made one
    calibration's Mamba backward 3-5x slower than the engine's."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, width))
        self.bias = nn.Parameter(torch.zeros(channels))


class GatedRMSNorm(nn.Module):
    """norm(y * silu(z)) * weight, the RMS taken over each group's channels (Mamba-2's grouped norm: with
    whole groups on a rank, tensor parallel needs no communication for it)."""

    def __init__(self, channels: int, groups: int, eps: float = 1e-6):
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(channels))

    def forward(self, y, z):
        g = y * F.silu(z)
        shape = g.shape
        g = g.reshape(*shape[:-1], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return g.reshape(shape) * self.weight


class Mamba2(nn.Module):
    def __init__(self, m: ModelConfig):
        super().__init__()
        d, di, gn = m.hidden, m.ssm_inner, m.ssm_groups * m.ssm_state
        self.heads, self.groups, self.head_dim, self.chunk = m.ssm_heads, m.ssm_groups, m.ssm_head_dim, m.ssm_chunk
        self.in_z = nn.Linear(d, di, bias=False)
        self.in_x = nn.Linear(d, di, bias=False)
        self.in_b = nn.Linear(d, gn, bias=False)
        self.in_c = nn.Linear(d, gn, bias=False)
        self.in_dt = nn.Linear(d, m.ssm_heads, bias=False)
        self.conv_x = CausalConv(di, m.conv_width)
        self.conv_b = CausalConv(gn, m.conv_width)
        self.conv_c = CausalConv(gn, m.conv_width)
        self.dt_bias = nn.Parameter(torch.zeros(m.ssm_heads))
        self.A_log = nn.Parameter(torch.zeros(m.ssm_heads))
        self.D = nn.Parameter(torch.ones(m.ssm_heads))
        self.out_norm = GatedRMSNorm(di, m.ssm_groups)
        self.out_proj = nn.Linear(di, d, bias=False)

    def forward(self, u):
        y = self.mix(self.in_x(u), self.in_b(u), self.in_c(u), self.in_dt(u))
        return self.out_proj(self.out_norm(y, self.in_z(u)))

    def mix(self, x, b, c, dt):
        """x[B, T, H P], b and c [B, T, G N], dt[B, T, H] -> y[B, T, H P]: conv, then the scan."""
        y, _, _, x_h, _ = conv_scan(x, b, c, dt, self.convs(), self.dt_bias, self.A_log, self.groups, self.chunk)
        return skip(y, x_h, self.D)

    def convs(self) -> tuple:
        """((weight, bias) of the conv over x, over B, over C)."""
        return tuple((conv.weight, conv.bias) for conv in (self.conv_x, self.conv_b, self.conv_c))


def conv_scan(x, b, c, dt, convs, dt_bias, a_log, groups: int, chunk: int, halos=(None, None, None)):
    """The part of a Mamba-2 layer that mixes positions, from a zero state: the causal convs over x, B and C
    (`convs`: their (weight, bias); `halos`: the inputs just before x where it continues a previous slice),
    the scan's inputs and the chunked scan. Returns (y from a zero state [B, T, H, P] without the D skip,
    dt A, C per head, x per head, the final state [B, H, P, N]): a context-parallel slice corrects y with the
    state entering it (`state_output`) and passes the final state on."""
    xs, bs, cs = (causal_conv(t, w, bias, halo) for t, (w, bias), halo in zip((x, b, c), convs, halos, strict=True))
    x_dt, log_a, b_h, c_h, x_h = scan_inputs(xs, bs, cs, dt, dt_bias, a_log, groups)
    y, final = ssd_scan(x_dt, log_a, b_h, c_h, chunk)
    return y, log_a, c_h, x_h, final


def scan_inputs(x, b, c, dt, dt_bias, a_log, groups: int):
    """Conv outputs x[B, T, H P], b and c [B, T, G N], raw dt[B, T, H] -> the scan's inputs: x dt and x
    [B, T, H, P], dt A [B, T, H], B and C per head [B, T, H, N] (a group's B, C serve its H/G heads)."""
    bs, t = x.shape[:2]
    heads = dt_bias.shape[0]
    dt = F.softplus(dt + dt_bias)
    x = x.reshape(bs, t, heads, -1)
    b = b.reshape(bs, t, groups, -1).repeat_interleave(heads // groups, dim=2)
    c = c.reshape(bs, t, groups, -1).repeat_interleave(heads // groups, dim=2)
    return x * dt[..., None], dt * -a_log.exp(), b, c, x


def skip(y, x, d):
    """y + D x per head, flattened back to [B, T, H P]."""
    return (y + x * d[:, None]).flatten(2)


def init_mamba_(model: nn.Module) -> None:
    """Mamba-2's own initialisation for the parameters a plain normal(0, 0.02) would break: A in [-16, -1]
    per head, dt between 1e-3 and 1e-1 after the softplus (log-spaced across heads, as the reference's
    random draw spreads them), D = 1, conv weights normal with standard deviation 1/sqrt(w) (PyTorch's
    Conv1d draws uniform within +-1/sqrt(w)), biases zero. Deterministic given the generator's state."""
    for module in model.modules():
        if isinstance(module, Mamba2):
            h = module.heads
            with torch.no_grad():
                module.A_log.copy_(torch.linspace(1.0, 16.0, h).log())
                dt = torch.logspace(-3, -1, h)
                module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
                module.D.fill_(1.0)
        if isinstance(module, CausalConv):
            with torch.no_grad():
                module.weight.normal_(0.0, module.weight.shape[1] ** -0.5)
                module.bias.zero_()
