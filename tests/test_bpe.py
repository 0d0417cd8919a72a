"""The run-trained BPE tokenizer: round trips, ChatML, deterministic, loads as a checkpoint's."""

import json
import shutil

import pytest

from rlmtrain.model.bpe import tokenizer_files, train_bpe
from rlmtrain.model.hf_tokenizer import HFTokenizer
from rlmtrain.model.tokenizer import ByteTokenizer

TEXTS = [
    "We evaluate OrbitFormer on 3 public benchmarks: Cora, CiteSeer and PubMed.",
    "hits = search(context, 'We compare', window=150, bidirectional=False)\nprint(hits)",
    "picks = [p for p in context if key in context[p]['abstract']]",
] * 30


def test_round_trip_chat_and_stops(tmp_path):
    tok = train_bpe(TEXTS, 400, tmp_path / "tok")
    assert tok.vocab_size == 400
    for text in [*TEXTS[:3], "ünïcödé ✓ and `<|im_end|>` as text", ""]:
        assert tok.decode(tok.encode(text)) == text
    # A control token inside text stays text: it can never end a turn.
    assert tok.token_to_id("<|im_end|>") not in tok.encode("say <|im_end|> now")
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    chat = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert chat[0] == tok.token_to_id("<|im_start|>")
    assert tok.render_chat(messages, add_generation_prompt=True) == ByteTokenizer().render_chat(
        messages, add_generation_prompt=True
    )
    assert tok.token_to_id("<|im_end|>") in tok.stop_ids


def test_code_merges_into_few_tokens(tmp_path):
    tok = train_bpe(TEXTS, 600, tmp_path / "tok")
    code = TEXTS[2]
    assert len(tok.encode(code)) <= len(code) / 4, [tok.decode([i]) for i in tok.encode(code)]


def test_split_digits_tokenizes_an_unseen_number_like_the_seen_ones(tmp_path):
    names = [f"pkg/iris{n}/util.py:{n % 9 + 1}| def helper():" for n in range(40)] * 10
    merged = train_bpe(names, 400, tmp_path / "merged")
    split = train_bpe(names, 400, tmp_path / "split", split_digits=True)

    def pieces(tok, text):
        return [tok.decode([i]) for i in tok.encode(text)]

    def shape(tok, text):
        return [piece for piece in pieces(tok, text) if not piece.isdigit()]

    seen, unseen = " pkg/iris12/util.py", " pkg/iris73/util.py"
    assert shape(merged, seen) != shape(merged, unseen)  # merges reached into the seen number
    assert shape(split, seen) == shape(split, unseen)
    assert [p for p in pieces(split, unseen) if p.isdigit()] == ["7", "3"]
    assert split.decode(split.encode(TEXTS[0])) == TEXTS[0]


def test_deterministic_and_copied_into_a_checkpoint(tmp_path):
    a = train_bpe(TEXTS, 400, tmp_path / "a")
    train_bpe(TEXTS, 400, tmp_path / "b")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (
        tmp_path / "b" / "tokenizer.json"
    ).read_bytes()
    (tmp_path / "ckpt").mkdir()
    for file in tokenizer_files(tmp_path / "a"):
        shutil.copyfile(file, tmp_path / "ckpt" / file.name)
    loaded = HFTokenizer.from_dir(tmp_path / "ckpt")
    assert loaded.encode(TEXTS[1]) == a.encode(TEXTS[1])
    config = json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|im_end|>"


def test_too_small_a_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="smaller than the 256 bytes"):
        train_bpe(TEXTS, 100, tmp_path / "tok")
