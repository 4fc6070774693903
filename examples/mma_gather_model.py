"""mma.sync and ldmatrix fragments modelled in float64 torch, to check the index schemes of a
tensor-core chunked kernel before writing it (examples/results/README.md, "The chunked kernel's
waves, and its output stores"). CPU only; no GPU needed.

The chunked kernel streams W_up and W_down^T through shared memory in slices of 8 columns per unit and
gathers each entry's 16-byte slice row. Here both projections do that gather with ldmatrix and run
on mma.sync:
- up, m16n8k8: A's rows are gathered entries, B holds x of a set of 4 tokens (columns 2j and 2j+1
  for token j); in variant q (0-3) rows r and r + 8 belong to token (r + q) % 4, so each lane is
  useful in one variant and keeps two fp32 accumulators per 4 variants;
- down, m16n8k16: A is 16 tokens x 16 entries with one h per token, B the entries' gathered rows of
  W_down^T, D the 16 tokens' 8 output columns; in variant q entry column k belongs to token
  2 (((k % 8) / 2 - q) mod 4) + k % 2 (+ 8 from k = 8), so only a0 and a3 are nonzero, in lane
  4 g + (g / 2 + q) % 4.

The fragment layouts are PTX's for .row.col bf16 with f32 accumulators (g = lane / 4, t = lane % 4):
A holds (g, 2t..2t+1), (g+8, ...) [, (g, 2t+8..), (g+8, 2t+8..) for k16]; B holds (2t..2t+1, g)
[, (2t+8.., g)]; C and D hold (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1). ldmatrix: lane 8i + r gives
row r of matrix i and receives (g, 2t..2t+1) of each matrix, or (2t..2t+1, g) with .trans.

The down projection's scheme was then built into the chunked kernel (branch chunked-mma-down): exact,
but slower than the FMA loop on an H100, since 15 of every 16 of the tensor cores' products are zeros
(examples/results/README.md, "A tensor-core down projection in the chunked kernel").

    python examples/mma_gather_model.py
"""

from __future__ import annotations

import torch

LANES = [(lane, lane >> 2, lane & 3) for lane in range(32)]  # (lane, g, t)


def zeros(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float64)


def randn(rng: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.float64, generator=rng)


def mma(a_regs, b_regs, c_regs, k: int) -> list[torch.Tensor]:
    """D = A B + C for m16n8k8 (k=8) or m16n8k16 (k=16), from and to per-lane fragments."""
    A, B, C = zeros(16, k), zeros(k, 8), zeros(16, 8)
    for lane, g, t in LANES:
        a, b, c = a_regs[lane], b_regs[lane], c_regs[lane]
        A[g, 2 * t:2 * t + 2], A[g + 8, 2 * t:2 * t + 2] = a[0], a[1]
        B[2 * t:2 * t + 2, g] = b[0]
        if k == 16:
            A[g, 2 * t + 8:2 * t + 10], A[g + 8, 2 * t + 8:2 * t + 10] = a[2], a[3]
            B[2 * t + 8:2 * t + 10, g] = b[1]
        C[g, 2 * t:2 * t + 2], C[g + 8, 2 * t:2 * t + 2] = c[0:2], c[2:4]
    D = A @ B + C
    return [torch.stack([D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]) for _, g, t in LANES]


def ldmatrix(rows: list[torch.Tensor], matrices: int, trans: bool = False) -> list[list[torch.Tensor]]:
    """Per lane, its pair of each 8x8 matrix whose row r lane 8i + r addressed (rows[8i + r])."""
    out = [[None] * matrices for _ in range(32)]
    for i in range(matrices):
        m = torch.stack(rows[8 * i:8 * i + 8])
        for lane, g, t in LANES:
            out[lane][i] = m[2 * t:2 * t + 2, g] if trans else m[g, 2 * t:2 * t + 2]
    return out


def check_up(rng: torch.Generator, units: int = 64, slices: int = 5) -> bool:
    """4 tokens x 16 entries, accumulated over all slices in two registers per lane."""
    w_up = randn(rng, units, 8 * slices)
    x = randn(rng, 4, 8 * slices)
    unit_of = torch.randint(0, units, (4, 16), generator=rng)  # [variant, A row]
    acc = zeros(32, 2)
    for s in range(slices):
        cols = slice(8 * s, 8 * s + 8)
        for q in range(4):
            a = ldmatrix([w_up[unit_of[q, r], cols] for r in range(16)], 2)
            b = [(x[g >> 1, cols][2 * t:2 * t + 2],) for _, g, t in LANES]  # column g: token g // 2
            c = [torch.stack([acc[lane, 0], zeros(), acc[lane, 1], zeros()]) for lane in range(32)]
            d = mma(a, b, c, k=8)
            for lane, g, t in LANES:
                if t == (g + q) % 4:  # this lane's variant: keep its two useful outputs
                    acc[lane] = torch.stack([d[lane][0], d[lane][2]])
    ok = True
    for lane, g, t in LANES:
        q = (t - g) % 4  # rows g and g + 8 of variant q are entries of token (g + q) % 4 == t
        want = torch.stack([w_up[unit_of[q, g]] @ x[t], w_up[unit_of[q, g + 8]] @ x[t]])
        ok &= torch.allclose(acc[lane], want)
    return ok


def down_token(q: int, k: int) -> int:
    """The token (0-15) whose entry is A's column k in variant q of the down projection."""
    kk = k % 8
    return 2 * (((kk >> 1) - q) % 4) + (kk & 1) + (8 if k >= 8 else 0)


def check_down(rng: torch.Generator, units: int = 64) -> bool:
    """16 tokens, 4 entries each (one per variant), into one 16 x 8 output tile."""
    w_down_t = randn(rng, units, 8)  # one slice of W_down^T
    h = randn(rng, 4, 16)  # [variant, token]
    unit_of = torch.randint(0, units, (4, 16), generator=rng)
    ok = all(sorted(down_token(q, k) for k in range(16)) == list(range(16)) for q in range(4))
    d = [zeros(4) for _ in range(32)]
    zero = zeros(2)
    for q in range(4):
        b = ldmatrix([w_down_t[unit_of[q, down_token(q, k)]] for k in range(16)], 2, trans=True)
        a = []
        for lane, g, t in LANES:
            a0, a3 = zeros(2), zeros(2)
            if t == ((g >> 1) + q) % 4:  # the holder of tokens g and g + 8 in this variant
                a0[g & 1], a3[g & 1] = h[q, g], h[q, g + 8]
            a.append((a0, zero, zero, a3))
        d = mma(a, b, d, k=16)
    got = zeros(16, 8)
    for lane, g, t in LANES:
        got[g, 2 * t:2 * t + 2], got[g + 8, 2 * t:2 * t + 2] = d[lane][0:2], d[lane][2:4]
    want = sum(h[q][:, None] * w_down_t[unit_of[q]] for q in range(4))
    return ok and torch.allclose(got, want)


def main() -> None:
    rng = torch.Generator().manual_seed(0)
    print(f"up projection, m16n8k8, 4 rotated variants: {check_up(rng)}")
    print(f"down projection, m16n8k16, block-diagonal h: {check_down(rng)}")


if __name__ == "__main__":
    main()
