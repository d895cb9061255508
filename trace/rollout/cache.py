"""Static per-batch KV cache of the rollout engine, in the engine dtype or FP4 (codes + scales).

What: one buffer per layer of `[B, H_kv, cap + 1, D]` (slot `cap` is a trash slot that padded chunk
positions are written to and that is never attended). Row `b` holds the tokens of sample `b` at slots
= absolute positions 0..len-1; head-major, so a decode step's grouped-query matmul reads each KV head's
slots as one strided batch without a copy. With `fp4_kv=True`, K (after norm and RoPE) and V are quantized per token
and head (`trace.fp4.quantize(x, fmt, "row")` over D, the DESIGN.md §2 KV site) and stored either as
  - `fp4_store="codes"`: packed codes [B, cap+1, H_kv, D/2] uint8, scale bytes [.., D/block] and the FP32
    outer scale [.., 1] (token-major: kernels/attention.py's layout, which the Triton decode kernel
    reads in place; the torch path dequantizes on read), a quarter of the bytes; or
  - `fp4_store="values"` (default): the dequantized values in the engine dtype, decoded once at write
    time -- bit-identical to decoding at read time (same codes, same formula, same final cast), without
    decoding the whole context at every step. FP4 KV numerics, BF16 KV memory: the torch emulation
    path's choice; the Triton path uses "codes". The FP4Tensor of the written rows is returned so the caller can record it.

Compared against: the trainer's K/V fake quant (`trace.qat.patch.trace_attention`), through the
engine-vs-patched-HF log-prob tests in tests/rollout.
"""
from __future__ import annotations

import torch

from trace import fp4
from trace.fp4 import reference as ref


def quant_rows(x: torch.Tensor, fmt: str) -> fp4.FP4Tensor:
    """Per-row RTN FP4 quantization = `trace.fp4.quantize(x, fmt, "row")`. On CUDA the library's
    finiteness check (a host sync per call) is skipped and the same oracle functions are called
    directly (identical codes); non-finite values still surface in the engine's logits check."""
    if not x.is_cuda:
        return fp4.quantize(x, fmt, "row")
    xf = x.float()
    if fmt == "nvfp4":
        codes, sb, s_enc = ref.nvfp4_quantize(xf, "row")
    else:
        codes, sb = ref.mxfp4_quantize(xf, "rtn", "floor")
        s_enc = torch.ones((), device=x.device)
    return fp4.FP4Tensor(codes, sb, s_enc, fmt, False, x.dtype)


