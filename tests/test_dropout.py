"""Fast dropout masks (ranmt.runtime.dropout, ``train.dropout_masks=fast``): the mask against its
definition from the random bits, the drop rate, values and gradients, the switch, and a
training run that resumes exactly and learns like the ``torch`` masks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from ranmt.config import load_config
from ranmt.runtime.dropout import Dropout, dropout, fast_masks, keep_mask
from ranmt.training.train import train


def test_keep_mask_is_its_definition_from_the_random_bits():
    """Element i is kept iff its 16-bit lane, read as a signed number s, has
    s + 32768 >= round(p * 65536)."""
    shape, p = (7, 5), 0.3  # 35 elements: nine int64 draws, the last one partly used
    keep, scale = keep_mask(shape, p, torch.Generator().manual_seed(3))
    bits = torch.empty(9, dtype=torch.int64).random_(-2 ** 63, 2 ** 63 - 1,
                                                    generator=torch.Generator().manual_seed(3))
    expected = []
    for word in bits.tolist():
        unsigned = word % 2 ** 64
        for lane in range(4):  # little-endian int16 lanes of the word
            bits16 = (unsigned >> (16 * lane)) & 0xFFFF
            signed = bits16 - 65536 if bits16 >= 32768 else bits16
            expected.append(signed + 32768 >= round(p * 65536))
    assert keep.shape == shape and keep.dtype == torch.bool
    assert keep.flatten().tolist() == expected[:35]
    assert scale == 65536 / (65536 - round(p * 65536))


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_drop_rate_is_p_rounded_to_sixteen_bits(p):
    keep, _ = keep_mask((1000, 1000), p, torch.Generator().manual_seed(0))
    rate = round(p * 65536) / 65536
    sigma = math.sqrt(rate * (1 - rate) / 1e6)
    assert abs(float((~keep).float().mean()) - rate) < 5 * sigma


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_dropout_values_and_gradient(dtype):
    x = torch.randn(6, 33, dtype=dtype, requires_grad=True)
    torch.manual_seed(5)
    with fast_masks():
        y = dropout(x, 0.25, True)
    torch.manual_seed(5)
    keep, scale = keep_mask(x.shape, 0.25)
    # the scale applied as a float, one rounding to the dtype (as F.dropout does)
    expected = (x.detach().float() * keep * scale).to(dtype)
    assert y.dtype == dtype and torch.equal(y, expected)
    grad = torch.randn_like(y)
    y.backward(grad)
    assert torch.equal(x.grad, (grad.float() * keep * scale).to(dtype))


def test_switch_eval_and_p_edges_fall_back_to_torch_dropout():
    x = torch.randn(4, 50)
    torch.manual_seed(1)
    expected = F.dropout(x, 0.1, True)
    torch.manual_seed(1)
    assert torch.equal(dropout(x, 0.1, True), expected)  # masks off: PyTorch's dropout
    with fast_masks():
        assert torch.equal(dropout(x, 0.1, False), x)  # evaluation
        assert torch.equal(dropout(x, 0.0, True), x)
        assert torch.equal(dropout(x, 1.0, True), torch.zeros_like(x))
        module = Dropout(0.1).eval()
        assert torch.equal(module(x), x)
    assert repr(Dropout(0.1)) == repr(torch.nn.Dropout(0.1))


def _cfg(**extra):
    values = {"model.preset": "tiny", "train.lr": 0.003, "train.warmup_steps": 20,
              "train.validate_every": 1000, "train.log_every": 1000, "train.progress": "false",
              "train.tensorboard": "false", "train.validate_bleu": "false",
              "data.max_tokens": 400, "train.dropout_masks": "fast", "model.dropout": 0.3}
    values.update({k: str(v) for k, v in extra.items()})
    return load_config(None, values)


def test_fast_masks_training_resumes_exactly_and_differs_from_torch_masks(reverse_data,
                                                                         tmp_path):
    """12 steps at once == 6, stop, resume to 12 (bit for bit); the same run with torch's
    masks ends elsewhere (the switch reaches the model) at a validation loss within 5%."""
    straight = train(_cfg(**{"train.max_steps": 12}), reverse_data, tmp_path / "straight")
    train(_cfg(**{"train.max_steps": 6}), reverse_data, tmp_path / "split")
    resumed = train(_cfg(**{"train.max_steps": 12}), reverse_data, tmp_path / "split")
    assert (resumed["resumed_from_step"], resumed["steps_this_run"]) == (6, 6)
    torch_masks = train(_cfg(**{"train.max_steps": 12, "train.dropout_masks": "torch"}),
                        reverse_data, tmp_path / "torch")
    final = "checkpoints/step_00000012/model.safetensors"
    a = load_file(str(tmp_path / "straight" / final))
    b = load_file(str(tmp_path / "split" / final))
    c = load_file(str(tmp_path / "torch" / final))
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert any(not torch.equal(a[key], c[key]) for key in a)
    loss, torch_loss = straight["best_valid_loss"], torch_masks["best_valid_loss"]
    assert math.isfinite(loss) and abs(loss - torch_loss) < 0.05 * torch_loss


def test_cells_written_before_the_setting_match_torch_masks_only():
    """A grid cell recorded before ``train.dropout_masks`` existed trained with torch's
    masks: reuse and warm start treat it as ``torch``, never as ``fast``."""
    from ranmt.experiment.reuse import _comparable_config

    old = {"train": {"precision": "fp32"}}
    assert _comparable_config(old) == _comparable_config(
        {"train": {"precision": "fp32", "dropout_masks": "torch"}})
    assert _comparable_config(old) != _comparable_config(
        {"train": {"precision": "fp32", "dropout_masks": "fast"}})


def test_dot_product_attention_dropout_uses_fast_masks_by_the_math_kernel_formula():
    """Attention-weight dropout inside the fused path: with fast masks on, the context is
    dropout(softmax(q k^T / sqrt(d_h))) v with the fast mask; padded keys get no weight."""
    from ranmt.attention.base import AttentionSpec, merge_heads, split_heads
    from ranmt.attention.dot_product import DotProductAttention

    torch.manual_seed(0)
    spec = AttentionSpec(d_model=16, heads=2, dropout=0.3, max_positions=32,
                         role="encoder_self", layer_index=0, num_layers=1)
    attention = DotProductAttention(spec).train()
    x = torch.randn(3, 5, 16)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, 3:] = True
    torch.manual_seed(7)
    with fast_masks():
        out = attention(x, x, key_padding_mask=padding).context
    q, k, v = (split_heads(proj(x), 2) for proj in
               (attention.q_proj, attention.k_proj, attention.v_proj))
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(8)
    scores = scores.masked_fill(padding[:, None, None, :], float("-inf"))
    torch.manual_seed(7)
    keep, scale = keep_mask(scores.shape, 0.3)
    weights = torch.softmax(scores, -1) * keep * scale
    expected = attention.out_proj(merge_heads(weights @ v))
    assert torch.allclose(out, expected, atol=1e-6)
    with fast_masks(False):  # PyTorch's masks: another draw than the fast one
        torch.manual_seed(7)
        assert not torch.allclose(attention(x, x, key_padding_mask=padding).context, out)


def test_cells_written_before_batch_pools_match_unpooled_batches_only():
    """A cell recorded before ``data.pool_batches`` (and the other later fields) trained on
    one sort by target length: reuse treats it as ``pool_batches: 0``, never as the pooled
    default, and a field nested two sections deep (``model.ran.kernel``) is filled too."""
    from ranmt.experiment.reuse import _comparable_config

    old = {"train": {"precision": "fp32"}, "data": {"max_tokens": 4096},
           "model": {"ran": {"init": "xavier"}}}
    now = {"train": {"precision": "fp32"}, "data": {"max_tokens": 4096, "pool_batches": 0},
           "model": {"ran": {"init": "xavier", "kernel": "auto"}}}
    assert _comparable_config(old) == _comparable_config(now)
    pooled = {**now, "data": {"max_tokens": 4096, "pool_batches": 8}}
    assert _comparable_config(old) != _comparable_config(pooled)
    assert _comparable_config(old)["model"]["ran"]["kernel"] == "auto"
    assert old == {"train": {"precision": "fp32"}, "data": {"max_tokens": 4096},
                   "model": {"ran": {"init": "xavier"}}}  # the caller's dict is not changed
