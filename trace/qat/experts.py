"""The QAT experts' forward: two implementations of one computation, chosen by `QATRuntime.experts`.

Both take hidden_states [N, H], top_k_index [N, k] and top_k_weights [N, k] and run the same FP4 sites: the
gate/up input per token (site "moe_in", one call on [N, H]), the down input per (token, slot) (site
"moe_down_in", one call on [N, k, I], the layout the guidance runtime addresses by token and slot), and the
experts' weights fake-quantized once per forward, all experts at once ([E, 2I, H] and [E, H, I]).

* `loop_experts`: the reference. A one-hot mask [E, k, N], then per hit expert an index, a GEMM, an
  `index_put` into [N, k, I] and later an `index_add_`. A Python loop over experts: launch-bound on a GPU.
* `grouped_experts`: the (token, slot) pairs sorted by expert once per layer (a stable sort of the slot-major
  flat index, so each expert's rows come in the loop's order), the gate/up and down projections as grouped GEMMs
  over the sorted rows (`torch._grouped_mm` where it runs with its backward: CUDA, BF16, sm80+; else one GEMM per
  contiguous segment of the sorted rows), the down input moved to the [N, k, I] layout and back by one gather
  each way, and the weighted rows added into the output by one `index_add_` in sorted order.

On the CPU the two are bit-identical in the forward (the same GEMMs on the same rows, the same summation order
per token: experts ascending), so every FP4 code, scale and replay statistic is too; in the backward the input's
gradient sums a token's slots (and autograd then adds the router's and a shared expert's part) in another order,
so the gradients below a layer agree within float tolerance. torch 2.13's CPU `_grouped_mm` gives the per-segment GEMMs' values, but
its backward fails on an expert that got no rows, so the CPU takes the segment loop.

"auto" picks grouped on a GPU, where it removes the per-expert launches, and the loop on the CPU: there the loop
is the reference the committed CPU runs were made with (a token's input gradient summed in another order moves a
CPU run's trajectory), and grouped gained 1.05-1.11x at most in FP4 (DESIGN.md §4, "The experts' forward").
Compared against: tests/qat/test_experts.py (every family and arm, loop vs grouped: values, gradients, codes,
replay statistics; the GPU test there at a small flavor).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

PATHS = ("auto", "loop", "grouped")


def resolve(path: str, device: torch.device) -> str:
    """The implementation `path` ("auto", "loop" or "grouped") stands for on `device`."""
    if path not in PATHS:
        raise ValueError(f"experts path must be one of {PATHS}, got {path!r}")
    if path == "auto":
        return "grouped" if torch.device(device).type == "cuda" else "loop"
    return path


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a GEMM on t runs in: autocast's where it is on for t's device, else t's own."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


def _expert_mlp(act_fn, x: torch.Tensor, w_gu: torch.Tensor) -> torch.Tensor:
    """x [n_e, H], w_gu [2I, H] (gate rows, then up rows) -> act_fn(gate) * up [n_e, I]."""
    gate, up = F.linear(x, w_gu).chunk(2, dim=-1)
    return act_fn(gate) * up


# ----------------------------------------------------------------------------------------------
# The reference: a loop over experts
# ----------------------------------------------------------------------------------------------
def loop_experts(self, rt, hidden_states, top_k_index, top_k_weights):
    """Eager expert loop with FP4 sites (rt: the model's QATRuntime). In bf16 mode the same loop without FP4
    (bit-identical to transformers' loop, forward and gradients)."""
    layer = self._trace_layer
    n, k = top_k_index.shape
    x = rt.act(layer, "moe_in", hidden_states) if rt.acts else hidden_states  # [N, H] per token
    # per-expert views through one unbind: its backward stacks the experts' gradients once, where indexing
    # w[e] would build a zero gradient of the whole [E, ...] weight for every expert the batch hit
    w_gu = rt.weight(self.gate_up_proj).unbind(0)  # E x [2I, H]
    w_d = rt.weight(self.down_proj).unbind(0)  # E x [H, I]
    inter = w_d[0].shape[-1]
    mask = F.one_hot(top_k_index, self.num_experts).permute(2, 1, 0)  # [E, k, N]
    hit = (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
    pairs, h_all = {}, None
    recompute = rt.recompute_experts and torch.is_grad_enabled()
    for e in hit:
        slot, tok = torch.where(mask[e])
        if recompute:
            # autograd keeps the GEMM's two inputs as it reads them: cast here as autocast would cast them inside
            # (same values), so neither the fp32 rows nor the fake-quantized fp32 weight is kept for the recompute
            xe, w = x[tok], w_gu[e]
            cdt = _compute_dtype(w)
            h = checkpoint(_expert_mlp, self.act_fn, xe.to(cdt), w.to(cdt), use_reentrant=False)
        else:
            h = _expert_mlp(self.act_fn, x[tok], w_gu[e])  # [n_e, I] (bf16 under autocast)
        if h_all is None:
            h_all = h.new_zeros(n, k, inter)  # [N, k, I]: the down input per (token, slot)
        h_all = h_all.index_put((tok, slot), h)
        pairs[e] = (slot, tok)
    if h_all is None:
        return torch.zeros_like(hidden_states)
    if rt.acts:
        h_all = rt.act(layer, "moe_down_in", h_all)
    out = torch.zeros_like(hidden_states)
    for e, (slot, tok) in pairs.items():
        y = F.linear(h_all[tok, slot], w_d[e]) * top_k_weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


# ----------------------------------------------------------------------------------------------
# Grouped: sorted rows, grouped GEMMs
# ----------------------------------------------------------------------------------------------
def _grouped_mm_runs(x: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` (forward and backward, empty groups included) takes rows of x's device and
    dtype: CUDA sm80+ in BF16."""
    return (x.device.type == "cuda" and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (8, 0))


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
    """x [S, K] rows sorted by expert, w [E, M, K] (nn.Linear orientation, x's dtype), offs [E] int32 the segments'
    ends, sizes the segments' lengths on the host (None where `torch._grouped_mm` runs: no host sync) -> [S, M],
    row r = x[r] @ w[e(r)].T."""
    if sizes is None:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    ws = w.unbind(0)  # one stack of the experts' gradients in the backward
    segs = [F.linear(s, ws[e]) for e, s in enumerate(x.split(sizes)) if sizes[e]]
    return torch.cat(segs) if segs else x.new_zeros(0, w.shape[1])


def _grouped_mlp(act_fn, xs: torch.Tensor, w_gu: torch.Tensor, offs: torch.Tensor, sizes) -> torch.Tensor:
    gate, up = grouped_linear(xs, w_gu, offs, sizes).chunk(2, dim=-1)
    return act_fn(gate) * up


def grouped_experts(self, rt, hidden_states, top_k_index, top_k_weights):
    """The loop's computation over the (token, slot) pairs sorted by expert (module docstring)."""
    layer = self._trace_layer
    n, k = top_k_index.shape
    if n == 0:
        return torch.zeros_like(hidden_states)
    x = rt.act(layer, "moe_in", hidden_states) if rt.acts else hidden_states  # [N, H] per token
    # the sort: slot-major flat index j = slot * N + token, stable, so an expert's rows are in the loop's order
    with torch.no_grad():
        flat = top_k_index.t().reshape(-1)  # [S = k N]
        order = torch.sort(flat, stable=True).indices  # sorted row r <- flat index order[r]
        tok, slot = order % n, order // n  # [S] each
        counts = torch.bincount(flat, minlength=self.num_experts)
        offs = counts.cumsum(0).to(torch.int32)  # [E] segment ends
        back = torch.empty_like(order)  # token-major (token, slot) -> its sorted row
        back[tok * k + slot] = torch.arange(order.numel(), device=order.device)
    cdt = _compute_dtype(self.gate_up_proj)
    # the fake-quantized weights of all experts in the GEMMs' dtype, cast once (autocast would cast per GEMM)
    w_gu = rt.weight(self.gate_up_proj).to(cdt)  # [E, 2I, H]
    w_d = rt.weight(self.down_proj).to(cdt)  # [E, H, I]
    xs = x.index_select(0, tok).to(cdt)  # [S, H] gathered in x's dtype, so the backward sums a token's slots there
    sizes = None if _grouped_mm_runs(xs) else counts.tolist()  # the segment loop: one host sync per layer
    if rt.recompute_experts and torch.is_grad_enabled():
        h = checkpoint(_grouped_mlp, self.act_fn, xs, w_gu, offs, sizes, use_reentrant=False)
    else:
        h = _grouped_mlp(self.act_fn, xs, w_gu, offs, sizes)  # [S, I]
    if rt.acts:  # the site's rows in the (token, slot) layout the runtime addresses, and back
        h_nk = rt.act(layer, "moe_down_in", h.index_select(0, back).view(n, k, -1))
        h = h_nk.reshape(n * k, -1).index_select(0, tok * k + slot)
    wts = top_k_weights.t().reshape(-1).index_select(0, order)  # [S] each row's routing weight
    y = grouped_linear(h, w_d, offs, sizes) * wts[:, None]
    return torch.zeros_like(hidden_states).index_add_(0, tok, y.to(hidden_states.dtype))


def experts_forward(self, rt, hidden_states, top_k_index, top_k_weights):
    """The implementation `rt.experts` names, on hidden_states' device."""
    fn = grouped_experts if resolve(rt.experts, hidden_states.device) == "grouped" else loop_experts
    return fn(self, rt, hidden_states, top_k_index, top_k_weights)
