"""KDA decode kernels (Triton, run by the CPU interpreter) against their references and the model's ShortConv."""

from __future__ import annotations

import pytest
import torch
from utils import TOLERANCE, assert_close, fresh_generator, poisoned_empty, rel_rms

from k3.kernels.kda.decode import (
    DecodeConfig,
    fused_recurrent_kda_decode,
    fused_recurrent_kda_decode_reference,
    short_conv_decode,
    short_conv_decode_reference,
)
from k3.kernels.kda.reference import kda_gate, kda_recurrent

N, H, K, V, SLOTS = 3, 2, 16, 32, 6


def _inputs(gen, dtype):
    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    q, k, g_raw = draw(N, H, K), draw(N, H, K), draw(N, H, K, scale=2.0)
    g_raw[0, 0, :3] = torch.tensor([float("inf"), float("-inf"), 40.0])  # saturated gates must not give NaN
    v, beta_raw = draw(N, H, V), draw(N, H)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    pool = torch.randn(SLOTS, H, K, V, generator=gen)
    slots = torch.randperm(SLOTS, generator=gen)[:N]  # unordered, leaves some slots untouched
    return q, k, v, g_raw, beta_raw, A_log, dt_bias, pool, slots


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_matches_reference_and_updates_only_its_slots(dtype):
    q, k, v, g_raw, beta_raw, A_log, dt_bias, pool, slots = _inputs(fresh_generator(), dtype)
    ours_pool, ref_pool = pool.clone(), pool.clone()
    out = poisoned_empty(N, H, V, dtype=dtype)
    # block_v < V: two programs share each (sequence, head) along V
    o = fused_recurrent_kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias, ours_pool, slots.int(), out=out,
                                   config=DecodeConfig(block_v=16))
    assert o.data_ptr() == out.data_ptr()
    o_ref = fused_recurrent_kda_decode_reference(q.float(), k.float(), v.float(), g_raw.float(),
                                                 beta_raw.float(), A_log, dt_bias, ref_pool, slots)
    assert_close(o, o_ref, dtype)
    assert_close(ours_pool[slots], ref_pool[slots], dtype, "updated state")
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(ours_pool[untouched], pool[untouched])
    assert not torch.equal(ours_pool[slots], pool[slots])


@pytest.mark.timeout(120)
def test_decode_steps_reproduce_the_token_recurrence():
    """Three decode steps through a slot pool equal kda_recurrent over the three tokens (plain gate/beta)."""
    gen = fresh_generator()
    T = 3
    q, k = (torch.nn.functional.normalize(torch.randn(N, T, H, K, generator=gen), dim=-1) for _ in range(2))
    v, g_raw = torch.randn(N, T, H, V, generator=gen), torch.randn(N, T, H, K, generator=gen)
    beta_raw = torch.randn(N, T, H, generator=gen)
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    h0 = torch.randn(N, H, K, V, generator=gen)
    pool = torch.zeros(N + 2, H, K, V)
    slots = torch.tensor([4, 0, 2])
    pool[slots] = h0
    outs = [
        fused_recurrent_kda_decode(q[:, t], k[:, t], v[:, t], g_raw[:, t], torch.sigmoid(beta_raw[:, t]), A_log,
                                   dt_bias, pool, slots, use_qk_l2norm=False, use_beta_sigmoid=False)
        for t in range(T)
    ]
    g = kda_gate(g_raw, A_log, dt_bias)
    o_ref, final = kda_recurrent(q, k, v, g, torch.sigmoid(beta_raw), initial_state=h0, output_final_state=True)
    assert rel_rms(torch.stack(outs, dim=1), o_ref) <= TOLERANCE[torch.float32]
    assert rel_rms(pool[slots], final) <= TOLERANCE[torch.float32]


def test_decode_rejects_bad_inputs():
    q, k, v, g_raw, beta_raw, A_log, dt_bias, pool, slots = _inputs(fresh_generator(), torch.float32)
    args = [q, k, v, g_raw, beta_raw, A_log, dt_bias, pool]
    with pytest.raises(ValueError, match="slot_ids must be distinct"):
        fused_recurrent_kda_decode(*args, torch.tensor([1, 1, 2]))
    with pytest.raises(ValueError, match=r"slot_ids must lie in \[0, 6\)"):
        fused_recurrent_kda_decode(*args, torch.tensor([0, 1, 6]))
    with pytest.raises(ValueError, match="slot_ids must be int32 or int64"):
        fused_recurrent_kda_decode(*args, slots.float())
    with pytest.raises(ValueError, match="state_pool must be float32"):
        fused_recurrent_kda_decode(*args[:-1], pool.bfloat16(), slots)
    with pytest.raises(ValueError, match=r"dt_bias must be \[H\*K\]=\[32\]"):
        fused_recurrent_kda_decode(q, k, v, g_raw, beta_raw, A_log, dt_bias[:-1], pool, slots)
    with pytest.raises(ValueError, match="lower_bound must be negative"):
        fused_recurrent_kda_decode(*args, slots, lower_bound=0.0)
    with pytest.raises(ValueError, match="DecodeConfig.block_v must be a positive power of two"):
        DecodeConfig(block_v=24)


# ----------------------------------------------------------------------------------------- short convolution
D, W = 40, 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_conv_matches_reference_and_model(dtype):
    from k3.model.kda import ShortConv

    gen = fresh_generator()
    conv = ShortConv(D, W)
    with torch.no_grad():
        conv.conv.weight.copy_(torch.randn(D, 1, W, generator=gen))
    x = torch.randn(N, D, generator=gen).to(dtype)
    pool = torch.randn(SLOTS, D, W - 1, generator=gen).to(dtype)
    slots = torch.tensor([5, 1, 3])
    ours_pool, ref_pool = pool.clone(), pool.clone()
    out = poisoned_empty(N, D, dtype=dtype)
    y = short_conv_decode(x, ours_pool, conv.conv.weight[:, 0].detach(), slots, out=out,
                          config=DecodeConfig(block_d=32))  # two channel blocks, the second one partial
    y_ref = short_conv_decode_reference(x.float(), ref_pool.float(), conv.conv.weight[:, 0].detach(), slots)
    assert_close(y, y_ref, dtype)
    assert torch.equal(ours_pool[slots][..., :-1], pool[slots][..., 1:])  # shifted, bit for bit
    assert torch.equal(ours_pool[slots][..., -1], x)
    keep = torch.tensor([0, 2, 4])
    assert torch.equal(ours_pool[keep], pool[keep])
    if dtype == torch.float32:  # the model's own decoding step
        with torch.no_grad():
            y_model, state_model = conv(x[:, None], pool[slots])
        assert rel_rms(y, y_model[:, 0]) <= TOLERANCE[dtype]
        assert torch.equal(ours_pool[slots], state_model)


def test_short_conv_rejects_bad_inputs():
    x, pool, w = torch.randn(2, D), torch.randn(4, D, W - 1), torch.randn(D, W)
    with pytest.raises(ValueError, match=r"conv_state_pool must be \[num_slots, D, W-1\]"):
        short_conv_decode(x, torch.randn(4, D, W), w, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"weight must be \[D, W\]"):
        short_conv_decode(x, pool, w[None], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"slot_ids must be \[N\]=\[2\]"):
        short_conv_decode(x, pool, w, torch.tensor([0]))
