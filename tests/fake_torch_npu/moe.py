"""The mixture-of-experts kernels: ``npu_grouped_matmul`` (with and without ``group_type``, and the builds
that refuse ``group_type=2``), ``npu_moe_token_permute`` and ``npu_moe_token_unpermute``."""

from __future__ import annotations

import torch

from .contract import FLOAT_DTYPES, GROUP_TYPE_2_REFUSAL, MAX_GMM_WEIGHTS, Release


def kernels(npu, release: Release) -> list:
    """The kernels of ``release`` (its ``npu_grouped_matmul`` with or without ``group_type``)."""

    def _gmm(x, weight, group_list, split_item, group_type, group_list_type):
        assert isinstance(x, list) and isinstance(weight, list) and len(x) == 1, "lists of tensors expected"
        assert len(weight) <= MAX_GMM_WEIGHTS, f"at most {MAX_GMM_WEIGHTS} weights in a list, got {len(weight)}"
        assert all(t.dtype in FLOAT_DTYPES and t.dtype == x[0].dtype for t in weight), "x and weights: one dtype"
        assert group_list.dtype == torch.int64 and group_list_type in (0, 1)
        sizes = group_list.tolist()
        if group_list_type == 0:  # cumulative ends
            sizes = [end - start for start, end in zip([0, *sizes[:-1]], sizes)]
        if group_type == 0:  # groups split x's rows (M); one [K, N] weight per group; one output tensor
            assert split_item in (2, 3) and len(weight) == len(sizes) and sum(sizes) == x[0].shape[0]
            return [torch.cat([rows @ w for rows, w in zip(x[0].split(sizes, 0), weight)], 0)]
        # groups split the contraction (K): x [N_in, K], weight [K, N_out] -> [groups, N_in, N_out]
        if group_type == 2 and not release.group_type_2:
            raise RuntimeError(f"npu_grouped_matmul: {GROUP_TYPE_2_REFUSAL}")
        assert group_type == 2 and split_item == 3 and len(weight) == 1 and sum(sizes) == x[0].shape[1]
        pieces = zip(x[0].split(sizes, 1), weight[0].split(sizes, 0))
        return [torch.stack([a @ b for a, b in pieces])]

    def npu_grouped_matmul(
        x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
        per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
        activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
        output_dtype=None, tuning_config=None,
    ):  # fmt: skip
        assert bias is None and scale is None and output_dtype is None, "the fake models the plain product"
        return _gmm(x, weight, group_list, split_item, group_type, group_list_type)

    def npu_grouped_matmul_old(
        x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
        group_list=None, split_item=0, output_dtype=None,
    ):  # fmt: skip
        assert bias is None and scale is None and output_dtype is None, "the fake models the plain product"
        return _gmm(x, weight, group_list, split_item, 0, 0)  # cumulative ends, rows split

    def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
        assert not padded_mode and tokens.dim() == 2 and indices.dim() in (1, 2)
        top_k = 1 if indices.dim() == 1 else indices.shape[1]
        first = torch.argsort(indices.reshape(-1), stable=True)  # the documented formula
        sorted_out = torch.argsort(first, stable=True)
        permuted = torch.empty(first.numel(), tokens.shape[1], dtype=tokens.dtype)
        permuted[sorted_out] = tokens[torch.arange(first.numel()) // top_k]
        return permuted, sorted_out.to(torch.int32)

    def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
        assert not padded_mode and sorted_indices.dtype == torch.int32
        assert probs is None or probs.dtype == permuted_tokens.dtype, "probs in the tokens' dtype"
        top_k = 1 if probs is None else probs.shape[1]
        copies = permuted_tokens[sorted_indices.long()].reshape(-1, top_k, permuted_tokens.shape[1])
        weights = torch.ones(copies.shape[:2], dtype=copies.dtype) if probs is None else probs
        return (copies * weights.unsqueeze(-1)).sum(1)

    gmm = npu_grouped_matmul if release.group_type else npu_grouped_matmul_old
    gmm.__name__ = "npu_grouped_matmul"
    return [gmm, npu_moe_token_permute, npu_moe_token_unpermute]
