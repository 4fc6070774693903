"""Triton kernels of the TwELL path (imported only where Triton and a GPU are present).

* ``gate_twell_tma_kernel`` / ``gate_twell_kernel``: ``relu(x W^T + b)`` as a tiled GEMM (TMA + wgmma
  on Hopper) whose epilogue writes the TwELL format straight from the accumulator tile: per
  (row, N-tile) the true count of active units, and up to ``CAP`` slots of (value, column in tile). A (row, tile) whose count exceeds ``CAP``
  writes its dense tile to the backup buffer instead, so nothing is lost. The dense activation is never
  written for the other tiles. Each CTA adds its active count to its 128-row block's total, which
  decides (on the device) whether the block takes the sparse or the dense path.
* ``dense_hidden_kernel`` / ``dense_down_kernel``: the dense path for 128-row blocks too dense for
  TwELL to pay. They exit at once for sparse blocks, so they are launched unconditionally and the
  host never has to know which path a block took.
"""

from __future__ import annotations

import triton
import triton.language as tl

DECISION_ROWS = 128


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped order: CTAs running together share weight tiles in L2.
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % in_group) % group_m)
    pid_n = (pid % in_group) // group_m
    return pid_m, pid_n


@triton.jit
def _matmul_tile(a_ptr, b_ptr, M, N, K, stride_am, stride_bn, pid_m, pid_n,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """fp32 tile of ``A[M, K] @ B[N, K]^T`` (both K-major, as nn.Linear stores weights)."""
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # wrapped rows are computed but never stored
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
    b_ptrs = b_ptr + rn.to(tl.int64)[None, :] * stride_bn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k0
            a = tl.load(a_ptrs, mask=rk[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=rk[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit
def _pack_subtile(acc, bias_ptr, packed_ptr, dense_ptr, M, F, n_tiles, row0, pid_n, col_in_tile, carry,
                  CAP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, SUB_N: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Packs ``SUB_N`` columns of a tile whose earlier columns hold ``carry`` active units per row.

    Returns (active count per row in this subtile, whether any row's raw values must go to the backup).
    A slot is one 32-bit word, ``value bits << 16 | column in tile``. Slot positions are exclusive
    prefix sums along the row, computed as a tensor-core product with a triangular ones matrix: exact
    (0/1 sums in fp32) and already in the accumulator's layout, where a scan would shuffle the tile
    through shared memory.
    """
    row = tl.arange(0, BLOCK_M)
    local = col_in_tile + tl.arange(0, SUB_N)
    col0 = pid_n * BLOCK_N
    row_ok = row < M - row0
    valid = row_ok[:, None] & (local < F - col0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col0 + local, mask=local < F - col0, other=0.0).to(tl.float32)[None, :]
    # Round like the linear it replaces, then ReLU: keep values > 0 (and NaN, which eager propagates).
    v = acc.to(dense_ptr.dtype.element_ty)
    vf = v.to(tl.float32)
    active = ((vf > 0) | (vf != vf)) & valid
    sub = tl.arange(0, SUB_N)
    upper = (sub[:, None] <= sub[None, :]).to(tl.float16)
    ones = active.to(tl.int32)
    slot = tl.dot(active.to(tl.float16), upper).to(tl.int32) - ones + carry[:, None]
    bits = v.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    word = (bits << 16) | local[None, :]
    row0_64 = row0.to(tl.int64)
    slot_off = (row * (n_tiles * CAP))[:, None] + slot
    tl.store(packed_ptr + (row0_64 * n_tiles + pid_n) * CAP + slot_off, word, mask=active & (slot < CAP))
    return tl.sum(ones, axis=1), v


@triton.jit
def _store_backup(v, dense_ptr, M, F, row0, pid_n, col_in_tile, overflow, BLOCK_M: tl.constexpr,
                  SUB_N: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.arange(0, BLOCK_M)
    local = col_in_tile + tl.arange(0, SUB_N)
    col0 = pid_n * BLOCK_N
    valid = (row < M - row0)[:, None] & (local < F - col0)[None, :]
    dense_off = (row * F)[:, None] + local[None, :]
    tl.store(dense_ptr + row0.to(tl.int64) * F + col0 + dense_off, v, mask=overflow[:, None] & valid)


@triton.jit
def _twell_epilogue(acc, bias_ptr, packed_ptr, counts_ptr, dense_ptr, block_nnz_ptr, M, F, n_tiles, pid_m, pid_n,
                    CAP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Packs one accumulator tile into the TwELL format (see the module docstring).

    The tile is packed in four column quarters, one after the other, so that only a quarter of the
    per-element store addresses is live at a time (the whole tile's would exceed the register file).
    """
    SUB: tl.constexpr = BLOCK_N // 4
    halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
    h0, h1 = tl.split(halves)
    q0, q1 = tl.split(tl.permute(tl.reshape(h0, (BLOCK_M, 2, SUB)), (0, 2, 1)))
    q2, q3 = tl.split(tl.permute(tl.reshape(h1, (BLOCK_M, 2, SUB)), (0, 2, 1)))
    row0 = pid_m * BLOCK_M
    count = tl.zeros((BLOCK_M,), dtype=tl.int32)
    c0, v0 = _pack_subtile(q0, bias_ptr, packed_ptr, dense_ptr, M, F, n_tiles, row0, pid_n, 0, count,
                           CAP, HAS_BIAS, BLOCK_M, SUB, BLOCK_N)
    count += c0
    c1, v1 = _pack_subtile(q1, bias_ptr, packed_ptr, dense_ptr, M, F, n_tiles, row0, pid_n, SUB, count,
                           CAP, HAS_BIAS, BLOCK_M, SUB, BLOCK_N)
    count += c1
    c2, v2 = _pack_subtile(q2, bias_ptr, packed_ptr, dense_ptr, M, F, n_tiles, row0, pid_n, 2 * SUB, count,
                           CAP, HAS_BIAS, BLOCK_M, SUB, BLOCK_N)
    count += c2
    c3, v3 = _pack_subtile(q3, bias_ptr, packed_ptr, dense_ptr, M, F, n_tiles, row0, pid_n, 3 * SUB, count,
                           CAP, HAS_BIAS, BLOCK_M, SUB, BLOCK_N)
    count += c3

    row = tl.arange(0, BLOCK_M)
    row_ok = row < M - row0
    tl.store(counts_ptr + row0.to(tl.int64) * n_tiles + pid_n + row * n_tiles, count, mask=row_ok)
    # Overflowing (row, tile): the raw tile goes to the backup (readers apply the ReLU). Rare, so the
    # stores are skipped unless some row of the tile overflowed.
    overflow = count > CAP
    if tl.max(count, axis=0) > CAP:
        _store_backup(v0, dense_ptr, M, F, row0, pid_n, 0, overflow, BLOCK_M, SUB, BLOCK_N)
        _store_backup(v1, dense_ptr, M, F, row0, pid_n, SUB, overflow, BLOCK_M, SUB, BLOCK_N)
        _store_backup(v2, dense_ptr, M, F, row0, pid_n, 2 * SUB, overflow, BLOCK_M, SUB, BLOCK_N)
        _store_backup(v3, dense_ptr, M, F, row0, pid_n, 3 * SUB, overflow, BLOCK_M, SUB, BLOCK_N)
    tl.atomic_add(block_nnz_ptr + row0 // 128, tl.sum(count))


@triton.jit
def gate_twell_kernel(
    x_ptr, w_ptr, bias_ptr, packed_ptr, counts_ptr, dense_ptr, block_nnz_ptr,
    M, F, K, stride_xm, stride_wf, n_tiles,
    CAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    """Pointer-load variant, for any K and row stride."""
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, F, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _matmul_tile(x_ptr, w_ptr, M, F, K, stride_xm, stride_wf, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    _twell_epilogue(acc, bias_ptr, packed_ptr, counts_ptr, dense_ptr, block_nnz_ptr, M, F, n_tiles, pid_m, pid_n,
                    CAP, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def gate_twell_tma_kernel(
    x_desc, w_desc, bias_ptr, packed_ptr, counts_ptr, dense_ptr, block_nnz_ptr,
    M, F, K, n_tiles,
    CAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """Persistent tensor-memory-accelerator variant (rows 16-byte aligned): TMA loads with zero-filled
    tails; each program walks tiles ``NUM_PROGRAMS`` apart, and the flattened loop lets the next
    tile's loads overlap this tile's epilogue."""
    n_tiles_m = tl.cdiv(M, BLOCK_M)
    n_tiles_f = tl.cdiv(F, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_tiles_m * n_tiles_f, NUM_PROGRAMS, flatten=True,
                         warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_ids(tile, M, F, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            a = x_desc.load([pid_m * BLOCK_M, ks * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, ks * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        _twell_epilogue(acc, bias_ptr, packed_ptr, counts_ptr, dense_ptr, block_nnz_ptr, M, F, n_tiles, pid_m, pid_n,
                        CAP, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def dense_hidden_kernel(
    x_ptr, w_up_ptr, b_up_ptr, packed_ptr, counts_ptr, dense_ptr, block_dense_ptr,
    M, F, K, stride_xm, stride_wf, n_tiles,
    CAP: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """Dense path, first half: writes the hidden activation of a dense block into ``dense`` in place.

    Gated: ``h = round(g) * round(x W_up^T + b_up)`` as eager computes it; non-gated: ``h = g``.
    ``g`` is rebuilt from the packed slots, or read from the backup for overflowing tiles. One CTA
    per (128-row block, TwELL tile), so it reads and writes only its own tile.
    """
    BLOCK_M: tl.constexpr = 128
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tl.load(block_dense_ptr + pid_m) == 0:
        return
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    local = tl.arange(0, BLOCK_N)
    rn = pid_n * BLOCK_N + local
    row_ok = rm < M
    valid = row_ok[:, None] & (rn < F)[None, :]
    rm64 = rm.to(tl.int64)

    count = tl.load(counts_ptr + rm64 * n_tiles + pid_n, mask=row_ok, other=0)
    overflow = count > CAP
    dense_ptrs = dense_ptr + rm64[:, None] * F + rn[None, :]
    g = tl.load(dense_ptrs, mask=overflow[:, None] & valid, other=0.0).to(tl.float32)
    g = tl.where((g > 0) | (g != g), g, 0.0)  # the backup holds the raw pre-activation
    packed_count = tl.where(overflow, 0, count)
    slot_base = (rm64 * n_tiles + pid_n) * CAP
    for j in range(0, tl.max(packed_count, axis=0)):
        live = j < packed_count
        word = tl.load(packed_ptr + slot_base + j, mask=live, other=0)
        vj = ((word >> 16) & 0xFFFF).to(tl.uint16).to(dense_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
        ij = tl.where(live, word & 0xFFFF, -1)
        g += tl.where(ij[:, None] == local[None, :], vj[:, None], 0.0)

    if GATED:
        up = _matmul_tile(x_ptr, w_up_ptr, M, F, K, stride_xm, stride_wf, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
        if HAS_BIAS:
            up += tl.load(b_up_ptr + rn, mask=rn < F, other=0.0).to(tl.float32)[None, :]
        up = up.to(dense_ptr.dtype.element_ty).to(tl.float32)
        g = g * up
    tl.store(dense_ptrs, g.to(dense_ptr.dtype.element_ty), mask=valid)


@triton.jit
def dense_down_kernel(
    h_ptr, w_down_ptr, b_down_ptr, out_ptr, block_dense_ptr,
    M, D, F, stride_hm, stride_wd, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    """Dense path, second half: ``out = h W_down^T + b_down`` for the rows of dense blocks."""
    BLOCK_M: tl.constexpr = 128
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if tl.load(block_dense_ptr + pid_m) == 0:
        return
    acc = _matmul_tile(h_ptr, w_down_ptr, M, D, F, stride_hm, stride_wd, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(b_down_ptr + rn, mask=rn < D, other=0.0).to(tl.float32)[None, :]
    mask = (rm < M)[:, None] & (rn < D)[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
