import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, BatchEncoding

from otbrl.data import get_task
from otbrl.models import (
    SPECIAL_TOKENS,
    build_tiny_model,
    build_tokenizer,
    eos_token_ids,
    load_model_and_tokenizer,
)
from tiny_models import TWO_LAYERS

pytestmark = pytest.mark.usefixtures("one_thread")


ALPHABET = get_task("arithmetic").alphabet


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_tiny_model(path, arch=request.param, seed=3, **TWO_LAYERS)
    return request.param, path


def test_vocabulary_is_the_alphabet_plus_special_tokens():
    tok = build_tokenizer("0123456789+=")
    assert len(tok) == len(SPECIAL_TOKENS) + 12
    vocab = tok.get_vocab()
    assert all(c in vocab for c in "0123456789+=")
    assert all(s in vocab for s in SPECIAL_TOKENS)
    # One token per character: the model sees numbers digit by digit.
    assert len(tok("1234+5678=", add_special_tokens=False)["input_ids"]) == 10


@pytest.fixture(scope="module")
def reloaded_tokenizers(tmp_path_factory):
    out = []
    for arch in ("llama", "qwen2"):
        path = tmp_path_factory.mktemp(f"tok-{arch}")
        build_tiny_model(path, arch=arch, **TWO_LAYERS)
        out.append(AutoTokenizer.from_pretrained(path))
    return out


@settings(max_examples=40, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=30))
def test_round_trip_of_task_text_after_reload(text, reloaded_tokenizers):
    for tok in reloaded_tokenizers:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert len(ids) == len(text)


def test_chat_template_round_trip(saved):
    _, path = saved
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "12+34="}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><user>12+34=<assistant>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(ids) == 9
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert isinstance(encoded, BatchEncoding) and list(encoded["input_ids"]) == ids
    full = [*messages, {"role": "assistant", "content": "46"}]
    text = tok.apply_chat_template(full, tokenize=False)
    assert text == "<bos><user>12+34=<assistant>46<eos>"
    assert tok(text, add_special_tokens=False)["input_ids"][-1] == tok.eos_token_id
    with pytest.raises(Exception, match="unsupported chat role"):
        tok.apply_chat_template([{"role": "tool", "content": "1"}], tokenize=False)


def test_load_sets_left_padding_pad_and_eos(saved):
    arch, path = saved
    model, tok = load_model_and_tokenizer(path)
    assert model.config.model_type == arch
    assert tok.padding_side == "left"
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    assert eos_token_ids(model, tok) == [tok.eos_token_id]
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert model.config.vocab_size == len(tok)
    assert model.dtype == torch.float32
    model_bf16, _ = load_model_and_tokenizer(path, dtype="bfloat16")
    assert model_bf16.dtype == torch.bfloat16


def test_saved_weights_load_back_identically(tmp_path):
    build_tiny_model(tmp_path / "a", seed=7, **TWO_LAYERS)
    build_tiny_model(tmp_path / "b", seed=7, **TWO_LAYERS)
    build_tiny_model(tmp_path / "c", seed=8, **TWO_LAYERS)
    a, _tok = load_model_and_tokenizer(tmp_path / "a")
    b, _ = load_model_and_tokenizer(tmp_path / "b")
    c, _ = load_model_and_tokenizer(tmp_path / "c")
    for (name, pa), pb, _pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    assert not a.config.tie_word_embeddings


def test_build_leaves_global_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path, seed=0, **TWO_LAYERS)
    assert torch.equal(torch.rand(3), expected)


def test_missing_pad_token_falls_back_to_eos(tmp_path):
    build_tiny_model(tmp_path, **TWO_LAYERS)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    _, loaded = load_model_and_tokenizer(tmp_path)
    assert loaded.pad_token_id == loaded.eos_token_id


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path, arch="gpt9")
    with pytest.raises(ValueError, match="hidden_sise"):
        build_tiny_model(tmp_path, hidden_sise=3)
    with pytest.raises(ValueError, match="task"):
        build_tiny_model(tmp_path, task="chess")
    with pytest.raises(ValueError, match="path"):
        load_model_and_tokenizer(tmp_path / "nothing")
    build_tiny_model(tmp_path, **TWO_LAYERS)
    with pytest.raises(ValueError, match="dtype"):
        load_model_and_tokenizer(tmp_path, dtype="fp8")
    with pytest.raises(ValueError, match="alphabet"):
        build_tokenizer("")
    with pytest.raises(ValueError, match="ASCII"):
        build_tokenizer("π")
    with pytest.raises(TypeError, match="alphabet"):
        build_tokenizer(list("12"))
