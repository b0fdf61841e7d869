"""SequenceState: block-boundary checkpoints, safetensors round trip, batching of independent sequences."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from k3.model.presets import get_preset
from k3.model.state import STATE_FORMAT, SequenceState
from k3.model.transformer import K3Model

BLOCK = 8  # stands in for the 512-token cache blocks


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return K3Model(get_preset("tiny")).eval()


@pytest.fixture(scope="module")
def ids():
    torch.manual_seed(1)
    return torch.randint(0, 512, (21,))


def _same_state(a: SequenceState, b: SequenceState) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return (a.num_tokens, a.config_hash, sorted(ta)) == (b.num_tokens, b.config_hash, sorted(tb)) and all(
        torch.equal(ta[k], tb[k]) for k in ta
    )


def test_fresh_state_layout(model):
    state = model.new_state()
    cfg = model.cfg
    assert sorted(state.kda) == [i for i in range(8) if cfg.layer_kind(i) == "kda"]
    assert sorted(state.mla) == [3, 7] and all(len(c) == 0 for c in state.mla.values())
    assert state.kda[0].recurrent.shape == (1, 2, 32, 32) and state.num_tokens == 0


@pytest.mark.timeout(300)
def test_checkpoint_at_block_boundary_restores_identically(model, ids):
    logits, final, checkpoints = model.prefill_with_checkpoints(ids, block_size=BLOCK)
    assert [c.num_tokens for c in checkpoints] == [8, 16] and final.num_tokens == 21
    with torch.no_grad():
        full = model(ids[None])[0]
    assert (logits - full).abs().max().item() <= 1e-4

    checkpoint = checkpoints[0]
    blob = checkpoint.to_bytes()
    restored = SequenceState.from_bytes(blob)
    assert _same_state(restored, checkpoint)
    # continue both the in-memory and the restored checkpoint: identical logits and states
    a_logits, a_state = model.prefill(ids[8:], checkpoint)
    b_logits, b_state = model.prefill(ids[8:], restored)
    assert torch.equal(a_logits, b_logits) and _same_state(a_state, b_state)
    assert (a_logits - full[8:]).abs().max().item() <= 1e-4
    a_next, _ = model.decode(ids[:1], [a_state])
    b_next, _ = model.decode(ids[:1], [b_state])
    assert torch.equal(a_next, b_next)


def test_serialised_metadata(model, ids):
    _, state = model.prefill(ids[:5])
    blob = state.to_bytes()
    header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    assert header["__metadata__"] == {"format": STATE_FORMAT, "num_tokens": "5", "config_hash": model.config_hash}
    assert header["layers.3.mla.c_kv"]["shape"] == [5, 32] and header["layers.0.kda.recurrent"]["dtype"] == "F32"


def test_from_bytes_rejects_bad_input(model):
    with pytest.raises(ValueError, match="truncated"):
        SequenceState.from_bytes(b"abc")
    with pytest.raises(ValueError, match="expects bytes, got str"):
        SequenceState.from_bytes("abc")
    from safetensors.torch import save

    other = save({"x": torch.zeros(1)}, metadata={"format": "something-else"})
    with pytest.raises(ValueError, match="not a serialised SequenceState"):
        SequenceState.from_bytes(other)
    odd = save({"x": torch.zeros(1)}, metadata={"format": STATE_FORMAT, "num_tokens": "1", "config_hash": "h"})
    with pytest.raises(ValueError, match="unexpected tensor 'x'"):
        SequenceState.from_bytes(odd)


def test_state_from_another_config_is_refused(model, ids):
    other = K3Model(dataclasses.replace(get_preset("tiny"), rms_eps=1e-6))
    _, state = other.prefill(ids[:3])
    with pytest.raises(ValueError, match=f"config hash {other.config_hash}, this model's is {model.config_hash}"):
        model.prefill(ids[3:6], state)
    with pytest.raises(ValueError, match=r"states\[0\] was produced by a model with config hash"):
        model.decode(ids[:1], [state])


def test_states_are_values_and_clone_is_deep(model, ids):
    _, state = model.prefill(ids[:6])
    snapshot = state.clone()
    assert _same_state(snapshot, state)
    model.decode(ids[6:7], [state])
    model.prefill(ids[6:9], state)
    assert _same_state(snapshot, state)  # calls never modify the state they are given
    copy = state.clone()
    copy.kda[0].recurrent.add_(1.0)
    copy.mla[3].c_kv.add_(1.0)
    assert _same_state(snapshot, state)


def test_batched_decode_equals_separate_decodes(model, ids):
    _, s1 = model.prefill(ids[:3])
    _, s2 = model.prefill(ids[5:12])
    tokens = torch.tensor([7, 300])
    batched, (n1, n2) = model.decode(tokens, [s1, s2])
    alone1, (m1,) = model.decode(tokens[:1], [s1])
    alone2, (m2,) = model.decode(tokens[1:], [s2])
    assert (batched - torch.cat([alone1, alone2])).abs().max().item() <= 1e-5
    assert (n1.num_tokens, n2.num_tokens) == (4, 8)
    torch.testing.assert_close(n2.kda[0].recurrent, m2.kda[0].recurrent)


def test_limits_and_bad_arguments(model, ids):
    small = K3Model(dataclasses.replace(get_preset("tiny"), max_seq_len=6))
    _, state = small.prefill(ids[:6])
    with pytest.raises(ValueError, match="would hold 7 tokens, more than max_seq_len 6"):
        small.decode(ids[:1], [state])
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 512\), got values in \[0, 512\]"):
        model.prefill(torch.tensor([0, 512]))
    with pytest.raises(ValueError, match=r"prefill takes one non-empty sequence \[T\] or \[1, T\], got shape \(2, 3\)"):
        model.prefill(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"decode takes token_ids \[B\] and B states, got shape \(2,\) and 1 states"):
        model.decode(torch.tensor([1, 2]), [state])
    with pytest.raises(ValueError, match="token_ids must be an integer tensor"):
        model.decode(torch.tensor([1.0]), [model.new_state()])
