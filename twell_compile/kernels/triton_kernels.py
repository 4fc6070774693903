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
def _twell_epilogue(acc, bias_ptr, packed_ptr, counts_ptr, dense_ptr, dense_desc, block_nnz_ptr, M, F, n_tiles,
                    pid_m, pid_n, CAP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BACKUP_BY_TMA: tl.constexpr, VALUE_DTYPE: tl.constexpr):
    """Packs one accumulator tile into the TwELL format (see the module docstring).

    A slot is one 32-bit word, ``value bits << 16 | column in tile``. At the sparsities TwELL is for, a
    row holds about one active unit per tile, so rather than scattering the whole tile (per-element
    addresses and predicated stores for every element, which cost more than the GEMM's last third),
    the words are extracted in column order one slot at a time: a row-wise min finds each row's next
    active column, and one store writes that slot for all rows. The loop runs as many times as the
    largest count among the tile's rows that fit (at most CAP).
    """
    row = tl.arange(0, BLOCK_M)
    local = tl.arange(0, BLOCK_N)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    row_ok = row < M - row0
    valid = row_ok[:, None] & (local < F - col0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col0 + local, mask=local < F - col0, other=0.0).to(tl.float32)[None, :]
    # Round like the linear it replaces, then ReLU: keep values > 0 (and NaN, which eager propagates).
    v = acc.to(VALUE_DTYPE)
    vf = v.to(tl.float32)
    active = ((vf > 0) | (vf != vf)) & valid
    count = tl.sum(active.to(tl.int32), axis=1)

    row0_64 = row0.to(tl.int64)
    tl.store(counts_ptr + row0_64 * n_tiles + pid_n + row * n_tiles, count, mask=row_ok)
    slot_ptrs = packed_ptr + (row0_64 * n_tiles + pid_n) * CAP + row * (n_tiles * CAP)
    remaining = tl.where(active, local[None, :], BLOCK_N).to(tl.int16)  # BLOCK_N: nothing left
    # Rows past capacity go to the backup whole, so only the others' slots are extracted.
    for j in range(0, tl.max(tl.where(count > CAP, 0, count), axis=0)):
        col = tl.min(remaining, axis=1)
        hit = remaining == col[:, None]
        value = tl.sum(tl.where(hit, v, 0.0).to(tl.float32), axis=1).to(VALUE_DTYPE)
        word = ((value.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) << 16) | col.to(tl.int32)
        tl.store(slot_ptrs + j, word, mask=col < BLOCK_N)
        remaining = tl.where(hit, BLOCK_N, remaining).to(tl.int16)

    # Overflowing (row, tile): the raw tile goes to the backup (readers apply the ReLU). Rare, so it is
    # skipped unless some row of the tile overflowed. A TMA store writes the whole tile (only the
    # overflowing rows are ever read) without the per-element addresses a masked store would need.
    if tl.max(count, axis=0) > CAP:
        if BACKUP_BY_TMA:
            dense_desc.store([row0, col0], v)
        else:
            overflow = count > CAP
            dense_off = (row * F)[:, None] + local[None, :]
            tl.store(dense_ptr + row0_64 * F + col0 + dense_off, v, mask=overflow[:, None] & valid)
    # Per 128-row block: active units, then (n_blocks further on) row-tiles past capacity.
    tl.atomic_add(block_nnz_ptr + row0 // 128, tl.sum(count))
    tl.atomic_add(block_nnz_ptr + tl.cdiv(M, 128) + row0 // 128, tl.sum((count > CAP).to(tl.int32)))


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
    _twell_epilogue(acc, bias_ptr, packed_ptr, counts_ptr, dense_ptr, dense_ptr, block_nnz_ptr, M, F, n_tiles,
                    pid_m, pid_n, CAP, HAS_BIAS, BLOCK_M, BLOCK_N, False, dense_ptr.dtype.element_ty)


@triton.jit
def gate_twell_tma_kernel(
    x_desc, w_desc, bias_ptr, packed_ptr, counts_ptr, dense_desc, block_nnz_ptr,
    M, F, K, n_tiles,
    CAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, VALUE_DTYPE: tl.constexpr,
):
    """Persistent tensor-memory-accelerator variant (rows 16-byte aligned): TMA loads with zero-filled
    tails; each program walks tiles ``NUM_PROGRAMS`` apart, and the flattened loop lets the next
    tile's loads overlap this tile's epilogue."""
    n_tiles_m = tl.cdiv(M, BLOCK_M)
    n_tiles_f = tl.cdiv(F, BLOCK_N)
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_tiles_m * n_tiles_f, NUM_PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_ids(tile, M, F, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            a = x_desc.load([pid_m * BLOCK_M, ks * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, ks * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        _twell_epilogue(acc, bias_ptr, packed_ptr, counts_ptr, dense_desc, dense_desc, block_nnz_ptr, M, F, n_tiles,
                        pid_m, pid_n, CAP, HAS_BIAS, BLOCK_M, BLOCK_N, True, VALUE_DTYPE)


@triton.jit
def _block_is_dense(block_nnz_ptr, block, n_blocks, thr_full, thr_last, thr_heavy):
    # The same integer test as the CUDA sparse kernel, so each block has exactly one owner: too many
    # active units, or rows so heavy (many tiles past capacity) that one CTA per row would straggle.
    too_many = tl.load(block_nnz_ptr + block) > tl.where(block == n_blocks - 1, thr_last, thr_full)
    return too_many | (tl.load(block_nnz_ptr + n_blocks + block) > thr_heavy)


@triton.jit
def _matmul_tile_tma(a_desc, b_desc, K, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc = tl.dot(a_desc.load([pid_m * BLOCK_M, k0]), b_desc.load([pid_n * BLOCK_N, k0]).T, acc)
    return acc


@triton.jit
def dense_hidden_kernel(
    x_ptr, w_up_ptr, b_up_ptr, packed_ptr, counts_ptr, dense_ptr, dense_desc, block_nnz_ptr,
    M, F, K, stride_xm, stride_wf, n_tiles, n_blocks, thr_full, thr_last, thr_heavy,
    CAP: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Dense path, first half: writes the hidden activation of a dense block into ``dense`` in place.

    Gated: ``h = round(g) * round(x W_up^T + b_up)`` as eager computes it; non-gated: ``h = g``.
    ``g`` is rebuilt from the packed slots, or read from the backup for overflowing tiles. One CTA
    per (128-row block, TwELL tile), so it reads and writes only its own tile.
    """
    BLOCK_M: tl.constexpr = 128
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if not _block_is_dense(block_nnz_ptr, pid_m, n_blocks, thr_full, thr_last, thr_heavy):
        return
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    local = tl.arange(0, BLOCK_N)
    rn = pid_n * BLOCK_N + local
    row_ok = rm < M
    valid = row_ok[:, None] & (rn < F)[None, :]
    rm64 = rm.to(tl.int64)

    count = tl.load(counts_ptr + rm64 * n_tiles + pid_n, mask=row_ok, other=0)
    overflow = count > CAP
    if USE_TMA:  # whole tile; rows that did not overflow hold stale data and are masked out below
        g = dense_desc.load([pid_m * BLOCK_M, pid_n * BLOCK_N]).to(tl.float32)
    else:
        dense_ptrs = dense_ptr + rm64[:, None] * F + rn[None, :]
        g = tl.load(dense_ptrs, mask=overflow[:, None] & valid, other=0.0).to(tl.float32)
    # The backup holds the raw pre-activation: apply the ReLU (NaN propagates as in eager).
    g = tl.where(overflow[:, None] & valid & ((g > 0) | (g != g)), g, 0.0)
    packed_count = tl.where(overflow, 0, count)
    slot_base = (rm64 * n_tiles + pid_n) * CAP
    for j in range(0, tl.max(packed_count, axis=0)):
        live = j < packed_count
        word = tl.load(packed_ptr + slot_base + j, mask=live, other=0)
        vj = ((word >> 16) & 0xFFFF).to(tl.uint16).to(dense_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
        ij = tl.where(live, word & 0xFFFF, -1)
        g += tl.where(ij[:, None] == local[None, :], vj[:, None], 0.0)

    if GATED:
        if USE_TMA:  # x_ptr / w_up_ptr are tensor descriptors
            up = _matmul_tile_tma(x_ptr, w_up_ptr, K, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            up = _matmul_tile(x_ptr, w_up_ptr, M, F, K, stride_xm, stride_wf, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K,
                              EVEN_K)
        if HAS_BIAS:
            up += tl.load(b_up_ptr + rn, mask=rn < F, other=0.0).to(tl.float32)[None, :]
        up = up.to(dense_ptr.dtype.element_ty).to(tl.float32)
        g = g * up
    if USE_TMA:
        dense_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], g.to(dense_ptr.dtype.element_ty))
    else:
        tl.store(dense_ptrs, g.to(dense_ptr.dtype.element_ty), mask=valid)


@triton.jit
def dense_down_kernel(
    h_ptr, w_down_ptr, b_down_ptr, out_ptr, out_desc, block_nnz_ptr,
    M, D, F, stride_hm, stride_wd, stride_om, n_blocks, thr_full, thr_last, thr_heavy,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """Dense path, second half: ``out = h W_down^T + b_down`` for the rows of dense blocks."""
    BLOCK_M: tl.constexpr = 128
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if not _block_is_dense(block_nnz_ptr, pid_m, n_blocks, thr_full, thr_last, thr_heavy):
        return
    if USE_TMA:  # h_ptr / w_down_ptr are tensor descriptors
        acc = _matmul_tile_tma(h_ptr, w_down_ptr, F, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = _matmul_tile(h_ptr, w_down_ptr, M, D, F, stride_hm, stride_wd, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K,
                           EVEN_K)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(b_down_ptr + rn, mask=rn < D, other=0.0).to(tl.float32)[None, :]
    if USE_TMA:
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_ptr.dtype.element_ty))
    else:
        mask = (rm < M)[:, None] & (rn < D)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
