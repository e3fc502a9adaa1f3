"""flashcore.bert_padding: packing a padded batch for the varlen calls and scattering it back
(flash_attn.bert_padding's names and returns), on CPU tensors."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

import flashcore  # noqa: E402
from flashcore.bert_padding import (  # noqa: E402
    IndexFirstAxis,
    IndexFirstAxisResidual,
    IndexPutFirstAxis,
    index_first_axis,
    index_first_axis_residual,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)


def random_mask(batch, seqlen, gen):
    """A mask with a full row, an empty row, and rows whose tokens have gaps."""
    mask = torch.rand(batch, seqlen, generator=gen) < 0.6
    mask[0] = True
    mask[1] = False
    return mask


def test_unpad_then_pad_round_trip():
    gen = torch.Generator().manual_seed(0)
    batch, seqlen = 5, 13
    x = torch.randn(batch, seqlen, 3, 4, generator=gen)
    mask = random_mask(batch, seqlen, gen)
    packed, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask.to(torch.int64))
    lengths = mask.sum(-1)
    assert cu_seqlens.dtype == torch.int32 and used.dtype == torch.int32
    assert cu_seqlens.tolist() == [0] + torch.cumsum(lengths, 0).tolist()
    assert used.tolist() == lengths.tolist()
    assert max_seqlen == int(lengths.max()) and isinstance(max_seqlen, int)
    assert packed.shape == (int(lengths.sum()), 3, 4)
    # the packed rows are each row's tokens in order
    expect = torch.cat([x[b][mask[b]] for b in range(batch)])
    assert torch.equal(packed, expect)
    assert torch.equal(indices, torch.nonzero(mask.flatten()).flatten())
    back = pad_input(packed, indices, batch, seqlen)
    assert torch.equal(back, x * mask[:, :, None, None])


def test_unused_mask_counts_in_the_packing_not_in_the_used_lengths():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 6, 8, generator=gen)
    mask = torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    unused = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0]], dtype=torch.bool)
    packed, indices, cu_seqlens, max_seqlen, used = unpad_input(x, mask, unused)
    assert cu_seqlens.tolist() == [0, 4, 8]
    assert used.tolist() == [2, 3]
    assert max_seqlen == 4
    assert indices.tolist() == [0, 1, 2, 3, 6, 7, 8, 9]
    assert torch.equal(packed, x.reshape(12, 8)[indices])


def test_gradients_flow_through_unpad_and_pad():
    gen = torch.Generator().manual_seed(2)
    batch, seqlen = 4, 9
    x = torch.randn(batch, seqlen, 5, generator=gen, requires_grad=True)
    mask = random_mask(batch, seqlen, gen)
    packed, indices, *_ = unpad_input(x, mask)
    weight = torch.randn(packed.shape, generator=gen)
    out = pad_input(packed * weight, indices, batch, seqlen)
    out.sum().backward()
    expect = torch.zeros(batch * seqlen, 5)
    expect[indices] = weight
    assert torch.equal(x.grad, expect.reshape(batch, seqlen, 5))
    # and the index helpers alone
    values = torch.randn(3, 2, generator=gen, requires_grad=True)
    placed = index_put_first_axis(values, torch.tensor([4, 0, 2]), 6)
    assert torch.equal(placed[[4, 0, 2]], values.detach()) and placed[[1, 3, 5]].abs().sum() == 0
    index_first_axis(placed, torch.tensor([2, 2])).sum().backward()
    assert values.grad.tolist() == [[0, 0], [0, 0], [2, 2]]


def test_concatenated_sequences():
    x = torch.arange(2 * 6, dtype=torch.float32).reshape(2, 6, 1)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    packed, indices, cu_seqlens, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu_seqlens.tolist() == [0, 2, 5, 6] and cu_seqlens.dtype == torch.int32
    assert max_seqlen == 3
    assert indices.tolist() == [0, 1, 2, 3, 4, 6]
    assert packed.flatten().tolist() == [0, 1, 2, 3, 4, 6]


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_attention_on_unpadded_tokens_matches_each_sequence(causal):
    """The use it exists for: unpad q / k / v with the batch's mask, attend with the varlen call,
    pad back; each row's tokens get exactly what attention over that row alone gives, and padded
    positions get zeros."""
    gen = torch.Generator().manual_seed(3)
    batch, seqlen, heads, dim = 4, 24, 2, 32
    q, k, v = (torch.randn(batch, seqlen, heads, dim, generator=gen) for _ in range(3))
    mask = torch.zeros(batch, seqlen, dtype=torch.bool)
    for b, n in enumerate([24, 0, 7, 13]):
        mask[b, :n] = True
    q_u, indices, cu, max_len, _ = unpad_input(q, mask)
    k_u, v_u = unpad_input(k, mask)[0], unpad_input(v, mask)[0]
    out_u = flashcore.flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, max_len, max_len, causal=causal)
    out = pad_input(out_u, indices, batch, seqlen)
    for b in range(batch):
        n = int(mask[b].sum())
        if n:
            alone = flashcore.flash_attn_func(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], causal=causal)
            torch.testing.assert_close(out[b:b + 1, :n], alone, rtol=0, atol=1e-5)
        assert out[b, n:].abs().sum() == 0


def test_flash_attn_function_names_and_residual_gather():
    """flash_attn's autograd Function names apply the same gathers; the residual form returns the
    input beside the rows, and the input's gradient is the rows' scattered back plus the
    residual's."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 3, 2, generator=gen, requires_grad=True)
    indices = torch.tensor([7, 0, 4, 5])
    assert torch.equal(IndexFirstAxis.apply(x, indices), index_first_axis(x, indices))
    rows = torch.randn(4, 3, 2, generator=gen)
    assert torch.equal(IndexPutFirstAxis.apply(rows, indices, 9), index_put_first_axis(rows, indices, 9))
    gathered, residual = IndexFirstAxisResidual.apply(x, indices)
    assert torch.equal(gathered, x[indices]) and torch.equal(residual, x)
    grad_rows, grad_residual = torch.randn(4, 3, 2, generator=gen), torch.randn(9, 3, 2, generator=gen)
    (grad_x,) = torch.autograd.grad((gathered, residual), x, (grad_rows, grad_residual))
    expected = grad_residual.clone()
    expected[indices] += grad_rows
    assert torch.allclose(grad_x, expected)
    assert index_first_axis_residual is IndexFirstAxisResidual.apply
