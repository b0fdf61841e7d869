"""Images in the language model: placeholder expansion, visual embeddings at the placeholders, cache keys."""

from __future__ import annotations

import pytest
import torch

from k3.model.multimodal import (
    IMAGE_PLACEHOLDER_ID,
    ImageSpan,
    PlaceholderError,
    VisualEmbeds,
    check_spans,
    expand_placeholders,
    insert_visual,
    slice_visual,
    visual_embeds,
)
from k3.model.presets import get_preset
from k3.model.tokenizer import SPECIAL_IDS
from k3.model.transformer import K3Model
from k3.services.cache.hashing import chain_block_hashes
from k3.services.vision.keys import image_key_ids, media_key_ids

P = IMAGE_PLACEHOLDER_ID


@pytest.fixture(scope="module")
def model() -> K3Model:
    torch.manual_seed(0)
    return K3Model(get_preset("tiny")).eval()


def test_placeholder_is_the_reserved_xtml_token():
    assert P == SPECIAL_IDS["<|kimi_image_placeholder|>"] == 7


def test_expansion_gives_each_image_its_token_count():
    ids, spans = expand_placeholders([10, P, 11, P, 12], [3, 2])
    assert ids == [10, P, P, P, 11, P, P, 12]
    assert spans == [ImageSpan(1, 3), ImageSpan(5, 2)]
    check_spans(ids, spans)


@pytest.mark.parametrize("ids, counts, text", [
    ([10, P, P], [4], "more image placeholders than images"),
    ([10, P], [4, 2], "more images than image placeholders"),
    ([10, 11], [1], "more images than image placeholders"),
])
def test_expansion_refuses_count_mismatches(ids, counts, text):
    with pytest.raises(PlaceholderError) as info:
        expand_placeholders(ids, counts)
    assert info.value.reason == "PLACEHOLDER_COUNT_MISMATCH" and text in info.value.message


def test_expansion_refuses_an_image_without_tokens():
    with pytest.raises(PlaceholderError, match="images\\[0\\]: must have at least one visual token"):
        expand_placeholders([P], [0])


def test_spans_must_cover_exactly_the_placeholders():
    ids = [10, P, P, P, 11]
    with pytest.raises(PlaceholderError, match="3 image placeholder positions but the images cover 2"):
        check_spans(ids, [ImageSpan(1, 2)])
    with pytest.raises(PlaceholderError, match="holds token 11"):
        check_spans(ids, [ImageSpan(2, 3)])
    with pytest.raises(PlaceholderError, match="in order, disjoint"):
        check_spans(ids, [ImageSpan(1, 2), ImageSpan(2, 2)])


def test_text_only_path_is_untouched(model):
    ids = torch.randint(8, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model(ids), model(ids, visual=None))


def test_visual_rows_equal_to_the_placeholder_embedding_change_nothing(model):
    ids = torch.tensor([[20, 21, P, P, P, 22, 23]])
    rows = model.embed.weight[P].detach().expand(3, -1).clone()
    visual = VisualEmbeds(torch.tensor([2, 3, 4]), rows)
    assert torch.equal(model(ids, visual=visual), model(ids))


def test_visual_rows_replace_the_placeholders_and_carry_gradients(model):
    ids = torch.tensor([[20, P, P, 22]])
    rows = torch.randn(2, model.cfg.hidden_size, requires_grad=True)
    x = insert_visual(model.embed(ids), ids, VisualEmbeds(torch.tensor([1, 2]), rows))
    assert torch.equal(x[0, 1:3], rows) and torch.equal(x[0, 0], model.embed.weight[20])
    logits = model(ids, visual=VisualEmbeds(torch.tensor([1, 2]), rows))
    logits[0, -1].sum().backward()
    assert rows.grad is not None and rows.grad.abs().sum() > 0


@pytest.mark.parametrize("positions, rows, reason", [
    ([1], 1, "PLACEHOLDER_COUNT_MISMATCH"),        # fewer visual tokens than placeholders
    ([1, 2, 3], 3, "PLACEHOLDER_COUNT_MISMATCH"),  # more visual tokens than placeholders
    ([0, 1], 2, "BAD_IMAGE_SPAN"),                 # a row on an ordinary token
    ([1, 1], 2, "BAD_IMAGE_SPAN"),                 # the same placeholder twice
])
def test_insertion_refuses_rows_off_the_placeholders(model, positions, rows, reason):
    ids = torch.tensor([[20, P, P, 22]])
    visual = VisualEmbeds(torch.tensor(positions), torch.zeros(rows, model.cfg.hidden_size))
    with pytest.raises(PlaceholderError) as info:
        model(ids, visual=visual)
    assert info.value.reason == reason


def test_insertion_refuses_the_wrong_width(model):
    ids = torch.tensor([[20, P]])
    with pytest.raises(PlaceholderError, match="hidden size") as info:
        model(ids, visual=VisualEmbeds(torch.tensor([1]), torch.zeros(1, 7)))
    assert info.value.reason == "WIDTH_MISMATCH"


def test_chunked_prefill_with_images_equals_the_whole_forward(model):
    text = torch.randint(8, 512, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    ids, spans = expand_placeholders(text[:5] + [P] + text[5:20] + [P] + text[20:], [6, 4])
    rows = [torch.randn(6, model.cfg.hidden_size), torch.randn(4, model.cfg.hidden_size)]
    visual = visual_embeds(spans, rows)
    full = model(torch.tensor([ids]), visual=visual)[0]
    state, pieces = None, []
    for start, end in ((0, 8), (8, 27), (27, len(ids))):  # cuts inside both images
        out, state = model.prefill(torch.tensor(ids[start:end]), state, slice_visual(visual, start, end))
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), full, rtol=1e-4, atol=1e-4)


def test_key_ids_separate_images_and_keep_text_prefixes():
    ids, spans = expand_placeholders([9] * 600 + [P] + [10] * 500, [20])
    a, b = bytes(range(32)), bytes(range(1, 33))
    keys_a = chain_block_hashes(media_key_ids(ids, [(spans[0].start, spans[0].length, a)]))
    keys_a2 = chain_block_hashes(media_key_ids(ids, [(spans[0].start, spans[0].length, a)]))
    keys_b = chain_block_hashes(media_key_ids(ids, [(spans[0].start, spans[0].length, b)]))
    assert keys_a == keys_a2
    assert keys_a[0] == keys_b[0] == chain_block_hashes(ids)[0]  # the block before the image is shared
    assert keys_a[1] != keys_b[1] and keys_a[1] != chain_block_hashes(ids)[1]


def test_key_ids_never_equal_token_ids_and_carry_the_whole_hash():
    first = image_key_ids(bytes(32), 20)
    assert len(first) == 20 and all(k >= 1 << 31 for k in first)
    assert len(set(first)) == 20
    flipped = bytearray(32)
    flipped[31] = 1  # the last byte of the hash changes the first key id already
    assert image_key_ids(bytes(flipped), 1) != first[:1]
    with pytest.raises(ValueError, match="outside"):
        media_key_ids([1, 2], [(1, 5, bytes(32))])