class KVCache:
    def __init__(self, num_layers: int, batch: int, cap: int, kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device, fp4_kv: bool = False, fmt: str = "nvfp4", fp4_store: str = "values"):
        if fp4_store not in ("values", "codes"):
            raise ValueError(f"fp4_store must be 'values' or 'codes', got {fp4_store!r}")
        self.cap, self.batch, self.fp4_kv, self.fmt, self.dtype = cap, batch, fp4_kv, fmt, dtype
        self.codes_stored = fp4_kv and fp4_store == "codes"
        shape = (batch, cap + 1, kv_heads, head_dim)  # token-major (FP4 codes); values are head-major below
        if self.codes_stored:
            block = ref.NVFP4_BLOCK if fmt == "nvfp4" else ref.MXFP4_BLOCK
            self.codes = [[torch.zeros(*shape[:-1], head_dim // 2, dtype=torch.uint8, device=device)
                           for _ in range(2)] for _ in range(num_layers)]
            self.scales = [[torch.zeros(*shape[:-1], head_dim // block, dtype=torch.uint8, device=device)
                            for _ in range(2)] for _ in range(num_layers)]
            self.outer = [[torch.ones(*shape[:-1], 1, dtype=torch.float32, device=device)
                           for _ in range(2)] for _ in range(num_layers)]
        else:
            self.kv = [[torch.zeros(batch, kv_heads, cap + 1, head_dim, dtype=dtype, device=device) for _ in range(2)]
                       for _ in range(num_layers)]

    def row_ids(self, rows, device) -> torch.Tensor:
        """The cache rows [R] a chunk addresses: rows, or all B rows for None."""
        return torch.arange(self.batch, device=device) if rows is None else rows

    def index(self, rows, slots: torch.Tensor):
        """(rows [R, T], slots [R, T]): the advanced index of a chunk's entries (rows None = all B rows)."""
        return self.row_ids(rows, slots.device)[:, None].expand_as(slots), slots

    def write(self, layer: int, rows, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Store k, v [R, T, H_kv, D] at (rows [R], slots [R, T]); rows None = all B rows.
        Returns the FP4Tensors of k and v (flattened to [R*T, H_kv, D]) when the cache is FP4, else None."""
        idx = self.index(rows, slots)
        if not self.fp4_kv:  # [B, H_kv, cap+1, D][rows, :, slots] is [R, T, H_kv, D]
            self.kv[layer][0][idx[0], :, idx[1]] = k.to(self.dtype)
            self.kv[layer][1][idx[0], :, idx[1]] = v.to(self.dtype)
            return None
        out = []
        for j, x in enumerate((k, v)):
            t = quant_rows(x.reshape(-1, *x.shape[2:]), self.fmt)  # [R*T, H_kv, D] per (token, head)
            out.append(t)
            if not self.codes_stored:  # the value read() would decode, decoded once here
                self.kv[layer][j][idx[0], :, idx[1]] = t.dequantize(self.dtype).reshape(x.shape)
                continue
            self.put_codes(layer, j, idx, ref.pack_fp4(t.codes), t.scales, t.outer.expand(*t.codes.shape[:-1], 1))
        return out

    def put_codes(self, layer: int, j: int, idx, packed: torch.Tensor, scales: torch.Tensor, outer: torch.Tensor):
        """Store K (j=0) or V (j=1) of a codes-storing cache at idx = (rows [R, T], slots [R, T]): packed codes,
        scale bytes and outer scales of the R*T*H_kv (token, head) rows in that order, any leading shape."""
        lead = idx[1].shape  # [R, T]
        self.codes[layer][j][idx] = packed.reshape(*lead, -1, packed.shape[-1])
        self.scales[layer][j][idx] = scales.reshape(*lead, -1, scales.shape[-1])
        self.outer[layer][j][idx] = outer.reshape(*lead, -1, 1)

    def stored(self, layer: int, rows, slots: torch.Tensor) -> list[fp4.FP4Tensor]:
        """The FP4 K and V held at (rows [R], slots [R, T]) of a codes-storing cache, as the FP4Tensors
        `write` returns ([R*T, H_kv, D]): what a recorder keeps of K/V written by another path (the
        Triton kv_store), read back rather than quantized again."""
        idx = self.index(rows, slots)
        return [fp4.FP4Tensor(ref.unpack_fp4(self.codes[layer][j][idx].flatten(0, 1)),
                              self.scales[layer][j][idx].flatten(0, 1), self.outer[layer][j][idx].flatten(0, 1),
                              self.fmt, False, self.dtype) for j in range(2)]

    def read(self, layer: int, rows, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots [0, length) for rows (None = all): [R, H_kv, length, D] in the engine dtype
        (a view of the cache for BF16 and all rows)."""
        sel = slice(None) if rows is None else rows
        if not self.codes_stored:
            return self.kv[layer][0][sel, :, :length], self.kv[layer][1][sel, :, :length]
        out = []
        for j in range(2):
            codes = ref.unpack_fp4(self.codes[layer][j][sel, :length])
            t = fp4.FP4Tensor(codes, self.scales[layer][j][sel, :length], self.outer[layer][j][sel, :length],
                              self.fmt, False, self.dtype)
            out.append(t.dequantize(self.dtype).transpose(1, 2))  # [R, H_kv, length, D]
        return out[0], out[1]

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Rows dst <- rows src (the n samples of a prompt share its prefilled prompt)."""
        bufs = ([b for lay in self.kv for b in lay] if not self.codes_stored else
                [b for grp in (self.codes, self.scales, self.outer) for lay in grp for b in lay])
        for b in bufs:
            b[dst] = b[src]
