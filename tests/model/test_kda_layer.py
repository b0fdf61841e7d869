"""The KDA layer: prefill + decode equals one pass, packed sequences stay apart, the state serialises."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from k3.kernels.kda import kda_gate
from k3.model import KDAState, KimiDeltaAttention
from k3.model.config import K3Config
from k3.model.kda import INIT_LOG_DECAY_RANGE, ShortConv

pytestmark = pytest.mark.timeout(120)


def tiny_config(**overrides) -> K3Config:
    fields = dict(
        vocab_size=64, hidden_size=32, num_layers=2, dense_intermediate_size=64,
        kda_heads=2, kda_head_dim=16, kda_gate_rank=8,
        mla_heads=2, q_lora_rank=16, num_experts=4, top_k=2, num_shared_experts=1,
        latent_size=16, expert_intermediate_size=32, max_seq_len=512,
    )
    fields.update(overrides)
    return K3Config(**fields)


@pytest.fixture(scope="module")
def cfg() -> K3Config:
    return tiny_config()


@pytest.fixture(scope="module")
def layer(cfg) -> KimiDeltaAttention:
    torch.manual_seed(0)
    layer = KimiDeltaAttention(cfg, layer_idx=0)
    # W_fb starts at zero (input-independent decay); give it weights so the tests exercise a data-dependent gate.
    with torch.no_grad():
        layer.w_fb.weight.normal_(std=0.3)
    return layer.eval()


def inputs(B: int, T: int, seed: int) -> torch.Tensor:
    return torch.randn(B, T, 32, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_prefill_then_decode_equals_one_pass(layer):
    x = inputs(2, 100, seed=1)
    y_full, state_full = layer(x, return_state=True)
    assert y_full.shape == x.shape
    y_prefill, state = layer(x[:, :70], return_state=True)  # chunked path, a partial second chunk
    outs = [y_prefill]
    for t in range(70, 100):
        y_t, state = layer(x[:, t : t + 1], state=state)
        outs.append(y_t)
    assert (torch.cat(outs, dim=1) - y_full).abs().max().item() <= 1e-4
    for name, tensor in state.to_dict().items():
        assert (tensor - getattr(state_full, name)).abs().max().item() <= 1e-4, name


@torch.no_grad()
def test_recurrent_path_equals_chunked_path_and_zero_state_equals_none(layer, cfg):
    x = inputs(2, 40, seed=2)
    y_chunk, s_chunk = layer(x, return_state=True)
    y_rec, s_rec = layer(x, use_chunk=False, return_state=True)
    assert (y_chunk - y_rec).abs().max().item() <= 1e-4
    assert (s_chunk.recurrent - s_rec.recurrent).abs().max().item() <= 1e-4
    y_zero, s_zero = layer(x, state=KDAState.zeros(2, cfg))
    assert s_zero is not None
    torch.testing.assert_close(y_zero, y_chunk)
    # the training path returns no state
    y_train, none = layer(x)
    assert none is None
    torch.testing.assert_close(y_train, y_chunk)


@torch.no_grad()
def test_outputs_are_causal(layer):
    x = inputs(1, 30, seed=3)
    y, _ = layer(x)
    x2 = x.clone()
    x2[:, 20:] += 5.0
    y2, _ = layer(x2)
    torch.testing.assert_close(y2[:, :20], y[:, :20], rtol=0, atol=1e-6)
    assert (y2[:, 20:] - y[:, 20:]).abs().max() > 1e-3


LENGTHS = [20, 5, 70]  # the middle one shorter than the conv's reach across a boundary would matter


@torch.no_grad()
def test_packed_sequences_do_not_leak(layer):
    xs = [inputs(1, n, seed=10 + i) for i, n in enumerate(LENGTHS)]
    cu = torch.tensor([0, 20, 25, 95], dtype=torch.int32)
    y_packed, state = layer(torch.cat(xs, dim=1), cu_seqlens=cu, return_state=True)
    assert state.batch_size == 3
    for n, x in enumerate(xs):
        y_alone, s_alone = layer(x, return_state=True)
        s, e = cu[n].item(), cu[n + 1].item()
        assert (y_packed[:, s:e] - y_alone).abs().max().item() <= 1e-4
        for name, tensor in s_alone.to_dict().items():
            assert (getattr(state, name)[n : n + 1] - tensor).abs().max().item() <= 1e-4, name


@torch.no_grad()
def test_packed_prefill_then_batched_decode(layer):
    # The serving flow: prefill several prompts packed, then decode them as a batch from the per-sequence state.
    xs = [inputs(1, n + 1, seed=20 + i) for i, n in enumerate(LENGTHS)]
    prompts = torch.cat([x[:, :-1] for x in xs], dim=1)
    cu = torch.tensor([0, 20, 25, 95])
    _, state = layer(prompts, cu_seqlens=cu, return_state=True)
    next_tokens = torch.cat([x[:, -1:] for x in xs], dim=0)  # [3, 1, d]
    y_next, _ = layer(next_tokens, state=state)
    for n, x in enumerate(xs):
        y_alone, _ = layer(x)
        assert (y_next[n] - y_alone[0, -1:]).abs().max().item() <= 1e-4
    # and continuing packed from the per-sequence state works as well
    y_cont, _ = layer(next_tokens.reshape(1, 3, 32), cu_seqlens=torch.tensor([0, 1, 2, 3]), state=state)
    assert (y_cont[0] - y_next[:, 0]).abs().max().item() <= 1e-4


def test_state_roundtrip_through_safetensors(layer, cfg):
    with torch.no_grad():
        _, state = layer(inputs(2, 10, seed=4), return_state=True)
    blob = safetensors.torch.save(state.to_dict())
    restored = KDAState.from_dict(safetensors.torch.load(blob))
    for name, tensor in state.to_dict().items():
        torch.testing.assert_close(getattr(restored, name), tensor, rtol=0, atol=0)
    restored.check(2, cfg)
    zeros = KDAState.zeros(3, cfg, dtype=torch.bfloat16)
    assert zeros.conv_q.shape == (3, 32, 3) and zeros.conv_q.dtype == torch.bfloat16
    assert zeros.recurrent.shape == (3, 2, 16, 16) and zeros.recurrent.dtype == torch.float32


def test_state_from_dict_rejects_bad_input(cfg):
    good = KDAState.zeros(2, cfg).to_dict()
    with pytest.raises(ValueError, match=r"missing keys \['conv_v'\], unknown keys \['extra'\]"):
        KDAState.from_dict({**{k: v for k, v in good.items() if k != "conv_v"}, "extra": torch.zeros(1)})
    with pytest.raises(ValueError, match="KDAState.recurrent must be float32, got torch.bfloat16"):
        KDAState.from_dict({**good, "recurrent": good["recurrent"].bfloat16()})
    with pytest.raises(ValueError, match=r"KDAState.recurrent must be \[B, H, K, V\]"):
        KDAState.from_dict({**good, "recurrent": good["recurrent"][0]})
    with pytest.raises(ValueError, match=r"KDAState.conv_k must be \[B=2, channels, kernel-1\], got shape \(1, 32, 3\)"):
        KDAState.from_dict({**good, "conv_k": good["conv_k"][:1]})
    with pytest.raises(ValueError, match="batch must be a positive integer, got 0"):
        KDAState.zeros(0, cfg)


def test_layer_rejects_bad_input(layer, cfg):
    with pytest.raises(ValueError, match=r"x must be \[B, T, hidden_size=32\], got shape \(2, 5, 16\)"):
        layer(torch.zeros(2, 5, 16))
    with pytest.raises(ValueError, match=r"x must hold at least one token"):
        layer(torch.zeros(2, 0, 32))
    with pytest.raises(ValueError, match="cu_seqlens requires a packed batch with B == 1, got B = 2"):
        layer(torch.zeros(2, 5, 32), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"cu_seqlens must start at 0 and end at T = 5, got 0 \.\. 4"):
        layer(torch.zeros(1, 5, 32), cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"KDAState.conv_q must have shape \(2, 32, 3\), got \(3, 32, 3\)"):
        layer(torch.zeros(2, 5, 32), state=KDAState.zeros(3, cfg))
    # with cu_seqlens the state has one row per sequence
    with pytest.raises(ValueError, match=r"KDAState.conv_q must have shape \(2, 32, 3\), got \(1, 32, 3\)"):
        layer(torch.zeros(1, 5, 32), cu_seqlens=torch.tensor([0, 2, 5]), state=KDAState.zeros(1, cfg))


def test_short_conv_state_and_errors():
    torch.manual_seed(5)
    conv = ShortConv(channels=4, kernel_size=4)
    x = torch.randn(2, 9, 4)
    y, state = conv(x)
    torch.testing.assert_close(state, x[:, -3:].transpose(1, 2))
    # explicit formula: y_t = silu(sum_i w[c, i] * x_{t - 3 + i}) with zeros before the start
    padded = torch.cat([torch.zeros(2, 3, 4), x], dim=1)
    w = conv.conv.weight[:, 0]  # [C, kernel]
    expected = torch.nn.functional.silu(sum(w[:, i] * padded[:, i : i + 9] for i in range(4)))
    torch.testing.assert_close(y, expected)
    # splitting the input with the state in between changes nothing, even with a piece shorter than the kernel
    y1, s1 = conv(x[:, :2])
    y2, s2 = conv(x[:, 2:], s1)
    torch.testing.assert_close(torch.cat([y1, y2], dim=1), y)
    torch.testing.assert_close(s2, state)
    with pytest.raises(ValueError, match=r"ShortConv expects x \[B, T, 4\], got shape \(2, 9\)"):
        conv(x[..., 0])
    with pytest.raises(ValueError, match=r"ShortConv state must be \(2, 4, 3\), got \(2, 4, 2\)"):
        conv(x, torch.zeros(2, 4, 2))


def test_initial_decay_is_moderate_and_gradients_flow(cfg):
    torch.manual_seed(6)
    layer = KimiDeltaAttention(cfg, layer_idx=1)
    assert ((layer.A_log.exp() >= 1.0) & (layer.A_log.exp() <= 16.0)).all()
    g0 = kda_gate(torch.zeros(1, 2, 16), layer.A_log, layer.dt_bias, cfg.kda_lower_bound)
    lo, hi = INIT_LOG_DECAY_RANGE
    assert (-g0 >= lo * 0.999).all() and (-g0 <= hi * 1.001).all()
    # W_fb = 0 at init, so the decay does not depend on the input yet
    x = inputs(2, 12, seed=7).requires_grad_()
    y, _ = layer(x)
    y.square().sum().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert layer.w_fb.weight.grad.abs().max() > 0  # the gate becomes data-dependent after the first step
    assert torch.isfinite(x.grad).all()


@torch.no_grad()
def test_bf16_layer_keeps_an_fp32_memory(cfg):
    torch.manual_seed(8)
    layer = KimiDeltaAttention(cfg, layer_idx=0).to(torch.bfloat16)
    x = inputs(1, 9, seed=9).bfloat16()
    y, state = layer(x, return_state=True)
    assert y.dtype == torch.bfloat16 and torch.isfinite(y.float()).all()
    assert state.recurrent.dtype == torch.float32 and state.conv_q.dtype == torch.bfloat16
    y_next, state = layer(x[:, :1], state=state)
    assert y_next.dtype == torch.bfloat16 and state.recurrent.dtype == torch.float32
